"""All MLX and KV-cache work: batched decode, sampling and logprob extraction, and prefill
(runner/prefill.py, a part of this class kept in a module of its own).

The runner keeps one batched KV cache whose rows are the running sequences in admission order
(the scheduler's `running` order). A step is launched (its graph queued on the device) and
collected later, so the host can work on one step's outputs while the device runs the next:
decode inputs are the previous step's sampled tokens, read on the device.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.batch.scheduler import SchedulerOutput
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.logprobs.extract import release_scratch
from omlx_logprobs.logprobs.extractor import Extractor, choose_extractor
from omlx_logprobs.runner import query_blocks
from omlx_logprobs.runner.batch_cache import BatchCache, kinds
from omlx_logprobs.runner.fast import attention, compiled, lean_decode
from omlx_logprobs.runner.fast.fusion import Fusion
from omlx_logprobs.runner.fast.lean_decode import LeanDecode
from omlx_logprobs.runner.grammar import bitmask, open_ended
from omlx_logprobs.runner.lora import BASE, AdapterSet
from omlx_logprobs.runner.prefill import Prefill, Prefilled
from omlx_logprobs.runner.prefix_cache import (
    MIN_TOKENS,
    PrefixCache,
    State,
    break_even,
    default_budget_mib,
)
from omlx_logprobs.runner.probe import probe, resumes_in_a_batch
from omlx_logprobs.runner.prompt_cache import PromptCache
from omlx_logprobs.runner.sampler import MaskState, draw, step_key, token_mask
from omlx_logprobs.runner.snapshot import from_row, keeps_prefixes, keeps_sequences, keeps_states
from omlx_logprobs.runner.speculation import Speculator
from omlx_logprobs.runner.step import DeviceTime, LaunchedStep, StepResult
from omlx_logprobs.runner.weights import load_into
from omlx_logprobs.types import AdapterChange, FinishReason

__all__ = ["ModelRunner"]

log = logging.getLogger("omlx_logprobs")


# On a GPU, MLX keeps every freed buffer for reuse up to about the device's memory: with batch
# and prompt sizes changing every step that grew to ~100 GB on an H200, and host RSS with it.
GPU_CACHE_LIMIT_MIB = 4096
# A left-padded prefill group's width is rounded up to this many tokens on a GPU: MLX's CUDA
# backend keeps host state per kernel shape (CUDA graphs, cuDNN attention plans, in bounded
# caches), which grew RSS with every new (rows, width) pair. On the CPU padding is real compute.
GPU_PREFILL_ALIGN = 32
CPU_PREFILL_ALIGN = 1
# Tests set this to run the GPU's path (extraction on the device, one packed read a step, the
# step processed beside the next launch) on the CPU backend.
FORCE_GPU_PATH = False
# The decode forward compiled (runner/fast/compiled.py), on a GPU only, and only when asked
# (OMLX_COMPILE_DECODE=1): on an H100 it cut the graph's Python (1.49 -> 0.96 ms a step at 64
# rows) but not the launch (5.07 -> 5.61 ms), and a server at c=64 ran slower with it; the lean
# step traced the same way was slower than the lean step as it is (docs/benchmarks.md,
# "Decisions").
COMPILE_DECODE = os.environ.get("OMLX_COMPILE_DECODE") == "1"


class ModelRunner(Prefill):
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
        self.boundaries: dict[int, list[tuple[int, State]]] = {}  # their states (prefill.py)
        self.prefilled: dict[int, Prefilled] = {}  # prompts done, not yet in the batch
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
        # Shared prompt prefixes and finished sequences (runner/prefix_cache.py), or None.
        self.prefixes: PrefixCache | None = self._prefix_cache(prefix_cache_mib)
        # Finished sequences kept: plain KV layers, or whole with their states (snapshot.py).
        self.whole = self.prefixes is not None and self.prefixes.whole
        self.resumes_batched = self._resumes_batched()
        self.keeps_finished = keeps_sequences(self.templates) or self.whole
        # Scored prompts' kept starts, with their entries (runner/prompt_cache.py); not from a
        # state (a scored prompt's entries are kept at every position, a state at one).
        scored = self.keeps_finished and not self.whole
        self.prompt_cache = PromptCache(self.prefixes, self.adapters.key, scored)
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

    def _prefix_cache(self, mib: int | None) -> PrefixCache | None:
        """Plain KV and sliding-window caches: any start of a kept sequence; plain KV and
        recurrent states: whole kept sequences (runner/snapshot.py). `mib` None: a share of
        the memory left after the weights."""
        if mib is None:
            mib = default_budget_mib()
            log.info("prefix cache: %d MiB (a quarter of the memory left after the weights)", mib)
        whole = keeps_states(self.templates)
        if mib > 0 and (keeps_prefixes(self.templates) or whole):
            cache = PrefixCache(mib << 20, self._make_prefix, whole=whole)
            if whole:
                log.info(
                    "prefix cache: sequences kept whole with their recurrent states (%s); a "
                    "prompt resumes from one it starts with",
                    ", ".join(kinds(self.templates)),
                )
            cache.min_use = break_even(self.model)
            if cache.min_use > MIN_TOKENS:
                log.info(
                    "prefix cache: kept starts of %d tokens or more (a forward's fixed cost here "
                    "is that many tokens' compute; shorter ones are computed)",
                    cache.min_use,
                )
            return cache
        if mib > 0:
            log.info(
                "prefix cache off for this model: its caches (%s) are neither keys and values "
                "nor recurrent states beside them; every prompt prefills in full",
                ", ".join(kinds(self.templates)),
            )
        return None

    def _resumes_batched(self) -> bool:
        """Rows resumed from states prefill in one right-padded forward where the family's
        recurrent layers take each row's length (probe.py), else one at a time."""
        if not self.whole:
            return False
        together = resumes_in_a_batch(self.model, self.templates, self.model)
        how = "together, right-padded" if together else "one at a time"
        log.info("prefix cache: prompts resumed from kept states prefill %s", how)
        return together

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
            parts.append(self.forward_rows(inputs))
            seqs += self.rows
        more, chosen, prompt, prompt_only = self._prefill(work)
        parts += more
        seqs += chosen
        if prompt:  # queued now, collected with the step: no sync per scored block
            self._queue(*(x for p in prompt for x in p.arrays()))
        if not seqs:
            if not prompt and not prompt_only:
                return None
            return LaunchedStep([], None, prompt, prompt_only)
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return replace(self._sample(logits, seqs), prompt=prompt, prompt_only=prompt_only)

    def forward_rows(self, inputs: mx.array) -> mx.array:
        """The decoding rows' logits for `inputs` [B, n]: [B, V] for one position (a plain
        step), [B, n, V] for more (a speculative step's verify, where the lean step launches
        about half the graph nodes of the model's forward). Through the decode step chosen at
        start-up where it serves the batch, else the model's forward; with adapters loaded,
        the model's forward (a compiled step would keep the selection it was traced with, the
        lean one calls the joined projections without them)."""
        cache = self.batch_cache
        assert cache is not None
        n = inputs.shape[1]
        cache.advance([n] * len(cache))
        if not self.adapters.stacks:
            if n == 1 and self.decode is not None and self.decode.supports(cache):
                return self.decode(inputs, cache)
            if isinstance(self.decode, LeanDecode) and self.decode.supports(cache, n):
                return self.decode(inputs, cache)
        logits = self.model(inputs, cache=cache.layers)
        return logits[:, -1, :] if n == 1 else logits

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
        sampled, dist = draw(self._mask(raw, seqs), params, histories, keys)
        tokens = self._shared(sampled)
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

    def warm_attention(self, chunk: int, context: int) -> None:
        """On CUDA with cuDNN's attention on: its graphs for the padded shapes long prefills
        take, built on the thread that will launch the steps (MLX keeps them per thread)
        rather than inside a request (runner/query_blocks.py). The probe forward is the base
        model's, whatever adapters are loaded."""
        t0 = time.perf_counter()

        def forward() -> None:
            self.adapters.select([BASE])
            mx.eval(self.model(mx.array([[0, 1]]), cache=make_prompt_cache(self.model)))

        try:
            built = query_blocks.warm(forward, chunk, context)
        except Exception as e:  # an optimisation: a model it cannot probe still serves
            log.warning("cuDNN attention: graphs not built at start-up (%s): the first prefill "
                        "of each padded shape builds its own", e)  # fmt: skip
            return
        if built:
            log.info("cuDNN attention: %d graphs built for prefills of up to %d tokens over "
                     "%d in %.1f s", built, chunk, context, time.perf_counter() - t0)  # fmt: skip

    def attach_disk(self, root: str, mib: int) -> None:
        """Give the prefix cache its disk tier (`--kv-cache-dir`), keyed by the weights."""
        from omlx_logprobs.runner.disk_tier import DiskTier, fingerprint

        if self.prefixes is None or not self.keeps_finished:
            log.info("--kv-cache-dir unused: this model's sequences are not kept (prefix cache"
                     " off, or caches other than plain keys and values)")  # fmt: skip
            return
        self._disk = (root, mib)
        try:
            self.prefixes.disk = DiskTier(root, mib << 20, fingerprint(self.model))
        except OSError as e:  # a folder that cannot be made: the memory tier serves alone
            log.warning("--kv-cache-dir %s unusable (%s): no disk tier", root, e)

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
        for s in seqs:
            self.boundaries.pop(s.seq_id, None)
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
            if self.whole:  # a state is the row's after every token fed: all of them
                n = min(cache.fed[i], n + 1)
            assert n <= cache.width - cache.pads[i] or not cache.width
            if n < self.prefixes.min_use and not seq.scored:  # too short to pay: no copy
                continue
            prefix = from_row(seq.prompt_ids, seq.output_ids, n, cache.layers, i, cache.pads[i])
            prefix = self.prompt_cache.finished(seq, prefix)  # a scored one's, with its entries
            # The copies now, with the step: until then they would hold the batch's arrays.
            mx.async_eval(prefix.keys, prefix.values)
            self.prefixes.keep(self.adapters.key(seq.adapter), prefix)
            if at := self.boundaries.get(seq.seq_id):
                self.prefixes.keep_boundaries(self.adapters.key(seq.adapter), prefix, at)
