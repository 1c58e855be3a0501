// RMSNorm over the last dimension, computed in fp32 in the order Hugging Face uses:
//
//   var = mean(x * x)                      (squares in fp32, mean = sum / D)
//   n   = x * rsqrt(var + eps)             (rsqrt = 1 / sqrt, eps cast to fp32)
//   y   = w * n                            NormStyle::kWeight        (Qwen3, DeepSeek, OLMoE)
//   y   = n * (1 + w)                      NormStyle::kOnePlusWeight (Qwen3-Next / Qwen3.5, w init 0)
//
// The same op covers every place a model normalizes: input/post-attention norms and the final norm
// (x [T, H]), MLA's q_a_layernorm / kv_a_layernorm (x [T, q_lora_rank] / [T, kv_lora_rank]) and
// Qwen3's per-head q_norm / k_norm (x [T, heads, head_dim]: the last dimension is head_dim, so every
// head of every token is normalized on its own, like HF's norm of q.view(..., heads, head_dim)).
//
// HF casts the normalized value to the model dtype before the weight multiply (kWeight) or the
// result after it (kOnePlusWeight); the reference stays in fp32 throughout, which is what the fp32
// goldens are made with.
#pragma once

#include "core/model_enums.h"
#include "core/tensor.h"

namespace moelora::ops {

struct RmsNormParams {
  double eps = 1e-6;  // config rms_norm_eps; added in fp32 like torch adds a Python float
  NormStyle style = NormStyle::kWeight;
};

// x: F32 [..., D] (at least 1-D); weight: [D] of any float dtype (used in place, converted per
// element). Returns a new F32 tensor with x's shape.
Tensor rms_norm_ref(const Tensor& x, const Tensor& weight, const RmsNormParams& params);
// Same, overwriting x.
void rms_norm_inplace_ref(Tensor& x, const Tensor& weight, const RmsNormParams& params);

}  // namespace moelora::ops
