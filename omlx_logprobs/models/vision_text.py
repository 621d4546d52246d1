"""The language halves of vision checkpoints whose weight names no mlx-lm module reads, built
as mlx-lm builds LLaVA's (its `mistral3` module tree: a `language_model` wrapping llama's
model), so the runner's caches, prefill and decode paths and its head split serve them as they
serve every text model (models/vision.py)."""

from __future__ import annotations

from typing import Any

from mlx_lm.models import mistral3

__all__ = ["Idefics3Text", "idefics3_classes"]


class Idefics3Text(mistral3.Model):
    """Idefics3's and SmolVLM's llama: its weights under `model.text_model.` (transformers) or
    mlx-vlm's `language_model.` (its head `language_model.lm_head`), the vision tower and the
    connector dropped."""

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        text = {}
        for key, value in weights.items():
            key = key.removeprefix("model.")
            if key.startswith(("text_model.", "language_model.")):
                name = key.split(".", 1)[1]
                text[name if name.startswith("lm_head.") else f"model.{name}"] = value
            elif key.startswith("lm_head."):
                text[key] = value
        kept = self.language_model.sanitize(text)
        return {f"language_model.{k}": v for k, v in kept.items()}


def idefics3_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's `get_model_classes` for Idefics3's language half."""
    return Idefics3Text, mistral3.ModelArgs
