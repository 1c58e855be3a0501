// Tests of the byte-level BPE tokenizer (io/tokenizer.h).
//
// Two kinds of checks:
//  - unit tests on small tokenizer.json files built here, whose expected ids follow from the
//    vocabulary by hand: merge order, both merge formats, added tokens and their flags,
//    normalization, split behaviours, post-processing, decoding;
//  - the errors of malformed files and parity with the Hugging Face `tokenizers` library:
//    tokenizer_parity_test.cpp.
#include <gtest/gtest.h>

#include "unit/tokenizer_test_support.h"

namespace moelora::io {
namespace {

using namespace tokenizer_test;  // json, TempDir and the helpers

// ---------------------------------------------------------------------------------------------
// Byte-level alphabet and UTF-8 helpers

TEST(TokenizerByteLevel, AlphabetMatchesGpt2Definition) {
  std::set<std::string> seen;
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    const std::string mapped = byte_level_encode(one);
    EXPECT_EQ(mapped, byte_char(static_cast<uint8_t>(b))) << "byte " << b;
    seen.insert(mapped);
    EXPECT_EQ(byte_level_decode(mapped), one) << "byte " << b;
  }
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(byte_level_encode(" "), "\xC4\xA0");   // Ġ U+0120
  EXPECT_EQ(byte_level_encode("\n"), "\xC4\x8A");  // Ċ U+010A
  EXPECT_EQ(byte_level_encode(std::string(1, '\0')), "\xC4\x80");
  EXPECT_EQ(byte_level_encode("\xAD"), "\xC5\x83");        // soft hyphen byte: the 68th shifted, U+0143
  EXPECT_EQ(byte_level_decode("\xC5\x84"), std::nullopt);  // U+0144 is past the alphabet
  EXPECT_EQ(byte_level_decode("\xE4\xB8\xAD"), std::nullopt);
}

TEST(TokenizerUtf8, ValidationSanitizingAndStreamingPrefix) {
  EXPECT_EQ(find_invalid_utf8("plain ascii"), std::nullopt);
  EXPECT_EQ(find_invalid_utf8("h\xC3\xA9llo \xF0\x9F\x98\x80"), std::nullopt);
  EXPECT_EQ(find_invalid_utf8("ab\xC3"), 2u);            // truncated
  EXPECT_EQ(find_invalid_utf8("abc\xC0\xAF"), 3u);       // overlong '/'
  EXPECT_EQ(find_invalid_utf8("a\xED\xA0\x80"), 1u);     // surrogate U+D800
  EXPECT_EQ(find_invalid_utf8("\xF4\x90\x80\x80"), 0u);  // past U+10FFFF
  EXPECT_EQ(find_invalid_utf8("x\x80"), 1u);             // stray continuation

  EXPECT_EQ(sanitize_utf8("a\xE2\x82"
                          "b"),
            "a\xEF\xBF\xBD"
            "b");                                                    // one U+FFFD for a cut sequence
  EXPECT_EQ(sanitize_utf8("\xF0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // F0 80: two invalid units
  EXPECT_EQ(sanitize_utf8("ok \xC3\xA9"), "ok \xC3\xA9");

  EXPECT_EQ(utf8_complete_prefix("abc"), 3u);
  EXPECT_EQ(utf8_complete_prefix("ab\xF0\x9F\x98"), 2u);  // emoji missing its last byte
  EXPECT_EQ(utf8_complete_prefix("ab\xC3"), 2u);
  EXPECT_EQ(utf8_complete_prefix("ab\xC3\xA9"), 4u);
  EXPECT_EQ(utf8_complete_prefix("ab\xFF"), 3u);  // invalid, not incomplete: nothing to wait for
}

// ---------------------------------------------------------------------------------------------
// BPE merges

TEST(TokenizerBpe, LowestRankMergesFirst) {
  TempDir dir1, dir2;
  Spec spec;
  spec.extra_tokens = {"ab", "bc"};  // ids 256, 257
  spec.merges = {{"a", "b"}, {"b", "c"}};
  const Tokenizer ab_first = load_spec(spec, dir1);
  EXPECT_EQ(ab_first.encode("abc"), (std::vector<int32_t>{256, 'c'}));
  spec.merges = {{"b", "c"}, {"a", "b"}};
  const Tokenizer bc_first = load_spec(spec, dir2);
  EXPECT_EQ(bc_first.encode("abc"), (std::vector<int32_t>{'a', 257}));
}

TEST(TokenizerBpe, EqualRanksMergeLeftmostFirstAndChain) {
  TempDir dir;
  Spec spec;
  spec.extra_tokens = {"aa", "aaa", "aaaa"};  // 256, 257, 258
  spec.merges = {{"a", "a"}, {"aa", "a"}, {"aa", "aa"}};
  const Tokenizer tok = load_spec(spec, dir);
  EXPECT_EQ(tok.encode("a"), (std::vector<int32_t>{'a'}));
  EXPECT_EQ(tok.encode("aa"), (std::vector<int32_t>{256}));
  // a a a -> (aa) a -> aaa: the leftmost pair merges first.
  EXPECT_EQ(tok.encode("aaa"), (std::vector<int32_t>{257}));
  // a a a a -> aa aa (rank 0 twice) -> aaaa (rank 2); "aa a" never forms.
  EXPECT_EQ(tok.encode("aaaa"), (std::vector<int32_t>{258}));
  // 5: aa aa a -> the (aa, a) pair at the end has rank 1 < rank 2 of (aa, aa).
  EXPECT_EQ(tok.encode("aaaaa"), (std::vector<int32_t>{256, 257}));
}

TEST(TokenizerBpe, MultiByteCharactersAndSpacePrefix) {
  TempDir dir;
  Spec spec;
  // "é" is C3 A9; " é" and " h" merge through the Ġ form of the space.
  spec.extra_tokens = {bl("é"), bl(" é"), bl(" h"), bl(" hé")};  // 256..259
  spec.merges = {{bl("\xC3"), bl("\xA9")}, {bl(" "), bl("é")}, {bl(" "), bl("h")}, {bl(" h"), bl("é")}};
  const Tokenizer tok = load_spec(spec, dir);
  EXPECT_EQ(tok.encode("é"), (std::vector<int32_t>{256}));
  EXPECT_EQ(tok.encode("x é"), (std::vector<int32_t>{'x', 257}));
  // " hé" is one Qwen pre-token ([^\r\n\p{L}\p{N}]?\p{L}+); ranks: (C3,A9)=0, (Ġ,h)=2, (Ġh,é)=3.
  EXPECT_EQ(tok.encode("a hé"), (std::vector<int32_t>{'a', 259}));
  EXPECT_EQ(tok.decode(tok.encode("a hé x é")), "a hé x é");
}

TEST(TokenizerBpe, BothMergeFormatsGiveTheSameIds) {
  TempDir dir1, dir2;
  Spec spec;
  spec.extra_tokens = {"he", "ll", "llo", "hello", bl(" w"), bl(" wor"), "or"};
  spec.merges = {{"h", "e"}, {"l", "l"},     {"ll", "o"},     {"he", "llo"},
                 {"o", "r"}, {bl(" "), "w"}, {bl(" w"), "or"}};
  const Tokenizer pairs = load_spec(spec, dir1);
  spec.legacy_merges = true;
  const Tokenizer legacy = load_spec(spec, dir2);
  for (const char* text : {"hello world", "hellohello", " wor wor", "llllo", "", "hell or"}) {
    EXPECT_EQ(pairs.encode(text), legacy.encode(text)) << text;
  }
  EXPECT_EQ(pairs.encode("hello world"), (std::vector<int32_t>{259, 261, 'l', 'd'}));
}

TEST(TokenizerBpe, IgnoreMergesEmitsWholeVocabularyWords) {
  TempDir dir1, dir2;
  Spec spec;
  // "abc" is in the vocabulary but no merge sequence builds it.
  spec.extra_tokens = {"ab", "abc"};
  spec.merges = {{"a", "b"}};
  const Tokenizer plain = load_spec(spec, dir1);
  EXPECT_EQ(plain.encode("abc"), (std::vector<int32_t>{256, 'c'}));
  spec.ignore_merges = true;
  const Tokenizer ignoring = load_spec(spec, dir2);
  EXPECT_EQ(ignoring.encode("abc"), (std::vector<int32_t>{257}));
  // A pre-token missing from the vocabulary goes through the merges.
  EXPECT_EQ(ignoring.encode("abcab"), (std::vector<int32_t>{256, 'c', 256}));
}

TEST(TokenizerBpe, LongPreTokensStayFast) {
  TempDir dir;
  Spec spec;
  spec.extra_tokens = {"ab", "abab"};
  spec.merges = {{"a", "b"}, {"ab", "ab"}};
  const Tokenizer tok = load_spec(spec, dir);
  // One 200k-letter pre-token: a quadratic merge loop would take minutes.
  std::string word;
  for (int i = 0; i < 100001; ++i) word += "ab";
  const auto start = std::chrono::steady_clock::now();
  const auto ids = tok.encode(word);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(ids.size(), 50001u);
  for (size_t i = 0; i + 1 < ids.size(); ++i) ASSERT_EQ(ids[i], 257) << i;
  EXPECT_EQ(ids.back(), 256);
  EXPECT_EQ(tok.decode(ids), word);
  EXPECT_LT(seconds, 10.0);

  // Long whitespace runs exercise the backtracking of \s*[\r\n]+ and \s+(?!\S) in the regex.
  for (const std::string& text : {std::string(300000, ' ') + "x", std::string(300000, '\n'),
                                  std::string(100000, ' ') + std::string(100000, '\t') + "\r\n y"}) {
    EXPECT_EQ(tok.decode(tok.encode(text)), text);
  }
}

TEST(TokenizerBpe, MissingByteCharactersAreDropped) {
  // A vocabulary without the byte 'z': `tokenizers` drops the unit when there is no unk token.
  json j = make_json(Spec{});
  j["model"]["vocab"].erase("z");
  TempDir dir;
  const Tokenizer tok = load_json(j, dir);
  EXPECT_EQ(tok.encode("aza"), (std::vector<int32_t>{'a', 'a'}));
  // With an unk token the unit becomes unk; fuse_unk joins neighbours.
  j["model"]["vocab"]["<unk>"] = 300;
  j["model"]["unk_token"] = "<unk>";
  TempDir dir2, dir3;
  EXPECT_EQ(load_json(j, dir2).encode("azza"), (std::vector<int32_t>{'a', 300, 300, 'a'}));
  j["model"]["fuse_unk"] = true;
  EXPECT_EQ(load_json(j, dir3).encode("azza"), (std::vector<int32_t>{'a', 300, 'a'}));
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenization

TEST(TokenizerPreTokenizer, QwenRegexBoundariesBlockMerges) {
  TempDir dir;
  Spec spec;
  spec.extra_tokens = {"ab", bl(" b"), "12"};
  spec.merges = {{"a", "b"}, {bl(" "), "b"}, {"1", "2"}};
  const Tokenizer tok = load_spec(spec, dir);
  // Digits are single pre-tokens (\p{N}), so "12" never merges; "a b" splits as "a", " b".
  EXPECT_EQ(tok.encode("12"), (std::vector<int32_t>{'1', '2'}));
  EXPECT_EQ(tok.encode("a b"), (std::vector<int32_t>{'a', 257}));
  EXPECT_EQ(tok.encode("ab"), (std::vector<int32_t>{256}));
  // Contractions are their own pre-tokens, case-insensitively.
  EXPECT_EQ(tok.encode("ab'S"), (std::vector<int32_t>{256, '\'', 'S'}));
}

// With ignore_merges and every expected piece in the vocabulary, each pre-token comes out as
// one id, which makes the pre-tokenizer's pieces visible.
std::vector<std::string> pieces(const json& pre_tokenizer, const std::vector<std::string>& vocab_pieces,
                                const std::string& text) {
  Spec spec;
  spec.ignore_merges = true;
  spec.pre_tokenizer = pre_tokenizer;
  for (const auto& p : vocab_pieces) spec.extra_tokens.push_back(bl(p));
  TempDir dir;
  const Tokenizer tok = load_spec(spec, dir);
  std::vector<std::string> out;
  for (const auto& token : tokens_of(tok, tok.encode(text))) out.push_back(*byte_level_decode(token));
  return out;
}

json split(const std::string& literal, const std::string& behavior, bool invert = false) {
  json pre = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"String": ""}, "behavior": "", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]})");
  pre["pretokenizers"][0]["pattern"]["String"] = literal;
  pre["pretokenizers"][0]["behavior"] = behavior;
  pre["pretokenizers"][0]["invert"] = invert;
  return pre;
}

