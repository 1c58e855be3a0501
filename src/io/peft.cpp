// PEFT LoRA adapter loading: adapter_config.json parsing with PEFT's matching and scaling rules,
// and adapter_model.safetensors normalized to the canonical A [Ea, R, in] / B [Eb, out, R] form
// of DESIGN.md §2 for the base model's architecture (see io/peft.h for the accepted layouts).
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
#include "io/input_limits.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string_view>
#include <unordered_map>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

constexpr std::string_view kPeftPrefix = "base_model.model.";

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}
bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string last_component(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

// Digits only, no sign, fits int64.
std::optional<int64_t> parse_index(std::string_view s) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end != s.data() + s.size() || s[0] == '-' || s[0] == '+') return std::nullopt;
  return value;
}

// A JSON value for an error message, cut short when long.
std::string brief(const ojson& value) {
  std::string text = value.dump();
  if (text.size() > 160) text = text.substr(0, 157) + "...";
  return text;
}

std::string format_number(double value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

// "0-2, 5, 7-9"
std::string format_ranges(const std::vector<int64_t>& sorted) {
  std::string out;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(sorted[i]);
    if (j > i) out += "-" + std::to_string(sorted[j]);
    i = j + 1;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Python `re` semantics through PCRE2 (UTF + UCP: Python 3 str patterns are Unicode-aware).

class PyRegex {
 public:
  // full: the match must span the whole subject (re.fullmatch); otherwise it only has to start
  // at the beginning (re.match).
  PyRegex(const std::string& pattern, bool full) {
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    const uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED | (full ? PCRE2_ENDANCHORED : 0u);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error_code,
                          &error_offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR buffer[256];
      pcre2_get_error_message(error_code, buffer, sizeof(buffer));
      error_ =
          std::string(reinterpret_cast<const char*>(buffer)) + " at offset " + std::to_string(error_offset);
      return;
    }
    // JIT is only an optimisation: the interpreter gives the same answers.
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
    pcre2_pattern_info(code_, PCRE2_INFO_CAPTURECOUNT, &captures_);
  }
  ~PyRegex() {
    if (code_ != nullptr) pcre2_code_free(code_);
  }
  PyRegex(const PyRegex&) = delete;
  PyRegex& operator=(const PyRegex&) = delete;

  bool ok() const { return code_ != nullptr; }
  const std::string& error() const { return error_; }

  // True on a match; *last_group receives the text of the highest-numbered capture group.
  bool match(std::string_view subject, std::string* last_group = nullptr) const {
    MOELORA_ASSERT(code_ != nullptr);
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    MOELORA_CHECK(data != nullptr, ErrorCode::kInternal, "out of memory creating PCRE2 match data");
    const auto* bytes = reinterpret_cast<PCRE2_SPTR>(subject.data());
    int rc = pcre2_match(code_, bytes, subject.size(), 0, 0, data.get(), nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      rc = pcre2_match(code_, bytes, subject.size(), 0, PCRE2_NO_JIT, data.get(), nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    MOELORA_CHECK(rc >= 0, ErrorCode::kInvalidArgument, "matching a regex against '", subject,
                  "' failed with PCRE2 error ", rc);
    if (last_group != nullptr && captures_ > 0) {
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
      const PCRE2_SIZE begin = ovector[2 * captures_], end = ovector[2 * captures_ + 1];
      *last_group = begin == PCRE2_UNSET ? std::string() : std::string(subject.substr(begin, end - begin));
    }
    return true;
  }

 private:
  pcre2_code* code_ = nullptr;
  uint32_t captures_ = 0;
  std::string error_;
};

// Compiled regexes by pattern, shared by every config and thread. Patterns come from adapter
// configs, so the set is small; it is dropped wholesale if it ever grows large.
std::shared_ptr<const PyRegex> cached_regex(const std::string& pattern, bool full) {
  static std::mutex mutex;
  static std::unordered_map<std::string, std::shared_ptr<const PyRegex>> cache;
  std::string key = (full ? "F" : "P") + pattern;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= 4096) cache.clear();
  auto regex = std::make_shared<const PyRegex>(pattern, full);
  cache.emplace(std::move(key), regex);
  return regex;
}

// The regex PEFT's get_pattern_key builds around a rank_pattern / alpha_pattern key.
std::string pattern_key_regex(const std::string& key) {
  return "(.*\\.)?(" + key + ")";
}
// The regex check_target_module_exists uses to find the layer index of a module.
std::string layer_index_regex(const std::string& layers_pattern) {
  return ".*\\." + layers_pattern + "\\.(\\d+)\\.";
}

// Throws kInvalidArgument naming `what` when the pattern does not compile.
std::shared_ptr<const PyRegex> checked_regex(const std::string& pattern, bool full, const std::string& what) {
  auto regex = cached_regex(pattern, full);
  MOELORA_CHECK(regex->ok(), ErrorCode::kInvalidArgument, what, " '", pattern,
                "' is not a valid regex: ", regex->error());
  return regex;
}

template <typename T>
std::optional<size_t> first_pattern_match(const std::vector<std::pair<std::string, T>>& patterns,
                                          const std::string& path, const char* field) {
  for (size_t i = 0; i < patterns.size(); ++i) {
    const auto regex = checked_regex(pattern_key_regex(patterns[i].first), true, std::string(field) + " key");
    if (regex->match(path)) return i;
  }
  return std::nullopt;
}

// PEFT: the number after the last ".<layers_pattern>." in the module path ("layers" by default
// any component), found by `re.match(rf".*\.{pattern}\.(\d+)\.", key)`; the greedy `.*` makes it
// the last such occurrence.
std::optional<int64_t> peft_layer_index(const std::string& key,
                                        const std::vector<std::string>& layers_pattern) {
  static const std::vector<std::string> kAnyComponent = {"[^.]*"};
  for (const std::string& pattern : layers_pattern.empty() ? kAnyComponent : layers_pattern) {
    std::string digits;
    if (checked_regex(layer_index_regex(pattern), false, "layers_pattern")->match(key, &digits)) {
      return parse_index(digits);
    }
  }
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// AdapterConfig

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

std::optional<std::string> AdapterConfig::rank_pattern_key(const std::string& path) const {
  const auto index = first_pattern_match(rank_pattern, path, "rank_pattern");
  if (!index) return std::nullopt;
  return rank_pattern[*index].first;
}

std::optional<std::string> AdapterConfig::alpha_pattern_key(const std::string& path) const {
  const auto index = first_pattern_match(alpha_pattern, path, "alpha_pattern");
  if (!index) return std::nullopt;
  return alpha_pattern[*index].first;
}

int64_t AdapterConfig::rank_for(const std::string& path) const {
  const auto index = first_pattern_match(rank_pattern, path, "rank_pattern");
  return index ? rank_pattern[*index].second : r;
}

double AdapterConfig::alpha_for(const std::string& path) const {
  const auto index = first_pattern_match(alpha_pattern, path, "alpha_pattern");
  return index ? alpha_pattern[*index].second : lora_alpha;
}

double AdapterConfig::scaling_for(const std::string& path) const {
  const int64_t rank = rank_for(path);
  MOELORA_CHECK(rank > 0, ErrorCode::kInvalidArgument, "adapter config",
                source.empty() ? std::string() : " " + source.string(), ": rank of '", path, "' is ", rank,
                "; it must be positive");
  const double alpha = alpha_for(path);
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

bool AdapterConfig::targets_module(const std::string& key) const {
  if (exclude_modules_regex) {
    if (checked_regex(*exclude_modules_regex, true, "exclude_modules")->match(key)) return false;
  } else {
    for (const std::string& excluded : exclude_modules) {
      if (key == excluded || ends_with(key, "." + excluded)) return false;
    }
  }
  if (target_modules_regex) return checked_regex(*target_modules_regex, true, "target_modules")->match(key);

  bool found = false;
  if (target_all_linear) {
    found = last_component(key) != "lm_head";
  } else if (target_modules.empty()) {
    // No target_modules at all: PEFT then only adapts target_parameters when those are given;
    // with neither, every module counts as targeted (the tensors decide).
    return target_parameters.empty();
  } else {
    if (std::find(target_modules.begin(), target_modules.end(), key) != target_modules.end()) return true;
    found = std::any_of(target_modules.begin(), target_modules.end(),
                        [&](const std::string& target) { return ends_with(key, "." + target); });
  }
  if (!found || layers_to_transform.empty()) return found;
  const auto layer = peft_layer_index(key, layers_pattern);
  return layer && std::find(layers_to_transform.begin(), layers_to_transform.end(), *layer) !=
                      layers_to_transform.end();
}

bool AdapterConfig::targets_parameter(const std::string& parameter_path) const {
  return std::any_of(target_parameters.begin(), target_parameters.end(), [&](const std::string& target) {
    return parameter_path == target || ends_with(parameter_path, "." + target);
  });
}

// ---------------------------------------------------------------------------------------------
// parse_adapter_config

namespace {

// Typed access to the fields of adapter_config.json; JSON null counts as absent, as in PEFT.
class ConfigFields {
 public:
  ConfigFields(const ojson& json, std::string source) : json_(json), source_(std::move(source)) {}

  const std::string& source() const { return source_; }
  const ojson* get(const char* key) const {
    auto it = json_.find(key);
    return (it == json_.end() || it->is_null()) ? nullptr : &*it;
  }
  [[noreturn]] void bad(const char* key, const char* expected) const {
    MOELORA_THROW(ErrorCode::kInvalidFile, source_, ": field '", key, "' must be ", expected, ", got ",
                  brief(json_.at(key)));
  }
  [[noreturn]] void unsupported(const char* key, const std::string& why) const {
    MOELORA_THROW(ErrorCode::kUnsupported, source_, ": field '", key, "' is ", brief(json_.at(key)), ": ",
                  why);
  }

  bool boolean(const char* key, bool fallback) const {
    const ojson* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) bad(key, "true or false");
    return v->get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    const ojson* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_string()) bad(key, "a string");
    return v->get<std::string>();
  }
  int64_t positive_integer(const char* key, int64_t fallback) const {
    const ojson* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_number_integer() || v->get<int64_t>() <= 0) bad(key, "a positive integer");
    return v->get<int64_t>();
  }
  double finite_number(const char* key, double fallback) const {
    const ojson* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_number() || !std::isfinite(v->get<double>())) bad(key, "a finite number");
    return v->get<double>();
  }
  std::vector<std::string> string_list(const char* key) const {
    const ojson* v = get(key);
    std::vector<std::string> out;
    if (v == nullptr) return out;
    if (!v->is_array()) bad(key, "a list of strings");
    for (const ojson& item : *v) {
      if (!item.is_string()) bad(key, "a list of strings");
      out.push_back(item.get<std::string>());
    }
    return out;
  }
  // A list of strings, a single string (returned in *single), or null.
  std::vector<std::string> string_or_list(const char* key, std::optional<std::string>* single) const {
    const ojson* v = get(key);
    if (v != nullptr && v->is_string()) {
      *single = v->get<std::string>();
      return {};
    }
    if (v != nullptr && !v->is_array()) bad(key, "a string (regex) or a list of strings");
    return string_list(key);
  }
  // "Off" when absent, null, false, an empty list or an empty object.
  bool engaged(const char* key) const {
    const ojson* v = get(key);
    if (v == nullptr) return false;
    if (v->is_boolean()) return v->get<bool>();
    if (v->is_array() || v->is_object()) return !v->empty();
    return true;
  }

 private:
  const ojson& json_;
  std::string source_;
};

void check_regex_field(const ConfigFields& f, const char* field, const std::string& pattern, bool full,
                       const std::string& shown) {
  const auto regex = cached_regex(pattern, full);
  MOELORA_CHECK(regex->ok(), ErrorCode::kInvalidFile, f.source(), ": field '", field, "': ", shown,
                " is not a valid regex: ", regex->error());
}

}  // namespace

