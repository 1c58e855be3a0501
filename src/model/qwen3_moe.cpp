// Qwen3-MoE attention (transformers Qwen3MoeAttention), fp32:
//
//   q = q_proj(h) [T, Hq, D];  k = k_proj(h) [T, Hkv, D];  v = v_proj(h) [T, Hkv, D]
//   q = q_norm(q), k = k_norm(k)            RMSNorm over D, per head, before RoPE
//   q, k rotated (rotate_half pairs (j, j + D/2), rope_theta, position of each token)
//   out = softmax(q k^T * D^-0.5, causal) v   query head h reads KV head h / (Hq / Hkv)
//   return o_proj(out [T, Hq * D])
//
// Qwen3.5 full-attention layers (transformers Qwen3_5MoeAttention, config.attention_output_gate):
// q_proj emits [T, Hq, 2D], per head [q (D) | gate (D)]; RoPE rotates only the first rotary_dim
// = int(D * partial_rotary_factor) dims of each head (rotate_half within them), and
//   out = out * sigmoid(gate [T, Hq * D])   before o_proj.
// The norms are (1 + w) RMSNorms there (config.norm_style).
//
// LoRA adds to the q/k/v/o projection outputs (before the norms), per token slot. The MoE and
// dense-MLP halves of the layer are shared with DeepSeek (model.cpp).
#include <cstring>

#include "model/architecture.h"
#include "ops/attention/attention.h"
#include "ops/linear/linear.h"
#include "ops/norm/norm.h"

namespace moelora::model::detail {

void check_qwen3_attention(const AttentionWeightsF32& w, const io::ModelConfig& config,
                           int64_t layer) {
  const int64_t hidden = config.hidden_size, heads = config.num_attention_heads,
                kv_heads = config.num_key_value_heads, head_dim = config.head_dim;
  const std::string where = "layer " + std::to_string(layer) + " self_attn.";
  for (const auto& [t, name] : {std::pair{&w.q_proj, "q_proj"}, std::pair{&w.k_proj, "k_proj"},
                                std::pair{&w.v_proj, "v_proj"}, std::pair{&w.o_proj, "o_proj"}}) {
    MOELORA_CHECK(t->defined(), ErrorCode::kInvalidArgument, where, name, " is missing");
  }
  const int64_t q_rows = heads * head_dim * (config.attention_output_gate ? 2 : 1);
  check_shape(w.q_proj, {q_rows, hidden}, where + "q_proj");
  check_shape(w.k_proj, {kv_heads * head_dim, hidden}, where + "k_proj");
  check_shape(w.v_proj, {kv_heads * head_dim, hidden}, where + "v_proj");
  check_shape(w.o_proj, {hidden, heads * head_dim}, where + "o_proj");
  if (config.qk_norm) {
    MOELORA_CHECK(w.q_norm.defined() && w.k_norm.defined(), ErrorCode::kInvalidArgument, where,
                  "q_norm / k_norm are missing");
  }
  if (w.q_norm.defined()) check_shape(w.q_norm, {head_dim}, where + "q_norm");
  if (w.k_norm.defined()) check_shape(w.k_norm, {head_dim}, where + "k_norm");
}

LayerCache make_qwen3_cache(const io::ModelConfig& config) {
  LayerCache cache;
  cache.gqa.emplace(config.num_key_value_heads, config.head_dim, config.head_dim);
  return cache;
}

Tensor qwen3_attention(const AttentionWeightsF32& w, const Tensor& h, const AttentionContext& ctx) {
  const io::ModelConfig& config = ctx.config;
  const int64_t tokens = h.dim(0), heads = config.num_attention_heads,
                kv_heads = config.num_key_value_heads, head_dim = config.head_dim;
  Tensor q, gate;
  if (config.attention_output_gate) {
    // [T, Hq, 2D] -> q [T, Hq, D] and gate [T, Hq * D]
    const Tensor qg = project(h, w.q_proj, ctx, &io::LayerLora::q_proj);
    q = Tensor::empty(DType::kF32, {tokens, heads, head_dim});
    gate = Tensor::empty(DType::kF32, {tokens, heads * head_dim});
    const float* src = qg.data<float>();
    for (int64_t r = 0; r < tokens * heads; ++r) {
      std::memcpy(q.data<float>() + r * head_dim, src + 2 * r * head_dim, head_dim * sizeof(float));
      std::memcpy(gate.data<float>() + r * head_dim, src + (2 * r + 1) * head_dim,
                  head_dim * sizeof(float));
    }
  } else {
    q = project(h, w.q_proj, ctx, &io::LayerLora::q_proj).reshape({tokens, heads, head_dim});
  }
  Tensor k =
      project(h, w.k_proj, ctx, &io::LayerLora::k_proj).reshape({tokens, kv_heads, head_dim});
  Tensor v =
      project(h, w.v_proj, ctx, &io::LayerLora::v_proj).reshape({tokens, kv_heads, head_dim});

  const ops::RmsNormParams norm{config.rms_norm_eps, config.norm_style};
  if (w.q_norm.defined()) ops::rms_norm_inplace_ref(q, w.q_norm, norm);
  if (w.k_norm.defined()) ops::rms_norm_inplace_ref(k, w.k_norm, norm);
  const ops::RopeApplyParams rope{config.rope_style, 0};
  ops::apply_rope_inplace_ref(q, ctx.positions, ctx.rope, rope);
  ops::apply_rope_inplace_ref(k, ctx.positions, ctx.rope, rope);

  Tensor out = Tensor::empty(DType::kF32, {tokens, heads, head_dim});
  const ops::AttentionParams params{ctx.scale};
  for (const Segment& seg : ctx.segments) {
    ops::KvCacheRef& cache = *seg.cache->gqa;
    cache.append(k.slice0(seg.begin, seg.begin + seg.count),
                 v.slice0(seg.begin, seg.begin + seg.count));
    const Tensor o = ops::attention_ref(q.slice0(seg.begin, seg.begin + seg.count), cache, params);
    std::memcpy(out.data<float>() + seg.begin * heads * head_dim, o.data<float>(), o.nbytes());
  }
  if (gate.defined()) {
    float* o = out.data<float>();
    const float* g = gate.data<float>();
    for (int64_t i = 0; i < tokens * heads * head_dim; ++i) o[i] *= ops::sigmoid_f32(g[i]);
  }
  return project(out.reshape({tokens, heads * head_dim}), w.o_proj, ctx, &io::LayerLora::o_proj);
}

}  // namespace moelora::model::detail
