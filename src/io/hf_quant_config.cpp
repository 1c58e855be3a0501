// Quantization configs: config.json's quantization_config (FP8 block-wise, ModelOpt NVFP4) and
// the legacy ModelOpt hf_quant_config.json, parsed into QuantConfig and written back
// (FORMATS.md §4.1-4.2), and which modules a config leaves unquantized.
#include <cctype>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_config.h"
#include "io/hf_config_fields.h"

namespace moelora::io {
namespace hf_config_internal {
namespace {

// Case-insensitive equality for algorithm names ("NVFP4", "nvfp4").
bool same_name(std::string a, std::string b) {
  auto lower = [](std::string& s) {
    for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  };
  lower(a);
  lower(b);
  return a == b;
}

void check_nvfp4_algo(const Fields& f, const std::string& key) {
  MOELORA_CHECK(f.has(key), ErrorCode::kUnsupported, f.source(), ": field '", f.path(key),
                "' is null or missing (no weight quantization); supported: NVFP4");
  const std::string algo = f.string(key);
  MOELORA_CHECK(same_name(algo, "NVFP4"), ErrorCode::kUnsupported, f.source(), ": field '",
                f.path(key), "' is \"", algo, "\"; the only supported ModelOpt algorithm is NVFP4");
}

// kv_cache_quant_algo ("FP8" or null) or a compressed-tensors style kv_cache_scheme
// ({"num_bits": 8, "type": "float", ...}) -> "" or "FP8".
std::string parse_kv_cache_algo(const Fields& f) {
  std::string algo;
  if (f.has("kv_cache_quant_algo")) {
    algo = f.string("kv_cache_quant_algo");
    MOELORA_CHECK(same_name(algo, "FP8"), ErrorCode::kUnsupported, f.source(), ": field '",
                  f.path("kv_cache_quant_algo"), "' is \"", algo, "\"; supported: null or \"FP8\"");
    algo = "FP8";
  }
  if (f.object("kv_cache_scheme") != nullptr) {
    const Fields kv = f.sub("kv_cache_scheme");
    const int64_t bits = kv.integer("num_bits");
    const std::string type = kv.string("type", "float");
    MOELORA_CHECK(bits == 8 && type == "float", ErrorCode::kUnsupported, f.source(), ": field '",
                  f.path("kv_cache_scheme"), "' describes a ", bits, "-bit ", type,
                  " KV cache; only 8-bit float (FP8) is supported");
    algo = "FP8";
  }
  return algo;
}

int parse_group_size(const Fields& f) {
  int64_t group = 16;
  if (f.has("group_size")) {
    group = f.integer("group_size");
  } else if (const json* groups = f.object("config_groups")) {
    // newer ModelOpt exports: config_groups.<name>.weights.group_size
    for (const auto& [name, value] : groups->items()) {
      if (value.is_object() && value.contains("weights") && value["weights"].is_object()) {
        const Fields weights(value["weights"], f.source(),
                             f.path("config_groups." + name + ".weights."));
        group = weights.integer("group_size", group);
      }
    }
  }
  MOELORA_CHECK(group == 16, ErrorCode::kUnsupported, f.source(), ": NVFP4 group size is ", group,
                " (field '", f.path("group_size"), "'); only 16 is supported");
  return 16;
}

// Glob match where '*' matches any run of characters (fnmatch without character classes).
bool glob_match(std::string_view pattern, std::string_view text) {
  size_t p = 0, t = 0, star = std::string_view::npos, resume = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace

QuantConfig parse_quantization_config(const Fields& q) {
  QuantConfig quant;
  quant.source = "config.json";
  const std::string method = q.string("quant_method");
  if (method == "fp8") {
    quant.method = QuantMethod::kFp8Block;
    const std::string fmt = q.string("fmt", "e4m3");
    MOELORA_CHECK(fmt == "e4m3", ErrorCode::kUnsupported, q.source(), ": field '", q.path("fmt"),
                  "' is \"", fmt, "\"; only e4m3 FP8 weights are supported");
    MOELORA_CHECK(
        q.has("weight_block_size"), ErrorCode::kUnsupported, q.source(), ": field '",
        q.path("weight_block_size"),
        "' is missing: per-tensor FP8 is not supported, expected block scales [128, 128]");
    const std::vector<int64_t> block = q.integer_list("weight_block_size");
    MOELORA_CHECK(block == (std::vector<int64_t>{128, 128}), ErrorCode::kUnsupported, q.source(),
                  ": field '", q.path("weight_block_size"), "' is ",
                  describe(q.at("weight_block_size")), "; only [128, 128] blocks are supported");
    quant.block_n = quant.block_k = 128;
    quant.activation_scheme = q.string("activation_scheme", "dynamic");
    MOELORA_CHECK(quant.activation_scheme == "dynamic", ErrorCode::kUnsupported, q.source(),
                  ": field '", q.path("activation_scheme"), "' is \"", quant.activation_scheme,
                  "\"; only dynamic FP8 activation scaling is supported");
    quant.scale_fmt = q.string("scale_fmt", "");
    if (quant.scale_fmt == "float") quant.scale_fmt.clear();  // FineGrainedFP8Config's default
    MOELORA_CHECK(quant.scale_fmt.empty() || quant.scale_fmt == "ue8m0", ErrorCode::kUnsupported,
                  q.source(), ": field '", q.path("scale_fmt"), "' is \"", quant.scale_fmt,
                  "\"; supported: float, ue8m0");
    for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
      for (std::string& m : q.string_list(key))
        quant.modules_to_not_convert.push_back(std::move(m));
    }
    return quant;
  }
  if (method == "modelopt") {
    quant.method = QuantMethod::kNvfp4;
    check_nvfp4_algo(q, "quant_algo");
    quant.group_size = parse_group_size(q);
    quant.kv_cache_quant_algo = parse_kv_cache_algo(q);
    for (const char* key : {"ignore", "exclude_modules"}) {
      for (std::string& m : q.string_list(key))
        quant.modules_to_not_convert.push_back(std::move(m));
    }
    return quant;
  }
  MOELORA_THROW(ErrorCode::kUnsupported, q.source(), ": field '", q.path("quant_method"), "' is \"",
                method, "\"; supported: fp8 (block-wise [128, 128]) and modelopt (NVFP4)");
}

json quant_to_json(const QuantConfig& q) {
  switch (q.method) {
    case QuantMethod::kNone: return nullptr;
    case QuantMethod::kFp8Block: {
      json j = {
          {"quant_method", "fp8"},
          {"fmt", "e4m3"},
          {"activation_scheme", q.activation_scheme.empty() ? "dynamic" : q.activation_scheme},
          {"weight_block_size", {q.block_n, q.block_k}}};
      if (!q.scale_fmt.empty()) j["scale_fmt"] = q.scale_fmt;
      if (!q.modules_to_not_convert.empty()) j["modules_to_not_convert"] = q.modules_to_not_convert;
      return j;
    }
    case QuantMethod::kNvfp4: {
      json j = {
          {"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"group_size", q.group_size}};
      if (!q.modules_to_not_convert.empty()) j["ignore"] = q.modules_to_not_convert;
      if (!q.kv_cache_quant_algo.empty()) {
        j["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}, {"dynamic", false}};
      }
      return j;
    }
  }
  return nullptr;
}

}  // namespace hf_config_internal

using hf_config_internal::describe;
using hf_config_internal::Fields;
using json = nlohmann::json;

const char* quant_method_name(QuantMethod q) {
  switch (q) {
    case QuantMethod::kNone: return "none";
    case QuantMethod::kFp8Block: return "fp8-block";
    case QuantMethod::kNvfp4: return "nvfp4";
  }
  return "unknown";
}

bool QuantConfig::operator==(const QuantConfig& o) const {
  return method == o.method && block_n == o.block_n && block_k == o.block_k &&
         group_size == o.group_size && activation_scheme == o.activation_scheme &&
         scale_fmt == o.scale_fmt && kv_cache_quant_algo == o.kv_cache_quant_algo &&
         modules_to_not_convert == o.modules_to_not_convert;
}

bool QuantConfig::is_excluded(const std::string& module) const {
  // Component boundaries of the module name: the ends of its ancestors and the starts of its
  // trailing runs of components.
  std::vector<size_t> dots;
  for (size_t i = 0; i < module.size(); ++i) {
    if (module[i] == '.') dots.push_back(i);
  }
  for (std::string pattern : modules_to_not_convert) {
    while (!pattern.empty() && pattern.back() == '.') pattern.pop_back();
    if (pattern.empty()) continue;
    if (hf_config_internal::glob_match(pattern, module)) return true;
    const std::string_view name(module);
    for (size_t dot : dots) {
      if (hf_config_internal::glob_match(pattern, name.substr(0, dot))) return true;  // an ancestor
      if (hf_config_internal::glob_match(pattern, name.substr(dot + 1)))
        return true;  // a trailing run
    }
  }
  return false;
}

QuantConfig parse_hf_quant_config(const json& config, const std::string& source) {
  MOELORA_CHECK(config.is_object(), ErrorCode::kInvalidFile, source,
                ": expected a JSON object, got ", describe(config));
  const Fields top(config, source, "");
  MOELORA_CHECK(top.object("quantization") != nullptr, ErrorCode::kInvalidFile, source,
                ": missing field 'quantization'");
  const Fields q = top.sub("quantization");
  QuantConfig quant;
  quant.source = "hf_quant_config.json";
  quant.method = QuantMethod::kNvfp4;
  hf_config_internal::check_nvfp4_algo(q, "quant_algo");
  quant.group_size = hf_config_internal::parse_group_size(q);
  quant.kv_cache_quant_algo = hf_config_internal::parse_kv_cache_algo(q);
  for (const char* key : {"exclude_modules", "ignore"}) {
    for (std::string& m : q.string_list(key)) quant.modules_to_not_convert.push_back(std::move(m));
  }
  return quant;
}

json hf_quant_config_to_json(const QuantConfig& quant) {
  MOELORA_CHECK(quant.method == QuantMethod::kNvfp4, ErrorCode::kInvalidArgument,
                "hf_quant_config.json describes ModelOpt NVFP4 only, not ",
                quant_method_name(quant.method));
  json q = {
      {"quant_algo", "NVFP4"},
      {"group_size", quant.group_size},
      {"exclude_modules", quant.modules_to_not_convert},
      {"kv_cache_quant_algo", quant.kv_cache_quant_algo.empty() ? json(nullptr) : json("FP8")}};
  return {{"producer", {{"name", "modelopt"}, {"version", "moelora"}}},
          {"quantization", std::move(q)}};
}

}  // namespace moelora::io
