// `moelora inspect` on an adapter directory: the config (r, alpha, rsLoRA, patterns, targets), the
// tensors (expert layout, per-target ranks and scalings) and, where the base model is found, the
// loader's verdict against it (tools/inspect.cpp has the overview).
#include <cmath>
#include <map>
#include <optional>
#include <set>

#include "core/error.h"
#include "format.h"
#include "inspect_internal.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "io/safetensors.h"

namespace moelora::cli::inspect {
namespace {

using io::ModelConfig;

// One adapted module of the file, generalized over layers and experts.
struct TargetGroup {
  std::map<std::pair<int64_t, double>, std::vector<int64_t>> layers_by_rank_scaling;
  std::set<int64_t> experts;
  uint64_t tensors = 0;
};

// "model.layers.3.mlp.experts.5.up_proj" -> kind "mlp.experts.*.up_proj", layer 3, expert 5.
struct ModulePath {
  std::string kind;
  int64_t layer = -1;
  int64_t expert = -1;
};

ModulePath split_module(const std::string& module) {
  ModulePath out;
  std::vector<std::string> parts;
  std::stringstream in(module);
  std::string part;
  while (std::getline(in, part, '.')) parts.push_back(part);
  std::string kind;
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool numeric =
        !parts[i].empty() && parts[i].find_first_not_of("0123456789") == std::string::npos;
    if (numeric && i > 0 && parts[i - 1] == "layers" && out.layer < 0) {
      out.layer = std::stoll(parts[i]);
      kind.clear();  // the kind starts below the decoder layer
      continue;
    }
    if (numeric && i > 0 && parts[i - 1] == "experts") {
      out.expert = std::stoll(parts[i]);
      kind += (kind.empty() ? "" : ".") + std::string("*");
      continue;
    }
    kind += (kind.empty() ? "" : ".") + parts[i];
  }
  out.kind = kind;
  return out;
}

}  // namespace

