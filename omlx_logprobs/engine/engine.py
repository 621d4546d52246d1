"""The engine: one thread owns all MLX work and runs the step loop; the asyncio side submits and
aborts requests through a thread-safe inbox. Outputs leave through an outbox: per-request
collectors when the engine runs in the server's process, a pipe when it runs in its own
(engine/process.py)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from omlx_logprobs import heap
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.model_runner import ModelRunner
from omlx_logprobs.engine.scheduler import Scheduler, SchedulerOutput
from omlx_logprobs.engine.sequence import Sequence, Status
from omlx_logprobs.engine.stats import EngineStats, StepStats
from omlx_logprobs.engine.step import LaunchedStep
from omlx_logprobs.output.collector import RequestOutputCollector
from omlx_logprobs.output.detokenizer import Vocabulary
from omlx_logprobs.output.processor import OutputProcessor
from omlx_logprobs.types import FinishReason, RequestOutput

log = logging.getLogger("omlx_logprobs")
SMALL_BATCH = 4
IDLE_WAIT_S = 0.5  # an idle engine looks at its inbox at least this often


Progress = Callable[[], None]


@dataclass(frozen=True)
class RequestHandle:
    """What the submitter keeps: the engine's record (read-only) and the output slot."""

    seq: Sequence
    collector: RequestOutputCollector
    # Called when the record has grown without an output (a non-streamed request's entries
    # arriving early from the engine's process: see EngineProcess); never in thread mode.
    on_progress: Progress | None = None


def new_handles(
    seq: Sequence,
    loop: asyncio.AbstractEventLoop,
    final_only: bool,
    on_progress: Progress | None = None,
) -> list[RequestHandle]:
    """One handle per choice of `seq` (the leader and its forks), in order; `on_progress`
    goes to the leader's."""
    return [
        RequestHandle(s, RequestOutputCollector(loop, final_only), on_progress if i == 0 else None)
        for i, s in enumerate(seq.group)
    ]


@dataclass(frozen=True)
class Submission:
    """A prompt and its forks as the engine thread receives them."""

    seq: Sequence  # the leader; its forks are seq.forks
    final_only: bool  # the consumers want the finished outputs alone (no streaming)
    collectors: tuple[RequestOutputCollector, ...] = ()  # one per choice, in the server's process
    progress: bool = False  # final_only, yet the leader's entries go out every few steps


class Outbox(Protocol):
    """Where the engine thread's outputs go."""

    def register(self, sub: Submission) -> None: ...

    def deliver(self, seq: Sequence, out: RequestOutput) -> None: ...

    def flush(self, engine: Engine) -> None:
        """After each step and each idle wait: hand over what was delivered since the last."""


class CollectorOutbox:
    """Outputs into per-request collectors; consumers woken together, once per flush."""

    def __init__(self) -> None:
        self._collectors: dict[int, RequestOutputCollector] = {}
        self._to_wake: list[RequestOutputCollector] = []

    def register(self, sub: Submission) -> None:
        for seq, collector in zip(sub.seq.group, sub.collectors, strict=True):
            self._collectors[seq.seq_id] = collector

    def deliver(self, seq: Sequence, out: RequestOutput) -> None:
        collector = self._collectors.get(seq.seq_id)
        if collector is not None and collector.deposit(out):
            self._to_wake.append(collector)
        if out.finished:
            self._collectors.pop(seq.seq_id, None)

    def flush(self, engine: Engine) -> None:
        if self._to_wake:
            RequestOutputCollector.wake_all(self._to_wake)
            self._to_wake = []


class EngineClient(Protocol):
    """What the API calls: `Engine` in this process, or `EngineProcess` (engine/process.py);
    both subclass it for `add_request`."""

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def begin_shutdown(self, grace_s: float) -> None: ...

    def add_request(
        self,
        seq: Sequence,
        loop: asyncio.AbstractEventLoop,
        final_only: bool = False,
        on_progress: Progress | None = None,
    ) -> RequestHandle:
        """Submit one choice; its handle."""
        return self.add_group(seq, loop, final_only, on_progress)[0]

    def add_group(
        self,
        seq: Sequence,
        loop: asyncio.AbstractEventLoop,
        final_only: bool = False,
        on_progress: Progress | None = None,
    ) -> list[RequestHandle]: ...

    def abort(self, seq: Sequence) -> None: ...

    def snapshot(self) -> EngineStats: ...

    @property
    def alive(self) -> bool: ...


