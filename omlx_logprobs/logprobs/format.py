"""Logprob entries in OpenAI's chat shape, written straight to JSON text.

Entries come as one columnar block (`types.Entries`). Each (place, id) pair has a
cached piece of text: the end of the entry before it, then the entry's `"token"` and `"bytes"`
up to its `"logprob":`. A body is one list, pieces and numbers interleaved by slice assignment,
and one `join`: no Python code runs per entry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from pydantic_core import to_json

from omlx_logprobs.types import Entries
from omlx_logprobs.vocab import Vocabulary

NEG_INF_LOGPROB = "-9999.0"  # OpenAI's own stand-in for a logprob of -inf
SLOT = 1 << 32  # piece keys: place * SLOT + token id


class NonFiniteLogprob(ValueError):
    """A NaN logprob must never reach a response."""


def num(x: float) -> str:
    """A logprob as JSON: -inf becomes -9999.0, NaN is refused."""
    if math.isfinite(x):
        return repr(x)
    if x == -math.inf:
        return NEG_INF_LOGPROB
    raise NonFiniteLogprob(f"non-finite logprob {x}")


def float_numbers(floats: np.ndarray) -> list[str]:
    """JSON numbers for float32 logprobs widened to double: the shortest digits that read back
    as the same double (-inf as -9999.0, NaN refused)."""
    if not len(floats):
        return []
    if np.isfinite(floats).all():
        # pydantic-core's JSON writer finds the same digits as `repr`, ~5x faster (a top-20 body
        # holds ~2,700 numbers); only the exponent is written differently (1e-5, not 1e-05).
        return to_json(floats.tolist()).decode()[1:-1].split(",")
    return [num(x) for x in floats.tolist()]


def token_string(vocab: Vocabulary, tid: int, as_ids: bool = False) -> str:
    """A token's `token` string: its vocabulary text, or vLLM's `token_id:<id>`."""
    if as_ids:
        return f"token_id:{tid}"
    return vocab.token_text[tid] if tid < len(vocab) else ""


T = TypeVar("T")


class Pieces(dict[int, T]):
    """A cached value per key (a piece of text), made on first use; afterwards a lookup is one
    C-level call, and `map(pieces.__getitem__, keys)` runs no Python code per key."""

    def __init__(self, make: Callable[[int], T]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key: int) -> T:
        text = self[key] = self.make(key)
        return text


# An entry's piece holds what precedes its logprob: the end of the entry before it, then its own
# start. Places: first entry of the body, a position's own token (after the previous position's
# last top entry), the first top entry, any other top entry; without top lists, the first and
# any later own entry.
FIRST, OWN, TOP1, TOP, BARE1, BARE = range(6)
_BEFORE = ("[{", "}]},{", ',"top_logprobs":[{', "},{", "[{", ',"top_logprobs":[]},{')
_END = ("}]}]", ',"top_logprobs":[]}]')  # with top lists, without


class ChatLogprobFormatter:
    def __init__(self, vocab: Vocabulary, as_ids: bool = False) -> None:
        self.vocab = vocab
        self.as_ids = as_ids  # return_tokens_as_token_ids
        self._pieces: Pieces[str] = Pieces(self._piece)
        self._places: dict[int, np.ndarray] = {}

    def token_fragment(self, tid: int) -> str:
        """`"token": ..., "bytes": ...` for one id (bytes null for special tokens)."""
        b = self.vocab.token_bytes[tid] if tid < len(self.vocab) else None
        text = token_string(self.vocab, tid, self.as_ids)
        raw = "null" if b is None else "[" + ",".join(map(str, b)) + "]"
        return f'"token":{json.dumps(text, ensure_ascii=False)},"bytes":{raw}'

    def _piece(self, key: int) -> str:
        place, tid = divmod(key, SLOT)
        return _BEFORE[place] + self.token_fragment(tid) + ',"logprob":'

    def _place_keys(self, k: int) -> np.ndarray:
        """Key offsets of one position's k + 1 entries (its own, then its top list); the body's
        first entry adds FIRST - OWN (or BARE1 - BARE) to its offset."""
        keys = self._places.get(k)
        if keys is None:
            places = [BARE] if k == 0 else [OWN, TOP1] + [TOP] * (k - 1)
            keys = self._places[k] = np.array(places, np.int64) * SLOT
        return keys

    def entries(self, e: Entries | None) -> str:
        """The JSON array of these entries: one join of cached pieces (looked up in C) and
        logprob numbers, whatever the number of entries."""
        if e is None or not len(e):
            return "[]"
        k, ids, lps = e.k, e.token_ids[:, None], e.logprobs[:, None]
        if k:
            ids = np.concatenate([ids, e.top_ids], axis=1)
            lps = np.concatenate([lps, e.top_logprobs], axis=1)
        keys = (ids.astype(np.int64) + self._place_keys(k)).ravel()
        keys[0] -= (OWN - FIRST if k else BARE - BARE1) * SLOT
        parts: list[str] = [""] * (2 * len(keys))
        parts[0::2] = map(self._pieces.__getitem__, keys.tolist())
        parts[1::2] = float_numbers(lps.ravel())
        return "".join(parts) + _END[k == 0]