int inspect_adapter(const fs::path& dir, const std::string& model_option, bool as_json) {
  const io::AdapterConfig cfg = io::parse_adapter_config(dir / "adapter_config.json");
  const io::SafetensorsStore store = io::SafetensorsStore::open_dir(dir, "adapter_model");
  Report report;
  json& j = report.data();
  j["kind"] = "adapter";
  j["path"] = dir.string();
  report.row("path", dir.string());
  report.row("type", "LoRA (PEFT)");

  // The base model, when it can be found: --model, else base_model_name_or_path as a directory
  // (absolute or relative to the adapter).
  std::optional<fs::path> base_dir;
  std::error_code ec;
  if (!model_option.empty()) {
    base_dir = fs::path(model_option);
  } else if (!cfg.base_model_name_or_path.empty()) {
    for (const fs::path& candidate :
         {fs::path(cfg.base_model_name_or_path), dir / cfg.base_model_name_or_path}) {
      if (fs::is_regular_file(candidate / "config.json", ec)) {
        base_dir = candidate;
        break;
      }
    }
  }
  std::optional<ModelConfig> base;
  std::string base_error;
  if (base_dir) {
    try {
      base = io::load_model_config(*base_dir);
    } catch (const Error& e) {
      base_error = e.what();
    }
  }

  // r, alpha, scaling, patterns
  const double scaling = cfg.use_rslora ? cfg.lora_alpha / std::sqrt(static_cast<double>(cfg.r))
                                        : cfg.lora_alpha / static_cast<double>(cfg.r);
  report.row("r", std::to_string(cfg.r));
  report.row("lora_alpha", fmt(cfg.lora_alpha));
  report.row("scaling",
             fmt(scaling) + (cfg.use_rslora ? " (rsLoRA: alpha / sqrt(r))" : " (alpha / r)"));
  j["r"] = cfg.r;
  j["lora_alpha"] = cfg.lora_alpha;
  j["use_rslora"] = cfg.use_rslora;
  j["scaling"] = scaling;
  if (!cfg.rank_pattern.empty() || !cfg.alpha_pattern.empty()) {
    std::string patterns;
    json jr = json::object(), ja = json::object();
    for (const auto& [key, r] : cfg.rank_pattern) {
      patterns +=
          (patterns.empty() ? "" : "\n") + std::string("rank ") + key + " = " + std::to_string(r);
      jr[key] = r;
    }
    for (const auto& [key, a] : cfg.alpha_pattern) {
      patterns += (patterns.empty() ? "" : "\n") + std::string("alpha ") + key + " = " + fmt(a);
      ja[key] = a;
    }
    report.row("patterns", patterns);
    j["rank_pattern"] = jr;
    j["alpha_pattern"] = ja;
  }
  std::string modules;
  if (cfg.target_modules_regex) {
    modules = "regex " + *cfg.target_modules_regex;
  } else if (cfg.target_all_linear) {
    modules = "all-linear";
  } else {
    for (const std::string& m : cfg.target_modules) modules += (modules.empty() ? "" : ", ") + m;
  }
  report.row("target_modules", modules.empty() ? "(none)" : modules);
  std::string parameters;
  for (const std::string& p : cfg.target_parameters)
    parameters += (parameters.empty() ? "" : ", ") + p;
  if (!parameters.empty()) report.row("target_parameters", parameters);
  j["target_modules"] =
      cfg.target_modules_regex ? json(*cfg.target_modules_regex) : json(cfg.target_modules);
  j["target_parameters"] = cfg.target_parameters;

  // Tensors grouped by adapted module kind, with rank and scaling per layer.
  std::map<std::string, TargetGroup> groups;
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;
  bool per_expert = false, peft3d = false, stacked = false, shared_outer = false;
  for (const std::string& name : store.names()) {
    const io::TensorInfo& info = store.info(name);
    auto& [count, bytes] = by_dtype[std::string(dtype_name(info.dtype))];
    ++count;
    bytes += info.nbytes();
    std::string module = name;
    if (module.starts_with("base_model.model.")) module = module.substr(17);
    bool is_a = false;
    for (const char* suffix : {".lora_A.weight", ".lora_B.weight", ".lora_A", ".lora_B"}) {
      if (module.ends_with(suffix)) {
        is_a = std::string(suffix).find("lora_A") != std::string::npos;
        module = module.substr(0, module.size() - std::string(suffix).size());
        break;
      }
    }
    // PEFT 3-D wrappers: experts.base_layer (inner, gate_up_proj when both are targeted) and
    // experts
    std::string scaling_path = module;
    const bool wrapper = module.ends_with(".experts") || module.ends_with(".experts.base_layer");
    if (wrapper) {
      peft3d = true;
      std::string parameter = module.ends_with(".base_layer") ? "gate_up_proj" : "down_proj";
      if (cfg.target_parameters.size() == 1) {
        const std::string& only = cfg.target_parameters.front();
        parameter = only.substr(only.rfind('.') + 1);
      }
      const std::string experts = module.substr(0, module.rfind(".experts") + 8);
      module = experts + "." + parameter;
      scaling_path = module;
    }
    const ModulePath path = split_module(module);
    if (path.expert >= 0) per_expert = true;
    const bool stacked_expert =
        !wrapper && info.shape.size() == 3 && path.kind.find("experts.") != std::string::npos;
    if (stacked_expert) {
      stacked = true;
      const bool outer = path.kind.ends_with("down_proj") ? !is_a : is_a;
      if (outer && info.shape[0] == 1) shared_outer = true;
    }
    TargetGroup& g = groups[path.kind];
    ++g.tensors;
    if (path.expert >= 0) g.experts.insert(path.expert);
    if (!is_a) continue;
    // rank from lora_A: [r, in] (2-D), [E*R, in] (PEFT 3-D), [Ea, r, in] (stacked)
    int64_t rank = info.shape.empty() ? 0 : info.shape[0];
    if (stacked_expert) rank = info.shape[1];
    if (wrapper)
      rank = base && base->num_experts > 0 ? info.shape[0] / base->num_experts : -info.shape[0];
    g.layers_by_rank_scaling[{rank, cfg.scaling_for(scaling_path)}].push_back(path.layer);
  }

  io::ExpertLoraLayout layout = io::ExpertLoraLayout::kNone;
  if (per_expert) layout = io::ExpertLoraLayout::kPerExpert;
  if (peft3d) layout = io::ExpertLoraLayout::kPeft3d;
  if (stacked)
    layout = shared_outer ? io::ExpertLoraLayout::kSharedOuter : io::ExpertLoraLayout::kStacked;

  std::string targets;
  json jt = json::array();
  for (const auto& [kind, g] : groups) {
    std::string line = kind;
    if (!g.experts.empty()) line += " (" + std::to_string(g.experts.size()) + " experts)";
    json entry = {{"module", kind}, {"tensors", g.tensors}, {"experts", g.experts.size()}};
    json ranks = json::array();
    for (const auto& [rank_scaling, layers] : g.layers_by_rank_scaling) {
      std::set<int64_t> unique(layers.begin(), layers.end());
      const std::vector<int64_t> layer_list(unique.begin(), unique.end());
      const std::string rank = rank_scaling.first >= 0
                                   ? std::to_string(rank_scaling.first)
                                   : "E*R=" + std::to_string(-rank_scaling.first);
      line += "\n  r " + rank + ", scaling " + fmt(rank_scaling.second) +
              (layer_list.empty() || layer_list.front() < 0
                   ? ""
                   : ", layers " + io::format_ranges(layer_list));
      ranks.push_back(
          {{"r", rank_scaling.first}, {"scaling", rank_scaling.second}, {"layers", layer_list}});
    }
    entry["ranks"] = ranks;
    jt.push_back(entry);
    targets += (targets.empty() ? "" : "\n") + line;
  }
  report.row("adapted modules", targets.empty() ? "(none)" : targets);
  report.row("expert layout", io::expert_lora_layout_name(layout));
  j["modules"] = jt;
  j["expert_layout"] = io::expert_lora_layout_name(layout);

  std::string dtypes;
  json jd = json::object();
  for (const auto& [name, stats] : by_dtype) {
    dtypes += (dtypes.empty() ? "" : ", ") + name + " " + std::to_string(stats.first);
    jd[name] = {{"tensors", stats.first}, {"bytes", stats.second}};
  }
  report.row("tensors", std::to_string(store.size()) + " (" + dtypes + "), " +
                            format_bytes(store.total_bytes()));
  report.row("base model",
             cfg.base_model_name_or_path.empty() ? "(not set)" : cfg.base_model_name_or_path);
  j["tensors"] = store.size();
  j["dtypes"] = jd;
  j["bytes"] = store.total_bytes();
  j["base_model_name_or_path"] = cfg.base_model_name_or_path;

  std::string check;
  bool ok = true;
  if (!base_dir) {
    check = "skipped (no base model directory: pass --model DIR)";
  } else if (!base) {
    check = "FAILED: base model " + base_dir->string() + ": " + base_error;
    ok = false;
  } else {
    try {
      const io::LoraAdapter adapter = io::load_adapter(dir, *base, dir.filename().string());
      check = "ok against " + base_dir->string() + ": " +
              io::expert_lora_layout_name(adapter.expert_layout) + " experts, max rank " +
              std::to_string(adapter.max_rank) + ", " + std::to_string(adapter.targets.size()) +
              " targets";
      j["loaded"] = {{"expert_layout", io::expert_lora_layout_name(adapter.expert_layout)},
                     {"max_rank", adapter.max_rank},
                     {"targets", adapter.targets}};
    } catch (const Error& e) {
      check = std::string("FAILED: ") + e.what();
      ok = false;
    }
  }
  report.row("check", check);
  j["check"] = ok ? json(check.substr(0, 7) == "skipped" ? "skipped" : "ok") : json(check);
  report.print(as_json);
  return ok ? 0 : 1;
}

}  // namespace moelora::cli::inspect
