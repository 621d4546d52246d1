"""A tiny seeded random LLaVA (a CLIP or SigLIP tower, a projector, a 2-layer llama) built with
transformers from a config and saved as transformers saves it (weights, processor config, chat
template; SmolLM2's tokenizer with an `<image>` token), and transformers' float32 forward of the
same weights and images: the reference the served logprobs are held to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.vlmmodel import tokenizer_with

IMAGE_TOKEN = "<image>"
SIDE = 56  # the tower's input: 4x4 patches of 14 pixels, so 16 placeholder tokens per image
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_llava_dir(
    out: Path, tokenizer_dir: Path, seed: int = 0, tower: str = "clip", ends: bool = False
) -> Path:
    """`tower`: "clip" (its class token dropped: the `default` feature strategy, quick GELU)
    or "siglip" (no class token: `full`; the tanh GELU). `ends`: the model answers its end token
    at once, by ~e^-70 (a random model otherwise runs to its length limit, and a client that
    checks a response `completed` needs one that stops)."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipVisionConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_with(out, tokenizer_dir, [IMAGE_TOKEN])
    text = tiny_llama_config()
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "image_size": SIDE, "patch_size": 14}  # fmt: skip
    clip = tower == "clip"
    vision = (
        CLIPVisionConfig(**shape, projection_dim=32)
        if clip
        else SiglipVisionConfig(**shape, vision_use_head=False)
    )
    strategy = "default" if clip else "full"
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1,
        vision_feature_select_strategy=strategy,
        max_position_embeddings=2048,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # logits with a spread: neither flat nor one-hot
        for name, p in model.named_parameters():
            p.normal_(0, 0.15 if "embed_tokens" in name else 0.08)
        if ends:  # every text token's residual points along dimension 0, and only the end
            # token's head row reads it: the final norm keeps dimension 0 alone
            lm = model.model.language_model
            lm.embed_tokens.weight[:, 0] = 100.0
            lm.norm.weight.zero_()
            lm.norm.weight[0] = 1.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[text.eos_token_id, 0] = 10.0
    model.save_pretrained(str(out))
    images = (
        CLIPImageProcessorPil(
            size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}
        )
        if clip
        else SiglipImageProcessorPil(size={"height": SIDE, "width": SIDE})
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy=strategy,
        chat_template=TEMPLATE,
        num_additional_image_tokens=1 if clip else 0,
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


def tiny_llama_config(rope_theta: float = 10000.0, tie: bool = False) -> Any:
    """The language half's config: a 2-layer llama over SmolLM2's tokenizer, its vocabulary
    (49,153 with LLaVA's image token, 49,192 with Idefics3's markers) padded to 49,216."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49216,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        tie_word_embeddings=tie,
        eos_token_id=2,
    )


def assert_answer_rows(entries: Any, out: list[int], rows: np.ndarray, k: int) -> None:
    """Each answer entry (the chat API's logprobs content) against the reference row that
    predicts it: the greedy id, its logprob and the top k, within 1e-4."""
    for j, entry in enumerate(entries):
        row = rows[j]
        assert out[j] == int(np.argmax(row))
        assert abs(entry.logprob - row[out[j]]) < 1e-4
        top = [t.logprob for t in entry.top_logprobs]
        np.testing.assert_allclose(top, np.sort(row)[::-1][:k], atol=1e-4)


def assert_prompt_rows(
    scored: list[Any], prompt: list[int], rows: np.ndarray, k: int, image_token: int | None
) -> None:
    """vLLM's `prompt_logprobs` of a prompt against the reference rows of its positions: null
    first and at each image placeholder (not text), every other position's token and top k
    within 1e-4."""
    assert scored[0] is None and len(scored) == len(prompt)
    for i in range(1, len(prompt)):
        if prompt[i] == image_token:
            assert scored[i] is None
            continue
        entry = scored[i][str(prompt[i])]
        assert abs(entry["logprob"] - rows[i - 1][prompt[i]]) < 1e-4
        np.testing.assert_allclose(
            sorted((e["logprob"] for e in scored[i].values()), reverse=True)[:k],
            np.sort(rows[i - 1])[::-1][:k],
            atol=1e-4,
        )


def picture(seed: int, width: int = 40, height: int = 60) -> Any:
    """A seeded noise image (PIL)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def png_bytes(image: Any) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class Reference:
    """transformers' model of the checkpoint (its config's architecture: LLaVA, Idefics3,
    SmolVLM, Mistral 3) in float32 on the same weights: log-softmax of each position. `sizes`:
    each image's (height, width) in pixels, for Pixtral's towers (images of any size, padded
    to the largest in `pixels`)."""

    def __init__(self, path: Path) -> None:
        import json

        import torch
        import transformers

        self.torch = torch
        arch = json.loads((path / "config.json").read_text())["architectures"][0]
        self.model = (
            getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()
        )

    def logprobs(
        self, ids: list[int], pixels: np.ndarray | None = None, sizes: Any = None
    ) -> np.ndarray:
        torch = self.torch
        kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids])}
        if pixels is not None:
            kwargs["pixel_values"] = torch.tensor(pixels)
        if sizes is not None:
            kwargs["image_sizes"] = torch.tensor(sizes)
        with torch.no_grad():
            logits = self.model(**kwargs).logits[0].double()
        return torch.log_softmax(logits, -1).float().numpy()

    def image_rows(self, pixels: np.ndarray, sizes: Any = None) -> np.ndarray:
        """One image's rows of input embeddings [N, hidden]: its tower and projector alone."""
        torch = self.torch
        kwargs = {} if sizes is None else {"image_sizes": torch.tensor(sizes)}
        with torch.no_grad():
            out = self.model.model.get_image_features(pixel_values=torch.tensor(pixels), **kwargs)
        return np.asarray(out.pooler_output[0].double().numpy(), np.float32)
