"""Sibling projections that read the same input, run as one matmul: a block's `q_proj`,
`k_proj` and `v_proj`, and its `gate_proj` and `up_proj`.

On a GPU the host launches every kernel of a decode step, and a matmul costs it ~10 us
(docs/benchmarks.md, "Decisions"): a llama block's seven become four. The model's own modules
stay where they are, with the same parameter names (weight updates, LoRA adapters and
`tree_flatten` see nothing new): each member's arrays become views into its group's joined
arrays (rows of one buffer, no copy), and the first member called with an input computes the
group's product once; the others take their columns of it. A member called with another input
(a family that projects different tensors) computes the group's product for that input: still
right, only not cheaper.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Names of sibling projections, in the order the families call them.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# What the output rows are joined along, per layer class (quantized layers: scales and biases
# too; their groups run along the input).
_ARRAYS = {
    nn.Linear: ("weight", "bias"),
    nn.QuantizedLinear: ("weight", "scales", "biases", "bias"),
}
ENABLED = os.environ.get("OMLX_FUSE_PROJECTIONS", "1") != "0"


class _Group:
    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self.base = type(members[0])
        self.layer: nn.Module | None = None  # the joined layer, outside the model's tree
        self.bounds: list[tuple[int, int]] = []  # each member's columns of the product
        self._x: mx.array | None = None
        self._y: mx.array | None = None
        self._served = 0

    def join(self) -> None:
        """Join the members' current arrays; theirs become views of the joined ones."""
        layer = copy.copy(self.members[0])
        layer.__class__ = self.base
        start, self.bounds = 0, []
        for m in self.members:
            n = m.weight.shape[0]
            self.bounds.append((start, start + n))
            start += n
        for name in _ARRAYS[self.base]:
            if name in layer:
                layer[name] = mx.concatenate([m[name] for m in self.members], axis=0)
        mx.eval(layer.parameters())
        for m, (a, b) in zip(self.members, self.bounds):
            for name in _ARRAYS[self.base]:
                if name in layer:
                    m[name] = layer[name][a:b]
            mx.eval(m.parameters())
        self.layer = layer
        self._x = self._y = None

    def output(self, member: int, x: mx.array) -> mx.array:
        if x is not self._x:
            assert self.layer is not None
            self._x, self._y, self._served = x, self.layer(x), 0
        assert self._y is not None
        a, b = self.bounds[member]
        y = self._y[..., a:b]
        self._served += 1
        if self._served == len(self.members):  # nothing of this input is kept past its use
            self._x = self._y = None
        return y


def _member_call(self: Any, x: mx.array) -> mx.array:
    return self._fused_group.output(self._fused_index, x)


_MEMBER_CLASSES = {
    base: type(f"Fused{base.__name__}", (base,), {"__call__": _member_call}) for base in _ARRAYS
}


def _signature(layer: Any) -> tuple[Any, ...]:
    """What must be equal for layers to join: class, arrays present, input width, dtype, and
    a quantized layer's quantization."""
    sig: tuple[Any, ...] = (
        type(layer),
        tuple(sorted(layer.keys())),
        layer.weight.shape[1],
        layer.weight.dtype,
    )
    if isinstance(layer, nn.QuantizedLinear):
        sig += (layer.bits, layer.group_size, getattr(layer, "mode", "affine"))
    return sig


def _fits(layers: list[Any]) -> bool:
    """Plain or quantized linear layers (exactly: no subclass, such as a split model's), that
    agree on everything but their output width."""
    return type(layers[0]) in _ARRAYS and len({_signature(m) for m in layers}) == 1


class Fusion:
    """The groups of one model; `rejoin` after its weights were replaced."""

    def __init__(self, model: nn.Module) -> None:
        self.groups: list[_Group] = []
        if not ENABLED:
            return
        for _, module in model.named_modules():
            for names in GROUPS:
                found = [module.get(n) for n in names]
                layers: list[Any] = [m for m in found if isinstance(m, nn.Module)]
                if len(layers) < len(names):
                    continue
                joined = getattr(layers[0], "_fused_group", None)
                if joined is not None and all(a is b for a, b in zip(joined.members, layers)):
                    # Joined by an earlier engine on this model object: the same group serves.
                    self.groups.append(joined)
                    continue
                if not _fits(layers):
                    continue
                group = _Group(layers)
                for i, m in enumerate(layers):
                    m._fused_group, m._fused_index = group, i  # plain attributes
                    m.__class__ = _MEMBER_CLASSES[group.base]
                group.join()
                self.groups.append(group)

    def __len__(self) -> int:
        return len(self.groups)

    def rejoin(self) -> None:
        for group in self.groups:
            group.join()

    def drop(self) -> None:
        """The members' arrays were dropped (/sleep at level 2): the joined ones, which they
        were views of, go too; `rejoin` once new weights are in."""
        for group in self.groups:
            group.layer = None
            group._x = group._y = None
