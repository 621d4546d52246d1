"""The one place logprobs are computed: a float32 log-softmax over the vocabulary, then, for the
whole batch at once, the chosen token's logprob and rank and the top K (or the logprobs of fixed
ids), and where asked each position's tail mass (logprobs/tail.py). On a GPU this stays on the
device and comes back packed (`device_step`: the CUDA kernel, or `extract`'s MLX ops); on MLX's
CPU backend it runs in numpy when the step is collected (`HostExtraction`). Generated and prompt
tokens take the same two paths."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from omlx_logprobs.logprobs import kernel
from omlx_logprobs.logprobs.tail import host_tail
from omlx_logprobs.types import Entries, SamplingParams


def log_softmax(logits: mx.array, lse: mx.array | None = None) -> mx.array:
    """Float32 log-softmax over the last axis, whatever the model's dtype. `lse`: the rows'
    log-sum-exp [R, 1] when the caller already has it (one pass over the vocabulary fewer)."""
    x = logits.astype(mx.float32)
    return x - (mx.logsumexp(x, axis=-1, keepdims=True) if lse is None else lse)


@dataclass(frozen=True)
class PackedStep:
    """A decode step's small outputs as one int32 [R, 4 + 2K] array (token, finite, the
    chosen token's logprob bits, rank, K ids, K logprob bits; then the tail's bits when asked),
    so the host reads one buffer a step: MLX's CUDA backend moves every array the host reads
    into unified memory, with an allocation and a synchronous copy each."""

    array: mx.array
    k: int | None  # None: no row of the step asked for logprobs
    tail: bool = False  # a last column: each row's tail mass (logprobs/tail.py)

    def arrays(self) -> list[mx.array]:
        return [self.array]

    def to_host(self) -> tuple[np.ndarray, np.ndarray, Entries | None]:
        """(token ids [B], finite [B] bool, the entries or None)."""
        a = np.array(self.array, copy=False)
        tokens, finite = a[:, 0].copy(), a[:, 1] != 0
        if self.k is None:
            return tokens, finite, None
        k = self.k
        return (
            tokens,
            finite,
            Entries(
                tokens,
                a[:, 2].view(np.float32).copy(),
                a[:, 3].copy(),
                np.ascontiguousarray(a[:, 4 : 4 + k]),
                np.ascontiguousarray(a[:, 4 + k : 4 + 2 * k]).view(np.float32),
                a[:, 4 + 2 * k].view(np.float32).copy() if self.tail else None,
            ),
        )


@dataclass(frozen=True)
class EntryAsk:
    """What a step's rows ask for: the distribution's logits `src` [R, V] float32 (raw, or per
    row the processed ones), K, and the fixed ids [R, K] (-1: the row's natural top list).
    `plain` [R] bool: rows whose entries are the logits themselves (vLLM's `*_logits` modes),
    their log-sum-exp taken as 0. `tail` [R] int32, when a row asks for its tail mass: how
    many of each row's K alternatives are its own (logprobs/tail.py)."""

    src: mx.array
    k: int
    fixed: mx.array | None = None
    natural: bool = True  # some row wants its natural top list
    raw: bool = True  # src is the raw logits (their log-sum-exp serves it)
    plain: mx.array | None = None
    tail: mx.array | None = None

    def lse(self, raw_lse: mx.array) -> mx.array:
        """[R, 1]: what each row's entries subtract from its logits."""
        lse = raw_lse if self.raw else mx.logsumexp(self.src, axis=-1, keepdims=True)
        return lse if self.plain is None else mx.where(self.plain[:, None], 0.0, lse)


def entries_asked(
    logits: mx.array, dist: mx.array, params: Sequence[SamplingParams]
) -> EntryAsk | None:
    """What a decode step's entries are taken from, when any row asks: the raw distribution
    (`logits`, the model's own), or per row what was sampled from (`dist`); normalised or not."""
    if not any(p.logprobs for p in params):
        return None
    k = max(p.num_top for p in params if p.logprobs)
    fixed, natural = _fixed_ids(params, k)
    plain = None
    if any(p.logprobs and p.logprobs_mode.logits for p in params):
        plain = mx.array([p.logprobs_mode.logits for p in params])
    tail = None
    if any(p.logprobs and p.tail_logprob for p in params):
        tail = mx.array([_own_count(p, k) for p in params], mx.int32)
    if not any(p.logprobs and p.processed for p in params):
        return EntryAsk(logits, k, fixed, natural, plain=plain, tail=tail)
    src = mx.where(mx.array([p.processed for p in params])[:, None], dist, logits)
    return EntryAsk(src, k, fixed, natural, raw=False, plain=plain, tail=tail)


def _own_count(p: SamplingParams, k: int) -> int:
    """How many of a row's k alternatives its tail leaves out: a fixed-id row's all k (its ids,
    then copies of its first), a natural row its top_logprobs."""
    if not p.logprobs:
        return 0
    return k if p.logprob_token_ids else p.top_logprobs


def _fixed_ids(params: Sequence[SamplingParams], k: int) -> tuple[mx.array | None, bool]:
    """[B, k] ids for rows with `logprob_token_ids` (padded with their first id, sliced off on
    the host), and whether any row still needs its natural top list (marked -1)."""
    if not any(p.logprob_token_ids for p in params):
        return None, True
    natural = any(p.logprobs and p.top_logprobs and not p.logprob_token_ids for p in params)
    rows = []
    for p in params:
        ids = list(p.logprob_token_ids[:k])
        if ids:
            rows.append(ids + [ids[0]] * (k - len(ids)))
        else:  # a row not asking for ids: -1 takes the natural list, 0 is an ignored filler
            rows.append([-1 if natural else 0] * k)
    return mx.array(rows, dtype=mx.int32), natural


def device_step(tokens: mx.array, lse: mx.array, ask: EntryAsk | None, fused: bool) -> PackedStep:
    """A step's packed outputs, lazy, on the device. `lse` [R, 1]: the raw logits' log-sum-exp
    (a row is finite when it is). `fused`: one CUDA kernel (logprobs/kernel.py); else MLX ops."""
    if ask is None:
        if fused:  # token and finiteness only: the kernel never reads its logits input
            return PackedStep(kernel.packed_step(lse, lse, lse, tokens, None), None)
        return pack_step(tokens, mx.isfinite(lse[:, 0]), None)
    src_lse = ask.lse(lse)
    # The kernel keeps at most KCAP natural candidates a thread; longer lists (--max-logprobs
    # above it) take the MLX ops, which compute the same float32 values, as do steps where a
    # row asks for its tail mass (a masked log-sum-exp the kernel does not compute).
    if fused and (ask.k <= kernel.KCAP or not ask.natural) and ask.tail is None:
        fixed = ask.fixed if ask.k else None
        return PackedStep(kernel.packed_step(ask.src, src_lse, lse, tokens, ask.k, fixed), ask.k)
    lp = log_softmax(ask.src, src_lse)
    parts = extract(lp, tokens, ask.k, ask.fixed, ask.natural, ask.tail)
    return pack_step(tokens, mx.isfinite(lse[:, 0]), parts)


def pack_step(tokens: mx.array, finite: mx.array, parts: Entries | None) -> PackedStep:
    """`PackedStep` of a step's lazy arrays (tokens [R], finite [R] and its extraction)."""
    cols = [tokens.astype(mx.int32)[:, None], finite.astype(mx.int32)[:, None]]
    if parts is not None:
        cols += [
            parts.logprobs.astype(mx.float32).view(mx.int32)[:, None],
            parts.ranks.astype(mx.int32)[:, None],
            parts.top_ids.astype(mx.int32),
            parts.top_logprobs.astype(mx.float32).view(mx.int32),
        ]
        if parts.tail is not None:
            cols.append(parts.tail.astype(mx.float32).view(mx.int32)[:, None])
    k = None if parts is None else parts.top_ids.shape[1]
    tail = parts is not None and parts.tail is not None
    return PackedStep(mx.concatenate(cols, axis=1), k, tail)


@dataclass(frozen=True)
class HostExtraction:
    """The same extraction, done in numpy when the step is collected, from the rows' logits
    evaluated with the step. For MLX's CPU backend: the rows already sit in host memory (nothing
    is copied) and numpy's `exp` and partition run about 3x and 5x faster than MLX's there."""

    logits: mx.array  # [R, V]
    chosen: mx.array  # [R]
    k: int
    fixed: mx.array | None  # [R, k]
    natural: bool
    plain: mx.array | None = None  # [R] bool: rows whose entries are the logits themselves
    tail: mx.array | None = None  # [R] int32: EntryAsk.tail

    def arrays(self) -> list[mx.array]:
        extra = [a for a in (self.fixed, self.plain, self.tail) if a is not None]
        return [self.logits, self.chosen, *extra]

    def to_host(self) -> Entries:
        x = np.array(self.logits, copy=False).astype(np.float32, copy=False)
        chosen = np.array(self.chosen, copy=False).astype(np.int64)[:, None]
        fixed = None if self.fixed is None else np.array(self.fixed, copy=False).astype(np.int64)
        k = 0 if fixed is not None and not self.natural else self.k
        groups = _group_maxima(x, max(k, RANK_GROUPS))
        lse = _lse(x, (x if groups is None else groups).max(axis=-1, keepdims=True))
        if self.plain is not None:
            lse = np.where(np.array(self.plain, copy=False)[:, None], np.float32(0), lse)
        # x[id] - lse: bitwise the value a materialized log-softmax row holds there
        own = np.take_along_axis(x, chosen, axis=-1) - lse
        if groups is None:  # a small or unevenly split vocabulary: whole rows
            with np.errstate(invalid="ignore"):
                lp = np.subtract(x, lse, out=_scratch(x.shape))
                ranks = np.asarray(np.sum(lp >= own, axis=-1, dtype=np.int32))
            idx = _best_first(lp, k)
        else:
            idx, ranks = _grouped_entries(x, lse, own, k, groups)
        if fixed is not None:
            idx = fixed if k == 0 else np.where(fixed >= 0, fixed, idx)
        vals = np.take_along_axis(x, idx, axis=-1) - lse
        tokens = chosen[:, 0].astype(np.int32)
        tail = None
        if self.tail is not None:
            tail = host_tail(x, lse, idx, np.array(self.tail, copy=False))
        return Entries(tokens, own[:, 0], ranks, idx.astype(np.int32), vals, tail)


# Buffers per thread and dtype for the host's [R, V] temporaries, kept between steps: with glibc's
# mmap threshold at 1 MiB (heap.py) a fresh one is a new mapping whose pages fault in on first
# touch, which cost about as much as the arithmetic (log-softmax of 8 rows: 1.6 -> 0.85 ms).
class _Scratch(threading.local):
    def __init__(self) -> None:
        self.bufs: dict[type, np.ndarray] = {}


_SCRATCH = _Scratch()


def _scratch(shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    n = int(np.prod(shape))
    buf = _SCRATCH.bufs.get(dtype)
    if buf is None or buf.size < n:
        buf = _SCRATCH.bufs[dtype] = np.empty(n, dtype)
    return buf[:n].reshape(shape)


def release_scratch() -> None:
    """Give the calling thread's buffers back (the engine went idle)."""
    _SCRATCH.bufs.clear()


def finite_rows(x: np.ndarray) -> np.ndarray:
    """[R] bool: the row's log-sum-exp is finite (no NaN, no +inf, not only -inf)."""
    return np.isfinite(x.max(axis=-1))


# Vocabulary groups for the host's top k: only the k groups with the largest maxima can hold a
# row's top k (at most k-1 groups have a maximum above the k-th value), so the partition runs on
# k * TOP_GROUP candidates instead of the whole row. Group j is ids j, j + V/TOP_GROUP, ...: the
# groups' maxima are then an elementwise maximum of TOP_GROUP contiguous rows (0.5 ms for
# [64, 49152] here, against 3.4 for maxima of contiguous groups, a reduction over a short axis).
TOP_GROUP = 64


# A rank counts the row's values >= the chosen one; only groups whose maximum reaches it can
# hold such values. Rows where no more than this many groups reach it (the sampled token is
# near the top) are counted inside those groups; the others over their whole row.
RANK_GROUPS = 4


def _group_maxima(x: np.ndarray, k: int) -> np.ndarray | None:
    """[R, V / TOP_GROUP] maxima of the strided groups, or None when the vocabulary is too small
    or does not split evenly (then every pass runs over whole rows)."""
    rows, v = x.shape
    if v % TOP_GROUP or v // TOP_GROUP <= 4 * k:
        return None
    return x.reshape(rows, TOP_GROUP, v // TOP_GROUP).max(axis=1)


def _lse(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[R, 1] float32 log-sum-exp from the rows' maxima: NaN for a row holding NaN or +inf, or
    only -inf (such a row is refused, see `finite_rows`)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        t = np.subtract(x, m, out=_scratch(x.shape))
        np.exp(t, out=t)
        return m + np.log(t.sum(axis=-1, keepdims=True))


def _grouped_entries(
    x: np.ndarray, lse: np.ndarray, own: np.ndarray, k: int, groups: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Top k ids (best first) and ranks from the elements of each row's largest groups, without
    writing the [R, V] logprobs. The ranks count fl(x - lse) >= own exactly as over a
    materialized row: rounding is monotonic, so a group whose maximum falls short holds nothing
    that counts."""
    rows, stride = groups.shape
    c = max(k, RANK_GROUPS)
    best = np.argpartition(groups, stride - c, axis=-1)[:, -c:]
    cols = (best[:, :, None] + np.arange(TOP_GROUP) * stride).reshape(rows, -1)
    cand = np.take_along_axis(x, cols, axis=-1)
    with np.errstate(invalid="ignore"):
        ranks = np.asarray(np.sum(cand - lse >= own, axis=-1, dtype=np.int32))
        wide = np.sum(groups - lse >= own, axis=-1) > c
        for r in np.flatnonzero(wide):
            ranks[r] = np.count_nonzero(x[r] - lse[r] >= own[r])
    return _best_first(cand, k, cols), ranks


def _best_first(vals: np.ndarray, k: int, ids: np.ndarray | None = None) -> np.ndarray:
    """[R, k] ids of each row's k largest values, best first: a partition, then a sort of those
    k. `ids`: the vocabulary id of each column of `vals` (default: the column itself)."""
    if k == 0:
        return np.zeros((len(vals), 0), np.int64)
    pick = np.argpartition(vals, vals.shape[1] - k, axis=-1)[:, -k:]
    order = np.argsort(-np.take_along_axis(vals, pick, axis=-1), axis=-1, kind="stable")
    pick = np.take_along_axis(pick, order, axis=-1)
    return pick if ids is None else np.take_along_axis(ids, pick, axis=-1)


def _listed(idx: mx.array, counts: mx.array) -> mx.array:
    """[R, K] bool: the columns of `idx` that are a row's own alternatives."""
    return mx.arange(idx.shape[1])[None, :] < counts[:, None]


def device_tail(logprobs: mx.array, idx: mx.array, counts: mx.array) -> mx.array:
    """[R] float32, lazy: the tail mass (logprobs/tail.py), the log-sum-exp of each row of
    `logprobs` [R, V] (float32) outside its first `counts` ids of `idx` [R, K]. A row's listed
    ids are distinct (or, for fixed ids, copies of one): the scatter writes -inf at them and
    their own value at the rest of `idx`."""
    if idx.shape[1] == 0:
        return mx.logsumexp(logprobs, axis=-1)
    vals = mx.take_along_axis(logprobs, idx, axis=-1)
    cut = mx.where(_listed(idx, counts), mx.array(-np.inf, mx.float32), vals)
    return mx.logsumexp(mx.put_along_axis(logprobs, idx, cut, axis=-1), axis=-1)


def extract(
    logprobs: mx.array,
    chosen: mx.array,
    k: int,
    fixed: mx.array | None = None,
    natural: bool = True,
    tail: mx.array | None = None,
) -> Entries:
    """Lazy on-device extraction; the caller evaluates it together with the sampled tokens.

    logprobs [R, V]; chosen [R]: the ids whose own logprob and rank each row reports (the sampled
    token, or the next prompt token). Each row then has k more entries: its natural top k, or,
    where `fixed` [R, k] holds ids >= 0, the logprobs of exactly those ids. `natural` is False
    when no row wants a natural top list, which skips the partial selection. `tail` [R]: how
    many of each row's k alternatives its tail mass leaves out (None: no tail).
    """
    own = mx.take_along_axis(logprobs, chosen[:, None], axis=-1)
    ranks = mx.sum(logprobs >= own, axis=-1).astype(mx.int32)
    idx, vals = _alternatives(logprobs, k, fixed, natural)
    masses = None if tail is None else device_tail(logprobs, idx, tail)
    return Entries(chosen, own[:, 0], ranks, idx, vals, masses)


def _alternatives(
    logprobs: mx.array, k: int, fixed: mx.array | None, natural: bool
) -> tuple[mx.array, mx.array]:
    """[R, k] ids and their logprobs: `extract`'s top k or fixed ids."""
    r = logprobs.shape[0]
    if k == 0:
        return mx.zeros((r, 0), mx.int32), mx.zeros((r, 0))
    if fixed is not None and not natural:
        idx = fixed.astype(mx.int32)
        return idx, mx.take_along_axis(logprobs, idx, axis=-1)
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
    return idx, vals
