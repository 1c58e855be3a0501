// config.json -> ModelConfig for Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3 and Kimi-K2 / K2.5, and
// back (FORMATS.md §1.2-1.6, §4.1-4.2).
//
// The parser mirrors what transformers 5 makes of the same file (its class defaults, its RoPE
// standardization, the text_config of the VLM wrappers), because the engine's numerics are
// checked against transformers. Where transformers would silently build something the engine
// does not implement (sliding windows, attention biases, another router or rope type, another
// quantization scheme) the parser refuses with kUnsupported instead of loading a model that
// computes something else.
#include "io/hf_config.h"
#include "io/hf_config_fields.h"
#include "io/input_limits.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using hf_config_internal::describe;
using hf_config_internal::Fields;
using hf_config_internal::parse_quantization_config;
using hf_config_internal::quant_to_json;

constexpr const char* kSupportedModelTypes =
    "qwen3_moe, qwen3_5_moe, qwen3_5_moe_text, deepseek_v3, kimi_k2, kimi_k25";

// Reads the first of `keys` that is present (aliases such as num_experts / num_local_experts);
// when several are present they must agree.
int64_t aliased_integer(const Fields& f, std::initializer_list<const char*> keys) {
  std::optional<int64_t> value;
  std::string first;
  for (const char* key : keys) {
    if (!f.has(key)) continue;
    const int64_t v = f.integer(key);
    MOELORA_CHECK(!value || *value == v, ErrorCode::kInvalidFile, f.source(), ": fields '", f.path(first),
                  "' (", *value, ") and '", f.path(key), "' (", v, ") are aliases but disagree");
    if (!value) first = key;
    value = v;
  }
  MOELORA_CHECK(value.has_value(), ErrorCode::kInvalidFile, f.source(), ": missing field '",
                f.path(*keys.begin()), "'");
  return *value;
}

// Fields that the engine does not implement, whatever transformers would do with them.
void reject_unsupported_features(const Fields& f) {
  const std::string act = f.string("hidden_act", "silu");
  MOELORA_CHECK(act == "silu", ErrorCode::kUnsupported, f.source(), ": field '", f.path("hidden_act"),
                "' is \"", act, "\"; only \"silu\" is supported");
  MOELORA_CHECK(!f.boolean("attention_bias", false), ErrorCode::kUnsupported, f.source(), ": field '",
                f.path("attention_bias"), "' is true; attention projections with biases are not supported");
}

// ---- RoPE ----

RopeConfig parse_rope(const Fields& f, int64_t max_position_embeddings, double default_partial_factor) {
  // transformers: rope_parameters = rope_scaling or rope_parameters (a non-empty legacy dict wins)
  std::optional<Fields> params;
  std::string params_key;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const json* obj = f.object(key);
    if (obj != nullptr && !obj->empty()) {
      params.emplace(f.sub(key));
      params_key = key;
      break;
    }
  }
  RopeConfig rope;
  rope.theta = f.number("rope_theta", 10000.0);
  rope.partial_rotary_factor = f.number("partial_rotary_factor", default_partial_factor);
  if (!params) return rope;

  const json& dict = *f.object(params_key);
  for (const auto& [key, value] : dict.items()) {
    // transformers 5 also allows one dict per layer type; none of the supported models uses it
    MOELORA_CHECK(!value.is_object(), ErrorCode::kUnsupported, f.source(), ": field '", params->path(key),
                  "' is an object; per-layer-type RoPE parameters are not supported");
  }
  const char* type_key = params->has("rope_type") ? "rope_type" : "type";
  rope.type = params->string(type_key, "default");
  MOELORA_CHECK(rope.type == "default" || rope.type == "yarn", ErrorCode::kUnsupported, f.source(),
                ": field '", params->path(type_key), "' is \"", rope.type,
                "\"; supported RoPE types: default, yarn");
  rope.theta = params->number("rope_theta", rope.theta);
  rope.partial_rotary_factor = params->number("partial_rotary_factor", rope.partial_rotary_factor);
  for (int64_t s : params->integer_list("mrope_section")) rope.mrope_section.push_back(static_cast<int>(s));
  if (rope.type == "yarn") {
    rope.original_max_position_embeddings =
        params->integer("original_max_position_embeddings", max_position_embeddings);
    MOELORA_CHECK(rope.original_max_position_embeddings > 0, ErrorCode::kInvalidFile, f.source(), ": field '",
                  params->path("original_max_position_embeddings"), "' must be positive, got ",
                  rope.original_max_position_embeddings);
    rope.factor = params->has("factor") ? params->number("factor")
                                        : static_cast<double>(max_position_embeddings) /
                                              static_cast<double>(rope.original_max_position_embeddings);
    // transformers: `get("beta_fast") or 32` -- 0 means the default as well
    rope.beta_fast = params->number("beta_fast", 0.0);
    if (rope.beta_fast == 0.0) rope.beta_fast = 32.0;
    rope.beta_slow = params->number("beta_slow", 0.0);
    if (rope.beta_slow == 0.0) rope.beta_slow = 1.0;
    rope.mscale = params->number("mscale", 0.0);
    rope.mscale_all_dim = params->number("mscale_all_dim", 0.0);
    if (params->has("attention_factor")) rope.attention_factor = params->number("attention_factor");
    rope.truncate = params->boolean("truncate", true);
  }
  return rope;
}

