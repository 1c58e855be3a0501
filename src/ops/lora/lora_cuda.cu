// Segmented LoRA shrink / expand kernels (see lora_cuda.cuh for the math and the grids), two
// families: the row-chunk kernels below (row-major views: long token segments, multi-target
// launches) and the short-segment kernels further down (segment-major views: the MoE layer's
// (slot, expert) pairs).
//
// Row-chunk kernels: 256 threads per CTA, one contiguous row range [begin, end) of one segment
// (find_rows) for one target.
//
// Shrink: CTA = (row range, target x K split). The CTA stages 8 x rows of its split
// (256 * kVec columns) in shared memory per pass; warp w owns ranks r = 2w, 2w + 1, 2w + 16, ...,
// holds those two A rows' slice of the split in registers (kVec 16-byte vectors per lane) and
// dots them with the 8 staged rows, so each pass is one round of loads for x and one for A. At
// decode (one adapter, 64 rows, rank 16) every CTA does a single pass with a single rank group:
// its latency is the segment lookup plus one load round, and the rows spread over 8 CTAs per
// split instead of 2.
// Expand: CTA = (row range, 256-column tile of one target); thread = one output column n holding
// its B row (up to R values) in registers, the range's reduced u rows staged in shared memory
// 8 rows at a time. After the segment lookup the slot's rank and scaling, the B row (bounded by
// the pool's R, not the slot's rank), a pass's base outputs (add mode) and its partials of every
// rank below R are one round of independent loads; ranks past the slot's are masked afterwards.
//
// No atomics: every partial and output element is written by exactly one thread in a fixed
// order, so results do not depend on the grid (eager and graph replays are bitwise equal).
#include <algorithm>
#include <climits>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/lora/lora_cuda.cuh"
#include "ops/lora/lora_row_fused.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kThreads = 256;  // both kernels
constexpr int kWarps = kThreads / 32;
constexpr int kShrinkPassRows = 8;                            // x rows staged per shrink pass
constexpr int kShrinkWarpRanks = 2;                           // ranks a shrink warp holds at once
constexpr int kShrinkGroupRanks = kWarps * kShrinkWarpRanks;  // ranks of the CTA per group: 16
constexpr int kExpandPassRows = 8;                            // u rows staged per expand pass
constexpr int kMaxRank = 256;
// Row-major grids: chunks of kMinChunkRows rows, doubled (up to kMaxChunkRows) while the grid
// would exceed kTargetCtas CTAs (about 8 per SM of an H200, a few waves at 2-3 resident CTAs per
// SM): small batches get many CTAs (latency), long prefills fewer, longer ones (A and B reuse).
constexpr int kMinChunkRows = 8;
constexpr int kMaxChunkRows = 64;
constexpr int64_t kTargetCtas = 1024;

static_assert(kShrinkPassRows * kShrinkWarpRanks <= 32, "one lane per (rank, row) result");

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fx = __bfloat1622float2(x[i]);
    const float2 fy = __bfloat1622float2(y[i]);
    s = fmaf(fx.x, fy.x, s);
    s = fmaf(fx.y, fy.y, s);
  }
  return s;
}

// Inclusive prefix sum of v over the CTA (kThreads threads, all must call it); total = sum of all.
__device__ int block_inclusive_scan(int v, int& total) {
  __shared__ int warp_sums[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += t;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int s = warp_sums[w];
    if (w < warp) before += s;
    total += s;
  }
  __syncthreads();  // warp_sums is rewritten by the next call
  return v + before;
}

// The rows [begin, end) of segment `seg` this CTA serves; begin >= end: none. All threads of the
// CTA call it (it synchronizes) and get the same answer.
struct RowRange {
  int4 seg;  // {slot, expert, begin, end}
  int begin, end;
};

// The row range of this CTA in a row-major grid (v.max_rows > 0): blockIdx.x = work item w; segment s owns chunks [first_s, first_s + ceil(len_s /
// chunk_rows)) with first_s the prefix sum of the chunk counts before it (segments in order).
__device__ RowRange find_rows(const LoraSegmentsView& v, int chunk_rows) {
  RowRange out{make_int4(0, 0, 0, 0), 0, 0};
  const int count = min(*v.num_segments, v.max_segments);
  __shared__ int found[3];  // segment, first row, last row + 1
  if (threadIdx.x == 0) found[0] = -1;
  const int work = blockIdx.x;
  int base = 0;                                   // chunks of the segments before this pass
  for (int s0 = 0; s0 < count; s0 += kThreads) {  // uniform: count and base are CTA-wide
    const int s = s0 + threadIdx.x;
    int4 seg = make_int4(0, 0, 0, 0);
    int chunks = 0;
    if (s < count) {
      seg = v.segments[s];
      chunks = (max(seg.w - seg.z, 0) + chunk_rows - 1) / chunk_rows;
    }
    int total = 0;
    const int last = base + block_inclusive_scan(chunks, total);  // one past s's chunks
    const int first = last - chunks;
    if (s < count && work >= first && work < last) {  // at most one thread of the CTA
      found[0] = s;
      found[1] = seg.z + (work - first) * chunk_rows;
      found[2] = min(seg.w, found[1] + chunk_rows);
    }
    base += total;
    if (base > work) break;
  }
  __syncthreads();
  if (found[0] < 0) return out;
  out.seg = v.segments[found[0]];
  out.begin = found[1];
  out.end = found[2];
  return out;
}

