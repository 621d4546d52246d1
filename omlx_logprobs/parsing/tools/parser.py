"""The incremental frame every tool-call format shares: content text in, pieces out.

Content text is scanned for the start of a call. Text that cannot be (part of) a call's start
leaves at once as content; a tail that may still become one is held back. From a call's start,
its text is held until the format says where the call ends; then it is decoded: a well-formed
call leaves as a call, a malformed one as content. After the first well-formed call, whitespace
(and a format's separators) between and after calls is framing, like the tags: it leaves as
neither content nor call. At the end, an unclosed call is a call if the format can still decode
it (a stop string or the end-of-turn token cut its closing tag), else content.

Every character fed leaves in exactly one piece, in order, so the consumer can place each
piece at its byte offsets and tell which tokens it came from.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

from omlx_logprobs.types import ToolCall


class Kind(Enum):
    CONTENT = "content"
    CALL = "call"  # the text of well-formed calls (tags included)
    FRAMING = "framing"  # separators between and after calls: neither content nor call


class Piece(NamedTuple):  # a tuple: one is made for nearly every token
    kind: Kind
    text: str  # the content text it covers, exactly as fed
    calls: tuple[ToolCall, ...] = ()


class _State(Enum):
    LEAD = "lead"  # nothing but whitespace yet (formats whose calls open the output)
    SCAN = "scan"  # in content: looking for a call's start
    CALL = "call"  # inside a call that has not ended
    AFTER = "after"  # after a well-formed call: separators, then another call or content


class ToolCallParser:
    """A format's parser. Subclasses name the strings that open a call (`starts`), whether a
    call may open anywhere in content or only the output (`anywhere`), and say where a call
    ends (`call_end`) and what it holds (`decode`)."""

    starts: tuple[str, ...] = ()
    anywhere = True  # False: a call opens the output (whitespace aside) or follows a call
    separators = " \t\r\n"  # framing between calls

    def __init__(self, tools: tuple[dict[str, Any], ...] = ()) -> None:
        self.tools = tools
        # A forced call (tool_choice required or named): the grammar made every token call
        # text, so what is left unsettled at the end (a call cut by max_tokens) is framing.
        self.forced = False
        # Text without any start's first character can neither hold nor begin a start.
        self._firsts = {s[0] for s in self.starts}
        self._buf = ""  # text fed and not yet settled
        self._state = _State.SCAN if self.anywhere else _State.LEAD
        self.calls = 0  # well-formed calls so far
        self._scanned = 0  # how far into a call's text `call_end` has looked

    # ---- a format's part ------------------------------------------------------------------
    def call_end(self, buf: str) -> int | None:
        """buf starts with one of `starts`: the length of the call's text once known."""
        raise NotImplementedError

    def decode(self, raw: str, closed: bool) -> list[ToolCall] | None:
        """The calls in a call's text, or None when it is malformed. `closed`: call_end found
        its end (else the output ended inside it)."""
        raise NotImplementedError

    # ---- the frame --------------------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        if (
            self._state is _State.SCAN
            and not self._buf
            and self.anywhere
            and not any(c in text for c in self._firsts)
        ):
            return [Piece(Kind.CONTENT, text)] if text else []  # the common case: plain text
        self._buf += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def flush(self) -> list[Piece]:
        """At the end: what is held is settled (an unclosed call decoded if it can be); for a
        forced call, text that is not a call is framing, never content."""
        out = self._flush()
        if self.forced:
            out = [Piece(Kind.FRAMING, p.text) if p.kind is Kind.CONTENT else p for p in out]
        return out

    def _flush(self) -> list[Piece]:
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        if not buf:
            return out
        if self._state is _State.CALL:
            calls = self.decode(buf, closed=False)
            if calls:
                self.calls += len(calls)
                out.append(Piece(Kind.CALL, buf, tuple(calls)))
            else:
                out.append(Piece(Kind.CONTENT, buf))
        elif self._state is _State.AFTER and not buf.strip(self.separators):
            out.append(Piece(Kind.FRAMING, buf))
        else:
            out.append(Piece(Kind.CONTENT, buf))
        return out

    def _step(self, out: list[Piece]) -> bool:
        """One move of the state machine; False when it must wait for more text."""
        buf = self._buf
        if not buf:
            return False
        state = self._state
        if state is _State.CALL:
            end = self.call_end(buf)
            if end is None:
                return False
            raw, self._buf = buf[:end], buf[end:]
            calls = self.decode(raw, closed=True)
            if calls:
                self.calls += len(calls)
                out.append(Piece(Kind.CALL, raw, tuple(calls)))
            else:
                out.append(Piece(Kind.CONTENT, raw))
            self._state = _State.AFTER if self.calls else self._scan_state()
            return True
        if state in (_State.LEAD, _State.AFTER):
            seps = self.separators if state is _State.AFTER else " \t\r\n"
            i = len(buf) - len(buf.lstrip(seps))
            if i == len(buf):
                return False  # only separators so far: wait for what follows
            opens = self._opens(buf[i:])
            if opens is None:
                return False
            if opens:
                if i:
                    kind = Kind.FRAMING if state is _State.AFTER else Kind.CONTENT
                    out.append(Piece(kind, buf[:i]))
                self._enter_call(buf[i:])
                return True
            self._state = _State.SCAN
            if not self.anywhere:  # content: no call can open from here on
                out.append(Piece(Kind.CONTENT, buf))
                self._buf = ""
                return False
            return True
        # SCAN
        if not self.anywhere:
            out.append(Piece(Kind.CONTENT, buf))
            self._buf = ""
            return False
        at = min((p for p in (buf.find(s) for s in self.starts) if p >= 0), default=-1)
        if at >= 0:
            if at:
                out.append(Piece(Kind.CONTENT, buf[:at]))
            self._enter_call(buf[at:])
            return True
        keep = max(_partial_suffix(buf, s) for s in self.starts)
        if keep < len(buf):
            out.append(Piece(Kind.CONTENT, buf[: len(buf) - keep]))
            self._buf = buf[len(buf) - keep :]
        return False

    def _scan_state(self) -> _State:
        return _State.SCAN if self.anywhere else _State.LEAD

    def _enter_call(self, buf: str) -> None:
        self._buf = buf
        self._state = _State.CALL
        self._scanned = 0
        self.begin_call()

    def begin_call(self) -> None:
        """A call's text starts: formats that scan incrementally reset here."""

    def _opens(self, text: str) -> bool | None:
        """Whether text starts with a call's start; None: it may still (a proper prefix)."""
        if any(text.startswith(s) for s in self.starts):
            return True
        if any(s.startswith(text) for s in self.starts):
            return None
        return False


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