AdapterConfig parse_adapter_config(const fs::path& file) {
  const std::string source = file.string();
  std::error_code ec;
  MOELORA_CHECK(fs::is_regular_file(file, ec), ErrorCode::kNotFound, source,
                ": not found (a PEFT LoRA adapter directory holds adapter_config.json and "
                "adapter_model.safetensors)");
  const std::string text = read_limited_text(file, kMaxJsonFileBytes, "adapter_config.json");
  check_json_depth(text, source);

  // Every JSON exception, not only parse_error: a number too large for a double is out_of_range
  // (406) and would otherwise escape as a crash.
  ojson json;
  try {
    json = ojson::parse(text);
  } catch (const ojson::exception& e) {
    MOELORA_THROW(ErrorCode::kInvalidFile, source, ": malformed JSON: ", e.what());
  }
  MOELORA_CHECK(json.is_object(), ErrorCode::kInvalidFile, source, ": expected a JSON object, got ",
                brief(json));
  const ConfigFields f(json, source);

  AdapterConfig c;
  c.source = file;

  const std::string peft_type = f.string("peft_type", "LORA");
  if (peft_type != "LORA") f.unsupported("peft_type", "only LoRA adapters (\"LORA\") are supported");

  c.r = f.positive_integer("r", c.r);
  c.lora_alpha = f.finite_number("lora_alpha", c.lora_alpha);
  c.use_rslora = f.boolean("use_rslora", false);

  // Features that change what the adapter computes beyond a low-rank delta: rejected rather than
  // silently ignored.
  c.use_dora = f.boolean("use_dora", false);
  if (c.use_dora) {
    f.unsupported("use_dora",
                  "DoRA adapters are not supported (they rescale the whole weight, not only add B·A)");
  }
  if (f.boolean("fan_in_fan_out", false)) {
    f.unsupported("fan_in_fan_out", "fan_in_fan_out (Conv1D-style transposed weights) is not supported");
  }
  if (f.boolean("lora_bias", false)) f.unsupported("lora_bias", "LoRA bias terms are not supported");
  c.bias = f.string("bias", "none");
  if (c.bias != "none") f.unsupported("bias", "trained biases are not supported; only bias \"none\" is");
  c.modules_to_save = f.string_list("modules_to_save");
  if (!c.modules_to_save.empty()) {
    f.unsupported("modules_to_save",
                  "full copies of modules (modules_to_save) are not supported; only LoRA factors are");
  }
  if (f.engaged("alora_invocation_tokens")) {
    f.unsupported("alora_invocation_tokens",
                  "activated LoRA (applied only after invocation tokens) is not supported");
  }
  if (f.engaged("layer_replication"))
    f.unsupported("layer_replication", "layer replication is not supported");
  if (f.engaged("trainable_token_indices")) {
    f.unsupported("trainable_token_indices", "trainable token embeddings are not supported");
  }
  if (f.boolean("use_qalora", false)) f.unsupported("use_qalora", "QA-LoRA is not supported");

  // target_modules: list, regex string or "all-linear"
  std::optional<std::string> target_string;
  c.target_modules = f.string_or_list("target_modules", &target_string);
  if (target_string) {
    std::string lower = *target_string;
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](unsigned char ch) { return std::tolower(ch); });
    if (lower == "all-linear") {
      c.target_all_linear = true;
    } else {
      check_regex_field(f, "target_modules", *target_string, true, "'" + *target_string + "'");
      c.target_modules_regex = target_string;
    }
  }
  c.target_parameters = f.string_list("target_parameters");

  std::optional<std::string> exclude_string;
  c.exclude_modules = f.string_or_list("exclude_modules", &exclude_string);
  if (exclude_string) {
    check_regex_field(f, "exclude_modules", *exclude_string, true, "'" + *exclude_string + "'");
    c.exclude_modules_regex = exclude_string;
  }

  // rank_pattern / alpha_pattern: dict order matters (the first matching key wins), which is why
  // the file is parsed into an ordered_json.
  if (const ojson* v = f.get("rank_pattern")) {
    if (!v->is_object()) f.bad("rank_pattern", "an object of module pattern -> rank");
    for (const auto& [key, value] : v->items()) {
      MOELORA_CHECK(value.is_number_integer() && value.get<int64_t>() > 0, ErrorCode::kInvalidFile, source,
                    ": field 'rank_pattern': the rank of '", key, "' must be a positive integer, got ",
                    brief(value));
      check_regex_field(f, "rank_pattern", pattern_key_regex(key), true, "key '" + key + "'");
      c.rank_pattern.emplace_back(key, value.get<int64_t>());
    }
  }
  if (const ojson* v = f.get("alpha_pattern")) {
    if (!v->is_object()) f.bad("alpha_pattern", "an object of module pattern -> alpha");
    for (const auto& [key, value] : v->items()) {
      MOELORA_CHECK(value.is_number() && std::isfinite(value.get<double>()), ErrorCode::kInvalidFile, source,
                    ": field 'alpha_pattern': the alpha of '", key, "' must be a finite number, got ",
                    brief(value));
      check_regex_field(f, "alpha_pattern", pattern_key_regex(key), true, "key '" + key + "'");
      c.alpha_pattern.emplace_back(key, value.get<double>());
    }
  }

  if (const ojson* v = f.get("layers_to_transform")) {
    const auto take = [&](const ojson& item) {
      if (!item.is_number_integer() || item.get<int64_t>() < 0) {
        f.bad("layers_to_transform", "a non-negative integer or a list of them");
      }
      c.layers_to_transform.push_back(item.get<int64_t>());
    };
    if (v->is_array()) {
      for (const ojson& item : *v) take(item);
    } else {
      take(*v);
    }
  }
  std::optional<std::string> layers_pattern_string;
  c.layers_pattern = f.string_or_list("layers_pattern", &layers_pattern_string);
  if (layers_pattern_string) c.layers_pattern = {*layers_pattern_string};
  for (const std::string& pattern : c.layers_pattern) {
    check_regex_field(f, "layers_pattern", layer_index_regex(pattern), false, "'" + pattern + "'");
  }
  // The same consistency rules as PEFT's LoraConfig.
  MOELORA_CHECK(
      c.layers_to_transform.empty() || !c.target_modules_regex, ErrorCode::kInvalidFile, source,
      ": field 'layers_to_transform' cannot be used when 'target_modules' is a regex (PEFT rejects it too)");
  MOELORA_CHECK(c.layers_pattern.empty() || !c.layers_to_transform.empty(), ErrorCode::kInvalidFile, source,
                ": field 'layers_pattern' is set but 'layers_to_transform' is not (PEFT rejects it too)");

  c.base_model_name_or_path = f.string("base_model_name_or_path", "");
  return c;
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

