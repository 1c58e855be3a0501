// LoRA fused into the kernels that already hold a decode MoE layer's rows (device-only header):
// the quant kernel (x rows) writes the seam-1 shrink partials, the activation kernel adds the
// seam-1 delta (expand) to its gate / up values and writes the seam-2 shrink partials of its
// output, so seam 1 needs no side-stream kernel at all and seam 2 only its expand.
//
// Shrink:
// Layout: the calling CTA serves one row q and one chunk of kRowShrinkChunk columns; its warp w
// holds columns chunk * kRowShrinkChunk + 128 w + 4 lane .. + 3 as four fp32 values (zero past
// the row's K). The CTA writes
//   partial[chunk, q, r] = sum over its columns c of v[c] * A[slot, ea, r, c],  r < rank[slot]
// ([splits = ceil(K / kRowShrinkChunk), row_capacity, R], the layout launch_lora_expand reads with
// splits set). Warps reduce their lanes with shuffles, the CTA sums the warps in a fixed order:
// results do not depend on timing.
//
// Why fused: the side-stream shrink grids (hundreds to thousands of CTAs) were placed on the SMs
// before the persistent expert GEMM that follows the quant kernel, which then started only when
// they drained (6 us at 16 tokens, 22 us at 64 in the decode timeline); fused, the A rows are one
// more round of loads in a kernel that waits for its row anyway.
#pragma once

#include <cuda_bf16.h>

#include "core/sm90_ptx.cuh"
#include "ops/lora/lora_cuda.cuh"

