// Gated DeltaNet mix on the GPU (see gdn_cuda.cuh; gdn_mix_ref is the oracle). Two kernels here,
// and the chunked rule kernel for long sequences in gdn_chunk_cuda.cu:
//
// 1. gdn_conv_kernel<dk, dv, K>, grid (max_tokens, ceil((nk + nv) / 8)), 8 warps: one warp per
//    "segment" of a row: a key head (its q and k channels: causal conv + SiLU, L2 norms, q scaled,
//    q.k) or a value head (conv + SiLU of its v channels); the first CTA of the row also computes
//    beta and g. All in fp32 into the workspace. A lane loads every tap of its channels before it
//    computes (one round trip). The taps before the call's first row come from the slot's conv
//    state; for a one-row sequence (decode) the row's CTA also writes the new conv state (no other
//    CTA reads it), for longer ones the rule kernel does, after this kernel has finished.
//
// 2. gdn_rule_kernel<dk, dv>, 256 threads, 2 CTAs per SM looping over the items (sequence, value
//    head) (or one CTA per item). The item's state S [dk, dv] (contiguous, 64 KiB at 128 x 128)
//    arrives in shared memory by one bulk copy (TMA) and is held in registers while the item runs,
//    and the next item's copy is in flight meanwhile; the first copy is issued before the kernel
//    waits for the conv kernel (programmatic dependent launch). Thread (rg, cg) holds columns
//    [4 cg, 4 cg + 4) of rows rg + i * row_groups. Per token, one pass over the registers gives the
//    partial sums of S^T k and S^T q; one shared-memory combine over the row groups; then, with
//    decay = exp(g),
//        delta = beta (v - decay S^T k),   o = decay S^T q + (k.q) delta,   S = decay S + k delta^T
//    (the reference's S = decay S; delta = beta (v - S^T k); S += k delta^T; o = S^T q, regrouped
//    so that one reduction serves both products), and the gated RMSNorm of o by warp shuffles.
//    The next token's q, k, v, z and gates are loaded during the current token's pass (three
//    staging buffers and two combine buffers make one __syncthreads per token enough). S is
//    written back (coalesced 16-byte stores) once per item, so a prefill of T tokens reads and
//    writes it once. For sequences of several rows the CTA of value head h also writes the slot's
//    new conv state of head h's v channels and, for the first value head of each key head, of the
//    key head's q and k channels: every channel once, after the conv kernel has read the old state.
//
// Input deltas (GdnInputDelta: a LoRA expand's rows beside the projection's). Calls that carry
// them take separate instances of both kernels (kDelta), which add a row's delta to q / k / v
// (conv taps of this call's rows), b, a and z as they read them, as bf16(x + delta): what the
// expand's in-place add would have left, so the conv state and every output are bitwise those of
// the in-place path. Calls without deltas run the kDelta = false instances, the code without them.
//
// Decode bandwidth. At Qwen3.5's shape (nv = 32, dk = dv = 128) a decode step moves 2 MiB of state
// in and 2 MiB out per sequence; everything else (qkv, z, the conv states, the fp32 workspace) adds
// ~6%. The byte limit is then (4 MiB B) / 4.8 TB/s, 56 us at B = 64. We expected 75-85% of it at
// B = 64 from the bytes in flight (one 64 KiB copy per CTA, two CTAs per SM: ~128 KiB per SM, well
// above the ~30 KiB that 4.8 TB/s needs at ~800 ns). Measured on an H200 (Sm90_Gdn.DecodeBandwidth-
// Qwen35Shape, L2 flushed before each step): B = 64 in 86 us, 65% of the limit (69% counting all
// bytes; the rule kernel alone 73 us at 69% of DRAM peak under ncu); B = 8 at 33%, B = 1 in 14 us
// (one wave of B nv CTAs: latency, the conv kernel's dependent loads then one state round trip).
// What is lost at B = 64 is the per-item chain of dependent loads (the item's gates, the next
// item's lookup) between copies, and the read/write mix (a device copy reaches ~90% of peak).
// Small batches need the state split over more CTAs (dk over a cluster) to fill the machine.
#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/gdn/gdn_cuda.cuh"
#include "ops/gdn/gdn_internal_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

using namespace gdn_detail;

constexpr int kConvWarps = 8;
constexpr int kRuleThreads = 256;
constexpr int kRuleCtasPerSm = 2;    // __launch_bounds__ below; 2 x (64 + 23) KB shared memory
constexpr float kL2NormEps = 1e-6f;  // as the reference (and transformers' l2norm)

