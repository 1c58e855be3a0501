// Grouped NVFP4 expert GEMM (GEMM1 / GEMM2 of DESIGN.md §3 with NVFP4 experts), CPU reference, and
// the device image of the weights that the weight-streaming NVFP4 kernel reads
// (ops/gemm/moe_gemm_cuda.cuh, launch_moe_gemm_nvfp4_stream).
//
//   out[q, n] = sum_k act[row(q), k] * e2m1(W[e, n, k]) * e4m3(scale[e, n, k/16]) * row_scale[e, n]
//
// W4A16: the activations are the layer's bf16 values (no activation quantization); row_scale is the
// checkpoint's per-tensor weight_scale_2, per row so that a fused gate_up weight keeps the two
// tensors' values. e(q) is the expert whose range [offsets[e], offsets[e+1]) holds q, row(q) =
// gather[q] (or q).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace moelora::ops {

struct MoeGemmNvfp4Ref {
  Tensor act;        // F32 or BF16 [rows, K]
  Tensor packed;     // U8 [E, N, K/2], low nibble = even k (the checkpoint's layout)
  Tensor scale;      // F8_E4M3 [E, N, K/16]
  Tensor row_scale;  // F32 [E, N]
  std::vector<int32_t> expert_offsets;  // [E + 1], non-decreasing, last = number of sorted positions
  std::vector<int32_t> gather;          // [P] act row of each sorted position; empty = identity
};

// Returns F32 [P, N], P = expert_offsets.back(). Accumulates in double (the oracle).
Tensor moe_gemm_nvfp4_ref(const MoeGemmNvfp4Ref& args);

// ---- device image of NVFP4 experts for the stream kernel ----
//
// One block of kNvfp4StreamBlockBytes per (expert, 64-row tile, 128-column K block), blocks in
// that order ([E][N/64][K/128]), so a pipeline stage is one contiguous bulk copy:
// - 4,096 bytes of codes, as 1,024 32-bit words: word (g * 128 + t) * 4 + j' holds what consumer
//   thread t (warp w = t / 32 of the warpgroup: rows 16 w .. 16 w + 15; lane l: r = l / 4,
//   c = l % 4) needs for k16 step j = 4 g + j' of the block, the eight codes of its wgmma A
//   fragment: register a_i (i = 0 .. 3: (row 16 w + r, k 2c), (row + 8, k 2c), (row, k 2c + 8),
//   (row + 8, k 2c + 8) of the step, k relative to 16 j) takes its low half's code from the low
//   16 bits of the word and its high half's (k + 1) from the high 16: the code's sign at bit
//   15 - i, its 3 magnitude bits (exponent, mantissa) at 9 - 3 i .. 11 - 3 i. So a_0 is the word
//   masked as it is, and a_i needs the word shifted left by i (sign) and by 3 i (magnitude) to put
//   them where an f16 has its sign and its exponent / mantissa boundary (bits 15 and 9-11).
// - 512 bytes of e4m3 group scales: 16 bytes per row pair (16 w + r, 16 w + r + 8), p = 8 w + r:
//   byte 2 j is the scale of row 16 w + r for step j's 16 columns, byte 2 j + 1 that of row + 8.
constexpr int kNvfp4StreamRows = 64;     // weight rows per tile (the wgmma M of one warpgroup)
constexpr int kNvfp4StreamK = 128;       // K columns per block (a pipeline stage)
constexpr int kNvfp4StreamCodeBytes = kNvfp4StreamRows * kNvfp4StreamK / 2;
constexpr int kNvfp4StreamScaleBytes = kNvfp4StreamRows * kNvfp4StreamK / 16;
constexpr int kNvfp4StreamBlockBytes = kNvfp4StreamCodeBytes + kNvfp4StreamScaleBytes;

