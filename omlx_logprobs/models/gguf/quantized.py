"""GGUF blocks as MLX affine quantization, where that represents them exactly.

A GGUF block type whose every 32 weights share one scale and one offset (w = s*q + b) is MLX's
affine quantization with groups of 32: Q4_0 (s = d, b = -8d), Q4_1 (d, m), Q5_0 (d, -16d),
Q5_1 (d, m), Q8_0 (d, -128d: MLX's codes are unsigned), and the K-quants Q4_K and Q5_K, whose
super-blocks of 256 hold eight sub-blocks of 32 with 6-bit scales and mins (s = d*sc,
b = -dmin*m). The scales and biases are kept in float32: d*sc has up to 17 significant bits,
which float16 and bfloat16 would round. Q2_K, Q3_K and Q6_K have sub-blocks of 16 weights, and
MLX's affine groups are 32, 64 or 128 (mlx 0.32.4 refuses 16), so those tensors, like every
other type, are dequantized to float32 (tensors.py).

The block fields are read with the `gguf` package's own layouts (its Q4_K.get_scale_min for the
6-bit scales); the codes q are recovered from the package's dequantized weights, and a mapping
is kept only when MLX's dequantize gives back those weights bit for bit.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

GROUP = 32
# The types mapped, and their bits a weight.
BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5}
# The zero point of the types that store signed codes (w = d*(q - zero)).
_ZERO = {T.Q4_0: 8, T.Q5_0: 16, T.Q8_0: 128}


def _f16(field: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)


def scales_and_biases(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """Each group of 32 weights' float32 scale and bias (w = scale*q + bias, q unsigned), from
    the blocks' header fields, as (n_blocks, groups a block)."""
    d = _f16(blocks[:, :2])
    if qtype in _ZERO:
        return d, -np.float32(_ZERO[qtype]) * d
    if qtype in (T.Q4_1, T.Q5_1):
        return d, _f16(blocks[:, 2:4])
    # Q4_K, Q5_K: d, dmin (float16), then the 12 bytes of eight 6-bit scales and mins.
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4 : 4 + Q4_K.K_SCALE_SIZE]))
    return d * sc.astype(np.float32), -(_f16(blocks[:, 2:4]) * m.astype(np.float32))


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes along the last axis (a multiple of 32) as MLX packs them: a little-endian
    bit stream in uint32 words, each code's lowest bit first (8 codes a word at 4 bits; every
    32 codes fill `bits` words, 5-bit codes crossing word boundaries)."""
    c = codes.astype(np.uint32, copy=False).reshape(-1, 32)
    out = np.zeros((c.shape[0], bits), dtype=np.uint32)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        out[:, word] |= c[:, i] << np.uint32(shift)  # bits past the word's end fall off
        if shift + bits > 32:
            out[:, word + 1] |= c[:, i] >> np.uint32(32 - shift)
    return out.reshape(*codes.shape[:-1], -1)


def to_affine(
    blocks: np.ndarray, qtype: T, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(packed uint32 weight, float32 scales, float32 biases) in `weights`' shape for a tensor
    of `qtype` whose blocks are `blocks` (its rows of raw bytes) and whose dequantized float32
    values are `weights`; None when the type is not mapped or the mapping is not exact."""
    bits = BITS.get(qtype)
    if bits is None or weights.ndim < 2 or weights.shape[-1] % GROUP:
        return None
    from gguf.constants import GGML_QUANT_SIZES

    block_bytes = GGML_QUANT_SIZES[qtype][1]
    scale, bias = scales_and_biases(np.asarray(blocks).reshape(-1, block_bytes), qtype)
    rows = weights.reshape(-1, weights.shape[-1])
    scale, bias = scale.reshape(rows.shape[0], -1), bias.reshape(rows.shape[0], -1)
    packed = np.empty((rows.shape[0], rows.shape[1] * bits // 32), dtype=np.uint32)
    # Rows a chunk at a time, so that a large embedding's codes never sit in memory all at once.
    step = max(1, (1 << 24) // rows.shape[1])
    for i in range(0, rows.shape[0], step):
        chunk = _to_codes(rows[i : i + step], scale[i : i + step], bias[i : i + step], bits)
        if chunk is None:
            return None
        packed[i : i + step] = chunk
    groups = (*weights.shape[:-1], weights.shape[-1] // GROUP)
    return packed.reshape(*weights.shape[:-1], -1), scale.reshape(groups), bias.reshape(groups)


def _to_codes(w: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> np.ndarray | None:
    """Rows of weights as packed codes, or None unless MLX's dequantize gives them back."""
    import mlx.core as mx

    grouped = w.reshape(w.shape[0], -1, GROUP)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.rint((grouped - bias[..., None]) / scale[..., None])
    # A zero scale makes every weight of its group the bias, whatever the code.
    codes = np.where(scale[..., None] == 0, 0, codes)
    if not np.isfinite(codes).all():
        return None
    packed = pack(np.clip(codes, 0, (1 << bits) - 1).astype(np.uint32).reshape(w.shape), bits)
    # On the CPU stream wherever the model will run: a GPU's dequantize may fuse the multiply
    # and add (one rounding instead of two), and the check is against gguf's own arithmetic.
    back = mx.dequantize(
        mx.array(packed),
        mx.array(scale),
        mx.array(bias),
        group_size=GROUP,
        bits=bits,
        stream=mx.cpu,
    )
    return packed if np.array_equal(np.array(back), w) else None
