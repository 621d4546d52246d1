"""Vision-language models: which families take images, their processor (the API's side: pixel
values and the prompt's placeholder tokens, as transformers computes them) and their vision
encoder (the engine's side: mlx-vlm's vision tower and projector, which turn one image's pixel
values into the rows of input embeddings its placeholder tokens stand for).

The language half is the mlx-lm model of the checkpoint's text config, loaded as every text
model is: the runner's batch caches, prefill and decode paths serve it unchanged, and an image's
rows enter its forward as input embeddings (runner/vision.py). mlx-vlm is pinned (pyproject.toml):
its module trees and weight names are what the loader maps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx_logprobs.models.qwen_vl_text import qwen_vl_classes
from omlx_logprobs.models.vision_encoder import (
    Encoder,
    exact_activation,
    image_token,
    read_weights,
    under,
    updating,
)
from omlx_logprobs.models.vision_gemma import gemma3_classes, gemma3_encoder
from omlx_logprobs.models.vision_pixtral import (
    llava_pixtral_encoder,
    mistral3_encoder,
    pixtral_processor,
)
from omlx_logprobs.models.vision_qwen import qwen_encoder, qwen_processor, qwen_text
from omlx_logprobs.models.vision_text import idefics3_classes

__all__ = [
    "Encoder",
    "Family",
    "VisionSpec",
    "encoder_of",
    "family_of",
    "load_encoder",
    "serves_images",
    "text_classes",
    "text_config",
    "vision_spec",
]

# The attribute of the text model that carries its encoder: a plain holder, not a child
# module, so the text model's parameters (weight updates, adapters, fingerprints) stay its own.
_ATTR = "omlx_vision_encoder"


@dataclass(frozen=True)
class Family:
    """A vision family served: the mlx-lm model type of its text half (mlx-lm's module that
    reads the whole checkpoint's weights and keeps the language model's), its encoder, and
    its transformers processor class (named, not found through AutoProcessor: importing an
    mlx-vlm family replaces AutoProcessor's choice with mlx-vlm's own processor, which would
    make the API's ids depend on whether the engine shares its process)."""

    text_model_type: str
    build: Callable[[Path, dict[str, Any]], Encoder]
    # transformers' class by name, or what builds the processor from the checkpoint's path
    processor: str | Callable[[Path], Any]
    # The text configs' model types that mlx-lm module reads (its language model's class).
    text_types: frozenset[str]
    # The vision configs' model types its encoder builds (a config without one: transformers'
    # default tower of the family, which is among them).
    towers: frozenset[str]
    # mlx-lm's `get_model_classes` of the text half where mlx-lm's module of `text_model_type`
    # cannot read the checkpoint's weight names (models/vision_text.py); None: that module.
    classes: Callable[[dict[str, Any]], tuple[type, type]] | None = None
    # The text config of a checkpoint, where it is not its `text_config` as it stands
    # (models/vision_qwen.py: the hub's Qwen2-VL keeps it at the top); None: that.
    text: Callable[[dict[str, Any]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class VisionSpec:
    """What the API reads images with: the checkpoint's transformers processor and the id of
    the token that stands for one row of an image's embeddings."""

    family: str
    processor: Any
    image_token_id: int
    # The text the processor writes for every image, where it is more than its placeholders
    # and tokenizes with the text around it (Gemma 3's: line breaks, its start and end of image
    # tokens): a chat's earlier answers are then spliced into the text so expanded
    # (api/core/prompts.py). None: an image's placeholders stand where its token was.
    expansion: str | None = None


def family_of(config: dict[str, Any]) -> str | None:
    """The served vision family of a config.json, None for a text model (or a vision family
    not served yet, which then loads as text, as mlx-lm reads it)."""
    kind = str(config.get("model_type") or "")
    if kind == "llava" and (config.get("vision_config") or {}).get("model_type") == "pixtral":
        kind = "pixtral"  # Pixtral-12B: LLaVA's model over a tower of its own
    return kind if kind in FAMILIES and "vision_config" in config else None


def serves_images(card_family: str, vision: bool) -> bool:
    """Whether a model of this card takes images here (/v1/models, /api/show)."""
    return vision and card_family in FAMILIES


def text_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The override of config.json that has mlx-lm load a vision checkpoint's language half,
    None for a text model."""
    family = family_of(config)
    if family is None:
        return None
    spec = FAMILIES[family]
    text = spec.text(config) if spec.text is not None else dict(config.get("text_config", {}))
    kind = str(text.get("model_type", ""))
    if kind not in spec.text_types:
        raise ValueError(
            f"a {family} model with a {kind!r} text model is not served yet (its text model"
            f" must be one of {', '.join(sorted(spec.text_types))})"
        )
    tower = config["vision_config"].get("model_type")
    if tower is not None and tower not in spec.towers:
        raise ValueError(
            f"a {family} model with a {tower!r} vision tower is not served yet (its tower must"
            f" be one of {', '.join(sorted(spec.towers))})"
        )
    # transformers 5 writes the rotary base under `rope_parameters`, which mlx-lm's llama
    # does not read (it would take its default, 10,000), and ties the head by the top config
    rope = text.get("rope_parameters") or {}
    if "rope_theta" in rope:
        text.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        text.setdefault("rope_scaling", rope)
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return {"model_type": spec.text_model_type, "text_config": text}


def text_classes(config: dict[str, Any]) -> Callable[[dict[str, Any]], tuple[type, type]] | None:
    """mlx-lm's `get_model_classes` for a vision checkpoint's text half, None where mlx-lm's
    own module reads it (a text model, LLaVA)."""
    family = family_of(config)
    return None if family is None else FAMILIES[family].classes


def vision_spec(path: Path, config: dict[str, Any]) -> VisionSpec | None:
    """The checkpoint's processor, None for a text model."""
    family = family_of(config)
    if family is None:
        return None
    import transformers

    make = FAMILIES[family].processor
    if isinstance(make, str):
        processor = getattr(transformers, make).from_pretrained(str(path))
    else:
        processor = make(path)
    if getattr(processor.image_processor, "do_pan_and_scan", None):
        raise ValueError("a Gemma 3 processor with pan and scan is not served yet")
    tower = config.get("vision_config") or {}
    edge = (getattr(processor.image_processor, "size", None) or {}).get("longest_edge")
    if tower.get("model_type") == "pixtral" and edge and edge > tower.get("image_size", edge):
        # the tower's rotary table covers image_size / patch_size patches a side: a larger
        # image would fail in the engine's prefill, so the checkpoint is refused at load
        raise ValueError(
            f"the processor scales an image to {edge} pixels a side, past the Pixtral tower's"
            f" image_size of {tower['image_size']}: the checkpoint's processor and tower disagree"
        )
    # Gemma3Processor's text for an image (its `image_token` is the start of image token the
    # chat template writes, which it expands to this)
    expansion = getattr(processor, "full_image_sequence", None)
    return VisionSpec(family, processor, image_token(config), expansion)


def load_encoder(net: Any, path: Path, config: dict[str, Any]) -> None:
    """Load a vision checkpoint's encoder and give it to its text model (`encoder_of`)."""
    family = family_of(config)
    if family is not None:
        object.__setattr__(net, _ATTR, FAMILIES[family].build(path, config))


def encoder_of(net: Any) -> Encoder | None:
    """The text model's vision encoder, None for a text model."""
    found = getattr(net, _ATTR, None)
    return found if isinstance(found, Encoder) else None


def _llava(path: Path, config: dict[str, Any]) -> Encoder:
    """LLaVA: a CLIP (or SigLIP) tower, the chosen layer's patch states (the class token
    dropped with the `default` strategy), a two-layer projector."""
    import mlx.core as mx
    import mlx_vlm.models.llava as family
    from mlx_vlm.models.llava.llava import LlavaMultiModalProjector
    from mlx_vlm.utils import update_module_configs

    cfg = family.ModelConfig.from_dict(config)
    cfg = update_module_configs(cfg, family, config, ["text", "vision"])
    tower = family.VisionModel(cfg.vision_config)
    act = config["vision_config"].get("hidden_act", "quick_gelu")
    exact_activation(tower.vision_model.encoder.layers, act)
    projector = LlavaMultiModalProjector(cfg)

    def tower_weights(weights: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 writes the tower's modules without CLIPVisionModel's `vision_model.`
        tw = {k if k.startswith("vision_model.") else f"vision_model.{k}": v
              for k, v in under(weights, "vision_tower.").items()}  # fmt: skip
        return tower.sanitize(tw) if tw else {}

    update = updating(
        (tower, tower_weights, "vision tower"),
        (projector, lambda w: under(w, "multi_modal_projector."), "projector"),
    )
    put = update(read_weights(path))
    assert put is not None, "a LLaVA checkpoint without its vision tower's weights"
    put()
    layer, strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
    if not isinstance(layer, int):
        raise ValueError("LLaVA with several vision feature layers is not served yet")

    def forward(pixels: Any) -> Any:
        *_, states = tower(mx.array(pixels).transpose(0, 2, 3, 1), output_hidden_states=True)
        chosen = states[layer]
        if strategy == "default":
            chosen = chosen[:, 1:]
        return projector(chosen).reshape(-1, projector.linear_2.weight.shape[0])

    return Encoder(forward, image_token(config), update)


def _idefics3(path: Path, config: dict[str, Any]) -> Encoder:
    """Idefics3 (and SmolVLM): a SigLIP-shaped tower over each tile of an image (the
    processor cuts it into rows and columns of tiles and adds the whole image, scaled down, as
    the last), then the connector: a pixel shuffle (each 2 x 2 block of patches into one row,
    with `scale_factor` 2) and a projection."""
    import mlx.core as mx
    import mlx_vlm.models.idefics3 as family
    import transformers
    from mlx_vlm.models.idefics3.idefics3 import Idefics3Connector
    from mlx_vlm.utils import update_module_configs

    # The tower's config as transformers completes it: the hub's SmolVLM2 leaves out what its
    # config class defaults (depth, width, activation, epsilon), which mlx-vlm's may not
    vision = transformers.AutoConfig.from_pretrained(str(path)).vision_config.to_dict()
    config = {**config, "vision_config": vision}
    cfg = family.ModelConfig.from_dict(config)
    cfg = update_module_configs(cfg, family, config, ["text", "vision"])
    tower = family.VisionModel(cfg.vision_config)
    exact_activation(tower.encoder.layers, vision["hidden_act"])
    # mlx-vlm gives the last norm MLX's default epsilon (1e-5), not the config's (1e-6)
    tower.post_layernorm.eps = cfg.vision_config.layer_norm_eps
    connector = Idefics3Connector(cfg)

    update = updating(
        (tower, lambda w: tower.sanitize(under(w, "vision_model.")), "vision tower"),
        (connector, lambda w: under(w, "connector."), "connector"),
    )
    put = update(read_weights(path))
    assert put is not None, "an Idefics3 checkpoint without its vision tower's weights"
    put()
    patch, hidden = cfg.vision_config.patch_size, cfg.text_config.hidden_size

    def forward(pixels: Any) -> Any:
        tiles = mx.array(pixels).reshape(-1, *pixels.shape[-3:]).transpose(0, 2, 3, 1)
        # Every patch of a tile is the image's (an image processed alone is cut into whole
        # tiles, none padded); the mask has the tower put a tile smaller than its native size
        # on its grid of positions, as transformers does.
        n, h, w, _ = tiles.shape
        mask = mx.ones((n, h // patch, w // patch), dtype=mx.bool_)
        states, *_ = tower(tiles, patch_attention_mask=mask)
        return connector(states).reshape(-1, hidden)

    return Encoder(forward, image_token(config), update)


# Idefics3's language half is llama's, under weight names of its own (vision_text.py); its
# towers are those mlx-vlm's Idefics3 vision model builds (the names transformers and earlier
# checkpoints give Idefics3's and SmolVLM's). SmolVLM is Idefics3 under another name:
# transformers' SmolVLMProcessor needs num2words (for video frames' counts) and a video
# processor; for images it expands the prompt as Idefics3Processor does (the same tile
# markers, the same image processor), which reads the same checkpoint files.
_IDEFICS3 = Family(
    "mistral3",
    _idefics3,
    "Idefics3Processor",
    frozenset({"llama"}),
    frozenset({"idefics3", "idefics3_vision", "siglip_vision_model", "smolvlm_vision"}),
    idefics3_classes,
)


def _qwen(kind: str) -> Family:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL (models/vision_qwen.py): a Qwen2 (Qwen3) text model
    with multimodal rotary positions, in mlx-lm's `qwen2_vl` (`qwen3_vl`) module tree, which
    reads transformers' and mlx-vlm's weight names; mlx-vlm's tower of the family;
    transformers' processor less its videos."""
    return Family(
        "qwen3_vl" if kind == "qwen3_vl" else "qwen2_vl",
        qwen_encoder,
        qwen_processor,
        frozenset({f"{kind}_text"}),
        # the hub's towers name the family; transformers 5's add `_vision`
        frozenset({kind, f"{kind}_vision"}),
        qwen_vl_classes,
        qwen_text,
    )


def _pixtral(path: Path) -> Any:
    """PixtralProcessor from a checkpoint (the class as models/vision_pixtral.py finds it)."""
    return pixtral_processor().from_pretrained(str(path))


FAMILIES: dict[str, Family] = {
    # mlx-lm's mistral3 module builds its language model as llama unless ministral3 or mistral4
    "llava": Family(
        "mistral3",
        _llava,
        "LlavaProcessor",
        frozenset({"llama", "mistral", "ministral3", "mistral4"}),
        # Pixtral-12B's `pixtral` tower is the family `pixtral` (family_of)
        frozenset({"clip_vision_model", "siglip_vision_model"}),
    ),
    "idefics3": _IDEFICS3,
    "smolvlm": _IDEFICS3,
    # Gemma 3: a SigLIP tower, the pooling projector, gemma3_text (models/vision_gemma.py)
    "gemma3": Family(
        "gemma3",
        gemma3_encoder,
        "Gemma3Processor",
        frozenset({"gemma3_text"}),
        frozenset({"siglip_vision_model"}),
        gemma3_classes,
    ),
    "qwen2_vl": _qwen("qwen2_vl"),
    "qwen2_5_vl": _qwen("qwen2_5_vl"),
    "qwen3_vl": _qwen("qwen3_vl"),
    # Pixtral's tower (models/vision_pixtral.py) over mlx-lm's mistral3 text half, as LLaVA's
    "mistral3": Family(
        "mistral3",
        mistral3_encoder,
        _pixtral,
        frozenset({"llama", "mistral", "ministral3", "mistral4"}),
        frozenset({"pixtral"}),
    ),
    "pixtral": Family(
        "mistral3",
        llava_pixtral_encoder,
        _pixtral,
        frozenset({"llama", "mistral", "ministral3", "mistral4"}),
        frozenset({"pixtral"}),
    ),
}
