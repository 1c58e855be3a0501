// The typed field access of the config.json parsers (hf_config.cpp, hf_quant_config.cpp) and the
// quantization parts they share. Internal to src/io.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_config.h"

namespace moelora::io::hf_config_internal {

using json = nlohmann::json;

// A value for an error message, cut to 80 characters.
inline std::string describe(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

// Typed access to the fields of one JSON object. Errors name the source file and the dotted
// path of the field ("text_config.hidden_size"). A null value counts as absent.
class Fields {
 public:
  Fields(const json& object, std::string source, std::string prefix)
      : object_(object), source_(std::move(source)), prefix_(std::move(prefix)) {}

  const std::string& source() const { return source_; }
  std::string path(const std::string& key) const { return prefix_ + key; }
  bool has(const std::string& key) const {
    auto it = object_.find(key);
    return it != object_.end() && !it->is_null();
  }
  // Present and explicitly null.
  bool is_null(const std::string& key) const {
    auto it = object_.find(key);
    return it != object_.end() && it->is_null();
  }
  const json& at(const std::string& key) const {
    MOELORA_CHECK(has(key), ErrorCode::kInvalidFile, source_, ": missing field '", path(key), "'");
    return object_.at(key);
  }
  [[noreturn]] void fail_type(const std::string& key, const char* expected) const {
    MOELORA_THROW(ErrorCode::kInvalidFile, source_, ": field '", path(key), "' must be ", expected,
                  ", got ", describe(object_.at(key)));
  }

  int64_t integer(const std::string& key) const {
    const json& v = at(key);
    if (!v.is_number_integer()) fail_type(key, "an integer");
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
      fail_type(key, "an integer within int64");
    }
    return v.get<int64_t>();
  }
  int64_t integer(const std::string& key, int64_t fallback) const {
    return has(key) ? integer(key) : fallback;
  }

  double number(const std::string& key) const {
    const json& v = at(key);
    if (!v.is_number()) fail_type(key, "a number");
    return v.get<double>();
  }
  double number(const std::string& key, double fallback) const {
    return has(key) ? number(key) : fallback;
  }

  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = at(key);
    if (!v.is_boolean()) fail_type(key, "true or false");
    return v.get<bool>();
  }

  std::string string(const std::string& key) const {
    const json& v = at(key);
    if (!v.is_string()) fail_type(key, "a string");
    return v.get<std::string>();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    return has(key) ? string(key) : fallback;
  }

  std::vector<int64_t> integer_list(const std::string& key) const {
    std::vector<int64_t> out;
    if (!has(key)) return out;
    const json& v = at(key);
    if (!v.is_array()) fail_type(key, "a list of integers");
    for (const json& item : v) {
      if (!item.is_number_integer()) fail_type(key, "a list of integers");
      out.push_back(item.get<int64_t>());
    }
    return out;
  }
  std::vector<std::string> string_list(const std::string& key) const {
    std::vector<std::string> out;
    if (!has(key)) return out;
    const json& v = at(key);
    if (!v.is_array()) fail_type(key, "a list of strings");
    for (const json& item : v) {
      if (!item.is_string()) fail_type(key, "a list of strings");
      out.push_back(item.get<std::string>());
    }
    return out;
  }
  // The object under `key`, or nullptr when absent or null.
  const json* object(const std::string& key) const {
    if (!has(key)) return nullptr;
    const json& v = at(key);
    if (!v.is_object()) fail_type(key, "an object");
    return &v;
  }
  Fields sub(const std::string& key) const {
    return Fields(*object(key), source_, path(key) + ".");
  }

 private:
  const json& object_;
  std::string source_;
  std::string prefix_;
};

// The quantization_config object of config.json (FP8 block-wise, ModelOpt NVFP4) -> QuantConfig,
// and back (hf_quant_config.cpp).
QuantConfig parse_quantization_config(const Fields& q);
json quant_to_json(const QuantConfig& q);

}  // namespace moelora::io::hf_config_internal
