// A model's share on one rank and its sharded prefill (sharded_model.h).
#include "dist/sharded_model.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/embedding/embedding.h"
#include "ops/linear/linear.h"
#include "ops/norm/norm.h"

namespace moelora::dist {

namespace {

void add_inplace(Tensor& x, const Tensor& y) {
  float* xp = x.data<float>();
  const float* yp = y.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] += yp[i];
}

LoraFactors owned(const LoraFactors* f) {
  return f != nullptr && f->defined() ? *f : LoraFactors{};
}

}  // namespace

ShardedModel::ShardedModel(const model::Model& model, ShardSpec shard, const ShardedModelOptions& options)
    : model_(model), shard_(shard), options_(options) {
  const io::ModelConfig& config = model.config();
  norm_ = {config.rms_norm_eps, config.norm_style};
  const model::ModelWeightsF32& w = model.weights();
  const model::AdapterSet& adapters = model.adapters();
  const ops::RopeParams rope_params = model::rope_params(config);
  const ops::RopeTable rope = ops::make_rope_table(rope_params);
  const bool data_parallel = options.attention == AttentionSplit::kDataParallel;
  const ShardSpec heads = data_parallel ? ShardSpec{0, 1} : shard;
  if (data_parallel) solo_ = std::make_unique<InProcessGroup>(1);
  for (int64_t l = 0; l < model.num_layers(); ++l) {
    const model::LayerWeightsF32& src = w.layers[static_cast<size_t>(l)];
    Layer layer;
    layer.input_layernorm = src.input_layernorm;
    layer.post_attention_layernorm = src.post_attention_layernorm;

    if (src.is_linear_attention)
      shard_gdn_layer(layer, src.linear_attn, l, heads);
    else if (config.use_mla)
      shard_mla_layer(layer, src.attention, l, rope, rope_params, heads);
    else
      shard_gqa_layer(layer, src.attention, l, rope, heads);

    layer.is_moe = src.is_moe;
    if (src.is_moe) {
      const ops::MoeParams params = model::moe_params(config, src);
      layer.moe = shard_moe(src.moe, params, shard, options.shared_expert);
      for (const ops::MoeLoraRef& r : adapters.moe(l))
        layer.moe_lora.push_back(shard_moe_lora(r, params, shard, options.shared_expert));
    } else {
      layer.mlp = shard_mlp(src.mlp_gate, src.mlp_up, src.mlp_down, shard);
      for (const ops::MlpLoraRef& r : adapters.dense_mlp(l)) layer.mlp_lora.push_back(shard_mlp_lora(r, shard));
    }
    layers_.push_back(std::move(layer));
  }
  lm_head_ = shard_dim(w.lm_head, 0, shard, "lm_head");
}

void ShardedModel::shard_gqa_layer(Layer& layer, const model::AttentionWeightsF32& src, int64_t l,
                                   const ops::RopeTable& rope, ShardSpec heads) {
  const io::ModelConfig& config = model_.config();
  const model::AdapterSet& adapters = model_.adapters();
  GqaWeights attention;
  attention.num_heads = config.num_attention_heads;
  attention.num_kv_heads = config.num_key_value_heads;
  attention.head_dim = config.head_dim;
  attention.output_gate = config.attention_output_gate;
  attention.q_proj = src.q_proj;
  attention.k_proj = src.k_proj;
  attention.v_proj = src.v_proj;
  attention.o_proj = src.o_proj;
  attention.q_norm = src.q_norm;
  attention.k_norm = src.k_norm;
  attention.norm = norm_;
  attention.rope = rope;
  attention.rope_apply = {config.rope_style, 0};
  layer.attention = shard_gqa(attention, heads);
  const auto q = adapters.target(l, &io::LayerLora::q_proj), k = adapters.target(l, &io::LayerLora::k_proj),
             v = adapters.target(l, &io::LayerLora::v_proj), o = adapters.target(l, &io::LayerLora::o_proj);
  for (int32_t s = 0; s < adapters.size(); ++s) {
    const GqaLora full{owned(q[s]), owned(k[s]), owned(v[s]), owned(o[s])};
    layer.attention_lora.push_back(shard_gqa_lora(full, attention, heads));
  }
}

