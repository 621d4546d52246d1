"""The engine in a process of its own, so the server's event loop (HTTP, JSON) and the engine's
step loop do not share one GIL.

The child loads the model and runs the same `Engine`, with a `PipeOutbox`: after each step it
sends one `StepOutputs` message, the requests' deltas together with what each request's record
gained (token ids, logprob entries, prompt entries). The parent keeps its own copy of every
`Sequence` it submitted, brings it up to date from those messages and hands each delta to the
request's collector, so the API reads ids and entries from the parent's copy exactly as it reads
them from the engine's own records when the engine runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from omlx_logprobs import heap
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import (
    Engine,
    EngineClient,
    Progress,
    RequestHandle,
    Submission,
    new_handles,
)
from omlx_logprobs.engine.sequence import Sequence
from omlx_logprobs.engine.stats import EngineStats
from omlx_logprobs.logprobs.store import StoreRows, append_from
from omlx_logprobs.output.collector import RequestOutputCollector
from omlx_logprobs.types import FinishReason, RequestOutput

log = logging.getLogger("omlx_logprobs")
NO_STATS = EngineStats(0, 0, 0, False, 0, 0, 0, 0)


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to load the model and build its engine."""

    model: str | None
    name: str | None
    engine: EngineConfig
    log_level: str = "info"


# ---- messages, parent to child ----------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    seq: Sequence  # the leader, its forks with it
    final_only: bool
    progress: bool = False  # final_only, but ship the leader's records every PROGRESS_EVERY


@dataclass(frozen=True)
class AbortRequest:
    seq_id: int


@dataclass(frozen=True)
class BeginShutdown:
    grace_s: float


@dataclass(frozen=True)
class Stop:
    pass


# ---- messages, child to parent ----------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    vocab_size: int


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class SeqUpdate:
    """One sequence's delta and what its record gained since the last update sent for it."""

    seq_id: int
    out: RequestOutput | None  # None: the record grew, nothing for the consumer yet
    output_from: int  # index of the first of `output_ids` in the sequence's output
    output_ids: bytes  # int32
    entries: StoreRows | None  # generated tokens' entries, from output_from
    prompt: StoreRows | None  # prompt entries


@dataclass(frozen=True)
class StepOutputs:
    updates: list[SeqUpdate]
    stats: EngineStats


# ---- child ------------------------------------------------------------------------------------
PROGRESS_EVERY = 16  # tokens between the records of a request whose server formats them early


@dataclass
class _Shipping:
    final_only: bool
    progress: bool = False
    outputs: int = 0  # output ids (and entries) already sent
    prompt: int = 0  # prompt entries already sent
    held: RequestOutput | None = None  # a non-streamed request's deltas, merged until the end


