// Segmented LoRA shrink / expand on the tensor cores (lora_mma_cuda.cuh has the math and the
// contracts).
//
// Both kernels: 128 threads, CTA x = one 64-row tile of one segment (found by a block-wide
// prefix sum over the segment lengths), mma.sync m16n8k16 bf16 with fp32 accumulators, operands
// fetched from padded shared rows with ldmatrix (row stride = width + 8 bf16, so the 8 rows of
// every 8x8 matrix start on distinct 4-bank groups).
//
// Shrink (M = rows, N = ranks, K = in): CTA y = a chunk of kRankTile ranks (16, 32 or 64);
// warp w owns rows 16w..16w+15 and all of the chunk's ranks. The K loop streams 64-feature
// stages of the 64 gathered x rows and of the chunk's A rows through a 3-stage cp.async ring
// (16-byte chunks; rows past the segment, ranks past the slot's rank and features past `in`
// are zero-filled, never read). Accumulators go straight to the fp32 partial (split 0).
//
// Expand (M = rows, N = out, K = rank): the CTA first builds u = scaling * sum_splits partial
// for its 64 rows in shared memory, split into bf16 hi + lo parts (u = hi + lo to ~2^-17, so
// the product keeps the CUDA-core expand's fp32 u up to the final bf16 rounding), then walks
// 128-column tiles of the output (CTA y = first column tile, stride gridDim.y) with the B tile
// [128 n, rank] double-buffered through cp.async. Warps are 2 x 2 over the 64 x 128 tile (32
// rows x 64 columns each); the bf16 result is parked in shared memory and written with
// coalesced 16-byte stores. Shared memory holds K up to kRankPad (16 ... 256, from the pool's
// max rank); the mma loop runs over ceil(rank / 16) k16 steps of the slot's own rank only.
#include "ops/lora/lora_mma_cuda.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda_utils.h"
#include "core/mma_ptx.cuh"
#include "core/error.h"

namespace moelora::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;  // 4 warps in both kernels
constexpr int kTileRows = kLoraMmaTileRows;
constexpr int kSmemPad = 8;        // bf16 elements of padding per shared row
constexpr int kScanPerThread = 4;  // segments a thread reads per pass of the tile search
constexpr int kMaxRank = 256;
// shrink
constexpr int kShrinkK = 64;  // input features per pipeline stage
constexpr int kShrinkStages = 3;
constexpr int kShrinkStride = kShrinkK + kSmemPad;  // shared row of x / A (elements)
// expand
constexpr int kExpandCols = 128;                    // output columns per tile
constexpr int kOutStride = kExpandCols + kSmemPad;  // shared row of the output tile
constexpr int kChunksPerOutRow = kExpandCols / 8;   // 16-byte chunks per output tile row

static_assert(kThreads == 128 && kTileRows == 64, "warp layouts below assume 4 warps, 64 rows");

// PTX wrappers: src/core/mma_ptx.cuh.
using namespace ::moelora::cuda::ptx;

// Fragment addressing (lane l), for a 16x16 tile at (row0, k0) of a row-major shared matrix:
//   A operand (rows = M, columns = K): matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
//     (8-15, 8-15) = a0..a3 of m16n8k16: lane l points at row l % 16, column 8 (l / 16).
//   B operand stored as [N][K] (both LoRA factors are K-contiguous): matrices (n 0-7, k 0-7),
//     (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) = {b0, b1} of n-tile 0 and {b0, b1} of n-tile 1:
//     lane l points at row (l % 8) + 8 (l / 16), column 8 ((l / 8) % 2).
__device__ __forceinline__ int a_frag_row(int lane) {
  return lane % 16;
}
__device__ __forceinline__ int a_frag_col(int lane) {
  return (lane / 16) * 8;
}
__device__ __forceinline__ int b_frag_row(int lane) {
  return lane % 8 + (lane / 16) * 8;
}
__device__ __forceinline__ int b_frag_col(int lane) {
  return ((lane / 8) % 2) * 8;
}

