"""Ollama's routes: `POST /api/chat` and `/api/generate` (NDJSON streams unless `stream` is
false) on the one request path, the embeddings (`/api/embed`, `/api/embeddings`: embed.py), and
the model routes its clients list and probe with (`/api/tags`, `/api/show`, `/api/ps`,
`/api/version`). Errors take Ollama's shape,
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
from omlx_logprobs.api.core.description import Description, describe
from omlx_logprobs.api.core.fields import check_unknown
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.prepare import Ask, Prepared, prepared
from omlx_logprobs.api.core.protocol import ChatCompletionRequest
from omlx_logprobs.api.core.response import finished
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.serving import respond
from omlx_logprobs.api.core.slot import ModelSlot
from omlx_logprobs.api.ollama.convert import NAMES, chat_request, generate_request
from omlx_logprobs.api.ollama.embed import embed_route, embeddings_route
from omlx_logprobs.api.ollama.output import OllamaOutput, now
from omlx_logprobs.api.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)


class OllamaRun:
    """One chat or generate request: prepared and submitted at once, then awaited or
    streamed."""

    def __init__(
        self, req: OllamaChatRequest | OllamaGenerateRequest, served: Served, p: Prepared
    ) -> None:
        self.p = p
        self.output = OllamaOutput(p, isinstance(req, OllamaChatRequest), req.model)
        self.handle = p.submit(served)[0]

    @classmethod
    async def start(
        cls, req: OllamaChatRequest | OllamaGenerateRequest, served: Served
    ) -> OllamaRun:
        """Prepared (off the event loop when it has images) and submitted."""
        inner = chat_request(req) if isinstance(req, OllamaChatRequest) else generate_request(req)
        ask = Ask.chat(inner) if isinstance(inner, ChatCompletionRequest) else Ask.completion(inner)
        return cls(req, served, await prepared(replace(ask, prefix="ollama-", names=NAMES), served))

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


def _details(d: Description) -> dict[str, Any]:
    """Ollama's `details`, from the model's card (api/core/description.py)."""
    card = d.card
    if card is None:  # a scripted test model: no weights files to read
        return {"parent_model": "", "format": "", "family": "", "families": None,
                "parameter_size": "", "quantization_level": ""}  # fmt: skip
    return {
        "parent_model": "",
        "format": card.format,
        "family": card.family,
        "families": [card.family] if card.family else None,
        "parameter_size": card.parameter_size,
        "quantization_level": card.quantization,
    }


def _card(slot: ModelSlot, d: Description) -> dict[str, Any]:
    """A model in /api/tags: `size` is its weights' files on disk (a GGUF file's own bytes),
    not the memory it takes loaded (/api/ps says that)."""
    return {
        "name": slot.name,
        "model": slot.name,
        "modified_at": now(),
        "size": d.card.size if d.card is not None else 0,
        "digest": "",
        "details": _details(d),
    }


def _model_info(d: Description, vocab_size: int) -> dict[str, Any]:
    """/api/show's `model_info`: GGUF's keys, the architecture's own under its name
    (`llama.context_length`), which Ollama's clients size their context from."""
    info: dict[str, Any] = {"general.context_length": d.max_model_len,
                            "general.vocab_size": vocab_size}  # fmt: skip
    if d.card is not None:
        family = d.card.family
        info |= {"general.architecture": family, "general.parameter_count": d.card.parameters,
                 f"{family}.context_length": d.max_model_len}  # fmt: skip
    return info


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    async def run(req: OllamaChatRequest | OllamaGenerateRequest, raw: Request) -> Response:
        req.model = _name(pool, req.model)
        start = lambda slot: OllamaRun.start(req, slot.live)  # noqa: E731
        return await respond(pool, req, raw, start, sse.NDJSON)

    @app.post("/api/chat")
    async def chat(req: OllamaChatRequest, raw: Request) -> Response:
        return await run(req, raw)

    @app.post("/api/generate")
    async def generate(req: OllamaGenerateRequest, raw: Request) -> Response:
        return await run(req, raw)

    @app.post("/api/embed")
    async def embed(req: OllamaEmbedRequest, raw: Request) -> Response:
        req.model = _name(pool, req.model)
        return await embed_route(pool, req, raw)

    @app.post("/api/embeddings")
    async def embeddings(req: OllamaEmbeddingsRequest, raw: Request) -> Response:
        req.model = _name(pool, req.model)
        return await embeddings_route(pool, req, raw)

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [_card(s, await describe(pool, s)) for s in pool.slots.values()]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        """`size`: the memory a loaded model takes (its estimate, models/footprint.py)."""
        loaded = [s for s in pool.slots.values() if s.state == "loaded"]
        return {"models": [{**_card(s, await describe(pool, s)), "size": s.need_mib << 20,
                            "expires_at": None, "size_vram": 0,
                            "context_length": s.max_model_len} for s in loaded]}  # fmt: skip

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": omlx_logprobs.__version__}

    @app.post("/api/show")
    async def show(req: OllamaShowRequest) -> dict[str, Any]:
        check_unknown(req, pool.ignore_unknown_fields)  # a field is never silently ignored
        name = _name(pool, req.model or req.name or "")
        model, _ = await pool.tokenizer(name)
        d = await describe(pool, pool.slot(name))
        return {
            "modelfile": "",
            "parameters": "",
            "template": str(getattr(model.tokenizer, "chat_template", None) or ""),
            "details": _details(d),
            "model_info": _model_info(d, len(model.vocab)),
            "capabilities": d.ollama_capabilities(),
            "modified_at": now(),
        }
