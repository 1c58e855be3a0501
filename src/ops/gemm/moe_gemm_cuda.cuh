// Grouped FP8 block-scaled expert GEMMs on Hopper (launchers). See docs/gpu_moe.md §5 and the CPU
// reference in ops/gemm/moe_gemm.h, which every kernel here is tested against.
//
//   out[q, n] = sum_k act[row(q), k] sx[row(q), k/128] * W[e(q), n, k] sw[e(q), n/128, k/128]
//
// Launchers never allocate and never synchronize; all pointers are device pointers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "ops/gemm/moe_gemm.h"

namespace moelora::ops::cuda {

struct MoeGemmFp8Args {
  const uint8_t* act = nullptr;        // e4m3 [rows, K]
  const float* act_scale = nullptr;    // [rows, K/128]
  const int32_t* gather = nullptr;     // [P] activation row of each sorted position; nullptr = identity
  const uint8_t* weight = nullptr;     // e4m3 [E, N, K] row-major
  const float* weight_scale = nullptr; // [E, ceil(N/128), K/128]
  const int32_t* expert_offsets = nullptr;  // [E + 1] sorted-position ranges per expert
  const int32_t* active_experts = nullptr;  // [E] experts with pairs, first *num_active valid
  const int32_t* num_active = nullptr;      // [1]
  __nv_bfloat16* out = nullptr;        // [P, N], rows in sorted order
  int num_experts = 0;  // E
  int n = 0;            // N (output features)
  int k = 0;            // K (input features), a multiple of 128
  // Capacity used to size the grid and pick the instance (host-side values, fixed per graph):
  int max_active_experts = 0;     // upper bound on *num_active (min(E, max pairs))
  int max_tokens_per_expert = 0;  // upper bound on the tokens of one expert (the batch's tokens)
};

// Swap-AB mma.sync kernel for few tokens per expert (decode). Works for any number of tokens per
// expert (it loops over passes of 8 * token_subtiles tokens) but is fastest at <= 32.
void launch_moe_gemm_fp8_decode(const MoeGemmFp8Args& args, int num_sms, cudaStream_t stream);

// Argument checks shared by both paths; throws moelora::Error naming the bad field.
void check_moe_gemm_fp8_args(const MoeGemmFp8Args& args);

}  // namespace moelora::ops::cuda