namespace {

// 2-D targets, in the order of LayerLora's fields.
enum class Plain {
  kQ,
  kK,
  kV,
  kO,
  kQA,
  kQB,
  kKVA,
  kKVB,
  kMlpGate,
  kMlpUp,
  kMlpDown,
  kSharedGate,
  kSharedUp,
  kSharedDown
};
constexpr size_t kNumPlain = 14;

LoraWeights& plain_slot(LayerLora& layer, Plain p) {
  switch (p) {
    case Plain::kQ: return layer.q_proj;
    case Plain::kK: return layer.k_proj;
    case Plain::kV: return layer.v_proj;
    case Plain::kO: return layer.o_proj;
    case Plain::kQA: return layer.q_a_proj;
    case Plain::kQB: return layer.q_b_proj;
    case Plain::kKVA: return layer.kv_a_proj_with_mqa;
    case Plain::kKVB: return layer.kv_b_proj;
    case Plain::kMlpGate: return layer.mlp_gate;
    case Plain::kMlpUp: return layer.mlp_up;
    case Plain::kMlpDown: return layer.mlp_down;
    case Plain::kSharedGate: return layer.shared_gate;
    case Plain::kSharedUp: return layer.shared_up;
    case Plain::kSharedDown: return layer.shared_down;
  }
  MOELORA_ASSERT(false);
  return layer.q_proj;
}

// How a routed-expert tensor is keyed.
enum class ExpertForm { kNone, kPerExpert, kPeft3dOuter, kPeft3dInner, kStacked };
// Projections of the per-expert and stacked layouts (gate_up: a fused stacked LoRA).
enum class ExpertProj { kGate = 0, kUp = 1, kDown = 2, kGateUp = 3 };
constexpr std::array<const char*, 4> kExpertProjNames = {"gate_proj", "up_proj", "down_proj", "gate_up_proj"};

struct ModuleRef {
  int64_t layer = -1;
  std::string layer_prefix;  // module path up to and including "layers.<L>."
  ExpertForm form = ExpertForm::kNone;
  Plain plain = Plain::kQ;              // when form == kNone
  int64_t expert = -1;                  // kPerExpert
  ExpertProj proj = ExpertProj::kGate;  // kPerExpert, kStacked
  int64_t in = 0, out = 0;              // expected features (all but PEFT 3-D, which is resolved by shape)
};

struct ModuleEntry {
  ModuleRef ref;
  std::string module;        // path without "base_model.model."
  std::string key_a, key_b;  // tensor names in the file ("" when absent)
};

// Everything a classification error needs to say where it is.
struct Where {
  const std::string& file;
  const std::string& key;
};

[[noreturn]] void another_architecture(const Where& w, const std::string& why) {
  MOELORA_THROW(ErrorCode::kUnsupported, w.file, ": tensor '", w.key,
                "': adapter was made for another architecture: ", why);
}
[[noreturn]] void unsupported_target(const Where& w, const std::string& what) {
  MOELORA_THROW(ErrorCode::kUnsupported, w.file, ": tensor '", w.key, "': ", what, " is not supported");
}

std::string describe_base(const ModelConfig& base) {
  std::string out = architecture_name(base.arch);
  if (base.use_mla) {
    out += base.q_lora_rank > 0 ? " (MLA, q_lora_rank " + std::to_string(base.q_lora_rank) + ")"
                                : " (MLA, plain q_proj)";
  } else {
    out += " (GQA attention)";
  }
  return out;
}

// Which part of `base` the module path names (module = key without "base_model.model." and without
// the lora_A/lora_B suffix). Throws for modules the base model does not have or that are not
// supported as LoRA targets.
ModuleRef classify_module(const std::string& module, const ModelConfig& base, const Where& w) {
  ModuleRef ref;
  // The decoder's prefix: the base checkpoint's, or any of the spellings transformers uses.
  std::string rest;
  for (const std::string& prefix :
       {base.weight_prefix, std::string("model."), std::string("model.language_model."),
        std::string("language_model.model.")}) {
    if (starts_with(module, prefix + "layers.")) {
      rest = module.substr(prefix.size() + 7);
      ref.layer_prefix = prefix + "layers.";
      break;
    }
  }
  if (ref.layer_prefix.empty()) {
    const std::string leaf = last_component(module);
    if (leaf == "embed_tokens") unsupported_target(w, "LoRA on the token embedding (embed_tokens)");
    if (leaf == "lm_head") unsupported_target(w, "LoRA on the output projection (lm_head)");
    another_architecture(w, "the base model " + describe_base(base) + " has no module '" + module + "'");
  }

  const size_t dot = rest.find('.');
  const auto layer = parse_index(rest.substr(0, dot));
  if (!layer || dot == std::string::npos) {
    another_architecture(w, "'" + module + "' does not name a decoder layer of " + describe_base(base));
  }
  if (*layer >= base.num_hidden_layers) {
    another_architecture(w, "it adapts layer " + std::to_string(*layer) + " but the base model has " +
                                std::to_string(base.num_hidden_layers) + " layers");
  }
  ref.layer = *layer;
  ref.layer_prefix += std::to_string(*layer) + ".";
  const std::string sub = rest.substr(dot + 1);
  const std::string where_in_layer = "layer " + std::to_string(ref.layer) + " of the base model";

  const int64_t H = base.hidden_size;
  auto plain = [&](Plain p, int64_t in, int64_t out) {
    ref.plain = p;
    ref.in = in;
    ref.out = out;
    return ref;
  };

  if (starts_with(sub, "self_attn.")) {
    const std::string name = sub.substr(10);
    if (static_cast<size_t>(ref.layer) < base.layer_types.size() &&
        base.layer_types[ref.layer] == "linear_attention") {
      another_architecture(
          w, where_in_layer + " is a Gated DeltaNet (linear attention) layer; it has no " + sub);
    }
    const int64_t heads = base.num_attention_heads;
    if (base.use_mla) {
      const int64_t qk = base.qk_head_dim();
      if (name == "q_proj") {
        if (base.q_lora_rank > 0) {
          another_architecture(w, describe_base(base) +
                                      " has no self_attn.q_proj: queries go through q_a_proj and "
                                      "q_b_proj");
        }
        return plain(Plain::kQ, H, heads * qk);
      }
      if (name == "q_a_proj" || name == "q_b_proj") {
        if (base.q_lora_rank == 0) {
          another_architecture(w, describe_base(base) + " has no self_attn." + name +
                                      " (q_lora_rank is null: it "
                                      "has a plain q_proj)");
        }
        return name == "q_a_proj" ? plain(Plain::kQA, H, base.q_lora_rank)
                                  : plain(Plain::kQB, base.q_lora_rank, heads * qk);
      }
      if (name == "kv_a_proj_with_mqa")
        return plain(Plain::kKVA, H, base.kv_lora_rank + base.qk_rope_head_dim);
      if (name == "kv_b_proj") {
        return plain(Plain::kKVB, base.kv_lora_rank, heads * (base.qk_nope_head_dim + base.v_head_dim));
      }
      if (name == "o_proj") return plain(Plain::kO, heads * base.v_head_dim, H);
    } else {
      const int64_t q_out = heads * base.head_dim * (base.attention_output_gate ? 2 : 1);
      const int64_t kv_out = base.num_key_value_heads * base.head_dim;
      if (name == "q_proj") return plain(Plain::kQ, H, q_out);
      if (name == "k_proj") return plain(Plain::kK, H, kv_out);
      if (name == "v_proj") return plain(Plain::kV, H, kv_out);
      if (name == "o_proj") return plain(Plain::kO, heads * base.head_dim, H);
    }
    another_architecture(w, describe_base(base) + " has no LoRA target self_attn." + name);
  }
  if (starts_with(sub, "linear_attn.")) unsupported_target(w, "LoRA on Gated DeltaNet (" + sub + ")");
  if (sub == "mlp.gate") unsupported_target(w, "LoRA on the router (mlp.gate)");
  if (sub == "mlp.shared_expert_gate")
    unsupported_target(w, "LoRA on the shared-expert gate (mlp.shared_expert_gate)");
  if (!starts_with(sub, "mlp.")) another_architecture(w, describe_base(base) + " has no LoRA target " + sub);

  const bool moe = base.is_moe_layer(ref.layer);
  const std::string mlp = sub.substr(4);
  auto mlp_proj = [&](const std::string& name, Plain gate, Plain up, Plain down, int64_t inter) {
    if (name == "gate_proj") return plain(gate, H, inter);
    if (name == "up_proj") return plain(up, H, inter);
    if (name == "down_proj") return plain(down, inter, H);
    another_architecture(w, describe_base(base) + " has no LoRA target " + sub);
  };
  if (mlp == "gate_proj" || mlp == "up_proj" || mlp == "down_proj") {
    if (moe) another_architecture(w, where_in_layer + " is a MoE layer; it has no dense " + sub);
    return mlp_proj(mlp, Plain::kMlpGate, Plain::kMlpUp, Plain::kMlpDown, base.intermediate_size);
  }
  if (starts_with(mlp, "shared_expert.") || starts_with(mlp, "shared_experts.")) {
    const std::string name = mlp.substr(mlp.find('.') + 1);
    const std::string module_name = mlp.substr(0, mlp.find('.'));
    const std::string expected = base.arch == Architecture::kDeepseekV3 ? "shared_experts" : "shared_expert";
    if (module_name != expected || base.shared_expert_intermediate_size == 0 || !moe) {
      another_architecture(w, where_in_layer + " has no mlp." + module_name +
                                  (base.shared_expert_intermediate_size > 0 && moe
                                       ? " (its shared expert is mlp." + expected + ")"
                                       : std::string(" (no shared expert)")));
    }
    return mlp_proj(name, Plain::kSharedGate, Plain::kSharedUp, Plain::kSharedDown,
                    base.shared_expert_intermediate_size);
  }
  if (mlp == "experts" || starts_with(mlp, "experts.")) {
    if (!moe) another_architecture(w, where_in_layer + " has a dense MLP; it has no routed experts");
    const std::string after = mlp.substr(7);  // "", ".base_layer", ".<e>.<proj>" or ".<proj>"
    if (after.empty()) {
      ref.form = ExpertForm::kPeft3dOuter;
      return ref;
    }
    if (after == ".base_layer") {
      ref.form = ExpertForm::kPeft3dInner;
      return ref;
    }
    std::string proj_name = after.substr(1);
    const size_t next = proj_name.find('.');
    if (next != std::string::npos) {
      const auto expert = parse_index(proj_name.substr(0, next));
      if (!expert) another_architecture(w, describe_base(base) + " has no LoRA target " + sub);
      if (*expert >= base.num_experts) {
        another_architecture(w, "it adapts expert " + std::to_string(*expert) + " but the base model has " +
                                    std::to_string(base.num_experts) + " routed experts per layer");
      }
      ref.form = ExpertForm::kPerExpert;
      ref.expert = *expert;
      proj_name = proj_name.substr(next + 1);
    } else {
      ref.form = ExpertForm::kStacked;
    }
    const int64_t I = base.moe_intermediate_size;
    if (proj_name == "gate_proj" || proj_name == "up_proj") {
      ref.proj = proj_name == "gate_proj" ? ExpertProj::kGate : ExpertProj::kUp;
      ref.in = H;
      ref.out = I;
    } else if (proj_name == "down_proj") {
      ref.proj = ExpertProj::kDown;
      ref.in = I;
      ref.out = H;
    } else if (proj_name == "gate_up_proj" && ref.form == ExpertForm::kStacked) {
      ref.proj = ExpertProj::kGateUp;
      ref.in = H;
      ref.out = 2 * I;
    } else {
      another_architecture(w, describe_base(base) + " has no LoRA target " + sub);
    }
    return ref;
  }
  another_architecture(w, describe_base(base) + " has no LoRA target " + sub);
}

// One LoRA factor as stored: element (i, j) of the logical [rows, cols] matrix is element
// offset + i * row_stride + j * col_stride of `t` (any float dtype, read through load_as_f32 so
// unaligned mmap'ed data is fine).
struct FactorView {
  Tensor t;
  int64_t offset = 0, row_stride = 0, col_stride = 1;
  int64_t rows = 0, cols = 0;

