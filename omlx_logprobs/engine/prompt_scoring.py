"""Prompt logprobs: entries for prompt positions, extracted block by block with the step and
brought to the host when the step is collected (no sync of their own).

Used by the model runner only; the extraction itself is `logprobs.extract`, as for generated
tokens (on the device, or in numpy on the CPU backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.logprobs.extract import (
    BatchLogprobs,
    EntryAsk,
    HostExtraction,
    PackedStep,
    device_step,
)
from omlx_logprobs.types import SamplingParams

# Prompt positions per extraction block: bounds its float32 temporaries whatever the chunk size.
# Rows are padded to a multiple of PROMPT_BLOCK; a runner may take up to `max_block` rows at once
# in power-of-two multiples of it (fewer kernel launches on a GPU, still few distinct shapes).
PROMPT_BLOCK = 128


@dataclass(frozen=True)
class PromptLogprobs:
    """Host entries for one chunk's prompt tokens: row i is prompt position `first + i`."""

    seq: Sequence
    first: int
    token_ids: np.ndarray  # [R] the prompt tokens being scored
    logprobs: BatchLogprobs


@dataclass(frozen=True)
class PromptSlice:
    """Which prompt positions a run of extracted rows belongs to."""

    seq: Sequence
    first: int  # prompt position of the first row (>= 1: position 0 has no entry)
    token_ids: np.ndarray  # [R] the prompt tokens those rows score


@dataclass(frozen=True)
class ScorePath:
    """How a runner extracts prompt entries: at most `max_block` rows a block (a power-of-two
    multiple of PROMPT_BLOCK); `host`: in numpy at collect time (see HostExtraction), else on
    the device as a decode step's entries are (`device_step`; `fused`: its CUDA kernel)."""

    max_block: int = PROMPT_BLOCK
    host: bool = False
    fused: bool = False


@dataclass(frozen=True)
class PackedBlocks:
    """Device blocks' packed rows (`device_step`'s layout), concatenated: the host reads one
    array for all of them (on CUDA each read is an allocation and a synchronous copy)."""

    packed: PackedStep

    def arrays(self) -> list[mx.array]:
        return [self.packed.array]

    def to_host(self) -> BatchLogprobs:
        entries = self.packed.to_host()[2]
        assert entries is not None
        return entries


@dataclass(frozen=True)
class PendingPrompts:
    """The entries of one or more slices, rows concatenated in slice order over the blocks,
    still lazy."""

    slices: list[PromptSlice]
    blocks: list[HostExtraction | PackedBlocks]

    def arrays(self) -> list[mx.array]:
        return [x for b in self.blocks for x in b.arrays()]

    def to_host(self) -> list[PromptLogprobs]:
        parts = [b.to_host() for b in self.blocks]
        host = parts[0] if len(parts) == 1 else _concatenate(parts)
        out, a = [], 0
        for s in self.slices:
            b = a + len(s.token_ids)
            rows = BatchLogprobs(
                host.logprobs[a:b], host.ranks[a:b], host.top_ids[a:b], host.top_logprobs[a:b]
            )
            out.append(PromptLogprobs(s.seq, s.first, s.token_ids, rows))
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
    path: ScorePath = ScorePath(),
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
    host = path.host
    blocks: list[HostExtraction | PackedBlocks] = []
    packed, a = [], 0
    # Blocks bound the temporaries: with the CUDA kernel a block adds only a float32 copy of its
    # rows (none for float32 logits), the MLX ops add a block's log-softmax; on the host each
    # block's logits wait for the collect. (CUDA holds a step's buffers until it completes:
    # the spec's "Memory bound".)
    for size in block_sizes(n, path.max_block):
        rows = logits_of(a, a + size)  # may stop short at the end
        if rows.shape[0] < size and not host:
            rows = mx.pad(rows, [(0, size - rows.shape[0]), (0, 0)])
        r = rows.shape[0]
        fixed = None if wanted is None else mx.broadcast_to(wanted, (r, k))
        if host:
            blocks.append(HostExtraction(rows, chosen[a : a + r], k, fixed, wanted is None))
        else:
            x = rows.astype(mx.float32)
            lse = mx.logsumexp(x, axis=-1, keepdims=True)
            ask = EntryAsk(x, k, fixed, natural=wanted is None)
            packed.append(device_step(chosen[a : a + r], lse, ask, path.fused).array)
        a += size
    if packed:
        joined = packed[0] if len(packed) == 1 else mx.concatenate(packed, axis=0)
        blocks.append(PackedBlocks(PackedStep(joined, k)))
    return PendingPrompts(slices, blocks)


def _concatenate(parts: list[BatchLogprobs]) -> BatchLogprobs:
    return BatchLogprobs(
        np.concatenate([p.logprobs for p in parts]),
        np.concatenate([p.ranks for p in parts]),
        np.concatenate([p.top_ids for p in parts]),
        np.concatenate([p.top_logprobs for p in parts]),
    )


def chunk_slice(seq: Sequence, start: int, rows: int) -> PromptSlice:
    """The prompt tokens predicted by `rows` logits rows from position `start`: row j predicts
    token start+j+1; a prompt's last row predicts output and has no entry."""
    stop = min(start + rows, seq.prompt_len - 1)
    return PromptSlice(seq, start + 1, np.array(seq.prompt_ids[start + 1 : stop + 1], np.int32))
