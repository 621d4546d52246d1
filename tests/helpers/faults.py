"""Wrappers that inject faults into a model, its tokenizer or its vocabulary. They import no HTTP
stack, so that engine tests use them on a host without it (the GPU host has no `openai`)."""

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


class FailingModel:
    """The tiny model, except that its forward raises from the `fail_at`-th call on: a fault of
    the launch itself (a kernel that cannot be built, memory gone)."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("launch fault injected by the test")
        return self.inner(inputs, cache=cache)


class FaultyTokenizer:
    """The real tokenizer, except that it raises on text holding `marker`."""

    def __init__(self, inner: Any, marker: str) -> None:
        self.inner = inner
        self.marker = marker

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, **kw: Any) -> list[int]:
        if self.marker in text:
            raise RuntimeError("tokenizer fault injected by the test")
        return list(self.inner.encode(text, **kw))


class FaultyBytes(tuple):  # type: ignore[type-arg]
    """A vocabulary byte table that raises when one token id is looked up: a detokenizer fault
    inside the engine thread, hit only by the request that generates that token."""

    poison: int = -1

    def __getitem__(self, i: Any) -> Any:
        if i == self.poison:
            raise KeyError(f"detokenizer fault injected by the test at token {i}")
        return super().__getitem__(i)


class AllocationFault:
    """An embedding layer that fails as MLX does when memory runs out (`[malloc] Unable to
    allocate`) for a prefill whose input holds `poison`: a prompt too large for the device,
    injected where both the model's forward and its body/head split pass."""

    def __init__(self, inner: Any, poison: int) -> None:
        self.inner, self.poison = inner, poison

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, inputs: mx.array) -> mx.array:
        if inputs.shape[-1] > 1 and bool(mx.any(inputs == self.poison)):
            raise RuntimeError("[malloc] Unable to allocate 68719476736 bytes.")
        return self.inner(inputs)
