// RMSNorm on the GPU (norm.h is the oracle), bf16 in and out, fp32 math, with the residual add
// of a pre-norm decoder fused in:
//
//   residual == nullptr:  y = norm(x)                                 (q/k norms, MLA latents)
//   residual != nullptr:  r = x + residual (fp32 sum rounded to bf16 once, written back to
//                         residual), y = norm(r)                      (input / post-attn norms)
//   x_delta != nullptr:   x is first replaced by bf16(x + x_delta) on the rows whose
//                         delta_slot >= 0 (the LoRA delta of the projection that wrote x,
//                         computed on the side stream; add_rows' arithmetic, so the result is
//                         bit-identical to adding the delta into x first)
//
// Rows are [rows, D] with a row stride (so q/k norms run on [T * heads, head_dim] views and MLA's
// kv_a_layernorm on the first r columns of [T, r + rope]). One warp (D <= 1024) or one CTA per row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/model_enums.h"

namespace moelora::ops::cuda {

struct RmsNormArgs {
  const __nv_bfloat16* x = nullptr;       // [rows, D] with stride x_stride (elements)
  __nv_bfloat16* residual = nullptr;      // [rows, D] contiguous, or nullptr (see above)
  const __nv_bfloat16* weight = nullptr;  // [D]
  __nv_bfloat16* y = nullptr;             // [rows, D] with stride y_stride (may alias x)
  int rows = 0;                           // grid capacity
  const int32_t* num_rows = nullptr;      // [1] valid rows (device), nullptr = rows
  int rows_per_token = 1;                 // num_rows counts tokens; rows = tokens * rows_per_token
  int dim = 0;                            // D (even)
  int64_t x_stride = 0, y_stride = 0;     // 0 = D
  float eps = 1e-6f;
  NormStyle style = NormStyle::kWeight;
  // Optional: needs the residual (pass 2 re-reads the sum) and rows_per_token 1.
  const __nv_bfloat16* x_delta = nullptr;  // [rows, D] contiguous
  const int32_t* delta_slot = nullptr;     // [rows] adapter slot of each row, < 0 = no delta
};
void launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
