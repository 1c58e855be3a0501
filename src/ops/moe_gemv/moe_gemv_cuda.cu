// The expert GEMV kernels of moe_gemv_cuda.cuh (layouts and the chain there).
#include "ops/moe_gemv/moe_gemv_cuda.cuh"

#include <cuda_fp8.h>

#include <algorithm>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/mma_ptx.cuh"
#include "core/sm90_ptx.cuh"
#include "ops/quant/fp8_device.cuh"

namespace moelora::ops::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
// weight rows of one mma (its M): intermediate columns (up) or H columns (down)
constexpr int kRows = 16;
constexpr int kMaxPairs = kMoeGemvMaxTokens * kMoeGemvMaxTopK;
// Each warp streams its bytes through a ring of stages in shared memory (cp.async.cg, 16 bytes
// per lane): the weight rows coalesced (8 lanes per 128-byte row segment, 4 rows per warp copy,
// swizzled, see weight_chunk) and read back as mma fragments after a __syncwarp; the activation
// codes and the scales (4-byte copies into the stage's last vectors) per lane, laid out
// [vector][lane]. The bytes in flight live in shared memory, not registers, and nothing waits on
// a load until its stage is consumed. Up: a stage is one 128-column block of one item: gate rows
// and up rows (32 rows x 128 bytes = 8 vectors), token g's 2 chunks of x codes, and the scales
// (gate, up, x of tokens 2q / 2q + 1). Down: a stage is one (expert, block) item: 16 rows x 128
// bytes (4 vectors), token g's 2 chunks of act codes, and the routing weights, act scales and
// weight scale of its output columns.
constexpr int kUpStages = 4, kUpVectors = 11;
constexpr int kDownStages = 6, kDownVectors = 8;
constexpr int kUpRingBytes = kWarps * kUpStages * kUpVectors * 32 * 16;  // 88 KB: 2 CTAs per SM
constexpr int kDownRingBytes =
    kWarps * kDownStages * kDownVectors * 32 * 16;  // 96 KB: 2 CTAs per SM
// The up kernel is persistent: at most this many CTAs per SM (its ring and tables fit twice), each
// looping over (tile, expert) items, so the ring streams across item boundaries and the per-CTA
// setup (expert table, first fills) is paid once per CTA instead of once per item.
constexpr int kUpCtasPerSm = 2;

// The batch's distinct experts in ascending order and, per expert, the pair routed to it from
// each token (-1: the token does not use it). Every CTA builds it from the routing (<= 256 ids).
struct ExpertTable {
  uint32_t mask[kMoeGemvMaxExperts / 32];
  int32_t word_base[kMoeGemvMaxExperts / 32];
  int32_t num;
  int32_t expert[kMaxPairs];
  int16_t pair[kMaxPairs][kMoeGemvMaxTokens];
};

__device__ void build_expert_table(ExpertTable& tab, const int32_t* __restrict__ ids, int pairs,
                                   int top_k, int num_experts) {
  const int tid = threadIdx.x;
  if (tid < kMoeGemvMaxExperts / 32) tab.mask[tid] = 0;
  for (int i = tid; i < pairs * kMoeGemvMaxTokens; i += kThreads) (&tab.pair[0][0])[i] = -1;
  __syncthreads();
  for (int pr = tid; pr < pairs; pr += kThreads) {
    const int e = ids[pr];
    if (e >= 0 && e < num_experts) atomicOr(&tab.mask[e >> 5], 1u << (e & 31));
  }
  __syncthreads();
  if (tid < 32) {  // exclusive prefix of the set bits per 32-expert word
    const int count = __popc(tab.mask[tid]);
    int incl = count;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (tid >= o) incl += v;
    }
    tab.word_base[tid] = incl - count;
    if (tid == 31) tab.num = incl;
  }
  __syncthreads();
  for (int pr = tid; pr < pairs; pr += kThreads) {
    const int e = ids[pr];
    if (e < 0 || e >= num_experts) continue;
    const int j = tab.word_base[e >> 5] + __popc(tab.mask[e >> 5] & ((1u << (e & 31)) - 1u));
    tab.expert[j] = e;  // every pair of expert e writes the same value
    tab.pair[j][pr / top_k] = static_cast<int16_t>(pr);
  }
  __syncthreads();
}

