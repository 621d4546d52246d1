"""The chat and legacy logprob JSON against a straightforward construction, entry by entry, from
the same entries: -inf, special tokens (bytes null), a partial UTF-8 character, JSON escapes and
'%' in token text, token ids as strings, and fixed `logprob_token_ids` lists."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omlx_logprobs.logprobs.columnar import Block, decode_block, encode_block
from omlx_logprobs.logprobs.format import (
    ChatLogprobFormatter,
    NonFiniteLogprob,
    float32_decimals,
    float_numbers,
)
from omlx_logprobs.logprobs.legacy import LegacyCursor, LegacyLogprobFormatter
from omlx_logprobs.types import Entries
from omlx_logprobs.vocab import Vocabulary, token_display
from tests.helpers.engine import StoreView

PIECES: list[bytes | None] = [
    None, b"true", b" true", b"true", "é".encode(), b"\xe6\x97", b"\xa5", b'"%s\\', b"\n%", b"x",
]  # fmt: skip
VOCAB = Vocabulary(tuple(PIECES), tuple(token_display(b, "<|end|>") for b in PIECES))


def random_store(rng: np.random.Generator, n: int, k: int, fixed: bool = False) -> StoreView:
    ids = np.stack([rng.permutation(len(PIECES))[:k] for _ in range(n)])
    if fixed:  # logprob_token_ids: the same ids in the order asked, values in any order
        ids = np.repeat(rng.permutation(len(PIECES))[None, :k], n, axis=0)
    lps = -rng.exponential(2.0, (n, k + 1)).astype(np.float32)
    lps[rng.random((n, k + 1)) < 0.15] = -np.inf
    if not fixed:
        lps[:, 1:] = -np.sort(-lps[:, 1:], axis=1)
    tokens, ranks = rng.integers(0, len(PIECES), n), rng.integers(1, 9, n)
    e = Entries(tokens, lps[:, 0], ranks, ids.reshape(n, k), lps[:, 1:].copy())
    return StoreView(e.to_host())


def value(x: float) -> float:
    """The number a response holds: numpy's shortest decimal of the float32, as a double."""
    return -9999.0 if x == -np.inf else float(str(np.float32(x)))


def token(tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else VOCAB.token_text[tid]


def chat_entry(tid: int, lp: float, as_ids: bool) -> dict[str, Any]:
    b = VOCAB.token_bytes[tid]
    raw = None if b is None else list(b)
    return {"token": token(tid, as_ids), "bytes": raw, "logprob": value(lp)}


@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize("k, n", [(0, 3), (1, 5), (3, 40), (8, 300)])
def test_chat_entries_match_entry_by_entry(as_ids: bool, k: int, n: int) -> None:
    store = random_store(np.random.default_rng(k * 100 + n), n, k)
    fmt = ChatLogprobFormatter(VOCAB, as_ids)
    for start, end in [(0, n), (1, 2), (n - 1, n), (2, 2)]:
        expected = []
        for i in range(start, end):
            entry = chat_entry(store.token_ids[i], store.logprobs[i], as_ids)
            top_ids, top_lps = store.top(i)
            entry["top_logprobs"] = [chat_entry(t, v, as_ids) for t, v in zip(top_ids, top_lps)]
            expected.append(entry)
        text = fmt.entries(store.entries.rows(start, end))
        assert json.loads(text) == expected
        assert "Infinity" not in text and "NaN" not in text


def digits(number: str) -> str:
    """A decimal's significant digits, whatever its notation."""
    mantissa = number.lower().partition("e")[0]
    return mantissa.lstrip("-").replace(".", "").strip("0")


def test_chat_numbers_are_the_float32_in_its_shortest_digits() -> None:
    """Each number reads back as exactly the float32, in numpy's shortest digits for it (the
    exponent may be written 1e-5 where numpy writes 1e-05)."""
    store = random_store(np.random.default_rng(3), 50, 4)
    tiny = [-1.5e-6, -2.3e-5, -9.9e-5, -1e-4, 0.0, -1e-45, -123456.7, -0.0, -1.0]
    for i, x in enumerate(tiny):
        store.logprobs[i] = x
    text = ChatLogprobFormatter(VOCAB).entries(store.entries)
    own = store.logprobs.tolist()
    assert [e["logprob"] for e in json.loads(text)] == [value(x) for x in own]
    assert '"logprob":-0.0,' in text and '"logprob":-1.0,' in text
    values = np.concatenate([store.logprobs, store.top_logprobs])
    for x, number in zip(values, float_numbers(values), strict=True):
        if np.isfinite(x):
            assert np.float32(float(number)).tobytes() == x.tobytes()
            assert digits(number) == digits(str(x))
        else:
            assert number == "-9999.0"
    assert float_numbers(np.zeros(0, np.float32)) == []


def log_softmax(rng: np.random.Generator, rows: int, vocab: int, scale: float) -> np.ndarray:
    """float32 log-softmax rows of random logits, as the engine computes them."""
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True, dtype=np.float32))