size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// Region sizes in bytes, in workspace order (q, k, v, beta, g, kq).
void scratch_bytes(const GdnShape& s, int max_tokens, size_t out[6]) {
  const size_t rows = static_cast<size_t>(max_tokens < 0 ? 0 : max_tokens);
  const size_t kd = static_cast<size_t>(s.key_dim()), vd = static_cast<size_t>(s.value_dim());
  const size_t nv = static_cast<size_t>(s.num_v_heads), nk = static_cast<size_t>(s.num_k_heads);
  const size_t widths[6] = {kd, kd, vd, nv, nv, nk};
  for (int i = 0; i < 6; ++i) out[i] = align256(rows * widths[i] * sizeof(float));
}

// The sequence holding batch row `row` (the last b with cu_seqlens[b] <= row), or -1 for a row
// outside the batch; called by whole warps. Each round the lanes test 32 evenly spaced boundaries
// of the remaining range at once (a ballot counts those <= row), so max_seqs <= 1024 takes two
// dependent rounds of loads instead of a binary search's ten; a decode batch (sequence b = row b)
// is recognised in the first round.
__device__ int sequence_of_row(const GdnParams& p, int row) {
  const int lane = threadIdx.x % 32;
  const int guess = min(row, p.max_seqs - 1);  // right when every sequence has one row (decode)
  const int first = p.cu_seqlens[0], end = p.cu_seqlens[p.max_seqs];
  const int guess_start = p.cu_seqlens[guess], guess_end = p.cu_seqlens[guess + 1];
  if (row < first || row >= end) return -1;
  if (guess_start <= row && row < guess_end) return guess;
  int lo = 0, n = p.max_seqs;  // the sequence is in [lo, lo + n); cu[lo] <= row
  while (n > 1) {
    const int step = (n + 31) / 32;
    const bool below =
        lane > 0 && step * lane < n && p.cu_seqlens[lo + step * lane] <= row;  // a prefix of lanes
    const int count = __popc(__ballot_sync(0xffffffffu, below));
    lo += step * count;
    n = min(step, n - step * count);
  }
  return lo;
}

// The conv taps of channel c for the sequence's token t (batch row `row`): u[t .. t + K - 1] with
// u = the slot's K - 1 stored inputs followed by the sequence's rows of this call, and the weights.
// A lane loads the taps of all its channels before it computes or stores anything, and the
// addresses are selected rather than branched on, so that all those loads issue together
// (otherwise each tap costs an L2 round trip).
template <int kK>
struct ConvTaps {
  __nv_bfloat16 x[kK];
  float w[kK];

  __device__ __forceinline__ void load_plain(const GdnParams& p, int64_t row, int t, int slot,
                                             int c) {
    constexpr int k1 = kK - 1;
    const __nv_bfloat16* state = p.conv_state + (static_cast<int64_t>(slot) * p.conv_dim + c) * k1;
#pragma unroll
    for (int j = 0; j < kK; ++j) {
      const int u = t + j;
      x[j] = *(u < k1 ? state + u : p.qkv + (row - t + u - k1) * p.qkv_stride + c);
      w[j] = __bfloat162float(p.conv_weight[static_cast<int64_t>(c) * kK + j]);
    }
  }

  // has_delta (kDelta instances only): the sequence's rows carry a LoRA delta (GdnInputDelta),
  // added to the taps from this call's rows (the conv state holds inputs with their deltas). The
  // delta loads wait for the row's slot lookup (has_delta); issuing them beside the taps' loads
  // instead measured the same (docs/gpu_engine.md §3a).
  template <bool kDelta>
  __device__ __forceinline__ void load(const GdnParams& p, int64_t row, int t, int slot, int c,
                                       bool has_delta) {
    load_plain(p, row, t, slot, c);
    if constexpr (kDelta) {
      constexpr int k1 = kK - 1;
      if (has_delta) {
#pragma unroll
        for (int j = 0; j < kK; ++j) {
          const int64_t src = row + j - k1;  // tap j's batch row, when it is one of this call's
          if (t + j >= k1) x[j] = add_delta(x[j], p.delta.qkv[src * p.delta.stride + c]);
        }
      }
    }
  }
  // silu(sum_j w[j] u[t + j]), summed in the reference's order.
  __device__ __forceinline__ float conv_silu() const {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kK; ++j) acc += w[j] * __bfloat162float(x[j]);
    return silu(acc);
  }
  // For a one-row sequence (a decode step) this row is the only reader of the channel's state, so
  // the conv kernel writes the new state (u[1 .. K - 1]); longer ones leave it to the rule kernel.
  __device__ __forceinline__ void store_state(const GdnParams& p, int slot, int c) const {
    __nv_bfloat16* state = p.conv_state + (static_cast<int64_t>(slot) * p.conv_dim + c) * (kK - 1);
#pragma unroll
    for (int j = 0; j < kK - 1; ++j) state[j] = x[j + 1];
  }
};

