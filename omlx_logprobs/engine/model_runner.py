"""All MLX and KV-cache work: prefill chunks, batched decode, sampling and logprob extraction.

The runner keeps one batched KV cache whose rows are the running sequences in admission order
(the scheduler's `running` order), and a private cache per sequence while its prompt prefills.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from omlx_logprobs.engine.sampler import apply_processors, sample, step_key
from omlx_logprobs.engine.scheduler import SchedulerOutput
from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.logprobs.extract import BatchLogprobs, extract, log_softmax, to_host


@dataclass(frozen=True)
class StepResult:
    """One step's sampled tokens; row i belongs to seqs[i]."""

    seqs: list[Sequence]
    token_ids: np.ndarray  # [B] int
    logprobs: BatchLogprobs | None  # None when no sequence in the step asked for logprobs
    finite: np.ndarray | None = None  # [B] bool: False where the row's logits held NaN or +inf


class ModelRunner:
    def __init__(self, model: Any, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.rows: list[Sequence] = []  # the batch cache's rows
        self.batch_cache: list[Any] | None = None
        self.prefill_caches: dict[int, list[Any]] = {}

    def execute(self, work: SchedulerOutput) -> StepResult | None:
        assert [s.seq_id for s in work.decode] == [s.seq_id for s in self.rows]
        parts: list[mx.array] = []
        seqs: list[Sequence] = []
        if self.rows:
            inputs = mx.array([[s.last_token] for s in self.rows])
            parts.append(self.model(inputs, cache=self.batch_cache)[:, -1, :])
            seqs += self.rows
        chunk = work.prefill
        if chunk is not None:
            cache = self.prefill_caches.setdefault(chunk.seq.seq_id, make_prompt_cache(self.model))
            ids = mx.array([chunk.seq.prompt_ids[chunk.start : chunk.end]])
            out = self.model(ids, cache=cache)
            if chunk.is_last:
                parts.append(out[:, -1, :])
                seqs.append(chunk.seq)
            else:
                mx.eval([c.state for c in cache])  # bound the lazy graph between chunks
        if not seqs:
            return None
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return self._sample(logits, seqs)

    def _sample(self, logits: mx.array, seqs: list[Sequence]) -> StepResult:
        params = [s.params for s in seqs]
        logits = logits.astype(mx.float32)
        histories = [
            (s.prompt_ids, s.output_ids.tolist()) if s.params.penalizes else ((), ()) for s in seqs
        ]
        logits = apply_processors(logits, params, histories)
        keys = [step_key(p.seed, s.num_output) for p, s in zip(params, seqs)]
        tokens = sample(logits, params, keys)
        # One reduction per row, evaluated in the same sync: a NaN or +inf anywhere in a row (or
        # a row of only -inf) makes its log-sum-exp non-finite and its sampled token meaningless.
        finite = mx.isfinite(mx.logsumexp(logits, axis=-1))
        if not any(p.logprobs for p in params):
            mx.eval(tokens, finite)
            return StepResult(seqs, np.array(tokens), None, np.array(finite))
        k = max(p.top_logprobs for p in params)
        parts = extract(log_softmax(logits), tokens, k)
        mx.eval(tokens, finite, *parts)  # one sync for the whole batch, then small copies
        return StepResult(seqs, np.array(tokens), to_host(parts), np.array(finite))

    @property
    def num_cached(self) -> int:
        """Sequences holding KV memory: batch rows and prompts mid-prefill."""
        return len(self.rows) + len(self.prefill_caches)

    @staticmethod
    def active_memory() -> int:
        return int(mx.get_active_memory())

    def admit(self, seq: Sequence) -> None:
        """Move a prefilled sequence's cache into the batch, as its last row."""
        own = self.prefill_caches.pop(seq.seq_id)
        merged = [BatchKVCache.merge([c]) for c in own]
        if self.batch_cache is None:
            self.batch_cache = merged
        else:
            for mine, new in zip(self.batch_cache, merged):
                mine.extend(new)
        self.rows.append(seq)

    def release(self, seqs: list[Sequence]) -> None:
        """Forget finished or aborted sequences and free their cache rows."""
        for s in seqs:
            self.prefill_caches.pop(s.seq_id, None)
        gone = {s.seq_id for s in seqs}
        keep = [i for i, s in enumerate(self.rows) if s.seq_id not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.batch_cache = None
            return
        assert self.batch_cache is not None
        for c in self.batch_cache:
            c.filter(mx.array(keep))
