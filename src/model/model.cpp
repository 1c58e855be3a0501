// The generic model loop shared by all architectures (see model.h): construction and checks,
// the batch layout (ids, slots, positions, per-sequence segments), the residual stream, the
// dense / MoE halves of every layer and the output head. The attention blocks live in
// qwen3_moe.cpp (GQA, also Qwen3.5's gated attention), deepseek_v3.cpp (MLA) and gated_deltanet.cpp
// (Qwen3.5 linear attention).
#include "model/model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <set>
#include <utility>

#include "model/architecture.h"
#include "ops/embedding/embedding.h"
#include "ops/linear/linear.h"
#include "ops/lora/lora.h"
#include "ops/mla/mla.h"
#include "ops/moe/moe.h"
#include "ops/norm/norm.h"

namespace moelora::model {

namespace {

std::atomic<uint64_t> next_model_id{1};

void add_inplace(Tensor& x, const Tensor& y) {
  MOELORA_ASSERT(x.numel() == y.numel());
  float* xp = x.data<float>();
  const float* yp = y.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] += yp[i];
}

void check_layer(const LayerWeightsF32& layer, const io::ModelConfig& config, int64_t l) {
  const int64_t hidden = config.hidden_size;
  const std::string where = "layer " + std::to_string(l) + " ";
  auto require = [&](const Tensor& t, const Shape& shape, const std::string& name) {
    MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, where, name, " is missing");
    check_shape(t, shape, where + name);
  };
  require(layer.input_layernorm, {hidden}, "input_layernorm");
  require(layer.post_attention_layernorm, {hidden}, "post_attention_layernorm");
  const bool linear = static_cast<size_t>(l) < config.layer_types.size() &&
                      config.layer_types[l] == "linear_attention";
  MOELORA_CHECK(linear == layer.is_linear_attention, ErrorCode::kInvalidArgument, where,
                "the config declares a ", linear ? "linear_attention" : "full-attention",
                " layer but the weights are those of a ",
                layer.is_linear_attention ? "linear-attention" : "full-attention", " layer");
  if (linear) {
    detail::check_linear_attention(layer.linear_attn, config, l);
  } else if (config.use_mla) {
    detail::check_mla_attention(layer.attention, config, l);
  } else {
    detail::check_qwen3_attention(layer.attention, config, l);
  }
  if (!layer.is_moe) {
    MOELORA_CHECK(layer.mlp_gate.defined() && layer.mlp_up.defined() && layer.mlp_down.defined(),
                  ErrorCode::kInvalidArgument, where, "dense MLP gate/up/down weights are missing");
    const int64_t inter = layer.mlp_gate.dim(0);
    require(layer.mlp_gate, {inter, hidden}, "mlp.gate_proj");
    require(layer.mlp_up, {inter, hidden}, "mlp.up_proj");
    require(layer.mlp_down, {hidden, inter}, "mlp.down_proj");
    return;
  }
  const ops::MoeWeightsRef& moe = layer.moe;
  MOELORA_CHECK(moe.w13.defined() && moe.w2.defined(), ErrorCode::kInvalidArgument, where,
                "expert weights are missing");
  const int64_t experts = moe.w13.dim(0), inter = moe.w13.dim(1) / 2;
  require(moe.router, {experts, hidden}, "mlp.gate (router)");
  check_shape(moe.w13, {experts, 2 * inter, hidden}, where + "experts W13");
  check_shape(moe.w2, {experts, hidden, inter}, where + "experts W2");
  if (moe.correction_bias.defined())
    check_shape(moe.correction_bias, {experts}, where + "e_score_correction_bias");
  MOELORA_CHECK(config.router != RouterKind::kSigmoidNoauxTc || moe.correction_bias.defined(),
                ErrorCode::kInvalidArgument, where,
                "mlp.gate.e_score_correction_bias is missing (noaux_tc router)");
  if (moe.shared_w13.defined()) {
    MOELORA_CHECK(moe.shared_w2.defined(), ErrorCode::kInvalidArgument, where,
                  "shared expert down_proj is missing");
    const int64_t shared_inter = moe.shared_w13.dim(0) / 2;
    check_shape(moe.shared_w2, {hidden, shared_inter}, where + "shared expert down_proj");
  }
  if (moe.shared_gate.defined())
    check_shape(moe.shared_gate, {1, hidden}, where + "shared_expert_gate");
  ops::check_route_params(moe_params(config, layer).route);
}

}  // namespace

