// PEFT LoRA adapter loading: adapter_model.safetensors normalized to the canonical
// A [Ea, R, in] / B [Eb, out, R] form of DESIGN.md §2 for the base model's architecture (see
// io/peft.h for the accepted layouts). adapter_config.json and PEFT's matching and scaling rules
// are in peft_config.cpp, the module classification in peft_modules.cpp, the routed-expert
// layouts and the canonical assembly in peft_experts.cpp.
//
// Loading works in three passes over the tensor names, so that adapters with tens of thousands of
// tensors (48 layers x 128 experts x 6) cost O(n log n):
//   1. every key is split into a module path and a factor (lora_A / lora_B) and the module is
//      classified against the base model (which layer, which target, which expert layout);
//      anything the base model does not have is rejected here, naming the key;
//   2. the pairs are checked (every A has its B) and grouped per layer and target;
//   3. each target's factors are validated (shapes, ranks vs adapter_config.json) and written
//      once, straight from the mmap'ed file, into freshly allocated fp32 canonical tensors.
#include "io/peft.h"
#include "io/peft_internal.h"
#include "io/peft_loader.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>
#include <string_view>

#include "core/error.h"
#include "io/safetensors.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using peft_detail::ends_with;
using peft_detail::last_component;
using peft_detail::parse_index;
using peft_detail::starts_with;

constexpr std::string_view kPeftPrefix = "base_model.model.";

