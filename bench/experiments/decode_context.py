"""One row decoding over a long context: a step's time, median and slowest of N steps (the cache
growing across 256-key boundaries on the way), with MLX's attention as the environment sets it
(`MLX_CUDA_USE_CUDNN_SDPA`: cuDNN's decode graphs are keyed by the cache's buffer length), or
with `--unfused` the fallback's ops (runner/query_blocks.py `_unfused`). The question: where
cuDNN's attention is on for prefill, what a single stream's decode should take.

    MLX_CUDA_USE_CUDNN_SDPA=1 python3 -m bench.experiments.decode_context --model DIR [--unfused]
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import json
import time

import omlx_logprobs  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from omlx_logprobs.models.loader import load_model
from omlx_logprobs.runner import query_blocks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 16384])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--unfused", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = load_model(args.model).model
    query_blocks.install()
    if args.unfused:
        inner = query_blocks._sdpa

        def route(q: mx.array, k: mx.array, v: mx.array, **kw: object) -> mx.array:
            if q.shape[2] == 1 and kw.get("mask") is None:
                kw.pop("sinks", None)
                return query_blocks._unfused(q, k, v, **kw)  # type: ignore[arg-type]
            return inner(q, k, v, **kw)  # type: ignore[arg-type]

        mx.fast.scaled_dot_product_attention = route
    out = []
    for context in args.contexts:
        cache = [BatchKVCache([0]) for _ in make_prompt_cache(model)]
        for a in range(0, context, 2048):
            n = min(2048, context - a)
            mx.eval(model(mx.random.randint(0, 1000, (1, n)), cache=cache)[:, -1])  # type: ignore[operator]
        token = mx.array([[1]])
        times = []
        for i in range(args.steps + 3):  # the first 3 untimed: kernels compiled
            t0 = time.perf_counter()
            logits = model(token, cache=cache)  # type: ignore[operator]
            token = logits[:, -1].argmax(axis=-1, keepdims=True)
            mx.eval(token)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        times.sort()
        row = {
            "context": context,
            "median_ms": round(times[len(times) // 2] * 1e3, 3),
            "max_ms": round(times[-1] * 1e3, 1),
            "over_20ms": sum(t > 0.02 for t in times),
        }
        out.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
