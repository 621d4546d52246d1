"""Pixtral's vision tower under two families (models/vision.py's table): Mistral 3 (Mistral
Small 3.1 / 3.2: the tower, an RMS norm, the patch merger that turns each `spatial_merge_size`
x `spatial_merge_size` block of patches into one row, a two-layer projection) and LLaVA with a
`pixtral` tower (Pixtral-12B: every patch a row through LLaVA's two-layer projector).

The tower takes an image at its own size (no fixed count of placeholders): the processor
resizes it to whole blocks of patches and writes a row of `[IMG]` placeholders per row of
blocks, `[IMG_BREAK]` after each row and `[IMG_END]` after the last. The encoder's rows come
in the same raster order, so the image's runs of placeholders (one per row) take them in turn.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omlx_logprobs.models.vision_encoder import Encoder

__all__ = ["llava_pixtral_encoder", "mistral3_encoder", "pixtral_processor"]


def pixtral_processor() -> Any:
    """transformers' `PixtralProcessor`. transformers exports it only with torchvision (its
    module imports the torchvision image processor for one function, the resized size, which
    the Pillow backend's module defines the same); without it the processor is built over the
    Pillow backend, which is also what its `from_pretrained` loads then."""
    fast = "transformers.models.pixtral.image_processing_pixtral"
    try:
        importlib.import_module(fast)
    except ImportError:
        pil = "transformers.models.pixtral.image_processing_pil_pixtral"
        sys.modules[fast] = importlib.import_module(pil)
    module = importlib.import_module("transformers.models.pixtral.processing_pixtral")
    return module.PixtralProcessor


def _tower(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-vlm's Pixtral tower from the checkpoint's vision config, and the function that picks
    its weights from a checkpoint's arrays."""
    import mlx.core as mx
    from mlx_vlm.models.pixtral import VisionConfig, VisionModel

    vision = dict(config["vision_config"])
    act = vision.get("hidden_act", "gelu")
    if act != "silu":  # mlx-vlm's Pixtral MLP computes SiLU whatever the config names
        raise ValueError(f"a Pixtral tower with the activation {act!r} is not served yet")
    # transformers derives the head width (mlx-vlm defaults it to 64) and, since version 5,
    # writes the rotary base under rope_parameters (mlx-vlm reads rope_theta)
    vision["head_dim"] = vision["hidden_size"] // vision["num_attention_heads"]
    rope = vision.get("rope_parameters") or {}
    vision["rope_theta"] = rope.get("rope_theta", vision.get("rope_theta", 10000.0))
    tower = VisionModel(VisionConfig.from_dict(vision))
    # its rotary table is no parameter: computed here, not lazily on the engine's thread
    # (MLX streams are per thread: there the loader's is not found)
    mx.eval(tower.vision_model.patch_positional_embedding.inv_freq)

    def weights(checkpoint: dict[str, Any]) -> dict[str, Any]:
        from omlx_logprobs.models.vision_encoder import under

        # transformers names the tower's modules without mlx-vlm's `vision_model.`
        tw = {k if k.startswith("vision_model.") else f"vision_model.{k}": v
              for k, v in under(checkpoint, "vision_tower.").items()}  # fmt: skip
        return tower.sanitize(tw) if tw else {}

    return tower, weights


def _chosen_layer(config: dict[str, Any]) -> int:
    layer = config.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ValueError("a Pixtral tower with several vision feature layers is not served yet")
    return layer


