"""Prefill attention within bounded memory, and fused where it is long.

Where MLX has no fused kernel for a prefill's attention (the CPU; its CUDA backend with cuDNN
off), it computes every score of the chunk at once: heads x chunk x context floats, which grows
with the context and ran an 80 GB card out of memory on 16k-24k token prompts. Each query's
softmax is its own, so the chunk's queries can be taken a block at a time: `install` puts a
wrapper in front of `mx.fast.scaled_dot_product_attention` that splits a call whose scores would
pass MAX_SCORE_BYTES into blocks of queries under it. A causal block needs only the keys up to
its last query, so it reads fewer keys too.

On CUDA, cuDNN's attention is on (cli.py; `MLX_CUDA_USE_CUDNN_SDPA=0` turns it off), and cuDNN
builds a graph for every new shape (100-250 ms at long prompts' shapes on an H200, the host
waiting): a turn of a long conversation, whose context is a new length every time, paid it at
every chunk. So a call of one row and FUSED_PAIRS query-key pairs or more goes to cuDNN (fused:
its memory is the output's) padded up to a few bucket shapes (`bucket`), its padding masked
out, so that a server builds a bounded number of graphs; every other call runs the unfused ops
MLX's own fallback runs (`_unfused`), in blocks as above.
`warm` builds those graphs at start-up (`shapes`), so that no request waits for one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_logprobs.blas import numpy_blas_threads
from omlx_logprobs.runner import fixed_rows

# The scores one attention call may hold (float32), per call; OMLX_MAX_SCORE_MIB overrides it.
MAX_SCORE_BYTES = int(os.environ.get("OMLX_MAX_SCORE_MIB", "512")) << 20
# Query-key pairs a row from which a prefill call takes cuDNN's fused attention, where it is on
# (OMLX_FUSED_PAIRS overrides; docs/benchmarks.md, "Long conversations").
FUSED_PAIRS = int(os.environ.get("OMLX_FUSED_PAIRS", str(1 << 22)))
QUERY_BUCKET, KEY_BUCKET = 256, 4096  # the smallest padded shape (see `bucket`)
KEY_STEPS = 4  # key buckets to the octave

# The CPU backend's prefill calls of this many scores or more take numpy (`_host`); under it
# the numpy round trip costs more than MLX's own ops.
HOST_ELEMENTS = 1 << 16

_inner: Any = None
_fused = False  # cuDNN's attention is on: calls under FUSED_PAIRS must keep away from it
_host_side = False  # MLX computes on the CPU here: long prefill calls take numpy
# Batch-invariant mode (runner/invariance.py): every call, a decode step's too, takes `_unfused`
# with runner/fixed_rows.py's products, whose sums do not depend on how many queries, keys or
# rows a call holds (OpenBLAS's and numpy's do).
_exact = False
# Inside `differentiable` (a training forward): numpy's attention is no MLX op a gradient traces.
_traced = 0
# While `warm` runs its probe forward: the head shapes (heads, key heads, query and value
# widths, dtype) of the prefill calls seen.
_heads: set[tuple[int, int, int, int, mx.Dtype]] | None = None


def blocks(q: mx.array, k: mx.array) -> int:
    """Queries per block for this call: all of them when the scores fit (in batch-invariant
    mode, the values weighted by them: `fixed_rows.weighted`, a value width per score)."""
    b, heads, lq, _ = q.shape
    per_query = b * heads * k.shape[2] * 4 * (q.shape[-1] if _exact else 1)
    return max(1, min(lq, MAX_SCORE_BYTES // max(per_query, 1)))


def bucket(n: int, least: int, per_octave: int = 2) -> int:
    """The padded length of n: the next of least * 2^i * (per_octave + j) / per_octave, for
    j < per_octave (queries: 2 to the octave, a third wasted at most; keys: 4, a fifth at
    most, as the keys' count sets what a chunk's attention costs)."""
    size, step = least, least // per_octave
    while size < n:
        if size + step > 2 * least:
            least, step = 2 * least, 2 * step
        size += step
    return size


def padded_shape(lq: int, lk: int) -> tuple[int, int]:
    """A fused call's (queries, keys) at its bucket: at least as many keys as queries."""
    bq = bucket(lq, QUERY_BUCKET)
    return bq, bucket(max(lk, bq), KEY_BUCKET, KEY_STEPS)


