#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/moe/moe_cuda.cuh"
#include "ops/quant/fp8_device.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kActWarps = 8;

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

static_assert(kActWarps == kRowShrinkWarps, "the fused LoRA shrink covers one CTA's 8 column groups");

// Warp per (row, 128-column group): lane owns columns 4*lane .. 4*lane+3 of the group. With LoRA
// (lora_row_fused.cuh) the CTA adds the fused seam-1 expand to its gate / up values and writes
// the seam-2 shrink partials of its row; their weights are loaded before the wait.
// kShrink / kExpand: the instances with the fused LoRA code (its registers would otherwise cost
// the plain instance its co-residence with the GEMMs it overlaps; the seam-1 expand alone needs
// most of them, so the shrink-only instance, used when GEMM1's epilogue adds the seam-1 delta,
// leaves it out).
template <bool kShrink, bool kExpand>
__global__ void __launch_bounds__(32 * kActWarps, kShrink && !kExpand ? 3 : 1)
    moe_activation_kernel(const MoeActivationArgs p) {
  // The dependent (GEMM2) may be scheduled at once: before its own wait it only fetches weights.
  // Every CTA waits (also those with no row): the grid's completion then implies the previous
  // kernel's, which the kernels after this one rely on.
  ::moelora::cuda::sm90::launch_dependents();
  const bool lora = kShrink && p.lora.partial != nullptr;
  const bool lora_expand = kExpand && p.lora_expand.partial != nullptr;
  const int row = blockIdx.x;
  const int groups = p.inter_padded / 128;
  const int group = blockIdx.y * kActWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int I = p.inter;
  const int c0 = group * 128 + lane * 4;
  const bool in = group < groups && c0 < I;  // I is a multiple of 4: a lane's 4 columns are all valid or padding
  // Before the wait (fused LoRA only): the pool's ranks, the row's {slot, expert} and row count
  // (align kernel outputs, complete before the previous kernel started) and the seam-1 B values
  // (weights).
  __shared__ RowShrinkSlots slots;
  RowExpandState expand;
  int2 slot_expert = make_int2(-1, 0);
  int ncols[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    ncols[i] = in ? c0 + i : -1;          // gate columns
    ncols[4 + i] = in ? I + c0 + i : -1;  // up columns
  }
  // The shrink-only instance also holds its row's first A values across the wait (the expand
  // instance's B values take those registers).
  RowShrinkPreload shrink_pre;
  // The shrink of this row: the routed experts' pool, or (MoeActivationArgs::shared_lora) a
  // shared-expert row's own, written at its token's row.
  LoraRowShrinkArgs shrink;
  int shrink_row = row;
  if (lora || lora_expand) {
    const int2* se = lora ? p.lora.row_slot_expert : p.lora_expand.row_slot_expert;
    bool shared_shrink = false;
    if (row < (p.num_rows ? *p.num_rows : p.max_rows)) {
      shared_shrink = !kExpand && lora && p.shared_lora.partial && row >= *p.shared_rows_begin;
      if (shared_shrink) {
        shrink_row = p.row_token[row];
        slot_expert = make_int2(p.slot[shrink_row], 0);
      } else {
        slot_expert = se[row];
      }
    }
    if (lora) {
      shrink = shared_shrink ? p.shared_lora : p.lora;
      stage_row_shrink_slots(shrink.pool, slots);
    }
    if (lora_expand) row_expand_prefetch(p.lora_expand, slot_expert, ncols, expand);
    __syncthreads();  // slots
    if (lora && !kExpand) row_shrink_preload(shrink, slots, slot_expert, c0, shrink_pre);
  }
  ::moelora::cuda::sm90::grid_dependency_wait();
  const int valid = p.num_rows ? *p.num_rows : p.max_rows;
  if (row >= valid) return;
  auto load4 = [](const __nv_bfloat16* ptr, float (&v)[4]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(ptr);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  };
  float g[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
  if (in) {  // h first: its loads are in flight while the seam-1 partials are reduced
    const __nv_bfloat16* h = p.h + static_cast<size_t>(row) * 2 * I;
    load4(h + c0, g);
    load4(h + I + c0, u);
    // A shared-expert row takes its delta from the token-segment expand's rows.
    const bool shared_row = p.shared_rows_begin && row >= *p.shared_rows_begin;
    const __nv_bfloat16* delta = shared_row ? p.shared_delta : p.delta;
    bool use_delta = false;
    int token = row;
    if (delta && p.slot) {
      token = p.row_token ? p.row_token[row] : row;
      use_delta = p.slot[token] >= 0;
    }
    if (use_delta) {
      const int drow = shared_row    ? p.shared_delta_row[token]
                       : p.delta_row ? p.delta_row[row]
                                     : row;
      const __nv_bfloat16* d = delta + static_cast<size_t>(drow) * 2 * I;
      float dg[4], du[4];
      load4(d + c0, dg);
      load4(d + I + c0, du);
#pragma unroll
      for (int i = 0; i < 4; ++i) g[i] += dg[i], u[i] += du[i];
    }
  }
  if (lora_expand) {
    float d1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    __shared__ float u1[kRowExpandMaxRank];
    row_expand_add(p.lora_expand, expand, row, ncols, u1, d1);
#pragma unroll
    for (int i = 0; i < 4; ++i) g[i] += d1[i], u[i] += d1[4 + i];
  }
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  if (in) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = silu(g[i]) * u[i];
    uint2 packed;
    *reinterpret_cast<__nv_bfloat162*>(&packed.x) = __floats2bfloat162_rn(a[0], a[1]);
    *reinterpret_cast<__nv_bfloat162*>(&packed.y) = __floats2bfloat162_rn(a[2], a[3]);
    *reinterpret_cast<uint2*>(p.a16 + static_cast<size_t>(row) * I + c0) = packed;
  }
  if (p.aq && group < groups) {
    uint32_t codes;
    const float s = quantize_group_128(a, codes);
    *reinterpret_cast<uint32_t*>(p.aq + static_cast<size_t>(row) * p.inter_padded + c0) = codes;
    if (lane == 0)
      p.sa[p.scale_ld > 0 ? static_cast<size_t>(group) * p.scale_ld + row : static_cast<size_t>(row) * groups + group] = s;
  }
  if (lora) {
    // The shrink reads what a16 holds: the bf16-rounded values.
    float ar[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) ar[i] = __bfloat162float(__float2bfloat16(a[i]));
    __shared__ float scratch[kRowShrinkWarps * kRowShrinkBatch];
    lora_row_shrink(shrink, slots, slot_expert, shrink_row, blockIdx.y, c0, ar, scratch,
                    kExpand ? nullptr : &shrink_pre);
  }
}

