"""The extraction against numpy (float64): chosen logprob, rank, the natural top k, on the device
(a step's packed entries, as the runner takes them) and on the host (the CPU backend's path),
fixed ids, the shared log-sum-exp, and rows the finiteness check must refuse."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.logprobs import kernel
from omlx_logprobs.logprobs.extract import (
    EntryAsk,
    HostExtraction,
    device_step,
    finite_rows,
    log_softmax,
)
from omlx_logprobs.types import Entries


def entries(
    x: np.ndarray,
    chosen: np.ndarray | list[int],
    k: int,
    fixed: mx.array | None = None,
    natural: bool = True,
    host: bool = False,
) -> Entries:
    """The rows' entries by the runner's own path: numpy at collect time (`host`), or a device
    step's packed entries (the CUDA kernel where there is one, else MLX ops)."""
    logits, ids = mx.array(x), mx.array(chosen).astype(mx.int32)
    if host:
        ex = HostExtraction(logits, ids, k, fixed, natural)
        mx.eval(*ex.arrays())
        return ex.to_host()
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    packed = device_step(ids, lse, EntryAsk(logits, k, fixed, natural), kernel.available())
    out = packed.to_host()[2]
    assert out is not None
    return out


def materialized(x: np.ndarray) -> np.ndarray:
    """The float32 log-softmax row written out (max, exp, numpy's pairwise sum, log, subtract):
    what the host path would hold if it wrote its rows, bit for bit."""
    x = x.astype(np.float32)
    m = x.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def reference(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return (x - np.logaddexp.reduce(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("host", [False, True])
def test_top_k_and_ranks_match_numpy(k: int, host: bool) -> None:
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((6, 4096)) * 3).astype(np.float32)  # distinct values: no ties
    chosen = rng.integers(0, 4096, 6)
    ref = reference(x)
    out = entries(x, chosen, k, host=host)
    rows = np.arange(6)
    np.testing.assert_allclose(out.logprobs, ref[rows, chosen], atol=1e-4)
    assert out.ranks.tolist() == [int(np.sum(ref[i] >= ref[i, c])) for i, c in zip(rows, chosen)]
    want = np.argsort(-ref, axis=-1)[:, :k]
    assert out.top_ids.tolist() == want.tolist()  # best first
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, want, -1), atol=1e-4)
    assert out.top_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32
    assert out.logprobs.dtype == np.float32 and out.ranks.dtype == np.int32


