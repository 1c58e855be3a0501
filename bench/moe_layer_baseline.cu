// bench_moe_layer's unfused baseline (moe_layer_baseline.cuh).
#include "moe_layer_baseline.cuh"

#include <cuda_fp8.h>

#include <algorithm>

namespace moelora::bench {

namespace {

__global__ void dequant_fp8_bf16_kernel(const uint8_t* q, const float* scale, __nv_bfloat16* out,
                                        int rows, int cols, int cols_padded) {
  const int kb = cols_padded / 128;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < static_cast<size_t>(rows) * cols; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / cols), c = static_cast<int>(i % cols);
    const float v = __half2float(__nv_cvt_fp8_to_halfraw(
                        q[static_cast<size_t>(r) * cols_padded + c], __NV_E4M3)) *
                    scale[(r / 128) * kb + c / 128];
    out[i] = __float2bfloat16(v);
  }
}
__global__ void gather_rows_kernel(const __nv_bfloat16* x, const int32_t* rows, __nv_bfloat16* out,
                                   int n, int cols) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < static_cast<size_t>(n) * cols; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = x[static_cast<size_t>(rows[i / cols]) * cols + i % cols];
}
__global__ void silu_mul_kernel(const __nv_bfloat16* h, __nv_bfloat16* a, int n, int inter) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < static_cast<size_t>(n) * inter; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = i / inter, c = i % inter;
    const float g = __bfloat162float(h[r * 2 * inter + c]),
                u = __bfloat162float(h[r * 2 * inter + inter + c]);
    a[i] = __float2bfloat16(g / (1.f + expf(-g)) * u);
  }
}
__global__ void scatter_add_kernel(const __nv_bfloat16* y, const int32_t* rows, const float* w,
                                   float* out, int n, int cols) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < static_cast<size_t>(n) * cols; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[static_cast<size_t>(rows[i / cols]) * cols + i % cols] +=
        w[i / cols] * __bfloat162float(y[i]);
}
__global__ void add_bf16_to_f32_kernel(const __nv_bfloat16* y, float* out, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] += __bfloat162float(y[i]);
}
__global__ void f32_to_bf16_kernel(const float* in, __nv_bfloat16* out, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
}

}  // namespace

Baseline::Baseline(const Preset& p, int max_tokens, int max_rank)
    : w13(static_cast<size_t>(2) * p.I * p.H * 2),
      w2(static_cast<size_t>(p.H) * p.I * 2),
      xe(static_cast<size_t>(max_tokens) * p.H * 2),
      he(static_cast<size_t>(max_tokens) * 2 * p.I * 2),
      ae(static_cast<size_t>(max_tokens) * p.I * 2),
      ye(static_cast<size_t>(max_tokens) * p.H * 2),
      u(static_cast<size_t>(max_tokens) * max_rank * 2),
      rows_d(static_cast<size_t>(max_tokens) * 4),
      w_d(static_cast<size_t>(max_tokens) * 4),
      acc(static_cast<size_t>(max_tokens) * p.H * 4),
      sh(static_cast<size_t>(max_tokens) * 2 * std::max(p.Is, 1) * 2),
      sa(static_cast<size_t>(max_tokens) * std::max(p.Is, 1) * 2),
      so(static_cast<size_t>(max_tokens) * p.H * 2),
      ws(size_t(32) << 20),
      H(p.H),
      I(p.I),
      Is(p.Is),
      E(p.E),
      R(max_rank) {
  cublasCreate(&h);
  cublasSetWorkspace(h, ws.get(), ws.bytes());
}
Baseline::~Baseline() {
  cublasDestroy(h);
}

void Baseline::gemm(const void* x, const void* w, void* y, int rows, int n, int k, float beta,
                    cudaStream_t s, int ldw) {
  const float alpha = 1.f;
  cublasSetStream(h, s);
  cublasSetWorkspace(h, ws.get(), ws.bytes());  // cublasSetStream fell back to the default pool
  cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &alpha, w, CUDA_R_16BF, ldw ? ldw : k, x,
               CUDA_R_16BF, k, &beta, y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}
