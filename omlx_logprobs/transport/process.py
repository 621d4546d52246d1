"""The engine in a process of its own, so the server's event loop (HTTP, JSON) and the engine's
step loop do not share one GIL.

The child loads the model and runs the same `Engine`, whose sink sends each step's
`RequestOutput`s (and the /health snapshot when it changed) over a pipe; the commands go the
other way as the records the engine itself is posted (engine/commands.py), each with the uid its
`Reply` comes back under. When the child dies, the requests and commands it held fail with an
error naming the cause, and the child is started again with a backoff (unless the server is
shutting down); requests and commands posted meanwhile wait for it.

What else crosses: transport/messages.py; the child's side: transport/child.py.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar

from omlx_logprobs.engine.commands import (
    BeginShutdown,
    ChangeAdapter,
    Command,
    Stop,
    Submit,
    UpdateWeights,
    posted,
)
from omlx_logprobs.engine.stats import EngineStats
from omlx_logprobs.transport.child import STOP_S, child_main
from omlx_logprobs.transport.client import Deliver, Lost
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

log = logging.getLogger("omlx_logprobs")
BACKOFF_S = (0.5, 30.0)  # the first restart's delay, doubled after each failure up to the second
STABLE_S = 60.0  # a child that ran this long before it died restarts after the first delay
# Beyond the engine's own bound on its stop (child.STOP_S), the child process's exit: a GPU's
# memory released. One bound for both, the parent's counted from before the child even read
# `Stop`, killed an engine that was still writing the prefix cache's disk tier.
EXIT_S = 20.0
A = TypeVar("A")


class _Child:
    """One engine process and the parent's ends of its pipes."""

    def __init__(self, spec: EngineSpec) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that may hold MLX or GPU state
        child_in, self.send = ctx.Pipe(duplex=False)
        self.recv, child_out = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=child_main, args=(spec, child_in, child_out), name="omlx-engine", daemon=True
        )
        self.proc.start()
        child_in.close()
        child_out.close()
        # The child ignores SIGTERM (transport/child.py), with which multiprocessing's exit hook
        # ends daemonic children before it joins them: at an exit without `shutdown`, the
        # child's pipe closes first (this hook runs before that one), and the child stops.
        atexit.register(self.send.close)

    def wait_ready(self) -> int:
        """The child's vocabulary size once its model is loaded; RuntimeError if it fails."""
        try:
            msg = self.recv.recv()
        except EOFError:
            self.proc.join(5)
            msg = Failed(self.cause())
        if isinstance(msg, (Failed, Fault)):
            raise RuntimeError(f"the engine process failed to start: {msg.message}")
        assert isinstance(msg, Ready)
        log.info("engine process %d ready", self.proc.pid)
        return msg.vocab_size

    def cause(self) -> str:
        code = self.proc.exitcode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"


