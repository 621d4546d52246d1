"""The reasoning, content and tool-call fields of a chat message and of a streamed delta.

With the thinking parser off, a message is `{"content"}` as before. With it on, reasoning goes in
`reasoning_content` (null when there is none) and the answer in `content`; a streamed delta holds
whichever of the two its output carries text or entries for (both when one output spans the end
of reasoning). Parsed tool calls go in `tool_calls` (content is null when a message has calls
and no text), as UTF-8 can carry them (`wire_call`).
"""

from __future__ import annotations

import json
import re
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
        m["tool_calls"] = [wire_call(c) for c in tool_calls]
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
        d["tool_calls"] = [wire_call(c) for c in tool_calls]
    return d


_SURROGATE = re.compile("[\ud800-\udfff]")


def wire_call(call: dict[str, Any]) -> dict[str, Any]:
    """A call that UTF-8 can carry. JSON may escape half a surrogate pair (`"\\ud83d"`, as a
    model writes half an emoji), which the parser's decoding turns into a lone surrogate: in
    `arguments` it is escaped again (the same JSON value, since JSON puts it only in a string),
    in a name replaced by U+FFFD. Left as it was, the body cannot be encoded: a 500, or a
    stream cut after its 200, which clients report as a connection error."""
    fn = call["function"]
    args, name = fn["arguments"], fn["name"]
    if not (_SURROGATE.search(args) or _SURROGATE.search(name)):
        return call
    args = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", args)
    fn = {**fn, "name": _SURROGATE.sub("\ufffd", name), "arguments": args}
    return {**call, "function": fn}


def dumps(obj: Any) -> str:
    """Compact JSON that UTF-8 can carry: non-ASCII as it is, unless a lone surrogate (a call's
    arguments parsed from JSON that escaped half a pair) is in it: then escaped, all of it."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    if _SURROGATE.search(text):
        return json.dumps(obj, separators=(",", ":"))
    return text
