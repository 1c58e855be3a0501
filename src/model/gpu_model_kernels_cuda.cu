// Kernels of gpu_model_kernels_cuda.cuh: the sigmoid gate, last-row gather, the cuBLAS bf16 GEMM
// wrapper and the seeded fills.
#include "model/gpu_model_kernels_cuda.cuh"

#include <algorithm>

#include "core/cuda_utils.h"

namespace moelora::model::gpu_detail {

namespace {

// One block per output row.
__global__ void gather_rows_kernel(const __nv_bfloat16* src, int src_rows, const int32_t* rows,
                                   int cols, __nv_bfloat16* dst) {
  const int b = blockIdx.x;
  const int row = rows[b];
  const bool ok = row >= 0 && row < src_rows;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    dst[static_cast<int64_t>(b) * cols + c] =
        ok ? src[static_cast<int64_t>(row) * cols + c] : __float2bfloat16(0.0f);
  }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1]: 24 random bits, never 0 (Box-Muller takes its log).
__device__ __forceinline__ float unit_uniform(uint64_t bits) {
  return (static_cast<float>(bits >> 40) + 1.0f) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ float fill_value(const FillArgs& p, int64_t i) {
  if (p.period > 0 && (i / p.inner) % p.period >= p.keep) return 0.0f;
  const uint64_t r = splitmix64(p.seed ^ splitmix64(static_cast<uint64_t>(i)));
  if (p.kind == FillKind::kUniform)
    return p.a + (p.b - p.a) * (unit_uniform(r) - 0.5f / 16777216.0f);
  const float u1 = unit_uniform(r), u2 = unit_uniform(splitmix64(r));
  const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
  return p.a + p.b * z;
}

__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t n, FillArgs args) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = __float2bfloat16(fill_value(args, i));
  }
}

__global__ void fill_f32_kernel(float* p, int64_t n, FillArgs args) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = fill_value(args, i);
  }
}

int fill_blocks(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 4096));
}

void check_cublas(cublasStatus_t status, const char* what) {
  MOELORA_CHECK(status == CUBLAS_STATUS_SUCCESS, ErrorCode::kCuda, what,
                " failed with cuBLAS status ", static_cast<int>(status));
}

// Grid (column blocks of 8 * 256, token rows): a thread takes 8 consecutive columns (one 16-byte
// vector of x and of the gate when both are aligned). One CTA per row walking the whole width left
// a decode batch of 16 rows at 16 CTAs and 9.5 us per layer on the H200.
constexpr int kGateThreads = 256;
constexpr int kGateVec = 8;

__global__ void __launch_bounds__(kGateThreads) sigmoid_gate_kernel(SigmoidGateArgs p, bool vec) {
  const int t = blockIdx.y;
  if (p.num_tokens != nullptr && t >= *p.num_tokens) return;
  __nv_bfloat16* x = p.x + static_cast<int64_t>(t) * p.width;
  const __nv_bfloat16* g = p.gate + static_cast<int64_t>(t) * p.gate_stride;
  const int i0 = (blockIdx.x * kGateThreads + threadIdx.x) * kGateVec;
  if (i0 >= p.width) return;
  if (vec && i0 + kGateVec <= p.width) {
    uint4 xv = *reinterpret_cast<const uint4*>(x + i0);
    const uint4 gv = *reinterpret_cast<const uint4*>(g + i0);
    auto* xe = reinterpret_cast<__nv_bfloat16*>(&xv);
    const auto* ge = reinterpret_cast<const __nv_bfloat16*>(&gv);
#pragma unroll
    for (int j = 0; j < kGateVec; ++j) {
      const float gate = __bfloat162float(ge[j]);
      xe[j] = __float2bfloat16(__bfloat162float(xe[j]) * (1.0f / (1.0f + expf(-gate))));
    }
    *reinterpret_cast<uint4*>(x + i0) = xv;
    return;
  }
  for (int i = i0; i < min(i0 + kGateVec, p.width); ++i) {
    const float gate = __bfloat162float(g[i]);
    x[i] = __float2bfloat16(__bfloat162float(x[i]) * (1.0f / (1.0f + expf(-gate))));
  }
}

}  // namespace

void launch_sigmoid_gate(const SigmoidGateArgs& args, cudaStream_t stream) {
  MOELORA_CHECK(args.x && args.gate && args.width > 0 && args.gate_stride >= args.width,
                ErrorCode::kInvalidArgument, "sigmoid_gate: x, gate, width = ", args.width,
                " and gate_stride = ", args.gate_stride, " (>= width) are required");
  if (args.tokens <= 0) return;
  MOELORA_CHECK(args.tokens <= 65535, ErrorCode::kInvalidArgument, "sigmoid_gate: tokens = ",
                args.tokens, " exceeds the grid's 65535 rows");
  const bool vec = reinterpret_cast<uintptr_t>(args.x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(args.gate) % 16 == 0 && args.width % kGateVec == 0 &&
                   args.gate_stride % kGateVec == 0;
  const dim3 grid((args.width + kGateThreads * kGateVec - 1) / (kGateThreads * kGateVec), args.tokens);
  sigmoid_gate_kernel<<<grid, kGateThreads, 0, stream>>>(args, vec);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_gather_rows(const __nv_bfloat16* src, int src_rows, const int32_t* rows, int count,
                        int cols, __nv_bfloat16* dst, cudaStream_t stream) {
  if (count <= 0) return;
  gather_rows_kernel<<<count, 256, 0, stream>>>(src, src_rows, rows, cols, dst);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void gemm_bf16(cublasHandle_t handle, cudaStream_t stream, const __nv_bfloat16* x, int64_t ldx,
               const __nv_bfloat16* w, void* y, cudaDataType_t y_type, int64_t ldy, int rows, int n,
               int k) {
  if (rows <= 0 || n <= 0) return;
  ::moelora::cuda::set_cublas_stream(handle, stream);
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: Y^T [n, rows] = W [k, n]^T . X^T [k, rows].
  check_cublas(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &alpha, w, CUDA_R_16BF, k,
                            x, CUDA_R_16BF, static_cast<int>(ldx), &beta, y, y_type,
                            static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

void launch_fill_bf16(__nv_bfloat16* p, int64_t n, const FillArgs& args, cudaStream_t stream) {
  if (n <= 0) return;
  fill_bf16_kernel<<<fill_blocks(n), 256, 0, stream>>>(p, n, args);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_fill_f32(float* p, int64_t n, const FillArgs& args, cudaStream_t stream) {
  if (n <= 0) return;
  fill_f32_kernel<<<fill_blocks(n), 256, 0, stream>>>(p, n, args);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::model::gpu_detail
