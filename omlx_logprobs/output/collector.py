"""One slot per request between the engine thread and the asyncio consumer.

When the consumer lags, a new output is merged into the one still waiting (text concatenated,
token range widened), so a slow client never stalls the engine and nothing is lost.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

from omlx_logprobs.types import RequestOutput


class RequestOutputCollector:
    def __init__(self, loop: asyncio.AbstractEventLoop, final_only: bool = False) -> None:
        self._loop = loop
        # A consumer that wants only the finished output (a non-streamed response) is woken
        # once, at the end, not after every step.
        self.final_only = final_only
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        """Engine thread: deposit or merge, then wake the consumer."""
        if self.deposit(out):
            self._loop.call_soon_threadsafe(self._ready.set)

    def deposit(self, out: RequestOutput) -> bool:
        """Engine thread: deposit or merge; True when the consumer needs a wake-up (`wake_all`)."""
        with self._lock:
            first = self._pending is None
            self._pending = out if self._pending is None else self._pending.merge(out)
        return out.finished if self.final_only else first

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
                return out


def _set_all(events: list[asyncio.Event]) -> None:
    for e in events:
        e.set()
