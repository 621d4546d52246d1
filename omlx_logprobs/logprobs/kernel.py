"""The GPU's step extraction as one CUDA kernel (MLX's `mx.fast.cuda_kernel`).

On the CUDA backend the step loop is bound by the host: MLX launches every op's kernel from the
engine thread, and the extraction built from MLX ops (log-softmax, compare and sum for the rank,
a partition, a sort of K, gathers, the packing concatenation) added about 30 launches a step.
This kernel does the same work for the whole batch in one launch, one block per row (a pass for
the rank, a pass in which every thread keeps its own best K, then K block-wide picks among the
threads' heads), and writes the step's packed row (`PackedStep`) directly:

    [token, finite, logprob bits, rank, K ids, K logprob bits]

with the same float32 arithmetic as `extract`: every logprob is `x - lse`, the rank is
`count(x - lse >= own)`, the top K is taken by logprob descending and, among exact ties, by id
ascending. Rows with `logprob_token_ids` (fixed ids >= 0) take those ids' logprobs instead.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

THREADS = 1024  # one block per row
KCAP = 20  # the longest natural top list (config.max_top_logprobs); each thread keeps this many

_HEADER = r"""
// (v, i) comes before (bv, bi): logprob descending, then id ascending; an id < 0 is "none".
__device__ __forceinline__ bool omlx_before(float v, int i, float bv, int bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

template <int NT>
__device__ void omlx_best(float& v, int& i, float* sv, int* si) {
  for (int off = 16; off > 0; off >>= 1) {
    float ov = __shfl_down_sync(0xffffffffu, v, off);
    int oi = __shfl_down_sync(0xffffffffu, i, off);
    if (omlx_before(ov, oi, v, i)) { v = ov; i = oi; }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    v = lane < NT / 32 ? sv[lane] : 0.0f;
    i = lane < NT / 32 ? si[lane] : -1;
    for (int off = 16; off > 0; off >>= 1) {
      float ov = __shfl_down_sync(0xffffffffu, v, off);
      int oi = __shfl_down_sync(0xffffffffu, i, off);
      if (omlx_before(ov, oi, v, i)) { v = ov; i = oi; }
    }
    if (lane == 0) { sv[0] = v; si[0] = i; }
  }
  __syncthreads();
  v = sv[0];
  i = si[0];
  __syncthreads();
}

template <int NT>
__device__ int omlx_sum(int c, int* sc) {
  for (int off = 16; off > 0; off >>= 1) c += __shfl_down_sync(0xffffffffu, c, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sc[warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = lane < NT / 32 ? sc[lane] : 0;
    for (int off = 16; off > 0; off >>= 1) c += __shfl_down_sync(0xffffffffu, c, off);
    if (lane == 0) sc[0] = c;
  }
  __syncthreads();
  c = sc[0];
  __syncthreads();
  return c;
}
"""

# Inputs: x [B, V] float32 (the entries' distribution's logits), lse [B, 1] its log-sum-exp,
# raw_lse [B, 1] the raw logits' (finiteness), tokens [B], fixed [B, K] ids (or a dummy),
# kdim [K + 1] (only its length is read: K without a compile per K). Output: out [B, W] int32.
_SOURCE = r"""
  __shared__ float sv[32];
  __shared__ int si[32];
  const int row = blockIdx.x;
  const int t = threadIdx.x;
  const int V = x_shape[1];
  const int K = kdim_shape[0] - 1;
  const int W = ENTRIES ? 4 + 2 * K : 2;
  int* o = out + (size_t)row * W;
  int tok = (int)tokens[row];
  if (t == 0) {
    o[0] = tok;
    o[1] = isfinite((float)raw_lse[row]) ? 1 : 0;
  }
  if (!ENTRIES) return;
  const float* xr = x + (size_t)row * V;
  const float l = lse[row];
  tok = tok < 0 ? 0 : (tok >= V ? V - 1 : tok);
  const float own = xr[tok] - l;
  int c = 0;
  for (int j = t; j < V; j += NT) c += (xr[j] - l >= own) ? 1 : 0;
  c = omlx_sum<NT>(c, si);
  if (t == 0) {
    o[2] = __float_as_int(own);
    o[3] = c;
  }
  if (K == 0) return;
  const bool natural = !FIXED || fixed[(size_t)row * K] < 0;
  if (!natural) {
    for (int r = t; r < K; r += NT) {
      int id = (int)fixed[(size_t)row * K + r];
      id = id < 0 ? 0 : (id >= V ? V - 1 : id);
      o[4 + r] = id;
      o[4 + K + r] = __float_as_int(xr[id] - l);
    }
    return;
  }
  // One pass: each thread keeps its own best KN in order; then KN block-wide picks among the
  // threads' heads, the winner advancing. Natural top lists are at most KCAP long (the server's
  // cap); a batch's K can be larger only for fixed-id rows, and slots past a row's own k are
  // never read.
  const int KN = K < KCAP ? K : KCAP;
  float lv[KCAP];
  int li[KCAP];
  int n = 0;
  for (int j = t; j < V; j += NT) {
    const float u = xr[j] - l;
    if (isnan(u)) continue;
    if (n == KN && !omlx_before(u, j, lv[KN - 1], li[KN - 1])) continue;
    int p = n < KN ? n : KN - 1;
    while (p > 0 && omlx_before(u, j, lv[p - 1], li[p - 1])) {
      lv[p] = lv[p - 1];
      li[p] = li[p - 1];
      --p;
    }
    lv[p] = u;
    li[p] = j;
    if (n < KN) ++n;
  }
  int head = 0;
  for (int r = 0; r < K; ++r) {
    float bv = 0.0f;
    int bi = -1;
    if (r < KN) {
      if (head < n) {
        bv = lv[head];
        bi = li[head];
      }
      omlx_best<NT>(bv, bi, sv, si);
      if (bi >= 0 && head < n && li[head] == bi) ++head;
    }
    if (t == 0) {  // no entry left (only a row refused as non-finite): id 0, NaN
      o[4 + r] = bi < 0 ? 0 : bi;
      o[4 + K + r] = __float_as_int(bi < 0 ? nanf("") : bv);
    }
  }
"""


def available() -> bool:
    """The default device runs MLX's CUDA backend (the kernel's only home)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="omlx_extract",
        input_names=["x", "lse", "raw_lse", "tokens", "fixed", "kdim"],
        output_names=["out"],
        source=_SOURCE,
        header=_HEADER,
    )


