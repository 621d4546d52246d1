"""Host CPU a generated token costs, per server process, for two running builds: tokens/s moves
with a GPU host's speed phases by 20-40% between runs, the CPU seconds a token takes much less.

Runs bench/loadgen.py against each server in turn (rounds alternate the build and the mode) and
reads the CPU time (user + system) of each server's API process and of its engine child from
/proc around every run:

    python3 -m bench.experiments.cpu_cost --servers old=8201:PID new=8202:PID --model NAME \\
        --concurrency 64 --requests 256 --rounds 4 --modes off,20,20:columnar --processes 16

A mode is `off` or a top list size, with `:FORMAT` for a `logprobs_format`; `--parse-in-loop`
parses every body before the worker's next request, as a user's script does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import psutil


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def processes(pid: int) -> tuple[psutil.Process, list[psutil.Process]]:
    root = psutil.Process(pid)
    return root, root.children(recursive=True)


def run_load(port: int, a: argparse.Namespace, mode: str) -> dict:
    top, _, fmt = mode.partition(":")
    cmd = [
        sys.executable, "-m", "bench.loadgen", "--base-url", f"http://127.0.0.1:{port}/v1",
        "--model", a.model, "--concurrency", str(a.concurrency), "--requests", str(a.requests),
        "--max-tokens", str(a.max_tokens), "--logprobs", top, "--prompt-words", "32",
        "--processes", str(a.processes), "--logprobs-format", fmt or "openai",
    ] + (["--parse-in-loop"] if a.parse_in_loop else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--servers", nargs="+", required=True, help="NAME=PORT:PID")
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes", default="off,20")
    ap.add_argument("--processes", type=int, default=16)
    ap.add_argument("--parse-in-loop", action="store_true")
    a = ap.parse_args()
    servers = []
    for spec in a.servers:
        name, rest = spec.split("=")
        port, pid = rest.split(":")
        servers.append((name, int(port), int(pid)))
    modes = a.modes.split(",")
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for r in range(a.rounds):
        order = servers if r % 2 == 0 else servers[::-1]
        for name, port, pid in order:
            for mode in modes if (r // 2) % 2 == 0 else modes[::-1]:
                api, kids = processes(pid)
                before = [cpu_seconds(api), sum(cpu_seconds(k) for k in kids)]
                res = run_load(port, a, mode)
                after = [cpu_seconds(api), sum(cpu_seconds(k) for k in kids)]
                tokens = res["completion_tokens"] if "completion_tokens" in res else None
                tokens = tokens or a.requests * a.max_tokens
                api_ms = 1e6 * (after[0] - before[0]) / tokens  # CPU us per token
                eng_ms = 1e6 * (after[1] - before[1]) / tokens
                rows.setdefault((name, mode), []).append((res["tokens_per_s"], api_ms, eng_ms))
                print(
                    f"round {r} {name:>4} {mode:>11}: {res['tokens_per_s']:8.0f} tok/s  "
                    f"API {api_ms:6.1f} us/token  engine {eng_ms:6.1f} us/token  "
                    f"errors {res['errors']}",
                    flush=True,
                )
    print("medians: tok/s, API CPU us/token, engine CPU us/token")
    for (name, mode), xs in sorted(rows.items()):
        med = [statistics.median(c) for c in zip(*xs)]
        print(f"  {name:>4} {mode:>11}: {med[0]:8.0f}  {med[1]:6.1f}  {med[2]:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
