// Internal pieces of the PEFT adapter loader (io/peft.h) that both of its source files use:
// peft_config.cpp (adapter_config.json parsing, PEFT's matching and scaling rules, the regex
// helpers) and peft.cpp (module classification, factor assembly, load_adapter). Nothing here is
// used outside src/io/peft*.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moelora::io::peft_detail {

inline bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}
inline bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The text after the last '.' of a module path (all of it when there is none).
std::string last_component(const std::string& path);

// Digits only, no sign, fits int64.
std::optional<int64_t> parse_index(std::string_view s);

}  // namespace moelora::io::peft_detail
