"""Draft tokens that cost no model: a client's Predicted Output (`prediction`, tokenized by the
API) and n-grams of a row's own prompt and output (prompt lookup). Plain Python.

Both find the row's last n tokens (n from `MAX_NGRAM` down) in a corpus and propose what
followed them there. A prediction is searched from where its last match left off, so an edited
file's unchanged tail is found again after an insertion or a deletion; the row's own text is
searched for its most recent earlier occurrence. Drafts are only proposals: the target model
verifies every one (runner/speculation.py), so a bad draft costs time, never correctness.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

__all__ = ["MAX_NGRAM", "NgramIndex", "RowDrafts"]

MAX_NGRAM = 4
# A lookup in the row's own text needs this long a match: single tokens (" the") repeat
# everywhere and their continuations are mostly wrong. A prediction is the client's own
# guess at the output, so one token is enough there.
MIN_LOOKUP_NGRAM = 2


class NgramIndex:
    """A growing token list and, for each n-gram (n <= MAX_NGRAM), the positions just after
    its occurrences, in order."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, new: Sequence[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(t)
            end = len(toks)
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self.ends.setdefault(tuple(toks[end - n :]), []).append(end)

    def follow(self, tail: Sequence[int], min_n: int, start: int) -> int:
        """Where a continuation of `tail`'s longest suffix found here (of at least min_n
        tokens) begins: its first occurrence at or after `start`, else its last one before;
        an occurrence with nothing after it does not count. -1: none."""
        size = len(self.tokens)
        for n in range(min(MAX_NGRAM, len(tail)), min_n - 1, -1):
            ends = self.ends.get(tuple(tail[len(tail) - n :]))
            if not ends:
                continue
            usable = bisect_left(ends, size)  # ends[:usable] have tokens after them
            at = bisect_left(ends, start, 0, usable)
            if at < usable:
                return ends[at]
            if usable:
                return ends[usable - 1]
        return -1


class RowDrafts:
    """One decoding row's draft sources: its prediction (if it sent one) and, with prompt
    lookup on, its own prompt and output so far."""

    def __init__(self, prompt: Sequence[int], prediction: Sequence[int], lookup: bool) -> None:
        self.prediction = NgramIndex(prediction) if prediction else None
        self.own = NgramIndex(prompt) if lookup else None
        self.seen = 0  # output tokens added to `own`
        self.cursor = 0  # where in the prediction the last match continued

    def draft(self, prompt: Sequence[int], output: Sequence[int], k: int) -> tuple[list[int], bool]:
        """Up to k tokens to follow `output`, and whether they came from the prediction."""
        if k <= 0:
            return [], False
        tail = _tail(prompt, output)
        if self.prediction is not None:
            at = self.prediction.follow(output[-MAX_NGRAM:], 1, self.cursor)
            if at >= 0:
                self.cursor = at
                return self.prediction.tokens[at : at + k], True
        if self.own is not None:
            self.own.extend(output[self.seen :])
            self.seen = len(output)
            # The most recent earlier occurrence: a start past every one.
            at = self.own.follow(tail, MIN_LOOKUP_NGRAM, len(self.own.tokens))
            if at >= 0:
                return _continued(self.own.tokens, at, k), False
        return [], False

    def promising(self, prompt: Sequence[int], output: Sequence[int]) -> bool:
        """Whether the text so far is where drafts come from: its last tokens continue in the
        prediction, or occurred before in the row's own text. A step in flight is processed
        before the next launch only for such a row (its next drafts follow that step's
        token); elsewhere the steps overlap, and a prediction or lookup that never matches
        costs nothing."""
        if self.prediction is not None:
            if self.prediction.follow(output[-MAX_NGRAM:], 1, self.cursor) >= 0:
                return True
        if self.own is not None:
            self.own.extend(output[self.seen :])
            self.seen = len(output)
            at = self.own.follow(_tail(prompt, output), MIN_LOOKUP_NGRAM, len(self.own.tokens))
            return at >= 0
        return False


def _tail(prompt: Sequence[int], output: Sequence[int]) -> list[int]:
    """The text's last MAX_NGRAM tokens, the prompt's end first where the output is shorter."""
    tail = list(output[-MAX_NGRAM:])
    if len(tail) < MAX_NGRAM:
        tail = list(prompt[len(prompt) - (MAX_NGRAM - len(tail)) :]) + tail
    return tail


def _continued(tokens: list[int], at: int, k: int) -> list[int]:
    """k tokens from `at`; past the end, the span from `at` to the end repeats (a match
    `period` tokens back: the text is looping, and a loop's next tokens are its first ones)."""
    period = len(tokens) - at
    out = tokens[at : at + k]
    while len(out) < k:
        out.append(out[len(out) - period])
    return out