constexpr int kFinalizeThreads = 128;
constexpr int kFinalizeCols = kFinalizeThreads * 8;  // 8 bf16 columns (16 bytes) per thread

// Qwen's shared-expert gate sigmoid(x[t] . wsg), by a CTA of kFinalizeThreads threads (both
// finalize kernels, so that they scale the shared expert by the same bits); recomputed by every
// column chunk's CTA (H MACs). Every thread of the CTA must call it.
__device__ float shared_expert_gate(const MoeFinalizeArgs& p, int t, float* reduce) {
  const int H = p.hidden;
  float s = 0.f;
  for (int c = threadIdx.x * 8; c < H; c += kFinalizeThreads * 8) {
    const uint4 xv = *reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(t) * H + c);
    const uint4 gv = *reinterpret_cast<const uint4*>(p.shared_gate + c);
    const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&xv);
    const __nv_bfloat162* gh = reinterpret_cast<const __nv_bfloat162*>(&gv);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = __bfloat1622float2(xh[i]), b = __bfloat1622float2(gh[i]);
      s = fmaf(a.x, b.x, fmaf(a.y, b.y, s));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = s;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kFinalizeThreads / 32; ++w) total += reduce[w];  // fixed order
  return 1.f / (1.f + expf(-total));
}

__device__ __forceinline__ void add_scaled8(float (&acc)[8], const uint4& v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}