class ProcessTransport:
    """The server's side of an engine in a child process (see the module's docstring)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.vocab_size = 0
        self._child: _Child | None = None
        # What the one sending thread sends, in order; None ends it.
        self._outgoing: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._up = threading.Event()  # a child is ready: requests may be sent
        self._stopping = threading.Event()
        self._closing = False  # shutdown has begun: a child that dies is not started again
        self._sent: dict[str, int] = {}  # requests the child holds: choices not yet finished
        self._stats = NO_STATS
        self._state = "stopped"
        self._threads: list[threading.Thread] = []
        # Commands waiting for their answer, by uid; those the child holds (sent to it).
        self._waiting: dict[int, tuple[Command[Any], Future[Any]]] = {}
        self._asked: set[int] = set()
        self._next_uid = 0
        self._fault: str | None = None  # why the child said it cannot go on
        self._lost: Lost | None = None
        self.restarts = 0  # children started again after one died (/metrics)

    # ---- lifetime ------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the child and wait until its model is loaded; RuntimeError if it fails."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the child, which loads the model; `wait_ready` waits for it."""
        self._child = _Child(self.spec)

    def wait_ready(self) -> None:
        assert self._child is not None
        self.vocab_size = self._child.wait_ready()
        self._state = "ok"
        self._up.set()

    def start(self, deliver: Deliver, lost: Lost) -> None:
        self._lost = lost
        for thread in (
            threading.Thread(target=self._send_loop, name="omlx-send", daemon=True),
            threading.Thread(
                target=self._watch, args=(deliver, lost), name="omlx-recv", daemon=True
            ),
        ):
            thread.start()
            self._threads.append(thread)

    def shutdown(self, timeout: float = STOP_S) -> None:
        """Stop the child: its engine stops within `timeout` (the child's own bound, counted
        from when it reads `Stop`), its process exits within EXIT_S more. A child not yet
        ready (a restart loading or warming) holds nothing to keep: it is ended at once."""
        self._stopping.set()
        self._outgoing.put((0, Stop()))
        child = self._child
        if child is not None:
            if not self._up.is_set():
                child.proc.kill()
            child.proc.join(timeout + EXIT_S)
            if child.proc.is_alive():
                log.warning(
                    "the engine process did not exit in %.0f s; killing it", timeout + EXIT_S
                )
                child.proc.kill()
                child.proc.join(5)
        self._outgoing.put(None)  # ends the sender
        for thread in self._threads:
            thread.join(timeout)
        self._refuse(None, "the server is shutting down")  # posted after the child stopped

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None

    @property
    def state(self) -> str:
        return self._state

    # ---- commands -----------------------------------------------------------------------------
    def post(self, command: Command[A]) -> Future[A]:
        """Send a command to the child (safe in a signal handler when nothing is to be
        answered). A restarted child starts unpaused: pause again after a restart
        (docs/specs/rl.md)."""
        if isinstance(command, BeginShutdown):
            self._closing = True
        if isinstance(command, Submit) and self._state == "failed" and self._lost is not None:
            self._lost([command.request.request_id], self._fault or "the engine process failed")
            return posted()  # no child will come back
        if not command.answered:
            self._outgoing.put((0, command))
            return posted()
        done: Future[A] = Future()
        with self._lock:
            self._next_uid += 1
            uid = self._next_uid
            self._waiting[uid] = (command, done)
        self._outgoing.put((uid, command))
        return done

    def snapshot(self) -> EngineStats:
        return self._stats

    # ---- threads ------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        """Sends in order; while no child is up, requests and commands wait here for the next
        one."""
        while (msg := self._outgoing.get()) is not None:
            uid, command = msg
            child = None
            while child is None:
                if not self._up.wait(0.5):
                    if self._stopping.is_set():
                        return
                    if self._state == "failed":  # no child will come back
                        self._drop(uid, command)
                        break
                    continue
                with self._lock:  # the watcher clears `_up` under this lock when a child dies
                    if not self._up.is_set():
                        continue
                    child = self._child
                    if isinstance(command, Submit):  # before the send: a death fails it
                        self._sent[command.request.request_id] = command.request.n
                    if uid:
                        self._asked.add(uid)
            if child is None:
                continue
            try:
                child.send.send(msg)
            except (OSError, ValueError):  # the child is gone: the watcher fails what it held
                pass

    def _drop(self, uid: int, command: Command[Any]) -> None:
        """No child will take this command: its request fails, or it is answered with why."""
        why = self._fault or "the engine process failed"
        if isinstance(command, Submit) and self._lost is not None:
            self._lost([command.request.request_id], why)
        if uid:
            self._refuse({uid}, why)

    def _watch(self, deliver: Deliver, lost: Lost) -> None:
        """Receive the child's outputs until it is gone; then fail what it held and start a
        new child, unless the server is stopping or shutting down, or the child led a group."""
        delay = BACKOFF_S[0]
        while True:
            child, began = self._child, time.monotonic()
            assert child is not None
            self._receive(child, deliver)
            child.proc.join(5)
            with self._lock:
                self._up.clear()
                self._state = "restarting"
                held, self._sent = list(self._sent), {}
                asked, self._asked = self._asked, set()
            if not self._restarts(child, held, lost):
                return
            if time.monotonic() - began > STABLE_S:
                delay = BACKOFF_S[0]
            why = f"the engine process stopped ({child.cause()})"
            log.error(
                "%s with %d requests unfinished; restarting it in %.1fs", why, len(held), delay
            )
            lost(held, why)
            self._refuse(asked, why)
            delay = self._restart(delay)
            if delay < 0:
                return

    def _restarts(self, child: _Child, held: list[str], lost: Lost) -> bool:
        """Whether a child that is gone is started again; if not, what it held fails and the
        transport stops (the server is stopping or shutting down), or fails (a group, which
        cannot be re-formed)."""
        last, self._stats = self._stats, NO_STATS
        why = f"the engine process stopped ({child.cause()})"
        if self._stopping.is_set():
            why, state = "the server is shutting down", "stopped"
        elif self._closing:  # a new child would serve nobody
            state = "stopped"
            log.warning("%s during shutdown; %d requests unfinished fail", why, len(held))
        elif self.spec.engine.parallel is not None:
            state = "failed"
            why = self._fault or f"{why}; its distributed group cannot be re-formed"
            log.error("%s; %d requests unfinished fail", why, len(held))
            self._fault = why
            if last.distributed is not None:  # /health still names the group's ranks
                self._stats = replace(NO_STATS, distributed=last.distributed.lost(why))
        else:
            return True
        self._state = state
        lost(held, why)
        self._refuse(None, why)
        return False

    def _receive(self, child: _Child, deliver: Deliver) -> None:
        while True:
            try:
                msg = child.recv.recv()
            except (EOFError, OSError):
                return
            match msg:
                case Reply(uid=uid, result=result):
                    self._answered(uid, result)
                case Fault(message=message):
                    self._fault = message
                case StepOutputs(outputs=outputs, stats=stats):
                    with self._lock:
                        for out in outputs:
                            if out.finished and out.request_id in self._sent:
                                self._sent[out.request_id] -= 1
                                if not self._sent[out.request_id]:
                                    del self._sent[out.request_id]
                    self._stats = stats
                    deliver(outputs)

    def _answered(self, uid: int, result: Any) -> None:
        """A command answered: a restarted child must serve the same weights and load the
        adapters loaded now."""
        with self._lock:
            self._asked.discard(uid)
            waiting = self._waiting.pop(uid, None)
        if waiting is None:  # answered already: the server stopped waiting
            return
        command, done = waiting
        match command:
            case UpdateWeights(update=update) if result.error is None:
                self.spec = replace(self.spec, weights_path=update.path, weights=result.version)
            case ChangeAdapter(change=change) if result is None:
                kept = tuple((n, p) for n, p in self.spec.adapters if n != change.name)
                if change.path is not None:
                    kept += ((change.name, change.path),)
                self.spec = replace(self.spec, adapters=kept)
        done.set_result(result)

    def _refuse(self, uids: set[int] | None, why: str) -> None:
        """Answer the commands waiting under `uids` (None: all) with why they were not done."""
        with self._lock:
            left = list(self._waiting) if uids is None else [u for u in uids if u in self._waiting]
            gone = [self._waiting.pop(uid) for uid in left]
        for command, done in gone:
            done.set_result(command.refused(why, self.spec.weights))

    def _restart(self, delay: float) -> float:
        """Start children until one is ready (waiting `delay`, doubled after each failure);
        the next delay, or -1 when the server began stopping or shutting down meanwhile."""
        while not self._stopping.wait(delay) and not self._closing:
            delay = min(2 * delay, BACKOFF_S[1])
            try:
                self.spawn()
                self.wait_ready()
            except RuntimeError as exc:
                if self._stopping.is_set():  # ended by `shutdown` while it loaded
                    break
                log.error("%s; trying again in %.1f s", exc, delay)
                continue
            log.info("the engine process is back (pid %s)", self.pid)
            self.restarts += 1
            return delay
        self._state = "stopped"
        return -1
