"""A small async HTTP client for the reliability tests: one chat request, streamed or not, read
into one typed result whatever the outcome (answer, error body, or error event)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.helpers.server import TINY_NAME


@dataclass(frozen=True)
class Chunk:
    """One streamed content chunk: its text and its entries' bytes decoded."""

    text: str
    entry_text: str | None  # None: the chunk had `"logprobs": null`


def text_aligned(text: str, entry_text: str, stops: tuple[str, ...]) -> bool:
    """Entries' text equals the text; after a stop string, the text and then the stop string
    (its tokens are entries, its text is not)."""
    if entry_text == text:
        return True
    rest = entry_text[len(text) :]
    return entry_text.startswith(text) and any(rest.startswith(s) for s in stops)


@dataclass
class ChatResult:
    status: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    chunks: list[Chunk] = field(default_factory=list)  # a stream's chunks with entries

    stops: tuple[str, ...] = ()

    @property
    def aligned(self) -> bool:
        """The alignment invariant, for the whole answer and for every stream chunk on its own:
        the entries' joined bytes are the text (only the last chunk may end in a stop string)."""
        if not self.entries:
            return True  # no logprobs asked for
        joined = b"".join(bytes(e["bytes"] or b"") for e in self.entries)
        if not text_aligned(self.text, joined.decode("utf-8", "replace"), self.stops):
            return False
        chunks = [c for c in self.chunks if c.text or c.entry_text is not None]
        return all(
            c.entry_text is not None
            and text_aligned(c.text, c.entry_text, self.stops if i == len(chunks) - 1 else ())
            for i, c in enumerate(chunks)
        )


def chat_body(content: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": content}],
        "return_token_ids": True,
        **kw,
    }


async def chat(client: httpx.AsyncClient, body: dict[str, Any]) -> ChatResult:
    out = await (_stream(client, body) if body.get("stream") else _plain(client, body))
    stop = body.get("stop") or ()
    out.stops = (stop,) if isinstance(stop, str) else tuple(stop)
    return out


async def _plain(client: httpx.AsyncClient, body: dict[str, Any]) -> ChatResult:
    r = await client.post("/v1/chat/completions", json=body)
    data = r.json()
    if r.status_code != 200:
        return ChatResult(r.status_code, error=data["error"])
    choice = data["choices"][0]
    lp = choice["logprobs"]
    return ChatResult(
        200,
        text=choice["message"]["content"],
        token_ids=choice["token_ids"],
        entries=lp["content"] if lp else [],
        finish_reason=choice["finish_reason"],
    )


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> ChatResult:
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return ChatResult(r.status_code, error=json.loads(await r.aread())["error"])
        out = ChatResult(200)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            _add_chunk(out, json.loads(line[6:]))
        return out


def _add_chunk(out: ChatResult, chunk: dict[str, Any]) -> None:
    if "error" in chunk:
        out.error = chunk["error"]
        return
    if not chunk["choices"]:
        return
    choice = chunk["choices"][0]
    delta = choice["delta"].get("content") or ""
    out.text += delta
    out.token_ids += choice.get("token_ids", [])
    entry_text = None
    if choice["logprobs"]:
        entries = choice["logprobs"]["content"]
        out.entries += entries
        entry_text = b"".join(bytes(e["bytes"] or b"") for e in entries).decode("utf-8", "replace")
    out.chunks.append(Chunk(delta, entry_text))
    out.finish_reason = choice["finish_reason"] or out.finish_reason
