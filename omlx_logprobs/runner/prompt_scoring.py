"""Prompt logprobs: entries for prompt positions, extracted block by block with the step and
brought to the host when the step is collected (no sync of their own).

Used by the model runner only; the extraction itself is the runner's `Extractor`, as for
generated tokens (on the device, or in numpy on the CPU backend).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from omlx_logprobs.batch.block_index import MIN_TOKENS
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.logprobs.extractor import PROMPT_BLOCK, Block, Extractor, PendingEntries
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.logprobs.tail import narrowed
from omlx_logprobs.types import Entries, SamplingParams

# What a scored prompt asks of each position: its top count, its fixed ids and whether it asks
# for the tail mass (`score_key`).
Ask = tuple[int, tuple[int, ...], bool]


@dataclass(frozen=True)
class PromptSlice:
    """Which prompt positions a run of extracted rows belongs to."""

    seq: Sequence
    first: int  # prompt position of the first row (>= 1: position 0 has no entry)
    token_ids: np.ndarray  # [R] the prompt tokens those rows score


@dataclass(frozen=True)
class PendingPrompts:
    """The entries of one or more slices, rows concatenated in slice order, still lazy; entries
    served from kept prefixes (`served`: on the host already, each a prompt's first positions,
    so recorded before the slices); arrays to evaluate with the step (`keep`: the copies of
    keys and values a kept prefix holds)."""

    slices: list[PromptSlice]
    pending: PendingEntries | None
    served: tuple[tuple[PromptSlice, Entries], ...] = ()
    keep: tuple[mx.array, ...] = ()

    def arrays(self) -> list[mx.array]:
        return [*(self.pending.arrays() if self.pending is not None else ()), *self.keep]

    def to_host(self) -> list[tuple[PromptSlice, Entries]]:
        """Each slice with its rows' entries (surplus padding rows dropped)."""
        out = list(self.served)
        if self.pending is None:
            return out
        host, a = self.pending.to_host(), 0
        for s in self.slices:
            b = a + len(s.token_ids)
            out.append((s, host.rows(a, b)))
            a = b
        return out


def score_key(params: SamplingParams) -> Ask:
    """Prompts whose entries can be extracted together: same top count, same fixed ids, both
    with the tail mass or both without."""
    return params.num_prompt_top, tuple(params.logprob_token_ids or ()), params.tail_logprob


@dataclass(frozen=True)
class KeptEntries:
    """A kept prefix's prompt entries: positions 1..count() of its tokens, as a scored prompt
    asked for them (`ask`), in that prompt's own store. Prompt entries are the model's own
    distribution whatever else the request asked, so only the ask decides what they serve."""

    ask: Ask
    store: LogprobStore  # filled by the output processor as the prompt's steps are collected

    def count(self) -> int:
        """Positions whose entries are whole. The store's columns grow in order, the top lists
        last (one `frombytes` each, atomic under the GIL), then the tail: a store being filled on
        the GPU's processing thread is read up to what is complete."""
        s = self.store
        if s.tail is not None:
            return len(s.tail)
        return len(s.top_logprobs) // s.k if s.k else len(s.ranks)

    def serves(self, ask: Ask) -> bool:
        return _answers(self.ask, ask)

    def served(self, seq: Sequence, n: int) -> tuple[PromptSlice, Entries]:
        """Prompt positions 1..n of `seq` (which starts with these tokens), from here, with as
        many alternatives as it asks (its tail, if asked, counting those left out)."""
        entries = narrowed(self.store.block(0, n), seq.params.num_prompt_top)
        if not seq.params.tail_logprob:
            entries = replace(entries, tail=None)
        return PromptSlice(seq, 1, np.array(seq.prompt_ids[1 : n + 1], np.int32)), entries


def block_sizes(n: int, max_block: int = PROMPT_BLOCK) -> list[int]:
    """Block lengths covering n rows padded to a multiple of PROMPT_BLOCK: the largest power-of-two
    multiple of PROMPT_BLOCK (at most `max_block`) that fits what is left, so at most
    log2(max_block / PROMPT_BLOCK) + 1 shapes ever occur."""
    left, sizes = n + (-n % PROMPT_BLOCK), []
    while left:
        b = max_block
        while b > left:
            b //= 2
        sizes.append(b)
        left -= b
    return sizes


