"""The reasoning and content fields of a chat message and of a streamed delta.

With the thinking parser off, a message is `{"content"}` as before. With it on, reasoning goes in
`reasoning_content` (null when there is none) and the answer in `content`; a streamed delta holds
whichever of the two its output carries text or entries for (both when one output spans the end
of reasoning).
"""

from __future__ import annotations

from typing import Any

from omlx_logprobs.types import RequestOutput, ThinkStart


def message(out: RequestOutput, think: ThinkStart) -> dict[str, Any]:
    if think is ThinkStart.OFF:
        return {"content": out.text}
    return {"content": out.text, "reasoning_content": out.reasoning_text or None}


def delta(out: RequestOutput, think: ThinkStart) -> dict[str, Any]:
    if think is ThinkStart.OFF:
        return {"content": out.text}
    d: dict[str, Any] = {}
    if out.reasoning_text or out.num_reasoning:
        d["reasoning_content"] = out.reasoning_text
    if out.text or out.num_tokens > out.num_reasoning or not d:
        d["content"] = out.text
    return d
