"""All MLX and KV-cache work: prefill chunks, batched decode, sampling and logprob extraction.

The runner keeps one batched KV cache whose rows are the running sequences in admission order
(the scheduler's `running` order). A step is launched (its graph queued on the device) and
collected later, so the host can work on one step's outputs while the device runs the next:
decode inputs are the previous step's sampled tokens, read on the device.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.batch.scheduler import PrefillChunk, SchedulerOutput
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.logprobs.extract import release_scratch
from omlx_logprobs.logprobs.extractor import PROMPT_BLOCK, Extractor, choose_extractor
from omlx_logprobs.runner import query_blocks
from omlx_logprobs.runner.batch_cache import BatchCache, kinds
from omlx_logprobs.runner.fast import attention, compiled, lean_decode
from omlx_logprobs.runner.fast.fusion import Fusion
from omlx_logprobs.runner.fast.lean_decode import LeanDecode
from omlx_logprobs.runner.grammar import bitmask, open_ended
from omlx_logprobs.runner.lora import AdapterSet
from omlx_logprobs.runner.prefix_cache import (
    Key,
    Prefix,
    PrefixCache,
    default_budget_mib,
    from_cache,
    from_row,
    keeps_prefixes,
    keeps_sequences,
    make_prefix,
    seed,
)
from omlx_logprobs.runner.probe import probe
from omlx_logprobs.runner.prompt_cache import PromptCache
from omlx_logprobs.runner.prompt_scoring import PendingPrompts, chunk_slice, score, score_key
from omlx_logprobs.runner.sampler import (
    MaskState,
    apply_processors,
    sample,
    sampling_logits,
    step_key,
    token_mask,
)
from omlx_logprobs.runner.speculation import Speculator
from omlx_logprobs.runner.step import DeviceTime, LaunchedStep, StepResult
from omlx_logprobs.runner.weights import load_into
from omlx_logprobs.types import AdapterChange, FinishReason

__all__ = ["ModelRunner"]

log = logging.getLogger("omlx_logprobs")


@dataclass(frozen=True)
class _Prefilled:
    """Where a prefilled sequence's keys and values wait for admission: a row of a batch cache."""

    cache: BatchCache
    row: int


# On a GPU, MLX keeps every freed buffer for reuse up to about the device's memory: with batch
# and prompt sizes changing every step that grew to ~100 GB on an H200, and host RSS with it.
GPU_CACHE_LIMIT_MIB = 4096
# A left-padded prefill group's width is rounded up to this many tokens on a GPU: MLX's CUDA
# backend keeps host state per kernel shape (CUDA graphs, cuDNN attention plans, in bounded
# caches), which grew RSS with every new (rows, width) pair. On the CPU padding is real compute.
GPU_PREFILL_ALIGN = 32
CPU_PREFILL_ALIGN = 1
# A prefill whose attention spans this many (query, key) pairs or more is evaluated apart from
# the step (`_settle`): its failure then ends its own requests only.
SETTLE_PAIRS = 1 << 24
# Tests set this to run the GPU's path (extraction on the device, one packed read a step, the
# step processed beside the next launch) on the CPU backend.
FORCE_GPU_PATH = False
# The decode forward compiled (runner/fast/compiled.py), on a GPU only, and only when asked
# (OMLX_COMPILE_DECODE=1): on an H100 it cut the graph's Python (1.49 -> 0.96 ms a step at 64
# rows) but not the launch (5.07 -> 5.61 ms), and a server at c=64 ran slower with it; the lean
# step traced the same way was slower than the lean step as it is (docs/benchmarks.md,
# "Decisions").
COMPILE_DECODE = os.environ.get("OMLX_COMPILE_DECODE") == "1"


