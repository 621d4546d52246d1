"""A conversation's prompt with its earlier answers as the ids that were sampled, not the ids of
their text.

The model answered turn i after the prompt the template renders of the messages before it (with
the generation prompt): `head`. If the whole conversation's text begins with that head, and the
text after it begins with the sampled ids' text (all of them, or all but a last end token the
template does not write), the ids are those: the head's ids, the sampled ids, then the template's
own text after them. So the next request's prompt begins with exactly the ids of the earlier
request's prompt and of its output, which the prefix cache holds, and an RL trajectory through
any chat client stays what the model sampled. Anything else (an edited answer, a template that
renders earlier turns otherwise) is tokenized from its text as before.

Each piece of text between spliced answers is encoded on its own; that equals the tokenizer's ids
of it in place only where the text is cut at an added token (a tokenizer splits its input there
first: models/segments.py), so an answer is spliced only where an added token ends it or follows
it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    """An earlier answer: its message's index and the ids sampled for it."""

    index: int
    ids: Sequence[int]


@dataclass(frozen=True)
class Spliced:
    """A prompt's ids and the spans [start, end) of them that are earlier answers' sampled ids."""

    ids: list[int]
    spans: tuple[tuple[int, int], ...]

    def reused(self, dropped: int = 0) -> int:
        """Sampled ids among the prompt's, its first `dropped` cut off (truncation)."""
        return sum(max(0, end - max(start, dropped)) for start, end in self.spans)


@dataclass(frozen=True)
class Tokenizer:
    """What splicing needs of a tokenizer: text to ids, ids to text (special tokens written;
    None where the tokenizer cannot say), the added tokens' ids, and where an added token's
    text starts at a position (or not)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str | None]
    added: frozenset[int]
    added_at: Callable[[str, int], bool]


def splice(
    text: str, turns: Sequence[Turn], head: Callable[[int], str | None], tok: Tokenizer
) -> Spliced:
    """`text`'s ids with each turn's sampled ids in place where they fit (module docstring);
    `head(i)`: the prompt text the model answered message i after (None: the template cannot
    render it)."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    cursor = 0
    for turn in turns:
        prefix = head(turn.index)
        if prefix is None or len(prefix) < cursor or not text.startswith(prefix):
            continue
        start = len(prefix)
        fit = _fit(text, start, turn.ids, tok)
        if fit is None:
            continue
        kept, end = fit
        ids += tok.encode(text[cursor:start])
        spans.append((len(ids), len(ids) + len(kept)))
        ids += kept
        cursor = end
    ids += tok.encode(text[cursor:])
    return Spliced(ids, tuple(spans))


def _fit(
    text: str, start: int, sampled: Sequence[int], tok: Tokenizer
) -> tuple[list[int], int] | None:
    """The sampled ids whose text `text` holds at `start` (all, or all but a last added token,
    an end of turn the template writes otherwise), and where that text ends; None if neither."""
    cuts = [len(sampled)]
    if sampled and sampled[-1] in tok.added:
        cuts.append(len(sampled) - 1)
    for cut in cuts:
        kept = list(sampled[:cut])
        if not kept:
            continue
        said = tok.decode(kept)
        if said is None or not text.startswith(said, start):
            continue
        end = start + len(said)
        if end == len(text) or kept[-1] in tok.added or tok.added_at(text, end):
            return kept, end
    return None
