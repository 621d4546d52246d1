"""A random LLaVA of a realistic small size for the vision benchmark, written as the published
llava-hf checkpoints are (transformers' config and processor, `vision_tower.vision_model.*`
weights), so that our server and mlx-vlm's load the same files.

Text half: SmolLM2-135M's shape (30 layers, 576 wide) with its tokenizer and an `<image>` token;
tower: CLIP ViT-B/16 at 224 pixels (12 layers, 768 wide), 196 placeholder tokens an image.

    .venv/bin/python -m bench.vlmmodel --out /tmp/vlm-bench [--tokenizer-from DIR]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
SIDE, PATCH = 224, 16
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_with(out, tokenizer_dir, [IMAGE_TOKEN])
    image_token = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert isinstance(image_token, int)
    text = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49216, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        image_size=SIDE, patch_size=PATCH, projection_dim=512,
    )  # fmt: skip
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=image_token,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # logits with a spread, as a trained model's have
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15 if "embed_tokens" in name else 0.02)
    model.save_pretrained(str(out))
    # The published layout: mlx-vlm reads the tower under `vision_model` (ours reads both).
    weights = load_file(str(out / "model.safetensors"))
    renamed = {
        ("vision_tower.vision_model." + k[len("vision_tower.") :])
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
        else k: v
        for k, v in weights.items()
    }
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    images = CLIPImageProcessorPil(
        size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        chat_template=TEMPLATE,
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


def tokenizer_with(out: Path, tokenizer_dir: Path, tokens: list[str]) -> Any:
    """SmolLM2's tokenizer (its files staged in `out` and removed) with these special tokens
    (the tests' tiny vision models take theirs from here too: tests/helpers/vision.py)."""
    from transformers import AutoTokenizer

    staged = out / "tokenizer-src"
    staged.mkdir(exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, staged / f.name)
    tok = AutoTokenizer.from_pretrained(str(staged))
    tok.add_tokens(tokens, special_tokens=True)
    shutil.rmtree(staged)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="default: the embedded model")
    a = ap.parse_args()
    if a.tokenizer_from is None:
        from omlx_logprobs.models.embedded import ensure_embedded_model

        a.tokenizer_from = Path(ensure_embedded_model())
    print(build(a.out, a.tokenizer_from))


if __name__ == "__main__":
    main()
