"""The batch-invariant mode's products (runner/fixed_rows.py) on the BLAS this process loaded
(OpenBLAS where it is installed): a row's bits alone, among other rows, at any place of its
block, whether the rows are a multiple of the block or not; attention's scores and weighted
values the same bits whatever the keys' count, the left padding and the keys past a query."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import omlx_logprobs
from omlx_logprobs.runner import fixed_rows


def rand(rng: np.random.Generator, *shape: int) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def bits(x: mx.array) -> bytes:
    return np.array(x).tobytes()


def test_the_loaded_blas_is_named() -> None:
    assert omlx_logprobs.BLAS  # OpenBLAS where installed: the property is measured on it


@pytest.mark.parametrize(("k", "n"), [(576, 576), (1536, 576), (576, 1536), (64, 49152)])
def test_a_rows_product_is_its_own_whatever_else_is_in_it(k: int, n: int) -> None:
    rng = np.random.default_rng(k + n)
    w, row = rand(rng, k, n), rand(rng, 1, k)
    alone = bits(fixed_rows.product(row, w))
    for rows, at in [(2, 1), (7, 3), (8, 7), (9, 8), (16, 0), (37, 20), (300, 299)]:
        x = rand(rng, rows, k)
        x[at] = row[0]
        assert bits(fixed_rows.product(x, w)[at : at + 1]) == alone, (rows, at)
    # leading dimensions flatten into the rows: a [B, L, K] batch
    x = rand(rng, 3, 5, k)
    x[2, 4] = row[0]
    assert bits(fixed_rows.product(x, w)[2, 4][None]) == alone


def test_a_gathered_product_equals_the_product_on_its_rows_weights() -> None:
    rng = np.random.default_rng(1)
    ws = rand(rng, 3, 96, 16)
    x = rand(rng, 5, 96)
    index = mx.array([2, 0, 1, 2, 2], mx.uint32)
    got = fixed_rows.gathered(x, ws, index)
    for b in range(5):
        want = fixed_rows.product(x[b : b + 1], ws[int(index[b])])
        assert bits(got[b : b + 1]) == bits(want), b
    seqs = rand(rng, 2, 11, 96)  # [B, L, K]: each sequence's rows with its own weights
    got = fixed_rows.gathered(seqs, ws, mx.array([1, 2], mx.uint32))
    assert bits(got[1]) == bits(fixed_rows.product(seqs[1], ws[2]))


@pytest.mark.parametrize("d", [64, 128])
def test_attention_products_ignore_padding_and_the_keys_count(d: int) -> None:
    rng = np.random.default_rng(d)
    length = 2100  # past OpenBLAS's small-matrix and inner-block sizes at these widths
    q, k, v = rand(rng, 3, d), rand(rng, length, d), rand(rng, length, d)
    p = mx.softmax(rand(rng, 3, length), axis=-1)
    s_alone = np.array(fixed_rows.scores(q, k))
    o_alone = bits(fixed_rows.weighted(p, v))
    for pad, extra, queries in [(0, 0, 8), (5, 0, 1), (1, 37, 11), (300, 1, 3), (0, 900, 2)]:
        # left padding before the keys, more keys after them (weight 0: past the query)
        kk = mx.concatenate([rand(rng, pad, d), k, rand(rng, extra, d)])
        vv = mx.concatenate([rand(rng, pad, d), v, rand(rng, extra, d)])
        pp = mx.concatenate([mx.zeros((3, pad)), p, mx.zeros((3, extra))], axis=1)
        qq = mx.concatenate([q, rand(rng, queries, d)])
        s = np.array(fixed_rows.scores(qq, kk))[:3, pad : pad + length]
        assert s.tobytes() == s_alone.tobytes(), (pad, extra)
        ppp = mx.concatenate([pp, mx.softmax(rand(rng, queries, pad + length + extra), -1)])
        assert bits(fixed_rows.weighted(ppp, vv)[:3]) == o_alone, (pad, extra)
    for cut in (1, 150, 151, 700):  # fewer keys: the first columns' bits stay
        s = np.array(fixed_rows.scores(q, k[:cut]))
        assert s.tobytes() == np.ascontiguousarray(s_alone[:, :cut]).tobytes(), cut
