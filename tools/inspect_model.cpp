// `moelora inspect` on a model directory: the config (architecture, layers, attention, experts,
// router, RoPE, quantization), the safetensors headers (dtypes, bytes, parameters), the tensors
// the loader skips and why, and the loader's verdict (tools/inspect.cpp has the overview).
#include <map>
#include <optional>
#include <set>

#include "core/error.h"
#include "format.h"
#include "inspect_internal.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "io/safetensors.h"

namespace moelora::cli::inspect {
namespace {

using io::Architecture;
using io::ModelConfig;
using io::QuantMethod;

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
    if (name.starts_with("mtp.")) {
      add("mtp.*", "the multi-token prediction layer (speculative decoding), not run here");
    } else if (name.ends_with(".rotary_emb.inv_freq")) {
      add("*.rotary_emb.inv_freq", "RoPE frequencies, recomputed from config.json");
    } else if (name.ends_with(".k_scale") || name.ends_with(".v_scale")) {
      add("*.self_attn.{k,v}_scale", "FP8 KV-cache scales; the engine keeps a bf16 KV cache");
    } else if (c.tie_word_embeddings && name.ends_with("lm_head.weight")) {
      add(name, "tied to the embeddings");
    } else if (name.starts_with(layers)) {
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

}  // namespace

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
                 (dense_layers.empty() ? "" : ", dense MLP in " + io::format_ranges(dense_layers)) +
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
    return n.ends_with(".experts.gate_up_proj");
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
    const bool is_scale = name.ends_with("_scale_inv") || name.ends_with(".weight_scale") ||
                          name.ends_with(".weight_scale_2") || name.ends_with(".input_scale") ||
                          name.ends_with(".k_scale") || name.ends_with(".v_scale");
    if (name.ends_with("_scale_inv")) ++fp8_linears;
    if (name.ends_with(".weight_scale") && store.contains(name.substr(0, name.size() - 6)) &&
        store.info(name.substr(0, name.size() - 6)).dtype == DType::kU8) {
      ++nvfp4_linears;
    }
    if (is_scale) {
      scale_bytes += info.nbytes();
      continue;
    }
    const bool packed_fp4 =
        info.dtype == DType::kU8 && name.ends_with(".weight") && store.contains(name + "_scale");
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
  const bool sharded = source.string().ends_with(".index.json");
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

}  // namespace moelora::cli::inspect
