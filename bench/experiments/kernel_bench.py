# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""The GPU step extraction, one CUDA kernel against the MLX ops it replaced (median ms): host
time to build and queue it (`async_eval`), and the whole call with its sync (queue + device).

    python -m bench.experiments.kernel_bench --reps 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import omlx_logprobs  # noqa: F401
import mlx.core as mx

from omlx_logprobs.logprobs.extract import EntryAsk, device_step


def one(x: mx.array, tok: mx.array, k: int | None, fused: bool) -> mx.array:
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    return device_step(tok, lse, None if k is None else EntryAsk(x, k), fused).array


def queue(x: mx.array, tok: mx.array, k: int | None, fused: bool) -> mx.array:
    out = one(x, tok, k, fused)
    mx.async_eval(out)
    return out


def median_ms(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    for b in (1, 64):
        for v in (49152, 151936):
            x = mx.random.normal((b, v)) * 4
            tok = mx.argmax(x, axis=-1)
            mx.eval(x, tok)
            for k in (None, 20):
                for fused in (False, True):
                    name = f"B={b:<3} V={v:<6} {'off ' if k is None else f'top{k}'} " + (
                        "kernel" if fused else "ops   "
                    )
                    mx.eval(one(x, tok, k, fused))  # compile, allocate

                    queued: list[mx.array] = []
                    q = median_ms(lambda: queued.append(queue(x, tok, k, fused)), a.reps)  # noqa: B023
                    mx.eval(*queued)
                    w = median_ms(lambda: mx.eval(one(x, tok, k, fused)), a.reps)  # noqa: B023
                    print(f"{name}  queue {q:6.3f} ms   queue+device {w:6.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
