"""A step's records at the runner's boundary: what `ModelRunner.launch` queued on the device,
what `ModelRunner.collect` read back for the output processor, and the host time spent there;
and what the runner holds (`ModelRunner.memory`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.logprobs.extractor import PendingStep
from omlx_logprobs.runner.pooling import PendingPooled
from omlx_logprobs.runner.prompt_scoring import PendingPrompts, PromptSlice
from omlx_logprobs.types import Entries

__all__ = ["DeviceTime", "LaunchedStep", "Memory", "StepResult"]


@dataclass
class DeviceTime:
    """Host seconds spent at the device boundary since the last `take_time`: queueing graphs
    (on a GPU, `async_eval` launches every kernel from the host) and reading steps back
    (waiting for the device, the copy out; on the CPU also the numpy extraction)."""

    queue_s: float = 0.0
    read_s: float = 0.0
    queued_at: float = 0.0  # perf_counter when the last async_eval returned (step trace)


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device; `collect` turns it into a StepResult."""

    seqs: list[Sequence]  # the sampled rows, in order
    sampled: PendingStep | None  # None: the step sampled nothing (prompts only)
    prompt: list[PendingPrompts] = field(default_factory=list)  # scored prompt positions
    prompt_only: list[Sequence] = field(default_factory=list)  # prefilled with max_tokens 0
    spec: Any = None  # a speculative step's drafts (runner/speculation.py's SpecStep)
    # Routed experts its forwards recorded (runner/routing.py): (sequences, first position,
    # [positions, moe_layers, top_k] int16 on the device), read back by `collect`.
    routes: list[tuple[list[Sequence], int, Any]] = field(default_factory=list)
    # Embedding prompts' last hidden states (runner/pooling.py); those prompts are prompt_only.
    pooled: list[PendingPooled] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """One step's sampled tokens; row i belongs to seqs[i] (after a speculative step a
    sequence has a row per token it emits, in order)."""

    seqs: list[Sequence]
    token_ids: np.ndarray  # [B] int
    finite: np.ndarray  # [B] bool: False where the row's logits held NaN or +inf
    logprobs: Entries | None  # None when no sequence in the step asked for logprobs
    prompt: list[tuple[PromptSlice, Entries]] = field(default_factory=list)
    prompt_only: list[Sequence] = field(default_factory=list)
    # Speculative steps: True where the row is an accepted draft from the request's prediction
    # (counted as accepted once the output takes it: drafts past a stop are in neither count).
    predicted: np.ndarray | None = None
    # Embedding prompts' last hidden states, [H] float32 each, read before their prompt_only end.
    pooled: list[tuple[Sequence, np.ndarray]] = field(default_factory=list)


@dataclass(frozen=True)
class Memory:
    """What the runner holds, in sequences and bytes (/health)."""

    sequences: int  # holding KV memory: batch rows, prompts between chunks, prompts done
    active: int  # MLX's active memory
    cache: int  # MLX's buffer cache (freed buffers kept for reuse)
    prefixes: int  # the prefix cache's entries (counted by its budget)


@dataclass(frozen=True)
class Tallies:
    """What the runner counted since it started (/metrics reads them as counters): prefixes read
    back from the disk tier, and speculation's drafted and accepted tokens."""

    disk_hits: int = 0
    disk_hit_tokens: int = 0
    draft_tokens: int = 0  # drafts verified, every source (prediction, lookup, draft model)
    accepted_tokens: int = 0  # of those, the ones equal to the target's own sample
