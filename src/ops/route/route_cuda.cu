// One warp per token. Each lane holds experts lane, lane + 32, ... in registers (E <= 1024).
// Selection is k rounds of a warp max over 64-bit keys (value, then the lower expert index), so
// the result is deterministic and in the CPU reference's descending order. Softmax routers compare
// exp(l - max) before the division by the sum: the same order as the probabilities except where
// that division rounds two different values to one probability (a near-tie within one rounding:
// the reference then takes the lower index, this kernel the larger exp). For noaux_tc with groups the biased scores are staged in shared memory so
// that one lane per group can sum its group's top-2. Instances per router kind and per E bound.
#include <cuda_bf16.h>

#include <cfloat>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/quant/fp8_device.cuh"
#include "ops/route/route_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kWarpsPerCta = 4;
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

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
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
__device__ __forceinline__ Key warp_max_key(Key v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Key o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o > v ? o : v;
  }
  return v;
}

struct KernelParams {
  RouteDeviceArgs a;
  int E, k, n_group, topk_group;
  bool renormalize;
  float routed_scaling_factor;
};

// One warp per token. kMaxPerLane experts per lane (E <= 32 * kMaxPerLane): the unrolled loops
// only cover what E needs. The top-k is k rounds of a warp-wide max over each lane's best key;
// only the lane that owned the winner rescans its own experts. The kernel is a single dependent
// chain per token (about a thousand instructions), so every instruction counts: a decode MoE
// layer waits for it before anything else.
template <int kMaxPerLane, bool kNoauxTc>
__global__ void __launch_bounds__(32 * kWarpsPerCta) route_kernel(const KernelParams p) {
  __shared__ float biased[kNoauxTc ? kWarpsPerCta : 1][kNoauxTc ? kMaxExperts : 1];
  __shared__ unsigned char group_kept[kWarpsPerCta][32];
  // The align kernel may be scheduled at once (it waits for this grid before reading).
  ::moelora::cuda::sm90::launch_dependents();
  // The L2 fills of the next kernels' cold inputs go out first, beside this kernel's own loads.
  for (const auto& range : p.a.prefetch)
    ::moelora::cuda::sm90::prefetch_l2_range(range.ptr, range.bytes,
                                             blockIdx.x * blockDim.x + threadIdx.x,
                                             gridDim.x * blockDim.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int route_ctas = (p.a.max_tokens + kWarpsPerCta - 1) / kWarpsPerCta;
  if (static_cast<int>(blockIdx.x) >= route_ctas) {  // the optional row quant: one warp per 128-column group
    const auto& qr = p.a.quant;
    const int groups = qr.hidden / 128;
    const int g = (blockIdx.x - route_ctas) * kWarpsPerCta + warp;
    if (g >= p.a.max_tokens * groups) return;
    const int t = g / groups, col = (g % groups) * 128 + 4 * lane;
    const uint2 raw =
        *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(qr.x) + static_cast<size_t>(t) * qr.hidden + col);
    uint32_t codes;
    const float scale = quantize_bf16_group_128(raw, codes);
    *reinterpret_cast<uint32_t*>(qr.q + static_cast<size_t>(t) * qr.hidden + col) = codes;
    if (lane == 0) qr.scale[g] = scale;
    return;
  }
  const int token = blockIdx.x * kWarpsPerCta + warp;
  if (token >= p.a.max_tokens) return;
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
  const float* logits = p.a.logits + static_cast<size_t>(token) * E;

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
        if (p.n_group > 1) biased[warp][e] = select[i];
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
          const float v = biased[warp][lane * per_group + i];
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
      group_kept[warp][lane] = 0;
      __syncwarp();
      ArgMax mine{group_score, lane < p.n_group ? lane : -1};
      for (int r = 0; r < p.topk_group; ++r) {
        const ArgMax best = warp_argmax(mine);
        if (lane == best.index) {
          group_kept[warp][lane] = 1;
          mine.index = -1;
        }
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int e = lane + 32 * i;
        // Masked experts (-FLT_MAX) stay eligible only after every kept expert is taken, which
        // cannot happen because topk_group * E / n_group >= k is validated.
        if (e < E && !group_kept[warp][e / per_group]) select[i] = -FLT_MAX;
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

template <bool kNoauxTc>
void launch_instance(const KernelParams& p, cudaStream_t stream) {
  const int route_ctas = (p.a.max_tokens + kWarpsPerCta - 1) / kWarpsPerCta;
  const int quant_warps = p.a.quant.q ? p.a.max_tokens * (p.a.quant.hidden / 128) : 0;
  const dim3 grid(route_ctas + (quant_warps + kWarpsPerCta - 1) / kWarpsPerCta), block(32 * kWarpsPerCta);
  if (p.E <= 64) {
    ::moelora::cuda::launch_kernel(route_kernel<2, kNoauxTc>, grid, block, 0, stream, false, p);
  } else if (p.E <= 128) {
    ::moelora::cuda::launch_kernel(route_kernel<4, kNoauxTc>, grid, block, 0, stream, false, p);
  } else if (p.E <= 256) {
    ::moelora::cuda::launch_kernel(route_kernel<8, kNoauxTc>, grid, block, 0, stream, false, p);
  } else if (p.E <= 512) {
    ::moelora::cuda::launch_kernel(route_kernel<16, kNoauxTc>, grid, block, 0, stream, false, p);
  } else {
    ::moelora::cuda::launch_kernel(route_kernel<32, kNoauxTc>, grid, block, 0, stream, false, p);
  }
}

}  // namespace

void launch_route(const RouteParams& params, const RouteDeviceArgs& args, cudaStream_t stream) {
  check_route_params(params);
  MOELORA_CHECK(params.num_experts <= kMaxExperts, ErrorCode::kUnsupported, "GPU router: E = ", params.num_experts,
                " experts; at most ", kMaxExperts, " are supported");
  MOELORA_CHECK(params.top_k <= 32, ErrorCode::kUnsupported, "GPU router: k = ", params.top_k,
                "; at most 32 are supported");
  MOELORA_CHECK(params.kind != RouterKind::kSigmoidNoauxTc || params.n_group <= 32, ErrorCode::kUnsupported,
                "GPU router: n_group = ", params.n_group, "; at most 32 are supported");
  MOELORA_CHECK(args.logits && args.topk_ids && args.topk_weights, ErrorCode::kInvalidArgument,
                "GPU router: logits, topk_ids and topk_weights are required");
  MOELORA_CHECK(!args.quant.q || (args.quant.x && args.quant.scale && args.quant.hidden > 0 &&
                                  args.quant.hidden % 128 == 0),
                ErrorCode::kInvalidArgument, "GPU router: the row quant needs x, scale and hidden (",
                args.quant.hidden, ") a positive multiple of 128");
  if (args.max_tokens == 0) return;
  KernelParams p;
  p.a = args;
  p.E = static_cast<int>(params.num_experts);
  p.k = static_cast<int>(params.top_k);
  p.n_group = static_cast<int>(params.n_group);
  p.topk_group = static_cast<int>(params.topk_group);
  p.renormalize = params.renormalize;
  p.routed_scaling_factor = params.routed_scaling_factor;
  if (params.kind == RouterKind::kSigmoidNoauxTc) {
    launch_instance<true>(p, stream);
  } else {
    launch_instance<false>(p, stream);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
