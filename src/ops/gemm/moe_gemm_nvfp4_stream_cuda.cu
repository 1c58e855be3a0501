// Grouped NVFP4 expert GEMM. Decode (few tokens per expert): weight streaming, the packed codes and
// group scales of every touched expert read from HBM once per pass of up to 32 tokens, 0.5625 bytes
// per weight instead of FP8's 1. Prefill: the same expansion over 256-row x 128-token tiles, where
// the f16 tensor cores are the limit (Tiling below).
//
//   out[q, n] = act_scale[q] * row_scale[e, n] *
//               sum_k act[q, k] * e2m1(W[e, n, k]) * e4m3(s[e, n, k/16])
//
// Hopper has no FP4 tensor cores, so the weights are expanded in registers: swap-AB as the FP8
// stream kernel (moe_gemm_stream_cuda.cu), 64 weight rows per warpgroup on the wgmma M side, but A
// comes from registers (wgmma m64nNk16 f16, N = 8 .. 128 tokens) and the activations are f16 rows
// in shared memory. Per k16 step a consumer thread turns one 32-bit word of codes into its four A
// registers (signs and magnitudes shifted into f16 positions: e2m1 * 2^-14, exact) and multiplies
// each pair by its row's group scale (e4m3 -> f16 by cvt; the product has at most 5 significant
// bits and is never below 2^-24, so it is exact in f16). The accumulator therefore holds the exact
// sum over K and the per-row scale_2 (times 2^14) and the activation row's power-of-two scale are
// applied once at the store. The code words come in the order the threads read them
// (pack_nvfp4_for_stream), so a stage is two 16-byte shared loads of codes and one of scales per
// thread, bank-conflict free.
//
// Pipeline (one CTA = a producer warp + one, two or four consumer warpgroups; Tiling below):
// - The producer walks the CTA's work items (expert, 64- or 128-row tile, or for prefill expert,
//   256-row tile, pass; round-robin or claimed from work counters, as the FP8 kernel) and per
//   128-wide K block fills one stage of its ring:
//   one bulk copy per 64-row block of its 4,608-byte image (codes + scales; decode: L2 evict-first)
//   and TMA boxes of the pass's activation rows (two 64-column swizzle atoms per stage, 8-row
//   boxes; prefill: 64-row boxes first), shared by the warpgroups. Completion is counted in bytes
//   on the stage's mbarrier; the producer records the stage's pass beside it.
// - Each consumer warpgroup expands half a stage (four k16 steps; prefill: a quarter) of its
//   64-row block while the previous group runs, and frees a stage once its last group has
//   completed.
// - Programmatic dependent launch: the weights of the first ring fill are copied before
//   griddepcontrol.wait, the activations after it; the kernel lets its dependents launch at once.
// docs/gpu_nvfp4.md has what each design step measured.
//
// Rows of a pass past the expert's tokens are computed but not stored (each output column depends
// on its own activation row only). Deterministic: one CTA owns each output element and adds its K
// steps in order.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/mma_ptx.cuh"
#include "core/sm90_ptx.cuh"
#include "core/tma_map.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/gemm/moe_gemm_nvfp4.h"
#include "ops/gemm/nvfp4_launch_checks.cuh"
#include "ops/gemm/stream_gemm_common.cuh"

