// A rank's share of a checkpoint and of an adapter for the GPU ranks (shard_checkpoint.h).
#include "dist/shard_checkpoint.h"

#include <string>
#include <vector>

#include "core/device_collectives.h"
#include "core/error.h"
#include "dist/parallel_attention.h"
#include "dist/parallel_gdn.h"
#include "dist/parallel_mla.h"
#include "model/model.h"
#include "model/weights.h"
#include "runtime/gpu_executor.h"

namespace moelora::dist {

namespace {

// The KV heads rank tp.rank holds: Hkv / n of them, or, with more ranks than KV heads, the one its
// query heads read (the rule of parallel_attention.cpp, which the CPU shards use).
ShardRange kv_head_range(int64_t num_heads, int64_t num_kv_heads, ShardSpec tp) {
  MOELORA_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                ErrorCode::kInvalidArgument, "attention: ", num_heads, " query heads and ",
                num_kv_heads, " KV heads (query heads must be a multiple of KV heads)");
  if (num_kv_heads % tp.size == 0) return shard_range(num_kv_heads, tp, "attention KV heads");
  MOELORA_CHECK(tp.size % num_kv_heads == 0, ErrorCode::kInvalidArgument,
                "attention: ", num_kv_heads, " KV heads over ", tp.size,
                " ranks; the ranks must divide the KV heads or be a multiple of them");
  const int64_t kv = tp.rank / (tp.size / num_kv_heads);
  return {kv, kv + 1};
}

bool has_dense_mlp(const io::ModelConfig& config) {
  for (int64_t l = 0; l < config.num_hidden_layers; ++l)
    if (!config.is_moe_layer(l)) return true;
  return false;
}

// A split projection as a dense F32 (or its own float dtype) weight of the given rows / columns.
Tensor float_weight(const io::LinearWeight& w) {
  MOELORA_CHECK(w.defined(), ErrorCode::kInvalidArgument, "shard_checkpoint: weight '", w.name,
                "' to split is missing");
  return w.format == io::WeightFormat::kDense ? w.weight : model::dequantize_linear(w);
}

io::LinearWeight dense_linear(Tensor weight, const io::LinearWeight& like, ShardSpec tp) {
  io::LinearWeight out;
  out.format = io::WeightFormat::kDense;
  out.out_features = weight.dim(0);
  out.in_features = weight.dim(1);
  out.weight = std::move(weight);
  out.name =
      like.name + " (rank " + std::to_string(tp.rank) + " of " + std::to_string(tp.size) + ")";
  return out;
}

// Rows [begin, end) of each range, concatenated (a column-parallel projection's share).
io::LinearWeight rows_of(const io::LinearWeight& w, const std::vector<ShardRange>& rows,
                         ShardSpec tp) {
  return dense_linear(slice_ranges(float_weight(w), 0, rows, w.name), w, tp);
}
io::LinearWeight rows_of(const io::LinearWeight& w, ShardRange rows, ShardSpec tp) {
  return rows_of(w, std::vector<ShardRange>{rows}, tp);
}
// Columns [begin, end) (a row-parallel projection's share).
io::LinearWeight columns_of(const io::LinearWeight& w, ShardRange columns, ShardSpec tp) {
  return dense_linear(slice_dim(float_weight(w), 1, columns.begin, columns.end, w.name), w, tp);
}

ShardRange scaled(ShardRange r, int64_t per) {
  return {r.begin * per, r.end * per};
}

// gate / up by rows, down by columns: [r I / n, (r + 1) I / n) of the intermediate channels.
io::MlpWeights shard_mlp_weights(const io::MlpWeights& mlp, ShardSpec tp, const std::string& what) {
  if (!mlp.defined()) return mlp;
  const ShardRange channels = shard_range(mlp.gate.out_features, tp, what + " intermediate size");
  io::MlpWeights s;
  s.gate = rows_of(mlp.gate, channels, tp);
  s.up = rows_of(mlp.up, channels, tp);
  s.down = columns_of(mlp.down, channels, tp);
  return s;
}

struct GdnHeads {
  ShardRange key, value;
};

GdnHeads gdn_heads(const io::ModelConfig& c, ShardSpec tp) {
  return {shard_range(c.linear_attention.num_key_heads, tp, "Gated DeltaNet key heads"),
          shard_range(c.linear_attention.num_value_heads, tp, "Gated DeltaNet value heads")};
}

io::LinearAttentionWeights shard_gdn_weights(const io::LinearAttentionWeights& w,
                                             const io::ModelConfig& c, ShardSpec tp) {
  const GdnHeads h = gdn_heads(c, tp);
  const int64_t dk = c.linear_attention.key_head_dim, dv = c.linear_attention.value_head_dim;
  const int64_t key_dim = c.linear_attention.num_key_heads * dk;
  // The [q | k | v] channel blocks of in_proj_qkv's rows and of the conv: the rank's heads of each.
  const std::vector<ShardRange> channels = {
      scaled(h.key, dk),
      {key_dim + h.key.begin * dk, key_dim + h.key.end * dk},
      {2 * key_dim + h.value.begin * dv, 2 * key_dim + h.value.end * dv}};
  io::LinearAttentionWeights s;
  s.in_proj_qkv = rows_of(w.in_proj_qkv, channels, tp);
  s.in_proj_z = rows_of(w.in_proj_z, scaled(h.value, dv), tp);
  s.in_proj_b = rows_of(w.in_proj_b, h.value, tp);
  s.in_proj_a = rows_of(w.in_proj_a, h.value, tp);
  s.conv1d = slice_ranges(w.conv1d, 0, channels, "conv1d");
  s.a_log = slice_dim(w.a_log, 0, h.value.begin, h.value.end, "A_log");
  s.dt_bias = slice_dim(w.dt_bias, 0, h.value.begin, h.value.end, "dt_bias");
  s.norm = w.norm;
  s.out_proj = columns_of(w.out_proj, scaled(h.value, dv), tp);
  return s;
}

void shard_attention(const io::LayerWeights& src, const io::ModelConfig& c, ShardSpec tp,
                     io::LayerWeights& s) {
  const ShardRange heads = shard_range(c.num_attention_heads, tp, "attention query heads");
  if (c.use_mla) {
    // The latents feed every head: whole. q_b (or q) and kv_b by heads, o_proj's columns.
    const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim,
                  kv = c.qk_nope_head_dim + c.v_head_dim;
    s.q_a_proj = src.q_a_proj;
    s.q_a_layernorm = src.q_a_layernorm;
    s.kv_a_proj_with_mqa = src.kv_a_proj_with_mqa;
    s.kv_a_layernorm = src.kv_a_layernorm;
    if (c.q_lora_rank > 0)
      s.q_b_proj = rows_of(src.q_b_proj, scaled(heads, qk), tp);
    else
      s.q_proj = rows_of(src.q_proj, scaled(heads, qk), tp);
    s.kv_b_proj = rows_of(src.kv_b_proj, scaled(heads, kv), tp);
    s.o_proj = columns_of(src.o_proj, scaled(heads, c.v_head_dim), tp);
    return;
  }
  const int64_t d = c.head_dim;
  const ShardRange kv = kv_head_range(c.num_attention_heads, c.num_key_value_heads, tp);
  // Qwen3.5's q_proj rows per head are [q | gate]: the rank's heads bring their gates.
  s.q_proj = rows_of(src.q_proj, scaled(heads, d * (c.attention_output_gate ? 2 : 1)), tp);
  s.k_proj = rows_of(src.k_proj, scaled(kv, d), tp);
  s.v_proj = rows_of(src.v_proj, scaled(kv, d), tp);
  s.o_proj = columns_of(src.o_proj, scaled(heads, d), tp);
  s.q_norm = src.q_norm;
  s.k_norm = src.k_norm;
}

std::string layer_name(int64_t l) {
  return "layer " + std::to_string(l);
}

}  // namespace