TEST(TokenizerPreTokenizer, SplitBehaviours) {
  const std::vector<std::string> vocab = {"the",    "final",  "countdown",  "the-",
                                          "final-", "-final", "-countdown", "--"};
  const std::string text = "the-final--countdown";
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces(split("-", "Removed"), vocab, text), (V{"the", "final", "countdown"}));
  EXPECT_EQ(pieces(split("-", "Isolated"), vocab, text), (V{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(pieces(split("-", "MergedWithPrevious"), vocab, text), (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(pieces(split("-", "MergedWithNext"), vocab, text), (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(pieces(split("-", "Contiguous"), vocab, text), (V{"the", "-", "final", "--", "countdown"}));
  // invert: the pattern marks the pieces to keep; Removed then drops everything else.
  EXPECT_EQ(pieces(split("-", "Removed", true), vocab, text), (V{"-", "-", "-"}));
}

TEST(TokenizerPreTokenizer, SeveralSplitsInSequenceLikeDeepSeekV3) {
  // DeepSeek-V3 style: digits in groups of up to three, CJK runs, then a word regex.
  const json pre = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
      {"type": "Split", "pattern": {"Regex": "[一-龥\u3040-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
      {"type": "Split", "pattern": {"Regex": "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
       "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})");
  const std::vector<std::string> vocab = {"1234567",  "123", "456",  "日本語",
                                          "テキスト", "abc", " abc", "日本語テキスト"};
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces(pre, vocab, "1234567"), (V{"123", "456", "7"}));
  EXPECT_EQ(pieces(pre, vocab, "abc日本語テキスト abc"), (V{"abc", "日本語テキスト", " abc"}));
}

TEST(TokenizerPreTokenizer, ByteLevelWithGpt2RegexAndPrefixSpace) {
  const auto byte_level = [](bool prefix) {
    json pre = json::parse(
        R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})");
    pre["add_prefix_space"] = prefix;
    return pre;
  };
  const std::vector<std::string> vocab = {"Hello", " Hello", " world", "world", "  ", "'ll", " 42"};
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces(byte_level(false), vocab, "Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces(byte_level(true), vocab, "Hello world"), (V{" Hello", " world"}));
  EXPECT_EQ(pieces(byte_level(true), vocab, " Hello"), (V{" Hello"}));
  // GPT-2 regex: " ?\p{N}+" keeps digits together, "\s+(?!\S)" leaves one space for the word.
  EXPECT_EQ(pieces(byte_level(false), vocab, "world   Hello'll 42"),
            (V{"world", "  ", " Hello", "'ll", " 42"}));
}

// ---------------------------------------------------------------------------------------------
// Added tokens and normalization

TEST(TokenizerAddedTokens, MatchedAtomicallyLongestFirst) {
  TempDir dir;
  Spec spec;
  spec.extra_tokens = {"ab"};
  spec.merges = {{"a", "b"}};
  spec.added_tokens = json::array({added_token(300, "<|a|>", true), added_token(301, "<|a|><|b|>", true),
                                   added_token(302, "<think>", false)});
  const Tokenizer tok = load_spec(spec, dir);
  EXPECT_EQ(tok.encode("<|a|>"), (std::vector<int32_t>{300}));
  EXPECT_EQ(tok.encode("x<|a|><|b|>y"), (std::vector<int32_t>{'x', 301, 'y'}));
  // Text on both sides is encoded separately: "a" and "b" would merge if they were one piece.
  EXPECT_EQ(tok.encode("a<|a|>b"), (std::vector<int32_t>{'a', 300, 'b'}));
  EXPECT_EQ(tok.encode("ab<think>ab"), (std::vector<int32_t>{256, 302, 256}));
  // A prefix of a token is plain text.
  EXPECT_EQ(tok.encode("<|a|"), concat({byte_ids("<|"), {'a'}, byte_ids("|")}));
  EXPECT_EQ(tok.token_to_id("<think>"), 302);
  EXPECT_EQ(tok.vocab_size(), 303);
  EXPECT_TRUE(tok.is_special(300));
  EXPECT_FALSE(tok.is_special(302));
}

TEST(TokenizerAddedTokens, StripAndSingleWordFlags) {
  TempDir dir;
  Spec spec;
  spec.added_tokens = json::array({added_token(300, "<l>", false, /*lstrip=*/true),
                                   added_token(301, "<r>", false, false, /*rstrip=*/true),
                                   added_token(302, "<w>", false, false, false, /*single_word=*/true)});
  const Tokenizer tok = load_spec(spec, dir);
  // lstrip swallows the whitespace on the left only (tabs and U+3000 count as whitespace).
  EXPECT_EQ(tok.encode("x \t<l> y"), concat({{'x', 300}, tok.encode(" y")}));
  EXPECT_EQ(tok.encode("x\u3000<l>"), (std::vector<int32_t>{'x', 300}));
  EXPECT_EQ(tok.encode("x <r>  y"), concat({tok.encode("x "), {301, 'y'}}));
  // <r> swallows the spaces that the following <l> would have taken.
  EXPECT_EQ(tok.encode("<r>  <l>"), (std::vector<int32_t>{301, 300}));
  // single_word: not glued to a word character on either side.
  EXPECT_EQ(tok.encode("a <w> b"), concat({tok.encode("a "), {302}, tok.encode(" b")}));
  EXPECT_EQ(tok.encode("a<w>"), byte_ids("a<w>"));
  EXPECT_EQ(tok.encode("<w>Ã©"), byte_ids("<w>Ã©"));  // é is a word character
  EXPECT_EQ(tok.encode("<w>_"), byte_ids("<w>_"));    // so is '_'
  EXPECT_EQ(tok.encode("(<w>)"), (std::vector<int32_t>{'(', 302, ')'}));
}

TEST(TokenizerNormalizer, NfcComposesBeforeBpe) {
  TempDir dir1, dir2, dir3;
  Spec spec;
  spec.extra_tokens = {bl("é")};
  spec.merges = {{bl("\xC3"), bl("\xA9")}};
  const std::string decomposed = "e\xCC\x81";  // e + U+0301
  const Tokenizer none = load_spec(spec, dir1);
  EXPECT_EQ(none.encode(decomposed), byte_ids(decomposed));
  spec.normalizer = {{"type", "NFC"}};
  const Tokenizer nfc = load_spec(spec, dir2);
  EXPECT_EQ(nfc.encode(decomposed), (std::vector<int32_t>{256}));
  EXPECT_EQ(nfc.encode("é"), (std::vector<int32_t>{256}));
  // NFC keeps compatibility characters (the ﬁ ligature) that NFKC would rewrite.
  EXPECT_EQ(nfc.encode("\xEF\xAC\x81"), byte_ids("\xEF\xAC\x81"));
  spec.normalizer = json::parse(R"({"type": "Sequence", "normalizers": [{"type": "NFKC"}]})");
  const Tokenizer nfkc = load_spec(spec, dir3);
  EXPECT_EQ(nfkc.encode("\xEF\xAC\x81"), byte_ids("fi"));
}

TEST(TokenizerNormalizer, AddedTokensMatchBeforeNormalizationUnlessNormalized) {
  TempDir dir;
  Spec spec;
  spec.normalizer = {{"type", "NFC"}};
  // Raw token holding a decomposed é, and a normalized token given in decomposed form.
  spec.added_tokens =
      json::array({added_token(300, "<e\xCC\x81>", true),
                   added_token(301, "[o\xCC\x88]", false, false, false, false, /*normalized=*/true)});
  const Tokenizer tok = load_spec(spec, dir);
  EXPECT_EQ(tok.encode("<e\xCC\x81>"), (std::vector<int32_t>{300}));  // raw match before NFC
  EXPECT_EQ(tok.encode("<\xC3\xA9>"), byte_ids("<\xC3\xA9>"));        // composed input: no match
  EXPECT_EQ(tok.encode("[\xC3\xB6]"), (std::vector<int32_t>{301}));   // matched after NFC
  EXPECT_EQ(tok.encode("[o\xCC\x88]"), (std::vector<int32_t>{301}));
}

TEST(TokenizerNormalizer, NfcMatchesUtf8procOnRandomMixes) {
  // normalize() skips characters that NFC cannot touch; compare it with a plain utf8proc_NFC call
  // on random strings full of compositions across those characters.
  const std::vector<std::string> atoms = {"e",
                                          "E",
                                          "a",
                                          " ",
                                          "\n",
                                          "\xCC\x81" /* U+0301 */,
                                          "\xCC\x88" /* U+0308 */,
                                          "\xCC\xA3" /* U+0323 */,
                                          "\xE3\x81\x8B" /* か */,
                                          "\xE3\x82\x99" /* U+3099 */,
                                          "\xE3\x82\xAB" /* カ */,
                                          "\xEA\xB0\x80" /* 가 */,
                                          "\xE1\x86\xA8" /* jamo T U+11A8 */,
                                          "\xE1\x84\x80" /* jamo L */,
                                          "\xE1\x85\xA1" /* jamo V */,
                                          "\xE4\xB8\xAD" /* 中 */,
                                          "\xC3\xA9" /* é */,
                                          "\xE2\x80\x80" /* U+2000 -> U+2002 */,
                                          "\xE2\x84\xAB" /* Angstrom sign -> Å */,
                                          "\xEF\xAC\x81" /* ﬁ, kept */,
                                          "\xF0\x9F\x98\x80"};
  std::mt19937_64 rng(test::test_seed(7));
  std::uniform_int_distribution<size_t> pick(0, atoms.size() - 1);
  std::uniform_int_distribution<int> length(0, 13);
  for (int n = 0; n < 3000; ++n) {
    std::string text;
    for (int i = length(rng); i > 0; --i) text += atoms[pick(rng)];
    utf8proc_uint8_t* expected = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(text.c_str()));
    ASSERT_NE(expected, nullptr);
    const std::string want(reinterpret_cast<const char*>(expected));
    std::free(expected);
    ASSERT_EQ(tokenizer_detail::normalize(text, tokenizer_detail::NormalForm::kNfc), want)
        << json(text).dump();
  }
}

// ---------------------------------------------------------------------------------------------
// Post-processing, decoding, config

TEST(TokenizerPostProcessor, TemplateProcessingAddsSpecialTokens) {
  TempDir dir;
  Spec spec;
  spec.added_tokens = json::array({added_token(300, "<s>", true), added_token(301, "</s>", true)});
  spec.post_processor = json::parse(R"({"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "</s>", "type_id": 0}}],
       "pair": [],
       "special_tokens": {"<s>": {"id": "<s>", "ids": [300], "tokens": ["<s>"]},
                          "</s>": {"id": "</s>", "ids": [301], "tokens": ["</s>"]}}}]})");
  const Tokenizer tok = load_spec(spec, dir);
  EXPECT_EQ(tok.encode("hi"), (std::vector<int32_t>{'h', 'i'}));
  EXPECT_EQ(tok.encode("hi", true), (std::vector<int32_t>{300, 'h', 'i', 301}));
  EXPECT_EQ(tok.encode("", true), (std::vector<int32_t>{300, 301}));
}

TEST(TokenizerDecode, SpecialTokensBytesAndUnknownIds) {
  TempDir dir;
  Spec spec;
  spec.extra_tokens = {bl("é")};
  spec.merges = {{bl("\xC3"), bl("\xA9")}};
  // A token outside the byte alphabet (DeepSeek-style) decodes to its own UTF-8.
  spec.added_tokens = json::array({added_token(300, "<|end|>", true), added_token(301, "<｜bos｜>", true),
                                   added_token(302, "<tool>", false)});
  const Tokenizer tok = load_spec(spec, dir);
  const std::vector<int32_t> ids = {301, 'h', 'i', 302, 256, 300};
  EXPECT_EQ(tok.decode(ids), "<｜bos｜>hi<tool>é<|end|>");
  EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), "hi<tool>é");
  // Half of "é" stays a raw byte (no U+FFFD) so that a stream can join it with the next token.
  EXPECT_EQ(tok.decode(std::vector<int32_t>{0xC3}), "\xC3");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{0xC3}) + tok.decode_token(0xA9), "é");
  // Ids without a token are skipped, as in `tokenizers`; id_to_token reports them.
  EXPECT_EQ(tok.decode(std::vector<int32_t>{-1, 'a', 299, 5000, 'b'}), "ab");
  EXPECT_TRUE(throws_error([&] { tok.id_to_token(299); }, ErrorCode::kOutOfRange, {"299"}));
  EXPECT_EQ(tok.id_to_token(' '), "\xC4\xA0");
  EXPECT_EQ(tok.token_to_id("\xC4\xA0"), ' ');
  EXPECT_EQ(tok.token_to_id("nope"), std::nullopt);
}

