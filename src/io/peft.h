// PEFT LoRA adapters, normalized to the canonical form of DESIGN.md §2.
//
// adapter_config.json: r, lora_alpha, use_rslora, target_modules (list, regex string or
// "all-linear"), target_parameters, rank_pattern, alpha_pattern (first matching key in dict
// order; regex `(.*\.)?(key)$` against the module or parameter path), exclude_modules,
// layers_to_transform. Scaling = alpha_eff / r_eff, or alpha_eff / sqrt(r_eff) with rsLoRA.
// rsLoRA together with rank/alpha patterns is accepted and computed the same way (PEFT's own
// transformers-5 conversion produces that combination when it loads per-expert adapters).
//
// adapter_model.safetensors, routed experts in any of:
//   per-expert 2-D   ...mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight  [r, in] / [out, r]
//   PEFT 3-D         ...mlp.experts[.base_layer].lora_A.weight [E*R, in] (row e*R + k),
//                    lora_B.weight [out, E*R] (column k*E + e), from target_parameters
//   stacked 3-D      ...mlp.experts.{gate,up,down}_proj.lora_A.weight [E, r, in], lora_B [E, out,
//   r]
//                    (a fused ...mlp.experts.gate_up_proj.lora_A [E, r, H] / lora_B [E, 2I, r] too)
//   shared-outer     as stacked, with gate/up lora_A [1, r, H] and down lora_B [1, H, r]
// and plain 2-D LoRA on q/k/v/o, MLA q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa /
// kv_b_proj / o_proj, the Gated DeltaNet projections of Qwen3.5's linear-attention layers
// (linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj, only on layers whose
// layer_types entry is "linear_attention"), dense MLP and shared-expert gate/up/down. Keys may
// carry the "base_model.model." prefix (PEFT writes it) or not, and end in "lora_A.weight" or
// "lora_A".
// The two PEFT 3-D wrappers are told apart by their shapes (gate_up_proj: [E*R, H] / [2I, E*R];
// down_proj: [E*R, I] / [H, E*R]), so the nesting order does not matter.
//
// Canonical form per layer and target: A [Ea, R, in], B [Eb, out, R] (fp32), scaling s.
//   - 2-D targets: Ea = Eb = 1.
//   - experts gate_up: one A over the fused [2I] outputs. PEFT 3-D shares A (R = r); per-expert
//     adapters with separate gate and up A become R = r_gate + r_up with block-diagonal B
//     ([gate rows | 0], [0 | up rows]). Shared-outer keeps Ea = 1 for gate_up A and Eb = 1 for
//     down B.
//   - Per-expert ranks that differ (an expert-specific rank_pattern) are zero-padded to the
//     largest one.
//   - Where gate and up (or experts) have different scalings, s is the one of largest magnitude
//     and each part's ratio s_part / s is folded into its B rows, so one s per target is exact
//     (with equal scalings nothing is folded and the factors are the file's values, converted
//     to fp32).
//   - A per-expert adapter is read with the per-expert meaning: each expert projection is its own
//     LoRA with its own alpha/r (or alpha/sqrt(r)). (PEFT 0.21 on transformers 5 converts such an
//     adapter to one rank-2r gate_up LoRA with alpha 2*alpha, which changes the rsLoRA scaling by
//     sqrt(2); tests/data/README.md §3 explains why the engine does not follow that.)
//
// Which tensors may be present: every tensor must adapt a module (or, for PEFT 3-D, a parameter)
// that adapter_config.json targets, as PEFT's check_target_module_exists decides (PEFT 3-D
// tensors are checked against target_parameters when the config lists any; stacked 3-D ones
// against target_modules, or target_parameters' experts.gate_up_proj / down_proj). A targeted
// module without tensors is simply not adapted (PEFT on transformers 5 moves gate_proj/up_proj/
// down_proj targets to the expert parameters, so dense and shared MLPs named by such configs
// often have none). In the per-expert layout, once one expert of a layer has a projection every
// expert the config targets must have it.
//
// Rejected with one clear error (file, tensor or field, expected vs actual):
//   kInvalidFile  malformed adapter_config.json or field types; a lora_A without its lora_B (or
//                 the reverse); ranks that disagree between A and B or with r / rank_pattern;
//                 a tensor of a module the config does not target; missing experts.
//   kUnsupported  DoRA, modules_to_save, lora bias / bias != "none", fan_in_fan_out, activated
//                 LoRA, layer_replication, trainable_token_indices, QA-LoRA; unsupported targets
//                 (embed_tokens, lm_head, the router mlp.gate, shared_expert_gate, the Gated
//                 DeltaNet's linear_attn.conv1d / A_log / dt_bias / norm); an adapter made for
//                 another architecture (a module the base model does not have, e.g. linear_attn
//                 on a full-attention layer or self_attn on a linear-attention one, a layer or
//                 expert index beyond the base model's, in/out features that differ from the base
//                 model's); a rank above AdapterLoadOptions::max_rank;
//                 pickle adapter_model.bin files; factor dtypes other than F32/BF16/F16/F64.
//   kNotFound     a missing adapter_config.json or adapter_model.safetensors.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "io/hf_config.h"

