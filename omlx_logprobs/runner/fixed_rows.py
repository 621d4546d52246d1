"""Products whose every BLAS call has one shape: a row's bits then depend on that row alone.

OpenBLAS chooses its kernel by a product's shape (a matrix-vector product for one row, small-
matrix kernels under a size, blocked ones over it, the inner dimension split past a block), and
the kernels sum in different orders: a row's outputs moved by 1e-5 with the batch it was in.
Measured on MLX's CPU backend with OpenBLAS (a row alone, among others, at every position of
its block, 1 to 300 rows): one call of R rows gives every row the same bits whatever the other
R - 1 hold. So `product` pads a product's rows (all leading dimensions flattened) to a multiple
of ROWS and multiplies them as [rows / ROWS, ROWS, K] against the weight broadcast over the
blocks, which MLX computes one BLAS call per block: the same (ROWS, K, N) call for every block
of every batch. Attention's products vary in the keys too; `scores` and `weighted` hold them
(runner/query_blocks.py's batch-invariant path). Under MLX's reference BLAS, an unblocked loop,
the blocks give the same bits as one call. A batched product is split where MLX's 32-bit
operand indices would overflow (`MAX_INDEX`).

The mode (runner/invariance.py) turns them on for the whole process: `ON`.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

ROWS = 8  # rows a BLAS call (2, 4, 8 and 16 measured the same property; 8 pads a decode least)
KEYS = 128  # keys a call of the attention's scores (runner/query_blocks.py)
# Elements of the broadcast operand times the calls of one batched product at most: MLX's CPU
# matmul locates each call's operands with 32-bit element indices (mlx 0.32), and past 2^31 a
# call read outside the weight (SmolLM2's head, 28M elements, from 76 blocks on: a crash in
# OpenBLAS's packing routines, or wrong bits where the read landed in memory).
MAX_INDEX = 1 << 30
ON = False  # batch-invariant mode: runner/lora.py and training/lora.py multiply with these


def _blocks(x: mx.array) -> tuple[mx.array, int]:
    """x [..., K] as [blocks, ROWS, K] (zero rows after the last), and its rows."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    flat = x.reshape(rows, x.shape[-1])
    pad = (-rows) % ROWS
    if pad:
        flat = mx.concatenate([flat, mx.zeros((pad, x.shape[-1]), x.dtype)])
    return flat.reshape(-1, ROWS, x.shape[-1]), rows


def _batched(a: mx.array, b: mx.array, axis: int) -> mx.array:
    """a @ b, split along `axis` (a batch axis of `a`) into products whose calls times the
    largest operand's matrix stay under MAX_INDEX elements."""
    calls = math.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    matrix = max(a.shape[-2] * a.shape[-1], b.shape[-2] * b.shape[-1], a.shape[-2] * b.shape[-1])
    n = a.shape[axis]
    per = max(1, MAX_INDEX // (matrix * max(1, calls // n)))
    if n <= per:
        return a @ b
    parts = mx.split(a, list(range(per, n, per)), axis=axis)
    return mx.concatenate([p @ b for p in parts], axis=axis)


def product(x: mx.array, w: mx.array) -> mx.array:
    """x [..., K] @ w [K, N], each BLAS call ROWS rows of x."""
    blocks, rows = _blocks(x)
    y = _batched(blocks, mx.expand_dims(w, 0), 0)  # MLX makes one call a block
    return y.reshape(-1, w.shape[-1])[:rows].reshape(*x.shape[:-1], w.shape[-1])


def gathered(x: mx.array, w: mx.array, index: mx.array) -> mx.array:
    """Row b of x [B, K] or [B, L, K] times w[index[b]] (w [S, K, N]), each call ROWS rows of one
    sequence's (a decode step's row alone in its block: the same call as `product`'s)."""
    flat = x.ndim == 2
    x3 = x[:, None, :] if flat else x
    b, length, k = x3.shape
    pad = (-length) % ROWS
    if pad:
        x3 = mx.concatenate([x3, mx.zeros((b, pad, k), x.dtype)], axis=1)
    blocks = x3.reshape(b, -1, ROWS, k)
    y = mx.gather_mm(blocks, w, rhs_indices=mx.broadcast_to(index[:, None], blocks.shape[:2]))
    y = y.reshape(b, -1, w.shape[-1])[:, :length]
    return y[:, 0] if flat else y


def scores(q: mx.array, k: mx.array) -> mx.array:
    """q [..., M, D] @ k [..., L, D]^T in calls of ROWS queries and KEYS keys: the keys' count
    sets no kernel (OpenBLAS takes a small-matrix kernel under about 150 keys of 64 wide)."""
    lead, m, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    length = k.shape[-2]
    qpad, kpad = (-m) % ROWS, (-length) % KEYS
    if qpad:
        q = mx.pad(q, [(0, 0)] * len(lead) + [(0, qpad), (0, 0)])
    if kpad:
        k = mx.pad(k, [(0, 0)] * (k.ndim - 2) + [(0, kpad), (0, 0)])
    qb = q.reshape(*lead, -1, 1, ROWS, d)
    kt = k.reshape(*k.shape[:-2], 1, -1, KEYS, d).swapaxes(-1, -2)
    s = _batched(qb, kt, -4)  # [..., M / ROWS, L / KEYS, ROWS, KEYS]
    s = s.swapaxes(-2, -3).reshape(*s.shape[:-4], m + qpad, length + kpad)
    return s[..., :m, :length]


def weighted(p: mx.array, v: mx.array) -> mx.array:
    """p [..., M, L] @ v [..., L, E] as a product and a sum over the keys, which MLX's CPU
    backend adds one key after the other (a scalar loop on Linux): a key's place in the call
    (left padding, keys past a chunk's queries, how many) leaves the sum's bits as they are.
    A BLAS call sums the keys in blocks whose bounds move with the padding."""
    return (mx.expand_dims(p, -1) * mx.expand_dims(v, -3)).sum(axis=-2)
