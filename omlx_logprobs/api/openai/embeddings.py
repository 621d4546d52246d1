"""`POST /v1/embeddings` in OpenAI's shape: `input` as a text, texts, token ids or lists of
token ids; `encoding_format` float (JSON numbers) or base64 (the float32 vector's little-endian
bytes, as OpenAI's SDK decodes them); `dimensions` where the model is trained for it; `usage`
with the prompt tokens. The vectors are api/core/embedding.py's."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictInt

from omlx_logprobs.api.core.embedding import EmbedAsk, Embedded, Input, check_inputs, embed
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.protocol import Priority, _Open
from omlx_logprobs.api.core.served import fields_headers


class EmbeddingRequest(_Open):
    """OpenAI's body (`user` accepted and unused), and vLLM's `priority` and
    `add_special_tokens` (false: a text without the tokenizer's special tokens)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    priority: Priority = 0
    add_special_tokens: bool = True

    def inputs(self) -> list[Input]:
        """One input per text or per list of token ids (a flat list of ids is one input)."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]


async def embeddings(pool: ModelPool, req: EmbeddingRequest, raw: Request) -> Response:
    headers = fields_headers(req, pool.ignore_unknown_fields)  # first, before any load
    inputs = req.inputs()
    check_inputs(inputs, "input")  # before the model is leased (or loaded)
    ask = EmbedAsk(inputs, req.model, req.dimensions, special=req.add_special_tokens,
                   priority=req.priority)  # fmt: skip
    async with pool.use(req.model) as slot:
        try:
            done = await embed(ask, slot.live, raw)
        except ConnectionAbortedError:
            return Response(status_code=499)
    return JSONResponse(body(done, req.encoding_format), headers=headers)


def body(done: Embedded, encoding: str) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": wire(v, encoding)}
            for i, v in enumerate(done.vectors)]  # fmt: skip
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": done.model,
        "data": data,
        "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens},
    }


def wire(v: np.ndarray, encoding: str) -> list[float] | str:
    """A vector as JSON numbers (each float32 exactly), or base64 of its float32 bytes,
    little-endian whatever the host's order."""
    if encoding == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return list(v.tolist())
