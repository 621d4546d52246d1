"""The API's one handle on the engine: submit an `EngineRequest`, read its `RequestOutput`s from
one collector per choice, abort it; the rest asked of the engine (weights, adapters, pause) as
the command records of engine/commands.py, through one `post`. Two transports carry the commands
to the engine and move the outputs into the collectors: the engine as a thread of this process
(`ThreadTransport`), or in a child process of its own (transport/process.py); nothing above this
module can tell which."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, TypeVar

from omlx_logprobs.control import (
    AdapterChange,
    Control,
    ControlResult,
    WeightUpdate,
    WeightUpdateResult,
)
from omlx_logprobs.engine.commands import (
    Abort,
    BeginShutdown,
    ChangeAdapter,
    Command,
    ControlCommand,
    Submit,
    UpdateWeights,
)
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.engine.stats import EngineStats
from omlx_logprobs.transport.collector import RequestOutputCollector
from omlx_logprobs.types import EngineRequest, FinishReason, RequestOutput

Deliver = Callable[[list[RequestOutput]], None]
Lost = Callable[[list[str], str], None]  # requests that can no longer finish, and why
A = TypeVar("A")


class Transport(Protocol):
    def start(self, deliver: Deliver, lost: Lost) -> None: ...

    def post(self, command: Command[A]) -> Future[A]:
        """The command on its way to the engine; its answer. Safe in a signal handler for a
        command with nothing to answer (`BeginShutdown`)."""
        ...

    def shutdown(self, timeout: float) -> None: ...

    def snapshot(self) -> EngineStats: ...

    @property
    def state(self) -> str:
        """ "ok", "restarting" (new requests wait) or "stopped"."""
        ...

    @property
    def restarts(self) -> int:
        """How many times the engine was started again after it died."""
        ...


class Observer(Protocol):
    """What watches requests pass (api/metrics/observer.py): each request as it is submitted (on
    the event loop), then its outputs as they reach the collectors (on the transport's thread)."""

    def submitted(self, req: EngineRequest) -> None: ...

    def delivered(self, outputs: list[RequestOutput]) -> None: ...


class ThreadTransport:
    """The engine as a thread of the server's process: its sink fills the collectors."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def start(self, deliver: Deliver, lost: Lost) -> None:
        self.engine.sink = deliver
        self.engine.start()

    def post(self, command: Command[A]) -> Future[A]:
        return self.engine.post(command)

    def shutdown(self, timeout: float) -> None:
        self.engine.shutdown(timeout)

    def snapshot(self) -> EngineStats:
        return self.engine.snapshot()

    @property
    def state(self) -> str:
        return "ok" if self.engine.alive else "stopped"

    @property
    def restarts(self) -> int:
        return 0  # an engine thread that dies is not started again


@dataclass
class RequestHandle:
    """One submitted request: a collector per choice, in choice order."""

    request_id: str
    choices: list[RequestOutputCollector]
    client: EngineClient

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    async def final(self) -> list[RequestOutput]:
        """Each choice's outputs, merged, once all have finished."""
        return list(await asyncio.gather(*[c.final() for c in self.choices]))

    def abort(self) -> None:
        """Abort what is unfinished (the consumer is gone)."""
        if not self.finished:
            self.client.abort(self.request_id)


class EngineClient:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._lock = threading.Lock()
        self._slots: dict[str, list[RequestOutputCollector]] = {}
        self._left: dict[str, int] = {}  # choices not yet finished
        self.observer: Observer | None = None  # /metrics' (api/metrics), when the app has one

    def start(self) -> None:
        self.transport.start(self._deliver, self._lost)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.transport.shutdown(timeout)
        with self._lock:
            left = list(self._slots)
        self._lost(left, "the server is shutting down")  # requests that never reached it

    def begin_shutdown(self, grace_s: float) -> None:
        """In-flight requests may finish for grace_s seconds; then they end with an error. Safe
        in a signal handler."""
        self.transport.post(BeginShutdown(grace_s))

    def post(self, command: Command[A]) -> Future[A]:
        """Any command to the engine (engine/commands.py); its answer's future."""
        return self.transport.post(command)

    def submit(self, req: EngineRequest) -> RequestHandle:
        """On the event loop: the request goes to the engine; its handle."""
        loop = asyncio.get_running_loop()
        slots = [RequestOutputCollector(loop) for _ in range(req.n)]
        with self._lock:  # registered before it is sent: an output may come back at once
            self._slots[req.request_id] = slots
            self._left[req.request_id] = req.n
        if self.observer is not None:
            self.observer.submitted(req)
        self.transport.post(Submit(req))
        return RequestHandle(req.request_id, slots, self)

    def abort(self, request_id: str) -> None:
        self.transport.post(Abort(request_id))

    def snapshot(self) -> EngineStats:
        return self.transport.snapshot()

    async def update_weights(self, update: WeightUpdate) -> WeightUpdateResult:
        """New weights, once the requests in flight have finished or been aborted."""
        return await asyncio.wrap_future(self.post(UpdateWeights(update)))

    async def change_adapter(self, change: AdapterChange) -> str | None:
        """Load, replace or unload a LoRA adapter: None once done, else why nothing changed."""
        return await asyncio.wrap_future(self.post(ChangeAdapter(change)))

    async def control(self, command: Control) -> ControlResult:
        """Pause, resume or flush the engine: its answer once done (docs/specs/rl.md)."""
        return await asyncio.wrap_future(self.post(ControlCommand(command)))

    @property
    def state(self) -> str:
        """The transport's state, or "failed" once the processes a model is split over can
        no longer run it (distributed/distributed.py): /health answers 503."""
        group = self.transport.snapshot().distributed
        if group is not None and group.state != "ok":
            return "failed"
        return self.transport.state

    @property
    def alive(self) -> bool:
        return self.state == "ok"

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished (a model with none may be unloaded)."""
        with self._lock:
            return len(self._slots)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """The transport's thread: each output into its choice's collector; consumers woken
        together, with one cross-thread call per event loop."""
        woken = []
        with self._lock:
            for out in outputs:
                slots = self._slots.get(out.request_id)
                if slots is None:
                    continue
                if slots[out.index].deposit(out):
                    woken.append(slots[out.index])
                if out.finished:
                    self._left[out.request_id] -= 1
                    if not self._left[out.request_id]:
                        del self._slots[out.request_id], self._left[out.request_id]
        RequestOutputCollector.wake_all(woken)
        if self.observer is not None:
            self.observer.delivered(outputs)

    def _lost(self, request_ids: list[str], message: str) -> None:
        """End requests that can no longer finish with an error naming why."""
        with self._lock:
            lost = [(rid, self._slots.pop(rid, [])) for rid in request_ids]
            for rid, _ in lost:
                self._left.pop(rid, None)
        ends = [
            (
                slot,
                RequestOutput(
                    rid, i, finished=True, finish_reason=FinishReason.ERROR, error=message
                ),
            )
            for rid, slots in lost
            for i, slot in enumerate(slots)
        ]
        for slot, end in ends:
            slot.put(end)
        if self.observer is not None:
            self.observer.delivered([end for _, end in ends])


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of every choice of several requests as they come: (position of the handle
    in `handles`, output); the output's `index` names the choice. One choice is read straight
    from its collector (no task, no queue)."""
    slots = [(i, slot) for i, h in enumerate(handles) for slot in h.choices]
    if len(slots) == 1:
        i, slot = slots[0]
        while True:
            out = await slot.get()
            yield i, out
            if out.finished:
                return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, slot: RequestOutputCollector) -> None:
        while True:
            out = await slot.get()
            queue.put_nowait((i, out))
            if out.finished:
                return

    tasks = [asyncio.ensure_future(pump(i, slot)) for i, slot in slots]
    try:
        left = len(tasks)
        while left:
            i, out = await queue.get()
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
