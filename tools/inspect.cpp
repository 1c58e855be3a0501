// `moelora inspect DIR`: what a model or adapter directory holds, as an aligned table (or JSON
// with --json), and whether the engine loads it.
//
// A model directory (config.json + safetensors) is described from its config (architecture,
// layers, attention, experts, router, RoPE, quantization) and from the safetensors headers
// (dtypes, bytes, parameters); then load_checkpoint validates every tensor against the config
// and the "check" row says ok or gives the loader's one-line error; tensors the loader skips as
// transformers does (a vision tower, an MTP layer) are counted, with the reason, in an "ignored"
// row. Qwen3.5's hybrid layers are shown as counts and as their repeating pattern ("10 x (3
// linear + 1 full)"). An adapter directory
// (adapter_config.json) is described from its config (r, alpha, rsLoRA, patterns, targets) and
// its tensor names and shapes (expert layout, per-target ranks and scalings); when the base
// model can be found (--model, or base_model_name_or_path as a directory) load_adapter checks it
// against that model. Reading headers only, inspect is fast on multi-GB checkpoints: tensors are
// mapped, never read.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli.h"
#include "core/error.h"
#include "format.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "io/safetensors.h"

namespace moelora::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using io::Architecture;
using io::ModelConfig;
using io::QuantMethod;

// ---- formatting helpers ----

std::string fmt(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
}