// Vector v of this lane in stage `stage` of its warp's ring ([stage][vector][lane] x 16 bytes).
template <int kVectors>
__device__ __forceinline__ uint4* ring_slot(uint4* warp_ring, int stage, int vector, int lane) {
  return warp_ring + (stage * kVectors + vector) * 32 + lane;
}
// The weight rows of a stage: row r's 16-byte chunk ch of a 128-column block lives at unit
// r * 8 + (ch ^ 4 (r & 1)): the copies (8 lanes per row, coalesced: 4 whole rows per warp copy)
// and the fragment reads (lanes 4g .. 4g + 3 read row g's chunks 4c .. 4c + 3) both touch 8
// distinct 16-byte bank groups per quarter warp.
__device__ __forceinline__ uint4* weight_chunk(uint4* stage, int row, int chunk) {
  return stage + row * 8 + (chunk ^ ((row & 1) << 2));
}
__device__ __forceinline__ void copy_16(uint4* dst, const void* src, bool valid) {
  ::moelora::cuda::ptx::cp_async_16(::moelora::cuda::ptx::smem_addr(dst), src,
                                    valid ? 16 : 0);  // 0: zeros
}
__device__ __forceinline__ void copy_4(float* dst, const float* src, bool valid) {
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(::moelora::cuda::ptx::smem_addr(dst)),
      "l"(src), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float* out) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Two mmas over one 64-column chunk: w_g / w_g8 = the lane's 16 weight bytes of rows g / g + 8,
// b = its 16 activation codes of the same columns.
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4& w_g, const uint4& w_g8,
                                          const uint4& b) {
  ::moelora::cuda::ptx::mma_e4m3_16832(d, w_g.x, w_g8.x, w_g.y, w_g8.y, b.x, b.y);
  ::moelora::cuda::ptx::mma_e4m3_16832(d, w_g.z, w_g8.z, w_g.w, w_g8.w, b.z, b.w);
}

__device__ __forceinline__ float silu(float v) {
  return v / (1.f + expf(-v));
}

// The reduced value of (row, token) from the 4 warps' accumulators red[w][lane][reg], where the
// mma put (row, token) in lane (row % 8) * 4 + token / 2, register (row / 8) * 2 + token % 2
// (plus `offset` for a second accumulator set). Fixed order: deterministic.
template <int kRegs>
__device__ __forceinline__ float reduce_warps(const float (&red)[kWarps][32][kRegs], int row,
                                              int token, int offset) {
  const int lane = (row % 8) * 4 + token / 2, reg = (row / 8) * 2 + token % 2 + offset;
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red[w][lane][reg];
  return sum;
}

