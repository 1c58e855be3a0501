// Grouped FP8 block-scaled GEMM of the MoE experts (GEMM1 and GEMM2 of DESIGN.md §3), CPU
// reference.
//
//   out[q, n] = sum_k  e4m3(act[row(q), k]) * act_scale[row(q), k/128]
//                    * e4m3(w[e(q), n, k])  * w_scale[e(q), n/128, k/128]
// for every sorted position q, where e(q) is the expert whose range [offsets[e], offsets[e+1])
// contains q and row(q) = gather[q] (or q when no gather index is given). K is a multiple of 128
// (the layer pads), N is arbitrary.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace moelora::ops {

struct MoeGemmFp8Ref {
  Tensor act;        // F8_E4M3 [rows, K]
  Tensor act_scale;  // F32 [rows, K/128]
  Tensor weight;     // F8_E4M3 [E, N, K]
  Tensor weight_scale;  // F32 [E, ceil(N/128), K/128]
  std::vector<int32_t> expert_offsets;  // [E + 1], non-decreasing, last = number of sorted positions
  std::vector<int32_t> gather;          // [P] activation row of each sorted position; empty = identity
};

// Returns F32 [P, N], P = expert_offsets.back().
Tensor moe_gemm_fp8_ref(const MoeGemmFp8Ref& args);

// ---- kernel selection for the GPU paths (pure functions, unit-tested on the CPU) ----

// Instance of the decode (swap-AB) kernel: warps_n 16-row tiles per CTA side by side, warps_k
// warps splitting K inside the CTA (warps_n * warps_k = 8), token_subtiles 8-token MMA subtiles
// per pass.
struct DecodeGemmConfig {
  int token_subtiles = 1;
  int warps_n = 1;
  int warps_k = 8;
};
// Picks the widest CTA (most rows, least K splitting) that still gives every SM at least two
// CTAs for the expected number of active experts, and never more K-splitting warps than K has
// 128-column blocks.
DecodeGemmConfig choose_decode_gemm_config(int n, int k, int max_active_experts, int max_tokens_per_expert,
                                           int num_sms);

// Decode kernels (up to 24 tokens per expert on average, T * k / E) against the tensor-core-bound
// grouped GEMM. The stream decode kernel reads each weight once per pass of up to 64 tokens (the
// register kernel once per 32), so the busiest experts of such a batch still take one pass.
bool should_use_decode_gemm(int64_t tokens, int64_t top_k, int64_t num_experts);

}  // namespace moelora::ops
