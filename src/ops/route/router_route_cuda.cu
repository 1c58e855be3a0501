// The router GEMM and the routing in one launch (RouteDeviceArgs::router), for decode sizes.
//
// Grid: one CTA per (token tile of 16, expert tile of 16, column chunk of 2048), chunks fastest,
// then the optional x row-quant CTAs. A logits CTA has 16 warps; warp w multiplies the expert
// tile's 16 Wg rows by the tile's 16 x rows over columns [chunk * 2048 + 128 w, + 128), four
// steps of 32 columns with two mma.sync m16n8k16 per 8 tokens each:
//
//   lane (g = lane / 4, q = lane % 4) reads 8 consecutive bf16 of Wg rows g and g + 8 and of x
//   rows g (tokens 0-7) and g + 8 (tokens 8-15) at column 32 s + 8 q of step s; the first mma
//   takes elements 0-3 of each, the second 4-7 (a permutation of k that A and B share, so the
//   products are those of the natural order).
//
// The CTA stages its Wg slice [16][2048] with cp.async before griddepcontrol.wait (no kernel writes
// the weights: the copies stream while the previous kernel finishes) and its x slice [16][2048]
// right after it, every copy of a thread in flight at once, so it waits for one round trip of x.
// (Fragments loaded straight into registers were slower, 9.3 against 7.9 us per layer in the
// engine: ptxas interleaved the x loads with the mma and sank the weight loads below the wait.)
// The fragments come from shared memory, rows padded by 64 bytes so that a quarter warp's 16-byte
// reads of rows g and g + 1 fall in distinct banks. The 16 warps' 16 x 16 accumulators are summed
// in warp order in shared memory and written as the chunk's fp32 partial [chunk][token][expert].
// The CTA whose ticket add completes its token tile (expert tiles x chunks CTAs) sums the chunks'
// partials in chunk order (so the logits have the same bits on every launch, whichever CTA
// finishes last), keeps the tile's logits in shared memory (and writes them out if asked), resets
// the ticket and routes the 16 tokens, one warp each, as route_cuda.cu does. Qwen3 / Qwen3.5
// (H = 2048) need one chunk: the completing CTA reads each logit once.
//
// Measured (H200, bench/results/h200/router_route_design_steps.log): 7.25 us added per decode
// layer at 16 tokens, E = 128, against 9.0 for the cuBLAS GEMM + route pair; most of it is the
// serial tail (the ticket's fences, the gather, the routing chain of one warp per token).
#include <cuda_bf16.h>

#include <algorithm>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/mma_ptx.cuh"
#include "core/sm90_ptx.cuh"
#include "ops/route/route_cuda.cuh"
#include "ops/route/route_device.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kWarps = 16;
constexpr int kThreads = 32 * kWarps;
constexpr int kTileExperts = 16;
constexpr int kTileTokens = kRouterRouteTileTokens;
constexpr int kChunk = kRouterRouteChunk;
constexpr int kSteps = kChunk / kWarps / 32;  // 32-column steps per warp (one 16-byte load per lane and row)
static_assert(kSteps * 32 * kWarps == kChunk, "the warps' steps cover the chunk");
static_assert(kTileTokens == kWarps, "the ticket's CTA routes one token per warp");

constexpr size_t kReduceBytes = sizeof(float) * kWarps * kTileExperts * kTileTokens;  // 16 KB

__host__ __device__ inline int chunks_of(int hidden) {
  return (hidden + kChunk - 1) / kChunk;
}
__host__ __device__ inline int tiles_of(int n, int tile) {
  return (n + tile - 1) / tile;
}

__device__ __forceinline__ void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

// Shared memory (dynamic): the staged Wg and x slices [16][kRowElems] bf16 each while the logits
// are formed; then the warps' accumulators [kWarps][16 experts][16 tokens]; then the completed
// tile's logits [16 tokens][E] (each warp's row doubles as its noaux_tc group staging: a lane reads
// logits[e] before it writes biased[e], and no other lane touches e).
constexpr int kRowElems = kChunk + 32;  // +64 bytes
constexpr size_t kStageBytes = sizeof(__nv_bfloat16) * 2 * kTileExperts * kRowElems;  // 130 KB
static_assert(kTileExperts == kTileTokens, "the Wg and x slices are staged alike");
constexpr int kPiecesPerRow = kChunk / 8;  // 16-byte copies
constexpr int kCopiesPerThread = kTileExperts * kPiecesPerRow / kThreads;
static_assert(kCopiesPerThread * kThreads == kTileExperts * kPiecesPerRow, "whole copies per thread");

size_t dynamic_smem_bytes(int E) {
  return std::max({kStageBytes, kReduceBytes, sizeof(float) * kTileTokens * static_cast<size_t>(E)});
}

