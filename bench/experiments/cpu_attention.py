"""One prefill attention call on the CPU backend, MLX's own ops against numpy's (the server's
`runner/query_blocks._host`), at a long conversation's turn: SmolLM2-135M's heads (9 query, 3
key and value, 64 wide), 700 new queries over 5.5k keys; and MLX's `exp` alone against numpy's.

    .venv/bin/python -m bench.experiments.cpu_attention [--queries 700 --keys 5544]
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import omlx_logprobs  # noqa: F401
import mlx.core as mx
import numpy as np

from omlx_logprobs.runner import query_blocks


def best(f: Callable[[], Any], reps: int = 3) -> float:
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        r = f()
        if isinstance(r, mx.array):
            mx.eval(r)
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=700)
    p.add_argument("--keys", type=int, default=5544)
    a = p.parse_args()
    mx.set_default_device(mx.cpu)
    query_blocks.install()
    q = mx.random.normal((1, 9, a.queries, 64))
    k, v = (mx.random.normal((1, 3, a.keys, 64)) for _ in range(2))
    mx.eval(q, k, v)

    def call() -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")

    query_blocks._host_side = False
    mlx_s = best(call)
    query_blocks._host_side = True
    host_s = best(call)
    s = mx.random.normal((27 * a.queries // 9, a.keys))
    mx.eval(s)
    sn = np.asarray(s)
    print(f"attention, MLX's ops: {1e3 * mlx_s:.1f} ms; numpy's: {1e3 * host_s:.1f} ms")
    print(f"exp of {s.size:,} floats, MLX: {1e3 * best(lambda: mx.exp(s)):.1f} ms;", end=" ")
    print(f"numpy: {1e3 * best(lambda: np.exp(sn)):.1f} ms")


if __name__ == "__main__":
    main()
