"""A draft model for speculative decoding (`--draft-model`): it must spell every token id the
way the served model does, or its drafts would name other tokens. Checked at start-up."""

from __future__ import annotations

from omlx_logprobs.vocab import Vocabulary

__all__ = ["draft_refusal", "vocabulary_mismatch"]


def draft_refusal(target: str | None, draft: str) -> str | None:
    """Why `draft` cannot draft for `target` (model sources as --model takes them), read from
    their tokenizers alone; None: it can."""
    from omlx_logprobs.models.loader import load_model

    t, d = load_model(target, weights=False), load_model(draft, weights=False)
    return vocabulary_mismatch(t.vocab, d.vocab, len(d.tokenizer))


def vocabulary_mismatch(target: Vocabulary, draft: Vocabulary, tokenizer_size: int) -> str | None:
    """Why the draft's vocabulary cannot serve the target's (None: it can): every id of the
    tokenizer (`tokenizer_size` of them; embeddings may be padded past it) must be the same
    token in both."""
    n = min(len(target), len(draft))
    if n < tokenizer_size:
        return (
            f"the draft model has {len(draft)} token ids, the served model's tokenizer"
            f" {tokenizer_size}"
        )
    for i in range(tokenizer_size):
        if (target.token_bytes[i], target.token_text[i]) != (
            draft.token_bytes[i],
            draft.token_text[i],
        ):
            return (
                f"token id {i} is {target.token_text[i]!r} for the served model but"
                f" {draft.token_text[i]!r} for the draft model: a draft model must share the"
                " served model's tokenizer"
            )
    return None