// ---- JSON helpers for the writer ----

json eos_to_json(const std::vector<int64_t>& ids) {
  if (ids.size() == 1) return ids[0];
  return ids;
}

json rope_to_json(const RopeConfig& rope, bool qwen35) {
  json r = {{"rope_type", rope.type}, {"rope_theta", rope.theta}};
  if (rope.partial_rotary_factor != 1.0 || qwen35) r["partial_rotary_factor"] = rope.partial_rotary_factor;
  if (!rope.mrope_section.empty()) {
    r["mrope_section"] = rope.mrope_section;
    if (qwen35) r["mrope_interleaved"] = true;
  }
  if (rope.type == "yarn") {
    r["factor"] = rope.factor;
    r["original_max_position_embeddings"] = rope.original_max_position_embeddings;
    r["beta_fast"] = rope.beta_fast;
    r["beta_slow"] = rope.beta_slow;
    if (rope.mscale != 0.0) r["mscale"] = rope.mscale;
    if (rope.mscale_all_dim != 0.0) r["mscale_all_dim"] = rope.mscale_all_dim;
    if (rope.attention_factor) r["attention_factor"] = *rope.attention_factor;
    if (!rope.truncate) r["truncate"] = false;
  }
  return r;
}

std::string read_text(const fs::path& path, const char* what) {
  std::error_code ec;
  MOELORA_CHECK(fs::exists(path, ec), ErrorCode::kNotFound, path.string(), ": cannot read ", what,
                " (no such file)");
  return read_limited_text(path, kMaxJsonFileBytes, what);
}

json parse_json_file(const fs::path& path, const char* what) {
  const std::string text = read_text(path, what);
  check_json_depth(text, path.string());
  // Every JSON exception, not only parse_error: a number too large for a double is out_of_range
  // (406), found by fuzz/fuzz_hf_config; it must end as kInvalidFile like any other bad JSON.
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    MOELORA_THROW(ErrorCode::kInvalidFile, path.string(), ": ", what, " is not valid JSON: ", e.what());
  }
}

// ---- per-family parsing ----

