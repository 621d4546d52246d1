"""Which OpenBLAS products depend on the batch's shape, and whether two routes around it do not
(batch-invariant mode on the CPU; docs/specs/logprobs.md, "Batch-invariant mode", OpenBLAS).

Rows: `x @ W.T` at every row count from 1 to --top (the largest products sampled past
--full-rows), each row's bits against the same row of a product of --top rows, plain and
padded (`linear`: zero rows up to the fewest OpenBLAS computes blocked), for the linear
shapes of SmolLM2-135M (and its joined q/k/v and gate/up), Qwen2.5-0.5B, Llama-3.2-1B and a
tiny test model.
Scores: `q @ k.T` (K = the head's width) for key and query-row counts, against a large product.
Values: one query's `P @ V` over T keys, left-padded by P and followed by Z keys of weight 0
(another row's padding; the keys past a query), against the row alone: one OpenBLAS call of
8 or 64 query rows (the blocked route) and `values` (two rows a call: the small kernel, one
multiply-add after the other over the keys).

    .venv/bin/python -m bench.experiments.blas_invariance [--top 1100] [--attention-only]
"""

from __future__ import annotations

import argparse
import time

# isort: off
import omlx_logprobs  # OpenBLAS first (blas.py)

# isort: on
import mlx.core as mx
import numpy as np

# OpenBLAS 0.3.21's small-matrix kernels (sgemm_small_kernel_permit_skylakex.c): at most this
# many multiply-adds, and for `x @ W.T` at most this many outputs.
SMALL_WORK, SMALL_OUTPUTS = 1_000_000, 1200


def rows_needed(outputs: int) -> int:
    """The fewest rows of an `x @ W.T` that OpenBLAS computes blocked (2 at least)."""
    return max(2, SMALL_OUTPUTS // outputs + 1)


def linear(x: mx.array, wt: mx.array) -> mx.array:
    """x @ wt, rows padded with zeros to `rows_needed`."""
    m, need = x.shape[0], rows_needed(wt.shape[-1])
    return (mx.pad(x, [(0, need - m), (0, 0)]) @ wt)[:m] if m < need else x @ wt


def values(p: mx.array, v: mx.array) -> mx.array:
    """p [rows, keys] @ v [keys, width] two rows an OpenBLAS call (MLX's batch loop), within
    SMALL_WORK (columns split past it)."""
    rows, keys = p.shape
    cols = SMALL_WORK // (2 * keys)
    pairs = mx.pad(p, [(0, rows % 2), (0, 0)]).reshape(-1, 2, keys)
    parts = (
        [v] if cols >= v.shape[-1] else [v[:, a : a + cols] for a in range(0, v.shape[-1], cols)]
    )
    out = mx.concatenate([pairs @ mx.contiguous(x)[None] for x in parts], axis=-1)
    return out.reshape(-1, v.shape[-1])[:rows]


SHAPES = {  # (in, out) of each linear product
    "SmolLM2-135M": [(576, 576), (576, 192), (576, 960), (576, 1536), (576, 3072), (1536, 576),
                     (576, 49152)],
    "Qwen2.5-0.5B": [(896, 896), (896, 128), (896, 1152), (896, 9728), (4864, 896),
                     (896, 151936)],
    "Llama-3.2-1B": [(2048, 2048), (2048, 512), (2048, 3072), (2048, 16384), (8192, 2048)],
    "tiny": [(64, 64), (64, 32), (64, 128), (128, 64)],
}  # fmt: skip
BIG = 2_000_000  # in x out past which row counts past --full-rows are sampled


def bits(a: mx.array) -> np.ndarray:
    return np.array(a).view(np.uint32)


def rows_sweep(k: int, n: int, counts: list[int]) -> tuple[list[int], list[int]]:
    """The row counts at which some row differs: plain `x @ W.T`, padded."""
    x = mx.random.normal((max(counts), k), key=mx.random.key(0))
    w = mx.random.normal((n, k), key=mx.random.key(1)) * 0.05
    mx.eval(x, w)
    ref = bits(x @ w.T)
    plain, padded = [], []
    for m in counts:
        if (bits(x[:m] @ w.T) != ref[:m]).any():
            plain.append(m)
        if (bits(linear(x[:m], w.T)) != ref[:m]).any():
            padded.append(m)
    return plain, padded


def scores_sweep(width: int = 64) -> None:
    q = mx.random.normal((64, width), key=mx.random.key(2))
    k = mx.random.normal((2048, width), key=mx.random.key(3))
    ref = bits(q @ k.T)
    tried, differ = 0, []
    for keys in [*range(1, 64), *range(64, 2049, 29)]:
        for rows in (1, 2, 3, 4, 5, 8, 13, 19, 33, 64):
            tried += 1
            if (bits(q[:rows] @ k[:keys].T) != ref[:rows, :keys]).any():
                differ.append(keys * rows)
    print(
        f"scores q @ k.T (width {width}): {len(differ)} of {tried} (keys, rows) differ, all with "
        f"keys x rows <= {max(differ, default=0)} (the small kernel takes up to {SMALL_OUTPUTS})"
    )


def values_sweep(width: int = 64) -> None:
    pads, tails = (0, 1, 3, 7, 16, 17, 255, 256, 257, 999), (0, 5, 300)
    for t in (100, 255, 256, 300, 700, 1500, 4000, 9000, 20000):
        v = mx.random.normal((t, width), key=mx.random.key(t))
        w = mx.softmax(mx.random.normal((8, t), key=mx.random.key(t + 1)) * 3, axis=-1)
        junk = mx.random.normal((2000, width), key=mx.random.key(5))
        alone = bits(values(w[:1], v))
        same: dict[str, int] = {}
        for p in pads:
            for z in tails:
                pw = mx.concatenate([mx.zeros((8, p)), w, mx.zeros((8, z))], axis=1)
                pv = mx.concatenate([junk[:p], v, junk[p : p + z]], axis=0)
                for name, out in (
                    ("one call of 8 rows", pw @ pv),
                    ("one call of 64 rows", mx.concatenate([pw] * 8) @ pv),
                    ("values, two rows a call", values(pw, pv)),
                ):
                    same[name] = same.get(name, 0) + bool((bits(out[:1]) == alone).all())
        print(
            f"values P @ V, {t} keys, {len(pads) * len(tails)} paddings: "
            + ", ".join(f"{name} {n} equal the row alone" for name, n in same.items())
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=1100)
    ap.add_argument("--full-rows", type=int, default=96, help="every count up to this (big)")
    ap.add_argument("--attention-only", action="store_true", help="the scores and values sweeps")
    args = ap.parse_args()
    print(omlx_logprobs.BLAS)
    scores_sweep()
    values_sweep()
    if args.attention_only:
        return
    for model, shapes in SHAPES.items():
        for k, n in shapes:
            full = args.top if k * n <= BIG else args.full_rows
            step = 37 if k * n > 20 * BIG else 7
            counts = [*range(1, full + 1), *range(full + 1, args.top + 1, step)]
            t0 = time.time()
            plain, padded = rows_sweep(k, n, counts)
            print(
                f"{model} x @ W.T, in {k} out {n}, {len(counts)} row counts to {args.top} "
                f"({time.time() - t0:.0f} s): plain differs at {plain or 'none'}; padded to "
                f"{rows_needed(n)} rows: {padded or 'none'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