namespace moelora::ops::cuda {

namespace {

namespace sm90 = ::moelora::cuda::sm90;
using ::moelora::cuda::make_tensor_map_2d;
using stream_gemm::kMaxExperts;
using stream_gemm::kScheduleBytes;
using stream_gemm::Schedule;

constexpr int kBlockK = kNvfp4StreamK;  // 128 columns per stage
constexpr int kSteps = kBlockK / 16;    // wgmma k16 steps per stage
constexpr int kTokenBox = 8;            // activation rows per TMA box
constexpr int kWideBox = 64;            // activation rows per TMA box of a prefill pass
constexpr int kAtomColumns = 64;        // f16 columns of one 128-byte swizzle row
constexpr int kWeightBlockBytes = kNvfp4StreamBlockBytes;  // one 64-row block
constexpr int kClaimAheadStages = 4;
constexpr int kProducerRegs = 40;  // registers a thread of a producer warpgroup keeps (setmaxnreg)
// 2^14: the expanded codes are e2m1 * 2^-14 (moe_gemm_nvfp4.h)
constexpr float kCodeScale = 16384.0f;

struct StageInfo {
  int q0, q_end, m0, expert;
};

// The three instances. kWg consumer warpgroups per CTA, each expanding and multiplying 64 rows of
// the item's weight tile against the stage's one activation tile of up to kTokens rows:
// - <1, 32>, three CTAs per SM with 5-deep rings (69 KB of codes in flight per SM): 64-row items,
//   twice as many as <2, 32> has, so few tokens still spread over every SM;
// - <2, 32>, two CTAs per SM with 6-deep rings (110 KB in flight): half the activation bytes read
//   from L2 per weight byte, which decides at 17-32 tokens per expert (f16 rows of 32 tokens weigh
//   8 KB a stage against 4.6 KB of codes per 64 rows).
//   Either way several consumer warps per scheduler, which the issue-bound expansion needs to hide
//   its latencies; an item (expert, row tile) walks its expert's tokens in passes of 32.
// - <4, 128>, prefill (many tokens per expert): one CTA per SM, 256-row x 128-token tiles, 4-deep
//   rings of 50 KB. Tensor-core bound: a k16 step of m64n128 keeps a scheduler's tensor core busy
//   64 cycles against ~20 issue slots of expansion per warp, and four warps per scheduler hide each
//   other's expansion. 256 weight rows per activation tile halve the L2 reads of the f16 rows
//   (~2.5 TB/s at 650 TFLOP/s). Items are single passes, (expert, row tile, pass) with the pass
//   innermost, so the CTAs working on one weight tile at the same time read it from HBM once.
template <int kWg, int kTokens>
struct Tiling {
  static constexpr int kMaxTokens = kTokens;
  static constexpr bool kPassItems = kTokens > 32;        // work items are single passes (prefill)
  static constexpr int kBlockM = kNvfp4StreamRows * kWg;  // weight rows per work item
  static constexpr int kCtasPerSm = kPassItems ? 1 : kWg == 2 ? 2 : 3;
  static constexpr int kStages = kPassItems ? 4 : kWg == 2 ? 6 : 5;
  static constexpr int kConsumerThreads = 128 * kWg;
  // Decode: one producer warp. Prefill: a producer warpgroup (one warp of it works) that gives
  // registers to the consumers with setmaxnreg: the launch leaves 96 a thread (five warps per
  // scheduler), where 64 accumulators spill; the increase draws on the CTA's own pool, which only
  // holds what the producers released: 128 x (96 - 40) >= 512 x (104 - 96).
  static constexpr int kProducerThreads = kPassItems ? 128 : 32;
  static constexpr int kConsumerRegs = kPassItems ? 104 : 0;  // 0: no setmaxnreg
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  static constexpr int kAtomBytes = kTokens * 128;      // one 64-column atom of a pass's rows
  static constexpr int kActTileBytes = 2 * kAtomBytes;  // 128 columns
  static constexpr int kWeightStageBytes = kWeightBlockBytes * kWg;
  static constexpr int kRingBytes = kStages * (kActTileBytes + kWeightStageBytes) +
                                    2 * kStages * 8 + kStages * static_cast<int>(sizeof(StageInfo));
  // pass items: the first item of each active expert ([kMaxExperts + 1] ints)
  static constexpr int kItemTableBytes = kPassItems ? (kMaxExperts + 1) * 4 : 0;
  static constexpr int kSmemBytes =
      kRingBytes + kScheduleBytes + kItemTableBytes + 1024;  // + alignment slack
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "kCtasPerSm CTAs per SM");
  static_assert(kActTileBytes % 1024 == 0);
};
using DecodeNarrow = Tiling<1, 32>;
using DecodeWide = Tiling<2, 32>;
using Prefill = Tiling<4, 128>;
static_assert(kWeightBlockBytes % 16 == 0);

struct StreamParams {
  const uint8_t* weight;          // image [E, N/64, K/128, 4608]
  const float* row_scale;         // [E, N]
  const float* act_scale;         // [act_rows]
  const int32_t* expert_offsets;  // [E + 1]
  const int32_t* active_experts;  // [E]
  const int32_t* num_active;      // [1]
  __nv_bfloat16* out;             // [P, N]
  int* work;
  int n, k_blocks, m_tiles, num_experts;  // m_tiles: items per expert (N / kBlockM)
};

// Activation tiles first (1024-byte aligned for the swizzle), then the weight blocks, barriers,
// stage records, the schedule, the item table.
template <class T>
struct Ring {
  static constexpr int kStages = T::kStages, kWeightStageBytes = T::kWeightStageBytes,
                       kActTileBytes = T::kActTileBytes;
  uint32_t base;
  __device__ uint32_t act(int s) const { return base + s * kActTileBytes; }
  __device__ uint32_t weight(int s) const {
    return base + kStages * kActTileBytes + s * kWeightStageBytes;
  }
  __device__ uint32_t full(int s) const {
    return base + kStages * (kActTileBytes + kWeightStageBytes) + s * 8;
  }
  __device__ uint32_t empty(int s) const { return full(kStages) + s * 8; }
  __device__ uint32_t info(int s) const { return full(2 * kStages) + s * sizeof(StageInfo); }
  __device__ uint32_t schedule() const { return base + T::kRingBytes; }
  __device__ uint32_t item_table() const { return schedule() + kScheduleBytes; }
};

// The wgmma N of a pass of n_valid tokens (an instance's passes hold up to kTokens).
template <int kTokens>
__device__ __forceinline__ int pass_width(int n_valid) {
  if (n_valid <= 8) return 8;
  if (n_valid <= 16) return 16;
  if (kTokens == 32 || n_valid <= 32) return 32;
  return n_valid <= 64 ? 64 : n_valid <= 96 ? 96 : 128;
}

// Pass items (Tiling::kPassItems): table[i] = the first item of active expert i, table[num_active]
// = the item count; an expert of t tokens has ceil(t / kTokens) passes per row tile. Computed by
// the producer warp with a warp scan over the staged schedule.
template <class T>
__device__ __forceinline__ void build_item_table(int* table, const Schedule& sched, int m_tiles) {
  const int lane = threadIdx.x % 32;
  int carry = 0;
  for (int base = 0; base < sched.num_active; base += 32) {
    const int i = base + lane;
    int count = 0;
    if (i < sched.num_active) {
      const int e = sched.active[i];
      count =
          (sched.offsets[e + 1] - sched.offsets[e] + T::kMaxTokens - 1) / T::kMaxTokens * m_tiles;
    }
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, count, d);
      if (lane >= d) count += up;
    }
    if (i < sched.num_active) table[i + 1] = carry + count;
    carry += __shfl_sync(0xffffffffu, count, 31);
  }
  if (lane == 0) table[0] = 0;
  __syncwarp();
}

