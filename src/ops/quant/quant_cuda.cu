// One warp per (row, 128-column group); 8 warps per CTA cover 8 groups of a row. With LoRA the
// CTA also writes the seam-1 shrink partials of its row and 1024 columns (lora_row_fused.cuh).
// With a scatter (QuantFp8DeviceArgs::scatter) the grid's rows are input rows, each quantized
// once and stored to its listed output rows.
#include <cstdint>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/quant/fp8_device.cuh"
#include "ops/quant/quant_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kWarps = 8;

static_assert(kWarps == kRowShrinkWarps, "the fused LoRA shrink covers one CTA's 8 column groups");

// Input row blockIdx.x, columns [1024 blockIdx.y, + 1024): each warp quantizes one 128-column
// group (quantize_group_128, the arithmetic of the per-row kernel below) and stores its codes and
// scale to every output row the scatter lists for this input row.
__global__ void __launch_bounds__(32 * kWarps)
    quantize_fp8_scatter_kernel(const QuantFp8DeviceArgs a) {
  ::moelora::cuda::sm90::grid_dependency_wait();
  ::moelora::cuda::sm90::launch_dependents();
  const int in_row = blockIdx.x;
  const int groups = a.cols_padded / 128;
  const int group = blockIdx.y * kWarps + threadIdx.x / 32;
  if (group >= groups) return;  // whole warps: no shuffle partner leaves early
  const int lane = threadIdx.x % 32;
  const int c0 = group * 128 + lane * 4;
  const __nv_bfloat16* x = a.x + static_cast<size_t>(in_row) * a.cols;
  uint32_t codes;
  float s;
  if (a.cols % 4 == 0) {  // one 8-byte load (rows start 8-byte aligned); padding lanes read zeros
    const uint2 raw = c0 < a.cols ? *reinterpret_cast<const uint2*>(x + c0) : make_uint2(0u, 0u);
    s = quantize_bf16_group_128(raw, codes);
  } else {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = c0 + i < a.cols ? __bfloat162float(x[c0 + i]) : 0.f;
    s = quantize_group_128(v, codes);
  }
  const int32_t* out_rows = a.scatter + static_cast<size_t>(in_row) * a.scatter_width;
  for (int j = 0; j < a.scatter_width; ++j) {
    const int row = out_rows[j];
    if (row < 0) continue;
    *reinterpret_cast<uint32_t*>(a.q + static_cast<size_t>(row) * a.cols_padded + c0) = codes;
    if (lane == 0)
      a.scale[a.scale_ld > 0 ? static_cast<size_t>(group) * a.scale_ld + row
                             : static_cast<size_t>(row) * groups + group] = s;
  }
}

// kLora: the instance with the fused LoRA shrink (the plain one keeps its small register count).
template <bool kLora>
__global__ void __launch_bounds__(32 * kWarps) quantize_fp8_rows_kernel(const QuantFp8DeviceArgs a) {
  const bool lora = kLora && a.lora.partial != nullptr;
  __shared__ RowShrinkSlots slots;
  if (lora) {  // pool metadata: does not depend on the previous kernel
    stage_row_shrink_slots(a.lora.pool, slots);
    __syncthreads();
  }
  ::moelora::cuda::sm90::grid_dependency_wait();
  ::moelora::cuda::sm90::launch_dependents();
  const int row = blockIdx.x;  // rows on x: prefill has more than 65535 of them
  const int valid_rows = a.num_rows ? *a.num_rows : a.max_rows;
  if (row >= valid_rows) return;
  const int groups = a.cols_padded / 128;
  const int group = blockIdx.y * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int c0 = group * 128 + lane * 4;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  const int2 slot_expert = lora ? a.lora.row_slot_expert[row] : make_int2(-1, 0);
  if (group < groups) {  // warps past the last group only join the LoRA shrink (with zeros)
    const int in_row = a.gather ? a.gather[row] : row;
    const __nv_bfloat16* x = a.x + static_cast<size_t>(in_row) * a.cols;
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = c0 + i < a.cols ? __bfloat162float(x[c0 + i]) : 0.f;
    uint32_t codes;
    const float s = quantize_group_128(v, codes);
    *reinterpret_cast<uint32_t*>(a.q + static_cast<size_t>(row) * a.cols_padded + c0) = codes;
    if (lane == 0)
      a.scale[a.scale_ld > 0 ? static_cast<size_t>(group) * a.scale_ld + row : static_cast<size_t>(row) * groups + group] = s;
  }
  if (lora) {
    __shared__ float scratch[kRowShrinkWarps * kRowShrinkBatch];
    lora_row_shrink(a.lora, slots, slot_expert, row, blockIdx.y, c0, v, scratch);
    prefetch_row_a(a.lora.prefetch_next, slot_expert, blockIdx.y * blockDim.x + threadIdx.x,
                   gridDim.y * blockDim.x);
  }
}

}  // namespace