__global__ void __launch_bounds__(kThreads, kUpCtasPerSm) moe_gemv_up_kernel(const MoeGemvArgs p) {
  __shared__ ExpertTable tab;
  __shared__ float red[kWarps][32][8];
  __shared__ int last_of_expert;
  extern __shared__ uint4 dyn_smem[];
  // Nothing is read before the wait (the routing and x's codes come from the route kernel); the
  // down kernel may start once every CTA is past it, so it can read the routing before its own.
  ::moelora::cuda::sm90::grid_dependency_wait();
  ::moelora::cuda::sm90::launch_dependents();
  build_expert_table(tab, p.topk_ids, p.tokens * p.top_k, p.top_k, p.num_experts);
  const int H = p.hidden, I = p.inter, nkb = H / 128, tiles = I / kRows;
  // items (expert j, tile) expert-major; this CTA takes blockIdx.x, + gridDim.x, ...
  const int items = tiles * tab.num;
  if (static_cast<int>(blockIdx.x) >= items) return;
  const int my_items = (items - 1 - blockIdx.x) / gridDim.x + 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int kb_begin = warp * nkb / kWarps, blocks = (warp + 1) * nkb / kWarps - kb_begin;
  // Lane's bytes per block: rows g and g + 8 of the gate and the up tile, columns 64c + 16q .. +
  // 16; token g's codes of the same columns (the B fragment: every token, routed to the expert or
  // not; the columns of the others are dropped at the store); the x scales of its output columns,
  // tokens 2q and 2q + 1.
  const bool has_g = g < p.tokens, has_t0 = 2 * q < p.tokens, has_t1 = 2 * q + 1 < p.tokens;
  const uint8_t* x_row = p.xq + static_cast<size_t>(has_g ? g : 0) * H + 16 * q;
  const float* sx0 = p.sx + static_cast<size_t>(has_t0 ? 2 * q : 0) * nkb;
  const float* sx1 = p.sx + static_cast<size_t>(has_t1 ? 2 * q + 1 : 0) * nkb;
  uint4* ring = dyn_smem + warp * kUpStages * kUpVectors * 32;
  // The issue side walks this warp's (item, block) steps in order with running pointers: the
  // per-step work is the 14 copies and a few adds (divisions only once per item), so the ring's
  // first fills leave within a few hundred cycles of the table.
  int issue_local = 0, issue_block = 0, issue_stage = 0;
  const uint8_t* gate_src = nullptr;
  const float *gate_scale_src = nullptr, *up_scale_src = nullptr;
  auto start_item = [&] {
    const int item = blockIdx.x + issue_local * gridDim.x, i0 = (item % tiles) * kRows;
    const int e = tab.expert[item / tiles];
    // this lane copies rows 4i + lane / 8 (i < 4: gate rows, else up rows), chunk lane % 8
    gate_src = p.w13 + (static_cast<size_t>(e) * 2 * I + i0 + lane / 8) * H + kb_begin * 128 +
               16 * (lane % 8);
    const float* w_scale = p.w13_scale + static_cast<size_t>(e) * (2 * I / 128) * nkb + kb_begin;
    gate_scale_src = w_scale + (i0 / 128) * nkb;
    up_scale_src = w_scale + ((I + i0) / 128) * nkb;
  };
  if (blocks > 0) start_item();
  auto issue = [&] {  // the next step into the next stage; an empty group past the end
    if (issue_local < my_items && blocks > 0) {
      const uint8_t* src = gate_src + issue_block * 128;
      const int kb = kb_begin + issue_block;
      uint4* rows =
          ring_slot<kUpVectors>(ring, issue_stage, 0, 0);  // 8 vectors = 32 rows x 128 bytes
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const size_t row_off =
            static_cast<size_t>(4 * i) * H + (i >= 4 ? static_cast<size_t>(I - 16) * H : 0);
        copy_16(weight_chunk(rows, 4 * i + lane / 8, lane % 8), src + row_off, true);
      }
#pragma unroll
      for (int c = 0; c < 2; ++c)
        copy_16(ring_slot<kUpVectors>(ring, issue_stage, 8 + c, lane), x_row + kb * 128 + c * 64,
                has_g);
      float* sc = reinterpret_cast<float*>(ring_slot<kUpVectors>(ring, issue_stage, 10, lane));
      copy_4(sc + 0, gate_scale_src + issue_block, true);
      copy_4(sc + 1, up_scale_src + issue_block, true);
      copy_4(sc + 2, sx0 + kb, has_t0);
      copy_4(sc + 3, sx1 + kb, has_t1);
      if (++issue_block == blocks) {
        issue_block = 0;
        if (++issue_local < my_items) start_item();
      }
    }
    ::moelora::cuda::ptx::cp_async_commit();
    issue_stage = issue_stage + 1 == kUpStages ? 0 : issue_stage + 1;
  };
  for (int n = 0; n < kUpStages; ++n) issue();

  int st = 0;  // the consumed stage
  for (int local = 0; local < my_items; ++local) {
    const int item = blockIdx.x + local * gridDim.x, j = item / tiles, i0 = (item % tiles) * kRows;
    float acc_g[4] = {0.f, 0.f, 0.f, 0.f}, acc_u[4] = {0.f, 0.f, 0.f, 0.f};
    for (int b = 0; b < blocks; ++b) {
      ::moelora::cuda::ptx::cp_async_wait<kUpStages -
                                          1>();  // this step's group (the oldest) landed
      __syncwarp();  // ... for every lane's copies: the weight rows are read across lanes
      // v[2c + h] = gate row g + 8h, chunk 4c + q; v[4 + ...] the up rows; v[8 + c] x codes
      uint4 v[kUpVectors - 1];
      uint4* rows = ring_slot<kUpVectors>(ring, st, 0, 0);
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          v[2 * c + h] = *weight_chunk(rows, g + 8 * h, 4 * c + q);
          v[4 + 2 * c + h] = *weight_chunk(rows, 16 + g + 8 * h, 4 * c + q);
        }
#pragma unroll
      for (int c = 0; c < 2; ++c) v[8 + c] = *ring_slot<kUpVectors>(ring, st, 8 + c, lane);
      const float4 sc = *reinterpret_cast<const float4*>(ring_slot<kUpVectors>(ring, st, 10, lane));
      float bg[4] = {0.f, 0.f, 0.f, 0.f}, bu[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        mma_chunk(bg, v[2 * c], v[2 * c + 1], v[8 + c]);
        mma_chunk(bu, v[4 + 2 * c], v[4 + 2 * c + 1], v[8 + c]);
      }
      const float col[4] = {sc.z, sc.w, sc.z, sc.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc_g[i] = fmaf(bg[i], sc.x * col[i], acc_g[i]);
        acc_u[i] = fmaf(bu[i], sc.y * col[i], acc_u[i]);
      }
      __syncwarp();  // every lane has read stage st before it is refilled
      issue();
      st = st + 1 == kUpStages ? 0 : st + 1;
    }
    // The item's epilogue, while the ring already streams the next item's blocks.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      red[warp][lane][i] = acc_g[i];
      red[warp][lane][4 + i] = acc_u[i];
    }
    __syncthreads();
    {
      const int row = threadIdx.x / kMoeGemvMaxTokens, token = threadIdx.x % kMoeGemvMaxTokens;
      const int pair = token < p.tokens ? tab.pair[j][token] : -1;
      if (pair >= 0) {
        const float gate = reduce_warps(red, row, token, 0), up = reduce_warps(red, row, token, 4);
        p.act[static_cast<size_t>(pair) * I + i0 + row] = __float2bfloat16_rn(silu(gate) * up);
      }
    }
    // The last of expert j's items to get here quantizes the act rows of j's tokens (their
    // 128-column groups span 8 items): every CTA publishes its stores before taking its ticket.
    // The barrier after the ticket also keeps red from being overwritten while others read it.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_of_expert = atomicAdd(&p.tickets[j], 1) == tiles - 1;
    __syncthreads();
    if (!last_of_expert) continue;
    __threadfence();
    if (threadIdx.x == 0)
      p.tickets[j] = 0;  // every item of expert j has counted: ready for the next launch
    const int groups = I / 128;
    for (int w = warp; w < kMoeGemvMaxTokens * groups; w += kWarps) {
      const int token = w / groups, group = w % groups;
      const int pair = token < p.tokens ? tab.pair[j][token] : -1;
      if (pair < 0) continue;
      const size_t at = static_cast<size_t>(pair) * I + group * 128 + 4 * lane;
      const uint2 raw =
          __ldcg(reinterpret_cast<const uint2*>(p.act + at));  // other CTAs' stores: from L2
      uint32_t codes;
      const float scale = quantize_bf16_group_128(raw, codes);
      *reinterpret_cast<uint32_t*>(p.aq + at) = codes;
      if (lane == 0) p.sa[static_cast<size_t>(pair) * groups + group] = scale;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 2) moe_gemv_down_kernel(const MoeGemvArgs p) {
  __shared__ ExpertTable tab;
  __shared__ float red[kWarps][32][4];
  __shared__ float gate_of[kMoeGemvMaxTokens];
  const int H = p.hidden, I = p.inter, nkb = I / 128;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int h0 = blockIdx.x * kRows;
  // Before the wait: the routing is complete (the up kernel let this grid start only after its
  // own wait on the route kernel), and so are the layer's inputs and the shared expert's output.
  build_expert_table(tab, p.topk_ids, p.tokens * p.top_k, p.top_k, p.num_experts);
  const int valid = p.num_tokens ? min(*p.num_tokens, p.tokens) : p.tokens;
  {  // L2 fills of this CTA's weight rows of the first experts, beside the up kernel's stream
    const int lines = I / 128, experts = min(tab.num, p.prefetch_experts);
    for (int i = threadIdx.x; i < experts * kRows * lines; i += kThreads) {
      const int jj = i / (kRows * lines), r = (i / lines) % kRows, l = i % lines;
      const uint8_t* line = p.w2 + (static_cast<size_t>(tab.expert[jj]) * H + h0 + r) * I + l * 128;
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line));
    }
  }
  if (p.shared && p.shared_gate) {  // Qwen: gate(t) = sigmoid(x[t] . wsg), one warp per token
    for (int t = warp; t < p.tokens; t += kWarps) {
      float s = 0.f;
      for (int c = lane * 8; c < H; c += 32 * 8) {
        float xf[8], gf[8];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(t) * H + c), xf);
        unpack_bf16x8(*reinterpret_cast<const uint4*>(p.shared_gate + c), gf);
#pragma unroll
        for (int i = 0; i < 8; ++i) s = fmaf(xf[i], gf[i], s);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) gate_of[t] = 1.f / (1.f + expf(-s));
    }
  } else if (threadIdx.x < kMoeGemvMaxTokens) {
    gate_of[threadIdx.x] = 1.f;
  }
  ::moelora::cuda::sm90::grid_dependency_wait();

  const int kb_begin = warp * nkb / kWarps, per_warp = (warp + 1) * nkb / kWarps - kb_begin;
  const int items = tab.num * per_warp;  // (expert, block) pairs of this warp, expert-major
  const float* scale_base = p.w2_scale + static_cast<size_t>(h0 / 128) * nkb;
  extern __shared__ uint4 dyn_smem[];
  uint4* ring = dyn_smem + warp * kDownStages * kDownVectors * 32;
  // The issue side walks this warp's (expert, block) items in order with running pointers (the
  // expert's rows, token pairs and scale pointers looked up once per expert).
  int issue_expert = 0, issue_block = 0, issue_stage = 0;
  const uint8_t *w_src = nullptr, *a_src = nullptr;
  const float *tw0 = nullptr, *sa0 = nullptr, *tw1 = nullptr, *sa1 = nullptr, *sw_src = nullptr;
  bool has_pr = false, has_p0 = false, has_p1 = false;
  auto start_expert = [&] {
    const int e = tab.expert[issue_expert];
    // this lane copies rows 4i + lane / 8, chunk lane % 8
    w_src =
        p.w2 + (static_cast<size_t>(e) * H + h0 + lane / 8) * I + kb_begin * 128 + 16 * (lane % 8);
    // B fragment: token g's act codes if it is routed to e (zeros otherwise)
    const int pr = g < p.tokens ? tab.pair[issue_expert][g] : -1;
    has_pr = pr >= 0;
    a_src = p.aq + static_cast<size_t>(has_pr ? pr : 0) * I + kb_begin * 128 + 16 * q;
    // output columns 2q / 2q + 1 = tokens 2q / 2q + 1: routing weight and act scales (zeros when
    // the token is not routed to e); the weight blocks' scales
    const int p0 = 2 * q < p.tokens ? tab.pair[issue_expert][2 * q] : -1;
    const int p1 = 2 * q + 1 < p.tokens ? tab.pair[issue_expert][2 * q + 1] : -1;
    has_p0 = p0 >= 0;
    has_p1 = p1 >= 0;
    tw0 = p.topk_weights + (has_p0 ? p0 : 0);
    tw1 = p.topk_weights + (has_p1 ? p1 : 0);
    sa0 = p.sa + static_cast<size_t>(has_p0 ? p0 : 0) * nkb + kb_begin;
    sa1 = p.sa + static_cast<size_t>(has_p1 ? p1 : 0) * nkb + kb_begin;
    sw_src = scale_base + static_cast<size_t>(e) * (H / 128) * nkb + kb_begin;
  };
  if (items > 0) start_expert();
  auto issue = [&](bool more) {  // the next item into the next stage; an empty group past the end
    if (more) {
      const uint8_t* src = w_src + issue_block * 128;
      uint4* rows =
          ring_slot<kDownVectors>(ring, issue_stage, 0, 0);  // 4 vectors = 16 rows x 128 bytes
#pragma unroll
      for (int i = 0; i < 4; ++i)
        copy_16(weight_chunk(rows, 4 * i + lane / 8, lane % 8),
                src + static_cast<size_t>(4 * i) * I, true);
#pragma unroll
      for (int c = 0; c < 2; ++c)
        copy_16(ring_slot<kDownVectors>(ring, issue_stage, 4 + c, lane),
                a_src + issue_block * 128 + c * 64, has_pr);
      float* sc = reinterpret_cast<float*>(ring_slot<kDownVectors>(ring, issue_stage, 6, lane));
      copy_4(sc + 0, tw0, has_p0);
      copy_4(sc + 1, sa0 + issue_block, has_p0);
      copy_4(sc + 2, tw1, has_p1);
      copy_4(sc + 3, sa1 + issue_block, has_p1);
      copy_4(reinterpret_cast<float*>(ring_slot<kDownVectors>(ring, issue_stage, 7, lane)),
             sw_src + issue_block, true);
      if (++issue_block == per_warp) {
        issue_block = 0;
        if (++issue_expert < tab.num) start_expert();
      }
    }
    ::moelora::cuda::ptx::cp_async_commit();
    issue_stage = issue_stage + 1 == kDownStages ? 0 : issue_stage + 1;
  };
  for (int it = 0; it < kDownStages; ++it) issue(it < items);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int st = 0;  // the consumed stage
  for (int it = 0; it < items; ++it) {
    ::moelora::cuda::ptx::cp_async_wait<kDownStages - 1>();
    __syncwarp();  // every lane's copies: the weight rows are read across lanes
    // v[2c + h] = row g + 8h, chunk 4c + q; v[4 + c] = act codes
    uint4 v[6];
    uint4* rows = ring_slot<kDownVectors>(ring, st, 0, 0);
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) v[2 * c + h] = *weight_chunk(rows, g + 8 * h, 4 * c + q);
#pragma unroll
    for (int c = 0; c < 2; ++c) v[4 + c] = *ring_slot<kDownVectors>(ring, st, 4 + c, lane);
    const float4 sc = *reinterpret_cast<const float4*>(ring_slot<kDownVectors>(ring, st, 6, lane));
    const float sw = *reinterpret_cast<const float*>(ring_slot<kDownVectors>(ring, st, 7, lane));
    float b[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < 2; ++c) mma_chunk(b, v[2 * c], v[2 * c + 1], v[4 + c]);
    const float c0 = sc.x * sc.y * sw, c1 = sc.z * sc.w * sw;
    const float col[4] = {c0, c1, c0, c1};
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = fmaf(b[i], col[i], acc[i]);
    __syncwarp();  // every lane has read stage st before it is refilled
    issue(it + kDownStages < items);
    st = st + 1 == kDownStages ? 0 : st + 1;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) red[warp][lane][i] = acc[i];
  __syncthreads();
  const int row = threadIdx.x / kMoeGemvMaxTokens, token = threadIdx.x % kMoeGemvMaxTokens;
  if (token >= valid) return;
  float v = reduce_warps(red, row, token, 0);
  const size_t at = static_cast<size_t>(token) * H + h0 + row;
  if (p.shared) v = fmaf(gate_of[token], __bfloat162float(p.shared[at]), v);
  p.out[at] = __float2bfloat16_rn(v);
}

}  // namespace

