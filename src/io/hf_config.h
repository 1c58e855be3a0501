// Hugging Face config.json for the supported MoE families, normalized into one ModelConfig.
//
// Accepted model_type values:
//   qwen3_moe                     Qwen3-MoE (Qwen3-30B-A3B, ...)
//   qwen3_5_moe / qwen3_5_moe_text  Qwen3.5-MoE; the VLM form keeps the text model in text_config
//                                 (parsed only: the CPU model of this family is not built yet)
//   deepseek_v3, kimi_k2          DeepSeek-V3 / Kimi-K2 (MLA, noaux_tc routing)
//   kimi_k25                      Kimi-K2.5; text model (kimi_k2 or deepseek_v3) in text_config
// RoPE is read from `rope_parameters` (transformers 5) or the legacy `rope_theta` /
// `rope_scaling` (with `type` or `rope_type`) / top-level `partial_rotary_factor` keys; like
// transformers, a non-empty `rope_scaling` wins over `rope_parameters`. Supported rope types:
// "default" and "yarn".
// Quantization: `quantization_config` with quant_method "fp8" (block [128, 128]) or
// "modelopt" NVFP4, or a ModelOpt `hf_quant_config.json` beside config.json.
//
// Defaults follow the transformers config classes for behavioural fields (rms_norm_eps,
// norm_topk_prob, decoder_sparse_step, n_group, routed_scaling_factor, ...). Fields that define
// weight shapes (vocab, hidden, layers, heads, expert sizes and counts, MLA ranks, linear
// attention sizes) are required, except Qwen3-MoE's head_dim (hidden / heads when absent) and
// DeepSeek's num_key_value_heads (= heads). A JSON null counts as absent; q_lora_rank null
// means a plain q_proj (0), n_group / topk_group null mean 1.
// Every missing required field or bad value throws moelora::Error naming the file and the field
// (kInvalidFile), or the unsupported value and the supported ones (kUnsupported).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/model_enums.h"

namespace moelora::io {

enum class Architecture { kQwen3Moe, kQwen35Moe, kDeepseekV3 };
enum class QuantMethod { kNone, kFp8Block, kNvfp4 };

const char* architecture_name(Architecture a);
const char* quant_method_name(QuantMethod q);

struct RopeConfig {
  std::string type = "default";  // "default" or "yarn"
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;
  // YaRN (values as transformers uses them after its defaults are applied)
  double factor = 1.0;  // when absent: max_position_embeddings / original_max_position_embeddings
  int64_t original_max_position_embeddings = 0;  // yarn: max_position_embeddings when absent; default: 0
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;                     // 0 = absent
  double mscale_all_dim = 0.0;             // 0 = absent; DeepSeek also scales the MLA softmax with it
  std::optional<double> attention_factor;  // explicit value, else yarn_attention_factor() derives it
  bool truncate = true;
  std::vector<int> mrope_section;  // Qwen3.5 (text-only input reduces to plain partial RoPE)

  // The factor cos and sin are multiplied by: 1 for "default"; for "yarn" the explicit
  // attention_factor, else get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when
  // both are given, else get_mscale(factor) (transformers _compute_yarn_parameters).
  double yarn_attention_factor() const;
  // 0.1 * m * ln(s) + 1 for s > 1, else 1.
  static double yarn_get_mscale(double scale, double m = 1.0);

  bool operator==(const RopeConfig&) const = default;
};

struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;
  int block_n = 128, block_k = 128;  // FP8 weight_block_size
  int group_size = 16;               // NVFP4
  std::string activation_scheme;     // "dynamic" for FP8
  std::string scale_fmt;             // "" or "ue8m0"
  std::string kv_cache_quant_algo;   // NVFP4 exports: "" or "FP8"
  // Module name patterns left unquantized (modules_to_not_convert / ignore / exclude_modules /
  // ignored_layers); ModelOpt patterns use '*' wildcards.
  std::vector<std::string> modules_to_not_convert;
  std::string source;  // "config.json" or "hf_quant_config.json"

  // True when `module` (a dotted module name, e.g. "model.layers.0.mlp.gate") matches one of the
  // patterns. A pattern matches when it equals, as a glob in which '*' stands for any run of
  // characters (dots included, as in fnmatch), either
  //   - the module or one of its ancestors: "model.layers.3" and "model.layers.*.self_attn"
  //     exclude everything below them; or
  //   - a trailing run of whole components of the module: "lm_head" matches
  //     "language_model.lm_head", "mlp.gate" matches "model.layers.7.mlp.gate" (but "gate" does
  //     not match "mlp.shared_expert_gate").
  // A trailing '.' on a pattern is ignored ("model.layers.11." = "model.layers.11"). This covers
  // the transformers rules for modules_to_not_convert (prefix, exact, suffix) and ModelOpt's
  // wildcard exclude lists, without transformers' unanchored suffix test (which would let
  // "gate" exclude "shared_expert_gate").
  bool is_excluded(const std::string& module) const;

  // Equality ignores `source`: the same quantization read from either file compares equal.
  bool operator==(const QuantConfig& other) const;
};

