"""What the model runner learns about a model at start-up, from a few tiny forwards: that it
runs a left-padded batch of its caches' batch forms exactly (three rows prefilled together and
one decode step, each row against its tokens alone), and where its body and head are
(runner/head.py). A family whose batch gives other numbers is refused here rather than served
wrong: mlx-lm's gemma2 attention as mlx-lm ships it, for one, broadcasts the batch's padding
mask over its head axes (an error at most batch sizes, silently wrong ones where the batch size
equals its number of KV heads); the loader fits it (models/padded_batch.py).

The model's own forward is called once (the reference the split is checked against); the rest
goes through the body and head where they are found. Only mlx-lm's families are split and
checked: a scripted model (models/scripted.py) reads left padding as tokens by design, and a
wrapper's forward is its own call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.runner.batch_cache import BatchCache, UnbatchableCache, check_batchable
from omlx_logprobs.runner.head import SplitForward, split_forward
from omlx_logprobs.runner.snapshot import make_prefix, resume_rows, seed

ROWS = [[1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11]]  # left-padded to the longest
NEXT = [12, 13, 14]
# Batched against alone, relative to the logits' scale: float rounding stays far below it (about
# 1e-6 in float32; in 16-bit types other reduction orders, and perhaps an expert routed the
# other way, move logits by a few percent), a row that sees another's keys or its own padding
# moves them by about the scale itself.
TOLERANCE = {mx.float32: 1e-3}
LOW_PRECISION = 0.2


def _refuse(model: Any, why: str) -> UnbatchableCache:
    family = type(model).__module__.rsplit(".", 1)[-1]
    return UnbatchableCache(f"the {family} model cannot run a left-padded batch: {why}")


def probe(model: Any, templates: list[Any]) -> SplitForward | None:
    """The model's body/head split (None: the generic forward); raises UnbatchableCache for a
    model whose caches cannot be batched or whose batch does not equal its rows alone."""
    check_batchable(templates)
    width = max(len(r) for r in ROWS)
    pads = [width - len(r) for r in ROWS]
    ids = mx.array([[0] * p + r for p, r in zip(pads, ROWS)])
    cache = BatchCache.for_prompts(templates, pads)
    try:
        want = model(ids, cache=cache.layers)
        mx.eval(want)
    except Exception as exc:  # noqa: BLE001  (whatever the family raises, said at start-up)
        raise _refuse(model, str(exc)) from exc

    if not type(model).__module__.startswith("mlx_lm.models."):
        # Our own models (scripted ones) and test wrappers: their forward is their own call
        # (a wrapper's body would bypass it), and their batch contract is their own.
        return None

    def fresh() -> list[Any]:
        return BatchCache.for_prompts(templates, pads).layers

    split = split_forward(model, ids, want, fresh)
    forward: Callable[..., mx.array] = model
    if split is not None:
        body, head = split.body, split.head

        def forward(x: mx.array, cache: list[Any]) -> mx.array:
            return head(body(x, cache=cache))

    cache.finish_prefill()
    try:
        got = forward(mx.array(NEXT)[:, None], cache=cache.layers)[:, -1, :]
        alone = [
            forward(mx.array([r + [n]]), cache=BatchCache.for_prompts(templates, [0]).layers)
            for r, n in zip(ROWS, NEXT)
        ]
        ref = mx.concatenate([a[:, -1, :] for a in alone], axis=0)
        mx.eval(got, ref)
    except Exception as exc:  # noqa: BLE001
        raise _refuse(model, str(exc)) from exc
    got32, ref32 = np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32))
    diff = float(np.abs(got32 - ref32).max())
    scale = 1 + float(np.abs(ref32).max())
    if not diff <= TOLERANCE.get(want.dtype, LOW_PRECISION) * scale:
        raise _refuse(model, f"its batched logits differ from each row's alone by {diff:.3g}")
    return split


def step_differs(
    model: Any, templates: list[Any], step: Callable[[mx.array, BatchCache], mx.array], what: str
) -> str | None:
    """Why `step` (another way to run a decode step: compiled, or the lean one) is not the
    model's own forward (None: it is, within rounding): one step of a padded two-row batch,
    against the model's forward on a copy of the same cache."""
    rows, pads = mx.array([[0, 1, 2], [3, 4, 5]]), [1, 0]

    def prefilled() -> BatchCache:
        cache = BatchCache.for_prompts(templates, pads)
        model(rows, cache=cache.layers)
        return cache

    plain, other = prefilled(), prefilled()
    nxt = mx.array([[6], [7]])
    try:
        raw = model(nxt, cache=plain.layers)[:, -1, :]
        want, got = raw.astype(mx.float32), step(nxt, other).astype(mx.float32)
        mx.eval(want, got)
    except Exception as exc:  # noqa: BLE001  (whatever the backend raises: the model's forward)
        return f"{what} failed: {exc}"
    diff = float(np.abs(np.array(got) - np.array(want)).max())
    scale = 1 + float(np.abs(np.array(want)).max())
    # Relative to the logits' scale, as the probe above: rounding (other fusions or reduction
    # orders in 16-bit types) stays far below it, a cache read wrong moves logits by about it.
    tolerance = 1e-3 if raw.dtype == mx.float32 else 0.1
    if not diff <= tolerance * scale:
        return f"{what}'s logits differ from the model's own by {diff:.3g}"
    return None


def resumes_in_a_batch(model: Any, templates: list[Any], forward: Callable[..., mx.array]) -> bool:
    """Whether rows resumed from kept states run right-padded in one forward exactly
    (snapshot.resume_rows): two rows seeded from states after 5 and 3 tokens, fed 4 and 2 more,
    then one decode step, each against its row alone. A family whose recurrent layers ignore a
    row's length (nemotron_h's SSM, as mlx-lm ships it) reads its padding into the state: its
    resumed rows prefill one at a time."""
    held, news, nxt = [[1, 2, 3, 4, 5], [6, 7, 8]], [[9, 10, 11, 12], [13, 14]], [20, 21]
    try:
        starts = [make_prefix(model, tuple(h), None) for h in held]
        rows = resume_rows(model, templates, starts, news)
        first = forward(rows.ids, cache=rows.layers)[mx.arange(len(news)), rows.last]
        rows.finish()
        cache = BatchCache(rows.layers, rows.pads, rows.fed)
        got = [first, forward(mx.array(nxt)[:, None], cache=cache.layers)[:, -1, :]]
        want = []
        for p, n, t in zip(starts, news, nxt):
            alone = make_prompt_cache(model)
            seed(alone, p)
            want.append((forward(mx.array([n]), cache=alone)[:, -1, :],
                         forward(mx.array([[t]]), cache=alone)[:, -1, :]))  # fmt: skip
        ref = [mx.concatenate([w[i] for w in want], axis=0) for i in (0, 1)]
        mx.eval(got, ref)
    except Exception:  # noqa: BLE001  (a family that cannot: one row at a time, as before)
        return False
    for g, r in zip(got, ref):
        g32, r32 = np.array(g.astype(mx.float32)), np.array(r.astype(mx.float32))
        scale = 1 + float(np.abs(r32).max())
        if not float(np.abs(g32 - r32).max()) <= TOLERANCE.get(g.dtype, LOW_PRECISION) * scale:
            return False
    return True
