"""The memory estimate of `--max-model-memory-mib` (models/footprint.py), from real safetensors
files: tensor sizes from the header, floats counted at the width the model will run in, packed
quantized weights as stored or, where the CPU dequantizes them, as float32."""

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
    assert weight_mib(tmp_path) == math.ceil(11 * MARGIN)  # as stored
    assert weight_mib(tmp_path, float_bytes=4) == math.ceil(21 * MARGIN)
    assert weight_mib(tmp_path, float_bytes=2, dequantize=True) == math.ceil(11 * MARGIN)
    # 4-bit quantized: each packed word holds 8 weights, 32 bytes once dequantized to float32
    (tmp_path / "config.json").write_text('{"quantization": {"group_size": 64, "bits": 4}}')
    assert weight_mib(tmp_path, float_bytes=4, dequantize=True) == math.ceil(28 * MARGIN)
    scripted = tmp_path / "s.json"
    scripted.write_text("{}")
    assert weight_mib(scripted, float_bytes=4) == 1


def test_each_quantized_layer_counted_at_its_own_bits(tmp_path: Path) -> None:
    """A converted GGUF names each quantized layer with its bits (4 by default, 8 for a Q8_0
    layer): 1 MiB of packed 8-bit codes is 4 MiB once dequantized, not 8."""
    mib = 2**20
    packed = {
        "a.weight": mx.zeros((mib // 4,), mx.uint32),
        "b.weight": mx.zeros((mib // 4,), mx.uint32),
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), packed)
    quantization = '{"group_size": 32, "bits": 4, "b": {"group_size": 32, "bits": 8}}'
    (tmp_path / "config.json").write_text('{"quantization": ' + quantization + "}")
    assert weight_mib(tmp_path, float_bytes=4, dequantize=True) == math.ceil((8 + 4) * MARGIN)
