// Internal pieces of the tokenizer (tokenizer.h): UTF-8 and Unicode helpers, the PCRE2 regex
// wrapper, the added-token matcher, the BPE model with its word cache, and the loaded state
// (Tokenizer::Impl). Split from tokenizer.cpp so that each part stays readable; nothing here is
// used outside src/io/tokenizer*.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/input_limits.h"
#include "io/tokenizer.h"

namespace moelora::io::tokenizer_detail {

// Hash map keyed by std::string that can be searched with a std::string_view (no allocation).
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename T>
using StringMap = std::unordered_map<std::string, T, StringHash, std::equal_to<>>;

// ---- UTF-8 / Unicode (tokenizer_text.cpp) ----

// Decodes the code point starting at text[pos] of text already known to be valid UTF-8 and
// advances pos past it.
char32_t next_code_point(std::string_view text, size_t& pos);
// Code point ending right before text[end] (valid UTF-8, end > 0); sets `begin` to its start.
char32_t previous_code_point(std::string_view text, size_t end, size_t& begin);
// Unicode White_Space (Rust char::is_whitespace, regex \s).
bool is_white_space(char32_t cp);
// Unicode word character as in the Rust regex crate's \w: letters, marks, decimal digits,
// letter numbers, connector punctuation, ZWNJ/ZWJ.
bool is_word_char(char32_t cp);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
const char* normal_form_name(NormalForm form);
// Unicode normalization of valid UTF-8 text (utf8proc). ASCII text is returned unchanged.
std::string normalize(std::string_view text, NormalForm form);

// The byte-level alphabet: UTF-8 form of the character that each byte maps to, and the inverse
// from code point (< 324) to byte.
const std::array<std::string, 256>& byte_to_unicode_table();
int byte_from_code_point(char32_t cp);  // -1 when cp is not one of the 256 characters

// ---- PCRE2 regex (tokenizer_text.cpp) ----

// A compiled pattern. Thread-safe: matching uses per-thread match data.
class Regex {
 public:
  // `literal` compiles the pattern as a plain string (tokenizer.json {"String": ...} patterns).
  // Throws kInvalidFile naming `what` and the PCRE2 message on a bad pattern.
  Regex(std::string_view pattern, bool literal, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [begin, end) byte ranges of all non-overlapping, non-empty matches in `subject`
  // (valid UTF-8), left to right. An empty match moves the search on by one character, as
  // Oniguruma's find_iter does.
  void find_all(std::string_view subject, std::vector<std::pair<size_t, size_t>>& matches) const;
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  std::string what_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// ---- added tokens (tokenizer.cpp) ----

// Leftmost-longest matcher over a set of byte strings (a byte trie), the semantics of the
// Aho-Corasick LeftmostLongest search that `tokenizers` uses for added tokens.
class TokenMatcher {
 public:
  void add(std::string_view pattern, int32_t value);
  bool empty() const { return nodes_.size() <= 1; }
  // Finds the leftmost position >= from where some pattern matches and the longest pattern
  // there. Returns false when none matches.
  bool find(std::string_view text, size_t from, size_t& match_begin, size_t& match_end,
            int32_t& value) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;  // (byte, node index), sorted by byte
    int32_t value = -1;                                 // index of the pattern ending here
  };
  int32_t child(int32_t node, uint8_t byte) const;
  std::vector<Node> nodes_{Node{}};
  std::array<bool, 256> first_byte_{};
};

// ---- BPE models (tokenizer_bpe.cpp) ----

// A bounded cache of pre-token -> ids, shared by both BPE models. Sharded so that threads rarely
// wait on each other; a full shard is cleared (cheap, and recent words come back quickly).
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 256;  // longer pre-tokens are not cached
  bool get(std::string_view word, std::vector<int32_t>& out) const;
  void put(std::string_view word, std::span<const int32_t> ids) const;

