"""All MLX and KV-cache work: batched decode, sampling and logprob extraction, and prefill
(runner/prefill.py), over the batch state (runner/batch_state.py) with the decisions taken at
start-up (runner/plan.py).

The runner keeps one batched KV cache whose rows are the running sequences in admission order
(the scheduler's `running` order). A step is launched (its graph queued on the device) and
collected later, so the host can work on one step's outputs while the device runs the next:
decode inputs are the previous step's sampled tokens, read on the device.

What the engine uses of it: the step (`launch`, `collect`, `admit`, `release`, `take_failed`,
`take_time`), the scheduler's look-ups (`cached_len`, `prompt_cache.waits`), the start-up
`plan` and the `speculator` it is given (built from the plan and the `model`), the model's
state between steps (`adapters`, `change_adapter`, `release_adapters`, `load_weights`,
`flush_prefixes`, `sleep`, `wake`, `attach_disk`, `keeps_finished`), the idle loop and its end
(`warm_attention`, `heartbeat`, `idle`, `close`) and what /health shows (`memory`, `health`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.batch.scheduler import SchedulerOutput
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.control import AdapterChange
from omlx_logprobs.logprobs.extract import release_scratch
from omlx_logprobs.logprobs.extractor import Extractor, choose_extractor
from omlx_logprobs.runner import query_blocks
from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.batch_state import BatchState
from omlx_logprobs.runner.fast import attention
from omlx_logprobs.runner.fast.fusion import Fusion
from omlx_logprobs.runner.fast.lean_decode import LeanDecode
from omlx_logprobs.runner.keep import keep_finished
from omlx_logprobs.runner.lora import BASE, AdapterSet
from omlx_logprobs.runner.masks import masked
from omlx_logprobs.runner.plan import make_plan
from omlx_logprobs.runner.prefill import Prefill
from omlx_logprobs.runner.prefix import Key, Prefix
from omlx_logprobs.runner.prefix_cache import PrefixCache
from omlx_logprobs.runner.prompt_cache import PromptCache
from omlx_logprobs.runner.routing import RowSpan, install, routed
from omlx_logprobs.runner.sampler import draw, step_key
from omlx_logprobs.runner.snapshot import make_prefix
from omlx_logprobs.runner.speculation import Speculator
from omlx_logprobs.runner.step import DeviceTime, LaunchedStep, Memory, StepResult, Tallies
from omlx_logprobs.runner.vision import ImageEmbedder
from omlx_logprobs.runner.weights import (
    Layout,
    WeightsError,
    drop_weights,
    load_into,
    read_weights,
)

__all__ = ["ModelRunner"]

log = logging.getLogger("omlx_logprobs")


class ModelRunner:
    # Whether this runner may compile its decode forward (plan.COMPILE_DECODE); a split model's
    # runner may not (distributed/group_runner.py).
    compiles = True
    # Whether this runner records and replays routed experts (runner/routing.py); a split
    # model's may not (its other ranks would route a replayed prompt their own way).
    routes = True

    def __init__(
        self,
        model: Any,
        vocab_size: int,
        cache_limit_mib: int | None = None,
        prefix_cache_mib: int | None = 0,
        stop_ids: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        # Routed experts of a MoE family's rows that ask (runner/routing.py), or None.
        self.routing = install(model) if self.routes else None
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids  # EOS ids: what min_tokens holds back besides stop_token_ids
        self.batch = BatchState()
        self._disk: tuple[str, int] | None = None  # the disk tier's folder and size limit
        self.time = DeviceTime()
        # The parameters' layout while /sleep at level 2 has dropped them (`wake` loads them).
        self.dropped: Layout | None = None
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
        # LoRA adapters (runner/lora.py): each forward first names its rows' adapters.
        self.adapters = AdapterSet(model)
        self.plan = make_plan(
            model, self.templates, self.fusion, prefix_cache_mib, self.compiles, cache_limit_mib
        )
        # Shared prompt prefixes and finished sequences (runner/prefix_cache.py), or None.
        self.prefixes: PrefixCache | None = None
        if self.plan.prefix_mib > 0:
            self.prefixes = PrefixCache(
                self.plan.prefix_mib << 20, self._make_prefix, whole=self.plan.whole
            )
            self.prefixes.min_use = self.plan.min_use
        # Finished sequences kept (the plan's), off while the engine warms (Engine's
        # `_warm_speculation`).
        self.keeps_finished = self.plan.keeps_finished
        # Scored prompts' kept starts, with their entries (runner/prompt_cache.py); not from a
        # state (a scored prompt's entries are kept at every position, a state at one).
        scored = self.plan.keeps_finished and not self.plan.whole
        self.prompt_cache = PromptCache(self.prefixes, self.prefix_key, scored)
        # Where entries are computed: in numpy at collect time on the CPU backend, on the
        # device elsewhere (logprobs/extractor.py); chosen once, here.
        self.extractor: Extractor = choose_extractor(self.plan.cpu)
        self.vision = ImageEmbedder.of(model)  # a vision model's images (runner/vision.py)
        self.prefill = Prefill(
            model, self.templates, self.plan, self.adapters, self.prefixes, self.prompt_cache,
            self.prefix_key, self.extractor, self.batch, self.queue, self._forward_unread,
            self.routing, self.vision,
        )  # fmt: skip
        if self.plan.cache_limit_mib is not None:
            mx.set_cache_limit(self.plan.cache_limit_mib << 20)

    def prefix_key(self, seq: Sequence) -> Key:
        """What a sequence's kept prefixes are keyed by: its adapter's slot and load
        (runner/lora.py) and its cache_salt's namespace."""
        slot, load = self.adapters.key(seq.adapter)
        return slot, load, seq.cache_namespace

    def _make_prefix(self, tokens: tuple[int, ...], base: Prefix | None, key: Key) -> Prefix:
        self.adapters.select([key[0]])
        return make_prefix(self.model, tokens, base)

    def launch(self, work: SchedulerOutput) -> LaunchedStep | None:
        """Queue one step on the device and return at once."""
        batch = self.batch
        assert [s.seq_id for s in work.decode] == [s.seq_id for s in batch.rows]
        # A row that records or replays routing steps without drafts: a verify would record
        # the routing of drafts it then rejects.
        if self.speculator is not None and not work.prefill and not self._routes_rows():
            if (spec := self.speculator.launch(batch, self)) is not None:
                return spec
        parts: list[mx.array] = []
        seqs: list[Sequence] = []
        if batch.rows:
            assert batch.last_tokens is not None
            # Every row took part in the last step, so its input token is there, on the device
            # (in the same rows when none joined or left: then no gather).
            if batch.rows == batch.last_seqs:
                inputs = batch.last_tokens[:, None]
            else:
                rows = mx.array([batch.last_rows[s.seq_id] for s in batch.rows])
                inputs = batch.last_tokens[rows][:, None]
            parts.append(self.forward_batch(inputs))
            seqs += batch.rows
        more, chosen, prompt, prompt_only, pooled = self.prefill.launch(work)
        parts += more
        seqs += chosen
        if prompt or pooled:  # queued now, collected with the step: no sync per scored block
            self.queue(*(x for p in prompt for x in p.arrays()), *(p.hidden for p in pooled))
        routes = self.routing.take() if self.routing is not None else []
        if routes:  # read back with the step that computed them
            self.queue(*(r for _, _, r in routes))
        if not seqs:
            if not prompt and not prompt_only and not routes:
                return None
            return LaunchedStep([], None, prompt, prompt_only, routes=routes, pooled=pooled)
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        step = self._sample(logits, seqs)
        return replace(step, prompt=prompt, prompt_only=prompt_only, routes=routes, pooled=pooled)

    def _routes_rows(self) -> bool:
        """Whether a batch row records or replays routed experts (runner/routing.py)."""
        return self.routing is not None and any(routed(s) for s in self.batch.rows)

    def forward_batch(self, inputs: mx.array, width: int = 0) -> mx.array:
        """The batch rows' logits for `inputs` (`forward_rows`), after their cache's room is
        reserved where caches grow by what their rows may use (`width`: the columns a
        speculative step writes at once) and their adapters are selected."""
        assert self.batch.cache is not None
        if self.plan.tight_cache:
            self.batch.cache.reserve(max(s.to_write for s in self.batch.rows), width)
        self.adapters.select_rows(self.batch.rows)
        return self.forward_rows(inputs)

    def forward_rows(self, inputs: mx.array) -> mx.array:
        """The decoding rows' logits for `inputs` [B, n]: [B, V] for one position (a plain
        step), [B, n, V] for more (a speculative step's verify, where the lean step launches
        about half the graph nodes of the model's forward). Through the decode step chosen at
        start-up where it serves the batch, else the model's forward; with adapters loaded,
        the model's forward (a compiled step would keep the selection it was traced with, the
        lean one calls the joined projections without them)."""
        cache, decode = self.batch.cache, self.plan.decode
        assert cache is not None
        n = inputs.shape[1]
        cache.advance([n] * len(cache))
        if self.routing is not None and self._routes_rows():  # the model's own forward records
            rows = [RowSpan([s], len(s.prompt_ids) + s.num_sampled - 1, n)
                    for s in self.batch.rows]  # fmt: skip
            logits = self.routing.run(lambda: self.model(inputs, cache=cache.layers), rows, n)
            return logits[:, -1, :] if n == 1 else logits
        if not self.adapters.stacks:
            if n == 1 and decode is not None and decode.supports(cache):
                return decode(inputs, cache)
            if isinstance(decode, LeanDecode) and decode.supports(cache, n):
                return decode(inputs, cache)
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
        masks = masked(raw, seqs, self.batch, self.vocab_size, self.stop_ids)
        sampled, dist = draw(masks, params, histories, keys)
        tokens = self._shared(sampled)
        for s in seqs:
            s.num_sampled += 1
        self.batch.sampled(tokens, seqs)
        pending = self.extractor.step(tokens, raw, dist, params)
        self.queue(tokens, *pending.arrays())  # the next step reads these ids on the device
        return LaunchedStep(seqs, pending)

    # ---- hooks a runner split over processes overrides (distributed/group_runner.py) ------------
    def _forward_unread(
        self, ids: mx.array, cache: list[Any], **extra: Any
    ) -> tuple[mx.array, ...]:
        """A forward whose output nothing reads (a prompt's chunk before its last): what must
        be evaluated with the cache (`extra`: the model's keyword arguments)."""
        self.model(ids, cache=cache, **extra)
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
        assert not self.batch.num_cached
        self._weights_from(path)
        self.flush_prefixes()  # the disk tier attached again: the new weights' own folder

    def _weights_from(self, path: str) -> None:
        """Read the weights at `path` into the model (asleep at level 2: checked against the
        layout they had), and rebuild what joined or traced the old ones."""
        encoder = self._encoder_update(path)
        load_into(self.model, path, self.dropped)
        if encoder is not None:
            encoder()
        self.dropped = None
        self.fusion.rejoin()
        if self.plan.decode is not None:
            self.plan.decode.reset()

    def _encoder_update(self, path: str) -> Callable[[], None] | None:
        """A vision model's encoder weights at `path` (a whole checkpoint's), checked before
        any weight is replaced; None for a text model or text weights alone."""
        if self.vision is None:
            return None
        weights = read_weights(path)  # lazily: MLX reads an array when it is used
        try:
            return self.vision.new_weights(weights)
        except ValueError as e:  # the encoder's own arrays do not fit: the old ones stay
            raise WeightsError(f"{path!r}: {e}") from None

    def flush_prefixes(self) -> None:
        """Drop every kept prefix in memory (/flush_cache, /reset_prefix_cache); rows keep
        theirs, and the disk tier (`--kv-cache-dir`, the same weights' folder) stays."""
        if self.prefixes is not None:
            self.prefixes.clear()
            if self._disk is not None:
                self.attach_disk(*self._disk)

    def sleep(self, level: int) -> None:
        """With nothing running (/sleep): the kept prefixes go (level 1), the weights too
        (level 2: each parameter an empty array, what joined or traced them dropped), then
        MLX's buffer cache, so that the memory goes back to the system."""
        assert not self.batch.num_cached
        self.flush_prefixes()
        if level >= 2 and self.dropped is None:
            self.dropped = drop_weights(self.model)
            self.fusion.drop()
            if self.plan.decode is not None:
                self.plan.decode.forget()
        self.idle()

    def wake(self, path: str | None) -> None:
        """After /sleep: weights dropped at level 2 are read again from `path` (runner/weights.py
        checks them against the layout they had); WeightsError leaves them dropped."""
        if self.dropped is None:
            return
        if path is None:
            raise WeightsError("the weights were dropped and no path to load them from is known")
        self._weights_from(path)

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

    def cached_len(self, seq: Sequence) -> int:
        """How many of a whole prompt's tokens a kept prefix holds now (prefixes made in the
        prompt's own step are not foreseen)."""
        if self.routing is not None and routed(seq):  # computed whole: see runner/prefill.py
            return 0
        if seq.scored:
            return self.prompt_cache.held(seq)
        if self.prefixes is None:
            return 0
        return self.prefixes.held(seq.context_ids, self.prefix_key(seq))

    def take_failed(self) -> list[tuple[Sequence, str]]:
        """The prompts whose prefill failed in the launches since the last call, with why: the
        engine ends them alone."""
        return self.batch.take_failed()

    def memory(self) -> Memory:
        """What the runner holds now (for /health)."""
        prefixes = self.prefixes.nbytes if self.prefixes is not None else 0
        active, cache = int(mx.get_active_memory()), int(mx.get_cache_memory())
        return Memory(self.batch.num_cached, active, cache, prefixes)

    def tallies(self) -> Tallies:
        """Disk-tier hits and speculation's drafts since the runner started (/metrics)."""
        disk = self.prefixes.disk if self.prefixes is not None else None
        spec = self.speculator
        return Tallies(
            disk.hits if disk is not None else 0,
            disk.hit_tokens if disk is not None else 0,
            spec.drafted if spec is not None else 0,
            spec.accepted if spec is not None else 0,
        )

    @staticmethod
    def idle() -> None:
        """Nothing is running: give MLX's cached buffers back (device memory on a GPU), and
        the host extraction's buffer."""
        mx.clear_cache()
        release_scratch()

    def queue(self, *arrays: Any) -> None:
        """Queue arrays on the device, the host's time at it counted (`take_time`)."""
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
            result = self.speculator.collect(self.batch, step, step.spec)
            self.time.read_s += time.perf_counter() - t0
            return result
        if step.sampled is not None:
            tokens, finite, logprobs = step.sampled.to_host()
        else:
            tokens, finite, logprobs = np.zeros(0, np.int32), np.ones(0, bool), None
        prompt = [x for p in step.prompt for x in p.to_host()]
        pooled = [x for p in step.pooled for x in p.to_host()]
        for seqs, first, routes in step.routes:
            host = np.array(routes, copy=False)
            for s in seqs:
                s.routes[first] = host
        self.time.read_s += time.perf_counter() - t0
        return StepResult(
            step.seqs, tokens, finite, logprobs, prompt, step.prompt_only, pooled=pooled
        )

    def admit(self, seqs: list[Sequence]) -> None:
        """Move prefilled sequences' caches into the batch, as its last rows, in this order.
        Consecutive rows of one prefill group move with one selection and one extend; a group
        may come back later in the order (groups split prompts by kind)."""
        runs: list[tuple[BatchCache, list[int]]] = []
        batch = self.batch
        for seq in seqs:
            p = batch.prefilled.pop(seq.seq_id)
            if runs and runs[-1][0] is p.cache:
                runs[-1][1].append(p.row)
            else:
                runs.append((p.cache, [p.row]))
        for cache, rows in runs:
            if rows != list(range(len(cache))):
                cache = cache.select(rows)
            if batch.cache is None:
                batch.cache = cache
            else:
                batch.cache.extend(cache)
        batch.rows += seqs

    def release(self, seqs: list[Sequence]) -> None:
        """Forget finished or aborted sequences and free their cache rows; a finished row's
        keys and values (its prompt and output) are kept in the prefix cache first."""
        batch = self.batch
        for s in seqs:
            batch.chunk_caches.pop(s.seq_id, None)
            batch.prefilled.pop(s.seq_id, None)
        gone = {s.seq_id for s in seqs}
        keep = [i for i, s in enumerate(batch.rows) if s.seq_id not in gone]
        if len(keep) == len(batch.rows):
            return
        self._keep_finished([i for i, s in enumerate(batch.rows) if s.seq_id in gone])
        for s in seqs:
            batch.boundaries.pop(s.seq_id, None)
        batch.rows = [batch.rows[i] for i in keep]
        if not keep:
            batch.cache = None
            # Idle: MLX holds only the weights.
            batch.sampled(None, [])
            return
        assert batch.cache is not None
        batch.cache.filter(keep, self.plan.trim_align)

    def _keep_finished(self, rows: list[int]) -> None:
        """Keep these batch rows' keys and values in the prefix cache (runner/keep.py)."""
        if self.prefixes is not None and self.keeps_finished:
            # keys and values computed with a replayed routing are not the model's own
            rows = [r for r in rows if self.batch.rows[r].replay is None]
            key_of, whole = self.prefix_key, self.plan.whole
            keep_finished(self.batch, rows, self.prefixes, self.prompt_cache, key_of, whole)
