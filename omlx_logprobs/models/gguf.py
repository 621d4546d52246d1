"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

The output holds float32 weights: we compute in float32 on the CPU because SmolLM2's activations
reach 2.5e4, where float16 is off by up to 1.3 nats. Quantized GGUF tensors are dequantized exactly
as llama.cpp does (Q4_0, Q4_1 and Q8_0 map one to one onto MLX affine quantization, group 32).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx

# ggml tensor types that we convert exactly; mx.load would silently turn others into float16.
_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
# Bits per quantized element of the tensor types that mx.load splits into weight/scales/biases.
_QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_GROUP_SIZE = 32
# GGUF metadata value types -> struct format; 8 (string) and 9 (array) are handled apart.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}  # fmt: skip
_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, f.read(size))[0]


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype == 8:
        f.seek(_read(f, "Q"), 1)
    elif vtype == 9:
        etype, count = _read(f, "I"), _read(f, "Q")
        if etype in _SCALAR_FORMATS:  # fixed-size elements: skip them in one seek
            f.seek(count * struct.calcsize(_SCALAR_FORMATS[etype]), 1)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    else:
        f.seek(struct.calcsize(_SCALAR_FORMATS[vtype]), 1)


def read_tensor_types(gguf_path: Path) -> dict[str, int]:
    """Map each tensor name to its ggml type id, read from the GGUF header.

    mx.load hides the stored type (it dequantizes unsupported ones to float16 silently), so we
    parse the header ourselves to refuse what we cannot convert exactly.
    """
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is not a GGUF file")
        version = _read(f, "I")
        count_fmt = "I" if version == 1 else "Q"
        n_tensors, n_kv = _read(f, count_fmt), _read(f, count_fmt)
        for _ in range(n_kv):
            f.seek(_read(f, "Q"), 1)  # key
            _skip_value(f, _read(f, "I"))
        types = {}
        for _ in range(n_tensors):
            name = f.read(_read(f, "Q")).decode()
            f.seek(_read(f, "I") * 8, 1)  # dims
            types[name] = _read(f, "I")
            f.seek(8, 1)  # data offset
    return types


def _plain(value: Any) -> Any:
    """Metadata comes back as mx.array scalars/vectors, str or list[str]: make it plain Python."""
    return value.tolist() if isinstance(value, mx.array) else value


