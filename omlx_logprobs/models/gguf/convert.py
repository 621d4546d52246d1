"""Convert a GGUF file into an mlx-lm model directory of float32 weights.

We compute in float32 on the CPU because SmolLM2's activations reach 2.5e4, where float16 is off
by up to 1.3 nats; every tensor type is dequantized as llama.cpp does (tensors.py), so the
converted model computes with the values llama.cpp computes with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from omlx_logprobs.models.gguf.architectures import ROPE_TENSORS, architecture
from omlx_logprobs.models.gguf.metadata import Metadata
from omlx_logprobs.models.gguf.tensors import check_types, float32_tensors, open_gguf, tensor_types
from omlx_logprobs.models.gguf.tokenizer import write_json, write_tokenizer

# Weights are written in shards of about this size, so that converting a large file holds one
# shard in float32 at a time.
SHARD_BYTES = 2 << 30


def convert_gguf(
    gguf_path: Path, out_dir: Path, progress: Callable[[str], None] | None = None
) -> None:
    """Write an mlx-lm model directory (config, float32 safetensors, tokenizer) for a GGUF file.

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
    say("dequantizing weights to float32")
    names = _write_weights(reader, arch, config, out_dir, say)
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
    reader: Any, arch: Any, config: dict[str, Any], out_dir: Path, say: Callable[[str], None]
) -> list[str]:
    import mlx.core as mx

    shards: list[dict[str, np.ndarray]] = [{}]
    size, names = 0, []
    paths: list[Path] = []

    def flush() -> None:
        path = out_dir / f"model-{len(paths) + 1:05d}.safetensors"
        weights = {k: mx.array(v) for k, v in shards[-1].items()}
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
        paths.append(path)
        shards[-1] = {}

    for gguf_name, w in float32_tensors(reader):
        if gguf_name in ROPE_TENSORS:
            continue
        name = arch.mlx_name(gguf_name)
        shards[-1][name] = arch.weight(gguf_name, w, config)
        names.append(name)
        size += w.nbytes
        if size >= SHARD_BYTES:
            flush()
            size = 0
    if shards[-1] or not paths:
        flush()
    if len(paths) == 1:  # one file: mlx-lm's usual name
        paths[0].rename(out_dir / "model.safetensors")
    say(f"wrote {len(names)} float32 tensors in {len(paths)} file(s) to {out_dir}")
    return names
