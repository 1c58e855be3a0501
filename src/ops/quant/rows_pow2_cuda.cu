// Activation rows with power-of-two row scales for the NVFP4 expert GEMMs (quant_cuda.cuh): f16
// rows for the W4A16 kernel (launch_rows_to_f16_pow2), e4m3 rows for the W4A8 one
// (launch_rows_to_e4m3_pow2). One CTA per output row: the row's largest magnitude, then the row
// divided by its power-of-two scale (exact) and rounded to the format; rows of up to 8192 columns
// are read once and held in registers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/quant/quant_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kThreads = 128;

struct RowsPow2Params {
  const __nv_bfloat16* x;
  const int32_t* gather;
  const int32_t* num_rows;
  int max_rows, cols;
  void* out;
  float* scale;
};

// The output formats: the scale exponent for amax = m 2^e (m in [0.5, 1)) and eight values' store.
struct F16Format {
  // 2^(e - 14): the row's largest magnitude lands in [2^13, 2^14) (f16_row_scale_for)
  __device__ static int scale_exponent(float m, int e) { return e - 14; }
  __device__ static void store(void* out, size_t at, const float (&v)[8]) {
    uint4 o;
    __half2* h = reinterpret_cast<__half2*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(static_cast<__half*>(out) + at) = o;
  }
};
struct E4m3Format {
  // 2^(e - 9) when m * 512 <= 448, else 2^(e - 8): the largest magnitude lands in (224, 448]
  // (e4m3_row_scale_for)
  __device__ static int scale_exponent(float m, int e) { return m <= 0.875f ? e - 9 : e - 8; }
  __device__ static void store(void* out, size_t at, const float (&v)[8]) {
    uint2 o;
    uint16_t* pairs = reinterpret_cast<uint16_t*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i)  // the low byte of each pair is the even value
      pairs[i] =
          __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i], v[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(out) + at) = o;
  }
};

// Eight bf16 values of x as floats times `inverse` (a power of two: exact), into the format.
template <class Format>
__device__ __forceinline__ void store_scaled(void* out, size_t at, const uint4& w, float inverse) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
  float values[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    values[2 * i] = f.x * inverse;
    values[2 * i + 1] = f.y * inverse;
  }
  Format::store(out, at, values);
}

__device__ __forceinline__ float amax8(float amax, const uint4& w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return amax;
}

// kHeld > 0: each thread holds its kHeld 16-byte vectors of the row in registers between the
// amax and the store (rows of up to kHeld x 128 x 8 columns), so the row is read once: at kimi
// shapes (7168 columns, 128 tokens x 8 pairs) the second read was half of the kernel's L2 traffic
// and GEMM1's first stages wait for this kernel. kHeld = 0: any width, the row read twice.
template <class Format, int kHeld>
__global__ void __launch_bounds__(kThreads) rows_pow2_kernel(const RowsPow2Params a) {
  ::moelora::cuda::sm90::grid_dependency_wait();
  ::moelora::cuda::sm90::launch_dependents();
  const int q = blockIdx.x;
  const int valid = a.num_rows ? *a.num_rows : a.max_rows;
  if (q >= valid) return;
  const int row = a.gather ? a.gather[q] : q;
  const uint4* src = reinterpret_cast<const uint4*>(a.x + static_cast<size_t>(row) * a.cols);
  const int vectors = a.cols / 8;
  float amax = 0.f;
  uint4 held[kHeld > 0 ? kHeld : 1];
  if constexpr (kHeld > 0) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int v = threadIdx.x + i * kThreads;
      held[i] = v < vectors ? src[v] : make_uint4(0u, 0u, 0u, 0u);  // zeros leave amax alone
    }
#pragma unroll
    for (int i = 0; i < kHeld; ++i) amax = amax8(amax, held[i]);
  } else {
    for (int v = threadIdx.x; v < vectors; v += kThreads) amax = amax8(amax, src[v]);
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  __shared__ float warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  int exponent = 0;
  float mantissa = 0.f;
  const bool scaled = amax > 0.f && isfinite(amax);
  if (scaled) mantissa = frexpf(amax, &exponent);
  const int e = scaled ? Format::scale_exponent(mantissa, exponent) : 0;
  const float inverse = ldexpf(1.f, -e);  // exact: a power of two
  if (threadIdx.x == 0) a.scale[q] = ldexpf(1.f, e);
  const size_t row_at = static_cast<size_t>(q) * a.cols;
  if constexpr (kHeld > 0) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vectors) store_scaled<Format>(a.out, row_at + 8 * v, held[i], inverse);
    }
  } else {
    for (int v = threadIdx.x; v < vectors; v += kThreads)
      store_scaled<Format>(a.out, row_at + 8 * v, src[v], inverse);
  }
}

template <class Format, class Args>
void launch_rows_pow2(const Args& a, const char* what, cudaStream_t stream) {
  MOELORA_CHECK(a.x && a.out && a.scale, ErrorCode::kInvalidArgument, what,
                ": x, out and scale are required");
  MOELORA_CHECK(a.cols > 0 && a.cols % 8 == 0, ErrorCode::kInvalidArgument, what,
                ": cols = ", a.cols, " must be a positive multiple of 8");
  MOELORA_CHECK(
      reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0,
      ErrorCode::kInvalidArgument, what, ": x and out must be 16-byte aligned");
  if (a.max_rows <= 0) return;
  const RowsPow2Params p{a.x, a.gather, a.num_rows, a.max_rows, a.cols, a.out, a.scale};
  // The fewest held vectors per thread that cover the row (rows_pow2_kernel).
  const int per_thread = (a.cols / 8 + kThreads - 1) / kThreads;
  auto kernel = per_thread <= 1   ? rows_pow2_kernel<Format, 1>
                : per_thread <= 2 ? rows_pow2_kernel<Format, 2>
                : per_thread <= 4 ? rows_pow2_kernel<Format, 4>
                : per_thread <= 8 ? rows_pow2_kernel<Format, 8>
                                  : rows_pow2_kernel<Format, 0>;
  ::moelora::cuda::launch_kernel(kernel, dim3(a.max_rows), dim3(kThreads), 0, stream, a.pdl, p);
}

}  // namespace

void launch_rows_to_f16_pow2(const RowsToF16Args& a, cudaStream_t stream) {
  launch_rows_pow2<F16Format>(a, "rows_to_f16_pow2", stream);
}

void launch_rows_to_e4m3_pow2(const RowsToE4m3Args& a, cudaStream_t stream) {
  launch_rows_pow2<E4m3Format>(a, "rows_to_e4m3_pow2", stream);
}

}  // namespace moelora::ops::cuda
