// Elementwise pieces of the dense layers on the GPU (linear.h is the oracle; the GEMMs are cuBLAS
// bf16 with fp32 accumulation, called by the model):
//   silu_mul:   out[t, j] = silu(gu[t, j]) * gu[t, I + j]        gu [T, 2I] -> out [T, I]
//   add_rows:   y[t, :] += delta[t, :] for the rows of the LoRA segments (slot >= 0), fp32 sum
//               rounded once; y [T, N], delta [T, N] (rows of base-only tokens are not touched).
//   add:        y += x (bf16, fp32 sum), n elements.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::ops::cuda {

struct SiluMulArgs {
  const __nv_bfloat16* gate_up = nullptr;  // [T, 2I]: gate columns [0, I), up [I, 2I)
  __nv_bfloat16* out = nullptr;            // [T, I]
  int tokens = 0;
  const int32_t* num_tokens = nullptr;  // nullptr = tokens
  int inter = 0;                        // I
};
void launch_silu_mul(const SiluMulArgs& args, cudaStream_t stream);

struct AddRowsArgs {
  __nv_bfloat16* y = nullptr;            // [T, N], row stride y_stride (0 = N)
  const __nv_bfloat16* delta = nullptr;  // [T, N] contiguous
  const int32_t* row_slot = nullptr;     // [T]: rows with slot < 0 are skipped; nullptr = all
  int tokens = 0;
  const int32_t* num_tokens = nullptr;
  int cols = 0;  // N
  int64_t y_stride = 0;
};
void launch_add_rows(const AddRowsArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
