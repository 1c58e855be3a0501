// Segmented LoRA shrink / expand kernels (see lora_cuda.cuh for the math).
//
// Shrink: CTA = (segment, K split), 8 warps. Warp w owns ranks r = w, w + 8, ...; it keeps its
// A rows' slice of the split in registers (kVec 16-byte vectors per lane, 256 * kVec columns per
// split) and streams the segment's x rows past them, so each A element is read once per CTA.
// Expand: CTA = (segment, 256-column tile of the output); thread = one output column n holding
// its B row (up to R values) in registers, the segment's reduced u rows staged in shared memory
// 32 rows at a time.
#include <algorithm>

#include "core/cuda_utils.h"
#include "ops/lora/lora_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kShrinkWarps = 8;
constexpr int kExpandThreads = 256;
constexpr int kExpandRows = 32;  // u rows staged per pass = rows per chunk of a segment
constexpr int kMaxRank = 256;
constexpr int kRowsInFlight = 4;  // shrink rows a warp reduces at once

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

template <int kVec>
__global__ void __launch_bounds__(32 * kShrinkWarps) lora_shrink_kernel(const LoraShrinkArgs p) {
  const int seg_index = blockIdx.x;
  if (seg_index >= *p.seg.num_segments) return;
  const int4 seg = p.seg.segments[seg_index];  // {slot, expert, begin, end}
  const int slot = seg.x, expert = seg.y;
  const LoraPoolTarget& pool = p.pool;
  const int rank = pool.rank[slot];
  if (rank == 0) return;  // the expand writes zeros for this segment without reading partials
  const int split = blockIdx.y;
  const int K = pool.in_features, R = pool.max_rank;
  constexpr int kSplitCols = 256 * kVec;
  const int k0 = split * kSplitCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ea = (pool.ea == 1 || (pool.a_shared && pool.a_shared[slot])) ? 0 : expert;
  const __nv_bfloat16* a_base = pool.a + (static_cast<size_t>(slot) * pool.ea + ea) * R * K;

  for (int r0 = warp; r0 < rank; r0 += kShrinkWarps) {
    // lane's columns: k0 + (v * 32 + lane) * 8 .. +8 for v < kVec
    uint4 a_reg[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const int col = k0 + (v * 32 + lane) * 8;
      a_reg[v] = col < K
                     ? *reinterpret_cast<const uint4*>(a_base + static_cast<size_t>(r0) * K + col)
                     : make_uint4(0, 0, 0, 0);
    }
    // This CTA's rows: chunks of kExpandRows starting at chunk blockIdx.z, every gridDim.z-th.
    for (int c0 = seg.z + blockIdx.z * kExpandRows; c0 < seg.w; c0 += gridDim.z * kExpandRows) {
      const int c1 = min(seg.w, c0 + kExpandRows);
      // kRowsInFlight rows per pass: their loads and warp reductions are independent, so the
      // warp overlaps their latencies instead of paying one L2 round trip per row.
      for (int q0 = c0; q0 < c1; q0 += kRowsInFlight) {
        uint4 x_reg[kRowsInFlight][kVec];
#pragma unroll
        for (int j = 0; j < kRowsInFlight; ++j) {
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
        float s[kRowsInFlight];
#pragma unroll
        for (int j = 0; j < kRowsInFlight; ++j) {
          s[j] = 0.f;
#pragma unroll
          for (int v = 0; v < kVec; ++v) s[j] += dot8(a_reg[v], x_reg[j][v]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
          for (int j = 0; j < kRowsInFlight; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], o);
        }
        if (lane == 0) {
#pragma unroll
          for (int j = 0; j < kRowsInFlight; ++j)
            if (q0 + j < c1)
              p.partial[(static_cast<size_t>(split) * p.row_capacity + q0 + j) * R + r0] = s[j];
        }
      }
    }
  }
}

template <int kRankChunks>  // B row held as kRankChunks 8-value chunks (R <= 8 * kRankChunks)
__global__ void __launch_bounds__(kExpandThreads)
    lora_expand_kernel(const LoraExpandArgs p, int splits) {
  __shared__ float u[kExpandRows][8 * kRankChunks];
  const int seg_index = blockIdx.x;
  if (seg_index >= *p.seg.num_segments) return;
  const int4 seg = p.seg.segments[seg_index];
  const int slot = seg.x, expert = seg.y;
  const LoraPoolTarget& pool = p.pool;
  const int rank = pool.rank[slot];
  const int R = pool.max_rank, N = pool.out_features;
  const int n = blockIdx.y * kExpandThreads + threadIdx.x;
  const int rank_chunks = (rank + 7) / 8;
  const float scaling = pool.scaling[slot];
  const int eb = (pool.eb == 1 || (pool.b_shared && pool.b_shared[slot])) ? 0 : expert;
  const __nv_bfloat16* b_row =
      pool.b + ((static_cast<size_t>(slot) * pool.eb + eb) * N + (n < N ? n : 0)) * R;

  uint4 b_reg[kRankChunks];
#pragma unroll
  for (int c = 0; c < kRankChunks; ++c)
    b_reg[c] = (c < rank_chunks && n < N) ? *reinterpret_cast<const uint4*>(b_row + c * 8)
                                          : make_uint4(0, 0, 0, 0);

  for (int q0 = seg.z + blockIdx.z * kExpandRows; q0 < seg.w; q0 += gridDim.z * kExpandRows) {
    const int rows = min(kExpandRows, seg.w - q0);
    __syncthreads();  // previous pass finished reading u
    // u[i][r] = scaling * sum over splits of the partials (zero past the slot's rank)
    for (int i = threadIdx.x; i < rows * 8 * kRankChunks; i += kExpandThreads) {
      const int row = i / (8 * kRankChunks), r = i % (8 * kRankChunks);
      float s = 0.f;
      if (r < rank) {
        const size_t u = p.u_row ? p.u_row[q0 + row] : q0 + row;
        for (int sp = 0; sp < splits; ++sp)
          s += p.partial[(static_cast<size_t>(sp) * p.row_capacity + u) * R + r];
      }
      u[row][r] = s * scaling;
    }
    __syncthreads();
    if (n < N) {
      for (int i = 0; i < rows; ++i) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < kRankChunks; ++c) {
          if (c >= rank_chunks) break;
          const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b_reg[c]);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 bf = __bfloat1622float2(b2[j]);
            acc = fmaf(u[i][c * 8 + 2 * j], bf.x, acc);
            acc = fmaf(u[i][c * 8 + 2 * j + 1], bf.y, acc);
          }
        }
        p.delta[static_cast<size_t>(q0 + i) * N + n] = __float2bfloat16(acc);
      }
    }
  }
}

