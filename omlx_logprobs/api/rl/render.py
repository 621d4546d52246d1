"""vLLM's render routes (SkyRL renders, then generates): `POST /v1/chat/completions/render` and
`POST /v1/completions/render` check a chat or completions request as those routes do and
answer the body /inference/v1/generate takes for it (the prompt's ids, the sampling params),
one per prompt for completions. Nothing is generated."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.prepare import Ask, prepare, prepared
from omlx_logprobs.api.core.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from omlx_logprobs.api.rl.features import features_json
from omlx_logprobs.api.rl.protocol import GenerateSampling
from omlx_logprobs.types import EngineRequest


def generate_body(
    req: SamplingFields, ereq: EngineRequest, prefix: str, top: int | None
) -> dict[str, Any]:
    """The /inference/v1/generate body for one prepared prompt: the request's sampling fields
    that the route takes, max_tokens resolved against the context, `logprobs` the top count
    (None: no entries)."""
    known = GenerateSampling.model_fields
    fields = {k: v for k, v in req.__dict__.items() if k in known and v is not None}
    fields.update(max_tokens=ereq.params.max_tokens, logprobs=top)
    opts = req.stream_options
    options = opts.model_dump() if opts is not None and req.stream else None
    sp = GenerateSampling.model_validate(fields).model_dump(mode="json", exclude_none=True)
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": ereq.prompt_ids,
        "features": features_json(ereq.images),
        "sampling_params": sp,
        "model": req.model,
        "stream": req.stream,
        "stream_options": options,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "kv_transfer_params": None,
    }


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    """Each render is the request prepared as its route prepares it (api/core/prepare.py), not
    submitted."""

    @app.post("/v1/chat/completions/render")
    async def render_chat(req: ChatCompletionRequest) -> JSONResponse:
        async with pool.use(req.model) as slot:
            served = slot.live
            headers = served.fields_headers(req)
            p = await prepared(Ask.chat(req), served)
            top = (req.top_logprobs or 0) if req.logprobs else None
            body = generate_body(req, p.first, "chatcmpl", top)
        return JSONResponse(body, headers=headers)

    @app.post("/v1/completions/render")
    async def render_completions(req: CompletionRequest) -> JSONResponse:
        async with pool.use(req.model) as slot:
            served = slot.live
            headers = served.fields_headers(req)
            p = prepare(Ask.completion(req), served)
            bodies = [generate_body(req, r, "cmpl", req.logprobs) for r in p.requests]
        return JSONResponse(bodies, headers=headers)
