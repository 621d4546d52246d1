"""New weights for the served model, loaded in place (`POST /update_weights_from_disk`): read
from a directory of safetensors files or from one file, checked against the model's own
parameters (names and shapes) before any is replaced, and cast to the dtypes the model runs in
(so the dtype policy chosen at load holds for every later version)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

# Each parameter's name, shape and dtype: what weights loaded into a model whose own arrays were
# dropped (`drop_weights`) are checked and cast against.
Layout = dict[str, tuple[tuple[int, ...], mx.Dtype]]


class WeightsError(ValueError):
    """The weights cannot replace the served model's (the old ones stay): the message says why."""


def read_weights(path: str) -> dict[str, mx.array]:
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"{path!r} holds no .safetensors files")
    elif p.is_file() and p.suffix == ".safetensors":
        files = [p]
    else:
        raise WeightsError(
            f"{path!r} is neither a directory of safetensors files nor a .safetensors file"
        )
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            loaded = mx.load(str(f))
        except Exception as e:  # a truncated or foreign file
            raise WeightsError(f"{f} could not be read: {e}") from None
        assert isinstance(loaded, dict)  # safetensors: name -> array
        weights.update(loaded)
    return weights


def _examples(names: set[str]) -> str:
    return ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")


def layout_of(model: Any) -> Layout:
    flat: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    return {n: (tuple(w.shape), w.dtype) for n, w in flat.items()}


def drop_weights(model: Any) -> Layout:
    """Replace every parameter with an empty array, so that its memory can go back (/sleep at
    level 2); the layout they had, for `load_into` on waking."""
    layout = layout_of(model)
    model.update(tree_unflatten([(n, mx.zeros((0,), dtype)) for n, (_, dtype) in layout.items()]))
    return layout


def load_into(model: Any, path: str, layout: Layout | None = None) -> None:
    """Replace the model's parameters with those at `path`, all or none; `layout`: what they
    must match when the model's own were dropped (else the model's current ones)."""
    weights = read_weights(path)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    current = layout if layout is not None else layout_of(model)
    missing, unknown = current.keys() - weights.keys(), weights.keys() - current.keys()
    if missing or unknown:
        raise WeightsError(
            f"{path!r} is not a checkpoint of the served model's architecture (or is quantized "
            f"differently): {len(missing)} of its parameters missing ({_examples(missing)}), "
            f"{len(unknown)} unknown ({_examples(unknown)})"
        )
    for name, w in weights.items():
        if tuple(w.shape) != current[name][0]:
            raise WeightsError(
                f"{name} has shape {tuple(w.shape)} in {path!r}, {current[name][0]} "
                "in the served model"
            )
    cast = [
        (n, w if w.dtype == current[n][1] else w.astype(current[n][1])) for n, w in weights.items()
    ]
    # Checked above against the layout: the dropped arrays' empty shapes are not the measure.
    model.load_weights(cast, strict=layout is None)
    mx.eval(model.parameters())
