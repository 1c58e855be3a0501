// Weight-streaming grouped FP8 expert GEMM for decode (few tokens per expert): the cost is reading
// each touched expert's weights from HBM once, so the kernel is built to keep HBM busy.
//
//   out[q, n] = sum_k act[q, k] sx[k/128, q] * W[e(q), n, k] sw[e(q), n/128, k/128]
//
// Swap-AB: 64 weight rows are the wgmma M side, the expert's tokens (1..64 per pass) the N side
// (wgmma m64nNk32, N = 8 / 16 / 32 / 64 picked per pass from the expert's token count).
//
// Pipeline (one CTA = one producer warp + one consumer warpgroup, two CTAs per SM):
// - The producer thread walks the CTA's work items (expert, 64-row tile) and, per 128-wide K
//   block, fills one stage of a 6-deep shared-memory ring with three TMA copies: the weight tile
//   [64 rows x 128 B] (128-byte swizzle, L2 evict-first), the activation rows of the pass
//   [N x 128 B] (8-row boxes, sorted positions q0 .. q0+N-1, so each expert's rows are contiguous;
//   rows past the buffer read as zeros) and their fp32 scales of that K block (scales stored
//   k-major, [K/128, ld], so they are one contiguous box; it starts at q0 rounded down to 16 bytes,
//   which TMA requires of the innermost coordinate). Completion is counted on the stage's mbarrier
//   in bytes.
// - The consumer warpgroup multiplies the stage with four wgmma k32 steps into a block
//   accumulator, promotes it into the main accumulator with sw * sx (DeepGEMM-style per-block
//   promotion; a 64-row tile always lies inside one 128-row scale block) and frees the stage.
// - Work items go to a persistent grid (<= 2 CTAs per SM): round-robin, or, when the caller gives
//   work counters, each CTA's first item by its index and the rest first come first served from
//   an atomic counter (a CTA on an SM that streams faster takes more items, so the CTAs finish
//   together instead of spreading over the last 2-3 items' time; the next item is claimed a few
//   stages before the current one ends, so the atomic's latency is hidden). The ring runs on
//   across items, so the producer is already streaming the next tile while the consumer finishes
//   this one. 12 stages x 8 KB of weights in flight per SM. The producer records each stage's
//   item (pass rows, weight rows, where its weight scale landed) beside the stage before it
//   arrives on the stage's barrier (release); the consumer reads it after its wait (acquire), and
//   a stage with no item ends the consumer. Every consumer thread arrives on the stage's empty
//   barrier itself, so each of its reads is ordered before the producer's next write there.
// - The weight scale of a stage comes with it (a 16-byte TMA box around the float), so the
//   consumer never waits on a global load of its own.
// - Programmatic dependent launch: the weights do not depend on the previous kernel, so the
//   producer issues the weight copies of the first ring fill before griddepcontrol.wait and the
//   activation / scale copies after it; the kernel lets its own dependents launch at once.
//
// - LoRA epilogue (MoeGemmLoraEpilogue, the kLora instance): each pass stages the slot deltas'
//   inputs u at its start and adds u . B^T to its accumulators with mma.sync before the store
//   (lora_pass_prepare / lora_pass_apply below; docs/gpu_moe.md §6.0c has what it measured).
//
// Rows of a pass past the expert's tokens and weight rows past N are computed but not stored
// (each output column depends only on its own activation row, so stale shared memory there
// cannot leak into stored values). Results are deterministic: one CTA owns each output element
// and accumulates its K blocks in order.
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/mma_ptx.cuh"
#include "core/sm90_ptx.cuh"
#include "core/tma_map.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/gemm/stream_gemm_common.cuh"