namespace moelora::io {

enum class ExpertLoraLayout { kNone, kPerExpert, kPeft3d, kStacked, kSharedOuter };
const char* expert_lora_layout_name(ExpertLoraLayout l);

struct AdapterConfig {
  int64_t r = 8;  // PEFT's LoraConfig defaults for absent fields
  double lora_alpha = 8;
  bool use_rslora = false;
  bool use_dora = false;
  // exactly one of: list of names, a regex, or "all-linear" (target_all_linear); none of them
  // (target_modules null) means "everything" unless target_parameters is set.
  std::vector<std::string> target_modules;
  std::optional<std::string> target_modules_regex;
  bool target_all_linear =
      false;  // target_modules == "all-linear" (any case): every linear but lm_head
  std::vector<std::string> target_parameters;
  std::vector<std::string> exclude_modules;
  std::optional<std::string> exclude_modules_regex;
  std::vector<std::pair<std::string, int64_t>> rank_pattern;  // dict order kept
  std::vector<std::pair<std::string, double>> alpha_pattern;
  std::vector<int64_t> layers_to_transform;  // empty = all
  std::vector<std::string> layers_pattern;  // regexes naming the layer list ("layers"); empty = any
  std::string base_model_name_or_path;
  std::string bias = "none";
  std::vector<std::string> modules_to_save;
  std::filesystem::path source;  // the adapter_config.json it was read from ("" when built in code)

  // Effective rank and scaling of a module/parameter path such as
  // "model.layers.0.self_attn.q_proj" or "model.layers.1.mlp.experts.gate_up_proj".
  int64_t rank_for(const std::string& path) const;
  double alpha_for(const std::string& path) const;
  double scaling_for(const std::string& path) const;
  // The rank_pattern / alpha_pattern key that applies to `path` (the first in dict order whose
  // regex `(.*\.)?(key)$` matches all of it), or nullopt when r / lora_alpha applies.
  std::optional<std::string> rank_pattern_key(const std::string& path) const;
  std::optional<std::string> alpha_pattern_key(const std::string& path) const;

  // PEFT's check_target_module_exists for a module path without "base_model.model.": excluded
  // modules (exclude_modules list: exact or ".name" suffix; regex: full match) never match; a
  // regex target_modules must match the whole path; a list entry matches the path exactly or as a
  // ".name" suffix; "all-linear" matches everything but lm_head. With layers_to_transform, a
  // list (or all-linear) match also needs the layer index -- the number after the last
  // ".<layers_pattern>." (any component when layers_pattern is empty), as PEFT's regex finds it
  // -- to be listed; an exact list match skips that filter, as in PEFT.
  bool targets_module(const std::string& module_path) const;
  // PEFT's target_parameters rule: a parameter path ("model.layers.1.mlp.experts.down_proj")
  // matches an entry exactly or as a ".entry" suffix. exclude_modules and layers_to_transform do
  // not apply to parameters (PEFT's matching of target_parameters ignores them too).
  bool targets_parameter(const std::string& parameter_path) const;
};

// Reads and validates an adapter_config.json (see the top of this file for what is rejected).
AdapterConfig parse_adapter_config(const std::filesystem::path& file);

using LoraWeights = LoraFactors;  // core/lora.h

struct LayerLora {
  // attention
  LoraWeights q_proj, k_proj, v_proj, o_proj;
  LoraWeights q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj;
  // Gated DeltaNet (Qwen3.5 linear-attention layers; module "linear_attn.<name>")
  LoraWeights in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj;
  // dense MLP (dense layers) and shared expert
  LoraWeights mlp_gate, mlp_up, mlp_down;
  LoraWeights shared_gate, shared_up, shared_down;
  // routed experts: gate_up A [Ea, R, H], B [Eb, 2I, R]; down A [Ea, R, I], B [Eb, H, R]
  LoraWeights experts_gate_up, experts_down;

  // Every target of the layer with its name as a module path below the decoder layer
  // ("self_attn.q_proj", "linear_attn.in_proj_qkv", "mlp.gate_proj", "mlp.shared_expert.up_proj",
  // "mlp.experts.gate_up_proj", ...), adapted or not, in the order above. The shared expert is
  // named after the base model's module ("shared_expert" for Qwen, "shared_experts" for DeepSeek)
  // by load_adapter; a default-constructed LayerLora says "shared_expert".
  std::vector<std::pair<std::string, const LoraWeights*>> named() const;
  std::string shared_expert_module = "shared_expert";
  bool any() const;  // at least one target adapted
};

struct LoraAdapter {
  std::string name;
  std::filesystem::path dir;
  AdapterConfig config;
  ExpertLoraLayout expert_layout = ExpertLoraLayout::kNone;
  int64_t max_rank = 0;              // largest R over all targets
  std::vector<LayerLora> layers;     // one per decoder layer of the base model
  std::vector<std::string> targets;  // human-readable list of what is adapted, for inspect
  int64_t num_tensors = 0;           // LoRA tensors read from adapter_model.safetensors
};

struct AdapterLoadOptions {
  int64_t max_rank = 256;  // the engine's configured maximum
};

// Loads dir/adapter_config.json + dir/adapter_model.safetensors against the base model's config.
LoraAdapter load_adapter(const std::filesystem::path& dir, const ModelConfig& base,
                         const std::string& name, const AdapterLoadOptions& options = {});

// Integers as sorted, de-duplicated ranges for messages: {8, 0, 1, 2, 5, 7} -> "0-2, 5, 7-8".
std::string format_ranges(std::vector<int64_t> values);

}  // namespace moelora::io