// cp.async of rows [row0, row0 + 16) x columns [col0, col0 + kChunk) of a [rows, H] bf16 matrix into
// a [16][kRowElems] stage; rows >= rows_valid and columns >= H are written as zeros.
__device__ __forceinline__ void stage_slice(__nv_bfloat16* stage, const __nv_bfloat16* src, int row0, int rows_valid,
                                            int col0, int H) {
#pragma unroll
  for (int j = 0; j < kCopiesPerThread; ++j) {
    const int piece = j * kThreads + static_cast<int>(threadIdx.x);
    const int row = piece / kPiecesPerRow, col = col0 + 8 * (piece % kPiecesPerRow);
    const bool in = row0 + row < rows_valid && col < H;  // H % 8 == 0
    const __nv_bfloat16* from = in ? src + static_cast<size_t>(row0 + row) * H + col : src;
    ::moelora::cuda::ptx::cp_async_16(::moelora::cuda::ptx::smem_addr(stage + row * kRowElems + (col - col0)), from,
                                      in ? 16 : 0);
  }
  ::moelora::cuda::ptx::cp_async_commit();
}

template <int kMaxPerLane, bool kNoauxTc>
__global__ void __launch_bounds__(kThreads) router_route_kernel(const route_internal::KernelParams p) {
  extern __shared__ __align__(16) float smem[];
  __shared__ unsigned char group_kept[kWarps][32];
  __shared__ int tile_complete;
  // The align kernel may be scheduled at once (it waits for this grid before reading).
  ::moelora::cuda::sm90::launch_dependents();
  const auto& r = p.a.router;
  const int E = p.E, H = r.hidden, T = p.a.max_tokens;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  const int chunks = chunks_of(H), expert_tiles = tiles_of(E, kTileExperts), token_tiles = tiles_of(T, kTileTokens);
  const int logit_ctas = token_tiles * expert_tiles * chunks;
  for (const auto& range : p.a.prefetch)
    ::moelora::cuda::sm90::prefetch_l2_range(range.ptr, range.bytes, blockIdx.x * blockDim.x + tid,
                                             gridDim.x * blockDim.x);
  if (static_cast<int>(blockIdx.x) >= logit_ctas) {  // the optional x row quant
    if (p.a.pdl) ::moelora::cuda::sm90::grid_dependency_wait();
    route_internal::quantize_x_group(p.a, (blockIdx.x - logit_ctas) * kWarps + warp);
    return;
  }
  const int chunk = blockIdx.x % chunks;
  const int expert_tile = (blockIdx.x / chunks) % expert_tiles;
  const int token_tile = blockIdx.x / (chunks * expert_tiles);
  const int e0 = expert_tile * kTileExperts, t0 = token_tile * kTileTokens, c0 = chunk * kChunk;
  __nv_bfloat16* w_stage = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* x_stage = w_stage + kTileExperts * kRowElems;
  stage_slice(w_stage, r.weight, e0, E, c0, H);  // before the wait: the weights are constant
  if (p.a.pdl) ::moelora::cuda::sm90::grid_dependency_wait();
  const int valid_tokens = min(T, p.a.num_tokens ? *p.a.num_tokens : T);
  stage_slice(x_stage, r.x, t0, valid_tokens, c0, H);  // padding tokens as zeros
  ::moelora::cuda::ptx::cp_async_wait<0>();
  __syncthreads();

  // Warp w: columns [128 w, + 128) of the slice in four 32-column steps. acc[nt]: experts g / g + 8
  // (c0 c1 / c2 c3) x tokens 8 nt + 2q, + 1.
  float acc[2][4] = {};
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    const int col = warp * (32 * kSteps) + 32 * st + 8 * q;
    const uint4 w_lo = *reinterpret_cast<const uint4*>(w_stage + g * kRowElems + col);
    const uint4 w_hi = *reinterpret_cast<const uint4*>(w_stage + (g + 8) * kRowElems + col);
    const uint4 x_lo = *reinterpret_cast<const uint4*>(x_stage + g * kRowElems + col);        // tokens 0-7
    const uint4 x_hi = *reinterpret_cast<const uint4*>(x_stage + (g + 8) * kRowElems + col);  // tokens 8-15
    const uint32_t a_first[4] = {w_lo.x, w_hi.x, w_lo.y, w_hi.y};  // elements 0-3 of rows g, g + 8
    const uint32_t a_second[4] = {w_lo.z, w_hi.z, w_lo.w, w_hi.w};  // elements 4-7
    ::moelora::cuda::ptx::mma_bf16_16816(acc[0], a_first, x_lo.x, x_lo.y);
    ::moelora::cuda::ptx::mma_bf16_16816(acc[0], a_second, x_lo.z, x_lo.w);
    ::moelora::cuda::ptx::mma_bf16_16816(acc[1], a_first, x_hi.x, x_hi.y);
    ::moelora::cuda::ptx::mma_bf16_16816(acc[1], a_second, x_hi.z, x_hi.w);
  }
  __syncthreads();  // the stages are reused below
  float* reduce = smem;  // [kWarps][16 experts][16 tokens]
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = g + 8 * (i / 2), t = 8 * nt + 2 * q + (i % 2);
      reduce[(warp * kTileExperts + e) * kTileTokens + t] = acc[nt][i];
    }
  __syncthreads();
  if (tid < kTileExperts * kTileTokens) {
    const int e = tid / kTileTokens, t = tid % kTileTokens;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += reduce[(w * kTileExperts + e) * kTileTokens + t];
    if (e0 + e < E && t0 + t < T) r.partials[(static_cast<size_t>(chunk) * T + t0 + t) * E + e0 + e] = sum;
  }
  // The ticket: every contributor's partial stores happen before its add (release), the last
  // contributor's reads after it (acquire).
  __syncthreads();
  if (tid == 0) {
    fence_acq_rel_gpu();
    const int done = atomicAdd(r.tickets + token_tile, 1) + 1;
    tile_complete = done == expert_tiles * chunks;
    if (tile_complete) {
      fence_acq_rel_gpu();
      r.tickets[token_tile] = 0;  // every contributor has added: ready for the next launch
    }
  }
  __syncthreads();
  if (!tile_complete) return;

  // The tile's logits, chunks summed in order: [16 tokens][E] in shared memory. Four logits per
  // thread per pass, their loads of one chunk in flight together.
  float* logits = smem;
  const int tile_logits = min(kTileTokens, T - t0) * E;
  const float* tile_partials = r.partials + static_cast<size_t>(t0) * E;  // + c T E + t E + e
  constexpr int kPerThread = 4;
  for (int base = 0; base < tile_logits; base += kThreads * kPerThread) {
    float sum[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = base + j * kThreads + tid;
      sum[j] = i < tile_logits ? __ldcg(tile_partials + i) : 0.f;
    }
    for (int c = 1; c < chunks; ++c) {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int i = base + j * kThreads + tid;
        if (i < tile_logits) sum[j] += __ldcg(tile_partials + static_cast<size_t>(c) * T * E + i);
      }
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = base + j * kThreads + tid;
      if (i >= tile_logits) continue;
      logits[i] = sum[j];
      if (r.logits) r.logits[static_cast<size_t>(t0) * E + i] = sum[j];
    }
  }
  __syncthreads();
  if (warp >= min(kTileTokens, T - t0)) return;
  float* row = logits + static_cast<size_t>(warp) * E;
  route_internal::route_token<kMaxPerLane, kNoauxTc>(p, t0 + warp, row, kNoauxTc ? row : nullptr, group_kept[warp]);
}

}  // namespace