namespace moelora::ops::cuda {

namespace {

namespace sm90 = ::moelora::cuda::sm90;
using ::moelora::cuda::make_tensor_map_2d;
using stream_gemm::kMaxExperts;
using stream_gemm::kScheduleBytes;
using stream_gemm::Schedule;

constexpr int kBlockM = 64;     // weight rows per work item (the wgmma M of one warpgroup)
constexpr int kBlockK = 128;    // K per stage: one scale block
constexpr int kMaxTokens = 64;  // tokens per pass (the widest wgmma N instantiated)
constexpr int kTokenBox = 8;    // activation rows per TMA box
constexpr int kStages = 6;
constexpr int kConsumerThreads = 128;
constexpr int kThreads = kConsumerThreads + 32;  // + the producer warp
constexpr int kWeightTileBytes = kBlockM * kBlockK;
constexpr int kActTileBytes = kMaxTokens * kBlockK;
// A TMA box must start at a 16-byte aligned global address in its innermost dimension, and the
// scales of a pass start at any sorted position q0: the scale box starts at q0 rounded down to 4
// floats and is 4 floats wider than a pass (the consumer skips the q0 % 4 leading ones).
constexpr int kScaleBoxFloats = kMaxTokens + 4;
constexpr int kScaleTileBytes =
    512;  // >= kScaleBoxFloats * 4, keeps every stage's box 128-byte aligned
// The weight scale of the stage: a box of 4 floats starting at its index rounded down to 4 (16
// bytes, the smallest box), placed after the activation scales in the same tile.
constexpr int kWeightScaleBoxFloats = 4;
constexpr int kWeightScaleOffset = 384;
static_assert(kScaleBoxFloats * 4 <= kWeightScaleOffset &&
              kWeightScaleOffset + kWeightScaleBoxFloats * 4 <= kScaleTileBytes);
// Claim the next work item this many stages before the current item's last stage.
constexpr int kClaimAheadStages = 4;
// What the producer tells the consumer about a stage: the pass's sorted rows [q0, q_end) (q0 < 0:
// no more work), the item's first weight row, and which float of the weight-scale box is the one.
struct StageInfo {
  int q0, q_end, m0, scale_lane;
};
constexpr int kRingBytes = kStages * (kWeightTileBytes + kActTileBytes + kScaleTileBytes) +
                           2 * kStages * 8 + kStages * static_cast<int>(sizeof(StageInfo));
constexpr int kSmemBytes = kRingBytes + kScheduleBytes + 1024;  // + alignment slack

// The LoRA epilogue's staging area (kLora instance): per token of a pass, the expand's input u for
// 16 ranks as bf16 pairs, the high parts in words 0..7 and the rounding residues in 8..15 (u =
// hi + lo to ~16 bits: the expand runs on bf16 tensor cores without rounding u to bf16), and the
// token's slot. Rows are 20 words apart so a warp's fragment loads hit 32 different banks.
constexpr int kLoraRanksPerStep = 16;  // the k of one mma.m16n8k16
constexpr int kLoraRowWords = 20;
struct LoraScratch {
  uint32_t u[kMaxTokens][kLoraRowWords];
  int slot[kMaxTokens];
};
// Two CTAs per SM still fit: 2 x (kSmemBytes + the scratch) + 2 KB reserved <= 228 KB.
constexpr int kSmemBytesLora = kSmemBytes + static_cast<int>(sizeof(LoraScratch));
static_assert(2 * (kSmemBytesLora + 1024) <= 228 * 1024);

struct StreamParams {
  const int32_t* expert_offsets;  // [E + 1]
  const int32_t* active_experts;  // [E]
  const int32_t* num_active;      // [1]
  __nv_bfloat16* out;             // [P, N]
  int* work;  // [2] items claimed past the first gridDim.x, CTAs done; nullptr = round-robin
  int n, k_blocks, n_scale_blocks, m_tiles, num_experts;
  MoeGemmLoraEpilogue lora;  // the kLora instance only
};

// Shared-memory carve-up (addresses in the shared window; tiles 1024-byte aligned for the swizzle).
struct Ring {
  uint32_t base;
  __device__ uint32_t weight(int s) const { return base + s * kWeightTileBytes; }
  __device__ uint32_t act(int s) const {
    return base + kStages * kWeightTileBytes + s * kActTileBytes;
  }
  __device__ uint32_t scale(int s) const {
    return base + kStages * (kWeightTileBytes + kActTileBytes) + s * kScaleTileBytes;
  }
  __device__ uint32_t full(int s) const {
    return base + kStages * (kWeightTileBytes + kActTileBytes + kScaleTileBytes) + s * 8;
  }
  __device__ uint32_t empty(int s) const { return full(kStages) + s * 8; }
  __device__ uint32_t weight_scale(int s) const { return scale(s) + kWeightScaleOffset; }
  __device__ uint32_t info(int s) const { return full(2 * kStages) + s * sizeof(StageInfo); }
  __device__ uint32_t schedule() const { return base + kRingBytes; }
  __device__ uint32_t lora_scratch() const { return schedule() + kScheduleBytes; }
};

// wgmma N for a pass of n_valid tokens.
__device__ __forceinline__ int pass_width(int n_valid) {
  return n_valid <= 8 ? 8 : n_valid <= 16 ? 16 : n_valid <= 32 ? 32 : 64;
}

// The producer thread: walks its items (passes of <= 64 tokens, K blocks) and fills the ring.
__device__ __forceinline__ void producer(const Ring& ring, StageInfo* info, const Schedule& sched,
                                         const CUtensorMap* tma_w, const CUtensorMap* tma_x,
                                         const CUtensorMap* tma_sx, const CUtensorMap* tma_sw,
                                         const StreamParams& p) {
  sm90::prefetch_tensor_map(tma_w);
  sm90::prefetch_tensor_map(tma_x);
  sm90::prefetch_tensor_map(tma_sx);
  sm90::prefetch_tensor_map(tma_sw);
  const uint64_t evict_first = sm90::l2_evict_first_policy();
  auto issue_activations = [&](int s, int q0, int width, int kb) {
    for (int j = 0; j < width / kTokenBox; ++j)
      sm90::tma_load_2d(ring.act(s) + j * kTokenBox * kBlockK, tma_x, ring.full(s), kb * kBlockK,
                        q0 + j * kTokenBox);
    sm90::tma_load_2d(ring.scale(s), tma_sx, ring.full(s), q0 & ~3, kb);
  };
  // Activation copies of the first ring fill, held back until the previous kernel is done.
  stream_gemm::FirstFillGate<kStages> gate;
  int stage = 0;
  uint32_t phase = 0;
  const int total_items = sched.num_active * p.m_tiles;
  const int claim_at = p.k_blocks > kClaimAheadStages ? p.k_blocks - kClaimAheadStages : 0;
  int item = static_cast<int>(blockIdx.x);
  while (item < total_items) {
    const int expert = sched.active[item / p.m_tiles];
    const int m0 = (item % p.m_tiles) * kBlockM;
    const int q_end = sched.offsets[expert + 1];
    int next = -1;
    // an active expert always has tokens; an empty one (a stale list) is skipped
    for (int q0 = sched.offsets[expert]; q0 < q_end; q0 += kMaxTokens) {
      const int rows = q_end - q0 < kMaxTokens ? q_end - q0 : kMaxTokens;
      const int width = pass_width(rows);
      const bool last_pass = q0 + kMaxTokens >= q_end;
      const int scale_row = expert * p.n_scale_blocks + m0 / 128;
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        if (last_pass && kb == claim_at) next = stream_gemm::claim_item(p.work, item);
        sm90::mbar_wait(ring.empty(stage), phase ^ 1);
        const int scale_index = scale_row * p.k_blocks + kb;
        info[stage] = StageInfo{q0, q0 + rows, m0, scale_index & 3};
        sm90::mbar_arrive_expect_tx(
            ring.full(stage),
            kWeightTileBytes + width * kBlockK + kScaleBoxFloats * 4 + kWeightScaleBoxFloats * 4);
        sm90::tma_load_2d_hint(ring.weight(stage), tma_w, ring.full(stage), kb * kBlockK,
                               expert * p.n + m0, evict_first);
        sm90::tma_load_2d(ring.weight_scale(stage), tma_sw, ring.full(stage), scale_index & ~3, 0);
        gate.copy(stage, q0, width, kb, issue_activations);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    item = next >= 0 ? next : stream_gemm::claim_item(p.work, item);
  }
  gate.finish(issue_activations);
  // No more items: a stage whose record says so ends the consumer.
  sm90::mbar_wait(ring.empty(stage), phase ^ 1);
  info[stage] = StageInfo{-1, -1, 0, 0};
  sm90::mbar_arrive(ring.full(stage));
  // The last CTA to have made its final claim resets the counters for the next launch (no claim
  // of this launch can follow). Done here, not at the CTA's end, so that the round trip overlaps
  // the consumer's last stages.
  stream_gemm::release_work_counters(p.work);
}

// The four consumer warps only (the producer warp never joins): named barrier 1.
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

// Two B values (ranks r, r + 1 of one weight row) as an mma A-fragment register; ranks at or past
// the slot's rank read as zero (the pool's rank tail is never multiplied in).
__device__ __forceinline__ uint32_t lora_b_pair(const __nv_bfloat16* row, int r, int rank, bool row_ok) {
  if (!row_ok || r >= rank) return 0u;
  uint32_t v = *reinterpret_cast<const uint32_t*>(row + r);
  if (r + 1 >= rank) v &= 0xffffu;  // the low half is rank r
  return v;
}

// The LoRA delta of one pass (MoeGemmLoraEpilogue), in two halves around the pass's K loop so
// that the loads it needs (slots, ranks, shrink partials, B rows: L2 and HBM round trips under a
// saturated memory system, ~1 us each) overlap the weight stream instead of stalling the
// consumer after it: lora_pass_prepare at the start of the pass stages, per token, u for ranks
// 0..15 (partials summed over the K splits, times the slot's scaling, split into bf16 hi + lo) in
// shared memory and loads the B fragments of the pass's first slot run into registers;
// lora_pass_apply after the K loop runs, per slot run, mma(B rows of the warp's 16 weight rows,
// u of the run's tokens) for hi and lo into the accumulators, and handles ranks past 16 (staged
// then). Deterministic: fixed summation order, no atomics.
struct LoraPassState {
  int max_rank = 0;     // the largest rank among the pass's slots (0: nothing to add)
  int first_run = -1;   // start of the first run with rank > 0 whose B fragments are in `a`
  uint32_t a[4] = {0u, 0u, 0u, 0u};
};

// u of ranks r0 .. r0 + 15 for every token of the pass, into the scratch (slots staged).
template <int kWidth>
__device__ __forceinline__ void lora_stage_u(const StreamParams& p, const StageInfo& pass,
                                             LoraScratch& ls, int r0) {
  const MoeGemmLoraEpilogue& L = p.lora;
  const int R = L.max_rank;
  for (int e = threadIdx.x; e < kWidth * kLoraRanksPerStep; e += kConsumerThreads) {
    const int n = e / kLoraRanksPerStep, j = e % kLoraRanksPerStep, r = r0 + j;
    const int s = ls.slot[n];
    // The partial loads do not wait for the slot's rank (one round trip, not two): rows and
    // ranks without a delta may hold anything, so their sum is discarded by the select below.
    float sum = 0.f;
    if (s >= 0 && r < R) {
      const float* part = L.partial + static_cast<size_t>(pass.q0 + n) * R + r;
#pragma unroll 8
      for (int sp = 0; sp < L.splits; ++sp) sum += part[static_cast<size_t>(sp) * L.row_capacity * R];
    }
    const int rank = s >= 0 ? L.rank[s] : 0;
    const float scaling = s >= 0 ? L.scaling[s] : 0.f;
    const float u = r < rank ? sum * scaling : 0.f;
    const __nv_bfloat16 hi = __float2bfloat16(u);
    const __nv_bfloat16 lo = __float2bfloat16(u - __bfloat162float(hi));
    __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(ls.u[n]);
    row[j] = hi;
    row[kLoraRanksPerStep + j] = lo;
  }
}

// The B fragments of slot s (ranks r0 .. r0 + 15) for the warp's 16 weight rows.
__device__ __forceinline__ void lora_load_b(const StreamParams& p, const StageInfo& pass, int s,
                                            int expert, int r0, uint32_t (&a)[4]) {
  const MoeGemmLoraEpilogue& L = p.lora;
  const int R = L.max_rank, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int rank = L.rank[s];
  const int eb = (L.b_experts == 1 || (L.b_shared && L.b_shared[s])) ? 0 : expert;
  const __nv_bfloat16* b =
      L.b + (static_cast<size_t>(s) * L.b_experts + eb) * static_cast<size_t>(p.n) * R;
  const int row_a = pass.m0 + 16 * warp + lane / 4, row_b = row_a + 8;
  const int r = r0 + 2 * (lane % 4);
  a[0] = lora_b_pair(b + static_cast<size_t>(row_a) * R, r, rank, row_a < p.n);
  a[1] = lora_b_pair(b + static_cast<size_t>(row_b) * R, r, rank, row_b < p.n);
  a[2] = lora_b_pair(b + static_cast<size_t>(row_a) * R, r + 8, rank, row_a < p.n);
  a[3] = lora_b_pair(b + static_cast<size_t>(row_b) * R, r + 8, rank, row_b < p.n);
}

// End of the slot run that starts at token n0 (tokens of one expert are sorted by slot).
__device__ __forceinline__ int lora_run_end(const LoraScratch& ls, int n0, int n_valid) {
  int n1 = n0 + 1;
  while (n1 < n_valid && ls.slot[n1] == ls.slot[n0]) ++n1;
  return n1;
}

template <int kWidth>
__device__ __forceinline__ LoraPassState lora_pass_prepare(const StreamParams& p,
                                                           const StageInfo& pass, LoraScratch& ls) {
  const MoeGemmLoraEpilogue& L = p.lora;
  const int n_valid = pass.q_end - pass.q0;
  consumer_sync();  // the previous pass's readers are done with the scratch
  for (int n = threadIdx.x; n < kWidth; n += kConsumerThreads)
    ls.slot[n] = n < n_valid ? L.row_slot_expert[pass.q0 + n].x : -1;
  consumer_sync();
  LoraPassState st;
  lora_stage_u<kWidth>(p, pass, ls, 0);
  const int expert = L.row_slot_expert[pass.q0].y;
  for (int n0 = 0; n0 < n_valid;) {
    const int n1 = lora_run_end(ls, n0, n_valid);
    const int s = ls.slot[n0];
    const int rank = s >= 0 ? L.rank[s] : 0;
    st.max_rank = max(st.max_rank, rank);
    if (rank > 0 && st.first_run < 0) {
      st.first_run = n0;
      lora_load_b(p, pass, s, expert, 0, st.a);  // consumed after the K loop
    }
    n0 = n1;
  }
  consumer_sync();  // u staged
  return st;
}

template <int kWidth>
__device__ __forceinline__ void lora_pass_apply(float (&acc)[kWidth / 2], const StreamParams& p,
                                                const StageInfo& pass, LoraScratch& ls,
                                                const LoraPassState& st) {
  const MoeGemmLoraEpilogue& L = p.lora;
  const int lane = threadIdx.x % 32;
  const int n_valid = pass.q_end - pass.q0;
  const int expert = L.row_slot_expert[pass.q0].y;
  for (int r0 = 0; r0 < st.max_rank; r0 += kLoraRanksPerStep) {
    if (r0 > 0) {  // ranks past 16: staged now (the previous block's readers done first)
      consumer_sync();
      lora_stage_u<kWidth>(p, pass, ls, r0);
      consumer_sync();
    }
    for (int n0 = 0; n0 < n_valid;) {  // slot runs [n0, n1) of the pass
      const int n1 = lora_run_end(ls, n0, n_valid);
      const int s = ls.slot[n0];
      const int rank = s >= 0 ? L.rank[s] : 0;
      if (rank > r0) {
        uint32_t a[4];
        if (r0 == 0 && n0 == st.first_run) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = st.a[i];
        } else {
          lora_load_b(p, pass, s, expert, r0, a);
        }
#pragma unroll
        for (int c = 0; c < kWidth / 8; ++c) {
          if (8 * c + 8 <= n0 || 8 * c >= n1) continue;  // no token of the run in this block
          const int n = 8 * c + lane / 4;
          const bool in_run = n >= n0 && n < n1;
          const uint32_t* u = ls.u[n];
          const uint32_t hi0 = in_run ? u[lane % 4] : 0u, hi1 = in_run ? u[4 + lane % 4] : 0u;
          const uint32_t lo0 = in_run ? u[8 + lane % 4] : 0u, lo1 = in_run ? u[12 + lane % 4] : 0u;
          // The wgmma accumulator of a warp lays out its 16 rows x 8 tokens of block c exactly as
          // the mma's C fragment, so the delta lands in place.
          float d[4] = {acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3]};
          ::moelora::cuda::ptx::mma_bf16_16816(d, a, hi0, hi1);
          ::moelora::cuda::ptx::mma_bf16_16816(d, a, lo0, lo1);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[4 * c + i] = d[i];
        }
      }
      n0 = n1;
    }
  }
}

// One pass of <= kWidth tokens (rows [pass.q0, pass.q_end)) over all K blocks of an item, then
// its bf16 stores. Each stage's weight scale arrived with the stage.
template <int kWidth, bool kLora>
__device__ __forceinline__ void consume_pass(const Ring& ring, uint8_t* smem_generic,
                                             uint32_t smem_window, const StageInfo* info,
                                             int& stage, uint32_t& phase, const StreamParams& p,
                                             const StageInfo pass) {
  constexpr int kAcc = kWidth / 2;
  const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
  [[maybe_unused]] LoraScratch* lora_scratch =
      kLora ? reinterpret_cast<LoraScratch*>(smem_generic + (ring.lora_scratch() - smem_window))
            : nullptr;
  LoraPassState lora_state;
  if constexpr (kLora) lora_state = lora_pass_prepare<kWidth>(p, pass, *lora_scratch);
  float acc[kAcc], blk[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    sm90::mbar_wait(ring.full(stage), phase);
    const float sw = reinterpret_cast<const float*>(
        smem_generic + (ring.weight_scale(stage) - smem_window))[info[stage].scale_lane];
    const uint64_t desc_w = sm90::wgmma_desc_k_major_sw128(ring.weight(stage));
    const uint64_t desc_x = sm90::wgmma_desc_k_major_sw128(ring.act(stage));
#pragma unroll
    for (int i = 0; i < kAcc; ++i) sm90::fence_operand(blk[i]);
    sm90::wgmma_fence();
#pragma unroll
    for (int step = 0; step < kBlockK / 32;
         ++step)  // 32 bytes of K per step: +2 in the 16-byte address field
      sm90::WgmmaE4m3<kWidth>::mma(blk, desc_w + 2 * step, desc_x + 2 * step, step > 0);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) sm90::fence_operand(blk[i]);
    const float* sx =
        reinterpret_cast<const float*>(smem_generic + (ring.scale(stage) - smem_window)) +
        (pass.q0 & 3);
#pragma unroll
    for (int c = 0; c < kWidth / 8; ++c) {
      const float s0 = sw * sx[8 * c + 2 * (lane % 4)], s1 = sw * sx[8 * c + 2 * (lane % 4) + 1];
      acc[4 * c + 0] = fmaf(blk[4 * c + 0], s0, acc[4 * c + 0]);  // row r,     token 2t
      acc[4 * c + 1] = fmaf(blk[4 * c + 1], s1, acc[4 * c + 1]);  // row r,     token 2t + 1
      acc[4 * c + 2] = fmaf(blk[4 * c + 2], s0, acc[4 * c + 2]);  // row r + 8, token 2t
      acc[4 * c + 3] = fmaf(blk[4 * c + 3], s1, acc[4 * c + 3]);  // row r + 8, token 2t + 1
    }
    sm90::mbar_arrive(ring.empty(stage));  // every thread, after its last read of the stage
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
  if constexpr (kLora) lora_pass_apply<kWidth>(acc, p, pass, *lora_scratch, lora_state);
  const int n_valid = pass.q_end - pass.q0;
  const int row = pass.m0 + 16 * warp + lane / 4;
#pragma unroll
  for (int c = 0; c < kWidth / 8; ++c)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 8 * c + 2 * (lane % 4) + j;
      if (col >= n_valid) continue;
      __nv_bfloat16* out_row = p.out + static_cast<size_t>(pass.q0 + col) * p.n;
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (row + 8 * i < p.n) out_row[row + 8 * i] = __float2bfloat16(acc[4 * c + 2 * i + j]);
    }
}