// A rows r0 .. r0 + kShrinkWarpRanks - 1 (zero at r >= rank_limit) over the lane's columns of the
// split starting at k0: k0 + (v * 32 + lane) * 8 .. + 8 for v < kVec.
template <int kVec>
__device__ __forceinline__ void load_a(uint4 (&a)[kShrinkWarpRanks][kVec],
                                       const __nv_bfloat16* a_base, int r0, int rank_limit, int K,
                                       int k0, int lane) {
#pragma unroll
  for (int h = 0; h < kShrinkWarpRanks; ++h) {
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const int r = r0 + h, col = k0 + (v * 32 + lane) * 8;
      a[h][v] = (r < rank_limit && col < K)
                    ? *reinterpret_cast<const uint4*>(a_base + static_cast<size_t>(r) * K + col)
                    : make_uint4(0, 0, 0, 0);
    }
  }
}

// grid: (row ranges, num_targets * splits); blockIdx.y = target *
// splits + split. partial[split, q, r] for this target, rows q of the range, r < rank.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    lora_shrink_kernel(const __grid_constant__ LoraMultiShrinkArgs p, int splits, int chunk_rows) {
  constexpr int kSplitCols = 256 * kVec;           // 32 lanes x 8 bf16 x kVec
  constexpr int kRowVecs = kSplitCols / 8;         // 16-byte vectors of one x row in a split
  __shared__ uint4 xs[kShrinkPassRows][kRowVecs];  // 4 KB per kVec

  const RowRange rr = find_rows(p.seg, chunk_rows);
  if (rr.begin >= rr.end) return;
  const int target = blockIdx.y / splits, split = blockIdx.y % splits;
  const LoraShrinkTarget& t = p.targets[target];
  const LoraPoolTarget& pool = t.pool;
  const int slot = rr.seg.x, expert = rr.seg.y;
  const int K = pool.in_features, R = pool.max_rank;
  const int k0 = split * kSplitCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ea = (pool.ea == 1 || (pool.a_shared && pool.a_shared[slot])) ? 0 : expert;
  const __nv_bfloat16* a_base = pool.a + (static_cast<size_t>(slot) * pool.ea + ea) * R * K;

  // The first rank group's A (bounded by the pool's R, not the slot's rank, so the loads need not
  // wait for rank[slot]; rows past the rank are computed but never stored) is in flight together
  // with the rank lookup and the first x pass.
  uint4 a_reg[kShrinkWarpRanks][kVec];
  load_a<kVec>(a_reg, a_base, warp * kShrinkWarpRanks, R, K, k0, lane);
  const int rank = min(pool.rank[slot], R);  // a slot's rank never exceeds the pool's R
  if (rank == 0) return;  // uniform; the expand writes zeros (or adds nothing) for this segment
  const bool one_group = rank <= kShrinkGroupRanks;

  for (int q0 = rr.begin; q0 < rr.end; q0 += kShrinkPassRows) {
    const int rows = min(kShrinkPassRows, rr.end - q0);
    __syncthreads();  // the previous pass finished reading xs
    for (int i = threadIdx.x; i < kShrinkPassRows * kRowVecs; i += kThreads) {
      const int j = i / kRowVecs, v = i % kRowVecs;
      const int col = k0 + v * 8;
      const int row = j < rows ? (p.gather ? p.gather[q0 + j] : q0 + j) : -1;
      xs[j][v] = (row >= 0 && col < K)
                     ? *reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(row) * K + col)
                     : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    // No barrier inside this loop, so warps may leave it at different ranks.
    for (int g0 = 0; g0 < rank; g0 += kShrinkGroupRanks) {
      const int r0 = g0 + warp * kShrinkWarpRanks;
      if (r0 >= rank) break;
      if (g0 > 0 || (q0 > rr.begin && !one_group))
        load_a<kVec>(a_reg, a_base, r0, rank, K, k0, lane);
      float s[kShrinkWarpRanks][kShrinkPassRows];
#pragma unroll
      for (int h = 0; h < kShrinkWarpRanks; ++h) {
#pragma unroll
        for (int j = 0; j < kShrinkPassRows; ++j) {
          float acc = 0.f;
#pragma unroll
          for (int v = 0; v < kVec; ++v) acc += dot8(a_reg[h][v], xs[j][v * 32 + lane]);
          s[h][j] = acc;
        }
      }
      // Butterfly: afterwards every lane holds all kShrinkWarpRanks * kShrinkPassRows sums.
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int h = 0; h < kShrinkWarpRanks; ++h) {
#pragma unroll
          for (int j = 0; j < kShrinkPassRows; ++j)
            s[h][j] += __shfl_xor_sync(0xffffffffu, s[h][j], o);
        }
      }
      // Lane h * kShrinkPassRows + j stores (rank r0 + h, row q0 + j): one store per warp.
      float mine = 0.f;
#pragma unroll
      for (int h = 0; h < kShrinkWarpRanks; ++h) {
#pragma unroll
        for (int j = 0; j < kShrinkPassRows; ++j)
          if (lane == h * kShrinkPassRows + j) mine = s[h][j];
      }
      const int h = lane / kShrinkPassRows, j = lane % kShrinkPassRows;
      if (h < kShrinkWarpRanks && r0 + h < rank && j < rows)
        t.partial[(static_cast<size_t>(split) * p.row_capacity + q0 + j) * R + r0 + h] = mine;
    }
  }
}

