"""Model wrappers that inject faults. Kept apart from the server fixtures so that engine tests
import them on a host without the HTTP stack (the GPU host has no `openai`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class PoisonModel:
    """The tiny model, except that every row whose input holds `poison` gets NaN logits: a fault
    inside one request, as a broken kernel or a bad weight would give."""

    def __init__(self, inner: Any, poison: int) -> None:
        self.inner = inner
        self.poison = poison

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        out = self.inner(inputs, cache=cache)
        bad = mx.any(inputs == self.poison, axis=1)[:, None, None]
        return mx.where(bad, mx.array(float("nan"), dtype=out.dtype), out)
