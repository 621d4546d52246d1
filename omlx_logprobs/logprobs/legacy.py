"""Logprobs in the legacy Completions shape: parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (string-keyed dicts) and `text_offset` (character offsets into the returned text).

Positions come from two entry blocks: the prompt's (for `echo`) and the generated tokens'. A
`LegacyCursor` carries the character offset from one streamed chunk to the next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import accumulate

from omlx_logprobs.logprobs.format import Pieces, float_numbers, token_string
from omlx_logprobs.logprobs.tail import narrowed
from omlx_logprobs.types import Entries
from omlx_logprobs.vocab import Vocabulary


@dataclass
class LegacyCursor:
    """Where the next position's text starts, in characters of the returned text."""

    offset: int = 0


class LegacyLogprobFormatter:
    def __init__(self, vocab: Vocabulary, as_ids: bool = False) -> None:
        self.vocab = vocab
        self.as_ids = as_ids
        self._keys: Pieces[str] = Pieces(self._key)
        # characters each id adds to the text: generated, echoed in the prompt
        self._counts: tuple[Pieces[int], Pieces[int]] = (
            Pieces(lambda t: self.chars(t, False)),
            Pieces(lambda t: self.chars(t, True)),
        )

    def _key(self, tid: int) -> str:
        return json.dumps(token_string(self.vocab, tid, self.as_ids), ensure_ascii=False)

    def key(self, tid: int) -> str:
        """The token's string, as a JSON string (the `tokens` item and the dict key)."""
        return self._keys[tid]

    def chars(self, tid: int, in_prompt: bool) -> int:
        """Characters the token adds to the returned text: the UTF-8 characters that start in
        its bytes (so a character split over tokens counts at its first byte). A special token
        adds its literal text in an echoed prompt and nothing when generated."""
        if tid >= len(self.vocab):
            return 0
        b = self.vocab.token_bytes[tid]
        if b is None:
            return len(self.vocab.token_text[tid]) if in_prompt else 0
        return sum(1 for c in b if c & 0xC0 != 0x80)

    def prompt_text(self, ids: list[int]) -> str:
        """The echoed prompt: its tokens' bytes (special tokens as their literal text)."""
        return b"".join(self._prompt_bytes(t) for t in ids).decode("utf-8", errors="replace")

    def _prompt_bytes(self, tid: int) -> bytes:
        if tid >= len(self.vocab):
            return b""
        return self.vocab.token_bytes[tid] or self.vocab.token_text[tid].encode()

    def _dicts(
        self,
        own: list[int],
        own_lps: list[str],
        top_ids: list[int],
        top_lps: list[str],
        k: int,
        fixed: bool,
    ) -> list[str]:
        """One `top_logprobs` dict per position, best first; a string already present keeps its
        higher-ranked value; the position's own token is always present (added last if it is not
        among the list). `top_*` hold `stride` items a position, of which the first k count."""
        key = self._keys.__getitem__
        if not own:
            return []
        if k == 0:
            return ["{" + key(t) + ":" + v + "}" for t, v in zip(own, own_lps)]
        stride = len(top_ids) // len(own)
        if k == 1:  # what lm-eval asks for: one comprehension, no per-position dict
            return [
                "{" + a + ":" + x + ("}" if a == b else "," + b + ":" + y + "}")
                for a, x, b, y in zip(
                    map(key, top_ids[::stride]), top_lps[::stride], map(key, own), own_lps
                )
            ]
        out = []
        for i, (t, v) in enumerate(zip(own, own_lps)):
            a = i * stride
            ids, lps = top_ids[a : a + k], top_lps[a : a + k]
            seen: dict[str, str] = {}
            for j in sorted(range(k), key=lambda j: -float(lps[j])) if fixed else range(k):
                seen.setdefault(key(ids[j]), lps[j])
            seen.setdefault(key(t), v)
            out.append("{" + ",".join([f"{x}:{y}" for x, y in seen.items()]) + "}")
        return out

    def json(
        self,
        cursor: LegacyCursor,
        k: int,
        prompt: tuple[list[int], Entries] | None,
        entries: Entries,
        fixed: bool = False,
    ) -> str:
        """Echoed prompt positions (when `prompt` is given: its ids and the entries of positions
        1..), then the generated positions of `entries`. `fixed`: the top lists are
        `logprob_token_ids` in the order asked, not best first. Whole ranges are converted at
        once: a scored prompt has hundreds of positions. Entries with a tail mass add the list
        `tail_logprobs` (null for the first prompt position)."""
        tokens: list[int] = []
        lps: list[str] = ["null"] if prompt is not None else []
        tops: list[str] = ["null"] if prompt is not None else []
        tails: list[str] = ["null"] if prompt is not None else []
        in_prompt = 0
        if prompt is not None:
            ids, scored = prompt
            tokens += ids
            in_prompt = len(ids)
            self._extend(lps, tops, tails, scored, k, fixed)
        tokens += entries.token_ids.tolist()
        self._extend(lps, tops, tails, entries, k, fixed)
        gen, prompt_chars = self._counts
        counts = [*map(prompt_chars.__getitem__, tokens[:in_prompt]),
                  *map(gen.__getitem__, tokens[in_prompt:])]  # fmt: skip
        offsets = list(accumulate(counts, initial=cursor.offset))
        cursor.offset = offsets.pop()
        keys = ",".join(map(self._keys.__getitem__, tokens))
        end = ',"tail_logprobs":[' + ",".join(tails) + "]" if entries.tail is not None else ""
        return (
            '{"tokens":[' + keys + '],"token_logprobs":[' + ",".join(lps) + '],"top_logprobs":['
            + ",".join(tops) + '],"text_offset":[' + ",".join(map(str, offsets)) + "]" + end + "}"
        )  # fmt: skip

    def _extend(
        self, lps: list[str], tops: list[str], tails: list[str], e: Entries, k: int, fixed: bool
    ) -> None:
        """Append the positions of `e`: their logprobs, their dicts and their tails (of the
        first k alternatives)."""
        if e.tail is not None:
            tails += float_numbers(narrowed(e, min(k, e.k)).tail)
        values = float_numbers(e.logprobs)
        lps += values
        tops += self._dicts(
            e.token_ids.tolist(), values, e.top_ids.ravel().tolist(),
            float_numbers(e.top_logprobs.ravel()), min(k, e.k), fixed,
        )  # fmt: skip