// CTA = (token, 1024-column chunk). All loads of a thread's k expert rows are independent and
// issued before use (restrict pointers let the compiler hoist them past the store). kMaxTopK
// bounds k at compile time so the pair positions and weights stay in registers: 16 for the
// models served (k = 8 at most), 32 (the router's own limit) for tests and models that route a
// token through more experts.
template <int kMaxTopK>
__global__ void __launch_bounds__(kFinalizeThreads) moe_finalize_kernel(const MoeFinalizeArgs p) {
  __shared__ float reduce[kFinalizeThreads / 32];
  // Launched programmatically after GEMM2, the routing (written by the route and align kernels,
  // complete before GEMM1 started) and the layer's inputs (token count, slot map) are read before
  // the wait, all in one round of independent loads (pair_pos is -1 for a pair without an expert,
  // so the ids are not needed); y and the deltas only after it, so the wait is followed by one
  // round trip and the store.
  const int t = blockIdx.x;
  const int k = p.top_k;
  const int kp = k + (p.shared_in_pairs ? 1 : 0);  // pair_pos entries per token
  int pos_of[kMaxTopK];
  float w_of[kMaxTopK];
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    pos_of[j] = j < k ? p.pair_pos[t * kp + j] : -1;
    w_of[j] = j < k ? p.topk_weights[t * k + j] : 0.f;
  }
  const int shared_pos = p.shared_in_pairs ? p.pair_pos[t * kp + k] : -1;
  const int valid = p.num_tokens ? *p.num_tokens : p.max_tokens;
  const bool lora = p.slot && p.slot[t] >= 0;
  const bool has_shared = p.shared || (p.shared_in_pairs && shared_pos >= 0);
  // The gate reads x, complete before the route kernel (whose outputs are read above) finished.
  const float gate =
      t < valid && has_shared && p.shared_gate ? shared_expert_gate(p, t, reduce) : 1.f;
  ::moelora::cuda::sm90::grid_dependency_wait();
  if (t >= valid) return;
  const int H = p.hidden;
  const __nv_bfloat16* __restrict__ y = p.y;
  const __nv_bfloat16* __restrict__ delta = p.delta;
  const __nv_bfloat16* shared = p.shared     ? p.shared + static_cast<size_t>(t) * H
                                : has_shared ? y + static_cast<size_t>(shared_pos) * H
                                             : nullptr;

  const int c = blockIdx.y * kFinalizeCols + threadIdx.x * 8;
  if (c >= H) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    if (pos_of[j] < 0) continue;
    const size_t pos = static_cast<size_t>(pos_of[j]);
    add_scaled8(acc, *reinterpret_cast<const uint4*>(y + pos * H + c), w_of[j]);
    if (lora && delta) add_scaled8(acc, *reinterpret_cast<const uint4*>(delta + pos * H + c), w_of[j]);
  }
  if (shared) {
    add_scaled8(acc, *reinterpret_cast<const uint4*>(shared + c), gate);
    const int shared_row = (p.shared_delta && lora) ? p.shared_delta_row[t] : -1;
    if (shared_row >= 0)
      add_scaled8(acc, *reinterpret_cast<const uint4*>(p.shared_delta + static_cast<size_t>(shared_row) * H + c), gate);
  }
  uint4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  *reinterpret_cast<uint4*>(p.out + static_cast<size_t>(t) * H + c) = out;
}

