"""A Responses body read into the chat request the one request path prepares: `instructions` as
the system message, the stored conversation of `previous_response_id`, `input` items as chat
messages (function calls and their outputs as the history's tool calls and results, reasoning
items as the next assistant message's `reasoning_content`), function tools, `tool_choice`,
`text.format` as `response_format`, `reasoning` as the template's variables, the sampling
fields. Each item or field this server cannot honour is a 400 naming it."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.images import image_part
from omlx_logprobs.api.core.protocol import ChatCompletionRequest
from omlx_logprobs.api.responses.compaction import unpack
from omlx_logprobs.api.responses.protocol import ResponsesRequest

# The chat request's field names as a Responses client knows them (prepare.wire_names).
NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
REFUSED = {
    "background": "background responses",
    "conversation": "conversations (send previous_response_id)",
    "prompt": "stored prompts",
    "context_management": "context management",
    "max_tool_calls": "max_tool_calls",
}


def chat_request(
    req: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request this Responses body asks for; `conversation`: the stored conversation
    of its `previous_response_id` and its own `input` as messages (`input_messages`), to which
    its instructions are put first (a stored response's are not carried over, as OpenAI's are
    not)."""
    for name, why in REFUSED.items():
        value = getattr(req, name)
        if value is not None and value is not False:
            raise APIError(
                f"{name}: {why} is not supported by this server.",
                param=name,
                code="unsupported_parameter",
            )
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += conversation
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "parallel_tool_calls": req.parallel_tool_calls,
        "chat_template_kwargs": _template_kwargs(req),
        "reasoning_effort": _effort(req),
        "response_format": _response_format(req),
        **_tools(req),
    }
    for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "logprobs_mode", "logprobs_format",
        "return_tokens_as_token_ids", "return_tail_logprob",
    ):  # fmt: skip
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # an item's shape the chat messages cannot hold
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise APIError(f"input: {where}: {err.get('msg')}", param="input") from None


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: text is one user message; items in order, an assistant's
    message and the function calls after it one assistant message (with `tool_calls`), a
    function call's output a `tool` message, a reasoning item's text the `reasoning_content`
    of the assistant message that follows it."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    reasoning = ""
    for i, item in enumerate(given):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"{where}.role: {role!r} is not a message role", param=where)
            out.append({"role": role, "content": _content(item.get("content"), where)})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                out.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text}
            )
        elif kind == "compaction":
            out += unpack(item, where)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise APIError(
                f"{where}: items of type {kind!r} are not supported by this server (messages,"
                " function_call, function_call_output, reasoning and compaction are)",
                param=where,
                code="unsupported_value",
            )
    return out


def check_calls(conversation: list[dict[str, Any]]) -> None:
    """Each function call's output answers a call made before it in the conversation (a 400
    otherwise, as OpenAI's: an output with no call is a client's mistake, never sent on to a
    template that would render it as a result of nothing)."""
    called: set[str] = set()
    for message in conversation:
        called.update(c.get("id") for c in message.get("tool_calls") or ())
        if message["role"] == "tool" and message.get("tool_call_id") not in called:
            raise APIError(
                "No tool call found for function call output with call_id"
                f" '{message.get('tool_call_id')}'.",
                param="input",
                code="tool_call_not_found",
            )


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or, where it holds `input_image` parts, its parts in
    order as chat's (text and image_url parts)."""
    parts = content if isinstance(content, list) else []
    if not any(isinstance(p, dict) and p.get("type") == "input_image" for p in parts):
        return _text(content, where)
    out = []
    for j, part in enumerate(parts):
        field = f"{where}.content[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise APIError(
                    f"{field}: an input_image needs an image_url (a file_id is not supported)",
                    param=field,
                    code="unsupported_value",
                )
            out.append(image_part(url, f"{field}.image_url"))
        else:
            out.append({"type": "text", "text": _text([part], where)})
    return out


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts joined (input_text,
    output_text; a refusal's text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise APIError(
                f"{where}.content[{j}]: parts of type {kind!r} are not supported (text only)",
                param=where,
                code="unsupported_value",
            )
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    """Function tools as chat's; any other kind of tool is a 400 (no hosted tools here)."""
    out: dict[str, Any] = {}
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.get("type") != "function":
            raise APIError(
                f"tools[{i}]: tools of type {t.get('type')!r} are not supported by this server"
                " (function tools are)",
                param="tools",
                code="unsupported_value",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        tools.append({"type": "function", "function": fn})
    if tools:
        out["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                "tool_choice: only none, auto, required or a function"
                ' ({"type": "function", "name": ...}) are supported',
                param="tool_choice",
                code="unsupported_value",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": fmt.name or "response", "strict": fmt.strict}
    if fmt.schema_ is not None:
        spec["schema"] = fmt.schema_
    return {"type": "json_schema", "json_schema": spec}


def _effort(req: ResponsesRequest) -> str | None:
    return req.reasoning.effort if req.reasoning is not None else None


def _template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """`reasoning.effort: none` turns thinking off for templates that read `enable_thinking`
    (the client's own chat_template_kwargs win)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if _effort(req) == "none":
        kwargs.setdefault("enable_thinking", False)
    return kwargs or None