// Thread n's B row of (slot, expert): kRankChunks 8-value chunks, zero past the slot's rank
// (rounded up to 8) and for n >= N. The pool's rank tail is zero, so ranks that are not multiples
// of 8 read zeros there.
template <int kRankChunks>
__device__ __forceinline__ void load_b_row(const LoraPoolTarget& pool, int slot, int expert, int n,
                                           int rank, uint4 (&b_reg)[kRankChunks]) {
  const int eb = (pool.eb == 1 || (pool.b_shared && pool.b_shared[slot])) ? 0 : expert;
  lora_load_b_chunks<kRankChunks>(pool, slot, eb, n, (rank + 7) / 8, /*active=*/true, b_reg);
}

// Column tiles of the targets of one expand launch: target t owns blockIdx.y in
// [tile_begin[t], tile_begin[t + 1]).
struct ExpandTiles {
  int tile_begin[kLoraMaxTargets + 1];
};

// grid: (row ranges, sum of the targets' 256-column tiles).
template <int kRankChunks>  // B row held as kRankChunks 8-value chunks (R <= 8 * kRankChunks)
__global__ void __launch_bounds__(kThreads)
    lora_expand_kernel(const __grid_constant__ LoraMultiExpandArgs p, int splits, int chunk_rows,
                       ExpandTiles tiles) {
  constexpr int kUStride = 8 * kRankChunks;
  __shared__ __align__(16) float u[kExpandPassRows][kUStride];

  const RowRange rr = find_rows(p.seg, chunk_rows);
  if (rr.begin >= rr.end) return;
  int target = 0;
  while (target + 1 < p.num_targets && static_cast<int>(blockIdx.y) >= tiles.tile_begin[target + 1])
    ++target;
  const LoraExpandTarget& t = p.targets[target];
  const LoraPoolTarget& pool = t.pool;
  const bool add = p.mode == LoraExpandMode::kAdd;
  const int slot = rr.seg.x, expert = rr.seg.y;
  const int R = pool.max_rank, N = pool.out_features;
  const int64_t stride = t.out_stride;  // resolved by the launcher
  const int n = (static_cast<int>(blockIdx.y) - tiles.tile_begin[target]) * kThreads + threadIdx.x;
  // Pools of R <= 16 (the 2-chunk instance): one round of independent loads after the segment
  // lookup, the slot's rank and scaling, its B row bounded by the pool's R rather than the slot's
  // rank (so the loads need not wait for it; chunks past the rank are loaded but never used), and
  // per pass the base outputs and the partials of every rank below R (masked past the slot's rank
  // once it is known). Larger pools bound B and the partials by the slot's rank, as a pool of R =
  // 64 serving rank-16 adapters would otherwise read 4x the bytes. The products and sums are the
  // same either way, in the same order.
  const int rank = min(pool.rank[slot], R);  // a slot's rank never exceeds the pool's R
  const float scaling = pool.scaling[slot];
  const int load_rank = kRankChunks <= 2 ? R : rank;
  uint4 b_reg[kRankChunks];
  load_b_row<kRankChunks>(pool, slot, expert, n, load_rank, b_reg);
  const int width = min(8 * kRankChunks, (R + 7) / 8 * 8);  // u columns staged per row
  constexpr int kEntries = (kExpandPassRows * 8 * kRankChunks + kThreads - 1) / kThreads;

  for (int q0 = rr.begin; q0 < rr.end; q0 += kExpandPassRows) {
    const int rows = min(kExpandPassRows, rr.end - q0);
    float base[kExpandPassRows];  // add mode: out[q0 + i, n] before the add
#pragma unroll
    for (int i = 0; i < kExpandPassRows; ++i)
      base[i] = (add && i < rows && n < N)
                    ? __bfloat162float(t.out[static_cast<int64_t>(q0 + i) * stride + n])
                    : 0.f;
    // sums[e]: entry i = threadIdx.x + e * kThreads of the pass's (row, r) partial sums
    float sums[kEntries];
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      const int i = threadIdx.x + e * kThreads;
      const int row = i / width, r = i % width;
      float s = 0.f;
      if (i < rows * width && r < load_rank) {
        const size_t uq = p.u_row ? p.u_row[q0 + row] : q0 + row;
#pragma unroll 4
        for (int sp = 0; sp < splits; ++sp)
          s += t.partial[(static_cast<size_t>(sp) * p.row_capacity + uq) * R + r];
      }
      sums[e] = s;
    }
    if (rank == 0 && add) return;  // uniform: a zero delta leaves the output as it is
    __syncthreads();               // the previous pass finished reading u
    // u[i][r] = scaling * sum over splits of the partials (zero past the slot's rank)
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      const int i = threadIdx.x + e * kThreads;
      if (i < rows * width) u[i / width][i % width] = i % width < rank ? sums[e] * scaling : 0.f;
    }
    __syncthreads();
    const int rank_chunks = (rank + 7) / 8;
    if (n < N) {
#pragma unroll
      for (int i = 0; i < kExpandPassRows; ++i) {
        if (i >= rows) break;
        // acc = sum_r u[i][r] * B[n, r]; u reads are CTA-wide broadcasts
        const float4* u4 = reinterpret_cast<const float4*>(u[i]);
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < kRankChunks; ++c) {
          if (c >= rank_chunks) break;
          const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b_reg[c]);
          const float4 lo = u4[2 * c], hi = u4[2 * c + 1];
          const float2 b01 = __bfloat1622float2(b2[0]), b23 = __bfloat1622float2(b2[1]);
          const float2 b45 = __bfloat1622float2(b2[2]), b67 = __bfloat1622float2(b2[3]);
          acc = fmaf(lo.x, b01.x, acc);
          acc = fmaf(lo.y, b01.y, acc);
          acc = fmaf(lo.z, b23.x, acc);
          acc = fmaf(lo.w, b23.y, acc);
          acc = fmaf(hi.x, b45.x, acc);
          acc = fmaf(hi.y, b45.y, acc);
          acc = fmaf(hi.z, b67.x, acc);
          acc = fmaf(hi.w, b67.y, acc);
        }
        const __nv_bfloat16 delta = __float2bfloat16(acc);
        t.out[static_cast<int64_t>(q0 + i) * stride + n] =
            add ? __float2bfloat16(base[i] + __bfloat162float(delta)) : delta;
      }
    }
  }
}

