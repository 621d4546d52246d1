"""Ollama's bodies read into the chat or completions request the one request path prepares:
`messages` (calls in the history with their arguments as objects, `tool` results), `tools`,
`format` (`"json"` or a JSON schema), `think` (the template's `enable_thinking`, a level as
its reasoning effort), `options` (runtime options as sampling fields), `logprobs` and
`top_logprobs`; `/api/generate` as a chat turn (system and prompt) or, with `raw`, the prompt as
it is."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.images import data_url, image_part
from omlx_logprobs.api.core.protocol import ChatCompletionRequest, CompletionRequest
from omlx_logprobs.api.ollama.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
)

# Runtime options and the sampling fields they set.
OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Options with no effect here: where and how a model is loaded and run (this server decides),
# and the window a repeat penalty looks back over (it looks at the whole sequence here).
IGNORED = {
    "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
    "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
    "repeat_last_n", "penalize_newline",
}  # fmt: skip
# Samplers this server does not have: refused unless they are off.
OFF = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}
# The chat request's field names as an Ollama client knows them (prepare.wire_names).
NAMES = {
    "max_tokens": "options.num_predict",
    "response_format": "format",
    "temperature": "options.temperature",
    "top_k": "options.top_k",
    "top_p": "options.top_p",
    "stop": "options.stop",
    "repetition_penalty": "options.repeat_penalty",
}


def _sampling(req: OllamaChatRequest | OllamaGenerateRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"stream": req.stream}
    for key, value in (req.options or {}).items():
        if key in OPTIONS:
            if value is not None:
                out[OPTIONS[key]] = value
        elif key == "num_predict":
            if not (value is None or isinstance(value, int)) or isinstance(value, bool):
                raise APIError("options.num_predict must be an integer", "options.num_predict")
            if value is not None and value >= 0:  # -1: no limit, -2: fill the context
                out["max_tokens"] = value
        elif key in OFF:
            if value is not None and not (isinstance(value, (int, float)) and value == OFF[key]):
                raise APIError(f"options.{key}: this sampler is not supported", "options")
        elif key not in IGNORED:
            raise APIError(f"options.{key} is not an option", param=f"options.{key}")
    if req.logprobs or req.top_logprobs is not None:
        out["top_logprobs"] = req.top_logprobs or 0
    return out


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise APIError('format must be "json" or a JSON schema', param="format")


def _think(req: OllamaChatRequest | OllamaGenerateRequest) -> dict[str, Any]:
    if req.think is None:
        return {}
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": req.think is not False}}
    if isinstance(req.think, str):
        out["reasoning_effort"] = req.think
    return out


def _validated(model: type[Any], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise APIError(f"{where}: {err.get('msg')}", param=where or None) from None


def chat_request(req: OllamaChatRequest) -> ChatCompletionRequest:
    if not req.messages:
        raise APIError("messages must not be empty", param="messages")
    sampling = _sampling(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [_message(m, i) for i, m in enumerate(req.messages)],
        "response_format": _format(req.format),
        "logprobs": "top_logprobs" in sampling,
        **sampling,
        **_think(req),
    }
    if req.tools:
        body["tools"] = req.tools
    return _validated(ChatCompletionRequest, body)


def _message(m: OllamaMessage, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.images:
        out["content"] = _with_images(m.content or "", m.images, f"messages[{i}].images")
    if m.thinking and m.role == "assistant":
        out["reasoning_content"] = m.thinking
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            args = c.function.arguments
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append({"id": c.id or f"call_{i}_{j}", "type": "function",
                          "function": {"name": c.function.name, "arguments": text}})  # fmt: skip
        out["tool_calls"] = calls
        out["content"] = m.content or None
    if m.role == "tool":
        if m.tool_name is not None:
            out["name"] = m.tool_name
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
    return out


def _with_images(text: str, images: list[Any] | None, field: str) -> Any:
    """Text with Ollama's images (base64 strings) before it, as chat parts; the text alone
    without images."""
    if not images:
        return text
    parts = [image_part(data_url(None, d, f"{field}[{j}]"), f"{field}[{j}]")
             for j, d in enumerate(images)]  # fmt: skip
    return [*parts, {"type": "text", "text": text}]


def generate_request(req: OllamaGenerateRequest) -> ChatCompletionRequest | CompletionRequest:
    """A chat turn (the system message and the prompt, through the chat template), or with
    `raw` the prompt as it is."""
    for name, why in (("suffix", "fill-in-the-middle"), ("template", "a template sent with"
                      " the request"), ("context", "a context of token ids (send the text)"),
                      ("images" if req.raw else "", "images with a raw prompt")):  # fmt: skip
        if name and getattr(req, name):
            raise APIError(f"{name}: {why} is not supported by this server", param=name)
    sampling = _sampling(req)
    fmt = _format(req.format)
    if req.raw:
        top = sampling.pop("top_logprobs", None)
        body = {"model": req.model, "prompt": req.prompt, "logprobs": top,
                "response_format": fmt, "max_tokens": None, **sampling}  # fmt: skip
        return _validated(CompletionRequest, body)
    messages = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": _with_images(req.prompt, req.images, "images")})
    body = {"model": req.model, "messages": messages, "response_format": fmt,
            "logprobs": "top_logprobs" in sampling, **sampling, **_think(req)}  # fmt: skip
    return _validated(ChatCompletionRequest, body)