void parse_qwen3_moe(const Fields& f, ModelConfig& c) {
  MOELORA_CHECK(!f.boolean("use_sliding_window", false), ErrorCode::kUnsupported, f.source(), ": field '",
                f.path("use_sliding_window"), "' is true; sliding-window attention is not supported");
  c.num_key_value_heads = f.integer("num_key_value_heads");
  if (f.has("head_dim")) {
    c.head_dim = f.integer("head_dim");
  } else {
    MOELORA_CHECK(c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0,
                  ErrorCode::kInvalidFile, f.source(), ": field '", f.path("head_dim"),
                  "' is absent and hidden_size ", c.hidden_size, " is not divisible by num_attention_heads ",
                  c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.qk_norm = true;
  c.max_position_embeddings = f.integer("max_position_embeddings", 32768);
  c.intermediate_size = f.integer("intermediate_size", 0);
  c.moe_intermediate_size = f.integer("moe_intermediate_size");
  c.num_experts = aliased_integer(f, {"num_experts", "num_local_experts"});
  c.num_experts_per_tok = f.integer("num_experts_per_tok");
  c.norm_topk_prob = f.boolean("norm_topk_prob", false);
  c.decoder_sparse_step = f.integer("decoder_sparse_step", 1);
  c.mlp_only_layers = f.integer_list("mlp_only_layers");
  c.router = RouterKind::kSoftmaxTopK;
}

void parse_qwen35_moe(const Fields& f, ModelConfig& c) {
  c.num_key_value_heads = f.integer("num_key_value_heads");
  c.head_dim = f.integer("head_dim");
  c.qk_norm = true;
  c.attention_output_gate = f.boolean("attn_output_gate", true);
  MOELORA_CHECK(c.attention_output_gate, ErrorCode::kUnsupported, f.source(), ": field '",
                f.path("attn_output_gate"), "' is false; Qwen3.5 attention is always gated in transformers");
  c.norm_style = NormStyle::kOnePlusWeight;
  c.max_position_embeddings = f.integer("max_position_embeddings", 32768);
  c.intermediate_size = f.integer("intermediate_size", 0);
  c.moe_intermediate_size = f.integer("moe_intermediate_size");
  c.shared_expert_intermediate_size = f.integer("shared_expert_intermediate_size");
  c.shared_expert_gate = true;
  c.num_experts = aliased_integer(f, {"num_experts", "num_local_experts"});
  c.num_experts_per_tok = f.integer("num_experts_per_tok");
  c.norm_topk_prob = true;  // no such field: the router always renormalizes
  c.router = RouterKind::kSoftmaxTopK;
  // every decoder layer is MoE (the text config has no decoder_sparse_step / mlp_only_layers)
  c.decoder_sparse_step = 1;
  c.mlp_only_layers.clear();
  if (f.has("layer_types")) {
    c.layer_types = f.string_list("layer_types");
  } else {
    const int64_t interval = f.integer("full_attention_interval", 4);
    MOELORA_CHECK(interval > 0, ErrorCode::kInvalidFile, f.source(), ": field '",
                  f.path("full_attention_interval"), "' must be positive, got ", interval);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      c.layer_types.push_back((i + 1) % interval == 0 ? "full_attention" : "linear_attention");
    }
  }
  c.linear_attention.conv_kernel_dim = f.integer("linear_conv_kernel_dim");
  c.linear_attention.key_head_dim = f.integer("linear_key_head_dim");
  c.linear_attention.value_head_dim = f.integer("linear_value_head_dim");
  c.linear_attention.num_key_heads = f.integer("linear_num_key_heads");
  c.linear_attention.num_value_heads = f.integer("linear_num_value_heads");
}

void parse_deepseek_v3(const Fields& f, ModelConfig& c) {
  const std::string scoring = f.string("scoring_func", "sigmoid");
  MOELORA_CHECK(scoring == "sigmoid", ErrorCode::kUnsupported, f.source(), ": field '",
                f.path("scoring_func"), "' is \"", scoring,
                "\"; DeepSeek-V3 routing supports only \"sigmoid\"");
  const std::string topk_method = f.string("topk_method", "noaux_tc");
  MOELORA_CHECK(topk_method == "noaux_tc", ErrorCode::kUnsupported, f.source(), ": field '",
                f.path("topk_method"), "' is \"", topk_method,
                "\"; DeepSeek-V3 routing supports only \"noaux_tc\"");
  c.use_mla = true;
  c.num_key_value_heads = f.integer("num_key_value_heads", c.num_attention_heads);
  MOELORA_CHECK(f.has("q_lora_rank") || f.is_null("q_lora_rank"), ErrorCode::kInvalidFile, f.source(),
                ": missing field '", f.path("q_lora_rank"), "' (null for a plain q_proj)");
  c.q_lora_rank = f.integer("q_lora_rank", 0);
  c.kv_lora_rank = f.integer("kv_lora_rank");
  c.qk_nope_head_dim = f.integer("qk_nope_head_dim");
  c.qk_rope_head_dim = f.integer("qk_rope_head_dim");
  c.v_head_dim = f.integer("v_head_dim");
  c.head_dim = c.qk_rope_head_dim;  // transformers: head_dim = qk_rope_head_dim (the RoPE width)
  c.max_position_embeddings = f.integer("max_position_embeddings", 4096);
  c.intermediate_size = f.integer("intermediate_size");
  c.moe_intermediate_size = f.integer("moe_intermediate_size");
  c.num_experts = aliased_integer(f, {"n_routed_experts", "num_local_experts"});
  c.num_experts_per_tok = f.integer("num_experts_per_tok");
  MOELORA_CHECK(f.has("n_shared_experts") || f.is_null("n_shared_experts"), ErrorCode::kInvalidFile,
                f.source(), ": missing field '", f.path("n_shared_experts"), "' (0 or null for none)");
  const int64_t n_shared = f.integer("n_shared_experts", 0);
  MOELORA_CHECK(n_shared >= 0, ErrorCode::kInvalidFile, f.source(), ": field '", f.path("n_shared_experts"),
                "' must be >= 0, got ", n_shared);
  c.shared_expert_intermediate_size = c.moe_intermediate_size * n_shared;
  c.router = RouterKind::kSigmoidNoauxTc;
  c.n_group = f.is_null("n_group") ? 1 : f.integer("n_group", 8);
  c.topk_group = f.is_null("topk_group") ? 1 : f.integer("topk_group", 4);
  c.routed_scaling_factor = f.number("routed_scaling_factor", 2.5);
  c.first_k_dense_replace = f.is_null("first_k_dense_replace") ? 0 : f.integer("first_k_dense_replace", 3);
  c.moe_layer_freq = f.integer("moe_layer_freq", 1);
  c.norm_topk_prob = f.is_null("norm_topk_prob") ? true : f.boolean("norm_topk_prob", true);
  c.rope_style = f.boolean("rope_interleave", true) ? RopeStyle::kInterleaved : RopeStyle::kRotateHalf;
  // DeepseekV3Config's defaults (bos 0, eos 1) apply when the ids are given nowhere; an explicit
  // null keeps them unset.
  if (!c.bos_token_id && !f.is_null("bos_token_id")) c.bos_token_id = 0;
  if (c.eos_token_ids.empty() && !f.is_null("eos_token_id")) c.eos_token_ids = {1};
}

// eos_token_id: an int, a list of ints, or null.
std::vector<int64_t> parse_eos(const Fields& f) {
  if (!f.has("eos_token_id")) return {};
  const json& v = f.at("eos_token_id");
  if (v.is_number_integer()) return {f.integer("eos_token_id")};
  std::vector<int64_t> ids = f.integer_list("eos_token_id");  // type-checks the list
  return ids;
}

}  // namespace

