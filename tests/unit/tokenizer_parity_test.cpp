// The byte-level BPE tokenizer (io/tokenizer.h) on files: malformed tokenizer.json files name the
// field and the value; parity with the Hugging Face `tokenizers` library on the fixture in
// tests/data/tokenizer (scripts/make_reference.py): cases.json lists {text, ids, decoded} produced
// by `tokenizers` for tokenizer.json; tokenizer_legacy_merges.json is the same tokenizer with
// "a b" merges.
#include <gtest/gtest.h>

#include "unit/tokenizer_test_support.h"

namespace moelora::io {
namespace {

using namespace tokenizer_test;  // json, TempDir and the helpers

// ---------------------------------------------------------------------------------------------
// Errors on malformed files

TEST(TokenizerErrors, MalformedFilesNameTheFieldAndValue) {
  const auto expect_load_error = [](const json& j, ErrorCode code,
                                    std::initializer_list<std::string> parts) {
    TempDir dir;
    test::write_text_file(dir / "tokenizer.json", j.dump());
    return throws_error([&] { Tokenizer::load(dir.path()); }, code, parts);
  };
  const json base = make_json(Spec{});

  json j = base;
  j.erase("model");
  EXPECT_TRUE(
      expect_load_error(j, ErrorCode::kInvalidFile, {"tokenizer.json", "missing field 'model'"}));

  j = base;
  j["model"]["type"] = "Unigram";
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kUnsupported, {"model.type", "Unigram", "BPE"}));
  j["model"]["type"] = "WordPiece";
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kUnsupported, {"model.type", "WordPiece"}));

  j = base;
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kUnsupported, {"normalizer.type", "Lowercase"}));
  j["normalizer"] = json::parse(
      R"({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Prepend", "prepend": "_"}]})");
  EXPECT_TRUE(
      expect_load_error(j, ErrorCode::kUnsupported, {"normalizer.normalizers[1].type", "Prepend"}));

  j = base;
  j["pre_tokenizer"]["pretokenizers"][0] =
      json::parse(R"({"type": "Metaspace", "replacement": "_"})");
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kUnsupported,
                                {"pre_tokenizer.pretokenizers[0].type", "Metaspace"}));
  j = base;
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kUnsupported,
                                {"pre_tokenizer.pretokenizers[0].behavior", "Sideways"}));
  j = base;
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kInvalidFile, {"(unclosed", "does not compile"}));
  j = base;
  j["pre_tokenizer"]["pretokenizers"].push_back(base["pre_tokenizer"]["pretokenizers"][0]);
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kUnsupported, {"ByteLevel must come last"}));

  j = base;
  j["decoder"] = {{"type", "WordPiece"}};
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kUnsupported, {"decoder.type", "WordPiece"}));
  j = base;
  j["model"]["byte_fallback"] = true;
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kUnsupported, {"model.byte_fallback"}));

  j = base;
  j["model"]["merges"] = json::parse(R"([["a", "b"]])");  // "ab" is not in the vocabulary
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kInvalidFile,
                                {"merge #0", "'a' + 'b'", "'ab'", "model.vocab"}));
  j["model"]["merges"] = json::array({"a b", "x \xE2\x82\xAC"});
  j["model"]["vocab"]["ab"] = 256;
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kInvalidFile,
                                {"merge #1", "\xE2\x82\xAC", "not in model.vocab"}));
  j["model"]["merges"] = json::array({"a b c"});
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kInvalidFile, {"model.merges[0]", "a b c"}));

  j = base;
  j["model"]["vocab"]["bad"] = -4;
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kInvalidFile, {"model.vocab[\"bad\"]", "-4"}));
  j = base;
  j["added_tokens"] = json::parse(R"([{"content": "<x>"}])");
  EXPECT_TRUE(expect_load_error(j, ErrorCode::kInvalidFile, {"added_tokens[0].id"}));

  TempDir dir;
  test::write_text_file(dir / "tokenizer.json", "{\"model\": ");
  EXPECT_TRUE(throws_error([&] { Tokenizer::load(dir.path()); }, ErrorCode::kInvalidFile,
                           {"not valid JSON"}));
  // A number too large for a double is nlohmann's out_of_range (406), not a parse_error: refused
  // the same way (the shape of a fuzz finding in config.json).
  EXPECT_TRUE(throws_error([&] { Tokenizer::from_json(R"({"model": {"dropout": 1E999999999}})"); },
                           ErrorCode::kInvalidFile, {"not valid JSON", "number overflow"}));
  TempDir empty;
  EXPECT_TRUE(throws_error([&] { Tokenizer::load(empty.path()); }, ErrorCode::kNotFound,
                           {"no tokenizer.json"}));
  EXPECT_TRUE(throws_error([&] { Tokenizer::load(empty / "nope.json"); }, ErrorCode::kNotFound,
                           {"nope.json"}));
  // Without tokenizer.json a tiktoken.model is read instead (tokenizer_tiktoken_test.cpp); this one
  // lacks most single bytes.
  test::write_text_file(empty / "tiktoken.model", "IQ== 0\n");
  EXPECT_TRUE(throws_error([&] { Tokenizer::load(empty.path()); }, ErrorCode::kInvalidFile,
                           {"tiktoken.model", "byte 0x00 has no rank"}));
}