class Engine(EngineClient):
    def __init__(
        self,
        model: Any,
        vocab: Vocabulary,
        eos: tuple[int, ...],
        cfg: EngineConfig,
        outbox: Outbox | None = None,
    ):
        self.cfg = cfg
        self.runner = ModelRunner(model, len(vocab), cfg.cache_limit_mib, cfg.prefix_cache_mib)
        self.scheduler = Scheduler(
            cfg.max_num_seqs,
            cfg.prefill_chunk,
            cfg.prefill_delay_ms / 1e3,
            cached=self.runner.cached_len,
        )
        self.processor = OutputProcessor(vocab, eos, self._deliver)
        self.outbox: Outbox = outbox or CollectorOutbox()
        self.inflight: LaunchedStep | None = None  # launched, not yet processed
        self.stats = StepStats()
        self._inflight_first = False  # the step in flight samples some prompt's first token
        self._live: dict[int, Sequence] = {}  # unfinished sequences by id (aborts name ids)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closing_at: float | None = None  # after this monotonic time, fail what is left
        self._aborted = {Status.WAITING: 0, Status.RUNNING: 0}
        self._busy = False  # stepped since the engine was last idle
        self._cached = False  # MLX may hold freed buffers from the last busy spell
        self._thread = threading.Thread(target=self._loop, name="omlx-engine", daemon=True)
        # On a GPU the host bounds the step loop: a launched step is processed on a second
        # thread while this one builds and queues the next (MLX launches kernels without the
        # GIL). MLX's CPU backend computes the step inside the launch on both cores: no gain.
        self._aside = None if self.runner.host_logprobs else ThreadPoolExecutor(1, "omlx-process")

    # ---- asyncio side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def begin_shutdown(self, grace_s: float) -> None:
        """In-flight requests may finish for grace_s seconds; then they end with an error."""
        self._closing_at = time.monotonic() + grace_s
        self._wake.set()

    def add_group(
        self,
        seq: Sequence,
        loop: asyncio.AbstractEventLoop,
        final_only: bool = False,
        on_progress: Progress | None = None,
    ) -> list[RequestHandle]:
        """Submit `seq` and its forks (made with `seq.fork`): one handle per choice, in order.
        `final_only`: the consumers wait for the finished outputs alone (no streaming).
        `on_progress` is not called here: the records live in this process, read them at the
        end."""
        handles = new_handles(seq, loop, final_only)
        self.submit(Submission(seq, final_only, tuple(h.collector for h in handles)))
        return handles

    def submit(self, sub: Submission) -> None:
        self._inbox.put(("add", sub))
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        self.abort_id(seq.seq_id)

    def abort_id(self, seq_id: int) -> None:
        self._inbox.put(("abort", seq_id))
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or not self._stop.is_set()

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def snapshot(self) -> EngineStats:
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            cached_sequences=self.runner.num_cached,
            step_in_flight=self.inflight is not None,
            active_memory=self.runner.active_memory(),
            cache_memory=self.runner.cache_memory(),
            aborted_waiting=self._aborted[Status.WAITING],
            aborted_running=self._aborted[Status.RUNNING],
        )

    # ---- engine thread ------------------------------------------------------------------------
    def step(self) -> None:
        """Launch this step, then process the previous one while the device runs this one."""
        if self.inflight is not None and (self._needs_history() or self._first_token_waits()):
            self._free(self._processed())
            self._wake_consumers()  # a first token goes out before the next launch's host work
        t0 = time.perf_counter()
        work = self.scheduler.schedule()
        aside = self._process_aside()
        try:
            launched = self.runner.launch(work)
        except Exception:
            if aside is not None:  # the processing beside it ends before the failure's cleanup
                wait([aside])
            raise
        t1 = time.perf_counter()
        finished = self._processed(aside)
        self._admit(work)
        self.scheduler.update(work)
        self._free(finished)
        self.inflight = launched
        self._inflight_first = any(c.is_last for c in work.prefill)
        rows = len(launched.seqs) if launched is not None else 0
        prefill = sum(c.end - c.start for c in work.prefill)
        cached = sum(c.seq.cached_tokens for c in work.prefill)
        self.stats.add(
            rows, prefill, cached, t1 - t0, time.perf_counter() - t1, self.runner.take_time()
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    def _process_aside(self) -> Future[list[Sequence]] | None:
        """Start processing the step in flight on the second thread, when there is one."""
        if self._aside is None or self.inflight is None:
            return None
        return self._aside.submit(self._process_timed, self._take_inflight())

    def _process_timed(self, step: LaunchedStep) -> list[Sequence]:
        """The second thread's work: the step's outputs, handed over at once (the pickling for
        the server's process then runs while the launch has released the GIL, not after it)."""
        t0 = time.perf_counter()
        finished = self._process(step)
        self._wake_consumers()
        self.stats.aside = (t0, time.perf_counter())
        return finished

    def _process(self, step: LaunchedStep) -> list[Sequence]:
        """A launched step's outputs and stops; the sequences that finished. Safe beside the
        next launch: it reads only arrays queued with its step (an MLX stream belongs to the
        thread that made it), and the two write different fields of the records. The launch
        reads one field this may change, a prompt's choices' statuses (`joining`: only
        non-finite prompt logits end them here), which the admission re-reads after the wait."""
        return self.processor.process(self.runner.collect(step))

    def _processed(self, aside: Future[list[Sequence]] | None = None) -> list[Sequence]:
        """The step in flight, processed (waited for when `aside` runs it); what finished."""
        if aside is not None:
            return aside.result()
        return [] if self.inflight is None else self._process(self._take_inflight())

    def _take_inflight(self) -> LaunchedStep:
        step, self.inflight = self.inflight, None
        assert step is not None
        return step

    def _free(self, finished: list[Sequence]) -> None:
        """Release what finished: its cache rows and its place in the scheduler."""
        self.runner.release(finished)
        self.scheduler.drop_finished()

    def _first_token_waits(self) -> bool:
        # A first token is latency a client sees; with a small batch, overlapping the next
        # step with its processing gains little, so it is processed before the next launch.
        return self._inflight_first and len(self.scheduler.running) <= SMALL_BATCH

    def _needs_history(self) -> bool:
        # Penalties read every earlier token, so the step in flight must be processed first.
        return any(s.params.penalizes for s in self.scheduler.running)

    def _admit(self, work: SchedulerOutput) -> None:
        # In the order the scheduler appends them to `running`, which is the batch's row order;
        # a prompt's forks join right after it.
        done = [s for c in work.prefill if c.is_last for s in c.seq.joining()]
        if done:
            self.runner.admit(done)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if self._closing_at is not None and time.monotonic() >= self._closing_at:
                self._fail_all("the server is shutting down")
            self._wake_consumers()
            if not self.has_work():
                if self._busy:  # just went idle: the batch's freed buffers go back to the OS
                    heap.trim()
                    self._busy, self._cached = False, True
                elif self._cached:  # still idle one wait later: MLX's buffer cache goes back
                    self.runner.idle()  # (not at once: a closed loop at c=1 idles per request)
                    self._cached = False
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            self._busy = True
            try:
                self.step()
            except Exception as exc:  # a fault must end its requests, never the server
                log.exception("engine step failed")
                self.inflight = None
                self._fail_all(f"internal error in the engine step: {exc}")
            self._wake_consumers()
        self._fail_all("the server is shutting down")
        self._wake_consumers()
        if self._aside is not None:
            self._aside.shutdown(wait=False)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.outbox.register(item)
                self._live.update((s.seq_id, s) for s in item.seq.group)
                self.scheduler.add(item.seq)
            elif (seq := self._live.get(item)) is not None:
                # Forks still waiting cannot start without their prompt: they end with it.
                for s in seq.group if seq.status is Status.WAITING else [seq]:
                    if s.status is not Status.FINISHED:
                        self._aborted[s.status] += 1
                        self._end(s, FinishReason.ABORT, None)

    def _end(self, seq: Sequence, reason: FinishReason, error: str | None) -> None:
        seq.finish(reason, error)
        self.scheduler.remove(seq)
        self.runner.release([seq])
        self.processor.emit(seq, seq.text.flush(), seq.num_output)

    def _wake_consumers(self) -> None:
        t0 = time.perf_counter()
        self.outbox.flush(self)
        self.stats.flush_s += time.perf_counter() - t0

    def _fail_all(self, message: str) -> None:
        waiting = [s for seq in self.scheduler.waiting for s in seq.group]
        for seq in waiting + self.scheduler.running + self.scheduler.scored:
            if seq.status is not Status.FINISHED:
                self._end(seq, FinishReason.ERROR, message)

    def _deliver(self, seq: Sequence, out: RequestOutput) -> None:
        self.outbox.deliver(seq, out)
        if out.finished:
            self._live.pop(seq.seq_id, None)
