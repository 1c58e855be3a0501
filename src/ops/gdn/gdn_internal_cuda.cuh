// Internals shared by the Gated DeltaNet kernels (gdn_cuda.cu: the conv and recurrent rule
// kernels and the launcher; gdn_chunk_cuda.cu: the chunked rule kernel for prefill). Not part of
// the op's interface: include gdn_cuda.cuh for that.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/gdn/gdn_cuda.cuh"

namespace moelora::ops::cuda::gdn_detail {

// Workspace regions (fp32), rows of the call's batch.
struct GdnScratch {
  float* q = nullptr;     // [max_tokens, nk * dk] normalised, scaled by 1 / sqrt(dk)
  float* k = nullptr;     // [max_tokens, nk * dk] normalised
  float* v = nullptr;     // [max_tokens, nv * dv]
  float* beta = nullptr;  // [max_tokens, nv]
  float* g = nullptr;     // [max_tokens, nv]
  float* kq = nullptr;    // [max_tokens, nk] k . q of each key head
};

// Kernel-side parameters: the public arguments with int sizes and the workspace split.
struct GdnParams {
  int nk, nv, dk, dv, conv_kernel, conv_dim, key_dim, value_dim, group;
  float norm_eps, q_scale;
  const int32_t* cu_seqlens;
  const int32_t* slots;
  int max_seqs, num_slots;
  // Items (sequence, value head) of this many tokens or more run in the chunked rule kernel, the
  // others in the recurrent one; 0: every item in the recurrent one.
  int chunk_min_tokens;
  const __nv_bfloat16 *qkv, *z, *b, *a;
  int64_t qkv_stride, z_stride, b_stride, a_stride;
  GdnInputDelta delta;  // delta.qkv == nullptr: none
  const __nv_bfloat16* conv_weight;
  const float *a_log, *dt_bias, *norm_weight;
  __nv_bfloat16* conv_state;
  float* recurrent_state;
  __nv_bfloat16* out;
  int64_t out_stride;
  GdnScratch ws;
};

__device__ __forceinline__ float silu(float v) {
  return v / (1.0f + expf(-v));  // as silu_f32
}
__device__ __forceinline__ float softplus(float v) {
  return v > 20.0f ? v : log1pf(expf(v));  // torch's softplus (beta 1, threshold 20)
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ bool slot_valid(const GdnParams& p, int slot) {
  return slot >= 0 && slot < p.num_slots;
}

// Whether batch row `row`'s inputs have a LoRA delta (GdnInputDelta); rows of one sequence share
// their adapter, so any row of the sequence answers for all.
__device__ __forceinline__ bool row_has_delta(const GdnParams& p, int64_t row) {
  return p.delta.qkv != nullptr && p.delta.row_slot[row] >= 0;
}
// An input with its delta, rounded to bf16 as the expand's in-place add would leave it.
__device__ __forceinline__ __nv_bfloat16 add_delta(__nv_bfloat16 x, __nv_bfloat16 d) {
  return __float2bfloat16(__bfloat162float(x) + __bfloat162float(d));
}

// The sequence's new conv state for the channels this CTA owns (see the file comment): u = [old
// state ; the call's T rows], new state = u[T .. T + K - 2]. Each channel is read whole before it
// is written, by one thread. kDelta: the call may carry input deltas (GdnInputDelta), added to this
// call's rows (a separate instance, so the kernels without deltas keep their code).
template <bool kDelta = false>
__device__ inline void update_conv_state(const GdnParams& p, int h, int slot, int start, int T) {
  if (T == 1) return;  // the conv kernel did it
  const int k1 = p.conv_kernel - 1;
  const bool has_delta = kDelta && row_has_delta(p, start);
  const int kh = h / p.group;
  const int count = p.dv + (h % p.group == 0 ? 2 * p.dk : 0);
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    int c;
    if (i < p.dv) {
      c = 2 * p.key_dim + h * p.dv + i;
    } else if (i < p.dv + p.dk) {
      c = kh * p.dk + (i - p.dv);
    } else {
      c = p.key_dim + kh * p.dk + (i - p.dv - p.dk);
    }
    __nv_bfloat16* state = p.conv_state + (static_cast<int64_t>(slot) * p.conv_dim + c) * k1;
    __nv_bfloat16 next[kGdnMaxConvKernel - 1];
#pragma unroll
    for (int j = 0; j < kGdnMaxConvKernel - 1; ++j) {
      if (j < k1) {
        const int u = T + j;
        const int64_t row = static_cast<int64_t>(start) + u - k1;
        next[j] = u < k1 ? state[u] : p.qkv[row * p.qkv_stride + c];
        if (u >= k1 && has_delta)
          next[j] = add_delta(next[j], p.delta.qkv[row * p.delta.stride + c]);
      }
    }
#pragma unroll
    for (int j = 0; j < kGdnMaxConvKernel - 1; ++j) {
      if (j < k1) state[j] = next[j];
    }
  }
}

// Launches the chunked rule kernel (gdn_chunk_cuda.cu) for the items (sequence, value head) with
// p.chunk_min_tokens or more tokens, one CTA per item of the max_seqs x nv grid; a programmatic
// dependent of the previous kernel in the stream (the recurrent rule kernel), which it waits for.
void launch_gdn_chunk_rule(const GdnParams& p, int max_seqs, cudaStream_t stream);

}  // namespace moelora::ops::cuda::gdn_detail
