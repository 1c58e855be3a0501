// Qwen3.5 Gated DeltaNet ("linear_attention" layers, transformers Qwen3_5MoeGatedDeltaNet), fp32:
//
//   qkv = in_proj_qkv(h) [T, 2 key_dim + value_dim];  z = in_proj_z(h) [T, value_dim]
//   b = in_proj_b(h) [T, nv];  a = in_proj_a(h) [T, nv]
//   per sequence: conv + SiLU over its tokens (rolling conv state), L2-normalised q / k, the gated
//   delta rule against its recurrent state, gated RMSNorm with z   -> [T, value_dim]
//   return out_proj(...)
//
// The projections run over the whole batch with their LoRA deltas per token slot (PEFT adapts
// in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj as plain linears); only the mixing
// part runs per sequence (ops::gdn_mix_ref). As in transformers, a sequence's step of one token
// uses the recurrent form and longer segments the chunked form (equal up to fp32 rounding).
#include <cstring>

#include "model/architecture.h"
#include "model/model.h"

namespace moelora::model::detail {

void check_linear_attention(const LinearAttentionWeightsF32& w, const io::ModelConfig& config,
                            int64_t layer) {
  const ops::GdnShape s = linear_attention_shape(config);
  const std::string where = "layer " + std::to_string(layer) + " linear_attn.";
  MOELORA_CHECK(s.num_k_heads > 0 && s.num_v_heads > 0 && s.head_k_dim > 0 && s.head_v_dim > 0 &&
                    s.conv_kernel >= 1 && s.num_v_heads % s.num_k_heads == 0,
                ErrorCode::kInvalidArgument, where, " sizes from the config: linear_num_key_heads ",
                s.num_k_heads, ", linear_num_value_heads ", s.num_v_heads,
                " (a multiple of it), dk ", s.head_k_dim, ", dv ", s.head_v_dim, ", conv kernel ",
                s.conv_kernel);
  const int64_t H = s.hidden, nv = s.num_v_heads, vd = s.value_dim();
  for (const auto& [t, name] :
       {std::pair{&w.in_proj_qkv, "in_proj_qkv"}, std::pair{&w.in_proj_z, "in_proj_z"},
        std::pair{&w.in_proj_b, "in_proj_b"}, std::pair{&w.in_proj_a, "in_proj_a"},
        std::pair{&w.conv1d, "conv1d"}, std::pair{&w.a_log, "A_log"},
        std::pair{&w.dt_bias, "dt_bias"}, std::pair{&w.norm, "norm"},
        std::pair{&w.out_proj, "out_proj"}}) {
    MOELORA_CHECK(t->defined(), ErrorCode::kInvalidArgument, where, name, " is missing");
  }
  check_shape(w.in_proj_qkv, {s.conv_dim(), H}, where + "in_proj_qkv");
  check_shape(w.in_proj_z, {vd, H}, where + "in_proj_z");
  check_shape(w.in_proj_b, {nv, H}, where + "in_proj_b");
  check_shape(w.in_proj_a, {nv, H}, where + "in_proj_a");
  check_shape(w.conv1d, {s.conv_dim(), s.conv_kernel}, where + "conv1d");
  check_shape(w.a_log, {nv}, where + "A_log");
  check_shape(w.dt_bias, {nv}, where + "dt_bias");
  check_shape(w.norm, {s.head_v_dim}, where + "norm");
  check_shape(w.out_proj, {H, vd}, where + "out_proj");
}

LayerCache make_linear_attention_cache(const io::ModelConfig& config) {
  LayerCache cache;
  cache.gdn.emplace();
  cache.gdn->state = ops::GdnState::zeros(linear_attention_shape(config));
  return cache;
}

Tensor linear_attention(const LinearAttentionWeightsF32& w, const Tensor& h,
                        const AttentionContext& ctx) {
  const ops::GdnShape shape = linear_attention_shape(ctx.config);
  const int64_t tokens = h.dim(0), vd = shape.value_dim();
  const Tensor qkv = project(h, w.in_proj_qkv, ctx, &io::LayerLora::in_proj_qkv);  // [T, conv_dim]
  const Tensor z = project(h, w.in_proj_z, ctx, &io::LayerLora::in_proj_z);        // [T, vd]
  const Tensor b = project(h, w.in_proj_b, ctx, &io::LayerLora::in_proj_b);        // [T, nv]
  const Tensor a = project(h, w.in_proj_a, ctx, &io::LayerLora::in_proj_a);        // [T, nv]
  ops::GdnWeights mix;  // the non-projection weights gdn_mix_ref reads
  mix.conv1d = w.conv1d;
  mix.a_log = w.a_log;
  mix.dt_bias = w.dt_bias;
  mix.norm = w.norm;

  Tensor out = Tensor::empty(DType::kF32, {tokens, vd});
  for (const Segment& seg : ctx.segments) {
    GdnLayerCache& cache = *seg.cache->gdn;
    cache.begin_update();
    const int64_t lo = seg.begin, hi = seg.begin + seg.count;
    const Tensor o =
        ops::gdn_mix_ref(qkv.slice0(lo, hi), z.slice0(lo, hi), b.slice0(lo, hi), a.slice0(lo, hi),
                         mix, shape, cache.state, /*chunked=*/seg.count > 1);
    cache.tokens += seg.count;
    std::memcpy(out.data<float>() + lo * vd, o.data<float>(), o.nbytes());
  }
  return project(out, w.out_proj, ctx, &io::LayerLora::out_proj);
}

}  // namespace moelora::model::detail
