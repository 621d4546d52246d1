"""The engine: one thread owns all MLX work and runs the step loop. Requests, aborts, weight
updates, adapters and pauses come in as the command records of engine/commands.py, posted to a
thread-safe inbox (`Engine.post`, engine/inbox.py) and read between two steps; pauses, weights
and adapters are then engine/lifecycle.py's. What leaves is `RequestOutput`s, handed to a sink
once a step (transport/client.py moves them to the API, from this process or from a child)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

import mlx.core as mx

from omlx_logprobs import heap
from omlx_logprobs.batch.budget import budget_due
from omlx_logprobs.batch.scheduler import Scheduler, SchedulerOutput
from omlx_logprobs.batch.sequence import Sequence, Status
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.control import INITIAL_WEIGHTS, AdapterChange, WeightVersion
from omlx_logprobs.engine.commands import (
    Abort,
    ChangeAdapter,
    Command,
    ControlCommand,
    Stop,
    Submit,
    Train,
    UpdateWeights,
)
from omlx_logprobs.engine.inbox import Inbox
from omlx_logprobs.engine.lifecycle import Lifecycle
from omlx_logprobs.engine.overlap import Overlap
from omlx_logprobs.engine.processor import OutputProcessor
from omlx_logprobs.engine.stats import EngineStats, StepStats
from omlx_logprobs.engine.trainings import Trainings
from omlx_logprobs.runner import invariance
from omlx_logprobs.runner.grammar import GrammarError, Grammars
from omlx_logprobs.runner.model_runner import ModelRunner
from omlx_logprobs.runner.speculation import speculator
from omlx_logprobs.runner.step import LaunchedStep
from omlx_logprobs.training.trainer import Trainer
from omlx_logprobs.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from omlx_logprobs.vocab import Vocabulary

log = logging.getLogger("omlx_logprobs")
SMALL_BATCH = 4
IDLE_WAIT_S = 0.5  # an idle engine looks at its inbox at least this often

Sink = Callable[[list[RequestOutput]], None]
A = TypeVar("A")


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
        if cfg.batch_invariant:
            invariance.enable()
        self.runner = runner(
            model, len(vocab), cfg.cache_limit_mib, cfg.prefix_cache_mib, tuple(eos)
        )
        if cfg.batch_invariant:  # InvarianceError: this process cannot keep the promise
            r = self.runner
            invariance.check(r.model, r.templates, len(vocab), r.plan.decode)
            log.info("batch-invariant mode: one sequence's logits checked the same bits alone, "
                     "batched, chunked and decoded (runner/invariance.py)")  # fmt: skip
        self.runner.speculator = speculator(cfg, self.runner.plan, self.runner.model, vocab)
        chunk, delay_ms = cfg.prefill(cpu=mx.default_device() == mx.cpu)
        # Built on the engine's thread as it starts (`_loop`): MLX keeps cuDNN's graphs per thread.
        self._warm = (chunk, context or cfg.max_model_len or 1 << 15)
        if cfg.kv_cache_dir is not None:
            self.runner.attach_disk(cfg.kv_cache_dir, cfg.kv_cache_disk_mib)
        for name, path in adapters:  # --lora, or those loaded before a restart or a reload
            self.runner.change_adapter(AdapterChange(name, path))
        self.scheduler = Scheduler(
            cfg.max_num_seqs,
            chunk,
            delay_ms / 1e3,
            cached=self.runner.cached_len,
            waits=self.runner.prompt_cache.waits,
            whole_runs=self.runner.vision is not None and self.runner.vision.encoder.bidirectional,
        )
        self.processor = OutputProcessor(vocab, eos)
        self.processor.weights = weights
        # Called once a step (and once an idle wait) with the outputs made since the last call,
        # perhaps none; on a GPU from the thread that processed the step.
        self.sink: Sink = sink or (lambda outputs: None)
        self.overlap = Overlap(self._process, aside=self.runner.plan.overlaps)
        self.stats = StepStats()
        self._inflight_first = False  # the step in flight samples some prompt's first token
        # Unfinished requests' choices (aborts), as submitted: a retraction splits a prompt's
        # choices, which then prefill apart.
        self._live: dict[str, list[Sequence]] = {}
        # Pause, resume and flush; new weights; adapters; retraction (docs/specs/rl.md).
        self.life = Lifecycle(
            self.scheduler, self.runner, self.processor, self._live, self.has_work, self._abort
        )
        self._inbox = Inbox()
        # Training calls waiting for their turn, each between two steps (engine/trainings.py).
        self.trainings = Trainings(self._trainer, chunk)
        self._vocab = len(vocab)
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
        self.post(Stop())
        self._thread.join(timeout)

    def post(self, command: Command[A]) -> Future[A]:
        """Any thread (a signal handler too): ask the engine to do something (the records of
        engine/commands.py; engine/inbox.py says when each takes effect)."""
        return self._inbox.post(command)

    @property
    def weights(self) -> WeightVersion:
        return self.processor.weights

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or not self._inbox.stopped

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
            updating=bool(self.life.updates),
            paused=self.life.paused.value if self.life.paused is not None else None,
            sleeping=self.life.sleeping,
            distributed=self.runner.health(),
            tallies=self.runner.tallies(),
        )

    # ---- engine thread ------------------------------------------------------------------------
    def step(self) -> None:
        """Schedule -> launch -> process the previous step while the device runs this one (on a
        GPU beside the launch, on a second thread) -> admit the new prompts -> free."""
        inflight = self.overlap.inflight
        if inflight is not None and (
            inflight.spec is not None or self._needs_history() or self._first_waits()
            or self.scheduler.preempts()
        ):  # fmt: skip
            # A first token goes out before the next launch. A speculative step's collect rolls
            # the cache back and sets the next inputs: MLX arrays, which the thread that
            # launches must make (a lazy array of another thread's stream fails there). A
            # preemption retracts rows whose tokens must all be processed first.
            self._free(self.overlap.finish())
        if self.overlap.inflight is None and (lower := self.scheduler.preempts()):
            self.life.preempt(lower)  # a higher-priority prompt takes their rows
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
        # token, so the step in flight must be processed first; so do drafts, and a thinking
        # budget at its end (whether the token in flight closed the reasoning).
        running = self.scheduler.running
        spec = self.runner.speculator
        if spec is not None and spec.wants(running):
            return True
        return any(s.params.penalizes or s.grammar is not None or budget_due(s) for s in running)

    def _loop(self) -> None:
        try:
            self.runner.warm_attention(*self._warm)
            self._warm_speculation()
        except Exception:  # speed-ups: a fault in one must not keep the engine from serving
            log.exception("engine: the start-up warm failed")
        finally:
            self._warmed.set()
        while not self._inbox.stopped:
            self._drain_inbox()
            if self.life.halted and self.overlap.inflight is not None:
                self._free(self.overlap.finish())  # the step in flight ends the run
            self.life.settle()
            closing_at = self._inbox.closing_at
            if closing_at is not None and time.monotonic() >= closing_at:
                self._fail_all("the server is shutting down")
            self.flush()
            serving = self.has_work() and not self.life.halted
            if self.trainings.due(serving) and self.trainings.run(self.life.sleeping > 0, serving):
                continue
            if not self.has_work() or self.life.halted:
                if self._busy:  # just went idle: the batch's freed buffers go back to the OS
                    heap.trim()
                    self._busy, self._cached = False, True
                elif self._cached:  # still idle one wait later: MLX's buffer cache goes back
                    self.runner.idle()  # (not at once: a closed loop at c=1 idles per request)
                    self._cached = False
                self.runner.heartbeat()
                self._inbox.wait(IDLE_WAIT_S)
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
        self.life.close("the server is shutting down")
        self._inbox.refuse("the server is shutting down", self.processor.weights)
        self.trainings.close("the server is shutting down")
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
            spec.drafted = spec.accepted = 0  # the warm's drafts are no client's
        log.info("speculation: verify shapes warmed in %.1f s", time.perf_counter() - t0)

    def _drain_inbox(self) -> None:
        aborts: list[str] = []
        try:
            self._read_inbox(aborts)
        finally:
            # Together: each release filters the batch's caches (and keeps a finished row's),
            # which cost a 64-row batch on the CPU ~0.45 s an abort when taken one by one.
            self._abort([s for rid in aborts for s in self._live.get(rid, ())])

    def _read_inbox(self, aborts: list[str]) -> None:
        for command, done in self._inbox.take():
            match command:
                case Submit(request=req):
                    self._add(req)
                case Abort(request_id=request_id):
                    aborts.append(request_id)
                case UpdateWeights(update=update):
                    self.life.update_weights(update, done)
                case ChangeAdapter(change=change):
                    self.life.change_adapter(change, done)
                case ControlCommand(control=control):
                    self.life.control(control, done)
                case Train(call=call):
                    self.trainings.post(call, done)

    def _trainer(self) -> Trainer | None:
        """The trainer on the model runner's model and adapters (training/trainer.py), or None
        where the runner has no adapters to train (a model split over processes)."""
        r = self.runner
        if not hasattr(r, "adapters") or not hasattr(r, "templates"):
            return None
        return Trainer(r.model, r.adapters, r.templates, self._vocab)

    def _add(self, req: EngineRequest) -> None:
        leader = Sequence.of(req)
        self._live[req.request_id] = leader.group
        if not self._constrain(leader) or not self.life.adapt(leader, req.adapter):
            return
        if not self.life.holds(leader):  # held: it starts on the weights asked for
            self.scheduler.add(leader)

    def _abort(self, seqs: Iterable[Sequence]) -> None:
        """End these choices (those not finished), their rows released at once."""
        ended = []
        for s in seqs:
            if s.status is not Status.FINISHED:  # an abort read twice ends its choices once
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
        waiting = [s for seq in [*self.scheduler.waiting, *self.life.held] for s in seq.group]
        self.life.held = []
        ended = [
            seq
            for seq in waiting + self.scheduler.running + self.scheduler.scored
            if seq.status is not Status.FINISHED
        ]
        for seq in ended:
            self.processor.end(seq, FinishReason.ERROR, message)
            self.scheduler.remove(seq)
        try:
            self.runner.release(ended)
        except Exception:  # the fault that failed the step may fail this too: if the loop
            # died here, every client would wait forever; all rows go instead
            log.exception("engine: the failed sequences' rows could not be released; the "
                          "batch is emptied")  # fmt: skip
            self.runner.batch.clear()
