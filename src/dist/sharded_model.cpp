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
  const ops::RopeParams rope_params = model::rope_params(config);
  const ops::RopeTable rope = ops::make_rope_table(rope_params);
  const bool data_parallel = options.attention == AttentionSplit::kDataParallel;
  MOELORA_CHECK(options.moe_combine != MoeCombine::kDispatch ||
                    (data_parallel && options.shared_expert == SharedExpertSplit::kReplicated),
                ErrorCode::kInvalidArgument,
                "sharded model: MoE token dispatch keeps each rank's tokens on it, which needs "
                "data-parallel attention and a replicated shared expert (attention ",
                data_parallel ? "data" : "tensor", " parallel, shared expert ",
                options.shared_expert == SharedExpertSplit::kReplicated ? "replicated" : "split",
                ")");
  heads_ = data_parallel ? ShardSpec{0, 1} : shard;
  num_slots_ = model.adapters().size();
  if (data_parallel) solo_ = std::make_unique<InProcessGroup>(1);
  for (int64_t l = 0; l < model.num_layers(); ++l) {
    const model::LayerWeightsF32& src = w.layers[static_cast<size_t>(l)];
    Layer layer;
    layer.input_layernorm = src.input_layernorm;
    layer.post_attention_layernorm = src.post_attention_layernorm;

    if (src.is_linear_attention)
      shard_gdn_layer(layer, src.linear_attn);
    else if (config.use_mla)
      shard_mla_layer(layer, src.attention, rope, rope_params);
    else
      shard_gqa_layer(layer, src.attention, rope);

    layer.is_moe = src.is_moe;
    if (src.is_moe) {
      layer.moe_params = model::moe_params(config, src);
      layer.moe = shard_moe(src.moe, layer.moe_params, shard, options.shared_expert);
    } else {
      layer.mlp = shard_mlp(src.mlp_gate, src.mlp_up, src.mlp_down, shard);
    }
    layer.resize_slots(num_slots_);
    for (int32_t s = 0; s < num_slots_; ++s) cut_slot(layer, l, s);
    layers_.push_back(std::move(layer));
  }
  lm_head_ = shard_dim(w.lm_head, 0, shard, "lm_head");
}

void ShardedModel::Layer::resize_slots(int32_t slots) {
  const auto n = static_cast<size_t>(slots);
  attention_lora.resize(n);
  mla_lora.resize(n);
  gdn_lora.resize(n);
  moe_lora.resize(n);
  mlp_lora.resize(n);
}

void ShardedModel::shard_gqa_layer(Layer& layer, const model::AttentionWeightsF32& src,
                                   const ops::RopeTable& rope) {
  const io::ModelConfig& config = model_.config();
  GqaWeights& attention = layer.attention_full;
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
  layer.attention = shard_gqa(attention, heads_);
}

void ShardedModel::shard_mla_layer(Layer& layer, const model::AttentionWeightsF32& src,
                                   const ops::RopeTable& rope, const ops::RopeParams& rope_params) {
  const io::ModelConfig& config = model_.config();
  MlaWeights& mla = layer.mla_full;
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
  layer.mla = shard_mla(mla, heads_);
}

void ShardedModel::shard_gdn_layer(Layer& layer, const model::LinearAttentionWeightsF32& src) {
  GdnLayer& gdn = layer.gdn_full;
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
  layer.gdn = shard_gdn(gdn, heads_);
}

void ShardedModel::cut_slot(Layer& layer, int64_t l, int32_t slot) const {
  const model::AdapterSet& adapters = model_.adapters();
  const auto s = static_cast<size_t>(slot);
  // The slot's factors of one target (undefined when not adapted or the slot is empty), shared
  // with the adapter until the shard_*_lora below copy their share out.
  auto factors = [&](model::LoraTargetMember target) {
    return owned(adapters.target(l, target)[s]);
  };
  if (layer.is_linear_attention) {
    const GdnLora full{factors(&io::LayerLora::in_proj_qkv), factors(&io::LayerLora::in_proj_z),
                       factors(&io::LayerLora::in_proj_b), factors(&io::LayerLora::in_proj_a),
                       factors(&io::LayerLora::out_proj)};
    layer.gdn_lora[s] = shard_gdn_lora(full, layer.gdn_full, heads_);
  } else if (model_.config().use_mla) {
    const MlaLora full{
        factors(&io::LayerLora::q_proj),    factors(&io::LayerLora::q_a_proj),
        factors(&io::LayerLora::q_b_proj),  factors(&io::LayerLora::kv_a_proj_with_mqa),
        factors(&io::LayerLora::kv_b_proj), factors(&io::LayerLora::o_proj)};
    layer.mla_lora[s] = shard_mla_lora(full, layer.mla_full, heads_);
  } else {
    const GqaLora full{factors(&io::LayerLora::q_proj), factors(&io::LayerLora::k_proj),
                       factors(&io::LayerLora::v_proj), factors(&io::LayerLora::o_proj)};
    layer.attention_lora[s] = shard_gqa_lora(full, layer.attention_full, heads_);
  }
  // An empty slot's refs are all nullptr: its cut adapts nothing.
  if (layer.is_moe)
    layer.moe_lora[s] =
        shard_moe_lora(adapters.moe(l)[s], layer.moe_params, shard_, options_.shared_expert);
  else
    layer.mlp_lora[s] = shard_mlp_lora(adapters.dense_mlp(l)[s], shard_);
}