// The finalize with the seam-2 LoRA expand folded in (MoeFinalizeArgs::lora_expand): the side
// stream runs only the seam-2 shrink, and this kernel forms each pair's delta itself,
//   d[pos, n] = bf16(sum_r u[pos, r] * B[s, e, n, r]),  u[pos, r] = scaling[s] * sum_split partial,
// in the segment expand's order (ranks ascending in 8-rank chunks, splits ascending), rounded to
// bf16 as that kernel stores it, then adds w (y + d) as the plain finalize does: the same bits as
// expand + finalize (lora_partial_sum and lora_expand_dot are the segment expand's own code),
// without the expand's grid beside GEMM2. No separate shared expert output: the layer folds only
// where the finalize is a programmatic dependent of GEMM2, which a separate shared expert's kernels
// are not; the shared expert among the pairs (shared_in_pairs) is added as the plain kernel adds
// it. CTA = (token, kFoldCols columns), one column per thread, so a thread's B values for all k
// pairs (k x R bf16) fit in registers: they are weights, loaded before the programmatic wait with
// the pairs' experts (the align's sorted {slot, expert}, complete before GEMM1 started) while GEMM2
// still runs. After the wait the CTA sums the pairs' partials into u in shared memory (k x R
// floats, one per thread at R = 16) and every thread forms its column.
constexpr int kFoldCols = 128;

template <int kRankChunks>  // R <= 8 * kRankChunks
__global__ void __launch_bounds__(kFoldCols) moe_finalize_fold_kernel(const MoeFinalizeArgs p) {
  constexpr int kURanks = 8 * kRankChunks;
  __shared__ float u[kFinalizeFoldMaxTopK + 1][kURanks];  // row k: the shared expert's
  __shared__ float reduce[kFoldCols / 32];
  const LoraRowExpandArgs& e = p.lora_expand;
  const LoraPoolTarget& pool = e.pool;
  const int t = blockIdx.x, k = p.top_k, H = p.hidden;
  const int kp = k + (p.shared_in_pairs ? 1 : 0);  // pair_pos entries per token
  const int n = blockIdx.y * kFoldCols + threadIdx.x;
  int pos_of[kFinalizeFoldMaxTopK];
  float w_of[kFinalizeFoldMaxTopK];
#pragma unroll
  for (int j = 0; j < kFinalizeFoldMaxTopK; ++j) {
    pos_of[j] = j < k ? p.pair_pos[t * kp + j] : -1;
    w_of[j] = j < k ? p.topk_weights[t * k + j] : 0.f;
  }
  const int shared_pos = p.shared_in_pairs ? p.pair_pos[t * kp + k] : -1;
  const int valid = p.num_tokens ? *p.num_tokens : p.max_tokens;
  const int slot = p.slot ? p.slot[t] : -1;
  // padding tokens (t >= valid) read no pool entry, whatever their slot
  const bool lora = t < valid && slot >= 0;
  const int rank = lora ? pool.rank[slot] : 0;
  const int rank_chunks = (rank + 7) / 8;
  const float scaling = lora ? pool.scaling[slot] : 0.f;
  const bool b_per_expert = lora && pool.eb > 1 && !(pool.b_shared && pool.b_shared[slot]);
  const int R = pool.max_rank;
  // The shared expert's seam-2 delta formed here too (shared_lora_expand): its pool's rank,
  // scaling and B values of the token's slot, loaded before the wait as the routed pairs' are.
  const LoraRowExpandArgs& se = p.shared_lora_expand;
  const bool shared_fold = lora && shared_pos >= 0 && se.partial != nullptr;
  const int shared_rank = shared_fold ? se.pool.rank[slot] : 0;
  const int shared_chunks = (shared_rank + 7) / 8;
  const float shared_scaling = shared_fold ? se.pool.scaling[slot] : 0.f;
  uint4 b_shared[kRankChunks];  // its one expert's B
  lora_load_b_chunks<kRankChunks>(se.pool, slot, 0, n, shared_chunks, shared_fold, b_shared);
  uint4 b_reg[kFinalizeFoldMaxTopK][kRankChunks];
#pragma unroll
  for (int j = 0; j < kFinalizeFoldMaxTopK; ++j) {
    const bool pair = lora && pos_of[j] >= 0;
    const int expert = pair ? e.row_slot_expert[pos_of[j]].y : 0;
    lora_load_b_chunks<kRankChunks>(pool, slot, b_per_expert ? expert : 0, n, rank_chunks, pair,
                                    b_reg[j]);
  }
  // The gate reads x (complete before the route kernel finished, as the routing read above).
  const float gate =
      t < valid && shared_pos >= 0 && p.shared_gate ? shared_expert_gate(p, t, reduce) : 1.f;
  ::moelora::cuda::sm90::grid_dependency_wait();
  if (t >= valid) return;  // uniform over the CTA: no thread reaches the barriers below
  // u[j][r] for the token's pairs: the segment expand's sums (zero past the slot's rank)
  if (lora) {
    for (int i = threadIdx.x; i < k * kURanks; i += kFoldCols) {
      const int j = i / kURanks, r = i % kURanks;
      const int pos = p.pair_pos[t * kp + j];
      const float s = r < rank && pos >= 0
                          ? lora_partial_sum(e.partial, e.splits, e.row_capacity, pos, r, R)
                          : 0.f;
      u[j][r] = s * scaling;
    }
    if (shared_fold) {
      for (int r = threadIdx.x; r < kURanks; r += kFoldCols)
        u[kFinalizeFoldMaxTopK][r] =
            r < shared_rank
                ? lora_partial_sum(se.partial, se.splits, se.row_capacity, t, r, se.pool.max_rank) *
                      shared_scaling
                : 0.f;
    }
  }
  __syncthreads();  // u complete
  if (n >= H) return;
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kFinalizeFoldMaxTopK; ++j) {
    if (pos_of[j] < 0) continue;
    const size_t pos = static_cast<size_t>(pos_of[j]);
    acc = fmaf(w_of[j], __bfloat162float(p.y[pos * H + n]), acc);
    if (!lora) continue;
    const float d = lora_expand_dot<kRankChunks>(u[j], b_reg[j], rank_chunks);
    acc = fmaf(w_of[j], __bfloat162float(__float2bfloat16(d)), acc);
  }
  if (shared_pos >= 0) {  // the plain finalize's order: the shared row, then its delta
    acc = fmaf(gate, __bfloat162float(p.y[static_cast<size_t>(shared_pos) * H + n]), acc);
    const int shared_row = (p.shared_delta && lora) ? p.shared_delta_row[t] : -1;
    if (shared_row >= 0)
      acc = fmaf(gate, __bfloat162float(p.shared_delta[static_cast<size_t>(shared_row) * H + n]),
                 acc);
    if (shared_fold) {
      const float d =
          lora_expand_dot<kRankChunks>(u[kFinalizeFoldMaxTopK], b_shared, shared_chunks);
      acc = fmaf(gate, __bfloat162float(__float2bfloat16(d)), acc);
    }
  }
  p.out[static_cast<size_t>(t) * H + n] = __float2bfloat16(acc);
}

}  // namespace