// ---- segment-major kernels for many short segments (the MoE layer's (slot, expert) pairs) ----
//
// Shrink: CTA = (segment, K split), 8 warps; warp w owns ranks r = w, w + 8, ...; it keeps its A
// rows' slice of the split in registers and streams the segment's x rows past them, four rows in
// flight, without shared memory or barriers. Expand: CTA = (segment, 256-column tile); thread =
// one output column holding its B row in registers, the segment's reduced u rows staged in shared
// memory 32 at a time. Measured on the H200: a decode MoE layer (segments of 1-10 pair rows)
// keeps 3-6 % more of its no-LoRA throughput with these than with the row-chunk kernels above,
// which stage 8 rows per pass and win on the long token segments of the dense projections.
//
// The segment shrink: 4 warps, each holding 4 rank rows of A at once (the CTA's 16 rank rows of a
// split in flight together: 8 KB per kVec), so that two CTAs fit beside the stream GEMM's two on
// an SM (<= 102 registers) and keep 16 KB of A loads in flight per SM. With 8 warps of 2 rank rows
// (one CTA beside the GEMM, two dependent A round trips per unit) the routed seam-1 shrink read its
// ~13 MB at ~150 GB/s beside GEMM1 and ended after it (docs/gpu_moe.md §6.0i, §6.0j).
constexpr int kSegShrinkWarps = 4;
constexpr int kSegShrinkWarpRanks = 4;
constexpr int kSegShrinkGroupRanks = kSegShrinkWarps * kSegShrinkWarpRanks;  // 16
constexpr int kSegExpandThreads = 256;
constexpr int kSegExpandRows = 32;   // u rows staged per pass = rows per chunk of a segment
// Shrink rows a warp reduces at once: their loads and reductions overlap. Fewer for wider splits,
// whose x rows take kVec registers each beside the four A rows' (kVec = 2 spilled at 4 rows).
template <int kVec>
constexpr int seg_shrink_rows_in_flight() {
  return kVec == 1 ? 4 : 2;
}

// The segment-major grids are a list of work units: (segment, K split or column tile, row chunk),
// segment-major. Grid x is the units' capacity (max_segments x splits or tiles x row_chunks), or at
// most seg.max_ctas CTAs that take every gridDim.x-th unit; either way a CTA loops over the units
// of the live segments only (*num_segments of them).
struct SegmentUnit {
  int segment, part, chunk;
};
__device__ __forceinline__ SegmentUnit segment_unit(int unit, int parts, int row_chunks) {
  const int per_segment = parts * row_chunks;
  const int rem = unit % per_segment;
  return {unit / per_segment, rem / row_chunks, rem % row_chunks};
}