// ============================================================================================

const char* architecture_name(Architecture a) {
  switch (a) {
    case Architecture::kQwen3Moe: return "qwen3_moe";
    case Architecture::kQwen35Moe: return "qwen3_5_moe";
    case Architecture::kDeepseekV3: return "deepseek_v3";
  }
  return "unknown";
}

double RopeConfig::yarn_get_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

double RopeConfig::yarn_attention_factor() const {
  if (type != "yarn") return 1.0;
  if (attention_factor) return *attention_factor;
  if (mscale != 0.0 && mscale_all_dim != 0.0) {
    return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim);
  }
  return yarn_get_mscale(factor);
}

int64_t ModelConfig::rotary_dim() const {
  if (use_mla) return qk_rope_head_dim;
  return static_cast<int64_t>(static_cast<double>(head_dim) *
                              rope.partial_rotary_factor);  // int() truncation
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  MOELORA_CHECK(layer >= 0 && layer < num_hidden_layers, ErrorCode::kOutOfRange, "layer ", layer,
                " of a model with ", num_hidden_layers, " layers");
  if (num_experts <= 0) return false;
  if (arch == Architecture::kDeepseekV3) {
    return layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  const bool listed_dense =
      std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end();
  return !listed_dense && (layer + 1) % decoder_sparse_step == 0;
}

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](int64_t value, const char* field) {
    MOELORA_CHECK(value > 0, ErrorCode::kInvalidFile, source, ": ", field, " must be positive, got ", value);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(max_position_embeddings, "max_position_embeddings");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  MOELORA_CHECK(rms_norm_eps > 0, ErrorCode::kInvalidFile, source, ": rms_norm_eps must be positive, got ",
                rms_norm_eps);
  MOELORA_CHECK(num_attention_heads % num_key_value_heads == 0, ErrorCode::kInvalidFile, source,
                ": num_attention_heads ", num_attention_heads, " is not divisible by num_key_value_heads ",
                num_key_value_heads);
  for (int64_t id : eos_token_ids) {
    MOELORA_CHECK(id >= 0 && id < vocab_size, ErrorCode::kInvalidFile, source, ": eos_token_id ", id,
                  " is outside the vocabulary [0, ", vocab_size, ")");
  }
  if (bos_token_id) {
    MOELORA_CHECK(*bos_token_id >= 0 && *bos_token_id < vocab_size, ErrorCode::kInvalidFile, source,
                  ": bos_token_id ", *bos_token_id, " is outside the vocabulary [0, ", vocab_size, ")");
  }

  // attention
  if (use_mla) {
    positive(kv_lora_rank, "kv_lora_rank");
    positive(qk_nope_head_dim, "qk_nope_head_dim");
    positive(qk_rope_head_dim, "qk_rope_head_dim");
    positive(v_head_dim, "v_head_dim");
    MOELORA_CHECK(q_lora_rank >= 0, ErrorCode::kInvalidFile, source,
                  ": q_lora_rank must be >= 0 (or null), got ", q_lora_rank);
    MOELORA_CHECK(head_dim == qk_rope_head_dim, ErrorCode::kInvalidFile, source, ": head_dim ", head_dim,
                  " must equal qk_rope_head_dim ", qk_rope_head_dim, " for MLA");
  } else {
    positive(head_dim, "head_dim");
  }

  // RoPE
  MOELORA_CHECK(rope.type == "default" || rope.type == "yarn", ErrorCode::kUnsupported, source,
                ": RoPE type \"", rope.type, "\"; supported: default, yarn");
  MOELORA_CHECK(rope.theta > 0, ErrorCode::kInvalidFile, source, ": rope_theta must be positive, got ",
                rope.theta);
  MOELORA_CHECK(rope.partial_rotary_factor > 0 && rope.partial_rotary_factor <= 1, ErrorCode::kInvalidFile,
                source, ": partial_rotary_factor must be in (0, 1], got ", rope.partial_rotary_factor);
  const int64_t rot = rotary_dim();
  MOELORA_CHECK(rot > 0 && rot % 2 == 0, ErrorCode::kInvalidFile, source, ": the rotary width (",
                use_mla ? "qk_rope_head_dim" : "head_dim x partial_rotary_factor", ") is ", rot,
                "; it must be positive and even");
  if (rope.type == "yarn") {
    MOELORA_CHECK(rope.factor > 0, ErrorCode::kInvalidFile, source, ": yarn factor must be positive, got ",
                  rope.factor);
    MOELORA_CHECK(rope.original_max_position_embeddings > 0, ErrorCode::kInvalidFile, source,
                  ": yarn original_max_position_embeddings must be positive, got ",
                  rope.original_max_position_embeddings);
  }
  if (!rope.mrope_section.empty()) {
    int64_t sum = 0;
    for (int s : rope.mrope_section) sum += s;
    MOELORA_CHECK(sum * 2 == rot, ErrorCode::kInvalidFile, source, ": mrope_section sums to ", sum,
                  " frequency slots but the rotary width ", rot, " has ", rot / 2);
  }

  // MLP / MoE
  MOELORA_CHECK(num_experts >= 0, ErrorCode::kInvalidFile, source,
                ": the number of experts must be >= 0, got ", num_experts);
  MOELORA_CHECK(decoder_sparse_step >= 1, ErrorCode::kInvalidFile, source,
                ": decoder_sparse_step must be >= 1, got ", decoder_sparse_step);
  MOELORA_CHECK(moe_layer_freq >= 1, ErrorCode::kInvalidFile, source, ": moe_layer_freq must be >= 1, got ",
                moe_layer_freq);
  MOELORA_CHECK(first_k_dense_replace >= 0 && first_k_dense_replace <= num_hidden_layers,
                ErrorCode::kInvalidFile, source, ": first_k_dense_replace ", first_k_dense_replace,
                " is outside [0, num_hidden_layers ", num_hidden_layers, "]");
  for (int64_t layer : mlp_only_layers) {
    MOELORA_CHECK(layer >= 0 && layer < num_hidden_layers, ErrorCode::kInvalidFile, source,
                  ": mlp_only_layers entry ", layer, " is outside [0, ", num_hidden_layers, ")");
  }
  MOELORA_CHECK(shared_expert_intermediate_size >= 0 && intermediate_size >= 0, ErrorCode::kInvalidFile,
                source, ": intermediate sizes must be >= 0");
  bool any_dense = false, any_moe = false;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    (is_moe_layer(layer) ? any_moe : any_dense) = true;
  }
  MOELORA_CHECK(!any_dense || intermediate_size > 0, ErrorCode::kInvalidFile, source,
                ": intermediate_size must be positive because some layers have a dense MLP, got ",
                intermediate_size);
  if (any_moe) {
    positive(moe_intermediate_size, "moe_intermediate_size");
    positive(num_experts_per_tok, "num_experts_per_tok");
    MOELORA_CHECK(num_experts_per_tok <= num_experts, ErrorCode::kInvalidFile, source,
                  ": num_experts_per_tok ", num_experts_per_tok, " exceeds the number of experts ",
                  num_experts);
  }
  if (router == RouterKind::kSigmoidNoauxTc && any_moe) {
    // group-limited top-k: experts split into n_group groups, each scored by its top-2 experts
    MOELORA_CHECK(n_group >= 1, ErrorCode::kInvalidFile, source, ": n_group must be >= 1, got ", n_group);
    MOELORA_CHECK(topk_group >= 1 && topk_group <= n_group, ErrorCode::kInvalidFile, source, ": topk_group ",
                  topk_group, " must be in [1, n_group ", n_group, "]");
    MOELORA_CHECK(num_experts % n_group == 0, ErrorCode::kInvalidFile, source, ": n_routed_experts ",
                  num_experts, " is not divisible by n_group ", n_group);
    const int64_t per_group = num_experts / n_group;
    MOELORA_CHECK(per_group >= 2, ErrorCode::kInvalidFile, source, ": n_routed_experts ", num_experts,
                  " / n_group ", n_group, " = ", per_group,
                  " experts per group; noaux_tc scores a group by its top 2, so at least 2");
    MOELORA_CHECK(topk_group * per_group >= num_experts_per_tok, ErrorCode::kInvalidFile, source,
                  ": topk_group ", topk_group, " groups of ", per_group,
                  " experts hold fewer than num_experts_per_tok ", num_experts_per_tok);
    MOELORA_CHECK(routed_scaling_factor > 0, ErrorCode::kInvalidFile, source,
                  ": routed_scaling_factor must be positive, got ", routed_scaling_factor);
  }

  // Qwen3.5 hybrid layers
  if (arch == Architecture::kQwen35Moe) {
    MOELORA_CHECK(static_cast<int64_t>(layer_types.size()) == num_hidden_layers, ErrorCode::kInvalidFile,
                  source, ": layer_types has ", layer_types.size(), " entries but num_hidden_layers is ",
                  num_hidden_layers);
    for (size_t i = 0; i < layer_types.size(); ++i) {
      MOELORA_CHECK(layer_types[i] == "linear_attention" || layer_types[i] == "full_attention",
                    ErrorCode::kUnsupported, source, ": layer_types[", i, "] is \"", layer_types[i],
                    "\"; supported: linear_attention, full_attention");
    }
    const LinearAttentionConfig& la = linear_attention;
    positive(la.conv_kernel_dim, "linear_conv_kernel_dim");
    positive(la.key_head_dim, "linear_key_head_dim");
    positive(la.value_head_dim, "linear_value_head_dim");
    positive(la.num_key_heads, "linear_num_key_heads");
    positive(la.num_value_heads, "linear_num_value_heads");
    MOELORA_CHECK(la.num_value_heads % la.num_key_heads == 0, ErrorCode::kInvalidFile, source,
                  ": linear_num_value_heads ", la.num_value_heads,
                  " is not divisible by linear_num_key_heads ", la.num_key_heads);
  }

  // quantization
  if (quant.method == QuantMethod::kFp8Block) {
    MOELORA_CHECK(quant.block_n == 128 && quant.block_k == 128, ErrorCode::kUnsupported, source,
                  ": FP8 weight_block_size [", quant.block_n, ", ", quant.block_k,
                  "]; only [128, 128] is supported");
  } else if (quant.method == QuantMethod::kNvfp4) {
    MOELORA_CHECK(quant.group_size == 16, ErrorCode::kUnsupported, source, ": NVFP4 group_size ",
                  quant.group_size, "; only 16 is supported");
  }
}

