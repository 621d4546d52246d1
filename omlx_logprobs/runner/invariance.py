"""Batch-invariant mode: a token's logits depend on the tokens before it alone, bit for bit.

An RL trainer recomputes the sampled tokens' logprobs with a forward of its own and divides;
any bit by which the server's numbers depend on something else (the other rows of the batch,
a prefix from the cache, the prefill chunk, a speculative verify) is training-inference
mismatch. What made them depend on it on MLX's CPU backend, found by computing one sequence
every way the engine does:

- OpenBLAS computes a small product (a decode step's few rows, short attention) with other
  kernels than a large one, and sums the values' product over the keys in blocks whose
  boundaries move with a row's left padding and with the keys past a query. Under OpenBLAS
  the mode computes every linear layer, tied head and attention call through
  runner/ordered_blas.py, which keeps each product on one route whatever the batch; where no
  OpenBLAS is loaded, MLX's bundled reference BLAS sums each output in one order whatever the
  rows (`OMLX_BLAS=reference` chooses it, blas.py).
- Long prefill attention in numpy (runner/query_blocks.py) sums a softmax pairwise, in an order
  that follows the length of the keys; `enable` keeps every call on MLX's own ops.

What stays as it is, because it already depends on nothing else: MLX's CPU softmax and
attention (padding and the masked columns past a query add exact zeros), the lean decode step
(the same ops on the same weights), joined projections (runner/fast/fusion.py), and the
host's extraction (numpy, one row at a time). `check` holds the claim at start-up: it computes
one sequence alone in one forward (what runner/scorer.py computes), in a left-padded batch
in two chunks, and one token at a time, alone and beside another row, and refuses to serve
unless every logit is the same bits; under OpenBLAS it also computes every linear layer's
product at many row counts, and attention over long keys (past OpenBLAS's blocks) left-padded
by several widths, decoded and in prefill chunks (`_products`). On a backend whose kernels are
not invariant (MLX's CUDA backend: cuBLAS picks its algorithm by shape) it refuses with the
difference it measured.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omlx_logprobs.runner import ordered_blas, query_blocks
from omlx_logprobs.runner.batch_cache import BatchCache

__all__ = ["InvarianceError", "check", "enable"]

LENGTH = 24  # the probe sequence's tokens
OTHERS = (9, 31)  # the other rows' lengths in the batched prefill
# Under OpenBLAS (`_products`): the row counts of every linear product; attention's keys (past
# OpenBLAS's blocks of 256-320), left paddings and prefill chunk.
ROWS = (*range(1, 17), 31, 64)
KEYS, PADS, CHUNK = 700, (0, 1, 37, 300), 48


class InvarianceError(RuntimeError):
    """This process cannot serve batch-invariant logprobs (the message says what differed)."""


def enable() -> None:
    """The attention choices of the mode; call before serving (runner/query_blocks.py)."""
    query_blocks.exact()
    if ordered_blas.available():
        ordered_blas.install()


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(0, min(vocab, 32000), n)]


def _logits(model: Any, ids: list[list[int]], cache: BatchCache) -> mx.array:
    out = model(mx.array(ids), cache=cache.layers)
    cache.advance([len(r) for r in ids])
    return out.astype(mx.float32)


def _rows_differ(wt: mx.array) -> int:
    """The first row count in ROWS at which `x @ wt` differs from the same rows of a product of
    more rows (0: none)."""
    x = mx.random.normal((max(ROWS), wt.shape[0]), key=mx.random.key(3)).astype(wt.dtype)
    full = np.array(ordered_blas.linear(x, wt))
    for m in ROWS:
        if not np.array_equal(np.array(ordered_blas.linear(x[:m], wt)), full[:m]):
            return m
    return 0


def _attention_differs(heads: int, kv_heads: int, width: int) -> str:
    """Where attention over KEYS keys, left-padded by PADS in a batch of two, decoded one query
    at a time and in a prefill chunk, differs from one call over the sequence alone ('':
    nowhere)."""
    r = mx.random.split(mx.random.key(4), 3)
    q = mx.random.normal((1, heads, KEYS, width), key=r[0])
    k, v = (mx.random.normal((1, kv_heads, KEYS, width), key=x) for x in r[1:])
    scale = width**-0.5
    alone = np.array(query_blocks._sdpa(q, k, v, scale=scale, mask="causal"))[0]
    for pad in PADS:
        n = KEYS + pad
        kp, vp = (mx.pad(x, [(1, 0), (0, 0), (pad, 0), (0, 0)]) for x in (k, v))
        kp, vp = (mx.concatenate([x[1:], x[:1] + 1], axis=0) for x in (kp, vp))
        real = mx.arange(n) >= pad
        for lq in (1, CHUNK):  # the last lq queries: decode steps, then one prefill chunk
            for end in (KEYS - 2 * CHUNK, KEYS):
                at = end + pad
                qp = mx.pad(q[:, :, end - lq : end], [(0, 1), (0, 0), (0, 0), (0, 0)])
                causal = mx.arange(at - lq, at)[:, None] >= mx.arange(at)[None]
                mask = (causal & real[None, :at])[None, None]
                mask = mx.concatenate([mask, mx.broadcast_to(causal[None, None], mask.shape)])
                got = query_blocks._sdpa(qp, kp[:, :, :at], vp[:, :, :at], scale=scale, mask=mask)
                if not np.array_equal(np.array(got)[0], alone[:, end - lq : end]):
                    return f"{lq} queries at {end} of {KEYS} keys left-padded by {pad}"
    return ""


def _products(model: Any) -> str:
    """Under OpenBLAS: every distinct linear product of the model at ROWS row counts, and
    attention at the model's head shape; what differed ('': nothing)."""
    shapes: dict[tuple[int, ...], mx.array] = {}
    for _, m in model.named_modules():
        own = m.get("weight") if isinstance(m, (nn.Linear, nn.Embedding)) else None
        joined = getattr(m, "_fused_group", None)  # runner/fast/fusion.py's joined product
        for w in (own, joined.layer.weight if joined and joined.layer else None):
            if w is not None and w.dtype == mx.float32:
                shapes.setdefault(tuple(w.shape), w)
    for shape, w in shapes.items():
        if m := _rows_differ(w.T):
            return f"a {shape[1]} x {shape[0]} product of {m} rows"
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", 2)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    width = getattr(args, "head_dim", None) or getattr(args, "hidden_size", 64 * heads) // heads
    where = _attention_differs(heads, kv_heads, width)
    return f"attention: {where}" if where else ""


