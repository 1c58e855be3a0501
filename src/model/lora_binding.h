// LoRA target binding: the adapters a model serves, one per slot, and the per-slot view of each
// target that the operators take.
//
// Slots are what tokens carry: slot s >= 0 means "apply adapter s", slot -1 means "base model
// only" (no LoRA work at all). A batch may mix slots freely. For every layer and target, the
// operators want a vector indexed by slot that holds the slot's factors or nullptr when that
// adapter does not adapt the target:
//   attention projections  -> ops::lora_add_slots_ref       (target(); the Gated DeltaNet's
//                                                            linear_attn projections too)
//   dense MLP              -> ops::mlp_forward_ref          (dense_mlp())
//   routed + shared experts -> ops::moe_forward_ref         (moe())
//
// Two ways to fill slots: add() appends a new slot per adapter (the tools: slots 0, 1, ... in the
// order given), while a serving runtime fixes the slot count once (resize()) and then replaces
// the content of individual slots (set() / clear()) as adapters are loaded and evicted, the way a
// GPU adapter pool rewrites its slot buffers. An empty slot adapts nothing: its entries in the
// per-target vectors are nullptr, so a token carrying it runs the base model only. The runtime
// never schedules a token on an empty slot (its executor checks); the model does not.
//
// add() checks an adapter against the base model's actual fp32 weights before it gets a slot:
// same number of layers, every adapted module exists in this architecture (a q_proj LoRA on an
// MLA model with q_lora_rank, a k_proj LoRA on MLA, a dense-MLP LoRA on a MoE layer, a
// linear_attn LoRA on a full-attention layer or a self_attn one on a Gated DeltaNet layer, ... are
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
  // The checks of add() without storing anything (kInvalidArgument / kUnsupported as add()).
  void check(const io::LoraAdapter& adapter) const;

  // Fixed-slot use. resize(n): n slots, the new ones empty; kInvalidArgument for n < 0 or when
  // a slot that would be dropped holds an adapter.
  void resize(int32_t slots);
  // Validates `adapter` like add() and puts it into `slot`, replacing what was there.
  // kOutOfRange for a slot outside [0, size()); kInvalidArgument for an empty name or a name
  // that another slot holds. Factor pointers handed out earlier for this slot become invalid.
  void set(int32_t slot, io::LoraAdapter adapter);
  // Empties `slot` (a no-op when it is empty already); kOutOfRange outside [0, size()).
  void clear(int32_t slot);
  // Whether `slot` (in [0, size())) holds an adapter.
  bool occupied(int32_t slot) const;

  // Number of slots, empty ones included.
  int32_t size() const { return static_cast<int32_t>(adapters_.size()); }
  bool contains(const std::string& name) const;
  // Slot of a loaded adapter; kNotFound naming the adapter and listing the loaded ones.
  int32_t slot_of(const std::string& name) const;
  // kOutOfRange for a slot outside [0, size()); kNotFound for an empty slot.
  const io::LoraAdapter& adapter(int32_t slot) const;
  // Names of the loaded adapters in slot order (empty slots skipped).
  std::vector<std::string> names() const;

  // Per-slot factors of `target` in `layer` (entry s for slot s; nullptr = not adapted or an
  // empty slot).
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
  void check_slot(int32_t slot) const;

  // unique_ptr: the factor pointers handed out stay valid when more adapters are added.
  // nullptr = an empty slot.
  std::vector<std::unique_ptr<io::LoraAdapter>> adapters_;
};

}  // namespace moelora::model
