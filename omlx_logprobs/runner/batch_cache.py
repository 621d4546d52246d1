"""The decode batch's cache: per layer, the batch class mlx-lm itself batches that layer's cache
with (`make_prompt_cache`'s KVCache -> BatchKVCache, RotatingKVCache -> BatchRotatingKVCache,
ArraysCache -> ArraysCache with a row per sequence, CacheList -> a CacheList of those), joined,
split and trimmed with their `extend`/`filter`/`merge`; each row's left padding of the plain KV
layers also kept on the host.

`BatchKVCache.filter` reads the padding back from the device to trim it, which waits for every
step queued before it. Keeping the padding here lets rows join and leave while the previous
step still runs on the device: the plain KV layers are filtered here, with the host's padding.
The other batch classes filter without reading the device (a sliding window or a state has no
shared padding to trim).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    dynamic_roll,
)

# mlx-lm's BatchKVCache allocates `step` (256) columns whenever it runs out: for short requests
# most of them are never used, yet they are zeroed and copied at every join. On the CPU the
# first decode step of a 32-row wave took ~560 ms instead of ~170 (docs/benchmarks.md,
# "Decisions"). On the CPU, caches here grow by what their rows may still write, rounded up, at
# most that step. (A GPU keeps mlx-lm's step: its copies are cheap, and few distinct widths keep
# MLX's per-shape state small, see runner/plan.py's GPU_PREFILL_ALIGN.)
GROWTH_ALIGN = 16
MAX_GROWTH = BatchKVCache.step


class UnbatchableCache(ValueError):
    """A model that cannot be served in a batch: a cache mlx-lm has no batch class for, or a
    forward whose left-padded batch differs from its rows alone (runner/probe.py)."""


def _aligned(n: int) -> int:
    return max(-(-n // GROWTH_ALIGN) * GROWTH_ALIGN, GROWTH_ALIGN)


def leaves(caches: list[Any]) -> Iterator[Any]:
    """Every cache of a list, those inside CacheLists included."""
    for c in caches:
        if isinstance(c, CacheList):
            yield from leaves(list(c.caches))
        else:
            yield c


def kinds(caches: list[Any]) -> list[str]:
    """The distinct cache classes of a model's caches, in first-seen order (for messages)."""
    return list(dict.fromkeys(type(c).__name__ for c in leaves(caches)))


def batch_form(template: Any, pads: list[int]) -> Any:
    """An empty batch cache of `template`'s kind (one of `make_prompt_cache`'s) for rows
    left-padded by `pads`."""
    kind = type(template)
    if kind is KVCache:
        return BatchKVCache(pads)
    if kind is RotatingKVCache and template.keep == 0:
        return BatchRotatingKVCache(template.max_size, pads)
    if kind is ArraysCache:
        return ArraysCache(len(template.cache), left_padding=pads)
    if kind is CacheList:
        return CacheList(*(batch_form(c, pads) for c in template.caches))
    raise UnbatchableCache(f"{kind.__name__} has no batch form in mlx-lm")


def check_batchable(templates: list[Any]) -> None:
    """Raise UnbatchableCache unless every layer's cache has a batch form."""
    for t in templates:
        batch_form(t, [0])


def _copy(c: Any) -> Any:
    """A layer whose `filter` leaves `c` as it is (filters replace arrays, never write into
    them; a CacheList's children are objects of their own)."""
    if isinstance(c, CacheList):
        return CacheList(*(_copy(x) for x in c.caches))
    return copy.copy(c)


