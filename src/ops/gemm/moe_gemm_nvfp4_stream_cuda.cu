// Weight-streaming grouped NVFP4 expert GEMM for decode (few tokens per expert): the packed codes
// and group scales of every touched expert are read from HBM once per pass of up to 32 tokens,
// 0.5625 bytes per weight instead of FP8's 1.
//
//   out[q, n] = act_scale[q] * row_scale[e, n] * sum_k act[q, k] * e2m1(W[e, n, k]) * e4m3(s[e, n, k/16])
//
// Hopper has no FP4 tensor cores, so the weights are expanded in registers: swap-AB as the FP8
// stream kernel (moe_gemm_stream_cuda.cu), 64 weight rows per warpgroup on the wgmma M side, but A comes from
// registers (wgmma m64nNk16 f16, N = 8 / 16 / 32 tokens) and the activations are f16 rows in shared
// memory. Per k16 step a consumer thread turns one 32-bit word of codes into its four A registers
// (signs and magnitudes shifted into f16 positions: e2m1 * 2^-14, exact) and multiplies each pair by
// its row's group scale (e4m3 -> f16 by cvt; the product has at most 5 significant bits and is never
// below 2^-24, so it is exact in f16). The accumulator therefore holds the exact sum over K and the
// per-row scale_2 (times 2^14) and the activation row's power-of-two scale are applied once at the
// store. The code words come in the order the threads read them (pack_nvfp4_for_stream), so a stage
// is two 16-byte shared loads of codes and one of scales per thread, bank-conflict free.
//
// Pipeline (one CTA = a producer warp + one or two consumer warpgroups; Tiling below):
// - The producer walks the CTA's work items (expert, 64- or 128-row tile; round-robin or claimed
//   from work counters, as the FP8 kernel) and per 128-wide K block fills one stage of its ring:
//   one bulk copy per 64-row block of its 4,608-byte image (codes + scales, L2 evict-first) and
//   TMA boxes of the pass's activation rows (two 64-column swizzle atoms per stage, 8-row boxes),
//   shared by the warpgroups. Completion is counted in bytes on the stage's mbarrier; the producer
//   records the stage's pass beside it.
// - Each consumer warpgroup expands half a stage (four k16 steps) of its 64-row block while the
//   previous half's wgmma group runs, and frees a stage once its last group has completed.
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
#include <mutex>
#include <vector>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/mma_ptx.cuh"
#include "core/sm90_ptx.cuh"
#include "core/tma_map.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/gemm/moe_gemm_nvfp4.h"
#include "ops/gemm/stream_gemm_common.cuh"