class PipeOutbox:
    """The child's outbox: deltas and record growth, one message per step."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._state: dict[int, _Shipping] = {}
        self._updates: list[SeqUpdate] = []
        self._stats = NO_STATS

    def register(self, sub: Submission) -> None:
        for seq in sub.seq.group:
            self._state[seq.seq_id] = _Shipping(sub.final_only, sub.progress and seq is sub.seq)

    def deliver(self, seq: Sequence, out: RequestOutput) -> None:
        st = self._state.get(seq.seq_id)
        if st is None:
            return
        if st.held is not None:
            out = st.held.merge(out)
        if st.final_only and not out.finished:
            st.held = out  # its consumer waits for the end: nothing to send before it
            if st.progress and self._progress_due(seq, st):
                self._updates.append(self._update(seq, st, None))  # ... but its records
            return
        st.held = None
        self._updates.append(self._update(seq, st, out))
        if out.finished:
            del self._state[seq.seq_id]

    @staticmethod
    def _progress_due(seq: Sequence, st: _Shipping) -> bool:
        """Every PROGRESS_EVERY tokens at a phase set by the id (a wave's rows ship a few a step,
        not one >64 KB message at once), and one token before max_tokens (rows ending together
        leave the server's event loop one position each to format)."""
        if seq.num_output <= st.outputs:
            return False
        if seq.num_output == seq.params.max_tokens - 1:
            return True
        return (seq.num_output + seq.seq_id) % PROGRESS_EVERY == 0

    def _update(self, seq: Sequence, st: _Shipping, out: RequestOutput | None) -> SeqUpdate:
        start, st.outputs = st.outputs, seq.num_output
        prompt = None
        if seq.prompt_store is not None and len(seq.prompt_store) > st.prompt:
            prompt = seq.prompt_store.rows(st.prompt)
            st.prompt = len(seq.prompt_store)
        entries = seq.store.rows(start) if seq.store is not None else None
        return SeqUpdate(seq.seq_id, out, start, seq.output_ids[start:].tobytes(), entries, prompt)

    def flush(self, engine: Engine) -> None:
        stats = engine.snapshot()
        if self._updates or stats != self._stats:
            self._conn.send(StepOutputs(self._updates, stats))
            self._updates, self._stats = [], stats


def child_main(spec: EngineSpec, inbox: Connection, outbox: Connection) -> None:
    """The engine process: load, report ready, run the engine until told to stop (or until the
    parent is gone), then exit without interpreter teardown (as the CLI does: MLX's native
    threads abort the process when destroyed at exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the parent drains
    logging.basicConfig(
        level=spec.log_level.upper(), format="%(levelname)s %(name)s[engine]: %(message)s"
    )
    try:
        from omlx_logprobs.models.loader import load_model

        model = load_model(spec.model, spec.name, spec.engine.max_model_len)
        engine = Engine(
            model.model, model.vocab, model.eos_token_ids, spec.engine, PipeOutbox(outbox)
        )
    except Exception as exc:
        log.exception("the engine process could not start")
        outbox.send(Failed(f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    heap.freeze_startup_objects()
    outbox.send(Ready(len(model.vocab)))  # first: from here on the engine thread sends
    engine.start()
    _serve_inbox(engine, inbox)
    engine.shutdown()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


def _serve_inbox(engine: Engine, inbox: Connection) -> None:
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if isinstance(msg, AddRequest):
            engine.submit(Submission(msg.seq, msg.final_only, progress=msg.progress))
        elif isinstance(msg, AbortRequest):
            engine.abort_id(msg.seq_id)
        elif isinstance(msg, BeginShutdown):
            engine.begin_shutdown(msg.grace_s)
        elif isinstance(msg, Stop):
            return


# ---- parent -----------------------------------------------------------------------------------
@dataclass
class _Wire:
    """The parent's ends: sends go through one thread (a signal handler may send too), receipts
    are read by another."""

    send: Connection
    recv: Connection
    outgoing: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)


class EngineProcess(EngineClient):
    """The server's handle on an engine in a child process: the calls `Engine` offers the API."""

    def __init__(self, spec: EngineSpec) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that may hold MLX or GPU state
        child_in, parent_out = ctx.Pipe(duplex=False)
        parent_in, child_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=child_main, args=(spec, child_in, child_out), name="omlx-engine", daemon=True
        )
        self._child_ends = (child_in, child_out)
        self._wire = _Wire(parent_out, parent_in)
        self._handles: dict[int, RequestHandle] = {}
        self._stats = NO_STATS
        self._gone: str | None = None  # why the engine process is no longer there
        self._lock = threading.Lock()  # a request is registered, or failed, never lost between
        self._threads: list[threading.Thread] = []
        self.vocab_size = 0

    # ---- lifetime ------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the child and wait until its model is loaded; RuntimeError if it fails."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the child, which loads the model; `wait_ready` waits for it."""
        self._proc.start()
        for end in self._child_ends:
            end.close()

    def wait_ready(self) -> None:
        try:
            msg = self._wire.recv.recv()
        except EOFError:
            self._proc.join(5)
            msg = Failed(f"exit status {self._proc.exitcode}")
        if isinstance(msg, Failed):
            raise RuntimeError(f"the engine process failed to start: {msg.message}")
        assert isinstance(msg, Ready)
        self.vocab_size = msg.vocab_size
        log.info("engine process %d ready", self._proc.pid)

    def start(self) -> None:
        for target, name in ((self._send_loop, "omlx-send"), (self._recv_loop, "omlx-recv")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._wire.outgoing.put(Stop())
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        self._wire.outgoing.put(None)  # ends the sender
        for thread in self._threads:
            thread.join(timeout)

    def begin_shutdown(self, grace_s: float) -> None:
        self._wire.outgoing.put(BeginShutdown(grace_s))  # safe in a signal handler

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ---- requests -----------------------------------------------------------------------------
    def add_group(
        self,
        seq: Sequence,
        loop: asyncio.AbstractEventLoop,
        final_only: bool = False,
        on_progress: Progress | None = None,
    ) -> list[RequestHandle]:
        handles = new_handles(seq, loop, final_only, on_progress)
        progress = final_only and on_progress is not None
        with self._lock:
            gone = self._gone
            if gone is None:  # registered before it is sent: an output may come back at once
                self._handles.update((h.seq.seq_id, h) for h in handles)
                self._wire.outgoing.put(AddRequest(seq, final_only, progress))
        if gone is not None:
            for handle in handles:
                _fail(handle, gone)
        return handles

    def abort(self, seq: Sequence) -> None:
        self._wire.outgoing.put(AbortRequest(seq.seq_id))

    def snapshot(self) -> EngineStats:
        return self._stats

    @property
    def alive(self) -> bool:
        return self._gone is None

    # ---- threads ------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while (msg := self._wire.outgoing.get()) is not None:
            try:
                self._wire.send.send(msg)
            except (OSError, ValueError):  # the child is gone; the receiver fails what is left
                return

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self._wire.recv.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, StepOutputs):
                self._apply(msg)
        self._proc.join(5)
        gone = f"the engine process has stopped (exit status {self._proc.exitcode})"
        with self._lock:
            self._gone = gone
            handles, self._handles = list(self._handles.values()), {}
        if handles:
            log.error("%s with %d requests unfinished", gone, len(handles))
        for handle in handles:
            _fail(handle, gone)

    def _apply(self, msg: StepOutputs) -> None:
        woken: list[RequestOutputCollector] = []
        for u in msg.updates:
            handle = self._handles.get(u.seq_id)
            if handle is None:
                continue
            seq, out = handle.seq, u.out
            append_from(seq.output_ids, u.output_from, u.output_ids)
            if u.entries is not None and seq.store is not None:
                seq.store.put(u.entries)
            if u.prompt is not None and seq.prompt_store is not None:
                seq.prompt_store.put(u.prompt)
            if out is None:  # records only: the request's server side may use them early
                if handle.on_progress is not None:
                    try:
                        handle.on_progress()
                    except Exception:  # an optimisation only: the end does the work instead
                        log.exception("progress hook failed for %s", seq.request_id)
                continue
            if out.finished:
                seq.finish(out.finish_reason or FinishReason.ERROR, out.error)
                del self._handles[u.seq_id]
            if handle.collector.deposit(out):
                woken.append(handle.collector)
        RequestOutputCollector.wake_all(woken)
        self._stats = msg.stats


def _fail(handle: RequestHandle, message: str) -> None:
    seq = handle.seq
    seq.finish(FinishReason.ERROR, message)
    n = seq.num_output
    out = RequestOutput(
        seq.request_id,
        "",
        n,
        n,
        finished=True,
        finish_reason=FinishReason.ERROR,
        prompt_tokens=seq.prompt_len,
        completion_tokens=n,
        error=message,
    )
    handle.collector.put(out)