// The (expert, row tile, first token) of pass item `item` (< table[num_active]).
template <class T>
__device__ __forceinline__ void locate_pass_item(const int* table, const Schedule& sched,
                                                 int m_tiles, int item, int& expert, int& tile,
                                                 int& q0) {
  int lo = 0, hi = sched.num_active - 1;  // the last i with table[i] <= item
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid] <= item)
      lo = mid;
    else
      hi = mid - 1;
  }
  expert = sched.active[lo];
  const int passes = (table[lo + 1] - table[lo]) / m_tiles;
  const int r = item - table[lo];
  tile = r / passes;
  q0 = sched.offsets[expert] + (r % passes) * T::kMaxTokens;
}

template <class T>
__device__ __forceinline__ void producer(const Ring<T>& ring, StageInfo* info,
                                         const Schedule& sched, const int* item_table,
                                         const CUtensorMap* tma_x, const CUtensorMap* tma_x_wide,
                                         const StreamParams& p) {
  constexpr int kStages = T::kStages, kWeightStageBytes = T::kWeightStageBytes;
  sm90::prefetch_tensor_map(tma_x);
  if constexpr (T::kPassItems) sm90::prefetch_tensor_map(tma_x_wide);
  // Decode: every weight byte is read once per pass and by one CTA. Prefill: the CTAs on the
  // passes of one row tile read it at about the same time.
  const uint64_t weight_policy =
      T::kPassItems ? sm90::l2_evict_normal_policy() : sm90::l2_evict_first_policy();
  // A pass's rows: boxes of kWideBox rows (prefill) and then of kTokenBox; 8-row-aligned boxes
  // land in the same swizzled layout whatever their height.
  auto issue_activations = [&](int s, int q0, int width, int kb) {
    for (int atom = 0; atom < 2; ++atom) {
      const uint32_t dst = ring.act(s) + atom * T::kAtomBytes;
      const int column = kb * kBlockK + atom * kAtomColumns;
      int j = 0;
      if constexpr (T::kPassItems)
        for (; j + kWideBox <= width; j += kWideBox)
          sm90::tma_load_2d(dst + j * 128, tma_x_wide, ring.full(s), column, q0 + j);
      for (; j < width; j += kTokenBox)
        sm90::tma_load_2d(dst + j * 128, tma_x, ring.full(s), column, q0 + j);
    }
  };
  stream_gemm::FirstFillGate<kStages> gate;
  int stage = 0;
  uint32_t phase = 0;
  const int claim_at = p.k_blocks > kClaimAheadStages ? p.k_blocks - kClaimAheadStages : 0;
  int next = -1;
  // One pass of the item's weight tile: every K block as a stage. The CTA's next item is claimed a
  // few stages before the end of its last pass, so its first stages follow without a gap.
  auto stream_pass = [&](int item, int expert, int tile, int q0, int rows, bool last_pass) {
    const int width = pass_width<T::kMaxTokens>(rows);
    // the item's 64-row blocks: tiles kWg * tile + w of the image, K blocks contiguous
    const uint8_t* blocks = p.weight + (static_cast<size_t>(expert) * p.m_tiles + tile) *
                                           (T::kBlockM / 64) * p.k_blocks * kWeightBlockBytes;
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      if (last_pass && kb == claim_at) next = stream_gemm::claim_item(p.work, item);
      sm90::mbar_wait(ring.empty(stage), phase ^ 1);
      info[stage] = StageInfo{q0, q0 + rows, tile * T::kBlockM, expert};
      sm90::mbar_arrive_expect_tx(ring.full(stage), kWeightStageBytes + 2 * width * 128);
      for (int w = 0; w < T::kBlockM / 64; ++w)
        sm90::bulk_load_hint(
            ring.weight(stage) + w * kWeightBlockBytes,
            blocks + (static_cast<size_t>(w) * p.k_blocks + kb) * kWeightBlockBytes,
            kWeightBlockBytes, ring.full(stage), weight_policy);
      gate.copy(stage, q0, width, kb, issue_activations);
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  };
  const int total_items =
      T::kPassItems ? item_table[sched.num_active] : sched.num_active * p.m_tiles;
  int item = static_cast<int>(blockIdx.x);
  while (item < total_items) {
    next = -1;
    if constexpr (T::kPassItems) {
      int expert, tile, q0;
      locate_pass_item<T>(item_table, sched, p.m_tiles, item, expert, tile, q0);
      const int q_end = sched.offsets[expert + 1];
      stream_pass(item, expert, tile, q0, min(q_end - q0, T::kMaxTokens), true);
    } else {
      const int expert = sched.active[item / p.m_tiles];
      const int tile = item % p.m_tiles;
      const int q_end = sched.offsets[expert + 1];
      for (int q0 = sched.offsets[expert]; q0 < q_end; q0 += T::kMaxTokens)
        stream_pass(item, expert, tile, q0, min(q_end - q0, T::kMaxTokens),
                    q0 + T::kMaxTokens >= q_end);
    }
    item = next >= 0 ? next : stream_gemm::claim_item(p.work, item);
  }
  gate.finish(issue_activations);
  sm90::mbar_wait(ring.empty(stage), phase ^ 1);
  info[stage] = StageInfo{-1, -1, 0, 0};
  sm90::mbar_arrive(ring.full(stage));
  stream_gemm::release_work_counters(p.work);
}