// Grid (max_tokens, ceil((nk + nv) / kConvWarps)); see the file comment. kDelta: the instance for
// calls with input deltas (GdnInputDelta).
template <int kDk, int kDv, int kK, bool kDelta>
__global__ void __launch_bounds__(kConvWarps * 32) gdn_conv_kernel(const GdnParams p) {
  ::moelora::cuda::sm90::grid_dependency_wait();
  ::moelora::cuda::sm90::launch_dependents();
  const int row = blockIdx.x;
  const int seq = sequence_of_row(p, row);
  if (seq < 0) return;
  const int slot = p.slots[seq];
  if (!slot_valid(p, slot)) return;
  const int t = row - p.cu_seqlens[seq], T = p.cu_seqlens[seq + 1] - p.cu_seqlens[seq];
  const int64_t r = row;
  const bool has_delta = kDelta && row_has_delta(p, r);
  const int lane = threadIdx.x % 32;
  const int segment = blockIdx.y * kConvWarps + threadIdx.x / 32;

  if (segment < p.nk) {  // key head: q and k channels
    constexpr int kPerLane = kDk / 32;
    const int kh = segment;
    ConvTaps<kK> tq[kPerLane], tk[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = kh * kDk + lane + 32 * i;
      tq[i].template load<kDelta>(p, r, t, slot, c, has_delta);
      tk[i].template load<kDelta>(p, r, t, slot, p.key_dim + c, has_delta);
    }
    float q[kPerLane], k[kPerLane], ss_q = 0.0f, ss_k = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      q[i] = tq[i].conv_silu();
      k[i] = tk[i].conv_silu();
      ss_q += q[i] * q[i];
      ss_k += k[i] * k[i];
    }
    const float inv_q = 1.0f / sqrtf(warp_sum(ss_q) + kL2NormEps);
    const float inv_k = 1.0f / sqrtf(warp_sum(ss_k) + kL2NormEps);
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t o = r * p.key_dim + kh * kDk + lane + 32 * i;
      q[i] = q[i] * inv_q * p.q_scale;  // in the reference's order
      k[i] = k[i] * inv_k;
      p.ws.q[o] = q[i];
      p.ws.k[o] = k[i];
      dot += q[i] * k[i];
    }
    dot = warp_sum(dot);
    if (lane == 0) p.ws.kq[r * p.nk + kh] = dot;
    if (T == 1) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int c = kh * kDk + lane + 32 * i;
        tq[i].store_state(p, slot, c);
        tk[i].store_state(p, slot, p.key_dim + c);
      }
    }
  } else if (segment < p.nk + p.nv) {  // value head: v channels
    constexpr int kPerLane = kDv / 32;
    const int c0 = 2 * p.key_dim + (segment - p.nk) * kDv + lane;
    const int64_t o0 = r * p.value_dim + (segment - p.nk) * kDv + lane;
    ConvTaps<kK> tv[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      tv[i].template load<kDelta>(p, r, t, slot, c0 + 32 * i, has_delta);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) p.ws.v[o0 + 32 * i] = tv[i].conv_silu();
    if (T == 1) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) tv[i].store_state(p, slot, c0 + 32 * i);
    }
  }

  if (blockIdx.y == 0) {
    for (int h = threadIdx.x; h < p.nv; h += blockDim.x) {
      __nv_bfloat16 b = p.b[r * p.b_stride + h], a = p.a[r * p.a_stride + h];
      if (has_delta) {
        b = add_delta(b, p.delta.b[r * p.delta.stride + h]);
        a = add_delta(a, p.delta.a[r * p.delta.stride + h]);
      }
      const float bv = __bfloat162float(b);
      const float av = __bfloat162float(a);
      p.ws.beta[r * p.nv + h] = 1.0f / (1.0f + expf(-bv));
      p.ws.g[r * p.nv + h] = -expf(p.a_log[h]) * softplus(av + p.dt_bias[h]);
    }
  }
}

__device__ __forceinline__ void fma4(float4& acc, const float4& s, float x) {
  acc.x += s.x * x;
  acc.y += s.y * x;
  acc.z += s.z * x;
  acc.w += s.w * x;
}
__device__ __forceinline__ void add4(float4& acc, const float4& v) {
  acc.x += v.x;
  acc.y += v.y;
  acc.z += v.z;
  acc.w += v.w;
}