// One unit of the shrink: split `split` of segment `seg`'s rows in chunks chunk, chunk +
// row_chunks, ... Warp w holds rank rows g0 + h * kSegShrinkWarps + w (h < kSegShrinkWarpRanks) of
// each 16-rank group g0; lane l the columns k0 + (v * 32 + l) * 8 .. + 8 (v < kVec). Every sum is
// the lane's dot8 terms in v order, then the xor butterfly: the same bits for any grouping.
template <int kVec>
__device__ __forceinline__ void shrink_segment_unit(const LoraShrinkArgs& p, const int4 seg,
                                                    int split, int chunk, int row_chunks) {
  const int slot = seg.x, expert = seg.y;
  const LoraPoolTarget& pool = p.pool;
  const int K = pool.in_features, R = pool.max_rank;
  constexpr int kSplitCols = 256 * kVec;
  constexpr int kRows = seg_shrink_rows_in_flight<kVec>();
  static_assert(kSegShrinkWarpRanks * kRows <= 32, "one lane per (rank, row) result");
  const int k0 = split * kSplitCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ea = (pool.ea == 1 || (pool.a_shared && pool.a_shared[slot])) ? 0 : expert;
  const __nv_bfloat16* a_base = pool.a + (static_cast<size_t>(slot) * pool.ea + ea) * R * K;
  auto load_group = [&](uint4(&a)[kSegShrinkWarpRanks][kVec], int g0, int rank_limit) {
#pragma unroll
    for (int h = 0; h < kSegShrinkWarpRanks; ++h) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const int r = g0 + h * kSegShrinkWarps + warp, col = k0 + (v * 32 + lane) * 8;
        a[h][v] = (r < rank_limit && col < K)
                      ? *reinterpret_cast<const uint4*>(a_base + static_cast<size_t>(r) * K + col)
                      : make_uint4(0, 0, 0, 0);
      }
    }
  };
  // The A loads wait for the slot's rank: a slot whose adapter does not target this module (an
  // attention-only adapter, say) reads no A bytes at all.
  const int rank = min(pool.rank[slot], R);
  if (rank == 0) return;  // the expand writes zeros for this segment without reading partials

  for (int g0 = 0; g0 < rank; g0 += kSegShrinkGroupRanks) {
    uint4 a_reg[kSegShrinkWarpRanks][kVec];
    load_group(a_reg, g0, rank);
    // This unit's rows: chunks of kSegExpandRows starting at `chunk`, every row_chunks-th.
    for (int c0 = seg.z + chunk * kSegExpandRows; c0 < seg.w; c0 += row_chunks * kSegExpandRows) {
      const int c1 = min(seg.w, c0 + kSegExpandRows);
      // kRows rows per pass: their loads and warp reductions are independent, so the warp
      // overlaps their latencies instead of paying one L2 round trip per row.
      for (int q0 = c0; q0 < c1; q0 += kRows) {
        uint4 x_reg[kRows][kVec];
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int q = q0 + j;
          const int row = q < c1 ? (p.gather ? p.gather[q] : q) : -1;
#pragma unroll
          for (int v = 0; v < kVec; ++v) {
            const int col = k0 + (v * 32 + lane) * 8;
            x_reg[j][v] =
                (row >= 0 && col < K)
                    ? *reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(row) * K + col)
                    : make_uint4(0, 0, 0, 0);
          }
        }
        float s[kSegShrinkWarpRanks][kRows];
#pragma unroll
        for (int h = 0; h < kSegShrinkWarpRanks; ++h) {
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
            s[h][j] = 0.f;
#pragma unroll
            for (int v = 0; v < kVec; ++v) s[h][j] += dot8(a_reg[h][v], x_reg[j][v]);
          }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
          for (int h = 0; h < kSegShrinkWarpRanks; ++h) {
#pragma unroll
            for (int j = 0; j < kRows; ++j) s[h][j] += __shfl_xor_sync(0xffffffffu, s[h][j], o);
          }
        }
        // Lane h * kRows + j stores (rank g0 + h * kSegShrinkWarps + warp, row q0 + j).
        float mine = 0.f;
#pragma unroll
        for (int h = 0; h < kSegShrinkWarpRanks; ++h) {
#pragma unroll
          for (int j = 0; j < kRows; ++j)
            if (lane == h * kRows + j) mine = s[h][j];
        }
        const int h = lane / kRows, j = lane % kRows;
        const int r = g0 + h * kSegShrinkWarps + warp;
        if (h < kSegShrinkWarpRanks && r < rank && q0 + j < c1)
          p.partial[(static_cast<size_t>(split) * p.row_capacity + q0 + j) * R + r] = mine;
      }
    }
  }
}

template <int kVec>
__global__ void __launch_bounds__(32 * kSegShrinkWarps, kVec <= 2 ? 5 : 1)
    lora_shrink_segment_kernel(const LoraShrinkArgs p, int splits, int row_chunks) {
  // The expand after this kernel may start at once: it loads its B rows before its wait.
  ::moelora::cuda::sm90::launch_dependents();
  const int units = *p.seg.num_segments * splits * row_chunks;
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const SegmentUnit u = segment_unit(unit, splits, row_chunks);
    shrink_segment_unit<kVec>(p, p.seg.segments[u.segment], u.part, u.chunk, row_chunks);
  }
}

// Register budget of the segment kernels: they run beside the stream GEMM (two CTAs per SM of 160
// threads at 112 registers = 35,840 of the SM's 65,536), so a 256-thread CTA must stay at <= 112
// registers per thread to start while the GEMM runs; at 115 (R = 64 pools) the decode timeline
// showed every expand waiting for the GEMM's last CTAs and finishing 11-14 us after it. Three CTAs
// per SM (<= 80 registers) leaves that room for ranks up to 64; larger ranks keep the compiler's
// choice. The bounded expand spills a little (R = 64: 40 bytes of stack), which cost 3-4 us at 1-4
// tokens, where its grid is small and on the critical path: LoraExpandArgs::beside_gemm picks.
constexpr int seg_kernel_min_ctas(int rank_chunks) { return rank_chunks <= 8 ? 3 : 1; }

