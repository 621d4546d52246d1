"""Tinker's futures: every training and sampling call answers at once with a request id, runs as
a task, and is polled with `POST /api/v1/retrieve_future`. A poll waits up to LONG_POLL_S for
the task (the SDK polls again at once on `try_again`), then answers its result: JSON, the
protobuf bytes of a forward or a sample, or `{"error", "category"}` (the SDK raises
`RequestFailedError`). Results are kept a while after they finish, for a poll that is retried
after a broken connection. A sample the SDK abandons (a timeout, a local cancel) is cancelled
with `POST /api/v1/cancel_future`: its engine request is aborted, and a later poll answers that
it was cancelled; training calls run to their end (a half-done one would leave half a
gradient)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from omlx_logprobs.api.core.errors import APIError

log = logging.getLogger("omlx_logprobs")
LONG_POLL_S = 30.0  # under the SDK's 45 s timeout of a poll
KEEP_S = 600.0  # how long a finished result waits for its poll
KEEP = 4096  # finished results kept at most
CANCELLABLE = frozenset({"sample"})  # the kinds of call cancel_future stops


class Failed(Exception):
    """A call that failed: `user` the request's fault (category "user"), else the server's."""

    def __init__(self, message: str, user: bool = True) -> None:
        super().__init__(message)
        self.message, self.user = message, user


@dataclass
class Result:
    """A finished call's answer: a JSON body, or protobuf bytes."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None


@dataclass
class _Entry:
    task: asyncio.Task[Result]
    kind: str
    done_at: float = 0.0


class Futures:
    def __init__(self) -> None:
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def start(self, kind: str, work: Coroutine[Any, Any, Result]) -> str:
        """Run `work` as a task; its request id."""
        rid = f"{kind}-{uuid.uuid4().hex}"
        entry = _Entry(asyncio.create_task(work), kind)
        entry.task.add_done_callback(lambda _t: setattr(entry, "done_at", time.monotonic()))
        self._entries[rid] = entry
        self._trim()
        return rid

    async def retrieve(self, rid: str) -> Result:
        """The result, once done; a `try_again` body while it runs past the long poll."""
        entry = self._entries.get(rid)
        if entry is None:
            raise APIError(f"no request {rid!r} (unknown, or its result expired)", status=404)
        if not entry.task.done():
            done, _ = await asyncio.wait({entry.task}, timeout=LONG_POLL_S)
            if not done:
                return Result({"type": "try_again", "request_id": rid, "queue_state": "active"})
        if entry.task.cancelled():
            return Result({"error": f"the request {rid} was cancelled", "category": "user"})
        exc = entry.task.exception()
        if exc is None:
            return entry.task.result()
        if isinstance(exc, Failed):
            return Result({"error": exc.message, "category": "user" if exc.user else "server"})
        if isinstance(exc, APIError):
            return Result({"error": exc.message, "category": "user"})
        log.error("tinker %s request failed", entry.kind, exc_info=exc)
        return Result({"error": f"internal error: {exc}", "category": "server"})

    def cancel(self, rid: str) -> None:
        """Stop a sample in flight (a finished one, or another kind of call: nothing)."""
        entry = self._entries.get(rid)
        if entry is None:
            raise APIError(f"no request {rid!r} (unknown, or its result expired)", status=404)
        if entry.kind in CANCELLABLE:
            entry.task.cancel()

    def _trim(self) -> None:
        """The oldest finished results go once expired, or while more than KEEP are kept."""
        now = time.monotonic()
        while self._entries:
            rid, e = next(iter(self._entries.items()))
            expired = e.task.done() and now - e.done_at > KEEP_S
            if not (expired or (len(self._entries) > KEEP and e.task.done())):
                break
            del self._entries[rid]
