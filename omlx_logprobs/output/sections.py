"""A request's generated text in two sections, reasoning then content, released incrementally.

The thinking parser splits the raw bytes; each section has its own `IncrementalText` (UTF-8
hold-back; stop strings in content only). `settled_bytes` is the raw offset before which every
byte is released text or a consumed tag: a token's entry is released once its last byte is settled.
A token belongs to the section where its first byte falls.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass

from omlx_logprobs.output.detokenizer import IncrementalText
from omlx_logprobs.parsing.thinking import Split, ThinkingParser, ThinkStart


@dataclass(frozen=True)
class TextDelta:
    """Text released by one step: reasoning first, then content."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, later: TextDelta) -> TextDelta:
        return TextDelta(self.reasoning + later.reasoning, self.content + later.content)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class SectionedText:
    __slots__ = ("parser", "reasoning", "content", "_plain", "_reasoning_done")

    def __init__(self, stops: tuple[str, ...] = (), start: ThinkStart = ThinkStart.OFF) -> None:
        self.parser = ThinkingParser(start)
        self.reasoning = IncrementalText()
        self.content = IncrementalText(stops)
        self._plain = start is ThinkStart.OFF  # the common case: every byte is content
        self._reasoning_done = self._plain

    @property
    def stopped(self) -> bool:
        """A stop string was found (in content: reasoning is never searched for stop strings)."""
        return self.content.stopped

    @property
    def settled_bytes(self) -> int:
        p = self.parser
        if p.content_from is not None:
            return p.content_from + self.content.released_bytes
        if p.reasoning_from is not None:
            return p.reasoning_from + self.reasoning.released_bytes
        # Undecided whether the output opens with <think>: not even a token without bytes at
        # offset 0 can be placed in a section yet.
        return -1

    def feed(self, b: bytes) -> TextDelta:
        if self._plain:
            self.parser.fed += len(b)
            return TextDelta(content=self.content.feed(b))
        return self._take(self.parser.feed(b), end=False)

    def flush(self) -> TextDelta:
        """At the end: release everything held (an unfinished character as U+FFFD)."""
        return self._take(self.parser.flush(), end=True)

    def _take(self, split: Split, end: bool) -> TextDelta:
        r = self.reasoning.feed(split.reasoning) if split.reasoning else ""
        if not self._reasoning_done and (end or self.parser.content_from is not None):
            r += self.reasoning.flush()  # reasoning is over: a broken character ends here
            self._reasoning_done = True
        c = self.content.feed(split.content) if split.content else ""
        if end:
            c += self.content.flush()
        return TextDelta(r, c)

    def reasoning_tokens(self, token_ends: array) -> int:
        """How many of the tokens so far are reasoning (their first byte lies before content)."""
        n = len(token_ends)
        start = self.parser.content_from
        if start is None:
            return n
        if start == 0 or n == 0:
            return 0
        # token i > 0 starts at token_ends[i - 1]; token 0 starts at 0 < start
        return 1 + bisect_left(token_ends, start, 0, n - 1)
