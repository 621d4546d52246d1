"""The tail mass (logprobs/tail.py) against float64 numpy: the log of the probability outside each
row's list, on the device path (a step's packed entries) and on the host, for natural top lists
of 0, 1, 20 and 256, fixed ids, rows of one batch with lists of their own length, a list that
holds all but ~1e-30 of the mass, one that covers everything (-inf, written -9999.0), and a kept
list served shorter (`narrowed`)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.logprobs import kernel
from omlx_logprobs.logprobs.columnar import decode_block, encode_block
from omlx_logprobs.logprobs.extract import EntryAsk, HostExtraction, device_step
from omlx_logprobs.logprobs.tail import narrowed
from omlx_logprobs.types import Entries


def entries(
    x: np.ndarray,
    k: int,
    counts: list[int],
    fixed: mx.array | None = None,
    natural: bool = True,
    host: bool = False,
) -> Entries:
    """The rows' entries with their tails, by the runner's own paths (see test_extract)."""
    logits, ids = mx.array(x), mx.zeros(len(x), mx.int32)
    tail = mx.array(counts, mx.int32)
    if host:
        ex = HostExtraction(logits, ids, k, fixed, natural, None, tail)
        mx.eval(*ex.arrays())
        return ex.to_host()
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    ask = EntryAsk(logits, k, fixed, natural, tail=tail)
    out = device_step(ids, lse, ask, kernel.available()).to_host()[2]
    assert out is not None and out.tail is not None
    return out


def reference_tail(x: np.ndarray, listed: list[list[int]]) -> np.ndarray:
    """Each row's log-sum-exp, in float64, of its float32 log-softmax outside `listed`."""
    lp = x.astype(np.float64) - np.logaddexp.reduce(x.astype(np.float64), axis=-1, keepdims=True)
    out = []
    for row, ids in zip(lp, listed):
        rest = np.delete(row, ids)
        out.append(np.logaddexp.reduce(rest) if len(rest) else -np.inf)
    return np.array(out)


def tolerance(host: bool) -> float:
    """MLX's log-sum-exp over a 49k row drifted up to ~2e-5 from float64 on the CPU; the host
    path (the one the CPU backend serves with) sums in numpy's pairwise order."""
    return 1e-5 if host else 5e-5


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("k", [0, 1, 20, 256])
def test_tail_of_natural_top_lists(k: int, host: bool) -> None:
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((4, 49152)) * 3).astype(np.float32)
    got = entries(x, k, [k] * 4, host=host)
    listed = [list(r) for r in got.top_ids.tolist()]
    assert got.tail.dtype == np.float32
    np.testing.assert_allclose(got.tail, reference_tail(x, listed), atol=tolerance(host))
    if k == 0:  # nothing listed: all of the mass
        np.testing.assert_allclose(got.tail, 0.0, atol=tolerance(host))


@pytest.mark.parametrize("host", [False, True])
def test_rows_of_one_batch_leave_out_their_own_list(host: bool) -> None:
    """The batch's K is 20; rows asked for 20, 5 and 0 alternatives: each tail leaves out only
    its own first k (a row's list is the first k of the batch's)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 4096)) * 2).astype(np.float32)
    got = entries(x, 20, [20, 5, 0], host=host)
    listed = [got.top_ids[0].tolist(), got.top_ids[1, :5].tolist(), []]
    np.testing.assert_allclose(got.tail, reference_tail(x, listed), atol=tolerance(host))


@pytest.mark.parametrize("host", [False, True])
def test_tail_outside_fixed_ids(host: bool) -> None:
    """logprob_token_ids: the tail is the mass outside exactly those ids; a row with fewer ids
    than the batch's K is padded with copies of its first (left out once)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    fixed = mx.array([[7, 3, 500], [11, 11, 11]], mx.int32)
    got = entries(x, 3, [3, 3], fixed, natural=False, host=host)
    want = reference_tail(x, [[7, 3, 500], [11]])
    np.testing.assert_allclose(got.tail, want, atol=tolerance(host))


@pytest.mark.parametrize("host", [False, True])
def test_a_list_holding_nearly_all_the_mass_keeps_its_tail(host: bool) -> None:
    """Twenty tokens 80 nats above the rest: the tail is ~3e-33 of the mass, log ~ -75, which
    1 - sum(exp(top)) gives as 0 (log: -inf) or a negative number."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    x[:, :20] += 80
    got = entries(x, 20, [20, 20], host=host)
    want = reference_tail(x, [list(range(20))] * 2)
    assert (want < -60).all()
    np.testing.assert_allclose(got.tail, want, rtol=1e-6, atol=tolerance(host))
    naive = np.log1p(-np.exp(got.top_logprobs.astype(np.float64)).sum(axis=1))
    assert not np.allclose(naive, want, atol=1.0)  # the naive form has lost it


@pytest.mark.parametrize("host", [False, True])
def test_a_list_covering_everything_has_a_tail_of_minus_inf(host: bool) -> None:
    x = np.full((1, 64), -np.inf, np.float32)
    x[0, [3, 9]] = [1.0, 2.0]  # a processed distribution: two tokens left
    got = entries(x, 2, [2], host=host)
    assert np.isneginf(got.tail[0])
    block = encode_block(got, 2, "columnar")
    assert '"tail_logprobs":[-9999.0]' in block


def test_a_longer_kept_list_narrowed_gives_the_shorter_lists_tail() -> None:
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 4096)) * 3).astype(np.float32)
    wide = entries(x, 256, [256] * 3, host=True)
    for k in (0, 1, 20):
        short = narrowed(wide, k)
        assert short.k == k
        np.testing.assert_allclose(short.tail, entries(x, k, [k] * 3, host=True).tail, atol=1e-5)


@pytest.mark.parametrize("encoding", ["columnar", "base64"])
def test_compact_blocks_of_256_alternatives_decode_with_their_tail(encoding: str) -> None:
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((5, 4096)) * 3).astype(np.float32)
    got = entries(x, 256, [256] * 5, host=True)
    block = decode_block(json.loads(encode_block(got, 256, encoding)))  # type: ignore[arg-type]
    assert block.top_ids.shape == (5, 256)
    np.testing.assert_array_equal(block.top_ids, got.top_ids)
    np.testing.assert_array_equal(block.top_logprobs, got.top_logprobs)
    assert block.tail is not None
    np.testing.assert_array_equal(block.tail, got.tail)
