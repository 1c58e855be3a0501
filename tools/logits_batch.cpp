// `moelora logits --batch` file reader (logits_batch.h).
#include "logits_batch.h"

#include <climits>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/input_limits.h"

namespace moelora::tools {

std::vector<BatchEntry> read_batch(const std::string& path) {
  std::error_code ec;
  MOELORA_CHECK(std::filesystem::exists(path, ec), ErrorCode::kNotFound, path,
                ": cannot open the batch file");
  const std::string text = io::read_limited_text(path, io::kMaxJsonFileBytes, "the batch file");
  io::check_json_depth(text, path);
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MOELORA_THROW(ErrorCode::kInvalidArgument, path, ": not valid JSON (", e.what(), ")");
  }
  MOELORA_CHECK(doc.is_array() && !doc.empty(), ErrorCode::kInvalidArgument, path,
                ": expected a non-empty JSON list of {\"tokens\": [...], \"adapter\": NAME or null}");
  std::vector<BatchEntry> out;
  for (size_t i = 0; i < doc.size(); ++i) {
    const nlohmann::json& e = doc[i];
    const std::string where = path + ": entry " + std::to_string(i);
    MOELORA_CHECK(e.is_object(), ErrorCode::kInvalidArgument, where, " is not an object");
    for (const auto& [key, value] : e.items()) {
      MOELORA_CHECK(key == "tokens" || key == "adapter", ErrorCode::kInvalidArgument, where,
                    ": unknown key '", key, "' (expected \"tokens\" and \"adapter\")");
    }
    MOELORA_CHECK(e.contains("tokens") && e["tokens"].is_array() && !e["tokens"].empty(),
                  ErrorCode::kInvalidArgument, where, ": \"tokens\" must be a non-empty list of token ids");
    BatchEntry entry;
    for (const nlohmann::json& t : e["tokens"]) {
      MOELORA_CHECK(t.is_number_integer() && t.get<int64_t>() >= INT32_MIN && t.get<int64_t>() <= INT32_MAX,
                    ErrorCode::kInvalidArgument, where, ": token ", t.dump(), " is not an integer");
      entry.tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    if (e.contains("adapter") && !e["adapter"].is_null()) {
      MOELORA_CHECK(e["adapter"].is_string(), ErrorCode::kInvalidArgument, where,
                    ": \"adapter\" must be a name or null, got ", e["adapter"].dump());
      entry.adapter = e["adapter"].get<std::string>();
    }
    out.push_back(std::move(entry));
  }
  return out;
}

}  // namespace moelora::tools
