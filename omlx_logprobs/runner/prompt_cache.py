"""The prefix cache as scored prompts use it: a scored prompt's kept sequence keeps its prompt
entries (prompt_scoring.KeptEntries), and a later scored prompt starts only from a kept start
whose entries answer it, taking them instead of computing them (docs/specs/logprobs.md,
"Prefix caching").

Used by the model runner only; plain prompts use PrefixCache directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.runner.prefix import Key, Prefix
from omlx_logprobs.runner.prefix_cache import PrefixCache
from omlx_logprobs.runner.prompt_scoring import KeptEntries, score_key, waits_for


class PromptCache:
    def __init__(
        self, prefixes: PrefixCache | None, key_of: Callable[[Sequence], Key], keeps: bool
    ) -> None:
        # Entries are kept with finished sequences: where those are not (no cache, or layers
        # other than plain KV), scored prompts are always computed.
        self.prefixes = prefixes if keeps else None
        self.key_of = key_of  # a sequence's key: its adapter's and its namespace (prefix.py)

    def start(self, seq: Sequence, limit: int, look: bool = False) -> Prefix | None:
        """The longest kept start of a scored prompt, at most `limit` tokens, whose entries
        answer it (PrefixCache.scored)."""
        if self.prefixes is None:
            return None
        key = self.key_of(seq)
        return self.prefixes.scored(seq.context_ids, limit, score_key(seq.params), key, look)

    def starts(self, seqs: list[Sequence]) -> list[Prefix | None]:
        """Each whole scored prompt's start; the same object for prompts given the same."""
        if self.prefixes is None:
            return [None] * len(seqs)
        return self.prefixes.assign_scored(
            [s.context_ids for s in seqs],
            [score_key(s.params) for s in seqs],
            [self.key_of(s) for s in seqs],
        )

    def held(self, seq: Sequence) -> int:
        """How many of a whole scored prompt's tokens (and their entries) are kept now."""
        found = self.start(seq, seq.prompt_len - 1, look=True)
        return len(found.tokens) if found is not None else 0

    def keep(self, seq: Sequence, make: Callable[[], Prefix]) -> list[mx.array]:
        """Keep a scored prompt that generates nothing at its prefill, with its entries (one
        that generates is kept when it finishes, runner/keep.py); `make` gives its
        keys and values. The copies, to evaluate with the step."""
        if self.prefixes is None or seq.params.max_tokens > 0:
            return []
        prefix = with_entries(seq, make())
        self.prefixes.keep(self.key_of(seq), prefix)
        return [*prefix.keys, *prefix.values]

    def finished(self, seq: Sequence, prefix: Prefix) -> Prefix:
        """A finished sequence's keys and values, with its prompt's entries where it was
        scored (its output has none)."""
        return with_entries(seq, prefix) if seq.prompt_store is not None else prefix

    def waits(self, seq: Sequence, busy: list[Sequence]) -> bool:
        """The scheduler's `waits` (prompt_scoring.waits_for)."""
        if self.prefixes is None or not seq.scored:
            return False
        return waits_for(seq, busy, lambda: self.held(seq), self.key_of)


def with_entries(seq: Sequence, prefix: Prefix) -> Prefix:
    """A scored prompt's kept sequence (it starts with the prompt) with the prompt's entries."""
    assert seq.prompt_store is not None
    return replace(prefix, scores=KeptEntries(score_key(seq.params), seq.prompt_store))