template <bool kLora>
__global__ void __launch_bounds__(kThreads, 2)
    moe_gemm_fp8_stream_kernel(const __grid_constant__ CUtensorMap tma_w,
                               const __grid_constant__ CUtensorMap tma_x,
                               const __grid_constant__ CUtensorMap tma_sx,
                               const __grid_constant__ CUtensorMap tma_sw, const StreamParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const uint32_t window = ::moelora::cuda::ptx::smem_addr(smem);
  const Ring ring{(window + 1023u) & ~1023u};
  sm90::launch_dependents();
  // Routing schedule -> shared memory. It was written by the align kernel, which finished before
  // the kernel this one may overlap (the quant / activation kernel) started.
  int* sched_smem = reinterpret_cast<int*>(smem + (ring.schedule() - window));
  stream_gemm::stage_schedule(sched_smem, p.num_active, p.active_experts, p.expert_offsets, p.num_experts);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(ring.full(s), 1);                       // the producer's arrive.expect_tx
      sm90::mbar_init(ring.empty(s), kConsumerThreads);  // one arrival per consumer thread
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const Schedule sched = stream_gemm::schedule_view(sched_smem);
  StageInfo* info = reinterpret_cast<StageInfo*>(smem + (ring.info(0) - window));
  if (threadIdx.x >= kConsumerThreads) {
    if (threadIdx.x == kConsumerThreads)
      producer(ring, info, sched, &tma_w, &tma_x, &tma_sx, &tma_sw, p);
    return;
  }
  // The LoRA epilogue reads the shrink partials the previous kernel wrote: the consumers wait for
  // it too (they have nothing to do before the producer's first post-wait stage anyway).
  if constexpr (kLora) sm90::grid_dependency_wait();
  int stage = 0;
  uint32_t phase = 0;
  for (;;) {
    sm90::mbar_wait(ring.full(stage), phase);
    const StageInfo pass = info[stage];
    if (pass.q0 < 0) break;
    switch (pass_width(pass.q_end - pass.q0)) {
      case 8: consume_pass<8, kLora>(ring, smem, window, info, stage, phase, p, pass); break;
      case 16: consume_pass<16, kLora>(ring, smem, window, info, stage, phase, p, pass); break;
      case 32: consume_pass<32, kLora>(ring, smem, window, info, stage, phase, p, pass); break;
      default: consume_pass<64, kLora>(ring, smem, window, info, stage, phase, p, pass); break;
    }
  }
#else
  __trap();  // wgmma and TMA need sm_90a; the launcher refuses other devices
#endif
}

