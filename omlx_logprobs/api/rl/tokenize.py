"""The tokenizer over HTTP, in vLLM's shapes (what lm-evaluation-harness's remote tokenizer reads):
`POST /tokenize` (chat messages with images: each image's placeholders expanded, as the chat
route's prompt has them), `POST /detokenize`, `GET /tokenizer_info`. They need the tokenizer
alone: a model that is not loaded is not loaded for them (api/core/pool.py keeps or loads its
tokenizer)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from omlx_logprobs.api.core import parts, tools
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.images import expand, image_parts
from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.core.prompts import encode, image_messages, read_images
from omlx_logprobs.api.core.served import fields_headers
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.api.rl.protocol import DetokenizeRequest, TokenizeRequest


def tokenize(req: TokenizeRequest, model: Any, checks: RequestLimits) -> dict[str, Any]:
    """Ids of a prompt (special tokens added by default) or of chat messages rendered with the
    chat template (its own special tokens only, as chat completions does). `model`: a
    LoadedModel, with or without its weights."""
    checks.check(req)
    tok = model.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError("Give exactly one of prompt and messages.", param="prompt")
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        checks.check_text(req.prompt, "prompt")
        ids = encode(model, req.prompt, "prompt", special=add)
    else:
        pictured = image_parts(req.messages or [])
        messages = image_messages(req.messages or [])
        kwargs = dict(req.chat_template_kwargs or {})
        if req.continue_final_message:
            if req.add_generation_prompt:
                raise APIError(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to"
                    " true (add_generation_prompt defaults to true: send false).",
                    param="continue_final_message",
                )
            kwargs["continue_final_message"] = True
        try:
            text = tok.apply_chat_template(
                parts.as_parts(messages, tok),  # as the chat route renders them
                tools=tools.template_tools(req.tools),
                add_generation_prompt=req.add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # a template error is the request's fault
            raise APIError(f"The chat template could not render: {e}", param="messages") from None
        checks.check_text(text, "messages")
        special = bool(req.add_special_tokens)
        if pictured:  # each image's placeholders expanded, as the chat route's prompt has them
            images = read_images(model, checks.limits, pictured)
            ids = expand(model.vision, text, images, special)[0]
        else:
            ids = encode(model, text, "messages", special=special)
    out: dict[str, Any] = {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": model.max_model_len,
    }
    if req.return_token_strs:
        out["token_strs"] = list(tok.convert_ids_to_tokens(ids))
    return out


def detokenize(req: DetokenizeRequest, model: Any, checks: RequestLimits) -> dict[str, Any]:
    checks.check(req)
    vocab = len(model.vocab)
    for t in req.tokens:
        if not 0 <= t < vocab:
            raise APIError(f"tokens: {t} is not a token id of this model", param="tokens")
    return {"prompt": model.tokenizer.decode(req.tokens)}


def tokenizer_info(model: Any) -> dict[str, Any]:
    tok = model.tokenizer
    return {
        "tokenizer_class": type(tok).__name__,
        "model": model.name,
        "vocab_size": len(model.vocab),
        "max_model_len": model.max_model_len,
        "model_max_length": model.max_model_len,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "eos_token_ids": list(model.eos_token_ids),
        "add_bos_token": getattr(tok, "add_bos_token", None),
        "chat_template": tok.chat_template,
    }


def add_routes(app: FastAPI, pool: ModelPool) -> None:
    """Each route takes the model by name (`model`; the default when absent)."""

    # Unknown fields: a 400 naming the first, or (--ignore-unknown-fields) the header.
    @app.post("/tokenize")
    async def _tokenize(req: TokenizeRequest) -> JSONResponse:
        headers = fields_headers(req, pool.ignore_unknown_fields)
        held = await pool.tokenizer(req.model)
        if image_parts(req.messages or []):  # read and processed off the event loop
            return JSONResponse(await asyncio.to_thread(tokenize, req, *held), headers=headers)
        return JSONResponse(tokenize(req, *held), headers=headers)

    @app.post("/detokenize")
    async def _detokenize(req: DetokenizeRequest) -> JSONResponse:
        headers = fields_headers(req, pool.ignore_unknown_fields)
        return JSONResponse(detokenize(req, *await pool.tokenizer(req.model)), headers=headers)

    @app.get("/tokenizer_info")
    async def _tokenizer_info(model: str | None = None) -> dict[str, Any]:
        return tokenizer_info((await pool.tokenizer(model))[0])
