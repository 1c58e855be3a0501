// Multi-LoRA on the GPU over an adapter pool (docs/gpu_moe.md §4): segmented split-K shrink and
// an expand that reduces the fp32 partials, applies the slot's scaling and writes bf16 deltas (or
// adds them into the base output).
//
// Rows are grouped into segments {slot, expert, begin, end} of consecutive (sorted) rows that use
// the same adapter slot and expert; the MoE align kernel produces them for expert pairs (and for
// tokens by slot, with expert 0, for plain targets such as the shared expert), the model's step
// metadata for the token rows of the dense projections.
//
//   shrink:  partial[split, q, r] = sum_{k in split} x[row(q), k] * A[slot, ea, r, k]
//   expand:  delta[q, n] = scaling[slot] * sum_r (sum_split partial[split, q, r]) * B[slot, eb, n,
//   r]
// with ea = (Ea == 1 || a_shared[slot]) ? 0 : expert (likewise eb), r < rank[slot]. In the write
// mode a slot of rank 0 writes zero deltas for its rows, so consumers can read the delta of every
// row whose slot is >= 0 without checking ranks. Rows outside every segment are never touched.
//
// Multi-target launches: up to kLoraMaxTargets targets that read the same x rows with the same
// segments (q/k/v of one attention, MLA's q_a and kv_a, gate and up of a dense MLP, the four input
// projections of a Gated DeltaNet layer) run as one
// shrink launch and one expand launch; each target has its own pool view, partials and output
// columns, and the CTA's blockIdx.y picks the target.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::ops::cuda {

// One (layer, target) of the adapter pool.
struct LoraPoolTarget {
  const __nv_bfloat16* a = nullptr;   // [S, Ea, R, in]
  const __nv_bfloat16* b = nullptr;   // [S, Eb, out, R]
  const float* scaling = nullptr;     // [S]
  const int32_t* rank = nullptr;      // [S], 0 = the slot's adapter does not target this module
  const uint8_t* a_shared = nullptr;  // [S] or nullptr; 1 = use expert 0 of A (shared-outer)
  const uint8_t* b_shared = nullptr;  // [S] or nullptr
  int num_slots = 0;                  // S
  int ea = 1, eb = 1;                 // expert extents of A and B in the pool
  int max_rank = 0;                   // R (a multiple of 8, at most 256)
  int in_features = 0;                // multiple of 8
  int out_features = 0;
};

// The segments of one launch and how the launchers spread their rows over CTAs. Segment counts
// are device values, so grids are sized by capacity; CTAs without work return at once.
struct LoraSegmentsView {
  const int4* segments = nullptr;         // [max_segments] {slot, expert, begin, end}
  const int32_t* num_segments = nullptr;  // [1], at most max_segments
  int max_segments = 0;                   // grid capacity
  // Segment-major grids (max_rows == 0; single-target launches only, the short-segment kernels):
  // work units (segment, K split / column tile, row chunk z); unit z of a segment takes its 32-row
  // chunks z, z + row_chunks, ... (any segment size is covered; more chunks = more parallelism
  // for long segments). Grid: one CTA per unit of the capacity max_segments x splits / tiles x
  // row_chunks, or max_ctas CTAs.
  int row_chunks = 1;
  // Segment-major grids only: 0 = one CTA per unit (segment, split / tile, row chunk); > 0 = at
  // most max_ctas CTAs, each taking every gridDim.x-th unit of the live segments. A capped grid
  // leaves room on every SM for a kernel that runs beside it: the MoE layer's persistent expert
  // GEMMs on the main stream, which an uncapped side-stream grid of ~1000 CTAs would delay until
  // its CTAs drained.
  int max_ctas = 0;
  // Row-major grids (max_rows > 0; required by the multi-target launchers, the row-chunk kernels):
  // the caller promises that the segments hold at most max_rows rows in all (disjoint token rows,
  // as for a dense projection). The launchers cut every segment into chunks of a few rows (8 at
  // decode sizes, more for long prefills) and size the grid by the chunk capacity
  // ceil(max_rows / chunk) + min(max_segments, max_rows) - 1, which bounds sum_s ceil(len_s /
  // chunk) for any split of max_rows rows into max_segments segments; each CTA finds its
  // (segment, chunk) with a prefix sum over the segment lengths (in array order; the segments need
  // not be sorted by row). So one adapter's 64 decode rows spread over as many CTAs as 8 adapters'
  // 8 rows each, and the grid does not grow with the number of slots times the rows. row_chunks
  // is ignored.
  int max_rows = 0;
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
  const float* partial = nullptr;  // [splits, row_capacity, R] from the shrink (or a GEMM)
  int row_capacity = 0;            // rows of `partial`
  int splits = 0;                  // 0 = lora_shrink_splits(in_features); 1 for a dense GEMM's u
  const int32_t* u_row = nullptr;  // row of `partial` holding sorted row q's u; nullptr = q
  __nv_bfloat16* delta = nullptr;  // [sorted rows, out]
  // Segment-major expand only: launched as a programmatic dependent of the kernel before it on the
  // stream (the shrink, which lets it start at once): it loads its B rows, then waits
  // (griddepcontrol.wait) before reading the partials. The segments, ranks and scalings must be
  // complete before that kernel started.
  bool pdl = false;
  // Segment-major expand only: take the register-bounded instance (<= 80 registers for R <= 64),
  // which starts beside two CTAs of the persistent expert GEMM. Set for large grids (the MoE
  // layer's decode batches of 32+ tokens); the unbounded one is faster alone (no spills).
  bool beside_gemm = false;
};