ops::MoeParams moe_params(const io::ModelConfig& config, const LayerWeightsF32& layer) {
  ops::MoeParams params;
  params.hidden = config.hidden_size;
  params.intermediate = layer.moe.w13.dim(1) / 2;
  params.route.kind = config.router;
  params.route.num_experts = layer.moe.w13.dim(0);
  params.route.top_k = config.num_experts_per_tok;
  params.route.renormalize = config.norm_topk_prob;
  params.route.n_group = config.n_group;
  params.route.topk_group = config.topk_group;
  params.route.routed_scaling_factor = static_cast<float>(config.routed_scaling_factor);
  return params;
}

ops::RopeParams rope_params(const io::ModelConfig& config) {
  ops::RopeParams p;
  p.type = ops::rope_type_from_name(config.rope.type);
  p.theta = config.rope.theta;
  p.rotary_dim = config.rotary_dim();
  p.factor = config.rope.factor;
  p.original_max_position_embeddings = config.rope.original_max_position_embeddings;
  p.max_position_embeddings = config.max_position_embeddings;
  p.beta_fast = config.rope.beta_fast;
  p.beta_slow = config.rope.beta_slow;
  p.mscale = config.rope.mscale;
  p.mscale_all_dim = config.rope.mscale_all_dim;
  p.attention_factor = config.rope.attention_factor;
  p.truncate = config.rope.truncate;
  return p;
}

ops::GdnShape linear_attention_shape(const io::ModelConfig& config) {
  const io::LinearAttentionConfig& la = config.linear_attention;
  ops::GdnShape s;
  s.hidden = config.hidden_size;
  s.num_k_heads = la.num_key_heads;
  s.num_v_heads = la.num_value_heads;
  s.head_k_dim = la.key_head_dim;
  s.head_v_dim = la.value_head_dim;
  s.conv_kernel = la.conv_kernel_dim;
  s.norm_eps = config.rms_norm_eps;
  return s;
}

namespace detail {

Tensor project(const Tensor& x, const Tensor& w, const AttentionContext& ctx,
               LoraTargetMember target) {
  Tensor y = ops::linear_ref(x, w);
  if (ctx.adapters.any(ctx.layer, target) &&
      std::any_of(ctx.slot.begin(), ctx.slot.end(), [](int32_t s) { return s >= 0; })) {
    ops::lora_add_slots_ref(x, ctx.slot, ctx.adapters.target(ctx.layer, target), y);
  }
  return y;
}

}  // namespace detail

Model Model::load(const std::filesystem::path& dir, const ModelOptions& options) {
  io::LoadOptions load;
  load.show_progress = options.show_progress;
  load.max_layers = options.max_layers;
  const io::ModelWeights weights = io::load_checkpoint(dir, load);
  return Model(weights, options);
}

Model::Model(const io::ModelWeights& weights, const ModelOptions& options)
    : config_(weights.config), dir_(weights.dir), id_(next_model_id++) {
  const std::string source = weights.dir.empty() ? std::string("model") : weights.dir.string();
  MOELORA_CHECK(config_.arch != io::Architecture::kDeepseekV3 || config_.use_mla,
                ErrorCode::kUnsupported, source,
                ": DeepSeek-V3 models without MLA are not supported");

  weights_ =
      std::make_shared<const ModelWeightsF32>(convert_weights(weights, options.show_progress));
  const ModelWeightsF32& w = *weights_;
  const int64_t vocab = config_.vocab_size, hidden = config_.hidden_size;
  MOELORA_CHECK(static_cast<int64_t>(w.layers.size()) == config_.num_hidden_layers,
                ErrorCode::kInvalidArgument, source, ": the checkpoint loaded ", w.layers.size(),
                " layers but the config has ", config_.num_hidden_layers);
  MOELORA_CHECK(w.embed_tokens.defined() && w.lm_head.defined() && w.final_norm.defined(),
                ErrorCode::kInvalidArgument, source,
                ": embed_tokens, lm_head or the final norm is missing");
  check_shape(w.embed_tokens, {vocab, hidden}, source + " embed_tokens");
  check_shape(w.lm_head, {vocab, hidden}, source + " lm_head");
  check_shape(w.final_norm, {hidden}, source + " norm");
  for (int64_t l = 0; l < num_layers(); ++l) check_layer(w.layers[l], config_, l);

  const ops::RopeParams rope = rope_params(config_);
  rope_ = ops::make_rope_table(rope);
  attention_scale_ =
      config_.use_mla ? static_cast<float>(ops::mla_softmax_scale(config_.qk_head_dim(), rope))
                      : static_cast<float>(1.0 / std::sqrt(static_cast<double>(config_.head_dim)));
  adapters_ = AdapterSet(weights_, config_);
}