def check(model: Any, templates: list[Any], vocab: int) -> float:
    """Raise InvarianceError unless one sequence's logits come out the same bits every way the
    engine computes them; returns the largest difference (0.0)."""
    if ordered_blas.ACTIVE and (where := _products(model)):
        raise InvarianceError(
            f"batch-invariant mode is not available with this OpenBLAS: {where} differs from "
            "the same rows computed in another shape (start with OMLX_BLAS=reference for "
            "MLX's reference BLAS; runner/ordered_blas.py)"
        )
    seq = _ids(LENGTH, 0, vocab)
    whole = np.array(_logits(model, [seq], BatchCache.for_prompts(templates, [0]))[0])
    ways: dict[str, np.ndarray] = {}
    # left-padded among longer and shorter rows, in two chunks
    rows = [seq] + [_ids(n, 1 + i, vocab) for i, n in enumerate(OTHERS)]
    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    padded = [[0] * p + r for p, r in zip(pads, rows)]
    cache = BatchCache.for_prompts(templates, pads)
    cut = pads[0] + LENGTH // 2
    first = _logits(model, [r[:cut] for r in padded], cache)
    rest = _logits(model, [r[cut:] for r in padded], cache)
    ways["a batch, two chunks"] = np.array(mx.concatenate([first, rest], axis=1)[0, pads[0] :])
    # the last tokens one at a time: alone, and beside a row of another length
    for beside in (False, True):
        head = LENGTH - 6
        rows = [seq[:head]] + ([_ids(head - 5, 7, vocab)] if beside else [])
        pads = [head - len(r) for r in rows]
        cache = BatchCache.for_prompts(templates, pads)
        _logits(model, [[0] * p + r for p, r in zip(pads, rows)], cache)
        steps = []
        for i in range(head, LENGTH):
            step = _logits(model, [[seq[i]]] + ([[seq[i]]] if beside else []), cache)
            steps.append(np.array(step[0, 0]))
        name = "decode steps beside a row" if beside else "decode steps alone"
        ways[name] = np.concatenate([whole[:head], np.stack(steps)])
    worst = 0.0
    for name, got in ways.items():
        d = float(np.abs(got - whole).max())
        if d or not np.array_equal(got, whole):
            raise InvarianceError(
                f"batch-invariant mode is not available here: {name} differ from one forward "
                f"of the whole sequence by up to {d:.3g} (this backend's kernels sum in an "
                "order that follows the batch's shape; on Linux's CPU backend, MLX's reference "
                "BLAS, OMLX_BLAS=reference, sums in one order)"
            )
        worst = max(worst, d)
    return worst
