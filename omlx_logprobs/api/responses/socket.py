"""The Responses API's WebSocket mode (the Open Responses specification's "WebSocket Transport"):
`/v1/responses` upgraded, each turn a `response.create` message (a create body without the HTTP
fields `stream`, `stream_options`, `background`) answered by the same events a stream carries,
one JSON message each, turns one after another. The connection keeps its latest response, so a
`store: false` chain continues on its own socket (never elsewhere, nor after a reconnect); a
continuation that fails forgets the response it named. A failure is an `error` envelope with an
HTTP-like `status` and a string `error.code`; the connection stays open for the next turn,
until its 60 minutes are over (`websocket_connection_limit_reached`, then closed)."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from omlx_logprobs.api.core.errors import APIError, invalid_body
from omlx_logprobs.api.core.fields import check_unknown
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.responses.protocol import ResponsesRequest
from omlx_logprobs.api.responses.routes import ResponseRun
from omlx_logprobs.api.responses.store import ResponseStore

LIFETIME_S = 60 * 60.0
HTTP_ONLY = ("stream", "stream_options", "background")


def add_socket(app: FastAPI, pool: ModelPool, store: ResponseStore) -> None:
    @app.websocket("/v1/responses")
    async def response_socket(ws: WebSocket) -> None:
        await ws.accept()
        opened = time.monotonic()
        local = ResponseStore(count=1)  # the latest response, whatever its `store`
        while True:
            try:
                message = await ws.receive_text()
            except WebSocketDisconnect:
                return
            if time.monotonic() - opened > LIFETIME_S:
                limit = APIError(
                    "This WebSocket has been open 60 minutes: open a new one.",
                    code="websocket_connection_limit_reached",
                )
                await ws.send_text(envelope(limit))
                await ws.close()
                return
            req: ResponsesRequest | None = None
            try:
                req = request(message)
                if not pool.ignore_unknown_fields:
                    check_unknown(req, False)
                async with pool.use(req.model) as slot:
                    run = await ResponseRun.start(req, slot.live, store, local)
                    async for event in run.events():
                        await ws.send_text(event_body(event))
            except APIError as e:
                if req is not None and req.previous_response_id is not None:
                    local.delete(req.previous_response_id)
                await ws.send_text(envelope(e))
            except WebSocketDisconnect:
                return


def request(message: str) -> ResponsesRequest:
    """A `response.create` message as the create body it carries (always streamed)."""
    try:
        body = json.loads(message)
    except ValueError as e:
        raise APIError(f"The message is not JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict) or body.get("type") != "response.create":
        raise APIError(
            'Each message must be a JSON object with "type": "response.create".',
            param="type",
            code="invalid_event",
        )
    for name in HTTP_ONLY:
        if name in body:
            raise APIError(
                f"{name} is an HTTP field: a WebSocket message must not send it.",
                param=name,
                code="unsupported_parameter",
            )
    fields = {k: v for k, v in body.items() if k != "type"}
    try:
        return ResponsesRequest.model_validate({**fields, "stream": True})
    except ValidationError as e:  # as an HTTP body's: the first field at fault
        raise invalid_body(e.errors()) from None


def event_body(event: str) -> str:
    """A stream's named server-sent event (api/core/sse.event) as the JSON it carries."""
    return event.split("data: ", 1)[1].rstrip("\n")


def envelope(e: APIError) -> str:
    """The specification's WebSocket error: `status` and a string `error.code` always."""
    error: dict[str, Any] = {"type": e.type, "code": e.code or e.type, "message": e.message,
                             "param": e.param}  # fmt: skip
    return json.dumps({"type": "error", "status": e.status, "error": error})
