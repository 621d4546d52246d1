"""Token text from the vocabulary, and incremental release of generated text.

Text is the concatenation of the generated tokens' own UTF-8 bytes, so every released character
can be traced to the tokens that carry it. Bytes of an unfinished character, and a tail that may
be the start of a stop string, are held back until they are settled; settled text is taken up to
a byte offset, so the caller decides where it is cut (at token boundaries).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from omlx_logprobs.parsing.thinking import THINK_TAGS

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: each printable stand-in char to its byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass(frozen=True)
class Vocabulary:
    """Per token id: its UTF-8 bytes (None for special tokens other than the think tags, which
    are text) and the string shown as `token`."""

    token_bytes: tuple[bytes | None, ...]
    token_text: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.token_bytes)


def token_display(b: bytes | None, special_text: str) -> str:
    """A token's `token` string: its text; for a partial UTF-8 character, OpenAI's `bytes:\\x..`."""
    if b is None:
        return special_text
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def _decoder_kind(hf_tokenizer: Any) -> str:
    try:
        spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    except Exception:  # a slow tokenizer: no tokenizer.json
        return "decode"
    text = json.dumps(spec.get("decoder") or {})
    if '"ByteLevel"' in text:
        return "bytelevel"
    if "\u2581" in text or '"ByteFallback"' in text:
        return "sentencepiece"
    return "decode"


def build_vocabulary(hf_tokenizer: Any, size: int) -> Vocabulary:
    """Read every token's bytes from the tokenizer's own vocabulary, once at load."""
    kind = _decoder_kind(hf_tokenizer)
    special = set(getattr(hf_tokenizer, "all_special_ids", []) or [])
    for tid, tok in getattr(hf_tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            special.add(int(tid))
    n_tok = len(hf_tokenizer)
    pieces = hf_tokenizer.convert_ids_to_tokens(list(range(min(size, n_tok))))
    byte_map = _byte_level_decoder()
    out_bytes: list[bytes | None] = []
    out_text: list[str] = []
    for tid in range(size):
        piece = pieces[tid] if tid < n_tok else None
        if piece in THINK_TAGS:  # a think tag is output text, even when marked special
            out_bytes.append(piece.encode())
            out_text.append(piece)
            continue
        if piece is None or tid in special:
            out_bytes.append(None)
            out_text.append(piece or "")
            continue
        b = _piece_bytes(piece, kind, byte_map, hf_tokenizer, tid)
        out_bytes.append(b)
        out_text.append(token_display(b, piece))
    return Vocabulary(tuple(out_bytes), tuple(out_text))


def _piece_bytes(piece: str, kind: str, byte_map: dict[str, int], tok: Any, tid: int) -> bytes:
    if kind == "bytelevel" and all(c in byte_map for c in piece):
        return bytes(byte_map[c] for c in piece)
    if kind == "sentencepiece":
        m = _BYTE_PIECE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")
    if kind == "bytelevel":  # an added, non-special token stored as plain text
        return piece.encode("utf-8")
    return str(tok.decode([tid])).encode("utf-8")


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

    __slots__ = ("stops", "_pending", "_held", "_ready", "settled_bytes", "taken_bytes", "stopped")

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
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
        hit = min((p for p in (self._held.find(s) for s in self.stops) if p >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            self._settle(hit)
            self._held = ""  # the stop string and what follows it are not text
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
        try:
            out.encode("utf-8")
        except UnicodeEncodeError:
            return out.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
        return out

    def _settle(self, n: int) -> None:
        text, self._held = self._held[:n], self._held[n:]
        self._ready += text
        self.settled_bytes += len(text.encode("utf-8", errors="surrogateescape"))


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
