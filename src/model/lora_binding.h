// LoRA target binding: the adapters a model serves, one per slot, and the per-slot view of each
// target that the operators take.
//
// Slots are what tokens carry: slot s >= 0 means "apply adapter s", slot -1 means "base model
// only" (no LoRA work at all). A batch may mix slots freely. For every layer and target, the
// operators want a vector indexed by slot that holds the slot's factors or nullptr when that
// adapter does not adapt the target:
//   attention projections  -> ops::lora_add_slots_ref       (target())
//   dense MLP              -> ops::mlp_forward_ref          (dense_mlp())
//   routed + shared experts -> ops::moe_forward_ref         (moe())
//
// add() checks an adapter against the base model's actual fp32 weights before it gets a slot:
// same number of layers, every adapted module exists in this architecture (a q_proj LoRA on an
// MLA model with q_lora_rank, a k_proj LoRA on MLA, a dense-MLP LoRA on a MoE layer, ... are
// rejected as "made for another architecture"), and every factor has the shape of that module
// (A [Ea, R, in], B [Eb, out, R], F32, Ea/Eb = 1, or E for routed experts).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "io/hf_config.h"
#include "io/peft.h"
#include "model/weights.h"
#include "ops/moe/moe.h"

namespace moelora::model {

// Pointer to one target of io::LayerLora, e.g. &io::LayerLora::q_proj.
using LoraTargetMember = io::LoraWeights io::LayerLora::*;

class AdapterSet {
 public:
  AdapterSet() = default;
  // `weights` are the base model's fp32 weights (shared with the Model); `config` its config.
  AdapterSet(std::shared_ptr<const ModelWeightsF32> weights, io::ModelConfig config);

  // Validates `adapter` against the base model (see the file comment) and stores it in the next
  // slot, which is returned. kInvalidArgument for an empty or duplicate name; kUnsupported /
  // kInvalidArgument naming the adapter, layer and target for a mismatch.
  int32_t add(io::LoraAdapter adapter);
  // io::load_adapter(dir, config, name, options), then add().
  int32_t load(const std::string& name, const std::filesystem::path& dir,
               const io::AdapterLoadOptions& options = {});

  int32_t size() const { return static_cast<int32_t>(adapters_.size()); }
  bool contains(const std::string& name) const;
  // Slot of a loaded adapter; kNotFound naming the adapter and listing the loaded ones.
  int32_t slot_of(const std::string& name) const;
  // kOutOfRange for a slot outside [0, size()).
  const io::LoraAdapter& adapter(int32_t slot) const;
  std::vector<std::string> names() const;

  // Per-slot factors of `target` in `layer` (entry s for slot s; nullptr = not adapted).
  std::vector<const LoraFactors*> target(int64_t layer, LoraTargetMember target) const;
  // Whether any loaded adapter adapts `target` in `layer`.
  bool any(int64_t layer, LoraTargetMember target) const;
  // Per-slot LoRA of a dense MLP layer (gate, up, down).
  std::vector<ops::MlpLoraRef> dense_mlp(int64_t layer) const;
  // Per-slot LoRA of a MoE layer (routed gate_up / down and the shared expert's gate / up / down).
  std::vector<ops::MoeLoraRef> moe(int64_t layer) const;

 private:
  void validate(const io::LoraAdapter& adapter) const;

  std::shared_ptr<const ModelWeightsF32> weights_;
  io::ModelConfig config_;
  // unique_ptr: the factor pointers handed out stay valid when more adapters are added.
  std::vector<std::unique_ptr<io::LoraAdapter>> adapters_;
};

}  // namespace moelora::model
