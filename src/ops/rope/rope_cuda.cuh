// RoPE on the GPU (rope.h is the oracle). The host precomputes the frequency table once
// (make_rope_table: plain or YaRN, attention factor included); the kernel rotates q and k heads
// in place at each token's position, computing angle = float(pos) * inv_freq[j] and cos/sin in
// fp32 like the reference.
//
//   x: bf16 rows of [T, heads, row_stride] (the head h of token t starts at t * token_stride +
//   h * head_stride); dims [dim_offset, dim_offset + rotary_dim) of each head are rotated,
//   rotate-half or interleaved pairs (RopeStyle).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/model_enums.h"

namespace moelora::ops::cuda {

struct RopeCudaArgs {
  __nv_bfloat16* x = nullptr;
  int tokens = 0;                       // grid capacity
  const int32_t* num_tokens = nullptr;  // [1] valid tokens (device), nullptr = tokens
  const int32_t* positions = nullptr;   // [T]
  int heads = 0;
  int64_t token_stride = 0;  // elements between tokens
  int64_t head_stride = 0;   // elements between heads
  int dim_offset = 0;
  int rotary_dim = 0;               // even
  const float* inv_freq = nullptr;  // [rotary_dim / 2], device
  float attention_factor = 1.0f;
  RopeStyle style = RopeStyle::kRotateHalf;
};
void launch_rope(const RopeCudaArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
