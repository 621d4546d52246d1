"""The disk tier's hit against computing again: a long conversation served once by a server with
`--kv-cache-dir`, that server stopped (it writes what it keeps) and started again on the same
folder, then the conversation's next turn: its time to first token from disk, again from memory,
and on a server with the prefix cache off (the whole prompt computed).

    python -m bench.experiments.disk_tier_hit --model DIR --tool-words 3000 --turns 5
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench.conversation import HELLO, SYSTEM, tool_output, ttft
from bench.server import free_port, omlx_command, start_server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--turns", type=int, default=5, help="tool outputs before the timed turn")
    p.add_argument("--tool-words", type=int, default=800)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    name = Path(a.model).name if a.model else "SmolLM2-135M-Instruct"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Find why test_parser fails and fix it."},
    ]
    for turn in range(1, a.turns + 1):
        messages += [
            {"role": "assistant", "content": f"Step {turn}: reading the next file."},
            {"role": "user", "content": "Tool output:\n" + tool_output(turn, a.tool_words)},
        ]
    follow = messages + [
        {"role": "assistant", "content": "Found it: the parser drops the last line."},
        {"role": "user", "content": "Fix it and run the tests."},
    ]
    row: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        disk = ["--kv-cache-dir", folder]
        port = free_port()
        s = start_server(omlx_command(port, a.model, 8) + disk, port)
        try:
            ttft(s.base_url, name, [HELLO])  # warm-up
            row["first"], _, _ = ttft(s.base_url, name, messages)
        finally:
            s.stop()
        row["disk_mib"] = sum(f.stat().st_size for f in Path(folder).rglob("*")) / 2**20
        s = start_server(omlx_command(port, a.model, 8) + disk, port)
        try:
            ttft(s.base_url, name, [HELLO])
            row["from_disk"], _, row["disk_cached"] = ttft(s.base_url, name, follow)
            row["from_memory"], _, row["memory_cached"] = ttft(s.base_url, name, follow)
        finally:
            s.stop()
    s = start_server(omlx_command(port, a.model, 8) + ["--prefix-cache-mib", "0"], port)
    try:
        ttft(s.base_url, name, [HELLO])
        row["recompute"], _, _ = ttft(s.base_url, name, follow)
        row["recompute_again"], _, _ = ttft(s.base_url, name, follow)
    finally:
        s.stop()
    row["disk / recompute"] = row["from_disk"] / min(row["recompute"], row["recompute_again"])
    print(json.dumps(row, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
