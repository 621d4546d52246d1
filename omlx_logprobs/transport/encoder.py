"""An encoder embedding model (runner/encoder.py) behind the engine's client: a `Transport` whose
engine is one thread of the server's process that runs the encoder's forward over the embedding
requests waiting, batched (each request `EngineRequest.embed`, answered with its pooled vector
in `RequestOutput.embedding`, as the causal engine answers one). An encoder has no KV cache and
no steps to share, so there is no scheduler: the thread takes what waits, shortest first, in
batches of at most `max_rows` rows and `max_tokens` padded tokens (one input alone may reach the
model's context), and sends each batch's outputs as it ends. Anything but an embedding request
ends at once with an error; pause, resume and flush change nothing (there is no generation to
pause); new weights and adapters are refused as an engine that is gone refuses them."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mlx.core as mx

from omlx_logprobs.control import INITIAL_WEIGHTS, ControlResult
from omlx_logprobs.engine.commands import (
    Abort,
    BeginShutdown,
    Command,
    ControlCommand,
    Stop,
    Submit,
    posted,
)
from omlx_logprobs.engine.stats import EngineStats
from omlx_logprobs.runner.encoder import EncoderRunner
from omlx_logprobs.transport.client import Deliver, Lost
from omlx_logprobs.types import EngineRequest, FinishReason, RequestOutput

log = logging.getLogger("omlx_logprobs")
ONLY_EMBEDS = "this model is an encoder: it serves embeddings and nothing else"


class EncoderTransport:
    """The encoder's thread, its queue of embedding requests, and their outputs."""

    def __init__(
        self,
        path: Path,
        pooling: str,
        pad_id: int,
        max_rows: int,
        max_tokens: int,
        dtype: str = "auto",
    ) -> None:
        self.path, self.pooling, self.pad_id, self.dtype = path, pooling, pad_id, dtype
        self.max_rows, self.max_tokens = max(1, max_rows), max(1, max_tokens)
        self._inbox: queue.SimpleQueue[EngineRequest | None] = queue.SimpleQueue()
        self._aborted: set[str] = set()  # aborted while waiting: skipped when taken
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deliver: Deliver | None = None
        self._lost: Lost | None = None
        self._waiting = self._running = 0
        self._alive = False

    def start(self, deliver: Deliver, lost: Lost) -> None:
        """The thread started, once it has loaded the weights (their error raised here)."""
        self._deliver, self._lost = deliver, lost
        ready: Future[EncoderRunner] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="omlx-encoder", daemon=True
        )
        self._thread.start()
        ready.result()
        self._alive = True

    def post(self, command: Command[Any]) -> Future[Any]:
        match command:
            case Submit(request=req) if req.embed:
                with self._lock:
                    self._waiting += 1
                self._inbox.put(req)
            case Submit(request=req):
                assert self._deliver is not None
                self._deliver([self._ended(req.request_id, ONLY_EMBEDS)])
            case Abort(request_id=rid):
                with self._lock:
                    self._aborted.add(rid)
            case BeginShutdown() | Stop():
                pass  # a batch is short: the requests in flight finish before shutdown ends
            case ControlCommand():
                # The control plane pauses generation (the RL routes: every loaded model); an
                # encoder generates nothing and holds no kept prefixes: its embeddings go on.
                done: Future[Any] = Future()
                done.set_result(ControlResult(paused=False))
                return done
            case _:
                answer: Future[Any] = Future()
                answer.set_result(command.refused(ONLY_EMBEDS, INITIAL_WEIGHTS))
                return answer
        return posted()

    def shutdown(self, timeout: float) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout)
        self._alive = False

    def snapshot(self) -> EngineStats:
        with self._lock:
            waiting, running = self._waiting, self._running
        return EngineStats(waiting, running, 0, running > 0, mx.get_active_memory(),
                           mx.get_cache_memory(), 0, 0)  # fmt: skip

    @property
    def state(self) -> str:
        return "ok" if self._alive else "stopped"

    @property
    def restarts(self) -> int:
        return 0  # a thread that dies is not started again

    def _run(self, ready: Future[EncoderRunner]) -> None:
        try:
            runner = EncoderRunner(self.path, self.pooling, self.pad_id, self.dtype)
        except BaseException as e:  # the load's error, raised by start()
            ready.set_exception(e)
            return
        ready.set_result(runner)
        while (taken := self._take()) is not None:
            for batch in self._batches(taken):
                self._embed(runner, batch)

    def _take(self) -> list[EngineRequest] | None:
        """Every request waiting (blocking for the first), the aborted ones dropped; None once
        the transport shuts down."""
        first = self._inbox.get()
        taken = [first]
        while first is not None:
            try:
                taken.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        requests = [r for r in taken if r is not None]
        if len(requests) < len(taken):
            self._lost_all([r.request_id for r in requests])
            return None
        with self._lock:
            dropped = {r.request_id for r in requests} & self._aborted
            self._aborted -= dropped
            self._waiting -= len(requests)
        if dropped and self._deliver is not None:
            self._deliver([self._ended(rid, None) for rid in sorted(dropped)])
        return [r for r in requests if r.request_id not in dropped]

    def _batches(self, taken: list[EngineRequest]) -> list[list[EngineRequest]]:
        """Shortest first (the least padding), each batch within the rows and padded tokens."""
        batches: list[list[EngineRequest]] = []
        for r in sorted(taken, key=lambda r: len(r.prompt_ids)):
            last = batches[-1] if batches else None
            if (
                last is not None
                and len(last) < self.max_rows
                and (len(last) + 1) * len(r.prompt_ids) <= self.max_tokens
            ):
                last.append(r)
            else:
                batches.append([r])
        return batches

    def _embed(self, runner: EncoderRunner, batch: list[EngineRequest]) -> None:
        assert self._deliver is not None
        with self._lock:
            self._running = len(batch)
        t0 = time.perf_counter()
        try:
            vectors = runner.embed([list(r.prompt_ids) for r in batch])
        except Exception as e:  # a failed forward fails its batch, not the thread
            log.exception("encoder forward failed")
            outs = [self._ended(r.request_id, f"the encoder failed: {e}") for r in batch]
        else:
            outs = [
                RequestOutput(r.request_id, finished=True, finish_reason=FinishReason.LENGTH,
                              prompt_tokens=len(r.prompt_ids), embedding=v)
                for r, v in zip(batch, vectors)
            ]  # fmt: skip
        with self._lock:
            self._running = 0
            self._aborted -= {r.request_id for r in batch}  # too late to abort: answered
        log.debug("encoder: %d rows in %.3f s", len(batch), time.perf_counter() - t0)
        self._deliver(outs)

    def _lost_all(self, request_ids: list[str]) -> None:
        if request_ids and self._lost is not None:
            self._lost(request_ids, "the server is shutting down")

    @staticmethod
    def _ended(request_id: str, error: str | None) -> RequestOutput:
        """A request ended without a vector: aborted (no error), or failed."""
        reason = FinishReason.ABORT if error is None else FinishReason.ERROR
        return RequestOutput(request_id, finished=True, finish_reason=reason, error=error)
