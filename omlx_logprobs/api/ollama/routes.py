"""Ollama's routes: `POST /api/chat` and `/api/generate` (NDJSON streams unless `stream` is
false) on the one request path, and the model routes its clients list and probe with
(`/api/tags`, `/api/show`, `/api/ps`, `/api/version`). Errors take Ollama's shape,
`{"error": message}` (api/core/errors.py, by path)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

import omlx_logprobs
from omlx_logprobs.api.core import sse
from omlx_logprobs.api.core.fields import check_unknown
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.prepare import Ask, prepare
from omlx_logprobs.api.core.protocol import ChatCompletionRequest
from omlx_logprobs.api.core.response import finished
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.serving import respond
from omlx_logprobs.api.core.slot import ModelSlot
from omlx_logprobs.api.ollama.convert import NAMES, chat_request, generate_request
from omlx_logprobs.api.ollama.output import OllamaOutput, now
from omlx_logprobs.api.ollama.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)


class OllamaRun:
    """One chat or generate request: prepared and submitted at once, then awaited or
    streamed."""

    def __init__(self, req: OllamaChatRequest | OllamaGenerateRequest, served: Served) -> None:
        inner = chat_request(req) if isinstance(req, OllamaChatRequest) else generate_request(req)
        ask = Ask.chat(inner) if isinstance(inner, ChatCompletionRequest) else Ask.completion(inner)
        self.p = prepare(replace(ask, prefix="ollama-", names=NAMES), served)
        self.output = OllamaOutput(self.p, isinstance(req, OllamaChatRequest), req.model)
        self.handle = self.p.submit(served)[0]

    async def complete(self, raw: Request) -> str:
        outs = await finished([self.handle], raw)
        self.p.heard(outs[0])
        return self.output.chunk(outs[0], done=True)

    async def events(self) -> AsyncIterator[str]:
        async for _, out in sse.outputs([self.handle]):
            self.p.heard(out)
            if out.error:
                yield sse.line(json.dumps({"error": out.error}))
                return
            if out.text or out.reasoning_text or out.num_tokens or out.tool_calls:
                yield sse.line(self.output.chunk(out))
            if out.finished:
                yield sse.line(self.output.last(out))


def _name(pool: ModelPool, name: str) -> str:
    """Ollama's names carry a tag; `:latest` is the served name itself."""
    base = name.removesuffix(":latest")
    return base if base != name and base in pool.slots else name


def _details(slot: ModelSlot) -> dict[str, Any]:
    source = str(slot.source or "")
    return {
        "parent_model": "",
        "format": "gguf" if source.endswith(".gguf") else "mlx",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _card(slot: ModelSlot) -> dict[str, Any]:
    return {
        "name": slot.name,
        "model": slot.name,
        "modified_at": now(),
        "size": slot.need_mib << 20,
        "digest": "",
        "details": _details(slot),
    }


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    async def run(req: OllamaChatRequest | OllamaGenerateRequest, raw: Request) -> Response:
        req.model = _name(pool, req.model)
        return await respond(pool, req, raw, lambda slot: OllamaRun(req, slot.live), sse.NDJSON)

    @app.post("/api/chat")
    async def chat(req: OllamaChatRequest, raw: Request) -> Response:
        return await run(req, raw)

    @app.post("/api/generate")
    async def generate(req: OllamaGenerateRequest, raw: Request) -> Response:
        return await run(req, raw)

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [_card(s) for s in pool.slots.values()]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        loaded = [s for s in pool.slots.values() if s.state == "loaded"]
        return {"models": [{**_card(s), "expires_at": None, "size_vram": 0,
                            "context_length": s.max_model_len} for s in loaded]}  # fmt: skip

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": omlx_logprobs.__version__}

    @app.post("/api/show")
    async def show(req: OllamaShowRequest) -> dict[str, Any]:
        check_unknown(req, pool.ignore_unknown_fields)  # a field is never silently ignored
        name = _name(pool, req.model or req.name or "")
        model, _ = await pool.tokenizer(name)
        slot = pool.slot(name)
        caps = ["completion"]
        if slot.served is not None and slot.served.tool_format != "none":
            caps.append("tools")
        if slot.served is not None and slot.served.reasoning:
            caps.append("thinking")
        return {
            "modelfile": "",
            "parameters": "",
            "template": str(getattr(model.tokenizer, "chat_template", None) or ""),
            "details": _details(slot),
            "model_info": {
                "general.context_length": model.max_model_len,
                "general.vocab_size": len(model.vocab),
            },  # fmt: skip
            "capabilities": caps,
            "modified_at": now(),
        }