// Shared-memory staging of one token for the rule kernel: [q (dk) | k (dk) | v (dv) | z (dv) |
// beta, decay, k.q, pad], fp32.
template <int kDk, int kDv>
struct RuleStage {
  static constexpr int kOffQ = 0, kOffK = kDk, kOffV = 2 * kDk, kOffZ = 2 * kDk + kDv;
  static constexpr int kOffBeta = 2 * kDk + 2 * kDv, kOffDecay = kOffBeta + 1,
                       kOffKq = kOffBeta + 2;
  static constexpr int kFloats = kOffBeta + 4;
  static constexpr int kVectors = kOffBeta / 4;  // threads loading one float4 each
  static constexpr int kLoaders = kVectors + 3;  // and three scalar loaders
  static_assert(kLoaders <= kRuleThreads, "one staged value per thread");
};

// Thread `tid`'s share of token row `row` for the stage (tid < kLoaders): a float4 of q, k, v or
// z, or one scalar in .x (beta, decay = exp(g), k.q).
template <int kDk, int kDv, bool kDelta>
__device__ __forceinline__ float4 load_stage(const GdnParams& p, int64_t row, int h, int kh,
                                             int tid, bool has_delta) {
  using St = RuleStage<kDk, kDv>;
  const int e = 4 * tid;  // offset in the stage
  if (e < St::kOffK) {
    return *reinterpret_cast<const float4*>(p.ws.q + row * p.key_dim + kh * kDk + e);
  }
  if (e < St::kOffV) {
    return *reinterpret_cast<const float4*>(p.ws.k + row * p.key_dim + kh * kDk + (e - St::kOffK));
  }
  if (e < St::kOffZ) {
    return *reinterpret_cast<const float4*>(p.ws.v + row * p.value_dim + h * kDv + (e - St::kOffV));
  }
  if (e < St::kOffBeta) {  // four bf16 loads: z may be a column slice at any element offset
    const int64_t col = h * kDv + (e - St::kOffZ);
    const __nv_bfloat16* z = p.z + row * p.z_stride + col;
    __nv_bfloat16 zv[4] = {z[0], z[1], z[2], z[3]};
    if (kDelta && has_delta) {
      const __nv_bfloat16* dz = p.delta.z + row * p.delta.stride + col;
#pragma unroll
      for (int i = 0; i < 4; ++i) zv[i] = add_delta(zv[i], dz[i]);
    }
    return make_float4(__bfloat162float(zv[0]), __bfloat162float(zv[1]), __bfloat162float(zv[2]),
                       __bfloat162float(zv[3]));
  }
  const int which = tid - St::kVectors;
  float v;
  if (which == 0) {
    v = p.ws.beta[row * p.nv + h];
  } else if (which == 1) {
    v = expf(p.ws.g[row * p.nv + h]);
  } else {
    v = p.ws.kq[row * p.nk + kh];
  }
  return make_float4(v, 0.0f, 0.0f, 0.0f);
}

template <int kDk, int kDv>
__device__ __forceinline__ void store_stage(float* stage, int tid, const float4& v) {
  using St = RuleStage<kDk, kDv>;
  if (tid < St::kVectors) {
    *reinterpret_cast<float4*>(stage + 4 * tid) = v;
  } else {
    stage[St::kOffBeta + (tid - St::kVectors)] = v.x;
  }
}

// Bulk copy (TMA, no tensor map) of `bytes` contiguous bytes global -> shared, completion counted
// on the mbarrier `bar`. Addresses 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Orders this thread's (and, after a barrier, the CTA's) generic-proxy shared-memory accesses
// before later async-proxy (bulk copy) ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One (sequence, value head) of the rule kernel.
struct RuleItem {
  int h, slot, start, T;
};

// The first runnable item among item, item + gridDim.x, ... (items are seq * nv + h), or `items`
// when there is none; fills `it` for it.
__device__ int next_item(const GdnParams& p, int item, int items, RuleItem& it) {
  for (; item < items; item += gridDim.x) {
    const int seq = item / p.nv;
    it.h = item - seq * p.nv;
    it.start = p.cu_seqlens[seq];
    it.T = p.cu_seqlens[seq + 1] - it.start;
    it.slot = p.slots[seq];
    const bool chunked =
        p.chunk_min_tokens > 0 && it.T >= p.chunk_min_tokens;  // the other kernel's
    if (it.T > 0 && !chunked && slot_valid(p, it.slot)) return item;
  }
  return items;
}

template <int kDk, int kDv>
__device__ __forceinline__ float* state_of(const GdnParams& p, const RuleItem& it) {
  return p.recurrent_state + (static_cast<int64_t>(it.slot) * p.nv + it.h) * kDk * kDv;
}

