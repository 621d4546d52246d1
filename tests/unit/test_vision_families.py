"""Which configs load as vision models (models/vision.py), and the clear refusal of a served
family whose text model its mlx-lm module cannot build."""

from __future__ import annotations

import pytest

from omlx_logprobs.models.vision import family_of, serves_images, text_config


def test_families() -> None:
    llava = {"model_type": "llava", "vision_config": {}, "text_config": {"model_type": "llama"}}
    assert family_of(llava) == "llava" and text_config(llava) == {"model_type": "mistral3"}
    assert (
        family_of({"model_type": "llama"}) is None and text_config({"model_type": "llama"}) is None
    )
    assert family_of({"model_type": "qwen2_vl", "vision_config": {}}) is None  # loads as text
    assert serves_images("llava", True) and not serves_images("qwen2_vl", True)
    assert not serves_images("llava", False)
    qwen_text = {**llava, "text_config": {"model_type": "qwen2"}}
    with pytest.raises(ValueError, match="'qwen2' text model is not served yet"):
        text_config(qwen_text)