void check_moe_gemv_args(const MoeGemvArgs& a) {
  const auto bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(a.tokens >= 1 && a.tokens <= kMoeGemvMaxTokens, bad,
                "moe gemv: tokens = ", a.tokens, " outside [1, ", kMoeGemvMaxTokens, "]");
  MOELORA_CHECK(a.top_k >= 1 && a.top_k <= kMoeGemvMaxTopK, bad, "moe gemv: top_k = ", a.top_k,
                " outside [1, ", kMoeGemvMaxTopK, "]");
  MOELORA_CHECK(a.num_experts >= 1 && a.num_experts <= kMoeGemvMaxExperts, bad,
                "moe gemv: num_experts = ", a.num_experts, " outside [1, ", kMoeGemvMaxExperts,
                "]");
  MOELORA_CHECK(a.hidden > 0 && a.hidden % 128 == 0, bad, "moe gemv: H = ", a.hidden,
                " must be a positive multiple of 128");
  MOELORA_CHECK(a.inter > 0 && a.inter % 128 == 0, bad, "moe gemv: I = ", a.inter,
                " must be a positive multiple of 128");
  MOELORA_CHECK(a.topk_ids && a.topk_weights, bad,
                "moe gemv: topk_ids and topk_weights are required");
  MOELORA_CHECK(a.prefetch_experts >= 0, bad, "moe gemv: prefetch_experts = ", a.prefetch_experts,
                " must be >= 0");
}

