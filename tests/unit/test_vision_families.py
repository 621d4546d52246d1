"""Which configs load as vision models (models/vision.py), the text config mlx-lm builds their
language half from, and the clear refusal of a served family whose text model its mlx-lm
module cannot build."""

from __future__ import annotations

import pytest

from omlx_logprobs.models.qwen_vl_text import Qwen3VLText, QwenVLText
from omlx_logprobs.models.vision import family_of, serves_images, text_classes, text_config
from omlx_logprobs.models.vision_text import Idefics3Text


def test_families() -> None:
    llava = {"model_type": "llava", "vision_config": {}, "text_config": {"model_type": "llama"}}
    assert family_of(llava) == "llava"
    assert text_config(llava) == {"model_type": "mistral3", "text_config": {"model_type": "llama"}}
    assert text_classes(llava) is None  # mlx-lm's own mistral3 module reads it
    assert (
        family_of({"model_type": "llama"}) is None and text_config({"model_type": "llama"}) is None
    )
    assert family_of({"model_type": "mllama", "vision_config": {}}) is None  # loads as text
    assert serves_images("llava", True) and not serves_images("mllama", True)
    assert serves_images("qwen2_vl", True) and serves_images("qwen3_vl", True)
    assert serves_images("idefics3", True) and serves_images("smolvlm", True)
    assert not serves_images("llava", False)
    qwen_text = {**llava, "text_config": {"model_type": "qwen2"}}
    with pytest.raises(ValueError, match="'qwen2' text model is not served yet"):
        text_config(qwen_text)
    pixtral = {**llava, "vision_config": {"model_type": "pixtral"}}  # Pixtral-12B's
    assert family_of(pixtral) == "pixtral" and serves_images("pixtral", True)
    assert text_config(pixtral) == text_config(llava)
    mistral3 = {**pixtral, "model_type": "mistral3"}
    assert family_of(mistral3) == "mistral3" and serves_images("mistral3", True)
    with pytest.raises(ValueError, match="'clip_vision_model' vision tower is not served yet"):
        text_config({**mistral3, "vision_config": {"model_type": "clip_vision_model"}})


def test_idefics3_text_half() -> None:
    """transformers 5 writes the rotary base under `rope_parameters` (mlx-lm's llama reads
    `rope_theta`) and ties the head by the top config; the weights' names are read by the
    family's own classes."""
    rope = {"rope_theta": 100000.0, "rope_type": "default"}
    smol = {"model_type": "smolvlm", "vision_config": {}, "tie_word_embeddings": True,
            "text_config": {"model_type": "llama", "rope_parameters": rope,
                            "tie_word_embeddings": False}}  # fmt: skip
    text = text_config(smol)
    assert text is not None and text["text_config"]["rope_theta"] == 100000.0
    assert text["text_config"]["tie_word_embeddings"] is True
    assert "rope_scaling" not in text["text_config"]
    classes = text_classes(smol)
    assert classes is not None and classes(smol)[0] is Idefics3Text
    scaled = {**rope, "rope_type": "llama3", "factor": 8.0}
    text = text_config({**smol, "text_config": {"model_type": "llama", "rope_parameters": scaled}})
    assert text is not None and text["text_config"]["rope_scaling"] == scaled


def test_qwen_text_half() -> None:
    """The hub's Qwen2-VL keeps its text fields at the top and its M-RoPE sections under
    `rope_scaling` of type `mrope` (which mlx-lm's rope does not know: dropped, the sections
    kept apart); transformers 5 writes a `text_config` with `rope_parameters`."""
    hub = {"model_type": "qwen2_vl", "vision_config": {"model_type": "qwen2_vl"},
           "hidden_size": 1536, "rope_theta": 1000000.0, "tie_word_embeddings": True,
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}  # fmt: skip
    text = text_config(hub)
    assert text is not None and text["model_type"] == "qwen2_vl"
    half = text["text_config"]
    assert half["model_type"] == "qwen2_vl_text" and half["hidden_size"] == 1536
    assert half["mrope_section"] == [16, 24, 24] and "rope_scaling" not in half
    assert "vision_config" not in half and half["tie_word_embeddings"] is True
    classes = text_classes(hub)
    assert classes is not None and classes(text)[0] is QwenVLText
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
            "mrope_interleaved": True}  # fmt: skip
    new = {"model_type": "qwen3_vl", "vision_config": {"model_type": "qwen3_vl_vision"},
           "text_config": {"model_type": "qwen3_vl_text", "rope_parameters": rope}}  # fmt: skip
    text = text_config(new)
    assert text is not None and text["model_type"] == "qwen3_vl"
    assert text["text_config"]["rope_theta"] == 5000000.0
    assert text["text_config"]["mrope_section"] == [24, 20, 20]
    assert classes(text)[0] is Qwen3VLText
    flat = {**new, "text_config": {"model_type": "qwen3_vl_text"}}
    with pytest.raises(ValueError, match="without its mrope_section"):
        text_config(flat)