ShardRange expert_range(const io::ModelConfig& config, ShardSpec ep) {
  return shard_range(config.num_experts, ep, "routed experts");
}

io::ModelConfig rank_config(const io::ModelConfig& c, ShardSpec tp) {
  io::ModelConfig r = c;
  r.num_attention_heads = shard_range(c.num_attention_heads, tp, "attention query heads").size();
  r.num_key_value_heads = kv_head_range(c.num_attention_heads, c.num_key_value_heads, tp).size();
  if (c.linear_attention.num_key_heads > 0) {
    const GdnHeads h = gdn_heads(c, tp);
    r.linear_attention.num_key_heads = h.key.size();
    r.linear_attention.num_value_heads = h.value.size();
  }
  if (has_dense_mlp(c))
    r.intermediate_size = shard_range(c.intermediate_size, tp, "intermediate_size").size();
  if (c.shared_expert_intermediate_size > 0)
    r.shared_expert_intermediate_size =
        shard_range(c.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size")
            .size();
  if (c.num_experts > 0) expert_range(c, tp);  // the experts divide evenly
  return r;
}

io::ModelWeights shard_checkpoint(const io::ModelWeights& w, ShardSpec tp) {
  const io::ModelConfig& c = w.config;
  MOELORA_CHECK(static_cast<int64_t>(w.layers.size()) == c.num_hidden_layers,
                ErrorCode::kInvalidArgument, "shard_checkpoint: ", w.layers.size(),
                " layers of weights for a config of ", c.num_hidden_layers);
  io::ModelWeights s;
  s.config = rank_config(c, tp);
  s.dir = w.dir;
  s.weight_prefix = w.weight_prefix;
  // The vocabulary's rows (embedding, lm_head) by vocab_shard: an equal share when V divides.
  const VocabShard vocab = vocab_shard(c.vocab_size, tp.rank, tp.size);
  const ShardRange vocab_rows{vocab.begin, vocab.begin + vocab.count};
  s.embed_tokens = vocab.split ? slice_dim(w.embed_tokens, 0, vocab_rows.begin, vocab_rows.end,
                                           "model.embed_tokens.weight")
                               : w.embed_tokens;
  s.final_norm = w.final_norm;
  s.tied_embeddings = w.tied_embeddings;
  if (!vocab.split) {
    s.lm_head = w.lm_head;
  } else if (w.tied_embeddings) {
    s.lm_head = w.lm_head;
    s.lm_head.weight = s.embed_tokens;
    s.lm_head.out_features = vocab.count;
  } else {
    s.lm_head = rows_of(w.lm_head, vocab_rows, tp);
  }
  s.ignored_tensors = w.ignored_tensors;
  s.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const io::LayerWeights& src = w.layers[l];
    io::LayerWeights& dst = s.layers[l];
    const std::string where = layer_name(static_cast<int64_t>(l));
    dst.input_layernorm = src.input_layernorm;
    dst.post_attention_layernorm = src.post_attention_layernorm;
    dst.is_linear_attention = src.is_linear_attention;
    if (src.is_linear_attention)
      dst.linear_attn = shard_gdn_weights(src.linear_attn, c, tp);
    else
      shard_attention(src, c, tp, dst);
    dst.is_moe = src.is_moe;
    if (!src.is_moe) {
      dst.mlp = shard_mlp_weights(src.mlp, tp, where + " mlp");
      continue;
    }
    dst.router = src.router;
    dst.e_score_correction_bias = src.e_score_correction_bias;
    const ShardRange experts = shard_range(src.experts.num_experts, tp, where + " routed experts");
    dst.experts.num_experts = experts.size();
    dst.experts.fused_on_disk = src.experts.fused_on_disk;
    for (int64_t e = experts.begin; e < experts.end; ++e) {
      dst.experts.gate.push_back(src.experts.gate.at(static_cast<size_t>(e)));
      dst.experts.up.push_back(src.experts.up.at(static_cast<size_t>(e)));
      dst.experts.down.push_back(src.experts.down.at(static_cast<size_t>(e)));
    }
    dst.shared_expert = shard_mlp_weights(src.shared_expert, tp, where + " shared expert");
    dst.shared_expert_gate = src.shared_expert_gate;
  }
  return s;
}

