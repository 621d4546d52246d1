"""The engine: one thread owns all MLX work and runs the step loop. Requests, aborts, weight
updates, adapters and pauses come in as typed commands (engine/commands.py) through a
thread-safe inbox; what leaves is `RequestOutput`s, handed to a sink once a step
(transport/client.py moves them to the API, from this process or from a child)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from omlx_logprobs import heap
from omlx_logprobs.batch.scheduler import Scheduler, SchedulerOutput
from omlx_logprobs.batch.sequence import Sequence, Status
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.commands import (
    Abort,
    Command,
    PendingAdapter,
    PendingControl,
    PendingUpdate,
    Submit,
)
from omlx_logprobs.engine.overlap import Overlap
from omlx_logprobs.engine.processor import OutputProcessor
from omlx_logprobs.engine.stats import EngineStats, StepStats
from omlx_logprobs.runner.grammar import GrammarError, Grammars
from omlx_logprobs.runner.lora import AdapterError
from omlx_logprobs.runner.model_runner import ModelRunner
from omlx_logprobs.runner.speculation import speculator
from omlx_logprobs.runner.step import LaunchedStep
from omlx_logprobs.runner.weights import WeightsError
from omlx_logprobs.types import (
    INITIAL_WEIGHTS,
    AdapterChange,
    Control,
    ControlResult,
    EngineRequest,
    FinishReason,
    PauseMode,
    RequestOutput,
    SamplingParams,
    WeightUpdate,
    WeightUpdateResult,
    WeightVersion,
)
from omlx_logprobs.vocab import Vocabulary

log = logging.getLogger("omlx_logprobs")
SMALL_BATCH = 4
IDLE_WAIT_S = 0.5  # an idle engine looks at its inbox at least this often

Sink = Callable[[list[RequestOutput]], None]


class Engine:
    def __init__(
        self,
        model: Any,
        vocab: Vocabulary,
        eos: tuple[int, ...],
        cfg: EngineConfig,
        sink: Sink | None = None,
        weights: WeightVersion = INITIAL_WEIGHTS,
        tokenizer: Any = None,
        runner: type[ModelRunner] | Callable[..., ModelRunner] = ModelRunner,
        adapters: tuple[tuple[str, str], ...] = (),
        context: int = 0,
    ):
        """`runner`: the model runner's class, or a factory taking its arguments (a model
        split over processes has its own: distributed/distributed.py). `context`: the longest
        prompt and output the model serves (0: `cfg.max_model_len`, else 32k)."""
        self.cfg = cfg
        # Constrained decoding's matchers need the Hugging Face tokenizer (runner/grammar.py).
        self.grammars = Grammars(tokenizer, len(vocab), tuple(eos))
        self.runner = runner(
            model, len(vocab), cfg.cache_limit_mib, cfg.prefix_cache_mib, tuple(eos)
        )
        self.runner.speculator = speculator(cfg, self.runner.plan, self.runner.model, vocab)
        # Built on the engine's thread as it starts (`_loop`): MLX keeps cuDNN's graphs per thread.
        self._warm = (cfg.prefill_chunk, context or cfg.max_model_len or 1 << 15)
        if cfg.kv_cache_dir is not None:
            self.runner.attach_disk(cfg.kv_cache_dir, cfg.kv_cache_disk_mib)
        for name, path in adapters:  # --lora, or those loaded before a restart or a reload
            self.runner.change_adapter(AdapterChange(name, path))
        self.scheduler = Scheduler(
            cfg.max_num_seqs,
            cfg.prefill_chunk,
            cfg.prefill_delay_ms / 1e3,
            cached=self.runner.cached_len,
            waits=self.runner.prompt_cache.waits,
        )
        self.processor = OutputProcessor(vocab, eos)
        self.processor.weights = weights
        # Weight updates asked for, oldest first, and the requests that arrived after one was:
        # they start on the new weights (runner/weights.py; docs/specs/rl.md).
        self._updates: list[PendingUpdate] = []
        self._held: list[Sequence] = []
        # Called once a step (and once an idle wait) with the outputs made since the last call,
        # perhaps none; on a GPU from the thread that processed the step.
        self.sink: Sink = sink or (lambda outputs: None)
        self.overlap = Overlap(self._process, aside=self.runner.plan.overlaps)
        self.stats = StepStats()
        self._inflight_first = False  # the step in flight samples some prompt's first token
        # Unfinished requests' choices (aborts), as submitted: a retraction splits a prompt's
        # choices, which then prefill apart.
        self._live: dict[str, list[Sequence]] = {}
        # Paused (docs/specs/rl.md): the mode, and pauses waiting to be answered (a wait
        # pause once nothing runs, a halting one once the step in flight is processed).
        self._paused: PauseMode | None = None
        self._pausing: list[tuple[PauseMode, int, Future[ControlResult]]] = []  # mode, aborted
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closing_at: float | None = None  # after this monotonic time, fail what is left
        self._aborted = {Status.WAITING: 0, Status.RUNNING: 0}
        self._busy = False  # stepped since the engine was last idle
        self._cached = False  # MLX may hold freed buffers from the last busy spell
        self._thread = threading.Thread(target=self._loop, name="omlx-engine", daemon=True)
        self._warmed = threading.Event()  # the start-up warms are done (`start`)

    # ---- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; return once its start-up warms (cuDNN's attention graphs,
        speculation's shapes) are done, so that a server says it is ready only when a first
        request no longer waits behind them."""
        self._thread.start()
        self._warmed.wait()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def begin_shutdown(self, grace_s: float) -> None:
        """In-flight requests may finish for grace_s seconds; then they end with an error."""
        self._closing_at = time.monotonic() + grace_s
        self._wake.set()

    def submit(self, req: EngineRequest) -> None:
        self._inbox.put(Submit(req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """End every unfinished choice of the request (unknown or finished ids are ignored)."""
        self._inbox.put(Abort(request_id))
        self._wake.set()

    def update_weights(self, update: WeightUpdate) -> Future[WeightUpdateResult]:
        """New weights once the requests in flight have finished (or been aborted, as the update
        asks); the future's result says which version serves from then on."""
        done: Future[WeightUpdateResult] = Future()
        self._inbox.put(PendingUpdate(update, done, time.monotonic()))
        self._wake.set()
        return done

    def control(self, command: Control) -> Future[ControlResult]:
        """Pause, resume or flush between two steps; the future's result once done (a pause
        that waits for its requests is answered when they have finished)."""
        done: Future[ControlResult] = Future()
        self._inbox.put(PendingControl(command, done))
        self._wake.set()
        return done

    def change_adapter(self, change: AdapterChange) -> Future[str | None]:
        """Load, replace or unload a LoRA adapter between two steps; the future's result is
        None, or why nothing changed."""
        done: Future[str | None] = Future()
        self._inbox.put(PendingAdapter(change, done))
        self._wake.set()
        return done

    @property
    def weights(self) -> WeightVersion:
        return self.processor.weights

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or not self._stop.is_set()

    def snapshot(self) -> EngineStats:
        memory = self.runner.memory()
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            cached_sequences=memory.sequences,
            step_in_flight=self.overlap.inflight is not None,
            active_memory=memory.active,
            prefix_cache_bytes=memory.prefixes,
            cache_memory=memory.cache,
            aborted_waiting=self._aborted[Status.WAITING],
            aborted_running=self._aborted[Status.RUNNING],
            weights=self.processor.weights,
            updating=bool(self._updates),
            paused=self._paused.value if self._paused is not None else None,
            distributed=self.runner.health(),
        )

    # ---- engine thread ------------------------------------------------------------------------
    def step(self) -> None:
        """Schedule -> launch -> process the previous step while the device runs this one (on a
        GPU beside the launch, on a second thread) -> admit the new prompts -> free."""
        inflight = self.overlap.inflight
        if inflight is not None and (
            inflight.spec is not None or self._needs_history() or self._first_waits()
        ):
            # A first token goes out before the next launch. A speculative step's collect rolls
            # the cache back and sets the next inputs: MLX arrays, which the thread that
            # launches must make (a lazy array of another thread's stream fails there).
            self._free(self.overlap.finish())
        t0 = time.perf_counter()
        work = self.scheduler.schedule()
        launched = self.overlap.launch(self.runner.launch, work)
        t1 = time.perf_counter()
        finished = self.overlap.finish()
        # A prefill that failed ends its prompt's choices alone.
        for seq, why in self.runner.take_failed():
            for s in seq.group:
                if s.status is not Status.FINISHED:
                    self._end(s, FinishReason.ERROR, why)
        self._free(finished, work)
        self.overlap.inflight = launched
        self._record(work, launched, t1 - t0, time.perf_counter() - t1)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.overlap.inflight is not None

    def _process(self, step: LaunchedStep) -> list[Sequence]:
        """A launched step's outputs and stops, handed over at once; the sequences that
        finished. Safe beside the next launch: it reads only arrays queued with its step (an
        MLX stream belongs to the thread that made it), and the two write different fields of
        the records. The launch reads one field this may change, a prompt's choices' statuses
        (`joining`: only non-finite prompt logits end them here), which the admission re-reads
        after the wait."""
        t0 = time.perf_counter()
        finished = self.processor.process(self.runner.collect(step))
        self.flush()
        if self.runner.plan.overlaps:  # the step trace's ASIDE columns: the second thread's work
            self.stats.aside = (t0, time.perf_counter())
        return finished

    def _free(self, finished: list[Sequence], work: SchedulerOutput | None = None) -> None:
        """Admit the prompts `work` prefilled (in the order the scheduler appends them to
        `running`, the batch's row order; a prompt's forks right after it), then release what
        finished: its cache rows and its place in the scheduler."""
        if work is not None:
            done = [s for c in work.prefill if c.is_last for s in c.seq.joining()]
            if done:
                self.runner.admit(done)
            self.scheduler.update(work)
        self.runner.release(finished)
        self.scheduler.drop_finished()

    def _record(
        self, work: SchedulerOutput, step: LaunchedStep | None, launch: float, rest: float
    ) -> None:
        self._inflight_first = any(c.is_last for c in work.prefill)
        rows = len(step.seqs) if step is not None else 0
        prefill = sum(c.end - c.start for c in work.prefill)
        cached = sum(c.seq.cached_tokens for c in work.prefill)
        self.stats.add(rows, prefill, cached, launch, rest, self.runner.take_time())

    def _first_waits(self) -> bool:
        # A first token is latency a client sees; with a small batch, overlapping the next
        # step with its processing gains little, so it is processed before the next launch.
        return self._inflight_first and len(self.scheduler.running) <= SMALL_BATCH

    def _needs_history(self) -> bool:
        # Penalties read every earlier token, and a grammar's next mask follows from the last
        # token, so the step in flight must be processed first; so do drafts.
        running = self.scheduler.running
        spec = self.runner.speculator
        if spec is not None and spec.wants(running):
            return True
        return any(s.params.penalizes or s.grammar is not None for s in running)

    def _loop(self) -> None:
        try:
            self.runner.warm_attention(*self._warm)
            self._warm_speculation()
        except Exception:  # speed-ups: a fault in one must not keep the engine from serving
            log.exception("engine: the start-up warm failed")
        finally:
            self._warmed.set()
        while not self._stop.is_set():
            self._drain_inbox()
            if self.runner.adapters.retiring:
                self._release_adapters()
            if self._halted and self.overlap.inflight is not None:
                self._free(self.overlap.finish())  # the step in flight ends the run
            if self._pausing:
                self._answer_pauses()
            if self._updates and (not self.has_work() or self._halted):
                self._swap_weights()
            if self._closing_at is not None and time.monotonic() >= self._closing_at:
                self._fail_all("the server is shutting down")
            self.flush()
            if not self.has_work() or self._halted:
                if self._busy:  # just went idle: the batch's freed buffers go back to the OS
                    heap.trim()
                    self._busy, self._cached = False, True
                elif self._cached:  # still idle one wait later: MLX's buffer cache goes back
                    self.runner.idle()  # (not at once: a closed loop at c=1 idles per request)
                    self._cached = False
                self.runner.heartbeat()
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            self._busy = True
            try:
                self.step()
            except Exception as exc:  # a fault must end its requests, never the server
                log.exception("engine step failed")
                self.overlap.inflight = None
                self._fail_all(f"internal error in the engine step: {exc}")
            self.flush()
        self._fail_all("the server is shutting down")
        self.flush()
        self.overlap.shutdown()
        self.runner.close()

    def _warm_speculation(self) -> None:
        """On a GPU, before any request: the draft model's feeds, and one internal request
        through a verify of every draft width (`Speculator.forcing`), its outputs dropped and
        its sequence not kept. MLX's CUDA backend builds kernels and plans for each shape it
        meets first: a speculating server's first request ran at a fifth of the second's."""
        spec = self.runner.speculator
        if spec is None or not spec.warms:
            return
        t0 = time.perf_counter()
        top = 20 if self.cfg.max_top_logprobs < 0 else min(20, self.cfg.max_top_logprobs)
        sink, keeps = self.sink, self.runner.keeps_finished
        self.sink, self.runner.keeps_finished = (lambda outputs: None), False
        try:
            spec.warm_draft()
            with spec.forcing() as tokens:
                params = SamplingParams(
                    max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=True,
                    top_logprobs=top,
                )  # fmt: skip
                self._add(EngineRequest("warm-speculation", [1] * 16, params))
                while self.has_work():
                    self.step()
        except Exception:  # a speed-up: a fault in it must not keep the server from serving
            log.exception("speculation: the warm failed (shapes are built at first use)")
            self.overlap.inflight = None
            self._fail_all("the warm failed")
            self.flush()
        finally:
            self.sink, self.runner.keeps_finished = sink, keeps
        log.info("speculation: verify shapes warmed in %.1f s", time.perf_counter() - t0)

    def _drain_inbox(self) -> None:
        aborts: list[str] = []
        try:
            self._read_inbox(aborts)
        finally:
            # Together: each release filters the batch's caches (and keeps a finished row's),
            # which cost a 64-row batch on the CPU ~0.45 s an abort when taken one by one.
            self._abort(aborts)

    def _read_inbox(self, aborts: list[str]) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            match command:
                case Submit(request=req):
                    self._add(req)
                case PendingAdapter(change=change, done=done):
                    self._change_adapter(change, done)
                case PendingControl(command=control, done=done):
                    self._control(control, done)
                case PendingUpdate():
                    self._updates.append(command)
                    if command.update.abort_in_flight:
                        command.aborted = self._abort_in_flight()
                case Abort(request_id=request_id):
                    aborts.append(request_id)

    def _add(self, req: EngineRequest) -> None:
        leader = Sequence.of(req)
        self._live[req.request_id] = leader.group
        if not self._constrain(leader) or not self._adapt(leader, req.adapter):
            return
        if self._updates or self._paused:  # it starts on the weights asked for
            self._held.append(leader)
        else:
            self.scheduler.add(leader)

    def _abort(self, request_ids: list[str]) -> None:
        """End every unfinished choice of these requests, their rows released at once."""
        ended = []
        for request_id in request_ids:
            for s in self._live.get(request_id, ()):
                if s.status is not Status.FINISHED:
                    self._aborted[s.status] += 1
                    self.processor.end(s, FinishReason.ABORT, None)
                    self.scheduler.remove(s)
                    ended.append(s)
        if ended:
            self.runner.release(ended)

    def _constrain(self, leader: Sequence) -> bool:
        """Give each choice of a constrained request its grammar matcher; a grammar that cannot
        be built (the API checked it: this is rare) ends the request with an error."""
        c = leader.params.constraint
        if c is None:
            return True
        try:
            for s in leader.group:
                s.grammar = self.grammars.matcher(c)
        except GrammarError as exc:
            for s in leader.group:
                self.processor.fail(s, f"the output grammar cannot be built: {exc}")
            return False
        return True

    def _adapt(self, leader: Sequence, name: str | None) -> bool:
        """Put each choice on its LoRA adapter; an adapter unloaded since the API routed the
        request ends it with an error."""
        if name is None:
            return True
        slot = self.runner.adapters.slot_of(name)
        for s in leader.group:
            if slot is None:
                self.processor.fail(s, f"the LoRA adapter {name!r} is not loaded (unloaded)")
            else:
                s.adapter, s.adapter_version = slot, self.runner.adapters.version(slot)
        return slot is not None

    def _change_adapter(self, change: AdapterChange, done: Future[str | None]) -> None:
        try:
            self.runner.change_adapter(change)
        except AdapterError as exc:
            done.set_result(str(exc))
            return
        except Exception as exc:  # an unexpected failure: the adapter is not served, the rest is
            log.exception("changing the adapter %s failed", change.name)
            done.set_result(f"the adapter could not be loaded: {exc}")
            return
        what = "unloaded" if change.path is None else f"loaded from {change.path}"
        log.info("LoRA adapter %s %s", change.name, what)
        done.set_result(None)

    def _release_adapters(self) -> None:
        in_use = {
            s.adapter
            for members in self._live.values()
            for s in members
            if s.status is not Status.FINISHED
        }
        self.runner.release_adapters(in_use)

    def _abort_in_flight(self) -> int:
        """End every request that arrived before the update (its finish reason: abort); how
        many."""
        held = {id(s) for s in self._held}
        ended = 0
        for members in list(self._live.values()):
            if id(members[0]) in held:
                continue
            ended += 1
            for s in members:
                if s.status is not Status.FINISHED:
                    self._aborted[s.status] += 1
                    self._end(s, FinishReason.ABORT, None)
        return ended

    def _swap_weights(self) -> None:
        """Nothing runs: load the asked weights in order (a failed one leaves the weights before
        it), answer each, then start the requests that waited for them."""
        if self.has_work():  # paused in place: the old weights' keys and values go
            self._retract()
        # retracted (now or by the pause): their tokens from here on are the new weights'
        kept = [s for s in self.scheduler.waiting if s.num_output]
        first = self.processor.weights
        for pending in self._updates:
            update, done, before = pending.update, pending.done, self.processor.weights
            try:
                self.runner.load_weights(update.path)
            except WeightsError as exc:
                log.warning("weights from %s not loaded: %s", update.path, exc)
                done.set_result(WeightUpdateResult(before, str(exc)))
                continue
            except Exception as exc:  # the model may be half written: say so, keep serving
                log.exception("loading weights from %s failed", update.path)
                done.set_result(WeightUpdateResult(before, f"loading the weights failed: {exc}"))
                continue
            now = WeightVersion(before.counter + 1, update.tag)
            self.processor.weights = now
            took = time.monotonic() - pending.asked
            log.info("weights version %d from %s in %.2f s", now.counter, update.path, took)
            done.set_result(WeightUpdateResult(now, None, pending.aborted, took))
        self._updates = []
        now = self.processor.weights
        for s in kept:
            if s.num_output and (not s.weight_spans or s.weight_spans[-1][1] != now):
                s.weight_spans = s.weight_spans or [(0, first)]
                s.weight_spans.append((s.num_output, now))
        if self._paused is None:
            self._release_held()

    # ---- pause, resume, flush (docs/specs/rl.md) ------------------------------------------------
    @property
    def _halted(self) -> bool:
        """Paused in place (keep, retract): no step runs."""
        return self._paused is not None and self._paused.halts

    def _control(self, command: Control, done: Future[ControlResult]) -> None:
        if command.action == "flush":
            self.runner.flush_prefixes()
            done.set_result(ControlResult(self._paused is not None))
        elif command.action == "resume":
            self._paused = None
            for _, _, waiting in self._pausing:  # a pause not yet answered is overtaken
                waiting.set_result(ControlResult(False, error="resumed before it took effect"))
            self._pausing = []
            if not self._updates:
                self._release_held()
            done.set_result(ControlResult(False))
        else:
            mode = command.mode
            aborted = self._abort_in_flight() if mode is PauseMode.ABORT else 0
            if self._paused is None or mode.halts or self._paused is PauseMode.WAIT:
                self._paused = mode  # a later pause may only halt more
            self._pausing.append((mode, aborted, done))

    def _answer_pauses(self) -> None:
        """Answer the pauses that took effect: halting ones once the step in flight was
        processed (retract then frees the requests' keys and values), a wait pause once
        nothing runs, an abort pause at once."""
        left: list[tuple[PauseMode, int, Future[ControlResult]]] = []
        for mode, aborted, done in self._pausing:
            if mode is PauseMode.WAIT and self.has_work():
                left.append((mode, aborted, done))
                continue
            held = len(self.scheduler.running) + len(self.scheduler.waiting)
            if mode is PauseMode.RETRACT:
                held = len(self._retract())
            done.set_result(ControlResult(True, aborted=aborted, held=held if mode.halts else 0))
        self._pausing = left

    def _retract(self) -> list[Sequence]:
        """Stop every request where it is and free its keys and values: prompts half
        prefilled start again, running choices wait to be prefilled again from their prompt
        and output (each on its own); the running ones, retracted."""
        running = list(self.scheduler.running)
        for s in self.scheduler.waiting:
            if s.num_prefilled:
                self.runner.release([s])
                s.num_prefilled = 0
        self.runner.release(running)  # their keys and values kept as prefixes (same weights)
        for s in running:
            self.scheduler.arrivals.pop(s.seq_id, None)
            s.retract()
        self.scheduler.requeue(running)
        return running

    def _release_held(self) -> None:
        """Requests that waited for new weights or a resume start (those aborted meanwhile
        are gone)."""
        for leader in self._held:
            if any(s.status is not Status.FINISHED for s in leader.group):
                self.scheduler.add(leader)
        self._held = []

    def _end(self, seq: Sequence, reason: FinishReason, error: str | None) -> None:
        self.processor.end(seq, reason, error)
        self.scheduler.remove(seq)
        self.runner.release([seq])

    def flush(self) -> None:
        """Hand the outputs made since the last flush to the sink."""
        t0 = time.perf_counter()
        outputs = self.processor.take()
        for out in outputs:
            if out.finished and (members := self._live.get(out.request_id)) is not None:
                if all(s.status is Status.FINISHED for s in members):
                    del self._live[out.request_id]
        self.sink(outputs)
        self.stats.flush_s += time.perf_counter() - t0

    def _fail_all(self, message: str) -> None:
        waiting = [s for seq in [*self.scheduler.waiting, *self._held] for s in seq.group]
        self._held = []
        for seq in waiting + self.scheduler.running + self.scheduler.scored:
            if seq.status is not Status.FINISHED:
                self._end(seq, FinishReason.ERROR, message)