namespace moelora::ops::cuda {

namespace {

namespace sm90 = ::moelora::cuda::sm90;
using ::moelora::cuda::make_tensor_map_2d;
using stream_gemm::kMaxExperts;
using stream_gemm::kScheduleBytes;
using stream_gemm::Schedule;

constexpr int kBlockK = kNvfp4StreamK;     // 128 columns per stage
constexpr int kSteps = kBlockK / 16;       // wgmma k16 steps per stage
constexpr int kMaxTokens = 32;             // tokens per pass (the widest wgmma N instantiated)
constexpr int kTokenBox = 8;               // activation rows per TMA box
constexpr int kAtomColumns = 64;           // f16 columns of one 128-byte swizzle row
constexpr int kAtomBytes = kMaxTokens * 128;        // one 64-column atom of a pass's rows
constexpr int kActTileBytes = 2 * kAtomBytes;       // 128 columns
constexpr int kWeightBlockBytes = kNvfp4StreamBlockBytes;    // one 64-row block
constexpr int kClaimAheadStages = 4;
// 2^14: the expanded codes are e2m1 * 2^-14 (moe_gemm_nvfp4.h)
constexpr float kCodeScale = 16384.0f;

struct StageInfo {
  int q0, q_end, m0, expert;
};

// The two instances. kWg consumer warpgroups per CTA, each expanding and multiplying 64 rows of
// the item's weight tile against the stage's one activation tile:
// - kWg = 1, three CTAs per SM with 5-deep rings (69 KB of codes in flight per SM): 64-row items,
//   twice as many as kWg = 2 has, so few tokens still spread over every SM;
// - kWg = 2, two CTAs per SM with 6-deep rings (110 KB in flight): half the activation bytes read
//   from L2 per weight byte, which decides at 17-32 tokens per expert (f16 rows of 32 tokens weigh
//   8 KB a stage against 4.6 KB of codes per 64 rows).
// Either way several consumer warps per scheduler, which the issue-bound expansion needs to hide
// its latencies.
template <int kWg>
struct Tiling {
  static constexpr int kBlockM = kNvfp4StreamRows * kWg;  // weight rows per work item
  static constexpr int kCtasPerSm = kWg == 2 ? 2 : 3;
  static constexpr int kStages = kWg == 2 ? 6 : 5;
  static constexpr int kConsumerThreads = 128 * kWg;
  static constexpr int kThreads = kConsumerThreads + 32;  // + the producer warp
  static constexpr int kWeightStageBytes = kWeightBlockBytes * kWg;
  static constexpr int kRingBytes = kStages * (kActTileBytes + kWeightStageBytes) + 2 * kStages * 8 +
                                    kStages * static_cast<int>(sizeof(StageInfo));
  static constexpr int kSmemBytes = kRingBytes + kScheduleBytes + 1024;  // + alignment slack
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "kCtasPerSm CTAs per SM");
};
static_assert(kWeightBlockBytes % 16 == 0 && kActTileBytes % 1024 == 0);

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
// stage records, the schedule.
template <int kWg>
struct Ring {
  using T = Tiling<kWg>;
  static constexpr int kStages = T::kStages, kWeightStageBytes = T::kWeightStageBytes;
  uint32_t base;
  __device__ uint32_t act(int s) const { return base + s * kActTileBytes; }
  __device__ uint32_t weight(int s) const { return base + kStages * kActTileBytes + s * kWeightStageBytes; }
  __device__ uint32_t full(int s) const { return base + kStages * (kActTileBytes + kWeightStageBytes) + s * 8; }
  __device__ uint32_t empty(int s) const { return full(kStages) + s * 8; }
  __device__ uint32_t info(int s) const { return full(2 * kStages) + s * sizeof(StageInfo); }
  __device__ uint32_t schedule() const { return base + T::kRingBytes; }
};

__device__ __forceinline__ int pass_width(int n_valid) {
  return n_valid <= 8 ? 8 : n_valid <= 16 ? 16 : 32;
}

template <int kWg>
__device__ __forceinline__ void producer(const Ring<kWg>& ring, StageInfo* info, const Schedule& sched,
                                         const CUtensorMap* tma_x, const StreamParams& p) {
  constexpr int kStages = Tiling<kWg>::kStages, kWeightStageBytes = Tiling<kWg>::kWeightStageBytes;
  sm90::prefetch_tensor_map(tma_x);
  const uint64_t evict_first = sm90::l2_evict_first_policy();
  auto issue_activations = [&](int s, int q0, int width, int kb) {
    for (int atom = 0; atom < 2; ++atom)
      for (int j = 0; j < width / kTokenBox; ++j)
        sm90::tma_load_2d(ring.act(s) + atom * kAtomBytes + j * kTokenBox * 128, tma_x, ring.full(s),
                          kb * kBlockK + atom * kAtomColumns, q0 + j * kTokenBox);
  };
  stream_gemm::FirstFillGate<kStages> gate;
  int stage = 0;
  uint32_t phase = 0;
  const int total_items = sched.num_active * p.m_tiles;
  const int claim_at = p.k_blocks > kClaimAheadStages ? p.k_blocks - kClaimAheadStages : 0;
  int item = static_cast<int>(blockIdx.x);
  while (item < total_items) {
    const int expert = sched.active[item / p.m_tiles];
    const int tile = item % p.m_tiles;
    const int q_end = sched.offsets[expert + 1];
    // the item's 64-row blocks: tiles kWg * tile + w of the image, K blocks contiguous
    const uint8_t* blocks = p.weight + (static_cast<size_t>(expert) * p.m_tiles + tile) * kWg *
                                           p.k_blocks * kWeightBlockBytes;
    int next = -1;
    for (int q0 = sched.offsets[expert]; q0 < q_end; q0 += kMaxTokens) {
      const int rows = q_end - q0 < kMaxTokens ? q_end - q0 : kMaxTokens;
      const int width = pass_width(rows);
      const bool last_pass = q0 + kMaxTokens >= q_end;
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        if (last_pass && kb == claim_at) next = stream_gemm::claim_item(p.work, item);
        sm90::mbar_wait(ring.empty(stage), phase ^ 1);
        info[stage] = StageInfo{q0, q0 + rows, tile * Tiling<kWg>::kBlockM, expert};
        sm90::mbar_arrive_expect_tx(ring.full(stage), kWeightStageBytes + 2 * width * 128);
        for (int w = 0; w < kWg; ++w)
          sm90::bulk_load_hint(ring.weight(stage) + w * kWeightBlockBytes,
                               blocks + (static_cast<size_t>(w) * p.k_blocks + kb) * kWeightBlockBytes,
                               kWeightBlockBytes, ring.full(stage), evict_first);
        gate.copy(stage, q0, width, kb, issue_activations);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
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

// The A registers of four k16 steps (half h of a stage: steps 4 h .. 4 h + 3): codes (one 16-byte
// load) times group scales (8 bytes of the row pair's 16; bytes 2 j / 2 j + 1 are rows r / r + 8
// of step j).
__device__ __forceinline__ void load_half_fragments(const uint8_t* block, int thread, int half,
                                                    uint32_t (&a)[kSteps / 2][4]) {
  const uint4 c = reinterpret_cast<const uint4*>(block)[half * 128 + thread];
  const int pair = (thread / 32) * 8 + (thread % 32) / 4;
  const uint2 sv = reinterpret_cast<const uint2*>(block + kNvfp4StreamCodeBytes)[2 * pair + half];
  const uint32_t codes[kSteps / 2] = {c.x, c.y, c.z, c.w};
  const uint32_t scale_words[2] = {sv.x, sv.y};
#pragma unroll
  for (int j = 0; j < kSteps / 2; ++j) {
    const __nv_fp8x2_storage_t pair_bits =
        static_cast<__nv_fp8x2_storage_t>(scale_words[j / 2] >> (16 * (j % 2)));
    const __half2 s = __half2(__nv_cvt_fp8x2_to_halfraw2(pair_bits, __NV_E4M3));  // (row r, row r + 8)
    const __half2 s_lo = __low2half2(s), s_hi = __high2half2(s);
    uint32_t h[4];
    expand_codes(codes[j], h);
    a[j][0] = hmul2_bits(h[0], s_lo);
    a[j][1] = hmul2_bits(h[1], s_hi);
    a[j][2] = hmul2_bits(h[2], s_lo);
    a[j][3] = hmul2_bits(h[3], s_hi);
  }
}

// Half h of a stage (four k16 steps) as one wgmma group: its codes are expanded while the group
// before it still runs; after the commit at most this group is in flight, so the previous one
// is done and its A registers (the other set) may be rewritten.
template <int kWidth>
__device__ __forceinline__ void consume_half(const uint8_t* block, uint32_t act_smem, int half, bool first,
                                             float (&acc)[kWidth / 2], uint32_t (&a)[kSteps / 2][4]) {
  load_half_fragments(block, threadIdx.x % 128, half, a);
  const uint64_t desc_x = sm90::wgmma_desc_k_major_sw128(act_smem + half * kAtomBytes);
  sm90::wgmma_fence();  // orders the A registers just written before the wgmma reads them
#pragma unroll
  for (int j = 0; j < kSteps / 2; ++j)  // 32 bytes of K per step inside the half's 128-byte atom rows
    sm90::WgmmaF16Rs<kWidth>::mma(acc, a[j], desc_x + 2 * j, !first || j > 0);
  sm90::wgmma_commit();
  sm90::wgmma_wait<1>();
}

template <int kWidth, int kWg>
__device__ __forceinline__ void consume_pass(const Ring<kWg>& ring, uint8_t* smem_generic, uint32_t smem_window,
                                             int& stage, uint32_t& phase, const StreamParams& p,
                                             const StageInfo pass) {
  constexpr int kAcc = kWidth / 2;
  // warpgroup wg multiplies rows 64 wg .. 64 wg + 63 of the item (its own weight block)
  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) sm90::fence_operand(acc[i]);
  // Two sets of A registers, one per half stage: half 1 is expanded while half 0's group runs, and
  // half 0 of the next stage while half 1's does. A stage is freed once its second group is done
  // (its activations are read by the wgmma from shared memory until then).
  uint32_t a_first[kSteps / 2][4], a_second[kSteps / 2][4];
  int previous = -1;
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    sm90::mbar_wait(ring.full(stage), phase);
    const uint8_t* block = smem_generic + (ring.weight(stage) + wg * kWeightBlockBytes - smem_window);
    consume_half<kWidth>(block, ring.act(stage), 0, kb == 0, acc, a_first);
    if (previous >= 0) sm90::mbar_arrive(ring.empty(previous));
    consume_half<kWidth>(block, ring.act(stage), 1, false, acc, a_second);
    previous = stage;
    if (++stage == Tiling<kWg>::kStages) stage = 0, phase ^= 1;
  }
  sm90::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) sm90::fence_operand(acc[i]);
  sm90::mbar_arrive(ring.empty(previous));
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

template <int kWg>
__global__ void __launch_bounds__(Tiling<kWg>::kThreads, Tiling<kWg>::kCtasPerSm)
    moe_gemm_nvfp4_stream_kernel(const __grid_constant__ CUtensorMap tma_x, const StreamParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const uint32_t window = ::moelora::cuda::ptx::smem_addr(smem);
  using T = Tiling<kWg>;
  const Ring<kWg> ring{(window + 1023u) & ~1023u};
  sm90::launch_dependents();
  int* sched_smem = reinterpret_cast<int*>(smem + (ring.schedule() - window));
  stream_gemm::stage_schedule(sched_smem, p.num_active, p.active_experts, p.expert_offsets, p.num_experts);
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
  if (threadIdx.x >= T::kConsumerThreads) {
    if (threadIdx.x == T::kConsumerThreads) producer(ring, info, sched, &tma_x, p);
    return;
  }
  // The epilogue reads the activation scales the previous kernel wrote.
  sm90::grid_dependency_wait();
  int stage = 0;
  uint32_t phase = 0;
  for (;;) {
    sm90::mbar_wait(ring.full(stage), phase);
    const StageInfo pass = info[stage];
    if (pass.q0 < 0) break;
    switch (pass_width(pass.q_end - pass.q0)) {
      case 8: consume_pass<8, kWg>(ring, smem, window, stage, phase, p, pass); break;
      case 16: consume_pass<16, kWg>(ring, smem, window, stage, phase, p, pass); break;
      default: consume_pass<32, kWg>(ring, smem, window, stage, phase, p, pass); break;
    }
  }
#else
  __trap();  // wgmma and TMA need sm_90a; the launcher refuses other devices
#endif
}

template <int kWg>
int stream_grid(const MoeGemmNvfp4Args& a, int num_sms) {
  const int64_t items = static_cast<int64_t>(a.max_active_experts) * (a.n / Tiling<kWg>::kBlockM);
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(items, static_cast<int64_t>(Tiling<kWg>::kCtasPerSm) * num_sms)));
}

