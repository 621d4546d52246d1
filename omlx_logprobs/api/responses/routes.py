"""`POST /v1/responses` (JSON or the Responses event stream), `GET` and `DELETE
/v1/responses/{id}`, `POST /v1/responses/compact` (compaction.py; WebSocket mode: socket.py): the
body read into a chat request (convert.py), prepared and submitted on
the one request path (api/core/prepare.py), its outputs written as Responses items and events
(output.py), the response stored (store.py) unless `store` is false."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from omlx_logprobs.api.core import sse
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.fields import check_unknown
from omlx_logprobs.api.core.items import REASONING, TEXT, Item
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.prepare import Ask, Prepared, prepared
from omlx_logprobs.api.core.response import finished
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.serving import respond
from omlx_logprobs.api.responses.compaction import pack
from omlx_logprobs.api.responses.convert import NAMES, chat_request, check_calls, input_messages
from omlx_logprobs.api.responses.output import ResponseOutput, meta
from omlx_logprobs.api.responses.protocol import CompactRequest, ResponsesRequest
from omlx_logprobs.api.responses.store import ResponseStore, Stored
from omlx_logprobs.types import RequestOutput


class ResponseRun:
    """One response: prepared and submitted at once (a bad request raises here, before any
    byte of a stream), then awaited whole or streamed. `local`: a WebSocket connection's own
    store (api/responses/socket.py), read first and holding its responses whatever `store`
    says, so that a `store: false` chain continues on its socket and nowhere else."""

    def __init__(
        self,
        req: ResponsesRequest,
        served: Served,
        store: ResponseStore,
        local: ResponseStore | None,
        said: tuple[list[dict[str, Any]], tuple[tuple[int, tuple[int, ...]], ...]],
        p: Prepared,
    ) -> None:
        self.req, self.store, self.local, self.p = req, store, local, p
        self.conversation, self.answers = said
        self.output = ResponseOutput(p, meta(_echoed(req), p.request_id, p.model), req.stream)
        self.handle = p.submit(served)[0]

    @classmethod
    async def start(
        cls,
        req: ResponsesRequest,
        served: Served,
        store: ResponseStore,
        local: ResponseStore | None = None,
    ) -> ResponseRun:
        """The conversation (the chain's, then the input), prepared (off the event loop when
        it has images) and submitted."""
        history: list[dict[str, Any]] = []
        answers: tuple[tuple[int, tuple[int, ...]], ...] = ()
        if req.previous_response_id is not None:
            stored = previous(req.previous_response_id, store, local)
            history, answers = list(stored.conversation), stored.answers
        conversation = history + input_messages(req.input)
        check_calls(conversation)
        chat = chat_request(req, conversation)
        # the chain's answers by their index among the chat messages (instructions first)
        first = len(chat.messages) - len(conversation)
        sampled = {first + i: ids for i, ids in answers}
        ask = replace(Ask.chat(chat, prefix="resp_", names=NAMES), sampled=sampled)
        p = await prepared(ask, served)
        return cls(req, served, store, local, (conversation, answers), p)

    async def complete(self, raw: Request) -> str:
        outs = await finished([self.handle], raw)
        self.p.heard(outs[0])
        self.output.created(outs[0])
        self.output.feed(outs[0])
        self.output.finish(outs[0])
        self._keep()
        return self.output.body

    async def events(self) -> AsyncIterator[str]:
        last: RequestOutput | None = None
        async for _, out in sse.outputs([self.handle]):
            self.p.heard(out)
            if last is None:
                for e in self.output.created(out):
                    yield e
            last = out
            if not out.error:
                for e in self.output.feed(out):
                    yield e
        assert last is not None
        for e in self.output.finish(last):
            yield e
        if not last.error:
            self._keep()

    def _keep(self) -> None:
        if self.req.store is False and self.local is None:
            return
        said = [*self.conversation, _assistant(self.output.items.items)]
        answers = self.answers
        recorder = self.p.recorder
        if recorder is not None and 0 in recorder.sampled:
            answers += ((len(self.conversation), tuple(recorder.sampled[0])),)
        stored = Stored.of(self.output.body, said, answers)
        if self.req.store is not False:
            self.store.put(self.p.request_id, stored)
        if self.local is not None:
            self.local.put(self.p.request_id, stored)


def previous(response_id: str, store: ResponseStore, local: ResponseStore | None) -> Stored:
    """The response `previous_response_id` names: the connection's own first, then the
    server's store; a 400 `previous_response_not_found` when neither holds it."""
    stored = (local.get(response_id) if local is not None else None) or store.get(response_id)
    if stored is None:
        raise APIError(
            f"Previous response with id '{response_id}' not found (this server keeps the last"
            f" {store.count} stored responses, in memory; a `store: false` response only on"
            " its own WebSocket, and only the latest).",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored


def _assistant(items: list[Item]) -> dict[str, Any]:
    """A response's output as the assistant message a continuation's template renders."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item.kind == REASONING:
            message["reasoning_content"] = item.text
        elif item.kind == TEXT:
            message["content"] += item.text
        elif item.call is not None:
            call = {"name": item.call.name, "arguments": item.call.arguments}
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
    if message.get("tool_calls") and not message["content"]:
        message["content"] = None
    return message


def _echoed(req: ResponsesRequest) -> dict[str, Any]:
    """The request's fields a response repeats."""
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
    reasoning = req.reasoning.model_dump(exclude_none=True) if req.reasoning else {}
    return {
        "background": False,  # a background request is refused (convert.REFUSED)
        "frequency_penalty": req.frequency_penalty,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,  # a limit is refused (convert.REFUSED)
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "presence_penalty": req.presence_penalty,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",  # the tier used: this server has one, whatever was asked
        "store": req.store is not False,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": text.get("format", {"type": "text"})},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        # the spec's FunctionTool names every field (null where the request left it out)
        "tools": [
            {"description": None, "parameters": None, "strict": None, **t} for t in req.tools or ()
        ],
        "top_logprobs": req.top_logprobs or 0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled",
        "user": req.user,
    }


def add_routes(app: FastAPI, pool: ModelPool, store: ResponseStore) -> None:
    pool.reports["responses_store"] = store.report

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        return await respond(pool, req, raw, lambda slot: ResponseRun.start(req, slot.live, store))

    @app.post("/v1/responses/compact")
    async def compact_response(req: CompactRequest) -> dict[str, Any]:
        """The conversation as one compaction item (api/responses/compaction.py): no model
        runs, so no token is counted; the model is checked to be one this server serves."""
        if not pool.ignore_unknown_fields:
            check_unknown(req, False)
        pool.slot(req.model)
        history = (
            []
            if req.previous_response_id is None
            else previous(req.previous_response_id, store, None).conversation
        )
        conversation = [*history, *input_messages(req.input or [])]
        check_calls(conversation)
        usage = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": 0}  # fmt: skip
        return {
            "id": "resp_" + secrets.token_hex(16),
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": [pack(conversation)],
            "usage": usage,
        }

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return Response(stored.body, media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(
        f"No response with id '{response_id}' is stored here.",
        param="response_id",
        status=404,
        code="not_found",
    )
