"""A decode step's masked attention as one CUDA kernel.

MLX's CUDA backend has a fused attention kernel for a single query position only when no mask
array is given, and a left-padded batch always gives one (each row's padding is masked out). So
every decode step's attention fell back to MLX ops: a scale, two matmuls, a select, a softmax
and the reshapes around them, ~11 graph nodes a layer, each launched from the engine's thread;
on a GPU most of a step's host time is MLX dispatching nodes (docs/benchmarks.md, "Decisions").

This kernel takes the mask as it comes (bool: attend where true; or additive) and computes
the softmax over the keys in float32 with one pass over them (an online maximum and sum, as
flash decoding does): one block per row and KV head, serving every query head that shares it
(so each key and value is read once), a key spread over a group of lanes. `install` puts it in
front of `mx.fast.scaled_dot_product_attention` for exactly that case (GPU, one query position,
a mask array without a head axis, no sinks, head size 32, 64, 128 or 256) and leaves every
other call to MLX, so mlx-lm's models use it without a change of their own.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import mlx.core as mx

WARPS = 8  # warps a block; each holds its own running softmax, combined at the end
HEADS = (32, 64, 128, 256)  # head sizes the lane layout covers (G lanes x E elements)
MAX_REP = 8  # query heads a KV head serves (each lane holds REP x E of q and of the sums)
MAX_REP_HEAD = 1024  # query heads a KV head serves, times the head size: the combine's memory
# A block per row and KV head: with few of them and many keys the GPU sits mostly idle, and
# MLX's matmuls were faster on the device (bench/experiments/attention_bench.py). Past SHORT
# keys, the kernel takes a batch of at least MIN_BLOCKS blocks; splitting keys is not written.
SHORT = 1024
MIN_BLOCKS = 256

_SOURCE = r"""
  // One block per (row b, KV head g); it serves the REP query heads that share g, so every key
  // and value is read once. A key is handled by G lanes, each holding E of the D elements
  // (KPW = 32 / G keys per warp at a time); each group of G lanes keeps, for every head, its
  // own running maximum, sum and weighted values (the online softmax of flash decoding).
  constexpr int NW = WARPS_T, D = HEAD, E = D / G, KPW = 32 / G;
  const float NEG_INF = __int_as_float(0xff800000);
  const int Hq = q_shape[1], Hkv = k_shape[1], L = k_shape[2];
  const int b = blockIdx.x / Hkv, g = blockIdx.x % Hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane / G, gl = lane % G;  // the key this lane works on, its slice of it
  const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1) << (grp * G);  // its group
  const float scale = scale_arr[0];
  float qr[REP][E];
  for (int r = 0; r < REP; ++r) {
    const auto* qh = q + b * q_strides[0] + (g * REP + r) * q_strides[1];
    for (int e = 0; e < E; ++e) {
      qr[r][e] = static_cast<float>(qh[(gl * E + e) * q_strides[3]]) * scale;
    }
  }
  const auto* kb = k + b * k_strides[0] + g * k_strides[1];
  const auto* vb = v + b * v_strides[0] + g * v_strides[1];
  const auto* mb = mask + (mask_shape[0] > 1 ? b * mask_strides[0] : 0);
  const long ks = k_strides[2], kd = k_strides[3], vs = v_strides[2], vd = v_strides[3];
  const long ms = mask_strides[3];
  float m[REP], l[REP], acc[REP][E];
  for (int r = 0; r < REP; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.0f;
    for (int e = 0; e < E; ++e) acc[r][e] = 0.0f;
  }
  for (int j = (warp * KPW) + grp; j < L; j += NW * KPW) {
    float add = 0.0f;
    if (BOOL_MASK) {
      if (!static_cast<bool>(mb[j * ms])) continue;  // the same for the group's G lanes
    } else {
      add = static_cast<float>(mb[j * ms]);
      if (add == NEG_INF) continue;
    }
    const auto* kr = kb + j * ks + gl * E * kd;
    const auto* vr = vb + j * vs + gl * E * vd;
    float kx[E], vx[E];
    for (int e = 0; e < E; ++e) kx[e] = static_cast<float>(kr[e * kd]);
    for (int e = 0; e < E; ++e) vx[e] = static_cast<float>(vr[e * vd]);
    for (int r = 0; r < REP; ++r) {
      float dot = 0.0f;
      for (int e = 0; e < E; ++e) dot += qr[r][e] * kx[e];
      for (int off = G / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(gmask, dot, off, G);
      const float sc = dot + add;
      const float nm = fmaxf(m[r], sc);
      const float corr = expf(m[r] - nm);  // 0 while m is -inf
      const float p = expf(sc - nm);
      l[r] = l[r] * corr + p;
      for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * corr + p * vx[e];
      m[r] = nm;
    }
  }
  // The warp's groups into one state a head (lanes gl of every group hold the same elements).
  for (int off = G; off < 32; off <<= 1) {
    for (int r = 0; r < REP; ++r) {
      const float om = __shfl_xor_sync(0xffffffffu, m[r], off);
      const float ol = __shfl_xor_sync(0xffffffffu, l[r], off);
      const float nm = fmaxf(m[r], om);
      const float a = nm == NEG_INF ? 0.0f : expf(m[r] - nm);
      const float o = nm == NEG_INF ? 0.0f : expf(om - nm);
      l[r] = l[r] * a + ol * o;
      for (int e = 0; e < E; ++e) {
        const float oa = __shfl_xor_sync(0xffffffffu, acc[r][e], off);
        acc[r][e] = acc[r][e] * a + oa * o;
      }
      m[r] = nm;
    }
  }
  __shared__ float wm[NW][REP], wl[NW][REP];
  __shared__ float wacc[NW][REP * D];
  if (lane < G) {
    for (int r = 0; r < REP; ++r) {
      if (lane == 0) { wm[warp][r] = m[r]; wl[warp][r] = l[r]; }
      for (int e = 0; e < E; ++e) wacc[warp][r * D + gl * E + e] = acc[r][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < REP * D; i += blockDim.x) {
    const int r = i / D, d = i % D;
    float M = NEG_INF;
    for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w][r]);
    float S = 0.0f, o = 0.0f;
    for (int w = 0; w < NW; ++w) {
      if (wm[w][r] == NEG_INF) continue;
      const float c = expf(wm[w][r] - M);
      S += wl[w][r] * c;
      o += wacc[w][i] * c;
    }
    out[(b * Hq + g * REP + r) * D + d] = static_cast<OutT>(S > 0.0f ? o / S : 0.0f);
  }
"""

_FLOATS = (mx.float16, mx.bfloat16, mx.float32)
_mlx_sdpa = mx.fast.scaled_dot_product_attention


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="omlx_decode_attention",
        input_names=["q", "k", "v", "mask", "scale_arr"],
        output_names=["out"],
        source=_SOURCE,
        ensure_row_contiguous=False,  # the KV cache's keys are a view of a wider buffer
    )


@functools.cache
def _scale(scale: float) -> mx.array:
    a = mx.array([scale], mx.float32)
    mx.eval(a)
    return a


def fits(q: mx.array, k: mx.array, v: mx.array, mask: Any, sinks: Any, stream: Any) -> bool:
    """Whether this call is the kernel's: one query position and a mask array on the GPU, a
    head size the lane layout covers and a mask without a head axis. (Called for every layer of
    every step: each shape is read once.)"""
    if sinks is not None or stream is not None or not isinstance(mask, mx.array):
        return False
    qs, ks, vs, ms = q.shape, k.shape, v.shape, mask.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4 or len(ms) != 4 or qs[2] != 1:
        return False
    b, hq, _, d = qs
    hkv, length = ks[1], ks[2]
    if d not in HEADS or ks[3] != d or vs != ks or ks[0] != b or hkv == 0 or hq % hkv:
        return False
    if hq // hkv > MAX_REP or (hq // hkv) * d > MAX_REP_HEAD:
        return False
    if ms[0] not in (1, b) or ms[1] != 1 or ms[2] != 1 or ms[3] != length:
        return False
    if length > SHORT and b * hkv < MIN_BLOCKS:
        return False
    dt = q.dtype
    return (
        dt in _FLOATS
        and k.dtype == dt
        and v.dtype == dt
        and (mask.dtype == mx.bool_ or mask.dtype in _FLOATS)
    )


def decode_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """[B, Hq, 1, D] in q's dtype: softmax(q k^T * scale, masked) v for each row and head."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    lanes = min(32, d // 4)  # G: lanes a key, each with d / G (>= 4) elements
    return _kernel()(
        inputs=[q, k, v, mask, _scale(float(scale))],
        template=[
            ("WARPS_T", WARPS),
            ("HEAD", d),
            ("G", lanes),
            ("REP", hq // hkv),
            ("BOOL_MASK", mask.dtype == mx.bool_),
            ("OutT", q.dtype),
        ],
        grid=(b * hkv * 32 * WARPS, 1, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(b, hq, 1, d)],
        output_dtypes=[q.dtype],
    )[0]


def _sdpa(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: Any = None,
    stream: Any = None,
    **kwargs: Any,
) -> mx.array:
    if not kwargs and fits(q, k, v, mask, sinks, stream):
        return decode_attention(q, k, v, scale, mask)
    extra = {"sinks": sinks} if sinks is not None else {}
    if stream is not None:
        extra["stream"] = stream
    return _mlx_sdpa(q, k, v, scale=scale, mask=mask, **extra, **kwargs)


def install() -> bool:
    """Route masked single-position attention on a GPU through the kernel (once per process;
    `OMLX_DECODE_ATTENTION=mlx` keeps MLX's for every call). True if installed."""
    if os.environ.get("OMLX_DECODE_ATTENTION") == "mlx":
        return False
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        return False
    mx.fast.scaled_dot_product_attention = _sdpa
    return True
