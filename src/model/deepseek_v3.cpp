// DeepSeek-V3 / Kimi-K2 multi-head latent attention (transformers DeepseekV3Attention), fp32.
// Sizes: n heads, nope = qk_nope_head_dim, rope = qk_rope_head_dim, dv = v_head_dim,
// r = kv_lora_rank.
//
//   q = q_b_proj(q_a_layernorm(q_a_proj(h)))   (q_lora_rank > 0)   or   q = q_proj(h)
//       viewed [T, n, nope + rope] = per head [q_nope | q_rope]
//   [c_kv | k_rope] = kv_a_proj_with_mqa(h)   [T, r + rope]
//   [k_nope | v] = kv_b_proj(kv_a_layernorm(c_kv)) viewed [T, n, nope + dv]
//   q_rope and k_rope (one head, shared by all heads) rotated: interleaved pairs (2j, 2j + 1)
//       when rope_interleave (YaRN frequencies, cos/sin times the YaRN attention factor)
//   out = softmax([q_nope | q_rope] . [k_nope | k_rope] * scale, causal) v     (ops::mla)
//       scale = qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2
//   return o_proj(out [T, n * dv])
//
// LoRA adds to every projection output (q_proj or q_a / q_b, kv_a_proj_with_mqa, kv_b_proj,
// o_proj), per token slot. The cache keeps k_nope, v and the rotated k_rope of every position
// (kv_cache.h explains why not the latent).
#include <cstring>

#include "model/architecture.h"
#include "ops/mla/mla.h"
#include "ops/norm/norm.h"

namespace moelora::model::detail {

void check_mla_attention(const AttentionWeightsF32& w, const io::ModelConfig& config, int64_t layer) {
  const int64_t hidden = config.hidden_size, heads = config.num_attention_heads,
                nope = config.qk_nope_head_dim, rope = config.qk_rope_head_dim, dv = config.v_head_dim,
                rank = config.kv_lora_rank, q_rank = config.q_lora_rank;
  const std::string where = "layer " + std::to_string(layer) + " self_attn.";
  auto require = [&](const Tensor& t, const Shape& shape, const char* name) {
    MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, where, name, " is missing");
    check_shape(t, shape, where + name);
  };
  if (q_rank > 0) {
    require(w.q_a_proj, {q_rank, hidden}, "q_a_proj");
    require(w.q_a_layernorm, {q_rank}, "q_a_layernorm");
    require(w.q_b_proj, {heads * (nope + rope), q_rank}, "q_b_proj");
  } else {
    require(w.q_proj, {heads * (nope + rope), hidden}, "q_proj");
  }
  require(w.kv_a_proj_with_mqa, {rank + rope, hidden}, "kv_a_proj_with_mqa");
  require(w.kv_a_layernorm, {rank}, "kv_a_layernorm");
  require(w.kv_b_proj, {heads * (nope + dv), rank}, "kv_b_proj");
  require(w.o_proj, {hidden, heads * dv}, "o_proj");
}

LayerCache make_mla_cache(const io::ModelConfig& config) {
  LayerCache cache;
  cache.mla.k_nope = RowBuffer(config.num_attention_heads * config.qk_nope_head_dim);
  cache.mla.k_rope = RowBuffer(config.qk_rope_head_dim);
  cache.mla.v = RowBuffer(config.num_attention_heads * config.v_head_dim);
  return cache;
}

Tensor mla_attention(const AttentionWeightsF32& w, const Tensor& h, const AttentionContext& ctx) {
  const io::ModelConfig& config = ctx.config;
  const int64_t tokens = h.dim(0), heads = config.num_attention_heads, nope = config.qk_nope_head_dim,
                rope = config.qk_rope_head_dim, dv = config.v_head_dim, rank = config.kv_lora_rank;
  const ops::RmsNormParams norm{config.rms_norm_eps, config.norm_style};

  // ---- query [T, n, nope + rope] ----
  Tensor q;
  if (config.q_lora_rank > 0) {
    Tensor q_latent = project(h, w.q_a_proj, ctx, &io::LayerLora::q_a_proj);  // [T, q_lora_rank]
    ops::rms_norm_inplace_ref(q_latent, w.q_a_layernorm, norm);
    q = project(q_latent, w.q_b_proj, ctx, &io::LayerLora::q_b_proj);
  } else {
    q = project(h, w.q_proj, ctx, &io::LayerLora::q_proj);
  }
  q = q.reshape({tokens, heads, nope + rope});

  // ---- keys and values ----
  const Tensor kv_a =
      project(h, w.kv_a_proj_with_mqa, ctx, &io::LayerLora::kv_a_proj_with_mqa);  // [T, r + rope]
  Tensor c_kv = Tensor::empty(DType::kF32, {tokens, rank});
  Tensor k_rope = Tensor::empty(DType::kF32, {tokens, rope});
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = kv_a.data<float>() + t * (rank + rope);
    std::memcpy(c_kv.data<float>() + t * rank, row, sizeof(float) * rank);
    std::memcpy(k_rope.data<float>() + t * rope, row + rank, sizeof(float) * rope);
  }
  ops::rms_norm_inplace_ref(c_kv, w.kv_a_layernorm, norm);
  const Tensor kv = project(c_kv, w.kv_b_proj, ctx, &io::LayerLora::kv_b_proj);  // [T, n * (nope + dv)]
  Tensor k_nope = Tensor::empty(DType::kF32, {tokens, heads * nope});
  Tensor v = Tensor::empty(DType::kF32, {tokens, heads * dv});
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t hd = 0; hd < heads; ++hd) {
      const float* src = kv.data<float>() + (t * heads + hd) * (nope + dv);
      std::memcpy(k_nope.data<float>() + (t * heads + hd) * nope, src, sizeof(float) * nope);
      std::memcpy(v.data<float>() + (t * heads + hd) * dv, src + nope, sizeof(float) * dv);
    }
  }

  // ---- RoPE on q_rope (dims [nope, nope + rope) of each head) and the shared k_rope ----
  ops::apply_rope_inplace_ref(q, ctx.positions, ctx.rope, {config.rope_style, nope});
  ops::apply_rope_inplace_ref(k_rope, ctx.positions, ctx.rope, {config.rope_style, 0});

  // ---- attention per sequence against its cache ----
  ops::MlaAttentionParams params;
  params.dims = {heads, nope, rope, dv, rank};
  params.softmax_scale = ctx.scale;
  Tensor out = Tensor::empty(DType::kF32, {tokens, heads, dv});
  for (const Segment& seg : ctx.segments) {
    MlaLayerCache& cache = seg.cache->mla;
    cache.k_nope.append(k_nope.data<float>() + seg.begin * heads * nope, seg.count, heads * nope);
    cache.k_rope.append(k_rope.data<float>() + seg.begin * rope, seg.count, rope);
    cache.v.append(v.data<float>() + seg.begin * heads * dv, seg.count, heads * dv);
    const int64_t cached = cache.k_rope.rows();
    const Tensor o = ops::mla_attention_ref(
        q.slice0(seg.begin, seg.begin + seg.count), cache.k_nope.view({cached, heads, nope}),
        cache.k_rope.view({cached, rope}), cache.v.view({cached, heads, dv}), params);
    std::memcpy(out.data<float>() + seg.begin * heads * dv, o.data<float>(), o.nbytes());
  }
  return project(out.reshape({tokens, heads * dv}), w.o_proj, ctx, &io::LayerLora::o_proj);
}

}  // namespace moelora::model::detail
