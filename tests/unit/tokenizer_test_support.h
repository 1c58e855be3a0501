// Handcrafted tokenizer.json files and helpers shared by the tokenizer tests (tokenizer_test.cpp,
// tokenizer_parity_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <utf8proc.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/tokenizer.h"
#include "io/tokenizer_internal.h"
#include "support/test_support.h"

namespace moelora::io::tokenizer_test {

using nlohmann::json;
using test::TempDir;

// ---------------------------------------------------------------------------------------------
// Handcrafted tokenizers

// The Qwen2/Qwen3 pre-tokenization regex (FORMATS.md §5.2).
inline const char* const kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2 bytes_to_unicode written out from its definition, independent of the library code.
inline std::string byte_char(uint8_t byte) {
  const auto printable = [](int b) {
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  };
  uint32_t cp = byte;
  if (!printable(byte)) {
    int shifted = 0;
    for (int b = 0; b < byte; ++b) shifted += printable(b) ? 0 : 1;
    cp = 256 + shifted;
  }
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

// Byte-level form of a UTF-8 string, through byte_char().
inline std::string bl(std::string_view text) {
  std::string out;
  for (char c : text) out += byte_char(static_cast<uint8_t>(c));
  return out;
}

// A tokenizer.json whose vocabulary starts with the 256 byte characters at ids 0..255 (so the id
// of an unmerged byte is the byte value), followed by `extra_tokens` (byte-level forms) at
// 256, 257, ...
struct Spec {
  std::vector<std::string> extra_tokens;
  std::vector<std::pair<std::string, std::string>> merges;  // byte-level forms
  bool legacy_merges = false;
  bool ignore_merges = false;
  json added_tokens = json::array();
  json normalizer = nullptr;
  json pre_tokenizer = qwen_pre_tokenizer();
  json post_processor =
      json::parse(R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false})");
  json decoder =
      json::parse(R"({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true})");

  static json qwen_pre_tokenizer() {
    json pre = json::parse(R"({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": ""}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})");
    pre["pretokenizers"][0]["pattern"]["Regex"] = kQwenPattern;
    return pre;
  }
};

inline json make_json(const Spec& spec) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(static_cast<uint8_t>(b))] = b;
  for (size_t i = 0; i < spec.extra_tokens.size(); ++i)
    vocab[spec.extra_tokens[i]] = 256 + static_cast<int>(i);
  json merges = json::array();
  for (const auto& [a, b] : spec.merges) {
    if (spec.legacy_merges) {
      merges.push_back(a + " " + b);
    } else {
      merges.push_back(json::array({a, b}));
    }
  }
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", spec.added_tokens},
              {"normalizer", spec.normalizer},
              {"pre_tokenizer", spec.pre_tokenizer},
              {"post_processor", spec.post_processor},
              {"decoder", spec.decoder},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", spec.ignore_merges},
                {"vocab", vocab},
                {"merges", merges}}}};
}

inline json added_token(int id, const std::string& content, bool special, bool lstrip = false,
                        bool rstrip = false, bool single_word = false, bool normalized = false) {
  return json{{"id", id},          {"content", content}, {"single_word", single_word},
              {"lstrip", lstrip},  {"rstrip", rstrip},   {"normalized", normalized},
              {"special", special}};
}

inline Tokenizer load_json(const json& tokenizer, const TempDir& dir) {
  test::write_text_file(dir / "tokenizer.json", tokenizer.dump());
  return Tokenizer::load(dir.path());
}

inline Tokenizer load_spec(const Spec& spec, const TempDir& dir) {
  return load_json(make_json(spec), dir);
}

// Ids of the bytes of `text` (no merges apply).
inline std::vector<int32_t> byte_ids(std::string_view text) {
  std::vector<int32_t> ids;
  for (char c : text) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

inline std::vector<int32_t> concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

inline std::vector<std::string> tokens_of(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(tok.id_to_token(id));
  return out;
}

// Runs `fn`, expecting moelora::Error with `code` whose message contains every one of `parts`.
inline ::testing::AssertionResult throws_error(const std::function<void()>& fn, ErrorCode code,
                                               std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const Error& e) {
    if (e.code() != code) {
      return ::testing::AssertionFailure()
             << "error code " << error_code_name(e.code()) << ", expected " << error_code_name(code)
             << "; message: " << e.what();
    }
    for (const auto& part : parts) {
      if (std::string(e.what()).find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks '" << part << "': " << e.what();
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "non-moelora exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "no exception thrown";
}

}  // namespace moelora::io::tokenizer_test