// ---- tile search ---------------------------------------------------------------------------

// Tile `tile` of the row-major enumeration of (segment, 64-row tile) pairs: segment i owns the
// tiles [first_i, first_i + ceil(len_i / 64)), first_i = the tiles of segments 0 .. i-1. A
// block-wide prefix sum over the lengths, kThreads * kScanPerThread segments per pass (one pass
// for a single adapter's E <= 512 expert segments). Every thread of the CTA must call it (it
// synchronizes); all get the same answer. False when `tile` is past the last tile.
__device__ bool find_segment_tile(const int4* __restrict__ segments, int num_segments, int tile,
                                  int4& seg, int& row_begin) {
  __shared__ int warp_sums[kThreads / 32];
  __shared__ int found_segment, found_first;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) found_segment = -1;
  __syncthreads();
  int base = 0;  // tiles of the segments of earlier passes
  for (int pass0 = 0; pass0 < num_segments; pass0 += kThreads * kScanPerThread) {
    const int i0 = pass0 + threadIdx.x * kScanPerThread;  // this thread's first segment
    int tiles[kScanPerThread];
    int sum = 0;
#pragma unroll
    for (int j = 0; j < kScanPerThread; ++j) {
      tiles[j] = 0;
      if (i0 + j < num_segments) {
        const int4 s = segments[i0 + j];  // {slot, expert, begin, end}
        tiles[j] = s.w > s.z ? (s.w - s.z + kTileRows - 1) / kTileRows : 0;
      }
      sum += tiles[j];
    }
    int inclusive = sum;  // warp-inclusive prefix of the per-thread sums
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += v;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    int first = base, pass_total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      if (w < warp) first += warp_sums[w];
      pass_total += warp_sums[w];
    }
    first += inclusive - sum;                   // first tile of segment i0
    if (tile >= first && tile < first + sum) {  // exactly one thread of the CTA
      bool done = false;
#pragma unroll
      for (int j = 0; j < kScanPerThread; ++j) {
        if (!done && tile < first + tiles[j]) {
          found_segment = i0 + j;
          found_first = first;
          done = true;
        }
        first += tiles[j];
      }
    }
    __syncthreads();  // found_* visible; every thread is done reading warp_sums
    if (found_segment >= 0) break;
    base += pass_total;
  }
  const int s = found_segment;
  if (s < 0) return false;
  seg = segments[s];
  row_begin = seg.z + (tile - found_first) * kTileRows;
  return true;
}

// ---- shrink --------------------------------------------------------------------------------

template <int kRankTile>
constexpr int shrink_smem_bytes() {
  return kShrinkStages * (kTileRows + kRankTile) * kShrinkStride * 2;
}

