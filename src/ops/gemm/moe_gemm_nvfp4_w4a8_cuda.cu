// W4A8 NVFP4 expert GEMM for decode (launch_moe_gemm_nvfp4_w4a8): packed e2m1 codes expanded to
// e4m3 in registers and multiplied on the FP8 tensor cores against e4m3 activation rows.
//
//   out[q, n] = act_scale[q] * row_scale[e, n] * 2^6 *
//               sum_g s[e, n, g] * sum_{k in g} e4m3(act[q, k]) * e2m1(W[e, n, k]) * 2^-6
//
// Why: the W4A16 kernel (moe_gemm_nvfp4_stream_cuda.cu) spends 19 of its 24.5 instructions per k16
// step and thread on f16 arithmetic (12 to expand a code word into four f16x2 registers, 4 HMUL2
// for the group scales, 1.5 to convert them) and is issue-bound on the H200. Here one code word of
// the W4A8 image (pack_nvfp4_for_w4a8, ops/gemm/moe_gemm_nvfp4.h) becomes the two e4m3 A
// registers of its k16 group in five integer ops; each group is one m64nNk32 e4m3 wgmma with the
// other half of A zero (even groups in the low 16 columns of a k32 slab, odd groups in the high
// 16) into its own accumulators, and those are multiplied by the rows' group scales and added up
// in fp32 (4 FFMA a group). Every product e2m1 * 2^-6 * e4m3 is exact.
//
// Pipeline (the W4A16 decode instance's, with 64-row items and passes of up to 8 tokens): a
// producer warp walks the CTA's items (expert, 64-row tile; the first by CTA index, the next
// round-robin or claimed from a counter) and per 128-column K block fills one ring stage with the
// block's 4,608-byte image (bulk copy, L2 evict-first) and the pass's e4m3 rows (8-row TMA boxes
// of 128 columns: one 128-byte swizzle row per token); the weights of the first ring fill go out
// before griddepcontrol.wait, the activations after it. One consumer warpgroup per CTA loads a
// stage's code words while the previous stage's eight wgmmas run, then waits for them, and only
// then expands the codes into the A registers those wgmmas read (a wgmma reads its register
// operands asynchronously, until wgmma.wait_group; rewriting them earlier corrupted products under
// load), scales and adds the previous products and issues the stage's. The other CTAs' warpgroups
// on the SM keep the tensor cores busy meanwhile.
//
// Rows of a pass past the expert's tokens are computed but not stored (each output column depends
// on its own activation row only). Deterministic: one CTA owns each output element and adds its
// groups in order.
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
namespace ptx = ::moelora::cuda::ptx;
using ::moelora::cuda::make_tensor_map_2d;
using stream_gemm::kScheduleBytes;
using stream_gemm::Schedule;

constexpr int kBlockK = kNvfp4StreamK;  // 128 columns per stage: one 128-byte row per token
// Tokens per pass: the wgmma N. Eight groups' products of 16 tokens (64 registers) beside two
// sets of A registers do not fit the 128 registers a thread of three CTAs per SM may have, and
// decode forwards route at most a few tokens to an expert; an expert with more takes several
// passes.
constexpr int kMaxTokens = 8;
constexpr int kTokenBox = 8;  // activation rows per TMA box
constexpr int kStages = 8;
constexpr int kCtasPerSm = 3;
constexpr int kConsumerThreads = 128;
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kActTileBytes = kMaxTokens * kBlockK;
constexpr int kWeightBlockBytes = kNvfp4StreamBlockBytes;
constexpr int kHalfStageCodeBytes = kNvfp4StreamCodeBytes / 2;  // groups 0-3, then 4-7
constexpr int kClaimAheadStages = 4;
constexpr float kCodeScale = 64.0f;  // the expanded codes are e2m1 * 2^-6

struct StageInfo {
  int q0, q_end, m0, expert;
};

constexpr int kRingBytes = kStages * (kActTileBytes + kWeightBlockBytes) + 2 * kStages * 8 +
                           kStages * static_cast<int>(sizeof(StageInfo));
constexpr int kSmemBytes = kRingBytes + kScheduleBytes + 1024;  // + alignment slack
static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "kCtasPerSm CTAs per SM");
static_assert(kActTileBytes % 1024 == 0 && kWeightBlockBytes % 16 == 0);