// packed U8 [E, N, K/2] + scale F8_E4M3 [E, N, K/16] -> U8 [E, N/64, K/128, 4608]. N % 64 == 0,
// K % 128 == 0; scales must not be negative (the kernel multiplies magnitudes; ModelOpt's recipe
// never writes a negative scale) nor NaN. Errors name the tensor, the expected and actual shape or
// the first bad scale.
Tensor pack_nvfp4_for_stream(const Tensor& packed, const Tensor& scale);
// The inverse (tests): the image back to {packed [E, N, K/2], scale [E, N, K/16]}.
struct Nvfp4Experts {
  Tensor packed;
  Tensor scale;
};
Nvfp4Experts unpack_nvfp4_from_stream(const Tensor& image, int64_t n, int64_t k);

// ---- W4A8 decode image (launch_moe_gemm_nvfp4_w4a8, the FP8 tensor cores) ----
//
// The blocks of the stream image above ([E][N/64][K/128], 4,096 code bytes, then the same 512
// scale bytes), with the code words laid out for the A fragments of e4m3 wgmma m64nNk32, one k16
// group of the block per wgmma (the other 16 columns of A zero): word (g / 4) * 512 + t * 4 + g % 4
// holds what consumer thread t (warp w = t / 32: rows 16 w .. 16 w + 15; lane l: r = l / 4, c =
// l % 4) needs for group g (block columns 16 g .. 16 g + 15): the codes of row 16 w + r at columns
// 16 g + 4 c + j, j = 0..3, in byte j where an e4m3 byte has them (sign at bit 7, the two exponent
// bits and the mantissa bit at 4-2), and those of row + 8 in the bits left over (sign at bit 1 and
// mantissa bit at bit 0 of byte j, exponent bits at bits 6-5 of byte j - 1, cyclically). Then
//   R0 = word & 0x9C9C9C9C,  R1 = (rotl(word, 6) & 0x98989898) | ((word << 2) & 0x04040404)
// are the e4m3 bytes of the two rows' codes (five integer ops for eight codes), each reading as
// e2m1 * 2^-6, the subnormal 0.5 included (scripts/nvfp4_e4m3_layout.py checks the layout).
// Same requirements and errors as pack_nvfp4_for_stream.
Tensor pack_nvfp4_for_w4a8(const Tensor& packed, const Tensor& scale);
// The inverse (tests).
Nvfp4Experts unpack_nvfp4_from_w4a8(const Tensor& image, int64_t n, int64_t k);

// The e4m3 activation rows the W4A8 kernel multiplies: x[row(q)] / s[q] rounded to e4m3 (nearest
// even), s[q] the power of two that brings the row's largest magnitude into (224, 448] (1 for a
// zero row), so no value saturates and the division is exact before the rounding. rows F8_E4M3
// [P, K], scale F32 [P]; x and gather as for rows_to_f16_pow2_ref.
struct E4m3Rows {
  Tensor rows;   // F8_E4M3 [P, K]
  Tensor scale;  // F32 [P]
};
E4m3Rows rows_to_e4m3_pow2_ref(const Tensor& x, const std::vector<int32_t>& gather, int64_t p);
// The power-of-two row scale for a row whose largest magnitude is `amax` (see above).
float e4m3_row_scale_for(float amax);
// F32 [P, K]: each e4m3 value times its row's scale (exact). The W4A8 GEMM's reference is
// moe_gemm_nvfp4_ref with these rows as act (and no gather): the kernel multiplies the same
// e4m3 values by the same e2m1 codes and group scales.
Tensor e4m3_rows_dequantized(const E4m3Rows& rows);

// The activation rows the NVFP4 stream kernel multiplies: x[row(q)] / s[q] as f16 (exact), with
// s[q] = 2^e the power of two that brings the row's largest magnitude into [2^13, 2^14) (1 for a
// zero row): f16 holds every bf16 value of the row above max|x| * 2^-30 exactly, and no value
// overflows. out F16 [P, K], row_scale F32 [P]. x: F32 or BF16 [rows, K] (F32 values are taken
// as they are, rounded to f16 only where not representable), gather as above.
struct F16Rows {
  Tensor rows;   // F16 [P, K]
  Tensor scale;  // F32 [P]
};
F16Rows rows_to_f16_pow2_ref(const Tensor& x, const std::vector<int32_t>& gather, int64_t p);
// The power-of-two row scale for a row whose largest magnitude is `amax` (see above).
float f16_row_scale_for(float amax);

}  // namespace moelora::ops