// grid (tile capacity, ceil(R / kRankTile)), kThreads threads, shrink_smem_bytes<kRankTile>().
template <int kRankTile>  // 16, 32 or 64 ranks per CTA
__global__ void __launch_bounds__(kThreads) lora_shrink_mma_kernel(const LoraShrinkArgs p) {
  static_assert(kRankTile % 16 == 0 && kRankTile <= 64, "rank tile of whole n16 pairs");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sx = reinterpret_cast<bf16*>(smem);                   // [stages][64][kShrinkStride]
  bf16* sa = sx + kShrinkStages * kTileRows * kShrinkStride;  // [stages][kRankTile][...]

  const int num_segments = min(*p.seg.num_segments, p.seg.max_segments);
  int4 seg;
  int row0;
  if (!find_segment_tile(p.seg.segments, num_segments, blockIdx.x, seg, row0)) return;
  const int slot = seg.x, expert = seg.y;
  const LoraPoolTarget& pool = p.pool;
  const int R = pool.max_rank, K = pool.in_features;
  const int rank = min(pool.rank[slot], R);
  const int r0 = blockIdx.y * kRankTile;        // first rank of this CTA
  if (r0 >= rank) return;                       // rank 0: the expand writes zeros without partials
  const int ranks = min(kRankTile, rank - r0);  // valid A rows of this CTA
  const int rows = min(kTileRows, seg.w - row0);  // valid x rows of this tile
  const int ea = (pool.ea == 1 || (pool.a_shared && pool.a_shared[slot])) ? 0 : expert;
  // A[slot, ea, r0 .. r0 + ranks, :]  (rows of `in` features)
  const bf16* a_rows =
      pool.a + (static_cast<size_t>(slot) * pool.ea + ea) * R * K + static_cast<size_t>(r0) * K;

  // Copy assignment: a stage row is 8 chunks of 16 bytes; thread t copies chunk t % 8 of rows
  // t / 8 + 16 j. Its source rows are fixed for the whole K loop (nullptr = zero-fill).
  const int chunk_col = (threadIdx.x % 8) * 8;
  const int row_in_pass = threadIdx.x / 8;
  const bf16* x_src[kTileRows / 16];
#pragma unroll
  for (int j = 0; j < kTileRows / 16; ++j) {
    const int i = row_in_pass + 16 * j;
    x_src[j] = nullptr;
    if (i < rows) {
      const int q = row0 + i;
      const int x_row = p.gather ? p.gather[q] : q;
      x_src[j] = p.x + static_cast<size_t>(x_row) * K + chunk_col;
    }
  }
  const bf16* a_src[kRankTile / 16];
#pragma unroll
  for (int j = 0; j < kRankTile / 16; ++j) {
    const int i = row_in_pass + 16 * j;
    a_src[j] = i < ranks ? a_rows + static_cast<size_t>(i) * K + chunk_col : nullptr;
  }
  // K % 8 == 0, so a 16-byte chunk lies either wholly inside `in` or wholly past it.
  auto load_stage = [&](int stage, int k_tile) {
    const int k = k_tile * kShrinkK;
    const bool in_k = k + chunk_col < K;
    bf16* xs = sx + stage * kTileRows * kShrinkStride;
    bf16* as = sa + stage * kRankTile * kShrinkStride;
#pragma unroll
    for (int j = 0; j < kTileRows / 16; ++j) {
      const bool ok = in_k && x_src[j] != nullptr;
      cp_async_16(smem_addr(xs + (row_in_pass + 16 * j) * kShrinkStride + chunk_col),
                  ok ? x_src[j] + k : p.x, ok ? 16 : 0);
    }
#pragma unroll
    for (int j = 0; j < kRankTile / 16; ++j) {
      const bool ok = in_k && a_src[j] != nullptr;
      cp_async_16(smem_addr(as + (row_in_pass + 16 * j) * kShrinkStride + chunk_col),
                  ok ? a_src[j] + k : pool.a, ok ? 16 : 0);
    }
  };

  const int k_tiles = (K + kShrinkK - 1) / kShrinkK;
#pragma unroll
  for (int s = 0; s < kShrinkStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();  // one group per stage, empty or not: the wait count stays uniform
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool warp_has_rows = warp * 16 < rows;
  float acc[kRankTile / 8][4];
#pragma unroll
  for (int nt = 0; nt < kRankTile / 8; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kShrinkStages - 2>();  // stage kt has landed (this thread's copies)
    __syncthreads();                     // ... everyone's; stage kt - 1 is free again
    const int next = kt + kShrinkStages - 1;
    if (next < k_tiles) load_stage(next % kShrinkStages, next);
    cp_async_commit();
    if (!warp_has_rows) continue;
    const int stage = kt % kShrinkStages;
    const bf16* xs = sx + stage * kTileRows * kShrinkStride;
    const bf16* as = sa + stage * kRankTile * kShrinkStride;
#pragma unroll
    for (int kk = 0; kk < kShrinkK; kk += 16) {
      uint32_t a[4];
      ldmatrix_x4(a, smem_addr(xs + (warp * 16 + a_frag_row(lane)) * kShrinkStride + kk +
                               a_frag_col(lane)));
#pragma unroll
      for (int np = 0; np < kRankTile / 16; ++np) {
        if (np * 16 >= ranks) break;  // n16 pairs past the rank are all zero
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(as + (np * 16 + b_frag_row(lane)) * kShrinkStride + kk +
                                 b_frag_col(lane)));
        mma_bf16_16816(acc[2 * np], a, b[0], b[1]);
        mma_bf16_16816(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }

  // Accumulator element (row g [+ 8], columns 2 t4, 2 t4 + 1) of n-tile nt -> partial[0, q, r].
  if (!warp_has_rows) return;
  const int g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kRankTile / 8; ++nt) {
    const int r = r0 + nt * 8 + 2 * t4;
    if (r >= rank) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = warp * 16 + g + 8 * h;
      if (i >= rows) continue;
      float* dst = p.partial + static_cast<size_t>(row0 + i) * R + r;
      if (r + 1 < rank) {
        *reinterpret_cast<float2*>(dst) = make_float2(acc[nt][2 * h], acc[nt][2 * h + 1]);
      } else {
        dst[0] = acc[nt][2 * h];
      }
    }
  }
}

// ---- expand --------------------------------------------------------------------------------

template <int kRankPad>
struct ExpandSmem {
  static constexpr int kUStride = kRankPad + kSmemPad;      // shared row of u and of B
  static constexpr int kUElems = kTileRows * kUStride;      // u_hi or u_lo [64][kUStride]
  static constexpr int kBElems = kExpandCols * kUStride;    // one B stage [128][kUStride]
  static constexpr int kOutElems = kTileRows * kOutStride;  // output tile [64][kOutStride]
  static constexpr int kBytes = (2 * kUElems + 2 * kBElems + kOutElems) * 2;
};

// grid (tile capacity, column groups), kThreads threads, ExpandSmem<kRankPad>::kBytes.
template <int kRankPad>  // 16, 32, 64, 128 or 256 >= the pool's max rank
__global__ void __launch_bounds__(kThreads)
    lora_expand_mma_kernel(const LoraExpandArgs p, int splits) {
  using Smem = ExpandSmem<kRankPad>;
  constexpr int kUStride = Smem::kUStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* su_hi = reinterpret_cast<bf16*>(smem);  // [64][kUStride]
  bf16* su_lo = su_hi + Smem::kUElems;          // [64][kUStride]
  bf16* sb = su_lo + Smem::kUElems;             // [2][128][kUStride]
  bf16* so = sb + 2 * Smem::kBElems;            // [64][kOutStride]

  const int num_segments = min(*p.seg.num_segments, p.seg.max_segments);
  int4 seg;
  int row0;
  if (!find_segment_tile(p.seg.segments, num_segments, blockIdx.x, seg, row0)) return;
  const int slot = seg.x, expert = seg.y;
  const LoraPoolTarget& pool = p.pool;
  const int R = pool.max_rank, N = pool.out_features;
  const int rank = min(pool.rank[slot], R);
  const int rows = min(kTileRows, seg.w - row0);
  const int col_tiles = (N + kExpandCols - 1) / kExpandCols;
  bf16* delta_tile = p.delta + static_cast<size_t>(row0) * N;  // [rows, N]

  if (rank == 0) {  // zero deltas: consumers read the delta of every row whose slot is >= 0
    for (int ct = blockIdx.y; ct < col_tiles; ct += gridDim.y) {
      for (int idx = threadIdx.x; idx < kTileRows * kChunksPerOutRow; idx += kThreads) {
        const int i = idx / kChunksPerOutRow, n = ct * kExpandCols + (idx % kChunksPerOutRow) * 8;
        if (i < rows && n < N)
          *reinterpret_cast<uint4*>(delta_tile + static_cast<size_t>(i) * N + n) =
              make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }
  const int k_steps = (rank + 15) / 16;
  const int k_pad = k_steps * 16;  // u / B columns the mma reads; [rank, k_pad) hold zeros
  const int eb = (pool.eb == 1 || (pool.b_shared && pool.b_shared[slot])) ? 0 : expert;
  const bf16* b_base = pool.b + (static_cast<size_t>(slot) * pool.eb + eb) * N * R;  // [N, R]

  // B[n, 0 .. k_pad) of the 128 rows n of column tile ct into B stage `stage`: 16-byte cp.async
  // chunks; rows past N and chunks past the rank are zeros; a chunk that straddles the rank
  // (rank % 8 != 0) is loaded and masked by hand (in bounds: c + 8 <= R as R % 8 == 0).
  auto load_b = [&](int stage, int ct) {
    bf16* stage_base = sb + stage * Smem::kBElems;
    const int chunks_per_row = k_pad / 8;
    for (int idx = threadIdx.x; idx < kExpandCols * chunks_per_row; idx += kThreads) {
      const int n = idx / chunks_per_row, c = (idx % chunks_per_row) * 8;
      const int n_global = ct * kExpandCols + n;
      bf16* dst = stage_base + n * kUStride + c;
      const int valid = n_global < N ? min(8, rank - c) : 0;
      if (valid == 8) {
        cp_async_16(smem_addr(dst), b_base + static_cast<size_t>(n_global) * R + c, 16);
      } else if (valid <= 0) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      } else {
        const uint4 v =
            *reinterpret_cast<const uint4*>(b_base + static_cast<size_t>(n_global) * R + c);
        // word w holds elements 2w (low half) and 2w + 1 (high half)
        auto mask = [valid](uint32_t word, int w) {
          return 2 * w + 1 < valid ? word : (2 * w < valid ? (word & 0xffffu) : 0u);
        };
        *reinterpret_cast<uint4*>(dst) =
            make_uint4(mask(v.x, 0), mask(v.y, 1), mask(v.z, 2), mask(v.w, 3));
      }
    }
  };

  int stage = 0;
  load_b(0, blockIdx.y);  // gridDim.y <= col_tiles: every CTA has a first column tile
  cp_async_commit();

  // u[i, r] = scaling * sum_split partial[split, u_row(q), r] as hi + lo bf16, zero past the
  // tile's rows and the slot's rank (overlaps the first B tile's copies).
  const float scaling = pool.scaling[slot];
  for (int idx = threadIdx.x; idx < kTileRows * k_pad; idx += kThreads) {
    const int i = idx / k_pad, r = idx % k_pad;
    float v = 0.f;
    if (i < rows && r < rank) {
      const int q = row0 + i;
      const size_t u_row = p.u_row ? p.u_row[q] : q;
      for (int sp = 0; sp < splits; ++sp)
        v += p.partial[(static_cast<size_t>(sp) * p.row_capacity + u_row) * R + r];
      v *= scaling;
    }
    const bf16 hi = __float2bfloat16(v);
    su_hi[i * kUStride + r] = hi;
    su_lo[i * kUStride + r] = __float2bfloat16(v - __bfloat162float(hi));  // v - hi is exact
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / 2, warp_n = warp % 2;  // rows 32 warp_m.., columns 64 warp_n..
  const bool warp_has_rows = warp_m * 32 < rows;
  const int g = lane / 4, t4 = lane % 4;
  for (int ct = blockIdx.y; ct < col_tiles; ct += gridDim.y) {
    const int next = ct + gridDim.y;
    if (next < col_tiles) load_b(stage ^ 1, next);  // its last reader finished before the
    cp_async_commit();                              // previous tile's store barrier
    cp_async_wait<1>();                             // this tile's B has landed
    __syncthreads();                                // ... for every thread; u is visible
    if (warp_has_rows) {
      const bf16* bs = sb + stage * Smem::kBElems;
      float acc[2][8][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
      for (int ks = 0; ks < k_steps; ++ks) {
        const int kk = ks * 16;
#pragma unroll
        for (int part = 0; part < 2; ++part) {  // u_hi, then u_lo (fewer live fragments)
          const bf16* su = part == 0 ? su_hi : su_lo;
          uint32_t a[2][4];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
            ldmatrix_x4(a[mt],
                        smem_addr(su + (warp_m * 32 + mt * 16 + a_frag_row(lane)) * kUStride + kk +
                                  a_frag_col(lane)));
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, smem_addr(bs + (warp_n * 64 + np * 16 + b_frag_row(lane)) * kUStride +
                                     kk + b_frag_col(lane)));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              mma_bf16_16816(acc[mt][2 * np], a[mt], b[0], b[1]);
              mma_bf16_16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
          }
        }
      }
      // accumulator (row g [+ 8], columns 2 t4, 2 t4 + 1) -> bf16 output tile in shared memory
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int row = warp_m * 32 + mt * 16 + g, col = warp_n * 64 + nt * 8 + 2 * t4;
          *reinterpret_cast<__nv_bfloat162*>(so + row * kOutStride + col) =
              __floats2bfloat162_rn(acc[mt][nt][0], acc[mt][nt][1]);
          *reinterpret_cast<__nv_bfloat162*>(so + (row + 8) * kOutStride + col) =
              __floats2bfloat162_rn(acc[mt][nt][2], acc[mt][nt][3]);
        }
      }
    }
    __syncthreads();  // output tile complete; every warp is done with B stage `stage`
    for (int idx = threadIdx.x; idx < kTileRows * kChunksPerOutRow; idx += kThreads) {
      const int i = idx / kChunksPerOutRow, c = (idx % kChunksPerOutRow) * 8;
      const int n = ct * kExpandCols + c;
      if (i < rows && n < N)  // N % 8 == 0: a chunk is wholly inside or past the output
        *reinterpret_cast<uint4*>(delta_tile + static_cast<size_t>(i) * N + n) =
            *reinterpret_cast<const uint4*>(so + i * kOutStride + c);
    }
    stage ^= 1;
  }
}

