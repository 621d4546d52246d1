"""Gemma 3's language half as mlx-lm's `gemma3` module builds it (models/vision_gemma.py): the
config transformers 5 writes (rotary bases by layer type, `layer_types`, the vocabulary in the
text config) and the hub's older one read alike; what mlx-lm cannot compute refused, named;
the weights' names of transformers and of mlx-vlm read; the image blocks ORed into the
causal masks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.models.vision import family_of, serves_images, text_classes, text_config
from omlx_logprobs.models.vision_gemma import Gemma3Text, _ahead, _joined, gemma3_text_config

TEXT = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 300, "sliding_window": 12}  # fmt: skip


def test_a_transformers_5_config() -> None:
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    kinds = ["sliding_attention", "full_attention"] * 2
    config = {"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"},
              "text_config": {**TEXT, "rope_parameters": rope, "_sliding_window_pattern": 6,
                              "layer_types": kinds}}  # fmt: skip
    assert family_of(config) == "gemma3" and serves_images("gemma3", True)
    override = text_config(config)
    assert override is not None and override["model_type"] == "gemma3"
    model_cls, args_cls = text_classes(config)(config)  # type: ignore[misc]
    assert model_cls is Gemma3Text
    args = args_cls.from_dict({**config, **override})
    text = args.text_config
    assert args.vocab_size == 300 and text["vocab_size"] == 300  # not mlx-lm's 262,208
    assert text["sliding_window_pattern"] == 2  # from layer_types, not the private field
    assert text["rope_theta"] == 1e6 and text["rope_local_base_freq"] == 1e4
    assert text["rope_scaling"]["factor"] == 8.0
    net = Gemma3Text(args)
    assert [lay.self_attn.is_sliding for lay in net.layers] == [True, False, True, False]


def test_the_hubs_config_as_it_is() -> None:
    hub = {**TEXT, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
           "sliding_window_pattern": 6}  # fmt: skip
    assert gemma3_text_config(dict(hub)) == hub


@pytest.mark.parametrize(
    "change, says",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "whose layers are"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "sliding layers"),
    ],
)  # fmt: skip
def test_what_mlx_lm_cannot_compute_is_refused(change: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        gemma3_text_config({**TEXT, **change})


def test_weight_names() -> None:
    """transformers' (with or without `model.`), mlx-vlm's: the language model's, the tower's
    and projector's dropped."""
    config = {"model_type": "gemma3", "text_config": {**TEXT, "num_hidden_layers": 1}}
    _, args_cls = text_classes({**config, "vision_config": {}})(config)  # type: ignore[misc]
    net = Gemma3Text(args_cls.from_dict(config))
    w = mx.zeros((1,))
    names = {
        "model.language_model.layers.0.mlp.up_proj.weight": w,
        "language_model.model.norm.weight": w,
        "lm_head.weight": w,
        "model.vision_tower.vision_model.post_layernorm.weight": w,
        "multi_modal_projector.mm_input_projection_weight": w,
    }
    assert sorted(net.sanitize(names)) == [
        "language_model.lm_head.weight",
        "language_model.model.layers.0.mlp.up_proj.weight",
        "language_model.model.norm.weight",
    ]
    tied = net.sanitize({"language_model.model.embed_tokens.weight": w})
    assert list(tied) == ["language_model.model.embed_tokens.weight"]


def test_image_blocks_in_the_masks() -> None:
    """Two rows, the second left-padded by one: an image's run attends ahead within itself
    only, and only in the forward's own columns (those of a cache before them stay causal)."""
    blocks = mx.array([[-1, 0, 0, 0, -1], [-1, -1, 1, 1, -1]])
    causal = mx.tril(mx.ones((5, 7), dtype=mx.bool_), k=2)  # two cached keys, then the forward
    got = np.array(_joined(causal, _ahead(blocks)))
    assert got.shape == (2, 1, 5, 7)
    want = np.array(causal)[None, None].repeat(2, 0)
    want[0, 0, 1, 2 + 2] = want[0, 0, 1, 2 + 3] = want[0, 0, 2, 2 + 3] = True
    want[1, 0, 2, 2 + 3] = True
    np.testing.assert_array_equal(got, want)
    assert _joined(None, _ahead(blocks)) is None
