"""The runner's batch between steps: one record that the step's launch, the prefill
(runner/prefill.py), the speculator (runner/speculation.py) and a split model's runners
(distributed/group_runner.py) are each handed, and which only they change.

Its rows are the running sequences in admission order (the scheduler's `running` order), each a
row of one batched KV cache; prompts between their chunks and prompts done wait beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.prefix import State

__all__ = ["BatchState", "Prefilled"]


@dataclass(frozen=True)
class Prefilled:
    """Where a prefilled sequence's keys and values wait for admission: a row of a batch cache."""

    cache: BatchCache
    row: int


@dataclass
class BatchState:
    rows: list[Sequence] = field(default_factory=list)  # the batch cache's rows
    cache: BatchCache | None = None
    last_tokens: mx.array | None = None  # the last launched step's sampled ids
    last_seqs: list[Sequence] = field(default_factory=list)  # their rows' sequences, in order
    # Long prompts between their chunks: each one's one-row cache (runner/prefill.py).
    chunk_caches: dict[int, list[Any]] = field(default_factory=dict)
    # A recurrent model's long prompts: their states at chunk boundaries (tokens, states), kept
    # with the sequence when it finishes (PrefixCache.keep_boundaries).
    boundaries: dict[int, list[tuple[int, State]]] = field(default_factory=dict)
    prefilled: dict[int, Prefilled] = field(default_factory=dict)  # prompts done, not yet in it
    # Prompts whose prefill failed in the last launch (an allocation, say), with why: the
    # engine ends them alone; the step goes on without them.
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    _last_rows: dict[int, int] | None = None  # seq_id -> its row in last_tokens, made when asked

    @property
    def last_rows(self) -> dict[int, int]:
        """seq_id -> its row in last_tokens."""
        if self._last_rows is None:
            self._last_rows = {s.seq_id: i for i, s in enumerate(self.last_seqs)}
        return self._last_rows

    def sampled(self, tokens: mx.array | None, seqs: list[Sequence]) -> None:
        """A step's sampled ids on the device, one per sequence in order: the next step's inputs
        (None: the batch is empty, and MLX holds only the weights)."""
        self.last_tokens, self.last_seqs, self._last_rows = tokens, list(seqs), None

    def take_failed(self) -> list[tuple[Sequence, str]]:
        """The prompts whose prefill failed since the last call, with why."""
        failed, self.failed = self.failed, []
        return failed

    def clear(self) -> None:
        """Drop every row and waiting prompt at once: the batch after a fault that left it in
        no state to release row by row (the engine has failed all its sequences)."""
        self.rows, self.cache, self.chunk_caches, self.boundaries = [], None, {}, {}
        self.prefilled, self.failed = {}, []
        self.sampled(None, [])

    @property
    def num_cached(self) -> int:
        """Sequences holding KV memory: batch rows, prompts between chunks, prompts done."""
        return len(self.rows) + len(self.chunk_caches) + len(self.prefilled)