// ---- launchers -----------------------------------------------------------------------------

void check_pool(const LoraPoolTarget& pool, const char* what) {
  MOELORA_CHECK(pool.a && pool.b && pool.scaling && pool.rank, ErrorCode::kInvalidArgument, what,
                ": pool pointers a, b, scaling and rank are required");
  MOELORA_CHECK(pool.max_rank > 0 && pool.max_rank % 8 == 0 && pool.max_rank <= kMaxRank,
                ErrorCode::kUnsupported, what, ": pool rank ", pool.max_rank,
                " must be a multiple of 8 in [8, ", kMaxRank, "]");
  MOELORA_CHECK(pool.in_features > 0 && pool.in_features % 8 == 0, ErrorCode::kInvalidArgument,
                what, ": in_features = ", pool.in_features, " must be a positive multiple of 8");
  MOELORA_CHECK(pool.out_features > 0 && pool.ea >= 1 && pool.eb >= 1, ErrorCode::kInvalidArgument,
                what, ": out_features = ", pool.out_features, ", Ea = ", pool.ea,
                ", Eb = ", pool.eb);
}

void check_segments(const LoraSegmentsView& seg, int max_rows, const char* what) {
  MOELORA_CHECK(seg.segments && seg.num_segments, ErrorCode::kInvalidArgument, what,
                ": segments and num_segments are required");
  MOELORA_CHECK(seg.max_segments >= 0 && max_rows >= 0, ErrorCode::kInvalidArgument, what,
                ": max_segments = ", seg.max_segments, ", max_rows = ", max_rows, " must be >= 0");
}

