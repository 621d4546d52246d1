"""The engine child's side (transport/process.py): its main function, the spawn target, which
builds the engine (transport/build.py) and runs it; the sink that sends each step's outputs over
the pipe; the loop that posts the parent's commands to the engine and sends their answers back."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from omlx_logprobs import heap
from omlx_logprobs.distributed.sharded import SplitRefused
from omlx_logprobs.engine.commands import Stop
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.transport.messages import (
    NO_STATS,
    EngineSpec,
    Failed,
    Fault,
    Posted,
    Ready,
    Reply,
    StepOutputs,
)
from omlx_logprobs.types import RequestOutput

log = logging.getLogger("omlx_logprobs")
# The engine's own bound on its stop (the step in flight, the prefix cache's disk tier written);
# the parent waits for this process longer than that (transport/process.py).
STOP_S = 10.0


class _PipeSink:
    """The child engine's sink: one message a step, when it has outputs or new stats."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.engine: Engine | None = None
        self._stats = NO_STATS
        self._lock = threading.Lock()  # replies may come from the inbox thread

    def __call__(self, outputs: list[RequestOutput]) -> None:
        if self.engine is None:  # before `Ready`: the start-up warm's steps, nobody's request
            return
        stats = self.engine.snapshot()
        if outputs or stats != self._stats:
            self.reply(StepOutputs(outputs, stats))
            self._stats = stats

    def reply(self, msg: Any) -> None:
        with self._lock:
            self.conn.send(msg)

    def answer(self, reply: Reply) -> None:
        """A command's answer, after the stats it changed: the parent's snapshot, which the
        API reads (/is_sleeping after /sleep, /is_paused after /pause), is the engine's by the
        time the command is answered. The snapshot is taken outside the lock, as the step's."""
        stats = self.engine.snapshot() if self.engine is not None else None
        with self._lock:
            if stats is not None and stats != self._stats:
                self.conn.send(StepOutputs([], stats))
                self._stats = stats
            self.conn.send(reply)


def child_main(spec: EngineSpec, inbox: Connection, outbox: Connection) -> None:
    """The engine process: load, report ready, run the engine until told to stop (or until the
    parent is gone), then exit without interpreter teardown (as the CLI does: MLX's native
    threads abort the process when destroyed at exit)."""
    # Ctrl-C, and a service manager's SIGTERM, reach the whole process group: the parent drains
    # and then stops the engine (`Stop`), which writes the prefix cache's disk tier first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level.upper(), format="%(levelname)s %(name)s[engine]: %(message)s"
    )
    heap.set_switch_interval()
    ready = threading.Event()
    threading.Thread(
        target=_end_with_parent, args=(ready,), name="omlx-parent", daemon=True
    ).start()
    sink = _PipeSink(outbox)
    try:
        from omlx_logprobs.transport.build import build_engine

        model, engine = build_engine(spec, sink, on_hang=partial(_fault, sink))
    except SplitRefused as exc:  # said in the log already, on every rank: no traceback
        _tell(outbox, Failed(str(exc)))
        os._exit(2)
    except Exception as exc:
        log.exception("the engine process could not start")
        _tell(outbox, Failed(f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    heap.freeze_startup_objects()
    engine.start()  # returns once the engine's start-up warms are done: ready means ready
    ready.set()
    _tell(outbox, Ready(len(model.vocab)))  # first: from here on the engine thread sends
    sink.engine = engine
    _serve_inbox(engine, inbox, sink)
    engine.shutdown(STOP_S)
    if engine.alive:  # the parent waits longer (transport/process.py): say why it waited
        log.warning("the engine did not stop in %.0f s; the engine process exits anyway", STOP_S)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


def _tell(outbox: Connection, msg: Failed | Ready) -> None:
    """Send the parent what became of the start; if it is gone, end here: an exception would
    leave through multiprocessing's interpreter teardown, which waits on the engine's threads
    (and MLX's) and, as SIGTERM is ignored, only SIGKILL ended."""
    try:
        outbox.send(msg)
    except OSError:
        log.warning("the server's process is gone: the engine process ends")
        logging.shutdown()
        os._exit(1)


def _end_with_parent(ready: threading.Event) -> None:
    """Until the engine is ready: if the server's process is gone (killed outright; SIGTERM and
    SIGINT end this process from there: transport/starting.py), end rather than load and warm
    a model for nobody. Once ready, the inbox's end stops the engine (`_serve_inbox`)."""
    parent = mp.parent_process()
    if parent is None:
        return
    parent.join()  # its sentinel: closed when the parent exits, however it does
    if not ready.is_set():
        log.warning("the server's process is gone: the engine process ends before it is ready")
        logging.shutdown()
        os._exit(1)


def _fault(sink: _PipeSink, message: str) -> None:
    """Tell the parent why, then end: the engine thread is stuck where it cannot be got back."""
    try:
        sink.reply(Fault(message))
    finally:
        logging.shutdown()
        os._exit(3)


def _reply(sink: _PipeSink, uid: int, done: Future[Any]) -> None:
    sink.answer(Reply(uid, done.result()))


def _serve_inbox(engine: Engine, inbox: Connection, sink: _PipeSink) -> None:
    """Post each command the parent sends; answer those with a uid once done. Until `Stop`, or
    until the parent is gone."""
    while True:
        try:
            msg: Posted = inbox.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        uid, command = msg
        done = engine.post(command)
        if uid:
            done.add_done_callback(partial(_reply, sink, uid))
        if isinstance(command, Stop):
            return
