"""The one extraction function against numpy: chosen logprob, rank, the natural top k picked on
the device and on the host (the CPU backend's path), fixed ids, and the shared log-sum-exp."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.logprobs.extract import extract, log_softmax


def reference(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return (x - np.logaddexp.reduce(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("host_top", [False, True])
def test_top_k_and_ranks_match_numpy(k: int, host_top: bool) -> None:
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((6, 4096)) * 3).astype(np.float32)  # distinct values: no ties
    chosen = rng.integers(0, 4096, 6)
    ref = reference(x)
    out = extract(log_softmax(mx.array(x)), mx.array(chosen), k, host_top=host_top).to_host()
    rows = np.arange(6)
    np.testing.assert_allclose(out.logprobs, ref[rows, chosen], atol=1e-4)
    assert out.ranks.tolist() == [int(np.sum(ref[i] >= ref[i, c])) for i, c in zip(rows, chosen)]
    want = np.argsort(-ref, axis=-1)[:, :k]
    assert out.top_ids.tolist() == want.tolist()  # best first
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, want, -1), atol=1e-4)
    assert out.top_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32


def test_fixed_ids_keep_their_order_whatever_host_top_says() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    fixed = mx.broadcast_to(mx.array([7, 3, 500], mx.int32), (3, 3))
    out = extract(log_softmax(mx.array(x)), mx.array([0, 1, 2]), 3, fixed, False, True).to_host()
    assert out.top_ids.tolist() == [[7, 3, 500]] * 3
    np.testing.assert_allclose(out.top_logprobs, reference(x)[:, [7, 3, 500]], atol=1e-4)


def test_a_given_log_sum_exp_gives_the_same_rows() -> None:
    x = mx.array(np.random.default_rng(2).standard_normal((4, 300)).astype(np.float32))
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.array(log_softmax(x, lse)), np.array(log_softmax(x)), atol=1e-6)