// Eight e2m1 codes of one word (moe_gemm_nvfp4.h) -> the four f16x2 A registers, each value
// e2m1 * 2^-14: a_i's sign bits sit at 15 - i / 31 - i and its magnitude bits (exponent 2,
// mantissa 1) at 9 - 3 i .. / 25 - 3 i .., so shifting the word left by i and 3 i puts them at
// 15 / 31 and 9-11 / 25-27, where an f16 (exponent bias 15) reads 2^(e - 15) (1 + m / 2) = e2m1 *
// 2^-14 (e = 0 is the subnormal 0.5 * 2^-14, again exact). Five left shifts (IMAD, the FMA pipe)
// and seven logic ops for the four registers; a_0 is one mask.
__device__ __forceinline__ void expand_codes(uint32_t q, uint32_t (&h)[4]) {
  constexpr uint32_t kSign = 0x80008000u, kMagnitude = 0x0E000E00u;
  const uint32_t q3 = q << 3;
  h[0] = q & (kSign | kMagnitude);
  h[1] = ((q << 1) & kSign) | (q3 & kMagnitude);
  h[2] = ((q << 2) & kSign) | ((q << 6) & kMagnitude);
  h[3] = (q3 & kSign) | ((q << 9) & kMagnitude);
}

__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, __half2 b) {
  __half2 x = *reinterpret_cast<__half2*>(&a);
  x = __hmul2(x, b);
  return *reinterpret_cast<uint32_t*>(&x);
}

