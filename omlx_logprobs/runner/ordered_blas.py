"""OpenBLAS products whose sums do not follow the batch's shape (batch-invariant mode on the CPU).

OpenBLAS (0.3.21, the Debian/Ubuntu build, SkylakeX kernels) computes a float32 product by one of
two routes, chosen by its shape (bench/experiments/blas_invariance.py measures all of this):

- a small-matrix kernel where the product is small (its `gemm_small_kernel_permit`: at most
  SMALL_WORK multiply-adds, and for the layout of `x @ W.T` at most SMALL_OUTPUTS outputs).
  The one for `x @ W.T` sums each output with 16 lanes over K and then across them; the one for
  `P @ V` (both operands as stored) is one fused multiply-add after the other over all of K.
- blocked kernels otherwise, one multiply-add after the other within blocks of K (256 or 320
  long, boundaries from the first column, the last ones shortened by K), the blocks added.

A row of `x @ W.T` comes out the same bits for every row count on the blocked route, but not
on both: a decode step of one row (the small kernel) differs from the same row in a prefill.
`linear` pads a product's rows to the fewest that keep it blocked (zero rows, cut off after).
Attention scores (`q @ k.T`, K = the head's width) are the same, with the query rows padded.

The values' product `P @ V` sums over the keys: blocked, a row left-padded in a batch has its
keys at other columns than alone, so they fall in other blocks; and the keys past a query
(masked, weight 0) set where the last blocks end. One multiply-add after the other in key
order gives one value whatever zeros come before and after. So `attention` takes the small
kernel for it, two query rows a call, within SMALL_WORK (wider heads split by columns).

`check` in runner/invariance.py holds it at start-up, where another OpenBLAS could differ.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

import omlx_logprobs

# OpenBLAS's small-matrix kernels take a product of at most this many outputs (for `x @ W.T`)
# and this many multiply-adds (any layout): sgemm_small_kernel_permit_skylakex.c.
SMALL_OUTPUTS = 1200
SMALL_WORK = 1_000_000

ACTIVE = False  # `install` ran: the mode's products take the functions here


def available() -> bool:
    """Whether OpenBLAS computes this process's float32 products on MLX's CPU backend."""
    return omlx_logprobs.BLAS.startswith("OpenBLAS") and mx.default_device() == mx.cpu


def rows_needed(outputs: int) -> int:
    """The fewest rows of an `x @ W.T` with `outputs` columns that OpenBLAS computes blocked
    (at least 2: newer OpenBLAS builds hand one row to a matrix-vector product)."""
    return max(2, SMALL_OUTPUTS // max(outputs, 1) + 1)


def _pad_rows(x: mx.array, rows: int) -> mx.array:
    return mx.pad(x, [(0, rows - x.shape[0]), (0, 0)])


def linear(x: mx.array, wt: mx.array, bias: mx.array | None = None) -> mx.array:
    """`x @ wt (+ bias)` for wt a weight's transpose ([in, out]): rows padded with zeros up to
    `rows_needed`, so that every row count sums each output the same way."""
    lead, n = x.shape[:-1], wt.shape[-1]
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    need = rows_needed(n)
    if m < need:
        flat = _pad_rows(flat, need)
    y = flat @ wt if bias is None else mx.addmm(bias, flat, wt)
    return (y[:m] if m < need else y).reshape(*lead, n)


def _linear_call(self: nn.Linear, x: mx.array) -> mx.array:
    return linear(x, self["weight"].T, self.get("bias"))


def _as_linear(self: nn.Embedding, x: mx.array) -> mx.array:
    return linear(x, self.weight.T)


def _values(p: mx.array, v: mx.array) -> mx.array:
    """p [..., rows, keys] @ v [..., keys, width], each output one multiply-add after the other
    over the keys: two query rows an OpenBLAS call (MLX's batch loop), within SMALL_WORK (wider
    heads split by columns). Not one row a call: MLX reads a one-row matrix's layout from its
    strides, and one whose row stride is 1 goes to another kernel (which crashed, with the
    stride 1 for a leading dimension, in OpenBLAS 0.3.21)."""
    *lead, rows, keys = p.shape
    width = v.shape[-1]
    cols = SMALL_WORK // (2 * max(keys, 1))
    if cols < 1:
        raise ValueError(f"batch-invariant attention takes at most {SMALL_WORK // 2} keys")
    if rows % 2:
        p = mx.pad(p, [(0, 0)] * len(lead) + [(0, 1), (0, 0)])
    pairs = p.reshape(*lead, -1, 2, keys)
    # Each part contiguous before it is broadcast over the pairs: MLX copies an operand whose
    # last two axes are strided, and a broadcast one whole (gigabytes at long contexts).
    parts = [v] if cols >= width else [v[..., a : a + cols] for a in range(0, width, cols)]
    outs = [pairs @ mx.expand_dims(mx.contiguous(x), -3) for x in parts]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)
    out = out.reshape(*lead, -1, width)
    return out[..., :rows, :] if rows % 2 else out


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """MLX's attention fallback (mlx/fast.cpp) as `runner/query_blocks.py`'s `_unfused` runs
    it, its two products in an order that follows no shape but the keys': the query heads of a
    key head and their positions are the rows of one scores product, padded to `rows_needed`
    of the keys; the values' product as `_values`."""
    b, heads, lq, d = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    rep = heads // kv_heads
    rows = rep * lq
    q = (q * mx.array(scale, q.dtype)).reshape(b, kv_heads, rows, d)
    need = rows_needed(lk)
    if rows < need:
        q = mx.pad(q, [(0, 0), (0, 0), (0, need - rows), (0, 0)])
    scores = (q @ k.swapaxes(-1, -2))[:, :, :rows].reshape(b, kv_heads, rep, lq, lk)
    if isinstance(mask, str):  # causal: the queries are the last lq positions of the keys
        mask = mx.arange(lk - lq, lk)[:, None] >= mx.arange(lk)[None]
    if mask is not None:
        if mask.ndim >= 3:  # a mask per query head: grouped as the queries are
            if mask.shape[-3] == 1:
                mask = mx.expand_dims(mask, -3)
            else:
                mask = mask.reshape(*mask.shape[:-3], kv_heads, rep, lq, lk)
        if mask.dtype == mx.bool_:
            # as MLX: the lowest float, so a row masked whole is uniform (not NaN)
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    if sinks is not None:
        column = sinks.astype(scores.dtype).reshape(1, kv_heads, rep, 1, 1)
        column = mx.broadcast_to(column, (*scores.shape[:-1], 1))
        weights = mx.softmax(mx.concatenate([column, scores], axis=-1), axis=-1, precise=True)
        weights = weights[..., 1:]
    else:
        weights = mx.softmax(scores, axis=-1, precise=True)
    out = _values(weights.reshape(b, kv_heads, rows, lk), v)
    return out.reshape(b, heads, lq, -1)


def install() -> None:
    """Every plain linear layer and tied head of the process computes through `linear` from
    now on (runner/fast/lean_decode.py reads ACTIVE; runner/query_blocks.py routes attention)."""
    global ACTIVE
    if ACTIVE:
        return
    nn.Linear.__call__ = _linear_call  # type: ignore[method-assign]
    nn.Embedding.as_linear = _as_linear  # type: ignore[method-assign]
    ACTIVE = True
