// Tests of the tiktoken backend of the tokenizer (io/tokenizer.h, io/tokenizer_tiktoken.cpp), the
// format of Kimi-K2 / K2.5.
//
//  - parity with Python `tiktoken` on tests/data/tokenizer_tiktoken (scripts/
//    make_tiktoken_reference.py): goldens.json holds the ids of ~2,900 strings encoded as Kimi's
//    TikTokenTokenizer.encode does, and, for each character class of Kimi's pattern that needs
//    class intersection, the code points that tiktoken's regex engine puts in it;
//  - the PCRE2 translation of the pattern on targeted strings;
//  - the merge order on a handcrafted vocabulary, special tokens and their roles;
//  - malformed tiktoken.model / tokenizer_config.json files, whose errors name file and line.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/tokenizer.h"
#include "io/tokenizer_internal.h"
#include "support/test_support.h"
#include "unit/tokenizer_test_support.h"

namespace moelora::io {
namespace {

using nlohmann::json;
using test::TempDir;
using tokenizer_test::throws_error;

std::filesystem::path fixture_dir() {
  return test::data_dir() / "tokenizer_tiktoken";
}

const json& goldens() {
  static const json data = [] {
    std::ifstream in(fixture_dir() / "goldens.json", std::ios::binary);
    EXPECT_TRUE(in.good()) << "cannot open goldens.json; run scripts/make_tiktoken_reference.py";
    std::stringstream text;
    text << in.rdbuf();
    return json::parse(text.str());
  }();
  return data;
}

std::string utf8(char32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

// Base64 written out from RFC 4648, independent of the library's decoder.
std::string base64(std::string_view bytes) {
  static const char* const kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t bits = 0;
    for (size_t k = 0; k < 3; ++k)
      bits = (bits << 8) | (k < n ? static_cast<uint8_t>(bytes[i + k]) : 0);
    for (size_t k = 0; k < 4; ++k)
      out.push_back(k <= n ? kAlphabet[(bits >> (18 - 6 * k)) & 63] : '=');
  }
  return out;
}

// A rank file: the 256 single bytes at rank = byte value, then `extra` tokens at 256, 257, ...
std::string rank_file(const std::vector<std::string>& extra = {}) {
  std::string out;
  for (int b = 0; b < 256; ++b)
    out += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  for (size_t i = 0; i < extra.size(); ++i)
    out += base64(extra[i]) + " " + std::to_string(256 + i) + "\n";
  return out;
}

// Pieces of `text` under the translated Kimi pattern.
std::vector<std::string> pieces(std::string_view text) {
  static const tokenizer_detail::Regex regex(tokenizer_detail::kimi_pcre2_pattern(), false, "kimi");
  std::vector<std::pair<size_t, size_t>> matches;
  regex.find_all(text, matches);
  std::vector<std::string> out;
  for (const auto& [b, e] : matches) out.emplace_back(text.substr(b, e - b));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Parity with Python tiktoken

TEST(TiktokenParity, GoldensEncodeAndDecode) {
  const Tokenizer tok = Tokenizer::load(fixture_dir());
  const json& cases = goldens().at("cases");
  ASSERT_GT(cases.size(), 2000u);
  size_t failures = 0;
  for (const json& c : cases) {
    const std::string text = c.at("text").get<std::string>();
    const std::vector<int32_t> expected = c.at("ids").get<std::vector<int32_t>>();
    const std::vector<int32_t> ids = tok.encode(text);
    if (ids != expected && ++failures <= 10) {
      ADD_FAILURE() << "encode mismatch for " << json(text).dump().substr(0, 200) << "\n  got      "
                    << json(ids).dump().substr(0, 300) << "\n  expected "
                    << json(expected).dump().substr(0, 300);
    }
    EXPECT_EQ(tok.decode(expected), text);
  }
  EXPECT_EQ(failures, 0u) << "of " << cases.size() << " cases";
}

TEST(TiktokenParity, FixtureMatchesKimiLayout) {
  const Tokenizer tok = Tokenizer::load(fixture_dir());
  const json& g = goldens();
  EXPECT_EQ(g.at("pat_str").get<std::string>(), tokenizer_detail::kKimiPatStr);
  const int32_t base = g.at("num_base_tokens").get<int32_t>();
  EXPECT_EQ(g.at("num_special_tokens").get<int32_t>(), 258);
  EXPECT_EQ(tok.vocab_size(), base + 258);
  EXPECT_EQ(tok.added_tokens().size(), 258u);
  EXPECT_EQ(tok.bos_token_id(), base);
  EXPECT_EQ(tok.eos_token_id(), base + 2);  // eos_token "<|im_end|>"
  EXPECT_EQ(tok.pad_token_id(), base + 255);
  EXPECT_EQ(tok.unk_token_id(), base + 254);
  EXPECT_EQ(tok.token_to_id("[EOS]"), base + 1);
  EXPECT_EQ(tok.id_to_token(base + 5), "<|reserved_token_" + std::to_string(base + 5) + "|>");
}

// Every code point: the PCRE2 spelling of each intersection class against the membership that
// tiktoken's engine (Rust regex) reported. PCRE2 10.42 knows Unicode 14, the Rust crate a later
// version: code points unassigned for PCRE2 (\p{Cn}) may differ and are only counted.
TEST(TiktokenPattern, IntersectionClassesMatchTiktokenOnEveryCodePoint) {
  using tokenizer_detail::Regex;
  const std::pair<const char*, std::string_view> classes[] = {
      {"upper_no_han", tokenizer_detail::kKimiUpperNoHan},
      {"lower_no_han", tokenizer_detail::kKimiLowerNoHan},
      {"han", tokenizer_detail::kKimiHan}};
  // All scalar values in one subject; offsets map matches back to code points.
  std::string subject;
  std::vector<size_t> offsets;
  for (char32_t cp = 0; cp < 0x110000; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    offsets.push_back(subject.size());
    subject += utf8(cp);
  }
  const auto members = [&](std::string_view pattern) {
    const Regex regex(pattern, false, "class");
    std::vector<std::pair<size_t, size_t>> matches;
    regex.find_all(subject, matches);
    std::vector<bool> in(0x110000, false);
    size_t index = 0;
    for (const auto& [b, e] : matches) {
      while (offsets[index] < b) ++index;
      char32_t cp = static_cast<char32_t>(index < 0xD800 ? index : index + 0x800);
      EXPECT_EQ(offsets[index], b);
      // A match may span several members (a `+` never appears here, but be safe).
      for (size_t pos = b; pos < e;) {
        in[cp] = true;
        pos += utf8(cp).size();
        cp = cp == 0xD7FF ? 0xE000 : cp + 1;
      }
    }
    return in;
  };
  const std::vector<bool> unassigned = members(R"(\p{Cn})");
  for (const auto& [name, pattern] : classes) {
    const json& ranges = goldens().at("classes").at(name).at("ranges");
    std::vector<bool> expected(0x110000, false);
    for (const json& r : ranges) {
      for (char32_t cp = r[0].get<char32_t>(); cp <= r[1].get<char32_t>(); ++cp)
        expected[cp] = true;
    }
    const std::vector<bool> got = members(pattern);
    size_t mismatches = 0, unassigned_mismatches = 0, members_total = 0;
    for (char32_t cp = 0; cp < 0x110000; ++cp) {
      if (cp >= 0xD800 && cp <= 0xDFFF) continue;
      members_total += expected[cp];
      if (got[cp] == expected[cp]) continue;
      if (unassigned[cp]) {
        ++unassigned_mismatches;
      } else if (++mismatches <= 10) {
        ADD_FAILURE() << name << ": U+" << std::hex << static_cast<uint32_t>(cp) << std::dec
                      << (expected[cp] ? " is" : " is not") << " in the class for tiktoken";
      }
    }
    EXPECT_EQ(mismatches, 0u) << name;
    EXPECT_GT(members_total, 1000u) << name;
    std::printf("%s: %zu members, %zu differences on code points unassigned in PCRE2's Unicode\n",
                name, members_total, unassigned_mismatches);
  }
}

TEST(TiktokenPattern, TranslationOnTargetedStrings) {
  using V = std::vector<std::string>;
  // [\p{Han}]+ takes Han runs; the letter alternatives exclude Han, so Han and kana split apart.
  EXPECT_EQ(pieces("汉字abc汉字"), (V{"汉字", "abc", "汉字"}));
  EXPECT_EQ(pieces("A中B"), (V{"A", "中", "B"}));
  EXPECT_EQ(pieces("日本語のテキスト"), (V{"日本語", "のテキスト"}));
  // Script, not Script_Extensions: CJK punctuation and the prolonged sound mark are not Han.
  EXPECT_EQ(pieces("中、文。"), (V{"中", "、", "文", "。"}));
  EXPECT_EQ(pieces("ーカ中"), (V{"ーカ", "中"}));
  EXPECT_EQ(pieces("〆々中"), (V{"〆", "々中"}));  // U+3006 is Common, U+3005 is Han
  // Upper-then-lower words, lowercase runs, contractions case-insensitively (and with long s).
  EXPECT_EQ(pieces("HTTPServer iPhone"), (V{"HTTPServer", " i", "Phone"}));
  EXPECT_EQ(pieces("DON'T it's I'M"), (V{"DON'T", " it's", " I'M"}));
  EXPECT_EQ(pieces("it'\u017F"), (V{"it'\u017F"}));
  // Titlecase (Lt) and modifier letters (Lm), marks (M) inside words.
  EXPECT_EQ(pieces("ǅungla ʰʲ"), (V{"ǅungla", " ʰʲ"}));
  EXPECT_EQ(pieces("e\u0301te"), (V{"e\u0301te"}));
  // Digits by three, punctuation, newlines and whitespace runs.
  EXPECT_EQ(pieces("1234567"), (V{"123", "456", "7"}));
  EXPECT_EQ(pieces("a  b\n\n c"), (V{"a", " ", " b", "\n\n", " c"}));
  EXPECT_EQ(pieces("x !!\n"), (V{"x", " !!\n"}));

  // PCRE2 reads a bare \p{Han} as Script_Extensions: that spelling would put U+3001 in a Han run.
  const tokenizer_detail::Regex scx(R"([\p{Han}]+)", false, "scx");
  std::vector<std::pair<size_t, size_t>> matches;
  scx.find_all("中、文", matches);
  EXPECT_EQ(matches.size(), 1u)
      << "PCRE2 no longer reads \\p{Han} as Script_Extensions; revisit kKimiHan";
}

// ---------------------------------------------------------------------------------------------
// Merge order and special tokens on handcrafted vocabularies

TEST(TiktokenModel, MergesLowestRankFirstAndWholePieces) {
  // "bc" = 256 ranks before "ab" = 257. "xyz" = 258 has no parts with ranks: only the whole-piece
  // lookup finds it. "aa" = 259 for leftmost ties. "cab" = 260 is reachable only as "c" + "ab".
  const Tokenizer tok = Tokenizer::from_tiktoken(rank_file({"bc", "ab", "xyz", "aa", "cab"}));
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{'a', 256}));        // bc before ab
  EXPECT_EQ(tok.encode("cabc"), (std::vector<int32_t>{'c', 'a', 256}));  // not "cab" + "c"
  EXPECT_EQ(tok.encode("cab"), (std::vector<int32_t>{260}));             // whole piece
  EXPECT_EQ(tok.encode("abd"), (std::vector<int32_t>{257, 'd'}));
  EXPECT_EQ(tok.encode("cabd"), (std::vector<int32_t>{260, 'd'}));  // "c" + "ab" -> "cab"
  EXPECT_EQ(tok.encode("xyz"), (std::vector<int32_t>{258}));
  EXPECT_EQ(tok.encode("xyzw"), (std::vector<int32_t>{'x', 'y', 'z', 'w'}));
  EXPECT_EQ(tok.encode("aaa"), (std::vector<int32_t>{259, 'a'}));
  EXPECT_EQ(tok.encode(" abc"), (std::vector<int32_t>{' ', 'a', 256}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{258, 260, 'q'}), "xyzcabq");
  EXPECT_EQ(tok.vocab_size(), 261 + 258);
  // Vocabulary forms are byte-level strings.
  EXPECT_EQ(tok.id_to_token(' '), "\xC4\xA0");
  EXPECT_EQ(tok.token_to_id("\xC4\xA0"), ' ');
  EXPECT_EQ(tok.token_to_id("cab"), 260);
  EXPECT_EQ(tok.token_to_id("nope"), std::nullopt);
  // Without a config the special ids are all reserved names, still matched in text.
  EXPECT_EQ(tok.encode("a<|reserved_token_262|>b"), (std::vector<int32_t>{'a', 262, 'b'}));
  EXPECT_FALSE(tok.is_special(262));
}

TEST(TiktokenSpecialTokens, MatchedAnywhereAndSkippedByFlag) {
  const std::string config = R"({
    "added_tokens_decoder": {
      "256": {"content": "[BOS]", "special": true},
      "257": {"content": "[EOS]", "special": true},
      "258": {"content": "<|im_end|>", "special": true},
      "260": {"content": "<think>", "special": false}
    },
    "bos_token": "[BOS]", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
    "chat_template": "{{ messages }}",
    "model_max_length": 1000000000000000019884624838656
  })";
  const Tokenizer tok = Tokenizer::from_tiktoken(rank_file(), config);
  EXPECT_EQ(tok.encode("[BOS]hi<|im_end|>"), (std::vector<int32_t>{256, 'h', 'i', 258}));
  // Specials inside words and at the edges; broken ones stay text.
  EXPECT_EQ(tok.encode("a<think>b"), (std::vector<int32_t>{'a', 260, 'b'}));
  EXPECT_EQ(tok.encode("<|im_end|<|im_end|>"),
            (std::vector<int32_t>{'<', '|', 'i', 'm', '_', 'e', 'n', 'd', '|', 258}));
  EXPECT_EQ(tok.encode("[EOS]", /*add_special_tokens=*/true), (std::vector<int32_t>{257}));
  // The text around a special token is pre-tokenized on its own ("  " then " x", not "   x").
  EXPECT_EQ(tok.encode("  [EOS] x"), (std::vector<int32_t>{' ', ' ', 257, ' ', 'x'}));
  const std::vector<int32_t> ids{256, 'h', 260, 'i', 258, 300};
  EXPECT_EQ(tok.decode(ids), "[BOS]h<think>i<|im_end|><|reserved_token_300|>");
  EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), "h<think>i<|reserved_token_300|>");
  EXPECT_EQ(tok.decode_token(258), "<|im_end|>");
  EXPECT_TRUE(tok.is_special(258));
  EXPECT_FALSE(tok.is_special(260));
  EXPECT_EQ(tok.bos_token_id(), 256);
  EXPECT_EQ(tok.eos_token_id(), 258);
  EXPECT_EQ(tok.chat_template(), "{{ messages }}");
}

