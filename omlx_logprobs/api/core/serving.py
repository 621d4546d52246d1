"""A generation route from its parsed body to its HTTP response, the same for every API: the
fields no model declares named (a 400, or with --ignore-unknown-fields a header), the model
leased (loaded first if need be), the request started (prepared and submitted: a bad request
raises its 400 here, before any byte of a stream), then streamed (SSE or NDJSON) or awaited
whole as one JSON body; 499 when the client left first. Each API says only how its request
starts (`Run`)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response

from omlx_logprobs.api.core import sse
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.fields import check_unknown
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.slot import ModelSlot


class Run(Protocol):
    """One started request: its stream, or its whole body."""

    def events(self) -> AsyncIterator[str]: ...

    async def complete(self, raw: Request) -> str: ...


async def respond(
    pool: ModelPool,
    req: Any,
    raw: Request,
    start: Callable[[ModelSlot], Run | Awaitable[Run]],
    media: str = sse.SSE,
    name: str | None = None,
) -> Response:
    """`name`: the model, when the body does not call it `model` (SGLang's). `start` may be
    awaited: a request with images is prepared off the event loop (api/core/prepare.py)."""
    if not pool.ignore_unknown_fields:
        check_unknown(req, False)
    if pool.sleeping:  # vLLM's answer while asleep (docs/specs/rl.md, "Sleep and wake")
        raise APIError(
            "Model is currently in sleep mode. Please wake it up first with a POST request to"
            " /wake_up",
            status=503,
            code="model_sleeping",
            type_="ModelSleepingError",
        )
    async with pool.use(name if name is not None else req.model) as slot:
        headers = slot.live.fields_headers(req)
        started = start(slot)
        run = await started if inspect.isawaitable(started) else started
        if req.stream:  # submitted by now: the engine counts it as in flight until it ends
            return sse.streaming(run.events(), media, headers)
        try:
            body = await run.complete(raw)
        except ConnectionAbortedError:
            return Response(status_code=499)
    return Response(body, media_type="application/json", headers=headers)