std::string format_number(double value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ExpertLoraLayout

const char* expert_lora_layout_name(ExpertLoraLayout l) {
  switch (l) {
    case ExpertLoraLayout::kNone: return "none";
    case ExpertLoraLayout::kPerExpert: return "per-expert";
    case ExpertLoraLayout::kPeft3d: return "peft-3d";
    case ExpertLoraLayout::kStacked: return "stacked";
    case ExpertLoraLayout::kSharedOuter: return "shared-outer";
  }
  return "?";
}
// ---------------------------------------------------------------------------------------------
// LayerLora

std::vector<std::pair<std::string, const LoraWeights*>> LayerLora::named() const {
  const std::string shared = "mlp." + shared_expert_module + ".";
  return {{"self_attn.q_proj", &q_proj},
          {"self_attn.k_proj", &k_proj},
          {"self_attn.v_proj", &v_proj},
          {"self_attn.o_proj", &o_proj},
          {"self_attn.q_a_proj", &q_a_proj},
          {"self_attn.q_b_proj", &q_b_proj},
          {"self_attn.kv_a_proj_with_mqa", &kv_a_proj_with_mqa},
          {"self_attn.kv_b_proj", &kv_b_proj},
          {"linear_attn.in_proj_qkv", &in_proj_qkv},
          {"linear_attn.in_proj_z", &in_proj_z},
          {"linear_attn.in_proj_b", &in_proj_b},
          {"linear_attn.in_proj_a", &in_proj_a},
          {"linear_attn.out_proj", &out_proj},
          {"mlp.gate_proj", &mlp_gate},
          {"mlp.up_proj", &mlp_up},
          {"mlp.down_proj", &mlp_down},
          {shared + "gate_proj", &shared_gate},
          {shared + "up_proj", &shared_up},
          {shared + "down_proj", &shared_down},
          {"mlp.experts.gate_up_proj", &experts_gate_up},
          {"mlp.experts.down_proj", &experts_down}};
}

bool LayerLora::any() const {
  for (const auto& [name, weights] : named()) {
    if (weights->defined()) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// load_adapter

namespace peft_detail {

void AdapterLoader::collect() {
  for (const std::string& key : store_.names()) {
    ++num_tensors_;
    std::string_view name = key;
    if (starts_with(name, kPeftPrefix)) name.remove_prefix(kPeftPrefix.size());
    const Where where{file_, key};
    bool is_b = false;
    std::string module;
    for (const auto& [suffix, b] : {std::pair<std::string_view, bool>{".lora_A.weight", false},
                                    {".lora_B.weight", true},
                                    {".lora_A", false},
                                    {".lora_B", true}}) {
      if (ends_with(name, suffix)) {
        module = std::string(name.substr(0, name.size() - suffix.size()));
        is_b = b;
        break;
      }
    }
    if (module.empty()) {
      if (ends_with(name, ".lora_A.bias") || ends_with(name, ".lora_B.bias")) {
        unsupported_target(where, "a LoRA bias (lora_bias)");
      }
      if (name.find("lora_embedding_") != std::string_view::npos) {
        unsupported_target(where, "LoRA on an embedding (lora_embedding_A/B)");
      }
      if (name.find("lora_magnitude_vector") != std::string_view::npos) {
        unsupported_target(where, "DoRA (lora_magnitude_vector)");
      }
      if (name.find("modules_to_save") != std::string_view::npos) {
        unsupported_target(where, "a full module copy (modules_to_save)");
      }
      MOELORA_THROW(
          ErrorCode::kUnsupported, file_, ": tensor '", key,
          "' is not a LoRA factor (expected a name ending in lora_A.weight or lora_B.weight); full "
          "weights and other PEFT methods are not supported");
    }
    auto [it, inserted] = modules_.try_emplace(module);
    ModuleEntry& entry = it->second;
    if (inserted) {
      entry.module = module;
      entry.ref = classify_module(module, base_, where);
    }
    std::string& slot = is_b ? entry.key_b : entry.key_a;
    MOELORA_CHECK(slot.empty(), ErrorCode::kInvalidFile, file_, ": '", slot, "' and '", key,
                  "' are both the ", is_b ? "lora_B" : "lora_A", " of '", module, "'");
    slot = key;
  }
  MOELORA_CHECK(num_tensors_ > 0, ErrorCode::kInvalidFile, file_, ": holds no tensors");
}

void AdapterLoader::check_pairs_and_dtypes() {
  for (const auto& [module, entry] : modules_) {
    const bool has_a = !entry.key_a.empty(), has_b = !entry.key_b.empty();
    if (!has_a || !has_b) {
      const std::string& present = has_a ? entry.key_a : entry.key_b;
      std::string missing = present;
      const size_t at = missing.rfind(has_a ? "lora_A" : "lora_B");
      missing.replace(at, 6, has_a ? "lora_B" : "lora_A");
      MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": '", present, "' has no matching ",
                    has_a ? "lora_B" : "lora_A", " ('", missing, "' is missing)");
    }
    for (const std::string* key : {&entry.key_a, &entry.key_b}) {
      const DType dtype = store_.info(*key).dtype;
      MOELORA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 ||
                        dtype == DType::kF64,
                    ErrorCode::kUnsupported, file_, ": tensor '", *key, "' has dtype ",
                    dtype_name(dtype), "; LoRA factors must be F32, BF16, F16 or F64");
    }
  }
}

void AdapterLoader::check_targeted(const ModuleEntry& entry) const {
  MOELORA_CHECK(config_.targets_module(entry.module), ErrorCode::kInvalidFile, file_, ": tensor '",
                entry.key_a, "' adapts '", entry.module, "', which ", config_file_,
                " does not target (see target_modules, exclude_modules and layers_to_transform)");
}

void AdapterLoader::check_ndim(const Tensor& t, int ndim, const std::string& factor,
                               const std::string& module, const char* layout) const {
  MOELORA_CHECK(t.ndim() == ndim, ErrorCode::kInvalidFile, file_, ": ", factor, " of '", module,
                "' has shape ", shape_str(t.shape()), "; the ", layout, " layout needs a ", ndim,
                "-D tensor");
}

void AdapterLoader::check_rank_vs_config(int64_t rank, const std::string& path,
                                         const std::string& module, const std::string& how) const {
  const int64_t expected = config_.rank_for(path);
  if (rank == expected) return;
  const auto key = config_.rank_pattern_key(path);
  MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": lora_A of '", module, "' has rank ", rank, how,
                " but ", config_file_, " says r=", expected,
                key ? " (rank_pattern key '" + *key + "')" : std::string(" (field 'r')"));
}

void AdapterLoader::check_feature(const Tensor& t, int dim, int64_t expected,
                                  const std::string& factor, const std::string& module,
                                  const char* feature) const {
  if (t.dim(dim) == expected) return;
  Shape want = t.shape();
  want[static_cast<size_t>(dim < 0 ? t.ndim() + dim : dim)] = expected;
  MOELORA_THROW(ErrorCode::kUnsupported, file_, ": ", factor, " of '", module, "' has shape ",
                shape_str(t.shape()), ", expected ", shape_str(want), ": ", feature,
                " of this module in the base model ", describe_base(base_), " is ", expected,
                " (the adapter was made for another model)");
}

LoraWeights AdapterLoader::load_plain(const ModuleEntry& entry) {
  check_targeted(entry);
  const Tensor a = store_.tensor(entry.key_a), b = store_.tensor(entry.key_b);
  check_ndim(a, 2, "lora_A", entry.module, "2-D module");
  check_ndim(b, 2, "lora_B", entry.module, "2-D module");
  const int64_t rank = a.dim(0);
  MOELORA_CHECK(b.dim(1) == rank, ErrorCode::kInvalidFile, file_, ": lora_B of '", entry.module,
                "' has shape ", shape_str(b.shape()), " but lora_A has rank ", rank, " (shape ",
                shape_str(a.shape()), ")");
  check_rank_vs_config(rank, entry.module, entry.module, "");
  check_feature(a, 1, entry.ref.in, "lora_A", entry.module, "in_features");
  check_feature(b, 0, entry.ref.out, "lora_B", entry.module, "out_features");

  Part part;
  part.label = last_component(entry.module);
  part.out_rows = entry.ref.out;
  part.a = {matrix_view(a, 0, rank, entry.ref.in)};
  part.b = {matrix_view(b, 0, entry.ref.out, rank)};
  part.scaling = {config_.scaling_for(entry.module)};
  part.rank = rank;
  return assemble({part}, 1, entry.ref.out, entry.ref.in);
}

LoraAdapter AdapterLoader::load() {
  std::error_code ec;
  MOELORA_CHECK(fs::is_directory(dir_, ec), ErrorCode::kNotFound, dir_.string(),
                ": adapter directory not found (expected adapter_config.json and "
                "adapter_model.safetensors in it)");
  const fs::path config_path = dir_ / "adapter_config.json";
  config_file_ = config_path.string();
  config_ = parse_adapter_config(config_path);

  if (!fs::exists(dir_ / "adapter_model.safetensors", ec) &&
      !fs::exists(dir_ / "adapter_model.safetensors.index.json", ec) &&
      fs::exists(dir_ / "adapter_model.bin", ec)) {
    MOELORA_THROW(ErrorCode::kUnsupported, (dir_ / "adapter_model.bin").string(),
                  ": pickle .bin adapters are not supported; convert to safetensors (e.g. load the "
                  "adapter with "
                  "PEFT and save it again with safe_serialization=True)");
  }
  store_ = SafetensorsStore::open_dir(dir_, "adapter_model");
  file_ = store_.source().string();

  collect();
  check_pairs_and_dtypes();

  const int64_t num_layers = base_.num_hidden_layers;
  plain_.assign(static_cast<size_t>(num_layers), {});
  experts_.assign(static_cast<size_t>(num_layers), {});
  for (const auto& [module, entry] : modules_) {
    const ModuleRef& ref = entry.ref;
    const size_t layer = static_cast<size_t>(ref.layer);
    LayerExperts& experts = experts_[layer];
    if (ref.form != ExpertForm::kNone) {
      experts.layer_prefix = ref.layer_prefix;
      experts.forms.insert(ref.form == ExpertForm::kPeft3dInner ? ExpertForm::kPeft3dOuter
                                                                : ref.form);
    }
    switch (ref.form) {
      case ExpertForm::kNone: {
        const ModuleEntry*& slot = plain_[layer][static_cast<size_t>(ref.plain)];
        // Two spellings of the decoder prefix can name the same module.
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_, ": '",
                      slot ? slot->key_a : "", "' and '", entry.key_a,
                      "' adapt the same module of layer ", ref.layer);
        slot = &entry;
        break;
      }
      case ExpertForm::kPerExpert: {
        auto& list = experts.per_expert[static_cast<size_t>(ref.proj)];
        if (list.empty()) list.assign(static_cast<size_t>(base_.num_experts), nullptr);
        MOELORA_CHECK(list[static_cast<size_t>(ref.expert)] == nullptr, ErrorCode::kInvalidFile,
                      file_, ": two tensors adapt expert ", ref.expert, " ",
                      kExpertProjNames[static_cast<size_t>(ref.proj)], " of layer ", ref.layer,
                      " ('", entry.key_a, "')");
        list[static_cast<size_t>(ref.expert)] = &entry;
        break;
      }
      case ExpertForm::kStacked: {
        const ModuleEntry*& slot = experts.stacked[static_cast<size_t>(ref.proj)];
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_,
                      ": two tensors adapt mlp.experts.",
                      kExpertProjNames[static_cast<size_t>(ref.proj)], " of layer ", ref.layer,
                      " ('", entry.key_a, "')");
        slot = &entry;
        break;
      }
      case ExpertForm::kPeft3dOuter:
      case ExpertForm::kPeft3dInner: {
        const ModuleEntry*& slot =
            ref.form == ExpertForm::kPeft3dOuter ? experts.peft3d_outer : experts.peft3d_inner;
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_,
                      ": two tensors adapt mlp.experts of layer ", ref.layer, " ('", entry.key_a,
                      "')");
        slot = &entry;
        break;
      }
    }
  }

  LoraAdapter adapter;
  adapter.name = name_;
  adapter.dir = dir_;
  adapter.num_tensors = num_tensors_;
  adapter.layers.resize(static_cast<size_t>(num_layers));
  std::optional<std::pair<ExpertForm, int64_t>> first_form;  // layout and the layer that set it
  bool shared_outer = false;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    LayerLora& out = adapter.layers[static_cast<size_t>(layer)];
    out.shared_expert_module =
        base_.arch == Architecture::kDeepseekV3 ? "shared_experts" : "shared_expert";
    for (size_t p = 0; p < kNumPlain; ++p) {
      const ModuleEntry* entry = plain_[static_cast<size_t>(layer)][p];
      if (entry == nullptr) continue;
      LoraWeights w = load_plain(*entry);
      check_max_rank(w, layer, entry->module.substr(entry->ref.layer_prefix.size()), "");
      plain_slot(out, static_cast<Plain>(p)) = std::move(w);
    }
    LayerExperts& experts = experts_[static_cast<size_t>(layer)];
    if (experts.forms.empty()) continue;
    load_experts(layer, experts, out);
    const ExpertForm form = *experts.forms.begin();
    if (!first_form) {
      first_form = {form, layer};
    } else if (first_form->first != form) {
      MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": routed-expert LoRAs of layer ",
                    first_form->second, " use the ", form_name(first_form->first),
                    " layout but those of layer ", layer, " use the ", form_name(form),
                    " layout; one adapter must use one layout");
    }
    for (const LoraWeights* w : {&out.experts_gate_up, &out.experts_down}) {
      if (w->defined() && base_.num_experts > 1 && (w->shared_a() || w->shared_b()))
        shared_outer = true;
    }
  }
  if (first_form) {
    switch (first_form->first) {
      case ExpertForm::kPerExpert: adapter.expert_layout = ExpertLoraLayout::kPerExpert; break;
      case ExpertForm::kStacked:
        adapter.expert_layout =
            shared_outer ? ExpertLoraLayout::kSharedOuter : ExpertLoraLayout::kStacked;
        break;
      default: adapter.expert_layout = ExpertLoraLayout::kPeft3d; break;
    }
  }

  // max_rank and the human-readable target list: one line per target and (rank, scaling, sharing),
  // with the layers it covers.
  struct Group {
    std::string target, detail;
    std::vector<int64_t> layers;
  };
  std::vector<Group> groups;
  MOELORA_ASSERT(LayerLora().named().size() == kNumPlain + 2,
                 "LayerLora::named() lists the plain targets, then the two expert targets");
  for (size_t t = 0; t < kNumPlain + 2; ++t) {
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      const auto named = adapter.layers[static_cast<size_t>(layer)].named();
      // Plain references, not a structured binding: the lambda below captures the name, which
      // clang before 16 does not allow for bindings.
      const auto& target = named[t].first;
      const auto& w = named[t].second;
      if (!w->defined()) continue;
      adapter.max_rank = std::max(adapter.max_rank, w->rank());
      std::string detail =
          "rank " + std::to_string(w->rank()) + ", scaling " + format_number(w->scaling);
      if (t >= kNumPlain) {
        detail += ", " + std::to_string(base_.num_experts) + " experts";
        if (base_.num_experts > 1 && w->shared_a()) detail += ", A shared by all experts";
        if (base_.num_experts > 1 && w->shared_b()) detail += ", B shared by all experts";
      }
      auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
        return g.target == target && g.detail == detail;
      });
      if (it == groups.end()) {
        groups.push_back({target, detail, {}});
        it = std::prev(groups.end());
      }
      it->layers.push_back(layer);
    }
  }
  for (const Group& g : groups) {
    adapter.targets.push_back(g.target + " (layer" + (g.layers.size() > 1 ? "s " : " ") +
                              format_ranges(g.layers) + "): " + g.detail);
  }
  MOELORA_ASSERT(adapter.max_rank > 0, "an adapter with tensors adapts at least one target");
  adapter.config = std::move(config_);
  return adapter;
}

}  // namespace peft_detail

LoraAdapter load_adapter(const fs::path& dir, const ModelConfig& base, const std::string& name,
                         const AdapterLoadOptions& options) {
  MOELORA_CHECK(options.max_rank > 0, ErrorCode::kInvalidArgument,
                "AdapterLoadOptions::max_rank must be positive, got ", options.max_rank);
  return peft_detail::AdapterLoader(dir, base, name, options).load();
}

std::string format_ranges(std::vector<int64_t> values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  std::string out;
  for (size_t i = 0; i < values.size();) {
    size_t j = i;
    while (j + 1 < values.size() && values[j + 1] == values[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(values[i]);
    if (j > i) out += "-" + std::to_string(values[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace moelora::io
