"""The decode batch's KV cache: mlx-lm's BatchKVCache per layer, with each row's left padding
also kept on the host.

`BatchKVCache.filter` reads the padding back from the device to trim it, which waits for every
step queued before it. Keeping the padding here lets rows join and leave while the previous
step still runs on the device.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

# mlx-lm's BatchKVCache allocates `step` (256) columns whenever it runs out: for short requests
# most of them are never used, yet they are zeroed and copied at every join. On the CPU the
# first decode step of a 32-row wave took ~560 ms instead of ~170 (docs/benchmarks.md,
# "Decisions"). On the CPU, caches here grow by what their rows may still write, rounded up, at
# most that step. (A GPU keeps mlx-lm's step: its copies are cheap, and few distinct widths keep
# MLX's per-shape state small, see GPU_PREFILL_ALIGN.)
GROWTH_ALIGN = 16
MAX_GROWTH = BatchKVCache.step


def _aligned(n: int) -> int:
    return max(-(-n // GROWTH_ALIGN) * GROWTH_ALIGN, GROWTH_ALIGN)


class BatchCache:
    def __init__(self, layers: list[Any], pads: list[int]) -> None:
        self.layers = layers  # one BatchKVCache per layer, all with the same rows and width
        self.pads = pads  # left padding of each row, as in every layer's `left_padding`

    @classmethod
    def empty(cls, num_layers: int, pads: list[int]) -> BatchCache:
        """A cache for prompts that will be prefilled together, left-padded by `pads`."""
        return cls([BatchKVCache(pads) for _ in range(num_layers)], list(pads))

    @classmethod
    def seeded(cls, keys: list[mx.array], values: list[mx.array], pads: list[int]) -> BatchCache:
        """A cache for left-padded prompts that all start with one prefix, whose per-layer keys
        and values ([1, heads, P, dim]) fill the first P columns: row i's padding, then the
        prefix's first P - pads[i] tokens. The prefill computes each row from column P on (a
        padded row recomputes the prefix's last pads[i] tokens there)."""
        n = keys[0].shape[2]
        cols = mx.maximum(mx.arange(n)[None, :] - mx.array(pads)[:, None], 0)  # [B, P]
        layers = []
        for k, v in zip(keys, values):
            c = BatchKVCache(pads)
            # Padding columns get the prefix's first token: masked, but never NaN.
            seeded = (mx.take(x[0], cols, axis=1).transpose(1, 0, 2, 3) for x in (k, v))
            c.state = (*seeded, c.offset + n, c.left_padding, n)
            layers.append(c)
        return cls(layers, list(pads))

    @classmethod
    def of_copies(cls, caches: list[Any], n: int) -> BatchCache:
        """One sequence's per-layer KVCache as n identical rows (the n choices of one prompt)."""
        return cls([BatchKVCache.merge([c] * n) for c in caches], [0] * n)

    def __len__(self) -> int:
        return len(self.pads)

    def reserve(self, need: int, width: int = 0) -> None:
        """Size the next allocation, if one is needed: room for `width` columns about to be
        written (a prefill: then exactly one allocation) and for the `need` tokens a row may
        write after them (at most mlx-lm's step)."""
        cols = (_aligned(width) if width else 0) + min(_aligned(need), MAX_GROWTH)
        for c in self.layers:
            c.step = cols

    def extend(self, other: BatchCache) -> None:
        """Append other's rows below these (BatchKVCache.extend right-aligns both)."""
        width = max(self.layers[0]._idx, other.layers[0]._idx)
        mine = [p + width - self.layers[0]._idx for p in self.pads]
        theirs = [p + width - other.layers[0]._idx for p in other.pads]
        for c, o in zip(self.layers, other.layers):
            c.extend(o)
        self.pads = mine + theirs

    def select(self, keep: list[int]) -> BatchCache:
        """These rows as a cache of their own; this one is left as it is (`filter` replaces
        arrays, never writes into them, so shallow copies of the layers suffice)."""
        out = BatchCache([copy.copy(c) for c in self.layers], list(self.pads))
        out.filter(keep)
        return out

    def filter(self, keep: list[int]) -> None:
        """Keep only these rows, and drop the padding columns every remaining row shares."""
        idx = mx.array(keep)
        pads = [self.pads[i] for i in keep]
        trim = min(pads)
        for c in self.layers:
            if c.keys is not None:
                c.keys, c.values = c.keys[idx], c.values[idx]
                if trim:
                    c.keys, c.values = c.keys[..., trim:, :], c.values[..., trim:, :]
            c.offset = c.offset[idx]
            c.left_padding = c.left_padding[idx] - trim
            c._idx -= trim
        self.pads = [p - trim for p in pads]