// ============================================================================================

ModelConfig parse_model_config(const json& config, const std::string& source) {
  MOELORA_CHECK(config.is_object(), ErrorCode::kInvalidFile, source, ": expected a JSON object, got ",
                describe(config));
  const Fields top(config, source, "");
  ModelConfig c;
  c.model_type = top.string("model_type");

  // Which object holds the text model, and how its weights are named.
  bool vlm = false;
  if (c.model_type == "qwen3_moe") {
    c.arch = Architecture::kQwen3Moe;
  } else if (c.model_type == "qwen3_5_moe_text") {
    c.arch = Architecture::kQwen35Moe;
  } else if (c.model_type == "qwen3_5_moe") {
    c.arch = Architecture::kQwen35Moe;
    vlm = true;
    c.weight_prefix = "model.language_model.";
  } else if (c.model_type == "deepseek_v3" || c.model_type == "kimi_k2") {
    c.arch = Architecture::kDeepseekV3;
  } else if (c.model_type == "kimi_k25") {
    c.arch = Architecture::kDeepseekV3;
    vlm = true;
    c.weight_prefix = "language_model.model.";
    c.lm_head_name = "language_model.lm_head";
  } else {
    MOELORA_THROW(ErrorCode::kUnsupported, source, ": model_type \"", c.model_type,
                  "\" is not supported; supported: ", kSupportedModelTypes);
  }
  c.text_model_type = c.model_type;
  if (vlm) {
    MOELORA_CHECK(top.object("text_config") != nullptr, ErrorCode::kInvalidFile, source,
                  ": missing field 'text_config' (model_type ", c.model_type, " keeps its text model there)");
    const Fields t = top.sub("text_config");
    if (c.model_type == "qwen3_5_moe") {
      c.text_model_type = t.string("model_type", "qwen3_5_moe_text");
      MOELORA_CHECK(c.text_model_type == "qwen3_5_moe_text", ErrorCode::kUnsupported, source,
                    ": field 'text_config.model_type' is \"", c.text_model_type,
                    "\"; model_type qwen3_5_moe expects qwen3_5_moe_text");
    } else {
      c.text_model_type = t.string("model_type", "deepseek_v3");  // Kimi_K25Config's default
      MOELORA_CHECK(c.text_model_type == "kimi_k2" || c.text_model_type == "deepseek_v3",
                    ErrorCode::kUnsupported, source, ": field 'text_config.model_type' is \"",
                    c.text_model_type, "\"; model_type kimi_k25 expects kimi_k2 or deepseek_v3");
    }
  }
  const Fields f = vlm ? top.sub("text_config") : top;

  // Fields every family has. The VLM wrappers keep tie_word_embeddings, dtype and
  // quantization_config at the top; token ids may be in either place.
  reject_unsupported_features(f);
  c.vocab_size = f.integer("vocab_size");
  c.hidden_size = f.integer("hidden_size");
  c.num_hidden_layers = f.integer("num_hidden_layers");
  c.num_attention_heads = f.integer("num_attention_heads");
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = top.has("tie_word_embeddings") ? top.boolean("tie_word_embeddings", false)
                                                         : f.boolean("tie_word_embeddings", false);
  const Fields& ids = (f.has("eos_token_id") || !vlm) ? f : top;
  c.eos_token_ids = parse_eos(ids);
  const Fields& bos = (f.has("bos_token_id") || !vlm) ? f : top;
  if (bos.has("bos_token_id")) c.bos_token_id = bos.integer("bos_token_id");
  for (const Fields* where : {&top, &f}) {
    if (c.dtype.empty()) c.dtype = where->string("dtype", where->string("torch_dtype", ""));
  }

  double default_partial_factor = 1.0;
  switch (c.arch) {
    case Architecture::kQwen3Moe: parse_qwen3_moe(f, c); break;
    case Architecture::kQwen35Moe:
      parse_qwen35_moe(f, c);
      default_partial_factor = 0.25;  // Qwen3_5MoeTextConfig's kwargs default
      break;
    case Architecture::kDeepseekV3: parse_deepseek_v3(f, c); break;
  }
  c.rope = parse_rope(f, c.max_position_embeddings, default_partial_factor);

  const Fields& q = top.has("quantization_config") ? top : f;
  if (q.object("quantization_config") != nullptr)
    c.quant = parse_quantization_config(q.sub("quantization_config"));

  c.validate(source);
  return c;
}