TEST(TiktokenEncode, LongRunsAreCutLikeKimi) {
  const Tokenizer tok = Tokenizer::from_tiktoken(rank_file({"aa"}));
  // 25,001 letters: the last one is cut off into a piece of its own.
  const std::string run(25'001, 'a');
  std::vector<int32_t> expected(12'500, 256);
  expected.push_back('a');
  EXPECT_EQ(tok.encode(run), expected);
  EXPECT_EQ(tok.encode("b" + run).front(), 'b');
  EXPECT_EQ(tok.encode("b" + run).size(), 1 + 12'500 + 1u);  // "b" + 24,999 a's | "aa"
  // Counted in characters, not bytes: 25,000 characters (37,497 bytes) stay one run; a cut at
  // 25,000 bytes would split the a's after an odd count and shift every later merge.
  std::string wide;
  for (int i = 0; i < 12'498; ++i) wide += "é";
  wide += "b" + std::string(12'501, 'a');
  std::vector<int32_t> wide_ids;
  for (int i = 0; i < 12'498; ++i) wide_ids.insert(wide_ids.end(), {0xC3, 0xA9});
  wide_ids.push_back('b');
  wide_ids.insert(wide_ids.end(), 6'250, 256);
  wide_ids.push_back('a');
  EXPECT_EQ(tok.encode(wide), wide_ids);
  // 400,000-character chunks: a special token across the chunk boundary is not recognised.
  const Tokenizer special = Tokenizer::from_tiktoken(rank_file());
  std::string text;
  while (text.size() < 399'998) text += "ab ";
  text.resize(399'998);
  const std::string tail = "<|reserved_token_300|>";
  EXPECT_EQ(special.encode(text + tail).back(), '>');
  EXPECT_EQ(special.encode(text.substr(0, 399'000) + tail).back(), 300);
}

// ---------------------------------------------------------------------------------------------
// Malformed files

TEST(TiktokenErrors, RankFileProblemsNameFileAndLine) {
  TempDir dir;
  const auto model = dir / "tiktoken.model";
  const auto expect_error = [&](const std::string& text, std::initializer_list<std::string> parts) {
    test::write_text_file(model, text);
    EXPECT_TRUE(throws_error([&] { Tokenizer::load(dir.path()); }, ErrorCode::kInvalidFile, parts));
  };
  const std::string good = rank_file({"ab"});
  const std::string where = model.string() + ":";
  expect_error("", {model.string(), "no tokens"});
  expect_error("\n\n", {"no tokens"});
  expect_error("IQ== 0\nIQ==\n", {where + "2:", "two fields"});
  expect_error("IQ== 0 1\n", {where + "1:", "two fields"});
  expect_error("IQ==  0\n", {where + "1:", "two fields"});
  expect_error("IQ== 0\n@@@@ 1\n", {where + "2:", "bad base64"});
  expect_error("IQ= 0\n", {where + "1:", "bad base64"});
  expect_error("IR== 0\n", {where + "1:", "bad base64"});  // non-zero padding bits
  expect_error("IQ== x\n", {where + "1:", "rank 'x' is not a non-negative integer"});
  expect_error("IQ== -1\n", {where + "1:", "not a non-negative integer"});
  expect_error("IQ== 99999999999\n", {where + "1:", "too large"});
  expect_error(good + base64("cd") + " 256\n", {where + "258:", "duplicate rank 256", "line 257"});
  expect_error(good + base64("ab") + " 257\n", {where + "258:", "duplicate token", "rank 256"});
  expect_error(good + base64("cd") + " 300\n",
               {where + "258:", "rank 300 leaves a gap", "rank 257 is missing"});
  std::string no_zero = rank_file();
  no_zero = no_zero.substr(no_zero.find('\n') + 1) + base64("ab") + " 0\n";
  expect_error(no_zero, {"byte 0x00 has no rank"});
  // CRLF line ends and blank lines are accepted, as load_tiktoken_bpe does.
  std::string crlf;
  for (char c : good) crlf += c == '\n' ? std::string("\r\n\r\n") : std::string(1, c);
  test::write_text_file(model, crlf);
  EXPECT_EQ(Tokenizer::load(dir.path()).encode("ab"), (std::vector<int32_t>{256}));
}

TEST(TiktokenErrors, ConfigProblemsNameTheField) {
  TempDir dir;
  test::write_text_file(dir / "tiktoken.model", rank_file());
  const auto config = dir / "tokenizer_config.json";
  const auto expect_error = [&](const std::string& text, std::initializer_list<std::string> parts) {
    test::write_text_file(config, text);
    EXPECT_TRUE(throws_error([&] { Tokenizer::load(dir.path()); }, ErrorCode::kInvalidFile, parts));
  };
  expect_error("{", {config.string(), "not valid JSON"});
  expect_error(R"({"added_tokens_decoder": []})", {"added_tokens_decoder", "must be an object"});
  expect_error(R"({"added_tokens_decoder": {"x": {"content": "a"}}})",
               {"key 'x'", "not a token id"});
  expect_error(R"({"added_tokens_decoder": {"255": {"content": "a"}}})",
               {"added_tokens_decoder.255", "outside the special-token ids [256, 514)"});
  expect_error(R"({"added_tokens_decoder": {"514": {"content": "a"}}})", {"outside"});
  expect_error(R"({"added_tokens_decoder": {"256": {"special": true}}})",
               {"added_tokens_decoder.256.content"});
  expect_error(R"({"added_tokens_decoder": {"256": {"content": ""}}})", {"is empty"});
  expect_error(R"({"added_tokens_decoder": {"256": {"content": "a", "special": 1}}})",
               {".special"});
  expect_error(
      R"({"added_tokens_decoder": {"256": {"content": "[X]"}, "257": {"content": "[X]"}}})",
      {"256 and 257", "same content '[X]'"});
  expect_error(R"({"added_tokens_decoder": {"256": {"content": "<|reserved_token_300|>"}}})",
               {"256 and 300"});
  expect_error(R"({"eos_token": "[NOPE]"})", {"eos_token '[NOPE]'"});
}

TEST(TiktokenLoad, PrefersTokenizerJsonAndReadsModelFile) {
  TempDir dir;
  test::write_text_file(dir / "tiktoken.model", rank_file({"ab"}));
  EXPECT_EQ(Tokenizer::load(dir / "tiktoken.model").encode("ab"), (std::vector<int32_t>{256}));
  std::ifstream in(test::data_dir() / "tokenizer" / "tokenizer.json", std::ios::binary);
  std::stringstream json_text;
  json_text << in.rdbuf();
  test::write_text_file(dir / "tokenizer.json", json_text.str());
  const Tokenizer tok = Tokenizer::load(dir.path());
  EXPECT_EQ(tok.encode("Hello world"),
            (std::vector<int32_t>{305, 489}));  // tests/data/tokenizer/cases.json
}

}  // namespace
}  // namespace moelora::io
