// Small kernels of the GPU decoder that no operator folder owns: Qwen3.5's sigmoid output gate of
// the attention,
// the gather of each sequence's last row for the output head, the bf16 dense GEMM wrapper over
// cuBLAS, and the counter-based random fills that GpuModel::random() and randomize_slot() use.
//
// All launchers follow the ops conventions: capacity-sized grids, device-side valid counts, no
// allocation, no synchronization, an explicit stream.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/model_enums.h"

namespace moelora::model::gpu_detail {

// Qwen3.5's attention output gate, in place: x[t, i] *= sigmoid(gate[t, i]) for i < width
// (x [T, width] contiguous rows; gate rows gate_stride apart, e.g. a column block of the fused
// qkv rows). fp32 math, one rounding to bf16, as transformers' attn_output * sigmoid(gate).
struct SigmoidGateArgs {
  __nv_bfloat16* x = nullptr;
  const __nv_bfloat16* gate = nullptr;
  int64_t gate_stride = 0;
  int width = 0;
  int tokens = 0;                       // grid capacity
  const int32_t* num_tokens = nullptr;  // [1] valid tokens (device), nullptr = tokens
};
void launch_sigmoid_gate(const SigmoidGateArgs& args, cudaStream_t stream);

// dst[b, :] = src[rows[b], :] for b < count (bf16 [*, cols] -> [count, cols]); a row index
// outside [0, src_rows) writes a zero row.
void launch_gather_rows(const __nv_bfloat16* src, int src_rows, const int32_t* rows, int count,
                        int cols, __nv_bfloat16* dst, cudaStream_t stream);

// y [rows, n] (bf16 or fp32, row stride ldy) = x [rows, k] (bf16, row stride ldx) . W [n, k]^T
// (bf16), fp32 accumulation. Binds `handle` to `stream` first.
void gemm_bf16(cublasHandle_t handle, cudaStream_t stream, const __nv_bfloat16* x, int64_t ldx,
               const __nv_bfloat16* w, void* y, cudaDataType_t y_type, int64_t ldy, int rows, int n,
               int k);

// Seeded fills (element i depends only on (seed, i): the same on every device and launch).
enum class FillKind { kNormal, kUniform };
struct FillArgs {
  FillKind kind = FillKind::kNormal;
  float a = 0.0f;  // normal: mean; uniform: low
  float b = 1.0f;  // normal: stddev; uniform: high
  uint64_t seed = 0;
  // Element i is written as zero when (i / inner) % period >= keep (the rank tail of a LoRA
  // factor in its padded pool slot); period 0 = never.
  int64_t inner = 1, period = 0, keep = 0;
};
void launch_fill_bf16(__nv_bfloat16* p, int64_t n, const FillArgs& args, cudaStream_t stream);
void launch_fill_f32(float* p, int64_t n, const FillArgs& args, cudaStream_t stream);

}  // namespace moelora::model::gpu_detail
