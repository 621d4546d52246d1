"""The vocabulary: every token's UTF-8 bytes and the string shown as its `token`, read once from
the tokenizer at load. Below every package that formats or detokenizes tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from omlx_logprobs.types import THINK_TAGS, TOOL_TAGS

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
    """Per token id: its UTF-8 bytes (None for special tokens other than the think tags and the
    tool-call markers, which are text) and the string shown as `token`."""

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


def build_vocabulary(
    hf_tokenizer: Any, size: int, text_tokens: Collection[str] = THINK_TAGS + TOOL_TAGS
) -> Vocabulary:
    """Read every token's bytes from the tokenizer's own vocabulary, once at load.
    `text_tokens`: special tokens that are output text all the same (the think tags, the
    tool-call markers that parsers read)."""
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
        if piece is not None and piece in text_tokens:  # a think tag or tool marker: text
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
