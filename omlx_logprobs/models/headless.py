"""Checkpoints saved as the base model alone, as Qwen3-Embedding's are (transformers' `AutoModel`:
`embed_tokens.weight`, `layers.*`, `norm.weight`, with no `model.` prefix and no `lm_head`):
mlx-lm's classes name those weights under `model.` and want a head. They load here with the
prefix added and, where the checkpoint has no head of its own, the head tied to the embedding
(Qwen3-Embedding-0.6B ties them anyway; the 4B and 8B were saved without theirs). Such a model's
embeddings are exactly its own; text it generates through a borrowed head means little."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_model, load_tokenizer

PREFIX = "model."
_BODY = ("embed_tokens.", "layers.", "norm.")


def weight_names(path: Path) -> list[str]:
    """The tensor names of a directory's `model*.safetensors` files, from their headers."""
    names: list[str] = []
    for f in sorted(path.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            names += [k for k in json.loads(fh.read(size)) if k != "__metadata__"]
    return names


def is_headless(path: Path) -> bool:
    """Whether the directory's weights are a base model's alone (none under `model.`)."""
    try:
        names = weight_names(path)
    except (OSError, ValueError, struct.error):
        return False
    return bool(names) and all(n.startswith(_BODY) for n in names)


def load_headless(path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer wrapper, config) as mlx-lm's `load` returns them."""
    # mlx-lm's own choice of class by config (private): imported here, so that only such a
    # checkpoint's load depends on it
    from mlx_lm.utils import _get_classes

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        model_class, args_class = _get_classes(config)

        class Prefixed(model_class):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
                named = {PREFIX + k: v for k, v in weights.items()}
                return super().sanitize(named) if hasattr(super(), "sanitize") else named

        # The family's own module and name: the runner knows families by them (runner/probe.py)
        Prefixed.__module__, Prefixed.__qualname__ = (
            model_class.__module__,
            model_class.__qualname__,
        )
        return Prefixed, args_class

    model, config = load_model(
        path, model_config={"tie_word_embeddings": True}, get_model_classes=classes
    )
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config
