// The tiktoken backend of the tokenizer (FORMATS.md §5.4): Kimi-K2 / K2.5 ship `tiktoken.model`
// and remote code (tokenization_kimi.py) instead of a tokenizer.json. This file reads the rank
// file and the special tokens of tokenizer_config.json, and encodes the way Kimi's
// TikTokenTokenizer.encode does with Python `tiktoken`:
//
//   1. the text is cut into chunks of at most 400,000 characters, and each chunk into pieces with
//      at most 25,000 consecutive whitespace (str.isspace) or non-whitespace characters (a
//      workaround in the Kimi code for tiktoken's recursion limits; it changes ids only for such
//      long runs, but it does change them, so it is reproduced);
//   2. in each piece, special tokens are cut out first (encode uses allowed_special="all"): every
//      one of the num_reserved_special_tokens + 2 = 258 ids after the ranks, named from
//      added_tokens_decoder or "<|reserved_token_{id}|>";
//   3. the text between them is split with the pattern (kKimiPatStr, run as its PCRE2
//      translation), and each match is encoded by TiktokenModel: whole when its bytes have a rank,
//      else by merging byte pairs by rank.
//
// tiktoken.model holds one "base64(token bytes) rank" line per token; the rank is the token id.
// It is validated before use: every error names the file, the line and the problem.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <functional>
#include <queue>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/input_limits.h"
#include "io/tokenizer_internal.h"