class BatchCache:
    def __init__(self, layers: list[Any], pads: list[int], fed: list[int] | None = None) -> None:
        self.layers = layers  # one batch cache per layer, all with the same rows
        # Left padding of each row, as in every plain KV layer's `left_padding` (all those
        # layers share one width); unused where a model has none.
        self.pads = pads
        # The tokens each row's caches hold: what a recurrent state is the state after (a
        # model of states alone has no KV width to tell it; runner/snapshot.py).
        self.fed = fed if fed is not None else [0] * len(pads)
        self._kv = [c for c in leaves(layers) if type(c) is BatchKVCache]
        self._grow = [c for c in leaves(layers) if type(c) in (BatchKVCache, BatchRotatingKVCache)]

    @classmethod
    def for_prompts(cls, templates: list[Any], pads: list[int]) -> BatchCache:
        """A cache for prompts that will be prefilled together, left-padded by `pads`;
        `templates` are the model's own caches (`make_prompt_cache`), which stay untouched."""
        return cls([batch_form(t, pads) for t in templates], list(pads))

    @classmethod
    def seeded(
        cls, templates: list[Any], keys: list[mx.array], values: list[mx.array], pads: list[int]
    ) -> BatchCache:
        """A cache for left-padded prompts that all start with one prefix, whose per-layer keys
        and values ([1, heads, P, dim], every token's) fill the first P columns: row i's
        padding, then the prefix's first P - pads[i] tokens. The prefill computes each row from
        column P on (a padded row recomputes the prefix's last pads[i] tokens there). Plain KV
        and sliding-window layers only (`templates`, the model's caches, say which): a sliding
        window's rows are then what a prefill of the P columns at once leaves, all P kept."""
        n = keys[0].shape[2]
        cols = mx.maximum(mx.arange(n)[None, :] - mx.array(pads)[:, None], 0)  # [B, P]
        layers: list[Any] = []
        for t, k, v in zip(templates, keys, values):
            # Padding columns get the prefix's first token: masked, but never NaN.
            sk, sv = (mx.take(x[0], cols, axis=1).transpose(1, 0, 2, 3) for x in (k, v))
            if type(t) is RotatingKVCache:
                rotating = BatchRotatingKVCache(t.max_size, pads)
                rotating.state = (
                    sk,
                    sv,
                    rotating.offset + n,
                    rotating.left_padding,
                    t.max_size,
                    n,
                    n,
                    False,
                )
                layers.append(rotating)
            else:
                plain = BatchKVCache(pads)
                plain.state = (sk, sv, plain.offset + n, plain.left_padding, n)
                layers.append(plain)
        return cls(layers, list(pads))

    @classmethod
    def of_copies(cls, caches: list[Any], n: int, tokens: int) -> BatchCache:
        """One sequence's caches (of `make_prompt_cache`'s kinds, holding `tokens`) as n
        identical rows (the n choices of one prompt), each layer merged by its own class's
        `merge`."""
        rows = cls([type(c).merge([c] * n) for c in caches], [0] * n)
        rows.fed = [tokens] * n
        return rows

    def advance(self, fed: list[int]) -> None:
        """Each row's caches took fed[i] more tokens (a prefill, a decode step)."""
        self.fed = [f + n for f, n in zip(self.fed, fed)]

    def __len__(self) -> int:
        return len(self.pads)

    def finish_prefill(self) -> None:
        """After a left-padded prefill: state layers drop their padding (it is consumed; left
        in place it would mask the next step's input of a padded row, for models whose layers
        do not advance it themselves)."""
        for c in leaves(self.layers):
            if type(c) is ArraysCache:
                c.left_padding = None
                c.lengths = None

    def reserve(self, need: int, width: int = 0) -> None:
        """Size the next allocation, if one is needed: room for `width` columns about to be
        written (a prefill: then exactly one allocation) and for the `need` tokens a row may
        write after them (at most mlx-lm's step; a sliding window never grows past itself)."""
        cols = (_aligned(width) if width else 0) + min(_aligned(need), MAX_GROWTH)
        for c in self._grow:
            c.step = cols

    def _width(self) -> int:
        return self._kv[0]._idx if self._kv else 0

    @property
    def width(self) -> int:
        """Columns written so far in the plain KV layers (each row's padding included)."""
        return self._width()

    def extend(self, other: BatchCache) -> None:
        """Append other's rows below these (BatchKVCache.extend right-aligns both)."""
        mine, theirs = self._width(), other._width()
        width = max(mine, theirs)
        pads = [p + width - mine for p in self.pads] + [p + width - theirs for p in other.pads]
        for c, o in zip(self.layers, other.layers):
            c.extend(o)
        self.pads = pads
        self.fed = self.fed + other.fed

    def select(self, keep: list[int]) -> BatchCache:
        """These rows as a cache of their own; this one is left as it is."""
        out = BatchCache([_copy(c) for c in self.layers], list(self.pads), list(self.fed))
        out.filter(keep)
        return out

    def rollback(self, unused: list[int]) -> None:
        """Drop each row's last unused[i] columns (a speculative step's rejected positions;
        plain KV layers only, runner/speculation.py): the columns every row drops are
        trimmed, and a row that drops more is shifted right by the difference, which joins its
        left padding (masked; mlx-lm's own right-padding `finalize` does the same)."""
        common = min(unused)
        shift = [u - common for u in unused]
        moved = mx.array(shift) if any(shift) else None
        for c in self._kv:
            if common:
                c.trim(common)
            if moved is not None:
                c.keys = dynamic_roll(c.keys, moved[:, None], axis=2)
                c.values = dynamic_roll(c.values, moved[:, None], axis=2)
                c.left_padding = c.left_padding + moved
                c.offset = c.offset - moved
        self.pads = [p + s for p, s in zip(self.pads, shift)]
        self.fed = [f - u for f, u in zip(self.fed, unused)]

    def filter(self, keep: list[int], align: int = 1) -> None:
        """Keep only these rows, and drop the padding columns every remaining row shares (a
        multiple of `align` of them)."""
        idx = mx.array(keep)
        pads = [self.pads[i] for i in keep]
        trim = min(pads) // align * align
        for c in leaves(self.layers):
            if type(c) is BatchKVCache:
                if c.keys is not None:
                    c.keys, c.values = c.keys[idx], c.values[idx]
                    if trim:
                        c.keys, c.values = c.keys[..., trim:, :], c.values[..., trim:, :]
                c.offset = c.offset[idx]
                c.left_padding = c.left_padding[idx] - trim
                c._idx -= trim
            else:
                c.filter(idx)
        self.pads = [p - trim for p in pads]
        self.fed = [self.fed[i] for i in keep]