struct Params {
  const uint8_t* weight;          // image [E, N/64, K/128, 4608]
  const float* row_scale;         // [E, N]
  const float* act_scale;         // [act_rows]
  const int32_t* expert_offsets;  // [E + 1]
  const int32_t* active_experts;  // [E]
  const int32_t* num_active;      // [1]
  __nv_bfloat16* out;             // [P, N]
  int* work;
  int n, k_blocks, m_tiles, num_experts;  // m_tiles = N / 64
};

// Activation tiles first (1024-byte aligned for the swizzle), then the weight blocks, barriers,
// stage records and the schedule.
struct Ring {
  uint32_t base;
  __device__ uint32_t act(int s) const { return base + s * kActTileBytes; }
  __device__ uint32_t weight(int s) const {
    return base + kStages * kActTileBytes + s * kWeightBlockBytes;
  }
  __device__ uint32_t full(int s) const {
    return base + kStages * (kActTileBytes + kWeightBlockBytes) + s * 8;
  }
  __device__ uint32_t empty(int s) const { return full(kStages) + s * 8; }
  __device__ uint32_t info(int s) const { return full(2 * kStages) + s * sizeof(StageInfo); }
  __device__ uint32_t schedule() const { return base + kRingBytes; }
};

__device__ __forceinline__ void producer(const Ring& ring, StageInfo* info, const Schedule& sched,
                                         const CUtensorMap* tma_x, const Params& p) {
  sm90::prefetch_tensor_map(tma_x);
  const uint64_t weight_policy = sm90::l2_evict_first_policy();  // each weight byte is read once
  auto issue_activations = [&](int s, int q0, int width, int kb) {
    for (int j = 0; j < width; j += kTokenBox)
      sm90::tma_load_2d(ring.act(s) + j * kBlockK, tma_x, ring.full(s), kb * kBlockK, q0 + j);
  };
  stream_gemm::FirstFillGate<kStages> gate;
  int stage = 0;
  uint32_t phase = 0;
  const int claim_at = p.k_blocks > kClaimAheadStages ? p.k_blocks - kClaimAheadStages : 0;
  const int total_items = sched.num_active * p.m_tiles;
  int item = static_cast<int>(blockIdx.x);
  while (item < total_items) {
    int next = -1;
    const int expert = sched.active[item / p.m_tiles], tile = item % p.m_tiles;
    const uint8_t* blocks = p.weight + (static_cast<size_t>(expert) * p.m_tiles + tile) *
                                           p.k_blocks * kWeightBlockBytes;
    const int q_end = sched.offsets[expert + 1];
    // the item's passes, each streaming every K block; the next item is claimed a few stages
    // before the end of the last pass, so its first stages follow without a gap
    for (int q0 = sched.offsets[expert]; q0 < q_end; q0 += kMaxTokens) {
      const int rows = min(q_end - q0, kMaxTokens), width = kMaxTokens;
      const bool last_pass = q0 + kMaxTokens >= q_end;
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        if (last_pass && kb == claim_at) next = stream_gemm::claim_item(p.work, item);
        sm90::mbar_wait(ring.empty(stage), phase ^ 1);
        info[stage] = StageInfo{q0, q0 + rows, tile * kNvfp4StreamRows, expert};
        sm90::mbar_arrive_expect_tx(ring.full(stage), kWeightBlockBytes + width * kBlockK);
        sm90::bulk_load_hint(ring.weight(stage),
                             blocks + static_cast<size_t>(kb) * kWeightBlockBytes,
                             kWeightBlockBytes, ring.full(stage), weight_policy);
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

// A W4A8 code word -> the e4m3 bytes of row r's four codes (r0) and row r + 8's (r1), each
// e2m1 * 2^-6 (moe_gemm_nvfp4.h).
__device__ __forceinline__ void expand_w4a8(uint32_t q, uint32_t& r0, uint32_t& r1) {
  r0 = q & 0x9C9C9C9Cu;
  r1 = (__funnelshift_l(q, q, 6) & 0x98989898u) | ((q << 2) & 0x04040404u);
}

// The group scales of rows r (x) and r + 8 (y) from the low 16 bits of `pair` (two e4m3 bytes).
__device__ __forceinline__ float2 group_scales(uint32_t pair) {
  const __half2 h =
      __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3));
  return __half22float2(h);
}

// One stage's words of a consumer thread: its eight code words (group g in word g) and its row
// pair's 16 scale bytes (bytes 2 g / 2 g + 1: rows r / r + 8 of group g).
struct StageWords {
  uint4 codes[2];
  uint4 scales;
};
__device__ __forceinline__ StageWords load_stage_words(uint32_t block, uint32_t codes_at,
                                                       uint32_t scales_at) {
  return {{ptx::ld_shared_v4_u32(block + codes_at),
           ptx::ld_shared_v4_u32(block + kHalfStageCodeBytes + codes_at)},
          ptx::ld_shared_v4_u32(block + scales_at)};
}

// The eight groups' A registers: group g's two e4m3 registers in the low (g even) or high (g odd)
// 16 columns of its k32 slab, zeros in the other half.
__device__ __forceinline__ void expand_stage(const StageWords& w, uint32_t (&a)[8][4]) {
  const uint32_t words[8] = {w.codes[0].x, w.codes[0].y, w.codes[0].z, w.codes[0].w,
                             w.codes[1].x, w.codes[1].y, w.codes[1].z, w.codes[1].w};
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    uint32_t r0, r1;
    expand_w4a8(words[g], r0, r1);
    a[g][0] = g % 2 ? 0u : r0;
    a[g][1] = g % 2 ? 0u : r1;
    a[g][2] = g % 2 ? r0 : 0u;
    a[g][3] = g % 2 ? r1 : 0u;
  }
}

