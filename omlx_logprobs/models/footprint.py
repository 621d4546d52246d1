"""The memory a model's weights will take once loaded, estimated from its files without loading
them: what `--max-model-memory-mib` counts (api/pool.py)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

# The estimate is the weights as they will sit in memory, plus this share for what grows beside
# them (the batch's keys and values, activations, the process itself).
MARGIN = 1.1
_SMALL_FLOATS = {"F16": 2, "BF16": 2}  # widened to float32 where the model runs in float32


def weight_mib(path: Path, float32: bool) -> int:
    """The estimated memory of a model's weights in MiB, MARGIN included: the tensors' sizes from
    the safetensors headers (16-bit floats at 4 bytes each when `float32`: on the CPU the model
    runs in float32), any other file (a scripted description) at its size on disk."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    total = 0
    for f in files:
        total += _tensor_bytes(f, float32) if f.suffix == ".safetensors" else f.stat().st_size
    return max(1, math.ceil(total * MARGIN / 2**20))


def _tensor_bytes(path: Path, float32: bool) -> int:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(size))
    total = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        start, end = t["data_offsets"]
        width = _SMALL_FLOATS.get(t["dtype"]) if float32 else None
        total += (end - start) // width * 4 if width else end - start
    return total