void launch_moe_gemv_up(const MoeGemvArgs& a, cudaStream_t stream) {
  check_moe_gemv_args(a);
  MOELORA_CHECK(a.xq && a.sx && a.w13 && a.w13_scale && a.act && a.aq && a.sa && a.tickets,
                ErrorCode::kInvalidArgument,
                "moe gemv up: xq, sx, w13, w13_scale, act, aq, sa and tickets are required");
  // one CTA per (tile, expert) item of the largest batch, at most kUpCtasPerSm per SM (persistent)
  const int max_items = (a.inter / kRows) * std::min(a.num_experts, a.tokens * a.top_k);
  const dim3 grid(a.num_sms > 0 ? std::min(max_items, kUpCtasPerSm * a.num_sms) : max_items);
  // above the default 48 KB of dynamic shared memory (per device: set at every launch, as cheap)
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(
      moe_gemv_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kUpRingBytes));
  ::moelora::cuda::launch_kernel(moe_gemv_up_kernel, grid, dim3(kThreads), kUpRingBytes, stream,
                                 a.pdl, a);
}

void launch_moe_gemv_down(const MoeGemvArgs& a, cudaStream_t stream) {
  check_moe_gemv_args(a);
  MOELORA_CHECK(a.aq && a.sa && a.w2 && a.w2_scale && a.out, ErrorCode::kInvalidArgument,
                "moe gemv down: aq, sa, w2, w2_scale and out are required");
  MOELORA_CHECK(!a.shared_gate || (a.shared && a.x), ErrorCode::kInvalidArgument,
                "moe gemv down: the shared gate needs the shared expert's output and x");
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(
      moe_gemv_down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDownRingBytes));
  ::moelora::cuda::launch_kernel(moe_gemv_down_kernel, dim3(a.hidden / kRows), dim3(kThreads),
                                 kDownRingBytes, stream, a.pdl, a);
}

}  // namespace moelora::ops::cuda
