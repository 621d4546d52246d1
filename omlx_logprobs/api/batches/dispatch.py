"""One batch line's body through the route it names, in this process and without HTTP: the
route's own handler (the function FastAPI calls for `POST /v1/chat/completions` and the rest)
given the body parsed into its model, so a line takes every field, and answers with the same
body and status, as the interactive request; only its priority is lowered (interactive
requests go first) and a stream is refused (a batch line is answered whole)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from omlx_logprobs.api.core.errors import APIError, invalid_body, shaped_body
from omlx_logprobs.types import PRIORITY_RANGE

log = logging.getLogger("omlx_logprobs")

# The endpoints of OpenAI's batches that a route of this server may serve (batch_create_params).
BATCH_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
)
# Added to a line's own `priority` (lower is scheduled first): every batch line waits behind
# the interactive requests of the default priority, and the batch's lines keep their order.
BATCH_PRIORITY = 2**30


@dataclass(frozen=True)
class Target:
    """A route's handler and how it is called: its body model and parameter names."""

    path: str
    model: type[BaseModel]
    body_param: str
    request_param: str | None
    handler: Callable[..., Awaitable[Any]]


def targets(app: FastAPI) -> dict[str, Target]:
    """The batch endpoints this app serves: a POST route whose handler takes the body as one
    model (and perhaps the Request)."""
    found = {}
    for route in app.routes:
        if not (isinstance(route, APIRoute) and route.path in BATCH_ENDPOINTS):
            continue
        d = route.dependant
        if "POST" not in (route.methods or ()) or len(d.body_params) != 1 or d.dependencies:
            continue
        model = d.body_params[0].field_info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            found[route.path] = Target(
                route.path, model, d.body_params[0].name, d.request_param_name, route.endpoint
            )
    return found


def batch_priority(own: int) -> int:
    return min(max(BATCH_PRIORITY + own, PRIORITY_RANGE[0]), PRIORITY_RANGE[1])


async def call(target: Target, body: Any, stop: asyncio.Event) -> tuple[int, Any]:
    """The status and JSON body the route answers `body` with; 499 when `stop` was set while
    it ran (the request aborted, as when an interactive client leaves)."""
    path = target.path
    try:
        req = target.model.model_validate(body)
    except ValidationError as e:
        return 400, shaped_body(invalid_body(e.errors()), path)
    if getattr(req, "stream", False):
        err = APIError("A batch line is answered whole: `stream` must be false.", "stream")
        return 400, shaped_body(err, path)
    if isinstance(getattr(req, "priority", None), int):
        req = req.model_copy(update={"priority": batch_priority(req.priority)})  # type: ignore[attr-defined]
    kwargs: dict[str, Any] = {target.body_param: req}
    if target.request_param is not None:
        kwargs[target.request_param] = detached_request(path, stop)
    try:
        response = await target.handler(**kwargs)
    except APIError as e:
        return e.status, shaped_body(e, path)
    except HTTPException as e:
        return e.status_code, shaped_body(APIError(str(e.detail), status=e.status_code), path)
    except Exception as e:  # a bug answers this line as a 500, as the app's handler would
        log.exception("batch line for %s failed", path)
        err = APIError(f"internal error: {type(e).__name__}", status=500, type_="server_error")
        return 500, shaped_body(err, path)
    if not isinstance(response, Response):  # a handler that returns its body's value
        return 200, jsonable_encoder(response)
    return response.status_code, json.loads(bytes(response.body)) if response.body else None


def detached_request(path: str, stop: asyncio.Event) -> Request:
    """A Request with no body and no client: its only message is the disconnect, once `stop`
    is set (a cancelled batch, a server shutting down)."""
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}

    async def receive() -> dict[str, Any]:
        await stop.wait()
        return {"type": "http.disconnect"}

    return Request(scope, receive)