TEST(TokenizerConfig, SpecialTokenRolesAndChatTemplates) {
  TempDir dir;
  Spec spec;
  spec.added_tokens =
      json::array({added_token(300, "<|endoftext|>", true), added_token(301, "<|im_end|>", true)});
  test::write_text_file(dir / "tokenizer.json", make_json(spec).dump());
  test::write_text_file(dir / "tokenizer_config.json",
                        R"({"eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
                            "pad_token": "<|endoftext|>", "bos_token": null,
                            "chat_template": [{"name": "default", "template": "D"},
                                              {"name": "tool_use", "template": "T"}]})");
  Tokenizer tok = Tokenizer::load(dir.path());
  EXPECT_EQ(tok.eos_token_id(), 301);
  EXPECT_EQ(tok.eos_token(), "<|im_end|>");
  EXPECT_EQ(tok.pad_token_id(), 300);
  EXPECT_EQ(tok.bos_token_id(), std::nullopt);
  EXPECT_EQ(tok.chat_template(), "D");
  EXPECT_EQ(tok.named_chat_templates().at("tool_use"), "T");
  // chat_template.jinja takes precedence over tokenizer_config.json.
  test::write_text_file(dir / "chat_template.jinja", "{{ messages }}");
  tok = Tokenizer::load(dir.path());
  EXPECT_EQ(tok.chat_template(), "{{ messages }}");
  // Loading the file alone reads no config.
  const Tokenizer file_only = Tokenizer::load(dir / "tokenizer.json");
  EXPECT_EQ(file_only.eos_token_id(), std::nullopt);
  EXPECT_EQ(file_only.chat_template(), std::nullopt);
  // A role naming a token the tokenizer lacks is an error naming the file.
  test::write_text_file(dir / "tokenizer_config.json", json{{"eos_token", "<eos>"}}.dump());
  EXPECT_TRUE(throws_error([&] { Tokenizer::load(dir.path()); }, ErrorCode::kInvalidFile,
                           {"tokenizer_config.json", "eos_token", "<eos>"}));
}