io::LoraAdapter shard_adapter(const io::LoraAdapter& adapter, const io::ModelConfig& c,
                              ShardSpec tp) {
  MOELORA_CHECK(static_cast<int64_t>(adapter.layers.size()) == c.num_hidden_layers,
                ErrorCode::kInvalidArgument, "adapter '", adapter.name, "' has LoRA weights for ",
                adapter.layers.size(), " layers but the model has ", c.num_hidden_layers);
  io::LoraAdapter s = adapter;
  for (size_t l = 0; l < adapter.layers.size(); ++l) {
    const auto layer = static_cast<int64_t>(l);
    const io::LayerLora& src = adapter.layers[l];
    io::LayerLora& dst = s.layers[l];
    const std::string where = "adapter '" + adapter.name + "' " + layer_name(layer);
    if (runtime::is_linear_attention_layer(c, layer)) {
      GdnLayer whole;
      whole.shape = model::linear_attention_shape(c);
      const GdnLora cut = shard_gdn_lora(
          {src.in_proj_qkv, src.in_proj_z, src.in_proj_b, src.in_proj_a, src.out_proj}, whole, tp);
      dst.in_proj_qkv = cut.in_proj_qkv;
      dst.in_proj_z = cut.in_proj_z;
      dst.in_proj_b = cut.in_proj_b;
      dst.in_proj_a = cut.in_proj_a;
      dst.out_proj = cut.out_proj;
    } else if (c.use_mla) {
      MlaWeights whole;
      whole.dims.num_heads = c.num_attention_heads;
      const MlaLora cut = shard_mla_lora({src.q_proj, src.q_a_proj, src.q_b_proj,
                                          src.kv_a_proj_with_mqa, src.kv_b_proj, src.o_proj},
                                         whole, tp);
      dst.q_proj = cut.q_proj;
      dst.q_a_proj = cut.q_a_proj;
      dst.q_b_proj = cut.q_b_proj;
      dst.kv_a_proj_with_mqa = cut.kv_a_proj_with_mqa;
      dst.kv_b_proj = cut.kv_b_proj;
      dst.o_proj = cut.o_proj;
    } else {
      GqaWeights whole;
      whole.num_heads = c.num_attention_heads;
      whole.num_kv_heads = c.num_key_value_heads;
      whole.head_dim = c.head_dim;
      whole.output_gate = c.attention_output_gate;
      const GqaLora cut =
          shard_gqa_lora({src.q_proj, src.k_proj, src.v_proj, src.o_proj}, whole, tp);
      dst.q_proj = cut.q;
      dst.k_proj = cut.k;
      dst.v_proj = cut.v;
      dst.o_proj = cut.o;
    }
    if (c.is_moe_layer(layer)) {
      dst.experts_gate_up =
          shard_lora_experts(src.experts_gate_up, c.num_experts, tp, where + " experts gate_up");
      dst.experts_down =
          shard_lora_experts(src.experts_down, c.num_experts, tp, where + " experts down");
      dst.shared_gate = shard_lora_column(src.shared_gate, tp, where + " shared expert gate");
      dst.shared_up = shard_lora_column(src.shared_up, tp, where + " shared expert up");
      dst.shared_down = shard_lora_row(src.shared_down, tp, where + " shared expert down");
    } else {
      dst.mlp_gate = shard_lora_column(src.mlp_gate, tp, where + " mlp gate");
      dst.mlp_up = shard_lora_column(src.mlp_up, tp, where + " mlp up");
      dst.mlp_down = shard_lora_row(src.mlp_down, tp, where + " mlp down");
    }
  }
  return s;
}

}  // namespace moelora::dist
