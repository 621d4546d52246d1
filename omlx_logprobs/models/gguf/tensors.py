"""A GGUF file's tensors as MLX arrays: MLX affine quantization where it is exact
(quantized.py), else float32 dequantized by the `gguf` package.

`gguf.quants.dequantize` follows llama.cpp's dequantizers (the scales in float32, then d*q or
d*q - m per block), so a converted weight, or a quantized one's dequantization, is the value
llama.cpp computes with.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from omlx_logprobs.models.gguf.quantized import BITS, to_affine

# The tensor types we convert: the float types and every block type that the `gguf` package
# dequantizes (the K-quants of Q4_K_M/Q5_K_M/Q6_K files, the legacy and i-quants, MXFP4).
_FLOATS = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
_NOT_WEIGHTS = {
    GGMLQuantizationType.I8,
    GGMLQuantizationType.I16,
    GGMLQuantizationType.I32,
    GGMLQuantizationType.I64,
    GGMLQuantizationType.F64,
}


def _dequantizable(t: GGMLQuantizationType) -> bool:
    if t in _FLOATS:
        return True
    if t in _NOT_WEIGHTS:
        return False
    try:  # the package raises NotImplementedError for a type it has no dequantizer for
        dequantize(np.zeros((1, _type_size(t)), dtype=np.uint8), t)
    except (NotImplementedError, KeyError):
        return False
    return True


def _type_size(t: GGMLQuantizationType) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[t][1]


SUPPORTED_TYPES = tuple(t for t in GGMLQuantizationType if _dequantizable(t))


def type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"#{type_id}"


def check_types(stored: dict[str, int]) -> None:
    """Refuse a file with a tensor type we cannot dequantize, naming it and what to do."""
    bad = {n: t for n, t in stored.items() if t not in SUPPORTED_TYPES}
    if bad:
        name, t = next(iter(bad.items()))
        raise ValueError(
            f"unsupported GGUF tensor type {t} ({type_name(t)}) for {name} (and {len(bad) - 1}"
            f" more): supported are {', '.join(s.name for s in SUPPORTED_TYPES)}; use a file"
            " quantized with one of them (Q4_K_M, Q5_K_M, Q6_K and Q8_0 files are), or the"
            " model's Hugging Face directory"
        )


def open_gguf(path: Path) -> GGUFReader:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
    return GGUFReader(path)


def tensor_types(reader: GGUFReader) -> dict[str, int]:
    return {t.name: int(t.tensor_type) for t in reader.tensors}


def read_tensor_types(gguf_path: Path) -> dict[str, int]:
    """Map each tensor name to its ggml type id, read from the GGUF header."""
    return tensor_types(open_gguf(Path(gguf_path)))


@dataclass(frozen=True)
class Converted:
    """One tensor: `weight` in numpy's row-major shape, float32, or MLX's packed uint32 codes
    with float32 `scales` and `biases` (groups of `GROUP`) and their `bits`."""

    weight: np.ndarray
    scales: np.ndarray | None = None
    biases: np.ndarray | None = None
    bits: int | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays by suffix, as an mlx-lm quantized layer names them."""
        if self.scales is None or self.biases is None:
            return {"weight": self.weight}
        return {"weight": self.weight, "scales": self.scales, "biases": self.biases}


def converted_tensors(reader: GGUFReader, quantize: bool = True) -> Iterator[tuple[str, Converted]]:
    """(name, Converted) for each tensor, one at a time, so that a large file is never held in
    float32 all at once. `quantize=False`: float32 everywhere."""
    for t in reader.tensors:
        w = _float32(t)
        mapped = to_affine(np.asarray(t.data), t.tensor_type, w) if quantize else None
        if mapped is None:
            yield t.name, Converted(w)
        else:
            yield t.name, Converted(*mapped, bits=BITS[t.tensor_type])


def _float32(t: Any) -> np.ndarray:
    # ggml lists dimensions fastest first; numpy wants them slowest first.
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    out = dequantize(np.asarray(t.data), t.tensor_type)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)