 private:
  static constexpr size_t kShards = 16;
  static constexpr size_t kEntriesPerShard = 4096;
  struct Shard {
    mutable std::mutex mutex;
    StringMap<std::vector<int32_t>> words;
  };
  mutable std::array<Shard, kShards> shards_;
};

class BpeModel {
 public:
  struct Options {
    bool byte_level = true;      // pre-tokens are raw bytes, mapped through bytes_to_unicode
    bool ignore_merges = false;  // a pre-token found whole in the vocabulary is emitted as is
    std::optional<int32_t> unk_id;
    bool fuse_unk = false;
  };

  BpeModel() = default;
  // vocab: token -> id. merges: (left, right) token strings in rank order. Throws kInvalidFile
  // (naming `source` and the merge) when a merge or its result is not in the vocabulary.
  BpeModel(StringMap<int32_t> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
           Options options, const std::string& source);

  // Appends the ids of one pre-token (raw bytes when byte_level).
  void tokenize(std::string_view pre_token, std::vector<int32_t>& out) const;

  const StringMap<int32_t>& vocab() const { return vocab_; }

 private:
  struct MergeResult {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  const MergeResult* find_merge(int32_t left, int32_t right) const;
  void merge_symbols(std::vector<int32_t>& symbols) const;

  StringMap<int32_t> vocab_;
  std::unordered_map<uint64_t, MergeResult> merges_;
  std::array<int32_t, 256> byte_ids_{};  // id of each byte's byte-level character, -1 if none
  Options options_;
  std::unique_ptr<WordCache> cache_ = std::make_unique<WordCache>();
};

// ---- tiktoken model (tokenizer_tiktoken.cpp) ----

// Kimi's pre-tokenization regex, TikTokenTokenizer.pat_str of tokenization_kimi.py, as tiktoken
// (Rust fancy-regex) reads it. Its letter classes use class intersection (`[A&&[^\p{Han}]]`),
// which PCRE2 lacks, and a bare `\p{Han}` there is the Script property (PCRE2 reads a bare script
// name as Script_Extensions, which adds CJK punctuation such as U+3001 and the kana prolonged
// sound mark). The classes below are the PCRE2 spellings of the three classes involved;
// kimi_pcre2_pattern() joins them into the equivalent of kKimiPatStr.
inline constexpr std::string_view kKimiPatStr =
    R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]: a lookahead excludes Han before the plain class.
inline constexpr std::string_view kKimiUpperNoHan =
    R"((?:(?!\p{sc:Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]))";
// [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
inline constexpr std::string_view kKimiLowerNoHan =
    R"((?:(?!\p{sc:Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}]))";
// [\p{Han}]
inline constexpr std::string_view kKimiHan = R"([\p{sc:Han}])";
std::string kimi_pcre2_pattern();

// tiktoken's BPE over raw bytes: a pre-token found whole in the ranks is one token; otherwise,
// starting from single bytes, the adjacent pair whose concatenation has the lowest rank is merged
// (leftmost among equal ranks) until no concatenation has a rank. The id of a token is its rank.
class TiktokenModel {
 public:
  // ranks: token bytes -> rank, ranks 0..n-1 without gaps; every single byte has a rank.
  explicit TiktokenModel(StringMap<int32_t> ranks);
  void tokenize(std::string_view piece, std::vector<int32_t>& out) const;
  std::optional<int32_t> rank(std::string_view bytes) const;

 private:
  void merge(std::string_view piece, std::vector<int32_t>& out) const;
  StringMap<int32_t> ranks_;
  std::array<int32_t, 256> byte_ranks_{};
  std::unique_ptr<WordCache> cache_ = std::make_unique<WordCache>();
};

// Python's str.isspace(), which TikTokenTokenizer.encode uses to cut long runs (it differs from
// White_Space: U+001C..U+001F are included, U+180E is not).
bool is_python_space(char32_t cp);

// ---- loaded state (tokenizer.cpp) ----

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One regex split of the pre-tokenizer: a Split, or the GPT-2 regex of ByteLevel(use_regex=true)
// (Isolated, at index Tokenizer::Impl::byte_level_step).
struct PreTokenizerStep {
  std::shared_ptr<const Regex> regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

}  // namespace moelora::io::tokenizer_detail

namespace moelora::io {

struct Tokenizer::Impl {
  std::string source;

