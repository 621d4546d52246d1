"""`GET /v1/models`, `POST /v1/chat/completions` (and `/v1/chat/completions/tokens`, the same
request with the token ids) and `POST /v1/completions`: each body started as its `Run` (chat.py,
completions.py) on the model it names, then streamed or awaited whole (api/core/serving.py);
`POST /v1/embeddings` (embeddings.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from omlx_logprobs.api.core.description import describe
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.protocol import (
    ChatCompletionRequest,
    ChatTokensRequest,
    CompletionRequest,
)
from omlx_logprobs.api.core.serving import respond
from omlx_logprobs.api.openai.chat import ChatRun
from omlx_logprobs.api.openai.completions import CompletionRun
from omlx_logprobs.api.openai.embeddings import EmbeddingRequest, embeddings


def add_routes(app: FastAPI, pool: ModelPool, created: int) -> None:
    """`created`: the models' creation time in the model list (the server's start)."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        described = {s.name: await describe(pool, s) for s in pool.slots.values()}
        return {"object": "list", "data": pool.cards(created, described)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await respond(pool, req, raw, lambda slot: ChatRun.start(req, slot.live))

    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, raw: Request) -> Response:
        return await respond(pool, req, raw, lambda slot: CompletionRun(req, slot.live))

    @app.post("/v1/chat/completions/tokens")
    async def chat_completions_tokens(req: ChatTokensRequest, raw: Request) -> Response:
        return await respond(pool, req, raw, lambda slot: ChatRun.start(req, slot.live))

    @app.post("/v1/embeddings")
    async def create_embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings(pool, req, raw)
