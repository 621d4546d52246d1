"""Prefill attention in blocks of queries, so that its memory stays bounded whatever the context.

Where MLX has no fused kernel for a prefill's attention (its CUDA backend with cuDNN off, which
the server keeps off; the CPU), it computes every score of the chunk at once: heads x chunk x
context floats, which grows with the context and ran an 80 GB card out of memory on 16k-24k
token prompts. Each query's softmax is its own, so the chunk's queries can be taken a block at a
time: `install` puts a wrapper in front of `mx.fast.scaled_dot_product_attention` that splits
a call whose scores would pass MAX_SCORE_BYTES into blocks of queries under it, and passes
every other call through unchanged. A causal block needs only the keys up to its last query,
so it reads fewer keys too.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

# The scores one attention call may hold (float32), per call; OMLX_MAX_SCORE_MIB overrides it.
MAX_SCORE_BYTES = int(os.environ.get("OMLX_MAX_SCORE_MIB", "512")) << 20

_inner: Any = None


def blocks(q: mx.array, k: mx.array) -> int:
    """Queries per block for this call: all of them when the scores fit."""
    b, heads, lq, _ = q.shape
    per_query = b * heads * k.shape[2] * 4
    return max(1, min(lq, MAX_SCORE_BYTES // max(per_query, 1)))


def _sdpa(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **extra: Any
) -> mx.array:
    """The caller's other arguments (sinks, stream) pass through as they came."""
    lq, lk = q.shape[2], k.shape[2]
    step = blocks(q, k) if lq > 1 else lq
    if step >= lq or not (mask is None or isinstance(mask, (str, mx.array))):
        return _inner(q, k, v, scale=scale, mask=mask, **extra)
    out: list[mx.array] = []
    for a in range(0, lq, step):
        b = min(a + step, lq)
        qb = q[:, :, a:b]
        if out:  # one block after the other: only one block's scores are alive at a time
            qb = mx.depends(qb, out[-1])
        if isinstance(mask, str):  # causal: queries are the last lq positions of the keys
            end = lk - lq + b
            part = _inner(qb, k[:, :, :end], v[:, :, :end], scale=scale, mask=mask, **extra)
        else:
            m = mask[..., a:b, :] if mask is not None and mask.shape[-2] > 1 else mask
            part = _inner(qb, k, v, scale=scale, mask=m, **extra)
        out.append(part)
    return mx.concatenate(out, axis=2)


def install() -> None:
    """Route every attention call through the wrapper (once per process, over whatever is
    installed already: runner/fast/attention.py's decode kernel stays in front of MLX's)."""
    global _inner
    if _inner is not None:
        return
    _inner = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = _sdpa
