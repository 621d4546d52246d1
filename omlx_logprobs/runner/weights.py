"""New weights for the served model, loaded in place (`POST /update_weights_from_disk`): read
from a directory of safetensors files or from one file, checked against the model's own
parameters (names and shapes) before any is replaced, and cast to the dtypes the model runs in
(so the dtype policy chosen at load holds for every later version)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


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


def load_into(model: Any, path: str) -> None:
    """Replace the model's parameters with those at `path`, all or none."""
    weights = read_weights(path)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    current = dict(tree_flatten(model.parameters()))
    missing, unknown = current.keys() - weights.keys(), weights.keys() - current.keys()
    if missing or unknown:
        raise WeightsError(
            f"{path!r} is not a checkpoint of the served model's architecture (or is quantized "
            f"differently): {len(missing)} of its parameters missing ({_examples(missing)}), "
            f"{len(unknown)} unknown ({_examples(unknown)})"
        )
    for name, w in weights.items():
        if w.shape != current[name].shape:
            raise WeightsError(
                f"{name} has shape {tuple(w.shape)} in {path!r}, {tuple(current[name].shape)} "
                "in the served model"
            )
    cast = [
        (n, w if w.dtype == current[n].dtype else w.astype(current[n].dtype))
        for n, w in weights.items()
    ]
    model.load_weights(cast, strict=True)
    mx.eval(model.parameters())
