// Quantization formats: FP8 e4m3 with 128x128 block scales (weights) and 1x128 per-token group
// scales (activations), and NVFP4 (e2m1 values, e4m3 scale per 16 inputs, fp32 per-tensor
// scale_2). References for dequantization (the oracle of every quantized kernel) and the
// quantizers used to write synthetic checkpoints.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moelora::ops {

// W[n, k] = e4m3(q[n, k]) * scale_inv[n / block_n, k / block_k]
// q: F8_E4M3 [N, K]; scale_inv: F32 [ceil(N/block_n), ceil(K/block_k)] -> F32 [N, K]
// N and K need not be multiples of the block (partial last blocks use their block's scale).
Tensor dequant_fp8_block_ref(const Tensor& q, const Tensor& scale_inv, int block_n = 128, int block_k = 128);

// W[n, k] = e2m1(packed[n, k/2] nibble) * e4m3(scale[n, k/16]) * scale_2; low nibble = even k.
// packed: U8 [N, K/2] (or E2M1x2 [N, K], the same bytes); scale: F8_E4M3 [N, K/16] -> F32 [N, K].
// K % 16 == 0, else an Error naming K.
Tensor dequant_nvfp4_ref(const Tensor& packed, const Tensor& scale, float scale_2);

struct Fp8Block {
  Tensor q;          // F8_E4M3 [N, K]
  Tensor scale_inv;  // F32 [ceil(N/bn), ceil(K/bk)], amax / 448 (1 for an all-zero block)
};
// Block quantizer (DeepSeek recipe): scale_inv = amax(block) / 448, q = e4m3(w / scale_inv),
// saturating at +-448 (the amax element maps to exactly +-448). An all-zero block gets
// scale_inv = 1 (its codes are 0 either way; the Python recipe's 1e-12 clamp gives the same
// dequantized zeros). w: any float dtype [N, K], finite; partial last blocks allowed.
Fp8Block quantize_fp8_block_ref(const Tensor& w, int block_n = 128, int block_k = 128);

struct Nvfp4Weight {
  Tensor packed;  // U8 [N, K/2]
  Tensor scale;   // F8_E4M3 [N, K/16]
  float scale_2;  // amax(W) / (6 * 448); 0 for an all-zero tensor
};
// ModelOpt recipe: scale_2 = amax/(6*448); scale = e4m3(amax16 / (6*scale_2));
// q = e2m1(w / (scale*scale_2)) (round to nearest even, ties to the even code, saturating at
// +-6; f32_to_e2m1). K % 16 == 0 (an Error names K otherwise); w finite. A block whose e4m3 scale
// is 0 (all zeros, or values below the smallest e4m3 scale) stores scale 0 and codes 0.
Nvfp4Weight quantize_nvfp4_ref(const Tensor& w);

struct Fp8Activations {
  Tensor q;      // F8_E4M3 [T, K]
  Tensor scale;  // F32 [T, ceil(K/group)], max(amax / 448, 1e-10) per token and group
};
// Dynamic activation quantization, per token per `group` columns (DESIGN.md §5):
// scale = max(amax / 448, 1e-10) (the floor keeps an all-zero group finite: its codes are 0),
// q = e4m3(x / scale), saturating. The last group of a row may be partial. x finite.
Fp8Activations quantize_fp8_per_token_ref(const Tensor& x, int group = 128);
// Inverse of the above (the value the FP8 GEMM actually sees).
Tensor dequant_fp8_per_token_ref(const Fp8Activations& a, int group = 128);
// dequant(quant(x)) of one row x[0, n) with the arithmetic above, written to out[0, n) (may alias
// x). Serial; used by the MoE reference to emulate FP8 GEMM inputs.
void fp8_round_trip_row_ref(const float* x, int64_t n, int group, float* out);

}  // namespace moelora::ops
