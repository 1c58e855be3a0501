// Prototype of a W4A8 NVFP4 decode consumer loop, compiled only to count its SASS instructions
// (README.md beside it; not built with moelora): e2m1 codes -> e4m3 bytes in registers (value *
// 2^-6), one m64n8k32 e4m3 wgmma per k16 group (the other group's half of A zero) into its own
// accumulator, the group's e4m3 scales applied with FFMA one half stage later.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

#include "core/mma_ptx.cuh"
#include "core/sm90_ptx.cuh"

namespace sm90 = ::moelora::cuda::sm90;
using ::moelora::cuda::ptx::ld_shared_v4_u32;
__device__ __forceinline__ void wgmma_fp8_rs_n8(float (&d)[4], uint32_t a0, uint32_t a1,
                                                uint32_t a2, uint32_t a3, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, "
      "0, 1, 1;\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}
// 8 codes -> two registers of four e4m3 bytes (scripts/nvfp4_e4m3_layout.py): row r's codes in
// place (sign bit 7, magnitude bits 4-2 of each byte); row r + 8's sign in bit 1, mantissa bit in
// bit 0 and exponent bits in bits 6-5 of the byte before (cyclically).
__device__ __forceinline__ void expand8(uint32_t q, uint32_t& r0, uint32_t& r1) {
  r0 = q & 0x9C9C9C9Cu;
  r1 = (__funnelshift_l(q, q, 6) & 0x98989898u) | ((q << 2) & 0x04040404u);
}
__device__ __forceinline__ float2 scales2(uint32_t pair) {
  const __half2 h =
      __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3));
  return __half22float2(h);
}
extern "C" __global__ void __launch_bounds__(160, 3)
    proto(uint64_t desc0, uint32_t smem0, int k_blocks, float* out) {
  float acc[4] = {0, 0, 0, 0};
  float tmp[2][4][4] = {};
  uint32_t prev_sc[4] = {0, 0, 0, 0};
  const int t = threadIdx.x % 128;
  const uint32_t codes_at = smem0 + t * 16, scales_at = smem0 + 4096 + (t / 4) * 16;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int stage = kb % 5;
    const uint32_t block = stage * 4608;
    const uint4 c0 = ld_shared_v4_u32(block + codes_at),
                c1 = ld_shared_v4_u32(block + codes_at + 2048);
    const uint4 s = ld_shared_v4_u32(block + scales_at);
    const uint64_t desc = desc0 + stage * 64;
    const uint32_t code[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const uint32_t sc[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t a[4][4];
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        uint32_t r0, r1;
        expand8(code[half * 4 + g], r0, r1);
        if (g % 2 == 0)
          a[g][0] = r0, a[g][1] = r1, a[g][2] = 0u, a[g][3] = 0u;
        else
          a[g][0] = 0u, a[g][1] = 0u, a[g][2] = r0, a[g][3] = r1;
      }
      sm90::wgmma_fence();
#pragma unroll
      for (int g = 0; g < 4; ++g)
        wgmma_fp8_rs_n8(tmp[half][g], a[g][0], a[g][1], a[g][2], a[g][3],
                        desc + (half * 2 + g / 2) * 2);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();  // the other half's group is done
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        float(&t)[4] = tmp[half ^ 1][g];
#pragma unroll
        for (int i = 0; i < 4; ++i) sm90::fence_operand(t[i]);
        const float2 sg = scales2(prev_sc[(half ^ 1) * 2 + g / 2] >> (16 * (g % 2)));
        acc[0] = fmaf(sg.x, t[0], acc[0]);
        acc[1] = fmaf(sg.x, t[1], acc[1]);
        acc[2] = fmaf(sg.y, t[2], acc[2]);
        acc[3] = fmaf(sg.y, t[3], acc[3]);
      }
      if (half == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) prev_sc[i] = sc[i];
      }
    }
  }
  out[threadIdx.x * 4 + 0] = acc[0];
  out[threadIdx.x * 4 + 1] = acc[1];
  out[threadIdx.x * 4 + 2] = acc[2];
  out[threadIdx.x * 4 + 3] = acc[3];
}