def _hparams(md: dict[str, Any]) -> dict[str, Any]:
    arch = _plain(md.get("general.architecture"))
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' is supported")

    def get(key: str, default: Any = None) -> Any:
        value = _plain(md.get(f"llama.{key}", default))
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "rope_traditional": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def _mlx_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        if len(parts) != 3 or parts[2] not in _LAYER_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _dequantize(name: str, ggml_type: str, tensors: dict[str, mx.array]) -> mx.array:
    w = tensors[f"{name}.weight"]
    if ggml_type not in _QUANT_BITS:
        return w.astype(mx.float32)
    scales, biases = tensors[f"{name}.scales"], tensors[f"{name}.biases"]
    bits = _QUANT_BITS[ggml_type]
    # The packing must match the type: in_features = 32 * scale columns = w columns * 32 / bits.
    if w.shape[-1] * 32 // bits != scales.shape[-1] * _GROUP_SIZE:
        raise ValueError(f"{name}: {ggml_type} shapes {w.shape} / {scales.shape} do not match")
    # float32 scales and biases make the arithmetic match llama.cpp's (f16 -> f32, then d*q + m).
    return mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32),
        group_size=_GROUP_SIZE, bits=bits, dtype=mx.float32,
    )  # fmt: skip


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's reordering of q/k rows (done so its rope can rotate adjacent pairs).

    llama.cpp stores w.reshape(n_head, 2, d/2, in).swapaxes(1, 2); mlx-lm's rope with
    traditional=False expects the Hugging Face order, i.e. the rows before that permutation.
    """
    out_dim, in_dim = w.shape
    w = w.reshape(n_head, out_dim // n_head // 2, 2, in_dim).swapaxes(1, 2)
    return w.reshape(out_dim, in_dim)


def _check_types(stored: dict[str, int]) -> None:
    bad = {n: t for n, t in stored.items() if t not in _GGML_TYPES}
    if bad:
        name, t = next(iter(bad.items()))
        raise ValueError(
            f"unsupported GGUF tensor type {t} for {name} (and {len(bad) - 1} more): "
            f"supported are {', '.join(_GGML_TYPES.values())}"
        )


def _convert_weights(
    stored: dict[str, int], tensors: dict[str, mx.array], config: dict[str, Any]
) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for gguf_name, ggml_type in stored.items():
        name = gguf_name.removesuffix(".weight")
        mlx_name = _mlx_name(gguf_name)  # first, so that unknown tensors fail before any work
        w = _dequantize(name, _GGML_TYPES[ggml_type], tensors)
        if name.endswith(".attn_q"):
            w = _unpermute(w, config["num_attention_heads"])
        elif name.endswith(".attn_k"):
            w = _unpermute(w, config["num_key_value_heads"])
        weights[mlx_name] = w
    return weights


def _build_tokenizer(md: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model, pre = _plain(md.get("tokenizer.ggml.model")), _plain(md.get("tokenizer.ggml.pre"))
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE")
    tokens: list[str] = _plain(md["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ")) for m in _plain(md["tokenizer.ggml.merges"])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp's "smollm" splits digits one by one before the GPT-2 regex
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    elif pre in (None, "default", "gpt-2"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    # Offsets only; SmolLM2 adds no BOS, so nothing is inserted into the ids.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _token_types(md, len(tokens))
    added = [
        AddedToken(t, special=kind == _CONTROL_TOKEN, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)
    ]
    tok.add_tokens(added)  # ids are unchanged: every token is already in the vocabulary
    return tok


def _token_types(md: dict[str, Any], n_tokens: int) -> list[int]:
    # A GGUF without token types has only normal tokens (type 1).
    return list(_plain(md.get("tokenizer.ggml.token_type", [1] * n_tokens)))


def _token(md: dict[str, Any], tokens: list[str], key: str) -> str | None:
    value = _plain(md.get(f"tokenizer.ggml.{key}_token_id"))
    return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None


def _write_tokenizer(md: dict[str, Any], out_dir: Path) -> list[int]:
    """Write tokenizer.json and friends; return the stop token ids for config.json."""
    tok = _build_tokenizer(md)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens: list[str] = _plain(md["tokenizer.ggml.tokens"])
    keys = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    special = {k: _token(md, tokens, key) for k, key in keys.items()}
    special["pad"] = special["pad"] or special["eos"]
    special_map = {f"{k}_token": v for k, v in special.items() if v is not None}
    types = _token_types(md, len(tokens))
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL_TOKEN]
    config = {
        **special_map,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_plain(md.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(_plain(md.get("tokenizer.ggml.add_eos_token", False))),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_plain(md.get("llama.context_length", 2048))),
        "additional_special_tokens": [t for t in control if t not in special_map.values()],
    }
    template = _plain(md.get("tokenizer.chat_template"))
    if template:
        config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    eos = [tokens.index(special["eos"])] if special["eos"] else []
    # Chat models end a turn with <|im_end|> but may also emit <|endoftext|>: stop on both.
    return eos + [tokens.index(t) for t in _STOP_TOKENS if t in control and t != special["eos"]]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: Path, out_dir: Path, progress: Callable[[str], None] | None = None
) -> None:
    """Write an mlx-lm model directory (config, float32 safetensors, tokenizer) for a GGUF file.

    Raises ValueError for an architecture, tokenizer or tensor type that we do not support.
    """
    say = progress or (lambda _msg: None)
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    say(f"reading {gguf_path}")
    stored = read_tensor_types(gguf_path)
    _check_types(stored)
    loaded = mx.load(str(gguf_path), return_metadata=True)
    assert isinstance(loaded, tuple)
    tensors, md = loaded
    config = _hparams(md)
    out_dir.mkdir(parents=True, exist_ok=True)
    say("building the tokenizer")
    eos_ids = _write_tokenizer(md, out_dir)
    say("dequantizing weights to float32")
    weights = _convert_weights(stored, tensors, config)
    config["vocab_size"] = int(weights["model.embed_tokens.weight"].shape[0])
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    config["bos_token_id"] = _plain(md.get("tokenizer.ggml.bos_token_id"))
    config["eos_token_id"] = eos_ids
    say(f"writing {len(weights)} float32 tensors to {out_dir / 'model.safetensors'}")
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out_dir / "config.json", config)
    say("conversion done")
