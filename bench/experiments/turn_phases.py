"""Where a long conversation's turn spends its time, in-process (no HTTP, no tokenizer): one
engine (thread transport), a conversation of random token ids growing by --new tokens a turn;
each turn's time to first token (a request for one token, as bench/conversation.py times it)
split by phase (the engine's and the runner's methods, timed by wrappers), against the same
engine on the turn's new tokens alone (ids no kept sequence starts with) and bare mlx-lm
prefilling the new tokens over a cache holding the rest (best of two).

    python -m bench.experiments.turn_phases --model $R8Q --turns 8 --new 2900
"""

# ruff: noqa: I001, E402  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections import defaultdict
from typing import Any

import omlx_logprobs  # noqa: F401
from omlx_logprobs.cli import mlx_environment

mlx_environment()

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs import heap
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.transport.client import EngineClient, ThreadTransport
from omlx_logprobs.types import EngineRequest, SamplingParams

from bench.experiments import clock

phases: dict[str, float] = defaultdict(float)
calls: dict[str, list[float]] = defaultdict(list)  # each call's ms, for LISTED names
LISTED = ("_settle", "queue", "bare_chunk")


def timed(obj: Any, name: str, label: str | None = None) -> None:
    """Wrap obj.name so that its wall time adds to phases[label] (and each call's ms to calls,
    for LISTED names)."""
    clock.timed(obj, name, phases, calls, label, LISTED)


def instrument(engine: Engine) -> None:
    r = engine.runner
    timed(engine.scheduler, "schedule")
    for name in ("launch", "queue", "collect", "admit", "release", "_sample"):
        timed(r, name)
    # runner/prefill.py's, and the runner's hooks as it holds them
    for name in ("_chunk_cache", "_last_logits", "_settle", "_prefixes", "forward_unread", "queue"):
        timed(r.prefill, name)
    timed(r, "_keep_finished")
    if r.prefixes is not None:
        timed(r.prefixes, "keep", "prefixes.keep")
    timed(mx, "async_eval")  # every caller's, the engine thread's included
    timed(engine, "_free")
    timed(engine, "_process")


def ttft(client: EngineClient, rid: str, prompt: list[int]) -> tuple[float, int]:
    """The time to the first token, and that token."""
    sp = SamplingParams(max_tokens=1, temperature=0)

    async def go() -> tuple[float, int]:
        t0 = time.perf_counter()
        handle = client.submit(EngineRequest(rid, prompt, sp, stream=True))
        slot = handle.choices[0]
        first, token = 0.0, 0
        while True:
            out = await slot.get()
            if len(out.token_ids) and not first:
                first, token = time.perf_counter() - t0, int(out.token_ids[0])
            if out.finished:
                return first, token

    return asyncio.run(go())


def bare(model: Any, turns: list[list[int]], chunk: int) -> list[float]:
    """mlx-lm alone: each turn's new tokens over a cache holding the turns before (best of 2)."""
    cache = make_prompt_cache(model)
    done: list[int] = []
    out = []

    def prefill(ids: list[int]) -> None:
        for a in range(0, len(ids), chunk):
            t0 = time.perf_counter()
            logits = model(mx.array([ids[a : a + chunk]]), cache=cache)
            mx.eval([c.state for c in cache])
            calls["bare_chunk"].append(round((time.perf_counter() - t0) * 1e3, 1))
        mx.eval(logits[:, -1, :])

    for prompt in turns:
        new = prompt[len(done) :]
        best = float("inf")
        for _ in range(2):
            calls.clear()
            t0 = time.perf_counter()
            prefill(new)
            best = min(best, time.perf_counter() - t0)
            for c in cache:
                c.trim(len(new))
        print(f"bare {len(prompt)}: chunks {calls['bare_chunk']}", flush=True)
        prefill(new)
        done = prompt
        out.append(best)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--new", type=int, default=2900, help="new tokens a turn")
    ap.add_argument("--first", type=int, default=3300, help="the first turn's tokens")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--cache-limit-mib", type=int, default=None)
    ap.add_argument("--no-bare", action="store_true")
    ap.add_argument(
        "--mlx-attention",
        action="store_true",
        help="bare mlx-lm on MLX's own attention (the wrapper taken out)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("omlx_logprobs").setLevel(logging.INFO)  # the warm-up's line
    model = load_model(args.model)
    rng = np.random.default_rng(0)
    low, high = 1000, len(model.vocab) - 1000

    def ids(n: int) -> list[int]:
        return rng.integers(low, high, n).tolist()

    cfg = EngineConfig(prefill_chunk=args.chunk)
    if args.cache_limit_mib is not None:
        cfg = EngineConfig(prefill_chunk=args.chunk, cache_limit_mib=args.cache_limit_mib)
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg, tokenizer=model.tokenizer,
                    context=model.max_model_len)  # fmt: skip
    instrument(engine)
    heap.freeze_startup_objects()  # as the server does: collections skip the start-up heap
    client = EngineClient(ThreadTransport(engine))
    client.start()
    turns: list[list[int]] = []
    rows: list[dict[str, Any]] = []
    prompt: list[int] = []
    try:
        ttft(client, "warm", ids(64))  # the prefix cache's own kept sequences start after
        for t in range(args.turns):
            prompt = prompt + ids(args.first if t == 0 else args.new)
            turns.append(prompt)
            phases.clear()
            calls.clear()
            ours, answer = ttft(client, f"t{t}", prompt)
            mine, mine_calls = dict(phases), {k: list(v) for k, v in calls.items()}
            # the answer joins the conversation, as a client's next turn resends it
            prompt = prompt + [answer]
            phases.clear()
            alone, _ = ttft(client, f"a{t}", ids(args.first if t == 0 else args.new + 1))
            ms = {k: round(v * 1e3, 1) for k, v in sorted(mine.items())}
            alone_ms = {k: round(v * 1e3, 1) for k, v in sorted(phases.items())}
            row = {"turn": t + 1, "tokens": len(turns[-1]), "ours": ours, "alone": alone,
                   "phases": ms, "calls": mine_calls, "alone_phases": alone_ms}  # fmt: skip
            rows.append(row)
            settle, queue = mine_calls.get("_settle"), mine_calls.get("queue")
            print(f"turn {t + 1}: ours {ours:.3f} alone {alone:.3f} settle {settle} queue {queue}",
                  flush=True)  # fmt: skip
    finally:
        client.shutdown()
    if not args.no_bare:
        if args.mlx_attention:
            from omlx_logprobs.runner import query_blocks

            mx.fast.scaled_dot_product_attention = query_blocks._inner
        for row, b in zip(rows, bare(model.model, turns, args.chunk)):
            row["bare"] = b
    for row in rows:
        ratio = row["ours"] / row["alone"]
        extra = f"  bare {row['bare']:.3f}" if "bare" in row else ""
        print(f"turn {row['turn']} {row['tokens']:6d} tokens: ours {row['ours']:.3f} s  "
              f"alone {row['alone']:.3f} s  ({ratio:.2f}x){extra}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