// Grid: min(nv max_seqs, 2 SMs) CTAs of kRuleThreads threads, each looping over the items
// blockIdx.x, blockIdx.x + gridDim.x, ...; dynamic shared memory: one state [dk, dv] (fp32). See
// the file comment. kDelta: the instance for calls with input deltas (GdnInputDelta).
template <int kDk, int kDv, bool kDelta>
__global__ void __launch_bounds__(kRuleThreads, 2) gdn_rule_kernel(const GdnParams p) {
  constexpr int kColGroups = kDv / 4;                    // threads across a row (float4 each)
  constexpr int kRowGroups = kRuleThreads / kColGroups;  // 8 (dv 128) or 16 (dv 64)
  constexpr int kRows = kDk / kRowGroups;                // state rows per thread
  constexpr uint32_t kStateBytes = kDk * kDv * sizeof(float);
  static_assert(kColGroups <= 32 && 32 % kColGroups == 0, "a row's column groups share a warp");
  static_assert(kRows * kRowGroups == kDk, "dk splits over the row groups");
  using St = RuleStage<kDk, kDv>;
  extern __shared__ __align__(128) float state_smem[];  // [dk, dv]: the current item's S
  __shared__ __align__(16) float stage[3][St::kFloats];
  __shared__ float4 partial[2][2][kRowGroups][kColGroups];  // [buffer][S^T k, S^T q][rg][cg]
  __shared__ __align__(8) uint64_t state_bar;

  const int items = p.nv * p.max_seqs;
  RuleItem it;
  int item = next_item(p, blockIdx.x, items, it);
  if (item >= items) return;  // uniform over the CTA
  const int tid = threadIdx.x, cg = tid % kColGroups, rg = tid / kColGroups;
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&state_bar));
  const uint32_t state_addr = static_cast<uint32_t>(__cvta_generic_to_shared(state_smem));
  // The first item's state is copied before the wait for the conv kernel (it is not its output).
  if (tid == 0) {
    ::moelora::cuda::sm90::mbar_init(bar, 1);
    ::moelora::cuda::sm90::fence_barrier_init();
    ::moelora::cuda::sm90::mbar_arrive_expect_tx(bar, kStateBytes);
    bulk_load(state_addr, state_of<kDk, kDv>(p, it), kStateBytes, bar);
  }
  float4 w = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (tid < 32 && rg == 0) {
    w = make_float4(p.norm_weight[4 * cg], p.norm_weight[4 * cg + 1], p.norm_weight[4 * cg + 2],
                    p.norm_weight[4 * cg + 3]);
  }
  __syncthreads();  // the barrier is initialised before anyone waits on it
  ::moelora::cuda::sm90::grid_dependency_wait();

  for (uint32_t phase = 0;; phase ^= 1) {
    const int kh = it.h / p.group;
    // the sequence's rows share their adapter
    const bool has_delta = kDelta && row_has_delta(p, it.start);
    // The first token's loads are issued first; the next item's lookup and the conv state update
    // (which stall on their own loads) and the state copy in flight overlap them.
    float4 next = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (tid < St::kLoaders)
      next = load_stage<kDk, kDv, kDelta>(p, it.start, it.h, kh, tid, has_delta);
    RuleItem next_it;
    const int next_index = next_item(p, item + gridDim.x, items, next_it);
    update_conv_state<kDelta>(p, it.h, it.slot, it.start, it.T);

    // S: thread (rg, cg) holds S[rg + i * kRowGroups][4 cg .. 4 cg + 4), i < kRows.
    ::moelora::cuda::sm90::mbar_wait(bar, phase);
    float4 s[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      s[i] = *reinterpret_cast<const float4*>(state_smem + (rg + i * kRowGroups) * kDv + 4 * cg);
    }
    __syncthreads();  // the state buffer is read, and the previous item's tokens are done
    if (tid == 0 && next_index < items) {  // the next item's state streams in during this one
      fence_proxy_async_shared();
      ::moelora::cuda::sm90::mbar_arrive_expect_tx(bar, kStateBytes);
      bulk_load(state_addr, state_of<kDk, kDv>(p, next_it), kStateBytes, bar);
    }
    if (tid < St::kLoaders) store_stage<kDk, kDv>(stage[0], tid, next);
    __syncthreads();

    int cur = 0;  // stage of token t
    for (int t = 0; t < it.T; ++t) {
      const float* st = stage[cur];
      const int nxt = cur == 2 ? 0 : cur + 1;
      const bool more = t + 1 < it.T;
      if (more && tid < St::kLoaders)
        next = load_stage<kDk, kDv, kDelta>(p, it.start + t + 1, it.h, kh, tid, has_delta);

      // Partial S^T k and S^T q over this thread's rows.
      float4 pk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), pq = pk;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int row = rg + i * kRowGroups;
        fma4(pk, s[i], st[St::kOffK + row]);
        fma4(pq, s[i], st[St::kOffQ + row]);
      }
      partial[t & 1][0][rg][cg] = pk;
      partial[t & 1][1][rg][cg] = pq;
      if (more && tid < St::kLoaders) store_stage<kDk, kDv>(stage[nxt], tid, next);
      __syncthreads();

      float4 sk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), sq = sk;