// "0-2, 5, 7-8"
std::string format_ranges(const std::vector<int64_t>& values) {
  std::vector<int64_t> v = values;
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  std::string out;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(v[i]) +
           (j > i ? "-" + std::to_string(v[j]) : "");
    i = j + 1;
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// An aligned two-column table, and the same facts as JSON.
class Report {
 public:
  void row(const std::string& key, const std::string& value) { rows_.emplace_back(key, value); }
  json& data() { return data_; }
  void print(bool as_json) const {
    if (as_json) {
      std::printf("%s\n", data_.dump(2).c_str());
      return;
    }
    size_t width = 0;
    for (const auto& [key, value] : rows_) width = std::max(width, key.size());
    for (const auto& [key, value] : rows_) {
      // continuation lines of a multi-line value are indented under the value column
      std::istringstream lines(value);
      std::string line;
      bool first = true;
      while (std::getline(lines, line)) {
        std::printf("%-*s  %s\n", static_cast<int>(width), first ? key.c_str() : "", line.c_str());
        first = false;
      }
      if (first) std::printf("%s\n", key.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::string>> rows_;
  json data_ = json::object();
};

json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
}

// ============================================================================================
// model directories

// Qwen3.5's layer_types as runs, folded when a block repeats: "10 x (3 linear + 1 full)",
// "3 linear + 1 full + 2 linear".
std::string layer_pattern(const std::vector<std::string>& types) {
  auto runs = [&](size_t end) {
    std::string out;
    for (size_t i = 0; i < end;) {
      size_t j = i;
      while (j < end && types[j] == types[i]) ++j;
      const std::string& t = types[i];
      const std::string kind = t == "linear_attention" ? "linear"
                               : t == "full_attention" ? "full"
                                                       : t;
      out += (out.empty() ? "" : " + ") + std::to_string(j - i) + " " + kind;
      i = j;
    }
    return out;
  };
  const size_t n = types.size();
  for (size_t period = 1; period < n; ++period) {
    if (n % period != 0) continue;
    bool repeats = true;
    for (size_t i = period; i < n && repeats; ++i) repeats = types[i] == types[i % period];
    if (repeats) return std::to_string(n / period) + " x (" + runs(period) + ")";
  }
  return runs(n);
}

// Tensors the loader skipped (ModelWeights::ignored_tensors), grouped by what they are and why
// the text decoder does not need them.
struct IgnoredGroup {
  std::string pattern;  // "mtp.*", "model.visual.*", ...
  std::string why;
  size_t count = 0;
};

std::vector<IgnoredGroup> group_ignored(const std::vector<std::string>& names, const ModelConfig& c,
                                        const std::string& prefix) {
  std::vector<IgnoredGroup> groups;
  auto add = [&](const std::string& pattern, const std::string& why) {
    for (IgnoredGroup& g : groups) {
      if (g.pattern == pattern) {
        ++g.count;
        return;
      }
    }
    groups.push_back({pattern, why, 1});
  };
  const std::string layers = prefix + "layers.";
  for (const std::string& name : names) {
    if (starts_with(name, "mtp.")) {
      add("mtp.*", "the multi-token prediction layer (speculative decoding), not run here");
    } else if (ends_with(name, ".rotary_emb.inv_freq")) {
      add("*.rotary_emb.inv_freq", "RoPE frequencies, recomputed from config.json");
    } else if (ends_with(name, ".k_scale") || ends_with(name, ".v_scale")) {
      add("*.self_attn.{k,v}_scale", "FP8 KV-cache scales; the engine keeps a bf16 KV cache");
    } else if (c.tie_word_embeddings && ends_with(name, "lm_head.weight")) {
      add(name, "tied to the embeddings");
    } else if (starts_with(name, layers)) {
      const std::string index =
          name.substr(layers.size(), name.find('.', layers.size()) - layers.size());
      add(layers + index + ".*", "beyond num_hidden_layers " + std::to_string(c.num_hidden_layers) +
                                     " (DeepSeek's MTP layer)");
    } else {
      // outside the text decoder: the vision tower and projector of a VLM checkpoint
      const size_t first = name.find('.');
      const bool nested = first != std::string::npos && name.substr(0, first) == "model";
      const size_t end = nested ? name.find('.', first + 1) : first;
      add(name.substr(0, end) + ".*", "outside the text model (vision tower / projector)");
    }
  }
  return groups;
}

std::string describe_attention(const ModelConfig& c, json& j) {
  std::ostringstream os;
  if (c.use_mla) {
    os << "MLA: " << c.num_attention_heads << " heads, "
       << (c.q_lora_rank > 0 ? "q_lora_rank " + std::to_string(c.q_lora_rank)
                             : std::string("plain q_proj"))
       << ", kv_lora_rank " << c.kv_lora_rank << ", qk_nope " << c.qk_nope_head_dim << " + qk_rope "
       << c.qk_rope_head_dim << ", v_head " << c.v_head_dim;
    j["attention"] = {{"type", "MLA"},
                      {"heads", c.num_attention_heads},
                      {"q_lora_rank", c.q_lora_rank},
                      {"kv_lora_rank", c.kv_lora_rank},
                      {"qk_nope_head_dim", c.qk_nope_head_dim},
                      {"qk_rope_head_dim", c.qk_rope_head_dim},
                      {"v_head_dim", c.v_head_dim}};
    return os.str();
  }
  os << "GQA: " << c.num_attention_heads << " query heads, " << c.num_key_value_heads
     << " KV heads, head_dim " << c.head_dim;
  if (c.qk_norm) os << ", q/k norm";
  if (c.attention_output_gate) os << ", output gate";
  j["attention"] = {{"type", "GQA"},
                    {"heads", c.num_attention_heads},
                    {"kv_heads", c.num_key_value_heads},
                    {"head_dim", c.head_dim},
                    {"qk_norm", c.qk_norm},
                    {"output_gate", c.attention_output_gate}};
  if (!c.layer_types.empty()) {
    const auto full = std::count(c.layer_types.begin(), c.layer_types.end(), "full_attention");
    const std::string pattern = layer_pattern(c.layer_types);
    os << "\nfull attention in " << full << " of " << c.layer_types.size()
       << " layers, Gated DeltaNet in " << c.layer_types.size() - static_cast<size_t>(full) << ": "
       << pattern;
    j["attention"]["full_attention_layers"] = full;
    j["attention"]["linear_attention_layers"] = static_cast<int64_t>(c.layer_types.size()) - full;
    j["attention"]["layer_pattern"] = pattern;
    if (full < static_cast<int64_t>(c.layer_types.size())) {
      const io::LinearAttentionConfig& la = c.linear_attention;
      os << "\nGated DeltaNet: " << la.num_key_heads << " key heads of " << la.key_head_dim << ", "
         << la.num_value_heads << " value heads of " << la.value_head_dim << ", conv kernel "
         << la.conv_kernel_dim;
      j["attention"]["linear_attention"] = {{"num_key_heads", la.num_key_heads},
                                            {"num_value_heads", la.num_value_heads},
                                            {"key_head_dim", la.key_head_dim},
                                            {"value_head_dim", la.value_head_dim},
                                            {"conv_kernel_dim", la.conv_kernel_dim}};
    }
  }
  return os.str();
}

std::string describe_router(const ModelConfig& c, json& j) {
  std::ostringstream os;
  if (c.router == RouterKind::kSoftmaxTopK) {
    os << "softmax top-" << c.num_experts_per_tok
       << (c.norm_topk_prob ? ", renormalized" : ", not renormalized");
    j["router"] = {{"scoring", "softmax"},
                   {"top_k", c.num_experts_per_tok},
                   {"renormalize", c.norm_topk_prob}};
  } else {
    os << "sigmoid + correction bias (noaux_tc), top-" << c.num_experts_per_tok << ", n_group "
       << c.n_group << ", topk_group " << c.topk_group << (c.norm_topk_prob ? ", renormalized" : "")
       << ", routed_scaling_factor " << fmt(c.routed_scaling_factor);
    j["router"] = {{"scoring", "sigmoid_noaux_tc"},
                   {"top_k", c.num_experts_per_tok},
                   {"n_group", c.n_group},
                   {"topk_group", c.topk_group},
                   {"renormalize", c.norm_topk_prob},
                   {"routed_scaling_factor", c.routed_scaling_factor}};
  }
  return os.str();
}

std::string describe_rope(const ModelConfig& c, json& j) {
  std::ostringstream os;
  const io::RopeConfig& r = c.rope;
  os << r.type << ", theta " << fmt(r.theta);
  if (r.partial_rotary_factor != 1.0) os << ", partial " << fmt(r.partial_rotary_factor);
  os << ", rotary dim " << c.rotary_dim()
     << (c.rope_style == RopeStyle::kInterleaved ? " (interleaved pairs)" : "");
  j["rope"] = {{"type", r.type},
               {"theta", r.theta},
               {"partial_rotary_factor", r.partial_rotary_factor},
               {"rotary_dim", c.rotary_dim()},
               {"interleaved", c.rope_style == RopeStyle::kInterleaved},
               {"max_position_embeddings", c.max_position_embeddings}};
  if (r.type == "yarn") {
    os << "\nyarn factor " << fmt(r.factor) << ", original_max_position_embeddings "
       << r.original_max_position_embeddings << ", beta_fast " << fmt(r.beta_fast) << ", beta_slow "
       << fmt(r.beta_slow) << ", attention factor " << fmt(r.yarn_attention_factor());
    j["rope"]["factor"] = r.factor;
    j["rope"]["original_max_position_embeddings"] = r.original_max_position_embeddings;
  }
  os << "\nmax_position_embeddings " << c.max_position_embeddings;
  return os.str();
}

int inspect_model(const fs::path& dir, bool as_json) {
  const ModelConfig c = io::load_model_config(dir);
  const json raw = read_json(dir / "config.json");
  const io::SafetensorsStore store = io::SafetensorsStore::open_dir(dir, "model");
  Report report;
  json& j = report.data();
  j["kind"] = "model";
  j["path"] = dir.string();

  std::string architectures;
  const json* arch_field =
      raw.is_object() && raw.contains("architectures") ? &raw["architectures"] : nullptr;
  if (arch_field && arch_field->is_array()) {
    for (const auto& a : *arch_field) {
      if (a.is_string())
        architectures += (architectures.empty() ? "" : ", ") + a.get<std::string>();
    }
  }
  report.row("path", dir.string());
  report.row("architecture",
             (architectures.empty() ? std::string("(no architectures field)") : architectures) +
                 " (model_type " + c.model_type +
                 (c.text_model_type != c.model_type ? ", text " + c.text_model_type : "") + ")");
  j["architectures"] = architectures;
  j["model_type"] = c.model_type;
  j["text_model_type"] = c.text_model_type;

  std::vector<int64_t> moe_layers, dense_layers, linear_layers;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    (c.is_moe_layer(l) ? moe_layers : dense_layers).push_back(l);
    if (!c.layer_types.empty() && c.layer_types[static_cast<size_t>(l)] == "linear_attention")
      linear_layers.push_back(l);
  }
  // Qwen3.5: how many layers are Gated DeltaNet (linear attention) and how many full attention
  const std::string attention_mix =
      c.layer_types.empty()
          ? ""
          : "; " + std::to_string(linear_layers.size()) + " Gated DeltaNet + " +
                std::to_string(c.layer_types.size() - linear_layers.size()) + " full attention";
  report.row("layers",
             std::to_string(c.num_hidden_layers) + " (" + std::to_string(moe_layers.size()) +
                 " MoE" +
                 (dense_layers.empty() ? "" : ", dense MLP in " + format_ranges(dense_layers)) +
                 attention_mix + ")");
  report.row("hidden size", std::to_string(c.hidden_size));
  report.row("vocabulary", std::to_string(c.vocab_size));
  j["layers"] = c.num_hidden_layers;
  j["moe_layers"] = moe_layers;
  j["dense_layers"] = dense_layers;
  if (!c.layer_types.empty()) j["linear_attention_layers"] = linear_layers;
  j["hidden_size"] = c.hidden_size;
  j["vocab_size"] = c.vocab_size;
  report.row("attention", describe_attention(c, j));

  std::string experts = std::to_string(c.num_experts) + " routed, top-" +
                        std::to_string(c.num_experts_per_tok) + ", moe_intermediate_size " +
                        std::to_string(c.moe_intermediate_size);
  if (c.shared_expert_intermediate_size > 0) {
    experts += "\nshared expert, intermediate " +
               std::to_string(c.shared_expert_intermediate_size) +
               (c.shared_expert_gate ? " (sigmoid-gated)" : "");
  }
  const std::vector<std::string> names = store.names();
  const bool fused = std::any_of(names.begin(), names.end(), [](const std::string& n) {
    return ends_with(n, ".experts.gate_up_proj");
  });
  experts += std::string("\non disk: ") +
             (fused ? "fused (experts.gate_up_proj [E, 2I, H])" : "per expert");
  report.row("experts", experts);
  if (!dense_layers.empty())
    report.row("dense MLP", "intermediate_size " + std::to_string(c.intermediate_size));
  j["experts"] = {{"routed", c.num_experts},
                  {"top_k", c.num_experts_per_tok},
                  {"moe_intermediate_size", c.moe_intermediate_size},
                  {"shared_intermediate_size", c.shared_expert_intermediate_size},
                  {"shared_expert_gate", c.shared_expert_gate},
                  {"fused_on_disk", fused}};
  j["intermediate_size"] = c.intermediate_size;
  report.row("router", describe_router(c, j));
  report.row("rope", describe_rope(c, j));

  // Tensors: dtypes, bytes, quantized linears, parameters (packed NVFP4 counts 2 per byte;
  // scale tensors are not parameters).
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // name -> (tensors, bytes)
  uint64_t parameters = 0, fp8_linears = 0, nvfp4_linears = 0, scale_bytes = 0;
  for (const std::string& name : names) {
    const io::TensorInfo& info = store.info(name);
    auto& [count, bytes] = by_dtype[std::string(dtype_name(info.dtype))];
    ++count;
    bytes += info.nbytes();
    const uint64_t numel = static_cast<uint64_t>(shape_numel(info.shape));
    const bool is_scale = ends_with(name, "_scale_inv") || ends_with(name, ".weight_scale") ||
                          ends_with(name, ".weight_scale_2") || ends_with(name, ".input_scale") ||
                          ends_with(name, ".k_scale") || ends_with(name, ".v_scale");
    if (ends_with(name, "_scale_inv")) ++fp8_linears;
    if (ends_with(name, ".weight_scale") && store.contains(name.substr(0, name.size() - 6)) &&
        store.info(name.substr(0, name.size() - 6)).dtype == DType::kU8) {
      ++nvfp4_linears;
    }
    if (is_scale) {
      scale_bytes += info.nbytes();
      continue;
    }
    const bool packed_fp4 =
        info.dtype == DType::kU8 && ends_with(name, ".weight") && store.contains(name + "_scale");
    parameters += packed_fp4 ? 2 * numel : numel;
  }

  std::string quant;
  json jq = json::object();
  jq["method"] = io::quant_method_name(c.quant.method);
  switch (c.quant.method) {
    case QuantMethod::kNone: quant = "none"; break;
    case QuantMethod::kFp8Block:
      quant = "fp8 e4m3, " + std::to_string(c.quant.block_n) + "x" +
              std::to_string(c.quant.block_k) + " weight blocks (weight_scale_inv), " +
              c.quant.activation_scheme + " activations" +
              (c.quant.scale_fmt.empty() ? "" : ", scale_fmt " + c.quant.scale_fmt);
      jq["block"] = {c.quant.block_n, c.quant.block_k};
      break;
    case QuantMethod::kNvfp4:
      quant =
          "nvfp4 (ModelOpt), e2m1 + e4m3 scale per " + std::to_string(c.quant.group_size) +
          " inputs + fp32 scale_2, from " + c.quant.source +
          (c.quant.kv_cache_quant_algo.empty() ? "" : ", KV cache " + c.quant.kv_cache_quant_algo);
      jq["group_size"] = c.quant.group_size;
      jq["source"] = c.quant.source;
      break;
  }
  if (c.quant.method != QuantMethod::kNone) {
    const uint64_t n = c.quant.method == QuantMethod::kFp8Block ? fp8_linears : nvfp4_linears;
    quant +=
        "\n" + std::to_string(n) + " quantized weight tensors, scales " + format_bytes(scale_bytes);
    if (!c.quant.modules_to_not_convert.empty()) {
      std::string excluded;
      const size_t shown = std::min<size_t>(c.quant.modules_to_not_convert.size(), 4);
      for (size_t i = 0; i < shown; ++i)
        excluded += (i ? ", " : "") + c.quant.modules_to_not_convert[i];
      if (c.quant.modules_to_not_convert.size() > shown) {
        excluded += ", ... (" + std::to_string(c.quant.modules_to_not_convert.size()) + " in all)";
      }
      quant += "\nunquantized: " + excluded;
    }
    jq["quantized_tensors"] = n;
    jq["modules_to_not_convert"] = c.quant.modules_to_not_convert;
  }
  report.row("quantization", quant);
  j["quantization"] = jq;

  std::string dtypes;
  json jd = json::object();
  for (const auto& [name, stats] : by_dtype) {
    dtypes += (dtypes.empty() ? "" : "\n") + name + ": " + std::to_string(stats.first) +
              " tensors, " + format_bytes(stats.second);
    jd[name] = {{"tensors", stats.first}, {"bytes", stats.second}};
  }
  report.row("dtypes", dtypes);
  j["dtypes"] = jd;
  const fs::path source = store.source();
  const bool sharded = ends_with(source.string(), ".index.json");
  std::set<std::string> files;
  for (const std::string& name : names) files.insert(store.file_of(name).filename().string());
  report.row("tensors", std::to_string(store.size()) + " in " + source.filename().string() +
                            (sharded ? " (" + std::to_string(files.size()) + " shards)" : ""));
  j["files"] = files.size();
  report.row("parameters", format_count(parameters) + " (" + std::to_string(parameters) + ")");
  report.row("size", format_bytes(store.total_bytes()) + " (" +
                         std::to_string(store.total_bytes()) + " bytes)");
  report.row("tied embeddings", c.tie_word_embeddings ? "yes" : "no");
  j["tensors"] = store.size();
  j["sharded"] = sharded;
  j["parameters"] = parameters;
  j["bytes"] = store.total_bytes();
  j["tie_word_embeddings"] = c.tie_word_embeddings;

  std::vector<std::string> tokenizer_files;
  std::error_code ec;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
    if (fs::is_regular_file(dir / name, ec)) tokenizer_files.push_back(name);
  }
  std::string tokenizer;
  for (const std::string& f : tokenizer_files) tokenizer += (tokenizer.empty() ? "" : ", ") + f;
  report.row("tokenizer", tokenizer.empty() ? "none" : tokenizer);
  j["tokenizer"] = tokenizer_files;
  if (raw.is_object() && raw.contains("moelora_synth") && raw["moelora_synth"].is_object()) {
    const json& s = raw["moelora_synth"];
    report.row("synthetic", "moelora synth --preset " + s.value("preset", std::string("?")) +
                                " --quant " + s.value("quant", std::string("?")) + " --seed " +
                                std::to_string(s.value("seed", uint64_t{0})));
    j["synthetic"] = s;
  }

  // Full validation through the loader.
  // The loader also names the tensors it skips (as transformers does): a vision tower, an MTP
  // layer, ... Say how many and why, so a checkpoint larger than its model is no surprise.
  std::string check = "ok";
  bool ok = true;
  try {
    io::LoadOptions options;
    options.show_progress = false;
    const io::ModelWeights weights = io::load_checkpoint(dir, options);
    if (!weights.ignored_tensors.empty()) {
      const std::vector<IgnoredGroup> groups =
          group_ignored(weights.ignored_tensors, c, weights.weight_prefix);
      const size_t n = weights.ignored_tensors.size();
      std::string note = std::to_string(n) + (n == 1 ? " tensor" : " tensors") +
                         " not used by the " + c.text_model_type + " text model (skipped on load)";
      json jg = json::array();
      for (const IgnoredGroup& g : groups) {
        note += "\n" + std::to_string(g.count) + " " + g.pattern + ": " + g.why;
        jg.push_back({{"tensors", g.pattern}, {"count", g.count}, {"why", g.why}});
      }
      report.row("ignored", note);
      j["ignored_tensors"] = {{"count", n}, {"groups", jg}};
    }
  } catch (const Error& e) {
    check = std::string("FAILED: ") + e.what();
    ok = false;
  }
  report.row("check", check);
  j["check"] = ok ? "ok" : check;
  report.print(as_json);
  return ok ? 0 : 1;
}

// ============================================================================================
// adapter directories

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
    if (starts_with(module, "base_model.model.")) module = module.substr(17);
    bool is_a = false;
    for (const char* suffix : {".lora_A.weight", ".lora_B.weight", ".lora_A", ".lora_B"}) {
      if (ends_with(module, suffix)) {
        is_a = std::string(suffix).find("lora_A") != std::string::npos;
        module = module.substr(0, module.size() - std::string(suffix).size());
        break;
      }
    }
    // PEFT 3-D wrappers: experts.base_layer (inner, gate_up_proj when both are targeted) and
    // experts
    std::string scaling_path = module;
    const bool wrapper = ends_with(module, ".experts") || ends_with(module, ".experts.base_layer");
    if (wrapper) {
      peft3d = true;
      std::string parameter = ends_with(module, ".base_layer") ? "gate_up_proj" : "down_proj";
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
      const bool outer = ends_with(path.kind, "down_proj") ? !is_a : is_a;
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
      line +=
          "\n  r " + rank + ", scaling " + fmt(rank_scaling.second) +
          (layer_list.empty() || layer_list.front() < 0 ? ""
                                                        : ", layers " + format_ranges(layer_list));
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

struct InspectOptions {
  std::string dir;
  std::string model;
  bool json = false;
};

int run_inspect(const InspectOptions& o) {
  const fs::path dir(o.dir);
  std::error_code ec;
  MOELORA_CHECK(fs::is_directory(dir, ec), ErrorCode::kNotFound, dir.string(), ": not a directory");
  if (fs::is_regular_file(dir / "adapter_config.json", ec))
    return inspect_adapter(dir, o.model, o.json);
  MOELORA_CHECK(fs::is_regular_file(dir / "config.json", ec), ErrorCode::kNotFound, dir.string(),
                ": neither a model (config.json) nor an adapter (adapter_config.json) directory");
  return inspect_model(dir, o.json);
}

std::function<int()> setup_inspect(CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  app.add_option("dir", o->dir, "Model directory (config.json + safetensors) or adapter directory")
      ->required();
  app.add_flag("--json", o->json, "Print JSON instead of the table");
  app.add_option("--model", o->model,
                 "For an adapter: the base model directory to check it against (default: "
                 "base_model_name_or_path when that is a directory)");
  app.footer(
      "\nThe last row, check, is the loader's verdict: the model or adapter is loaded and\n"
      "validated (every shape and dtype against config.json); the exit code is 1 when that\n"
      "fails.");
  return [o] { return run_inspect(*o); };
}

MOELORA_SUBCOMMAND("inspect", "Describe a model or adapter directory and check that it loads", 62,
                   setup_inspect);

}  // namespace
}  // namespace moelora::cli
