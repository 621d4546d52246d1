"""Sessions whose client is gone (api/tinker/sessions.py's `expire_s` without a heartbeat or a
call) end as finished ones do, so that their training runs and sampler snapshots do not hold
the engine's memory for good: a task on the event loop looks every few seconds while any
session is live, and stops when none is."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from omlx_logprobs.api.tinker.sessions import HEARTBEAT_S, Sessions

log = logging.getLogger("omlx_logprobs")


class Expiry:
    def __init__(self, sessions: Sessions, finish: Callable[[str], Awaitable[None]]) -> None:
        """`finish`: what ends a session (its training runs dropped from their engines)."""
        self.sessions, self.finish = sessions, finish
        self.every_s = min(HEARTBEAT_S, sessions.expire_s / 3)
        self._task: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """On the event loop, when a session opens: the sweep runs (again) if it had stopped."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._sweep(), name="tinker session expiry")

    async def _sweep(self) -> None:
        while self.sessions.sessions:
            await asyncio.sleep(self.every_s)
            for sid in self.sessions.expired():
                log.info(
                    "tinker: session %s unheard of for %.0f s: ended", sid, self.sessions.expire_s
                )
                try:
                    await self.finish(sid)
                except Exception:  # finished meanwhile, or its engine gone: the next one
                    log.exception("tinker: ending the expired session %s failed", sid)
