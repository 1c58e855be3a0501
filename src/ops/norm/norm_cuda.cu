// RMSNorm on the GPU (see norm_cuda.cuh). A "row group" of threads normalizes one row: a warp for
// D <= 1024 (q/k heads of 128, MLA latents of 512 / 1536: many short rows, one CTA of 8 warps
// takes 8 rows) or a whole CTA for longer rows (the hidden size). Two passes over the row:
//   1. r = x (+ its LoRA delta, rounded to bf16 once) (+ residual, fp32 sum rounded to bf16 once
//      and written back to residual);
//      sum of r^2 in fp32, reduced over the group;
//   2. y = style(w, r * inv_rms), re-reading r (from residual when fused, else from x).
// Each element is read and written by the same thread in both passes, so y may alias x.
// 16-byte vectors when D, the strides and the pointers allow it, else one element per step.
#include <cstdint>

#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/norm/norm_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kNormThreads = 256;
constexpr int kWarpRowMaxDim = 1024;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the CTA; every thread gets the total. `scratch` holds one float per warp.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += scratch[w];  // same order in every thread
  return total;
}

__device__ __forceinline__ float apply_style(float n, float w, NormStyle style) {
  return style == NormStyle::kWeight ? w * n : n * (1.0f + w);
}

// Loads 8 bf16 as floats / stores 8 floats as bf16 (16-byte aligned).
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float out[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float v[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// One row, processed by `group` threads with index `g` in the group. kVec: 8 elements per step.
template <bool kVec>
__device__ float row_pass1(const RmsNormArgs& a, int64_t row, int g, int group) {
  const __nv_bfloat16* x = a.x + row * a.x_stride;
  __nv_bfloat16* res = a.residual ? a.residual + row * a.dim : nullptr;
  const __nv_bfloat16* dx = a.x_delta && a.delta_slot[row] >= 0 ? a.x_delta + row * a.dim : nullptr;
  float sum_sq = 0.0f;
  if constexpr (kVec) {
    for (int c = g * 8; c < a.dim; c += group * 8) {
      float v[8];
      load8(x + c, v);
      if (dx) {
        float d[8];
        load8(dx + c, d);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(v[i] + d[i]));
      }
      if (res) {
        float r[8];
        load8(res + c, r);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(v[i] + r[i]));
        store8(res + c, v);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) sum_sq += v[i] * v[i];
    }
  } else {
    for (int c = g; c < a.dim; c += group) {
      float v = __bfloat162float(x[c]);
      if (dx) v = __bfloat162float(__float2bfloat16_rn(v + __bfloat162float(dx[c])));
      if (res) {
        const __nv_bfloat16 r = __float2bfloat16_rn(v + __bfloat162float(res[c]));
        res[c] = r;
        v = __bfloat162float(r);
      }
      sum_sq += v * v;
    }
  }
  return sum_sq;
}

template <bool kVec>
__device__ void row_pass2(const RmsNormArgs& a, int64_t row, int g, int group, float inv_rms) {
  // r: the residual row just written (fused) or x itself.
  const __nv_bfloat16* r = a.residual ? a.residual + row * a.dim : a.x + row * a.x_stride;
  __nv_bfloat16* y = a.y + row * a.y_stride;
  if constexpr (kVec) {
    for (int c = g * 8; c < a.dim; c += group * 8) {
      float v[8], w[8];
      load8(r + c, v);
      load8(a.weight + c, w);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = apply_style(v[i] * inv_rms, w[i], a.style);
      store8(y + c, v);
    }
  } else {
    for (int c = g; c < a.dim; c += group) {
      const float n = __bfloat162float(r[c]) * inv_rms;
      y[c] = __float2bfloat16_rn(apply_style(n, __bfloat162float(a.weight[c]), a.style));
    }
  }
}

__device__ __forceinline__ int64_t valid_rows(const RmsNormArgs& a) {
  return a.num_rows ? static_cast<int64_t>(*a.num_rows) * a.rows_per_token : a.rows;
}

