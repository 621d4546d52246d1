"""A request's generated text in two sections, reasoning then content, released incrementally.

The thinking parser splits the raw bytes; each section has its own `IncrementalText` (UTF-8
hold-back; stop strings in content only). `settled_bytes` is the raw offset before which every
byte is settled text or a consumed tag. A token is released, its entry and its text together,
once its last byte is settled and its end is not inside a character; text is never cut inside a
token. A token belongs to the section where its first byte falls.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right

from omlx_logprobs.output.detokenizer import IncrementalText, ends_inside_character
from omlx_logprobs.parsing.thinking import Sections, Split, ThinkingParser
from omlx_logprobs.types import ThinkStart

TextDelta = Sections[str]  # text released by one step
NO_TEXT: TextDelta = Sections("", "")


class SectionedText:
    __slots__ = ("parser", "reasoning", "content", "_plain", "_reasoning_done", "_tail", "_split")

    def __init__(
        self,
        stops: tuple[str, ...] = (),
        start: ThinkStart = ThinkStart.OFF,
        include_stop: bool = False,
    ) -> None:
        self.parser = ThinkingParser(start)
        self.reasoning = IncrementalText()
        self.content = IncrementalText(stops, include_stop)
        self._plain = start is ThinkStart.OFF  # the common case: every byte is content
        self._reasoning_done = self._plain
        self._tail = b""  # the last raw bytes fed, enough to tell whether a character is open
        self._split: list[int] = []  # raw offsets not yet taken that fall inside a character

    @property
    def stopped(self) -> bool:
        """A stop string was found (in content: reasoning is never searched for stop strings)."""
        return self.content.stopped

    @property
    def settled_bytes(self) -> int:
        p = self.parser
        if p.content_from is not None:
            return p.content_from + self.content.settled_bytes
        if p.reasoning_from is not None:
            return p.reasoning_from + self.reasoning.settled_bytes
        # Undecided whether the output opens with <think>: not even a token without bytes at
        # offset 0 can be placed in a section yet.
        return -1

    def feed(self, b: bytes) -> None:
        """Add one token's bytes (a token without bytes needs no call)."""
        tail = self._tail + b
        self._tail = tail[-4:]
        if ends_inside_character(self._tail):
            self._split.append(self.parser.fed + len(b))  # this token ends inside a character
        if self._plain:
            self.parser.fed += len(b)
            self.content.feed(b)
        else:
            self._feed_sections(self.parser.feed(b), end=False)

    def release(self, token_ends: array, first: int) -> tuple[int, TextDelta]:
        """Tokens `first..end` whose every byte is settled and whose end is a character boundary,
        and their text: text leaves only at token boundaries, with the token that carries it."""
        end = bisect_right(token_ends, self.settled_bytes, first)
        split = self._split
        while end > first and split and token_ends[end - 1] in split:
            end -= 1
        if end == first:
            return first, NO_TEXT
        upto = token_ends[end - 1]
        while split and split[0] <= upto:
            split.pop(0)
        return end, self._take(upto)

    def flush(self) -> TextDelta:
        """At the end: settle and take everything held (an unfinished character as U+FFFD)."""
        self._feed_sections(self.parser.flush(), end=True)
        self._split.clear()
        return self._take(None)

    def _feed_sections(self, split: Split, end: bool) -> None:
        if split.reasoning:
            self.reasoning.feed(split.reasoning)
        if not self._reasoning_done and (end or self.parser.content_from is not None):
            self.reasoning.flush()  # reasoning is over: a broken character ends here
            self._reasoning_done = True
        if split.content:
            self.content.feed(split.content)
        if end:
            self.content.flush()

    def _take(self, upto: int | None) -> TextDelta:
        """The settled text of both sections before raw offset `upto` (all when None)."""
        p = self.parser
        if self._plain:
            return Sections("", self.content.take(upto))
        r = c = ""
        if p.reasoning_from is not None:
            r = self.reasoning.take(None if upto is None else upto - p.reasoning_from)
        if p.content_from is not None and (upto is None or upto > p.content_from):
            c = self.content.take(None if upto is None else upto - p.content_from)
        return Sections(r, c)

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