// ---- multi-target launches ----

constexpr int kLoraMaxTargets = 4;  // Gated DeltaNet's in_proj_qkv / z / b / a

// One target of a multi-target shrink. Every target of a launch has the same in_features (they
// read the same x), hence the same K splits; max_rank may differ.
struct LoraShrinkTarget {
  LoraPoolTarget pool;
  float* partial = nullptr;  // [splits, row_capacity, pool.max_rank], this target's own buffer
};

struct LoraMultiShrinkArgs {
  LoraShrinkTarget targets[kLoraMaxTargets];
  int num_targets = 0;               // 1..kLoraMaxTargets
  LoraSegmentsView seg;              // shared by all targets
  const __nv_bfloat16* x = nullptr;  // [rows, in]
  const int32_t* gather = nullptr;   // x row of each sorted row, nullptr = identity
  int row_capacity = 0;              // rows of every target's partial
};

enum class LoraExpandMode {
  kWrite,  // out[q, n] = bf16(delta); a rank-0 slot writes zeros
  // out[q, n] = bf16(out[q, n] + bf16(delta)): the same rounding as writing the delta and adding
  // it with add_rows (linear_cuda.cuh); a rank-0 slot leaves its rows untouched. For outputs
  // that the base GEMM wrote on the same stream: no cross-stream in-place add.
  kAdd,
};

// One target of a multi-target expand: its partials (from the multi shrink) and its output.
struct LoraExpandTarget {
  LoraPoolTarget pool;
  const float* partial = nullptr;  // [splits, row_capacity, pool.max_rank]
  // Output element (sorted row q, column n < out_features) at out[q * out_stride + n]: a delta
  // buffer [rows, out_features], or the base output's column block of this target, e.g. the
  // k columns of a fused qkv output y [T, q + 2 kv] are out = y + q, out_stride = q + 2 kv.
  __nv_bfloat16* out = nullptr;
  int64_t out_stride = 0;  // elements between rows, 0 = out_features
};

struct LoraMultiExpandArgs {
  LoraExpandTarget targets[kLoraMaxTargets];
  int num_targets = 0;             // 1..kLoraMaxTargets, same in_features (same splits)
  LoraSegmentsView seg;            // shared by all targets
  int row_capacity = 0;            // rows of every target's partial
  int splits = 0;                  // 0 = lora_shrink_splits(in_features); 1 for a dense GEMM's u
  const int32_t* u_row = nullptr;  // row of `partial` holding sorted row q's u; nullptr = q
  LoraExpandMode mode = LoraExpandMode::kWrite;
};

// Number of K splits the shrink uses for `in` input features (the expand needs it too).
int lora_shrink_splits(int in_features);
// Bytes of one target's partials: splits * row_capacity * max_rank fp32.
size_t lora_partial_bytes(int in_features, int row_capacity, int max_rank);

// Launchers: no allocation, no synchronization (graph-capturable). The single-target forms are
// the multi-target ones with one target (and kWrite into delta).
void launch_lora_shrink(const LoraShrinkArgs& args, cudaStream_t stream);
void launch_lora_expand(const LoraExpandArgs& args, cudaStream_t stream);
void launch_lora_shrink_multi(const LoraMultiShrinkArgs& args, cudaStream_t stream);
void launch_lora_expand_multi(const LoraMultiExpandArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
