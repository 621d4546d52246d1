"""A tiny seeded random Gemma 3 (a SigLIP tower, the projector's average pool of 8 x 8 patches
into 4 x 4 rows, its soft embedding norm and projection, a 4-layer gemma3_text whose layers
alternate a sliding window of 12 positions and global attention) built with transformers from
a config and saved as transformers saves it (weights, processor, chat template; SmolLM2's
tokenizer with Gemma's image and turn tokens, named as Gemma3Processor reads them), and its
reference: transformers' float32 forward with the `token_type_ids` Gemma3Processor gives (an
image's placeholders attend to each other both ways).

An image takes 16 placeholders, written by the processor as "\\n\\n<start_of_image>", the
placeholders, "<end_of_image>\\n\\n"; the window is shorter than an image, so an image's
positions meet it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.vision import Reference, tokenizer_with

NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
         "image_token": "<image_soft_token>"}  # fmt: skip
TURNS = ["<start_of_turn>", "<end_of_turn>"]
# Gemma 3's chat template, shortened: a string content or parts, each image its start token;
# without its trims (a random model's answer that begins with a space would not be spliced
# back as its sampled ids: api/core/splice.py)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SIDE = 56  # 8 x 8 patches of 7 pixels, pooled 2 x 2: 16 placeholders an image


def tiny_gemma3_dir(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    import torch
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_with(out, tokenizer_dir, [*NAMED.values(), *TURNS])
    tok._set_model_specific_special_tokens(NAMED)  # tokenizer.boi_token etc., as Gemma's has
    text = tf.Gemma3TextConfig(
        hidden_size=64,  # sqrt 8: the embedding's scale exact in bfloat16 too
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        vocab_size=49216,
        sliding_window=12,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=2048,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
        },
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    vision = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=SIDE, patch_size=7, vision_use_head=False,
    )  # fmt: skip
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        boi_token_index=tok.convert_tokens_to_ids(NAMED["boi_token"]),
        eoi_token_index=tok.convert_tokens_to_ids(NAMED["eoi_token"]),
        image_token_index=tok.convert_tokens_to_ids(NAMED["image_token"]),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # logits with a spread: neither flat nor one-hot
        for name, p in model.named_parameters():
            p.normal_(0, 0.15 if "embed_tokens" in name else 0.08)
    model.save_pretrained(str(out))
    tf.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}),
        tokenizer=tok,
        image_seq_length=16,
        chat_template=TEMPLATE,
    ).save_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


class Gemma3Reference(Reference):
    """`Reference` with Gemma3Processor's `token_type_ids` (1 at each placeholder) where the
    prompt has images: transformers then lets each image's placeholders attend both ways."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.image_token = int(self.model.config.image_token_index)

    def logprobs(self, ids: list[int], pixels: np.ndarray | None = None) -> np.ndarray:
        if pixels is None:
            return super().logprobs(ids)
        torch = self.torch
        kinds = torch.tensor([[int(t == self.image_token) for t in ids]])
        ins: dict[str, Any] = {"input_ids": torch.tensor([ids]), "token_type_ids": kinds}
        with torch.no_grad():
            logits = self.model(**ins, pixel_values=torch.tensor(pixels)).logits[0].double()
        return torch.log_softmax(logits, -1).float().numpy()
