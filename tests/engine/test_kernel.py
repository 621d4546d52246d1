"""The CUDA step kernel (logprobs/kernel.py) against numpy and against the MLX-ops path it
replaces: token, finiteness, the chosen logprob, rank, the top K (ties by id), fixed ids.
Runs only where MLX's CUDA backend is the default device (the GPU host, not CI)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.logprobs import kernel
from omlx_logprobs.logprobs.extract import EntryAsk, device_step
from omlx_logprobs.logprobs.extractor import DeviceExtractor
from omlx_logprobs.runner.prompt_scoring import PromptSlice, score
from omlx_logprobs.types import SamplingParams

pytestmark = pytest.mark.skipif(not kernel.available(), reason="needs MLX's CUDA backend")


def lse32(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.logaddexp.reduce(x.astype(np.float64), axis=-1, keepdims=True).astype(np.float32)


def expected(x: np.ndarray, lse: np.ndarray, tok: np.ndarray, k: int) -> np.ndarray:
    """The packed rows, in numpy: every logprob is the float32 x - lse, ties go to the lower id."""
    b = len(x)
    lp = (x - lse).astype(np.float32)
    own = lp[np.arange(b), tok]
    ranks = np.sum(lp >= own[:, None], axis=-1)
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[1]), x.shape), -lp), axis=-1)[:, :k]
    vals = np.take_along_axis(lp, order, -1)
    return np.concatenate(
        [
            tok[:, None].astype(np.int32),
            np.isfinite(lse).astype(np.int32),
            own.view(np.int32)[:, None],
            ranks[:, None].astype(np.int32),
            order.astype(np.int32),
            vals.astype(np.float32).view(np.int32),
        ],
        axis=1,
    )


def run(x: np.ndarray, tok: np.ndarray, k: int | None, fused: bool, fixed=None) -> np.ndarray:
    xs = mx.array(x)
    lse = mx.logsumexp(xs, axis=-1, keepdims=True)
    ask = None if k is None else EntryAsk(xs, k, None if fixed is None else mx.array(fixed))
    packed = device_step(mx.array(tok.astype(np.uint32)), lse, ask, fused)
    mx.eval(packed.array)
    return np.array(packed.array)


@pytest.mark.parametrize("v", [1000, 49152, 151936])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_kernel_matches_numpy_and_the_ops_path(v: int, k: int) -> None:
    rng = np.random.default_rng(v + k)
    x = (rng.standard_normal((7, v)) * 4).astype(np.float32)
    x[1, :50] = x[1].max() + 1  # 50 exact ties at the top: lower ids first
    x[2, rng.integers(0, v, 300)] = -np.inf  # masked tokens
    x[3] = np.round(x[3])  # many ties everywhere
    tok = rng.integers(0, v, 7)
    tok[0] = int(np.argmax(x[0]))
    got = run(x, tok, k, fused=True)
    want = expected(x, np.array(mx.logsumexp(mx.array(x), axis=-1, keepdims=True)), tok, k)
    assert got.shape == (7, 4 + 2 * k)
    np.testing.assert_array_equal(got, want)  # bit for bit, ids and logprobs
    ops = run(x, tok, k, fused=False)
    np.testing.assert_array_equal(got[:, :4], ops[:, :4])  # token, finite, logprob, rank
    # The ops path orders exact ties arbitrarily: the same values, and ids with equal values.
    np.testing.assert_array_equal(got[:, 4 + k :], ops[:, 4 + k :])
    lp = (x - lse32(x)).astype(np.float32)
    for r in range(7):
        a, b = got[r, 4 : 4 + k], ops[r, 4 : 4 + k]
        np.testing.assert_allclose(lp[r, a], lp[r, b], atol=1e-6)
    assert got[0, 3] == 1


def test_off_rows_carry_token_and_finiteness() -> None:
    x = np.zeros((3, 300), np.float32)
    x[1, 7], x[2] = np.nan, -np.inf
    got = run(x, np.array([4, 5, 6]), None, fused=True)
    assert got.tolist() == [[4, 1], [5, 0], [6, 0]]


def test_nan_and_inf_rows_are_flagged_and_the_rest_is_exact() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 4096)).astype(np.float32)
    x[1, 9], x[2, 10] = np.nan, np.inf
    tok = np.array([0, 1, 2, 3])
    got = run(x, tok, 5, fused=True)
    assert got[:, 1].tolist() == [1, 0, 0, 1]
    ok = [0, 3]
    want = expected(x[ok], lse32(x[ok]), tok[ok], 5)
    np.testing.assert_array_equal(got[ok, 2:4], want[:, 2:4])
    np.testing.assert_array_equal(got[ok, 4:], want[:, 4:])


def test_fixed_ids_beside_natural_rows() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 2048)).astype(np.float32)
    fixed = np.array([[9, 4, 9], [-1, -1, -1], [2047, 0, 5]], np.int32)
    tok = np.array([1, 2, 3])
    got = run(x, tok, 3, fused=True, fixed=fixed)
    lp = (x - np.array(mx.logsumexp(mx.array(x), axis=-1, keepdims=True))).astype(np.float32)
    assert got[0, 4:7].tolist() == [9, 4, 9] and got[2, 4:7].tolist() == [2047, 0, 5]
    assert got[1, 4:7].tolist() == np.argsort(-lp[1], kind="stable")[:3].tolist()
    for r in (0, 2):
        np.testing.assert_array_equal(got[r, 7:].view(np.float32), lp[r, fixed[r]])
    np.testing.assert_array_equal(got, run(x, tok, 3, fused=False, fixed=fixed))


def test_fixed_ids_longer_than_the_natural_cap() -> None:
    """A row with 25 fixed ids makes the batch's K 25; a natural row beside it still gets its
    top 20 (the server's cap) in the first 20 slots."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    fixed = np.array([list(range(100, 125)), [-1] * 25], np.int32)
    tok = np.array([0, 1])
    got = run(x, tok, 25, fused=True, fixed=fixed)
    lse = np.array(mx.logsumexp(mx.array(x), axis=-1, keepdims=True))
    want = expected(x, lse, tok, 20)
    assert got[0, 4:29].tolist() == list(range(100, 125))
    np.testing.assert_array_equal(got[1, 4:24], want[1, 4:24])
    np.testing.assert_array_equal(got[1, 29:49], want[1, 24:44])


@pytest.mark.parametrize(("k", "ids"), [(0, None), (1, None), (5, None), (3, [7, 2, 900])])
def test_fused_prompt_blocks_equal_the_ops_path(k: int, ids: list[int] | None) -> None:
    """Prompt scoring's fused blocks (one kernel a block, one packed read) give the entries
    the MLX-ops extraction gives, over several blocks and a padded last one, and both equal a
    numpy float32 log-softmax of the same logits."""
    rng = np.random.default_rng(k)
    n, v = 700, 49152
    logits = mx.array((rng.standard_normal((n, v)) * 4).astype(np.float32)).astype(mx.bfloat16)
    params = SamplingParams(max_tokens=0, prompt_logprobs=k, logprob_token_ids=tuple(ids or ()))
    seq = Sequence("r", list(range(n + 1)), params)
    token_ids = rng.integers(0, v, n).astype(np.int32)
    slices = [PromptSlice(seq, 1, token_ids[:300]), PromptSlice(seq, 301, token_ids[300:])]
    got, want = (
        score(slices, lambda a, b: logits[a:b], DeviceExtractor(f, 256)) for f in (True, False)
    )
    assert got is not None and want is not None
    mx.eval(got.arrays(), want.arrays())
    for (gs, g), (ws, w) in zip(got.to_host(), want.to_host(), strict=True):
        assert gs.first == ws.first
        np.testing.assert_array_equal(g.logprobs, w.logprobs)
        np.testing.assert_array_equal(g.ranks, w.ranks)
        np.testing.assert_array_equal(g.top_logprobs, w.top_logprobs)
        if ids is not None:
            np.testing.assert_array_equal(g.top_ids, w.top_ids)
    x = np.array(logits.astype(mx.float32))
    ref = x - lse32(x)  # independent of both paths; MLX's float32 sum of 49k exps: ~1e-4 off
    pos = np.arange(n)
    entries = [e for _, e in got.to_host()]
    own = np.concatenate([e.logprobs for e in entries])
    np.testing.assert_allclose(own, ref[pos, token_ids], atol=5e-4)
    tops = np.concatenate([e.top_logprobs for e in entries])
    want_tops = ref[:, list(ids)] if ids else -np.sort(-ref, axis=-1)[:, :k]
    np.testing.assert_allclose(tops, want_tops, atol=5e-4)
