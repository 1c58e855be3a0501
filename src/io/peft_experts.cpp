// The routed-expert LoRA layouts of a PEFT adapter (per-expert 2-D tensors, PEFT's 3-D
// ParamWrapper tensors, stacked 3-D tensors with an expert dimension) read into canonical
// A [Ea, R, in] / B [Eb, out, R] targets (experts_gate_up with gate and up fused, experts_down),
// and the assembly that writes every target once, straight from the mmap'ed file.
#include "io/peft_internal.h"
#include "io/peft_loader.h"

#include <cmath>
#include <string>

#include "core/error.h"

namespace moelora::io::peft_detail {

FactorView matrix_view(const Tensor& t, int64_t index, int64_t rows, int64_t cols) {
  return FactorView{t, index * rows * cols, cols, 1, rows, cols};
}

LoraWeights assemble(const std::vector<Part>& parts, int64_t num_experts, int64_t out_total,
                     int64_t in) {
  int64_t total_rank = 0;
  bool share_a = true, share_b = true;
  std::vector<double> all_scalings;
  for (const Part& p : parts) {
    total_rank += p.rank;
    share_a = share_a && p.a.size() == 1;
    share_b = share_b && p.b.size() == 1 && p.uniform_scaling();
    all_scalings.insert(all_scalings.end(), p.scaling.begin(), p.scaling.end());
  }
  // One scaling for the target: the common one, else the largest in magnitude with the ratios of
  // the others folded into their B rows.
  double s = all_scalings.at(0);
  for (double value : all_scalings) {
    if (std::abs(value) > std::abs(s)) s = value;
  }

  const int64_t ea = share_a ? 1 : num_experts;
  const int64_t eb = share_b ? 1 : num_experts;
  LoraWeights w;
  w.a = Tensor::zeros(DType::kF32, {ea, total_rank, in});
  w.b = Tensor::zeros(DType::kF32, {eb, out_total, total_rank});
  w.scaling = static_cast<float>(s);
  float* a = w.a.data<float>();
  float* b = w.b.data<float>();
  for (int64_t e = 0; e < ea; ++e) {
    int64_t column = 0;
    for (const Part& p : parts) {
      const FactorView& view = p.a[p.a.size() == 1 ? 0 : e];
      for (int64_t k = 0; k < view.rows; ++k)
        view.copy_row(k, a + (e * total_rank + column + k) * in, 1.0);
      column += p.rank;
    }
  }
  for (int64_t e = 0; e < eb; ++e) {
    int64_t column = 0;
    for (const Part& p : parts) {
      const FactorView& view = p.b[p.b.size() == 1 ? 0 : e];
      const double part_scaling = p.scaling[p.scaling.size() == 1 ? 0 : e];
      const double ratio = part_scaling == s ? 1.0 : part_scaling / s;
      for (int64_t o = 0; o < view.rows; ++o) {
        view.copy_row(o, b + (e * out_total + p.out_offset + o) * total_rank + column, ratio);
      }
      column += p.rank;
    }
  }
  return w;
}

const char* form_name(ExpertForm form) {
  switch (form) {
    case ExpertForm::kPerExpert: return "per-expert 2-D (mlp.experts.{e}.<proj>)";
    case ExpertForm::kPeft3dOuter:
    case ExpertForm::kPeft3dInner: return "PEFT 3-D (mlp.experts[.base_layer].lora_*)";
    case ExpertForm::kStacked:
      return "stacked 3-D (mlp.experts.<proj>.lora_* with an expert dimension)";
    case ExpertForm::kNone: break;
  }
  return "none";
}

std::vector<Part> AdapterLoader::per_expert_parts(int64_t layer, LayerExperts& experts,
                                                  bool gate_up) {
  const int64_t E = base_.num_experts, I = base_.moe_intermediate_size, H = base_.hidden_size;
  std::vector<Part> parts;
  for (ExpertProj proj : gate_up ? std::vector<ExpertProj>{ExpertProj::kGate, ExpertProj::kUp}
                                 : std::vector<ExpertProj>{ExpertProj::kDown}) {
    const auto& entries = experts.per_expert[static_cast<size_t>(proj)];
    const int64_t present =
        std::count_if(entries.begin(), entries.end(), [](const ModuleEntry* e) { return e; });
    if (present == 0) continue;
    const char* proj_name = kExpertProjNames[static_cast<size_t>(proj)];
    const int64_t in = proj == ExpertProj::kDown ? I : H, out = proj == ExpertProj::kDown ? H : I;
    Part part;
    part.label = proj_name;
    part.out_offset = proj == ExpertProj::kUp ? I : 0;
    part.out_rows = out;
    part.a.resize(static_cast<size_t>(E));
    part.b.resize(static_cast<size_t>(E));
    part.scaling.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const std::string path =
          experts.layer_prefix + "mlp.experts." + std::to_string(e) + "." + proj_name;
      part.scaling[static_cast<size_t>(e)] = config_.scaling_for(path);
      const ModuleEntry* entry = entries[static_cast<size_t>(e)];
      if (entry == nullptr) {
        // Absent experts are fine only where the config does not target them (the adapter then
        // declares them unadapted); otherwise the file is incomplete.
        MOELORA_CHECK(!config_.targets_module(path), ErrorCode::kInvalidFile, file_,
                      ": per-expert LoRA of layer ", layer, " has mlp.experts.{e}.", proj_name,
                      " for ", present, " of ", E, " experts; missing: '", path,
                      "' (its lora_A and lora_B), which ", config_file_, " targets");
        continue;
      }
      check_targeted(*entry);
      const Tensor a = store_.tensor(entry->key_a), b = store_.tensor(entry->key_b);
      check_ndim(a, 2, "lora_A", path, "per-expert");
      check_ndim(b, 2, "lora_B", path, "per-expert");
      const int64_t rank = a.dim(0);
      MOELORA_CHECK(b.dim(1) == rank, ErrorCode::kInvalidFile, file_, ": lora_B of '", path,
                    "' has shape ", shape_str(b.shape()), " but lora_A has rank ", rank, " (shape ",
                    shape_str(a.shape()), ")");
      check_rank_vs_config(rank, path, path, "");
      check_feature(a, 1, in, "lora_A", path, "in_features");
      check_feature(b, 0, out, "lora_B", path, "out_features");
      part.a[static_cast<size_t>(e)] = matrix_view(a, 0, rank, in);
      part.b[static_cast<size_t>(e)] = matrix_view(b, 0, out, rank);
      part.rank = std::max(part.rank, rank);
    }
    parts.push_back(std::move(part));
  }
  return parts;
}