void launch_quantize_fp8_rows(const QuantFp8DeviceArgs& a, cudaStream_t stream) {
  MOELORA_CHECK(a.x && a.q && a.scale, ErrorCode::kInvalidArgument, "quantize_fp8_rows: null pointer");
  MOELORA_CHECK(a.cols_padded % 128 == 0 && a.cols_padded >= a.cols && a.cols_padded - a.cols < 128,
                ErrorCode::kInvalidArgument, "quantize_fp8_rows: cols_padded = ", a.cols_padded,
                " must be cols = ", a.cols, " rounded up to a multiple of 128");
  MOELORA_CHECK(a.scale_ld == 0 || a.scale_ld >= a.max_rows, ErrorCode::kInvalidArgument,
                "quantize_fp8_rows: scale_ld = ", a.scale_ld, " must be 0 (row-major) or >= max_rows = ", a.max_rows);
  MOELORA_CHECK(!a.lora.partial || row_shrink_args_ok(a.lora, a.max_rows, a.cols), ErrorCode::kInvalidArgument,
                "quantize_fp8_rows: the fused LoRA shrink needs row_slot_expert, the pool's A and ranks, at most ",
                kRowShrinkMaxSlots, " slots (got ", a.lora.pool.num_slots, "), row_capacity >= max_rows (",
                a.lora.row_capacity, " vs ", a.max_rows, ") and in_features = cols (", a.lora.pool.in_features,
                " vs ", a.cols, ")");
  if (a.scatter) {
    MOELORA_CHECK(!a.gather && !a.lora.partial && a.scatter_width > 0 && a.scatter_rows >= 0,
                  ErrorCode::kInvalidArgument, "quantize_fp8_rows: a scatter (width ",
                  a.scatter_width, ", rows ", a.scatter_rows,
                  ") takes a width > 0 and neither a gather nor the fused LoRA shrink");
    MOELORA_CHECK(
        a.cols % 4 != 0 || reinterpret_cast<uintptr_t>(a.x) % 8 == 0, ErrorCode::kInvalidArgument,
        "quantize_fp8_rows: x must be 8-byte aligned for the scatter form's 8-byte loads");
    if (a.scatter_rows == 0) return;
    const dim3 grid(a.scatter_rows, (a.cols_padded / 128 + kWarps - 1) / kWarps);
    ::moelora::cuda::launch_kernel(quantize_fp8_scatter_kernel, grid, dim3(32 * kWarps), 0, stream,
                                   a.pdl, a);
    return;
  }
  if (a.max_rows == 0) return;
  dim3 grid(a.max_rows, (a.cols_padded / 128 + kWarps - 1) / kWarps);
  if (a.lora.partial)
    ::moelora::cuda::launch_kernel(quantize_fp8_rows_kernel<true>, grid, dim3(32 * kWarps), 0, stream, a.pdl, a);
  else
    ::moelora::cuda::launch_kernel(quantize_fp8_rows_kernel<false>, grid, dim3(32 * kWarps), 0, stream, a.pdl, a);
}

}  // namespace moelora::ops::cuda