void ShardedModel::shard_mla_layer(Layer& layer, const model::AttentionWeightsF32& src, int64_t l,
                                   const ops::RopeTable& rope, const ops::RopeParams& rope_params,
                                   ShardSpec heads) {
  const io::ModelConfig& config = model_.config();
  const model::AdapterSet& adapters = model_.adapters();
  MlaWeights mla;
  mla.dims = {config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
              config.v_head_dim, config.kv_lora_rank};
  mla.q_lora_rank = config.q_lora_rank;
  mla.q_a_proj = src.q_a_proj;
  mla.q_a_layernorm = src.q_a_layernorm;
  mla.q_b_proj = src.q_b_proj;
  mla.q_proj = src.q_proj;
  mla.kv_a_proj_with_mqa = src.kv_a_proj_with_mqa;
  mla.kv_a_layernorm = src.kv_a_layernorm;
  mla.kv_b_proj = src.kv_b_proj;
  mla.o_proj = src.o_proj;
  mla.norm = norm_;
  mla.rope = rope;
  mla.rope_style = config.rope_style;
  mla.scale = static_cast<float>(ops::mla_softmax_scale(config.qk_head_dim(), rope_params));
  layer.mla = shard_mla(mla, heads);
  const auto q = adapters.target(l, &io::LayerLora::q_proj),
             q_a = adapters.target(l, &io::LayerLora::q_a_proj),
             q_b = adapters.target(l, &io::LayerLora::q_b_proj),
             kv_a = adapters.target(l, &io::LayerLora::kv_a_proj_with_mqa),
             kv_b = adapters.target(l, &io::LayerLora::kv_b_proj),
             o = adapters.target(l, &io::LayerLora::o_proj);
  for (int32_t s = 0; s < adapters.size(); ++s) {
    const MlaLora full{owned(q[s]),    owned(q_a[s]),  owned(q_b[s]),
                       owned(kv_a[s]), owned(kv_b[s]), owned(o[s])};
    layer.mla_lora.push_back(shard_mla_lora(full, mla, heads));
  }
}

void ShardedModel::shard_gdn_layer(Layer& layer, const model::LinearAttentionWeightsF32& src,
                                   int64_t l, ShardSpec heads) {
  const model::AdapterSet& adapters = model_.adapters();
  GdnLayer gdn;
  gdn.shape = model::linear_attention_shape(model_.config());
  gdn.weights.in_proj_qkv = src.in_proj_qkv;
  gdn.weights.in_proj_z = src.in_proj_z;
  gdn.weights.in_proj_b = src.in_proj_b;
  gdn.weights.in_proj_a = src.in_proj_a;
  gdn.weights.conv1d = src.conv1d;
  gdn.weights.a_log = src.a_log;
  gdn.weights.dt_bias = src.dt_bias;
  gdn.weights.norm = src.norm;
  gdn.weights.out_proj = src.out_proj;
  layer.is_linear_attention = true;
  layer.gdn = shard_gdn(gdn, heads);
  const auto qkv = adapters.target(l, &io::LayerLora::in_proj_qkv),
             z = adapters.target(l, &io::LayerLora::in_proj_z),
             b = adapters.target(l, &io::LayerLora::in_proj_b),
             a = adapters.target(l, &io::LayerLora::in_proj_a),
             out = adapters.target(l, &io::LayerLora::out_proj);
  for (int32_t s = 0; s < adapters.size(); ++s) {
    const GdnLora full{owned(qkv[s]), owned(z[s]), owned(b[s]), owned(a[s]), owned(out[s])};
    layer.gdn_lora.push_back(shard_gdn_lora(full, gdn, heads));
  }
}

Tensor ShardedModel::attention(const Layer& layer, const Tensor& h,
                               const std::vector<int32_t>& slots,
                               ShardedSequence::LayerCache& cache, Communicator& comm) const {
  if (layer.is_linear_attention)
    return gdn_forward_tp(h, slots, layer.gdn, layer.gdn_lora, cache.gdn, comm);
  if (model_.config().use_mla)
    return mla_forward_tp(h, slots, layer.mla, layer.mla_lora, cache.mla, comm);
  return gqa_forward_tp(h, slots, layer.attention, layer.attention_lora, cache.gqa, comm);
}

ShardedSequence ShardedModel::new_sequence(int32_t slot, int owner) const {
  MOELORA_CHECK(slot >= -1 && slot < model_.adapters().size(), ErrorCode::kOutOfRange,
                "sharded model: adapter slot ", slot, " is not -1 (base) or in [0, ",
                model_.adapters().size(), ")");
  MOELORA_CHECK(owner >= 0 && owner < shard_.size, ErrorCode::kInvalidArgument,
                "sharded model: owner rank ", owner, " is not a rank of ", shard_.size);
  ShardedSequence seq;
  seq.model_ = this;
  seq.slot_ = slot;
  seq.owner_ = owner;
  seq.layers_.resize(layers_.size());
  return seq;
}

Tensor ShardedModel::prefill_logits(std::span<const int32_t> tokens, int32_t slot,
                                    Communicator& comm) const {
  return prefill_batch_logits({std::vector<int32_t>(tokens.begin(), tokens.end())}, {slot}, comm)
      .front();
}

std::vector<Tensor> ShardedModel::prefill_batch_logits(
    const std::vector<std::vector<int32_t>>& prompts, const std::vector<int32_t>& slots,
    Communicator& comm) const {
  MOELORA_CHECK(prompts.size() == slots.size(), ErrorCode::kInvalidArgument, "sharded model: ",
                prompts.size(), " prompts with ", slots.size(), " adapter slots (one per prompt)");
  std::vector<ShardedSequence> sequences;
  std::vector<ShardedSequence*> batch;
  for (size_t i = 0; i < prompts.size(); ++i)
    sequences.push_back(new_sequence(slots[i], static_cast<int>(i % static_cast<size_t>(shard_.size))));
  for (ShardedSequence& seq : sequences) batch.push_back(&seq);
  return forward(batch, prompts, comm);
}

