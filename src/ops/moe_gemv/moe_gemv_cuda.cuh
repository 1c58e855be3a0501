// The routed experts of a decode step with up to kMoeGemvMaxTokens tokens in two kernels
// (docs/gpu_moe.md §6.4), the reference being moe_gemv.h:
//
//   up    persistent grid over (j, i) items, the j-th distinct expert e of the batch and 16
//         intermediate columns: gate rows W13[e][16i ..] and up rows
//         W13[e][I + 16i ..] against every token's FP8 x codes (quantized by the route kernel,
//         RouteDeviceArgs::quant), then act[pair] = silu(gate) * up (bf16) for the tokens routed
//         to e. The last CTA of expert e to finish (a ticket per expert) quantizes the act rows of
//         e's tokens per 128 columns into aq / sa.
//   down  grid (H / 16): CTA h takes 16 output columns of every token: for each distinct expert,
//         W2[e][16h ..] against the aq rows of the tokens routed to e, scaled by sa and the
//         routing weights and summed in registers, plus the (gated) shared expert's output.
//
// No sorted order, no alignment, no quant / activation / finalize kernels: route -> up -> down is
// the whole routed chain. Both kernels are weight-streaming GEMVs on the tensor cores: the
// weights are the M side of mma.m16n8k32 (e4m3, fp32 accumulate), the (up to 8) tokens its N
// side, and each lane's 16 contiguous weight bytes and 16 contiguous activation codes of a
// 64-column chunk are its A and B fragments of two mmas (any permutation of K inside an mma is
// exact when A and B share it); weights, codes and scales stream through a cp.async ring in
// shared memory (moe_gemv_cuda.cu says how it is laid out). Block scales are applied
// per 128-column block in registers; the 4 warps of a CTA split K and add their partial sums in
// a fixed order, so results are deterministic.
//
// Programmatic dependent launch (pdl): up waits before reading anything and then lets down start;
// down builds its expert table from the routing and issues the L2 fills of its first
// `prefetch_experts` experts' weight slices before its wait, so they stream beside up.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::ops::cuda {

constexpr int kMoeGemvMaxTokens = 8;  // the mma's N
constexpr int kMoeGemvMaxTopK = 32;   // the GPU router's limit
constexpr int kMoeGemvMaxExperts = 1024;
constexpr int kMoeGemvMaxTickets = kMoeGemvMaxTokens * kMoeGemvMaxTopK;  // one per distinct expert

struct MoeGemvArgs {
  // Routing (the route kernel's outputs): pair p = t * k + j.
  const int32_t* topk_ids = nullptr;    // [T, k], -1 = no expert (padding token)
  const float* topk_weights = nullptr;  // [T, k]
  const int32_t* num_tokens = nullptr;  // [1] valid tokens (device value), nullptr = tokens
  int tokens = 0;                       // T (1 .. kMoeGemvMaxTokens)
  int top_k = 0;                        // k (1 .. kMoeGemvMaxTopK)
  int num_experts = 0;                  // E (<= kMoeGemvMaxExperts)
  int hidden = 0;                       // H, multiple of 128
  int inter = 0;                        // I, multiple of 128
  // up
  const uint8_t* xq = nullptr;       // e4m3 [T, H]: x quantized per token per 128 columns
  const float* sx = nullptr;         // [T, H / 128]
  const uint8_t* w13 = nullptr;      // e4m3 [E, 2I, H]
  const float* w13_scale = nullptr;  // [E, 2I / 128, H / 128]
  __nv_bfloat16* act = nullptr;      // [T * k, I] (rows of pairs without an expert untouched)
  uint8_t* aq = nullptr;             // e4m3 [T * k, I]: act quantized per 128 columns
  float* sa = nullptr;               // [T * k, I / 128]
  int32_t* tickets = nullptr;        // [kMoeGemvMaxTickets], zero before the first launch; the
                                     // kernel leaves them zero
  // down
  const __nv_bfloat16* x = nullptr;       // [T, H] (only for the shared gate)
  const uint8_t* w2 = nullptr;            // e4m3 [E, H, I]
  const float* w2_scale = nullptr;        // [E, H / 128, I / 128]
  const __nv_bfloat16* shared = nullptr;  // [T, H] shared expert output, or nullptr
  const __nv_bfloat16* shared_gate =
      nullptr;  // [H] Qwen's sigmoid gate weight (gate = sigmoid(x . w)) or nullptr
  __nv_bfloat16* out = nullptr;  // [T, H] (rows of padding tokens untouched)
  int prefetch_experts = 0;  // down: experts whose W2 slice each CTA fills into L2 before its wait
  int num_sms = 0;           // up: persistent grid of 2 CTAs per SM; 0 = one CTA per item
  bool pdl = false;
};

// Throws kInvalidArgument naming the field when the arguments do not fit the kernels.
void check_moe_gemv_args(const MoeGemvArgs& args);
void launch_moe_gemv_up(const MoeGemvArgs& args, cudaStream_t stream);
void launch_moe_gemv_down(const MoeGemvArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