// Qwen3.5 Gated DeltaNet ("linear_attention") layer sizes.
struct LinearAttentionConfig {
  int64_t conv_kernel_dim = 0;  // linear_conv_kernel_dim
  int64_t key_head_dim = 0;     // linear_key_head_dim (dk)
  int64_t value_head_dim = 0;   // linear_value_head_dim (dv)
  int64_t num_key_heads = 0;    // linear_num_key_heads (nk)
  int64_t num_value_heads = 0;  // linear_num_value_heads (nv), a multiple of nk
  bool operator==(const LinearAttentionConfig&) const = default;
};

struct ModelConfig {
  Architecture arch = Architecture::kQwen3Moe;
  std::string model_type;       // top-level model_type as written
  std::string text_model_type;  // model_type of text_config when present, else = model_type
  // Prefix of the decoder's weights in the checkpoint: "model." (Qwen3-MoE, DeepSeek, Kimi-K2,
  // qwen3_5_moe_text as transformers saves it), "model.language_model." (Qwen3.5 VLM; transformers
  // also loads such checkpoints into qwen3_5_moe_text by dropping "language_model."),
  // "language_model.model." (Kimi-K2.5, whose original checkpoints keep the llava layout;
  // transformers renames it to "model.language_model." on load).
  std::string weight_prefix = "model.";
  // Module name of the output projection: "lm_head", or "language_model.lm_head" (Kimi-K2.5).
  std::string lm_head_name = "lm_head";
  std::string dtype;  // "dtype" / "torch_dtype" as written ("bfloat16", ...); "" when absent

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  NormStyle norm_style = NormStyle::kWeight;
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;  // eos_token_id (int or list)
  std::optional<int64_t> bos_token_id;

  // Attention (GQA): q/k/v/o, optional per-head q_norm / k_norm (Qwen3)
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // MLA: qk_rope_head_dim, as transformers sets it
  bool qk_norm = false;
  bool attention_output_gate = false;  // Qwen3.5 gated attention
  // MLA (DeepSeek-V3 / Kimi)
  bool use_mla = false;
  int64_t q_lora_rank = 0;  // 0 = plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  RopeConfig rope;
  RopeStyle rope_style = RopeStyle::kRotateHalf;

  // MLP / MoE
  int64_t intermediate_size = 0;                // dense MLP layers (0 when the model has none)
  int64_t moe_intermediate_size = 0;            // per routed expert (I)
  int64_t num_experts = 0;                      // routed experts (E)
  int64_t num_experts_per_tok = 0;              // k
  int64_t shared_expert_intermediate_size = 0;  // 0 = no shared expert
  bool shared_expert_gate = false;              // Qwen: shared output *= sigmoid(x Wsg^T)
  bool norm_topk_prob = false;
  RouterKind router = RouterKind::kSoftmaxTopK;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;       // DeepSeek: layers < this are dense ...
  int64_t moe_layer_freq = 1;              // ... and so are layers with i % moe_layer_freq != 0
  int64_t decoder_sparse_step = 1;         // Qwen: layer is MoE when (i+1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;    // ... and i not in mlp_only_layers
  std::vector<std::string> layer_types;    // Qwen3.5: "linear_attention" / "full_attention"
  LinearAttentionConfig linear_attention;  // Qwen3.5

  QuantConfig quant;

  // Whether decoder layer `layer` (0-based, < num_hidden_layers; kOutOfRange otherwise) has a
  // routed-expert MLP rather than a dense one.
  bool is_moe_layer(int64_t layer) const;
  // Query/key head width used for attention scores (GQA: head_dim; MLA: nope + rope).
  int64_t qk_head_dim() const { return use_mla ? qk_nope_head_dim + qk_rope_head_dim : head_dim; }
  // Width RoPE rotates: int(head_dim * partial_rotary_factor) (MLA: qk_rope_head_dim).
  int64_t rotary_dim() const;
  // Checks internal consistency (router group constraints, head divisibility, ...); throws
  // kInvalidFile naming `source` and the fields, or kUnsupported for unsupported quantization.
  void validate(const std::string& source) const;

  bool operator==(const ModelConfig&) const = default;
};

// Reads dir/config.json (and dir/hf_quant_config.json when present; config.json's own
// quantization_config wins, and the two must not name different methods). `dir` may also be
// the path of a config.json file.
ModelConfig load_model_config(const std::filesystem::path& dir);
// Parses an already-loaded config.json; `source` names it in errors.
ModelConfig parse_model_config(const nlohmann::json& config, const std::string& source);
// Parses a ModelOpt hf_quant_config.json; `source` names it in errors.
QuantConfig parse_hf_quant_config(const nlohmann::json& config, const std::string& source);
// Serializes back to a Hugging Face config.json (used by `moelora synth`): the field names
// transformers 5 reads, "architectures", RoPE as `rope_parameters`, and quantization_config.
// parse_model_config(model_config_to_json(c), ...) == c for every valid c.
nlohmann::json model_config_to_json(const ModelConfig& config);
// A ModelOpt hf_quant_config.json for an NVFP4 QuantConfig (kInvalidArgument for other methods).
nlohmann::json hf_quant_config_to_json(const QuantConfig& quant);

}  // namespace moelora::io
