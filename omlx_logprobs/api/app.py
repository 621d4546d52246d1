"""Routes. Thin: parse, hand to serving, return JSON or SSE."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omlx_logprobs.api import page
from omlx_logprobs.api import tokenize as tok
from omlx_logprobs.api.completions import CompletionServing
from omlx_logprobs.api.errors import APIError, install_error_handlers
from omlx_logprobs.api.guard import install_guard
from omlx_logprobs.api.openapi import install_openapi
from omlx_logprobs.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UpdateWeightsRequest,
)
from omlx_logprobs.api.serving import ChatServing, Served
from omlx_logprobs.config import Access
from omlx_logprobs.types import WeightUpdate

log = logging.getLogger("omlx_logprobs")


def create_app(served: Served, access: Access | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        served.engine.start()
        yield
        served.engine.shutdown()
        alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        log.info("stopped; threads left: %s", ", ".join(alive) or "none")

    access = access or Access()
    # /docs is served by install_openapi from installed assets; FastAPI's own pages use a CDN
    app = FastAPI(
        title="omlx_logprobs",
        description="OpenAI-compatible completions with exact logprobs. [The logprobs page](/)",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    install_openapi(app, access.api_key is not None)
    install_guard(app, access, served.limits, served.cfg.max_num_seqs)
    chat = ChatServing(served)
    completions = CompletionServing(served)
    created = int(time.time())

    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | JSONResponse:
        stats = asdict(served.engine.snapshot())
        running = stats["waiting"] + stats["running"]
        body = {
            "status": "ok",
            "running": running,
            "weight_version": stats["weights"],
            "engine": stats,
        }
        state = served.engine.state
        if state != "ok":  # the engine process is gone (restarting, or for good)
            return JSONResponse({**body, "status": f"engine {state}"}, status_code=503)
        return body

    @app.post("/update_weights_from_disk")
    async def update_weights(req: UpdateWeightsRequest) -> dict[str, Any]:
        if req.model is not None:
            served.check_model(req.model)
        if not req.flush_cache:  # kept keys and values of the old weights: wrong numbers
            raise APIError(
                "flush_cache must be true: the prefix cache always goes with the old weights",
                param="flush_cache",
            )
        if req.load_format not in (None, "auto", "safetensors"):
            raise APIError("load_format must be safetensors", param="load_format")
        abort = req.abort_in_flight or req.abort_all_requests
        result = await served.engine.update_weights(
            WeightUpdate(req.model_path, abort, req.weight_version)
        )
        if result.error is not None:
            raise APIError(result.error, param="model_path", code="weights_not_loaded")
        return {
            "success": True,
            "message": f"weights from {req.model_path} serve from now on",
            "weight_version": result.version.json(),
            "aborted_requests": result.aborted,
            "seconds": round(result.seconds, 3),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served.model.name,
            "object": "model",
            "created": created,
            "owned_by": "omlx_logprobs",
            "max_model_len": served.model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await _respond(chat, req, raw)

    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, raw: Request) -> Response:
        return await _respond(completions, req, raw)

    tok.add_routes(app, served)
    page.add_routes(app, access.api_key is not None)
    return app


async def _respond(serving: Any, req: Any, raw: Request) -> Response:
    """SSE for a streamed request, else one JSON body; 499 when the client left first. Unknown
    fields: a 400, or (--ignore-unknown-fields) a header naming them."""
    headers = serving.served.fields_headers(req)
    if req.stream:
        events = serving.stream(req)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        body = await serving.complete(req, raw)
    except ConnectionAbortedError:
        return Response(status_code=499)
    return Response(body, media_type="application/json", headers=headers)
