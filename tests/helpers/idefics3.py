"""A tiny seeded random Idefics3 or SmolVLM (a SigLIP-shaped tower, the connector's pixel
shuffle and projection, a 2-layer llama) built with transformers from a config and saved as
transformers saves it (weights, processor, chat template; SmolLM2's tokenizer with the image,
tile marker and row/column tokens these models' tokenizers have). Its reference forward is
tests/helpers/vision.py's `Reference`.

The Idefics3 cuts an image into tiles: scaled to 112 pixels on its longest side, then into
56-pixel tiles (2 x 2, or 2 x 1 for a tall one) and the whole image scaled to one more tile,
each tile 4 placeholder tokens after its row and column marker. The SmolVLM scales an image to
one 112-pixel tile (its longest side no longer than a tile's), 16 placeholders (SmolVLM2's
pixel shuffle, 4 x 4 patches a row) after the global-image marker, in the layout the hub's
SmolVLM checkpoints have (`preprocessor_config.json` beside a `processor_config.json` naming
SmolVLMProcessor, which transformers cannot build here: it needs num2words; a vision config
without the fields its class defaults)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.vision import tiny_llama_config, tokenizer_with

MARKERS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
# SmolVLM's chat template as the hub has it: a message's content read only as parts (a string
# content is given to it as one text part: api/core/parts.py)
TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def tiny_idefics3_dir(
    out: Path, tokenizer_dir: Path, family: str = "idefics3", seed: int = 0
) -> Path:
    """`family`: "idefics3" (tiles of 56 pixels, patches of 14, the pixel shuffle's 2 x 2
    patches a row: 4 placeholders a tile; an untied head) or "smolvlm" (one tile of 112
    pixels, patches of 7, SmolVLM2's 4 x 4 patches a row: 16 placeholders; the head tied to
    the token embedding, so the checkpoint has no `lm_head`)."""
    import torch
    import transformers as tf

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_with(out, tokenizer_dir, MARKERS)
    smol = family == "smolvlm"
    # SmolLM2's rotary base, which transformers 5 writes under rope_parameters
    text = tiny_llama_config(rope_theta=100000.0, tie=smol)
    side, patch, scale = (112, 7, 4) if smol else (56, 14, 2)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "image_size": side, "patch_size": patch}  # fmt: skip
    vision = (tf.SmolVLMVisionConfig if smol else tf.Idefics3VisionConfig)(**shape)
    config = (tf.SmolVLMConfig if smol else tf.Idefics3Config)(
        text_config=text,
        vision_config=vision,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=scale,
        tie_word_embeddings=smol,
    )
    torch.manual_seed(seed)
    cls = tf.SmolVLMForConditionalGeneration if smol else tf.Idefics3ForConditionalGeneration
    model = cls(config).eval()
    with torch.no_grad():  # logits with a spread: neither flat nor one-hot
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15 if "embed_tokens" in name else 0.08)
    model.save_pretrained(str(out))
    seq_len = (side // patch) ** 2 // scale**2
    if smol:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import (
            SmolVLMImageProcessorPil,
        )

        images = SmolVLMImageProcessorPil(
            size={"longest_edge": side}, max_image_size={"longest_edge": side}
        )
        images.save_pretrained(str(out))
        processor = {"image_seq_len": seq_len, "processor_class": "SmolVLMProcessor"}
        (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
        # the hub's SmolVLM2 config leaves out what SmolVLMVisionConfig defaults
        saved = json.loads((out / "config.json").read_text())
        for key in ("hidden_act", "layer_norm_eps", "num_channels"):
            del saved["vision_config"][key]
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    else:
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil,
        )

        images = Idefics3ImageProcessorPil(
            size={"longest_edge": 112}, max_image_size={"longest_edge": 56}
        )
        tf.Idefics3Processor(
            image_processor=images, tokenizer=tok, image_seq_len=seq_len, chat_template=TEMPLATE
        ).save_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out
