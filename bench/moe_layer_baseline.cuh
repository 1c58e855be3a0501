// bench_moe_layer's unfused baseline: what a straightforward implementation does
// (moe_layer_baseline.cu).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "core/cuda_utils.h"
#include "moe_layer_config.h"
#include "ops/moe/moe_layer_cuda.cuh"

namespace moelora::bench {

// Routing comes back to the host; then per active expert: dequantize its FP8 weights to bf16,
// gather its tokens, cuBLAS GEMM1, SiLU*up, cuBLAS GEMM2, weighted scatter-add; LoRA as separate
// cuBLAS GEMMs per (adapter, expert); the shared expert through cuBLAS. Timed with the same
// events, eagerly (it cannot be captured: its launches depend on the routing).
struct Baseline {
  cublasHandle_t h = nullptr;
  cuda::DeviceBuffer w13, w2, xe, he, ae, ye, u, rows_d, w_d, acc, sh, sa, so, ws;
  int H, I, Is, E, R;
  Baseline(const Preset& p, int max_tokens, int max_rank);
  ~Baseline();
  Baseline(const Baseline&) = delete;
  Baseline& operator=(const Baseline&) = delete;
  // y[rows, n] (+)= x[rows, k] . w[n, k]^T, all bf16
  void gemm(const void* x, const void* w, void* y, int rows, int n, int k, float beta,
            cudaStream_t s, int ldw = 0);
  // One unfused forward. ids/weights/slots on the host (downloaded by the caller as part of the
  // timing).
  void forward(const ops::cuda::MoeLayerCuda::DeviceView& v, const __nv_bfloat16* x,
               const std::vector<int32_t>& ids, const std::vector<float>& wts,
               const std::vector<int32_t>& slots, int T, int k, bool lora, int rank, bool shared,
               __nv_bfloat16* out, cudaStream_t s);
};

}  // namespace moelora::bench