int32_t Model::load_adapter(const std::string& name, const std::filesystem::path& dir) {
  return adapters_.load(name, dir);
}

Sequence Model::new_sequence(int32_t slot) const {
  MOELORA_CHECK(slot >= -1 && slot < adapters_.size(), ErrorCode::kOutOfRange, "adapter slot ",
                slot, " is not loaded; valid: -1 (base) or [0, ", adapters_.size(), ")");
  Sequence seq;
  seq.model_id_ = id_;
  seq.slot_ = slot;
  seq.layers_.reserve(static_cast<size_t>(num_layers()));
  for (int64_t l = 0; l < num_layers(); ++l) {
    seq.layers_.push_back(weights_->layers[l].is_linear_attention
                              ? detail::make_linear_attention_cache(config_)
                          : config_.use_mla ? detail::make_mla_cache(config_)
                                            : detail::make_qwen3_cache(config_));
  }
  return seq;
}

Sequence Model::new_sequence(const std::string& adapter_name) const {
  return new_sequence(adapter_name.empty() ? -1 : adapters_.slot_of(adapter_name));
}

Tensor Model::forward(Sequence& sequence, std::span<const int32_t> tokens,
                      const ForwardOptions& options) {
  const SequenceInput input{&sequence, tokens};
  return forward(std::span<const SequenceInput>(&input, 1), options).front();
}

