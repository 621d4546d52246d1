"""The memory estimate of `--max-model-memory-mib` (models/footprint.py), from real safetensors
files: tensor sizes from the header, 16-bit floats counted at float32's width where the model
will run in float32, quantized weights as they are."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx

from omlx_logprobs.models.footprint import MARGIN, weight_mib


def test_estimate_from_headers(tmp_path: Path) -> None:
    mib = 2**20
    # 10 MiB of bfloat16 in two shards, 1 MiB of packed integers (a quantized weight's)
    mx.save_safetensors(str(tmp_path / "a.safetensors"), {"w": mx.zeros((4 * mib,), mx.bfloat16)})
    mx.save_safetensors(
        str(tmp_path / "b.safetensors"),
        {"v": mx.zeros((mib,), mx.bfloat16), "q": mx.zeros((mib // 4,), mx.uint32)},
    )
    (tmp_path / "config.json").write_text("{}")  # not weights: not counted
    assert weight_mib(tmp_path, float32=False) == math.ceil(11 * MARGIN)
    assert weight_mib(tmp_path, float32=True) == math.ceil(21 * MARGIN)
    scripted = tmp_path / "s.json"
    scripted.write_text("{}")
    assert weight_mib(scripted, float32=True) == 1
