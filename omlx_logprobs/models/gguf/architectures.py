"""What each GGUF architecture becomes in mlx-lm: its config.json and its tensor names.

llama.cpp's converter renames tensors (`blk.N.attn_q`), reorders the q/k rows of llama models
for its rope, and stores Gemma's norms as 1 + w; each is undone here so that the weights are the
Hugging Face model's, which mlx-lm's model classes expect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omlx_logprobs.models.gguf.metadata import Metadata

# llama.cpp's per-layer names -> mlx-lm's, common to every architecture here.
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_GEMMA3 = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3 = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that hold rope parameters, read into config.json rather than kept as weights.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

Config = dict[str, Any]


@dataclass(frozen=True)
class Architecture:
    gguf_name: str
    model_type: str  # mlx-lm's module under mlx_lm.models
    hf_class: str
    config: Callable[[Metadata, dict[str, np.ndarray]], Config]
    layer_names: dict[str, str] = field(default_factory=dict)
    permuted_qk: bool = False  # llama.cpp reordered q/k rows for its interleaved rope
    norm_shift: float = 0.0  # llama.cpp stored norm weights as w + norm_shift

    def mlx_name(self, gguf_name: str) -> str:
        base, _, suffix = gguf_name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3:
            names = {**_LAYER, **self.layer_names}
            if parts[2] in names:
                return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
        elif base in _GLOBAL:
            return f"{_GLOBAL[base]}.{suffix}"
        raise ValueError(
            f"unsupported GGUF tensor {gguf_name!r} for architecture {self.gguf_name!r}"
        )

    def weight(self, gguf_name: str, w: np.ndarray, config: Config) -> np.ndarray:
        """A converted tensor as mlx-lm's model wants it."""
        if self.permuted_qk and gguf_name.endswith((".attn_q.weight", ".attn_q.bias")):
            return unpermute(w, config["num_attention_heads"])
        if self.permuted_qk and gguf_name.endswith((".attn_k.weight", ".attn_k.bias")):
            return unpermute(w, config["num_key_value_heads"])
        if self.norm_shift and gguf_name.endswith("norm.weight"):
            return (w - np.float32(self.norm_shift)).astype(np.float32)
        return w


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (done so that its rope rotates adjacent pairs).

    llama.cpp stores w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2); mlx-lm's rope with
    traditional=False expects the Hugging Face order, the rows before that permutation.
    """
    rows = w.shape[0]
    rest = w.shape[1:]
    w = w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2)
    return np.ascontiguousarray(w.reshape(rows, *rest))


def _common(md: Metadata) -> Config:
    hidden, heads = md.arch_int("embedding_length"), md.arch_int("attention.head_count")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": md.arch_int("block_count"),
        "intermediate_size": md.arch_int("feed_forward_length", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": md.arch_int("attention.head_count_kv", heads),
        "head_dim": md.arch_int("attention.key_length", hidden // heads),
        "rms_norm_eps": float(md.arch("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(md.arch("rope.freq_base", 10000.0)),
        "max_position_embeddings": md.arch_int("context_length", 4096),
    }


def _linear_rope(md: Metadata) -> dict[str, Any] | None:
    kind = md.arch("rope.scaling.type", None)
    factor = float(md.arch("rope.scaling.factor", 1.0) or 1.0)
    if kind in (None, "none") or factor == 1.0:
        return None
    if kind != "linear":
        raise ValueError(
            f"unsupported rope scaling {kind!r} in this GGUF file: use the model's Hugging Face"
            " directory"
        )
    return {"rope_type": "linear", "factor": factor}


def _llama3_rope(freqs: np.ndarray, config: Config) -> dict[str, Any]:
    """Llama 3.1+ stores its rope scaling as per-frequency factors (`rope_freqs`), not as the
    parameters mlx-lm takes: find the parameters that reproduce them, or refuse the file."""
    dim, base = 2 * freqs.shape[0], config["rope_theta"]
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv
    factor = float(freqs.max())
    for low, high, context in [(1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384)]:
        smooth = (context / wavelen - low) / (high - low)
        expect = np.where(
            wavelen < context / high,
            1.0,
            np.where(wavelen > context / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(expect, freqs, rtol=1e-5, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": context,
            }
    raise ValueError(
        "this GGUF file's rope_freqs are not Llama 3's rope scaling: use the model's Hugging Face"
        " directory"
    )


def _llama(md: Metadata, rope: dict[str, np.ndarray]) -> Config:
    config = _common(md)
    scaling = _linear_rope(md)
    if "rope_freqs.weight" in rope:
        scaling = _llama3_rope(rope["rope_freqs.weight"], config)
    return {
        **config,
        "rope_traditional": False,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": scaling,
    }


def _qwen(md: Metadata, rope: dict[str, np.ndarray]) -> Config:
    return {**_common(md), "rope_scaling": _linear_rope(md)}


def _qwen3_moe(md: Metadata, rope: dict[str, np.ndarray]) -> Config:
    config = _qwen(md, rope)
    moe = md.arch_int("expert_feed_forward_length")
    return {
        **config,
        "intermediate_size": config["intermediate_size"] or moe,
        "num_experts": md.arch_int("expert_count"),
        "num_experts_per_tok": md.arch_int("expert_used_count"),
        "moe_intermediate_size": moe,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,  # llama.cpp renormalizes the chosen experts' weights for qwen3moe
    }


def _gemma3(md: Metadata, rope: dict[str, np.ndarray]) -> Config:
    config = _common(md)
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B model (62 layers), which
    # uses hidden_size / num_heads.
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    pattern = md.arch("attention.sliding_window_pattern", 6)
    if not isinstance(pattern, int):
        raise ValueError("a per-layer sliding_window_pattern is not supported for gemma3 GGUF")
    return {
        **config,
        "query_pre_attn_scalar": scalar,
        "sliding_window": md.arch_int("attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "rope_local_base_freq": float(md.arch("rope.freq_base_swa", 10000.0)),
        "rope_scaling": _linear_rope(md),
    }


def _phi3(md: Metadata, rope: dict[str, np.ndarray]) -> Config:
    config = _common(md)
    rotary = md.arch_int("rope.dimension_count", config["head_dim"])
    config.pop("head_dim")  # phi3 derives it from hidden_size / num_attention_heads
    out: Config = {
        **config,
        "partial_rotary_factor": rotary / (config["hidden_size"] // config["num_attention_heads"]),
        "original_max_position_embeddings": md.arch_int(
            "rope.scaling.original_context_length", config["max_position_embeddings"]
        ),
    }
    if "rope_factors_long.weight" in rope:
        out["rope_scaling"] = {
            "type": "longrope",
            "long_factor": rope["rope_factors_long.weight"].tolist(),
            "short_factor": rope["rope_factors_short.weight"].tolist(),
        }
    return out


def _mistral3(md: Metadata, rope: dict[str, np.ndarray]) -> Config:
    """Ministral 3 (llama.cpp's `mistral3`): llama's layers, YaRN rope scaling, and Llama 4's
    query temperature (queries times 1 + beta*log(1 + floor(pos / original context)))."""
    config = _common(md)
    original = md.arch_int(
        "rope.scaling.original_context_length", config["max_position_embeddings"]
    )
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": config["rope_theta"],
        "original_max_position_embeddings": original,
        "llama_4_scaling_beta": float(md.arch("attention.temperature_scale", 0.0)),
    }
    kind = md.arch("rope.scaling.type", None)
    if kind == "yarn":
        params |= {
            "rope_type": "yarn",
            "factor": float(md.arch("rope.scaling.factor")),
            # llama.cpp's defaults where the file has none.
            "beta_fast": float(md.arch("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(md.arch("rope.scaling.yarn_beta_slow", 1.0)),
            # llama.cpp's mistral3 graph cancels YaRN's magnitude scaling of q and k (its
            # attn_factor is 1 / (1 + 0.1 ln(factor))), as Ministral 3's own config does with
            # mscale = mscale_all_dim = 1.
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    elif kind not in (None, "none"):
        raise ValueError(
            f"unsupported rope scaling {kind!r} for mistral3 in this GGUF file: use the model's"
            " Hugging Face directory"
        )
    return {**config, "rope_parameters": params}


ARCHITECTURES = {
    a.gguf_name: a
    for a in [
        Architecture("llama", "llama", "LlamaForCausalLM", _llama, permuted_qk=True),
        Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen),
        Architecture("qwen3", "qwen3", "Qwen3ForCausalLM", _qwen),
        Architecture("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe, _MOE),
        Architecture(
            "gemma3", "gemma3_text", "Gemma3ForCausalLM", _gemma3, _GEMMA3, norm_shift=1.0
        ),
        Architecture("phi3", "phi3", "Phi3ForCausalLM", _phi3, _PHI3),
        # llama.cpp writes Ministral 3's q/k rows in its interleaved-rope order, as for llama.
        Architecture(
            "mistral3", "ministral3", "Ministral3ForCausalLM", _mistral3, permuted_qk=True
        ),
    ]
}


def architecture(md: Metadata) -> Architecture:
    arch = ARCHITECTURES.get(md.architecture)
    if arch is None:
        raise ValueError(
            f"unsupported GGUF architecture {md.architecture!r}: supported are"
            f" {', '.join(ARCHITECTURES)} (older Mistral and Ministral files, which llama.cpp"
            " writes as 'llama', among them); serve the model's Hugging Face or mlx-community"
            " directory instead"
        )
    return arch