namespace moelora::io::tokenizer_detail {

namespace {

using nlohmann::json;

// tokenization_kimi.py: TikTokenTokenizer.num_reserved_special_tokens; the special ids are
// [num_base_tokens, num_base_tokens + kNumReservedSpecialTokens + 2).
constexpr int32_t kNumReservedSpecialTokens = 256;
constexpr int32_t kNumSpecialTokens = kNumReservedSpecialTokens + 2;
// TikTokenTokenizer.encode: TIKTOKEN_MAX_ENCODE_CHARS and MAX_NO_WHITESPACES_CHARS (characters).
constexpr size_t kMaxEncodeChars = 400'000;
constexpr size_t kMaxRunChars = 25'000;

std::string hex_byte(uint8_t byte) {
  char text[8];
  std::snprintf(text, sizeof(text), "0x%02X", static_cast<unsigned>(byte));
  return text;
}

// Standard base64 (RFC 4648 alphabet, '=' padding, length a multiple of 4), strict: nullopt on
// any other character, misplaced padding or non-zero padding bits.
std::optional<std::string> decode_base64(std::string_view text) {
  const auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (text.empty() || text.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    const int padding =
        last ? (text[i + 3] == '=') + (text[i + 2] == '=' && text[i + 3] == '=') : 0;
    uint32_t bits = 0;
    for (int k = 0; k < 4 - padding; ++k) {
      const int v = value(text[i + k]);
      if (v < 0) return std::nullopt;
      bits = (bits << 6) | static_cast<uint32_t>(v);
    }
    bits <<= 6 * padding;
    if (padding == 2 && (bits & 0xFFFF) != 0) return std::nullopt;
    if (padding == 1 && (bits & 0xFF) != 0) return std::nullopt;
    out.push_back(static_cast<char>(bits >> 16));
    if (padding < 2) out.push_back(static_cast<char>((bits >> 8) & 0xFF));
    if (padding < 1) out.push_back(static_cast<char>(bits & 0xFF));
  }
  return out;
}

struct RankFile {
  StringMap<int32_t> ranks;
  std::vector<std::string> tokens;  // indexed by rank
};

RankFile parse_rank_file(std::string_view text, const std::string& source) {
  RankFile file;
  std::vector<size_t> line_of_rank;  // indexed by rank, 0 = not seen
  size_t line_number = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;  // load_tiktoken_bpe skips empty lines
    const std::string where = source + ":" + std::to_string(line_number) + ": ";

    const size_t space = line.find(' ');
    MOELORA_CHECK(space != std::string_view::npos && space > 0 &&
                      line.find(' ', space + 1) == std::string_view::npos &&
                      space + 1 < line.size(),
                  ErrorCode::kInvalidFile, where,
                  "expected '<base64 token bytes> <rank>' (two fields separated by one space)");
    const std::string_view encoded = line.substr(0, space);
    const std::string_view rank_text = line.substr(space + 1);

    auto bytes = decode_base64(encoded);
    MOELORA_CHECK(bytes.has_value(), ErrorCode::kInvalidFile, where, "bad base64 '",
                  encoded.substr(0, 40),
                  "' (standard alphabet, '=' padding, length a multiple of 4)");
    MOELORA_CHECK(!bytes->empty(), ErrorCode::kInvalidFile, where, "empty token");

    int64_t rank = -1;
    const auto [rank_end, ec] =
        std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    MOELORA_CHECK(ec == std::errc() && rank_end == rank_text.data() + rank_text.size() &&
                      rank >= 0 && rank_text.front() != '-',
                  ErrorCode::kInvalidFile, where, "rank '", rank_text.substr(0, 40),
                  "' is not a non-negative integer");
    MOELORA_CHECK(rank < kMaxTokenId - kNumSpecialTokens, ErrorCode::kInvalidFile, where, "rank ",
                  rank, " is too large; ranks plus the ", kNumSpecialTokens,
                  " special tokens must stay below ", kMaxTokenId, " (io/input_limits.h)");

    if (static_cast<size_t>(rank) >= line_of_rank.size()) line_of_rank.resize(rank + 1, 0);
    MOELORA_CHECK(line_of_rank[rank] == 0, ErrorCode::kInvalidFile, where, "duplicate rank ", rank,
                  " (already given on line ", line_of_rank[rank], ")");
    line_of_rank[rank] = line_number;
    const auto [it, inserted] = file.ranks.emplace(std::move(*bytes), static_cast<int32_t>(rank));
    if (!inserted) {
      MOELORA_THROW(ErrorCode::kInvalidFile, where, "duplicate token '", encoded.substr(0, 40),
                    "': it already has rank ", it->second, " (line ", line_of_rank[it->second],
                    ")");
    }
  }
  MOELORA_CHECK(!file.ranks.empty(), ErrorCode::kInvalidFile, source, ": no tokens");
  // Ranks are ids and the special ids follow them, so they must be exactly 0..n-1.
  const size_t n = file.ranks.size();
  if (line_of_rank.size() > n) {
    size_t missing = 0;
    while (line_of_rank[missing] != 0) ++missing;
    const size_t largest = line_of_rank.size() - 1;
    MOELORA_THROW(ErrorCode::kInvalidFile, source, ":", line_of_rank[largest], ": rank ", largest,
                  " leaves a gap: the ", n, " tokens must have ranks 0..", n - 1, " (rank ",
                  missing, " is missing)");
  }
  file.tokens.resize(n);
  for (auto& [bytes, rank] : file.ranks) file.tokens[rank] = bytes;
  for (int b = 0; b < 256; ++b) {
    MOELORA_CHECK(file.ranks.count(std::string(1, static_cast<char>(b))) != 0,
                  ErrorCode::kInvalidFile, source, ": byte ", hex_byte(static_cast<uint8_t>(b)),
                  " has no rank of its own; tiktoken needs all 256 single bytes");
  }
  return file;
}

// added_tokens_decoder of tokenizer_config.json: {"<id>": {"content": ..., "special": ...}}.
std::map<int32_t, AddedToken> parse_added_tokens_decoder(std::string_view config_text,
                                                         const std::string& source,
                                                         int32_t first_id) {
  std::map<int32_t, AddedToken> out;
  if (config_text.empty()) return out;
  check_json_depth(config_text, source);
  json config;
  try {
    config = json::parse(config_text.begin(), config_text.end());
  } catch (const json::exception& e) {
    MOELORA_THROW(ErrorCode::kInvalidFile, source, ": not valid JSON: ", e.what());
  }
  MOELORA_CHECK(config.is_object(), ErrorCode::kInvalidFile, source,
                ": the top level must be an object");
  const auto decoder = config.find("added_tokens_decoder");
  if (decoder == config.end() || decoder->is_null()) return out;
  MOELORA_CHECK(decoder->is_object(), ErrorCode::kInvalidFile, source,
                ": field 'added_tokens_decoder' must be an object {id: token}");
  const int32_t end_id = first_id + kNumSpecialTokens;
  for (const auto& item : decoder->items()) {
    // Named, not structured bindings: clang 14 cannot capture those in the lambda below.
    const std::string& key = item.key();
    const json& entry = item.value();
    const std::string field = "added_tokens_decoder." + key;
    int64_t id = -1;
    const auto [key_end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    MOELORA_CHECK(
        ec == std::errc() && key_end == key.data() + key.size() && !key.empty() && key[0] != '-',
        ErrorCode::kInvalidFile, source, ": key '", key,
        "' of 'added_tokens_decoder' is not a token id");
    // Only these ids are tiktoken special tokens (TikTokenTokenizer.__init__); any other id would
    // be an added token that the Kimi encoder never produces.
    MOELORA_CHECK(id >= first_id && id < end_id, ErrorCode::kInvalidFile, source, ": field '",
                  field, "': id ", id, " is outside the special-token ids [", first_id, ", ",
                  end_id, ") that follow the ", first_id, " ranks of tiktoken.model");
    MOELORA_CHECK(entry.is_object(), ErrorCode::kInvalidFile, source, ": field '", field,
                  "' must be an object");
    const auto content = entry.find("content");
    MOELORA_CHECK(content != entry.end() && content->is_string(), ErrorCode::kInvalidFile, source,
                  ": field '", field, ".content' must be a string");
    AddedToken token;
    token.id = static_cast<int32_t>(id);
    token.content = content->get<std::string>();
    MOELORA_CHECK(!token.content.empty(), ErrorCode::kInvalidFile, source, ": field '", field,
                  ".content' is empty");
    const auto flag = [&](const char* name, bool fallback) {
      const auto it = entry.find(name);
      if (it == entry.end() || it->is_null()) return fallback;
      MOELORA_CHECK(it->is_boolean(), ErrorCode::kInvalidFile, source, ": field '", field, ".",
                    name, "' must be true or false");
      return it->get<bool>();
    };
    // Kept for added_tokens(); tiktoken matches special tokens exactly and ignores the flags.
    token.special = flag("special", false);
    token.single_word = flag("single_word", false);
    token.lstrip = flag("lstrip", false);
    token.rstrip = flag("rstrip", false);
    token.normalized = flag("normalized", false);
    out.emplace(token.id, std::move(token));
  }
  return out;
}

// Calls on_piece for each piece of TikTokenTokenizer.encode's cutting (step 1 of the file
// comment). `text` is valid UTF-8; lengths are counted in code points, as Python does.
void for_each_encode_piece(std::string_view text,
                           const std::function<void(std::string_view)>& on_piece) {
  size_t chunk_start = 0;
  while (true) {
    // One chunk: at most kMaxEncodeChars code points.
    size_t chunk_end = chunk_start;
    for (size_t count = 0; chunk_end < text.size() && count < kMaxEncodeChars; ++count) {
      next_code_point(text, chunk_end);
    }
    const std::string_view chunk = text.substr(chunk_start, chunk_end - chunk_start);
    // _split_whitespaces_or_nonwhitespaces: a run longer than kMaxRunChars is cut.
    size_t slice_start = 0;
    size_t run_length = 0;
    bool run_is_space = false;
    if (!chunk.empty()) {
      size_t first = 0;
      run_is_space = is_python_space(next_code_point(chunk, first));
    }
    for (size_t pos = 0; pos < chunk.size();) {
      const size_t here = pos;
      const bool is_space = is_python_space(next_code_point(chunk, pos));
      if (is_space != run_is_space) {
        run_length = 1;
        run_is_space = is_space;
      } else if (++run_length > kMaxRunChars) {
        on_piece(chunk.substr(slice_start, here - slice_start));
        slice_start = here;
        run_length = 1;
      }
    }
    on_piece(chunk.substr(slice_start));
    chunk_start = chunk_end;
    if (chunk_start >= text.size()) break;
  }
}

}  // namespace

bool is_python_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::string kimi_pcre2_pattern() {
  const std::string upper(kKimiUpperNoHan), lower(kKimiLowerNoHan), han(kKimiHan);
  const std::string contraction = "(?i:'s|'t|'re|'ve|'m|'ll|'d)?";
  // The alternatives of kKimiPatStr, in order.
  return han + "+" +                                                            //
         "|[^\\r\\n\\p{L}\\p{N}]?" + upper + "*" + lower + "+" + contraction +  //
         "|[^\\r\\n\\p{L}\\p{N}]?" + upper + "+" + lower + "*" + contraction +  //
         "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
}

// ---- TiktokenModel ----

TiktokenModel::TiktokenModel(StringMap<int32_t> ranks) : ranks_(std::move(ranks)) {
  for (int b = 0; b < 256; ++b) {
    const char byte = static_cast<char>(b);
    const auto it = ranks_.find(std::string_view(&byte, 1));
    MOELORA_CHECK(it != ranks_.end(), ErrorCode::kInternal, "tiktoken ranks lack byte ", b);
    byte_ranks_[b] = it->second;
  }
}

std::optional<int32_t> TiktokenModel::rank(std::string_view bytes) const {
  const auto it = ranks_.find(bytes);
  return it == ranks_.end() ? std::nullopt : std::optional<int32_t>(it->second);
}

void TiktokenModel::tokenize(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  // tiktoken's CoreBPE::encode looks the whole piece up before merging.
  if (const auto it = ranks_.find(piece); it != ranks_.end()) {
    out.push_back(it->second);
    return;
  }
  const bool cacheable = piece.size() <= WordCache::kMaxWordBytes;
  if (cacheable && cache_->get(piece, out)) return;
  const size_t first = out.size();
  merge(piece, out);
  if (cacheable) cache_->put(piece, std::span<const int32_t>(out).subspan(first));
}

// tiktoken's _byte_pair_merge picks, again and again, the leftmost adjacent pair of parts whose
// concatenated bytes have the lowest rank. The same order with a min-heap of candidate pairs:
// parts are byte ranges in a linked list (a part is named by its first byte), and a candidate is
// stale when the range it covered is no longer exactly two live parts.
void TiktokenModel::merge(std::string_view piece, std::vector<int32_t>& out) const {
  const int32_t n = static_cast<int32_t>(piece.size());
  std::vector<int32_t> next(n), prev(n);
  std::vector<uint8_t> alive(n, 1);
  for (int32_t i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  const auto part_end = [&](int32_t part) { return next[part] < 0 ? n : next[part]; };

  struct Candidate {
    int32_t rank, begin, end;  // the pair covers piece[begin, end)
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : begin > o.begin;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  const auto push_pair = [&](int32_t left) {
    if (left < 0 || next[left] < 0) return;
    const int32_t end = part_end(next[left]);
    if (const auto it = ranks_.find(piece.substr(left, end - left)); it != ranks_.end()) {
      heap.push({it->second, left, end});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);

  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    const int32_t left = top.begin;
    if (!alive[left] || next[left] < 0 || part_end(next[left]) != top.end) continue;
    const int32_t right = next[left];
    alive[right] = 0;
    next[left] = next[right];
    if (next[left] >= 0) prev[next[left]] = left;
    push_pair(prev[left]);
    push_pair(left);
  }

  for (int32_t part = 0; part >= 0; part = next[part]) {
    const int32_t end = part_end(part);
    out.push_back(end - part == 1 ? byte_ranks_[static_cast<uint8_t>(piece[part])]
                                  : ranks_.find(piece.substr(part, end - part))->second);
  }
}

// ---- loading and encoding ----

std::shared_ptr<Tokenizer::Impl> build_tiktoken_impl(std::string_view model_text,
                                                     const std::string& model_source,
                                                     std::string_view config_text,
                                                     const std::string& config_source) {
  auto impl = std::make_shared<Tokenizer::Impl>();
  impl->source = model_source;
  RankFile file = parse_rank_file(model_text, model_source);
  const int32_t base = static_cast<int32_t>(file.tokens.size());
  std::map<int32_t, AddedToken> named =
      parse_added_tokens_decoder(config_text, config_source, base);

  // TikTokenTokenizer.__init__: every special id gets a name, a content given twice is an error
  // (Python would silently drop the first id from the encoder).
  const int64_t size = int64_t{base} + kNumSpecialTokens;
  impl->id_to_token.resize(size);
  impl->decoded_bytes.resize(size);
  impl->id_flags.assign(size, Tokenizer::Impl::kHasToken);
  for (int32_t rank = 0; rank < base; ++rank) {
    impl->id_to_token[rank] = byte_level_encode(file.tokens[rank]);
    impl->decoded_bytes[rank] = std::move(file.tokens[rank]);
  }
  for (int32_t id = base; id < size; ++id) {
    AddedToken token;
    if (const auto it = named.find(id); it != named.end()) {
      token = it->second;
    } else {
      token.id = id;
      token.content = "<|reserved_token_" + std::to_string(id) + "|>";
    }
    const auto [previous, inserted] = impl->added_by_content.emplace(token.content, id);
    MOELORA_CHECK(inserted, ErrorCode::kInvalidFile, config_source, ": special tokens ",
                  previous->second, " and ", id, " have the same content '", token.content, "'");
    impl->raw_added.add(token.content, static_cast<int32_t>(impl->added_tokens.size()));
    if (token.special) impl->id_flags[id] |= Tokenizer::Impl::kSpecial;
    impl->id_to_token[id] = token.content;
    impl->decoded_bytes[id] = token.content;
    impl->added_tokens.push_back(std::move(token));
  }
  // decode() joins tokens without separators, as for a ByteLevel decoder.
  impl->byte_level_decoder = true;
  impl->tiktoken_regex =
      std::make_shared<Regex>(kimi_pcre2_pattern(), false, model_source + " (Kimi pattern)");
  impl->tiktoken = std::make_shared<TiktokenModel>(std::move(file.ranks));
  return impl;
}

void encode_tiktoken(const Tokenizer::Impl& impl, std::string_view text,
                     std::vector<int32_t>& out) {
  std::vector<std::pair<size_t, size_t>> matches;
  const auto encode_ordinary = [&](std::string_view part) {
    if (part.empty()) return;
    matches.clear();
    impl.tiktoken_regex->find_all(part, matches);
    for (const auto& [begin, end] : matches)
      impl.tiktoken->tokenize(part.substr(begin, end - begin), out);
  };
  for_each_encode_piece(text, [&](std::string_view piece) {
    // CoreBPE::encode: the leftmost special token, the text before it as ordinary text. The
    // special tokens of a Kimi vocabulary are prefix-free, so leftmost-longest (TokenMatcher) and
    // tiktoken's leftmost-first alternation agree.
    size_t start = 0, begin = 0, end = 0;
    int32_t index = 0;
    while (impl.raw_added.find(piece, start, begin, end, index)) {
      encode_ordinary(piece.substr(start, begin - start));
      out.push_back(impl.added_tokens[index].id);
      start = end;
    }
    encode_ordinary(piece.substr(start));
  });
}

}  // namespace moelora::io::tokenizer_detail
