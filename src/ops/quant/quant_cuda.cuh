// Dynamic FP8 activation quantization on the GPU (per row per 128 columns), optionally fused
// with the permute into expert-sorted order. Bit-identical to quantize_fp8_per_token_ref. And the
// f16 rows with power-of-two row scales that the NVFP4 expert GEMM multiplies.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/lora/lora_row_fused.cuh"

namespace moelora::ops::cuda {

struct QuantFp8DeviceArgs {
  const __nv_bfloat16* x = nullptr;  // [rows_in, cols]
  const int32_t* gather = nullptr;   // [max_rows] input row of each output row; nullptr = identity
  const int32_t* num_rows = nullptr; // [1] valid output rows (device value); nullptr = max_rows
  int max_rows = 0;                  // grid capacity
  int cols = 0;                      // valid columns
  int cols_padded = 0;               // multiple of 128; columns past `cols` are written as 0
  uint8_t* q = nullptr;              // e4m3 [max_rows, cols_padded]
  float* scale = nullptr;            // [max_rows, cols_padded / 128], or k-major (scale_ld)
  // 0: scales row-major as above; > 0: k-major [cols_padded / 128, scale_ld] (scale_ld >=
  // max_rows), the layout the stream GEMM loads one K block of many rows from.
  int scale_ld = 0;
  bool pdl = false;  // see launch_quantize_fp8_rows
  // Optional LoRA shrink of the same rows (lora.partial != nullptr; lora_row_fused.cuh): the
  // decode MoE layer's seam-1 A factors, partials [ceil(cols / 1024), capacity, R] with
  // lora.row_token = gather. Rows are the sorted (token, expert) pairs.
  LoraRowShrinkArgs lora;
  // Optional scatter (no LoRA shrink, no gather): input row t is quantized once and written to
  // the output rows scatter[t * scatter_width + j] (j < scatter_width; -1 = none), one grid row
  // per input row (scatter_rows of them). The decode MoE layer passes pair_pos: a token's codes
  // are the same in each of its k pair rows, so quantizing per pair did k times the work (at
  // kimi-ep8 128 tokens 7,168 CTAs for 128 tokens). The rows written, and their bits, are those
  // of the gather form with gather = the scatter's inverse (sorted_token).
  const int32_t* scatter = nullptr;  // [scatter_rows, scatter_width]
  int scatter_rows = 0;
  int scatter_width = 0;
};

// args.pdl: launch with programmatic stream serialization (after the align kernel). The kernel
// waits for its predecessor (griddepcontrol.wait) and only then lets its own dependent (the
// stream GEMM) be scheduled: the GEMM reads the align kernel's schedule before its own wait, so
// that schedule must be complete by then. It writes only q and scale, which the GEMM reads after
// its wait.
void launch_quantize_fp8_rows(const QuantFp8DeviceArgs& args, cudaStream_t stream);

// f16 activation rows for the NVFP4 expert GEMM (rows_to_f16_pow2_ref in ops/gemm/moe_gemm_nvfp4.h,
// bit-identical): out[q] = x[gather[q]] / s[q] with s[q] the power of two that brings the row's
// largest magnitude into [2^13, 2^14). One CTA per output row; rows past *num_rows are not
// written.
struct RowsToF16Args {
  const __nv_bfloat16* x = nullptr;   // [rows_in, cols]
  const int32_t* gather = nullptr;    // [max_rows] input row of each output row; nullptr = identity
  const int32_t* num_rows = nullptr;  // [1] valid output rows (device value); nullptr = max_rows
  int max_rows = 0;                   // grid capacity
  int cols = 0;                       // a multiple of 8
  __half* out = nullptr;              // [max_rows, cols]
  float* scale = nullptr;             // [max_rows]
  // Programmatic stream serialization: the kernel waits for its predecessor before reading
  // anything and lets its dependent (the GEMM, which reads the routing schedule before its own
  // wait) start only after that.
  bool pdl = false;
};
void launch_rows_to_f16_pow2(const RowsToF16Args& args, cudaStream_t stream);
// e4m3 activation rows for the W4A8 NVFP4 GEMM (rows_to_e4m3_pow2_ref, bit-identical): out[q] =
// x[gather[q]] / s[q] rounded to e4m3, s[q] the power of two that brings the row's largest
// magnitude into (224, 448]. Fields and launch as RowsToF16Args, out one byte per value.
struct RowsToE4m3Args {
  const __nv_bfloat16* x = nullptr;   // [rows_in, cols]
  const int32_t* gather = nullptr;    // [max_rows]; nullptr = identity
  const int32_t* num_rows = nullptr;  // [1]; nullptr = max_rows
  int max_rows = 0;
  int cols = 0;            // a multiple of 8
  uint8_t* out = nullptr;  // [max_rows, cols] e4m3
  float* scale = nullptr;  // [max_rows]
  bool pdl = false;
};
void launch_rows_to_e4m3_pow2(const RowsToE4m3Args& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
