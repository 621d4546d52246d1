"""Drafts from a small model that shares the served model's tokenizer (`--draft-model`).

Each speculating row has its own one-row cache in the draft model, holding the ids it was fed.
A proposal first brings that cache to the row's prompt and output (trimming what the target
rejected since, feeding what is new), then takes the draft model's argmax k times, lazily. The
drafts are queued on the device and not read: the verify takes them as its input, so the device
runs the draft steps and the verify back to back while the host builds the verify, and the
host reads the drafts with the verify's result. They are deterministic (a one-hot draft
distribution), so the target verifies them with the same test as a prediction's
(runner/speculation.py)."""

from __future__ import annotations

import time
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.runner.batch_cache import kinds

__all__ = ["DraftModel", "step_seconds"]


# MLX's CUDA backend hands a one-position attention over a cache whose capacity is a multiple
# of 256 (mlx-lm's step) to cuDNN, which builds a graph for each new capacity: a request's draft
# steps stalled 1.2-1.6 s (H100) when its context passed 256. A capacity that is not a multiple
# of 256 stays one as mlx-lm grows it (by 256, from the old capacity or the used length, which
# is not a multiple of 256 when it trims), so each row's first one is made so (`_off_cudnn`).
CUDNN_STEP = 256


class _RowCache:
    def __init__(self, model: Any) -> None:
        self.layers = make_prompt_cache(model)
        self.fed: list[int] = []  # the ids whose keys and values the layers hold, in order
        self.sure = 0  # of those, how many were the row's own (not drafts) when last fed
        # The last proposal's drafts, not read yet: all but the last were fed after `fed`.
        self.unread: mx.array | None = None

    def settle(self) -> None:
        """Take the last drafts into `fed` (read with their verify's result by now: no wait)."""
        if self.unread is not None:
            self.fed += cast(list[int], self.unread.tolist())[:-1]  # `fed` is the row's own list
            self.unread = None


class DraftModel:
    def __init__(self, model: Any, vocab_size: int) -> None:
        found = kinds(make_prompt_cache(model))
        if found != ["KVCache"]:
            raise ValueError(
                f"the draft model's caches ({', '.join(found)}) cannot drop rejected positions:"
                " a draft model needs plain attention layers"
            )
        self.model = model
        self.vocab_size = vocab_size  # the served model's: a draft past it is never proposed
        self._rows: dict[int, _RowCache] = {}

    def forget(self, live: set[int]) -> None:
        """Drop the caches of rows that are gone."""
        for gone in [i for i in self._rows if i not in live]:
            del self._rows[gone]

    def propose(self, seq_id: int, context: list[int], k: int) -> mx.array:
        """k greedy tokens of the draft model after `context` (the row's prompt and output),
        as an int32 array queued on the device and not read. Only ids of the served model's
        vocabulary are proposed (the draft model's may be larger)."""
        row = self._rows.get(seq_id)
        if row is None:
            row = self._rows[seq_id] = _RowCache(self.model)
        row.settle()
        same = row.sure  # drafts after it may have been rejected since
        for a, b in zip(row.fed[same:], context[same:]):
            if a != b:
                break
            same += 1
        same = min(same, len(context) - 1)  # the last token is fed again: its logits are needed
        if same < len(row.fed):
            for c in row.layers:
                c.trim(len(row.fed) - same)
        new = context[same:]
        token = self._next(mx.array([new]), row)
        _off_cudnn(row.layers)
        mx.async_eval(token)  # the device starts while the host builds the other steps
        out = [token]
        for _ in range(k - 1):
            token = self._next(token[:, None], row)
            out.append(token)
        drafts = mx.concatenate(out).astype(mx.int32)
        mx.async_eval(drafts)
        row.fed, row.sure, row.unread = list(context), len(context), drafts
        return drafts

    def _next(self, ids: mx.array, row: _RowCache) -> mx.array:
        logits = self.model(ids, cache=row.layers)[:, -1, : self.vocab_size]
        return mx.argmax(logits, axis=-1)

    def warm(self, k: int) -> None:
        """Feed every length a proposal may feed first (1 to k + 1 new ids, as rejected drafts
        leave) after a short context, and take a step: MLX's CUDA backend builds kernels for
        each shape it meets first, which a request would otherwise wait for."""
        context = [0] * 8
        for n in range(1, k + 2):
            self.propose(-1, context, 1)
            mx.eval(self.propose(-1, context + [1] * n, 2))
        self.forget(set())


def _off_cudnn(layers: list[Any]) -> None:
    """One more position in each cache whose capacity is a multiple of CUDNN_STEP (a row's
    first; see CUDNN_STEP)."""
    for c in layers:
        if c.keys is not None and c.keys.shape[2] % CUDNN_STEP == 0:
            c.keys = mx.concatenate([c.keys, mx.zeros_like(c.keys[..., :1, :])], axis=2)
            c.values = mx.concatenate([c.values, mx.zeros_like(c.values[..., :1, :])], axis=2)


def step_seconds(model: Any, reps: int = 5, width: int = 1) -> float:
    """A forward's time over a short cache for `width` new tokens of one row, evaluated: the
    median of `reps` after two that compile (each call's tokens are trimmed off again). The
    per-row off rule (runner/speculation.py) prices a verify of K drafts (width K + 1) and a
    draft model's step in steps of the served model (width 1)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 32), mx.int32), cache=cache))
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        mx.eval(model(mx.zeros((1, width), mx.int32), cache=cache))
        times.append(time.perf_counter() - t0)
        for c in cache:
            if c.is_trimmable():
                c.trim(width)
    return sorted(times[2:])[reps // 2]
