"""A multi-turn agent trace: time to first token per turn, here with the prefix cache, here with it
off, and mlx-lm's server, on the same weights in one run.

Each turn resends the conversation so far (a system turn with tool definitions, then the user's
task, each earlier answer and a tool's output after it) and streams an answer of up to 32 tokens
at temperature 0 (timed: a request for its first token alone). The conversation grows by
about `--tool-words` a turn. Beside each turn, the
cache-off server is timed on the new tokens alone (the last answer and tool output as one
message), and, after the servers stop, bare mlx-lm on the same weights in this process prefills
the turn's uncached tokens over a cache already holding the rest ("new over context": what
prefilling only the new tokens costs, their attention over the context included, with MLX's
default attention, cuDNN's on CUDA).

    .venv/bin/python -m bench.conversation                      # CPU: the embedded model, 8 turns
    python -m bench.conversation --model DIR --turns 8 --tool-words 3000   # the GPU preset
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.server import Server, free_port, mlx_lm_command, omlx_command, start_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "query": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for name in ("read_file", "search_code", "list_directory", "run_tests")
]
SYSTEM = (
    "You are a coding agent working in a Python repository. Read files before you change them,"
    " run the tests after every change, and explain each step in one sentence. Tools:\n"
    + json.dumps(TOOLS, indent=1)
)


HELLO = {"role": "user", "content": "Hello."}
ANSWER_TOKENS = 32


def tool_output(turn: int, words: int) -> str:
    lines = [f"# file src/module_{turn}.py, part {i}" for i in range(words // 8)]
    body = [f"def function_{turn}_{i}(x):\n    return x * {i} + {turn}" for i in range(words // 12)]
    return "\n".join(lines + body)


TRACE = os.environ.get("OMLX_STEP_TRACE", "") not in ("", "0")


def ttft(
    base: str, model: str, messages: list[dict[str, Any]], max_tokens: int = 1
) -> tuple[float, str, int]:
    """(seconds to the first token, the answer, the prompt tokens served from a cache). The
    first token is timed as a request for one token: the first content of a random model's
    answer may come many tokens in (whitespace, special tokens)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    if TRACE:  # on the engine's step-trace clock (OMLX_STEP_TRACE=1): a turn's steps lined up
        print(f"request-trace: {t0:.6f} {model} {len(json.dumps(messages))} {max_tokens}")
    first: float | None = None
    text, cached = "", 0
    with httpx.stream("POST", base + "/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached
    whole = time.perf_counter() - t0
    return (whole if max_tokens == 1 or first is None else first), text, cached


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.model is None:  # the embedded model: float32 for mlx-lm, as ours dequantizes it
        from bench.run import float32_copy, resolved_dir

        model_dir = str(float32_copy(resolved_dir(None)))
    else:  # a directory: the same weights for both
        model_dir = args.model
    name = "SmolLM2-135M-Instruct" if args.model is None else Path(args.model).name
    servers: dict[str, Server] = {}
    started = time.perf_counter()
    ports = {k: free_port() for k in ("on", "off", "mlx-lm")}
    extra = ["--prefix-cache-mib", "0"]
    servers["on"] = start_server(omlx_command(ports["on"], args.model, 8), ports["on"])
    if not args.only_ours:
        servers["off"] = start_server(
            omlx_command(ports["off"], args.model, 8) + extra, ports["off"]
        )
    if not (args.no_mlx_lm or args.only_ours):
        servers["mlx-lm"] = start_server(
            mlx_lm_command(ports["mlx-lm"], model_dir, 8), ports["mlx-lm"], "/v1/models"
        )
    rows = []
    ids: dict[int, list[int]] = {}  # each turn's prompt, for new_over_context
    try:
        # Each server's first request warms it up (on a GPU, MLX compiles its kernels then:
        # tens of seconds), all at once.
        with ThreadPoolExecutor(len(servers)) as pool:
            warming = [
                pool.submit(ttft, s.base_url, name if key != "mlx-lm" else model_dir, [HELLO])
                for key, s in servers.items()
            ]
            for w in warming:
                w.result()
        print(f"servers up and warm after {time.perf_counter() - started:.0f} s", flush=True)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Find why test_parser fails and fix it."},
        ]
        last_new = ""  # the last answer and tool output: what a turn adds
        for turn in range(1, args.turns + 1):
            row: dict[str, Any] = {"turn": turn}
            answer = ""
            for key, server in servers.items():
                if key == "off" and args.alone_only:
                    continue
                served = name if key != "mlx-lm" else model_dir
                s, _, cached = ttft(server.base_url, served, messages)
                row[key], row[f"{key}_cached"] = s, cached
                # The turn's answer, untimed, from each server (it keeps what it computed)
                text = ttft(server.base_url, served, messages, ANSWER_TOKENS)[1]
                answer = text if key == "on" else answer
            tokens = httpx.post(
                servers["on"].base_url.removesuffix("/v1") + "/tokenize",
                json={"model": name, "messages": messages},
                timeout=60,
            ).json()["tokens"]
            row["prompt_tokens"] = len(tokens)
            ids[turn] = tokens
            new = tool_output(turn, args.tool_words)
            if (
                turn > 1 and "off" in servers
            ):  # the new tokens alone, cold: what the cache leaves to compute
                row["new_alone"], _, _ = ttft(
                    servers["off"].base_url, name, [{"role": "user", "content": last_new}]
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Tool output:\n" + new},
            ]
            last_new = answer + "\n" + new
    finally:
        for key, server in servers.items():
            server.stop()
            if args.logs:
                Path(args.logs, f"{key}.log").write_text(server.log_text())
    if args.model is not None and not args.no_bare:
        new_over_context(model_dir, rows, ids)
    return rows


