"""Chat templates that read a message's content only as a list of parts (the hub's Idefics3,
SmolVLM and LLaVA templates: `message['content'][0]['type']`, `selectattr('type', ...)`): a
string content renders there without its text (a system prompt, a text turn, an earlier
answer), so such a template is given every string content as one text part, as vLLM's
`--chat-template-content-format openai` does. Which templates those are is found by rendering
a probe, once per template."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["as_parts"]

_PROBE = "omlx-content-probe"


def as_parts(messages: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """`messages` as the tokenizer's chat template reads them: unchanged, or with each string
    content as one text part where the template reads parts only."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None or not _parts_only(str(template), tokenizer):
        return messages
    return [
        {**m, "content": [{"type": "text", "text": m["content"]}]}
        if isinstance(m.get("content"), str)
        else m
        for m in messages
    ]


@lru_cache(maxsize=16)
def _parts_only(template: str, tokenizer: Any) -> bool:
    """Whether a probe's text is lost when it is a string and kept when it is a text part (a
    template that renders neither: unchanged, the request finds out)."""

    def keeps(content: Any) -> bool:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False
            )
        except Exception:
            return False
        return _PROBE in str(text)

    return not keeps(_PROBE) and keeps([{"type": "text", "text": _PROBE}])
