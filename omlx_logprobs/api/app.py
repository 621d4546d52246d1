"""Routes. Thin: parse, hand to serving, return JSON or SSE."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from omlx_logprobs.api import control, lora, page, render, weights
from omlx_logprobs.api import tokenize as tok
from omlx_logprobs.api.anthropic import routes as anthropic
from omlx_logprobs.api.errors import error_response, install_error_handlers
from omlx_logprobs.api.guard import install_guard
from omlx_logprobs.api.ollama import routes as ollama
from omlx_logprobs.api.openapi import install_openapi
from omlx_logprobs.api.pool import ModelPool, Unavailable
from omlx_logprobs.api.protocol import (
    ChatCompletionRequest,
    ChatTokensRequest,
    CompletionRequest,
    GenerateRequest,
    SglangGenerateRequest,
)
from omlx_logprobs.api.responses import routes as responses
from omlx_logprobs.api.responses.store import ResponseStore
from omlx_logprobs.api.served import Served
from omlx_logprobs.api.serving import respond
from omlx_logprobs.api.slot import ModelSlot
from omlx_logprobs.config import Access

log = logging.getLogger("omlx_logprobs")


def create_app(served: Served | ModelPool, access: Access | None = None) -> FastAPI:
    """The app over one model (a `Served`) or several (a `ModelPool`, api/pool.py)."""
    pool = served if isinstance(served, ModelPool) else ModelPool.single(served)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pool.start()
        yield
        pool.shutdown()
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
    install_guard(app, access, pool.limits, pool.engine.max_num_seqs)

    @app.exception_handler(Unavailable)
    async def _unavailable(r: Request, e: Unavailable) -> JSONResponse:
        response = error_response(e, r.url.path)
        response.headers["Retry-After"] = str(e.retry_after_s)
        return response

    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | JSONResponse:
        body, status = pool.health()
        return body if status == 200 else JSONResponse(body, status_code=status)

    weights.add_routes(app, pool)

    _add_routes(app, pool, int(time.time()))
    responses.add_routes(app, pool, ResponseStore())
    anthropic.add_routes(app, pool)
    ollama.add_routes(app, pool)
    tok.add_routes(app, pool)
    lora.add_routes(app, pool)
    render.add_routes(app, pool)
    control.add_routes(app, pool)
    page.add_routes(app, access.api_key is not None)
    return app


def _add_routes(app: FastAPI, pool: ModelPool, created: int) -> None:
    """The model list and the OpenAI-shaped routes, with the token routes RL frameworks call
    (vLLM's /inference/v1/generate, SGLang's /generate; docs/specs/rl.md)."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": pool.cards(created)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await _respond(pool, req, raw)

    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, raw: Request) -> Response:
        return await _respond(pool, req, raw)

    @app.post("/v1/chat/completions/tokens")
    async def chat_completions_tokens(req: ChatTokensRequest, raw: Request) -> Response:
        return await _respond(pool, req, raw)

    @app.post("/inference/v1/generate")
    async def generate(req: GenerateRequest, raw: Request) -> Response:
        return await _respond(pool, req, raw)

    @app.post("/generate")
    async def sglang_generate(req: SglangGenerateRequest, raw: Request) -> Response:
        return await _respond(pool, req, raw)


Routed = ChatCompletionRequest | CompletionRequest | GenerateRequest | SglangGenerateRequest


class _Bound:
    """A request of the OpenAI-shaped routes as a `Run`: started by `events` or `complete`."""

    def __init__(self, serving: Any, req: Routed) -> None:
        self.serving, self.req = serving, req

    def events(self) -> AsyncIterator[str]:
        return self.serving.stream(self.req)  # type: ignore[no-any-return]

    async def complete(self, raw: Request) -> str:
        return await self.serving.complete(self.req, raw)  # type: ignore[no-any-return]


def _serving(slot: ModelSlot, req: Routed) -> Any:
    """The serving object of the request's route on its model."""
    if isinstance(req, ChatCompletionRequest):
        return slot.chat
    if isinstance(req, GenerateRequest):
        return slot.generate
    if isinstance(req, SglangGenerateRequest):
        return slot.sglang
    return slot.completions


async def _respond(pool: ModelPool, req: Routed, raw: Request) -> Response:
    name = req.served_name if isinstance(req, SglangGenerateRequest) else req.model
    return await respond(pool, req, raw, lambda slot: _Bound(_serving(slot, req), req), name=name)
