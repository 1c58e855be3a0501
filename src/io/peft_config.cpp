// adapter_config.json of PEFT LoRA adapters (io/peft.h): the parser with its validation and
// rejections, and PEFT's rules for which modules and parameters a config targets
// (check_target_module_exists, target_parameters, layers_to_transform) and what rank and scaling
// each gets (rank_pattern / alpha_pattern, rsLoRA). PEFT's patterns are Python `re` regexes; they
// run through PCRE2 with the same anchoring as PEFT's re.match / re.fullmatch calls.
#include "io/input_limits.h"
#include "io/peft.h"
#include "io/peft_internal.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moelora::io {

namespace peft_detail {

std::string last_component(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

// Digits only, no sign, fits int64.
std::optional<int64_t> parse_index(std::string_view s) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end != s.data() + s.size() || s[0] == '-' || s[0] == '+')
    return std::nullopt;
  return value;
}

}  // namespace peft_detail

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using peft_detail::ends_with;
using peft_detail::last_component;
using peft_detail::parse_index;

// A JSON value for an error message, cut short when long.
std::string brief(const ojson& value) {
  std::string text = value.dump();
  if (text.size() > 160) text = text.substr(0, 157) + "...";
  return text;
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
    const uint32_t options =
        PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED | (full ? PCRE2_ENDANCHORED : 0u);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                          &error_code, &error_offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR buffer[256];
      pcre2_get_error_message(error_code, buffer, sizeof(buffer));
      error_ = std::string(reinterpret_cast<const char*>(buffer)) + " at offset " +
               std::to_string(error_offset);
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
      *last_group =
          begin == PCRE2_UNSET ? std::string() : std::string(subject.substr(begin, end - begin));
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
std::shared_ptr<const PyRegex> checked_regex(const std::string& pattern, bool full,
                                             const std::string& what) {
  auto regex = cached_regex(pattern, full);
  MOELORA_CHECK(regex->ok(), ErrorCode::kInvalidArgument, what, " '", pattern,
                "' is not a valid regex: ", regex->error());
  return regex;
}

template <typename T>
std::optional<size_t> first_pattern_match(const std::vector<std::pair<std::string, T>>& patterns,
                                          const std::string& path, const char* field) {
  for (size_t i = 0; i < patterns.size(); ++i) {
    const auto regex =
        checked_regex(pattern_key_regex(patterns[i].first), true, std::string(field) + " key");
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
                source.empty() ? std::string() : " " + source.string(), ": rank of '", path,
                "' is ", rank, "; it must be positive");
  const double alpha = alpha_for(path);
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank))
                    : alpha / static_cast<double>(rank);
}

bool AdapterConfig::targets_module(const std::string& key) const {
  if (exclude_modules_regex) {
    if (checked_regex(*exclude_modules_regex, true, "exclude_modules")->match(key)) return false;
  } else {
    for (const std::string& excluded : exclude_modules) {
      if (key == excluded || ends_with(key, "." + excluded)) return false;
    }
  }
  if (target_modules_regex)
    return checked_regex(*target_modules_regex, true, "target_modules")->match(key);

  bool found = false;
  if (target_all_linear) {
    found = last_component(key) != "lm_head";
  } else if (target_modules.empty()) {
    // No target_modules at all: PEFT then only adapts target_parameters when those are given;
    // with neither, every module counts as targeted (the tensors decide).
    return target_parameters.empty();
  } else {
    if (std::find(target_modules.begin(), target_modules.end(), key) != target_modules.end())
      return true;
    found = std::any_of(target_modules.begin(), target_modules.end(),
                        [&](const std::string& target) { return ends_with(key, "." + target); });
  }
  if (!found || layers_to_transform.empty()) return found;
  const auto layer = peft_layer_index(key, layers_pattern);
  return layer && std::find(layers_to_transform.begin(), layers_to_transform.end(), *layer) !=
                      layers_to_transform.end();
}

bool AdapterConfig::targets_parameter(const std::string& parameter_path) const {
  return std::any_of(target_parameters.begin(), target_parameters.end(),
                     [&](const std::string& target) {
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
    MOELORA_THROW(ErrorCode::kInvalidFile, source_, ": field '", key, "' must be ", expected,
                  ", got ", brief(json_.at(key)));
  }
  [[noreturn]] void unsupported(const char* key, const std::string& why) const {
    MOELORA_THROW(ErrorCode::kUnsupported, source_, ": field '", key, "' is ", brief(json_.at(key)),
                  ": ", why);
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
  std::vector<std::string> string_or_list(const char* key,
                                          std::optional<std::string>* single) const {
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

void check_regex_field(const ConfigFields& f, const char* field, const std::string& pattern,
                       bool full, const std::string& shown) {
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
  if (peft_type != "LORA")
    f.unsupported("peft_type", "only LoRA adapters (\"LORA\") are supported");

  c.r = f.positive_integer("r", c.r);
  c.lora_alpha = f.finite_number("lora_alpha", c.lora_alpha);
  c.use_rslora = f.boolean("use_rslora", false);

  // Features that change what the adapter computes beyond a low-rank delta: rejected rather than
  // silently ignored.
  c.use_dora = f.boolean("use_dora", false);
  if (c.use_dora) {
    f.unsupported(
        "use_dora",
        "DoRA adapters are not supported (they rescale the whole weight, not only add B·A)");
  }
  if (f.boolean("fan_in_fan_out", false)) {
    f.unsupported("fan_in_fan_out",
                  "fan_in_fan_out (Conv1D-style transposed weights) is not supported");
  }
  if (f.boolean("lora_bias", false))
    f.unsupported("lora_bias", "LoRA bias terms are not supported");
  c.bias = f.string("bias", "none");
  if (c.bias != "none")
    f.unsupported("bias", "trained biases are not supported; only bias \"none\" is");
  c.modules_to_save = f.string_list("modules_to_save");
  if (!c.modules_to_save.empty()) {
    f.unsupported(
        "modules_to_save",
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
      MOELORA_CHECK(value.is_number_integer() && value.get<int64_t>() > 0, ErrorCode::kInvalidFile,
                    source, ": field 'rank_pattern': the rank of '", key,
                    "' must be a positive integer, got ", brief(value));
      check_regex_field(f, "rank_pattern", pattern_key_regex(key), true, "key '" + key + "'");
      c.rank_pattern.emplace_back(key, value.get<int64_t>());
    }
  }
  if (const ojson* v = f.get("alpha_pattern")) {
    if (!v->is_object()) f.bad("alpha_pattern", "an object of module pattern -> alpha");
    for (const auto& [key, value] : v->items()) {
      MOELORA_CHECK(value.is_number() && std::isfinite(value.get<double>()),
                    ErrorCode::kInvalidFile, source, ": field 'alpha_pattern': the alpha of '", key,
                    "' must be a finite number, got ", brief(value));
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
  MOELORA_CHECK(c.layers_to_transform.empty() || !c.target_modules_regex, ErrorCode::kInvalidFile,
                source,
                ": field 'layers_to_transform' cannot be used when 'target_modules' is a regex "
                "(PEFT rejects it too)");
  MOELORA_CHECK(
      c.layers_pattern.empty() || !c.layers_to_transform.empty(), ErrorCode::kInvalidFile, source,
      ": field 'layers_pattern' is set but 'layers_to_transform' is not (PEFT rejects it too)");

  c.base_model_name_or_path = f.string("base_model_name_or_path", "");
  return c;
}

}  // namespace moelora::io