// ---------------------------------------------------------------------------------------------
// Parity with Hugging Face `tokenizers` (fixture from scripts/make_reference.py)

struct ParityCase {
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
};

std::vector<ParityCase> load_cases(const std::filesystem::path& path) {
  std::vector<ParityCase> cases;
  for (const json& c : json::parse(test::read_text_file(path))) {
    cases.push_back({c.at("text").get<std::string>(), c.at("ids").get<std::vector<int32_t>>(),
                     c.contains("decoded") ? c.at("decoded").get<std::string>() : std::string()});
  }
  return cases;
}

std::filesystem::path fixture_dir() {
  return test::data_dir() / "tokenizer";
}

void check_parity(const Tokenizer& tok, const std::vector<ParityCase>& cases,
                  const std::string& label) {
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const ParityCase& c = cases[i];
    const auto ids = tok.encode(c.text);
    if (ids != c.ids && ++failures <= 10) {
      ADD_FAILURE() << label << " case " << i << " text " << json(c.text).dump() << "\n  ids      "
                    << json(ids).dump() << "\n  expected " << json(c.ids).dump();
    }
    const std::string decoded = tok.decode(c.ids);
    if (decoded != c.decoded && ++failures <= 10) {
      ADD_FAILURE() << label << " case " << i << " decode " << json(sanitize_utf8(decoded)).dump()
                    << "\n  expected " << json(c.decoded).dump();
    }
  }
  EXPECT_EQ(failures, 0) << label << ": " << failures << " mismatches over " << cases.size()
                         << " cases";
}

TEST(TokenizerParity, MatchesHuggingFaceIdsWithPairMerges) {
  const auto dir = fixture_dir();
  ASSERT_TRUE(std::filesystem::exists(dir / "tokenizer.json"))
      << "missing fixture " << dir / "tokenizer.json";
  ASSERT_TRUE(std::filesystem::exists(dir / "cases.json"))
      << "missing fixture " << dir / "cases.json";
  const auto cases = load_cases(dir / "cases.json");
  ASSERT_GE(cases.size(), 10u);
  check_parity(Tokenizer::load(dir / "tokenizer.json"), cases, "tokenizer.json");
  // Loading the directory (config + template) gives the same ids.
  check_parity(Tokenizer::load(dir), cases, "tokenizer directory");
}

TEST(TokenizerParity, MatchesHuggingFaceIdsWithLegacyMerges) {
  const auto dir = fixture_dir();
  ASSERT_TRUE(std::filesystem::exists(dir / "tokenizer_legacy_merges.json"))
      << "missing fixture " << dir / "tokenizer_legacy_merges.json";
  ASSERT_TRUE(std::filesystem::exists(dir / "cases.json"))
      << "missing fixture " << dir / "cases.json";
  const json legacy = json::parse(test::read_text_file(dir / "tokenizer_legacy_merges.json"));
  ASSERT_TRUE(legacy["model"]["merges"][0].is_string())
      << "the legacy fixture should hold \"a b\" merges";
  check_parity(Tokenizer::load(dir / "tokenizer_legacy_merges.json"),
               load_cases(dir / "cases.json"), "legacy merges");
}

