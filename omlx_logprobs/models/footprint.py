"""The memory a model's weights will take once loaded, estimated from its files without loading
them: what `--max-model-memory-mib` counts (api/core/loading.py)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

# The estimate is the weights as they will sit in memory, plus this share for what grows beside
# them (the batch's keys and values, activations, the process itself).
MARGIN = 1.1
_FLOATS = {"F16": 2, "BF16": 2, "F32": 4}


def weight_mib(path: Path, float_bytes: int | None = None, dequantize: bool = False) -> int:
    """The estimated memory of a model's weights in MiB, MARGIN included, from the safetensors
    headers: floating tensors at `float_bytes` each when given (the dtype the model is cast to,
    models/dtype.py), packed quantized weights as float32 when `dequantize` (the CPU's auto
    dtype dequantizes them at load when they fit). Any other file (a scripted description)
    counts its size on disk."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    bits = _quantized_bits(path) if dequantize else {}
    total = 0
    for f in files:
        if f.suffix == ".safetensors":
            total += _tensor_bytes(f, float_bytes, bits)
        else:
            total += f.stat().st_size
    return max(1, math.ceil(total * MARGIN / 2**20))


def kv_bytes_per_token(path: Path, float_bytes: int = 4) -> int:
    """The keys and values one token adds to a sequence's cache (every layer's), from
    config.json's attention shape; 0 where the config does not tell (a scripted description,
    a family whose cache is not one key and value per head)."""
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return 0
    c = json.loads(config.read_text())
    c = c.get("text_config", c)
    try:
        layers, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    return 2 * layers * kv_heads * head_dim * float_bytes


def kv_memory(model: Any) -> tuple[int, int]:
    """(one token's keys and values at float32, the host's memory less the weights') for a
    LoadedModel: what a request's context is checked against at admission (api/core/validation.py).
    float32 is the CPU's dtype and an upper bound elsewhere; the host's memory is a Mac's
    unified memory (on a GPU host the card may have less: its prefill is bounded by
    runner/query_blocks.py, its rows by max_num_seqs). (0, 0) where the config does not tell."""
    import psutil

    path = getattr(model, "path", None)
    if not isinstance(path, Path):
        return 0, 0
    per_token = kv_bytes_per_token(path)
    if not per_token:
        return 0, 0
    total = psutil.virtual_memory().total
    return per_token, max(total - (weight_mib(path) << 20), 0)


def _quantized_bits(path: Path) -> dict[str, int]:
    """Bits by packed weight's name: "" for the default, a layer's own where config.json names
    it (a converted GGUF mixes 4, 5 and 8 bits)."""
    config = path / "config.json"
    if not config.is_file():
        return {}
    q = json.loads(config.read_text()).get("quantization") or {}
    bits = {f"{k}.weight": int(v["bits"]) for k, v in q.items() if isinstance(v, dict)}
    return bits | ({"": int(q["bits"])} if "bits" in q else {})


def _tensor_bytes(path: Path, float_bytes: int | None, bits: dict[str, int]) -> int:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(size))
    total = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        start, end = t["data_offsets"]
        stored, width = end - start, _FLOATS.get(t["dtype"])
        if width and float_bytes:
            total += stored // width * float_bytes
        elif bits and t["dtype"] == "U32":  # 32 // bits weights in each packed word
            total += stored * 8 // bits.get(name, bits.get("", 4)) * 4
        else:
            total += stored
    return total