std::vector<Tensor> ShardedModel::forward(const std::vector<ShardedSequence*>& sequences,
                                          const std::vector<std::vector<int32_t>>& tokens,
                                          Communicator& comm) const {
  MOELORA_CHECK(comm.size() == shard_.size && comm.rank() == shard_.rank, ErrorCode::kInvalidArgument,
                "sharded model: cut for rank ", shard_.rank, " of ", shard_.size, " but run on rank ",
                comm.rank(), " of ", comm.size());
  MOELORA_CHECK(!sequences.empty() && sequences.size() == tokens.size(), ErrorCode::kInvalidArgument,
                "sharded model: ", sequences.size(), " sequences with ", tokens.size(),
                " token lists (one list per sequence, at least one sequence)");
  // Rows [offset[i], offset[i + 1]) of the batch are sequence i's new tokens.
  std::vector<int64_t> offset = {0};
  std::vector<int32_t> all_tokens, token_slots;
  for (size_t i = 0; i < sequences.size(); ++i) {
    MOELORA_CHECK(sequences[i] != nullptr && sequences[i]->model_ == this,
                  ErrorCode::kInvalidArgument, "sharded model: sequence ", i,
                  " was not made by this rank's model (new_sequence)");
    MOELORA_CHECK(!sequences[i]->broken_, ErrorCode::kInvalidArgument, "sharded model: sequence ",
                  i, " is broken: an earlier step failed part-way through its layers; start a new "
                  "sequence");
    MOELORA_CHECK(!tokens[i].empty(), ErrorCode::kInvalidArgument, "sharded model: sequence ", i,
                  " has no new tokens");
    all_tokens.insert(all_tokens.end(), tokens[i].begin(), tokens[i].end());
    token_slots.insert(token_slots.end(), tokens[i].size(), sequences[i]->slot());
    offset.push_back(static_cast<int64_t>(all_tokens.size()));
  }
  const int64_t count = offset.back(), hidden = model_.config().hidden_size;
  const bool data_parallel = options_.attention == AttentionSplit::kDataParallel;
  // Broken until every layer has taken the step (an exception leaves it so).
  for (ShardedSequence* seq : sequences) seq->broken_ = true;
  Tensor x = ops::embedding_ref(model_.weights().embed_tokens, all_tokens);  // [T, H]
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    const Tensor h = ops::rms_norm_ref(x, layer.input_layernorm, norm_);
    // Attention per sequence against its cache: every sequence on every rank by heads, or each on
    // its owner rank whole, the others' rows left zero and filled by the all-reduce.
    Tensor attended = Tensor::zeros(DType::kF32, {count, hidden});
    for (size_t i = 0; i < sequences.size(); ++i) {
      ShardedSequence& seq = *sequences[i];
      if (data_parallel && seq.owner() != comm.rank()) continue;
      const std::vector<int32_t> slots(tokens[i].size(), seq.slot());
      const Tensor out = attention(layer, h.slice0(offset[i], offset[i + 1]).clone(), slots,
                                   seq.layers_[l], data_parallel ? solo_->rank(0) : comm);
      std::copy_n(out.data<float>(), out.numel(), attended.data<float>() + offset[i] * hidden);
    }
    if (data_parallel)
      comm.all_reduce_sum({attended.data<float>(), static_cast<size_t>(attended.numel())});
    add_inplace(x, attended);
    const Tensor h2 = ops::rms_norm_ref(x, layer.post_attention_layernorm, norm_);
    add_inplace(x, layer.is_moe ? moe_forward_ep(h2, token_slots, layer.moe, layer.moe_lora,
                                                 options_.moe_combine, comm)
                                : mlp_forward_tp(h2, token_slots, layer.mlp, layer.mlp_lora, comm));
  }
  for (size_t i = 0; i < sequences.size(); ++i) {
    sequences[i]->length_ += static_cast<int64_t>(tokens[i].size());
    sequences[i]->broken_ = false;
  }
  ops::rms_norm_inplace_ref(x, model_.weights().final_norm, norm_);
  // Vocab-parallel head: this rank's [T, V / n] columns, gathered rank-major to [n, T, V / n].
  const Tensor local = ops::linear_ref(x, lm_head_);
  const int64_t per = local.dim(1), ranks = comm.size();
  Tensor gathered = Tensor::empty(DType::kF32, {ranks, count, per});
  comm.all_gather({local.data<float>(), static_cast<size_t>(local.numel())},
                  {gathered.data<float>(), static_cast<size_t>(gathered.numel())});
  std::vector<Tensor> logits;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const int64_t rows = offset[i + 1] - offset[i];
    Tensor sequence_logits = Tensor::empty(DType::kF32, {rows, ranks * per});
    for (int64_t r = 0; r < ranks; ++r)
      for (int64_t t = 0; t < rows; ++t)
        std::copy_n(gathered.data<float>() + (r * count + offset[i] + t) * per, per,
                    sequence_logits.data<float>() + t * ranks * per + r * per);
    logits.push_back(std::move(sequence_logits));
  }
  return logits;
}

}  // namespace moelora::dist
