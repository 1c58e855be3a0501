// The largest inputs the readers of src/io (and the `moelora logits --batch` file) accept. Each is
// refused before it is read or parsed any further, with kInvalidFile naming the file, what it is,
// the measured value and the limit (README.md lists them). They are far above what real
// checkpoints, adapters and tokenizers need and bound what a lying or garbage file can make a
// reader allocate or walk.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace moelora::io {

// config.json, hf_quant_config.json, adapter_config.json,
// tokenizer_config.json, chat templates, *.safetensors.index.json, the logits batch file.
inline constexpr uint64_t kMaxJsonFileBytes = uint64_t{64} << 20;
// tokenizer.json (the largest published ones are ~30 MB).
inline constexpr uint64_t kMaxTokenizerFileBytes = uint64_t{512} << 20;
// Nesting of arrays and objects in any JSON input (real ones nest at most ~6 deep).
inline constexpr int kMaxJsonDepth = 64;
// Token ids (vocabulary, added tokens, post-processor ids): tokenizer tables are indexed by id, so
// this bounds what a tokenizer.json can make the reader allocate. The largest real vocabularies
// hold ~256 k tokens.
inline constexpr int64_t kMaxTokenId = int64_t{1} << 21;
// Tensors in one safetensors header (an unsharded DeepSeek-V3 has ~95 k); the header itself is
// bounded by kSafetensorsMaxHeaderBytes (safetensors.h).
inline constexpr uint64_t kMaxSafetensorsTensors = uint64_t{1} << 18;

// The text of `path`, refused (kInvalidFile: the path, `what`, its size and the limit) when the
// file is larger than max_bytes, before anything is read; kNotFound when it cannot be opened.
std::string read_limited_text(const std::filesystem::path& path, uint64_t max_bytes,
                              const std::string& what);

// kInvalidFile naming `source` and kMaxJsonDepth when arrays / objects in `text` nest deeper than
// it (brackets inside strings do not count). Cheap: one pass, no allocation.
void check_json_depth(std::string_view text, const std::string& source);

}  // namespace moelora::io
