"""A request's generated text in its sections, reasoning, content and tool calls, released
incrementally.

The thinking parser splits the raw bytes; each section has its own `IncrementalText` (UTF-8
hold-back; stop strings in content only). With a tool-call parser, content's settled text goes
through it (`CallText`): what may still open a call and calls not yet ended are held, calls
leave whole. `settled_bytes` is the raw offset before which every byte is settled text, a
consumed tag or a decided call. A token is released, its entry and its text together, once its
last byte is settled and its end is not inside a character; text is never cut inside a token.
A token belongs to the section where its first byte falls; the tool-call section runs from the
first well-formed call's first byte to the end of the output.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass

from omlx_logprobs.output.detokenizer import IncrementalText, ends_inside_character, visible
from omlx_logprobs.parsing.thinking import Split, ThinkingParser
from omlx_logprobs.parsing.tools import Kind, Piece, ToolCallParser
from omlx_logprobs.types import THINK_TAGS, ThinkStart, ToolCall


@dataclass(frozen=True)
class TextDelta:
    """Text released by one step: reasoning, content, and the tool calls it completed."""

    reasoning: str
    content: str
    calls: tuple[ToolCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


NO_TEXT = TextDelta("", "")


class CallText:
    """Content through a tool-call parser: content's settled text is parsed into pieces (text,
    calls, framing), each placed at its byte offsets in the content section, and taken up to a
    token's end like text. Takes the place of content's `IncrementalText`."""

    __slots__ = ("text", "parser", "_pieces", "settled_bytes", "tool_from", "calls")

    def __init__(
        self, stops: tuple[str, ...], parser: ToolCallParser, include_stop: bool = False
    ) -> None:
        self.text = IncrementalText(stops, include_stop)  # UTF-8, stop strings, then the parser
        self.parser = parser
        self._pieces: deque[tuple[int, int, Piece]] = deque()  # (start, end, piece), not taken
        self.settled_bytes = 0  # content bytes the parser has decided
        # content offset of the first well-formed call; a forced call's output is all calls
        self.tool_from: int | None = 0 if parser.forced else None
        self.calls = 0

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def feed(self, b: bytes) -> None:
        self.text.feed(b)
        self._place(self.parser.feed(self.text.take_escaped()))

    def flush(self) -> None:
        self.text.flush()
        self._place(self.parser.feed(self.text.take_escaped()) + self.parser.flush())

    def _place(self, pieces: list[Piece]) -> None:
        for p in pieces:
            start = self.settled_bytes
            self.settled_bytes += len(p.text.encode("utf-8", "surrogateescape"))
            if p.kind is Kind.CALL:
                self.calls += len(p.calls)
                if self.tool_from is None:
                    self.tool_from = start
            self._pieces.append((start, self.settled_bytes, p))

    def call_around(self, at: int) -> int | None:
        """The start of the call not yet taken whose text runs past content offset `at`, if
        `at` falls inside it."""
        for start, end, p in self._pieces:
            if start >= at:
                return None
            if p.kind is Kind.CALL and at < end:
                return start
        return None

    def take(self, upto: int | None = None) -> tuple[str, tuple[ToolCall, ...]]:
        """Content text and calls before content byte `upto` (all when None). A call leaves
        whole, with the token that ends it."""
        text: list[str] = []
        calls: list[ToolCall] = []
        pieces = self._pieces
        while pieces and (upto is None or pieces[0][0] < upto):
            start, end, p = pieces[0]
            if upto is None or end <= upto:
                pieces.popleft()
                if p.kind is Kind.CONTENT:
                    text.append(p.text)
                elif p.kind is Kind.CALL:
                    calls += p.calls
                continue
            if p.kind is Kind.CALL:
                break  # its token has not ended
            raw = p.text.encode("utf-8", "surrogateescape")
            cut = raw[: upto - start].decode("utf-8", "surrogateescape")
            rest = raw[upto - start :].decode("utf-8", "surrogateescape")
            if p.kind is Kind.CONTENT:
                text.append(cut)
            pieces[0] = (upto, end, Piece(p.kind, rest))
            break
        return visible("".join(text)), tuple(calls)


class SectionedText:
    __slots__ = (
        "parser",
        "reasoning",
        "content",
        "_plain",
        "_reasoning_done",
        "_tail",
        "_split",
        "_single",
    )

    def __init__(
        self,
        stops: tuple[str, ...] = (),
        start: ThinkStart = ThinkStart.OFF,
        tools: ToolCallParser | None = None,
        single_call: bool = False,
        tags: tuple[str, str] = THINK_TAGS,
        include_stop: bool = False,
    ) -> None:
        self.parser = ThinkingParser(start, tags)
        self.reasoning = IncrementalText()
        self.content: IncrementalText | CallText = (
            IncrementalText(stops, include_stop)
            if tools is None
            else CallText(stops, tools, include_stop)
        )
        self._single = single_call  # parallel_tool_calls false: the first call ends the output
        self._plain = start is ThinkStart.OFF  # the common case: every byte is content
        self._reasoning_done = self._plain
        self._tail = b""  # the last raw bytes fed, enough to tell whether a character is open
        self._split: list[int] = []  # raw offsets not yet taken that fall inside a character

    @property
    def stopped(self) -> bool:
        """A stop string was found (in content: reasoning is never searched for stop strings),
        or the one call a request allows is complete."""
        c = self.content
        return c.stopped or (self._single and isinstance(c, CallText) and c.calls > 0)

    def arm_stops(self, armed: bool) -> None:
        """Whether content is searched for stop strings (min_tokens: not yet)."""
        c = self.content
        (c if isinstance(c, IncrementalText) else c.text).armed = armed

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
        c, start = self.content, self.parser.content_from
        while end > first:
            last = token_ends[end - 1]
            if split and last in split:  # ends inside a character
                end -= 1
            elif (
                isinstance(c, CallText)
                and start is not None
                and (inside := c.call_around(last - start)) is not None
            ):
                # A call leaves with the token that ends it: tokens ending inside it wait for
                # that one (which may itself end inside the next call).
                end = bisect_right(token_ends, start + inside, first, end)
            else:
                break
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
        """The settled text of every section before raw offset `upto` (all when None)."""
        p = self.parser
        r = c = ""
        calls: tuple[ToolCall, ...] = ()
        if not self._plain and p.reasoning_from is not None:
            r = self.reasoning.take(None if upto is None else upto - p.reasoning_from)
        if p.content_from is not None and (upto is None or upto > p.content_from):
            at = None if upto is None else upto - p.content_from
            if isinstance(self.content, CallText):
                c, calls = self.content.take(at)
            else:
                c = self.content.take(at)
        return TextDelta(r, c, calls)

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

    def tool_start(self, token_ends: array) -> int | None:
        """The index of the first tool-call token (the first whose first byte is at or after
        the first well-formed call's), or None while no call has been found."""
        c, start = self.content, self.parser.content_from
        if not isinstance(c, CallText) or c.tool_from is None or start is None:
            return None
        at = start + c.tool_from
        n = len(token_ends)
        if at == 0 or n == 0:
            return 0
        return 1 + bisect_left(token_ends, at, 0, n - 1)
