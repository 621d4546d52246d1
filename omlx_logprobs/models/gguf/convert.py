"""Convert a GGUF file into an mlx-lm model directory: MLX affine quantization where a block type
maps onto it exactly (quantized.py), float32 weights elsewhere.

We compute in float32 on the CPU because SmolLM2's activations reach 2.5e4, where float16 is off
by up to 1.3 nats; every tensor is dequantized as llama.cpp does (tensors.py), and a quantized
layer's dequantization is those same values, so the converted model computes with the values
llama.cpp computes with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from omlx_logprobs.models.gguf.architectures import ROPE_TENSORS, architecture
from omlx_logprobs.models.gguf.metadata import Metadata
from omlx_logprobs.models.gguf.quantized import GROUP
from omlx_logprobs.models.gguf.tensors import (
    check_types,
    converted_tensors,
    open_gguf,
    tensor_types,
)
from omlx_logprobs.models.gguf.tokenizer import write_json, write_tokenizer

# Weights are written in shards of about this size, so that converting a large file holds one
# shard in float32 at a time.
SHARD_BYTES = 2 << 30


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    progress: Callable[[str], None] | None = None,
    quantize: bool = True,
) -> None:
    """Write an mlx-lm model directory (config, safetensors, tokenizer) for a GGUF file; with
    `quantize=False`, every weight in float32.

    Raises ValueError for an architecture, tokenizer or tensor type that we do not support.
    """
    say = progress or (lambda _msg: None)
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    say(f"reading {gguf_path}")
    reader = open_gguf(gguf_path)
    stored = tensor_types(reader)
    md = Metadata(reader)
    arch = architecture(md)
    check_types(stored)
    for name in stored:  # unknown tensors fail before any work
        if name not in ROPE_TENSORS:
            arch.mlx_name(name)
    rope = {t.name: _rope_tensor(t) for t in reader.tensors if t.name in ROPE_TENSORS}
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        **{k: v for k, v in arch.config(md, rope).items() if v is not None},
        "torch_dtype": "float32",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    say("building the tokenizer")
    eos_ids = write_tokenizer(md, out_dir, config["max_position_embeddings"])
    say("converting weights" + (" (MLX quantization where exact)" if quantize else ""))
    names, quantized = _write_weights(reader, arch, config, out_dir, say, quantize)
    if quantized:
        # Every quantized layer named with its bits (a Q4_K_M file mixes 4, 5 and 8 bits);
        # the defaults are nn.quantize's required arguments, used by no layer unnamed.
        config["quantization"] = {"group_size": GROUP, "bits": 4, "mode": "affine", **quantized}
    vocab = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config["vocab_size"] = int(vocab.shape[-1])
    config["tie_word_embeddings"] = "lm_head.weight" not in names
    if any(n.endswith("self_attn.q_proj.bias") for n in names) and arch.model_type == "llama":
        config["attention_bias"] = True
    config["bos_token_id"] = md.get("tokenizer.ggml.bos_token_id")
    config["eos_token_id"] = eos_ids
    write_json(out_dir / "config.json", config)  # last: a directory with it is complete
    say("conversion done")


def _rope_tensor(t: Any) -> np.ndarray:
    from gguf.quants import dequantize

    return np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float64).ravel()


def _write_weights(
    reader: Any,
    arch: Any,
    config: dict[str, Any],
    out_dir: Path,
    say: Callable[[str], None],
    quantize: bool,
) -> tuple[list[str], dict[str, dict[str, int]]]:
    """The weights' names, and each quantized layer's group size and bits by its path."""
    import mlx.core as mx

    shards: list[dict[str, np.ndarray]] = [{}]
    size, names = 0, []
    quantized: dict[str, dict[str, int]] = {}
    paths: list[Path] = []

    def flush() -> None:
        path = out_dir / f"model-{len(paths) + 1:05d}.safetensors"
        weights = {k: mx.array(v) for k, v in shards[-1].items()}
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
        paths.append(path)
        shards[-1] = {}

    for gguf_name, tensor in converted_tensors(reader, quantize):
        if gguf_name in ROPE_TENSORS:
            continue
        name = arch.mlx_name(gguf_name)
        arrays = {name: tensor.weight}
        if tensor.bits is not None:
            path = name.removesuffix(".weight")
            arrays = {f"{path}.{suffix}": w for suffix, w in tensor.arrays().items()}
            quantized[path] = {"group_size": GROUP, "bits": tensor.bits}
        for key, w in arrays.items():
            # Row reorderings apply alike to packed rows and to their scales and biases.
            shards[-1][key] = arch.weight(gguf_name, w, config)
            size += w.nbytes
        names.append(name)
        if size >= SHARD_BYTES:
            flush()
            size = 0
    if shards[-1] or not paths:
        flush()
    if len(paths) == 1:  # one file: mlx-lm's usual name
        paths[0].rename(out_dir / "model.safetensors")
    say(
        f"wrote {len(names)} tensors ({len(quantized)} quantized, the rest float32) in"
        f" {len(paths)} file(s) to {out_dir}"
    )
    return names, quantized
