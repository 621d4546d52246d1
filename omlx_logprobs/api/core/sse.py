"""How every stream is framed, in one place: OpenAI's `data:` chunks ending with `[DONE]` (chat,
completions), named events (Responses, Anthropic Messages) and NDJSON lines (Ollama); the
outputs a stream writes, read from the engine until every choice finishes and aborted when the
stream stops first (the client left); and the chunk stream of chat and completions, whose head,
usage tail, error chunk and `[DONE]` are the same for both.

A route's body writer only says what its chunks or events hold; nothing else frames them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from omlx_logprobs.api.core.errors import error_body
from omlx_logprobs.api.core.response import weight_version_json
from omlx_logprobs.transport.client import RequestHandle, merged
from omlx_logprobs.types import RequestOutput

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
DONE = "data: [DONE]\n\n"


def data(body: str) -> str:
    """An unnamed server-sent event (OpenAI's chunks)."""
    return f"data: {body}\n\n"


def event(name: str, body: str) -> str:
    """A named server-sent event (Responses, Anthropic: the name repeats the body's type)."""
    return f"event: {name}\ndata: {body}\n\n"


def line(body: str) -> str:
    """One NDJSON object (Ollama)."""
    return body + "\n"


def streaming(
    events: AsyncIterator[str], media: str = SSE, headers: dict[str, str] | None = None
) -> StreamingResponse:
    return StreamingResponse(events, media_type=media, headers=headers)


async def outputs(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every choice's outputs as they come, (which handle, output); whatever is unfinished is
    aborted when the stream stops reading (its client left, or it ended)."""
    try:
        async for item in merged(handles):
            yield item
    finally:
        for h in handles:
            h.abort()


class Chunks:
    """OpenAI's chunk stream (chat and completions): every chunk is the response's head
    (id, object, created, model, fingerprint), its choices, then the tail (`"usage": null` when
    the client asked for usage, and the weights' version once the first output named them)."""

    def __init__(self, head: str, include_usage: bool) -> None:
        self.head = head
        self.include_usage = include_usage
        self.weights = ""  # the weight_version fragment, known with the first output

    def name_weights(self, out: RequestOutput) -> None:
        """The version the first output names, for the whole response (and its adapter)."""
        if not self.weights:
            self.weights = weight_version_json(out.weight_version, out.adapter)

    def chunk(self, choice: str, extra: str = "") -> str:
        """A chunk with one choice; `extra`: fields of the chunk itself, after its choices."""
        usage = ',"usage":null' if self.include_usage else ""
        return data(f'{self.head}"choices":[{choice}]{extra}{self.weights}{usage}}}')

    def usage(self, body: dict[str, Any]) -> str:
        """The last chunk before `[DONE]` when usage is asked for: no choices."""
        return data(f'{self.head}"choices":[],"usage":{json.dumps(body)}{self.weights}}}')

    @staticmethod
    def error(message: str) -> str:
        """A choice that failed in the engine: OpenAI's error object as a chunk of its own."""
        return data(json.dumps(error_body(message, "server_error", None, None)))