std::vector<Part> AdapterLoader::peft3d_parts(int64_t layer, LayerExperts& experts, bool gate_up) {
  const int64_t E = base_.num_experts, I = base_.moe_intermediate_size, H = base_.hidden_size;
  std::vector<Part> parts;
  const ModuleEntry* found = nullptr;
  for (const ModuleEntry* entry : {experts.peft3d_inner, experts.peft3d_outer}) {
    if (entry == nullptr) continue;
    const Tensor a = store_.tensor(entry->key_a), b = store_.tensor(entry->key_b);
    check_ndim(a, 2, "lora_A", entry->module, "PEFT 3-D (target_parameters)");
    check_ndim(b, 2, "lora_B", entry->module, "PEFT 3-D (target_parameters)");
    // The parameter a wrapper adapts follows from its shapes: gate_up_proj [E, 2I, H] takes
    // lora_A [E*R, H] / lora_B [2I, E*R], down_proj [E, H, I] takes [E*R, I] / [H, E*R].
    const bool is_gate_up = a.dim(1) == H && b.dim(0) == 2 * I;
    const bool is_down = a.dim(1) == I && b.dim(0) == H;
    MOELORA_CHECK(is_gate_up || is_down, ErrorCode::kUnsupported, file_, ": 3-D expert LoRA '",
                  entry->module, "' (lora_A ", shape_str(a.shape()), ", lora_B ",
                  shape_str(b.shape()), ") fits neither gate_up_proj (lora_A [E*R, ", H,
                  "], lora_B [", 2 * I, ", E*R]) nor down_proj (lora_A [E*R, ", I, "], lora_B [", H,
                  ", E*R]) of the base model ", describe_base(base_),
                  " (the adapter was made for another model)");
    if (is_gate_up != gate_up) continue;
    const char* param = gate_up ? "gate_up_proj" : "down_proj";
    MOELORA_CHECK(found == nullptr, ErrorCode::kInvalidFile, file_, ": '",
                  found ? found->key_a : "", "' and '", entry->key_a,
                  "' are both LoRAs of mlp.experts.", param, " of layer ", layer);
    found = entry;
    const std::string param_path = experts.layer_prefix + "mlp.experts." + param;
    MOELORA_CHECK(config_.target_parameters.empty() || config_.targets_parameter(param_path),
                  ErrorCode::kInvalidFile, file_, ": tensor '", entry->key_a, "' adapts '",
                  param_path, "', which ", config_file_,
                  " does not target (see target_parameters)");
    const int64_t rows = a.dim(0);
    MOELORA_CHECK(rows % E == 0 && rows > 0, ErrorCode::kUnsupported, file_, ": lora_A of '",
                  param_path, "' has ", rows, " rows, not a positive multiple of the base model's ",
                  E, " experts (E*R rows expected; the adapter was made for another model)");
    MOELORA_CHECK(b.dim(1) == rows, ErrorCode::kInvalidFile, file_, ": lora_B of '", param_path,
                  "' has shape ", shape_str(b.shape()), " but lora_A has ", rows, " rows (shape ",
                  shape_str(a.shape()), "): both must hold E*R = ", rows, " rank components");
    const int64_t rank = rows / E;
    check_rank_vs_config(
        rank, param_path, param_path,
        " (" + std::to_string(rows) + " rows / " + std::to_string(E) + " experts)");

    Part part;
    part.label = param;
    part.out_rows = gate_up ? 2 * I : H;
    const int64_t in = gate_up ? H : I;
    part.scaling.assign(static_cast<size_t>(E), config_.scaling_for(param_path));
    part.rank = rank;
    for (int64_t e = 0; e < E; ++e) {
      // A_e[k, :] = lora_A[e*R + k, :] (expert-major rows); B_e[:, k] = lora_B[:, k*E + e]
      // (rank-major columns).
      part.a.push_back(FactorView{a, e * rank * in, in, 1, rank, in});
      part.b.push_back(FactorView{b, e, E * rank, E, part.out_rows, rank});
    }
    parts.push_back(std::move(part));
  }
  return parts;
}

