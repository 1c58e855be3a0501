#include "io/input_limits.h"

#include <fstream>
#include <sstream>
#include <system_error>

#include "core/error.h"

namespace moelora::io {

std::string read_limited_text(const std::filesystem::path& path, uint64_t max_bytes,
                              const std::string& what) {
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(path, ec);
  MOELORA_CHECK(!ec, ErrorCode::kNotFound, path.string(), ": cannot read ", what, " (",
                ec.message(), ")");
  MOELORA_CHECK(size <= max_bytes, ErrorCode::kInvalidFile, path.string(), ": ", what, " is ", size,
                " bytes, larger than the ", max_bytes, " bytes accepted (io/input_limits.h)");
  std::ifstream in(path, std::ios::binary);
  MOELORA_CHECK(in.good(), ErrorCode::kNotFound, path.string(), ": cannot open ", what);
  std::ostringstream text;
  text << in.rdbuf();
  MOELORA_CHECK(!in.bad(), ErrorCode::kInvalidFile, path.string(), ": read error in ", what);
  return text.str();
}

void check_json_depth(std::string_view text, const std::string& source) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      MOELORA_CHECK(++depth <= kMaxJsonDepth, ErrorCode::kInvalidFile, source,
                    ": arrays and objects nest deeper than the ", kMaxJsonDepth,
                    " levels accepted (at byte ", i, "; io/input_limits.h)");
    } else if (c == ']' || c == '}') {
      --depth;  // unbalanced brackets are the JSON parser's to report
    }
  }
}

}  // namespace moelora::io