#pragma unroll
      for (int g = 0; g < kRowGroups; ++g) {
        add4(sk, partial[t & 1][0][g][cg]);
        add4(sq, partial[t & 1][1][g][cg]);
      }
      const float beta = st[St::kOffBeta], decay = st[St::kOffDecay], kq = st[St::kOffKq];
      const float4 v = *reinterpret_cast<const float4*>(st + St::kOffV + 4 * cg);
      const float4 delta = make_float4(beta * (v.x - decay * sk.x), beta * (v.y - decay * sk.y),
                                       beta * (v.z - decay * sk.z), beta * (v.w - decay * sk.w));
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const float k = st[St::kOffK + rg + i * kRowGroups];
        s[i].x = decay * s[i].x + k * delta.x;
        s[i].y = decay * s[i].y + k * delta.y;
        s[i].z = decay * s[i].z + k * delta.z;
        s[i].w = decay * s[i].w + k * delta.w;
      }

      if (tid < 32) {  // warp 0 holds every column (its row groups 0 .. 32 / kColGroups - 1)
        const float4 o = make_float4(decay * sq.x + kq * delta.x, decay * sq.y + kq * delta.y,
                                     decay * sq.z + kq * delta.z, decay * sq.w + kq * delta.w);
        float ss = o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w;
#pragma unroll
        for (int off = kColGroups / 2; off > 0; off >>= 1)
          ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float inv = 1.0f / sqrtf(ss / static_cast<float>(kDv) + p.norm_eps);
        if (rg == 0) {
          const float4 z = *reinterpret_cast<const float4*>(st + St::kOffZ + 4 * cg);
          const __nv_bfloat162 y01 =
              __floats2bfloat162_rn(w.x * (o.x * inv) * silu(z.x), w.y * (o.y * inv) * silu(z.y));
          const __nv_bfloat162 y23 =
              __floats2bfloat162_rn(w.z * (o.z * inv) * silu(z.z), w.w * (o.w * inv) * silu(z.w));
          uint2 raw;
          raw.x = *reinterpret_cast<const uint32_t*>(&y01);
          raw.y = *reinterpret_cast<const uint32_t*>(&y23);
          *reinterpret_cast<uint2*>(p.out + (static_cast<int64_t>(it.start) + t) * p.out_stride +
                                    it.h * kDv + 4 * cg) = raw;
        }
      }
      cur = nxt;
    }

    float* state = state_of<kDk, kDv>(p, it) + 4 * cg;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      __stcs(reinterpret_cast<float4*>(state + (rg + i * kRowGroups) * kDv), s[i]);
    }
    if (next_index >= items) break;
    item = next_index;
    it = next_it;
  }
}

bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

bool head_dim_supported(int64_t d) {
  return d == 64 || d == 128;
}

Status invalid(std::string message) {
  return Status(ErrorCode::kInvalidArgument, "gdn_mix: " + std::move(message));
}

template <int kDk, int kDv, bool kDelta>
void launch_pair(const GdnParams& p, const GdnMixArgs& args, cudaStream_t stream) {
  const dim3 conv_grid(args.max_tokens, (p.nk + p.nv + kConvWarps - 1) / kConvWarps);
  const dim3 conv_block(kConvWarps * 32);
  switch (p.conv_kernel) {
    case 2:
      ::moelora::cuda::launch_kernel(gdn_conv_kernel<kDk, kDv, 2, kDelta>, conv_grid, conv_block, 0,
                                     stream, args.pdl, p);
      break;
    case 3:
      ::moelora::cuda::launch_kernel(gdn_conv_kernel<kDk, kDv, 3, kDelta>, conv_grid, conv_block, 0,
                                     stream, args.pdl, p);
      break;
    default:
      ::moelora::cuda::launch_kernel(gdn_conv_kernel<kDk, kDv, 4, kDelta>, conv_grid, conv_block, 0,
                                     stream, args.pdl, p);
      break;
  }
  // Always a programmatic dependent of the conv kernel, which lets it start at once: the state
  // loads overlap the conv kernel, and the kernel waits for it before reading the workspace. It
  // does not trigger its own dependents early (they would hold SM slots its later waves need).
  const int items = p.nv * args.max_seqs;
  const int grid = args.num_sms > 0 ? std::min(items, kRuleCtasPerSm * args.num_sms) : items;
  constexpr int kSmem = kDk * kDv * sizeof(float);
  auto kernel = gdn_rule_kernel<kDk, kDv, kDelta>;
  MOELORA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  ::moelora::cuda::launch_kernel(kernel, dim3(grid), dim3(kRuleThreads), kSmem, stream, true, p);
  // The chunked rule kernel (gdn_chunk_cuda.cu) for the long sequences, only when the call can
  // hold one: a decode step's graph never contains it.
  if (p.chunk_min_tokens > 0 && args.max_tokens >= p.chunk_min_tokens)
    launch_gdn_chunk_rule(p, args.max_seqs, stream);
}

}  // namespace

