"""gpt-oss's harmony format: the output is messages, each a header and a body,
`<|start|>assistant<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>json]<|message|>BODY<|end|>`.
The first analysis message is reasoning (the thinking parser takes it with harmony's tags);
this parser reads what follows. A message to `functions.NAME` is a call (its body the JSON
arguments, ended by `<|call|>`); the body of any other message (the final answer, a commentary
preamble) is content; headers and end markers are framing, like tags."""

from __future__ import annotations

import json
import re
from typing import Any

from omlx_logprobs.parsing.tools.parser import Kind, Piece, ToolCallParser, _partial_suffix
from omlx_logprobs.types import ToolCall

_HEADS = ("<|start|>", "<|channel|>")
_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_MESSAGE = "<|message|>"
_CALL = "<|call|>"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_FUNCTIONS = "functions."


class Harmony(ToolCallParser):
    starts = _HEADS

    def __init__(self, tools: tuple[dict[str, Any], ...] = (), calls: bool = True) -> None:
        super().__init__(tools)
        self._allowed = calls  # false (tool_choice none, no tools): a call is content
        self._mode = "head"  # "head": a message starts; "body"; "call": a call's body
        self._args_from = 0

    def _step(self, out: list[Piece]) -> bool:
        buf = self._buf
        if not buf:
            return False
        if self._mode == "head":
            opens = self._opens(buf)
            if opens is None:
                return False
            if not opens:  # text without a header: content
                self._mode = "body"
                return True
            at = buf.find(_MESSAGE)
            if at < 0:
                return False
            header = buf[: at + len(_MESSAGE)]
            m = _RECIPIENT.search(header)
            if m and m.group(1).startswith(_FUNCTIONS):
                self._mode = "call"
                self._args_from = self._scanned = len(header)
                return True
            out.append(Piece(Kind.FRAMING, header))
            self._buf = buf[len(header) :]
            self._mode = "body"
            return True
        if self._mode == "body":
            markers = _ENDS + _HEADS
            at = min((p for p in (buf.find(s) for s in markers) if p >= 0), default=-1)
            if at < 0:
                keep = max(_partial_suffix(buf, s) for s in markers)
                if keep < len(buf):
                    out.append(Piece(Kind.CONTENT, buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep :]
                return False
            if at:
                out.append(Piece(Kind.CONTENT, buf[:at]))
            rest = buf[at:]
            end = next((m for m in _ENDS if rest.startswith(m)), None)
            if end is not None:
                out.append(Piece(Kind.FRAMING, end))
                rest = rest[len(end) :]
            self._buf = rest
            self._mode = "head"
            return True
        at = buf.find(_CALL, self._scanned)
        if at < 0:
            self._scanned = max(len(buf) - len(_CALL) + 1, self._args_from)
            return False
        raw, self._buf = buf[: at + len(_CALL)], buf[at + len(_CALL) :]
        self._emit_call(raw, raw[self._args_from : at], out)
        self._mode = "head"
        return True

    def _flush(self) -> list[Piece]:
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        if buf and self._mode == "call":  # the output ended before <|call|>
            self._emit_call(buf, buf[self._args_from :], out)
        elif buf:  # an unfinished header or a marker's first characters: text as written
            out.append(Piece(Kind.CONTENT, buf))
        return out

    def _emit_call(self, raw: str, args: str, out: list[Piece]) -> None:
        call = self._decode(raw, args)
        if call is None:
            out.append(Piece(Kind.CONTENT, raw))
        else:
            self.calls += 1
            out.append(Piece(Kind.CALL, raw, (call,)))

    def _decode(self, raw: str, args: str) -> ToolCall | None:
        if not self._allowed:
            return None
        m = _RECIPIENT.search(raw[: self._args_from])
        name = m.group(1)[len(_FUNCTIONS) :] if m else ""
        try:
            value = json.loads(args.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
        except ValueError:
            return None
        if not name or not isinstance(value, dict):
            return None
        return ToolCall(name, json.dumps(value, ensure_ascii=False))
