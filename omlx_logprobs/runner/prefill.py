"""Prompts into keys and values: whole prompts in left-padded groups (each group from the kept
prefix its prompts share), long ones chunk by chunk in a one-row cache, scored ones with their
prompt entries; a prefill that fails ends its own prompts, not the batch.

`Prefill` is handed the runner's parts (runner/model_runner.py) and its batch state
(runner/batch_state.py), into which it writes what it prefills: prompts between their chunks,
prompts done and waiting for admission, a recurrent prompt's boundary states, prompts that
failed. model_runner.py keeps decode, sampling, the batch's rows and the device boundary.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.batch.scheduler import PrefillChunk, SchedulerOutput
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.logprobs.extractor import PROMPT_BLOCK, Extractor
from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.batch_state import BatchState, Prefilled
from omlx_logprobs.runner.lora import AdapterSet
from omlx_logprobs.runner.plan import Plan
from omlx_logprobs.runner.pooling import PendingPooled, last_hidden
from omlx_logprobs.runner.prefix import Key, Prefix
from omlx_logprobs.runner.prefix_cache import PrefixCache
from omlx_logprobs.runner.prompt_cache import PromptCache
from omlx_logprobs.runner.prompt_scoring import PendingPrompts, chunk_slice, score, score_key
from omlx_logprobs.runner.routing import Routing, RowSpan, routed
from omlx_logprobs.runner.snapshot import (
    from_cache,
    from_row,
    kv_bytes_per_token,
    resume_rows,
    seed,
    states_nbytes,
    states_of,
)
from omlx_logprobs.runner.vision import ImageEmbedder

__all__ = ["Prefill"]

T = TypeVar("T")

log = logging.getLogger("omlx_logprobs")

# A prefill whose attention spans this many (query, key) pairs or more is queued apart from the
# step (`_settle`): its failure then ends its own requests only.
SETTLE_PAIRS = 1 << 24


# A forward whose output nothing reads (a prompt's chunk before its last): what must be
# evaluated with the cache (ModelRunner._forward_unread).
# Keyword arguments: the model's own (a prompt's input embeddings, runner/vision.py).
ForwardUnread = Callable[..., tuple[mx.array, ...]]


class Prefill:
    def __init__(
        self,
        model: Any,
        templates: list[Any],
        plan: Plan,
        adapters: AdapterSet,
        prefixes: PrefixCache | None,
        prompt_cache: PromptCache,
        key_of: Callable[[Sequence], Key],
        extractor: Extractor,
        batch: BatchState,
        queue: Callable[..., None],
        forward_unread: ForwardUnread,
        routing: Routing | None = None,
        vision: ImageEmbedder | None = None,
    ) -> None:
        """The runner's parts that prefilling reads and its batch state, which it writes;
        `queue` queues arrays on the device, timed (ModelRunner.queue); `key_of`: a prompt's
        prefix-cache key, its adapter's and its namespace (runner/prefix.py); `routing` records
        and replays routed experts (runner/routing.py); `vision` puts a prompt's images in its
        input embeddings (runner/vision.py)."""
        self.model = model
        self.templates = templates
        self.plan = plan
        self.split = plan.split
        self.adapters = adapters
        self.prefixes = prefixes
        self.prompt_cache = prompt_cache
        self.key_of = key_of
        self.extractor = extractor
        self.batch = batch
        self.queue = queue
        self.forward_unread = forward_unread
        self.routing = routing
        self.vision = vision

    def launch(
        self, work: SchedulerOutput
    ) -> tuple[
        list[mx.array], list[Sequence], list[PendingPrompts], list[Sequence], list[PendingPooled]
    ]:
        """The step's prompts: the logits of those that sample now and their sequences (a row
        per choice), the scored prompts' pending entries, the prompts done with no output, and
        the embedding prompts' hidden states (runner/pooling.py; they are prompts done too)."""
        pooled: list[PendingPooled] = []
        parts: list[mx.array] = []
        seqs: list[Sequence] = []
        # Whole prompts prefill together in left-padded groups, scored ones in groups of their
        # own; partial chunks and prompts with forks take the one-prompt path.
        grouped = [c for c in work.prefill if self._groupable(c)]
        grouped, prefixes, resumed = self._resumed(grouped, self._prefixes(grouped))
        prompt: list[PendingPrompts] = []
        prompt_only: list[Sequence] = []
        todo = deque(_groups(grouped, prefixes))
        todo += _groups([c for c in work.prefill if c.seq.seq_id in resumed], {})
        while todo:
            group = todo.popleft()
            try:
                if group[0].seq.seq_id in resumed:
                    logits = self._resume_group(group, [resumed[c.seq.seq_id] for c in group])
                    pending = None
                else:
                    prefix = prefixes.get(group[0].seq.seq_id)
                    logits, pending = self._prefill_group(group, prefix)
                self._settle([c.seq for c in group], logits)
            except Exception as exc:
                if len(group) > 1:  # each prompt alone, next: only the one at fault fails
                    todo.extendleft([c] for c in reversed(group))
                else:
                    self._prefill_failed([group[0].seq], exc)
                continue
            prompt += [pending] if pending is not None else []
            if group[0].seq.embed:  # a group of embedding prompts: `logits` are hidden states
                pooled.append(PendingPooled([c.seq for c in group], logits))
            sampled = [i for i, c in enumerate(group) if c.seq.params.max_tokens > 0]
            prompt_only += [c.seq for c in group if c.seq.params.max_tokens == 0]
            if sampled:
                part = logits if len(sampled) == len(group) else logits[mx.array(sampled)]
                parts.append(part)
                seqs += [group[i].seq for i in sampled]
        for chunk in work.prefill:
            if chunk in grouped or chunk.seq.seq_id in resumed:
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
            if chunk.seq.embed:
                pooled.append(PendingPooled([chunk.seq], last))
            if chunk.seq.params.max_tokens == 0:
                prompt_only += chunk.seq.group
            elif members := chunk.seq.joining():  # one row per choice: forks sample here too
                parts.append(mx.broadcast_to(last, (len(members), last.shape[-1])))
                seqs += members
        return parts, seqs, prompt, prompt_only, pooled

    def _settle(self, seqs: list[Sequence], logits: mx.array | None) -> None:
        """Queue a large prefill now, apart from the step: MLX allocates an op's buffers as it
        queues it, so an allocation that fails raises here and fails these prompts alone, not
        every row of the batch. Queued, not waited for: the host builds the next chunk while
        the device runs this one. Small ones stay in the step's one graph; a chunk before a
        prompt's last (no logits) was queued apart already (`_prefill_chunk`)."""
        if logits is None:
            return
        context = max(s.prompt_len for s in seqs)
        if context * sum(s.prompt_len - s.cached_tokens for s in seqs) < SETTLE_PAIRS:
            return
        arrays: list[Any] = [logits]
        for s in seqs:  # a last chunk's one-row cache is gone by now: its rows' caches hold it
            if (p := self.batch.prefilled.get(s.seq_id)) is not None:
                arrays += [c.state for c in p.cache.layers]
        self.queue(*arrays)

    def _prefill_failed(self, seqs: list[Sequence], exc: Exception) -> None:
        log.error("prefill of %d prompt(s) failed: %s", len(seqs), exc)
        for s in seqs:
            for m in s.group:
                self.batch.prefilled.pop(m.seq_id, None)
            self.batch.chunk_caches.pop(s.seq_id, None)
            self.batch.failed.append((s, f"the prompt could not be prefilled: {exc}"))

    def _groupable(self, c: PrefillChunk) -> bool:
        """A whole prompt with one choice (every batch form takes left padding); a scored one
        also needs the head apart from the body (to run it on its positions block by block).
        A prompt with images groups as any other of a KV model; else it takes the one-prompt
        path (its input embeddings go with each of its chunks)."""
        if not (c.start == 0 and c.is_last and not c.seq.forks):
            return False
        if c.seq.images and (self.plan.whole or self.routing is not None):
            return False  # resumed from a state, or routed: with images, alone
        return not c.seq.scored or self.plan.split_head

    def _routed(self, rows: list[RowSpan], width: int, forward: Callable[[], T]) -> T:
        """`forward()` over `rows` of `width` columns, recording and replaying routed experts
        when one of its rows asks (runner/routing.py); else as it is."""
        if self.routing is None or not any(routed(r.seqs[0]) for r in rows):
            return forward()
        return self.routing.run(forward, rows, width)

    def _head(self, h: mx.array) -> mx.array:
        assert self.split is not None
        return self.split.head(h)

    def _last_logits(self, ids: mx.array, cache: list[Any], **extra: Any) -> mx.array:
        """[B, V] logits of the last position only (`extra`: the model's keyword arguments)."""
        if self.split is None:
            return self.model(ids, cache=cache, **extra)[:, -1, :]
        return self._head(self.split.body(ids, cache=cache, **extra)[:, -1:, :])[:, 0, :]

    def _last_hidden(self, ids: mx.array, cache: list[Any]) -> mx.array:
        """[B, H] hidden states of the last position (embedding prompts)."""
        return last_hidden(self.split.body if self.split is not None else None, ids, cache)

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
        width += -width % self.plan.prefill_align + start
        pads = [width - c.end for c in group]
        ids = mx.array([([0] * p + c.seq.context_ids)[start:] for p, c in zip(pads, group)])
        extra = self._embedded(ids, [(c.seq, start - p) for c, p in zip(group, pads)])
        if prefix is None:
            cache = BatchCache.for_prompts(self.templates, pads)
        else:
            cache = BatchCache.seeded(self.templates, prefix.keys, prefix.values, pads)
        if self.plan.tight_cache:
            cache.reserve(max(c.seq.to_write for c in group), width - start)
        cache.advance([c.end for c in group])
        self.adapters.select_rows([c.seq for c in group])
        for row, c in enumerate(group):
            c.seq.cached_tokens = max(start - pads[row], 0)
            if c.seq.params.max_tokens > 0:
                self.batch.prefilled[c.seq.seq_id] = Prefilled(cache, row)
        if self.vision is not None:  # each prompt's decode positions (multimodal ones)
            self.vision.shift(cache, [(row, c.seq, c.end) for row, c in enumerate(group)])
        # Each row's computed positions (routed experts): from after the prefix or the padding,
        # whichever ends later.
        spans = [RowSpan(c.seq.group, f, c.end - f, max(p - start, 0))
                 for c, p in zip(group, pads) for f in [max(start - p, 0)]]  # fmt: skip
        if not scored:
            embed = group[0].seq.embed  # an embedding group's rows all embed

            def last() -> mx.array:
                if embed:
                    return self._last_hidden(ids, cache.layers)
                return self._last_logits(ids, cache.layers, **extra)

            logits = self._routed(spans, width - start, last)
            cache.finish_prefill()
            return logits, None
        assert self.split is not None
        body = self.split.body
        h = self._routed(spans, width - start, lambda: body(ids, cache=cache.layers, **extra))
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
        keep = [
            x
            for r, (c, p) in enumerate(zip(group, pads))
            if c.seq.replay is None  # entries of a replayed routing are not the model's own
            for x in self.prompt_cache.keep(
                c.seq, partial(from_row, c.seq.prompt_ids, np.zeros(0), c.end, cache.layers, r, p)
            )
        ]
        pending = score(
            slices, lambda a, b: self._head(hidden[a:b]), self.extractor, served, tuple(keep)
        )
        return self._head(h[:, -1, :]), pending

    def _resumed(
        self, grouped: list[PrefillChunk], prefixes: dict[int, Prefix]
    ) -> tuple[list[PrefillChunk], dict[int, Prefix], dict[int, Prefix]]:
        """(left-padded prompts, their kept starts, prompts resumed from states together). A
        row resumed from a state cannot be left-padded (its padding would fall between the
        state and its tokens): rows resumed prefill right-padded together where the family
        allows it, else each alone from its state (the one-prompt path)."""
        if self.prefixes is None or not self.prefixes.whole or not prefixes:
            return grouped, prefixes, {}
        cold = [c for c in grouped if c.seq.seq_id not in prefixes]
        return cold, {}, prefixes if self.plan.resumes_batched else {}

    def _resume_group(self, group: list[PrefillChunk], starts: list[Prefix]) -> mx.array:
        """Whole prompts, each resumed from the kept state it starts with, in one right-padded
        forward (snapshot.resume_rows): their last logits; the rows wait in the group's cache
        for admission."""
        news = [c.seq.context_ids[len(p.tokens) : c.end] for c, p in zip(group, starts)]
        rows = resume_rows(self.model, self.templates, starts, news)
        self.adapters.select_rows([c.seq for c in group])
        idx = mx.arange(len(group))
        if self.split is None:
            logits = self.model(rows.ids, cache=rows.layers)[idx, rows.last]
        else:
            h = self.split.body(rows.ids, cache=rows.layers)[idx, rows.last]
            logits = self._head(h[:, None, :])[:, 0, :]
        rows.finish()
        cache = BatchCache(rows.layers, rows.pads, rows.fed)
        for row, (c, p) in enumerate(zip(group, starts)):
            c.seq.cached_tokens = len(p.tokens)
            if c.seq.params.max_tokens > 0:
                self.batch.prefilled[c.seq.seq_id] = Prefilled(cache, row)
        return logits

    def _prefixes(self, chunks: list[PrefillChunk]) -> dict[int, Prefix]:
        """By seq_id, the kept prefix each whole prompt starts from: for plain prompts, made
        here where two prompts that began alike share one (evaluated with the step); for
        scored ones, one that keeps their prompt entries too."""
        if self.prefixes is None:
            return {}
        # Prompts that record or replay routed experts are computed whole: a kept prefix's
        # routing was not recorded, and one computed with a replayed routing is not kept.
        chunks = [c for c in chunks if self.routing is None or not routed(c.seq)]
        if self.prefixes.whole:  # a state resumed would give logits (`_resume_group`)
            chunks = [c for c in chunks if not c.seq.embed]
        plain = [c for c in chunks if not c.seq.scored and not c.seq.images]
        scored = [c for c in chunks if c.seq.scored]
        keys = [self.key_of(c.seq) for c in plain]
        found = self.prefixes.assign([c.seq.context_ids for c in plain], keys)
        found += self.prompt_cache.starts([c.seq for c in scored])
        # Plain prompts with images take kept starts but make none: a start is made by a
        # forward of its tokens alone, which has no images (scored ones' starts are only
        # found).
        pictured = [c for c in chunks if c.seq.images and not c.seq.scored]
        prefixes = self.prefixes
        found += [prefixes.longest(c.seq.context_ids, c.end - 1, self.key_of(c.seq))
                  for c in pictured]  # fmt: skip
        chunks = plain + scored + pictured
        return {c.seq.seq_id: p for c, p in zip(chunks, found) if p is not None}

    def _chunk_cache(self, chunk: PrefillChunk) -> tuple[list[Any], int, Prefix | None]:
        """A prompt's one-row cache between its chunks, where this chunk's forward starts, and
        the kept prefix it started from. At the prompt's first chunk, the cache is seeded with
        the longest kept start (a scored prompt's: with its entries; the scheduler started the
        chunk there; should that prefix be gone since, the forward starts from what is kept)."""
        seq = chunk.seq
        cache = self.batch.chunk_caches.get(seq.seq_id)
        if cache is not None:
            return cache, chunk.start, None
        cache = self.batch.chunk_caches[seq.seq_id] = make_prompt_cache(self.model)
        found = None
        if self.routing is not None and routed(seq):  # computed whole (`_prefixes`)
            pass
        elif seq.scored:
            found = self.prompt_cache.start(seq, chunk.end - 1)
        elif self.prefixes is not None:
            found = self.prefixes.longest(seq.context_ids, chunk.end - 1, self.key_of(seq))
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
        extra = self._embedded(ids, [(seq, start)])
        self.adapters.select_rows([seq])
        scored: Any = None
        unread: tuple[mx.array, ...] = ()
        span, n = [RowSpan(seq.group, start, chunk.end - start)], chunk.end - start
        if seq.scored:  # every position's logits but those of a kept start: the prompt is scored
            out = self._routed(span, n, lambda: self.model(ids, cache=cache, **extra))[0]
            rows = chunk_slice(seq, start, out.shape[0])
            served = (found.scores.served(seq, start),) if found and found.scores else ()
            keep = []
            if chunk.is_last and seq.replay is None:  # the whole prompt's keys and values
                keep = self.prompt_cache.keep(seq, lambda: from_cache(seq.prompt_ids, cache))
            scored = score([rows], lambda a, b: out[a:b], self.extractor, served, tuple(keep))
            logits = out[-1:, :]
        elif chunk.is_last:
            if seq.embed:
                logits = self._routed(span, n, lambda: self._last_hidden(ids, cache))
            else:
                logits = self._routed(span, n, lambda: self._last_logits(ids, cache, **extra))
        else:
            # Lazy: evaluating only the cache skips the head. Split over processes, the
            # forward's output is evaluated too (distributed/group_runner.py).
            unread = self._routed(span, n, lambda: self.forward_unread(ids, cache, **extra))
        if not chunk.is_last:
            kept = self._boundary(seq, cache, chunk.end)
            # Bound the lazy graph between chunks.
            self.queue([c.state for c in cache], *unread, *kept)
            return None, scored
        del self.batch.chunk_caches[seq.seq_id]
        members = seq.joining()
        if members:  # one copy of the prompt's cache per choice, rows in choice order
            rows_cache = BatchCache.of_copies(cache, len(members), chunk.end)
            if self.vision is not None:
                self.vision.shift(rows_cache, [(r, seq, chunk.end) for r in range(len(members))])
            for row, m in enumerate(members):
                self.batch.prefilled[m.seq_id] = Prefilled(rows_cache, row)
        return logits, scored

    def _embedded(self, ids: mx.array, rows: list[tuple[Sequence, int]]) -> dict[str, Any]:
        """The forward's keyword arguments for `ids`: their input embeddings where a row holds
        image positions, and where a row's prompt has images its family's multimodal positions
        (runner/vision.py), else none. `rows`: each row's sequence and the prompt position of
        its column 0."""
        if not any(seq.images for seq, _ in rows):
            return {}
        if self.vision is None:  # a model loaded without its encoder (split over processes)
            raise ValueError("this engine's model has no vision encoder: it takes no images")
        return self.vision.inputs(ids, rows)

    def _boundary(self, seq: Sequence, cache: list[Any], n: int) -> list[mx.array]:
        """A recurrent model's states after a chunk, n tokens into the prompt (copies), where
        the keys and values since the last kept boundary weigh at least as much as the states:
        what the prompt keeps beside its sequence (pure state models keep none)."""
        if self.prefixes is None or not self.prefixes.whole:
            return []
        per_token, weight = kv_bytes_per_token(cache), states_nbytes(cache)
        kept = self.batch.boundaries.setdefault(seq.seq_id, [])
        since = n - (kept[-1][0] if kept else 0)
        if per_token == 0 or since * per_token < weight:
            return []
        states = states_of(cache)  # copies only of what is kept
        kept.append((n, states))
        return [a for s in states for a in s]


def _groups(chunks: list[PrefillChunk], prefixes: dict[int, Prefix]) -> list[list[PrefillChunk]]:
    """Split whole prompts into forward groups, in order: by the cached prefix they start from,
    scored prompts apart from plain ones and by `score_key`, embedding prompts apart, and so
    that left padding never more than doubles a group's tokens."""
    groups: list[list[PrefillChunk]] = []
    open_: dict[object, tuple[list[PrefillChunk], int, int]] = {}  # kind -> (group, width, total)
    for c in chunks:
        p = c.seq.params
        # One kept prefix seeds a whole group (prefixes of different adapters may hold the same
        # tokens, so the prefix itself is the kind)
        prefix = prefixes.get(c.seq.seq_id)
        kind: object = ("prefix", id(prefix) if prefix is not None else None)
        if c.seq.embed:  # their forward stops at the hidden states
            kind = ("embed", kind)
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
