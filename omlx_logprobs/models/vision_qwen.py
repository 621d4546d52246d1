"""Qwen2-VL and Qwen2.5-VL: their text half (mlx-lm's Qwen2 layers, whose rotary positions
are multimodal: M-RoPE), their encoder (mlx-vlm's vision tower with its patch merger) and
their processor (transformers', without the video processor, which needs torchvision).

M-RoPE gives each image placeholder three positions (its frame, row and column in the image's
grid of merged patches, after the text before it) and the text after an image continues from
the largest of them plus one; a text token's three positions are equal, and its rotation is
then the plain 1-D one at that position. So:

- a forward over rows that hold a prompt with images is given each column's three positions
  (`position_ids`, [3, B, L]: `positions`), and every attention layer rotates by them;
- after its prefill, such a row's decode positions run `delta` behind (or ahead of) its count
  of tokens (`delta`: its prompt's largest position plus one, less its length), which the
  runner adds to the row's cache offset once (runner/vision.py): mlx-lm's rotation of every
  decode step (position = cache offset, per row) then gives it the M-RoPE position;
- every other forward (text prompts, decode steps) is mlx-lm's own, unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import qwen2, qwen2_vl, qwen3, qwen3_vl
from mlx_lm.models.base import create_attention_mask

__all__ = [
    "Qwen3VLText",
    "QwenVLText",
    "positions",
    "qwen_encoder",
    "qwen_processor",
    "qwen_text",
    "qwen_vl_classes",
]


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


class _Positions:
    """The rotation of the forward under way, shared by every attention layer: None (mlx-lm's
    own, from the cache's offset) or the (cos, sin) of its columns' M-RoPE positions."""

    def __init__(self, dims: int, base: float, section: list[int], interleaved: bool) -> None:
        # Host arrays: a lazy MLX array made here would belong to the loading thread's stream
        self.inv_freq = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
        # Which of (frame, row, column) each frequency reads, as transformers takes them:
        # Qwen2-VL's in three blocks of `section`'s sizes; Qwen3-VL's interleaved (row and
        # column every third frequency from the second and third on, the rest frame)
        if interleaved:
            self.axis = np.zeros(dims // 2, np.int64)
            self.axis[1 : 3 * section[1] : 3] = 1
            self.axis[2 : 3 * section[2] : 3] = 2
        else:
            self.axis = np.repeat(np.arange(3), section)
        self.rotation: tuple[mx.array, mx.array] | None = None

    def set(self, position_ids: mx.array | None) -> None:
        if position_ids is None:
            self.rotation = None
            return
        inv_freq = mx.array(self.inv_freq)
        freqs = position_ids.astype(mx.float32)[..., None] * inv_freq  # [3, B, L, D/2]
        picked = mx.take_along_axis(freqs, mx.array(self.axis)[None, None, None, :], axis=0)[0]
        emb = mx.concatenate([picked, picked], axis=-1)[:, None]  # [B, 1, L, D]
        self.rotation = (mx.cos(emb), mx.sin(emb))


class _MRoPE(nn.Module):
    """An attention layer's rotation: mlx-lm's own unless the forward's M-RoPE positions are
    set (transformers' `apply_multimodal_rotary_pos_emb`, rotate-half)."""

    def __init__(self, plain: nn.Module, shared: _Positions) -> None:
        super().__init__()
        self.plain = plain
        self._shared = shared  # not an array: no parameter of the model

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        rotation = self._shared.rotation
        if rotation is None:
            return self.plain(x, offset=offset)  # type: ignore[no-any-return]
        cos, sin = rotation
        half = x.shape[-1] // 2
        turned = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return (x.astype(mx.float32) * cos + turned.astype(mx.float32) * sin).astype(x.dtype)


class _Multimodal:
    """A Qwen text body (mlx-lm's) that takes the forward's M-RoPE positions
    (`position_ids`) and Qwen3-VL's deepstack rows (`deepstack` [k, B, L, H]: added to the
    hidden states after each of the first k layers; zeros but at an image's positions)."""

    shared: _Positions
    layers: list[Any]
    embed_tokens: Any
    norm: Any

    def __call__(
        self,
        inputs: mx.array,
        cache: Any = None,
        input_embeddings: mx.array | None = None,
        position_ids: mx.array | None = None,
        deepstack: mx.array | None = None,
    ) -> mx.array:
        self.shared.set(position_ids)
        try:
            if deepstack is None:
                return super().__call__(inputs, cache, input_embeddings)  # type: ignore[misc, no-any-return]
            return self._stacked(inputs, cache, input_embeddings, deepstack)
        finally:
            self.shared.set(None)

    def _stacked(
        self, inputs: mx.array, cache: Any, input_embeddings: mx.array | None, deep: mx.array
    ) -> mx.array:
        """mlx-lm's body (one process: no pipeline) with the deepstack rows added."""
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, mask, c)
            if i < deep.shape[0]:
                h = h + deep[i]
        return self.norm(h)  # type: ignore[no-any-return]


class _Qwen2Body(_Multimodal, qwen2.Qwen2Model):
    pass


class _Qwen3Body(_Multimodal, qwen3.Qwen3Model):
    pass


def _multimodal(model: Any, body_class: type, interleaved: bool) -> None:
    """Give a Qwen VL text module (mlx-lm's) the body that takes M-RoPE positions."""
    lm = model.language_model
    text = lm.args
    body = body_class(text)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    section = list(model.args.text_config["mrope_section"])
    body.shared = _Positions(head_dim, text.rope_theta, section, interleaved)
    for layer in body.layers:
        layer.self_attn.rope = _MRoPE(layer.self_attn.rope, body.shared)
    lm.model = body


def _forward(
    model: Any,
    inputs: mx.array,
    cache: Any = None,
    input_embeddings: mx.array | None = None,
    position_ids: mx.array | None = None,
    deepstack: mx.array | None = None,
) -> mx.array:
    """The text module's forward, its body given the positions and deepstack rows."""
    lm = model.language_model
    out = lm.model(inputs, cache, input_embeddings, position_ids, deepstack)
    if lm.args.tie_word_embeddings:
        return lm.model.embed_tokens.as_linear(out)  # type: ignore[no-any-return]
    return lm.lm_head(out)  # type: ignore[no-any-return]


class QwenVLText(qwen2_vl.Model):
    """Qwen2-VL's and Qwen2.5-VL's language model: mlx-lm's `qwen2_vl` module (which reads
    both checkpoints' weight names, transformers' and mlx-vlm's) with each attention's
    rotation able to take M-RoPE positions."""

    def __init__(self, args: qwen2_vl.ModelArgs) -> None:
        super().__init__(args)
        _multimodal(self, _Qwen2Body, interleaved=False)

    __call__ = _forward  # type: ignore[assignment]


class Qwen3VLText(qwen3_vl.Model):
    """Qwen3-VL's language model: mlx-lm's `qwen3_vl` module (Qwen3's layers), its rotations
    able to take interleaved M-RoPE positions and its body the deepstack rows."""

    def __init__(self, args: qwen3_vl.ModelArgs) -> None:
        super().__init__(args)
        _multimodal(self, _Qwen3Body, interleaved=True)

    __call__ = _forward  # type: ignore[assignment]


def qwen_vl_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's `get_model_classes` for the Qwen VL text half."""
    if config.get("model_type") == "qwen3_vl":
        return Qwen3VLText, qwen3_vl.ModelArgs
    return QwenVLText, qwen2_vl.ModelArgs


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

    from omlx_logprobs.models import vision as v

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
        found = v._under(weights, "visual.") or v._under(weights, "vision_tower.")
        return tower.sanitize(found) if found else {}

    update = v._updating((tower, pick, "vision tower"))
    put = update(v._weights(path))
    assert put is not None, f"a {kind} checkpoint without its vision tower's weights"
    put()

    def forward(pixels: Any) -> Any:
        _, t, h, w, d = pixels.shape
        out = tower(mx.array(pixels.reshape(-1, d)), mx.array([[t, h, w]]))
        if isinstance(out, tuple):  # Qwen3-VL: the rows, then each deepstack layer's
            rows, deep = out
            return mx.stack([rows, *deep])
        return out

    return v.Encoder(forward, v._image_token(config), update, positions)
