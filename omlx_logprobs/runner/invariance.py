"""Batch-invariant mode: a token's logits depend on the tokens before it alone, bit for bit.

An RL trainer recomputes the sampled tokens' logprobs with a forward of its own and divides;
any bit by which the server's numbers depend on something else (the other rows of the batch,
a prefix from the cache, the prefill chunk, a speculative verify) is training-inference
mismatch. What made them depend on it on MLX's CPU backend, found by computing one sequence
every way the engine does:

- OpenBLAS picks its kernel by a product's shape (a matrix-vector product for one row, small-
  matrix kernels under a size, the inner dimension split past a block), and its kernels sum in
  other orders: a row's outputs moved with the number of rows beside it, and attention's with
  the number of keys and the left padding. In the mode every product whose rows vary with the
  batch is made of BLAS calls of one shape (runner/fixed_rows.py): rows in blocks of
  `fixed_rows.ROWS`, attention's scores in tiles of ROWS queries and `fixed_rows.KEYS` keys,
  its weighted values a product and a sum over the keys that MLX adds one key after the other.
  OpenBLAS stays loaded: the mode's first version ran on MLX's bundled reference BLAS (an
  unblocked loop, invariant but 22x slower at 32 streams); the products here are invariant on
  either.
- Long prefill attention in numpy (runner/query_blocks.py) sums a softmax pairwise, in an order
  that follows the length of the keys; in the mode every call, a decode step's too, takes
  query_blocks' `_unfused` ops with the products above.

Where the products are installed: `enable` sets `fixed_rows.ON` and replaces, on the classes,
`mlx.nn.Linear.__call__` and `mlx.nn.Embedding.as_linear`. mlx-lm's families call these from
hundreds of modules (and runner/head.py's head, runner/fast/fusion.py's joined projections and
the adapted layers of runner/lora.py are those classes or subclasses of them), so the classes are
the one place that reaches every linear layer; a process serves in the mode or not at all (the
engine turns it on before it builds its runner), so no layer outside the mode shares them. Our own
products read `fixed_rows.ON`: the lean decode step (runner/fast/lean_decode.py) takes the layers
themselves, LoRA's (runner/lora.py, training/lora.py) multiply with `fixed_rows`. With the mode
off nothing is replaced and no product changes. Quantized layers keep MLX's own kernel
(`quantized_matmul`, a loop of MLX's over each row): `check` says whether it keeps the bits.

What stays as it is, because it already depends on nothing else: MLX's CPU softmax and norms
(scalar loops on Linux; padding and the masked columns past a query add exact zeros) and the
host's extraction (numpy, one row at a time). `check` holds the claim at start-up: it computes
one sequence alone in one forward (what runner/scorer.py computes), in a left-padded batch
beside a longer and a shorter row in two chunks, and one token at a time (through the engine's
decode step), alone and behind a longer row's padding, past a tile of keys, and refuses to
serve unless every logit is the same bits. On a backend whose kernels are not invariant (MLX's
CUDA backend: cuBLAS picks its algorithm by shape) it refuses with the difference it measured.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omlx_logprobs.runner import fixed_rows, query_blocks
from omlx_logprobs.runner.batch_cache import BatchCache

__all__ = ["InvarianceError", "check", "enable"]

LENGTH = 24  # the probe sequence's tokens
# The other rows' lengths in the batched prefill: the longer one pads the probe past a tile of
# keys (fixed_rows.KEYS) and past OpenBLAS's small-matrix sizes.
OTHERS = (9, 24 + fixed_rows.KEYS + 30)
BEHIND = fixed_rows.KEYS + 20  # how much longer the row beside the decode steps is
# A decode step the engine takes instead of the model's forward where it serves the batch
# (runner/fast/lean_decode.py): `supports(cache)`, and [B, V] logits of one position.
Step = Any


class InvarianceError(RuntimeError):
    """This process cannot serve batch-invariant logprobs (the message says what differed)."""


def _linear(self: nn.Linear, x: mx.array) -> mx.array:
    y = fixed_rows.product(x, self["weight"].T)
    return y + self["bias"] if "bias" in self else y


def _as_linear(self: nn.Embedding, x: mx.array) -> mx.array:
    return fixed_rows.product(x, self.weight.T)


def enable() -> None:
    """The mode for the rest of the process; call before building the model's runner (see the
    module's docstring for what it replaces)."""
    fixed_rows.ON = True
    nn.Linear.__call__ = _linear  # type: ignore[method-assign]
    nn.Embedding.as_linear = _as_linear  # type: ignore[method-assign]
    query_blocks.exact()


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(0, min(vocab, 32000), n)]


def _logits(model: Any, ids: list[list[int]], cache: BatchCache) -> mx.array:
    out = model(mx.array(ids), cache=cache.layers)
    cache.advance([len(r) for r in ids])
    return out.astype(mx.float32)


def _stepped(step: Step, model: Any, ids: list[list[int]], cache: BatchCache) -> mx.array:
    """One decode position a row, [B, V], through `step` where it serves the batch (as
    ModelRunner.forward_rows takes it), else the model's forward."""
    if step is None or not step.supports(cache):
        return _logits(model, ids, cache)[:, -1]
    cache.advance([1] * len(ids))
    out: mx.array = step(mx.array(ids), cache)
    return out.astype(mx.float32)


def check(model: Any, templates: list[Any], vocab: int, step: Step = None) -> float:
    """Raise InvarianceError unless one sequence's logits come out the same bits every way the
    engine computes them; returns the largest difference (0.0). `step`: the engine's decode
    step, where it has one of its own (runner/plan.py)."""
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
    # the last tokens one at a time: alone, and behind a longer row's padding
    for beside in (False, True):
        head = LENGTH - 6
        rows = [seq[:head]] + ([_ids(head + BEHIND, 7, vocab)] if beside else [])
        width = max(len(r) for r in rows)
        pads = [width - len(r) for r in rows]
        cache = BatchCache.for_prompts(templates, pads)
        _logits(model, [[0] * p + r for p, r in zip(pads, rows)], cache)
        steps = []
        for i in range(head, LENGTH):
            out = _stepped(step, model, [[seq[i]]] + ([[seq[i]]] if beside else []), cache)
            steps.append(np.array(out[0]))
        name = "decode steps beside a row" if beside else "decode steps alone"
        ways[name] = np.concatenate([whole[:head], np.stack(steps)])
    worst = 0.0
    for name, got in ways.items():
        d = float(np.abs(got - whole).max())
        if d or not np.array_equal(got, whole):
            raise InvarianceError(
                f"batch-invariant mode is not available here: {name} differ from one forward "
                f"of the whole sequence by up to {d:.3g} (this backend's kernels sum in an "
                "order that follows the batch's shape: runner/invariance.py)"
            )
        worst = max(worst, d)
    return worst
