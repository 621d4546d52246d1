"""Ollama's `POST /api/embed` (`input` a text or texts; answered with `embeddings`,
`prompt_eval_count` and the durations in nanoseconds) and the older `POST /api/embeddings` (one
`prompt`, answered with `embedding`): the vectors are api/core/embedding.py's, as
/v1/embeddings'. `keep_alive` and `options` are accepted and change nothing (the pool keeps
models loaded by its own rules)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omlx_logprobs.api.core.embedding import (
    EmbedAsk,
    Embedded,
    Input,
    check_inputs,
    embed,
    embedding_config,
)
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.served import fields_headers
from omlx_logprobs.api.ollama.protocol import OllamaEmbeddingsRequest, OllamaEmbedRequest


async def embed_route(pool: ModelPool, req: OllamaEmbedRequest, raw: Request) -> Response:
    headers = fields_headers(req, pool.ignore_unknown_fields)
    inputs: list[Input] = [req.input] if isinstance(req.input, str) else list(req.input or [])
    inputs = [] if inputs == [""] else inputs  # Ollama's empty text: nothing to embed
    if inputs:
        check_inputs(inputs, "input")
    ask = EmbedAsk(inputs, req.model, req.dimensions, truncate=req.truncate)
    done, load_ns, total_ns = await _embedded(pool, ask, raw)
    if done is None:
        return Response(status_code=499)
    body: dict[str, Any] = {
        "model": req.model,
        "embeddings": [v.tolist() for v in done.vectors],
        "total_duration": total_ns,
        "load_duration": load_ns,
        "prompt_eval_count": done.prompt_tokens,
    }
    return JSONResponse(body, headers=headers)


async def embeddings_route(pool: ModelPool, req: OllamaEmbeddingsRequest, raw: Request) -> Response:
    headers = fields_headers(req, pool.ignore_unknown_fields)
    ask = EmbedAsk([req.prompt] if req.prompt else [], req.model, param="prompt", truncate=True)
    done, _, _ = await _embedded(pool, ask, raw)
    if done is None:
        return Response(status_code=499)
    vector = done.vectors[0].tolist() if done.vectors else []
    return JSONResponse({"embedding": vector}, headers=headers)


async def _embedded(
    pool: ModelPool, ask: EmbedAsk, raw: Request
) -> tuple[Embedded | None, int, int]:
    """(the embeddings, None when the client left first; the nanoseconds spent waiting for
    the model, loading it; the nanoseconds in all). No inputs: the model is loaded and
    checked, nothing embedded."""
    t0 = time.perf_counter_ns()
    async with pool.use(ask.model) as slot:
        t1 = time.perf_counter_ns()
        served = slot.live
        if not ask.inputs:
            embedding_config(served, ask.model or served.model.name)
            done: Embedded | None = Embedded([], 0, served.model.name)
        else:
            try:
                done = await embed(ask, served, raw)
            except ConnectionAbortedError:
                done = None
    return done, t1 - t0, time.perf_counter_ns() - t0
