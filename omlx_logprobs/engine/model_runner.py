"""All MLX and KV-cache work: prefill chunks, batched decode, sampling and logprob extraction.

The runner keeps one batched KV cache whose rows are the running sequences in admission order
(the scheduler's `running` order). A step is launched (its graph queued on the device) and
collected later, so the host can work on one step's outputs while the device runs the next:
decode inputs are the previous step's sampled tokens, read on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx_logprobs.engine.batch_cache import BatchCache
from omlx_logprobs.engine.sampler import apply_processors, sample, step_key
from omlx_logprobs.engine.scheduler import PrefillChunk, SchedulerOutput
from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.logprobs.extract import BatchLogprobs, extract, log_softmax, to_host


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device; `collect` turns it into a StepResult."""

    seqs: list[Sequence]
    tokens: mx.array  # [B] sampled ids, lazy
    logprobs: tuple[mx.array, ...] | None  # extract()'s lazy arrays
    finite: mx.array  # [B] bool, lazy


@dataclass(frozen=True)
class StepResult:
    """One step's sampled tokens; row i belongs to seqs[i]."""

    seqs: list[Sequence]
    token_ids: np.ndarray  # [B] int
    logprobs: BatchLogprobs | None  # None when no sequence in the step asked for logprobs
    finite: np.ndarray | None = None  # [B] bool: False where the row's logits held NaN or +inf


# Model families whose forward is `model.model` (hidden states) then a head: prefill can run the
# head on the last position only, instead of computing logits for every prompt position.
_SPLIT_HEAD = frozenset({"llama", "qwen2", "qwen3", "mistral"})


@dataclass(frozen=True)
class _Prefilled:
    """Where a prefilled sequence's keys and values wait for admission: a row of a batch cache."""

    cache: BatchCache
    row: int