  // dst[0, cols) = row i * ratio (ratio 1: the stored value converted to fp32, exactly).
  void copy_row(int64_t i, float* dst, double ratio) const {
    const int64_t start = offset + i * row_stride;
    if (t.dtype() == DType::kF32 && col_stride == 1 && ratio == 1.0) {
      std::memcpy(dst, static_cast<const char*>(t.raw_data()) + 4 * start, static_cast<size_t>(cols) * 4);
      return;
    }
    for (int64_t j = 0; j < cols; ++j) {
      const float v = load_as_f32(t.raw_data(), t.dtype(), static_cast<uint64_t>(start + j * col_stride));
      dst[j] = ratio == 1.0 ? v : static_cast<float>(static_cast<double>(v) * ratio);
    }
  }
};

FactorView matrix_view(const Tensor& t, int64_t index, int64_t rows, int64_t cols) {
  return FactorView{t, index * rows * cols, cols, 1, rows, cols};
}

// A block of one canonical target: its rows [out_offset, out_offset + out_rows) of the fused
// output and `rank` columns of R, for every expert.
struct Part {
  std::string label;  // "gate_proj", "up_proj", ... for messages
  int64_t out_offset = 0, out_rows = 0;
  std::vector<FactorView> a, b;  // one (shared by all experts) or one per expert
  std::vector<double> scaling;   // per expert (one entry for plain targets)
  int64_t rank = 0;              // the largest rank of any expert

