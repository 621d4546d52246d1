"""Prefill attention within bounded memory, and fused where it is long.

Where MLX has no fused kernel for a prefill's attention (the CPU; its CUDA backend with cuDNN
off), it computes every score of the chunk at once: heads x chunk x context floats, which grows
with the context and ran an 80 GB card out of memory on 16k-24k token prompts. Each query's
softmax is its own, so the chunk's queries can be taken a block at a time: `install` puts a
wrapper in front of `mx.fast.scaled_dot_product_attention` that splits a call whose scores would
pass MAX_SCORE_BYTES into blocks of queries under it. A causal block needs only the keys up to
its last query, so it reads fewer keys too.

On CUDA with cuDNN's attention on (the server's default), cuDNN builds a graph for every new
shape (60-90 ms, the host waiting): worth it for long prefills, where the unfused blocks cost
seconds, not for the many short shapes of a serving batch. So a call of FUSED_PAIRS query-key
pairs a row or more goes to cuDNN (fused: its memory is the output's), and a shorter one to the
same unfused ops MLX's own fallback runs (`_unfused`), in blocks as above.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

# The scores one attention call may hold (float32), per call; OMLX_MAX_SCORE_MIB overrides it.
MAX_SCORE_BYTES = int(os.environ.get("OMLX_MAX_SCORE_MIB", "512")) << 20
# Query-key pairs a row from which a prefill call takes cuDNN's fused attention, where it is on
# (OMLX_FUSED_PAIRS overrides; docs/benchmarks.md, "Long conversations").
FUSED_PAIRS = int(os.environ.get("OMLX_FUSED_PAIRS", str(1 << 22)))

_inner: Any = None
_fused = False  # cuDNN's attention is on: calls under FUSED_PAIRS must keep away from it


def blocks(q: mx.array, k: mx.array) -> int:
    """Queries per block for this call: all of them when the scores fit."""
    b, heads, lq, _ = q.shape
    per_query = b * heads * k.shape[2] * 4
    return max(1, min(lq, MAX_SCORE_BYTES // max(per_query, 1)))


def fuses(q: mx.array, k: mx.array, v: mx.array, mask: Any, extra: dict[str, Any]) -> bool:
    """Whether cuDNN takes this call (MLX's own test, supports_sdpa_cudnn, and ours: long)."""
    lq, lk = q.shape[2], k.shape[2]
    return (
        _fused
        and 1 < lq <= lk
        and lq * lk >= FUSED_PAIRS
        and q.dtype in (mx.float16, mx.bfloat16)
        and all(x.shape[-1] % 8 == 0 and x.shape[-1] <= 128 for x in (q, v))
        and "sinks" not in extra
        and (mask is None or isinstance(mask, (str, mx.array)))
    )


def _unfused(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **extra: Any
) -> mx.array:
    """The ops MLX's fallback runs (mlx/fast.cpp): scaled queries, scores, the mask, a precise
    softmax, the values; query heads grouped over their key head."""
    b, heads, lq, d = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    rep = heads // kv_heads
    q = q * mx.array(scale, q.dtype)
    if rep > 1:
        q = q.reshape(b, kv_heads, rep, lq, d)
        k, v = k[:, :, None], v[:, :, None]
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):  # causal: the queries are the last lq positions of the keys
        mask = mx.arange(lk - lq, lk)[:, None] >= mx.arange(lk)[None]
    if mask is not None:
        if rep > 1 and mask.ndim >= 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(b, heads, lq, -1) if rep > 1 else out


def _sdpa(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **extra: Any
) -> mx.array:
    """The caller's other arguments (sinks, stream) pass through as they came."""
    lq, lk = q.shape[2], k.shape[2]
    if lq == 1 or fuses(q, k, v, mask, extra):
        return _inner(q, k, v, scale=scale, mask=mask, **extra)
    # Under cuDNN, the short calls MLX would give it take the fallback's ops here instead.
    call = _unfused if _fused and "sinks" not in extra and "stream" not in extra else _inner
    step = blocks(q, k)
    if step >= lq or not (mask is None or isinstance(mask, (str, mx.array))):
        return call(q, k, v, scale=scale, mask=mask, **extra)
    out: list[mx.array] = []
    for a in range(0, lq, step):
        b = min(a + step, lq)
        qb = q[:, :, a:b]
        if out:  # one block after the other: only one block's scores are alive at a time
            qb = mx.depends(qb, out[-1])
        if isinstance(mask, str):  # causal: queries are the last lq positions of the keys
            end = lk - lq + b
            part = call(qb, k[:, :, :end], v[:, :, :end], scale=scale, mask=mask, **extra)
        else:
            m = mask[..., a:b, :] if mask is not None and mask.shape[-2] > 1 else mask
            part = call(qb, k, v, scale=scale, mask=m, **extra)
        out.append(part)
    return mx.concatenate(out, axis=2)


def cudnn_on() -> bool:
    """Whether MLX's CUDA backend will use cuDNN's attention here (it reads the variable once)."""
    on_gpu = mx.default_device() == mx.gpu and mx.cuda.is_available()
    return on_gpu and os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1") != "0"


def install() -> None:
    """Route every attention call through the wrapper (once per process, over whatever is
    installed already: runner/fast/attention.py's decode kernel stays in front of MLX's)."""
    global _inner, _fused
    if _inner is not None:
        return
    _inner = mx.fast.scaled_dot_product_attention
    _fused = cudnn_on()
    mx.fast.scaled_dot_product_attention = _sdpa