TEST(TokenizerEncode, InvalidUtf8NamesTheByteOffset) {
  TempDir dir;
  const Tokenizer tok = load_spec(Spec{}, dir);
  EXPECT_TRUE(throws_error(
      [&] {
        tok.encode(
            "abc\xFF"
            "def");
      },
      ErrorCode::kInvalidArgument, {"UTF-8", "byte offset 3", "0xFF"}));
  EXPECT_TRUE(
      throws_error([&] { tok.encode("h\xC3\xA9\xE2\x82"); }, ErrorCode::kInvalidArgument, {"byte offset 3"}));
}

TEST(TokenizerEncode, ConcurrentCallsAgree) {
  TempDir dir;
  Spec spec;
  spec.extra_tokens = {"th", "the", bl(" th"), bl(" the")};
  spec.merges = {{"t", "h"}, {"th", "e"}, {bl(" "), "th"}, {bl(" th"), "e"}};
  const Tokenizer tok = load_spec(spec, dir);
  std::vector<std::string> texts;
  for (int i = 0; i < 50; ++i) texts.push_back("the then other " + std::to_string(i * 7919) + " thee the");
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) expected.push_back(tok.encode(t));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) mismatches[w] += tok.encode(texts[i]) != expected[i];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < 4; ++w) EXPECT_EQ(mismatches[w], 0) << "thread " << w;
}

}  // namespace
}  // namespace moelora::io