std::vector<Part> AdapterLoader::stacked_parts(int64_t layer, LayerExperts& experts, bool gate_up) {
  const int64_t E = base_.num_experts, I = base_.moe_intermediate_size;
  const auto& stacked = experts.stacked;
  if (gate_up && stacked[3] != nullptr && (stacked[0] != nullptr || stacked[1] != nullptr)) {
    MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": layer ", layer, " has both a fused '",
                  stacked[3]->module, "' LoRA and separate ", stacked[0] ? "gate_proj" : "up_proj",
                  " LoRAs");
  }
  std::vector<Part> parts;
  for (ExpertProj proj :
       gate_up ? std::vector<ExpertProj>{ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kGateUp}
               : std::vector<ExpertProj>{ExpertProj::kDown}) {
    const ModuleEntry* entry = stacked[static_cast<size_t>(proj)];
    if (entry == nullptr) continue;
    const std::string& path = entry->module;
    const std::string param_path =
        experts.layer_prefix +
        (proj == ExpertProj::kDown ? "mlp.experts.down_proj" : "mlp.experts.gate_up_proj");
    MOELORA_CHECK(config_.targets_module(path) || config_.targets_parameter(param_path),
                  ErrorCode::kInvalidFile, file_, ": tensor '", entry->key_a, "' adapts '", path,
                  "', which ", config_file_,
                  " does not target (see target_modules and target_parameters)");
    const Tensor a = store_.tensor(entry->key_a), b = store_.tensor(entry->key_b);
    check_ndim(a, 3, "lora_A", path, "stacked 3-D");
    check_ndim(b, 3, "lora_B", path, "stacked 3-D");
    for (const Tensor* t : {&a, &b}) {
      MOELORA_CHECK(t->dim(0) == 1 || t->dim(0) == E, ErrorCode::kUnsupported, file_, ": ",
                    t == &a ? "lora_A" : "lora_B", " of '", path, "' has shape ",
                    shape_str(t->shape()),
                    ": its leading (expert) dimension must be 1 "
                    "(shared by all experts) or the base model's ",
                    E,
                    " experts (the adapter was made for another "
                    "model)");
    }
    const int64_t rank = a.dim(1);
    MOELORA_CHECK(b.dim(2) == rank, ErrorCode::kInvalidFile, file_, ": lora_B of '", path,
                  "' has shape ", shape_str(b.shape()), " but lora_A has rank ", rank, " (shape ",
                  shape_str(a.shape()), ")");
    check_rank_vs_config(rank, path, path, "");
    const ModuleRef& ref = entry->ref;
    check_feature(a, 2, ref.in, "lora_A", path, "in_features");
    check_feature(b, 1, ref.out, "lora_B", path, "out_features");

    Part part;
    part.label = kExpertProjNames[static_cast<size_t>(proj)];
    part.out_offset = proj == ExpertProj::kUp ? I : 0;
    part.out_rows = ref.out;
    part.scaling.assign(static_cast<size_t>(E), config_.scaling_for(path));
    part.rank = rank;
    for (int64_t e = 0; e < a.dim(0); ++e) part.a.push_back(matrix_view(a, e, rank, ref.in));
    for (int64_t e = 0; e < b.dim(0); ++e) part.b.push_back(matrix_view(b, e, ref.out, rank));
    parts.push_back(std::move(part));
  }
  return parts;
}