TEST(TokenizerParity, ConfigAndChatTemplateCases) {
  const auto dir = fixture_dir();
  ASSERT_TRUE(std::filesystem::exists(dir / "tokenizer_config.json")) << "missing fixture " << dir;
  const Tokenizer tok = Tokenizer::load(dir);
  const json config = json::parse(test::read_text_file(dir / "tokenizer_config.json"));
  ASSERT_TRUE(config.contains("eos_token") && config["eos_token"].is_string());
  EXPECT_EQ(tok.eos_token(), config["eos_token"].get<std::string>());
  EXPECT_EQ(tok.eos_token_id(), tok.token_to_id(config["eos_token"].get<std::string>()));
  ASSERT_TRUE(tok.eos_token_id().has_value());
  EXPECT_TRUE(tok.is_special(*tok.eos_token_id()));
  if (std::filesystem::exists(dir / "chat_template.jinja")) {
    EXPECT_EQ(tok.chat_template(), test::read_text_file(dir / "chat_template.jinja"));
  }
  if (std::filesystem::exists(dir / "chat_cases.json")) {
    // The rendered chat texts encode to the ids `tokenizers` gave (special tokens inside the text).
    const json chats = json::parse(test::read_text_file(dir / "chat_cases.json"));
    ASSERT_FALSE(chats.empty());
    for (size_t i = 0; i < chats.size(); ++i) {
      const std::string text = chats[i].at("text").get<std::string>();
      EXPECT_EQ(tok.encode(text), chats[i].at("ids").get<std::vector<int32_t>>())
          << "chat case " << i;
      EXPECT_EQ(tok.decode(tok.encode(text)), text) << "chat case " << i;
    }
  }
}

TEST(TokenizerParity, RandomTextRoundTrips) {
  const auto dir = fixture_dir();
  ASSERT_TRUE(std::filesystem::exists(dir / "tokenizer.json")) << "missing fixture " << dir;
  const Tokenizer tok = Tokenizer::load(dir);
  std::mt19937_64 rng(test::test_seed(20261130));
  // Code points from blocks the fixture covers and some it does not (all become byte tokens).
  const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {0x20, 0x7E},     {0x09, 0x0D},     {0xA0, 0x17F},    {0x300, 0x36F},     {0x400, 0x4FF},
      {0x3040, 0x30FF}, {0x4E00, 0x4FFF}, {0xAC00, 0xAD00}, {0x1F300, 0x1F64F}, {0x2000, 0x206F}};
  const auto utf8 = [](char32_t cp) {
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s += {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    } else if (cp < 0x10000) {
      s += {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
            static_cast<char>(0x80 | (cp & 0x3F))};
    } else {
      s += {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
            static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
    }
    return s;
  };
  std::uniform_int_distribution<size_t> pick_range(0, ranges.size() - 1);
  std::uniform_int_distribution<int> pick_length(0, 61);
  int failures = 0;
  for (int n = 0; n < 300; ++n) {
    std::string text;
    const int length = pick_length(rng);
    for (int i = 0; i < length; ++i) {
      const auto [lo, hi] = ranges[pick_range(rng)];
      text += utf8(std::uniform_int_distribution<uint32_t>(lo, hi)(rng));
    }
    const auto ids = tok.encode(text);
    // The fixture normalizes with NFC, which also rewrites a few singletons (U+2000 -> U+2002).
    utf8proc_uint8_t* nfc_bytes =
        utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(text.c_str()));
    ASSERT_NE(nfc_bytes, nullptr);
    const std::string nfc(reinterpret_cast<const char*>(nfc_bytes));
    std::free(nfc_bytes);
    if (tok.decode(ids) != nfc && ++failures <= 5) {
      ADD_FAILURE() << "round trip of " << json(text).dump() << " gave "
                    << json(sanitize_utf8(tok.decode(ids))).dump();
    }
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size());
  }
  EXPECT_EQ(failures, 0);
}

TEST(TokenizerParity, SpeedOn100KBText) {
  const auto dir = fixture_dir();
  ASSERT_TRUE(std::filesystem::exists(dir / "cases.json")) << "missing fixture " << dir;
  const Tokenizer tok = Tokenizer::load(dir);
  const auto cases = load_cases(dir / "cases.json");
  std::string text;
  for (size_t i = 0; text.size() < 100 * 1024; ++i) text += cases[i % cases.size()].text + "\n";
  // Cold run (empty word cache) and a warm one; printed only, machines differ too much to assert.
  for (const char* label : {"cold", "warm"}) {
    const auto start = std::chrono::steady_clock::now();
    const auto ids = tok.encode(text);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("[ speed    ] encode %s: %zu bytes -> %zu tokens in %.2f ms (%.2f M tokens/s)\n",
                label, text.size(), ids.size(), seconds * 1e3, ids.size() / seconds / 1e6);
    EXPECT_FALSE(ids.empty());
    const auto dstart = std::chrono::steady_clock::now();
    const std::string back = tok.decode(ids);
    const double dseconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - dstart).count();
    std::printf("[ speed    ] decode %s: %zu tokens in %.2f ms\n", label, ids.size(),
                dseconds * 1e3);
  }
}

}  // namespace
}  // namespace moelora::io
