# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""Device time of the logprob extraction's parts, each timed alone with its own sync (median).

python bench/extract_bench.py --batch 8 64 --vocab 49152 --k 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import omlx_logprobs  # noqa: F401
import mlx.core as mx

from omlx_logprobs.logprobs.extract import extract, log_softmax


def timed(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cases(x: mx.array, tok: mx.array, lp: mx.array, k: int) -> dict[str, Callable[[], object]]:
    return {
        "argmax (greedy sample)": lambda: mx.argmax(x, axis=-1),
        "log_softmax": lambda: log_softmax(x),
        "chosen + rank": lambda: extract(lp, tok, 0)[:2],
        "argpartition k": lambda: mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k],
        "topk values": lambda: mx.topk(lp, k, axis=-1),
        "argsort full": lambda: mx.argsort(-lp, axis=-1)[:, :k],
        f"extract k={k} (all)": lambda: extract(log_softmax(x), tok, k),
        "extract k=0 (all)": lambda: extract(log_softmax(x), tok, 0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    print(f"device {mx.default_device()}, vocab {a.vocab}, k {a.k}; median ms per call")
    for b in a.batch:
        x = mx.random.normal((b, a.vocab)).astype(mx.float32) * 3
        tok = mx.argmax(x, axis=-1)
        lp = log_softmax(x)
        mx.eval(x, tok, lp)
        for name, fn in cases(x, tok, lp, a.k).items():
            print(f"  B={b:<3} {name:24s} {timed(fn, a.reps):8.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