  bool uniform_scaling() const {
    return std::all_of(scaling.begin(), scaling.end(), [&](double s) { return s == scaling[0]; });
  }
};

// Writes the canonical A [Ea, R, in], B [Eb, out, R] of a target made of `parts` (blocks on the
// diagonal: part p takes rows [out_offset, +out_rows) and its own columns of R).
LoraWeights assemble(const std::vector<Part>& parts, int64_t num_experts, int64_t out_total, int64_t in) {
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
      for (int64_t k = 0; k < view.rows; ++k) view.copy_row(k, a + (e * total_rank + column + k) * in, 1.0);
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

// Per-layer collection of the routed-expert tensors.
struct LayerExperts {
  std::set<ExpertForm> forms;
  const ModuleEntry* peft3d_outer = nullptr;
  const ModuleEntry* peft3d_inner = nullptr;
  std::array<std::vector<const ModuleEntry*>, 3> per_expert;  // gate, up, down; one slot per expert
  std::array<const ModuleEntry*, 4> stacked{};                // gate, up, down, gate_up
  std::string layer_prefix;
};

const char* form_name(ExpertForm form) {
  switch (form) {
    case ExpertForm::kPerExpert: return "per-expert 2-D (mlp.experts.{e}.<proj>)";
    case ExpertForm::kPeft3dOuter:
    case ExpertForm::kPeft3dInner: return "PEFT 3-D (mlp.experts[.base_layer].lora_*)";
    case ExpertForm::kStacked: return "stacked 3-D (mlp.experts.<proj>.lora_* with an expert dimension)";
    case ExpertForm::kNone: break;
  }
  return "none";
}

class AdapterLoader {
 public:
  AdapterLoader(const fs::path& dir, const ModelConfig& base, const std::string& name,
                const AdapterLoadOptions& options)
      : dir_(dir), base_(base), name_(name), options_(options) {}

  LoraAdapter load();

 private:
  void collect();
  void check_pairs_and_dtypes();
  void check_targeted(const ModuleEntry& entry) const;
  LoraWeights load_plain(const ModuleEntry& entry);
  void load_experts(int64_t layer, LayerExperts& experts, LayerLora& out);
  std::vector<Part> per_expert_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  std::vector<Part> peft3d_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  std::vector<Part> stacked_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  void check_max_rank(const LoraWeights& w, int64_t layer, const std::string& target,
                      const std::string& detail) const;

  // Validations shared by the layouts; `module` is the module path for messages.
  void check_ndim(const Tensor& t, int ndim, const std::string& factor, const std::string& module,
                  const char* layout) const;
  void check_rank_vs_config(int64_t rank, const std::string& path, const std::string& module,
                            const std::string& how) const;
  void check_feature(const Tensor& t, int dim, int64_t expected, const std::string& factor,
                     const std::string& module, const char* feature) const;

  const fs::path dir_;
  const ModelConfig& base_;
  const std::string name_;
  const AdapterLoadOptions options_;
  AdapterConfig config_;
  SafetensorsStore store_;
  std::string file_;  // the safetensors file (or index), for messages
  std::string config_file_;
  std::map<std::string, ModuleEntry> modules_;  // by module path
  int64_t num_tensors_ = 0;
  std::vector<std::array<const ModuleEntry*, kNumPlain>> plain_;  // per layer
  std::vector<LayerExperts> experts_;                             // per layer
};

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
      MOELORA_THROW(ErrorCode::kUnsupported, file_, ": tensor '", key,
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
      MOELORA_CHECK(
          dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF64,
          ErrorCode::kUnsupported, file_, ": tensor '", *key, "' has dtype ", dtype_name(dtype),
          "; LoRA factors must be F32, BF16, F16 or F64");
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

void AdapterLoader::check_rank_vs_config(int64_t rank, const std::string& path, const std::string& module,
                                         const std::string& how) const {
  const int64_t expected = config_.rank_for(path);
  if (rank == expected) return;
  const auto key = config_.rank_pattern_key(path);
  MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": lora_A of '", module, "' has rank ", rank, how, " but ",
                config_file_, " says r=", expected,
                key ? " (rank_pattern key '" + *key + "')" : std::string(" (field 'r')"));
}

void AdapterLoader::check_feature(const Tensor& t, int dim, int64_t expected, const std::string& factor,
                                  const std::string& module, const char* feature) const {
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

std::vector<Part> AdapterLoader::per_expert_parts(int64_t layer, LayerExperts& experts, bool gate_up) {
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
      const std::string path = experts.layer_prefix + "mlp.experts." + std::to_string(e) + "." + proj_name;
      part.scaling[static_cast<size_t>(e)] = config_.scaling_for(path);
      const ModuleEntry* entry = entries[static_cast<size_t>(e)];
      if (entry == nullptr) {
        // Absent experts are fine only where the config does not target them (the adapter then
        // declares them unadapted); otherwise the file is incomplete.
        MOELORA_CHECK(!config_.targets_module(path), ErrorCode::kInvalidFile, file_,
                      ": per-expert LoRA of layer ", layer, " has mlp.experts.{e}.", proj_name, " for ",
                      present, " of ", E, " experts; missing: '", path, "' (its lora_A and lora_B), which ",
                      config_file_, " targets");
        continue;
      }
      check_targeted(*entry);
      const Tensor a = store_.tensor(entry->key_a), b = store_.tensor(entry->key_b);
      check_ndim(a, 2, "lora_A", path, "per-expert");
      check_ndim(b, 2, "lora_B", path, "per-expert");
      const int64_t rank = a.dim(0);
      MOELORA_CHECK(b.dim(1) == rank, ErrorCode::kInvalidFile, file_, ": lora_B of '", path, "' has shape ",
                    shape_str(b.shape()), " but lora_A has rank ", rank, " (shape ", shape_str(a.shape()),
                    ")");
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
    MOELORA_CHECK(is_gate_up || is_down, ErrorCode::kUnsupported, file_, ": 3-D expert LoRA '", entry->module,
                  "' (lora_A ", shape_str(a.shape()), ", lora_B ", shape_str(b.shape()),
                  ") fits neither gate_up_proj (lora_A [E*R, ", H, "], lora_B [", 2 * I,
                  ", E*R]) nor down_proj (lora_A [E*R, ", I, "], lora_B [", H, ", E*R]) of the base model ",
                  describe_base(base_), " (the adapter was made for another model)");
    if (is_gate_up != gate_up) continue;
    const char* param = gate_up ? "gate_up_proj" : "down_proj";
    MOELORA_CHECK(found == nullptr, ErrorCode::kInvalidFile, file_, ": '", found ? found->key_a : "",
                  "' and '", entry->key_a, "' are both LoRAs of mlp.experts.", param, " of layer ", layer);
    found = entry;
    const std::string param_path = experts.layer_prefix + "mlp.experts." + param;
    MOELORA_CHECK(config_.target_parameters.empty() || config_.targets_parameter(param_path),
                  ErrorCode::kInvalidFile, file_, ": tensor '", entry->key_a, "' adapts '", param_path,
                  "', which ", config_file_, " does not target (see target_parameters)");
    const int64_t rows = a.dim(0);
    MOELORA_CHECK(rows % E == 0 && rows > 0, ErrorCode::kUnsupported, file_, ": lora_A of '", param_path,
                  "' has ", rows, " rows, not a positive multiple of the base model's ", E,
                  " experts (E*R rows expected; the adapter was made for another model)");
    MOELORA_CHECK(b.dim(1) == rows, ErrorCode::kInvalidFile, file_, ": lora_B of '", param_path,
                  "' has shape ", shape_str(b.shape()), " but lora_A has ", rows, " rows (shape ",
                  shape_str(a.shape()), "): both must hold E*R = ", rows, " rank components");
    const int64_t rank = rows / E;
    check_rank_vs_config(rank, param_path, param_path,
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
                  stacked[3]->module, "' LoRA and separate ", stacked[0] ? "gate_proj" : "up_proj", " LoRAs");
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
                  ErrorCode::kInvalidFile, file_, ": tensor '", entry->key_a, "' adapts '", path, "', which ",
                  config_file_, " does not target (see target_modules and target_parameters)");
    const Tensor a = store_.tensor(entry->key_a), b = store_.tensor(entry->key_b);
    check_ndim(a, 3, "lora_A", path, "stacked 3-D");
    check_ndim(b, 3, "lora_B", path, "stacked 3-D");
    for (const Tensor* t : {&a, &b}) {
      MOELORA_CHECK(t->dim(0) == 1 || t->dim(0) == E, ErrorCode::kUnsupported, file_, ": ",
                    t == &a ? "lora_A" : "lora_B", " of '", path, "' has shape ", shape_str(t->shape()),
                    ": its leading (expert) dimension must be 1 "
                    "(shared by all experts) or the base model's ",
                    E,
                    " experts (the adapter was made for another "
                    "model)");
    }
    const int64_t rank = a.dim(1);
    MOELORA_CHECK(b.dim(2) == rank, ErrorCode::kInvalidFile, file_, ": lora_B of '", path, "' has shape ",
                  shape_str(b.shape()), " but lora_A has rank ", rank, " (shape ", shape_str(a.shape()), ")");
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
    check_max_rank(w, layer, gate_up ? "mlp.experts.gate_up_proj" : "mlp.experts.down_proj", detail);
    (gate_up ? out.experts_gate_up : out.experts_down) = std::move(w);
  }
}

LoraAdapter AdapterLoader::load() {
  std::error_code ec;
  MOELORA_CHECK(
      fs::is_directory(dir_, ec), ErrorCode::kNotFound, dir_.string(),
      ": adapter directory not found (expected adapter_config.json and adapter_model.safetensors in it)");
  const fs::path config_path = dir_ / "adapter_config.json";
  config_file_ = config_path.string();
  config_ = parse_adapter_config(config_path);

  if (!fs::exists(dir_ / "adapter_model.safetensors", ec) &&
      !fs::exists(dir_ / "adapter_model.safetensors.index.json", ec) &&
      fs::exists(dir_ / "adapter_model.bin", ec)) {
    MOELORA_THROW(
        ErrorCode::kUnsupported, (dir_ / "adapter_model.bin").string(),
        ": pickle .bin adapters are not supported; convert to safetensors (e.g. load the adapter with "
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
      experts.forms.insert(ref.form == ExpertForm::kPeft3dInner ? ExpertForm::kPeft3dOuter : ref.form);
    }
    switch (ref.form) {
      case ExpertForm::kNone: {
        const ModuleEntry*& slot = plain_[layer][static_cast<size_t>(ref.plain)];
        // Two spellings of the decoder prefix can name the same module.
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_, ": '", slot ? slot->key_a : "",
                      "' and '", entry.key_a, "' adapt the same module of layer ", ref.layer);
        slot = &entry;
        break;
      }
      case ExpertForm::kPerExpert: {
        auto& list = experts.per_expert[static_cast<size_t>(ref.proj)];
        if (list.empty()) list.assign(static_cast<size_t>(base_.num_experts), nullptr);
        MOELORA_CHECK(list[static_cast<size_t>(ref.expert)] == nullptr, ErrorCode::kInvalidFile, file_,
                      ": two tensors adapt expert ", ref.expert, " ",
                      kExpertProjNames[static_cast<size_t>(ref.proj)], " of layer ", ref.layer, " ('",
                      entry.key_a, "')");
        list[static_cast<size_t>(ref.expert)] = &entry;
        break;
      }
      case ExpertForm::kStacked: {
        const ModuleEntry*& slot = experts.stacked[static_cast<size_t>(ref.proj)];
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_, ": two tensors adapt mlp.experts.",
                      kExpertProjNames[static_cast<size_t>(ref.proj)], " of layer ", ref.layer, " ('",
                      entry.key_a, "')");
        slot = &entry;
        break;
      }
      case ExpertForm::kPeft3dOuter:
      case ExpertForm::kPeft3dInner: {
        const ModuleEntry*& slot =
            ref.form == ExpertForm::kPeft3dOuter ? experts.peft3d_outer : experts.peft3d_inner;
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_,
                      ": two tensors adapt mlp.experts of layer ", ref.layer, " ('", entry.key_a, "')");
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
    out.shared_expert_module = base_.arch == Architecture::kDeepseekV3 ? "shared_experts" : "shared_expert";
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
      MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": routed-expert LoRAs of layer ", first_form->second,
                    " use the ", form_name(first_form->first), " layout but those of layer ", layer,
                    " use the ", form_name(form), " layout; one adapter must use one layout");
    }
    for (const LoraWeights* w : {&out.experts_gate_up, &out.experts_down}) {
      if (w->defined() && base_.num_experts > 1 && (w->shared_a() || w->shared_b())) shared_outer = true;
    }
  }
  if (first_form) {
    switch (first_form->first) {
      case ExpertForm::kPerExpert: adapter.expert_layout = ExpertLoraLayout::kPerExpert; break;
      case ExpertForm::kStacked:
        adapter.expert_layout = shared_outer ? ExpertLoraLayout::kSharedOuter : ExpertLoraLayout::kStacked;
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
  for (size_t t = 0; t < kNumPlain + 2; ++t) {
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      const auto named = adapter.layers[static_cast<size_t>(layer)].named();
      // Plain references, not a structured binding: the lambda below captures the name, which
      // clang before 16 does not allow for bindings.
      const auto& target = named[t].first;
      const auto& w = named[t].second;
      if (!w->defined()) continue;
      adapter.max_rank = std::max(adapter.max_rank, w->rank());
      std::string detail = "rank " + std::to_string(w->rank()) + ", scaling " + format_number(w->scaling);
      if (t >= kNumPlain) {
        detail += ", " + std::to_string(base_.num_experts) + " experts";
        if (base_.num_experts > 1 && w->shared_a()) detail += ", A shared by all experts";
        if (base_.num_experts > 1 && w->shared_b()) detail += ", B shared by all experts";
      }
      auto it = std::find_if(groups.begin(), groups.end(),
                             [&](const Group& g) { return g.target == target && g.detail == detail; });
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

}  // namespace

LoraAdapter load_adapter(const fs::path& dir, const ModelConfig& base, const std::string& name,
                         const AdapterLoadOptions& options) {
  MOELORA_CHECK(options.max_rank > 0, ErrorCode::kInvalidArgument,
                "AdapterLoadOptions::max_rank must be positive, got ", options.max_rank);
  return AdapterLoader(dir, base, name, options).load();
}

}  // namespace moelora::io
