"""Incremental release of generated text.

Text is the concatenation of the generated tokens' own UTF-8 bytes, so every released character
can be traced to the tokens that carry it. Bytes of an unfinished character, and a tail that may
be the start of a stop string, are held back until they are settled; settled text is taken up to
a byte offset, so the caller decides where it is cut (at token boundaries).
"""

from __future__ import annotations


def _longest_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        # Only suffixes starting at an occurrence of s[0] can match: str.find skips the rest, so
        # a long held tail costs a scan, not a comparison per length.
        i = text.find(s[0], max(len(text) - len(s) + 1, 0))
        while i >= 0 and len(text) - i > best:
            if s.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(s[0], i + 1)
    return best


class IncrementalText:
    """Turns a section's bytes into text; finds stop strings across token boundaries.

    Text is settled once no later byte can change it (a whole character, not the start of a stop
    string); settled text waits in `_ready` until the caller takes it up to a byte offset (the
    end of a token), so text leaves with the token that carries it.
    """

    __slots__ = (
        "stops", "include_stop", "armed", "_pending", "_held", "_ready", "settled_bytes",
        "taken_bytes", "stopped",
    )  # fmt: skip

    def __init__(self, stops: tuple[str, ...] = (), include_stop: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop  # the matched stop string stays in the text
        # Stop strings are only looked for while armed (vLLM's min_tokens: not before the
        # output has more tokens than that); a match may still begin in earlier held text.
        self.armed = True
        self._pending = b""  # bytes of a character not yet complete
        self._held = ""  # decoded text that may still begin a stop string
        self._ready = ""  # settled text not yet taken
        self.settled_bytes = 0  # bytes of the section settled (taken or ready)
        self.taken_bytes = 0
        self.stopped = False

    def feed(self, b: bytes) -> None:
        """Add bytes; settle what no later byte can change."""
        if self.stopped:
            return
        data = self._pending + b
        cut = _complete_utf8_prefix(data)
        self._pending = data[cut:]
        # surrogateescape keeps invalid bytes countable; they become U+FFFD when taken.
        text = data[:cut].decode("utf-8", errors="surrogateescape")
        if not self.stops:
            self._ready += text
            self.settled_bytes += cut
            return
        self._held += text
        hits = [(p, s) for s in self.stops if (p := self._held.find(s)) >= 0] if self.armed else []
        if hits:
            hit, stop = min(hits, key=lambda h: h[0])  # the earliest; at a tie the first listed
            self.stopped = True
            self._settle(hit + (len(stop) if self.include_stop else 0))
            self._held = ""  # what follows the stop string (and it, unless kept) is not text
        else:
            self._settle(len(self._held) - _longest_stop_prefix(self._held, self.stops))

    def flush(self) -> None:
        """At the end: settle everything held (an unfinished character as U+FFFD)."""
        if self.stopped:
            return
        self._held += self._pending.decode("utf-8", errors="surrogateescape")
        self._pending = b""
        self._settle(len(self._held))

    def take(self, upto: int | None = None) -> str:
        """The settled text before section byte `upto` (all settled text when None or beyond)."""
        if upto is None or upto >= self.settled_bytes:
            out, self._ready = self._ready, ""
            self.taken_bytes = self.settled_bytes
        else:
            raw = self._ready.encode("utf-8", errors="surrogateescape")
            k = max(upto - self.taken_bytes, 0)
            out = raw[:k].decode("utf-8", errors="surrogateescape")
            self._ready = raw[k:].decode("utf-8", errors="surrogateescape")
            self.taken_bytes += k
        return visible(out)

    def take_escaped(self) -> str:
        """All settled text not yet taken, invalid bytes still as surrogate escapes (for a stage
        downstream that counts bytes; `visible` makes it text)."""
        out, self._ready = self._ready, ""
        self.taken_bytes = self.settled_bytes
        return out

    def _settle(self, n: int) -> None:
        text, self._held = self._held[:n], self._held[n:]
        self._ready += text
        self.settled_bytes += len(text.encode("utf-8", errors="surrogateescape"))


def visible(text: str) -> str:
    """Text with the surrogate escapes of invalid bytes as U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
    return text


def ends_inside_character(data: bytes) -> bool:
    """Whether data (at least its last 4 bytes) ends with an unfinished UTF-8 character."""
    return _complete_utf8_prefix(data) < len(data)


def _complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of data that does not end inside a UTF-8 character."""
    n = len(data)
    i = n - 1
    while i >= 0 and n - i <= 4 and data[i] & 0xC0 == 0x80:  # step back over continuation bytes
        i -= 1
    if i < 0 or n - i > 4 or data[i] < 0x80:
        return n  # complete, or invalid (decoding marks it)
    lead = data[i]
    need = (
        2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    )
    return n if n - i >= need else i