class ModelRunner:
    def __init__(self, model: Any, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.rows: list[Sequence] = []  # the batch cache's rows
        self.batch_cache: BatchCache | None = None
        self.last_tokens: mx.array | None = None  # the last launched step's sampled ids
        self.last_rows: dict[int, int] = {}  # seq_id -> its row in last_tokens
        self.chunk_caches: dict[int, list[Any]] = {}  # long prompts between their chunks
        self.prefilled: dict[int, _Prefilled] = {}  # prompts done, not yet in the batch
        probe = make_prompt_cache(model)
        self.num_layers = len(probe)
        # Prompts batch together only with plain KV caches (left padding needs BatchKVCache).
        self.batch_prefill = all(type(c) is KVCache for c in probe)
        family = type(model).__module__.rsplit(".", 1)[-1]
        self.split_head = family in _SPLIT_HEAD and hasattr(model, "model")

    def launch(self, work: SchedulerOutput) -> LaunchedStep | None:
        """Queue one step on the device and return at once."""
        assert [s.seq_id for s in work.decode] == [s.seq_id for s in self.rows]
        parts: list[mx.array] = []
        seqs: list[Sequence] = []
        if self.rows:
            assert self.last_tokens is not None and self.batch_cache is not None
            # Every row took part in the last step, so its input token is there, on the device.
            rows = mx.array([self.last_rows[s.seq_id] for s in self.rows])
            inputs = self.last_tokens[rows][:, None]
            parts.append(self.model(inputs, cache=self.batch_cache.layers)[:, -1, :])
            seqs += self.rows
        whole = [c for c in work.prefill if c.start == 0 and c.is_last and self.batch_prefill]
        for group in _groups(whole):
            parts.append(self._prefill_group(group))
            seqs += [c.seq for c in group]
        for chunk in work.prefill:
            if chunk not in whole:
                logits = self._prefill_chunk(chunk)
                if logits is not None:
                    parts.append(logits)
                    seqs.append(chunk.seq)
        if not seqs:
            return None
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return self._sample(logits, seqs)

    def _last_logits(self, ids: mx.array, cache: list[Any]) -> mx.array:
        """[B, V] logits of the last position only."""
        if not self.split_head:
            return self.model(ids, cache=cache)[:, -1, :]
        m = self.model
        h = m.model(ids, cache=cache)[:, -1:, :]
        head = m.lm_head if hasattr(m, "lm_head") else m.model.embed_tokens.as_linear
        return head(h)[:, 0, :]

    def _prefill_group(self, group: list[PrefillChunk]) -> mx.array:
        """Whole prompts in one left-padded forward; their rows wait in the group's cache."""
        width = max(c.end for c in group)
        pads = [width - c.end for c in group]
        ids = mx.array([[0] * p + c.seq.prompt_ids for p, c in zip(pads, group)])
        cache = BatchCache.empty(self.num_layers, pads)
        logits = self._last_logits(ids, cache.layers)
        for row, c in enumerate(group):
            self.prefilled[c.seq.seq_id] = _Prefilled(cache, row)
        return logits

    def _prefill_chunk(self, chunk: PrefillChunk) -> mx.array | None:
        """One chunk of one prompt in its own cache; the last chunk's logits, else None."""
        cache = self.chunk_caches.setdefault(chunk.seq.seq_id, make_prompt_cache(self.model))
        ids = mx.array([chunk.seq.prompt_ids[chunk.start : chunk.end]])
        if not chunk.is_last:
            self.model(ids, cache=cache)  # lazy: evaluating only the cache skips the head
            mx.async_eval([c.state for c in cache])  # bound the lazy graph between chunks
            return None
        logits = self._last_logits(ids, cache)
        del self.chunk_caches[chunk.seq.seq_id]
        self.prefilled[chunk.seq.seq_id] = _Prefilled(BatchCache.of_one(cache), 0)
        return logits

    def _sample(self, logits: mx.array, seqs: list[Sequence]) -> LaunchedStep:
        params = [s.params for s in seqs]
        logits = logits.astype(mx.float32)
        histories = [
            (s.prompt_ids, s.output_ids.tolist()) if s.params.penalizes else ((), ()) for s in seqs
        ]
        logits = apply_processors(logits, params, histories)
        keys = [step_key(p.seed, s.num_sampled) for p, s in zip(params, seqs)]
        tokens = sample(logits, params, keys)
        # One reduction per row, in the same evaluation: a NaN or +inf anywhere in a row (or a
        # row of only -inf) makes its log-sum-exp non-finite and its sampled token meaningless.
        finite = mx.isfinite(mx.logsumexp(logits, axis=-1))
        parts = None
        if any(p.logprobs for p in params):
            parts = extract(log_softmax(logits), tokens, max(p.top_logprobs for p in params))
        for s in seqs:
            s.num_sampled += 1
        self.last_tokens = tokens
        self.last_rows = {s.seq_id: i for i, s in enumerate(seqs)}
        mx.async_eval(tokens, finite, *(parts or ()))
        return LaunchedStep(seqs, tokens, parts, finite)

    @property
    def num_cached(self) -> int:
        """Sequences holding KV memory: batch rows, prompts between chunks, prompts done."""
        return len(self.rows) + len(self.chunk_caches) + len(self.prefilled)

    @staticmethod
    def active_memory() -> int:
        return int(mx.get_active_memory())

    @staticmethod
    def cache_memory() -> int:
        return int(mx.get_cache_memory())

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step; one copy of its small arrays to the host."""
        tokens = np.array(step.tokens)
        logprobs = to_host(step.logprobs) if step.logprobs is not None else None
        return StepResult(step.seqs, tokens, logprobs, np.array(step.finite))

    def admit(self, seqs: list[Sequence]) -> None:
        """Move prefilled sequences' caches into the batch, as its last rows, in this order.
        Consecutive rows of one prefill group move with one filter and one extend."""
        runs: list[tuple[BatchCache, list[int]]] = []
        for seq in seqs:
            p = self.prefilled.pop(seq.seq_id)
            if runs and runs[-1][0] is p.cache:
                runs[-1][1].append(p.row)
            else:
                runs.append((p.cache, [p.row]))
        for cache, rows in runs:
            if rows != list(range(len(cache))):
                cache.filter(rows)
            if self.batch_cache is None:
                self.batch_cache = cache
            else:
                self.batch_cache.extend(cache)
        self.rows += seqs

    def release(self, seqs: list[Sequence]) -> None:
        """Forget finished or aborted sequences and free their cache rows."""
        for s in seqs:
            self.chunk_caches.pop(s.seq_id, None)
            self.prefilled.pop(s.seq_id, None)
        gone = {s.seq_id for s in seqs}
        keep = [i for i, s in enumerate(self.rows) if s.seq_id not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.batch_cache = None
            self.last_tokens, self.last_rows = None, {}  # idle: MLX holds only the weights
            return
        assert self.batch_cache is not None
        self.batch_cache.filter(keep)


def _groups(chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
    """Split whole prompts into forward groups, in order, so that left padding never more than
    doubles the tokens a group computes."""
    groups: list[list[PrefillChunk]] = []
    width = total = 0
    for c in chunks:
        n = c.end
        if groups and max(width, n) * (len(groups[-1]) + 1) <= 2 * (total + n):
            groups[-1].append(c)
            width, total = max(width, n), total + n
        else:
            groups.append([c])
            width, total = n, n
    return groups
