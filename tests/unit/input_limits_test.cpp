// The input limits of src/io (io/input_limits.h): the helpers on their own (JSON nesting depth with
// brackets inside strings and escapes, a file over the size limit refused from its size alone,
// before any byte is read: a sparse file stands in for a huge one) and every reader applying
// them: config.json, adapter_config.json, tokenizer.json in memory and on disk, a safetensors
// header with too many tensors, a sharded index nested too deep. (The logits batch file is
// covered by ModelCli.BadArgumentsGiveOneLineErrors.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "io/hf_config.h"
#include "io/input_limits.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"
#include "support/test_support.h"

namespace moelora::io {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using test::error_message;

std::string nested(int depth, const std::string& inner = "0") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

// A file of `bytes` bytes that occupies no disk space.
void write_sparse_file(const std::filesystem::path& path, uint64_t bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.seekp(static_cast<std::streamoff>(bytes - 1));
  out.put('\0');
}

TEST(InputLimits, JsonDepthCountsBracketsOutsideStrings) {
  EXPECT_NO_THROW(check_json_depth(nested(kMaxJsonDepth), "x.json"));
  EXPECT_THAT(error_message([] { check_json_depth(nested(kMaxJsonDepth + 1), "x.json"); },
                            ErrorCode::kInvalidFile),
              AllOf(HasSubstr("x.json"), HasSubstr("nest deeper than the 64 levels accepted"),
                    HasSubstr("at byte 64")));
  // Brackets in strings (also after escaped quotes and backslashes) do not nest.
  const std::string in_string = "\"" + std::string(200, '[') + "\\\" \\\\" + "\"";
  EXPECT_NO_THROW(check_json_depth("{\"k\": " + in_string + "}", "x.json"));
  EXPECT_NO_THROW(check_json_depth(nested(kMaxJsonDepth - 1, in_string), "x.json"));
  // Unbalanced or garbage text is the parser's to refuse, not this check's.
  EXPECT_NO_THROW(check_json_depth("]]]]{", "x.json"));
}

TEST(InputLimits, FileSizeIsCheckedBeforeReading) {
  test::TempDir dir;
  test::write_text_file(dir / "small.json", "{\"a\": 1}");
  EXPECT_EQ(read_limited_text(dir / "small.json", 8, "the file"), "{\"a\": 1}");  // 8 bytes
  EXPECT_THAT(error_message([&] { read_limited_text(dir / "small.json", 7, "the file"); },
                            ErrorCode::kInvalidFile),
              AllOf(HasSubstr("small.json"), HasSubstr("is 8 bytes, larger than the 7 bytes accepted")));
  EXPECT_THAT(error_message([&] { read_limited_text(dir / "missing.json", 8, "the file"); },
                            ErrorCode::kNotFound),
              HasSubstr("missing.json"));
}

TEST(InputLimits, ConfigAndAdapterConfigApplyThem) {
  test::TempDir dir;
  write_sparse_file(dir / "config.json", kMaxJsonFileBytes + 1);
  EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("config.json"), HasSubstr("larger than the 67108864 bytes accepted")));
  test::write_text_file(dir / "config.json", "{\"architectures\": " + nested(kMaxJsonDepth) + "}");
  EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kInvalidFile),
              HasSubstr("nest deeper than the 64 levels"));
  test::write_text_file(dir / "adapter_config.json", "{\"r\": " + nested(kMaxJsonDepth) + "}");
  EXPECT_THAT(error_message([&] { parse_adapter_config(dir / "adapter_config.json"); },
                            ErrorCode::kInvalidFile),
              AllOf(HasSubstr("adapter_config.json"), HasSubstr("nest deeper")));
  write_sparse_file(dir / "adapter_config.json", kMaxJsonFileBytes + 1);
  EXPECT_THAT(error_message([&] { parse_adapter_config(dir / "adapter_config.json"); },
                            ErrorCode::kInvalidFile),
              HasSubstr("larger than"));
}

// A token id sizes the tokenizer's tables: 2,000,000,000 once asked for 64 GB (found by hand
// against fuzz/fuzz_tokenizer, which then ran out of memory).
TEST(InputLimits, TokenIdsAreBounded) {
  const auto with_vocab_id = [](int64_t id) {
    return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": )" + std::to_string(id) +
           R"(}, "merges": []}})";
  };
  EXPECT_THAT(error_message([&] { Tokenizer::from_json(with_vocab_id(kMaxTokenId)); }, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("model.vocab[\"b\"]"), HasSubstr("holds token id 2097152"),
                    HasSubstr("outside the [0, 2097152) accepted")));
  EXPECT_THAT(error_message([&] { Tokenizer::from_json(with_vocab_id(2000000000)); }, ErrorCode::kInvalidFile),
              HasSubstr("holds token id 2000000000"));
  const std::string added =
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": [{"id": 2100000000, )"
      R"("content": "<big>", "special": true}]})";
  EXPECT_THAT(error_message([&] { Tokenizer::from_json(added); }, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("added_tokens[0].id"), HasSubstr("2100000000")));
}

TEST(InputLimits, TokenizerAppliesThem) {
  EXPECT_THAT(error_message([] { Tokenizer::from_json("{\"model\": " + nested(kMaxJsonDepth) + "}"); },
                            ErrorCode::kInvalidFile),
              AllOf(HasSubstr("tokenizer.json"), HasSubstr("nest deeper")));
  test::TempDir dir;
  write_sparse_file(dir / "tokenizer.json", kMaxTokenizerFileBytes + 1);
  EXPECT_THAT(error_message([&] { Tokenizer::load(dir.path()); }, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("tokenizer.json"), HasSubstr("larger than the 536870912 bytes accepted")));
}

TEST(InputLimits, SafetensorsHeaderTensorCountAndIndexDepth) {
  test::TempDir dir;
  // kMaxSafetensorsTensors + 1 empty U8 tensors (all at offset 0: the count is checked first).
  std::string header = "{";
  for (uint64_t i = 0; i <= kMaxSafetensorsTensors; ++i) {
    if (i) header += ",";
    header += "\"t" + std::to_string(i) + "\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}";
  }
  header += "}";
  {
    std::ofstream out(dir / "many.safetensors", std::ios::binary);
    const uint64_t n = header.size();
    for (int b = 0; b < 8; ++b) out.put(static_cast<char>((n >> (8 * b)) & 0xff));
    out << header;
  }
  EXPECT_THAT(error_message([&] { SafetensorsFile::open(dir / "many.safetensors"); }, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("many.safetensors"), HasSubstr("262145 tensors, more than the 262144 accepted")));
  test::write_text_file(dir / "model.safetensors.index.json",
                        "{\"weight_map\": {}, \"metadata\": " + nested(kMaxJsonDepth) + "}");
  EXPECT_THAT(error_message([&] { SafetensorsStore::open_dir(dir.path()); }, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("nest deeper")));
}

}  // namespace
}  // namespace moelora::io
