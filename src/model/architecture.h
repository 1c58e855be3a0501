// Internal interface between the generic model loop (model.cpp) and the attention blocks of
// each architecture (qwen3_moe.cpp, deepseek_v3.cpp). Not part of the public model API.
//
// Blocks: GQA (qwen3_moe.cpp; with Qwen3.5's output gate), MLA (deepseek_v3.cpp) and Gated
// DeltaNet linear attention (gated_deltanet.cpp, Qwen3.5).
//
// An attention block gets the normalized activations of the whole batch h [T, H] and returns
// the attention output after o_proj [T, H]. Projections (and their LoRA, per token slot) run over
// all T tokens at once; the attention core runs per sequence segment against that sequence's
// cache of this layer, after appending the segment's new keys and values.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "io/hf_config.h"
#include "model/kv_cache.h"
#include "model/lora_binding.h"
#include "model/weights.h"
#include "ops/rope/rope.h"

namespace moelora::model::detail {

struct Segment {
  int64_t begin = 0;  // first row of the sequence's tokens in the batch
  int64_t count = 0;  // number of new tokens
  LayerCache* cache;  // the sequence's cache of the current layer
};

struct AttentionContext {
  const io::ModelConfig& config;
  const ops::RopeTable& rope;
  float scale;  // softmax scale
  const AdapterSet& adapters;
  int64_t layer;
  const std::vector<int32_t>& slot;       // [T] adapter slot per token (-1 = base)
  const std::vector<int64_t>& positions;  // [T] position of each token in its sequence
  const std::vector<Segment>& segments;   // one per sequence, in batch order
};

// y = x W^T plus, for every token whose slot adapts `target` in this layer, the LoRA delta.
// x: F32 [T, in]; w: F32 [out, in] -> F32 [T, out].
Tensor project(const Tensor& x, const Tensor& w, const AttentionContext& ctx,
               LoraTargetMember target);

// Qwen3-MoE: GQA with per-head q_norm / k_norm before rotate_half RoPE. Qwen3.5 full-attention
// layers (config.attention_output_gate): q_proj also emits a per-head gate and the attention output
// is multiplied by sigmoid(gate) before o_proj; RoPE rotates the first rotary_dim dims only.
void check_qwen3_attention(const AttentionWeightsF32& w, const io::ModelConfig& config,
                           int64_t layer);
LayerCache make_qwen3_cache(const io::ModelConfig& config);
Tensor qwen3_attention(const AttentionWeightsF32& w, const Tensor& h, const AttentionContext& ctx);

// Qwen3.5 Gated DeltaNet ("linear_attention" layers): the projections (and their LoRA) over the
// whole batch, the conv + gated delta rule + gated norm per sequence against its state.
void check_linear_attention(const LinearAttentionWeightsF32& w, const io::ModelConfig& config,
                            int64_t layer);
LayerCache make_linear_attention_cache(const io::ModelConfig& config);
Tensor linear_attention(const LinearAttentionWeightsF32& w, const Tensor& h,
                        const AttentionContext& ctx);

// DeepSeek-V3 / Kimi: MLA (with or without q_lora_rank), interleaved RoPE on the rope dims.
void check_mla_attention(const AttentionWeightsF32& w, const io::ModelConfig& config,
                         int64_t layer);
LayerCache make_mla_cache(const io::ModelConfig& config);
Tensor mla_attention(const AttentionWeightsF32& w, const Tensor& h, const AttentionContext& ctx);

}  // namespace moelora::model::detail