// One warp per row, kNormThreads / 32 rows per CTA.
// Both kernels let a programmatically launched successor be scheduled at once (the MoE layer's
// route launch loads the router weight rows before its griddepcontrol.wait); a successor launched
// normally still starts after this grid ends.
template <bool kVec>
__global__ void __launch_bounds__(kNormThreads) rms_norm_warp_kernel(const RmsNormArgs a) {
  ::moelora::cuda::sm90::launch_dependents();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kNormThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.rows || row >= valid_rows(a)) return;  // whole warps leave together
  const float sum_sq = warp_sum(row_pass1<kVec>(a, row, lane, 32));
  __syncwarp();  // the residual row written by other lanes is re-read in pass 2
  const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(a.dim) + a.eps);
  row_pass2<kVec>(a, row, lane, 32, inv_rms);
}

// One CTA per row.
template <bool kVec>
__global__ void __launch_bounds__(kNormThreads) rms_norm_block_kernel(const RmsNormArgs a) {
  ::moelora::cuda::sm90::launch_dependents();
  __shared__ float scratch[kNormThreads / 32];
  const int64_t row = blockIdx.x;
  if (row >= valid_rows(a)) return;  // uniform over the CTA
  const float sum_sq = block_sum(row_pass1<kVec>(a, row, threadIdx.x, blockDim.x), scratch);
  const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(a.dim) + a.eps);
  row_pass2<kVec>(a, row, threadIdx.x, blockDim.x, inv_rms);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream) {
  MOELORA_CHECK(args.rows >= 0, ErrorCode::kInvalidArgument, "rms_norm: rows must be >= 0, got ",
                args.rows);
  if (args.rows == 0) return;
  MOELORA_CHECK(args.x && args.weight && args.y, ErrorCode::kInvalidArgument,
                "rms_norm: x, weight and y must be device pointers (got null)");
  MOELORA_CHECK(args.dim > 0 && args.dim % 2 == 0, ErrorCode::kInvalidArgument,
                "rms_norm: dim must be even and > 0, got ", args.dim);
  MOELORA_CHECK(args.rows_per_token >= 1, ErrorCode::kInvalidArgument,
                "rms_norm: rows_per_token must be >= 1, got ", args.rows_per_token);
  MOELORA_CHECK(args.x_stride >= 0 && args.y_stride >= 0, ErrorCode::kInvalidArgument,
                "rms_norm: strides must be >= 0 (0 = dim), got x_stride ", args.x_stride,
                ", y_stride ", args.y_stride);
  MOELORA_CHECK(args.eps >= 0.0f, ErrorCode::kInvalidArgument, "rms_norm: eps must be >= 0, got ",
                args.eps);
  MOELORA_CHECK(!args.x_delta || (args.delta_slot && args.residual && args.rows_per_token == 1),
                ErrorCode::kInvalidArgument,
                "rms_norm: x_delta needs delta_slot, the residual (pass 2 re-reads the sum) and "
                "rows_per_token 1 (got delta_slot ",
                args.delta_slot != nullptr, ", residual ", args.residual != nullptr,
                ", rows_per_token ", args.rows_per_token, ")");
  RmsNormArgs a = args;
  if (a.x_stride == 0) a.x_stride = a.dim;
  if (a.y_stride == 0) a.y_stride = a.dim;
  MOELORA_CHECK(a.x_stride >= a.dim && a.y_stride >= a.dim, ErrorCode::kInvalidArgument,
                "rms_norm: row strides (x ", a.x_stride, ", y ", a.y_stride, ") must be >= dim ",
                a.dim);
  const bool vec = a.dim % 8 == 0 && a.x_stride % 8 == 0 && a.y_stride % 8 == 0 && aligned16(a.x) &&
                   aligned16(a.y) && aligned16(a.weight) &&
                   (!a.residual || aligned16(a.residual)) && (!a.x_delta || aligned16(a.x_delta));
  if (a.dim <= kWarpRowMaxDim) {
    const int rows_per_cta = kNormThreads / 32;
    const int grid = (a.rows + rows_per_cta - 1) / rows_per_cta;
    if (vec) {
      rms_norm_warp_kernel<true><<<grid, kNormThreads, 0, stream>>>(a);
    } else {
      rms_norm_warp_kernel<false><<<grid, kNormThreads, 0, stream>>>(a);
    }
  } else if (vec) {
    rms_norm_block_kernel<true><<<a.rows, kNormThreads, 0, stream>>>(a);
  } else {
    rms_norm_block_kernel<false><<<a.rows, kNormThreads, 0, stream>>>(a);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