void launch_moe_activation(const MoeActivationArgs& p, cudaStream_t stream) {
  MOELORA_CHECK(p.h && p.a16 && (!p.aq || p.sa), ErrorCode::kInvalidArgument, "moe activation: null pointer");
  MOELORA_CHECK(p.inter % 4 == 0, ErrorCode::kInvalidArgument, "moe activation: I = ", p.inter,
                " must be a multiple of 4 (8-byte vectors)");
  MOELORA_CHECK(p.inter > 0 && p.inter_padded % 128 == 0 && p.inter_padded >= p.inter && p.inter_padded - p.inter < 128,
                ErrorCode::kInvalidArgument, "moe activation: inter_padded = ", p.inter_padded,
                " must be I = ", p.inter, " rounded up to a multiple of 128");
  MOELORA_CHECK(
      !p.shared_delta || (p.shared_rows_begin && p.shared_delta_row && p.slot && p.row_token),
      ErrorCode::kInvalidArgument,
      "moe activation: shared_delta needs shared_rows_begin, shared_delta_row, slot and row_token");
  if (p.max_rows == 0) return;
  MOELORA_CHECK(p.scale_ld == 0 || p.scale_ld >= p.max_rows, ErrorCode::kInvalidArgument,
                "moe activation: scale_ld = ", p.scale_ld, " must be 0 (row-major) or >= max_rows = ", p.max_rows);
  MOELORA_CHECK(!p.lora.partial || row_shrink_args_ok(p.lora, p.max_rows, p.inter), ErrorCode::kInvalidArgument,
                "moe activation: the fused LoRA shrink needs row_slot_expert, the pool's A and ranks, at most ",
                kRowShrinkMaxSlots, " slots (got ", p.lora.pool.num_slots, "), row_capacity >= max_rows (",
                p.lora.row_capacity, " vs ", p.max_rows, ") and in_features = I (", p.lora.pool.in_features,
                " vs ", p.inter, ")");
  MOELORA_CHECK(!p.shared_lora.partial ||
                    (p.lora.partial && !p.lora_expand.partial && p.shared_rows_begin &&
                     p.row_token && p.slot && p.shared_lora.pool.a && p.shared_lora.pool.rank &&
                     p.shared_lora.row_capacity > 0 && p.shared_lora.pool.in_features == p.inter &&
                     p.shared_lora.pool.num_slots <= kRowShrinkMaxSlots),
                ErrorCode::kInvalidArgument,
                "moe activation: the shared expert's fused shrink needs the routed one (lora), no "
                "fused expand, shared_rows_begin, row_token, slot, its pool's A and ranks, "
                "row_capacity > 0, in_features = I (",
                p.shared_lora.pool.in_features, " vs ", p.inter, ") and at most ",
                kRowShrinkMaxSlots, " slots");
  MOELORA_CHECK(!p.lora_expand.partial || (!p.delta && row_expand_args_ok(p.lora_expand, p.max_rows, 2 * p.inter)),
                ErrorCode::kInvalidArgument,
                "moe activation: the fused LoRA expand needs row_slot_expert, the pool's B, ranks and scalings, "
                "splits > 0, row_capacity >= max_rows (", p.lora_expand.row_capacity, " vs ", p.max_rows,
                "), out_features = 2I (", p.lora_expand.pool.out_features, " vs ", 2 * p.inter,
                "), R <= 256, and no separate delta");
  const dim3 grid(p.max_rows, (p.inter_padded / 128 + kActWarps - 1) / kActWarps);
  if (p.lora_expand.partial)
    ::moelora::cuda::launch_kernel(moe_activation_kernel<true, true>, grid, dim3(32 * kActWarps), 0, stream, p.pdl,
                                   p);
  else if (p.lora.partial)
    ::moelora::cuda::launch_kernel(moe_activation_kernel<true, false>, grid, dim3(32 * kActWarps), 0, stream, p.pdl,
                                   p);
  else
    ::moelora::cuda::launch_kernel(moe_activation_kernel<false, false>, grid, dim3(32 * kActWarps), 0, stream,
                                   p.pdl, p);
}