namespace moelora::ops::cuda {

constexpr int kRowShrinkWarps = 8;
constexpr int kRowShrinkChunk = kRowShrinkWarps * 128;  // columns of one CTA
constexpr int kRowShrinkBatch = 16;                     // ranks whose A loads are in flight at once

// Where the fused shrink writes (nullptr partial = no LoRA).
struct LoraRowShrinkArgs {
  LoraPoolTarget pool;
  float* partial = nullptr;  // [ceil(K / kRowShrinkChunk), row_capacity, R]
  int row_capacity = 0;
  const int2* row_slot_expert = nullptr;  // [rows] {slot, expert} of each sorted row (moe_align)
  // Optional: a later kernel's pool target whose A rows of this row's {slot, expert} the CTAs
  // prefetch into L2 after their shrink (prefetch_row_a); pool.a == nullptr = none.
  LoraPoolTarget prefetch_next;
};

// The pool's per-slot ranks and shared-A flags, staged in shared memory before the kernel's
// griddepcontrol.wait (they do not depend on the previous kernel): after the wait a row's
// factors are one load ({slot, expert}) away from their address.
constexpr int kRowShrinkMaxSlots = 256;
struct RowShrinkSlots {
  int rank[kRowShrinkMaxSlots];
  int a_shared[kRowShrinkMaxSlots];
};
__device__ __forceinline__ void stage_row_shrink_slots(const LoraPoolTarget& pool,
                                                       RowShrinkSlots& slots) {
  for (int s = threadIdx.x; s < pool.num_slots; s += blockDim.x) {
    slots.rank[s] = pool.rank[s];
    slots.a_shared[s] = pool.a_shared ? pool.a_shared[s] : 0;
  }
}

__device__ __forceinline__ const __nv_bfloat16* row_shrink_a_rows(const LoraPoolTarget& pool,
                                                                  const RowShrinkSlots& slots,
                                                                  int2 se) {
  const int ea = (pool.ea == 1 || slots.a_shared[se.x]) ? 0 : se.y;
  return pool.a + (static_cast<size_t>(se.x) * pool.ea + ea) * pool.max_rank * pool.in_features;
}

// The A values of the first kRowShrinkBatch ranks at the lane's 4 columns, loaded by a kernel
// before its griddepcontrol.wait (weights; the row's {slot, expert} is an align output, complete
// before the previous kernel started), so that the shrink after the wait starts from registers
// instead of a round trip to memory. `slots` staged and synchronized before.
struct RowShrinkPreload {
  uint2 av[kRowShrinkBatch];
};
__device__ __forceinline__ void row_shrink_preload(const LoraRowShrinkArgs& a,
                                                   const RowShrinkSlots& slots, int2 se, int c0,
                                                   RowShrinkPreload& pre) {
  const int rank = se.x >= 0 ? slots.rank[se.x] : 0;
  const bool active = rank > 0 && c0 < a.pool.in_features;
  const __nv_bfloat16* a_rows = active ? row_shrink_a_rows(a.pool, slots, se) : nullptr;
#pragma unroll
  for (int j = 0; j < kRowShrinkBatch; ++j)
    pre.av[j] = (active && j < rank)
                    ? *reinterpret_cast<const uint2*>(
                          a_rows + static_cast<size_t>(j) * a.pool.in_features + c0)
                    : make_uint2(0, 0);
}

// All threads of the CTA call it (it synchronizes through `scratch`, kRowShrinkWarps *
// kRowShrinkBatch floats of shared memory; `slots` staged and synchronized before). K =
// pool.in_features; c0 = the lane's first column; se = the row's {slot, expert}; pre = the first
// batch's A values from row_shrink_preload, or nullptr (loaded here). The same bits either way.
__device__ __forceinline__ void lora_row_shrink(const LoraRowShrinkArgs& a,
                                                const RowShrinkSlots& slots, int2 se, int q,
                                                int chunk, int c0, const float (&v)[4],
                                                float* scratch,
                                                const RowShrinkPreload* pre = nullptr) {
  const LoraPoolTarget& pool = a.pool;
  const int slot = se.x;
  const int rank = slot >= 0 ? slots.rank[slot] : 0;
  if (rank == 0) return;  // uniform over the CTA: the expand writes zeros without partials
  const int R = pool.max_rank;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const __nv_bfloat16* a_rows = row_shrink_a_rows(pool, slots, se);
  for (int r0 = 0; r0 < rank; r0 += kRowShrinkBatch) {
    float s[kRowShrinkBatch];
    uint2 av[kRowShrinkBatch];
    if (pre && r0 == 0) {
#pragma unroll
      for (int j = 0; j < kRowShrinkBatch; ++j) av[j] = pre->av[j];
    } else {  // one round of independent loads
      const int K = pool.in_features;
      const bool active = c0 < K;  // K is a multiple of 4: a lane's 4 columns are all in or all out
#pragma unroll
      for (int j = 0; j < kRowShrinkBatch; ++j)
        av[j] = (active && r0 + j < rank)
                    ? *reinterpret_cast<const uint2*>(a_rows + static_cast<size_t>(r0 + j) * K + c0)
                    : make_uint2(0, 0);
    }
#pragma unroll
    for (int j = 0; j < kRowShrinkBatch; ++j) {
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&av[j].x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&av[j].y));
      s[j] = fmaf(v[0], lo.x, fmaf(v[1], lo.y, fmaf(v[2], hi.x, v[3] * hi.y)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int j = 0; j < kRowShrinkBatch; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], o);
    if (lane == 0)
#pragma unroll
      for (int j = 0; j < kRowShrinkBatch; ++j) scratch[warp * kRowShrinkBatch + j] = s[j];
    __syncthreads();
    if (threadIdx.x < kRowShrinkBatch && r0 + threadIdx.x < rank) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kRowShrinkWarps; ++w) total += scratch[w * kRowShrinkBatch + threadIdx.x];
      a.partial[(static_cast<size_t>(chunk) * a.row_capacity + q) * R + r0 + threadIdx.x] = total;
    }
    __syncthreads();  // scratch is reused by the next batch
  }
}

