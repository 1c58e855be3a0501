// What the three parts of `moelora inspect` share (tools/inspect.cpp: the subcommand;
// inspect_model.cpp: model directories; inspect_adapter.cpp: adapter directories): the report
// (an aligned two-column table, or the same facts as JSON) and small formatting helpers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moelora::cli::inspect {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

inline std::string fmt(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
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

inline json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
}

// The report of a model directory (config.json + safetensors) / an adapter directory
// (adapter_config.json, checked against `model_option` or its base_model_name_or_path); the
// exit code: 0 when the loader accepts it, 1 otherwise.
int inspect_model(const fs::path& dir, bool as_json);
int inspect_adapter(const fs::path& dir, const std::string& model_option, bool as_json);

}  // namespace moelora::cli::inspect
