"""What a speculative verify step costs against a plain decode step: the target's forward of
K+1 tokens per row against one token, at a context of L tokens, for B rows (the cost ratio that
runner/speculation.py's BREAK_EVEN and --speculate-max-batch stand for). The full step is
timed: the forward, the float32 log-softmax top-20 extraction of every position included.

    .venv/bin/python -m bench.experiments.verify_cost                      # the embedded model
    python -m bench.experiments.verify_cost --model DIR --rows 1 4 8 32    # the GPU host
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import json
import time

import omlx_logprobs  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.models.loader import load_model


def step_time(model: object, rows: int, context: int, n: int, reps: int) -> float:
    """Seconds per forward of n new tokens per row over `context` cached ones, with the
    top-20 of every position's float32 log-softmax read back."""
    cache = [BatchKVCache([0] * rows) for _ in make_prompt_cache(model)]
    prompt = mx.random.randint(0, 1000, (rows, context))
    mx.eval(model(prompt, cache=cache))  # type: ignore[operator]
    times = []
    for _ in range(reps + 1):
        ids = mx.random.randint(0, 1000, (rows, n))
        t0 = time.perf_counter()
        logits = model(ids, cache=cache).astype(mx.float32)  # type: ignore[operator]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.argpartition(-lp, 20, axis=-1)[..., :20]
        mx.eval(top, lp.max(axis=-1))
        times.append(time.perf_counter() - t0)
        for c in cache:
            c.trim(n)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    mlx_environment()
    model = load_model(args.model).model
    out = []
    for b in args.rows:
        base = step_time(model, b, args.context, 1, args.reps)
        for k in args.drafts:
            t = step_time(model, b, args.context, k + 1, args.reps) if k else base
            ratio = round(t / base, 2)
            out.append({"rows": b, "drafts": k, "ms": round(t * 1e3, 2), "ratio": ratio})
            print(f"rows {b:3d} drafts {k:2d}: {t * 1e3:8.2f} ms, {t / base:5.2f}x a plain step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