// L2 fills of the A rows (r < the slot's rank) of `pool` for the row's {slot, expert}, spread over
// `workers` callers: the quant kernel warms the seam-2 factors the activation kernel's fused shrink
// reads ~60 us later (otherwise first touches from DRAM while GEMM2's weight stream saturates it).
__device__ __forceinline__ void prefetch_row_a(const LoraPoolTarget& pool, int2 se, int worker,
                                               int workers) {
  if (!pool.a || se.x < 0) return;
  const int rank = pool.rank[se.x];
  const int ea = (pool.ea == 1 || (pool.a_shared && pool.a_shared[se.x])) ? 0 : se.y;
  const __nv_bfloat16* rows =
      pool.a + (static_cast<size_t>(se.x) * pool.ea + ea) * pool.max_rank * pool.in_features;
  ::moelora::cuda::sm90::prefetch_l2_range(
      rows, static_cast<size_t>(rank) * pool.in_features * sizeof(__nv_bfloat16), worker, workers);
}

// The seam-1 expand fused into the activation kernel: the delta of row q at column n,
//   d[q, n] = scaling[s] * sum_r u[q, r] * B[s, eb, n, r],  u[q, r] = sum_split partial[split, q, r]
// with {s, e} = the row's slot and expert (eb = 0 for a shared B), r < rank[s]; none for s < 0.
struct LoraRowExpandArgs {
  LoraPoolTarget pool;             // B [S, Eb, N, R]
  const float* partial = nullptr;  // [splits, row_capacity, R] (the quant kernel's fused shrink)
  int splits = 0;
  int row_capacity = 0;
  const int2* row_slot_expert = nullptr;  // [rows] {slot, expert} of each sorted row (moe_align)
};

// B values a lane holds for 8 output columns: chunks of 8 ranks, the first kRowExpandPreChunks
// loaded before the kernel's griddepcontrol.wait (weights, and the row's slot and expert from the
// align kernel, complete before the previous kernel started), so their latency overlaps it.
constexpr int kRowExpandPreChunks = 2;  // ranks 1..16 need no load after the wait
constexpr int kRowExpandMaxRank = 256;
struct RowExpandState {
  int rank = 0;
  float scaling = 0.f;
  const __nv_bfloat16* b = nullptr;  // the row's B block [N, R]
  uint4 pre[kRowExpandPreChunks][8];
};

// ncols[8]: the lane's 8 output columns (< 0 = none).
__device__ __forceinline__ void row_expand_prefetch(const LoraRowExpandArgs& a, int2 se,
                                                    const int (&ncols)[8], RowExpandState& st) {
  const LoraPoolTarget& pool = a.pool;
  st.rank = se.x >= 0 ? pool.rank[se.x] : 0;
  if (st.rank == 0) return;
  st.scaling = pool.scaling[se.x];
  const int eb = (pool.eb == 1 || (pool.b_shared && pool.b_shared[se.x])) ? 0 : se.y;
  const int R = pool.max_rank;
  st.b = pool.b + (static_cast<size_t>(se.x) * pool.eb + eb) * pool.out_features * R;
  const int chunks = (st.rank + 7) / 8;
#pragma unroll
  for (int c = 0; c < kRowExpandPreChunks; ++c)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      st.pre[c][i] = (c < chunks && ncols[i] >= 0)
                         ? *reinterpret_cast<const uint4*>(st.b + static_cast<size_t>(ncols[i]) * R + 8 * c)
                         : make_uint4(0, 0, 0, 0);
}

// After the wait. All threads of the CTA call it (it synchronizes through `u`, R floats of shared
// memory); adds the deltas of the lane's columns to d[8]. The slot is uniform over the CTA.
__device__ __forceinline__ void row_expand_add(const LoraRowExpandArgs& a, const RowExpandState& st,
                                               int q, const int (&ncols)[8], float* u,
                                               float (&d)[8]) {
  if (st.rank == 0) return;
  const int R = a.pool.max_rank;
  for (int r = threadIdx.x; r < st.rank; r += blockDim.x) {
    float s = 0.f;
    for (int sp = 0; sp < a.splits; ++sp)
      s += a.partial[(static_cast<size_t>(sp) * a.row_capacity + q) * R + r];
    u[r] = s * st.scaling;
  }
  for (int r = st.rank + threadIdx.x; r < (st.rank + 7) / 8 * 8; r += blockDim.x) u[r] = 0.f;
  __syncthreads();
  const int chunks = (st.rank + 7) / 8;
  for (int c = 0; c < chunks; ++c) {
    uint4 bv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (c < kRowExpandPreChunks) {
#pragma unroll
        for (int cc = 0; cc < kRowExpandPreChunks; ++cc)
          if (cc == c) bv[i] = st.pre[cc][i];
      } else {
        bv[i] = ncols[i] >= 0 ? *reinterpret_cast<const uint4*>(st.b + static_cast<size_t>(ncols[i]) * R + 8 * c)
                              : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&bv[i]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 bf = __bfloat1622float2(b2[j]);
        d[i] = fmaf(u[8 * c + 2 * j], bf.x, fmaf(u[8 * c + 2 * j + 1], bf.y, d[i]));
      }
    }
  }
}

