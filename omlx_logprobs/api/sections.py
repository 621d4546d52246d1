"""The reasoning, content and tool-call fields of a chat message and of a streamed delta.

With the thinking parser off, a message is `{"content"}` as before. With it on, reasoning goes in
`reasoning_content` (null when there is none) and the answer in `content`; a streamed delta holds
whichever of the two its output carries text or entries for (both when one output spans the end
of reasoning). Parsed tool calls go in `tool_calls` (content is null when a message has calls
and no text).
"""

from __future__ import annotations

from typing import Any

from omlx_logprobs.types import RequestOutput, ThinkStart


def message(
    out: RequestOutput, think: ThinkStart, tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    m: dict[str, Any] = {"content": out.text}
    if think is not ThinkStart.OFF:
        m["reasoning_content"] = out.reasoning_text or None
    if tool_calls:
        m["tool_calls"] = tool_calls
        m["content"] = out.text or None
    return m


def delta(
    out: RequestOutput, think: ThinkStart, tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    if think is ThinkStart.OFF and not (out.num_tool or tool_calls):
        return {"content": out.text}
    d: dict[str, Any] = {}
    if think is not ThinkStart.OFF and (out.reasoning_text or out.num_reasoning):
        d["reasoning_content"] = out.reasoning_text
    content_tokens = out.num_tokens - out.num_reasoning - out.num_tool
    if out.text or content_tokens or not (d or tool_calls):
        d["content"] = out.text
    if tool_calls:
        d["tool_calls"] = tool_calls
    return d
