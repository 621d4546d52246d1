"""GGUF files written in tests, the way llama.cpp's converter writes a Hugging Face model: its
tensor names, its reordered q/k rows for llama, Gemma's norms stored as 1 + w, rope parameters
as tensors, and a tokenizer trained here. The `gguf` package writes the file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, RopeScalingType

from tests.helpers.kquants import quantize

# GGUF architecture and mlx-lm model type.
ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
          "gemma3_text": "gemma3", "phi3": "phi3", "ministral3": "mistral3"}  # fmt: skip
# Families whose q/k rows llama.cpp reorders for its interleaved rope.
_PERMUTED = ("llama", "ministral3")
_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}
_GEMMA3 = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, hello there; the model reads the words and the numbers 12345 and 678.",
    "What is the capital of France? The capital of France is Paris.",
    "def main():\n    return 42\n\nprint(main())\n",
]


def gguf_name(name: str, model_type: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    parts = base.split(".")
    assert parts[:2] == ["model", "layers"], name
    inner = ".".join(parts[3:])
    names = {**_NAMES, **(_GEMMA3 if model_type == "gemma3_text" else {})}
    return f"blk.{parts[2]}.{names[inner]}.{suffix}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of llama's q/k rows for its interleaved rope."""
    rows = w.shape[0]
    out = w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(out.reshape(w.shape))


def llama3_rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """The per-frequency factors llama.cpp writes for Llama 3's rope scaling."""
    s = config["rope_scaling"]
    dim = config["head_dim"]
    freqs = config["rope_theta"] ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    context, low, high = (
        s["original_max_position_embeddings"],
        s["low_freq_factor"],
        s["high_freq_factor"],
    )
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(s["factor"])
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of `size` tokens trained on CORPUS: tokens, merges."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(tokens) <= size, len(tokens)
    return tokens + _unused(size - len(tokens)), merges


def _unused(n: int) -> list[str]:
    """Filler tokens up to the model's vocabulary size (llama.cpp's type 5, unused)."""
    return [f"<unused{i}>" for i in range(n)]


def sentencepiece_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary (<unk>, <s>, </s>, 256 byte tokens, then pieces with
    ▁ for spaces), with llama.cpp's token types and scores that rank the merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Pieces within words, each word's first with its ▁, as SentencePiece builds them.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    n_pieces = size - 3 - 256
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    pieces = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    # Later merges score lower, as in a SentencePiece model; single characters lowest.
    scores = [0.0] * (3 + 256) + [
        -1000.0 if len(p) == 1 else -float(i) for i, p in enumerate(pieces)
    ]
    assert len(tokens) <= size, len(tokens)
    filler = size - len(tokens)
    return tokens + _unused(filler), scores + [-1e4] * filler, types + [5] * filler


def write_gguf(
    path: Path,
    config: dict[str, Any],
    weights: dict[str, np.ndarray],
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    tokenizer: str = "gpt2",
    pre: str = "qwen2",
    types: dict[str, GGMLQuantizationType] | None = None,
    file_type: LlamaFileType | None = None,
) -> None:
    """A GGUF file of an mlx-lm model's config and float32 weights: `qtype` for every matrix,
    or the type `types` gives a weight's mlx-lm name (as a Q4_K_M file mixes Q4_K and Q6_K);
    `file_type`: the `general.file_type` llama.cpp's quantizer writes (what the mix is named)."""
    model_type = config["model_type"]
    arch = ARCHES[model_type]
    w = GGUFWriter(str(path), arch)
    if file_type is not None:
        w.add_file_type(file_type)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    w.add_block_count(config["num_hidden_layers"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads", heads))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    w.add_context_length(config.get("max_position_embeddings", 4096))
    w.add_rope_dimension_count(head_dim)
    if model_type == "qwen3_moe":
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if model_type == "gemma3_text":
        w.add_sliding_window(config["sliding_window"])
    if model_type == "phi3" and config.get("rope_scaling"):
        w.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        for kind in ("long", "short"):
            factors = np.array(config["rope_scaling"][f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
    if model_type == "ministral3" and rope.get("rope_type") == "yarn":
        # As llama.cpp's converter writes Ministral 3's rope parameters.
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if model_type == "llama" and config.get("rope_scaling"):
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    _add_tokenizer(w, config["vocab_size"], tokenizer, pre)
    for name, value in weights.items():
        value = np.asarray(value, dtype=np.float32)
        if model_type in _PERMUTED and ".q_proj." in name:
            value = _permute(value, heads)
        elif model_type in _PERMUTED and ".k_proj." in name:
            value = _permute(value, config.get("num_key_value_heads", heads))
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            value = value + np.float32(1.0)
        _add_tensor(w, gguf_name(name, model_type), value, (types or {}).get(name, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_tensor(w: GGUFWriter, name: str, value: np.ndarray, qtype: GGMLQuantizationType) -> None:
    from gguf.constants import GGML_QUANT_SIZES

    block = GGML_QUANT_SIZES[qtype][0]
    # As llama.cpp does, norms and other vectors stay float32; so do rows that do not fill
    # whole blocks.
    if qtype == GGMLQuantizationType.F32 or value.ndim < 2 or value.shape[-1] % block:
        w.add_tensor(name, value)
    else:
        w.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)


def _add_tokenizer(w: GGUFWriter, vocab_size: int, kind: str, pre: str) -> None:
    if kind == "gpt2":
        tokens, merges = byte_level_vocab(vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3 if t in SPECIALS else 5 if t.startswith("<unused") else 1
                           for t in tokens])  # fmt: skip
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(pre == "llama-bpe")
    else:
        tokens, scores, types = sentencepiece_vocab(vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(kind == "llama")
