// Elementwise kernels of the dense layers (see linear_cuda.cuh). One CTA per token row; threads
// walk the columns with 16-byte vectors (8 bf16) when the widths and pointers allow it, else one
// element per step. Both are memory-bound: one read of each input, one write of the output.
#include <cstdint>

#include "core/cuda_utils.h"
#include "ops/linear/linear_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kRowThreads = 128;

// silu(v) = v / (1 + exp(-v)), the reference's form (precise expf).
__device__ __forceinline__ float silu(float v) {
  return v / (1.0f + expf(-v));
}

__device__ __forceinline__ void unpack8(const uint4& raw, float out[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float v[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return raw;
}

// gate_up [T, 2I] -> out [T, I]
template <bool kVec>
__global__ void __launch_bounds__(kRowThreads) silu_mul_kernel(const SiluMulArgs a) {
  const int token = blockIdx.x;
  const int valid = a.num_tokens ? *a.num_tokens : a.tokens;
  if (token >= valid) return;
  const __nv_bfloat16* gate = a.gate_up + static_cast<int64_t>(token) * 2 * a.inter;
  const __nv_bfloat16* up = gate + a.inter;
  __nv_bfloat16* out = a.out + static_cast<int64_t>(token) * a.inter;
  if constexpr (kVec) {
    for (int c = threadIdx.x * 8; c < a.inter; c += blockDim.x * 8) {
      float g[8], u[8];
      unpack8(*reinterpret_cast<const uint4*>(gate + c), g);
      unpack8(*reinterpret_cast<const uint4*>(up + c), u);
#pragma unroll
      for (int i = 0; i < 8; ++i) g[i] = silu(g[i]) * u[i];
      *reinterpret_cast<uint4*>(out + c) = pack8(g);
    }
  } else {
    for (int c = threadIdx.x; c < a.inter; c += blockDim.x)
      out[c] = __float2bfloat16_rn(silu(__bfloat162float(gate[c])) * __bfloat162float(up[c]));
  }
}

// y [T, N] (row stride y_stride) += delta [T, N] on rows whose slot is >= 0
template <bool kVec>
__global__ void __launch_bounds__(kRowThreads) add_rows_kernel(const AddRowsArgs a) {
  const int token = blockIdx.x;
  const int valid = a.num_tokens ? *a.num_tokens : a.tokens;
  if (token >= valid) return;
  if (a.row_slot && a.row_slot[token] < 0) return;  // base-only token: no LoRA delta
  __nv_bfloat16* y = a.y + static_cast<int64_t>(token) * a.y_stride;
  const __nv_bfloat16* d = a.delta + static_cast<int64_t>(token) * a.cols;
  if constexpr (kVec) {
    for (int c = threadIdx.x * 8; c < a.cols; c += blockDim.x * 8) {
      float yv[8], dv[8];
      unpack8(*reinterpret_cast<const uint4*>(y + c), yv);
      unpack8(*reinterpret_cast<const uint4*>(d + c), dv);
#pragma unroll
      for (int i = 0; i < 8; ++i) yv[i] += dv[i];
      *reinterpret_cast<uint4*>(y + c) = pack8(yv);
    }
  } else {
    for (int c = threadIdx.x; c < a.cols; c += blockDim.x)
      y[c] = __float2bfloat16_rn(__bfloat162float(y[c]) + __bfloat162float(d[c]));
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void launch_silu_mul(const SiluMulArgs& args, cudaStream_t stream) {
  MOELORA_CHECK(args.tokens >= 0, ErrorCode::kInvalidArgument,
                "silu_mul: tokens must be >= 0, got ", args.tokens);
  if (args.tokens == 0) return;
  MOELORA_CHECK(args.gate_up && args.out, ErrorCode::kInvalidArgument,
                "silu_mul: gate_up and out must be device pointers (got null)");
  MOELORA_CHECK(args.inter > 0, ErrorCode::kInvalidArgument, "silu_mul: inter must be > 0, got ",
                args.inter);
  const bool vec = args.inter % 8 == 0 && aligned16(args.gate_up) && aligned16(args.out);
  if (vec) {
    silu_mul_kernel<true><<<args.tokens, kRowThreads, 0, stream>>>(args);
  } else {
    silu_mul_kernel<false><<<args.tokens, kRowThreads, 0, stream>>>(args);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_add_rows(const AddRowsArgs& args, cudaStream_t stream) {
  MOELORA_CHECK(args.tokens >= 0, ErrorCode::kInvalidArgument,
                "add_rows: tokens must be >= 0, got ", args.tokens);
  if (args.tokens == 0) return;
  MOELORA_CHECK(args.y && args.delta, ErrorCode::kInvalidArgument,
                "add_rows: y and delta must be device pointers (got null)");
  MOELORA_CHECK(args.cols > 0, ErrorCode::kInvalidArgument, "add_rows: cols must be > 0, got ",
                args.cols);
  AddRowsArgs a = args;
  if (a.y_stride == 0) a.y_stride = a.cols;
  MOELORA_CHECK(a.y_stride >= a.cols, ErrorCode::kInvalidArgument, "add_rows: y_stride ",
                a.y_stride, " is smaller than cols ", a.cols);
  const bool vec = a.cols % 8 == 0 && a.y_stride % 8 == 0 && aligned16(a.y) && aligned16(a.delta);
  if (vec) {
    add_rows_kernel<true><<<a.tokens, kRowThreads, 0, stream>>>(a);
  } else {
    add_rows_kernel<false><<<a.tokens, kRowThreads, 0, stream>>>(a);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
