"""The one place logprobs are computed: a float32 log-softmax over the vocabulary, then, for the
whole batch at once and still on the device, the chosen token's logprob and rank and the top K
(or the logprobs of fixed ids). Generated tokens and prompt tokens go through the same function."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


def log_softmax(logits: mx.array) -> mx.array:
    """Float32 log-softmax over the last axis, whatever the model's dtype."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@dataclass(frozen=True)
class BatchLogprobs:
    """Host copies of one step's small arrays: row i belongs to the step's i-th sequence."""

    logprobs: np.ndarray  # [B] float32, the chosen (sampled or prompt) token's logprob
    ranks: np.ndarray  # [B] int32, count(logprobs >= sampled), 1 for the argmax
    top_ids: np.ndarray  # [B, K] int32, best first, distinct ids (or the fixed ids, in order)
    top_logprobs: np.ndarray  # [B, K] float32


def extract(
    logprobs: mx.array,
    chosen: mx.array,
    k: int,
    fixed: mx.array | None = None,
    natural: bool = True,
) -> tuple[mx.array, ...]:
    """Lazy on-device extraction; the caller evaluates it together with the sampled tokens.

    logprobs [R, V]; chosen [R]: the ids whose own logprob and rank each row reports (the sampled
    token, or the next prompt token). Each row then has k more entries: its natural top k, or,
    where `fixed` [R, k] holds ids >= 0, the logprobs of exactly those ids. `natural` is False
    when no row wants a natural top list, which skips the partial selection.
    """
    own = mx.take_along_axis(logprobs, chosen[:, None], axis=-1)
    ranks = mx.sum(logprobs >= own, axis=-1).astype(mx.int32)
    r = logprobs.shape[0]
    if k == 0:
        return own[:, 0], ranks, mx.zeros((r, 0), mx.int32), mx.zeros((r, 0), mx.float32)
    if fixed is not None and not natural:
        idx = fixed.astype(mx.int32)
        return own[:, 0], ranks, idx, mx.take_along_axis(logprobs, idx, axis=-1)
    if k == 1:  # scoring's usual ask (lm-eval sends logprobs=1): one pass, no selection
        idx = mx.argmax(logprobs, axis=-1, keepdims=True).astype(mx.int32)
        vals = mx.take_along_axis(logprobs, idx, axis=-1)
    else:  # a partial selection of K, then a sort of only those K: never a full-vocabulary sort
        idx = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(logprobs, idx, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        idx = mx.take_along_axis(idx, order, axis=-1).astype(mx.int32)
        vals = mx.take_along_axis(vals, order, axis=-1)
    if fixed is not None:
        idx = mx.where(fixed >= 0, fixed.astype(mx.int32), idx)
        vals = mx.take_along_axis(logprobs, idx, axis=-1)
    return own[:, 0], ranks, idx, vals


def to_host(parts: tuple[mx.array, ...]) -> BatchLogprobs:
    lp, ranks, ids, vals = (np.array(p, copy=False) for p in parts)
    # The stores take raw 4-byte items: pin the dtypes (no copy when they already match).
    return BatchLogprobs(
        lp.astype(np.float32, copy=False),
        ranks.astype(np.int32, copy=False),
        ids.astype(np.int32, copy=False),
        vals.astype(np.float32, copy=False),
    )
