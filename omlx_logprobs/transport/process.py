"""The engine in a process of its own, so the server's event loop (HTTP, JSON) and the engine's
step loop do not share one GIL.

The child loads the model and runs the same `Engine`, whose sink sends each step's
`RequestOutput`s (and the /health snapshot when it changed) over a pipe; requests go the other
way as the `EngineRequest`s themselves. When the child dies, the requests it held fail with an
error naming the cause, and the child is started again with a backoff; requests submitted
meanwhile wait for it.

The messages that cross: transport/messages.py; the child's side: transport/child.py.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from omlx_logprobs.engine.stats import EngineStats
from omlx_logprobs.transport.child import child_main
from omlx_logprobs.transport.client import Deliver, Lost
from omlx_logprobs.transport.messages import (
    NO_STATS,
    Abort,
    AdapterChanged,
    BeginShutdown,
    ChangeAdapter,
    ControlCommand,
    Controlled,
    EngineSpec,
    Failed,
    Fault,
    Ready,
    StepOutputs,
    Stop,
    UpdateWeights,
    WeightsUpdated,
)
from omlx_logprobs.types import (
    AdapterChange,
    Control,
    ControlResult,
    EngineRequest,
    WeightUpdate,
    WeightUpdateResult,
)

log = logging.getLogger("omlx_logprobs")
BACKOFF_S = (0.5, 30.0)  # the first restart's delay, doubled after each failure up to the second
STABLE_S = 60.0  # a child that ran this long before it died restarts after the first delay


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
        self._outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()  # one sending thread
        self._lock = threading.Lock()
        self._up = threading.Event()  # a child is ready: requests may be sent
        self._stopping = threading.Event()
        self._sent: dict[str, int] = {}  # requests the child holds: choices not yet finished
        self._stats = NO_STATS
        self._state = "stopped"
        self._threads: list[threading.Thread] = []
        self._updates: dict[int, tuple[WeightUpdate, Future[WeightUpdateResult]]] = {}
        self._adapter_changes: dict[int, tuple[AdapterChange, Future[str | None]]] = {}
        self._controls: dict[int, Future[ControlResult]] = {}
        self._next_update = 0
        self._fault: str | None = None  # why the child said it cannot go on
        self._lost: Lost | None = None

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

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._outgoing.put(Stop())
        child = self._child
        if child is not None:
            child.proc.join(timeout)
            if child.proc.is_alive():
                log.warning("the engine process did not stop in %.0f s; killing it", timeout)
                child.proc.kill()
                child.proc.join(5)
        self._outgoing.put(None)  # ends the sender
        for thread in self._threads:
            thread.join(timeout)

    def begin_shutdown(self, grace_s: float) -> None:
        self._outgoing.put(BeginShutdown(grace_s))  # safe in a signal handler

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None

    @property
    def state(self) -> str:
        return self._state

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        if self._state == "failed" and self._lost is not None:  # no child will come back
            self._lost([req.request_id], self._fault or "the engine process failed")
            return
        self._outgoing.put(req)

    def abort(self, request_id: str) -> None:
        self._outgoing.put(Abort(request_id))

    def snapshot(self) -> EngineStats:
        return self._stats

    def update_weights(self, update: WeightUpdate) -> Future[WeightUpdateResult]:
        done: Future[WeightUpdateResult] = Future()
        with self._lock:
            self._next_update += 1
            uid = self._next_update
            self._updates[uid] = (update, done)
        self._outgoing.put(UpdateWeights(uid, update))
        return done

    def change_adapter(self, change: AdapterChange) -> Future[str | None]:
        done: Future[str | None] = Future()
        with self._lock:
            self._next_update += 1
            uid = self._next_update
            self._adapter_changes[uid] = (change, done)
        self._outgoing.put(ChangeAdapter(uid, change))
        return done

    def control(self, command: Control) -> Future[ControlResult]:
        """A restarted child starts unpaused: pause again after a restart (docs/specs/rl.md)."""
        done: Future[ControlResult] = Future()
        with self._lock:
            self._next_update += 1
            uid = self._next_update
            self._controls[uid] = done
        self._outgoing.put(ControlCommand(uid, command))
        return done

    # ---- threads ------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        """Sends in order; while no child is up, requests wait here for the next one."""
        while (msg := self._outgoing.get()) is not None:
            child = None
            while child is None:
                if not self._up.wait(0.5):
                    if self._stopping.is_set():
                        return
                    if self._state == "failed":  # no child will come back
                        if isinstance(msg, EngineRequest) and self._lost is not None:
                            self._lost([msg.request_id], self._fault or "the engine failed")
                        break
                    continue
                with self._lock:  # the watcher clears `_up` under this lock when a child dies
                    if not self._up.is_set():
                        continue
                    child = self._child
                    if isinstance(msg, EngineRequest):  # before the send: a death fails it
                        self._sent[msg.request_id] = msg.n
            if child is None:
                continue
            try:
                child.send.send(msg)
            except (OSError, ValueError):  # the child is gone: the watcher fails what it held
                pass

    def _watch(self, deliver: Deliver, lost: Lost) -> None:
        """Receive the child's outputs until it is gone; then fail what it held and start a
        new child, unless the server is stopping."""
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
            last, self._stats = self._stats, NO_STATS
            if self._stopping.is_set():
                self._state = "stopped"
                lost(held, "the server is shutting down")
                self._fail_updates("the server is shutting down")
                return
            if time.monotonic() - began > STABLE_S:
                delay = BACKOFF_S[0]
            why = f"the engine process stopped ({child.cause()})"
            if self.spec.engine.parallel is not None:  # a group is not re-formed: no restart
                why = self._fault or f"{why}; its distributed group cannot be re-formed"
                log.error("%s; %d requests unfinished fail", why, len(held))
                self._fault, self._state = why, "failed"
                if last.distributed is not None:  # /health still names the group's ranks
                    self._stats = replace(NO_STATS, distributed=last.distributed.lost(why))
                lost(held, why)
                self._fail_updates(why)
                return
            log.error(
                "%s with %d requests unfinished; restarting it in %.1fs", why, len(held), delay
            )
            lost(held, why)
            self._fail_updates(why)
            delay = self._restart(delay)
            if delay < 0:
                return

    def _receive(self, child: _Child, deliver: Deliver) -> None:
        while True:
            try:
                msg = child.recv.recv()
            except (EOFError, OSError):
                return
            if isinstance(msg, WeightsUpdated):
                self._updated(msg)
            if isinstance(msg, Fault):
                self._fault = msg.message
            if isinstance(msg, AdapterChanged):
                self._adapter_changed(msg)
            if isinstance(msg, Controlled):
                with self._lock:
                    answered = self._controls.pop(msg.uid)
                answered.set_result(msg.result)
            if not isinstance(msg, StepOutputs):
                continue
            with self._lock:
                for out in msg.outputs:
                    if out.finished and out.request_id in self._sent:
                        self._sent[out.request_id] -= 1
                        if not self._sent[out.request_id]:
                            del self._sent[out.request_id]
            self._stats = msg.stats
            deliver(msg.outputs)

    def _updated(self, msg: WeightsUpdated) -> None:
        """An update answered: a restarted child must serve the same weights."""
        with self._lock:
            update, done = self._updates.pop(msg.uid)
        if msg.result.error is None:
            self.spec = replace(self.spec, weights_path=update.path, weights=msg.result.version)
        done.set_result(msg.result)

    def _adapter_changed(self, msg: AdapterChanged) -> None:
        """A restarted child loads the adapters loaded now."""
        with self._lock:
            change, done = self._adapter_changes.pop(msg.uid)
        if msg.error is None:
            kept = tuple((n, p) for n, p in self.spec.adapters if n != change.name)
            if change.path is not None:
                kept += ((change.name, change.path),)
            self.spec = replace(self.spec, adapters=kept)
        done.set_result(msg.error)

    def _fail_updates(self, why: str) -> None:
        with self._lock:
            pending, self._updates = list(self._updates.values()), {}
            changes, self._adapter_changes = list(self._adapter_changes.values()), {}
            controls, self._controls = list(self._controls.values()), {}
        for _, done in pending:
            done.set_result(WeightUpdateResult(self.spec.weights, why))
        for _, changed in changes:
            changed.set_result(why)
        for control in controls:
            control.set_result(ControlResult(False, error=why))

    def _restart(self, delay: float) -> float:
        """Start children until one is ready (waiting `delay`, doubled after each failure);
        the next delay, or -1 when the server began stopping meanwhile."""
        while not self._stopping.wait(delay):
            delay = min(2 * delay, BACKOFF_S[1])
            try:
                self.spawn()
                self.wait_ready()
            except RuntimeError as exc:
                log.error("%s; trying again in %.1f s", exc, delay)
                continue
            log.info("the engine process is back (pid %s)", self.pid)
            return delay
        self._state = "stopped"
        return -1
