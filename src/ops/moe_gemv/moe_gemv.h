// The routed experts of a decode step with few tokens, as two expert GEMVs over the (token,
// expert) pairs in routing order (no sorted order, no alignment), on FP8 block-scaled weights.
// CPU reference of the GPU kernels in moe_gemv_cuda.cuh (docs/gpu_moe.md §6.4).
//
//   up:   for each pair p = t * k + j with e = ids[t, j] >= 0
//           h = dequant(quant(x[t])) . W13[e]^T               [2I]  (x quantized per 128 columns)
//           a[p] = silu(h[:I]) * h[I:]                          [I]
//   down: out[t] = sum_j w[t, j] * dequant(quant(a[t * k + j])) . W2[ids[t, j]]^T   [H]
//
// quant = the dynamic per-row 1x128 FP8 quantization of quant.h; W = dequant_fp8_block_ref of the
// e4m3 codes and their 128x128 block scales. Pairs whose id is -1 (padding tokens of a captured
// batch) have no expert: their a row is zero and they add nothing. Sums are fp32 (ops::dot_f32
// per 128-column block, then the blocks in order; out adds j = 0..k-1 in order).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace moelora::ops {

struct MoeGemvWeightsRef {
  Tensor w13;        // F8_E4M3 [E, 2I, H] (gate rows [0, I), up rows [I, 2I))
  Tensor w13_scale;  // F32 [E, 2I / 128, H / 128]
  Tensor w2;         // F8_E4M3 [E, H, I]
  Tensor w2_scale;   // F32 [E, H / 128, I / 128]
};

// x: F32 [T, H]; ids: [T * k] expert of each pair (-1 = none). Returns F32 [T * k, I].
// H and I must be multiples of 128; an Error names the tensor with expected and actual shapes.
Tensor moe_gemv_up_ref(const Tensor& x, const std::vector<int32_t>& ids, int top_k,
                       const MoeGemvWeightsRef& w);

// a: F32 [T * k, I] (the up GEMV's output); weights: F32 [T, k] routing weights. Returns F32 [T,
// H].
Tensor moe_gemv_down_ref(const Tensor& a, const std::vector<int32_t>& ids, const Tensor& weights,
                         const MoeGemvWeightsRef& w);

}  // namespace moelora::ops