std::vector<Tensor> Model::forward(std::span<const SequenceInput> batch,
                                   const ForwardOptions& options) {
  const ModelWeightsF32& w = *weights_;
  const int64_t vocab = config_.vocab_size, hidden = config_.hidden_size;

  // ---- validate everything before any cache changes ----
  MOELORA_CHECK(!batch.empty(), ErrorCode::kInvalidArgument, "forward: the batch is empty");
  std::set<const Sequence*> seen;
  int64_t total = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Sequence* seq = batch[i].sequence;
    MOELORA_CHECK(seq != nullptr, ErrorCode::kInvalidArgument, "forward: sequence ", i, " is null");
    MOELORA_CHECK(
        seq->model_id_ == id_ && static_cast<int64_t>(seq->layers_.size()) == num_layers(),
        ErrorCode::kInvalidArgument, "forward: sequence ", i,
        " was not made by this model (use Model::new_sequence)");
    MOELORA_CHECK(seen.insert(seq).second, ErrorCode::kInvalidArgument, "forward: sequence ", i,
                  " appears twice in the batch");
    MOELORA_CHECK(!batch[i].tokens.empty(), ErrorCode::kInvalidArgument, "forward: sequence ", i,
                  " has no new tokens");
    MOELORA_CHECK(seq->slot_ >= -1 && seq->slot_ < adapters_.size(), ErrorCode::kOutOfRange,
                  "forward: sequence ", i, " uses adapter slot ", seq->slot_,
                  ", which is not loaded");
    for (size_t t = 0; t < batch[i].tokens.size(); ++t) {
      const int32_t id = batch[i].tokens[t];
      MOELORA_CHECK(id >= 0 && id<vocab, ErrorCode::kOutOfRange, "token id ", id, " at position ",
                                  t, batch.size()> 1
                        ? " of sequence " + std::to_string(i)
                        : std::string(),
                    " is outside the vocabulary [0, ", vocab, ")");
    }
    total += static_cast<int64_t>(batch[i].tokens.size());
  }

  // ---- batch layout: tokens of sequence 0, then sequence 1, ... ----
  std::vector<int32_t> ids, slot;
  std::vector<int64_t> positions;
  std::vector<detail::Segment> segments;
  ids.reserve(total);
  slot.reserve(total);
  positions.reserve(total);
  for (const SequenceInput& in : batch) {
    segments.push_back(
        {static_cast<int64_t>(ids.size()), static_cast<int64_t>(in.tokens.size()), nullptr});
    for (size_t t = 0; t < in.tokens.size(); ++t) {
      ids.push_back(in.tokens[t]);
      slot.push_back(in.sequence->slot_);
      positions.push_back(in.sequence->length() + static_cast<int64_t>(t));
    }
  }

  if (options.trace) *options.trace = ForwardTrace();
  const ops::RmsNormParams norm{config_.rms_norm_eps, config_.norm_style};
  Tensor x;
  try {
    x = ops::embedding_ref(w.embed_tokens, std::span<const int32_t>(ids));  // [T, H]
    if (options.trace) options.trace->hidden.push_back(x.clone());
    for (int64_t l = 0; l < num_layers(); ++l) {
      const LayerWeightsF32& layer = w.layers[l];
      for (size_t i = 0; i < batch.size(); ++i) segments[i].cache = &batch[i].sequence->layers_[l];
      const detail::AttentionContext ctx{config_, rope_, attention_scale_, adapters_,
                                         l,       slot,  positions,        segments};

      Tensor h = ops::rms_norm_ref(x, layer.input_layernorm, norm);
      add_inplace(x, layer.is_linear_attention ? detail::linear_attention(layer.linear_attn, h, ctx)
                     : config_.use_mla         ? detail::mla_attention(layer.attention, h, ctx)
                                               : detail::qwen3_attention(layer.attention, h, ctx));

      h = ops::rms_norm_ref(x, layer.post_attention_layernorm, norm);
      if (layer.is_moe) {
        ops::MoeTrace moe_trace;
        Tensor forced;
        if (options.forced_routes) {
          const auto it = options.forced_routes->find(l);
          if (it != options.forced_routes->end()) forced = it->second;
        }
        add_inplace(x, ops::moe_forward_ref(
                           h, slot, layer.moe, adapters_.moe(l), moe_params(config_, layer),
                           options.trace ? &moe_trace : nullptr, Tensor(), forced));
        if (options.trace) options.trace->routes[l] = moe_trace.route;
      } else {
        add_inplace(x, ops::mlp_forward_ref(h, slot, layer.mlp_gate, layer.mlp_up, layer.mlp_down,
                                            adapters_.dense_mlp(l)));
      }
      if (options.trace && l + 1 < num_layers()) options.trace->hidden.push_back(x.clone());
    }
  } catch (...) {
    // Leave every sequence as it was: drop whatever the failed pass appended.
    for (const SequenceInput& in : batch) {
      for (LayerCache& cache : in.sequence->layers_) cache.truncate(in.sequence->length());
    }
    throw;
  }
  for (const SequenceInput& in : batch) {
    in.sequence->tokens_.insert(in.sequence->tokens_.end(), in.tokens.begin(), in.tokens.end());
    for (LayerCache& cache : in.sequence->layers_) cache.commit();
  }

  // ---- output head ----
  ops::rms_norm_inplace_ref(x, w.final_norm, norm);
  if (options.trace) options.trace->hidden.push_back(x.clone());
  std::vector<Tensor> logits;
  if (options.all_logits) {
    const Tensor all = ops::linear_ref(x, w.lm_head);  // [T, V]
    for (const detail::Segment& seg : segments)
      logits.push_back(all.slice0(seg.begin, seg.begin + seg.count));
  } else {
    Tensor last = Tensor::empty(DType::kF32, {static_cast<int64_t>(segments.size()), hidden});
    for (size_t i = 0; i < segments.size(); ++i) {
      const int64_t row = segments[i].begin + segments[i].count - 1;
      std::copy_n(x.data<float>() + row * hidden, hidden,
                  last.data<float>() + static_cast<int64_t>(i) * hidden);
    }
    const Tensor all = ops::linear_ref(last, w.lm_head);  // [B, V]
    for (size_t i = 0; i < segments.size(); ++i) {
      logits.push_back(all.slice0(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1));
    }
  }
  return logits;
}

}  // namespace moelora::model
