"""`POST /rerank` (and vLLM's `/v1/rerank`, `/v2/rerank`) and `POST /score` (and `/v1/score`):
the body's pairs scored on the model it names (scores.py), answered in vLLM's shapes: rerank's
`results` best first (ties in the documents' order), at most `top_n`; score's `data` in the
pairs' order, its usage with vLLM's `prompt_tokens_details` (the prompt tokens the prefix cache
held: a query's documents share its start). Cohere's SDK posts to /v1/rerank (`Client`) and
/v2/rerank (`ClientV2`) and reads rerank's answer as it is, with `meta` added."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.served import fields_headers
from omlx_logprobs.api.scoring.protocol import RerankRequest, ScoreRequest
from omlx_logprobs.api.scoring.scores import Scored, check_pairs, score_pairs
from omlx_logprobs.api.scoring.template import YesNoTemplate


def add_routes(app: FastAPI, pool: ModelPool, template: YesNoTemplate) -> None:
    async def scored(
        req: RerankRequest | ScoreRequest,
        raw: Request,
        pairs: list[tuple[str, str]],
        names: tuple[str, str],
    ) -> Scored | None:
        """The pairs' scores; None when the client left first."""
        check_pairs(pairs, names)  # before the model is leased (or loaded)
        async with pool.use(req.model) as slot:
            try:
                return await score_pairs(pairs, req, slot.live, template, raw, names)
            except ConnectionAbortedError:
                return None

    async def rerank(req: RerankRequest, raw: Request) -> Response:
        headers = fields_headers(req, pool.ignore_unknown_fields)  # first, before any load
        docs = req.texts()
        done = await scored(req, raw, [(req.query, d) for d in docs], ("query", "documents"))
        if done is None:
            return Response(status_code=499)
        return JSONResponse(rerank_body(req, docs, done), headers=headers)

    async def score(req: ScoreRequest, raw: Request) -> Response:
        headers = fields_headers(req, pool.ignore_unknown_fields)
        pairs, names = req.pairs()
        done = await scored(req, raw, pairs, names)
        if done is None:
            return Response(status_code=499)
        return JSONResponse(score_body(done), headers=headers)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)
    for path in ("/score", "/v1/score"):
        app.post(path)(score)


def rerank_body(req: RerankRequest, docs: list[str], done: Scored) -> dict[str, Any]:
    order = sorted(range(len(docs)), key=lambda i: -done.scores[i])
    results: list[dict[str, Any]] = []
    for i in order[: req.top_n or None]:
        result: dict[str, Any] = {"index": i, "relevance_score": done.scores[i]}
        if req.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": done.model,
        "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens},
        # Cohere's account of the same tokens, which its SDK parses into `meta.billed_units`
        "meta": {"billed_units": {"input_tokens": done.prompt_tokens}},
        "results": results,
    }


def score_body(done: Scored) -> dict[str, Any]:
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": done.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(done.scores)],
        "usage": {
            "prompt_tokens": done.prompt_tokens,
            "total_tokens": done.prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        },
    }