// The stage's eight wgmmas (group g reads k32 slab g / 2: 32 bytes further per slab) as one
// committed group, each into its own products.
template <int kWidth>
__device__ __forceinline__ void issue_stage(uint64_t desc_stage, const uint32_t (&a)[8][4],
                                            float (&part)[8][kWidth / 2]) {
  sm90::wgmma_fence();  // orders the A registers just written before the wgmmas read them
#pragma unroll
  for (int g = 0; g < 8; ++g)
    sm90::WgmmaE4m3RsFresh<kWidth>::mma(part[g], a[g], desc_stage + 2 * (g / 2));
  sm90::wgmma_commit();
}

// acc += each group's products times its rows' group scale. Called only once no wgmma is in
// flight (after wgmma.wait_group 0): ptxas serializes every wgmma of a loop in which other
// instructions read the accumulators of an earlier wgmma while a later one may run.
template <int kAcc>
__device__ __forceinline__ void fold_stage(float (&acc)[kAcc], float (&part)[8][kAcc],
                                           uint4 scale_bytes) {
  const uint32_t scales[4] = {scale_bytes.x, scale_bytes.y, scale_bytes.z, scale_bytes.w};
#pragma unroll
  for (int g = 0; g < 8; ++g) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) sm90::fence_operand(part[g][i]);
    const float2 s = group_scales(scales[g / 2] >> (16 * (g % 2)));
#pragma unroll
    for (int c = 0; c < kAcc / 4; ++c) {  // d[4 c + 2 i + j]: row r + 8 i
      acc[4 * c + 0] = fmaf(part[g][4 * c + 0], s.x, acc[4 * c + 0]);
      acc[4 * c + 1] = fmaf(part[g][4 * c + 1], s.x, acc[4 * c + 1]);
      acc[4 * c + 2] = fmaf(part[g][4 * c + 2], s.y, acc[4 * c + 2]);
      acc[4 * c + 3] = fmaf(part[g][4 * c + 3], s.y, acc[4 * c + 3]);
    }
  }
  // every product is read before the next stage's wgmmas are issued (without this fence the
  // compiler sinks the last FFMAs past the wgmma issue, and ptxas then serializes the wgmmas)
#pragma unroll
  for (int i = 0; i < kAcc; ++i) sm90::fence_operand(acc[i]);
}

// The registers of `w` as if rewritten here: expand_stage, which reads them, cannot be scheduled
// above this point (the compiler may otherwise hoist the pure integer ops above wgmma.wait_group,
// rewriting A registers an in-flight wgmma still reads).
__device__ __forceinline__ void pin_words(StageWords& w) {
  for (uint4* v : {&w.codes[0], &w.codes[1]}) {
    sm90::fence_operand(v->x);
    sm90::fence_operand(v->y);
    sm90::fence_operand(v->z);
    sm90::fence_operand(v->w);
  }
}

