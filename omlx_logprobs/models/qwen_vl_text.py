"""The language half of Qwen2-VL, Qwen2.5-VL and Qwen3-VL: mlx-lm's `qwen2_vl` and
`qwen3_vl` modules (Qwen2's and Qwen3's layers; they read transformers' and mlx-vlm's weight
names) with each attention's rotation able to take multimodal positions (M-RoPE) and Qwen3-VL's
body the deepstack rows of an image (models/vision_qwen.py says what they are).

A forward given `position_ids` [3, B, L] rotates each column by its (frame, row, column)
positions, each rotary frequency reading one of them; a forward given none (a text prompt, a
decode step) is mlx-lm's own, its rotation at the cache's offset of each row (where the runner
has moved an image prompt's decode positions by its delta: runner/vision.py). A forward given
`deepstack` [k, B, L, H] adds its rows to the hidden states after each of the first k layers.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import qwen2, qwen2_vl, qwen3, qwen3_vl
from mlx_lm.models.base import create_attention_mask

__all__ = ["Qwen3VLText", "QwenVLText", "qwen_vl_classes"]


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
