"""Tool calls at the API: the history's calls and results as chat templates expect them, the
request's `tools` and `tool_choice` as the engine's `ToolParsing` (and, for a forced call, the
grammar of calls in the model's format), and parsed calls as OpenAI's `tool_calls` with ids
(whole in a message, one entry per call with its index in a delta)."""

from __future__ import annotations

import json
import secrets
import string
from functools import lru_cache
from typing import Any

from omlx_logprobs.api.core.constraints import constraint_field, whitespace_option
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    Tool,
)
from omlx_logprobs.parsing.grammar import (
    MARKERS,
    GrammarError,
    calls_or_content,
    check,
    tool_calls_grammar,
)
from omlx_logprobs.parsing.tools import ToolCallFormat
from omlx_logprobs.types import Constraint, ConstraintKind, ToolCall, ToolParsing

_ALNUM = string.ascii_letters + string.digits


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's calls with their arguments as
    objects (templates write them with `tojson`; a string would be quoted twice), a tool
    result with the id of the call it answers, content "" where a message has none, an
    assistant's earlier reasoning as `reasoning_content` (what reasoning templates read)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        reasoning = (m.model_extra or {}).get("reasoning_content")
        if m.role == "assistant" and isinstance(reasoning, str) and reasoning:
            d["reasoning_content"] = reasoning
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


def tool_parsing(req: ChatCompletionRequest, fmt: str, tokenizer: Any) -> ToolParsing | None:
    """How the request's output is searched for calls; None when it is not. A 400 for what
    cannot be honoured: calls need a format the server can parse and a chat template that
    shows the model its tools."""
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
    if fmt == ToolCallFormat.NONE.value:
        raise APIError(
            "This server parses no tool calls for this model: its chat template shows no known"
            " tool-call format (start the server with --tool-call-parser)",
            param="tools",
        )
    if not renders_tools(tokenizer):
        raise APIError(
            "This model's chat template does not show tools to the model (it renders the same"
            " prompt with and without them), so it could not call them: send the tools in a"
            " message, or serve the model with a template that renders `tools`",
            param="tools",
        )
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools)
    named = isinstance(choice, NamedToolChoice)
    # A named function gets one call, as OpenAI and vLLM answer it.
    parallel = req.parallel_tool_calls is not False and not named
    return ToolParsing(fmt, tools, parallel=parallel, forced=named or choice == "required")


def tool_constraint(
    req: ChatCompletionRequest,
    parsing: ToolParsing | None,
    tokenizer: Any,
    content: Constraint | None,
) -> Constraint | None:
    """The output's constraint where tools shape it (`content`, the request's own constraint,
    otherwise). `tool_choice` `required` (any of the tools) or a named function: the grammar of
    calls in the model's own format (parsing/grammar.py), one call for a named function, one or
    more for `required` unless `parallel_tool_calls` is false, each with arguments following its
    function's `parameters`; `content` is moot (a forced turn has no content). `auto` beside a
    constraint (`response_format`, `structured_outputs`): calls, or content that matches it.
    Either way the model may end its turn after any complete call (`ConstraintKind.TOOL_CALLS`
    is open-ended), and the format's parser reads the calls back as `tool_calls`."""
    forced = parsing is not None and parsing.forced
    if parsing is None or not parsing.calls or not (forced or content is not None):
        return content
    if req.min_tokens:
        raise APIError(
            "min_tokens cannot be combined with tool calls under a grammar: the grammar of the"
            " calls decides where the output may end",
            param="min_tokens",
        )
    choice = req.tool_choice
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    try:
        text = tool_calls_grammar(
            parsing.parser,
            parsing.tools,
            name,
            parsing.parallel,
            whitespace_option(req),
            # Mistral's v11 templates write `[TOOL_CALLS]NAME[ARGS]{...}`, v3's a JSON list
            mistral_args="[ARGS]" in str(getattr(tokenizer, "chat_template", None) or ""),
            tokens=marker_tokens(tokenizer),
        )
        if not forced and content is not None:
            text = calls_or_content(text, content)
        c = Constraint(ConstraintKind.TOOL_CALLS, text, strict=False)
        check(c)
    except GrammarError as exc:
        param = "tool_choice" if forced else constraint_field(req) or "tools"
        raise APIError(
            f"{param}: the tool calls cannot be constrained ({exc})",
            param=param,
            code="unsupported_value",
        ) from None
    return c


def marker_tokens(tokenizer: Any) -> dict[str, int]:
    """The tool-call markers that are one token of this tokenizer, with their ids."""
    out = {}
    for marker in MARKERS:
        try:
            ids = tokenizer.encode(marker, add_special_tokens=False)
        except Exception:
            continue
        if len(ids) == 1:
            out[marker] = int(ids[0])
    return out


@lru_cache(maxsize=16)
def _renders(template: str, tokenizer: Any) -> bool:
    probe = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "probe_tool", "parameters": {}}}
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
        without = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template that cannot render the probe: let the request find out
        return True
    return bool(with_tools != without)


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes `tools` into the prompt (a probe rendered with and
    without a tool differs), once per template."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None or not hasattr(tokenizer, "apply_chat_template"):
        return True
    return _renders(str(template), tokenizer)


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


def finish_reason(reason: str | None, called: bool, named: bool = False) -> str | None:
    """`tool_calls` when the model ended its turn after calling; `stop` when the request named
    the function (OpenAI's answer to a named `tool_choice`, and vLLM's)."""
    return "tool_calls" if called and reason == "stop" and not named else reason