int shrink_vec(int in_features) {
  return std::clamp((in_features + 2047) / 2048, 1, 4);
}

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

}  // namespace

int lora_shrink_splits(int in_features) {
  const int cols = 256 * shrink_vec(in_features);
  return (in_features + cols - 1) / cols;
}

size_t lora_partial_bytes(int in_features, int row_capacity, int max_rank) {
  return static_cast<size_t>(lora_shrink_splits(in_features)) * row_capacity * max_rank *
         sizeof(float);
}

void launch_lora_shrink(const LoraShrinkArgs& p, cudaStream_t stream) {
  check_pool(p.pool, "lora shrink");
  MOELORA_CHECK(p.x && p.partial && p.seg.segments && p.seg.num_segments,
                ErrorCode::kInvalidArgument, "lora shrink: x, partial and segments are required");
  if (p.seg.max_segments == 0) return;
  dim3 grid(p.seg.max_segments, lora_shrink_splits(p.pool.in_features),
            std::max(1, p.seg.row_chunks));
  switch (shrink_vec(p.pool.in_features)) {
    case 1: lora_shrink_kernel<1><<<grid, dim3(32 * kShrinkWarps), 0, stream>>>(p); break;
    case 2: lora_shrink_kernel<2><<<grid, dim3(32 * kShrinkWarps), 0, stream>>>(p); break;
    case 3: lora_shrink_kernel<3><<<grid, dim3(32 * kShrinkWarps), 0, stream>>>(p); break;
    default: lora_shrink_kernel<4><<<grid, dim3(32 * kShrinkWarps), 0, stream>>>(p); break;
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_lora_expand(const LoraExpandArgs& p, cudaStream_t stream) {
  check_pool(p.pool, "lora expand");
  MOELORA_CHECK(p.partial && p.delta && p.seg.segments && p.seg.num_segments,
                ErrorCode::kInvalidArgument,
                "lora expand: partial, delta and segments are required");
  if (p.seg.max_segments == 0) return;
  const int splits = p.splits > 0 ? p.splits : lora_shrink_splits(p.pool.in_features);
  dim3 grid(p.seg.max_segments, (p.pool.out_features + kExpandThreads - 1) / kExpandThreads,
            std::max(1, p.seg.row_chunks));
  const int chunks = p.pool.max_rank / 8;
  if (chunks <= 2) {
    lora_expand_kernel<2><<<grid, dim3(kExpandThreads), 0, stream>>>(p, splits);
  } else if (chunks <= 4) {
    lora_expand_kernel<4><<<grid, dim3(kExpandThreads), 0, stream>>>(p, splits);
  } else if (chunks <= 8) {
    lora_expand_kernel<8><<<grid, dim3(kExpandThreads), 0, stream>>>(p, splits);
  } else if (chunks <= 16) {
    lora_expand_kernel<16><<<grid, dim3(kExpandThreads), 0, stream>>>(p, splits);
  } else {
    lora_expand_kernel<32><<<grid, dim3(kExpandThreads), 0, stream>>>(p, splits);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
