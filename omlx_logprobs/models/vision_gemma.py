"""Gemma 3's images: its language half, built in mlx-lm's `gemma3` module tree, that takes an
image's rows as they are and lets them attend to each other both ways; and its encoder,
mlx-vlm's SigLIP tower and Gemma 3's projector (an average pool of the patches, the soft
embedding norm, a projection).

transformers' Gemma 3 differs from a text model's forward in two ways for an image:
- its token embedding scales each text row by sqrt(hidden), inside the embedding, so an
  image's rows enter the first layer unscaled; mlx-lm's `gemma3_text` scales whatever input
  embeddings it is given. The body here (`Gemma3Body`) takes input embeddings as the first
  layer reads them, the text rows scaled as mlx-lm scales them (`embed_inputs`, which
  runner/vision.py asks for) and an image's rows as the projector gives them;
- during the prefill, the placeholder tokens of one image (a run of them: transformers'
  `token_type_ids` blocks) attend to each other in both directions, in the sliding-window
  layers too (within their window, as transformers composes the two); afterwards, and for
  every other token, attention is causal. The body ORs each row's blocks (`image_blocks`,
  runner/vision.py) into mlx-lm's causal masks of the forward, so an image must be whole in
  one forward (batch/scheduler.py keeps a chunk from cutting it).
A forward without input embeddings is mlx-lm's own, unchanged: text prompts and decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import gemma3, gemma3_text
from mlx_lm.models.base import create_attention_mask

__all__ = ["Gemma3Body", "Gemma3Text", "gemma3_classes", "gemma3_encoder"]


class Gemma3Body(gemma3_text.Gemma3Model):
    """mlx-lm's Gemma 3 body, whose input embeddings are taken as they are (module
    docstring), with an image's rows attending to each other both ways where `image_blocks`
    says ([B, L] int: the block of each position, one per run of an image's placeholders, -1
    for text)."""

    def embed_inputs(self, ids: mx.array) -> mx.array:
        """The token embeddings as mlx-lm's forward scales them (by sqrt(hidden), rounded to
        bfloat16 as transformers' bfloat16 checkpoints have it)."""
        h = self.embed_tokens(ids)
        return h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def __call__(  # type: ignore[override]
        self,
        inputs: mx.array,
        cache: Any = None,
        input_embeddings: mx.array | None = None,
        image_blocks: mx.array | None = None,
    ) -> mx.array:
        if input_embeddings is None:
            return super().__call__(inputs, cache)
        h = input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        every = self.sliding_window_pattern
        full = create_attention_mask(h, cache[every - 1], return_array=True)
        window = None
        if every > 1:
            window = create_attention_mask(h, cache[0], self.window_size, return_array=True)
        if image_blocks is not None and h.shape[1] > 1:
            ahead = _ahead(image_blocks)
            full, window = _joined(full, ahead), _joined(window, ahead)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, full if i % every == every - 1 else window, c)
        return self.norm(h)  # type: ignore[no-any-return]


def _ahead(blocks: mx.array) -> mx.array:
    """[B, 1, L, L]: key after query, both in one image block (what the causal mask leaves
    out of transformers' blockwise overlay; the keys before are causal already, and inside a
    sliding window: transformers ANDs the window over the OR of the two)."""
    n = blocks.shape[1]
    q, k = blocks[:, :, None], blocks[:, None, :]
    later = mx.arange(n)[None, :] > mx.arange(n)[:, None]
    return ((q == k) & (q >= 0) & later)[:, None]


def _joined(mask: Any, ahead: mx.array) -> Any:
    """`mask` ([L, K] or [B, 1, L, K]: the forward's keys last) with `ahead` ORed into its
    last L columns; None (one query: nothing ahead) as it is."""
    if mask is None:
        return None
    extra = mask.shape[-1] - ahead.shape[-1]
    if extra:
        ahead = mx.pad(ahead, [(0, 0), (0, 0), (0, 0), (extra, 0)])
    return mask | ahead


class _Language(gemma3_text.Model):
    """mlx-lm's `gemma3_text` model over `Gemma3Body`."""

    model: Gemma3Body

    def __init__(self, args: gemma3_text.ModelArgs) -> None:
        super().__init__(args)
        self.model = Gemma3Body(args)

    def __call__(  # type: ignore[override]
        self,
        inputs: mx.array,
        cache: Any = None,
        input_embeddings: mx.array | None = None,
        image_blocks: mx.array | None = None,
    ) -> mx.array:
        out = self.model(inputs, cache, input_embeddings, image_blocks)
        if self.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)  # type: ignore[no-any-return]
        return self.lm_head(out)  # type: ignore[no-any-return]


