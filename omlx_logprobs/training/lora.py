"""A LoRA adapter being trained: which of the served model's linear layers it adapts (as
Tinker's `LoraConfig` says), its initial weights (mlx-lm's: lora_a uniform in +-1/sqrt(in),
lora_b zeros), and the model's forward with it added (`attached`), on the base weights the
engine serves (no copy).

A layer adds `(x @ lora_a) @ (scale * lora_b)` in the layer's dtype: the form in which
runner/lora.py serves an adapter (the scale folded into B), so that the trainer's forward and
the sampler's compute the same bits. The scale is ALPHA / rank, as Tinker's LoRA has it.
While `attached` the adapted layers are of a subclass of their class (their parameters and
names unchanged); the engine's thread runs nothing else meanwhile.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from omlx_logprobs.runner import fixed_rows
from omlx_logprobs.runner.lora import layer_dims
from omlx_logprobs.training.calls import LoraSpec

ALPHA = 32.0
Params = dict[str, dict[str, mx.array]]  # layer path -> {"lora_a": [in, r], "lora_b": [r, out]}

_TRAINED: dict[type, type] = {}


class LoraError(ValueError):
    """The adapter asked for cannot be made on this model (the message says why)."""


def _trained(cls: type) -> type:
    """`cls` with the attached adapter's delta added to its output."""
    if cls not in _TRAINED:

        def __call__(self: Any, x: mx.array) -> mx.array:
            y = cls.__call__(self, x)
            a, b = self._train
            if fixed_rows.ON:  # batch-invariant mode: the served adapter's products
                return y + fixed_rows.product(fixed_rows.product(x, a), b).astype(y.dtype)
            return y + ((x @ a) @ b).astype(y.dtype)

        _TRAINED[cls] = type(f"Trained{cls.__name__}", (cls,), {"__call__": __call__})
    return _TRAINED[cls]


def _kind(path: str) -> str | None:
    """ "attn" or "mlp" for a transformer block's linear layer, by the name of its parent."""
    parent = path.rsplit(".", 1)[0].rsplit(".", 1)[-1]
    if "attn" in parent or "attention" in parent:
        return "attn"
    if "mlp" in parent or "feed_forward" in parent:
        return "mlp"
    return None


def choose_layers(model: nn.Module, spec: LoraSpec) -> dict[str, nn.Module]:
    """The transformer blocks' linear layers the spec adapts, by path. The head (`unembed`)
    is not among them: served adapters adapt the blocks alone (runner/lora.py)."""
    if spec.rank < 1:
        raise LoraError(f"the LoRA rank must be at least 1, not {spec.rank}")
    want = {k for k, on in (("attn", spec.attn), ("mlp", spec.mlp)) if on}
    layers = {
        path: m
        for path, m in model.named_modules()
        if ".layers." in f".{path}"
        and isinstance(m, (nn.Linear, nn.QuantizedLinear))
        and _kind(path) in want
    }
    if not layers:
        raise LoraError(
            "no layer to train: train_attn and train_mlp are both off (or the model has"
            " neither), and the head (train_unembed) is not trained here"
        )
    return dict(sorted(layers.items()))


class TrainableLora:
    """The layers one run adapts and how; the weights themselves are the run's (`Params`)."""

    def __init__(self, model: nn.Module, spec: LoraSpec) -> None:
        self.spec = spec
        self.layers = choose_layers(model, spec)
        self.scale = ALPHA / spec.rank

    def initial(self) -> Params:
        """mlx-lm's LoRALinear initialisation, from the spec's seed (float32)."""
        key = mx.random.key(self.spec.seed if self.spec.seed is not None else _fresh_seed())
        params: Params = {}
        for path, layer in self.layers.items():
            key, sub = mx.random.split(key)
            in_dims, out_dims, _ = layer_dims(layer)
            bound = 1 / math.sqrt(in_dims)
            a = mx.random.uniform(-bound, bound, (in_dims, self.spec.rank), key=sub)
            params[path] = {"lora_a": a, "lora_b": mx.zeros((self.spec.rank, out_dims))}
        mx.eval(params)
        return params

    @contextmanager
    def attached(self, params: Params) -> Iterator[None]:
        """The model's forward with these weights added (arrays a gradient may trace)."""
        classes = {}
        try:
            for path, layer in self.layers.items():
                _, _, dtype = layer_dims(layer)
                p = params[path]
                layer._train = (
                    p["lora_a"].astype(dtype),
                    (self.scale * p["lora_b"].astype(mx.float32)).astype(dtype),
                )
                classes[path] = layer.__class__
                layer.__class__ = _trained(layer.__class__)
            yield
        finally:
            for path, cls in classes.items():
                layer = self.layers[path]
                layer.__class__ = cls
                del layer._train

    def served(self, params: Params) -> dict[str, tuple[mx.array, mx.array]]:
        """The weights as runner/lora.py serves them: (lora_a, lora_b) by layer path."""
        return {path: (p["lora_a"], p["lora_b"]) for path, p in params.items()}


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")