void ShardedModel::refresh_slot(int32_t slot) {
  const int32_t slots = model_.adapters().size();
  MOELORA_CHECK(slot >= 0 && slot < slots, ErrorCode::kOutOfRange, "sharded model: adapter slot ",
                slot, " to refresh is not in [0, ", slots, ")");
  // Cut into a copy of the layers (their tensors share storage, so it costs the new cuts only)
  // and swap it in at the end: a cut that throws leaves the model as it was.
  std::vector<Layer> next = layers_;
  for (size_t l = 0; l < next.size(); ++l) {
    Layer& layer = next[l];
    layer.resize_slots(slots);
    for (int32_t s = num_slots_; s < slots; ++s) cut_slot(layer, static_cast<int64_t>(l), s);
    if (slot < num_slots_) cut_slot(layer, static_cast<int64_t>(l), slot);
  }
  layers_ = std::move(next);
  num_slots_ = slots;
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

uint64_t ShardedSequence::kv_bytes() const {
  uint64_t floats = 0;
  for (const LayerCache& c : layers_) {
    if (c.gqa.kv)
      floats += static_cast<uint64_t>(c.gqa.kv->size() * c.gqa.kv->num_kv_heads() *
                                      (c.gqa.kv->head_dim() + c.gqa.kv->v_head_dim()));
    floats += c.mla.k_nope.size() + c.mla.k_rope.size() + c.mla.v.size();
  }
  return floats * sizeof(float);
}

uint64_t ShardedSequence::state_bytes() const {
  uint64_t bytes = 0;
  for (const LayerCache& c : layers_)
    if (c.gdn.state)
      bytes += static_cast<uint64_t>(c.gdn.state->conv.nbytes() + c.gdn.state->recurrent.nbytes());
  return bytes;
}

uint64_t ShardedModel::cache_bytes_per_position() const {
  uint64_t floats = 0;
  for (const Layer& layer : layers_) {
    if (layer.is_linear_attention) continue;
    if (model_.config().use_mla) {  // k_nope and v of the held heads, the shared k_rope
      const ops::MlaDims& d = layer.mla.dims;
      floats += static_cast<uint64_t>(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim) +
                                      d.qk_rope_head_dim);
    } else {  // K and V of the held KV heads
      floats += static_cast<uint64_t>(2 * layer.attention.num_kv_heads * layer.attention.head_dim);
    }
  }
  return floats * sizeof(float);
}

uint64_t ShardedModel::state_bytes_per_sequence() const {
  uint64_t floats = 0;
  for (const Layer& layer : layers_) {
    if (!layer.is_linear_attention) continue;
    const ops::GdnShape& s = layer.gdn.shape;
    floats += static_cast<uint64_t>(s.conv_dim() * (s.conv_kernel - 1) +
                                    s.num_v_heads * s.head_k_dim * s.head_v_dim);
  }
  return floats * sizeof(float);
}

