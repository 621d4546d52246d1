"""A batch's `usage` (OpenAI's BatchUsage): the tokens of its lines' responses summed, read from
whichever shape each body's `usage` has (chat and completions' prompt/completion tokens, the
Responses API's input/output tokens)."""

from __future__ import annotations

from typing import Any

Tokens = tuple[int, int, int, int]  # input, of which cached, output, of which reasoning
NONE: Tokens = (0, 0, 0, 0)


def tokens(body: Any) -> Tokens:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return NONE
    details_in = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
    details_out = usage.get("output_tokens_details") or usage.get("completion_tokens_details") or {}
    return (
        count(usage.get("input_tokens", usage.get("prompt_tokens"))),
        count(details_in.get("cached_tokens")),
        count(usage.get("output_tokens", usage.get("completion_tokens"))),
        count(details_out.get("reasoning_tokens")),
    )


def count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def batch_usage(total: Tokens) -> dict[str, Any]:
    given, cached, made, reasoning = total
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": made,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": given + made,
    }