def float32_cases(rng: np.random.Generator) -> np.ndarray:
    """Every kind of float32: random bit patterns (all exponents, subnormals), powers of two and
    their neighbours, integers, signed zeros, short decimals, and real log-softmax values."""
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    twos = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    up, down = np.nextafter(twos, np.float32(np.inf)), np.nextafter(twos, np.float32(0))
    twos = np.concatenate([twos, up, down])
    subnormal = rng.integers(1, 2**23, 20_000, dtype=np.uint32).view(np.float32)
    decimals = rng.integers(-(10**6), 10**6, 20_000) / 10.0 ** rng.integers(0, 12, 20_000)
    cases = [
        bits, twos, subnormal, np.arange(-20_000, 20_001), decimals, [0.0, -0.0, -9999.0],
        log_softmax(rng, 8, 4096, 1.0), log_softmax(rng, 8, 4096, 30.0),
        -rng.exponential(3.0, 50_000),
    ]  # fmt: skip
    x = np.concatenate([np.asarray(c, np.float32).ravel() for c in cases])
    x = np.concatenate([x, -x])
    return x[np.isfinite(x)]


def test_numbers_identify_the_float32_in_numpys_shortest_digits() -> None:
    """(a) json.loads then float32 gives the value bit for bit; (b) the decimal is numpy's
    shortest for that float32 (`str(np.float32(x))`): same digits, so the same count. Equal, not
    just at most: a shorter one would be a decimal that only reads back through a double's
    rounding, one numpy would not write."""
    x = float32_cases(np.random.default_rng(0))
    text = "[" + ",".join(float_numbers(x)) + "]"
    # a few values at a time (a streamed chunk's way through the grids) write the same
    chunks = [n for i in range(0, len(x), 50) for n in float_numbers(x[i : i + 50])]
    assert chunks == text[1:-1].split(",")
    back = np.array(json.loads(text), np.float64).astype(np.float32)
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))
    numbers = text[1:-1].split(",")
    numpy_digits = [str(v) for v in x]
    assert [digits(n) for n in numbers] == [digits(n) for n in numpy_digits]
    assert [float(n) for n in numbers] == [float(n) for n in numpy_digits]
    assert all("inf" not in n.lower() and "nan" not in n.lower() for n in numbers)


FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False) | st.just(-np.inf)


@settings(max_examples=500, deadline=None)
@given(st.lists(FLOAT32, min_size=1, max_size=40))
def test_any_float32_reads_back_in_numpys_digits(values: list[float]) -> None:
    x = np.array(values, np.float32)
    for v, number in zip(x, float_numbers(x), strict=True):
        if v == -np.inf:
            assert number == "-9999.0"
        else:
            assert np.float32(json.loads(number)).tobytes() == v.tobytes()
            assert float(number) == float(str(v))  # numpy's shortest decimal


def test_float32_decimals_keeps_shape_and_refuses_nan_and_inf() -> None:
    x = np.array([[-0.5312500596046448, -np.inf], [-0.0009307371, 0.0]], np.float32)
    d = float32_decimals(x)
    assert d.dtype == np.float64 and d.shape == (2, 2)
    assert d.tolist() == [[-0.53125006, -9999.0], [-0.0009307371, 0.0]]
    assert float32_decimals(np.zeros((3, 0), np.float32)).shape == (3, 0)
    for bad in (np.nan, np.inf):
        with pytest.raises(NonFiniteLogprob):
            float32_decimals(np.array([-1.0, bad], np.float32))
    assert float_numbers(np.array([-0.5312500596046448], np.float32)) == ["-0.53125006"]


