"""Pipeline parallelism over layers for the families whose mlx-lm model has none (llama,
qwen3): the same split as mlx-lm's own pipeline (mlx_lm/models/pipeline.py), made from outside
the family's code.

Each process holds a contiguous range of the layers, rank 0 the last ones, the low ranks one
more where the count does not divide (mlx-lm's even split). The first layer this process holds
takes its input from the rank after it (`recv_like`: the embedding it replaces is then never
computed) and its last layer's output is sent to the rank before it; the body's output, the
last stage's, reaches every rank by an all-gather, so every rank's forward returns what one
process's would and every rank's runner reads the same hidden states.

Why only these families: the other layers are dropped from the body's list (the caches follow
the list), so every index the body's forward takes into its layers or caches must mean the same
in the held range. Llama's and Qwen3's forward is the embedding, each layer on its own cache
under one mask made from the first cache, then the norm: true while every layer is full
attention (a llama with sliding-window layers picks its masks by global index, and gets no
pipeline)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

FAMILIES = ("llama", "qwen3")


def family(net: Any) -> str:
    return str(type(net).__module__).rsplit(".", 1)[-1]


def eligible(net: Any) -> bool:
    """Whether this model can be split by the runner's own layer ranges."""
    if family(net) not in FAMILIES or not hasattr(net, "model"):
        return False
    body = net.model
    if getattr(body, "swa_idx", None) is not None:  # llama's sliding-window layers
        return False
    return isinstance(getattr(body, "layers", None), list) and len(body.layers) > 0


def ranges(layers: int, size: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) of the layers, as mlx-lm's pipeline splits them: rank 0 the
    last ones, the low ranks one more where `size` does not divide `layers`."""
    base, extra = divmod(layers, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    out = []
    for r in range(size):
        start = sum(counts[r + 1 :])
        out.append((start, start + counts[r]))
    return out


def split(net: Any, group: Any) -> tuple[int, int]:
    """Keep this rank's layers of `net` (eligible; at least one layer a rank) and make its
    forward a stage of the pipeline over `group`; the [start, end) held."""
    rank, size = group.rank(), group.size()
    body = net.model
    start, end = ranges(len(body.layers), size)[rank]
    held = body.layers[start:end]
    body.layers = held
    first = rank < size - 1  # a rank after this one runs the layers before
    last = rank > 0  # a rank before this one runs the layers after
    if first:
        _wrap(held[0], _receiving(rank + 1, group))
    if last:
        _wrap(held[-1], _sending(rank - 1, group))
    _wrap(body, _gathering(group))
    return start, end


def _receiving(src: int, group: Any) -> Any:
    def call(inner: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        return inner(mx.distributed.recv_like(x, src, group=group), *args, **kwargs)

    return call


def _sending(dst: int, group: Any) -> Any:
    def call(inner: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        return mx.distributed.send(inner(x, *args, **kwargs), dst, group=group)

    return call


def _gathering(group: Any) -> Any:
    # Every rank's output in the graph (each stage's sends run), rank 0's rows kept: the last
    # stage's. The norm after the layers is per row, so gathering after it is the same.
    def call(inner: Any, *args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        return mx.distributed.all_gather(out, group=group)[: out.shape[0]]

    return call


def _wrap(module: Any, around: Any) -> None:
    """Give this one module a `__call__` that runs `around(its own call, ...)` (a subclass of
    its class, as distributed/group_model.py orders forwards: Python looks `__call__` up on the
    class)."""
    cls = type(module)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        return around(lambda *a, **k: cls.__call__(self, *a, **k), *args, **kwargs)

    module.__class__ = type(cls.__name__, (cls,), {"__call__": wrapped})