void launch_moe_finalize(const MoeFinalizeArgs& p, cudaStream_t stream) {
  MOELORA_CHECK(p.y && p.topk_weights && p.pair_pos && p.out, ErrorCode::kInvalidArgument,
                "moe finalize: null pointer");
  MOELORA_CHECK(!p.shared_gate || p.x, ErrorCode::kInvalidArgument, "moe finalize: the shared gate needs x");
  MOELORA_CHECK(!p.shared_delta || (p.shared_delta_row && p.slot), ErrorCode::kInvalidArgument,
                "moe finalize: shared_delta needs shared_delta_row and slot");
  MOELORA_CHECK(!(p.shared && p.shared_in_pairs), ErrorCode::kInvalidArgument,
                "moe finalize: the shared expert's output comes from `shared` or from the pairs "
                "(shared_in_pairs), not both");
  MOELORA_CHECK(p.hidden % 8 == 0, ErrorCode::kInvalidArgument, "moe finalize: H = ", p.hidden,
                " must be a multiple of 8 (16-byte rows)");
  MOELORA_CHECK(p.top_k >= 1 && p.top_k <= 32, ErrorCode::kUnsupported, "moe finalize: top_k = ", p.top_k,
                " outside [1, 32] (the GPU router's limit)");
  const int pair_rows = p.max_tokens * (p.top_k + (p.shared_in_pairs ? 1 : 0));  // T kp
  MOELORA_CHECK(!p.shared_lora_expand.partial || p.lora_expand.partial, ErrorCode::kInvalidArgument,
                "moe finalize: the shared expert's folded seam-2 expand (shared_lora_expand) needs "
                "the routed one (lora_expand)");
  if (p.lora_expand.partial) {
    MOELORA_CHECK(!p.delta && !p.shared && p.slot && p.top_k <= kFinalizeFoldMaxTopK &&
                      row_expand_args_ok(p.lora_expand, pair_rows, p.hidden) &&
                      p.lora_expand.pool.max_rank <= kFinalizeFoldMaxRank,
                  ErrorCode::kInvalidArgument,
                  "moe finalize: the folded seam-2 expand needs the slot map, top_k <= ",
                  kFinalizeFoldMaxTopK, " (got ", p.top_k, "), the pool's B, ranks and scalings, ",
                  "row_slot_expert, splits > 0, row_capacity >= the pair rows (",
                  p.lora_expand.row_capacity, " vs ", pair_rows, "), out_features = H (",
                  p.lora_expand.pool.out_features, " vs ", p.hidden,
                  "), R <= ", kFinalizeFoldMaxRank, " (got ", p.lora_expand.pool.max_rank,
                  "), no separate delta and no separate shared expert output");
    const LoraRowExpandArgs& s = p.shared_lora_expand;
    MOELORA_CHECK(
        !s.partial ||
            (p.shared_in_pairs && !p.shared_delta && s.pool.b && s.pool.rank && s.pool.scaling &&
             s.splits > 0 && s.row_capacity >= p.max_tokens && s.pool.out_features == p.hidden &&
             s.pool.max_rank <= finalize_fold_ranks(p.lora_expand.pool.max_rank)),
        ErrorCode::kInvalidArgument,
        "moe finalize: the shared expert's folded seam-2 expand needs shared_in_pairs, no "
        "shared_delta, its pool's B, ranks and scalings, splits > 0, row_capacity >= T (",
        s.row_capacity, " vs ", p.max_tokens, "), out_features = H (", s.pool.out_features, " vs ",
        p.hidden, ") and R within the routed pool's instance (", s.pool.max_rank, " vs ",
        p.lora_expand.pool.max_rank, ")");
    if (p.max_tokens == 0) return;
    const dim3 grid(p.max_tokens, (p.hidden + kFoldCols - 1) / kFoldCols);
    if (finalize_fold_ranks(p.lora_expand.pool.max_rank) == 16)
      ::moelora::cuda::launch_kernel(moe_finalize_fold_kernel<2>, grid, dim3(kFoldCols), 0, stream,
                                     p.pdl, p);
    else
      ::moelora::cuda::launch_kernel(moe_finalize_fold_kernel<4>, grid, dim3(kFoldCols), 0, stream,
                                     p.pdl, p);
    MOELORA_CUDA_CHECK_LAUNCH();
    return;
  }
  if (p.max_tokens == 0) return;
  const dim3 grid(p.max_tokens, (p.hidden + kFinalizeCols - 1) / kFinalizeCols);
  if (p.top_k <= 16)
    ::moelora::cuda::launch_kernel(moe_finalize_kernel<16>, grid, dim3(kFinalizeThreads), 0, stream, p.pdl, p);
  else
    ::moelora::cuda::launch_kernel(moe_finalize_kernel<32>, grid, dim3(kFinalizeThreads), 0, stream, p.pdl, p);
}

}  // namespace moelora::ops::cuda