template <int kRankChunks, bool kBesideGemm>  // B row held as kRankChunks 8-value chunks (R <= 8 * kRankChunks)
__global__ void __launch_bounds__(kSegExpandThreads, kBesideGemm ? seg_kernel_min_ctas(kRankChunks) : 1)
    lora_expand_segment_kernel(const LoraExpandArgs p, int splits, int tiles, int row_chunks) {
  __shared__ float u[kSegExpandRows][8 * kRankChunks];
  const LoraPoolTarget& pool = p.pool;
  const int R = pool.max_rank, N = pool.out_features;
  const int units = *p.seg.num_segments * tiles * row_chunks;
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const SegmentUnit su = segment_unit(unit, tiles, row_chunks);
    const int4 seg = p.seg.segments[su.segment];
    const int slot = seg.x, expert = seg.y;
    const int rank = pool.rank[slot];
    const int n = su.part * kSegExpandThreads + threadIdx.x;
    const int rank_chunks = (rank + 7) / 8;
    const float scaling = pool.scaling[slot];
    uint4 b_reg[kRankChunks];
    load_b_row<kRankChunks>(pool, slot, expert, n, rank, b_reg);
    // Launched programmatically after the shrink: the first unit's B rows (weights) above overlap
    // its run; the partials are read only after it completed (later waits return at once).
    ::moelora::cuda::sm90::grid_dependency_wait();

    for (int q0 = seg.z + su.chunk * kSegExpandRows; q0 < seg.w;
         q0 += row_chunks * kSegExpandRows) {
      const int rows = min(kSegExpandRows, seg.w - q0);
      __syncthreads();  // previous pass finished reading u
      // u[i][r] = scaling * sum over splits of the partials (zero past the slot's rank)
      for (int i = threadIdx.x; i < rows * 8 * kRankChunks; i += kSegExpandThreads) {
        const int row = i / (8 * kRankChunks), r = i % (8 * kRankChunks);
        float s = 0.f;
        if (r < rank) {
          const size_t ur = p.u_row ? p.u_row[q0 + row] : q0 + row;
          s = lora_partial_sum(p.partial, splits, p.row_capacity, ur, r, R);
        }
        u[row][r] = s * scaling;
      }
      __syncthreads();
      if (n < N) {
        for (int i = 0; i < rows; ++i)
          p.delta[static_cast<size_t>(q0 + i) * N + n] =
              __float2bfloat16(lora_expand_dot<kRankChunks>(u[i], b_reg, rank_chunks));
      }
    }
  }
  // CTAs without work wait too, so that this grid's completion implies the shrink's.
  ::moelora::cuda::sm90::grid_dependency_wait();
}

// Grid x of a segment-major launch: the unit capacity, capped at seg.max_ctas when set.
unsigned segment_grid(const LoraSegmentsView& seg, int parts, const char* what) {
  const int64_t units = static_cast<int64_t>(seg.max_segments) * parts * std::max(1, seg.row_chunks);
  const int64_t grid = seg.max_ctas > 0 ? std::min<int64_t>(units, seg.max_ctas) : units;
  MOELORA_CHECK(grid <= INT_MAX, ErrorCode::kUnsupported, what, ": ", units,
                " work units (segments x parts x row chunks) exceed the CUDA grid limit; set "
                "max_ctas");
  return static_cast<unsigned>(grid);
}

int shrink_vec(int in_features) {
  return std::clamp((in_features + 2047) / 2048, 1, 4);
}

void check_pool(const LoraPoolTarget& pool, const char* what, int target) {
  MOELORA_CHECK(pool.a && pool.b && pool.scaling && pool.rank, ErrorCode::kInvalidArgument, what,
                " target ", target, ": pool pointers a, b, scaling and rank are required");
  MOELORA_CHECK(pool.max_rank > 0 && pool.max_rank % 8 == 0 && pool.max_rank <= kMaxRank,
                ErrorCode::kUnsupported, what, " target ", target, ": pool rank ", pool.max_rank,
                " must be a multiple of 8 in [8, ", kMaxRank, "]");
  MOELORA_CHECK(pool.in_features > 0 && pool.in_features % 8 == 0, ErrorCode::kInvalidArgument,
                what, " target ", target, ": in_features = ", pool.in_features,
                " must be a positive multiple of 8");
  MOELORA_CHECK(pool.out_features > 0 && pool.ea >= 1 && pool.eb >= 1, ErrorCode::kInvalidArgument,
                what, " target ", target, ": out_features = ", pool.out_features,
                ", Ea = ", pool.ea, ", Eb = ", pool.eb);
}

void check_segments(const LoraSegmentsView& seg, int row_capacity, const char* what) {
  MOELORA_CHECK(seg.segments && seg.num_segments, ErrorCode::kInvalidArgument, what,
                ": segments and num_segments are required");
  MOELORA_CHECK(seg.max_segments >= 0 && seg.max_rows >= 0 && seg.row_chunks >= 0,
                ErrorCode::kInvalidArgument, what, ": max_segments = ", seg.max_segments,
                ", max_rows = ", seg.max_rows, ", row_chunks = ", seg.row_chunks, " must be >= 0");
  MOELORA_CHECK(seg.max_segments == 0 || row_capacity > 0, ErrorCode::kInvalidArgument, what,
                ": row_capacity = ", row_capacity, " must be > 0");
}

// Row-major grids: the chunk length and the number of chunks (grid x) for `ctas_per_chunk` CTAs
// per chunk.
struct RowGrid {
  int chunk_rows = 0;
  int64_t work = 0;
};

RowGrid row_grid(const LoraSegmentsView& seg, int64_t ctas_per_chunk) {
  // sum_s ceil(len_s / c) <= ceil(sum_s len_s / c) + (non-empty segments) - 1, and there are at
  // most min(max_segments, max_rows) non-empty segments.
  const int64_t nonempty = std::min<int64_t>(seg.max_segments, seg.max_rows);
  auto chunks = [&](int c) { return (seg.max_rows + c - 1) / c + nonempty - 1; };
  int c = kMinChunkRows;
  while (c < kMaxChunkRows && chunks(c) * ctas_per_chunk > kTargetCtas) c *= 2;
  return {c, chunks(c)};
}

dim3 make_grid(const RowGrid& rg, int64_t grid_y, const char* what) {
  MOELORA_CHECK(rg.work <= INT_MAX && grid_y <= 65535, ErrorCode::kUnsupported, what, ": grid (",
                rg.work, ", ", grid_y, ") exceeds the CUDA limits");
  return dim3(static_cast<unsigned>(rg.work), static_cast<unsigned>(grid_y));
}

