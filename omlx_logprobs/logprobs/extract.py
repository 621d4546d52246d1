"""The one place logprobs are computed: a float32 log-softmax over the vocabulary, then, for the
whole batch at once and still on the device, the chosen token's logprob and rank and the top K
(or the logprobs of fixed ids). Generated tokens and prompt tokens go through the same function."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


def log_softmax(logits: mx.array, lse: mx.array | None = None) -> mx.array:
    """Float32 log-softmax over the last axis, whatever the model's dtype. `lse`: the rows'
    log-sum-exp [R, 1] when the caller already has it (one pass over the vocabulary fewer)."""
    x = logits.astype(mx.float32)
    return x - (mx.logsumexp(x, axis=-1, keepdims=True) if lse is None else lse)


@dataclass(frozen=True)
class BatchLogprobs:
    """Host copies of one step's small arrays: row i belongs to the step's i-th sequence."""

    logprobs: np.ndarray  # [B] float32, the chosen (sampled or prompt) token's logprob
    ranks: np.ndarray  # [B] int32, count(logprobs >= sampled), 1 for the argmax
    top_ids: np.ndarray  # [B, K] int32, best first, distinct ids (or the fixed ids, in order)
    top_logprobs: np.ndarray  # [B, K] float32


@dataclass(frozen=True)
class Extraction:
    """extract()'s lazy arrays; `to_host` copies them out. With `rows` set, the natural top k is
    picked on the host from those [R, V] logprobs instead (see `extract`'s `host_top`)."""

    logprobs: mx.array  # [R]
    ranks: mx.array  # [R]
    top_ids: mx.array | None  # [R, K]
    top_logprobs: mx.array | None  # [R, K]
    rows: mx.array | None = None
    k: int = 0

    def arrays(self) -> list[mx.array]:
        """What to evaluate."""
        out = [self.logprobs, self.ranks, self.top_ids, self.top_logprobs, self.rows]
        return [x for x in out if x is not None]

    def to_host(self) -> BatchLogprobs:
        lp = np.array(self.logprobs, copy=False).astype(np.float32, copy=False)
        ranks = np.array(self.ranks, copy=False).astype(np.int32, copy=False)
        if self.rows is not None:
            ids, vals = _host_top(np.array(self.rows, copy=False), self.k)
        else:
            assert self.top_ids is not None and self.top_logprobs is not None
            ids, vals = np.array(self.top_ids, copy=False), np.array(self.top_logprobs, copy=False)
        # The stores take raw 4-byte items: pin the dtypes (no copy when they already match).
        return BatchLogprobs(
            lp, ranks, ids.astype(np.int32, copy=False), vals.astype(np.float32, copy=False)
        )


def _host_top(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The same selection as on the device: a partition for the top k, then a sort of those k."""
    idx = np.argpartition(rows, rows.shape[1] - k, axis=-1)[:, -k:]
    vals = np.take_along_axis(rows, idx, axis=-1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(idx, order, axis=-1), np.take_along_axis(vals, order, axis=-1)


def extract(
    logprobs: mx.array,
    chosen: mx.array,
    k: int,
    fixed: mx.array | None = None,
    natural: bool = True,
    host_top: bool = False,
) -> Extraction:
    """Lazy on-device extraction; the caller evaluates it together with the sampled tokens.

    logprobs [R, V]; chosen [R]: the ids whose own logprob and rank each row reports (the sampled
    token, or the next prompt token). Each row then has k more entries: its natural top k, or,
    where `fixed` [R, k] holds ids >= 0, the logprobs of exactly those ids. `natural` is False
    when no row wants a natural top list, which skips the partial selection. `host_top`: pick a
    natural top k (k > 1, no fixed ids) on the host, from the evaluated rows; on MLX's CPU
    backend numpy's partition is about 5x faster than MLX's, and the rows are already in host
    memory, so nothing is copied.
    """
    own = mx.take_along_axis(logprobs, chosen[:, None], axis=-1)
    ranks = mx.sum(logprobs >= own, axis=-1).astype(mx.int32)
    r = logprobs.shape[0]
    if k == 0:
        return Extraction(own[:, 0], ranks, mx.zeros((r, 0), mx.int32), mx.zeros((r, 0)))
    if fixed is not None and not natural:
        idx = fixed.astype(mx.int32)
        return Extraction(own[:, 0], ranks, idx, mx.take_along_axis(logprobs, idx, axis=-1))
    if host_top and k > 1 and fixed is None:
        return Extraction(own[:, 0], ranks, None, None, logprobs, k)
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
    return Extraction(own[:, 0], ranks, idx, vals)
