"""The tokenizer over HTTP, in vLLM's shapes (what lm-evaluation-harness's remote tokenizer reads):
`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from omlx_logprobs.api import tools
from omlx_logprobs.api.errors import APIError
from omlx_logprobs.api.pool import ModelPool
from omlx_logprobs.api.protocol import DetokenizeRequest, TokenizeRequest
from omlx_logprobs.api.serving import Served, encode


def tokenize(req: TokenizeRequest, served: Served) -> dict[str, Any]:
    """Ids of a prompt (special tokens added by default) or of chat messages rendered with the
    chat template (its own special tokens only, as chat completions does)."""
    served.checks.check(req)
    tok = served.model.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError("Give exactly one of prompt and messages.", param="prompt")
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        served.checks.check_text(req.prompt, "prompt")
        ids = encode(served.model, req.prompt, "prompt", special=add)
    else:
        messages = tools.template_messages(req.messages or [])
        try:
            text = tok.apply_chat_template(
                messages,
                tools=tools.template_tools(req.tools),
                add_generation_prompt=req.add_generation_prompt,
                tokenize=False,
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # a template error is the request's fault
            raise APIError(f"The chat template could not render: {e}", param="messages") from None
        served.checks.check_text(text, "messages")
        ids = encode(served.model, text, "messages", special=bool(req.add_special_tokens))
    return {"tokens": ids, "count": len(ids), "max_model_len": served.model.max_model_len}


def detokenize(req: DetokenizeRequest, served: Served) -> dict[str, Any]:
    served.checks.check(req)
    vocab = len(served.model.vocab)
    for t in req.tokens:
        if not 0 <= t < vocab:
            raise APIError(f"tokens: {t} is not a token id of this model", param="tokens")
    return {"prompt": served.model.tokenizer.decode(req.tokens)}


def tokenizer_info(served: Served) -> dict[str, Any]:
    tok = served.model.tokenizer
    return {
        "tokenizer_class": type(tok).__name__,
        "model": served.model.name,
        "vocab_size": len(served.model.vocab),
        "max_model_len": served.model.max_model_len,
        "model_max_length": served.model.max_model_len,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "eos_token_ids": list(served.model.eos_token_ids),
        "add_bos_token": getattr(tok, "add_bos_token", None),
        "chat_template": tok.chat_template,
    }


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    """Each route takes the model by name (`model`; the default when absent) and loads it if
    need be."""

    @app.post("/tokenize")
    async def _tokenize(req: TokenizeRequest) -> dict[str, Any]:
        async with pool.use(req.model) as slot:
            assert slot.served is not None
            return tokenize(req, slot.served)

    @app.post("/detokenize")
    async def _detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        async with pool.use(req.model) as slot:
            assert slot.served is not None
            return detokenize(req, slot.served)

    @app.get("/tokenizer_info")
    async def _tokenizer_info(model: str | None = None) -> dict[str, Any]:
        async with pool.use(model) as slot:
            assert slot.served is not None
            return tokenizer_info(slot.served)
