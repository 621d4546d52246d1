# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""Host time of the logprob extraction, as the engine pays it: building the ops and queueing them
(`async_eval`, no wait), then, after the device is done, the copy of the small results to numpy.
Device time is excluded (extract_bench.py measures that). Medians over many repetitions.

python bench/experiments/extract_host.py --batch 64 --vocab 49152 --k 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import omlx_logprobs  # noqa: F401
import mlx.core as mx

from omlx_logprobs.logprobs.extract import extract, log_softmax


def host_ms(build: Callable[[], list[mx.array]], reps: int) -> tuple[float, float]:
    """(median ms to build and queue, median ms to copy the results out once evaluated)."""
    queue_t, copy_t = [], []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        outs = build()
        mx.async_eval(*outs)
        t1 = time.perf_counter()
        mx.synchronize()
        t2 = time.perf_counter()
        for o in outs:
            o.tolist() if o.ndim == 0 else __import__("numpy").array(o, copy=False)
        t3 = time.perf_counter()
        if i >= 5:
            queue_t.append(t1 - t0)
            copy_t.append(t3 - t2)
    return 1e3 * statistics.median(queue_t), 1e3 * statistics.median(copy_t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    logits = mx.random.normal((a.batch, a.vocab)).astype(mx.bfloat16)
    mx.eval(logits)

    def step(k: int | None) -> list[mx.array]:
        x = logits.astype(mx.float32)
        tokens = mx.argmax(x, axis=-1)
        lse = mx.logsumexp(x, axis=-1, keepdims=True)
        outs = [tokens, mx.isfinite(lse[:, 0])]
        if k is not None:
            outs += extract(log_softmax(x, lse), tokens, k).arrays()
        return outs

    cases: dict[str, Callable[[], list[mx.array]]] = {
        "off (argmax, lse, isfinite)": lambda: step(None),
        "top 0 (+ chosen logprob, rank)": lambda: step(0),
        "top 1": lambda: step(1),
        f"top {a.k} (argpartition)": lambda: step(a.k),
        f"topk values only, k={a.k}": lambda: [mx.topk(logits.astype(mx.float32), a.k, axis=-1)],
        f"argpartition only, k={a.k}": lambda: [
            mx.argpartition(-logits.astype(mx.float32), kth=a.k - 1, axis=-1)[:, : a.k]
        ],
        "argsort only": lambda: [mx.argsort(-logits.astype(mx.float32), axis=-1)[:, : a.k]],
    }
    print(f"device {mx.default_device()}, [{a.batch}, {a.vocab}], median of {a.reps}")
    for name, build in cases.items():
        q, c = host_ms(build, a.reps)
        print(f"  {name:34s} queue {q:6.3f} ms   copy out {c:6.3f} ms")


if __name__ == "__main__":
    main()
