// Device-side FP8 helpers shared by the kernels that quantize activations (quant, activation).
// Bit-identical to the CPU reference (ops/quant/quant.h): scale = max(amax / 448, 1e-10) per
// 128-column group, code = e4m3(x / scale) with IEEE division, round to nearest even, saturating.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace moelora::ops::cuda {

constexpr float kFp8ScaleFloor = 1e-10f;
constexpr float kFp8Max = 448.0f;

__device__ __forceinline__ uint8_t f32_to_e4m3_sat(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float warp_max_abs(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// One warp quantizes one 128-column group: lane holds values[4] of columns 4*lane .. 4*lane+3
// (zeros for padding columns). Returns the group's scale; codes go to `codes` (4 bytes packed).
__device__ __forceinline__ float quantize_group_128(const float (&values)[4], uint32_t& codes) {
  float amax = fmaxf(fmaxf(fabsf(values[0]), fabsf(values[1])), fmaxf(fabsf(values[2]), fabsf(values[3])));
  amax = warp_max_abs(amax);
  const float scale = fmaxf(__fdiv_rn(amax, kFp8Max), kFp8ScaleFloor);
  codes = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) codes |= static_cast<uint32_t>(f32_to_e4m3_sat(__fdiv_rn(values[i], scale))) << (8 * i);
  return scale;
}

// quantize_group_128 of the lane's 4 bf16 values packed in `raw` (columns 4 * lane .. + 3).
__device__ __forceinline__ float quantize_bf16_group_128(const uint2& raw, uint32_t& codes) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const float2 lo = __bfloat1622float2(h[0]), hi = __bfloat1622float2(h[1]);
  const float values[4] = {lo.x, lo.y, hi.x, hi.y};
  return quantize_group_128(values, codes);
}

}  // namespace moelora::ops::cuda