def new_over_context(
    model_dir: str, rows: list[dict[str, Any]], prompts: dict[int, list[int]]
) -> None:
    """Bare mlx-lm: each turn's uncached tokens (what ours took from its cache decides the
    split) prefilled over a cache holding the rest, in mlx-lm's 2048-token steps; the best of
    two. The lower bound of a turn's time to first token, sampling and HTTP aside."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model = load(model_dir)[0]

    def prefill(ids: list[int], cache: list[Any]) -> None:
        for a in range(0, len(ids), 2048):
            out = model(mx.array([ids[a : a + 2048]]), cache=cache)
            mx.eval(out[:, -1], [c.state for c in cache])

    prefill(list(range(1, 300)), make_prompt_cache(model))  # kernels compiled before timing
    for r in rows:
        cached, ids = r["on_cached"], prompts[r["turn"]]
        if r["turn"] == 1 or cached == 0:
            continue
        best = float("inf")
        for _ in range(2):
            cache = make_prompt_cache(model)
            prefill(ids[:cached], cache)
            t0 = time.perf_counter()
            prefill(ids[cached:], cache)
            best = min(best, time.perf_counter() - t0)
        r["new_over_context"] = best
        print(json.dumps({"turn": r["turn"], "new_over_context": best}), flush=True)
        del cache
        mx.clear_cache()


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| turn | prompt tokens | here | cached | cache off | new tokens alone | here / new"
        " alone | new over context | here / new over context | mlx-lm | here / mlx-lm |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    out = [head]
    for r in rows:
        alone, mlx, on = r.get("new_alone"), r.get("mlx-lm"), r["on"]
        ratio = f"{on / alone:.2f}" if alone else "-"
        vs_mlx = f"{on / mlx:.2f}" if mlx else "-"
        alone_s = f"{alone:.3f} s" if alone else "-"
        over = r.get("new_over_context")
        over_s, over_r = (f"{over:.3f} s", f"{on / over:.2f}") if over else ("-", "-")
        mlx_s = f"{mlx:.3f} s" if mlx else "-"
        out.append(
            f"| {r['turn']} | {r['prompt_tokens']} | {on:.3f} s | {r['on_cached']} |"
            f" {r.get('off', 0):.3f} s | {alone_s} | {ratio} | {over_s} | {over_r} | {mlx_s} |"
            f" {vs_mlx} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an mlx-lm directory (default: the embedded)")
    p.add_argument("--turns", type=int, default=8)
    # ~3.5 tokens a word: the default grows the conversation to ~6k tokens in 8 turns
    p.add_argument("--tool-words", type=int, default=200, help="a tool output's size, in words")
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument("--only-ours", action="store_true", help="ours with the cache on alone")
    p.add_argument(
        "--alone-only",
        action="store_true",
        help="the cache-off server times the new tokens alone, not each whole turn",
    )
    p.add_argument("--no-bare", action="store_true", help="skip bare mlx-lm's new over context")
    p.add_argument("--json", default=None, help="write the rows here too")
    p.add_argument("--logs", default=None, help="a folder for the servers' logs")
    args = p.parse_args()
    # A timeout's TERM still stops the servers and writes their logs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = run(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