// The LoRA epilogue's arguments, named in the error (the kernel trusts them).
void check_lora_epilogue(const MoeGemmFp8Args& a) {
  const MoeGemmLoraEpilogue& l = a.lora;
  MOELORA_CHECK(l.scaling && l.rank && l.partial && l.row_slot_expert, ErrorCode::kInvalidArgument,
                "stream GEMM LoRA epilogue: scaling, rank, partial and row_slot_expert are required "
                "with B");
  MOELORA_CHECK(l.max_rank > 0 && l.max_rank % 8 == 0 && l.max_rank <= 256,
                ErrorCode::kInvalidArgument, "stream GEMM LoRA epilogue: max_rank = ", l.max_rank,
                " must be a positive multiple of 8, at most 256");
  const int lora_experts = a.num_experts - l.base_only_experts;
  MOELORA_CHECK(l.base_only_experts >= 0 && l.base_only_experts < a.num_experts,
                ErrorCode::kInvalidArgument,
                "stream GEMM LoRA epilogue: base_only_experts = ", l.base_only_experts,
                " (must be in [0, E = ", a.num_experts, "))");
  MOELORA_CHECK(l.num_slots > 0 && (l.b_experts == 1 || l.b_experts == lora_experts),
                ErrorCode::kInvalidArgument, "stream GEMM LoRA epilogue: ", l.num_slots,
                " slots and B expert extent ", l.b_experts,
                " (must be 1 or the experts with LoRA, ", lora_experts, " = E ", a.num_experts,
                " - ", l.base_only_experts, " base-only)");
  MOELORA_CHECK(l.splits > 0 && l.row_capacity >= a.act_rows, ErrorCode::kInvalidArgument,
                "stream GEMM LoRA epilogue: splits = ", l.splits, ", row_capacity = ",
                l.row_capacity, " (must be > 0 and >= act_rows = ", a.act_rows, ")");
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(l.b) % 4 == 0, ErrorCode::kInvalidArgument,
                "stream GEMM LoRA epilogue: B must be 4-byte aligned (rank pairs are one load)");
}

