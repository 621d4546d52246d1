"""The door every HTTP request passes first: the API key, the body size and the number of requests
in flight. A pure ASGI middleware, so streamed responses and disconnect notices pass untouched."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from omlx_logprobs.api.admin import openapi, page
from omlx_logprobs.api.batches.routes import UPLOAD_PATH
from omlx_logprobs.api.core.errors import APIError, shaped_body
from omlx_logprobs.config import Access, Limits

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]

# Reachable without the API key: /health (load balancers, probes), the page and the API reference
# (they hold no data; the calls they make carry the key).
OPEN_PATHS = frozenset({"/health"}) | page.OPEN_PATHS | openapi.OPEN_PATHS
OPEN_PREFIXES = page.OPEN_PREFIXES + openapi.OPEN_PREFIXES
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Bodies passed on as they arrive, neither held whole nor held to --max-body-bytes: a file
# upload, which its route streams to disk and bounds by its own limit (api/batches/upload.py).
STREAMED_PATHS = frozenset({UPLOAD_PATH})


class Guard:
    """Checks, in order: API key (401), declared body size (413), requests in flight (429), then
    reads the body with a running count (413) and replays it to the app."""

    def __init__(self, app: ASGIApp, access: Access, limits: Limits, capacity: int) -> None:
        self.app = app
        self.key = access.api_key.encode() if access.api_key else None
        self.limits = limits
        self.capacity = capacity  # requests with a body that may be in flight at once
        self.in_flight = 0

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # the Responses API's WebSocket mode: the key only
            try:
                self._authorize(scope)
            except APIError:  # closed before the handshake: the client sees HTTP 403
                await send({"type": "websocket.close", "code": 1008})
                return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._authorize(scope)
            if scope["method"] not in BODY_METHODS or scope["path"] in STREAMED_PATHS:
                await self.app(scope, receive, send)
                return
            self._check_declared_size(scope)
            self._admit()
        except APIError as e:
            await send_error(send, e, self._headers_for(e), scope["path"])
            return
        try:
            await self._forward_with_body(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _authorize(self, scope: Message) -> None:
        path = scope["path"]
        if self.key is None or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer":  # Anthropic's clients send the key as x-api-key
            token = _header(scope, b"x-api-key") or b""
        # compare_digest: the time taken does not depend on how much of the key matched
        if not hmac.compare_digest(token.strip(), self.key):
            raise APIError(
                "Incorrect or missing API key: send `Authorization: Bearer <key>` (or"
                " `x-api-key: <key>`).",
                status=401,
                code="invalid_api_key",
            )

    def _check_declared_size(self, scope: Message) -> None:
        declared = _header(scope, b"content-length")
        if (
            declared is not None
            and declared.isdigit()
            and int(declared) > self.limits.max_body_bytes
        ):
            raise self._too_large()

    def _too_large(self) -> APIError:
        return APIError(
            f"The request body exceeds the server's limit of {self.limits.max_body_bytes} bytes.",
            status=413,
            code="request_too_large",
        )

    def _admit(self) -> None:
        if self.in_flight >= self.capacity:
            raise APIError(
                f"The server is busy: {self.capacity} requests are already in flight. Retry later.",
                status=429,
                code="server_busy",
            )
        self.in_flight += 1

    def _headers_for(self, e: APIError) -> list[tuple[bytes, bytes]]:
        if e.status == 401:
            return [(b"www-authenticate", b"Bearer")]
        if e.status == 429:
            return [(b"retry-after", str(self.limits.retry_after_s).encode())]
        return []

    async def _forward_with_body(self, scope: Message, receive: Receive, send: Send) -> None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                await send_error(send, self._too_large(), [], scope["path"])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # later calls wait for the disconnect notice
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _header(scope: Message, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


async def send_error(
    send: Send, e: APIError, extra: list[tuple[bytes, bytes]], path: str = ""
) -> None:
    body = json.dumps(shaped_body(e, path)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_guard(app: FastAPI, access: Access, limits: Limits, max_num_seqs: int) -> None:
    """The guard inside CORS (so a browser sees CORS headers on a 401 too); CORS only if asked."""
    app.add_middleware(
        Guard, access=access, limits=limits, capacity=max_num_seqs + limits.max_queued
    )
    if access.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(access.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
        )
