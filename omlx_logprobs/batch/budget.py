"""A thinking budget (vLLM's `thinking_token_budget`): once a choice has written that many
reasoning tokens without closing its reasoning, its next tokens are the model's own closing tag
(`SamplingParams.thinking_end_ids`), forced instead of sampled, and the answer follows.

Reasoning tokens are counted from the first token after the opening tag (the first output token
when the prompt opened it), as vLLM counts them; the closing tag is the reasoning parser's, so a
choice that closes its reasoning itself, or whose output opens with content, is never forced.
Pure Python over a sequence's processed state: the runner asks `forced_token` for the token to
force at a launch, the output processor asks it which processed token was forced.
"""

from __future__ import annotations

from bisect import bisect_right

from omlx_logprobs.batch.sequence import Sequence

__all__ = ["budget_due", "budgeted", "forced_token", "note_reasoning_start"]


def budgeted(seq: Sequence) -> bool:
    """Whether a budget may still force this choice's tokens (its reasoning is not over): the
    speculator gives such a row no drafts, so no draft runs past a forced token."""
    p = seq.params
    return p.thinking_token_budget is not None and seq.text.parser.content_from is None


def forced_token(seq: Sequence, index: int) -> int | None:
    """The id output token `index` is forced to, or None where it is sampled; read with the
    tokens before `index` processed (the engine processes them first: `budget_due`)."""
    p = seq.params
    if not budgeted(seq) or seq.think_from is None:
        return None  # no budget, reasoning over (or never begun), or not opened yet
    assert p.thinking_token_budget is not None
    k = index - seq.think_from - p.thinking_token_budget
    return p.thinking_end_ids[k] if 0 <= k < len(p.thinking_end_ids) else None


def budget_due(seq: Sequence) -> bool:
    """Whether the next token's decision needs every token sampled so far processed: the budget
    is reached at it, or where reasoning starts is not known yet. Elsewhere `forced_token` is
    None for the next token whatever the token in flight is, and the steps overlap."""
    p = seq.params
    if not budgeted(seq):
        return False
    if seq.think_from is None:
        return True
    assert p.thinking_token_budget is not None
    return seq.num_sampled >= seq.think_from + p.thinking_token_budget


def note_reasoning_start(seq: Sequence) -> None:
    """After a token is processed: where its reasoning starts, in tokens, once the parser has
    read the opening tag (the first token after the tag's last byte)."""
    if seq.think_from is not None or seq.params.thinking_token_budget is None:
        return
    at = seq.text.parser.reasoning_from
    if at is not None:
        seq.think_from = bisect_right(seq.token_ends, at)