// Column n's B row of (slot, B expert eb; eb already resolved: 0 for a one-expert or shared-B
// pool): kRankChunks 8-value chunks, the first rank_chunks loaded, zero past them, for n >= N =
// pool.out_features and when !active (nothing is read then). The pool's rank tail is zero, so
// ranks that are not multiples of 8 read zeros there. Shared by the expands of lora_cuda.cu and
// the MoE finalize's fold.
template <int kRankChunks>
__device__ __forceinline__ void lora_load_b_chunks(const LoraPoolTarget& pool, int slot, int eb,
                                                   int n, int rank_chunks, bool active,
                                                   uint4 (&b)[kRankChunks]) {
  const int N = pool.out_features, R = pool.max_rank;
  const __nv_bfloat16* b_row =
      active ? pool.b + ((static_cast<size_t>(slot) * pool.eb + eb) * N + (n < N ? n : 0)) * R
             : nullptr;
#pragma unroll
  for (int c = 0; c < kRankChunks; ++c)
    b[c] = (active && c < rank_chunks && n < N) ? *reinterpret_cast<const uint4*>(b_row + c * 8)
                                                : make_uint4(0, 0, 0, 0);
}

// The expand's arithmetic for one output column, shared by the segment expand
// (lora_cuda.cu) and the MoE finalize's folded seam-2 expand, which must give its bits:
//   lora_partial_sum: u's sum over the K splits of a shrink's partials [splits, capacity, R] (row
//                     q, rank r), splits ascending (the caller multiplies by the slot's scaling);
//   lora_expand_dot:  sum over the first rank_chunks 8-rank chunks of u[r] * B[r], ranks
//                     ascending, one FMA each; b = the column's B values, 8 bf16 per chunk.
__device__ __forceinline__ float lora_partial_sum(const float* partial, int splits,
                                                  int row_capacity, size_t q, int r, int R) {
  float s = 0.f;
  for (int sp = 0; sp < splits; ++sp)
    s += partial[(static_cast<size_t>(sp) * row_capacity + q) * R + r];
  return s;
}
template <int kRankChunks>
__device__ __forceinline__ float lora_expand_dot(const float* u, const uint4 (&b)[kRankChunks],
                                                 int rank_chunks) {
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < kRankChunks; ++c) {
    if (c >= rank_chunks) break;
    const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b[c]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 bf = __bfloat1622float2(b2[j]);
      acc = fmaf(u[c * 8 + 2 * j], bf.x, acc);
      acc = fmaf(u[c * 8 + 2 * j + 1], bf.y, acc);
    }
  }
  return acc;
}

inline bool row_expand_args_ok(const LoraRowExpandArgs& a, int max_rows, int out_features) {
  return a.row_slot_expert && a.pool.b && a.pool.rank && a.pool.scaling && a.splits > 0 &&
         a.row_capacity >= max_rows && a.pool.out_features == out_features && a.pool.max_rank <= 256;
}

// Host-side checks of a fused shrink's arguments for a kernel over `max_rows` rows of K = `cols`.
inline bool row_shrink_args_ok(const LoraRowShrinkArgs& a, int max_rows, int cols) {
  return a.row_slot_expert && a.pool.a && a.pool.rank && a.row_capacity >= max_rows &&
         a.pool.in_features == cols && a.pool.num_slots <= kRowShrinkMaxSlots;
}

}  // namespace moelora::ops::cuda
