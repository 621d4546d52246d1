"""Build a random-weight llama (or Qwen3.5 hybrid) as an mlx-lm model directory, with SmolLM2's
tokenizer.

The GPU benchmark's model (about 1.1B parameters, bfloat16) has no weights anyone can download
here, and needs none: throughput depends on shapes, not values.

    python -m bench.randmodel --out /tmp/rand-1b --tokenizer-from DIR [--size 1b|tiny|hybrid-9b]
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import omlx_logprobs  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes

SIZES = {
    # hidden 2048, 16 layers, vocab 49,152: the GPU preset's model (1.07B parameters).
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # SmolLM2-135M's shapes (the CPU preset's quantized row).
    "135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # Llama-3-8B's shapes with SmolLM2's vocabulary (7.5B parameters, 15 GB in bfloat16): the
    # model split over two GPUs in bench/experiments/gpu_distributed.sh.
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # A Qwen3.5-shaped hybrid (the family most Mac users run): gated delta (linear attention)
    # layers, every fourth layer full attention, 9B parameters at Qwen3.5's head shapes: the
    # hybrid conversation benchmark's model (docs/benchmarks.md).
    "hybrid-9b": {
        "model_type": "qwen3_5",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 12288,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "type": "default",
            "mrope_section": [11, 11, 10],
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    },
}


def build(
    out: Path,
    tokenizer_from: Path,
    size: str = "1b",
    dtype: str = "bfloat16",
    vocab: int = 49152,
    context: int = 8192,
    bits: int = 0,
) -> Path:
    """`vocab` may exceed the tokenizer's (Qwen's 151,936): ids past it are never prompted but
    are sampled and extracted like any other."""
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    config = {
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **SIZES[size],
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "eos_token_id": [2],
    }
    mx.random.seed(0)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    # Embeddings (and an untied head) scaled so the logits are neither flat nor one-hot.
    for name, w in nn.utils.tree_flatten(model.parameters()):  # type: ignore[attr-defined]
        if w.ndim == 2 and w.shape[0] == vocab:
            model.load_weights([(name, mx.random.normal(w.shape) * 0.02)], strict=False)
    model.set_dtype(getattr(mx, dtype))
    if bits:  # as `mlx_lm convert -q` writes it, without the full-precision copy on disk
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    weights = dict(nn.utils.tree_flatten(model.parameters()))  # type: ignore[attr-defined]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-from", type=Path, required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--context", type=int, default=8192, help="max_position_embeddings")
    ap.add_argument("--bits", type=int, default=0, help="quantized to this many bits (0: not)")
    a = ap.parse_args(argv)
    print(build(a.out, a.tokenizer_from, a.size, a.dtype, a.vocab, a.context, a.bits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
