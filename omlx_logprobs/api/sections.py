"""The reasoning, content and tool-call fields of a chat message and of a streamed delta.

With the thinking parser off, a message is `{"content"}` as before. With it on, reasoning goes in
`reasoning_content` (null when there is none) and the answer in `content`; a streamed delta holds
whichever of the two its output carries text or entries for (both when one output spans the end
of reasoning). Parsed tool calls go in `tool_calls` (content is null when a message has calls
and no text).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from omlx_logprobs.types import Entries, RequestOutput, ThinkStart


class Sections(NamedTuple):
    """An output's entries by section: reasoning first, then content, then tool calls (every
    API places each section's entries beside that section's text)."""

    reasoning: Entries
    content: Entries
    tools: Entries


def sections(out: RequestOutput) -> Sections | None:
    """The entries of out's tokens, split where its sections meet; None without logprobs."""
    e = out.logprobs
    if e is None:
        return None
    r, t = out.num_reasoning, len(e) - out.num_tool
    return Sections(e.rows(0, r), e.rows(r, t), e.rows(t, len(e)))


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
