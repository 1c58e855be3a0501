// The dense projections of a decode step as a weight-streaming kernel (sm_90a):
//
//   y [rows, n] = x [rows, k] . W [n, k]^T      bf16 in, fp32 accumulation, bf16 out
//
// for rows <= kLinearStreamMaxRows (the decode buckets). At these sizes a projection is a read of
// W (qkv of Qwen3-30B-A3B: 21 MB) and nothing else, so the kernel is built like the expert GEMM's
// stream kernel (ops/gemm/moe_gemm_stream_cuda.cu): 64-row weight tiles by TMA into a shared-memory
// ring, wgmma with the weights as the M side and the tokens as N, and the first ring fill's weight
// copies issued before griddepcontrol.wait, so that with programmatic dependent launch the weights
// stream while the kernel before it (the residual RMSNorm, which lets its dependents start at once)
// still runs. linear_stream_cuda.cu has the design and what it measured.
//
// The work is split stream-K: the (64-row tile, 64-wide k block) units, tile-major, are cut into
// gridDim.x equal ranges, so every CTA streams the same number of bytes whatever n and k are. A
// tile that lies inside one CTA's range is stored directly; a tile cut by range boundaries leaves
// an fp32 partial per CTA in the workspace, and the CTA whose ticket completes the tile sums them
// in CTA order (the same bits on every launch, whichever CTA finishes last) and stores the tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moelora::ops::cuda {

constexpr int kLinearStreamMaxRows = 64;  // tokens per launch (the widest wgmma N instantiated)
constexpr int kLinearStreamBlockK =
    64;  // k must be a multiple of this (one 128-byte row per stage)

// The split-K scratch: partial tiles and the per-tile tickets. One workspace serves every
// projection of a forward (launches on one stream never overlap in their use of it).
struct LinearStreamWorkspace {
  float* partials = nullptr;   // linear_stream_partial_floats(num_sms) floats
  int32_t* tickets = nullptr;  // linear_stream_tickets(max n) ints, zero before the first launch
  int max_tiles = 0;           // tickets available (tiles of the widest projection)
};

struct LinearStreamArgs {
  const __nv_bfloat16* x = nullptr;  // [rows, k], rows ldx elements apart (16-byte aligned)
  int64_t ldx = 0;                   // 0 = k
  const __nv_bfloat16* w = nullptr;  // [n, k] contiguous (16-byte aligned)
  __nv_bfloat16* y = nullptr;        // [rows, n], rows ldy elements apart
  int64_t ldy = 0;                   // 0 = n
  int rows = 0;                      // 1 .. kLinearStreamMaxRows
  int n = 0, k = 0;
  LinearStreamWorkspace ws;
};

// Workspace sizes for a device of num_sms SMs / projections of at most max_n output rows.
size_t linear_stream_partial_floats(int num_sms);
int linear_stream_tickets(int max_n);

// Whether the kernel takes the shape (the device is checked at launch): 1 <= rows <= 64,
// k a positive multiple of 64, n >= 1.
bool linear_stream_supports(int rows, int n, int k);

// Enqueues the projection (no allocation, no synchronization; capturable into graphs). With `pdl`
// the launch is programmatic: the weight copies of the first ring fill go out before the previous
// kernel in the stream has finished, x is read after it. Errors (kInvalidArgument naming the
// field, kUnsupported on a device without wgmma / TMA) are raised before anything is enqueued.
void launch_linear_stream(const LinearStreamArgs& args, int num_sms, bool pdl, cudaStream_t stream);

}  // namespace moelora::ops::cuda
