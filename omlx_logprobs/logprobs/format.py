"""Logprob entries in OpenAI's chat shape, written straight to JSON text.

Entries are read from a request's flat store by position range. Each (place, id) pair has a
cached piece of text: the end of the entry before it, then the entry's `"token"` and `"bytes"`
up to its `"logprob":`. A body is one list, pieces and numbers interleaved by slice assignment,
and one `join`: no Python code runs per entry.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from pydantic_core import to_json

from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.output.detokenizer import Vocabulary

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
    as the same double (-inf as -9999.0, NaN refused). `floats` must not view a store's own
    array: that would block the engine thread's appends to it ("cannot resize an array that is
    exporting buffers")."""
    if not len(floats):
        return []
    if np.isfinite(floats).all():
        # pydantic-core's JSON writer finds the same digits as `repr`, ~5x faster (a top-20 body
        # holds ~2,700 numbers); only the exponent is written differently (1e-5, not 1e-05).
        return to_json(floats.tolist()).decode()[1:-1].split(",")
    return [num(x) for x in floats.tolist()]


def numbers(values: array) -> list[str]:
    """`float_numbers` of a copy (a slice) of a store's float32 array."""
    return float_numbers(np.frombuffer(values, np.float32))


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

    def entries(self, store: LogprobStore, start: int, end: int) -> str:
        """The JSON array of entries for positions [start, end): one join of cached pieces
        (looked up in C) and logprob numbers, whatever the number of entries."""
        if end <= start:
            return "[]"
        return self.span(store, start, end, first=True) + _END[store.k == 0]

    def span(self, store: LogprobStore, start: int, end: int, first: bool) -> str:
        """Entries [start, end) without the list's closing: consecutive spans of one list
        concatenate (the list's first span with `first`), then `close` ends it."""
        k, n = store.k, end - start
        ids = np.frombuffer(store.token_ids[start:end], np.int32)[:, None]
        lps = np.frombuffer(store.logprobs[start:end], np.float32)[:, None]
        if k:  # slices are copies: no view of the store's arrays (see float_numbers)
            top_ids = np.frombuffer(store.top_ids[start * k : end * k], np.int32)
            top_lps = np.frombuffer(store.top_logprobs[start * k : end * k], np.float32)
            ids = np.concatenate([ids, top_ids.reshape(n, k)], axis=1)
            lps = np.concatenate([lps, top_lps.reshape(n, k)], axis=1)
        keys = (ids + self._place_keys(k)).ravel()
        if first:
            keys[0] -= (OWN - FIRST if k else BARE - BARE1) * SLOT
        parts: list[str] = [""] * (2 * len(keys))
        parts[0::2] = map(self._pieces.__getitem__, keys.tolist())
        parts[1::2] = float_numbers(lps.ravel())
        return "".join(parts)

    @staticmethod
    def close(store: LogprobStore) -> str:
        return _END[store.k == 0]


class EntriesText:
    """One request's chat `content` entries as text, formatted while it runs: a non-streamed
    top-20 body of 128 tokens is ~170 KB, and when a batch finishes together the event loop
    would build every body at once (a closed loop's next wave then waits on it). The engine
    process ships such a request's entries every few steps (engine/process.py); `extend` runs
    on arrival, `json` at the end formats only the tail."""

    def __init__(self, fmt: ChatLogprobFormatter, store: LogprobStore) -> None:
        self.fmt, self.store = fmt, store
        self.parts: list[str] = []
        self.upto = 0  # positions [0, upto) are in `parts`
        self.failed = False  # a NaN arrived: the end's own formatting raises the error

    def extend(self) -> None:
        end = len(self.store)
        if self.failed or end <= self.upto:
            return
        try:
            self.parts.append(self.fmt.span(self.store, self.upto, end, first=self.upto == 0))
        except NonFiniteLogprob:
            self.failed = True
            return
        self.upto = end

    def json(self, start: int, end: int) -> str:
        """`fmt.entries(store, start, end)`, from the text made so far where it can."""
        if self.failed or start != 0 or end < self.upto or end == 0:
            return self.fmt.entries(self.store, start, end)
        tail = ""
        if end > self.upto:
            tail = self.fmt.span(self.store, self.upto, end, first=self.upto == 0)
        return "".join(self.parts) + tail + self.fmt.close(self.store)