// The shared-memory words of group g of a stage (kGroupSteps k16 steps: kGroupSteps g ..): one
// 32-bit code word per step (one 16- or 8-byte load) and the row pair's group scales (bytes 2 j /
// 2 j + 1 of its 16 are rows r / r + 8 of step j).
template <int kGroupSteps>
struct GroupWords {
  uint32_t codes[kGroupSteps], scales[kGroupSteps / 2];
};
// A consumer thread's byte offsets inside a 64-row block: its code words of group 0 (decode: a
// half stage of four steps, 16 bytes; group 1 is kHalfStageCodeBytes further) and its row pair's
// scales (16 bytes: steps 0-3 of the stage, then 4-7).
struct ThreadOffsets {
  uint32_t codes, scales;
};
constexpr uint32_t kHalfStageCodeBytes = 128 * 16;
__device__ __forceinline__ ThreadOffsets thread_offsets(int thread) {
  const int pair = (thread / 32) * 8 + (thread % 32) / 4;
  return {static_cast<uint32_t>(thread) * 16,
          static_cast<uint32_t>(kNvfp4StreamCodeBytes + pair * 16)};
}
// Decode: half h of a stage (four k16 steps, a 16-byte code load; `scales` is the thread's 16 scale
// bytes of the stage, steps 0-3 then 4-7).
__device__ __forceinline__ GroupWords<4> load_half_words(uint32_t block, ThreadOffsets at, int half,
                                                         uint4 scales) {
  const uint4 c =
      ::moelora::cuda::ptx::ld_shared_v4_u32(block + half * kHalfStageCodeBytes + at.codes);
  return {{c.x, c.y, c.z, c.w}, {half == 0 ? scales.x : scales.z, half == 0 ? scales.y : scales.w}};
}
// Prefill: quarter q of a stage (two k16 steps: 8 bytes of the half's 16-byte code words, one
// scale word).
__device__ __forceinline__ GroupWords<2> load_quarter_words(uint32_t block, ThreadOffsets at,
                                                            int quarter) {
  namespace ptx = ::moelora::cuda::ptx;
  const uint2 c = ptx::ld_shared_v2_u32(block + (quarter / 2) * kHalfStageCodeBytes + at.codes +
                                        (quarter % 2) * 8);
  return {{c.x, c.y}, {ptx::ld_shared_u32(block + at.scales + quarter * 4)}};
}

// A group's words -> its A registers: codes expanded and multiplied by their group scales.
template <int kGroupSteps>
__device__ __forceinline__ void expand_group(const GroupWords<kGroupSteps>& w,
                                             uint32_t (&a)[kGroupSteps][4]) {
#pragma unroll
  for (int j = 0; j < kGroupSteps; ++j) {
    const __nv_fp8x2_storage_t pair_bits =
        static_cast<__nv_fp8x2_storage_t>(w.scales[j / 2] >> (16 * (j % 2)));
    const __half2 s =
        __half2(__nv_cvt_fp8x2_to_halfraw2(pair_bits, __NV_E4M3));  // (row r, row r + 8)
    const __half2 s_lo = __low2half2(s), s_hi = __high2half2(s);
    uint32_t h[4];
    expand_codes(w.codes[j], h);
    a[j][0] = hmul2_bits(h[0], s_lo);
    a[j][1] = hmul2_bits(h[1], s_hi);
    a[j][2] = hmul2_bits(h[2], s_lo);
    a[j][3] = hmul2_bits(h[3], s_hi);
  }
}