void Baseline::forward(const ops::cuda::MoeLayerCuda::DeviceView& v, const __nv_bfloat16* x,
                       const std::vector<int32_t>& ids, const std::vector<float>& wts,
                       const std::vector<int32_t>& slots, int T, int k, bool lora, int rank,
                       bool shared, __nv_bfloat16* out, cudaStream_t s) {
  const int blocks = 512, threads = 256;
  MOELORA_CUDA_CHECK(cudaMemsetAsync(acc.get(), 0, static_cast<size_t>(T) * H * 4, s));
  std::vector<std::vector<int32_t>> rows(E);
  std::vector<std::vector<float>> ws_e(E);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      if (e < 0) continue;
      rows[e].push_back(t);
      ws_e[e].push_back(wts[t * k + j]);
    }
  for (int e = 0; e < E; ++e) {
    const int m = static_cast<int>(rows[e].size());
    if (m == 0) continue;
    MOELORA_CUDA_CHECK(
        cudaMemcpyAsync(rows_d.get(), rows[e].data(), m * 4, cudaMemcpyHostToDevice, s));
    MOELORA_CUDA_CHECK(
        cudaMemcpyAsync(w_d.get(), ws_e[e].data(), m * 4, cudaMemcpyHostToDevice, s));
    dequant_fp8_bf16_kernel<<<blocks, threads, 0, s>>>(
        v.w13 + static_cast<size_t>(e) * 2 * I * v.hidden_padded,
        v.w13_scale + static_cast<size_t>(e) * (2 * I / 128) * (v.hidden_padded / 128),
        w13.as<__nv_bfloat16>(), 2 * I, H, v.hidden_padded);
    dequant_fp8_bf16_kernel<<<blocks, threads, 0, s>>>(
        v.w2 + static_cast<size_t>(e) * H * I,
        v.w2_scale + static_cast<size_t>(e) * ((H + 127) / 128) * (I / 128), w2.as<__nv_bfloat16>(),
        H, I, I);
    gather_rows_kernel<<<blocks, threads, 0, s>>>(x, rows_d.as<int32_t>(), xe.as<__nv_bfloat16>(),
                                                  m, H);
    gemm(xe.get(), w13.get(), he.get(), m, 2 * I, H, 0.f, s);
    const int slot = lora ? slots[rows[e][0]] : -1;  // the baseline runs single-adapter batches
    if (slot >= 0) {
      const int ea = v.lora_a13_experts == 1 ? 0 : e;
      const __nv_bfloat16* a13 =
          v.lora_a13 + (static_cast<size_t>(slot) * v.lora_a13_experts + ea) * R * H;
      const __nv_bfloat16* b13 = v.lora_b13 + (static_cast<size_t>(slot) * E + e) * 2 * I * R;
      gemm(xe.get(), a13, u.get(), m, rank, H, 0.f, s);  // shrink: rows of A past `rank` are zero
      gemm(u.get(), b13, he.get(), m, 2 * I, rank, 1.f, s, R);  // expand: B rows have R entries
    }
    silu_mul_kernel<<<blocks, threads, 0, s>>>(he.as<__nv_bfloat16>(), ae.as<__nv_bfloat16>(), m,
                                               I);
    gemm(ae.get(), w2.get(), ye.get(), m, H, I, 0.f, s);
    if (slot >= 0) {
      const int eb = v.lora_b2_experts == 1 ? 0 : e;
      const __nv_bfloat16* a2 = v.lora_a2 + (static_cast<size_t>(slot) * E + e) * R * I;
      const __nv_bfloat16* b2 =
          v.lora_b2 + (static_cast<size_t>(slot) * v.lora_b2_experts + eb) * H * R;
      gemm(ae.get(), a2, u.get(), m, rank, I, 0.f, s);
      gemm(u.get(), b2, ye.get(), m, H, rank, 1.f, s, R);
    }
    scatter_add_kernel<<<blocks, threads, 0, s>>>(ye.as<__nv_bfloat16>(), rows_d.as<int32_t>(),
                                                  w_d.as<float>(), acc.as<float>(), m, H);
  }
  if (shared && Is > 0) {
    gemm(x, v.shared_w13, sh.get(), T, 2 * Is, H, 0.f, s);
    silu_mul_kernel<<<blocks, threads, 0, s>>>(sh.as<__nv_bfloat16>(), sa.as<__nv_bfloat16>(), T,
                                               Is);
    gemm(sa.get(), v.shared_w2, so.get(), T, H, Is, 0.f, s);
    add_bf16_to_f32_kernel<<<blocks, threads, 0, s>>>(so.as<__nv_bfloat16>(), acc.as<float>(),
                                                      static_cast<size_t>(T) * H);
  }
  f32_to_bf16_kernel<<<blocks, threads, 0, s>>>(acc.as<float>(), out, static_cast<size_t>(T) * H);
}

}  // namespace moelora::bench
