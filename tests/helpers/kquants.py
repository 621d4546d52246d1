"""K-quant encoders for tests: the `gguf` package dequantizes Q2_K..Q6_K but cannot quantize them.

Each packs its blocks as the package's dequantizer unpacks them (the byte layouts of llama.cpp's
block_q2_K ... block_q6_K), with plain min/max scales rather than llama.cpp's search for the
best ones: the tests need valid blocks close to known weights, not llama.cpp's exact choice.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

QK = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float32), where=b != 0)


def _pack(q: np.ndarray, groups: int, shifts: list[int], width: int) -> np.ndarray:
    """Inverse of `bytes.reshape(n, groups, 1, width) >> shifts`, flattened in that order."""
    n = q.shape[0]
    q = q.astype(np.uint8).reshape(n, groups, len(shifts), width)
    out = np.zeros((n, groups, width), dtype=np.uint8)
    for j, s in enumerate(shifts):
        out |= q[:, :, j, :] << np.uint8(s)
    return out.reshape(n, -1)


def _affine(x: np.ndarray, sub: int, levels: int, scale_levels: int) -> tuple[np.ndarray, ...]:
    """Scales and mins (w = d*sc*q - dmin*m) of super-blocks with sub-blocks of `sub` values."""
    n = x.shape[0]
    g = x.reshape(n, -1, sub)
    lo = np.minimum(g.min(-1), 0)
    s = (g.max(-1) - lo) / levels
    off = -lo
    d = _f16(s.max(-1, keepdims=True) / scale_levels)
    dmin = _f16(off.max(-1, keepdims=True) / scale_levels)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.round(_safe_div(s, d32)), 0, scale_levels).astype(np.uint8)
    m = np.clip(np.round(_safe_div(off, dmin32)), 0, scale_levels).astype(np.uint8)
    step = d32 * sc
    q = np.clip(np.round(_safe_div(g + (dmin32 * m)[..., None], step[..., None])), 0, levels)
    return d, dmin, sc, m, q.astype(np.uint8).reshape(n, QK)


def _scales_6bit(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins."""
    d = sc[:, :4] | ((sc[:, 4:] & 0x30) << 2)
    mm = m[:, :4] | ((m[:, 4:] & 0x30) << 2)
    md = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, mm, md], axis=1).astype(np.uint8)


def _bytes(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate([p.reshape(p.shape[0], -1).view(np.uint8) for p in parts], axis=1)


def q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x, 16, 3, 15)
    return _bytes(sc | (m << 4), _pack(q, 2, [0, 2, 4, 6], 32), d, dmin)


def q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    g = x.reshape(n, 16, 16)
    amax = np.abs(g).max(-1) / 4
    d = _f16(amax.max(-1, keepdims=True) / 31)
    d32 = d.astype(np.float32)
    scale = np.clip(np.round(_safe_div(amax, d32)), 0, 31)
    q = np.clip(np.round(_safe_div(g, (d32 * scale)[..., None])), -4, 3).astype(np.int8) + 4
    q = q.astype(np.uint8).reshape(n, QK)
    hmask = _pack((q >> 2) & 1, 1, list(range(8)), 32)
    qs = _pack(q & 3, 2, [0, 2, 4, 6], 32)
    s = (scale.astype(np.int8) + 32).astype(np.uint8)
    low, high = s & 0x0F, (s >> 4).reshape(n, 4, 4)
    lbytes = low[:, :8] | (low[:, 8:] << 4)
    hbytes = np.zeros((n, 4), dtype=np.uint8)
    for a in range(4):
        hbytes |= high[:, a, :] << np.uint8(2 * a)
    return _bytes(hmask, qs, lbytes, hbytes, d)


def q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x, 32, 15, 63)
    return _bytes(d, dmin, _scales_6bit(sc, m), _pack(q, 4, [0, 4], 32))


def q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x, 32, 31, 63)
    qh = _pack(q >> 4, 1, list(range(8)), 32)
    return _bytes(d, dmin, _scales_6bit(sc, m), qh, _pack(q & 0x0F, 4, [0, 4], 32))


def q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    g = x.reshape(n, 16, 16)
    amax = np.abs(g).max(-1) / 31
    d = _f16(amax.max(-1, keepdims=True) / 127)
    d32 = d.astype(np.float32)
    sc = np.clip(np.round(_safe_div(amax, d32)), 0, 127).astype(np.int8)
    step = (d32 * sc)[..., None]
    q = (np.clip(np.round(_safe_div(g, step)), -32, 31) + 32).astype(np.uint8).reshape(n, QK)
    ql = _pack(q & 0x0F, 2, [0, 4], 64)
    qh = _pack(q >> 4, 2, [0, 2, 4, 6], 32)
    return _bytes(ql, qh, sc, d)


ENCODERS = {T.Q2_K: q2_k, T.Q3_K: q3_k, T.Q4_K: q4_k, T.Q5_K: q5_k, T.Q6_K: q6_k}


def quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    """Rows of bytes, as `gguf.quants.quantize` returns them."""
    if qtype not in ENCODERS:
        from gguf.quants import quantize as package_quantize

        return package_quantize(w, qtype)
    rows = w.reshape(-1, w.shape[-1])
    blocks = ENCODERS[qtype](rows.reshape(-1, QK).astype(np.float32))
    return blocks.reshape(*w.shape[:-1], -1)