// Group g of a stage (kGroupSteps k16 steps) as one committed wgmma group on A registers `a`,
// accumulating onto acc (zeroed before a pass's first group, so every wgmma accumulates and no
// predicate is computed per stage). desc_stage is the wgmma descriptor of the stage's activation
// tile: steps 0-3 read its first 64-column atom, 4-7 the second, 32 bytes of K per step inside the
// atom's 128-byte rows (descriptor units of 16 bytes).
template <int kWidth, int kAtomBytes, int kGroupSteps>
__device__ __forceinline__ void issue_group(uint64_t desc_stage, int group,
                                            float (&acc)[kWidth / 2],
                                            uint32_t (&a)[kGroupSteps][4]) {
  const int step0 = group * kGroupSteps;
  const uint64_t desc_x = desc_stage + (step0 / 4) * (kAtomBytes >> 4) + 2 * (step0 % 4);
  sm90::wgmma_fence();  // orders the A registers just written before the wgmma reads them
#pragma unroll
  for (int j = 0; j < kGroupSteps; ++j)
    sm90::WgmmaF16Rs<kWidth>::mma(acc, a[j], desc_x + 2 * j, true);
  sm90::wgmma_commit();
}

template <int kWidth, class T>
__device__ __forceinline__ void consume_pass(const Ring<T>& ring, int& stage, uint32_t& phase,
                                             const StreamParams& p, const StageInfo pass) {
  constexpr int kAcc = kWidth / 2;
  // warpgroup wg multiplies rows 64 wg .. 64 wg + 63 of the item (its own weight block)
  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) sm90::fence_operand(acc[i]);
  // Two sets of A registers: group g + 1 is expanded while group g runs. A stage is freed once its
  // last group is done (its activations are read by the wgmma from shared memory until then).
  // Decode: half-stage groups. Prefill: quarter-stage groups (beside 64 accumulators).
  int previous = -1;
  if constexpr (!T::kPassItems) {
    // Decode: half-stage groups, group h + 1 expanded while group h runs; after each commit at most
    // one group stays in flight, so the other A register set may be rewritten. The per-stage
    // bookkeeping is kept small (the kernel is issue-bound): one descriptor base and one block
    // address per stage, both halves' scales in one 16-byte load.
    namespace ptx = ::moelora::cuda::ptx;
    uint32_t a_first[kSteps / 2][4], a_second[kSteps / 2][4];
    const ThreadOffsets offsets = thread_offsets(threadIdx.x % 128);
    const uint64_t desc_ring = sm90::wgmma_desc_k_major_sw128(ring.act(0));
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      sm90::mbar_wait(ring.full(stage), phase);
      const uint32_t block = ring.weight(stage) + wg * kWeightBlockBytes;
      const uint64_t desc_stage = desc_ring + stage * (T::kActTileBytes >> 4);
      const uint4 scales = ptx::ld_shared_v4_u32(block + offsets.scales);
      expand_group<kSteps / 2>(load_half_words(block, offsets, 0, scales), a_first);
      issue_group<kWidth, T::kAtomBytes, kSteps / 2>(desc_stage, 0, acc, a_first);
      sm90::wgmma_wait<1>();
      if (previous >= 0) sm90::mbar_arrive(ring.empty(previous));
      expand_group<kSteps / 2>(load_half_words(block, offsets, 1, scales), a_second);
      issue_group<kWidth, T::kAtomBytes, kSteps / 2>(desc_stage, 1, acc, a_second);
      sm90::wgmma_wait<1>();
      previous = stage;
      if (++stage == T::kStages) stage = 0, phase ^= 1;
    }
  } else {
    // Quarter-stage groups (two k16 steps), two A register sets, and the next group's words read
    // from shared memory before the current group is issued, so neither the shared-memory latency
    // nor the expansion waits for the tensor cores (ncu: the shared loads right before the
    // expansion were 44 % of the stalls).
    constexpr int kGroups = 4, kGroupSteps = kSteps / kGroups;
    const ThreadOffsets offsets = thread_offsets(threadIdx.x % 128);
    uint32_t a[2][kGroupSteps][4];
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      sm90::mbar_wait(ring.full(stage), phase);
      const uint32_t block = ring.weight(stage) + wg * kWeightBlockBytes;
      const uint64_t desc_stage = sm90::wgmma_desc_k_major_sw128(ring.act(stage));
      GroupWords<kGroupSteps> words = load_quarter_words(block, offsets, 0);
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        expand_group<kGroupSteps>(words, a[g % 2]);
        if (g + 1 < kGroups) words = load_quarter_words(block, offsets, g + 1);
        issue_group<kWidth, T::kAtomBytes, kGroupSteps>(desc_stage, g, acc, a[g % 2]);
        sm90::wgmma_wait<1>();  // group g - 1 is done: its A set may be rewritten
        if (g == 0 && previous >= 0) sm90::mbar_arrive(ring.empty(previous));
      }
      previous = stage;
      if (++stage == T::kStages) stage = 0, phase ^= 1;
    }
  }
  sm90::wgmma_wait<0>();
  sm90::mbar_arrive(ring.empty(previous));
