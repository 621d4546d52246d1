"""One slot per choice of a request, between the thread that delivers the engine's outputs and
the asyncio consumer.

When the consumer lags, a new output is merged into the one still waiting (tokens, entries and
text concatenated), so a slow client never stalls the engine and nothing is lost.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

from omlx_logprobs.types import RequestOutput


class RequestOutputCollector:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()
        self.finished = False  # the consumer has taken the choice's last output

    def put(self, out: RequestOutput) -> None:
        """Delivering thread: deposit or merge, then wake the consumer."""
        if self.deposit(out):
            self._loop.call_soon_threadsafe(self._ready.set)

    def deposit(self, out: RequestOutput) -> bool:
        """Delivering thread: deposit or merge; True when the consumer needs a wake-up
        (`wake_all`)."""
        with self._lock:
            first = self._pending is None
            self._pending = out if self._pending is None else self._pending.merge(out)
        return first

    @staticmethod
    def wake_all(collectors: Iterable[RequestOutputCollector]) -> None:
        """Wake many consumers with one cross-thread call per event loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        for c in collectors:
            by_loop.setdefault(c._loop, []).append(c._ready)
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_set_all, events)

    async def get(self) -> RequestOutput:
        """Event loop: wait for the next (possibly merged) output."""
        while True:
            await self._ready.wait()
            with self._lock:
                out, self._pending = self._pending, None
                self._ready.clear()
            if out is not None:
                self.finished = out.finished
                return out

    async def final(self) -> RequestOutput:
        """Event loop: every output until the choice finishes, merged."""
        out = await self.get()
        while not out.finished:
            out = out.merge(await self.get())
        return out


def _set_all(events: list[asyncio.Event]) -> None:
    for e in events:
        e.set()
