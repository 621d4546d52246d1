# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""What a prefill forward of a new shape costs the first time: for each (rows, width), a
left-padded group forward as the model runner makes it (BatchCache, array mask), timed on its
first call and again, host and device included (each call evaluated and waited for).

    python bench/experiments/prefill_shapes.py --model DIR --shapes 27x96 33x96 64x96 27x96
    # MLX's unfused attention instead of cuDNN's:
    MLX_CUDA_USE_CUDNN_SDPA=0 python bench/experiments/prefill_shapes.py ...
"""

from __future__ import annotations

import argparse
import time

import omlx_logprobs  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.models.loader import load_model


def forward_ms(model: object, rows: int, width: int) -> float:
    pads = [(i * 7) % 24 for i in range(rows)]  # uneven left padding, as in a real group
    ids = mx.array([[0] * p + [(i * 31 + j) % 1000 + 5 for j in range(width - p)]
                    for i, p in enumerate(pads)])  # fmt: skip
    cache = BatchCache.for_prompts(make_prompt_cache(model), pads)
    t0 = time.perf_counter()
    out = model(ids, cache=cache.layers)[:, -1, :]  # type: ignore[operator]
    mx.eval(out, *[c.keys for c in cache.layers])
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", nargs="+", required=True, help="ROWSxWIDTH")
    a = ap.parse_args()
    model = load_model(a.model).model
    forward_ms(model, 1, 32)  # the process's first forward pays for everything once
    for s in a.shapes:
        rows, width = (int(x) for x in s.split("x"))
        first = forward_ms(model, rows, width)
        again = min(forward_ms(model, rows, width) for _ in range(3))
        print(f"{rows:3d} x {width:5d}: first {first:7.1f} ms, then {again:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
