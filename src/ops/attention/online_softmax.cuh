// The per-tile math the paged-attention kernels (attention_cuda.cu, gqa_decode_cuda.cu) share,
// FlashAttention-2 style: the online softmax step folding one tile of scores into a thread's
// running row state, and O += P V from the same registers.
//
// Fragment layout (mma.sync m16n8k16 accumulators): s[nt] holds this thread's raw scores q.k of n8
// tile nt, rows gid (elements 0, 1) and gid + 8 (elements 2, 3), masked keys at -inf; a row is
// spread over the 4 threads of a quad. scale_log2 (> 0) is the softmax scale times log2(e): the
// running max is kept in that log2 domain and the scale is folded into each exponent's fma. On
// return s holds exp2(score * scale_log2 - row max) (the P of P.V, still fp32), row_max /
// row_sum the running max and this thread's share of the running sum (the quad's shares are
// added once, at the end), and acc (the O accumulators, same row layout) is rescaled to the new
// max. exp2 is the hardware's ex2.approx (relative error ~2^-22, subnormal results flushed to
// zero: far below the bf16 rounding of P).
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "core/mma_ptx.cuh"

namespace moelora::ops::cuda {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <int kScoreTiles, int kOutTiles>
__device__ __forceinline__ void online_softmax_step(float (&s)[kScoreTiles][4],
                                                    float (&acc)[kOutTiles][4], float (&row_max)[2],
                                                    float (&row_sum)[2], float scale_log2) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float raw = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kScoreTiles; ++nt)
      raw = fmaxf(raw, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
    raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 1));
    raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 2));
    const float m = fmaxf(row_max[half], raw * scale_log2);
    // m stays -inf while every key seen so far is masked: subtract 0 then (exp2(-inf) = 0).
    const float base = m == -INFINITY ? 0.f : m;
    const float correction = fast_exp2(row_max[half] - base);
    row_max[half] = m;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kScoreTiles; ++nt) {
      s[nt][2 * half] = fast_exp2(fmaf(s[nt][2 * half], scale_log2, -base));
      s[nt][2 * half + 1] = fast_exp2(fmaf(s[nt][2 * half + 1], scale_log2, -base));
      sum += s[nt][2 * half] + s[nt][2 * half + 1];
    }
    row_sum[half] = row_sum[half] * correction + sum;
#pragma unroll
    for (int t = 0; t < kOutTiles; ++t) {
      acc[t][2 * half] *= correction;
      acc[t][2 * half + 1] *= correction;
    }
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

// O += P V over the kKeySteps k16 steps of a warp's keys, for kDimPairs pairs of n8 tiles of O.
// s: the probabilities from online_softmax_step (n8 tiles 2kk, 2kk + 1 are the A fragment of k
// step kk once rounded to bf16); v: shared V [keys, stride] at the warp's first key and first
// dim; acc[2 np], acc[2 np + 1] receive dims np * 16 .. + 15. ldmatrix.x4.trans on V rows kk * 16 +
// (lane % 16), dims + (lane / 16) * 8: matrices 0 / 1 are keys 0-7 / 8-15 of the first 8 dims,
// 2 / 3 the same of the next 8, transposed into B fragments.
template <int kKeySteps, int kDimPairs, int kScoreTiles, int kOutTiles>
__device__ __forceinline__ void accumulate_pv(const float (&s)[kScoreTiles][4],
                                              float (&acc)[kOutTiles][4], const __nv_bfloat16* v,
                                              int stride, int lane) {
  static_assert(2 * kKeySteps <= kScoreTiles && 2 * kDimPairs <= kOutTiles, "fragment counts");
  using namespace ::moelora::cuda::ptx;
#pragma unroll
  for (int kk = 0; kk < kKeySteps; ++kk) {
    uint32_t a[4];
    a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    const __nv_bfloat16* v_base = v + (kk * 16 + (lane & 15)) * stride + (lane >> 4) * 8;
#pragma unroll
    for (int np = 0; np < kDimPairs; ++np) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, smem_addr(v_base + np * 16));
      mma_bf16_16816(acc[2 * np], a, b[0], b[1]);
      mma_bf16_16816(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

}  // namespace moelora::ops::cuda
