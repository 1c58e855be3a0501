// f16 activation rows with power-of-two row scales (quant_cuda.cuh, launch_rows_to_f16_pow2).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/quant/quant_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) rows_to_f16_pow2_kernel(const RowsToF16Args a) {
  ::moelora::cuda::sm90::grid_dependency_wait();
  ::moelora::cuda::sm90::launch_dependents();
  const int q = blockIdx.x;
  const int valid = a.num_rows ? *a.num_rows : a.max_rows;
  if (q >= valid) return;
  const int row = a.gather ? a.gather[q] : q;
  const uint4* src = reinterpret_cast<const uint4*>(a.x + static_cast<size_t>(row) * a.cols);
  const int vectors = a.cols / 8;
  float amax = 0.f;
  for (int v = threadIdx.x; v < vectors; v += kThreads) {
    const uint4 w = src[v];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  __shared__ float warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  // the power of two 2^(e - 14) for amax = m 2^e, m in [0.5, 1) (f16_row_scale_for)
  int exponent = 0;
  const bool scaled = amax > 0.f && isfinite(amax);
  if (scaled) frexpf(amax, &exponent);
  const float scale = scaled ? ldexpf(1.f, exponent - 14) : 1.f;
  const float inverse = scaled ? ldexpf(1.f, 14 - exponent) : 1.f;  // exact: a power of two
  if (threadIdx.x == 0) a.scale[q] = scale;
  uint4* dst = reinterpret_cast<uint4*>(a.out + static_cast<size_t>(q) * a.cols);
  for (int v = threadIdx.x; v < vectors; v += kThreads) {
    const uint4 w = src[v];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
    uint4 o;
    __half2* oh = reinterpret_cast<__half2*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      oh[i] = __floats2half2_rn(f.x * inverse, f.y * inverse);
    }
    dst[v] = o;
  }
}

}  // namespace

void launch_rows_to_f16_pow2(const RowsToF16Args& a, cudaStream_t stream) {
  MOELORA_CHECK(a.x && a.out && a.scale, ErrorCode::kInvalidArgument, "rows_to_f16_pow2: x, out and scale are required");
  MOELORA_CHECK(a.cols > 0 && a.cols % 8 == 0, ErrorCode::kInvalidArgument, "rows_to_f16_pow2: cols = ", a.cols,
                " must be a positive multiple of 8");
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0,
                ErrorCode::kInvalidArgument, "rows_to_f16_pow2: x and out must be 16-byte aligned");
  if (a.max_rows <= 0) return;
  ::moelora::cuda::launch_kernel(rows_to_f16_pow2_kernel, dim3(a.max_rows), dim3(kThreads), 0, stream, a.pdl, a);
}

}  // namespace moelora::ops::cuda
