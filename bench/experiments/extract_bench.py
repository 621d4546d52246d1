# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""Device time of the logprob extraction's parts, each timed alone with its own sync (median).

python -m bench.experiments.extract_bench --batch 8 64 --vocab 49152 --k 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import omlx_logprobs  # noqa: F401
import mlx.core as mx

from omlx_logprobs.logprobs.extract import HostExtraction, extract, log_softmax
from omlx_logprobs.types import Entries


def run(fn: Callable[[], object]) -> None:
    out = fn()
    if isinstance(out, (Entries, HostExtraction)):  # the host part is the copy out
        out.to_host()
    else:
        mx.eval(out)


def timed(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        run(fn)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(fn)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def two_stage_top_k(lp: mx.array, k: int, block: int = 512) -> tuple[mx.array, mx.array]:
    """Top k by blocks: the top k of each `block`-wide slice, then the top k of those."""
    b, v = lp.shape
    x = lp if v % block == 0 else mx.pad(lp, [(0, 0), (0, -v % block)], float("-inf"))
    x = x.reshape(b, -1, block)
    i1 = mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]
    v1 = mx.take_along_axis(x, i1, axis=-1).reshape(b, -1)
    i1 = (i1 + (mx.arange(x.shape[1]) * block)[None, :, None]).reshape(b, -1)
    j = mx.argpartition(-v1, kth=k - 1, axis=-1)[:, :k]
    return mx.take_along_axis(i1, j, axis=-1), mx.take_along_axis(v1, j, axis=-1)


def cases(x: mx.array, tok: mx.array, lp: mx.array, k: int) -> dict[str, Callable[[], object]]:
    return {
        "argmax (greedy sample)": lambda: mx.argmax(x, axis=-1),
        "log_softmax": lambda: log_softmax(x),
        "chosen + rank": lambda: extract(lp, tok, 0).arrays()[:2],
        "argpartition k": lambda: mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k],
        "topk values": lambda: mx.topk(lp, k, axis=-1),
        "argsort full": lambda: mx.argsort(-lp, axis=-1)[:, :k],
        "two-stage top k (512)": lambda: two_stage_top_k(lp, k),
        "two-stage top k (256)": lambda: two_stage_top_k(lp, k, 256),
        "two-stage top k (2048)": lambda: two_stage_top_k(lp, k, 2048),
        f"extract k={k} (all)": lambda: extract(log_softmax(x), tok, k).arrays(),
        f"extract k={k}, on the host": lambda: HostExtraction(x, tok, k, None, True),
        "extract k=0 (all)": lambda: extract(log_softmax(x), tok, 0).arrays(),
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
