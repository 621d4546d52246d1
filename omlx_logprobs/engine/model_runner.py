"""All MLX and KV-cache work: prefill chunks, batched decode, sampling and logprob extraction.

The runner keeps one batched KV cache whose rows are the running sequences in admission order
(the scheduler's `running` order), and a private cache per sequence while its prompt prefills.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from omlx_logprobs.engine.sampler import apply_processors, sample, sampling_logits, step_key
from omlx_logprobs.engine.scheduler import PrefillChunk, SchedulerOutput
from omlx_logprobs.engine.sequence import Sequence, Status
from omlx_logprobs.logprobs.extract import BatchLogprobs, extract, log_softmax, to_host
from omlx_logprobs.types import SamplingParams

# Prompt positions scored per extraction: bounds its temporaries whatever the prefill chunk.
PROMPT_BLOCK = 128


@dataclass(frozen=True)
class PromptLogprobs:
    """Entries for one chunk's prompt tokens: row i is prompt position `first + i`."""

    seq: Sequence
    first: int
    token_ids: np.ndarray  # [R] the prompt tokens being scored
    logprobs: BatchLogprobs


@dataclass(frozen=True)
class StepResult:
    """One step's sampled tokens; row i belongs to seqs[i]."""

    seqs: list[Sequence]
    token_ids: np.ndarray  # [B] int
    logprobs: BatchLogprobs | None  # None when no sequence in the step asked for logprobs
    prompt: PromptLogprobs | None = None  # the prefill chunk's prompt entries, when asked for
    prompt_only: list[Sequence] = field(default_factory=list)  # prefilled with max_tokens 0


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
        prompt, prompt_only = None, []
        if work.prefill is not None:
            logits, prompt = self._prefill(work.prefill)
            if logits is not None:
                members = [s for s in work.prefill.seq.group if s.status is not Status.FINISHED]
                if work.prefill.seq.params.max_tokens == 0:
                    prompt_only = members
                else:  # one row per choice: the forks sample their first token here
                    parts.append(mx.broadcast_to(logits, (len(members), logits.shape[-1])))
                    seqs += members
        if not seqs:
            if prompt is None and not prompt_only:
                return None
            return StepResult([], np.zeros(0, np.int32), None, prompt, prompt_only)
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return replace(self._sample(logits, seqs), prompt=prompt, prompt_only=prompt_only)

    def _prefill(self, chunk: PrefillChunk) -> tuple[mx.array | None, PromptLogprobs | None]:
        """Run one prompt chunk: the last position's logits [1, V] when the prompt is done."""
        seq = chunk.seq
        cache = self.prefill_caches.setdefault(seq.seq_id, make_prompt_cache(self.model))
        ids = mx.array([seq.prompt_ids[chunk.start : chunk.end]])
        out = self.model(ids, cache=cache)
        prompt = None
        if seq.prompt_store is not None:
            prompt = self._score_prompt(seq, chunk.start, out[0])
        if chunk.is_last:
            return out[:, -1, :], prompt
        mx.eval([c.state for c in cache])  # bound the lazy graph between chunks
        return None, prompt

    def _score_prompt(self, seq: Sequence, start: int, logits: mx.array) -> PromptLogprobs | None:
        """Entries for the prompt tokens this chunk predicts: row j predicts token start+j+1.
        Prompt entries are the model's own distribution (no processors, no temperature)."""
        stop = min(start + logits.shape[0], seq.prompt_len - 1)  # the last row predicts output
        if stop <= start:
            return None
        p = seq.params
        k = p.num_prompt_top
        wanted = (
            mx.array(list(p.logprob_token_ids), dtype=mx.int32) if p.logprob_token_ids else None
        )
        blocks = []
        for a in range(start, stop, PROMPT_BLOCK):
            b = min(stop, a + PROMPT_BLOCK)
            fixed = None if wanted is None else mx.broadcast_to(wanted, (b - a, k))
            chosen = mx.array(seq.prompt_ids[a + 1 : b + 1], dtype=mx.int32)
            lp = log_softmax(logits[a - start : b - start])
            parts = extract(lp, chosen, k, fixed, natural=wanted is None)
            mx.eval(*parts)
            blocks.append(to_host(parts))
        merged = BatchLogprobs(*(np.concatenate(x) for x in zip(*(_fields(b) for b in blocks))))
        ids = np.array(seq.prompt_ids[start + 1 : stop + 1], np.int32)
        return PromptLogprobs(seq, start + 1, ids, merged)

    def _sample(self, logits: mx.array, seqs: list[Sequence]) -> StepResult:
        params = [s.params for s in seqs]
        logits = logits.astype(mx.float32)
        histories = [
            (s.prompt_ids, s.output_ids.tolist()) if s.params.penalizes else ((), ()) for s in seqs
        ]
        logits = apply_processors(logits, params, histories)
        dist = sampling_logits(logits, params)
        keys = [step_key(p.seed, s.num_output, s.choice_index) for p, s in zip(params, seqs)]
        tokens = sample(logits, dist, params, keys)
        if not any(p.logprobs for p in params):
            mx.eval(tokens)
            return StepResult(seqs, np.array(tokens), None)
        src = logits
        if any(p.logprobs and p.processed for p in params):  # per row: what was sampled from
            src = mx.where(mx.array([p.processed for p in params])[:, None], dist, logits)
        k = max(p.num_top for p in params if p.logprobs)
        fixed, natural = _fixed_ids(params, k)
        parts = extract(log_softmax(src), tokens, k, fixed, natural)
        mx.eval(tokens, *parts)  # one sync for the whole batch, then one copy of small arrays
        return StepResult(seqs, np.array(tokens), to_host(parts))

    def admit(self, seq: Sequence) -> None:
        """Move a prefilled prompt's cache into the batch: one row per choice still running
        (`seq` and its forks, in order), each a copy of the prompt's cache."""
        own = self.prefill_caches.pop(seq.seq_id)
        for member in seq.group:
            if member.status is not Status.WAITING:
                continue
            merged = [BatchKVCache.merge([c]) for c in own]
            if self.batch_cache is None:
                self.batch_cache = merged
            else:
                for mine, new in zip(self.batch_cache, merged):
                    mine.extend(new)
            self.rows.append(member)

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


def _fields(b: BatchLogprobs) -> tuple[np.ndarray, ...]:
    return b.logprobs, b.ranks, b.top_ids, b.top_logprobs


def _fixed_ids(params: list[SamplingParams], k: int) -> tuple[mx.array | None, bool]:
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
