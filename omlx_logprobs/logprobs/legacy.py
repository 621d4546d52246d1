"""Logprobs in the legacy Completions shape: parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (string-keyed dicts) and `text_offset` (character offsets into the returned text).

Positions come from two flat stores: the prompt's (for `echo`) and the generated tokens'. A
`LegacyCursor` carries the character offset from one streamed chunk to the next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from omlx_logprobs.logprobs.format import num, token_string
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.output.detokenizer import Vocabulary


@dataclass
class LegacyCursor:
    """Where the next position's text starts, in characters of the returned text."""

    offset: int = 0


class LegacyLogprobFormatter:
    def __init__(self, vocab: Vocabulary, as_ids: bool = False) -> None:
        self.vocab = vocab
        self.as_ids = as_ids
        self._keys: dict[int, str] = {}
        self._chars: dict[int, int] = {}

    def key(self, tid: int) -> str:
        """The token's string, as a JSON string (the `tokens` item and the dict key)."""
        k = self._keys.get(tid)
        if k is None:
            k = json.dumps(token_string(self.vocab, tid, self.as_ids), ensure_ascii=False)
            self._keys[tid] = k
        return k

    def chars(self, tid: int, in_prompt: bool) -> int:
        """Characters the token adds to the returned text: the UTF-8 characters that start in
        its bytes (so a character split over tokens counts at its first byte). A special token
        adds its literal text in an echoed prompt and nothing when generated."""
        if tid >= len(self.vocab):
            return 0
        b = self.vocab.token_bytes[tid]
        if b is None:
            return len(self.vocab.token_text[tid]) if in_prompt else 0
        n = self._chars.get(tid)
        if n is None:
            n = sum(1 for c in b if c & 0xC0 != 0x80)
            self._chars[tid] = n
        return n

    def prompt_text(self, ids: list[int]) -> str:
        """The echoed prompt: its tokens' bytes (special tokens as their literal text)."""
        return b"".join(self._prompt_bytes(t) for t in ids).decode("utf-8", errors="replace")

    def _prompt_bytes(self, tid: int) -> bytes:
        if tid >= len(self.vocab):
            return b""
        return self.vocab.token_bytes[tid] or self.vocab.token_text[tid].encode()

    def _dict(self, ids: list[int], lps: list[float], own: int, own_lp: float) -> str:
        """Best first; a string already present keeps its higher-ranked value; the position's
        own token is always present (added last if it is not among the list)."""
        order = sorted(range(len(ids)), key=lambda j: -lps[j])
        seen: dict[str, str] = {}
        for j in order:
            seen.setdefault(self.key(ids[j]), num(lps[j]))
        seen.setdefault(self.key(own), num(own_lp))
        return "{" + ",".join(f"{k}:{v}" for k, v in seen.items()) + "}"

    def json(
        self,
        cursor: LegacyCursor,
        k: int,
        prompt: tuple[list[int], LogprobStore] | None,
        store: LogprobStore,
        span: tuple[int, int],
    ) -> str:
        """Echoed prompt positions (when `prompt` is given), then generated positions [span)."""
        tokens: list[str] = []
        lps: list[str] = []
        tops: list[str] = []
        offsets: list[str] = []

        def add(tid: int, lp: str, top: str, in_prompt: bool) -> None:
            tokens.append(self.key(tid))
            lps.append(lp)
            tops.append(top)
            offsets.append(str(cursor.offset))
            cursor.offset += self.chars(tid, in_prompt)

        if prompt is not None:
            ids, pstore = prompt
            add(ids[0], "null", "null", True)
            for i in range(1, len(ids)):
                t, v = pstore.token_ids[i - 1], pstore.logprobs[i - 1]
                top_ids, top_lps = pstore.top(i - 1)
                add(t, num(v), self._dict(list(top_ids[:k]), list(top_lps[:k]), t, v), True)
        for i in range(*span):
            t, v = store.token_ids[i], store.logprobs[i]
            top_ids, top_lps = store.top(i)
            add(t, num(v), self._dict(list(top_ids[:k]), list(top_lps[:k]), t, v), False)
        return (
            '{"tokens":[' + ",".join(tokens) + '],"token_logprobs":[' + ",".join(lps)
            + '],"top_logprobs":[' + ",".join(tops) + '],"text_offset":[' + ",".join(offsets)
            + "]}"
        )  # fmt: skip