ModelConfig load_model_config(const fs::path& dir) {
  std::error_code ec;
  const fs::path config_path = fs::is_regular_file(dir, ec) ? dir : dir / "config.json";
  ModelConfig config = parse_model_config(parse_json_file(config_path, "config.json"), config_path.string());

  const fs::path quant_path = config_path.parent_path() / "hf_quant_config.json";
  if (fs::is_regular_file(quant_path, ec)) {
    const QuantConfig legacy =
        parse_hf_quant_config(parse_json_file(quant_path, "hf_quant_config.json"), quant_path.string());
    if (config.quant.method == QuantMethod::kNone) {
      config.quant = legacy;
      config.validate(quant_path.string());
    } else {
      MOELORA_CHECK(config.quant.method == legacy.method, ErrorCode::kInvalidFile, config_path.string(),
                    ": quantization_config says ", quant_method_name(config.quant.method), " but ",
                    quant_path.string(), " says ", quant_method_name(legacy.method));
    }
  }
  return config;
}

json model_config_to_json(const ModelConfig& c) {
  json t = json::object();  // the text model's fields
  t["model_type"] = c.text_model_type.empty() ? c.model_type : c.text_model_type;
  t["vocab_size"] = c.vocab_size;
  t["hidden_size"] = c.hidden_size;
  t["num_hidden_layers"] = c.num_hidden_layers;
  t["num_attention_heads"] = c.num_attention_heads;
  t["num_key_value_heads"] = c.num_key_value_heads;
  t["max_position_embeddings"] = c.max_position_embeddings;
  t["rms_norm_eps"] = c.rms_norm_eps;
  t["hidden_act"] = "silu";
  t["attention_bias"] = false;
  if (c.bos_token_id) t["bos_token_id"] = *c.bos_token_id;
  t["eos_token_id"] = c.eos_token_ids.empty() ? json(nullptr) : eos_to_json(c.eos_token_ids);
  t["rope_parameters"] = rope_to_json(c.rope, c.arch == Architecture::kQwen35Moe);
  if (c.intermediate_size > 0) t["intermediate_size"] = c.intermediate_size;
  t["moe_intermediate_size"] = c.moe_intermediate_size;
  t["num_experts_per_tok"] = c.num_experts_per_tok;

  std::string architecture;
  switch (c.arch) {
    case Architecture::kQwen3Moe:
      architecture = "Qwen3MoeForCausalLM";
      t["head_dim"] = c.head_dim;
      t["num_experts"] = c.num_experts;
      t["norm_topk_prob"] = c.norm_topk_prob;
      t["decoder_sparse_step"] = c.decoder_sparse_step;
      t["mlp_only_layers"] = c.mlp_only_layers;
      t["use_sliding_window"] = false;
      break;
    case Architecture::kQwen35Moe:
      architecture =
          c.model_type == "qwen3_5_moe" ? "Qwen3_5MoeForConditionalGeneration" : "Qwen3_5MoeForCausalLM";
      t["head_dim"] = c.head_dim;
      t["num_experts"] = c.num_experts;
      t["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
      t["layer_types"] = c.layer_types;
      t["linear_conv_kernel_dim"] = c.linear_attention.conv_kernel_dim;
      t["linear_key_head_dim"] = c.linear_attention.key_head_dim;
      t["linear_value_head_dim"] = c.linear_attention.value_head_dim;
      t["linear_num_key_heads"] = c.linear_attention.num_key_heads;
      t["linear_num_value_heads"] = c.linear_attention.num_value_heads;
      break;
    case Architecture::kDeepseekV3: {
      architecture = c.model_type == "kimi_k25" ? "KimiK25ForConditionalGeneration" : "DeepseekV3ForCausalLM";
      MOELORA_CHECK(
          c.moe_intermediate_size > 0 && c.shared_expert_intermediate_size % c.moe_intermediate_size == 0,
          ErrorCode::kInvalidArgument, "model_config_to_json: shared_expert_intermediate_size ",
          c.shared_expert_intermediate_size, " is not a multiple of moe_intermediate_size ",
          c.moe_intermediate_size, ", so n_shared_experts cannot express it");
      t["n_routed_experts"] = c.num_experts;
      t["n_shared_experts"] = c.shared_expert_intermediate_size / c.moe_intermediate_size;
      t["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr);
      t["kv_lora_rank"] = c.kv_lora_rank;
      t["qk_nope_head_dim"] = c.qk_nope_head_dim;
      t["qk_rope_head_dim"] = c.qk_rope_head_dim;
      t["v_head_dim"] = c.v_head_dim;
      t["n_group"] = c.n_group;
      t["topk_group"] = c.topk_group;
      t["routed_scaling_factor"] = c.routed_scaling_factor;
      t["first_k_dense_replace"] = c.first_k_dense_replace;
      if (c.moe_layer_freq != 1) t["moe_layer_freq"] = c.moe_layer_freq;
      t["norm_topk_prob"] = c.norm_topk_prob;
      t["rope_interleave"] = c.rope_style == RopeStyle::kInterleaved;
      t["scoring_func"] = "sigmoid";
      t["topk_method"] = "noaux_tc";
      if (!c.bos_token_id) t["bos_token_id"] = nullptr;  // else the class default 0 would appear
      break;
    }
  }

  const bool vlm = c.model_type == "qwen3_5_moe" || c.model_type == "kimi_k25";
  json top = vlm ? json::object() : std::move(t);
  if (vlm) {
    top["model_type"] = c.model_type;
    top["text_config"] = std::move(t);
  }
  top["architectures"] = json::array({architecture});
  top["tie_word_embeddings"] = c.tie_word_embeddings;
  if (!c.dtype.empty()) {
    top["dtype"] = c.dtype;
    if (vlm) top["text_config"]["dtype"] = c.dtype;  // as the published VLM configs do
  }
  if (c.quant.method != QuantMethod::kNone) top["quantization_config"] = quant_to_json(c.quant);
  return top;
}

}  // namespace moelora::io
