// Element-wise kernels of the MoE layer on the GPU (docs/gpu_moe.md §1):
//   activation: a = silu(h_gate + d_gate) * (h_up + d_up) per sorted pair row; writes the bf16
//               copy for the down LoRA and the FP8 codes + scales for GEMM2, in one pass.
//   finalize:   out[t] = sum_j w[t, j] (y + d2)[pair_pos(t, j)] + gate(t) * (shared[t] + ds[t]),
//               shared[t] a row of y when the shared expert is one of the pairs,
//               gate(t) = sigmoid(x[t] . wsg) for Qwen's gated shared expert, else 1; d2 (and
//               ds) read from the expands' rows, or formed here from the seam-2 shrinks' partials.
// Deltas are read only for rows whose token has a slot >= 0 (the LoRA expand wrote them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/lora/lora_row_fused.cuh"

namespace moelora::ops::cuda {

struct MoeActivationArgs {
  const __nv_bfloat16* h = nullptr;      // [rows, 2I] gate columns [0, I), up [I, 2I)
  const __nv_bfloat16* delta = nullptr;  // [rows, 2I] or nullptr
  const int32_t* delta_row = nullptr;    // [rows] row of `delta` holding row r's delta, nullptr = r
  const int32_t* row_token = nullptr;    // [rows] token of each row (to look up its slot), or nullptr
  const int32_t* slot = nullptr;         // [T] or nullptr (no LoRA)
  const int32_t* num_rows = nullptr;     // [1] valid rows (device), or nullptr = max_rows
  // The shared expert among the routed ones (MoeLayerConfig::shared_in_experts): rows from
  // *shared_rows_begin on (device value: its expert offset) are its pairs, which take their
  // seam-1 delta from `shared_delta` at row shared_delta_row[token] (the token-segment expand's
  // rows) instead of `delta`, for tokens with a slot >= 0. nullptr: no such rows.
  const int32_t* shared_rows_begin = nullptr;
  const __nv_bfloat16* shared_delta = nullptr;  // [T', 2I] or nullptr (no shared-expert LoRA)
  const int32_t* shared_delta_row = nullptr;    // [T] (token_pos)
  int max_rows = 0;
  int inter = 0;          // I
  int inter_padded = 0;   // I rounded up to 128 (the GEMM2 K)
  __nv_bfloat16* a16 = nullptr;  // [rows, I]
  uint8_t* aq = nullptr;         // [rows, inter_padded] e4m3, or nullptr (bf16 output only)
  float* sa = nullptr;           // [rows, inter_padded / 128], or k-major (scale_ld)
  int scale_ld = 0;              // 0: sa row-major; > 0: k-major [inter_padded / 128, scale_ld]
  // Launch with programmatic stream serialization: the kernel waits for the previous kernel in
  // the stream (griddepcontrol.wait) before reading, and lets its own dependents start at once.
  bool pdl = false;
  // Optional seam-2 LoRA shrink of the activation rows (lora.partial != nullptr;
  // lora_row_fused.cuh): partials [ceil(I / 1024), capacity, R] of the bf16-rounded a16 values,
  // with lora.row_token = row_token.
  LoraRowShrinkArgs lora;
  // Optional, with `lora` and without `lora_expand`: the shared expert's rows (from
  // *shared_rows_begin on) shrink with this pool (its down LoRA A, slot = the row's token's,
  // expert 0) into these partials at row = the token ([ceil(I / 1024), capacity >= T, R]) instead
  // of `lora`'s (whose {slot, expert} of those rows is the base bin's).
  LoraRowShrinkArgs shared_lora;
  // Optional seam-1 LoRA expand fused in (lora_expand.partial != nullptr, instead of `delta`):
  // the rows' deltas from the quant kernel's shrink partials, added to the gate and up values
  // before the activation. Its B rows are read before the kernel's wait, with num_rows and
  // lora_expand.row_slot_expert, which must be complete before the previous kernel started (the
  // align kernel's outputs in the MoE layer).
  LoraRowExpandArgs lora_expand;
};
void launch_moe_activation(const MoeActivationArgs& args, cudaStream_t stream);

struct MoeFinalizeArgs {
  const __nv_bfloat16* y = nullptr;        // [P, H] expert outputs in sorted order
  const __nv_bfloat16* delta = nullptr;    // [P, H] seam-2 deltas or nullptr
  const float* topk_weights = nullptr;     // [T, k]
  // [T * kp], -1 for a pair without an expert (moe_align); kp = k, or k + 1 with shared_in_pairs
  const int32_t* pair_pos = nullptr;
  const int32_t* slot = nullptr;           // [T] or nullptr
  const __nv_bfloat16* shared = nullptr;   // [T, H] shared expert output or nullptr
  // The shared expert among the routed ones (MoeLayerConfig::shared_in_experts; instead of
  // `shared`): pair k of each token (pair_pos[t * (k + 1) + k]) is its row of y, added with the
  // shared expert's gate (and shared_delta) after the k routed pairs.
  bool shared_in_pairs = false;
  const __nv_bfloat16* shared_delta = nullptr;  // [T', H] shared down LoRA delta rows or nullptr
  const int32_t* shared_delta_row = nullptr;    // [T] row of token t in shared_delta (token_pos)
  const __nv_bfloat16* shared_gate = nullptr;   // [H] Qwen sigmoid gate weight or nullptr
  const __nv_bfloat16* x = nullptr;        // [T, H] layer input (for the gate)
  const int32_t* num_tokens = nullptr;     // [1] or nullptr
  int max_tokens = 0, top_k = 0, hidden = 0;
  __nv_bfloat16* out = nullptr;            // [T, H]
  bool pdl = false;  // programmatic stream serialization (griddepcontrol.wait before any read)
  // Optional seam-2 LoRA expand folded in (lora_expand.partial != nullptr, instead of `delta`):
  // each pair's delta from the seam-2 shrink's partials [splits, row_capacity, R] (rows = sorted
  // pair positions) and the pool's B of the pair's {slot, expert} (lora_expand.row_slot_expert,
  // the align's; pool.out_features = H), with the segment expand's arithmetic and bf16 rounding,
  // so the output has the bits of expand + finalize. Needs `slot`, top_k <= 8, R <= 32 (the B
  // values of a column's pairs are held in registers) and no separate shared expert output (the
  // shared expert among the pairs, shared_in_pairs, is fine). The B rows and {slot,
  // expert} are read before the kernel's wait, the partials after it (also those of a side-stream
  // shrink joined by an event: in a graph the event's edge into a programmatic launch may let this
  // kernel start as soon as that shrink triggers, and only the wait covers its completion).
  LoraRowExpandArgs lora_expand;
  // Optional with lora_expand and shared_in_pairs (instead of shared_delta): the shared expert's
  // seam-2 delta formed here too, from its shrink's partials at row = the token (the activation's
  // MoeActivationArgs::shared_lora) and its down pool's B of the token's slot (expert 0);
  // row_slot_expert unused.
  LoraRowExpandArgs shared_lora_expand;
};
constexpr int kFinalizeFoldMaxTopK = 8;
constexpr int kFinalizeFoldMaxRank = 32;
// The ranks the fold's instance holds for a routed down pool of rank <= `routed_max_rank` (<=
// kFinalizeFoldMaxRank): 16 or 32. The shared expert's folded expand must fit the same instance.
constexpr int finalize_fold_ranks(int routed_max_rank) {
  return routed_max_rank <= 16 ? 16 : 32;
}
void launch_moe_finalize(const MoeFinalizeArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
