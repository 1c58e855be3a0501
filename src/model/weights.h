// The CPU model's weights: every tensor of a loaded checkpoint converted once to fp32.
//
// io::load_checkpoint hands out weights in their on-disk form (bf16 / f16 / f32 views into the
// mmap'ed files, FP8 e4m3 with 128x128 block scales, NVFP4 e2m1 with e4m3 group scales). The CPU
// reference computes in fp32 only, so the model dequantizes each LinearWeight exactly once at
// load (ops::dequant_fp8_block_ref / ops::dequant_nvfp4_ref are the exact oracles of the GPU
// kernels) and then never touches the quantized bytes again. The result equals the
// "dequantized-weight twin" the parity references are computed on (W4A16 / W8A16 semantics:
// activations stay fp32).
//
// Routed experts are stacked into the canonical W13 [E, 2I, H] (gate rows [0, I), up rows
// [I, 2I)) and W2 [E, H, I] that ops::moe_forward_ref takes.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "io/checkpoint.h"
#include "ops/moe/moe.h"

namespace moelora::model {

// Attention projections of one layer. Only the tensors of the layer's attention kind are defined.
struct AttentionWeightsF32 {
  // GQA (Qwen3-MoE)
  Tensor q_proj;  // [Hq * D, H]; MLA without q_lora_rank: [n * (nope + rope), H]
  Tensor k_proj;  // [Hkv * D, H]
  Tensor v_proj;  // [Hkv * D, H]
  Tensor q_norm;  // [D] (Qwen3 per-head RMSNorm), undefined when the model has none
  Tensor k_norm;  // [D]
  // MLA (DeepSeek-V3 / Kimi)
  Tensor q_a_proj;            // [q_lora_rank, H]
  Tensor q_a_layernorm;       // [q_lora_rank]
  Tensor q_b_proj;            // [n * (nope + rope), q_lora_rank]
  Tensor kv_a_proj_with_mqa;  // [kv_lora_rank + rope, H]
  Tensor kv_a_layernorm;      // [kv_lora_rank]
  Tensor kv_b_proj;           // [n * (nope + dv), kv_lora_rank]
  // both
  Tensor o_proj;  // [H, Hq * Dv] (GQA: Dv = D; MLA: n * dv)
};

// Gated DeltaNet (Qwen3.5 linear-attention layers), key_dim = nk * dk, value_dim = nv * dv,
// conv_dim = 2 key_dim + value_dim.
struct LinearAttentionWeightsF32 {
  Tensor in_proj_qkv;  // [conv_dim, H], rows [q | k | v]
  Tensor in_proj_z;    // [value_dim, H]
  Tensor in_proj_b;    // [nv, H]
  Tensor in_proj_a;    // [nv, H]
  Tensor conv1d;       // [conv_dim, K] (depthwise, the checkpoint's [conv_dim, 1, K] squeezed)
  Tensor a_log;        // [nv]
  Tensor dt_bias;      // [nv]
  Tensor norm;         // [dv] (gated RMSNorm, plain weight)
  Tensor out_proj;     // [H, value_dim]
  bool defined() const { return in_proj_qkv.defined(); }
};

struct LayerWeightsF32 {
  Tensor input_layernorm;           // [H]
  Tensor post_attention_layernorm;  // [H]
  AttentionWeightsF32 attention;            // full-attention layers
  bool is_linear_attention = false;         // Qwen3.5 Gated DeltaNet layer: linear_attn instead
  LinearAttentionWeightsF32 linear_attn;
  bool is_moe = false;
  // Dense SwiGLU MLP (is_moe == false): gate/up [Id, H], down [H, Id].
  Tensor mlp_gate, mlp_up, mlp_down;
  // MoE layer (is_moe == true): router [E, H], correction bias [E] (DeepSeek), W13 [E, 2I, H],
  // W2 [E, H, I], shared expert W13 [2Is, H] / W2 [H, Is], Qwen's shared-expert gate [1, H].
  ops::MoeWeightsRef moe;
};

struct ModelWeightsF32 {
  Tensor embed_tokens;  // [V, H]
  std::vector<LayerWeightsF32> layers;
  Tensor final_norm;   // [H]
  Tensor lm_head;      // [V, H] (a copy of embed_tokens when the embeddings are tied)
  uint64_t bytes = 0;  // total fp32 bytes held
};

// One linear weight as fp32 [out, in]: dense weights converted, FP8 block and NVFP4 weights
// dequantized. Throws kInvalidArgument naming the weight when the result's shape is not
// [out_features, in_features] or the stored tensors are inconsistent.
Tensor dequantize_linear(const io::LinearWeight& weight);

// Converts every weight of `weights` (the layers the checkpoint loaded) to fp32. Parallel over
// tensors; shows a progress bar on stderr when `show_progress`.
ModelWeightsF32 convert_weights(const io::ModelWeights& weights, bool show_progress);

}  // namespace moelora::model
