// Grouped FP8 block-scaled expert GEMMs on Hopper (launchers). See docs/gpu_moe.md §5 and the CPU
// reference in ops/gemm/moe_gemm.h, which every kernel here is tested against.
//
//   out[q, n] = sum_k act[row(q), k] sx[row(q), k/128] * W[e(q), n, k] sw[e(q), n/128, k/128]
//
// Launchers never allocate and never synchronize; all pointers are device pointers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "ops/gemm/moe_gemm.h"

namespace moelora::ops::cuda {

// The routed experts' LoRA delta added in the stream kernel's epilogue, before the bf16 store:
//
//   out[q, n] += scaling[s] * sum_r u[q, r] * B[s, eb, n, r],   u[q, r] = sum_split partial[split, q, r]
//
// with {s, e} = row_slot_expert[q] (eb = 0 when the pool's B is shared by the experts), r below
// the slot's rank; rows of slot -1 or rank 0 get nothing. The shrink partials come from the kernel
// this one follows (the quant kernel for GEMM1, the activation kernel for GEMM2: ops/lora/
// lora_row_fused.cuh), so the expand costs no launch and no extra pass over the output. Rows of
// one expert are sorted by slot (moe_align), so a pass meets each of its slots in one run.
struct MoeGemmLoraEpilogue {
  const __nv_bfloat16* b = nullptr;        // pool [S, Eb, N, R]; nullptr = no LoRA epilogue
  const float* scaling = nullptr;          // [S]
  const int32_t* rank = nullptr;           // [S]
  const uint8_t* b_shared = nullptr;       // [S] 1 = expert 0 of B serves every expert, or nullptr
  const float* partial = nullptr;          // [splits, row_capacity, R]
  const int2* row_slot_expert = nullptr;   // [rows] {slot, expert} of each sorted position
  int num_slots = 0;                       // S
  int b_experts = 1;                       // Eb (1, E or E - base_only_experts)
  // Trailing experts of the GEMM whose rows all carry slot -1, so B has no region for them: the
  // shared expert stored as expert E of the routed stacks (its LoRA is applied outside the GEMM).
  int base_only_experts = 0;
  int max_rank = 0;                        // R, a multiple of 8, at most 256
  int splits = 0;                          // K chunks of the partials
  int row_capacity = 0;                    // rows of one split (>= the sorted positions)
};

struct MoeGemmFp8Args {
  const uint8_t* act = nullptr;      // e4m3 [rows, K]
  const float* act_scale = nullptr;  // [rows, K/128], or k-major [K/128, act_scale_ld] (stream kernel)
  const int32_t* gather =
      nullptr;  // [P] activation row of each sorted position; nullptr = identity
  const uint8_t* weight = nullptr;          // e4m3 [E, N, K] row-major
  const float* weight_scale = nullptr;      // [E, ceil(N/128), K/128]
  const int32_t* expert_offsets = nullptr;  // [E + 1] sorted-position ranges per expert
  const int32_t* active_experts = nullptr;  // [E] experts with pairs, first *num_active valid
  const int32_t* num_active = nullptr;      // [1]
  __nv_bfloat16* out = nullptr;             // [P, N], rows in sorted order
  int num_experts = 0;                      // E
  int n = 0;                                // N (output features)
  int k = 0;                                // K (input features), a multiple of 128
  // Capacity used to size the grid and pick the instance (host-side values, fixed per graph):
  int max_active_experts = 0;     // upper bound on *num_active (min(E, max pairs))
  int max_tokens_per_expert = 0;  // upper bound on the tokens of one expert (the batch's tokens)
  // Stream kernel only: rows of the act buffer (the TMA view's extent; rows past it read as 0)
  // and the leading dimension of its k-major scales (>= act_rows, a multiple of 4).
  int act_rows = 0;
  int act_scale_ld = 0;
  // Stream kernel only, optional: two zeroed ints through which the CTAs claim work items first
  // come first served (nullptr: round-robin). The kernel leaves them zeroed for its next launch;
  // launches that may run at the same time (GEMM1 and GEMM2 of one layer overlap under
  // programmatic launch) need their own pair.
  int* work_counters = nullptr;
  // Stream kernel only, optional: the LoRA delta added before the store (lora.b == nullptr: none).
  MoeGemmLoraEpilogue lora;
};

// Weight-streaming kernel for decode (moe_gemm_stream_cuda.cu): TMA ring of 64-row weight tiles
// feeding wgmma (swap-AB, tokens on N = 8..64 per pass), persistent grid of two CTAs per SM, each
// touched weight read once per pass of 64 tokens. Requirements beyond check_moe_gemm_fp8_args:
// gather == nullptr (act rows in sorted order, one per sorted position), act_scale k-major
// ([K/128, act_scale_ld], 16-byte aligned), a sm_90a device. pdl: launch with programmatic stream
// serialization (the weights of the first ring fill are fetched while the previous kernel in the
// stream finishes; the activations only after it completes).
void launch_moe_gemm_fp8_stream(const MoeGemmFp8Args& args, int num_sms, bool pdl, cudaStream_t stream);

// Swap-AB mma.sync kernel for few tokens per expert (decode). Works for any number of tokens per
// expert (it loops over passes of 8 * token_subtiles tokens) but is fastest at <= 32.
void launch_moe_gemm_fp8_decode(const MoeGemmFp8Args& args, int num_sms, cudaStream_t stream);

// ---- prefill: CUTLASS sm90 grouped GEMM with blockwise scaling (moe_gemm_prefill_cuda.cu) ----

// Caller-owned device memory of the prefill GEMM. Layout (each region 256-byte aligned, in this
// order): CUTLASS's per-SM TMA descriptor slots (depends on num_sms only), then per-expert arrays
// of E entries: problem shapes (M_e, N, K), pointers to A, B, D, A scales, B scales, strides of
// A, B, D, scale layouts of A and B. Every launch rewrites the per-expert arrays on the device from
// expert_offsets, so one workspace may serve any number of launches (GEMM1 and GEMM2 of every
// layer) as long as they are ordered on one stream; launches in flight at the same time need
// separate workspaces.
struct MoeGemmPrefillWorkspace {
  void* data = nullptr;  // device memory, 256-byte aligned
  size_t bytes = 0;      // >= moe_gemm_prefill_workspace_bytes(num_experts, num_sms)
  int num_sms = 0;       // SMs of the persistent grid (>= 2); the value given to the size function
};

// Bytes of workspace for up to `num_experts` groups on a grid of `num_sms` SMs. Independent of the
// token count, N and K (the per-expert row counts live on the device only).
size_t moe_gemm_prefill_workspace_bytes(int num_experts, int num_sms);

// Grouped GEMM for many tokens per expert (prefill): one CUTLASS group per expert, M_e =
// expert_offsets[e + 1] - expert_offsets[e] read on the device, so a captured CUDA graph stays
// valid for any routing; experts with no rows do no work. Requirements beyond
// check_moe_gemm_fp8_args: gather == nullptr (act row q is sorted position q), N % 128 == 0,
// out 16-byte aligned, a sm_90 device. act_scale is used as it is ([P, K/128] row-major).
// active_experts, num_active and max_tokens_per_expert are not used (max_active_experts only has
// to pass the shared check).
// Launches two kernels (a per-expert setup kernel, then the GEMM); never allocates or syncs.
void launch_moe_gemm_fp8_prefill(const MoeGemmFp8Args& args, const MoeGemmPrefillWorkspace& ws,
                                 cudaStream_t stream);

// Argument checks shared by both paths; throws moelora::Error naming the bad field.
void check_moe_gemm_fp8_args(const MoeGemmFp8Args& args);

// ---- NVFP4 experts, decode (moe_gemm_nvfp4_stream_cuda.cu) ----

// Which instance of the NVFP4 stream kernel runs: kAuto picks from max_tokens_per_expert (below);
// the others force one, for measurements (any routing is computed correctly by each, with the same
// bits): kNarrow 64-row items and 32-token passes, kWide 128-row items and 32-token passes,
// kPrefill 256-row x 128-token pass items (N a multiple of 256).
enum class Nvfp4StreamInstance { kAuto, kNarrow, kWide, kPrefill };
// "auto", "narrow", "wide" or "prefill" (bench rows and file names).
inline const char* nvfp4_stream_instance_name(Nvfp4StreamInstance i) {
  switch (i) {
    case Nvfp4StreamInstance::kNarrow: return "narrow";
    case Nvfp4StreamInstance::kWide: return "wide";
    case Nvfp4StreamInstance::kPrefill: return "prefill";
    default: return "auto";
  }
}

// clang-format off
//   out[q, n] = act_scale[q] * row_scale[e, n] * sum_k act[q, k] * e2m1(W[e, n, k]) * e4m3(s[e, n, k/16])
// clang-format on
//
// W4A16 on f16 tensor cores: the activation rows come from rows_to_f16_pow2 (f16 values times a
// power-of-two row scale, exact for bf16 inputs), the weights from pack_nvfp4_for_stream
// (ops/gemm/moe_gemm_nvfp4.h). Each code is expanded in registers to the f16 e2m1 * 2^-14 and
// multiplied by its group scale (exact: at most 5 significant bits, never below 2^-24), then fed to
// wgmma as the A operand; the row scales times 2^14 are applied once, in the epilogue.
struct MoeGemmNvfp4Args {
  const __half* act = nullptr;         // f16 [act_rows, K], one row per sorted position
  const float* act_scale = nullptr;    // [act_rows] power-of-two row scales
  const uint8_t* weight = nullptr;     // image [E, N/64, K/128, 4608] (pack_nvfp4_for_stream), 16-byte aligned
  const float* row_scale = nullptr;    // [E, N]
  const int32_t* expert_offsets = nullptr;  // [E + 1]
  const int32_t* active_experts = nullptr;  // [E], first *num_active valid
  const int32_t* num_active = nullptr;      // [1]
  __nv_bfloat16* out = nullptr;             // [P, N], rows in sorted order
  int num_experts = 0;                      // E (at most 512)
  int n = 0;                                // N, a multiple of 128
  int k = 0;                                // K, a multiple of 128
  int max_active_experts = 0;               // grid sizing (host value, fixed per graph)
  // Expected tokens of the busiest expert (host value, fixed per graph): above
  // kNvfp4PrefillMinTokens (and N a multiple of 256) the prefill instance (256-row x 128-token
  // tiles, one item per pass), above 16 128-row items (two warpgroups sharing each activation
  // tile), else 64-row ones. Any routing is computed correctly by each; the bits are the same.
  int max_tokens_per_expert = 0;
  int act_rows = 0;                         // rows of act (the TMA view's extent)
  int* work_counters = nullptr;             // optional, as MoeGemmFp8Args::work_counters
  Nvfp4StreamInstance instance = Nvfp4StreamInstance::kAuto;
};

constexpr int kNvfp4PrefillMinTokens = 64;
// The instance launch_moe_gemm_nvfp4_stream runs for `args` (never kAuto).
Nvfp4StreamInstance nvfp4_stream_instance(const MoeGemmNvfp4Args& args);

// Persistent weight-streaming kernel as launch_moe_gemm_fp8_stream (swap-AB, passes of up to 32
// tokens, items of 64 or 128 weight rows, weights of the first ring fill fetched before
// griddepcontrol.wait when `pdl`); prefill sizes take passes of 128 tokens over 256 weight rows. Throws moelora::Error naming the bad field; never allocates or
// synchronizes.
void launch_moe_gemm_nvfp4_stream(const MoeGemmNvfp4Args& args, int num_sms, bool pdl, cudaStream_t stream);

// W4A8 for decode (moe_gemm_nvfp4_w4a8_cuda.cu): the activation rows as e4m3 with power-of-two
// row scales (rows_to_e4m3_pow2), the codes of pack_nvfp4_for_w4a8's image expanded to e4m3 for
// the FP8 tensor cores, group scales applied in fp32. Passes of up to 8 tokens over 64-row items,
// three CTAs per SM; an expert with more tokens takes several passes (it reads its weights again
// for each: the kernel is meant for decode). Same fields as MoeGemmNvfp4Args otherwise.
struct MoeGemmNvfp4W4a8Args {
  const uint8_t* act = nullptr;      // e4m3 [act_rows, K], one row per sorted position
  const float* act_scale = nullptr;  // [act_rows] power-of-two row scales
  const uint8_t* weight =
      nullptr;  // image [E, N/64, K/128, 4608] (pack_nvfp4_for_w4a8), 16-byte aligned
  const float* row_scale = nullptr;         // [E, N]
  const int32_t* expert_offsets = nullptr;  // [E + 1]
  const int32_t* active_experts = nullptr;  // [E], first *num_active valid
  const int32_t* num_active = nullptr;      // [1]
  __nv_bfloat16* out = nullptr;             // [P, N], rows in sorted order
  int num_experts = 0;                      // E (at most 512)
  int n = 0;                                // N, a multiple of 64
  int k = 0;                                // K, a multiple of 128
  int max_active_experts = 0;               // grid sizing (host value, fixed per graph)
  int act_rows = 0;                         // rows of act (the TMA view's extent)
  int* work_counters = nullptr;             // optional, as MoeGemmFp8Args::work_counters
};
// Throws moelora::Error naming the bad field; never allocates or synchronizes. With `pdl` the
// weights of the first ring fill are fetched before griddepcontrol.wait.
void launch_moe_gemm_nvfp4_w4a8(const MoeGemmNvfp4W4a8Args& args, int num_sms, bool pdl,
                                cudaStream_t stream);

// ---- bf16 experts (moe_gemm_bf16_cuda.cu) ----
//
//   out[q, n] = sum_k act[row(q), k] * W[e(q), n, k]   (bf16 in, fp32 accumulation, bf16 out)
//
// for every sorted position q of an active expert, row(q) = gather[q] (or q). Used by the MoE
// layer when the routed experts are bf16: GEMM1 reads x rows through the align's sorted_token,
// GEMM2 reads the activation's bf16 rows in sorted order. mma.sync m16n8k16 on tensor cores.

// Tile shape of the bf16 kernel: kDecode = 64 weight rows x 16 tokens per CTA (few tokens per
// expert, weight streaming), kPrefill = 128 x 64 (many tokens per expert, tensor-core bound).
enum class MoeGemmBf16Tile { kAuto, kDecode, kPrefill };

struct MoeGemmBf16Args {
  const __nv_bfloat16* act = nullptr;     // [rows, K]
  const int32_t* gather = nullptr;        // [P] act row of each sorted position; nullptr = identity
  const __nv_bfloat16* weight = nullptr;  // [E, N, K] row-major
  const int32_t* expert_offsets = nullptr;  // [E + 1] sorted-position ranges per expert
  const int32_t* active_experts = nullptr;  // [E] experts with pairs, first *num_active valid
  const int32_t* num_active = nullptr;      // [1]
  __nv_bfloat16* out = nullptr;             // [P, N], rows in sorted order
  int num_experts = 0;                      // E
  int n = 0;                                // N, a multiple of 8
  int k = 0;                                // K, a multiple of 8
  // Capacity used to size the grid (host values, fixed per captured graph): grid.y =
  // max_active_experts, grid.z = row splits for max_tokens_per_expert rows. An expert with more
  // rows than that is still covered (each CTA loops over its share of token tiles).
  int max_active_experts = 0;     // upper bound on *num_active (min(E, max pairs))
  int max_tokens_per_expert = 0;  // expected rows of the busiest expert
  MoeGemmBf16Tile tile = MoeGemmBf16Tile::kAuto;
};

// kAuto's choice: kDecode up to 32 expected rows per expert, kPrefill beyond.
MoeGemmBf16Tile choose_moe_gemm_bf16_tile(int max_tokens_per_expert);
// Throws moelora::Error naming the bad field (null pointers, N or K not a multiple of 8,
// max_active_experts outside [1, E], pointers not 16-byte aligned).
void check_moe_gemm_bf16_args(const MoeGemmBf16Args& args);
// Never allocates or synchronizes; CTAs past *num_active exit at once (graph-capturable).
void launch_moe_gemm_bf16(const MoeGemmBf16Args& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