#pragma unroll
  for (int i = 0; i < kAcc; ++i) sm90::fence_operand(acc[i]);
  const int n_valid = pass.q_end - pass.q0;
  const int row = pass.m0 + kNvfp4StreamRows * wg + 16 * warp + lane / 4;
  const float* rs = p.row_scale + static_cast<size_t>(pass.expert) * p.n;
  const float rs0 = rs[row] * kCodeScale, rs1 = rs[row + 8] * kCodeScale;
#pragma unroll
  for (int c = 0; c < kWidth / 8; ++c)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 8 * c + 2 * (lane % 4) + j;
      if (col >= n_valid) continue;
      const float sx = p.act_scale[pass.q0 + col];
      __nv_bfloat16* out_row = p.out + static_cast<size_t>(pass.q0 + col) * p.n;
      out_row[row] = __float2bfloat16(acc[4 * c + j] * (rs0 * sx));
      out_row[row + 8] = __float2bfloat16(acc[4 * c + 2 + j] * (rs1 * sx));
    }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kCtasPerSm)
    moe_gemm_nvfp4_stream_kernel(const __grid_constant__ CUtensorMap tma_x,
                                 const __grid_constant__ CUtensorMap tma_x_wide,
                                 const StreamParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const uint32_t window = ::moelora::cuda::ptx::smem_addr(smem);
  const Ring<T> ring{(window + 1023u) & ~1023u};
  sm90::launch_dependents();
  int* sched_smem = reinterpret_cast<int*>(smem + (ring.schedule() - window));
  stream_gemm::stage_schedule(sched_smem, p.num_active, p.active_experts, p.expert_offsets,
                              p.num_experts);
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      sm90::mbar_init(ring.full(s), 1);
      sm90::mbar_init(ring.empty(s), T::kConsumerThreads);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const Schedule sched = stream_gemm::schedule_view(sched_smem);
  StageInfo* info = reinterpret_cast<StageInfo*>(smem + (ring.info(0) - window));
  if (threadIdx.x >= T::kConsumerThreads) {  // the producer warp (or warpgroup)
    if constexpr (T::kConsumerRegs > 0) sm90::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x >= T::kConsumerThreads + 32) return;
    int* item_table = reinterpret_cast<int*>(smem + (ring.item_table() - window));
    if constexpr (T::kPassItems) build_item_table<T>(item_table, sched, p.m_tiles);
    if (threadIdx.x == T::kConsumerThreads)
      producer(ring, info, sched, item_table, &tma_x, &tma_x_wide, p);
    return;
  }
  if constexpr (T::kConsumerRegs > 0) sm90::setmaxnreg_inc<T::kConsumerRegs>();
  // The epilogue reads the activation scales the previous kernel wrote.
  sm90::grid_dependency_wait();
  int stage = 0;
  uint32_t phase = 0;
  for (;;) {
    sm90::mbar_wait(ring.full(stage), phase);
    const StageInfo pass = info[stage];
    if (pass.q0 < 0) break;
    switch (pass_width<T::kMaxTokens>(pass.q_end - pass.q0)) {
      case 8: consume_pass<8, T>(ring, stage, phase, p, pass); break;
      case 16: consume_pass<16, T>(ring, stage, phase, p, pass); break;
      case 32: consume_pass<32, T>(ring, stage, phase, p, pass); break;
      default:
        if constexpr (T::kMaxTokens > 32) {
          const int rows = pass.q_end - pass.q0;
          if (rows <= 64)
            consume_pass<64, T>(ring, stage, phase, p, pass);
          else if (rows <= 96)
            consume_pass<96, T>(ring, stage, phase, p, pass);
          else
            consume_pass<128, T>(ring, stage, phase, p, pass);
        }
        break;
    }
  }
