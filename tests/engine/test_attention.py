"""The decode step's masked attention kernel (runner/fast/attention.py) against a float32 softmax
computed in numpy from the same inputs; the kernel itself runs on MLX's CUDA backend only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.runner.fast import attention

ON_CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()
cuda = pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")


def reference(q, k, v, scale, mask) -> np.ndarray:  # type: ignore[no-untyped-def]
    """float32 [B, Hq, 1, D] from numpy, the mask bool (attend) or additive."""
    q32, k32, v32 = (np.array(a.astype(mx.float32)) for a in (q, k, v))
    m = np.array(mask.astype(mx.float32)) if mask.dtype != mx.bool_ else np.array(mask)
    b, hq, _, d = q32.shape
    rep = hq // k32.shape[1]
    k32, v32 = np.repeat(k32, rep, axis=1), np.repeat(v32, rep, axis=1)
    scores = np.einsum("bhqd,bhkd->bhqk", q32 * scale, k32)
    if m.dtype == np.bool_:
        scores = np.where(np.broadcast_to(m, scores.shape), scores, -np.inf)
    else:
        scores = scores + m
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, v32)


def inputs(dtype, b, hq, hkv, d, length, seed=0):  # type: ignore[no-untyped-def]
    """q, and k and v as views of a wider cache buffer (as a KV cache hands them over)."""
    mx.random.seed(seed)
    q = mx.random.normal((b, hq, 1, d)).astype(dtype)
    cap = length + 40
    kbuf = mx.random.normal((b, hkv, cap, d)).astype(dtype)
    vbuf = mx.random.normal((b, hkv, cap, d)).astype(dtype)
    return q, kbuf[:, :, :length, :], vbuf[:, :, :length, :]


def padded_mask(b: int, length: int) -> mx.array:
    pads = mx.array([(3 * i) % length for i in range(b)])
    return pads[:, None, None, None] <= mx.arange(length)[None, None, None, :]


TOL = {mx.float32: 2e-5, mx.bfloat16: 2e-2, mx.float16: 4e-3}


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    ("hq", "hkv", "d"), [(8, 2, 64), (4, 4, 128), (12, 3, 64), (2, 1, 256), (16, 2, 32)]
)
@pytest.mark.parametrize("length", [1, 37, 300])
def test_bool_mask_matches_a_float32_softmax(dtype, hq, hkv, d, length) -> None:  # type: ignore[no-untyped-def]
    q, k, v = inputs(dtype, 5, hq, hkv, d, length)
    mask = padded_mask(5, length)
    assert attention.fits(q, k, v, mask, None, None)
    got = attention.decode_attention(q, k, v, d**-0.5, mask)
    assert got.dtype == dtype and got.shape == (5, hq, 1, d)
    ref = reference(q, k, v, d**-0.5, mask)
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), ref, atol=TOL[dtype], rtol=TOL[dtype]
    )


@cuda
def test_additive_mask() -> None:
    q, k, v = inputs(mx.float32, 3, 4, 2, 64, 50, seed=1)
    mx.random.seed(2)
    add = mx.random.normal((3, 1, 1, 50)) * 3
    add = mx.where(mx.arange(50)[None, None, None, :] < 7, -mx.inf, add)  # the first 7 masked
    got = attention.decode_attention(q, k, v, 0.125, add)
    np.testing.assert_allclose(np.array(got), reference(q, k, v, 0.125, add), atol=2e-5, rtol=2e-5)


@cuda
def test_installed_route_is_taken_only_for_its_case() -> None:
    q, k, v = inputs(mx.bfloat16, 4, 8, 2, 64, 20, seed=3)
    mask = padded_mask(4, 20)
    assert attention.install()
    routed = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    np.testing.assert_array_equal(
        np.array(routed.astype(mx.float32)),
        np.array(attention.decode_attention(q, k, v, 0.125, mask).astype(mx.float32)),
    )
    # No mask, or more than one query position: MLX's own kernels, the same values within rounding.
    plain = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    ones = mx.ones((4, 1, 1, 20), mx.bool_)
    np.testing.assert_allclose(
        np.array(plain.astype(mx.float32)),
        np.array(attention.decode_attention(q, k, v, 0.125, ones).astype(mx.float32)),
        atol=2e-2,
    )


def test_fits_only_one_masked_query_position() -> None:
    q = mx.zeros((2, 4, 1, 64))
    k = v = mx.zeros((2, 2, 9, 64))
    mask = mx.ones((2, 1, 1, 9), mx.bool_)
    assert attention.fits(q, k, v, mask, None, None)
    assert not attention.fits(q, k, v, None, None, None)  # MLX's vector kernel has it
    assert not attention.fits(q, k, v, "causal", None, None)
    assert not attention.fits(q, k, v, mask, mx.zeros((4,)), None)  # sinks
    assert not attention.fits(
        mx.zeros((2, 4, 2, 64)), k, v, mx.ones((2, 1, 2, 9), mx.bool_), None, None
    )
    assert not attention.fits(q, k, v, mx.ones((2, 1, 1, 8), mx.bool_), None, None)
    assert not attention.fits(mx.zeros((2, 3, 1, 64)), k, v, mask, None, None)  # 3 heads over 2
    assert not attention.fits(q, k, v, mx.ones((2, 4, 1, 9), mx.bool_), None, None)  # per head
    assert not attention.fits(mx.zeros((2, 18, 1, 64)), k, v, mask, None, None)  # 9 heads a KV head
    long_kv, long_mask = mx.zeros((2, 2, 4096, 64)), mx.ones((2, 1, 1, 4096), mx.bool_)
    assert not attention.fits(q, long_kv, long_kv, long_mask, None, None)  # 4 blocks, long
    kv80 = mx.zeros((2, 2, 9, 80))
    assert not attention.fits(mx.zeros((2, 4, 1, 80)), kv80, kv80, mask, None, None)
    assert not attention.fits(q, k, v, mask.astype(mx.int32), None, None)
    assert not attention.fits(
        mx.zeros((2, 4, 1, 512)),
        mx.zeros((2, 2, 9, 512)),
        mx.zeros((2, 2, 9, 512)),
        mask,
        None,
        None,
    )


def test_not_installed_without_cuda() -> None:
    if ON_CUDA:
        pytest.skip("a CUDA host")
    assert not attention.install()
    assert mx.fast.scaled_dot_product_attention is attention._mlx_sdpa
