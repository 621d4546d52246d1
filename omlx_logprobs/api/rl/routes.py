"""Every RL route on the app: the token routes (`POST /inference/v1/generate`, vLLM's; `POST
/generate`, SGLang's), each body started as its `Run` on the model it names, and the routes of
render.py, tokenize.py, weights.py, lora.py, control.py and sleep.py."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.serving import respond
from omlx_logprobs.api.rl import control, lora, render, sleep, tokenize, weights
from omlx_logprobs.api.rl.protocol import GenerateRequest, SglangGenerateRequest
from omlx_logprobs.api.rl.sglang_generate import SglangRun
from omlx_logprobs.api.rl.vllm_generate import GenerateRun


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    @app.post("/inference/v1/generate")
    async def generate(req: GenerateRequest, raw: Request) -> Response:
        return await respond(pool, req, raw, lambda slot: GenerateRun(req, slot.live))

    @app.post("/generate")
    async def sglang_generate(req: SglangGenerateRequest, raw: Request) -> Response:
        start = lambda slot: SglangRun(req, slot.live)  # noqa: E731
        return await respond(pool, req, raw, start, name=req.served_name)

    weights.add_routes(app, pool)
    tokenize.add_routes(app, pool)
    lora.add_routes(app, pool)
    render.add_routes(app, pool)
    control.add_routes(app, pool)
    sleep.add_routes(app, pool)
