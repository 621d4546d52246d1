"""The tail mass of a position: the natural log of the probability of every token outside its
returned alternatives (its top k, or its `logprob_token_ids`), asked with `tail_logprob`.

It is a log-sum-exp over the vocabulary's other entries of the float32 log-softmax, never
`log(1 - sum(exp(top)))`: when the list holds nearly all the mass that difference cancels to
nothing (or below zero), where the sum over the rest keeps every digit. With it a client bounds
the KL between its model and the served distribution exactly (the tail is one more bucket). A
list that covers every token of nonzero probability has a tail of -inf (written -9999.0).

The sampled token's own entry is not an alternative: the tail counts it when it is outside the
list. In the `_logits` modes the entries are the logits themselves, and the tail is the
log-sum-exp of the other logits, in the same units.

Rows of a step share one K (the batch's widest list); `counts` [R] says how many of a row's K
alternatives are its own (its k; all K for fixed ids, padded with copies of its first id).
On a device the tail is computed with the step (extract.py's `device_tail`); here in numpy on
MLX's CPU backend, and where a kept prefix's entries serve a shorter list. No mlx here: the
entry store imports this.
"""

from __future__ import annotations

import numpy as np

from omlx_logprobs.types import Entries


def host_tail(x: np.ndarray, lse: np.ndarray, idx: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[R] float32: each row's tail mass from its logits `x` [R, V] and their log-sum-exp `lse`
    [R, 1], outside its first `counts` ids of `idx` [R, K] (the log-sum-exp of `x - lse`
    outside the list is the one of `x` there, less `lse`)."""
    t = x.astype(np.float32, copy=True)
    rows = np.arange(len(x))[:, None]
    listed = np.arange(idx.shape[1])[None, :] < counts[:, None]
    t[np.broadcast_to(rows, idx.shape)[listed], idx[listed]] = -np.inf
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = t.max(axis=-1, keepdims=True)
        safe = np.where(np.isfinite(m), m, np.float32(0))
        np.subtract(t, safe, out=t)
        np.exp(t, out=t)
        out = safe + np.log(t.sum(axis=-1, keepdims=True)) - lse
    return out[:, 0].astype(np.float32)


def widen(tail: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """[n] float32: the tail once the alternatives `extra` [n, j] (logprobs) leave the list, a
    log-sum-exp of positive terms (no cancellation): a kept prefix's entries, extracted with a
    longer list than a later prompt asks, answer it."""
    if extra.shape[1] == 0:
        return np.asarray(tail, np.float32)
    both = np.concatenate([np.asarray(tail, np.float64)[:, None], extra.astype(np.float64)], 1)
    m = both.max(axis=1, keepdims=True)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        out = safe + np.log(np.exp(both - safe).sum(axis=1, keepdims=True))
    return out[:, 0].astype(np.float32)


def narrowed(e: Entries, k: int) -> Entries:
    """These entries with their first `k` alternatives, the tail (when there is one) counting
    the alternatives left out (no more than it has)."""
    if e.k <= k:
        return e
    tail = None if e.tail is None else widen(e.tail, np.asarray(e.top_logprobs)[:, k:])
    return Entries(e.token_ids, e.logprobs, e.ranks, e.top_ids[:, :k], e.top_logprobs[:, :k], tail)