// The multi-target (row-chunk) launchers serve row-major views only.
void check_row_major(const LoraSegmentsView& seg, const char* what) {
  MOELORA_CHECK(seg.max_rows > 0 || seg.max_segments == 0, ErrorCode::kInvalidArgument, what,
                ": multi-target launches need a row-major view (max_rows > 0, the rows of all "
                "segments together), got max_rows = ",
                seg.max_rows);
}

}  // namespace

int lora_shrink_splits(int in_features) {
  const int cols = 256 * shrink_vec(in_features);
  return (in_features + cols - 1) / cols;
}

size_t lora_partial_bytes(int in_features, int row_capacity, int max_rank) {
  return static_cast<size_t>(lora_shrink_splits(in_features)) * row_capacity * max_rank *
         sizeof(float);
}

void launch_lora_shrink_multi(const LoraMultiShrinkArgs& p, cudaStream_t stream) {
  const char* what = "lora shrink";
  MOELORA_CHECK(p.num_targets >= 1 && p.num_targets <= kLoraMaxTargets, ErrorCode::kInvalidArgument,
                what, ": num_targets = ", p.num_targets, ", expected 1..", kLoraMaxTargets);
  MOELORA_CHECK(p.x, ErrorCode::kInvalidArgument, what, ": x is required");
  check_segments(p.seg, p.row_capacity, what);
  check_row_major(p.seg, what);
  const int in = p.targets[0].pool.in_features;
  for (int t = 0; t < p.num_targets; ++t) {
    check_pool(p.targets[t].pool, what, t);
    MOELORA_CHECK(p.targets[t].partial, ErrorCode::kInvalidArgument, what, " target ", t,
                  ": partial is required");
    MOELORA_CHECK(p.targets[t].pool.in_features == in, ErrorCode::kInvalidArgument, what,
                  " target ", t, ": in_features = ", p.targets[t].pool.in_features,
                  " differs from target 0's ", in, " (the targets of one launch share x)");
  }
  if (p.seg.max_segments == 0) return;
  const int splits = lora_shrink_splits(in);
  const int64_t grid_y = static_cast<int64_t>(splits) * p.num_targets;
  const RowGrid rg = row_grid(p.seg, grid_y);
  if (rg.work == 0) return;
  const dim3 grid = make_grid(rg, grid_y, what);
  switch (shrink_vec(in)) {
    case 1: lora_shrink_kernel<1><<<grid, kThreads, 0, stream>>>(p, splits, rg.chunk_rows); break;
    case 2: lora_shrink_kernel<2><<<grid, kThreads, 0, stream>>>(p, splits, rg.chunk_rows); break;
    case 3: lora_shrink_kernel<3><<<grid, kThreads, 0, stream>>>(p, splits, rg.chunk_rows); break;
    default: lora_shrink_kernel<4><<<grid, kThreads, 0, stream>>>(p, splits, rg.chunk_rows); break;
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_lora_expand_multi(const LoraMultiExpandArgs& args, cudaStream_t stream) {
  const char* what = "lora expand";
  MOELORA_CHECK(args.num_targets >= 1 && args.num_targets <= kLoraMaxTargets,
                ErrorCode::kInvalidArgument, what, ": num_targets = ", args.num_targets,
                ", expected 1..", kLoraMaxTargets);
  check_segments(args.seg, args.row_capacity, what);
  check_row_major(args.seg, what);
  LoraMultiExpandArgs p = args;
  const int in = p.targets[0].pool.in_features;
  ExpandTiles tiles{};
  int max_rank = 0;
  for (int t = 0; t < p.num_targets; ++t) {
    LoraExpandTarget& e = p.targets[t];
    check_pool(e.pool, what, t);
    MOELORA_CHECK(e.partial && e.out, ErrorCode::kInvalidArgument, what, " target ", t,
                  ": partial and out are required");
    MOELORA_CHECK(e.pool.in_features == in, ErrorCode::kInvalidArgument, what, " target ", t,
                  ": in_features = ", e.pool.in_features, " differs from target 0's ", in,
                  " (the targets of one launch share the shrink's splits)");
    if (e.out_stride == 0) e.out_stride = e.pool.out_features;
    MOELORA_CHECK(e.out_stride >= e.pool.out_features, ErrorCode::kInvalidArgument, what,
                  " target ", t, ": out_stride ", e.out_stride, " is smaller than out_features ",
                  e.pool.out_features);
    tiles.tile_begin[t + 1] = tiles.tile_begin[t] + (e.pool.out_features + kThreads - 1) / kThreads;
    max_rank = std::max(max_rank, e.pool.max_rank);
  }
  MOELORA_CHECK(p.splits >= 0, ErrorCode::kInvalidArgument, what, ": splits = ", p.splits,
                " must be >= 0");
  if (p.seg.max_segments == 0) return;
  const int splits = p.splits > 0 ? p.splits : lora_shrink_splits(in);
  const int64_t grid_y = tiles.tile_begin[p.num_targets];
  const RowGrid rg = row_grid(p.seg, grid_y);
  if (rg.work == 0) return;
  const dim3 grid = make_grid(rg, grid_y, what);
  const int chunks = max_rank / 8;
  const int c = rg.chunk_rows;
  if (chunks <= 2) {
    lora_expand_kernel<2><<<grid, kThreads, 0, stream>>>(p, splits, c, tiles);
  } else if (chunks <= 4) {
    lora_expand_kernel<4><<<grid, kThreads, 0, stream>>>(p, splits, c, tiles);
  } else if (chunks <= 8) {
    lora_expand_kernel<8><<<grid, kThreads, 0, stream>>>(p, splits, c, tiles);
  } else if (chunks <= 16) {
    lora_expand_kernel<16><<<grid, kThreads, 0, stream>>>(p, splits, c, tiles);
  } else {
    lora_expand_kernel<32><<<grid, kThreads, 0, stream>>>(p, splits, c, tiles);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_lora_shrink(const LoraShrinkArgs& args, cudaStream_t stream) {
  if (args.seg.max_rows <= 0) {  // segment-major: the short-segment kernel
    const char* what = "lora shrink";
    check_pool(args.pool, what, 0);
    MOELORA_CHECK(args.x && args.partial, ErrorCode::kInvalidArgument, what,
                  ": x and partial are required");
    check_segments(args.seg, args.row_capacity, what);
    if (args.seg.max_segments == 0) return;
    MOELORA_CHECK(args.seg.max_ctas >= 0, ErrorCode::kInvalidArgument, what, ": max_ctas = ",
                  args.seg.max_ctas, " must be >= 0");
    const int splits = lora_shrink_splits(args.pool.in_features);
    const int row_chunks = std::max(1, args.seg.row_chunks);
    const unsigned grid = segment_grid(args.seg, splits, what);
    switch (shrink_vec(args.pool.in_features)) {
      case 1: ::moelora::cuda::launch_kernel(lora_shrink_segment_kernel<1>, dim3(grid), dim3(32 * kSegShrinkWarps), 0, stream, false, args, splits, row_chunks); break;
      case 2: ::moelora::cuda::launch_kernel(lora_shrink_segment_kernel<2>, dim3(grid), dim3(32 * kSegShrinkWarps), 0, stream, false, args, splits, row_chunks); break;
      case 3: ::moelora::cuda::launch_kernel(lora_shrink_segment_kernel<3>, dim3(grid), dim3(32 * kSegShrinkWarps), 0, stream, false, args, splits, row_chunks); break;
      default: ::moelora::cuda::launch_kernel(lora_shrink_segment_kernel<4>, dim3(grid), dim3(32 * kSegShrinkWarps), 0, stream, false, args, splits, row_chunks); break;
    }
    MOELORA_CUDA_CHECK_LAUNCH();
    return;
  }
  LoraMultiShrinkArgs p;
  p.targets[0].pool = args.pool;
  p.targets[0].partial = args.partial;
  p.num_targets = 1;
  p.seg = args.seg;
  p.x = args.x;
  p.gather = args.gather;
  p.row_capacity = args.row_capacity;
  launch_lora_shrink_multi(p, stream);
}

void launch_lora_expand(const LoraExpandArgs& args, cudaStream_t stream) {
  if (args.seg.max_rows <= 0) {  // segment-major: the short-segment kernel
    const char* what = "lora expand";
    check_pool(args.pool, what, 0);
    MOELORA_CHECK(args.partial && args.delta, ErrorCode::kInvalidArgument, what,
                  ": partial and delta are required");
    MOELORA_CHECK(args.splits >= 0, ErrorCode::kInvalidArgument, what, ": splits = ", args.splits,
                  " must be >= 0");
    check_segments(args.seg, args.row_capacity, what);
    if (args.seg.max_segments == 0) return;
    const int splits = args.splits > 0 ? args.splits : lora_shrink_splits(args.pool.in_features);
    MOELORA_CHECK(args.seg.max_ctas >= 0, ErrorCode::kInvalidArgument, what, ": max_ctas = ",
                  args.seg.max_ctas, " must be >= 0");
    const int tiles = (args.pool.out_features + kSegExpandThreads - 1) / kSegExpandThreads;
    const int row_chunks = std::max(1, args.seg.row_chunks);
    const dim3 grid(segment_grid(args.seg, tiles, what));
    const dim3 block(kSegExpandThreads);
    const int chunks = args.pool.max_rank / 8;
    using ::moelora::cuda::launch_kernel;
    auto launch = [&](auto kernel) {
      launch_kernel(kernel, grid, block, 0, stream, args.pdl, args, splits, tiles, row_chunks);
    };
    const bool b = args.beside_gemm;
    if (chunks <= 2) {
      b ? launch(lora_expand_segment_kernel<2, true>) : launch(lora_expand_segment_kernel<2, false>);
    } else if (chunks <= 4) {
      b ? launch(lora_expand_segment_kernel<4, true>) : launch(lora_expand_segment_kernel<4, false>);
    } else if (chunks <= 8) {
      b ? launch(lora_expand_segment_kernel<8, true>) : launch(lora_expand_segment_kernel<8, false>);
    } else if (chunks <= 16) {
      launch(lora_expand_segment_kernel<16, false>);  // the bound does not apply above R = 64
    } else {
      launch(lora_expand_segment_kernel<32, false>);
    }
    MOELORA_CUDA_CHECK_LAUNCH();
    return;
  }
  LoraMultiExpandArgs p;
  p.targets[0].pool = args.pool;
  p.targets[0].partial = args.partial;
  p.targets[0].out = args.delta;
  p.targets[0].out_stride = args.pool.out_features;
  p.num_targets = 1;
  p.seg = args.seg;
  p.row_capacity = args.row_capacity;
  p.splits = args.splits;
  p.u_row = args.u_row;
  p.mode = LoraExpandMode::kWrite;
  launch_lora_expand_multi(p, stream);
}

}  // namespace moelora::ops::cuda