void prepare_device() {
  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::vector<bool> prepared;
  std::lock_guard<std::mutex> lock(mutex);
  if (device < static_cast<int>(prepared.size()) && prepared[device]) return;
  int major = 0, minor = 0;
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  MOELORA_CHECK(major == 9 && minor == 0, ErrorCode::kUnsupported, "NVFP4 stream GEMM: device ", device, " is sm_",
                major, minor, "; the kernel needs sm_90a (Hopper: wgmma and TMA)");
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_nvfp4_stream_kernel<1>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, Tiling<1>::kSmemBytes));
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_nvfp4_stream_kernel<2>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, Tiling<2>::kSmemBytes));
  if (device >= static_cast<int>(prepared.size())) prepared.resize(device + 1, false);
  prepared[device] = true;
}

}  // namespace

void launch_moe_gemm_nvfp4_stream(const MoeGemmNvfp4Args& a, int num_sms, bool pdl, cudaStream_t stream) {
  MOELORA_CHECK(a.act && a.act_scale && a.weight && a.row_scale && a.expert_offsets && a.active_experts &&
                    a.num_active && a.out,
                ErrorCode::kInvalidArgument,
                "NVFP4 stream GEMM: act, act_scale, weight, row_scale, expert_offsets, active_experts, num_active "
                "and out are required");
  MOELORA_CHECK(a.num_experts > 0 && a.num_experts <= kMaxExperts, ErrorCode::kUnsupported,
                "NVFP4 stream GEMM: E = ", a.num_experts, " experts; the kernel's schedule holds 1 to ", kMaxExperts);
  MOELORA_CHECK(a.n > 0 && a.n % Tiling<2>::kBlockM == 0 && a.k > 0 && a.k % kBlockK == 0, ErrorCode::kUnsupported,
                "NVFP4 stream GEMM: N = ", a.n, " must be a positive multiple of ", Tiling<2>::kBlockM, " and K = ",
                a.k, " of ", kBlockK);
  MOELORA_CHECK(a.max_active_experts >= 1 && a.max_active_experts <= a.num_experts, ErrorCode::kInvalidArgument,
                "NVFP4 stream GEMM: max_active_experts = ", a.max_active_experts, " outside [1, E = ", a.num_experts,
                "]");
  MOELORA_CHECK(a.act_rows > 0, ErrorCode::kInvalidArgument, "NVFP4 stream GEMM: act_rows = ", a.act_rows,
                " must be positive");
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(a.weight) % 16 == 0 && reinterpret_cast<uintptr_t>(a.act) % 16 == 0,
                ErrorCode::kInvalidArgument, "NVFP4 stream GEMM: weight and act must be 16-byte aligned");
  MOELORA_CHECK(static_cast<int64_t>(a.num_experts) * a.n < (1LL << 31), ErrorCode::kInvalidArgument,
                "NVFP4 stream GEMM: E * N = ", static_cast<int64_t>(a.num_experts) * a.n, " rows exceed 2^31");
  const CUtensorMap tma_x =
      make_tensor_map_2d(a.act, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, a.k, a.act_rows, static_cast<uint64_t>(a.k) * 2,
                         kAtomColumns, kTokenBox, CU_TENSOR_MAP_SWIZZLE_128B, "the f16 activation rows");
  prepare_device();
  // Two warpgroups per CTA once a pass may be wider than 16 tokens (the activation bytes per weight
  // byte then decide), one below (more, smaller items for few tokens).
  const bool two = a.max_tokens_per_expert > 16;
  const StreamParams p{a.weight,     a.row_scale, a.act_scale,     a.expert_offsets,
                       a.active_experts, a.num_active, a.out,     a.work_counters,
                       a.n,          a.k / kBlockK, a.n / (two ? Tiling<2>::kBlockM : Tiling<1>::kBlockM),
                       a.num_experts};
  if (two)
    ::moelora::cuda::launch_kernel(moe_gemm_nvfp4_stream_kernel<2>, dim3(stream_grid<2>(a, num_sms)),
                                   dim3(Tiling<2>::kThreads), Tiling<2>::kSmemBytes, stream, pdl, tma_x, p);
  else
    ::moelora::cuda::launch_kernel(moe_gemm_nvfp4_stream_kernel<1>, dim3(stream_grid<1>(a, num_sms)),
                                   dim3(Tiling<1>::kThreads), Tiling<1>::kSmemBytes, stream, pdl, tma_x, p);
}

}  // namespace moelora::ops::cuda
