"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: their text config, their multimodal positions (M-RoPE),
their encoder (mlx-vlm's vision tower with its patch merger; Qwen3-VL's deepstack mergers too)
and their processor (transformers', without the video processor, which needs torchvision).
The text half is models/qwen_vl_text.py.

M-RoPE gives each image placeholder three positions (its frame, row and column in the image's
grid of merged patches, after the text before it) and the text after an image continues from
the largest of them plus one; a text token's three positions are equal, and its rotation is
then the plain 1-D one at that position. So:

- a forward over rows that hold a prompt with images is given each column's three positions
  (`position_ids`, [3, B, L]: `positions`), and every attention layer rotates by them;
- after its prefill, such a row's decode positions run behind (or ahead of) its count of
  tokens by its delta (its prompt's largest position plus one, less its length), which the
  runner adds to the row's cache offset once (runner/vision.py): mlx-lm's rotation of every
  decode step (position = cache offset, per row) then gives it the M-RoPE position;
- every other forward (text prompts, decode steps) is mlx-lm's own, unchanged.

Qwen3-VL's tower also gives, for some of its layers, rows that are added to the hidden states
of the text model's first layers at the image's positions (deepstack): the encoder gives them
after the image's rows ([1 + k, N, hidden]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["merged_grid", "positions", "qwen_encoder", "qwen_processor", "qwen_text"]


def positions(images: Any, n: int) -> np.ndarray:
    """[3, n] the M-RoPE positions (frame, row, column) of a prompt's first n tokens, as
    transformers' `get_rope_index` gives them for images: text positions count on from the
    last one; an image's placeholders (one run of t x h x w merged patches, in the processor's
    order) are at the position after the text before it plus their frame, row and column."""
    out = np.empty((3, n), np.int64)
    at = nxt = 0  # the prompt position written up to; the next text position
    for image in sorted(images, key=lambda i: i.start):
        if image.start >= n:
            break
        text = image.start - at
        out[:, at : image.start] = nxt + np.arange(text)
        nxt += text
        t, h, w = merged_grid(image)
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        placed = grid.reshape(3, -1) + nxt
        end = min(image.start + placed.shape[1], n)
        out[:, image.start : end] = placed[:, : end - image.start]
        nxt, at = int(placed.max()) + 1, image.start + placed.shape[1]
    if at < n:
        out[:, at:n] = nxt + np.arange(n - at)
    return out


def merged_grid(image: Any) -> tuple[int, int, int]:
    """An image's grid of placeholders (frames, rows, columns): its pixel values are the
    processor's patches shaped [1, t, h, w, values] by its grid (api/core/images.py), each
    `MERGE` x `MERGE` block of patches one placeholder."""
    _, t, h, w, _ = image.pixels.shape
    return t, h // MERGE, w // MERGE


# Qwen's spatial merge (2 x 2 patches a placeholder) in every published checkpoint; a config
# with another is refused at load (`qwen_encoder`).
MERGE = 2


def qwen_text(config: dict[str, Any]) -> dict[str, Any]:
    """The text config: transformers 5 writes a `text_config`; earlier checkpoints (the hub's
    Qwen2-VL and Qwen2.5-VL) keep the text model's fields at the top. Its M-RoPE sections
    (`rope_parameters` or `rope_scaling`, `mrope`) are given as `mrope_section`: mlx-lm's rope
    does not know the `mrope` type, and the plain rotation it makes is the text rows' own."""
    text = dict(config.get("text_config") or {})
    if not text:
        text = {k: v for k, v in config.items() if k != "vision_config"}
        text["model_type"] = f"{config['model_type']}_text"
    rope: dict[str, Any] = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    if "mrope_section" not in rope:
        raise ValueError(f"a {config['model_type']} text config without its mrope_section")
    text["mrope_section"] = list(rope["mrope_section"])
    text.pop("rope_scaling", None)  # `mrope`, or `default` with its sections: no scaling
    text.setdefault("rope_theta", rope.get("rope_theta", 1000000.0))
    if "rope_parameters" in text:
        text["rope_parameters"] = {**rope, "rope_type": "default"}
    return text


def qwen_processor(path: Path) -> Any:
    """The checkpoint's processor for images (transformers' Qwen2-VL processor class, which
    Qwen2.5-VL's extends for videos only)."""
    from omlx_logprobs.models.qwen_processor import QwenImagesProcessor

    return QwenImagesProcessor.from_pretrained(str(path))


# The towers' activations (mlx-vlm computes each family's own)
_ACTIVATION = {"qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu", "qwen3_vl": "gelu_pytorch_tanh"}


def qwen_encoder(path: Path, config: dict[str, Any]) -> Any:
    """mlx-vlm's vision tower of the family (its patch embedding over 2 frames of 14-pixel
    patches, rotary positions over the grid; Qwen2.5-VL's windowed attention) with its patch
    merger: one image's patches to a row per 2 x 2 block of them."""
    import importlib

    from omlx_logprobs.models import vision_encoder as v

    kind = str(config["model_type"])
    family = importlib.import_module(f"mlx_vlm.models.{kind}")
    vision = {**config["vision_config"], "model_type": kind}
    if int(vision.get("spatial_merge_size", MERGE)) != MERGE:
        raise ValueError(f"a {kind} model with a spatial merge other than {MERGE}")
    act = vision.get("hidden_act", _ACTIVATION[kind])
    if act != _ACTIVATION[kind]:  # mlx-vlm's tower computes the family's own
        raise ValueError(f"a {kind} vision tower with the activation {act!r} is not served yet")
    tower = family.VisionModel(family.VisionConfig.from_dict(vision))

    def pick(weights: dict[str, Any]) -> dict[str, Any]:
        # transformers names the tower `visual.` (under `model.` from transformers 5 on),
        # mlx-vlm `vision_tower.`
        found = v.under(weights, "visual.") or v.under(weights, "vision_tower.")
        return tower.sanitize(found) if found else {}

    update = v.updating((tower, pick, "vision tower"))
    put = update(v.read_weights(path))
    assert put is not None, f"a {kind} checkpoint without its vision tower's weights"
    put()

    def forward(pixels: Any) -> Any:
        _, t, h, w, d = pixels.shape
        out = tower(mx.array(pixels.reshape(-1, d)), mx.array([[t, h, w]]))
        if isinstance(out, tuple):  # Qwen3-VL: the rows, then each deepstack layer's
            rows, deep = out
            return mx.stack([rows, *deep])
        return out

    return v.Encoder(forward, v.image_token(config), update, positions=positions)
