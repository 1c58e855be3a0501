// AdapterSet: slots of loaded adapters (appended or fixed and replaced) and their per-target
// binding (see lora_binding.h).
#include "model/lora_binding.h"

#include <algorithm>
#include <utility>

namespace moelora::model {

namespace {

// One LoRA target of a layer with the base weight it adapts.
struct TargetSpec {
  const char* name;
  LoraTargetMember member;
};

constexpr TargetSpec kPlainTargets[] = {
    {"q_proj", &io::LayerLora::q_proj},
    {"k_proj", &io::LayerLora::k_proj},
    {"v_proj", &io::LayerLora::v_proj},
    {"o_proj", &io::LayerLora::o_proj},
    {"q_a_proj", &io::LayerLora::q_a_proj},
    {"q_b_proj", &io::LayerLora::q_b_proj},
    {"kv_a_proj_with_mqa", &io::LayerLora::kv_a_proj_with_mqa},
    {"kv_b_proj", &io::LayerLora::kv_b_proj},
    {"linear_attn.in_proj_qkv", &io::LayerLora::in_proj_qkv},
    {"linear_attn.in_proj_z", &io::LayerLora::in_proj_z},
    {"linear_attn.in_proj_b", &io::LayerLora::in_proj_b},
    {"linear_attn.in_proj_a", &io::LayerLora::in_proj_a},
    {"linear_attn.out_proj", &io::LayerLora::out_proj},
    {"mlp.gate_proj", &io::LayerLora::mlp_gate},
    {"mlp.up_proj", &io::LayerLora::mlp_up},
    {"mlp.down_proj", &io::LayerLora::mlp_down},
    {"shared_expert.gate_proj", &io::LayerLora::shared_gate},
    {"shared_expert.up_proj", &io::LayerLora::shared_up},
    {"shared_expert.down_proj", &io::LayerLora::shared_down},
};

bool is_linear_attention_target(LoraTargetMember member) {
  return member == &io::LayerLora::in_proj_qkv || member == &io::LayerLora::in_proj_z ||
         member == &io::LayerLora::in_proj_b || member == &io::LayerLora::in_proj_a ||
         member == &io::LayerLora::out_proj;
}

bool is_attention_target(LoraTargetMember member) {
  return member == &io::LayerLora::q_proj || member == &io::LayerLora::k_proj ||
         member == &io::LayerLora::v_proj || member == &io::LayerLora::o_proj ||
         member == &io::LayerLora::q_a_proj || member == &io::LayerLora::q_b_proj ||
         member == &io::LayerLora::kv_a_proj_with_mqa || member == &io::LayerLora::kv_b_proj;
}

// The base weight [out, in] that a plain target adapts in `layer`, or an undefined tensor when
// the layer has no such module: self_attn targets exist on full-attention layers only, the Gated
// DeltaNet's linear_attn targets on linear-attention layers only. Shared-expert gate/up are the
// halves of shared_w13.
Tensor base_weight(const LayerWeightsF32& layer, LoraTargetMember member) {
  if (is_attention_target(member) && layer.is_linear_attention) return Tensor();
  if (is_linear_attention_target(member) && !layer.is_linear_attention) return Tensor();
  const LinearAttentionWeightsF32& g = layer.linear_attn;
  if (member == &io::LayerLora::in_proj_qkv) return g.in_proj_qkv;
  if (member == &io::LayerLora::in_proj_z) return g.in_proj_z;
  if (member == &io::LayerLora::in_proj_b) return g.in_proj_b;
  if (member == &io::LayerLora::in_proj_a) return g.in_proj_a;
  if (member == &io::LayerLora::out_proj) return g.out_proj;
  const AttentionWeightsF32& a = layer.attention;
  if (member == &io::LayerLora::q_proj) return a.q_proj;
  if (member == &io::LayerLora::k_proj) return a.k_proj;
  if (member == &io::LayerLora::v_proj) return a.v_proj;
  if (member == &io::LayerLora::o_proj) return a.o_proj;
  if (member == &io::LayerLora::q_a_proj) return a.q_a_proj;
  if (member == &io::LayerLora::q_b_proj) return a.q_b_proj;
  if (member == &io::LayerLora::kv_a_proj_with_mqa) return a.kv_a_proj_with_mqa;
  if (member == &io::LayerLora::kv_b_proj) return a.kv_b_proj;
  if (member == &io::LayerLora::mlp_gate) return layer.mlp_gate;
  if (member == &io::LayerLora::mlp_up) return layer.mlp_up;
  if (member == &io::LayerLora::mlp_down) return layer.mlp_down;
  const Tensor& w13 = layer.moe.shared_w13;
  if (!w13.defined()) return Tensor();
  const int64_t shared_inter = w13.dim(0) / 2;
  if (member == &io::LayerLora::shared_gate) return w13.slice0(0, shared_inter);
  if (member == &io::LayerLora::shared_up) return w13.slice0(shared_inter, 2 * shared_inter);
  if (member == &io::LayerLora::shared_down) return layer.moe.shared_w2;
  return Tensor();
}

// What a layer's token mixer is, for messages.
std::string attention_kind(const LayerWeightsF32& layer, const io::ModelConfig& config) {
  if (layer.is_linear_attention) return "Gated DeltaNet linear attention";
  if (config.use_mla) return "MLA attention";
  return config.attention_output_gate ? "gated GQA attention" : "GQA attention";
}

std::string adapter_label(const io::LoraAdapter& adapter) {
  std::string label = "adapter '" + adapter.name + "'";
  if (!adapter.dir.empty()) label += " (" + adapter.dir.string() + ")";
  return label;
}

// Checks A [Ea, R, in], B [Eb, out, R] F32 with Ea, Eb in {1, experts}.
void check_factors(const LoraFactors& f, int64_t experts, int64_t in, int64_t out,
                   const std::string& what) {
  const auto bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(f.b.defined(), bad, what, ": lora A is set but lora B is missing");
  check_dtype(f.a, DType::kF32, what + " lora A");
  check_dtype(f.b, DType::kF32, what + " lora B");
  MOELORA_CHECK(f.a.ndim() == 3 && f.b.ndim() == 3, bad, what, ": lora factors must be 3-D, got A ",
                shape_str(f.a.shape()), " and B ", shape_str(f.b.shape()));
  const int64_t ea = f.a.dim(0), rank = f.a.dim(1), eb = f.b.dim(0);
  const std::string lead = experts == 1 ? "1" : "1 or " + std::to_string(experts);
  MOELORA_CHECK(rank > 0, bad, what, ": lora rank is 0");
  MOELORA_CHECK((ea == 1 || ea == experts) && f.a.dim(2) == in, bad, what, ": lora A has shape ",
                shape_str(f.a.shape()), ", expected [", lead, ", R, ", in, "]");
  MOELORA_CHECK((eb == 1 || eb == experts) && f.b.dim(1) == out && f.b.dim(2) == rank, bad, what,
                ": lora B has shape ", shape_str(f.b.shape()), ", expected [", lead, ", ", out,
                ", ", rank, "]");
}

}  // namespace

AdapterSet::AdapterSet(std::shared_ptr<const ModelWeightsF32> weights, io::ModelConfig config)
    : weights_(std::move(weights)), config_(std::move(config)) {}

void AdapterSet::validate(const io::LoraAdapter& adapter) const {
  MOELORA_ASSERT(weights_ != nullptr, "AdapterSet used without a model");
  const std::string label = adapter_label(adapter);
  const int64_t num_layers = static_cast<int64_t>(weights_->layers.size());
  MOELORA_CHECK(static_cast<int64_t>(adapter.layers.size()) == num_layers,
                ErrorCode::kInvalidArgument, label, " has LoRA weights for ", adapter.layers.size(),
                " layers but the model has ", num_layers, " layers: it was made for another model");
  const char* arch = io::architecture_name(config_.arch);
  for (int64_t l = 0; l < num_layers; ++l) {
    const io::LayerLora& lora = adapter.layers[l];
    const LayerWeightsF32& layer = weights_->layers[l];
    for (const TargetSpec& spec : kPlainTargets) {
      const LoraFactors& f = lora.*spec.member;
      if (!f.defined()) continue;
      const Tensor base = base_weight(layer, spec.member);
      MOELORA_CHECK(base.defined(), ErrorCode::kUnsupported, label, " adapts ", spec.name,
                    " of layer ", l, ", which this ", arch, " model does not have (",
                    layer.is_moe ? "MoE" : "dense", " layer, ", attention_kind(layer, config_),
                    "): the adapter was made for another architecture");
      check_factors(f, 1, base.dim(1), base.dim(0),
                    label + " layer " + std::to_string(l) + " " + spec.name);
    }
    for (const auto& [name, member] :
         {std::pair{"experts.gate_up_proj", &io::LayerLora::experts_gate_up},
          std::pair{"experts.down_proj", &io::LayerLora::experts_down}}) {
      const LoraFactors& f = lora.*member;
      if (!f.defined()) continue;
      MOELORA_CHECK(layer.is_moe, ErrorCode::kUnsupported, label, " adapts ", name, " of layer ", l,
                    ", which is a dense layer of this ", arch,
                    " model: the adapter was made for another architecture");
      const Tensor& w = member == &io::LayerLora::experts_gate_up ? layer.moe.w13 : layer.moe.w2;
      check_factors(f, w.dim(0), w.dim(2), w.dim(1),
                    label + " layer " + std::to_string(l) + " " + name);
    }
  }
}

int32_t AdapterSet::add(io::LoraAdapter adapter) {
  MOELORA_CHECK(!adapter.name.empty(), ErrorCode::kInvalidArgument,
                "an adapter needs a non-empty name");
  MOELORA_CHECK(!contains(adapter.name), ErrorCode::kInvalidArgument, "adapter name '",
                adapter.name, "' is already loaded");
  validate(adapter);
  adapters_.push_back(std::make_unique<io::LoraAdapter>(std::move(adapter)));
  return size() - 1;
}

void AdapterSet::check(const io::LoraAdapter& adapter) const {
  MOELORA_CHECK(!adapter.name.empty(), ErrorCode::kInvalidArgument,
                "an adapter needs a non-empty name");
  validate(adapter);
}

void AdapterSet::check_slot(int32_t slot) const {
  MOELORA_CHECK(slot >= 0 && slot < size(), ErrorCode::kOutOfRange, "adapter slot ", slot,
                " is not in [0, ", size(), ")");
}

void AdapterSet::resize(int32_t slots) {
  MOELORA_CHECK(slots >= 0, ErrorCode::kInvalidArgument, "adapter slot count must be >= 0, got ",
                slots);
  for (int32_t s = slots; s < size(); ++s) {
    MOELORA_CHECK(adapters_[s] == nullptr, ErrorCode::kInvalidArgument, "cannot shrink to ", slots,
                  " adapter slots: slot ", s, " holds adapter '", adapters_[s]->name, "'");
  }
  adapters_.resize(static_cast<size_t>(slots));
}

void AdapterSet::set(int32_t slot, io::LoraAdapter adapter) {
  check_slot(slot);
  MOELORA_CHECK(!adapter.name.empty(), ErrorCode::kInvalidArgument,
                "an adapter needs a non-empty name");
  for (int32_t s = 0; s < size(); ++s) {
    MOELORA_CHECK(s == slot || adapters_[s] == nullptr || adapters_[s]->name != adapter.name,
                  ErrorCode::kInvalidArgument, "adapter name '", adapter.name,
                  "' is already loaded in slot ", s);
  }
  validate(adapter);
  adapters_[slot] = std::make_unique<io::LoraAdapter>(std::move(adapter));
}

void AdapterSet::clear(int32_t slot) {
  check_slot(slot);
  adapters_[slot].reset();
}

bool AdapterSet::occupied(int32_t slot) const {
  check_slot(slot);
  return adapters_[slot] != nullptr;
}

int32_t AdapterSet::load(const std::string& name, const std::filesystem::path& dir,
                         const io::AdapterLoadOptions& options) {
  MOELORA_CHECK(!name.empty(), ErrorCode::kInvalidArgument, "an adapter needs a non-empty name (",
                dir.string(), ")");
  MOELORA_CHECK(!contains(name), ErrorCode::kInvalidArgument, "adapter name '", name,
                "' is already loaded");
  return add(io::load_adapter(dir, config_, name, options));
}

bool AdapterSet::contains(const std::string& name) const {
  return std::any_of(adapters_.begin(), adapters_.end(),
                     [&](const auto& a) { return a && a->name == name; });
}

int32_t AdapterSet::slot_of(const std::string& name) const {
  for (int32_t s = 0; s < size(); ++s) {
    if (adapters_[s] && adapters_[s]->name == name) return s;
  }
  std::string known;
  for (const std::string& n : names()) known += (known.empty() ? "" : ", ") + n;
  MOELORA_THROW(ErrorCode::kNotFound, "unknown adapter '", name, "'; ",
                known.empty() ? std::string("no adapters are loaded") : "loaded: " + known);
}

const io::LoraAdapter& AdapterSet::adapter(int32_t slot) const {
  check_slot(slot);
  MOELORA_CHECK(adapters_[slot] != nullptr, ErrorCode::kNotFound, "adapter slot ", slot,
                " is empty");
  return *adapters_[slot];
}

std::vector<std::string> AdapterSet::names() const {
  std::vector<std::string> out;
  for (const auto& a : adapters_) {
    if (a) out.push_back(a->name);
  }
  return out;
}

std::vector<const LoraFactors*> AdapterSet::target(int64_t layer, LoraTargetMember member) const {
  std::vector<const LoraFactors*> out(adapters_.size(), nullptr);
  for (size_t s = 0; s < adapters_.size(); ++s) {
    if (!adapters_[s]) continue;
    const LoraFactors& f = adapters_[s]->layers[layer].*member;
    if (f.defined()) out[s] = &f;
  }
  return out;
}

bool AdapterSet::any(int64_t layer, LoraTargetMember member) const {
  return std::any_of(adapters_.begin(), adapters_.end(),
                     [&](const auto& a) { return a && (a->layers[layer].*member).defined(); });
}

std::vector<ops::MlpLoraRef> AdapterSet::dense_mlp(int64_t layer) const {
  std::vector<ops::MlpLoraRef> out(adapters_.size());
  for (size_t s = 0; s < adapters_.size(); ++s) {
    if (!adapters_[s]) continue;  // empty slot: value-initialized, all nullptr
    const io::LayerLora& l = adapters_[s]->layers[layer];
    out[s] = {l.mlp_gate.defined() ? &l.mlp_gate : nullptr,
              l.mlp_up.defined() ? &l.mlp_up : nullptr,
              l.mlp_down.defined() ? &l.mlp_down : nullptr};
  }
  return out;
}

std::vector<ops::MoeLoraRef> AdapterSet::moe(int64_t layer) const {
  std::vector<ops::MoeLoraRef> out(adapters_.size());
  auto ptr = [](const LoraFactors& f) { return f.defined() ? &f : nullptr; };
  for (size_t s = 0; s < adapters_.size(); ++s) {
    if (!adapters_[s]) continue;  // empty slot: value-initialized, all nullptr
    const io::LayerLora& l = adapters_[s]->layers[layer];
    out[s] = {ptr(l.experts_gate_up), ptr(l.experts_down), ptr(l.shared_gate), ptr(l.shared_up),
              ptr(l.shared_down)};
  }
  return out;
}

}  // namespace moelora::model