@functools.cache
def _constant(n: int) -> mx.array:
    """An evaluated int32 [n] array: the kernel reads only its length (or nothing)."""
    a = mx.zeros((n,), mx.int32)
    mx.eval(a)
    return a


def packed_step(
    x: mx.array,
    lse: mx.array,
    raw_lse: mx.array,
    tokens: mx.array,
    k: int | None,
    fixed: mx.array | None = None,
) -> mx.array:
    """int32 [B, 2] (k None: token, finite) or [B, 4 + 2k]; lazy, one kernel launch.
    x [B, V] float32 and lse [B, 1]: the entries' distribution; raw_lse [B, 1]: the raw
    logits' log-sum-exp, whose finiteness is the row's; fixed [B, k] ids, -1 for a natural row."""
    b = x.shape[0]
    entries = k is not None
    width = 4 + 2 * k if k is not None else 2
    return _kernel()(
        inputs=[x, lse, raw_lse, tokens, fixed if fixed is not None else _constant(1)]
        + [_constant((k or 0) + 1)],
        template=[
            ("NT", THREADS),
            ("KCAP", KCAP),
            ("ENTRIES", entries),
            ("FIXED", fixed is not None),
        ],
        grid=(b * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, width)],
        output_dtypes=[mx.int32],
    )[0]
