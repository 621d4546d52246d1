"""The decode attention kernel (runner/fast/attention.py) against MLX's own path for a mask array
(its fallback: matmuls, a select and a softmax), on a GPU: each call's host time (building and
`async_eval`) and its time to done (host and device, synchronized every call), over batch
sizes and key lengths, bfloat16: 32 query heads over 8 KV heads of 128 (an 8B llama's), and
32 over 4 of 64 (the GPU preset's random 1.1B llama).

    python3 -m bench.experiments.attention_bench [--reps 50]
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import statistics
import time

import omlx_logprobs  # noqa: F401
import mlx.core as mx

from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.runner.fast import attention


def timed(fn, reps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    hosts, totals = [], []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        y = fn()
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        hosts.append(t1 - t0)
        totals.append(t2 - t0)
    return statistics.median(hosts[3:]) * 1e3, statistics.median(totals[3:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=16, help="attention calls chained per timing")
    a = ap.parse_args()
    mlx_environment()
    shapes = [(b, n, 32, 8, 128) for b, n in ((1, 512), (1, 8192), (1, 32768), (8, 8192))]
    shapes += [(64, 256, 32, 8, 128), (64, 2048, 32, 8, 128), (64, 200, 32, 4, 64)]
    for b, length, hq, hkv, d in shapes:
        q = mx.random.normal((b, hq, 1, d)).astype(mx.bfloat16)
        k = mx.random.normal((b, hkv, length + 64, d)).astype(mx.bfloat16)[:, :, :length]
        v = mx.random.normal((b, hkv, length + 64, d)).astype(mx.bfloat16)[:, :, :length]
        pads = mx.array([(7 * i) % max(length // 4, 1) for i in range(b)])
        mask = pads[:, None, None, None] <= mx.arange(length)[None, None, None, :]
        mx.eval(q, k, v, mask)

        def ours(q=q, k=k, v=v, mask=mask, d=d) -> mx.array:  # type: ignore[no-untyped-def]
            x = q
            for _ in range(a.layers):
                x = attention.decode_attention(x, k, v, d**-0.5, mask)
            return x

        def mlx(q=q, k=k, v=v, mask=mask, d=d) -> mx.array:  # type: ignore[no-untyped-def]
            x = q
            for _ in range(a.layers):
                x = attention._mlx_sdpa(x, k, v, scale=d**-0.5, mask=mask)
            return x

        diff = mx.abs(ours().astype(mx.float32) - mlx().astype(mx.float32)).max().item()
        (h1, t1), (h2, t2) = timed(ours, a.reps), timed(mlx, a.reps)
        print(
            f"B {b:3d} L {length:6d} heads {hq}/{hkv}x{d}, {a.layers} calls: kernel host "
            f"{h1:.3f} ms, done {t1:.3f} ms"
            f" | MLX host {h2:.3f} ms, done {t2:.3f} ms | max diff {diff:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