def ladder(least: int, top: int, per_octave: int = 2) -> list[int]:
    """The bucket sizes from `least` up to the bucket of `top`."""
    sizes = [least]
    while sizes[-1] < top:
        sizes.append(bucket(sizes[-1] + 1, least, per_octave))
    return sizes


def shapes(chunk: int, context: int) -> list[tuple[int, int]]:
    """The padded (queries, keys) shapes a fused call can take where prefill chunks are at most
    `chunk` tokens and contexts at most `context`: 71 for 2,048 and 32k (a half-precision mask
    within MAX_SCORE_BYTES: at most 2,048 x 128k)."""
    return [
        (bq, bk)
        for bq in ladder(QUERY_BUCKET, min(chunk, context))
        for bk in ladder(KEY_BUCKET, context, KEY_STEPS)
        if bq <= bk and bq * bk >= FUSED_PAIRS and bq * bk * 2 <= MAX_SCORE_BYTES
    ]


def warm(forward: Callable[[], None], chunk: int, context: int) -> int:
    """Where cuDNN's attention is on, build its graph for every bucket shape (`shapes`) of every
    head shape the model's attention calls have (`forward` runs a short prefill that shows
    them), so that no request waits 100-250 ms for one. The graphs are keyed by the shapes and
    strides of q, k, v and the mask (MLX's SDPACacheKey), which `_padded`'s contiguous inputs
    and [1, 1, bq, bk] mask match. Returns the number of graphs built."""
    global _heads
    if not _fused:
        return 0
    _heads = set()
    try:
        forward()
        heads = sorted(_heads, key=str)
    finally:
        _heads = None
    built = 0
    for h, kv_h, d, dv, dtype in heads:
        if not cudnn_heads(d, dv, dtype):  # MLX's unfused ops at these shapes: gigabytes
            continue
        for bq, bk in shapes(chunk, context):
            q = mx.zeros((1, h, bq, d), dtype)
            k, v = mx.zeros((1, kv_h, bk, d), dtype), mx.zeros((1, kv_h, bk, dv), dtype)
            mask = mx.zeros((1, 1, bq, bk), dtype)
            mx.eval(_inner(q, k, v, scale=d**-0.5, mask=mask))
            built += 1
    return built


def cudnn_heads(d: int, dv: int, dtype: mx.Dtype) -> bool:
    """Whether cuDNN's attention takes heads this wide in this dtype (MLX's
    supports_sdpa_cudnn): half precision, widths multiples of 8 up to 128."""
    return dtype in (mx.float16, mx.bfloat16) and all(x % 8 == 0 and x <= 128 for x in (d, dv))


def fuses(q: mx.array, k: mx.array, v: mx.array, mask: Any, extra: dict[str, Any]) -> bool:
    """Whether cuDNN takes this call (MLX's own test, supports_sdpa_cudnn, and ours: one row,
    long, and a padded mask within MAX_SCORE_BYTES, as the unfused blocks' scores are)."""
    lq, lk = q.shape[2], k.shape[2]
    return (
        _fused
        and q.shape[0] == 1
        and 1 < lq <= lk
        and lq * lk >= FUSED_PAIRS
        and math.prod(padded_shape(lq, lk)) * q.dtype.size <= MAX_SCORE_BYTES
        and cudnn_heads(q.shape[-1], v.shape[-1], q.dtype)
        and "sinks" not in extra
        and (mask is None or isinstance(mask, str) or getattr(mask, "size", 0) == lq * lk)
    )


def _padded(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **extra: Any
) -> mx.array:
    """One fused call at the bucket shape: queries and keys padded at their ends, an additive
    mask in which padded keys take no weight and padded queries (dropped after) see the real
    keys. The mask is made once per shape and reused by every layer of the forward."""
    lq, lk = q.shape[2], k.shape[2]
    bq, bk = padded_shape(lq, lk)
    q = mx.pad(q, [(0, 0), (0, 0), (0, bq - lq), (0, 0)])
    k, v = (mx.pad(x, [(0, 0), (0, 0), (0, bk - lk), (0, 0)]) for x in (k, v))
    out = _inner(q, k, v, scale=scale, mask=_bucket_mask(mask, lq, lk, bq, bk, q.dtype), **extra)
    return out[:, :, :lq]