int num_sms() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
      sms > 0)
    return sms;
  return 132;  // H100 / H200
}

template <int kRankTile>
void launch_shrink(const LoraShrinkArgs& p, dim3 grid, cudaStream_t stream) {
  constexpr int kBytes = shrink_smem_bytes<kRankTile>();
  auto kernel = lora_shrink_mma_kernel<kRankTile>;
  MOELORA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  kernel<<<grid, kThreads, kBytes, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

template <int kRankPad>
void launch_expand(const LoraExpandArgs& p, int splits, dim3 grid, cudaStream_t stream) {
  constexpr int kBytes = ExpandSmem<kRankPad>::kBytes;
  static_assert(kBytes <= 227 * 1024, "expand tile exceeds the sm_90 shared memory per CTA");
  auto kernel = lora_expand_mma_kernel<kRankPad>;
  MOELORA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  kernel<<<grid, kThreads, kBytes, stream>>>(p, splits);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace

int lora_mma_tile_capacity(int max_rows, int max_segments) {
  if (max_rows <= 0 || max_segments <= 0) return 0;
  const int64_t nonempty = std::min<int64_t>(max_segments, max_rows);
  return static_cast<int>((static_cast<int64_t>(max_rows) + (kTileRows - 1) * nonempty) /
                          kTileRows);
}

void launch_lora_shrink_mma(const LoraShrinkArgs& p, int max_rows, cudaStream_t stream) {
  check_pool(p.pool, "lora shrink (mma)");
  check_segments(p.seg, max_rows, "lora shrink (mma)");
  MOELORA_CHECK(p.x && p.partial && p.row_capacity > 0, ErrorCode::kInvalidArgument,
                "lora shrink (mma): x and partial are required, row_capacity = ", p.row_capacity);
  const int tiles = lora_mma_tile_capacity(max_rows, p.seg.max_segments);
  if (tiles == 0) return;
  const int R = p.pool.max_rank;
  const int rank_tile = R <= 16 ? 16 : (R <= 32 ? 32 : 64);
  const dim3 grid(tiles, (R + rank_tile - 1) / rank_tile);
  switch (rank_tile) {
    case 16: launch_shrink<16>(p, grid, stream); break;
    case 32: launch_shrink<32>(p, grid, stream); break;
    default: launch_shrink<64>(p, grid, stream); break;
  }
}

void launch_lora_expand_mma(const LoraExpandArgs& p, int max_rows, cudaStream_t stream) {
  check_pool(p.pool, "lora expand (mma)");
  check_segments(p.seg, max_rows, "lora expand (mma)");
  MOELORA_CHECK(
      p.partial && p.delta && p.row_capacity > 0, ErrorCode::kInvalidArgument,
      "lora expand (mma): partial and delta are required, row_capacity = ", p.row_capacity);
  MOELORA_CHECK(p.pool.out_features % 8 == 0, ErrorCode::kUnsupported,
                "lora expand (mma): out_features = ", p.pool.out_features,
                " must be a multiple of 8");
  const int tiles = lora_mma_tile_capacity(max_rows, p.seg.max_segments);
  if (tiles == 0) return;
  const int splits = p.splits > 0 ? p.splits : lora_shrink_splits(p.pool.in_features);
  // Column groups: a CTA walks the column tiles y, y + groups, ... of its row tile. One group
  // when the row tiles alone fill the GPU (its u tile is built once for all columns); more when
  // there are few row tiles (one adapter's token segment: T / 64 tiles).
  const int col_tiles = (p.pool.out_features + kExpandCols - 1) / kExpandCols;
  const int64_t target_ctas = 2 * static_cast<int64_t>(num_sms());
  const int groups =
      tiles >= target_ctas
          ? 1
          : static_cast<int>(std::min<int64_t>(col_tiles, (target_ctas + tiles - 1) / tiles));
  const dim3 grid(tiles, groups);
  const int R = p.pool.max_rank;
  if (R <= 16) {
    launch_expand<16>(p, splits, grid, stream);
  } else if (R <= 32) {
    launch_expand<32>(p, splits, grid, stream);
  } else if (R <= 64) {
    launch_expand<64>(p, splits, grid, stream);
  } else if (R <= 128) {
    launch_expand<128>(p, splits, grid, stream);
  } else {
    launch_expand<256>(p, splits, grid, stream);
  }
}

}  // namespace moelora::ops::cuda
