"""Where a JSON value that opens with `{` or `[` ends, found incrementally: brackets are counted
outside strings, so a call's text is scanned once however many pieces it arrives in."""

from __future__ import annotations


class JsonSpan:
    __slots__ = ("start", "pos", "depth", "in_string", "escaped")

    def __init__(self, start: int) -> None:
        self.start = start  # where the value opens (its `{` or `[`)
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def end(self, text: str) -> int | None:
        """The offset just past the value's closing bracket, once text holds it."""
        i, n = self.pos, len(text)
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        while i < n:
            c = text[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self.pos = i
                    return i
        self.pos, self.depth, self.in_string, self.escaped = i, depth, in_string, escaped
        return None
