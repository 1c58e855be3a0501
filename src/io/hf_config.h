// Hugging Face config.json for the supported MoE families, normalized into one ModelConfig.
//
// Accepted model_type values:
//   qwen3_moe                     Qwen3-MoE (Qwen3-30B-A3B, ...)
//   qwen3_5_moe / qwen3_5_moe_text  Qwen3.5-MoE; the VLM form keeps the text model in text_config
//                                 (parsed only: the CPU model of this family is not built yet)
//   deepseek_v3, kimi_k2          DeepSeek-V3 / Kimi-K2 (MLA, noaux_tc routing)
//   kimi_k25                      Kimi-K2.5; text model in text_config
// RoPE is read from `rope_parameters` (transformers 5) or the legacy `rope_theta` /
// `rope_scaling` (with `type` or `rope_type`) / top-level `partial_rotary_factor` keys.
// Quantization: `quantization_config` with quant_method "fp8" (block [128, 128]) or
// "modelopt" NVFP4, or a ModelOpt `hf_quant_config.json` beside config.json.
// Every missing required field or bad value throws moelora::Error naming the file and the field.
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
  // YaRN
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;  // 0 = absent
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;          // used by the attention_factor default
  double mscale_all_dim = 0.0;  // 0 = absent
  std::optional<double> attention_factor;  // explicit value, else derived (see ops/rope)
  bool truncate = true;
  std::vector<int> mrope_section;  // Qwen3.5 (text-only input reduces to plain partial RoPE)
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
  // True when `module` (e.g. "model.layers.0.mlp.gate") matches one of the patterns.
  bool is_excluded(const std::string& module) const;
};

struct ModelConfig {
  Architecture arch = Architecture::kQwen3Moe;
  std::string model_type;       // top-level model_type as written
  std::string text_model_type;  // model_type of text_config when present, else = model_type
  std::string weight_prefix = "model.";  // "model." or "model.language_model." (Qwen3.5 VLM)

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
  int64_t head_dim = 0;
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
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // per routed expert (I)
  int64_t num_experts = 0;            // routed experts (E)
  int64_t num_experts_per_tok = 0;    // k
  int64_t shared_expert_intermediate_size = 0;  // 0 = no shared expert
  bool shared_expert_gate = false;    // Qwen: shared output *= sigmoid(x Wsg^T)
  bool norm_topk_prob = false;
  RouterKind router = RouterKind::kSoftmaxTopK;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;  // DeepSeek: layers < this are dense
  int64_t decoder_sparse_step = 1;    // Qwen: layer is MoE when (i+1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and i not in mlp_only_layers
  std::vector<std::string> layer_types;  // Qwen3.5: "linear_attention" / "full_attention"

  QuantConfig quant;

  bool is_moe_layer(int64_t layer) const;
  // Query/key head width used for attention scores (GQA: head_dim; MLA: nope + rope).
  int64_t qk_head_dim() const { return use_mla ? qk_nope_head_dim + qk_rope_head_dim : head_dim; }
  // Width RoPE rotates: head_dim * partial_rotary_factor (MLA: qk_rope_head_dim).
  int64_t rotary_dim() const;
  // Checks internal consistency (router group constraints, head divisibility, ...).
  void validate(const std::string& source) const;
};

// Reads dir/config.json (and dir/hf_quant_config.json when present).
ModelConfig load_model_config(const std::filesystem::path& dir);
// Parses an already-loaded config.json; `source` names it in errors.
ModelConfig parse_model_config(const nlohmann::json& config, const std::string& source);
// Serializes back to a Hugging Face config.json (used by `moelora synth`).
nlohmann::json model_config_to_json(const ModelConfig& config);

}  // namespace moelora::io