@pytest.mark.parametrize("encoding", ["columnar", "base64"])
def test_columnar_json_holds_the_same_float32(encoding: str) -> None:
    """The columnar JSON form writes the OpenAI shape's own numbers; both forms decode to the
    float32 values bit for bit."""
    store = random_store(np.random.default_rng(7), 30, 4)
    e = store.entries
    obj = json.loads(encode_block(e, 4, encoding))  # type: ignore[arg-type]
    block: Block = decode_block(obj)
    wire = np.where(np.isneginf(e.logprobs), np.float32(-9999.0), e.logprobs)
    top_wire = np.where(np.isneginf(e.top_logprobs), np.float32(-9999.0), e.top_logprobs)
    np.testing.assert_array_equal(block.logprobs.view(np.uint32), wire.view(np.uint32))
    np.testing.assert_array_equal(block.top_logprobs.view(np.uint32), top_wire.view(np.uint32))
    if encoding == "columnar":
        assert obj["logprobs"] == [value(v) for v in e.logprobs.tolist()]
        assert obj["top_logprobs"] == [[value(v) for v in row] for row in e.top_logprobs.tolist()]


def test_nan_is_refused() -> None:
    store = random_store(np.random.default_rng(4), 3, 2)
    store.top_logprobs[4] = float("nan")
    with pytest.raises(NonFiniteLogprob):
        ChatLogprobFormatter(VOCAB).entries(store.entries)
    with pytest.raises(NonFiniteLogprob):
        LegacyLogprobFormatter(VOCAB).json(LegacyCursor(), 2, None, store.entries)


def legacy_dict(own: int, own_lp: float, ids: Any, lps: Any, fixed: bool, as_ids: bool) -> dict:
    """Best first (fixed ids sorted by value), a string seen before keeps its value, then the
    position's own token."""
    pairs = sorted(zip(ids, lps), key=lambda p: -value(p[1])) if fixed else list(zip(ids, lps))
    out: dict[str, float] = {}
    for t, v in [*pairs, (own, own_lp)]:
        out.setdefault(token(t, as_ids), value(v))
    return out


@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize("k, fixed", [(0, False), (1, False), (3, False), (4, True)])
def test_legacy_matches_entry_by_entry(as_ids: bool, k: int, fixed: bool) -> None:
    rng = np.random.default_rng(k + 10 * fixed)
    pstore, store = random_store(rng, 30, k, fixed), random_store(rng, 20, k, fixed)
    prompt_ids = [0, *pstore.token_ids.tolist()]  # entry i scores prompt token i + 1
    fmt = LegacyLogprobFormatter(VOCAB, as_ids)
    cursor = LegacyCursor(5)
    prompt = (prompt_ids, pstore.entries)
    out = json.loads(fmt.json(cursor, k, prompt, store.entries.rows(3, 20), fixed))
    positions = [(pstore, i, True) for i in range(30)] + [(store, i, False) for i in range(3, 20)]
    tokens = [prompt_ids[0]] + [s.token_ids[i] for s, i, _ in positions]
    assert out["tokens"] == [token(t, as_ids) for t in tokens]
    assert out["token_logprobs"] == [None] + [value(s.logprobs[i]) for s, i, _ in positions]
    dicts = [legacy_dict(s.token_ids[i], s.logprobs[i], *s.top(i), fixed, as_ids)
             for s, i, _ in positions]  # fmt: skip
    assert [None if d is None else list(d.items()) for d in out["top_logprobs"]] == [None] + [
        list(d.items()) for d in dicts
    ]
    in_prompt = [True] * 31 + [False] * 17
    starts = np.cumsum([5] + [count(t, p) for t, p in zip(tokens, in_prompt)]).tolist()
    assert out["text_offset"] == starts[:-1] and cursor.offset == starts[-1]


def count(tid: int, in_prompt: bool) -> int:
    """Characters whose first byte the token holds; a special token's text only in a prompt."""
    b = VOCAB.token_bytes[tid]
    if b is None:
        return len(VOCAB.token_text[tid]) if in_prompt else 0
    return sum(1 for c in b if c < 0x80 or c >= 0xC0)
