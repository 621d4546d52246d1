"""A `/v1/messages` body read into the chat request the one request path prepares: `system` as
the system message, content blocks as chat messages (`tool_use` as the assistant's tool calls,
`tool_result` as tool messages, `thinking` as the assistant's `reasoning_content`), tools,
`tool_choice`, `thinking` as the template's `enable_thinking` (its `budget_tokens` as the
thinking budget), `output_config.format` as a
JSON-schema constraint, `stop_sequences` and the sampling fields. A block or field this server
cannot honour is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from omlx_logprobs.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.images import data_url, image_part
from omlx_logprobs.api.core.protocol import ChatCompletionRequest

# The chat request's field names as an Anthropic client knows them (prepare.wire_names).
NAMES = {
    "stop": "stop_sequences",
    "max_completion_tokens": "max_tokens",
    "response_format": "output_config",
    "reasoning_effort": "output_config",
    "thinking_token_budget": "thinking.budget_tokens",
}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}
EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}


def chat_request(
    req: MessagesRequest | CountTokensRequest, reasoning: bool = False
) -> ChatCompletionRequest:
    """`reasoning`: the served model's reasoning is parsed, so `thinking.budget_tokens` is
    enforced (a thinking budget); elsewhere the budget has nothing to bound."""
    body: dict[str, Any] = {"model": req.model, "messages": messages(req), **_tools(req)}
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        if reasoning and req.thinking.type == "enabled":
            body["thinking_token_budget"] = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        body.update(
            max_tokens=req.max_tokens,
            stream=req.stream,
            stop=req.stop_sequences,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            logprobs_mode=req.logprobs_mode,
            seed=req.seed,
            min_p=req.min_p,
            **_output_config(req.output_config),
        )
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # a block's shape the chat messages cannot hold
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise APIError(f"{where}: {err.get('msg')}", param="messages") from None


def messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text(req.system, "system")
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out += _user(m.content, where)
        else:
            out.append(_assistant(m.content, where))
    return out


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages (first, as the calls they answer come
    right before), then its text."""
    results, parts = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "tool_result":
            content = b.get("content", "")
            text = content if isinstance(content, str) else _text(content, f"{where}[{j}]")
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id")),
                            "content": text})  # fmt: skip
        elif kind == "text":
            parts.append({"type": "text", "text": str(b.get("text", ""))})
        elif kind == "image":
            parts.append(_image(b.get("source"), f"{where}[{j}].source"))
        else:
            _refuse(kind, f"{where}[{j}]")
    if not parts:
        return results
    if all(p["type"] == "text" for p in parts):
        return [*results, {"role": "user", "content": "".join(p["text"] for p in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _image(source: Any, field: str) -> dict[str, Any]:
    """An image block's source (base64 data, or a URL) as a chat image part."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        return image_part(data_url(source.get("media_type"), source.get("data"), field), field)
    if kind == "url" and isinstance(source.get("url"), str):  # type: ignore[union-attr]
        return image_part(source["url"], field)  # type: ignore[index]
    raise APIError(
        f"{field}: an image's source must be base64 data or a URL", param=field,
        code="unsupported_value",
    )  # fmt: skip


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            message["content"] += str(b.get("text", ""))
        elif kind == "thinking":
            message["reasoning_content"] = str(b.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing to show this model
        elif kind == "tool_use":
            args = json.dumps(b.get("input") or {}, ensure_ascii=False)
            call = {"name": str(b.get("name")), "arguments": args}
            message.setdefault("tool_calls", []).append(
                {"id": str(b.get("id")), "type": "function", "function": call}
            )
        else:
            _refuse(kind, f"{where}[{j}]")
    if message.get("tool_calls") and not message["content"]:
        message["content"] = None
    return message


def _text(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list):
        raise APIError(f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text":
            _refuse(b.get("type") if isinstance(b, dict) else None, f"{where}[{j}]")
        texts.append(str(b.get("text", "")))
    return "".join(texts)


def _refuse(kind: Any, where: str) -> None:
    raise APIError(
        f"{where}: content blocks of type {kind!r} are not supported by this server (text,"
        " tool_use, tool_result and thinking are)",
        param=where,
    )


def _tools(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.get("type") not in (None, "custom"):
            raise APIError(
                f"tools[{i}]: tools of type {t.get('type')!r} are not supported by this server"
                " (custom tools are)",
                param="tools",
            )
        fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    if tools:
        out["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError("tool_choice: a tool choice of type tool names one", "tool_choice")
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = CHOICES[choice.type]
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def _output_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """`format: {type: json_schema, schema}` as a strict JSON-schema constraint; `effort` as
    the template's reasoning effort."""
    out: dict[str, Any] = {}
    fmt = (config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise APIError("output_config.format: only json_schema is supported", "output_config")
        spec = {"name": "output", "schema": fmt.get("schema", {}), "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": spec}
    effort = (config or {}).get("effort")
    if effort is not None:
        if effort not in EFFORT:
            raise APIError(f"output_config.effort: {effort!r} is not an effort", "output_config")
        out["reasoning_effort"] = EFFORT[effort]
    return out
