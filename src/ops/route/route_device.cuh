// Device pieces shared by the two router launches (route_cuda.cu: logits given; router_route_cuda.cu:
// the router GEMM in the same launch): the per-token routing of one warp and the optional x row
// quant of the expert GEMV chain. Internal to ops/route.
//
// Routing: one warp per token. Each lane holds experts lane, lane + 32, ... in registers (E <= 1024).
// Selection is k rounds of a warp max over 64-bit keys (value, then the lower expert index), so
// the result is deterministic and in the CPU reference's descending order. Softmax routers compare
// exp(l - max) before the division by the sum: the same order as the probabilities except where
// that division rounds two different values to one probability (a near-tie within one rounding:
// the reference then takes the lower index, this kernel the larger exp). For noaux_tc with groups
// the biased scores are staged in shared memory so that one lane per group can sum its group's
// top-2.
#pragma once

#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>

#include "ops/quant/fp8_device.cuh"
#include "ops/route/route_cuda.cuh"

namespace moelora::ops::cuda::route_internal {

constexpr int kMaxExperts = 1024;

struct ArgMax {
  float value;
  int index;
};

// Larger value wins; equal values go to the lower index; index -1 never wins.
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  if (b.index < 0) return a;
  if (a.index < 0) return b;
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    ArgMax o{__shfl_xor_sync(0xffffffffu, v.value, offset), __shfl_xor_sync(0xffffffffu, v.index, offset)};
    v = better(v, o);
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Warp max of finite floats: one redux.sync on order-preserving integers (negative values have
// their magnitude bits flipped) instead of five dependent shuffles.
__device__ __forceinline__ float warp_max(float v) {
  int bits = __float_as_int(v);
  bits = bits >= 0 ? bits : bits ^ 0x7fffffff;
  bits = __reduce_max_sync(0xffffffffu, bits);
  return __int_as_float(bits >= 0 ? bits : bits ^ 0x7fffffff);
}

// Selection key of (value, expert): a larger value gives a larger key, equal values the lower
// expert the larger key, and 0 is below every entry (no expert). One 64-bit max then does what a
// (value, index) argmax with tie-breaking does, in a quarter of the instructions.
using Key = unsigned long long;
__device__ __forceinline__ Key selection_key(float value, int expert) {
  uint32_t bits = __float_as_uint(value);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // order-preserving for non-NaN
  return (static_cast<Key>(bits) << 32) | (0xffffffffu - static_cast<uint32_t>(expert));
}
__device__ __forceinline__ int key_expert(Key key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}
// The warp's largest key: the high words' max, then the low words' max among the lanes that hold
// it (two redux.sync; the 64-bit shuffle tree it replaces was the routing's critical path: ten
// dependent shuffles per pick, about 3.3 us of a 16-token tile at E = 128 on the H200).
__device__ __forceinline__ Key warp_max_key(Key v) {
  const uint32_t hi = static_cast<uint32_t>(v >> 32), lo = static_cast<uint32_t>(v);
  const uint32_t max_hi = __reduce_max_sync(0xffffffffu, hi);
  const uint32_t max_lo = __reduce_max_sync(0xffffffffu, hi == max_hi ? lo : 0u);
  return (static_cast<Key>(max_hi) << 32) | max_lo;
}

struct KernelParams {
  RouteDeviceArgs a;
  int E, k, n_group, topk_group;
  bool renormalize;
  float routed_scaling_factor;
};

// Warp routing of one token from its logits row [E]. kMaxPerLane experts per lane (E <= 32 *
// kMaxPerLane): the unrolled loops only cover what E needs. The top-k is k rounds of a warp-wide
// max over each lane's best key; only the lane that owned the winner rescans its own experts. A
// single dependent chain per token (about a thousand instructions): a decode MoE layer waits for
// it before anything else. biased: [E] shared-memory staging of this warp (noaux_tc with groups);
// group_kept: [32] of this warp. Padding tokens (>= *num_tokens) get ids -1 and weights 0.
template <int kMaxPerLane, bool kNoauxTc>
__device__ __forceinline__ void route_token(const KernelParams& p, int token, const float* logits,
                                            float* biased, unsigned char* group_kept) {
  const int lane = threadIdx.x % 32;
  const int E = p.E, k = p.k;
  int32_t* ids_out = p.a.topk_ids + static_cast<size_t>(token) * k;
  float* w_out = p.a.topk_weights + static_cast<size_t>(token) * k;
  const int valid_tokens = p.a.num_tokens ? *p.a.num_tokens : p.a.max_tokens;
  if (token >= valid_tokens) {  // padding token of a captured batch: no pairs at all
    for (int j = lane; j < k; j += 32) {
      ids_out[j] = -1;
      w_out[j] = 0.f;
    }
    return;
  }

  // score: what the router reports for an expert before normalization (softmax: exp(l - max),
  // noaux_tc: the unbiased sigmoid); key: what the top-k compares (softmax: the same exp, whose
  // order is the probabilities' order; noaux_tc: the biased score, -FLT_MAX in dropped groups).
  float score[kMaxPerLane];
  Key key[kMaxPerLane];
  float softmax_sum = 1.f;
  if constexpr (!kNoauxTc) {
    float m = -FLT_MAX;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      score[i] = e < E ? logits[e] : -FLT_MAX;
      m = fmaxf(m, score[i]);
    }
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      score[i] = e < E ? expf(score[i] - m) : 0.f;
      key[i] = e < E ? selection_key(score[i], e) : 0;
      sum += score[i];
    }
    softmax_sum = warp_sum(sum);
  } else {
    float select[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E) {
        score[i] = 1.f / (1.f + expf(-logits[e]));
        select[i] = score[i] + (p.a.correction_bias ? p.a.correction_bias[e] : 0.f);
        if (p.n_group > 1) biased[e] = select[i];
      } else {
        score[i] = select[i] = 0.f;
      }
    }
    if (p.n_group > 1) {
      __syncwarp();
      const int per_group = E / p.n_group;
      // Lane g < n_group: sum of the top-2 biased scores of group g (ties irrelevant for sums).
      float group_score = -FLT_MAX;
      if (lane < p.n_group) {
        float best = -FLT_MAX, second = -FLT_MAX;
        for (int i = 0; i < per_group; ++i) {
          const float v = biased[lane * per_group + i];
          if (v > best) {
            second = best;
            best = v;
          } else if (v > second) {
            second = v;
          }
        }
        group_score = best + second;
      }
      // Keep the topk_group best groups (ties to the lower group index).
      group_kept[lane] = 0;
      __syncwarp();
      ArgMax mine{group_score, lane < p.n_group ? lane : -1};
      for (int r = 0; r < p.topk_group; ++r) {
        const ArgMax best = warp_argmax(mine);
        if (lane == best.index) {
          group_kept[lane] = 1;
          mine.index = -1;
        }
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int e = lane + 32 * i;
        // Masked experts (-FLT_MAX) stay eligible only after every kept expert is taken, which
        // cannot happen because topk_group * E / n_group >= k is validated.
        if (e < E && !group_kept[e / per_group]) select[i] = -FLT_MAX;
      }
    }
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      key[i] = e < E ? selection_key(select[i], e) : 0;
    }
  }

  Key head = 0;  // this lane's best remaining key
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) head = key[i] > head ? key[i] : head;
  float chosen_weight = 0.f;  // lane j < k keeps the weight of pick j
  int chosen_id = -1;
  for (int j = 0; j < k; ++j) {
    const Key best = warp_max_key(head);
    const int expert = key_expert(best), owner = expert % 32;
    float w = 0.f;
    if (lane == owner) {  // take the winner out and find this lane's next best
      head = 0;
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        if (key[i] == best) {
          w = score[i];
          key[i] = 0;
        }
        head = key[i] > head ? key[i] : head;
      }
    }
    w = __shfl_sync(0xffffffffu, w, owner);
    if (lane == j) {
      chosen_weight = w;
      chosen_id = expert;
    }
  }
  // Weights in pick order, summed in pick order (the reference's order).
  float w = chosen_weight;
  if constexpr (!kNoauxTc) w = w / softmax_sum;
  float weight_sum = 0.f;
  for (int j = 0; j < k; ++j) weight_sum += __shfl_sync(0xffffffffu, w, j);
  if (lane < k) {
    if (p.renormalize) w = kNoauxTc ? w / (weight_sum + 1e-20f) : w / weight_sum;
    if (kNoauxTc) w *= p.routed_scaling_factor;
    ids_out[lane] = chosen_id;
    w_out[lane] = w;
  }
}

// The optional row quant (RouteDeviceArgs::quant): warp `group` of the launch's quant warps
// quantizes one 128-column group of one token row.
__device__ __forceinline__ void quantize_x_group(const RouteDeviceArgs& a, int group) {
  const auto& qr = a.quant;
  const int groups = qr.hidden / 128;
  if (group >= a.max_tokens * groups) return;
  const int lane = threadIdx.x % 32;
  const int t = group / groups, col = (group % groups) * 128 + 4 * lane;
  const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(qr.x) +
                                                    static_cast<size_t>(t) * qr.hidden + col);
  uint32_t codes;
  const float scale = quantize_bf16_group_128(raw, codes);
  *reinterpret_cast<uint32_t*>(qr.q + static_cast<size_t>(t) * qr.hidden + col) = codes;
  if (lane == 0) qr.scale[group] = scale;
}

// Launches of one router kind and E bound (route_cuda.cu / router_route_cuda.cu).
template <bool kNoauxTc>
void launch_route_logits(const KernelParams& p, cudaStream_t stream);
template <bool kNoauxTc>
void launch_router_route(const KernelParams& p, cudaStream_t stream);

}  // namespace moelora::ops::cuda::route_internal
