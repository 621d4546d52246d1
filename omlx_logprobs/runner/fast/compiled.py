"""The decode forward as one compiled MLX function (`mx.compile`), for models whose every layer
caches plain keys and values (mlx-lm's `BatchKVCache`).

On a GPU the decode step is bound by the host: the model's Python builds ~25 graph nodes per
layer each step, and MLX launches a kernel for each. A compiled function is traced once per
input shape; later calls replay the traced graph from C++ (no Python per layer) with its
elementwise chains fused into fewer kernels. What keeps the shapes fixed from step to step:

- attention reads the cache's whole allocated width, the columns not yet written or left of a
  row's padding masked out (exp(-inf) adds nothing to a row's softmax);
- the new keys and values are written at an index given as an array (`mx.slice_update` with a
  dynamic start), not baked into the graph;
- the width is kept a multiple of `WIDTH_ALIGN`, so a trace serves every step until the cache
  grows; rows joining and leaving change the batch size, one trace per size met.

The model's weights are constants of the traces: `reset` drops them when the weights change.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.probe import step_differs

# Columns a cache grows by, and what its width stays a multiple of (mlx-lm's own step: the
# widths a GPU meets without compilation too).
WIDTH_ALIGN = BatchKVCache.step


class _Slot:
    """One layer's cache inside the traced function: the full-width keys and values, the rows'
    positions (for RoPE) and the mask of the columns a row attends to."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, mask: mx.array):
        self.keys, self.values, self.offset, self._mask = keys, values, offset, mask
        self._at: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        assert self._at is not None
        self.keys = mx.slice_update(self.keys, keys, self._at, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._at, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, **kwargs: Any) -> mx.array:
        return self._mask


def attended(cols: mx.array, pads: mx.array, at: Any) -> mx.array:
    """[B, 1, 1, width]: the columns each row attends to at a decode step over a cache's whole
    width, from its left padding to the column written now (`at`)."""
    return ((cols >= pads[:, None]) & (cols <= at))[:, None, None, :]


def check(model: Any, templates: list[Any], lean: Any = None) -> str | None:
    """Why the model's decode cannot be compiled (None: it can): its caches are not all plain
    KV ones, or one compiled step of a padded two-row batch fails or gives other logits than
    the model's own forward (a backend without an op the traced graph uses, a family whose
    attention reads the cache another way). At start-up, on a tiny batch."""
    if not type(model).__module__.startswith("mlx_lm.models."):
        # Scripted models and wrappers: their forward is Python of their own, which a trace
        # would run once and then skip.
        return "it is not one of mlx-lm's families"
    if not all(type(t) is KVCache for t in templates):
        return "its caches are not all plain KV caches"
    return step_differs(model, templates, CompiledDecode(model, lean), "a compiled step")


def supports(cache: BatchCache) -> bool:
    """Whether the batch's layers are all plain KV caches, holding keys (a decoding batch)."""
    return all(type(c) is BatchKVCache and c.keys is not None for c in cache.layers)


class CompiledDecode:
    supports = staticmethod(supports)

    def __init__(self, model: Any, lean: Any = None) -> None:
        """`lean`: runner/fast/lean_decode.py's step, traced in place of the model's forward."""
        self.model, self.lean = model, lean
        self._fn: Any = None
        self.reset()

    def reset(self) -> None:
        """Forget the traces (the weights changed: they are constants of the traces)."""
        if self.lean is not None:
            self.lean.reset()
            self.lean.blocks()  # its weights' transposes, evaluated outside any trace
        self._fn = mx.compile(self._forward)

    def forget(self) -> None:
        """Drop the traces and transposes, which hold the weights (dropped by /sleep at level
        2); `reset` once new weights are in."""
        if self.lean is not None:
            self.lean.reset()
        self._fn = None

    def _forward(
        self, inputs: mx.array, at: mx.array, offset: mx.array, pads: mx.array, *kv: mx.array
    ) -> list[mx.array]:
        n = len(kv) // 2
        width = kv[0].shape[2]
        mask = attended(mx.arange(width), pads, at)
        slots = [_Slot(kv[i], kv[n + i], offset, mask) for i in range(n)]
        for s in slots:
            s._at = at
        if self.lean is not None:
            logits = self.lean.slots_forward(inputs, slots)
        else:
            logits = self.model(inputs, cache=slots)[:, -1, :]
        return [logits, *(s.keys for s in slots), *(s.values for s in slots)]

    def __call__(self, inputs: mx.array, cache: BatchCache) -> mx.array:
        """[B, V] logits of the batch's next position; the cache advanced by one column."""
        layers: list[Any] = cache.layers  # BatchKVCache, each holding keys
        first = layers[0]
        idx = first._idx
        width = first.keys.shape[2]
        if width % WIDTH_ALIGN or idx >= width:  # columns from idx on hold nothing yet
            _widen(layers, (idx // WIDTH_ALIGN + 1) * WIDTH_ALIGN)
        keys = [c.keys for c in layers]
        values = [c.values for c in layers]
        out = self._fn(
            inputs, mx.array([idx], mx.int32), first.offset, first.left_padding, *keys, *values
        )
        n = len(layers)
        # One new positions array for every layer: they are equal, and each layer's is only
        # ever replaced, never written in place (BatchCache.filter and extend make new ones).
        offset = first.offset + 1
        for i, c in enumerate(layers):
            c.keys, c.values = out[1 + i], out[1 + n + i]
            c.offset = offset
            c._idx = idx + 1
        return out[0]


def _widen(layers: list[Any], width: int) -> None:
    """Zero columns on the right up to `width` (a copy of the cache: when it grows, or after
    a join or a trim left it at another width)."""
    for c in layers:
        extra = width - c.keys.shape[2]
        if extra > 0:
            pad = [(0, 0), (0, 0), (0, extra), (0, 0)]
            c.keys, c.values = mx.pad(c.keys, pad), mx.pad(c.values, pad)
        elif extra < 0:
            c.keys, c.values = c.keys[..., :width, :], c.values[..., :width, :]
