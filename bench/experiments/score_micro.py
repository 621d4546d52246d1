# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""Where a scored prompt's time goes, piece by piece, on whatever device MLX uses here.

    python bench/experiments/score_micro.py MODEL_DIR [TOKENS]

Medians of a few runs, each piece with its own sync: the forward with the head on the last
position, with the head everywhere, the float32 log-softmax, and the extraction with K = 1.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import omlx_logprobs  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from omlx_logprobs.logprobs.extract import extract, log_softmax


def timed(name: str, f: Callable[[], object], n: int = 5) -> None:
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    print(f"{name:<32} {statistics.median(times) * 1e3:8.2f} ms", flush=True)


def main() -> int:
    model, _ = load(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    ids = mx.random.randint(0, 49000, (1, tokens))
    chosen = ids[0]
    timed(
        "forward, head on last",
        lambda: mx.eval(model.model(ids, cache=make_prompt_cache(model))[:, -1]),
    )
    timed("forward, head everywhere", lambda: mx.eval(model(ids, cache=make_prompt_cache(model))))
    logits = model(ids)[0]
    mx.eval(logits)
    timed("log_softmax", lambda: mx.eval(log_softmax(logits)))
    lp = log_softmax(logits)
    mx.eval(lp)
    timed("extract k=1", lambda: mx.eval(*extract(lp, chosen, 1).arrays()))
    timed("extract k=0", lambda: mx.eval(*extract(lp, chosen, 0).arrays()))
    timed("extract k=5", lambda: mx.eval(*extract(lp, chosen, 5).arrays()))
    for b in (128, 512):

        def blocks(b: int = b) -> None:
            for a in range(0, tokens, b):
                mx.eval(*extract(log_softmax(logits[a : a + b]), chosen[a : a + b], 1).arrays())

        timed(f"softmax+extract, blocks of {b}", blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
