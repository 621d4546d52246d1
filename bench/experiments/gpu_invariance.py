"""Where batch-invariant mode stands on this device: whether one row's matmul result depends on
how many rows the product holds (float32, bfloat16, 4-bit quantized; the shapes of a 1.1B
llama), and what runner/invariance.py's start-up check finds on a model directory (one
sequence alone, batched and chunked, decoded alone and beside a row).

    python3 -m bench.experiments.gpu_invariance --model $M1B [--model $R8Q]
"""

# ruff: noqa: I001  (omlx_logprobs first: it chooses the BLAS before mlx loads)
from __future__ import annotations

import argparse

import omlx_logprobs  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.models.loader import load_model
from omlx_logprobs.runner import invariance, query_blocks
from omlx_logprobs.runner.fast import attention
from omlx_logprobs.runner.fast.fusion import Fusion

ROWS = (1, 2, 3, 4, 7, 8, 16, 17, 32, 64, 128, 512)
SHAPES = ((2048, 2048), (2048, 8192), (8192, 2048), (2048, 49152))


def product(kind: str, weight: tuple[mx.array, ...], a: mx.array) -> mx.array:
    if kind == "q4":
        return mx.quantized_matmul(a, *weight, transpose=True, group_size=64, bits=4)
    return a @ weight[0].T


def matmuls() -> None:
    """For each dtype and (in, out): the row counts whose row 0 differs from 2 rows' row 0."""
    mx.random.seed(0)
    for kind in ("float32", "bfloat16", "q4"):
        for k, n in SHAPES:
            w = mx.random.normal((n, k)) * 0.02
            x = mx.random.normal((max(ROWS), k))
            if kind == "q4":
                weight = tuple(mx.quantize(w, group_size=64, bits=4))
                x = x.astype(mx.bfloat16)
            else:
                weight = (w.astype(getattr(mx, kind)),)
                x = x.astype(weight[0].dtype)
            ref = product(kind, weight, x[:2])[0].astype(mx.float32)
            mx.eval(ref)
            differ = []
            for m in ROWS:
                row = product(kind, weight, x[:m])[0].astype(mx.float32)
                d = float(mx.abs(row - ref).max())
                if d:
                    differ.append(f"{m}:{d:.2g}")
            print(f"{kind:9s} {k}x{n}: rows whose row 0 differs from 2 rows': {differ or 'none'}")


def check(path: str) -> None:
    lm = load_model(path)
    attention.install()
    query_blocks.install()
    invariance.enable()
    Fusion(lm.model)
    try:
        d = invariance.check(lm.model, make_prompt_cache(lm.model), len(lm.vocab))
        print(f"{path}: the start-up check passes ({d})")
    except invariance.InvarianceError as e:
        print(f"{path}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=[])
    a = ap.parse_args()
    print(f"device {mx.default_device()}, BLAS {omlx_logprobs.BLAS}")
    matmuls()
    for path in a.model:
        check(path)


if __name__ == "__main__":
    main()
