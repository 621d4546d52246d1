"""A decode step's masked attention as one CUDA kernel.

MLX's CUDA backend has a fused attention kernel for a single query position only when no mask
array is given, and a left-padded batch always gives one (each row's padding is masked out). So
every decode step's attention fell back to MLX ops: a scale, two matmuls, a select, a softmax
and the reshapes around them, ~11 graph nodes a layer, each launched from the engine's thread.
On an H100 (random 1.1B llama in bfloat16, 64 rows) leaving the mask out took the step's
`async_eval` from ~3.6 to ~2.8 ms: most of the step's host time is MLX dispatching nodes.

This kernel takes the mask as it comes (bool: attend where true; or additive) and computes,
per row and query head, the softmax over the keys in float32 with one pass over them (an
online maximum and sum, as flash decoding does), one block of warps per (row, head), each warp
a stripe of 32 keys at a time. `install` puts it in front of `mx.fast.scaled_dot_product_attention`
for exactly that case (GPU, one query position, a mask array, no sinks, head size <= 256) and
leaves every other call to MLX, so mlx-lm's models use it without a change of their own.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import mlx.core as mx

WARPS = 4  # warps a block: stripes of 32 keys each, combined at the end
MAX_HEAD = 256

_SOURCE = r"""
  constexpr int NW = WARPS_T;
  const float NEG_INF = __int_as_float(0xff800000);
  const int D = q_shape[3];
  const int Hq = q_shape[1];
  const int Hkv = k_shape[1];
  const int L = k_shape[2];
  const int bh = blockIdx.x;
  const int b = bh / Hq, h = bh % Hq, g = h / (Hq / Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __shared__ float qs[DPL * 32];
  __shared__ float wm[NW], ws[NW];
  __shared__ float wacc[NW][DPL * 32];
  const float scale = scale_arr[0];
  const auto* qb = q + b * q_strides[0] + h * q_strides[1];
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    qs[d] = static_cast<float>(qb[d * q_strides[3]]) * scale;
  }
  __syncthreads();
  const auto* kb = k + b * k_strides[0] + g * k_strides[1];
  const auto* vb = v + b * v_strides[0] + g * v_strides[1];
  const auto* mb = mask + (mask_shape[0] > 1 ? b * mask_strides[0] : 0)
      + (mask_shape[1] > 1 ? h * mask_strides[1] : 0);
  const long ks = k_strides[2], kd = k_strides[3], vs = v_strides[2], vd = v_strides[3];
  const long ms = mask_strides[3];
  float m = NEG_INF, s = 0.0f;
  float acc[DPL];
  for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
  for (int j0 = warp * 32; j0 < L; j0 += NW * 32) {
    const int j = j0 + lane;
    float sc = NEG_INF;
    if (j < L) {
      float add = 0.0f;
      bool keep = true;
      if (BOOL_MASK) {
        keep = static_cast<bool>(mb[j * ms]);
      } else {
        add = static_cast<float>(mb[j * ms]);
      }
      if (keep) {
        const auto* kr = kb + j * ks;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qs[d] * static_cast<float>(kr[d * kd]);
        sc = dot + add;
      }
    }
    float cm = sc;
    for (int off = 16; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
    const float nm = fmaxf(m, cm);
    if (nm == NEG_INF) continue;  // every key so far masked (the same in the whole warp)
    const float p = sc == NEG_INF ? 0.0f : expf(sc - nm);
    const float corr = m == NEG_INF ? 0.0f : expf(m - nm);
    float ps = p;
    for (int off = 16; off > 0; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
    s = s * corr + ps;
    for (int i = 0; i < DPL; ++i) acc[i] *= corr;
    const int n = min(32, L - j0);
    for (int t = 0; t < n; ++t) {
      const float pt = __shfl_sync(0xffffffffu, p, t);
      if (pt != 0.0f) {
        const auto* vr = vb + (j0 + t) * vs;
        for (int i = 0; i < DPL; ++i) {
          const int d = lane + 32 * i;
          if (d < D) acc[i] += pt * static_cast<float>(vr[d * vd]);
        }
      }
    }
    m = nm;
  }
  if (lane == 0) { wm[warp] = m; ws[warp] = s; }
  for (int i = 0; i < DPL; ++i) {
    const int d = lane + 32 * i;
    if (d < D) wacc[warp][d] = acc[i];
  }
  __syncthreads();
  float M = NEG_INF;
  for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w]);
  float S = 0.0f;
  for (int w = 0; w < NW; ++w) S += wm[w] == NEG_INF ? 0.0f : ws[w] * expf(wm[w] - M);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < NW; ++w) o += wm[w] == NEG_INF ? 0.0f : wacc[w][d] * expf(wm[w] - M);
    out[bh * D + d] = static_cast<OutT>(S > 0.0f ? o / S : 0.0f);
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
    """Whether this call is the kernel's: one query position and a mask array on the GPU."""
    if sinks is not None or stream is not None or not isinstance(mask, mx.array):
        return False
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or mask.ndim != 4 or q.shape[2] != 1:
        return False
    b, hq, _, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if d > MAX_HEAD or v.shape[3] != d or k.shape[3] != d or hkv == 0 or hq % hkv:
        return False
    if k.shape[0] != b or v.shape[:3] != k.shape[:3]:
        return False
    if mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hq) or mask.shape[2] != 1:
        return False
    if mask.shape[3] != length or not (mask.dtype == mx.bool_ or mask.dtype in _FLOATS):
        return False
    return q.dtype in _FLOATS and k.dtype == q.dtype and v.dtype == q.dtype


def decode_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """[B, Hq, 1, D] in q's dtype: softmax(q k^T * scale, masked) v for each row and head."""
    b, hq, _, d = q.shape
    dpl = (d + 31) // 32
    return _kernel()(
        inputs=[q, k, v, mask, _scale(float(scale))],
        template=[
            ("WARPS_T", WARPS),
            ("DPL", dpl),
            ("BOOL_MASK", mask.dtype == mx.bool_),
            ("OutT", q.dtype),
        ],
        grid=(b * hq * 32 * WARPS, 1, 1),
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