class ModelRunner:
    # Whether this runner may compile its decode forward (COMPILE_DECODE); a split model's
    # runner may not (distributed/group_runner.py).
    compiles = True

    def __init__(
        self,
        model: Any,
        vocab_size: int,
        cache_limit_mib: int | None = None,
        prefix_cache_mib: int | None = 0,
        stop_ids: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids  # EOS ids: what min_tokens holds back besides stop_token_ids
        self.rows: list[Sequence] = []  # the batch cache's rows
        self.batch_cache: BatchCache | None = None
        self.last_tokens: mx.array | None = None  # the last launched step's sampled ids
        self.last_seqs: list[Sequence] = []  # their rows' sequences, in order
        self._last_rows: dict[int, int] | None = None  # seq_id -> its row, made when asked
        self.chunk_caches: dict[int, list[Any]] = {}  # long prompts between their chunks
        self.prefilled: dict[int, _Prefilled] = {}  # prompts done, not yet in the batch
        # Prompts whose prefill failed in the last launch (an allocation, say), with why: the
        # engine ends them alone; the step goes on without them.
        self.failed: list[tuple[Sequence, str]] = []
        self._disk: tuple[str, int] | None = None  # the disk tier's folder and size limit
        self.time = DeviceTime()
        self.speculator: Speculator | None = None  # set by the engine (runner/speculation.py)
        # On a GPU a decode step's masked attention is one kernel (attention.py), before the
        # probe below compares the batch with each row alone.
        if attention.install():
            log.info("decode attention: one CUDA kernel per layer (runner/fast/attention.py)")
        query_blocks.install()  # prefill attention's memory bounded (runner/query_blocks.py)
        self.fusion = Fusion(model)  # q/k/v and gate/up projections as one matmul each
        # The model's own caches, one per layer: each batch cache is made of their batch forms
        # (batch_cache.py); a model with a cache mlx-lm cannot batch is refused here.
        self.templates = make_prompt_cache(model)
        self.split = probe(model, self.templates)  # the body/head split, if any (head.py)
        # LoRA adapters (runner/lora.py): each forward first names its rows' adapters.
        self.adapters = AdapterSet(model)
        # Shared prompt prefixes: plain KV and sliding-window caches only. A prefix's keys are
        # placed per row at its own padding; a recurrent state cannot be cut to that length.
        self.prefixes: PrefixCache | None = None
        # Finished sequences (prompt and output) are kept too: plain KV layers only.
        self.keeps_finished = keeps_sequences(self.templates)
        if prefix_cache_mib is None:
            prefix_cache_mib = default_budget_mib()
            log.info("prefix cache: %d MiB (a quarter of the memory left after the weights)",
                     prefix_cache_mib)  # fmt: skip
        if prefix_cache_mib > 0 and keeps_prefixes(self.templates):
            self.prefixes = PrefixCache(prefix_cache_mib << 20, self._make_prefix)
        elif prefix_cache_mib > 0:
            log.info(
                "prefix cache off for this model: its caches (%s) hold a recurrent state, which "
                "a kept prefix cannot be cut from at each row's padding; every prompt prefills "
                "in full",
                ", ".join(kinds(self.templates)),
            )
        # Scored prompts' kept starts, with their entries (runner/prompt_cache.py).
        self.prompt_cache = PromptCache(self.prefixes, self.adapters.key, self.keeps_finished)
        # Body and head apart (runner/head.py), where the model has them: the head then runs on
        # the positions needed only. Else every forward computes every position's logits.
        self.split_head = self.split is not None
        if not self.split_head:
            log.info(
                "no body/head split found for %s: prefill computes logits at every position, "
                "and scored prompts prefill one at a time",
                type(model).__module__,
            )
        cpu = mx.default_device() == mx.cpu and not FORCE_GPU_PATH
        # Where entries are computed: in numpy at collect time on the CPU backend, on the
        # device elsewhere (logprobs/extractor.py); chosen once, here.
        self.extractor: Extractor = choose_extractor(cpu)
        # On a GPU the host bounds the step loop: the engine processes a step beside the next
        # launch. MLX's CPU backend computes the step inside the launch on both cores: no gain.
        self.overlaps = not cpu
        self.prefill_align = CPU_PREFILL_ALIGN if cpu else GPU_PREFILL_ALIGN
        self.tight_cache = cpu  # caches grow by what their rows may use (see batch_cache.py)
        # A decode step other than the model's forward, where one serves the model.
        self.decode: compiled.CompiledDecode | LeanDecode | None = self._decode_step(model, cpu)
        # Where the decode batch is compiled, its shared left padding is trimmed in whole
        # multiples of the width it keeps (else every trim would widen the cache again).
        compiles = isinstance(self.decode, compiled.CompiledDecode)
        self.trim_align = compiled.WIDTH_ALIGN if compiles else 1
        if cache_limit_mib is None and not cpu:
            cache_limit_mib = GPU_CACHE_LIMIT_MIB
        if cache_limit_mib is not None:
            mx.set_cache_limit(cache_limit_mib << 20)

    def _decode_step(self, model: Any, cpu: bool) -> compiled.CompiledDecode | LeanDecode | None:
        """The decode forward compiled (runner/fast/compiled.py) where asked on a GPU, else the lean
        step (runner/fast/lean_decode.py) where it serves the model; each checked against the
        model's own forward at start-up. None: the model's forward (a split model's runner
        always takes it)."""
        if not self.compiles:
            return None
        why = lean_decode.eligible(model, self.fusion, self.templates)
        lean = LeanDecode(model, self.fusion, full_width=not cpu) if why is None else None
        if COMPILE_DECODE and not cpu:
            why_not = compiled.check(model, self.templates, lean)
            if why_not is None:
                log.info(
                    "decode steps compiled (runner/fast/compiled.py), lean: %s", lean is not None
                )
                return compiled.CompiledDecode(model, lean)
            log.info("decode steps not compiled for %s: %s", type(model).__module__, why_not)
        if lean is not None:
            why = lean_decode.check(lean, self.templates)
        if why is None:
            log.info("decode steps: the lean step (runner/fast/lean_decode.py)")
            return lean
        log.info("decode steps through the model's own forward: %s", why)
        return None

    def launch(self, work: SchedulerOutput) -> LaunchedStep | None:
        """Queue one step on the device and return at once."""
        assert [s.seq_id for s in work.decode] == [s.seq_id for s in self.rows]
        if self.speculator is not None and not work.prefill:
            if (spec := self.speculator.launch(self)) is not None:
                return spec
        parts: list[mx.array] = []
        seqs: list[Sequence] = []
        if self.rows:
            assert self.last_tokens is not None and self.batch_cache is not None
            # Every row took part in the last step, so its input token is there, on the device
            # (in the same rows when none joined or left: then no gather).
            if self.rows == self.last_seqs:
                inputs = self.last_tokens[:, None]
            else:
                rows = mx.array([self.last_rows[s.seq_id] for s in self.rows])
                inputs = self.last_tokens[rows][:, None]
            if self.tight_cache:
                self.batch_cache.reserve(max(s.to_write for s in self.rows))
            self.adapters.select_rows(self.rows)
            # With adapters loaded, the model's forward: a compiled one would keep the selection
            # it was traced with, the lean one calls the joined projections without them.
            if (
                self.decode is not None
                and not self.adapters.stacks
                and self.decode.supports(self.batch_cache)
            ):
                parts.append(self.decode(inputs, self.batch_cache))
            else:
                parts.append(self.model(inputs, cache=self.batch_cache.layers)[:, -1, :])
            seqs += self.rows
        # Whole prompts prefill together in left-padded groups, scored ones in groups of their
        # own; partial chunks and prompts with forks take the one-prompt path.
        grouped = [c for c in work.prefill if self._groupable(c)]
        prefixes = self._prefixes(grouped)
        prompt: list[PendingPrompts] = []
        prompt_only: list[Sequence] = []
        todo = deque(_groups(grouped, prefixes))
        while todo:
            group = todo.popleft()
            try:
                logits, pending = self._prefill_group(group, prefixes.get(group[0].seq.seq_id))
                self._settle([c.seq for c in group], logits)
            except Exception as exc:
                if len(group) > 1:  # each prompt alone, next: only the one at fault fails
                    todo.extendleft([c] for c in reversed(group))
                else:
                    self._prefill_failed([group[0].seq], exc)
                continue
            prompt += [pending] if pending is not None else []
            sampled = [i for i, c in enumerate(group) if c.seq.params.max_tokens > 0]
            prompt_only += [c.seq for c in group if c.seq.params.max_tokens == 0]
            if sampled:
                part = logits if len(sampled) == len(group) else logits[mx.array(sampled)]
                parts.append(part)
                seqs += [group[i].seq for i in sampled]
        for chunk in work.prefill:
            if chunk in grouped:
                continue
            try:
                last, scored = self._prefill_chunk(chunk)
                self._settle([chunk.seq], last)
            except Exception as exc:
                self._prefill_failed([chunk.seq], exc)
                continue
            prompt += [scored] if scored is not None else []
            if last is None:
                continue
            if chunk.seq.params.max_tokens == 0:
                prompt_only += chunk.seq.group
            elif members := chunk.seq.joining():  # one row per choice: forks sample here too
                parts.append(mx.broadcast_to(last, (len(members), last.shape[-1])))
                seqs += members
        if prompt:  # queued now, collected with the step: no sync per scored block
            self._queue(*(x for p in prompt for x in p.arrays()))
        if not seqs:
            if not prompt and not prompt_only:
                return None
            return LaunchedStep([], None, prompt, prompt_only)
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return replace(self._sample(logits, seqs), prompt=prompt, prompt_only=prompt_only)

    def _settle(self, seqs: list[Sequence], logits: mx.array | None) -> None:
        """Evaluate a large prefill now, apart from the step: an allocation that fails then
        fails these prompts alone, not every row of the batch. Small ones stay in the step's
        one graph (on a GPU its launch overlaps the previous step's processing)."""
        context = max(s.prompt_len for s in seqs)
        if context * sum(s.prompt_len - s.cached_tokens for s in seqs) < SETTLE_PAIRS:
            return
        arrays: list[Any] = [logits] if logits is not None else []
        for s in seqs:
            if (p := self.prefilled.get(s.seq_id)) is not None:
                arrays += [c.state for c in p.cache.layers]
            arrays += [c.state for c in self.chunk_caches.get(s.seq_id, ())]
        mx.eval(*arrays)

    def _prefill_failed(self, seqs: list[Sequence], exc: Exception) -> None:
        log.error("prefill of %d prompt(s) failed: %s", len(seqs), exc)
        for s in seqs:
            for m in s.group:
                self.prefilled.pop(m.seq_id, None)
            self.chunk_caches.pop(s.seq_id, None)
            self.failed.append((s, f"the prompt could not be prefilled: {exc}"))

    def _groupable(self, c: PrefillChunk) -> bool:
        """A whole prompt with one choice (every batch form takes left padding); a scored one
        also needs the head apart from the body (to run it on its positions block by block)."""
        if not (c.start == 0 and c.is_last and not c.seq.forks):
            return False
        return not c.seq.scored or self.split_head

    def _head(self, h: mx.array) -> mx.array:
        assert self.split is not None
        return self.split.head(h)

    def _last_logits(self, ids: mx.array, cache: list[Any]) -> mx.array:
        """[B, V] logits of the last position only."""
        if self.split is None:
            return self.model(ids, cache=cache)[:, -1, :]
        return self._head(self.split.body(ids, cache=cache)[:, -1:, :])[:, 0, :]

    def _prefill_group(
        self, group: list[PrefillChunk], prefix: Prefix | None
    ) -> tuple[mx.array, PendingPrompts | None]:
        """Whole prompts in one left-padded forward, computed from after `prefix` (which they
        all start with): their last logits, and their prompt entries when they are scored (a
        group is all scored or all plain, see `_groups`). Rows that will generate wait in the
        group's cache for admission."""
        scored = group[0].seq.scored
        start = len(prefix.tokens) if prefix is not None else 0
        width = max(c.end for c in group) - start  # the columns the forward computes
        width += -width % self.prefill_align + start
        pads = [width - c.end for c in group]
        ids = mx.array([([0] * p + c.seq.context_ids)[start:] for p, c in zip(pads, group)])
        if prefix is None:
            cache = BatchCache.for_prompts(self.templates, pads)
        else:
            cache = BatchCache.seeded(self.templates, prefix.keys, prefix.values, pads)
        if self.tight_cache:
            cache.reserve(max(c.seq.to_write for c in group), width - start)
        self.adapters.select_rows([c.seq for c in group])
        for row, c in enumerate(group):
            c.seq.cached_tokens = max(start - pads[row], 0)
            if c.seq.params.max_tokens > 0:
                self.prefilled[c.seq.seq_id] = _Prefilled(cache, row)
        if not scored:
            logits = self._last_logits(ids, cache.layers)
            cache.finish_prefill()
            return logits, None
        assert self.split is not None
        h = self.split.body(ids, cache=cache.layers)
        cache.finish_prefill()
        # Every row's computed positions but its last, rows in group order: one flat [N, H]
        # block. A row's first `done` positions came with the prefix, their entries too.
        cols, done = width - start, [c.seq.cached_tokens for c in group]
        flat = np.concatenate([r * cols + np.arange(p + d - start, cols - 1)
                               for r, (p, d) in enumerate(zip(pads, done))])  # fmt: skip
        if self.extractor.pads_blocks:  # whole blocks on the device: see prompt_scoring
            flat = np.pad(flat, (0, -len(flat) % PROMPT_BLOCK))
        hidden = h.reshape(-1, h.shape[-1])[mx.array(flat)]
        slices = [chunk_slice(c.seq, d, c.end) for c, d in zip(group, done)]
        kept = prefix.scores if prefix is not None else None
        served = tuple(kept.served(c.seq, d) for c, d in zip(group, done) if d and kept)
        keep = [x for r, (c, p) in enumerate(zip(group, pads)) for x in self.prompt_cache.keep(
            c.seq, partial(from_row, c.seq.prompt_ids, np.zeros(0), c.end, cache.layers, r, p))]
        pending = score(
            slices, lambda a, b: self._head(hidden[a:b]), self.extractor, served, tuple(keep)
        )
        return self._head(h[:, -1, :]), pending

    def _prefixes(self, chunks: list[PrefillChunk]) -> dict[int, Prefix]:
        """By seq_id, the kept prefix each whole prompt starts from: for plain prompts, made
        here where two prompts that began alike share one (evaluated with the step); for
        scored ones, one that keeps their prompt entries too."""
        if self.prefixes is None:
            return {}
        plain = [c for c in chunks if not c.seq.scored]
        scored = [c for c in chunks if c.seq.scored]
        keys = [self.adapters.key(c.seq.adapter) for c in plain]
        found = self.prefixes.assign([c.seq.context_ids for c in plain], keys)
        found += self.prompt_cache.starts([c.seq for c in scored])
        return {c.seq.seq_id: p for c, p in zip(plain + scored, found) if p is not None}

    def cached_len(self, seq: Sequence) -> int:
        """How many of a whole prompt's tokens a kept prefix holds now (prefixes made in the
        prompt's own step are not foreseen)."""
        if seq.scored:
            return self.prompt_cache.held(seq)
        if self.prefixes is None:
            return 0
        return self.prefixes.held(seq.context_ids, self.adapters.key(seq.adapter))

    def _make_prefix(self, tokens: tuple[int, ...], base: Prefix | None, key: Key) -> Prefix:
        self.adapters.select([key[0]])
        return make_prefix(self.model, tokens, base)

    def _chunk_cache(self, chunk: PrefillChunk) -> tuple[list[Any], int, Prefix | None]:
        """A prompt's one-row cache between its chunks, where this chunk's forward starts, and
        the kept prefix it started from. At the prompt's first chunk, the cache is seeded with
        the longest kept start (a scored prompt's: with its entries; the scheduler started the
        chunk there; should that prefix be gone since, the forward starts from what is kept)."""
        seq = chunk.seq
        cache = self.chunk_caches.get(seq.seq_id)
        if cache is not None:
            return cache, chunk.start, None
        cache = self.chunk_caches[seq.seq_id] = make_prompt_cache(self.model)
        found = None
        if seq.scored:
            found = self.prompt_cache.start(seq, chunk.end - 1)
        elif self.prefixes is not None:
            key = self.adapters.key(seq.adapter)
            found = self.prefixes.longest(seq.context_ids, chunk.end - 1, key)
        if found is not None:
            seed(cache, found)
        start = len(found.tokens) if found is not None else 0
        for s in seq.group:
            s.cached_tokens = start
        return cache, start, found

    def _prefill_chunk(self, chunk: PrefillChunk) -> tuple[mx.array | None, PendingPrompts | None]:
        """One chunk of one prompt in its own cache: the last chunk's last logits (else None),
        and the chunk's prompt entries when the prompt asks for them."""
        seq = chunk.seq
        cache, start, found = self._chunk_cache(chunk)
        ids = mx.array([seq.context_ids[start : chunk.end]])
        self.adapters.select_rows([seq])
        scored: Any = None
        unread: tuple[mx.array, ...] = ()
        if seq.scored:  # every position's logits but those of a kept start: the prompt is scored
            out = self.model(ids, cache=cache)[0]
            rows = chunk_slice(seq, start, out.shape[0])
            served = (found.scores.served(seq, start),) if found and found.scores else ()
            keep = []
            if chunk.is_last:  # the whole prompt's keys and values are in the cache now
                keep = self.prompt_cache.keep(seq, lambda: from_cache(seq.prompt_ids, cache))
            scored = score([rows], lambda a, b: out[a:b], self.extractor, served, tuple(keep))
            logits = out[-1:, :]
        elif chunk.is_last:
            logits = self._last_logits(ids, cache)
        else:
            # Lazy: evaluating only the cache skips the head. Split over processes, the
            # forward's output is evaluated too (distributed/group_runner.py).
            unread = self._forward_unread(ids, cache)
        if not chunk.is_last:
            self._queue([c.state for c in cache], *unread)  # bound the lazy graph between chunks
            return None, scored
        del self.chunk_caches[seq.seq_id]
        members = seq.joining()
        if members:  # one copy of the prompt's cache per choice, rows in choice order
            rows_cache = BatchCache.of_copies(cache, len(members))
            for row, m in enumerate(members):
                self.prefilled[m.seq_id] = _Prefilled(rows_cache, row)
        return logits, scored

    def _sample(self, logits: mx.array, seqs: list[Sequence]) -> LaunchedStep:
        params = [s.params for s in seqs]
        keys = [step_key(s.params.seed, s.num_sampled, s.choice_index) for s in seqs]
        histories: list[tuple[Any, Any]] = []  # read only for rows with a processor
        if any(p.processes for p in params):
            histories = [
                (s.prompt_ids, s.output_ids.tolist()) if s.params.penalizes else ((), ())
                for s in seqs
            ]
        raw = logits.astype(mx.float32)  # the model's own: raw logprobs and finiteness
        logits = self._mask(raw, seqs)
        logits = apply_processors(logits, params, histories)
        dist = sampling_logits(logits, params)
        tokens = self._shared(sample(logits, dist, params, keys))
        for s in seqs:
            s.num_sampled += 1
        self.last_tokens = tokens
        self.last_seqs, self._last_rows = list(seqs), None
        pending = self.extractor.step(tokens, raw, dist, params)
        self._queue(tokens, *pending.arrays())  # the next step reads these ids on the device
        return LaunchedStep(seqs, pending)

    @property
    def last_rows(self) -> dict[int, int]:
        """seq_id -> its row in last_tokens."""
        if self._last_rows is None:
            self._last_rows = {s.seq_id: i for i, s in enumerate(self.last_seqs)}
        return self._last_rows

    def _mask(self, logits: mx.array, seqs: list[Sequence]) -> mx.array:
        """The rows' token masks (runner/sampler.py). A row whose last sampled token was not
        processed yet reads it from the last step's ids, on the device."""
        if not any(s.params.masks for s in seqs):
            return logits
        states, prev_rows = [], []
        for s in seqs:
            # On a GPU the step in flight may be processed (its token appended) meanwhile:
            # one read of the length, and only the tail the bad words need, before it.
            n = len(s.output_ids)
            longest = max((len(w) for w in s.params.bad_words_ids), default=1)
            tail = s.output_ids[max(n - longest, 0) : n].tolist()
            in_flight = s.num_sampled > n and s.seq_id in self.last_rows
            states.append(MaskState(s.num_sampled, tail, in_flight))
            prev_rows.append(self.last_rows[s.seq_id] if in_flight else 0)
        prev = None
        if self.last_tokens is not None and any(st.in_flight for st in states):
            prev = self.last_tokens[mx.array(prev_rows)]
        # Constrained rows were processed before this launch (Engine._needs_history).
        assert not any(s.grammar is not None and st.in_flight for s, st in zip(seqs, states))
        bits = bitmask(
            [s.grammar for s in seqs],
            self.vocab_size,
            [open_ended(s.params.constraint) for s in seqs],
        )
        return token_mask(logits, [s.params for s in seqs], states, self.stop_ids, prev, bits)

    # ---- hooks a runner split over processes overrides (distributed/group_runner.py) ------------
    def _forward_unread(self, ids: mx.array, cache: list[Any]) -> tuple[mx.array, ...]:
        """A forward whose output nothing reads (a prompt's chunk before its last): what must
        be evaluated with the cache."""
        self.model(ids, cache=cache)
        return ()

    def _shared(self, tokens: mx.array) -> mx.array:
        """The step's sampled ids as every process of the model has them."""
        return tokens

    def heartbeat(self) -> None:
        """The engine is idle (called at each idle wait)."""

    def close(self) -> None:
        """The engine's loop has ended: the kept sequences go to the disk tier, if any."""
        if self.prefixes is not None:
            self.prefixes.persist()

    def attach_disk(self, root: str, mib: int) -> None:
        """Give the prefix cache its disk tier (`--kv-cache-dir`), keyed by the weights."""
        from omlx_logprobs.runner.disk_tier import DiskTier, fingerprint

        if self.prefixes is None or not self.keeps_finished:
            log.info("--kv-cache-dir unused: this model's sequences are not kept (prefix cache"
                     " off, or caches other than plain keys and values)")  # fmt: skip
            return
        self._disk = (root, mib)
        self.prefixes.disk = DiskTier(root, mib << 20, fingerprint(self.model))

    def health(self) -> Any:
        """The processes the model is split over, for /health (None: this process alone)."""
        return None

    def load_weights(self, path: str) -> None:
        """New weights in place (runner/weights.py), with nothing running; the kept prefixes go:
        their keys and values came from the old weights. WeightsError leaves the old ones."""
        assert not self.rows and not self.chunk_caches and not self.prefilled
        load_into(self.model, path)
        self.fusion.rejoin()
        if self.decode is not None:
            self.decode.reset()
        if self.prefixes is not None:
            self.prefixes.clear()
            if self._disk is not None:  # the new weights' own folder
                self.attach_disk(*self._disk)

    def flush_prefixes(self) -> None:
        """Drop every kept prefix in memory (/flush_cache, /reset_prefix_cache); rows keep
        theirs, and the disk tier (`--kv-cache-dir`, the same weights' folder) stays."""
        if self.prefixes is not None:
            self.prefixes.clear()
            if self._disk is not None:
                self.attach_disk(*self._disk)

    def change_adapter(self, change: AdapterChange) -> None:
        """Load, replace or unload a LoRA adapter between steps (runner/lora.py); AdapterError
        changes nothing. Rows running on an unloaded or replaced one finish on it."""
        if change.path is None:
            self.adapters.unload(change.name)
        else:
            self.adapters.load(change.name, change.path, change.replace)

    def release_adapters(self, in_use: set[int]) -> None:
        """Free the slots of unloaded adapters that no row runs on, and their kept prefixes."""
        for key in self.adapters.release(in_use):
            if self.prefixes is not None:
                self.prefixes.drop(key)

    @property
    def num_cached(self) -> int:
        """Sequences holding KV memory: batch rows, prompts between chunks, prompts done."""
        return len(self.rows) + len(self.chunk_caches) + len(self.prefilled)

    @staticmethod
    def idle() -> None:
        """Nothing is running: give MLX's cached buffers back (device memory on a GPU), and
        the host extraction's buffer."""
        mx.clear_cache()
        release_scratch()

    @staticmethod
    def active_memory() -> int:
        return int(mx.get_active_memory())

    @staticmethod
    def cache_memory() -> int:
        return int(mx.get_cache_memory())

    def _queue(self, *arrays: Any) -> None:
        t0 = time.perf_counter()
        mx.async_eval(*arrays)
        self.time.queued_at = time.perf_counter()
        self.time.queue_s += self.time.queued_at - t0

    def take_time(self) -> DeviceTime:
        """The device-boundary time since the last call."""
        spent, self.time = self.time, DeviceTime()
        return spent

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step; one copy of its small arrays to the host."""
        t0 = time.perf_counter()
        if step.spec is not None:
            assert self.speculator is not None
            result = self.speculator.collect(self, step, step.spec)
            self.time.read_s += time.perf_counter() - t0
            return result
        if step.sampled is not None:
            tokens, finite, logprobs = step.sampled.to_host()
        else:
            tokens, finite, logprobs = np.zeros(0, np.int32), np.ones(0, bool), None
        prompt = [x for p in step.prompt for x in p.to_host()]
        self.time.read_s += time.perf_counter() - t0
        return StepResult(step.seqs, tokens, finite, logprobs, prompt, step.prompt_only)

    def admit(self, seqs: list[Sequence]) -> None:
        """Move prefilled sequences' caches into the batch, as its last rows, in this order.
        Consecutive rows of one prefill group move with one selection and one extend; a group
        may come back later in the order (groups split prompts by kind)."""
        runs: list[tuple[BatchCache, list[int]]] = []
        for seq in seqs:
            p = self.prefilled.pop(seq.seq_id)
            if runs and runs[-1][0] is p.cache:
                runs[-1][1].append(p.row)
            else:
                runs.append((p.cache, [p.row]))
        for cache, rows in runs:
            if rows != list(range(len(cache))):
                cache = cache.select(rows)
            if self.batch_cache is None:
                self.batch_cache = cache
            else:
                self.batch_cache.extend(cache)
        self.rows += seqs

    def release(self, seqs: list[Sequence]) -> None:
        """Forget finished or aborted sequences and free their cache rows; a finished row's
        keys and values (its prompt and output) are kept in the prefix cache first."""
        for s in seqs:
            self.chunk_caches.pop(s.seq_id, None)
            self.prefilled.pop(s.seq_id, None)
        gone = {s.seq_id for s in seqs}
        keep = [i for i, s in enumerate(self.rows) if s.seq_id not in gone]
        if len(keep) == len(self.rows):
            return
        self._keep_finished([i for i, s in enumerate(self.rows) if s.seq_id in gone])
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.batch_cache = None
            # Idle: MLX holds only the weights.
            self.last_tokens, self.last_seqs, self._last_rows = None, [], None
            return
        assert self.batch_cache is not None
        self.batch_cache.filter(keep, self.trim_align)


    def _keep_finished(self, rows: list[int]) -> None:
        """Keep these batch rows' keys and values, each under its tokens: the prompt and the
        output but its last token (every other output token was fed back; whether the last
        one was depends on step timing, and the same conversation should keep the same)."""
        cache = self.batch_cache
        if self.prefixes is None or not self.keeps_finished or cache is None:
            return
        for i in rows:
            seq = self.rows[i]
            if seq.finish_reason is FinishReason.ERROR:
                continue
            n = len(seq.prompt_ids) + seq.num_output - 1  # prompt_len is the last prefill's
            assert n <= cache.width - cache.pads[i]
            prefix = from_row(seq.prompt_ids, seq.output_ids, n, cache.layers, i, cache.pads[i])
            prefix = self.prompt_cache.finished(seq, prefix)  # a scored one's, with its entries
            # The copies now, with the step: until then they would hold the batch's arrays.
            mx.async_eval(prefix.keys, prefix.values)
            self.prefixes.keep(self.adapters.key(seq.adapter), prefix)


def _groups(chunks: list[PrefillChunk], prefixes: dict[int, Prefix]) -> list[list[PrefillChunk]]:
    """Split whole prompts into forward groups, in order: by the cached prefix they start from,
    scored prompts apart from plain ones and by `score_key`, and so that left padding never
    more than doubles a group's tokens."""
    groups: list[list[PrefillChunk]] = []
    open_: dict[object, tuple[list[PrefillChunk], int, int]] = {}  # kind -> (group, width, total)
    for c in chunks:
        p = c.seq.params
        # One kept prefix seeds a whole group (prefixes of different adapters may hold the same
        # tokens, so the prefix itself is the kind)
        prefix = prefixes.get(c.seq.seq_id)
        kind: object = ("prefix", id(prefix) if prefix is not None else None)
        if c.seq.scored:
            kind = (score_key(p), kind)
        n = c.end
        group, width, total = open_.get(kind, ([], 0, 0))
        if group and max(width, n) * (len(group) + 1) <= 2 * (total + n):
            group.append(c)
            open_[kind] = (group, max(width, n), total + n)
        else:
            groups.append([c])
            open_[kind] = (groups[-1], n, n)
    return groups