// Persistent grid: two CTAs per SM, fewer when there are fewer work items.
int stream_grid(const MoeGemmFp8Args& a, int num_sms) {
  const int m_tiles = (a.n + kBlockM - 1) / kBlockM;
  const int64_t items = static_cast<int64_t>(a.max_active_experts) * m_tiles;
  return static_cast<int>(std::min<int64_t>(items, 2LL * num_sms));
}

// Refuses devices without wgmma / TMA (the kernel body is built for sm_90a only) and raises the
// kernel's dynamic shared-memory limit, once per device (the attribute is per device). Neither is
// a stream operation, so a launch under graph capture may come here first.
void prepare_device_for_stream_kernel() {
  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::vector<bool> prepared;
  std::lock_guard<std::mutex> lock(mutex);
  if (device < static_cast<int>(prepared.size()) && prepared[device]) return;
  int major = 0, minor = 0;
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  MOELORA_CHECK(major == 9 && minor == 0, ErrorCode::kUnsupported, "stream GEMM: device ", device,
                " is sm_", major, minor, "; the kernel needs sm_90a (Hopper: wgmma and TMA)");
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(
      moe_gemm_fp8_stream_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_fp8_stream_kernel<true>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kSmemBytesLora));
  if (device >= static_cast<int>(prepared.size())) prepared.resize(device + 1, false);
  prepared[device] = true;
}

}  // namespace

