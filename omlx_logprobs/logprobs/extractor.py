"""The extraction path, chosen once when the model runner starts: where a step's entries and
its finiteness check are computed, and how they come back to the host.

- `HostExtractor` (MLX's CPU backend): the step evaluates the rows' logits; numpy extracts the
  entries when the step is collected (the rows already sit in host memory, and numpy's `exp`
  and partition run ~3x and ~5x faster than MLX's there).
- `DeviceExtractor` (a GPU): on the device, packed into one int32 array a step, so the host
  reads one buffer; with MLX's ops (the reference) or, on CUDA, one fused kernel.

Both hand back objects with `arrays()` (what to queue with the step) and `to_host()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from omlx_logprobs.logprobs import kernel
from omlx_logprobs.logprobs.extract import (
    EntryAsk,
    HostExtraction,
    PackedStep,
    device_step,
    entries_asked,
    finite_rows,
)
from omlx_logprobs.types import Entries, SamplingParams

# Prompt positions per extraction block: bounds its float32 temporaries whatever the chunk size.
# Rows are padded to a multiple of PROMPT_BLOCK on a device; a block may take up to an
# extractor's `max_block` rows, in power-of-two multiples of it (few distinct kernel shapes).
PROMPT_BLOCK = 128
# On a GPU fewer, larger kernels (the step is host-bound there); on the CPU small blocks keep
# the float32 temporaries in cache.
DEVICE_PROMPT_BLOCK = 512


class PendingStep(Protocol):
    """A sampling step's outputs, queued: (token ids [B], finite [B], entries or None)."""

    def arrays(self) -> list[mx.array]: ...

    def to_host(self) -> tuple[np.ndarray, np.ndarray, Entries | None]: ...


class PendingEntries(Protocol):
    """Prompt blocks' entries, queued; their rows concatenated in block order."""

    def arrays(self) -> list[mx.array]: ...

    def to_host(self) -> Entries: ...


@dataclass(frozen=True)
class Block:
    """One block of prompt rows to extract: logits [R, V], the tokens they predict [R], the
    top count and the fixed ids [R, k] (None: the natural top list), and whether each row's
    tail mass is asked (every row leaves out all k)."""

    rows: mx.array
    chosen: mx.array
    k: int
    fixed: mx.array | None
    tail: bool = False

    def tail_counts(self) -> mx.array | None:
        return mx.full((self.rows.shape[0],), self.k, mx.int32) if self.tail else None


class Extractor(Protocol):
    name: str
    pads_blocks: bool  # prompt blocks padded to whole sizes (device: fixed kernel shapes)
    max_block: int

    def step(
        self, tokens: mx.array, logits: mx.array, dist: mx.array, params: Sequence[SamplingParams]
    ) -> PendingStep:
        """Entries of the sampled tokens, from the raw `logits` (the model's own; their
        finiteness is the row's) or what was sampled from (`dist`)."""
        ...

    def prompt(self, blocks: list[Block]) -> PendingEntries: ...


@dataclass(frozen=True)
class _HostStep:
    tokens: mx.array
    logits: mx.array  # [B, V]: where the host checks finiteness
    entries: HostExtraction | None

    def arrays(self) -> list[mx.array]:
        extra = self.entries.arrays() if self.entries is not None else []
        return [self.tokens, self.logits, *extra]

    def to_host(self) -> tuple[np.ndarray, np.ndarray, Entries | None]:
        tokens = np.array(self.tokens)
        finite = finite_rows(np.array(self.logits, copy=False))
        return tokens, finite, self.entries.to_host() if self.entries is not None else None


@dataclass(frozen=True)
class _HostBlocks:
    blocks: list[HostExtraction]

    def arrays(self) -> list[mx.array]:
        return [x for b in self.blocks for x in b.arrays()]

    def to_host(self) -> Entries:
        return Entries.concat([b.to_host() for b in self.blocks])


class HostExtractor:
    name = "host"
    pads_blocks = False  # in numpy padding would only be work
    max_block = PROMPT_BLOCK

    def step(
        self, tokens: mx.array, logits: mx.array, dist: mx.array, params: Sequence[SamplingParams]
    ) -> PendingStep:
        ask = entries_asked(logits, dist, params)
        host = None
        if ask is not None:
            host = HostExtraction(
                ask.src, tokens, ask.k, ask.fixed, ask.natural, ask.plain, ask.tail
            )
        return _HostStep(tokens, logits, host)

    def prompt(self, blocks: list[Block]) -> PendingEntries:
        return _HostBlocks(
            [
                HostExtraction(
                    b.rows, b.chosen, b.k, b.fixed, b.fixed is None, None, b.tail_counts()
                )
                for b in blocks
            ]
        )


@dataclass(frozen=True)
class _PackedBlocks:
    """Device blocks' packed rows, concatenated: the host reads one array for all of them (on
    CUDA each read is an allocation and a synchronous copy)."""

    packed: PackedStep

    def arrays(self) -> list[mx.array]:
        return [self.packed.array]

    def to_host(self) -> Entries:
        entries = self.packed.to_host()[2]
        assert entries is not None
        return entries


class DeviceExtractor:
    pads_blocks = True

    def __init__(self, fused: bool, max_block: int = DEVICE_PROMPT_BLOCK) -> None:
        self.fused = fused  # one CUDA kernel (logprobs/kernel.py); else MLX's ops
        self.name = "kernel" if fused else "ops"
        self.max_block = max_block

    def step(
        self, tokens: mx.array, logits: mx.array, dist: mx.array, params: Sequence[SamplingParams]
    ) -> PendingStep:
        # One reduction per row, in the same evaluation: a NaN or +inf anywhere in a row (or a
        # row of only -inf) makes its log-sum-exp non-finite and its token meaningless.
        lse = mx.logsumexp(logits, axis=-1, keepdims=True)
        return device_step(tokens, lse, entries_asked(logits, dist, params), self.fused)

    def prompt(self, blocks: list[Block]) -> PendingEntries:
        packed = []
        for b in blocks:
            x = b.rows.astype(mx.float32)
            lse = mx.logsumexp(x, axis=-1, keepdims=True)
            ask = EntryAsk(x, b.k, b.fixed, natural=b.fixed is None, tail=b.tail_counts())
            packed.append(device_step(b.chosen, lse, ask, self.fused).array)
        joined = packed[0] if len(packed) == 1 else mx.concatenate(packed, axis=0)
        return _PackedBlocks(PackedStep(joined, blocks[0].k, blocks[0].tail))


def choose_extractor(on_cpu: bool) -> Extractor:
    """The host path on MLX's CPU backend; on a device the CUDA kernel where it builds."""
    if on_cpu:
        return HostExtractor()
    return DeviceExtractor(fused=kernel.available())
