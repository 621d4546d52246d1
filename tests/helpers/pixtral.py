"""A tiny seeded random Mistral 3 or Pixtral LLaVA (a Pixtral tower, its projector, a 2-layer
mistral) built with transformers from a config and saved as transformers saves it (weights,
PixtralProcessor's config over its Pillow image processor, chat template; SmolLM2's tokenizer
with `[IMG]`, `[IMG_BREAK]` and `[IMG_END]`). Its reference forward is tests/helpers/vision.py's
`Reference`, given each image's size.

The processor scales an image to at most 64 pixels on its longest side, then up to whole blocks
of 16 pixels (Mistral 3: patches of 8, merged 2 x 2; the LLaVA: patches of 16): a 40 x 60
image is 64 x 48 pixels, 4 rows of 3 placeholders, `[IMG_BREAK]` after each row but the last,
`[IMG_END]` after it."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.vision import tokenizer_with

MARKERS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}[IMG]{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LONGEST = 64  # the image processor's longest edge, and the tower's `image_size`


def tiny_pixtral_dir(
    out: Path, tokenizer_dir: Path, family: str = "mistral3", seed: int = 0
) -> Path:
    """`family`: "mistral3" (patches of 8 pixels, the patch merger's 2 x 2 blocks, the
    projector without biases) or "pixtral" (LLaVA's model over a Pixtral tower: patches of 16,
    every patch a row, the projector with biases)."""
    import torch
    import transformers as tf
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    from omlx_logprobs.models.vision_pixtral import pixtral_processor

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_with(out, tokenizer_dir, MARKERS)
    text = tf.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49216, max_position_embeddings=2048,
        rms_norm_eps=1e-5, sliding_window=None, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )  # fmt: skip
    mistral3 = family == "mistral3"
    patch, merge = (8, 2) if mistral3 else (16, 1)
    vision = tf.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=LONGEST, patch_size=patch, hidden_act="silu",
    )  # fmt: skip
    image_token = tok.convert_tokens_to_ids("[IMG]")
    if mistral3:
        config = tf.Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=image_token,
            spatial_merge_size=merge,
            vision_feature_layer=-1,
            tie_word_embeddings=False,
        )
        model = tf.Mistral3ForConditionalGeneration
    else:
        config = tf.LlavaConfig(
            text_config=text,
            vision_config=vision,
            image_token_index=image_token,
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
            tie_word_embeddings=False,
        )
        model = tf.LlavaForConditionalGeneration
    torch.manual_seed(seed)
    net = model(config).eval()
    with torch.no_grad():  # logits with a spread: neither flat nor one-hot
        for name, p in net.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15 if "embed_tokens" in name else 0.08)
    net.save_pretrained(str(out))
    images = PixtralImageProcessorPil(
        size={"longest_edge": LONGEST}, patch_size={"height": patch, "width": patch}
    )
    processor = pixtral_processor()(
        image_processor=images,
        tokenizer=tok,
        patch_size=patch,
        spatial_merge_size=merge,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out