namespace route_internal {

template <bool kNoauxTc>
void launch_router_route(const KernelParams& p, cudaStream_t stream) {
  const int T = p.a.max_tokens, H = p.a.router.hidden;
  const int logit_ctas = tiles_of(T, kTileTokens) * tiles_of(p.E, kTileExperts) * chunks_of(H);
  const int quant_warps = p.a.quant.q ? T * (p.a.quant.hidden / 128) : 0;
  const dim3 grid(logit_ctas + tiles_of(quant_warps, kWarps)), block(kThreads);
  const size_t smem = dynamic_smem_bytes(p.E);
  auto launch = [&](auto kernel) {
    if (smem > 48 * 1024)
      MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
    ::moelora::cuda::launch_kernel(kernel, grid, block, smem, stream, p.a.pdl, p);
  };
  if (p.E <= 64) {
    launch(router_route_kernel<2, kNoauxTc>);
  } else if (p.E <= 128) {
    launch(router_route_kernel<4, kNoauxTc>);
  } else if (p.E <= 256) {
    launch(router_route_kernel<8, kNoauxTc>);
  } else if (p.E <= 512) {
    launch(router_route_kernel<16, kNoauxTc>);
  } else {
    launch(router_route_kernel<32, kNoauxTc>);
  }
}
template void launch_router_route<false>(const KernelParams&, cudaStream_t);
template void launch_router_route<true>(const KernelParams&, cudaStream_t);

}  // namespace route_internal

size_t router_route_partial_floats(int num_experts, int hidden, int max_tokens) {
  return static_cast<size_t>(chunks_of(hidden)) * std::max(max_tokens, 0) * std::max(num_experts, 0);
}

int router_route_tickets(int max_tokens) {
  return tiles_of(std::max(max_tokens, 1), kTileTokens);
}

bool router_route_supports(const RouteParams& params, int hidden, int max_tokens) {
  return max_tokens >= 0 && max_tokens <= kRouterRouteMaxTokens && hidden > 0 && hidden % 8 == 0 &&
         params.num_experts >= 1 && params.num_experts <= route_internal::kMaxExperts && params.top_k <= 32;
}

}  // namespace moelora::ops::cuda