#else
  __trap();  // wgmma and TMA need sm_90a; the launcher refuses other devices
#endif
}

template <class T>
int stream_grid(const MoeGemmNvfp4Args& a, int num_sms) {
  const int64_t items = static_cast<int64_t>(a.max_active_experts) * (a.n / T::kBlockM);
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(items, static_cast<int64_t>(T::kCtasPerSm) * num_sms)));
}

template <class T>
void launch_instance(const CUtensorMap& tma_x, const CUtensorMap& tma_x_wide,
                     const MoeGemmNvfp4Args& a, int num_sms, bool pdl, cudaStream_t stream) {
  const StreamParams p{
      a.weight, a.row_scale,     a.act_scale, a.expert_offsets, a.active_experts, a.num_active,
      a.out,    a.work_counters, a.n,         a.k / kBlockK,    a.n / T::kBlockM, a.num_experts};
  nvfp4_launch::prepare_kernel(reinterpret_cast<const void*>(moe_gemm_nvfp4_stream_kernel<T>),
                               T::kSmemBytes, "NVFP4 stream GEMM");
  ::moelora::cuda::launch_kernel(moe_gemm_nvfp4_stream_kernel<T>, dim3(stream_grid<T>(a, num_sms)),
                                 dim3(T::kThreads), T::kSmemBytes, stream, pdl, tma_x, tma_x_wide,
                                 p);
}

}  // namespace

void launch_moe_gemm_nvfp4_stream(const MoeGemmNvfp4Args& a, int num_sms, bool pdl,
                                  cudaStream_t stream) {
  nvfp4_launch::check_args(a, DecodeWide::kBlockM, kBlockK, "NVFP4 stream GEMM");
  // The f16 rows as TMA boxes of `rows` x 64 columns (128-byte swizzle).
  auto activation_map = [&](uint32_t rows, const char* what) {
    return make_tensor_map_2d(a.act, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, a.k, a.act_rows,
                              static_cast<uint64_t>(a.k) * 2, kAtomColumns, rows,
                              CU_TENSOR_MAP_SWIZZLE_128B, what);
  };
  const CUtensorMap tma_x = activation_map(kTokenBox, "the f16 activation rows");
  // Prefill-sized passes (more than kPrefillMinTokens tokens for the busiest expert): 256-row x
  // 128-token tiles, tensor-core bound, whose full 64-row blocks of a pass come as 64-row boxes (a
  // 128-token stage is 4 copies instead of 32). Decode: two warpgroups per CTA once a pass may be
  // wider than 16 tokens (the activation bytes per weight byte then decide), one below (more,
  // smaller items for few tokens); they never read the wide map.
  switch (nvfp4_stream_instance(a)) {
    case Nvfp4StreamInstance::kPrefill:
      launch_instance<Prefill>(tma_x,
                               activation_map(kWideBox, "the f16 activation rows (prefill boxes)"),
                               a, num_sms, pdl, stream);
      break;
    case Nvfp4StreamInstance::kWide:
      launch_instance<DecodeWide>(tma_x, tma_x, a, num_sms, pdl, stream);
      break;
    default: launch_instance<DecodeNarrow>(tma_x, tma_x, a, num_sms, pdl, stream);
  }
}

Nvfp4StreamInstance nvfp4_stream_instance(const MoeGemmNvfp4Args& a) {
  const bool prefill_fits = a.n % Prefill::kBlockM == 0;
  if (a.instance == Nvfp4StreamInstance::kPrefill)
    MOELORA_CHECK(prefill_fits, ErrorCode::kInvalidArgument,
                  "NVFP4 stream GEMM: the prefill instance needs N a multiple of ",
                  Prefill::kBlockM, "; N = ", a.n, " (use the narrow or wide instance, or auto)");
  if (a.instance != Nvfp4StreamInstance::kAuto) return a.instance;
  if (a.max_tokens_per_expert > kNvfp4PrefillMinTokens && prefill_fits)
    return Nvfp4StreamInstance::kPrefill;
  return a.max_tokens_per_expert > 16 ? Nvfp4StreamInstance::kWide : Nvfp4StreamInstance::kNarrow;
}

}  // namespace moelora::ops::cuda