size_t gdn_mix_workspace_bytes(const GdnShape& shape, int max_tokens) {
  size_t regions[6];
  scratch_bytes(shape, max_tokens, regions);
  size_t total = 0;
  for (size_t r : regions) total += r;
  return total;
}

Status can_implement_gdn_mix(const GdnMixArgs& a) {
  using detail::concat;
  const GdnShape& s = a.shape;
  if (s.num_k_heads <= 0 || s.num_v_heads <= 0 || s.num_v_heads % s.num_k_heads != 0)
    return invalid(concat("num_v_heads ", s.num_v_heads, " must be a positive multiple of ",
                          "num_k_heads ", s.num_k_heads));
  if (!head_dim_supported(s.head_k_dim) || !head_dim_supported(s.head_v_dim))
    return Status(ErrorCode::kUnsupported,
                  concat("gdn_mix: head dims dk = ", s.head_k_dim, ", dv = ", s.head_v_dim,
                         " unsupported; supported: 64, 128 each"));
  if (s.conv_kernel < 2 || s.conv_kernel > kGdnMaxConvKernel)
    return Status(ErrorCode::kUnsupported,
                  concat("gdn_mix: conv kernel width ", s.conv_kernel,
                         " unsupported; supported: 2 .. ", kGdnMaxConvKernel));
  if (!(s.norm_eps >= 0.0)) return invalid(concat("norm_eps must be >= 0, got ", s.norm_eps));
  if (s.conv_dim() > INT32_MAX / 2 || s.num_v_heads > 65535)
    return invalid(concat("conv_dim ", s.conv_dim(), " / num_v_heads ", s.num_v_heads,
                          " too large (<= 2^30 / 65535)"));
  if (a.max_seqs < 0 || a.max_seqs > INT32_MAX / s.num_v_heads)
    return invalid(concat("max_seqs must be in [0, 2^31 / nv], got ", a.max_seqs));
  if (a.chunked_min_tokens < 0)
    return invalid(
        concat("chunked_min_tokens must be >= 0 (0: no chunked form), got ", a.chunked_min_tokens));
  const GdnInputDelta& d = a.delta;
  if (d.qkv || d.z || d.b || d.a || d.row_slot) {
    std::string missing;
    const std::pair<const void*, const char*> parts[] = {
        {d.qkv, "qkv"}, {d.z, "z"}, {d.b, "b"}, {d.a, "a"}, {d.row_slot, "row_slot"}};
    for (const auto& [ptr, name] : parts)
      if (!ptr) missing += std::string(missing.empty() ? "" : ", ") + "delta." + name;
    if (!missing.empty())
      return invalid(concat("delta needs all of qkv, z, b, a and row_slot; null: ", missing));
    if (d.stride < s.conv_dim())
      return invalid(concat("delta.stride ", d.stride,
                            " is smaller than the widest input, conv_dim ", s.conv_dim()));
    if (a.chunked_min_tokens > 0)
      return Status(ErrorCode::kUnsupported,
                    concat("gdn_mix: input deltas are read by the recurrent kernels only; got "
                           "chunked_min_tokens = ",
                           a.chunked_min_tokens, " (pass 0, or add the deltas in place)"));
  }
  if (a.num_sms < 0) return invalid(concat("num_sms must be >= 0, got ", a.num_sms));
  if (a.max_tokens < 0) return invalid(concat("max_tokens must be >= 0, got ", a.max_tokens));
  if (a.max_seqs == 0 || a.max_tokens == 0) return Status::ok();  // nothing to run
  if (a.num_slots <= 0) return invalid(concat("num_slots must be > 0, got ", a.num_slots));

  const std::pair<const void*, const char*> required[] = {{a.cu_seqlens, "cu_seqlens"},
                                                          {a.slots, "slots"},
                                                          {a.qkv, "qkv"},
                                                          {a.z, "z"},
                                                          {a.b, "b"},
                                                          {a.a, "a"},
                                                          {a.conv_weight, "conv_weight"},
                                                          {a.a_log, "a_log"},
                                                          {a.dt_bias, "dt_bias"},
                                                          {a.norm_weight, "norm_weight"},
                                                          {a.recurrent_state, "recurrent_state"},
                                                          {a.out, "out"},
                                                          {a.workspace, "workspace"}};
  for (const auto& [ptr, name] : required)
    if (!ptr) return invalid(concat(name, " must be a device pointer (got null)"));

  const std::tuple<int64_t, int64_t, const char*> strides[] = {
      {a.qkv_stride, s.conv_dim(), "qkv_stride"},
      {a.z_stride, s.value_dim(), "z_stride"},
      {a.b_stride, s.num_v_heads, "b_stride"},
      {a.a_stride, s.num_v_heads, "a_stride"},
      {a.out_stride, s.value_dim(), "out_stride"}};
  for (const auto& [stride, width, name] : strides)
    if (stride < width)
      return invalid(concat(name, " ", stride, " is smaller than the row width ", width));
  if (a.out_stride % 4 != 0 || !aligned(a.out, 8))
    return invalid(concat("out rows must be 8-byte aligned (4 bf16): out_stride ", a.out_stride,
                          " (a multiple of 4), out at ", a.out));
  if (!aligned(a.recurrent_state, 16))
    return invalid(concat("recurrent_state must be 16-byte aligned, got ", a.recurrent_state));
  if (!aligned(a.workspace, 256))
    return invalid(concat("workspace must be 256-byte aligned, got ", a.workspace));
  const size_t need = gdn_mix_workspace_bytes(s, a.max_tokens);
  if (a.workspace_bytes < need)
    return invalid(concat("workspace of ", a.workspace_bytes, " bytes is too small: ", need,
                          " needed for max_tokens ", a.max_tokens));
  return Status::ok();
}

