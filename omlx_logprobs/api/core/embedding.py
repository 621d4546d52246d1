"""Embeddings, whichever API asks (OpenAI's /v1/embeddings, Ollama's /api/embed): each input
becomes one `EngineRequest` that prefills only (`EngineRequest.embed`), all submitted at once so
that they batch with whatever else the engine runs (an encoder model's: with the other
embedding requests, transport/encoder.py), and each answer's pooled hidden state is made the
model's embedding: normalized where its sentence-transformers modules normalize, or cut to
`dimensions` and normalized again where the model is trained for that (models/embedding.py).

A text is tokenized with the tokenizer's own special tokens, as sentence-transformers tokenizes
it: Qwen3-Embedding's tokenizer appends `<|endoftext|>`, the position its embedding is read at.
Token ids are the model's input as given (nothing appended), as OpenAI and vLLM take them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np
from fastapi import Request

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.prompts import encode
from omlx_logprobs.api.core.response import finished
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.models.embedding import EmbeddingConfig
from omlx_logprobs.types import EngineRequest, SamplingParams

MAX_INPUTS = 2048  # one request's inputs, as OpenAI's limit
EPS = 1e-12  # the smallest norm divided by (torch's F.normalize, as sentence-transformers')

Input = str | list[int]


@dataclass(frozen=True)
class EmbedAsk:
    """What a route asks, in no API's words: the inputs, the model (None: the default), the
    vector's width (None: the model's), whether inputs longer than the context are cut
    (Ollama's `truncate`; else a 400), texts with the tokenizer's special tokens (vLLM's
    `add_special_tokens`), the scheduling priority, and the wire's name of the inputs."""

    inputs: list[Input]
    model: str | None = None
    dimensions: int | None = None
    truncate: bool = False
    special: bool = True
    priority: int = 0
    param: str = "input"


@dataclass(frozen=True)
class Embedded:
    vectors: list[np.ndarray]  # [width] float32 per input, in order
    prompt_tokens: int
    model: str  # the name the response carries: the adapter's, or the model's


def check_inputs(inputs: list[Input], param: str) -> None:
    """What needs no model: some inputs, not too many, none empty."""
    if not inputs:
        raise APIError(f"{param} must not be empty", param=param)
    if len(inputs) > MAX_INPUTS:
        raise APIError(f"At most {MAX_INPUTS} inputs may be embedded at once.", param=param)
    for i, x in enumerate(inputs):
        if not x:
            what = "an empty string" if isinstance(x, str) else "an empty list of token ids"
            raise APIError(f"{param}[{i}] is {what}", param=param)


def embedding_config(served: Served, name: str) -> EmbeddingConfig:
    """The model's embedding config; a 400 for a model served to generate only (vLLM refuses
    a model not served for pooling the same way)."""
    served.check_model(name, generates=False)
    if served.embedding is None:
        raise APIError(
            f"The model `{name}` does not serve embeddings: an embedding model is one whose"
            " sentence-transformers files pool the last token (Qwen3-Embedding), one served"
            " with --task embed, or an encoder (BERT).",
            param="model",
            code="model_not_supported",
        )
    return served.embedding


async def embed(ask: EmbedAsk, served: Served, raw: Request) -> Embedded:
    """The inputs' embeddings; ConnectionAbortedError when the client left first."""
    check_inputs(ask.inputs, ask.param)
    name = ask.model or served.model.name
    cfg = embedding_config(served, name)
    if ask.dimensions is not None and (why := cfg.check_dimensions(ask.dimensions)) is not None:
        raise APIError(why, param="dimensions")
    prompts = [_ids(x, i, ask, served) for i, x in enumerate(ask.inputs)]
    rid, adapter = f"embd-{uuid.uuid4().hex}", served.adapter(name)
    requests = [
        EngineRequest(f"{rid}-{i}", ids, SamplingParams(max_tokens=0), adapter=adapter,
                      priority=ask.priority, embed=True)
        for i, ids in enumerate(prompts)
    ]  # fmt: skip
    outs = await finished([served.engine.submit(r) for r in requests], raw)
    vectors = []
    for out in outs:
        assert out.embedding is not None  # an embedding request's last output carries it
        vectors.append(pooled(out.embedding, cfg, ask.dimensions))
    return Embedded(vectors, sum(len(p) for p in prompts), adapter or served.model.name)


def pooled(hidden: np.ndarray, cfg: EmbeddingConfig, dimensions: int | None) -> np.ndarray:
    """The embedding of a last hidden state: its first `dimensions` (Matryoshka), normalized
    where the model normalizes, and always after a cut (a cut vector is normalized again)."""
    v = hidden[:dimensions] if dimensions is not None else hidden
    if cfg.normalize or dimensions is not None:
        v = v / max(float(np.linalg.norm(v.astype(np.float64))), EPS)
    return np.asarray(v, np.float32)


def _ids(x: Input, i: int, ask: EmbedAsk, served: Served) -> list[int]:
    """One input's ids, checked against the vocabulary and the context (cut to it where the
    ask truncates)."""
    limit, param = served.model.max_model_len, ask.param
    if isinstance(x, str):
        if not ask.truncate:  # far too long: refused before paying to tokenize it
            served.checks.check_text(x, param)
        ids = encode(served.model, x, param, special=ask.special)
    else:
        vocab = served.checks.bounds.vocab_size
        bad = next((t for t in x if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                f"{param}[{i}] holds {bad}, which is not a token id of this model (vocabulary"
                f" {vocab})",
                param=param,
                code="invalid_token_id",
            )
        ids = list(x)
    if not ids:
        raise APIError(f"{param}[{i}] has no tokens", param=param)
    if len(ids) <= limit:
        return ids
    if not ask.truncate:
        raise APIError(
            f"This model's maximum context length is {limit} tokens; {param}[{i}] has {len(ids)}.",
            param=param,
            code="context_length_exceeded",
        )
    return _cut(served, x, ids, limit, ask.special)


def _cut(served: Served, x: Input, ids: list[int], limit: int, special: bool) -> list[int]:
    """`ids` cut to `limit` tokens, the tokenizer's special tokens around a text kept (as a
    tokenizer that truncates keeps them: Qwen3-Embedding's `<|endoftext|>` stays last)."""
    if isinstance(x, str) and special:
        plain = encode(served.model, x, "input")
        extra = len(ids) - len(plain)
        for head in range(extra + 1):
            if ids[head : head + len(plain)] == plain:
                tail = extra - head
                if limit > extra:
                    return ids[:head] + plain[: limit - extra] + ids[len(ids) - tail :]
                break
    return ids[:limit]
