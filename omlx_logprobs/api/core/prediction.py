"""OpenAI's Predicted Outputs: `prediction: {"type": "content", "content": str | [{"type":
"text", "text": str}]}` on chat completions, the text the client expects the answer to be
(mostly), tokenized once here. The engine drafts from it (runner/speculation.py): it changes
how fast the answer comes, never what it is."""

from __future__ import annotations

from typing import Any

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.prompts import encode
from omlx_logprobs.models.loader import LoadedModel

__all__ = ["prediction_ids"]


def _text(prediction: Any) -> str:
    """The prediction's text; a 400 for any other shape."""
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise APIError(
            'prediction must be {"type": "content", "content": ...}', param="prediction.type"
        )
    if set(prediction) - {"type", "content"}:
        extra = sorted(set(prediction) - {"type", "content"})[0]
        raise APIError(f"Unknown field in prediction: {extra}", param=f"prediction.{extra}")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for i, part in enumerate(content):
            ok = (
                isinstance(part, dict)
                and part.get("type") == "text"
                and set(part)
                <= {
                    "type",
                    "text",
                }
            )
            if not ok or not isinstance(part.get("text"), str):
                raise APIError(
                    'each part of prediction.content must be {"type": "text", "text": str}',
                    param=f"prediction.content[{i}]",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(
        "prediction.content must be a string or a non-empty list of text parts",
        param="prediction.content",
    )


def prediction_ids(prediction: Any, model: LoadedModel) -> tuple[int, ...]:
    """The prediction's token ids (none when the request sent no prediction)."""
    if prediction is None:
        return ()
    return tuple(encode(model, _text(prediction), "prediction.content"))
