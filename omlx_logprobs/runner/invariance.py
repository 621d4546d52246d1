"""Batch-invariant mode: a token's logits depend on the tokens before it alone, bit for bit.

An RL trainer recomputes the sampled tokens' logprobs with a forward of its own and divides;
any bit by which the server's numbers depend on something else (the other rows of the batch,
a prefix from the cache, the prefill chunk, a speculative verify) is training-inference
mismatch. What made them depend on it on MLX's CPU backend, found by computing one sequence
every way the engine does:

- OpenBLAS takes a matrix-vector product for a single row (a decode step of one sequence, the
  head on one prompt's last position) and a blocked product for more, and the two sum in
  another order. The reference BLAS that `mlx[cpu]` bundles sums each output in one order
  whatever the rows: the server then starts with it (`OMLX_BLAS=reference`, blas.py; the
  CLI restarts itself so under `--batch-invariant`).
- Long prefill attention in numpy (runner/query_blocks.py) sums a softmax pairwise, in an order
  that follows the length of the keys; `enable` keeps every call on MLX's own ops.

What stays as it is, because it already depends on nothing else: MLX's CPU softmax and
attention (padding and the masked columns past a query add exact zeros), the lean decode step
(the same ops on the same weights), joined projections (runner/fast/fusion.py), and the
host's extraction (numpy, one row at a time). `check` holds the claim at start-up: it computes
one sequence alone in one forward (what runner/scorer.py computes), in a left-padded batch
in two chunks, and one token at a time, alone and beside another row, and refuses to serve
unless every logit is the same bits. On a backend whose kernels are not invariant (MLX's CUDA
backend: cuBLAS picks its algorithm by shape) it refuses with the difference it measured.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from omlx_logprobs.runner import query_blocks
from omlx_logprobs.runner.batch_cache import BatchCache

__all__ = ["InvarianceError", "check", "enable"]

LENGTH = 24  # the probe sequence's tokens
OTHERS = (9, 31)  # the other rows' lengths in the batched prefill


class InvarianceError(RuntimeError):
    """This process cannot serve batch-invariant logprobs (the message says what differed)."""


def enable() -> None:
    """The attention choices of the mode; call before serving (runner/query_blocks.py)."""
    query_blocks.exact()


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(0, min(vocab, 32000), n)]


def _logits(model: Any, ids: list[list[int]], cache: BatchCache) -> mx.array:
    out = model(mx.array(ids), cache=cache.layers)
    cache.advance([len(r) for r in ids])
    return out.astype(mx.float32)


def check(model: Any, templates: list[Any], vocab: int) -> float:
    """Raise InvarianceError unless one sequence's logits come out the same bits every way the
    engine computes them; returns the largest difference (0.0)."""
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
                "order that follows the batch's shape; on Linux's CPU backend start with "
                "OMLX_BLAS=reference, as `omlx-logprobs serve --batch-invariant` does)"
            )
        worst = max(worst, d)
    return worst
