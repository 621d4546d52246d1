"""Tool calls at the API: the history's calls and results as chat templates expect them, the
request's `tools` and `tool_choice` as the engine's `ToolParsing`, and parsed calls as OpenAI's
`tool_calls` with ids (whole in a message, one entry per call with its index in a delta)."""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from omlx_logprobs.api.errors import APIError
from omlx_logprobs.api.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from omlx_logprobs.parsing.tools import ToolCallFormat
from omlx_logprobs.types import ToolCall, ToolParsing

_ALNUM = string.ascii_letters + string.digits


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's calls with their arguments as
    objects (templates write them with `tojson`; a string would be quoted twice), a tool
    result with the id of the call it answers, content "" where a message has none."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _arguments(call: Any) -> Any:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments  # not JSON: the template gets the text as it came
    return args if isinstance(args, dict) else call.function.arguments


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def tool_parsing(req: ChatCompletionRequest, fmt: str) -> ToolParsing | None:
    """How the request's output is searched for calls; None when it is not. A 400 for what
    cannot be honoured: a forced call (`required`, a named function) needs constrained
    decoding, and `auto` needs a format the server can parse."""
    choice = req.tool_choice
    harmony = fmt == ToolCallFormat.HARMONY.value
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        # A harmony answer is a message with a header too: parsed, with no calls.
        return ToolParsing(fmt, calls=False) if harmony else None
    if choice == "none":
        # the template still sees the tools, as OpenAI's model does
        return ToolParsing(fmt, calls=False) if harmony else None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in req.tools}:
            raise APIError(
                f"tool_choice names `{name}`, which is not in tools", param="tool_choice"
            )
    if choice == "required" or isinstance(choice, NamedToolChoice):
        raise APIError(
            "tool_choice `required` or a named function is not supported yet: forcing a call"
            " needs constrained decoding; use `auto`",
            param="tool_choice",
            code="unsupported_value",
        )
    if fmt == ToolCallFormat.NONE.value:
        raise APIError(
            "This server parses no tool calls for this model: its chat template shows no known"
            " tool-call format (start the server with --tool-call-parser)",
            param="tools",
        )
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools)
    return ToolParsing(fmt, tools, parallel=req.parallel_tool_calls is not False)


class CallIds:
    """One choice's calls, numbered in order with fresh ids (Mistral's templates require nine
    alphanumeric characters; others get `call_` and 24)."""

    def __init__(self, fmt: str | None) -> None:
        self.mistral = fmt == ToolCallFormat.MISTRAL.value
        self.count = 0

    def new_id(self) -> str:
        if self.mistral:
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return "call_" + secrets.token_hex(12)

    def message(self, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
        """`message.tool_calls`."""
        self.count += len(calls)
        return [_call(self.new_id(), c) for c in calls]

    def delta(self, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
        """`delta.tool_calls`: each call whole, with its index among the choice's calls."""
        out = []
        for c in calls:
            out.append({"index": self.count, **_call(self.new_id(), c)})
            self.count += 1
        return out


def _call(call_id: str, c: ToolCall) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    }


def finish_reason(reason: str | None, called: bool) -> str | None:
    """`tool_calls` when the model ended its turn after calling."""
    return "tool_calls" if called and reason == "stop" else reason