ShardedSequence ShardedModel::new_sequence(int32_t slot, int owner) const {
  // The slots cut, not the AdapterSet's count: a slot grown by resize has no cut until
  // refresh_slot.
  MOELORA_CHECK(
      slot >= -1 && slot < num_slots_, ErrorCode::kOutOfRange, "sharded model: adapter slot ", slot,
      " is not -1 (base) or in [0, ", num_slots_, ")",
      num_slots_ < model_.adapters().size() ? " (the model has more slots: refresh_slot cuts them)"
                                            : "");
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
    MOELORA_CHECK(sequences[i]->slot() < num_slots_, ErrorCode::kOutOfRange,
                  "sharded model: sequence ", i, " has adapter slot ", sequences[i]->slot(),
                  ", dropped by a refresh_slot (", num_slots_, " slots now)");
    all_tokens.insert(all_tokens.end(), tokens[i].begin(), tokens[i].end());
    token_slots.insert(token_slots.end(), tokens[i].size(), sequences[i]->slot());
    offset.push_back(static_cast<int64_t>(all_tokens.size()));
  }
  const int64_t count = offset.back(), hidden = model_.config().hidden_size;
  const bool data_parallel = options_.attention == AttentionSplit::kDataParallel;
  // With token dispatch each rank carries only its own sequences' rows of the residual stream
  // (the other rows stay zero) until the head; otherwise every rank carries every row.
  const bool dispatch = options_.moe_combine == MoeCombine::kDispatch;
  std::vector<char> own(static_cast<size_t>(count), 1);  // (T) rows this rank carries
  std::vector<int32_t> own_slots;                        // their slots, in row order
  if (dispatch) {
    for (size_t i = 0; i < sequences.size(); ++i) {
      const bool mine = sequences[i]->owner() == comm.rank();
      std::fill(own.begin() + offset[i], own.begin() + offset[i + 1], mine);
      if (mine) own_slots.insert(own_slots.end(), tokens[i].size(), sequences[i]->slot());
    }
  }
  // t [T, H] with the rows this rank does not carry set to zero.
  auto zero_others = [&](Tensor& t) {
    for (int64_t r = 0; r < count; ++r)
      if (!own[static_cast<size_t>(r)]) std::fill_n(t.data<float>() + r * hidden, hidden, 0.0f);
  };
  // Broken until every layer has taken the step (an exception leaves it so).
  for (ShardedSequence* seq : sequences) seq->broken_ = true;
  Tensor x = ops::embedding_ref(model_.weights().embed_tokens, all_tokens);  // [T, H]
  if (dispatch) zero_others(x);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    const Tensor h = ops::rms_norm_ref(x, layer.input_layernorm, norm_);
    // Attention per sequence against its cache: every sequence on every rank by heads, or each on
    // its owner rank whole, the others' rows left zero and filled by the all-reduce (not with
    // token dispatch: the rows stay with their rank).
    Tensor attended = Tensor::zeros(DType::kF32, {count, hidden});
    for (size_t i = 0; i < sequences.size(); ++i) {
      ShardedSequence& seq = *sequences[i];
      if (data_parallel && seq.owner() != comm.rank()) continue;
      const std::vector<int32_t> slots(tokens[i].size(), seq.slot());
      const Tensor out = attention(layer, h.slice0(offset[i], offset[i + 1]).clone(), slots,
                                   seq.layers_[l], data_parallel ? solo_->rank(0) : comm);
      std::copy_n(out.data<float>(), out.numel(), attended.data<float>() + offset[i] * hidden);
    }
    if (data_parallel && !dispatch)
      comm.all_reduce_sum({attended.data<float>(), static_cast<size_t>(attended.numel())});
    add_inplace(x, attended);
    Tensor h2 = ops::rms_norm_ref(x, layer.post_attention_layernorm, norm_);
    if (!dispatch) {
      add_inplace(x, layer.is_moe
                         ? moe_forward_ep(h2, token_slots, layer.moe, layer.moe_lora,
                                          options_.moe_combine, comm)
                         : mlp_forward_tp(h2, token_slots, layer.mlp, layer.mlp_lora, comm));
    } else if (layer.is_moe) {
      // This rank's rows to the experts' ranks and back.
      Tensor mine = Tensor::empty(DType::kF32, {static_cast<int64_t>(own_slots.size()), hidden});
      int64_t k = 0;
      for (int64_t r = 0; r < count; ++r)
        if (own[static_cast<size_t>(r)])
          std::copy_n(h2.data<float>() + r * hidden, hidden, mine.data<float>() + k++ * hidden);
      const Tensor out = moe_forward_dispatch(mine, own_slots, layer.moe, layer.moe_lora, comm);
      k = 0;
      for (int64_t r = 0; r < count; ++r) {
        if (!own[static_cast<size_t>(r)]) continue;
        float* xr = x.data<float>() + r * hidden;
        const float* o = out.data<float>() + k++ * hidden;
        for (int64_t c = 0; c < hidden; ++c) xr[c] += o[c];
      }
    } else {
      // A dense layer stays tensor parallel over every token: gather the rows exactly (one
      // nonzero contribution each), keep the own rows of the result.
      zero_others(h2);
      comm.all_reduce_sum({h2.data<float>(), static_cast<size_t>(h2.numel())});
      Tensor out = mlp_forward_tp(h2, token_slots, layer.mlp, layer.mlp_lora, comm);
      zero_others(out);
      add_inplace(x, out);
    }
  }
  for (size_t i = 0; i < sequences.size(); ++i) {
    sequences[i]->length_ += static_cast<int64_t>(tokens[i].size());
    sequences[i]->broken_ = false;
  }
  // The vocab-parallel head needs every row on every rank.
  if (dispatch) comm.all_reduce_sum({x.data<float>(), static_cast<size_t>(x.numel())});
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
