// Multi-LoRA on the GPU over an adapter pool (docs/gpu_moe.md §4): segmented split-K shrink and
// an expand that reduces the fp32 partials, applies the slot's scaling and writes bf16 deltas.
//
// Rows are grouped into segments {slot, expert, begin, end} of consecutive (sorted) rows that use
// the same adapter slot and expert; the MoE align kernel produces them for expert pairs (and for
// tokens by slot, with expert 0, for plain targets such as the shared expert).
//
//   shrink:  partial[split, q, r] = sum_{k in split} x[row(q), k] * A[slot, ea, r, k]
//   expand:  delta[q, n] = scaling[slot] * sum_r (sum_split partial[split, q, r]) * B[slot, eb, n, r]
// with ea = (Ea == 1 || a_shared[slot]) ? 0 : expert (likewise eb), r < rank[slot]. A slot of
// rank 0 writes zero deltas for its rows, so consumers can read the delta of every row whose
// slot is >= 0 without checking ranks. Rows outside every segment are never touched.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::ops::cuda {

// One (layer, target) of the adapter pool.
struct LoraPoolTarget {
  const __nv_bfloat16* a = nullptr;  // [S, Ea, R, in]
  const __nv_bfloat16* b = nullptr;  // [S, Eb, out, R]
  const float* scaling = nullptr;    // [S]
  const int32_t* rank = nullptr;     // [S], 0 = the slot's adapter does not target this module
  const uint8_t* a_shared = nullptr; // [S] or nullptr; 1 = use expert 0 of A (shared-outer)
  const uint8_t* b_shared = nullptr; // [S] or nullptr
  int num_slots = 0;     // S
  int ea = 1, eb = 1;    // expert extents of A and B in the pool
  int max_rank = 0;      // R (a multiple of 8, at most 256)
  int in_features = 0;   // multiple of 8
  int out_features = 0;
};

struct LoraSegmentsView {
  const int4* segments = nullptr;      // {slot, expert, begin, end}
  const int32_t* num_segments = nullptr;  // [1]
  int max_segments = 0;                // grid capacity
  // CTAs per segment along the rows: CTA z handles rows begin + 32 z, begin + 32 (z + row_chunks),
  // ... (any segment size is covered; more chunks = more parallelism for long segments, e.g. a
  // prefill's single adapter over thousands of tokens).
  int row_chunks = 1;
};

struct LoraShrinkArgs {
  LoraPoolTarget pool;
  LoraSegmentsView seg;
  const __nv_bfloat16* x = nullptr;  // [rows, in]
  const int32_t* gather = nullptr;   // x row of each sorted row, nullptr = identity
  float* partial = nullptr;          // [splits, row_capacity, R]
  int row_capacity = 0;
};

struct LoraExpandArgs {
  LoraPoolTarget pool;
  LoraSegmentsView seg;
  const float* partial = nullptr;    // [splits, row_capacity, R] from the shrink (or a GEMM)
  int row_capacity = 0;              // rows of `partial`
  int splits = 0;                    // 0 = lora_shrink_splits(in_features); 1 for a dense GEMM's u
  const int32_t* u_row = nullptr;    // row of `partial` holding sorted row q's u; nullptr = q
  __nv_bfloat16* delta = nullptr;    // [sorted rows, out]
};

// Number of K splits the shrink uses for `in` input features (the expand needs it too).
int lora_shrink_splits(int in_features);
size_t lora_partial_bytes(int in_features, int row_capacity, int max_rank);

void launch_lora_shrink(const LoraShrinkArgs& args, cudaStream_t stream);
void launch_lora_expand(const LoraExpandArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
