"""vLLM's render routes (SkyRL renders, then generates): `POST /v1/chat/completions/render` and
`POST /v1/completions/render` check a chat or completions request as those routes do and
answer the body /inference/v1/generate takes for it (the prompt's ids, the sampling params),
one per prompt for completions. Nothing is generated."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from omlx_logprobs.api.completions import parse_prompts
from omlx_logprobs.api.inputs import sampling_params
from omlx_logprobs.api.pool import ModelPool
from omlx_logprobs.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateSampling,
    SamplingFields,
)
from omlx_logprobs.api.served import Served


def generate_body(
    req: SamplingFields, served: Served, ids: list[int], prefix: str, top: int | None
) -> dict[str, Any]:
    """The /inference/v1/generate body for one prompt: the request's sampling fields that the
    route takes (checked as the request's own route checks them), max_tokens resolved against
    the context, `logprobs` the top count (None: no entries)."""
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    params = sampling_params(
        req, served, len(ids), max_tokens, top is not None, top or 0, req.prompt_logprobs
    )
    known = GenerateSampling.model_fields
    fields = {k: v for k, v in req.__dict__.items() if k in known and v is not None}
    fields.update(max_tokens=params.max_tokens, logprobs=top)
    opts = req.stream_options
    options = opts.model_dump() if opts is not None and req.stream else None
    sp = GenerateSampling.model_validate(fields).model_dump(mode="json", exclude_none=True)
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": ids,
        "features": None,
        "sampling_params": sp,
        "model": req.model,
        "stream": req.stream,
        "stream_options": options,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
    }


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    @app.post("/v1/chat/completions/render")
    async def render_chat(req: ChatCompletionRequest) -> JSONResponse:
        async with pool.use(req.model) as slot:
            assert slot.served is not None and slot.chat is not None
            served, chat = slot.served, slot.chat
            headers = served.fields_headers(req)
            served.check_model(req.model)
            served.checks.check_chat(req)
            top = (req.top_logprobs or 0) if req.logprobs else None
            body = generate_body(req, served, chat.prompt(req), "chatcmpl", top)
        return JSONResponse(body, headers=headers)

    @app.post("/v1/completions/render")
    async def render_completions(req: CompletionRequest) -> JSONResponse:
        async with pool.use(req.model) as slot:
            assert slot.served is not None
            served = slot.served
            headers = served.fields_headers(req)
            served.check_model(req.model)
            served.checks.check_completion(req)
            bodies = [
                generate_body(req, served, ids, "cmpl", req.logprobs)
                for ids in parse_prompts(req, served)
            ]
        return JSONResponse(bodies, headers=headers)
