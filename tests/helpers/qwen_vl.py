"""A tiny seeded random Qwen2-VL or Qwen2.5-VL (its vision tower: patches of 14 pixels over 2
frames, each 2 x 2 block of patches merged into one row; a 2-layer Qwen2 text model with
multimodal rotary positions) built with transformers from a config and saved as transformers
saves it (weights, processor, chat template; SmolLM2's tokenizer with Qwen's vision tokens).
Its reference forward is `QwenReference`: transformers' with the images' grids.

The processor resizes an image to multiples of 28 pixels, from 4 to 64 blocks of 28 x 28 (each
a 2 x 2 block of 14-pixel patches, one placeholder token): the 40 x 60 picture is 56 x 84, 2
columns by 3 rows of placeholders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.vision import Reference, tokenizer_with

TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
              "qwen3_vl": "Qwen3VLProcessor"}  # fmt: skip


def tiny_qwen_vl_dir(
    out: Path, tokenizer_dir: Path, family: str = "qwen2_vl", seed: int = 0
) -> Path:
    """`family`: "qwen2_vl", "qwen2_5_vl" (its tower: RMS norms, a gated MLP, windowed
    attention in all but its full-attention blocks) or "qwen3_vl" (interleaved M-RoPE
    sections, deepstack)."""
    import torch
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from omlx_logprobs.models.qwen_processor import QwenImagesProcessor

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_with(out, tokenizer_dir, TOKENS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in TOKENS}
    text = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49216,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
        "eos_token_id": 2,
        # head dim 16: 8 rotary frequencies, 2 of time, 3 of height, 3 of width
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [2, 3, 3]},
    }  # fmt: skip
    if family == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4,
                  "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2}  # fmt: skip
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **_ids(ids))
        cls = tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                  "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "window_size": 56,
                  "fullatt_block_indexes": [1]}  # fmt: skip
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_ids(ids))
        cls = tf.Qwen2_5_VLForConditionalGeneration
    else:
        # Qwen3's layers (q and k norms, no biases); 14-pixel patches as the others' (the
        # hub's are 16), learned position embeddings on a 4 x 4 grid (interpolated to an
        # image's), each tower layer's merged rows added to the text layer of the same index
        text = {**text, "head_dim": 16}
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                  "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "num_position_embeddings": 16,
                  "deepstack_visual_indexes": [0, 1]}  # fmt: skip
        config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **_ids(ids))
        cls = tf.Qwen3VLForConditionalGeneration
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # logits with a spread: neither flat nor one-hot
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15 if "embed_tokens" in name else 0.08)
    model.save_pretrained(str(out))
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28},
        patch_size=14, temporal_patch_size=2, merge_size=2,
    )  # fmt: skip
    # transformers' own processor classes need torchvision (their video processor): the
    # files are written by the server's processor, under the class name the hub's have
    processor = QwenImagesProcessor(image_processor=images, tokenizer=tok, chat_template=TEMPLATE)
    processor.save_pretrained(str(out))
    named = out / "processor_config.json"
    config_ = json.loads(named.read_text())
    config_["processor_class"] = PROCESSORS[family]
    named.write_text(json.dumps(config_, indent=2))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


def _ids(ids: dict[str, int]) -> dict[str, int]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


class QwenReference(Reference):
    """transformers' float32 forward of a Qwen VL checkpoint: an image's patches flattened as
    the processor gave them, its grid, and which tokens are an image's (M-RoPE's positions)."""

    def logprobs(self, ids: list[int], images: Any = None) -> np.ndarray:  # type: ignore[override]
        torch = self.torch
        kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids])}
        if images:
            token = self.model.config.image_token_id
            flat = [i.pixels.reshape(-1, i.pixels.shape[-1]) for i in images]
            kwargs["pixel_values"] = torch.tensor(np.concatenate(flat))
            kwargs["image_grid_thw"] = torch.tensor([list(i.pixels.shape[1:4]) for i in images])
            kwargs["mm_token_type_ids"] = torch.tensor([[int(t == token) for t in ids]])
        with torch.no_grad():
            logits = self.model(**kwargs).logits[0].double()
        return torch.log_softmax(logits, -1).float().numpy()

    def image_rows(self, pixels: np.ndarray) -> np.ndarray:
        """One image's rows of input embeddings: its tower and merger alone (Qwen3-VL's, then
        its deepstack layers' rows: [1 + k, N, hidden])."""
        torch = self.torch
        with torch.no_grad():
            out = self.model.model.get_image_features(
                pixel_values=torch.tensor(pixels.reshape(-1, pixels.shape[-1])),
                image_grid_thw=torch.tensor([list(pixels.shape[1:4])]),
            )
        rows = torch.cat(list(out.pooler_output))
        deep = getattr(out, "deepstack_features", None)
        if deep is not None:
            rows = torch.stack([rows, *(torch.cat(list(layer)) for layer in deep)])
        return np.asarray(rows.numpy(), np.float32)

    def rope_index(self, ids: list[int], images: Any) -> tuple[np.ndarray, int]:
        """transformers' M-RoPE positions [3, n] of the prompt and its rope delta."""
        torch = self.torch
        token = self.model.config.image_token_id
        pos, deltas = self.model.model.get_rope_index(
            torch.tensor([ids]),
            image_grid_thw=torch.tensor([list(i.pixels.shape[1:4]) for i in images]),
            mm_token_type_ids=torch.tensor([[int(t == token) for t in ids]]),
        )
        return pos[:, 0].numpy(), int(deltas[0, 0])