def score(
    slices: list[PromptSlice],
    logits_of: Callable[[int, int], mx.array],
    extractor: Extractor,
    served: tuple[tuple[PromptSlice, Entries], ...] = (),
    keep: tuple[mx.array, ...] = (),
) -> PendingPrompts | None:
    """Entries for the slices' rows; `logits_of(a, b)` gives rows [a, b) of their logits, rows
    in slice order (past the last row it may return fewer rows, or filler). All slices share
    one `score_key`. Prompt entries are the model's own distribution: no processors, no
    temperature. `served` and `keep`: see PendingPrompts."""
    slices = [s for s in slices if len(s.token_ids)]
    if not slices:
        return PendingPrompts([], None, served, keep) if served or keep else None
    p = slices[0].seq.params
    k = p.num_prompt_top
    wanted = mx.array(list(p.logprob_token_ids), mx.int32) if p.logprob_token_ids else None
    ids = np.concatenate([s.token_ids for s in slices])
    n = len(ids)
    # On the device every block has one of a few fixed lengths (the last is padded, its surplus
    # rows dropped on the host): prompt lengths then never make new kernel shapes (compiled per
    # shape on a GPU). In numpy padding would only be work: the last block stays short.
    chosen = mx.array(np.pad(ids, (0, -n % PROMPT_BLOCK)))
    # Blocks bound the temporaries: with the CUDA kernel a block adds only a float32 copy of its
    # rows (none for float32 logits), the MLX ops add a block's log-softmax; on the host each
    # block's logits wait for the collect. (CUDA holds a step's buffers until it completes:
    # the spec's "Memory bound".)
    blocks, a = [], 0
    for size in block_sizes(n, extractor.max_block):
        rows = logits_of(a, a + size)  # may stop short at the end
        if rows.shape[0] < size and extractor.pads_blocks:
            rows = mx.pad(rows, [(0, size - rows.shape[0]), (0, 0)])
        r = rows.shape[0]
        fixed = None if wanted is None else mx.broadcast_to(wanted, (r, k))
        blocks.append(Block(rows, chosen[a : a + r], k, fixed, p.tail_logprob))
        a += size
    return PendingPrompts(slices, extractor.prompt(blocks), served, keep)


def chunk_slice(seq: Sequence, start: int, rows: int) -> PromptSlice:
    """The prompt tokens predicted by `rows` logits rows from position `start`: row j predicts
    token start+j+1; a prompt's last row predicts output and has no entry."""
    stop = min(start + rows, seq.prompt_len - 1)
    return PromptSlice(seq, start + 1, np.array(seq.prompt_ids[start + 1 : stop + 1], np.int32))


def _answers(kept: Ask, ask: Ask) -> bool:
    """Whether entries extracted for `kept` answer `ask`: a natural top list at least as long
    (its first k are the top k), or fixed ids that begin with the ones asked, in that order;
    with the tail mass when it is asked (a longer list's tail widens: logprobs/tail.py)."""
    (k, fixed, tail), (kept_k, kept_fixed, kept_tail) = ask, kept
    if tail and not kept_tail:
        return False
    if fixed:
        return kept_fixed[: len(fixed)] == fixed
    return not kept_fixed and kept_k >= k


def waits_for(
    seq: Sequence,
    busy: list[Sequence],
    cached: Callable[[], int],
    key_of: Callable[[Sequence], Hashable],
) -> bool:
    """Whether a scored prompt should wait for a scored prompt being prefilled now (`busy`)
    that shares at least half of what it would compute: that one is kept with its entries
    once its last step is processed (when it generates at most one token), and this one then
    computes only what follows (lm-eval's multiple choice: one context, several continuations,
    sent together). `cached()`: what the prefix cache holds of it already."""
    ask, key = score_key(seq.params), key_of(seq)
    others = [
        b for b in busy
        if b is not seq and b.scored and b.params.max_tokens <= 1 and key_of(b) == key
        and _answers(score_key(b.params), ask)
    ]  # fmt: skip
    if not seq.scored or not others:
        return False
    held = cached()
    # It would take from b the start they share but its last token (PrefixCache.scored): worth
    # a step when that is `need` tokens more than is held. One list comparison each, in C (the
    # scheduler asks this of every waiting prompt it reaches, every step).
    need = held + max(MIN_TOKENS, (seq.prompt_len - held) // 2)
    if need > seq.prompt_len - 1:
        return False
    start = seq.context_ids[: need + 1]
    return any(b.context_ids[: need + 1] == start for b in others)
