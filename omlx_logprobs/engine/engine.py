"""The engine: one thread owns all MLX work and runs the step loop; the asyncio side submits and
aborts requests through a thread-safe inbox and reads outputs from per-request collectors."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.model_runner import ModelRunner
from omlx_logprobs.engine.scheduler import Scheduler, SchedulerOutput
from omlx_logprobs.engine.sequence import Sequence, Status
from omlx_logprobs.output.collector import RequestOutputCollector
from omlx_logprobs.output.detokenizer import Vocabulary
from omlx_logprobs.output.processor import OutputProcessor
from omlx_logprobs.types import FinishReason, RequestOutput

log = logging.getLogger("omlx_logprobs")


@dataclass(frozen=True)
class RequestHandle:
    """What the submitter keeps: the engine's record (read-only) and the output slot."""

    seq: Sequence
    collector: RequestOutputCollector


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /health: what is queued, what holds KV memory, and how much MLX holds."""

    waiting: int
    running: int
    cached_sequences: int  # batch cache rows plus prompts mid-prefill
    active_memory: int  # bytes in live MLX arrays, weights included
    aborted_waiting: int  # requests aborted (client gone) before their prompt was prefilled
    aborted_running: int  # ... and while decoding


class Engine:
    def __init__(self, model: Any, vocab: Vocabulary, eos: tuple[int, ...], cfg: EngineConfig):
        self.cfg = cfg
        self.scheduler = Scheduler(cfg.max_num_seqs, cfg.prefill_chunk)
        self.runner = ModelRunner(model, len(vocab))
        self.processor = OutputProcessor(vocab, eos, self._deliver)
        self._collectors: dict[int, RequestOutputCollector] = {}
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closing_at: float | None = None  # after this monotonic time, fail what is left
        self._aborted = {Status.WAITING: 0, Status.RUNNING: 0}
        self._thread = threading.Thread(target=self._loop, name="omlx-engine", daemon=True)

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

    def add_request(self, seq: Sequence, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        handle = RequestHandle(seq, RequestOutputCollector(loop))
        self._inbox.put(("add", handle))
        self._wake.set()
        return handle

    def abort(self, seq: Sequence) -> None:
        self._inbox.put(("abort", seq))
        self._wake.set()

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def stats(self) -> EngineStats:
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            cached_sequences=self.runner.num_cached,
            active_memory=self.runner.active_memory(),
            aborted_waiting=self._aborted[Status.WAITING],
            aborted_running=self._aborted[Status.RUNNING],
        )

    # ---- engine thread ------------------------------------------------------------------------
    def step(self) -> None:
        work = self.scheduler.schedule()
        result = self.runner.execute(work)
        finished = self.processor.process(result) if result is not None else []
        self._admit(work)
        self.runner.release(finished)
        self.scheduler.update(work)

    def _admit(self, work: SchedulerOutput) -> None:
        chunk = work.prefill
        if chunk is not None and chunk.is_last and chunk.seq.status is Status.WAITING:
            self.runner.admit(chunk.seq)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if self._closing_at is not None and time.monotonic() >= self._closing_at:
                self._fail_all("the server is shutting down")
            if not self.scheduler.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # a fault must end its requests, never the server
                log.exception("engine step failed")
                self._fail_all(f"internal error in the engine step: {exc}")
        self._fail_all("the server is shutting down")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._collectors[item.seq.seq_id] = item.collector
                self.scheduler.add(item.seq)
            elif item.status is not Status.FINISHED:
                self._aborted[item.status] += 1
                self._end(item, FinishReason.ABORT, None)

    def _end(self, seq: Sequence, reason: FinishReason, error: str | None) -> None:
        seq.finish(reason, error)
        self.scheduler.remove(seq)
        self.runner.release([seq])
        self.processor.emit(seq, seq.text.flush(), seq.num_output)

    def _fail_all(self, message: str) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            self._end(seq, FinishReason.ERROR, message)

    def _deliver(self, seq: Sequence, out: RequestOutput) -> None:
        collector = self._collectors.get(seq.seq_id)
        if collector is not None:
            collector.put(out)
        if out.finished:
            self._collectors.pop(seq.seq_id, None)
