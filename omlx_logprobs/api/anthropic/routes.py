"""`POST /v1/messages` (JSON or Anthropic's event stream) and `POST /v1/messages/count_tokens`:
the body read into a chat request (convert.py), prepared and submitted on the one request path
(api/core/prepare.py), its outputs written as content blocks and events (output.py). Errors take
Anthropic's shape (api/core/errors.py, by path); the key may come as `x-api-key` (api/guard.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from omlx_logprobs.api.anthropic.convert import NAMES, chat_request
from omlx_logprobs.api.anthropic.output import MessageOutput
from omlx_logprobs.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from omlx_logprobs.api.core import sse
from omlx_logprobs.api.core.fields import check_unknown
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.prepare import Ask, Prepared, prepared, wire_names
from omlx_logprobs.api.core.prompts import chat_prompt, faithful_chat_prompt
from omlx_logprobs.api.core.response import finished
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.serving import respond
from omlx_logprobs.types import RequestOutput


class MessageRun:
    """One message: prepared and submitted at once (a bad request raises here, before any byte
    of a stream), then awaited whole or streamed."""

    def __init__(self, req: MessagesRequest, served: Served, p: Prepared) -> None:
        self.p = p
        stops = list(req.stop_sequences or [])
        self.output = MessageOutput(p, req.stream, stops, served.model.vocab)
        self.handle = p.submit(served)[0]

    @classmethod
    async def start(cls, req: MessagesRequest, served: Served) -> MessageRun:
        """Prepared (off the event loop when it has images) and submitted."""
        ask = Ask.chat(chat_request(req, served.reasoning), prefix="msg_", names=NAMES)
        return cls(req, served, await prepared(ask, served))

    async def complete(self, raw: Request) -> str:
        outs = await finished([self.handle], raw)
        self.p.heard(outs[0])
        self.output.feed(outs[0])
        self.output.finish(outs[0])
        return self.output.body

    async def events(self) -> AsyncIterator[str]:
        last: RequestOutput | None = None
        async for _, out in sse.outputs([self.handle]):
            self.p.heard(out)
            if last is None:
                for e in self.output.start(out):
                    yield e
            last = out
            if out.error:  # Anthropic's error event; the stream ends there
                err = {"type": "error", "error": {"type": "api_error", "message": out.error}}
                yield sse.event("error", _dumps(err))
                return
            for e in self.output.feed(out):
                yield e
        assert last is not None
        for e in self.output.finish(last):
            yield e


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    @app.post("/v1/messages")
    async def create_message(req: MessagesRequest, raw: Request) -> Response:
        return await respond(pool, req, raw, lambda slot: MessageRun.start(req, slot.live))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> dict[str, int]:
        """The prompt's tokens as the chat template renders it (tools and system included),
        earlier answers as the ids they were sampled as, as a message would count them; the
        model's tokenizer alone is needed (a model not loaded is not loaded for it)."""
        if not pool.ignore_unknown_fields:
            check_unknown(req, False)
        model, checks = await pool.tokenizer(req.model)
        served = pool.slot(req.model).served
        with wire_names(NAMES):
            chat = chat_request(req)
            checks.check(chat)
            if served is None:
                return {"input_tokens": len(chat_prompt(chat, model, checks))}
            return {"input_tokens": len(faithful_chat_prompt(chat, served)[0])}
