"""Tiny seeded random models of each mlx-lm family, built from a config and saved as an mlx-lm
directory with SmolLM2's tokenizer (the vocabulary every family here shares), then loaded the
way the server loads a model."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

VOCAB = 49152
WINDOW = 8  # sliding windows: shorter than every test prompt

# Qwen3-Next's and Qwen3.5's linear-attention (gated delta) layers, every layer but each second.
_GATED_DELTA = {
    "num_hidden_layers": 2,
    "full_attention_interval": 2,
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
_ATTN = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}

# SmolLM2's case in small: 3 query heads and 1 KV head (of 8 columns; a hidden size of 3 heads'
# width, as transformers requires) do not divide over 2 ranks, though the projections (24 and 8
# rows) do: mlx-lm's shard would leave each rank 1 head and 0 KV heads.
ODD_HEADS = {"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 24}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {**_ATTN, "num_hidden_layers": 2},
    # Soft-capped attention scores and logits, grouped queries (models/padded_batch.py).
    "gemma2": {**_ATTN, "num_hidden_layers": 2, "query_pre_attn_scalar": 8},
    "qwen2": {**_ATTN, "num_hidden_layers": 2},
    "qwen3": {**_ATTN, "num_hidden_layers": 2, "tie_word_embeddings": False},
    "qwen3_moe": {
        **_ATTN,
        "num_hidden_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "gemma3_text": {
        **_ATTN,
        "num_hidden_layers": 3,
        "query_pre_attn_scalar": 8,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
    },
    "gpt_oss": {
        **_ATTN,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "ministral3": {
        **_ATTN,
        "num_hidden_layers": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "rope_theta": 10000.0,
            "rope_type": "default",
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 2048,
        },
    },
    "phi3": {**_ATTN, "num_hidden_layers": 2, "tie_word_embeddings": False},
    "gpt2": {
        "n_ctx": 1024,
        "n_embd": 32,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 1024,
        "layer_norm_epsilon": 1e-5,
        "vocab_size": VOCAB,
    },
    "mamba2": {
        "num_heads": 4,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "state_size": 8,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, 100.0],
        "time_step_rank": "auto",
    },
    "qwen3_next": {
        **_ATTN,
        **_GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.5,
        "tie_word_embeddings": False,
    },
    # Qwen3.5: linear-attention (gated delta) layers every layer but each second, dense MLPs.
    "qwen3_5": {
        **_ATTN,
        **_GATED_DELTA,
        "rope_parameters": {
            "type": "default",
            "mrope_section": [1, 1, 0],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        "tie_word_embeddings": False,
    },
    "lfm2": {
        **_ATTN,
        "num_hidden_layers": 2,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 32,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention"],
    },
    "granitemoehybrid": {
        **_ATTN,
        "num_hidden_layers": 2,
        "attention_bias": False,
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.125,
        "logits_scaling": 2.0,
        "residual_multiplier": 0.5,
        "layer_types": ["mamba", "attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 32,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
    },
    "falcon_h1": {
        **_ATTN,
        "num_hidden_layers": 2,
        "mamba_d_conv": 4,
        "mamba_d_head": 8,
        "mamba_d_ssm": 32,
        "mamba_d_state": 8,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
        "embedding_multiplier": 2.0,
        "lm_head_multiplier": 0.5,
    },
    "nemotron_h": {
        **_ATTN,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "mamba_proj_bias": False,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "-"],
    },
}


def _model_class(model_type: str) -> tuple[Any, Any]:
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model, module.ModelArgs


def build_family(
    model_type: str,
    out: Path,
    tokenizer_dir: Path,
    seed: int = 1234,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """A tiny `model_type` model with seeded random weights, saved in `out` (an mlx-lm
    directory with SmolLM2's tokenizer); `overrides`: config fields other than FAMILIES'."""
    family = FAMILIES[model_type]
    config = {"model_type": model_type, "eos_token_id": [2, 0], **family, **(overrides or {})}
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model_cls, args_cls = _model_class(model_type)
    model = model_cls(args_cls.from_dict(config))
    weights = dict(nn.utils.tree_flatten(model.parameters()))  # type: ignore[attr-defined]
    # Embeddings with logits of a standard deviation near 1 (neither flat nor one-hot): sampling
    # leaves the argmax, and ranks and top lists carry information.
    for name, w in weights.items():
        if w.ndim == 2 and w.shape[0] == VOCAB:
            weights[name] = mx.random.normal(w.shape) * 0.15
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out