void launch_gdn_mix(const GdnMixArgs& args, cudaStream_t stream) {
  const Status ok = can_implement_gdn_mix(args);
  MOELORA_CHECK(ok.is_ok(), ok.code(), ok.message());
  if (args.max_seqs == 0 || args.max_tokens == 0) return;
  const GdnShape& s = args.shape;

  GdnParams p{};
  p.nk = static_cast<int>(s.num_k_heads);
  p.nv = static_cast<int>(s.num_v_heads);
  p.dk = static_cast<int>(s.head_k_dim);
  p.dv = static_cast<int>(s.head_v_dim);
  p.conv_kernel = static_cast<int>(s.conv_kernel);
  p.conv_dim = static_cast<int>(s.conv_dim());
  p.key_dim = static_cast<int>(s.key_dim());
  p.value_dim = static_cast<int>(s.value_dim());
  p.group = p.nv / p.nk;
  p.norm_eps = static_cast<float>(s.norm_eps);
  p.q_scale = 1.0f / sqrtf(static_cast<float>(p.dk));  // as the reference
  p.cu_seqlens = args.cu_seqlens;
  p.slots = args.slots;
  p.max_seqs = args.max_seqs;
  p.num_slots = args.num_slots;
  p.chunk_min_tokens = args.chunked_min_tokens;
  p.qkv = args.qkv;
  p.z = args.z;
  p.b = args.b;
  p.a = args.a;
  p.qkv_stride = args.qkv_stride;
  p.z_stride = args.z_stride;
  p.b_stride = args.b_stride;
  p.a_stride = args.a_stride;
  p.delta = args.delta;
  p.conv_weight = args.conv_weight;
  p.a_log = args.a_log;
  p.dt_bias = args.dt_bias;
  p.norm_weight = args.norm_weight;
  p.conv_state = args.conv_state;
  p.recurrent_state = args.recurrent_state;
  p.out = args.out;
  p.out_stride = args.out_stride;
  size_t regions[6];
  scratch_bytes(s, args.max_tokens, regions);
  char* base = static_cast<char*>(args.workspace);
  float** dst[6] = {&p.ws.q, &p.ws.k, &p.ws.v, &p.ws.beta, &p.ws.g, &p.ws.kq};
  for (int i = 0; i < 6; ++i) {
    *dst[i] = reinterpret_cast<float*>(base);
    base += regions[i];
  }

  // Calls with input deltas take their own instances (the others keep the code without them).
  const bool delta = p.delta.qkv != nullptr;
  switch (p.dk * 1000 + p.dv + (delta ? 1 : 0)) {
    case 64064: launch_pair<64, 64, false>(p, args, stream); break;
    case 64065: launch_pair<64, 64, true>(p, args, stream); break;
    case 64128: launch_pair<64, 128, false>(p, args, stream); break;
    case 64129: launch_pair<64, 128, true>(p, args, stream); break;
    case 128064: launch_pair<128, 64, false>(p, args, stream); break;
    case 128065: launch_pair<128, 64, true>(p, args, stream); break;
    case 128129: launch_pair<128, 128, true>(p, args, stream); break;
    default: launch_pair<128, 128, false>(p, args, stream); break;
  }
}

}  // namespace moelora::ops::cuda
