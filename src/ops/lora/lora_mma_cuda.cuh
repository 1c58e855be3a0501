// Tensor-core (mma.sync m16n8k16, bf16 in, fp32 accumulate) segmented LoRA shrink and expand
// for prefill-sized segments: the same math, argument structs and buffer layouts as the
// CUDA-core kernels of lora_cuda.cuh, so either expand can follow either shrink.
//
// The CUDA-core kernels are built for decode (a few rows per segment: every A / B element is
// read once per segment and the rows stream past it in registers). In a prefill a segment holds
// hundreds to thousands of rows, and their per-row FMA work dominates; here a CTA takes a tile
// of 64 consecutive rows of one segment and runs it through the tensor cores:
//
//   shrink:  partial[0, q, r] = sum_k x[row(q), k] * A[slot, ea, r, k]        r < rank[slot]
//            (split 0 only: an expand that follows must be given splits = 1)
//   expand:  delta[q, n] = bf16(scaling[slot] * sum_r u[q, r] * B[slot, eb, n, r])
//            u[q, r] = sum over `splits` of partial[split, u_row(q), r] (splits = 0: the
//            CUDA-core shrink's lora_shrink_splits(in), i.e. it can follow launch_lora_shrink)
//
// with row(q) = gather ? gather[q] : q, u_row(q) = u_row ? u_row[q] : q and ea / eb as in
// lora_cuda.cuh. Contracts kept from lora_cuda.cuh: rows outside every segment are never touched
// (neither partial nor delta); the shrink writes partial columns r < rank only; a slot of rank 0
// makes the shrink write nothing and the expand write zero deltas for its rows.
//
// Grids are sized by capacity (graph-capturable): the caller bounds the rows that all segments
// hold together (max_rows, e.g. T * top_k for MoE pair segments, T for token segments); CTA x
// is tile x of the row-major enumeration of (segment, 64-row tile) pairs, found on the device by
// a prefix sum over the segment lengths; CTAs past the last tile exit. Launchers neither
// allocate nor synchronize; LoraSegmentsView::row_chunks is not used.
#pragma once

#include <cuda_runtime.h>

#include "ops/lora/lora_cuda.cuh"

namespace moelora::ops::cuda {

// Rows of one CTA tile in both kernels.
constexpr int kLoraMmaTileRows = 64;

// Token count of a forward from which the layers switch their LoRA to the mma kernels. Below,
// the decode-tuned CUDA-core kernels win or tie: a (slot, expert) segment of a Qwen3.5 layer
// (E 256, top-k 8) holds about T * 8 / 256 rows, i.e. 8 rows at T = 256, and a 64-row tile
// would waste most of its work (and the CUDA graphs of the decode buckets, B <= 128, are
// captured and tuned on the CUDA-core path). From T = 256 on, the rows per segment grow
// linearly, the CUDA-core kernels' cost grows with rows x rank x features FMAs on CUDA cores,
// while the mma kernels stay bound by the bytes they move (x rows in, deltas out).
constexpr int kLoraMmaMinTokens = 256;
inline bool should_use_lora_mma(int tokens) {
  return tokens >= kLoraMmaMinTokens;
}

// Upper bound of sum_s ceil(len_s / 64) over any segments holding at most max_rows rows in all,
// at most max_segments of them: floor((max_rows + 63 * min(max_segments, max_rows)) / 64) (an
// empty segment has no tile, each non-empty one wastes less than one tile). The grid's x extent.
int lora_mma_tile_capacity(int max_rows, int max_segments);

// args as for launch_lora_shrink (args.seg.row_chunks is ignored); the partial gets split 0.
void launch_lora_shrink_mma(const LoraShrinkArgs& args, int max_rows, cudaStream_t stream);
// args as for launch_lora_expand; out_features must be a multiple of 8 (16-byte row stores).
void launch_lora_expand_mma(const LoraExpandArgs& args, int max_rows, cudaStream_t stream);

}  // namespace moelora::ops::cuda