void launch_moe_gemm_fp8_stream(const MoeGemmFp8Args& a, int num_sms, bool pdl,
                                cudaStream_t stream) {
  check_moe_gemm_fp8_args(a);
  MOELORA_CHECK(a.active_experts && a.num_active, ErrorCode::kInvalidArgument,
                "stream GEMM: active_experts and num_active are required");
  MOELORA_CHECK(a.gather == nullptr, ErrorCode::kInvalidArgument,
                "stream GEMM: activation rows must be in sorted order (gather = nullptr); the "
                "quant kernel permutes them");
  MOELORA_CHECK(a.act_rows > 0, ErrorCode::kInvalidArgument,
                "stream GEMM: act_rows (rows of the act buffer) = ", a.act_rows,
                " must be positive");
  MOELORA_CHECK(
      a.act_scale_ld >= a.act_rows && a.act_scale_ld % 4 == 0, ErrorCode::kInvalidArgument,
      "stream GEMM: act_scale must be k-major [K/128, ld] with ld >= act_rows = ", a.act_rows,
      " and a multiple of 4, got ld = ", a.act_scale_ld);
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(a.act_scale) % 16 == 0, ErrorCode::kInvalidArgument,
                "stream GEMM: act_scale must be 16-byte aligned");
  MOELORA_CHECK(static_cast<int64_t>(a.num_experts) * a.n < (1LL << 31),
                ErrorCode::kInvalidArgument,
                "stream GEMM: E * N = ", static_cast<int64_t>(a.num_experts) * a.n,
                " weight rows exceed 2^31");
  const int k_blocks = a.k / kBlockK;
  const CUtensorMap tma_w = make_tensor_map_2d(
      a.weight, CU_TENSOR_MAP_DATA_TYPE_UINT8, a.k, static_cast<uint64_t>(a.num_experts) * a.n, a.k,
      kBlockK, kBlockM, CU_TENSOR_MAP_SWIZZLE_128B, "the expert weights");
  const CUtensorMap tma_x =
      make_tensor_map_2d(a.act, CU_TENSOR_MAP_DATA_TYPE_UINT8, a.k, a.act_rows, a.k, kBlockK,
                         kTokenBox, CU_TENSOR_MAP_SWIZZLE_128B, "the activations");
  const CUtensorMap tma_sx =
      make_tensor_map_2d(a.act_scale, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, a.act_scale_ld, k_blocks,
                         static_cast<uint64_t>(a.act_scale_ld) * 4, kScaleBoxFloats, 1,
                         CU_TENSOR_MAP_SWIZZLE_NONE, "the activation scales");
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(a.weight_scale) % 16 == 0, ErrorCode::kInvalidArgument,
                "stream GEMM: weight_scale must be 16-byte aligned (TMA)");
  const uint64_t weight_scale_count =
      static_cast<uint64_t>(a.num_experts) * ((a.n + 127) / 128) * k_blocks;
  // All weight scales as one row; a stage loads the 4 floats around its own (16 bytes, aligned).
  const CUtensorMap tma_sw = make_tensor_map_2d(
      a.weight_scale, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, weight_scale_count, 1,
      (weight_scale_count * 4 + 15) / 16 * 16, kWeightScaleBoxFloats, 1,
      CU_TENSOR_MAP_SWIZZLE_NONE, "the weight scales");
  MOELORA_CHECK(a.num_experts <= kMaxExperts, ErrorCode::kUnsupported,
                "stream GEMM: E = ", a.num_experts,
                " experts; the kernel's shared-memory schedule holds at most ", kMaxExperts);
  StreamParams p{a.expert_offsets,
                 a.active_experts,
                 a.num_active,
                 a.out,
                 a.work_counters,
                 a.n,
                 k_blocks,
                 (a.n + 127) / 128,
                 (a.n + kBlockM - 1) / kBlockM,
                 a.num_experts,
                 a.lora};
  const bool lora = a.lora.b != nullptr;
  if (lora) check_lora_epilogue(a);

  prepare_device_for_stream_kernel();
  if (lora)
    ::moelora::cuda::launch_kernel(moe_gemm_fp8_stream_kernel<true>, dim3(stream_grid(a, num_sms)),
                                   dim3(kThreads), kSmemBytesLora, stream, pdl, tma_w, tma_x,
                                   tma_sx, tma_sw, p);
  else
    ::moelora::cuda::launch_kernel(moe_gemm_fp8_stream_kernel<false>, dim3(stream_grid(a, num_sms)),
                                   dim3(kThreads), kSmemBytes, stream, pdl, tma_w, tma_x, tma_sx,
                                   tma_sw, p);
}

}  // namespace moelora::ops::cuda
