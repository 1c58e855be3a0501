// PEFT LoRA adapters, normalized to the canonical form of DESIGN.md §2.
//
// adapter_config.json: r, lora_alpha, use_rslora, target_modules (list, regex string or
// "all-linear"), target_parameters, rank_pattern, alpha_pattern (first matching key in dict
// order; regex `(.*\.)?(key)$` against the module or parameter path), exclude_modules,
// layers_to_transform. Scaling = alpha_eff / r_eff, or alpha_eff / sqrt(r_eff) with rsLoRA.
//
// adapter_model.safetensors, routed experts in any of:
//   per-expert 2-D   ...mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight  [r, in] / [out, r]
//   PEFT 3-D         ...mlp.experts[.base_layer].lora_A.weight [E*R, in] (row e*R + k),
//                    lora_B.weight [out, E*R] (column k*E + e), from target_parameters
//   stacked 3-D      ...mlp.experts.{gate,up,down}_proj.lora_A.weight [E, r, in], lora_B [E, out, r]
//   shared-outer     as stacked, with gate/up lora_A [1, r, H] and down lora_B [1, H, r]
// and plain 2-D LoRA on q/k/v/o, MLA q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa /
// kv_b_proj / o_proj, dense MLP and shared-expert gate/up/down.
//
// Canonical form per layer and target: A [Ea, R, in], B [Eb, out, R] (fp32), scaling s.
//   - 2-D targets: Ea = Eb = 1.
//   - experts gate_up: one A over the fused [2I] outputs. PEFT 3-D shares A (R = r); per-expert
//     adapters with separate gate and up A become R = 2r with block-diagonal B ([gate rows | 0],
//     [0 | up rows]). Shared-outer keeps Ea = 1 for gate_up A and Eb = 1 for down B.
//   - Where gate and up (or experts) have different scalings, the ratio to the target's scaling
//     is folded into B, so one s per target is exact.
// Rejected with one clear error (file, tensor or field, expected vs actual): DoRA,
// modules_to_save, lora bias, an unknown or unsupported target, shape or rank mismatches with
// the config or the base model, a rank above the configured maximum, an adapter made for another
// architecture (targets or shapes that the base model does not have).
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "io/hf_config.h"

namespace moelora::io {

enum class ExpertLoraLayout { kNone, kPerExpert, kPeft3d, kStacked, kSharedOuter };
const char* expert_lora_layout_name(ExpertLoraLayout l);

struct AdapterConfig {
  int64_t r = 0;
  double lora_alpha = 0;
  bool use_rslora = false;
  bool use_dora = false;
  // exactly one of: list of names, a regex, or "all-linear"
  std::vector<std::string> target_modules;
  std::optional<std::string> target_modules_regex;
  std::vector<std::string> target_parameters;
  std::vector<std::string> exclude_modules;
  std::optional<std::string> exclude_modules_regex;
  std::vector<std::pair<std::string, int64_t>> rank_pattern;  // dict order kept
  std::vector<std::pair<std::string, double>> alpha_pattern;
  std::vector<int64_t> layers_to_transform;  // empty = all
  std::string base_model_name_or_path;
  std::string bias = "none";
  std::vector<std::string> modules_to_save;

  // Effective rank and scaling of a module/parameter path such as
  // "model.layers.0.self_attn.q_proj" or "model.layers.1.mlp.experts.gate_up_proj".
  int64_t rank_for(const std::string& path) const;
  double alpha_for(const std::string& path) const;
  double scaling_for(const std::string& path) const;
};

AdapterConfig parse_adapter_config(const std::filesystem::path& file);

using LoraWeights = LoraFactors;  // core/lora.h

struct LayerLora {
  // attention
  LoraWeights q_proj, k_proj, v_proj, o_proj;
  LoraWeights q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj;
  // dense MLP (dense layers) and shared expert
  LoraWeights mlp_gate, mlp_up, mlp_down;
  LoraWeights shared_gate, shared_up, shared_down;
  // routed experts: gate_up A [Ea, R, H], B [Eb, 2I, R]; down A [Ea, R, I], B [Eb, H, R]
  LoraWeights experts_gate_up, experts_down;
};

struct LoraAdapter {
  std::string name;
  std::filesystem::path dir;
  AdapterConfig config;
  ExpertLoraLayout expert_layout = ExpertLoraLayout::kNone;
  int64_t max_rank = 0;                 // largest R over all targets
  std::vector<LayerLora> layers;        // one per decoder layer of the base model
  std::vector<std::string> targets;     // human-readable list of what is adapted, for inspect
};

struct AdapterLoadOptions {
  int64_t max_rank = 256;  // the engine's configured maximum
};

// Loads dir/adapter_config.json + dir/adapter_model.safetensors against the base model's config.
LoraAdapter load_adapter(const std::filesystem::path& dir, const ModelConfig& base, const std::string& name,
                         const AdapterLoadOptions& options = {});

}  // namespace moelora::io
