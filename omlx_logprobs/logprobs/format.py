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
from fractions import Fraction
from typing import TypeVar

import numpy as np
from pydantic_core import to_json

from omlx_logprobs.types import Entries
from omlx_logprobs.vocab import Vocabulary

NEG_INF_LOGPROB = "-9999.0"  # OpenAI's own stand-in for a logprob of -inf
SLOT = 1 << 32  # piece keys: place * SLOT + token id


class NonFiniteLogprob(ValueError):
    """A NaN logprob must never reach a response."""


def _floor_log10_pow2(t: int) -> int:
    """The largest q with 10**q <= 2**t."""
    q = math.floor(t * math.log10(2))
    while Fraction(10) ** (q + 1) <= Fraction(2) ** t:
        q += 1
    while Fraction(10) ** q > Fraction(2) ** t:
        q -= 1
    return q


def _finest_grids() -> tuple[np.ndarray, np.ndarray, int]:
    """The finest decimal grid tried (the multiples of 10**q), by np.frexp's exponent e of a
    float32 (x = m * 2**e, 0.5 <= m < 1; at index e mod the length, for np.take's
    mode="wrap"): the coarsest not wider than x's spacing 2**max(e - 24, -149), where the
    multiple nearest x reads back as x (but at a power of two, whose gap below is half). As
    factors: x / 10**q is x * up / down, one of them 1. 10**q is exact in double for |q| <= 22,
    so each product or quotient is one correctly rounded operation; exponents that need more
    have NaN factors (no grid fits). Also: the least exponent whose grid is wider than 1."""
    exps = range(-148, 129)  # -148: 2**-149, the least subnormal
    up, down = np.full(len(exps), np.nan), np.full(len(exps), np.nan)
    wide = 129
    for e in exps:
        q = _floor_log10_pow2(max(e - 24, -149))
        wide = min(wide, e) if q > 0 else wide
        if abs(q) <= 22:
            up[e], down[e] = float(10 ** max(-q, 0)), float(10 ** max(q, 0))
    return up, down, wide


_UP, _DOWN, _WIDE_FROM = _finest_grids()
# Grid j is 10**j times the finest; at j = 8 one significant digit is left (|x| < 2**24 * x's
# spacing). A multiple of grid j is an integer of the finest's times 10**j, exact in double.
_ROWS = 9
_TENTHS = 10.0 ** -np.arange(_ROWS)[:, None]
_TENS = 10.0 ** np.arange(_ROWS)[:, None]
_FIRST, _ONE_PASS = 3, 512


def _on_grids(
    y: np.ndarray, x32: np.ndarray, up: np.ndarray, down: np.ndarray | None, rows: slice
) -> tuple[np.ndarray, np.ndarray]:
    """For values y (the float32 x32 over the finest grid, x * up / down) and these grids: the
    double nearest the multiple nearest x on the coarsest grid where it reads back as x32
    (through a double, as a client's `float(text)` does; meaningless where none does), and
    whether it does on each grid. y * 10**-j is rounded, which can only move the multiple
    picked on a grid wider than x's spacing when x is about half-way, so that neither multiple
    reads back. Arrays are [grids, values]: numpy's inner loops run along the values."""
    d = y * _TENTHS[rows]
    np.rint(d, out=d)
    d *= _TENS[rows]
    if down is not None:
        d *= down
    d /= up
    ok = d.astype(np.float32) == x32
    # A grid wider than x's spacing (any but the finest) holds at most one multiple that reads
    # back, and then it is the nearest, which the finer ones hold too: so the wider grids that
    # read back are the first k of them, and the coarsest that does is the k-th (the finest: 0).
    n = len(y)
    return d.reshape(-1)[ok[1:].sum(axis=0) * n + np.arange(n)], ok


def float32_decimals(floats: np.ndarray) -> np.ndarray:
    """float32 logprobs (any shape) as the doubles nearest their shortest decimals: the fewest
    significant digits that read back as the same float32 (numpy's, `str(np.float32(x))`), so
    writing each double in its own shortest digits (`repr`, pydantic-core) writes that decimal.
    -inf becomes -9999.0; NaN and +inf are refused.

    Each value tries, from the finest grid up, the grid's multiple nearest it: x's rounding
    interval is symmetric but at a power of two, whose gap below is half; there the farther
    multiple alone may read back only on a grid finer than x's spacing, i.e. the finest, where
    a coarser one fits or numpy writes the value. numpy also writes values outside the tables
    (|x| < ~1e-15 or > ~1e29); everything else runs no Python code per value."""
    x32 = np.asarray(floats, np.float32)
    shape, x32 = x32.shape, x32.ravel()
    if not len(x32):
        return x32.astype(np.float64).reshape(shape)
    if not np.isfinite(x32).all():
        if np.isnan(x32).any() or np.isposinf(x32).any():
            raise NonFiniteLogprob("non-finite logprob (NaN or +inf)")
        x32 = np.where(np.isneginf(x32), np.float32(NEG_INF_LOGPROB), x32)
    x = x32.astype(np.float64)
    e = np.frexp(x32)[1]
    up, down = np.take(_UP, e, mode="wrap"), None
    y = x * up
    if e.max() >= _WIDE_FROM:  # some finest grid wider than 1 (|x| >= 2**27)
        down = np.take(_DOWN, e, mode="wrap")
        y /= down
    # Many values: the first grids for all, the rest for the few that fit the last (fewer
    # operations); a streamed chunk's few: all grids at once (fewer calls).
    first = _FIRST if len(x) > _ONE_PASS else _ROWS
    out, ok = _on_grids(y, x32, up, down, slice(first))
    if first < _ROWS and ok[-1].any():  # these may fit a coarser grid still
        m = np.flatnonzero(ok[-1])
        rest = _on_grids(y[m], x32[m], up[m], None if down is None else down[m], slice(first, None))
        out[m] = np.where(rest[1][0], rest[0], out[m])
    idx = np.flatnonzero(~ok.any(axis=0)) if not ok[0].all() else ()  # where no grid fits
    if len(idx):
        numpy_digits = np.array([float(str(v)) for v in x32[idx]])  # numpy's shortest decimals
        # as a client reads them (through a double); else the widened double, which always does
        out[idx] = np.where(numpy_digits.astype(np.float32) == x32[idx], numpy_digits, x[idx])
    return out.reshape(shape)


def float_numbers(floats: np.ndarray) -> list[str]:
    """JSON numbers for float32 logprobs: the shortest digits that read back as the same float32
    (-inf as -9999.0, NaN refused)."""
    if not len(floats):
        return []
    # pydantic-core writes a double's shortest digits like `repr`, ~5x faster (a top-20 body
    # holds ~2,700 numbers); only the notation of small values differs (1.5e-6 for repr's
    # 1.5e-06, 0.00001 for 1e-05).
    return to_json(float32_decimals(floats).tolist()).decode()[1:-1].split(",")


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
        if e.tail is not None:  # each position's tail mass after its own logprob
            own = slice(1, None, 2 * (k + 1))
            parts[own] = [
                f'{x},"tail_logprob":{t}' for x, t in zip(parts[own], float_numbers(e.tail))
            ]
        if e.forced is not None:  # a forced token's entry says so (its logprob was not sampled)
            for i in np.flatnonzero(e.forced).tolist():
                parts[1 + 2 * (k + 1) * i] += ',"forced":true'
        return "".join(parts) + _END[k == 0]