class Gemma3Text(gemma3.Model):
    """Gemma 3's language half under the names transformers writes (`language_model.model.`,
    with or without `model.` before it, and `lm_head.`) or mlx-vlm's (`language_model.model.`,
    `language_model.lm_head.`); the vision tower and projector dropped."""

    language_model: _Language

    def __init__(self, args: gemma3.ModelArgs) -> None:
        super().__init__(args)
        self.language_model = _Language(gemma3_text.ModelArgs.from_dict(args.text_config))

    def __call__(  # type: ignore[override]
        self,
        inputs: mx.array,
        cache: Any = None,
        input_embeddings: mx.array | None = None,
        image_blocks: mx.array | None = None,
    ) -> mx.array:
        return self.language_model(inputs, cache, input_embeddings, image_blocks)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        text = {}
        for key, value in weights.items():
            key = key.removeprefix("model.")
            if key.startswith("lm_head."):
                text[key] = value
            elif key.startswith("language_model."):
                name = key.split(".", 1)[1]
                text[name if name.startswith(("model.", "lm_head.")) else f"model.{name}"] = value
        kept = self.language_model.sanitize(text)
        return {f"language_model.{k}": v for k, v in kept.items()}


@dataclass
class _Args(gemma3.ModelArgs):
    """mlx-lm's `gemma3` arguments from the config transformers 5 writes: the rotary bases
    under `rope_parameters` by layer type, the layers' kinds as `layer_types` (mlx-lm reads
    `rope_theta`, `rope_local_base_freq` and `sliding_window_pattern`), the vocabulary in the
    text config (mlx-lm's module takes the top config's, 262,208 where it has none)."""

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> _Args:
        text = gemma3_text_config(dict(params["text_config"]))
        vocab = int(text.get("vocab_size", params.get("vocab_size", 262208)))
        return cls(model_type="gemma3", text_config=text, vocab_size=vocab)


def gemma3_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """The text config with what mlx-lm's `gemma3_text` reads filled in from transformers 5's
    fields; a ValueError for what it cannot compute."""
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if text.get(cap) is not None:
            raise ValueError(f"a Gemma 3 with {cap} is not served yet")
    rope = text.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if "rope_theta" in full:
        text.setdefault("rope_theta", full["rope_theta"])
    if full.get("rope_type", "default") != "default":
        text.setdefault("rope_scaling", full)
    if "rope_theta" in local:
        text.setdefault("rope_local_base_freq", local["rope_theta"])
    if local.get("rope_type", "default") != "default":
        raise ValueError("a Gemma 3 with a scaled rotary base in its sliding layers is not served")
    kinds = text.get("layer_types")
    if kinds:
        text["sliding_window_pattern"] = _pattern(kinds)
    return text


def _pattern(kinds: list[str]) -> int:
    """mlx-lm's `sliding_window_pattern` of these layer types: every p-th layer global."""
    every = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0
    want = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(len(kinds))] if every else []  # fmt: skip
    if kinds != want:
        raise ValueError(f"a Gemma 3 whose layers are {kinds} is not served yet")
    return every


def gemma3_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's `get_model_classes` for Gemma 3's language half."""
    return Gemma3Text, _Args


def gemma3_encoder(path: Path, config: dict[str, Any]) -> Any:
    """Gemma 3's encoder (models/vision_encoder.py's `Encoder`): the SigLIP tower's last states
    (after its last norm), average-pooled to `mm_tokens_per_image` rows, normed (Gemma's
    1 + w) and projected; its images attend both ways in the prefill (`bidirectional`)."""
    import mlx_vlm.models.gemma3 as family
    import transformers
    from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
    from mlx_vlm.utils import update_module_configs

    from omlx_logprobs.models import vision_encoder as v

    # The configs as transformers completes them (the hub's leave out what their classes default)
    full = transformers.AutoConfig.from_pretrained(str(path))
    vision = full.vision_config.to_dict()
    text = {**full.text_config.to_dict(), "mm_tokens_per_image": full.mm_tokens_per_image}
    raw = {**config, "text_config": text, "vision_config": vision}
    cfg = update_module_configs(family.ModelConfig.from_dict(raw), family, raw, ["text", "vision"])
    tower = family.VisionModel(cfg.vision_config)
    v.exact_activation(tower.vision_model.encoder.layers, vision["hidden_act"])
    # mlx-vlm gives the last norm MLX's default epsilon (1e-5), not the config's (1e-6)
    tower.vision_model.post_layernorm.eps = cfg.vision_config.layer_norm_eps
    projector = Gemma3MultiModalProjector(cfg)

    def tower_weights(weights: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 writes the tower's modules without SiglipVisionModel's `vision_model.`
        tw = {k if k.startswith("vision_model.") else f"vision_model.{k}": w
              for k, w in v.under(weights, "vision_tower.").items()}  # fmt: skip
        return tower.sanitize(tw) if tw else {}

    update = v.updating(
        (tower, tower_weights, "vision tower"),
        (projector, lambda w: v.under(w, "multi_modal_projector."), "projector"),
    )
    put = update(v.read_weights(path))
    assert put is not None, "a Gemma 3 checkpoint without its vision tower's weights"
    put()
    hidden = cfg.text_config.hidden_size

    def forward(pixels: Any) -> Any:
        states, *_ = tower(mx.array(pixels).transpose(0, 2, 3, 1))
        return projector(states).reshape(-1, hidden)

    return v.Encoder(forward, v.image_token(config), update, bidirectional=True)