@pytest.mark.parametrize("k", [2, 5, 20])
def test_host_top_k_from_vocabulary_groups_equals_a_full_sort(k: int) -> None:
    """The host's top k looks only inside the k groups (ids j, j + 768, j + 2 * 768, ...) with
    the largest maxima: rows whose top values crowd into one group, spread one per group, tie,
    are mostly -inf, or crowd into a run of neighbouring ids."""
    rng = np.random.default_rng(k)
    v = 49152
    stride = v // 64
    x = (rng.standard_normal((6, v)) * 2).astype(np.float32)
    x[0, 640 + stride * np.arange(2 * k)] += 20  # the whole top k in one group
    x[1, :stride] += 20  # one high value in every group
    x[2, :] = np.round(x[2, :])  # many exact ties
    x[3, :] = -np.inf
    x[3, rng.choice(v, k // 2 + 1, replace=False)] = rng.standard_normal(k // 2 + 1)
    x[5, 640 : 640 + 2 * k] += 20  # neighbours: one per group
    got = entries(x, np.zeros(6, np.int64), k, host=True)
    lp = materialized(x)
    want = -np.sort(-lp, axis=-1)[:, :k]
    np.testing.assert_array_equal(got.top_logprobs, want)  # the same values, best first
    assert all(len(set(r)) == k for r in got.top_ids.tolist())
    np.testing.assert_array_equal(np.take_along_axis(lp, got.top_ids.astype(np.int64), -1), want)


@pytest.mark.parametrize("k", [0, 5, 20])
def test_host_ranks_counted_in_reaching_groups_equal_a_full_count(k: int) -> None:
    """The host counts a rank only inside the groups whose maximum reaches the chosen token's
    logprob, and over the whole row when more than max(k, RANK_GROUPS) groups do: either way
    count(lp >= lp[chosen]) over the materialized float32 row, ties made by rounding included."""
    rng = np.random.default_rng(k)
    v = 49152
    x = np.full((6, v), -10.0, np.float32) + rng.standard_normal((6, v)).astype(np.float32)
    chosen = np.zeros(6, np.int64)
    x[0, 77] = 5.0
    chosen[0] = 77  # the argmax: rank 1
    chosen[1] = int(np.argsort(x[1])[v // 2])  # mid-row: every group reaches it
    x[2, 0] = 20.0  # the log-sum-exp ~20: x - lse rounds at ~2e-6, so ids 5 and 800 tie
    x[2, 5], x[2, 800] = np.float32(1e-3), np.float32(1e-3) - np.float32(1e-9)
    chosen[2] = 800
    x[3, [1, 2, 3]] = [3.0, 2.0, 1.5]  # three groups reach id 4
    x[3, 4] = 1.0
    chosen[3] = 4
    x[4, 10 + 768 * np.arange(6)] = 4.0  # six ids in one group above the chosen
    x[4, 11] = 3.0
    chosen[4] = 11
    x[5, np.arange(8) * 769] = 4.0  # eight groups above the chosen
    x[5, 9] = 3.0
    chosen[5] = 9
    got = entries(x, chosen, k, host=True)
    lp = materialized(x)
    own = lp[np.arange(6), chosen]
    assert lp[2, 5] == lp[2, 800] and x[2, 5] != x[2, 800]
    assert got.ranks.tolist() == [int(np.sum(lp[i] >= own[i])) for i in range(6)]
    assert got.ranks[:1].tolist() == [1] and got.ranks[2:].tolist() == [3, 4, 7, 9]
    np.testing.assert_array_equal(got.logprobs, own)
    np.testing.assert_allclose(got.logprobs, reference(x)[np.arange(6), chosen], atol=1e-5)


@pytest.mark.parametrize("host", [False, True])
def test_fixed_ids_keep_their_order(host: bool) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    fixed = mx.broadcast_to(mx.array([7, 3, 500], mx.int32), (3, 3))
    out = entries(x, [0, 1, 2], 3, fixed, False, host)
    assert out.top_ids.tolist() == [[7, 3, 500]] * 3
    np.testing.assert_allclose(out.top_logprobs, reference(x)[:, [7, 3, 500]], atol=1e-4)


@pytest.mark.parametrize("host", [False, True])
def test_fixed_ids_beside_natural_top_lists(host: bool) -> None:
    """Rows with `logprob_token_ids` (ids >= 0) next to a row that wants its natural top 2 (-1)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    fixed = mx.array([[9, 4], [-1, -1]], mx.int32)
    out = entries(x, [0, 1], 2, fixed, True, host)
    ref = reference(x)
    assert out.top_ids[0].tolist() == [9, 4]
    assert out.top_ids[1].tolist() == np.argsort(-ref[1])[:2].tolist()
    np.testing.assert_allclose(out.top_logprobs[0], ref[0, [9, 4]], atol=1e-4)


@pytest.mark.parametrize("v", [8, 49152])  # whole rows; vocabulary groups
def test_host_rows_with_nan_inf_or_only_minus_inf_are_not_finite(v: int) -> None:
    x = np.zeros((4, v), np.float32)
    x[1, 3], x[2, 5], x[3] = np.nan, np.inf, -np.inf
    assert finite_rows(x).tolist() == [True, False, False, False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning, no exception: the caller refuses those rows
        got = entries(x, np.zeros(4, np.int64), 4, host=True)
    np.testing.assert_allclose(got.logprobs[0], -np.log(v), atol=1e-6)
    x[0, :4] = -np.inf  # -inf entries in a row that has finite ones are fine
    assert finite_rows(x)[0]
    got = entries(x, np.zeros(4, np.int64), 4, host=True)
    assert np.isneginf(got.logprobs[0]) and got.ranks[0] == v  # every entry is >= -inf
    np.testing.assert_allclose(got.top_logprobs[0], np.full(4, -np.log(v - 4)), atol=1e-6)


def test_a_given_log_sum_exp_gives_the_same_rows() -> None:
    x = mx.array(np.random.default_rng(2).standard_normal((4, 300)).astype(np.float32))
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.array(log_softmax(x, lse)), np.array(log_softmax(x)), atol=1e-6)


def test_host_extractions_in_turn_keep_their_own_values() -> None:
    """The host reuses one buffer per thread for its [R, V] temporaries: extractions of other
    sizes, one after another, each equal numpy, and an earlier result is not overwritten."""
    rng = np.random.default_rng(7)
    results = []
    for rows in (3, 9, 2):
        x = (rng.standard_normal((rows, 4096)) * 3).astype(np.float32)
        chosen = rng.integers(0, 4096, rows)
        results.append((reference(x), chosen, entries(x, chosen, 4, host=True)))
    for ref, chosen, got in results:
        rows = np.arange(len(chosen))
        np.testing.assert_allclose(got.logprobs, ref[rows, chosen], atol=1e-4)
        assert got.ranks.tolist() == [int(np.sum(r >= r[c])) for r, c in zip(ref, chosen)]
        want = np.argsort(-ref, axis=-1)[:, :4]
        assert got.top_ids.tolist() == want.tolist()
        np.testing.assert_allclose(got.top_logprobs, np.take_along_axis(ref, want, -1), atol=1e-4)