void AdapterLoader::check_max_rank(const LoraWeights& w, int64_t layer, const std::string& target,
                                   const std::string& detail) const {
  MOELORA_CHECK(w.rank() <= options_.max_rank, ErrorCode::kUnsupported, "adapter '", name_, "' (",
                dir_.string(), "): ", target, " of layer ", layer, " has rank ", w.rank(), detail,
                ", above the configured maximum LoRA rank ", options_.max_rank);
}

void AdapterLoader::load_experts(int64_t layer, LayerExperts& experts, LayerLora& out) {
  const int64_t E = base_.num_experts, I = base_.moe_intermediate_size, H = base_.hidden_size;
  if (experts.forms.size() > 1) {
    MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": layer ", layer,
                  " mixes routed-expert LoRA layouts: ", form_name(*experts.forms.begin()), " and ",
                  form_name(*std::next(experts.forms.begin())));
  }
  const ExpertForm form = *experts.forms.begin();
  for (const bool gate_up : {true, false}) {
    std::vector<Part> parts;
    if (form == ExpertForm::kPerExpert) {
      parts = per_expert_parts(layer, experts, gate_up);
    } else if (form == ExpertForm::kStacked) {
      parts = stacked_parts(layer, experts, gate_up);
    } else {
      parts = peft3d_parts(layer, experts, gate_up);
    }
    if (parts.empty()) continue;
    LoraWeights w = assemble(parts, E, gate_up ? 2 * I : H, gate_up ? H : I);
    std::string detail;
    if (parts.size() > 1) {
      detail = " (";
      for (size_t i = 0; i < parts.size(); ++i) {
        detail += (i ? " + " : "") + parts[i].label + " " + std::to_string(parts[i].rank);
      }
      detail += ": separate gate and up LoRAs are stacked into one A)";
    }
    check_max_rank(w, layer, gate_up ? "mlp.experts.gate_up_proj" : "mlp.experts.down_proj",
                   detail);
    (gate_up ? out.experts_gate_up : out.experts_down) = std::move(w);
  }
}

}  // namespace moelora::io::peft_detail