_masks: dict[tuple[Any, ...], tuple[Any, mx.array]] = {}  # the last forward's padded masks


def _bucket_mask(mask: Any, lq: int, lk: int, bq: int, bk: int, dtype: mx.Dtype) -> mx.array:
    key = (id(mask) if isinstance(mask, mx.array) else mask, lq, lk, bq, bk, dtype)
    if (hit := _masks.get(key)) is not None and hit[0] is mask:
        return hit[1]
    neg = mx.array(-float("inf"), dtype)
    if isinstance(mask, mx.array):  # one row's own mask (`fuses`): bool, or added to scores
        m = mask.reshape(lq, lk)
        added = mx.where(m, mx.array(0, dtype), neg) if m.dtype == mx.bool_ else m.astype(dtype)
    elif mask is not None:  # causal: the queries are the last lq positions of the keys
        added = mx.where(mx.arange(lk - lq, lk)[:, None] >= mx.arange(lk)[None], 0, neg)
    else:
        added = mx.zeros((lq, lk), dtype)
    added = mx.pad(added.astype(dtype), [(0, 0), (0, bk - lk)], constant_values=neg)
    tail = mx.where(mx.arange(bk) < lk, mx.array(0, dtype), neg)  # padded queries: real keys
    added = mx.concatenate([added, mx.broadcast_to(tail, (bq - lq, bk))], axis=0)[None, None]
    _masks.clear()
    _masks[key] = (mask, added)
    return added


def _unfused(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """The ops MLX's fallback runs (mlx/fast.cpp): scaled queries, scores, the mask, the sinks
    (a logit per query head that takes weight and gives no value), a precise softmax, the
    values; query heads grouped over their key head. In batch-invariant mode the two products
    are runner/fixed_rows.py's (a key head's query heads one block of rows)."""
    b, heads, lq, d = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    rep = heads // kv_heads
    q = q * mx.array(scale, q.dtype)
    if _exact:
        scores = fixed_rows.scores(q.reshape(b, kv_heads, rep * lq, d), k)
        scores = scores.reshape(b, kv_heads, rep, lq, lk) if rep > 1 else scores
    if rep > 1:
        q = q.reshape(b, kv_heads, rep, lq, d)
        k, v = k[:, :, None], v[:, :, None]
    if not _exact:
        scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):  # causal: the queries are the last lq positions of the keys
        mask = mx.arange(lk - lq, lk)[:, None] >= mx.arange(lk)[None]
    if mask is not None:
        if rep > 1 and mask.ndim >= 3:  # a mask per query head: grouped as the queries are
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
        column = sinks.astype(scores.dtype).reshape(
            (1, kv_heads, rep, 1, 1) if rep > 1 else (1, heads, 1, 1)
        )
        column = mx.broadcast_to(column, (*scores.shape[:-1], 1))
        weights = mx.softmax(mx.concatenate([column, scores], axis=-1), axis=-1, precise=True)
        weights = weights[..., 1:]
    else:
        weights = mx.softmax(scores, axis=-1, precise=True)
    out = fixed_rows.weighted(weights, v) if _exact else weights @ v
    return out.reshape(b, heads, lq, -1) if rep > 1 else out