def _states(tower: Any, pixels: Any, layer: int) -> Any:
    """The tower's patch states [rows * columns, width] of one image [1, C, H, W] (processed
    alone: no padding), in raster order: mlx-vlm's forward of its modules without the
    attention mask it builds for several images (a square of floats as wide as the image's
    patches, all zeros for one image: 0.6 GB for a 1540-pixel square)."""
    import mlx.core as mx

    v = tower.vision_model
    conv = v.patch_conv
    x = conv(mx.array(pixels).transpose(0, 2, 3, 1).astype(conv.weight.dtype))
    _, h, w, d = x.shape
    side = v.config.image_size // v.config.patch_size
    if h > side or w > side:  # its rotary table has `side` rows and columns
        raise ValueError(f"an image of {h} x {w} patches is past the tower's {side} x {side}")
    x = v.ln_pre(x.reshape(1, h * w, d))
    at = (mx.arange(h)[:, None] * side + mx.arange(w)[None, :]).reshape(-1)
    rotary = v.patch_positional_embedding(x, at)
    states = [x]
    for block in v.transformer.layers:
        x = block(x, position_embeddings=rotary)
        states.append(x)
    return states[layer][0]


def _encoder(
    path: Path,
    config: dict[str, Any],
    tower: tuple[Any, Any],
    projector: Any,
    project: Callable[[Any, Any], Any],
) -> Encoder:
    """The encoder of a Pixtral tower (the module and its weights' picker) and a projector
    loaded from the checkpoint: `project(states, pixels)` turns the tower's patch states of one
    image into its rows."""
    from omlx_logprobs.models.vision_encoder import (
        Encoder,
        image_token,
        read_weights,
        under,
        updating,
    )

    module, picks = tower
    update = updating(
        (module, picks, "vision tower"),
        (projector, lambda w: under(w, "multi_modal_projector."), "projector"),
    )
    put = update(read_weights(path))
    if put is None:
        raise ValueError("a checkpoint without the weights of its Pixtral tower")
    put()
    layer = _chosen_layer(config)

    def forward(pixels: Any) -> Any:
        return project(_states(module, pixels, layer), pixels)

    return Encoder(forward, image_token(config), update)


def mistral3_encoder(path: Path, config: dict[str, Any]) -> Encoder:
    """Mistral 3: the tower's patch states, RMS-normed, each `spatial_merge_size` squared block
    of patches concatenated (as torch's unfold orders a block: width, then the block's rows and
    columns) into one row by the merging layer, then linear, GELU, linear."""
    import mlx_vlm.models.mistral3 as family
    from mlx_vlm.models.mistral3.mistral3 import Mistral3MultiModalProjector

    tower = _tower(config)
    cfg = family.ModelConfig.from_dict(config)
    cfg.text_config = family.TextConfig.from_dict(config["text_config"])
    cfg.vision_config = tower[0].vision_model.config
    projector = Mistral3MultiModalProjector(cfg)
    patch, m = cfg.vision_config.patch_size, cfg.spatial_merge_size

    def project(states: Any, pixels: Any) -> Any:
        h, w = pixels.shape[-2] // patch, pixels.shape[-1] // patch
        if h % m or w % m:
            raise ValueError(f"an image of {h} x {w} patches is not whole {m} x {m} blocks")
        x = projector.norm(states)
        d = x.shape[-1]
        x = x.reshape(h // m, m, w // m, m, d).transpose(0, 2, 4, 1, 3).reshape(-1, d * m * m)
        x = projector.patch_merger.merging_layer(x)
        return projector.linear_2(projector.gelu(projector.linear_1(x)))

    return _encoder(path, config, tower, projector, project)


def llava_pixtral_encoder(path: Path, config: dict[str, Any]) -> Encoder:
    """LLaVA with a Pixtral tower (Pixtral-12B): every patch's state (the `full` strategy: the
    tower has no class token) through LLaVA's projector, linear, GELU, linear."""
    from mlx_vlm.models.pixtral import ModelConfig, TextConfig
    from mlx_vlm.models.pixtral.pixtral import LlavaMultiModalProjector

    if config.get("vision_feature_select_strategy", "full") != "full":
        raise ValueError("LLaVA with a Pixtral tower takes the `full` feature strategy")
    tower = _tower(config)
    cfg = ModelConfig(
        text_config=TextConfig.from_dict(config["text_config"]),
        vision_config=tower[0].vision_model.config,
    )
    projector = LlavaMultiModalProjector(cfg)
    return _encoder(path, config, tower, projector, lambda states, _: projector(states))