// One pass: per stage, the next stage's code words are loaded while the previous stage's wgmmas
// run; then wait, free the previous stage, expand the words into the A registers (free only now),
// fold the previous products, issue this stage's.
template <int kWidth>
__device__ __forceinline__ void consume_pass(const Ring& ring, int& stage, uint32_t& phase,
                                             const Params& p, const StageInfo pass) {
  constexpr int kAcc = kWidth / 2;
  const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
  const uint32_t codes_at = thread * 16;
  const uint32_t scales_at = kNvfp4StreamCodeBytes + (warp * 8 + lane / 4) * 16;
  const uint64_t desc_ring = sm90::wgmma_desc_k_major_sw128(ring.act(0));
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  float part[8][kAcc];
  uint32_t a[8][4];
  sm90::mbar_wait(ring.full(stage), phase);
  StageWords words = load_stage_words(ring.weight(stage), codes_at, scales_at);
  expand_stage(words, a);
  issue_stage<kWidth>(desc_ring + stage * (kActTileBytes >> 4), a, part);
  uint4 held = words.scales;  // the scales of the stage in flight
  int previous = stage;
  if (++stage == kStages) stage = 0, phase ^= 1;
  for (int kb = 1; kb < p.k_blocks; ++kb) {
    sm90::mbar_wait(ring.full(stage), phase);
    words = load_stage_words(ring.weight(stage), codes_at, scales_at);
    sm90::wgmma_wait<0>();
    sm90::mbar_arrive(ring.empty(previous));
    pin_words(words);
    expand_stage(words, a);
    fold_stage(acc, part, held);
    issue_stage<kWidth>(desc_ring + stage * (kActTileBytes >> 4), a, part);
    held = words.scales;
    previous = stage;
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
  sm90::wgmma_wait<0>();
  sm90::mbar_arrive(ring.empty(previous));
  fold_stage(acc, part, held);
  const int n_valid = pass.q_end - pass.q0;
  const int row = pass.m0 + 16 * warp + lane / 4;
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

__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    moe_gemm_nvfp4_w4a8_kernel(const __grid_constant__ CUtensorMap tma_x, const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const uint32_t window = ptx::smem_addr(smem);
  const Ring ring{(window + 1023u) & ~1023u};
  sm90::launch_dependents();
  int* sched_smem = reinterpret_cast<int*>(smem + (ring.schedule() - window));
  stream_gemm::stage_schedule(sched_smem, p.num_active, p.active_experts, p.expert_offsets,
                              p.num_experts);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(ring.full(s), 1);
      sm90::mbar_init(ring.empty(s), kConsumerThreads);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const Schedule sched = stream_gemm::schedule_view(sched_smem);
  StageInfo* info = reinterpret_cast<StageInfo*>(smem + (ring.info(0) - window));
  if (threadIdx.x >= kConsumerThreads) {  // the producer warp
    if (threadIdx.x == kConsumerThreads) producer(ring, info, sched, &tma_x, p);
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
    consume_pass<kMaxTokens>(ring, stage, phase, p, pass);
  }
#else
  __trap();  // wgmma and TMA need sm_90a; the launcher refuses other devices
#endif
}

}  // namespace

void launch_moe_gemm_nvfp4_w4a8(const MoeGemmNvfp4W4a8Args& a, int num_sms, bool pdl,
                                cudaStream_t stream) {
  nvfp4_launch::check_args(a, kNvfp4StreamRows, kBlockK, "NVFP4 W4A8 GEMM");
  // The e4m3 rows as TMA boxes of 8 rows x 128 columns (one 128-byte swizzle row each).
  const CUtensorMap tma_x =
      make_tensor_map_2d(a.act, CU_TENSOR_MAP_DATA_TYPE_UINT8, a.k, a.act_rows, a.k, kBlockK,
                         kTokenBox, CU_TENSOR_MAP_SWIZZLE_128B, "the e4m3 activation rows");
  nvfp4_launch::prepare_kernel(reinterpret_cast<const void*>(moe_gemm_nvfp4_w4a8_kernel),
                               kSmemBytes, "NVFP4 W4A8 GEMM");
  const Params p{a.weight,
                 a.row_scale,
                 a.act_scale,
                 a.expert_offsets,
                 a.active_experts,
                 a.num_active,
                 a.out,
                 a.work_counters,
                 a.n,
                 a.k / kBlockK,
                 a.n / kNvfp4StreamRows,
                 a.num_experts};
  const int64_t items = static_cast<int64_t>(a.max_active_experts) * (a.n / kNvfp4StreamRows);
  const int grid = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(items, static_cast<int64_t>(kCtasPerSm) * num_sms)));
  ::moelora::cuda::launch_kernel(moe_gemm_nvfp4_w4a8_kernel, dim3(grid), dim3(kThreads), kSmemBytes,
                                 stream, pdl, tma_x, p);
}

}  // namespace moelora::ops::cuda
