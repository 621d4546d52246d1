"""Prompt logprobs: entries for prompt positions, extracted block by block with the step and
brought to the host when the step is collected (no sync of their own).

Used by the model runner only; the extraction itself is the runner's `Extractor`, as for
generated tokens (on the device, or in numpy on the CPU backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.logprobs.extractor import PROMPT_BLOCK, Block, Extractor, PendingEntries
from omlx_logprobs.types import Entries, SamplingParams


@dataclass(frozen=True)
class PromptSlice:
    """Which prompt positions a run of extracted rows belongs to."""

    seq: Sequence
    first: int  # prompt position of the first row (>= 1: position 0 has no entry)
    token_ids: np.ndarray  # [R] the prompt tokens those rows score


@dataclass(frozen=True)
class PendingPrompts:
    """The entries of one or more slices, rows concatenated in slice order, still lazy."""

    slices: list[PromptSlice]
    pending: PendingEntries

    def arrays(self) -> list[mx.array]:
        return self.pending.arrays()

    def to_host(self) -> list[tuple[PromptSlice, Entries]]:
        """Each slice with its rows' entries (surplus padding rows dropped)."""
        host = self.pending.to_host()
        out, a = [], 0
        for s in self.slices:
            b = a + len(s.token_ids)
            out.append((s, host.rows(a, b)))
            a = b
        return out


def score_key(params: SamplingParams) -> tuple[int, tuple[int, ...]]:
    """Prompts whose entries can be extracted together: same top count, same fixed ids."""
    return params.num_prompt_top, tuple(params.logprob_token_ids or ())


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
) -> PendingPrompts | None:
    """Entries for the slices' rows; `logits_of(a, b)` gives rows [a, b) of their logits, rows
    in slice order (past the last row it may return fewer rows, or filler). All slices share
    one `score_key`. Prompt entries are the model's own distribution: no processors, no
    temperature."""
    slices = [s for s in slices if len(s.token_ids)]
    if not slices:
        return None
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
        blocks.append(Block(rows, chosen[a : a + r], k, fixed))
        a += size
    return PendingPrompts(slices, extractor.prompt(blocks))


def chunk_slice(seq: Sequence, start: int, rows: int) -> PromptSlice:
    """The prompt tokens predicted by `rows` logits rows from position `start`: row j predicts
    token start+j+1; a prompt's last row predicts output and has no entry."""
    stop = min(start + rows, seq.prompt_len - 1)
    return PromptSlice(seq, start + 1, np.array(seq.prompt_ids[start + 1 : stop + 1], np.int32))