  // Model vocabulary and the id -> token table (added tokens override model tokens).
  tokenizer_detail::BpeModel model;
  std::vector<std::string> id_to_token;    // indexed by id; "" for holes
  std::vector<uint8_t> id_flags;           // kHasToken | kSpecial per id
  std::vector<std::string> decoded_bytes;  // what the decoder makes of each id
  static constexpr uint8_t kHasToken = 1, kSpecial = 2;

  std::vector<AddedToken> added_tokens;
  tokenizer_detail::StringMap<int32_t> added_by_content;
  tokenizer_detail::TokenMatcher raw_added;         // normalized=false tokens, value = index
  tokenizer_detail::TokenMatcher normalized_added;  // normalized=true tokens (normalized content)

  std::vector<tokenizer_detail::NormalForm> normalizers;  // applied in order
  std::vector<tokenizer_detail::PreTokenizerStep> pre_tokenizers;
  bool byte_level = false;               // a ByteLevel pre-tokenizer is present (last step)
  bool byte_level_prefix_space = false;  // its add_prefix_space
  size_t byte_level_step = 0;            // index in pre_tokenizers where ByteLevel acts
  bool byte_level_decoder = false;

  // Post-processor for add_special_tokens: ids before and after the sequence.
  std::vector<int32_t> special_prefix, special_suffix;

  // tiktoken.model tokenizers (Kimi) use these instead of `model` and the pre-tokenizers; the
  // added tokens are then tiktoken's special tokens.
  std::shared_ptr<const tokenizer_detail::TiktokenModel> tiktoken;
  std::shared_ptr<const tokenizer_detail::Regex> tiktoken_regex;

  // Id of a token in its vocabulary form (added tokens first), nullopt when unknown.
  std::optional<int32_t> find_token(std::string_view token) const;

  std::optional<std::string> eos_token, bos_token, pad_token, unk_token;
  std::optional<int32_t> eos_id, bos_id, pad_id, unk_id;
  std::optional<std::string> chat_template;
  std::map<std::string, std::string> named_chat_templates;
};

}  // namespace moelora::io

namespace moelora::io::tokenizer_detail {

// Builds a tiktoken tokenizer from the text of a tiktoken.model file and of its
// tokenizer_config.json (empty when there is none; only added_tokens_decoder is read here).
// Throws kInvalidFile naming the source, the line and the problem.
std::shared_ptr<Tokenizer::Impl> build_tiktoken_impl(std::string_view model_text,
                                                     const std::string& model_source,
                                                     std::string_view config_text,
                                                     const std::string& config_source);

// Encodes valid UTF-8 text with a tiktoken tokenizer (impl.tiktoken set), appending to `out`.
void encode_tiktoken(const Tokenizer::Impl& impl, std::string_view text, std::vector<int32_t>& out);

// tokenizer_json.cpp: the text of a tokenizer file, refused past max_bytes (tokenizer.json may be
// large, kMaxTokenizerFileBytes; its config and templates are small files); tokenizer.json ->
// Impl; tokenizer_config.json's settings (special tokens, chat templates) applied to an Impl.
// Errors name the source and the field.
std::string read_file(const std::filesystem::path& path, uint64_t max_bytes = kMaxJsonFileBytes);
std::shared_ptr<Tokenizer::Impl> build_impl(std::string_view json_text, const std::string& source);
void apply_config(Tokenizer::Impl& impl, std::string_view config_text,
                  const std::string& config_source);

}  // namespace moelora::io::tokenizer_detail