def _host(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **extra: Any
) -> mx.array:
    """The CPU backend's prefill attention in numpy, float32: MLX's CPU `exp` is scalar (380 ms
    for a 700 x 5.5k-key call of SmolLM2's 9 heads, against numpy's 19 ms), and it was most of
    a long conversation's turn (docs/benchmarks.md, "Long conversations"). Masks as MLX reads
    them; a row whose additive mask is -inf everywhere comes out zero, not NaN."""
    b, heads, lq, d = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    rep = heads // kv_heads
    f32 = mx.float32
    qn = np.asarray(q.astype(f32)).reshape(b, kv_heads, rep * lq, d) * np.float32(scale)
    kn, vn = np.asarray(k.astype(f32)), np.asarray(v.astype(f32))
    s = (qn @ kn.swapaxes(-1, -2)).reshape(b, kv_heads, rep, lq, lk)
    if isinstance(mask, str):  # causal: the queries are the last lq positions of the keys
        m: np.ndarray | None = np.arange(lk - lq, lk)[:, None] >= np.arange(lk)[None]
    else:
        m = None if mask is None else np.asarray(mask)
    if m is not None:
        if m.ndim == 4:  # [B or 1, heads or 1, lq, lk]
            m = m.reshape(m.shape[0], kv_heads, rep, lq, lk) if m.shape[1] > 1 else m[:, :, None]
        if m.dtype == np.bool_:  # as MLX: the lowest float, so a row masked whole is uniform
            np.copyto(s, np.finfo(np.float32).min, where=~m)
        else:
            s += m.astype(np.float32)
    top = s.max(axis=-1, keepdims=True)
    top[~np.isfinite(top)] = 0  # -inf everywhere: all weights zero
    s -= top
    np.exp(s, out=s)
    s /= np.maximum(s.sum(axis=-1, keepdims=True), np.finfo(np.float32).tiny)
    out = s.reshape(b, kv_heads, rep * lq, lk) @ vn
    return mx.array(out.reshape(b, heads, lq, d)).astype(q.dtype)


def _sdpa(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **extra: Any
) -> mx.array:
    """The caller's other arguments (sinks, stream) pass through as they came."""
    if "sinks" in extra and extra["sinks"] is None:  # mlx-lm passes sinks=None on every call
        del extra["sinks"]
    lq, lk = q.shape[2], k.shape[2]
    if _exact:  # every call, a decode step's too (mx.fast's own attention sums by shape)
        extra.pop("stream", None)
        return _blocked(_unfused, q, k, v, scale=scale, mask=mask, **extra)
    if lq == 1:
        return _inner(q, k, v, scale=scale, mask=mask, **extra)
    if _heads is not None:
        _heads.add((q.shape[1], k.shape[1], q.shape[3], v.shape[3], q.dtype))
    if fuses(q, k, v, mask, extra):
        return _padded(q, k, v, scale=scale, mask=mask, **extra)
    # Under cuDNN, the calls MLX would give it at a new shape each (short ones, batches, with
    # sinks) take the fallback's ops here instead; on the CPU backend, numpy's (see `_host`).
    call = _inner
    if _fused and "stream" not in extra:
        call = _unfused
    elif not extra and _host_side and not _traced and q.size // q.shape[-1] * lk >= HOST_ELEMENTS:
        call = _host
    return _blocked(call, q, k, v, scale=scale, mask=mask, **extra)


def _blocked(
    call: Callable[..., mx.array],
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    **extra: Any,
) -> mx.array:
    """`call` on blocks of queries whose scores fit (`blocks`), one after the other."""
    lq, lk = q.shape[2], k.shape[2]
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
    global _inner, _fused, _host_side
    if _inner is not None:
        return
    _inner = mx.fast.scaled_dot_product_attention
    _fused = cudnn_on()
    _host_side = mx.default_device() == mx.cpu and not _exact
    if mx.default_device() == mx.cpu:
        # `_host`'s matmuls on the engine's thread alone: a pool of numpy's own beside MLX's
        # BLAS pool halved the speed of every prefill (blas.numpy_blas_threads)
        numpy_blas_threads(1)
    mx.fast.scaled_dot_product_attention = _sdpa


@contextmanager
def differentiable() -> Iterator[None]:
    """Every call in the block on MLX's ops, which a gradient can trace (a training forward,
    training/trainer.py); on the engine's thread, as every forward."""
    global _traced
    _traced += 1
    try:
        yield
    finally:
        _traced -= 1


def exact() -> None:
    """Batch-invariant mode, from now on (before or after `install`): every call through
    `_unfused` with runner/fixed_rows.py's products, no numpy prefill attention, no
    mx.fast attention."""
    global _exact, _host_side
    _exact, _host_side = True, False
