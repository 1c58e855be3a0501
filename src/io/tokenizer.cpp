// Tokenizer: loading tokenizer.json / tokenizer_config.json into Tokenizer::Impl, and the
// encode/decode pipelines described in tokenizer.h (the tiktoken backend is in
// tokenizer_tiktoken.cpp). The order of the steps and the treatment of
// edge cases (empty pieces, whitespace swallowed by lstrip/rstrip, unknown ids) follow the
// `tokenizers` library, whose ids are the ground truth for every model we serve.
#include "io/tokenizer.h"
#include "io/input_limits.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/tokenizer_internal.h"

namespace moelora::io {

using nlohmann::json;
using tokenizer_detail::NormalForm;
using tokenizer_detail::PreTokenizerStep;
using tokenizer_detail::SplitBehavior;

using tokenizer_detail::apply_config;
using tokenizer_detail::build_impl;
using tokenizer_detail::read_file;

std::optional<int32_t> Tokenizer::Impl::find_token(std::string_view token) const {
  if (const auto it = added_by_content.find(token); it != added_by_content.end()) return it->second;
  if (tiktoken) {
    // tiktoken vocabularies are raw bytes; their vocabulary form is the byte-level alphabet.
    const auto bytes = byte_level_decode(token);
    return bytes ? tiktoken->rank(*bytes) : std::nullopt;
  }
  if (const auto it = model.vocab().find(token); it != model.vocab().end()) return it->second;
  return std::nullopt;
}

namespace {

// ---- encode helpers ----

struct Segment {
  size_t begin, end;
  bool is_match;
};

// Splits [0, n) at the regex matches and applies a `tokenizers` SplitDelimiterBehavior.
void split_by_behavior(size_t n, const std::vector<std::pair<size_t, size_t>>& matches,
                       SplitBehavior behavior, bool invert, std::vector<Segment>& out) {
  std::vector<Segment> segments;
  segments.reserve(matches.size() * 2 + 1);
  size_t previous = 0;
  for (const auto& [begin, end] : matches) {
    if (previous != begin) segments.push_back({previous, begin, invert});
    segments.push_back({begin, end, !invert});
    previous = end;
  }
  if (previous != n) segments.push_back({previous, n, invert});

  out.clear();
  switch (behavior) {
    case SplitBehavior::kIsolated: out = std::move(segments); break;
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments) {
        if (!s.is_match) out.push_back(s);
      }
      break;
    case SplitBehavior::kMergedWithPrevious: {
      // A match joins the piece before it, unless that piece is itself a match.
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match && !previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back({s.begin, s.end, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      // Mirror image: a match joins the piece after it, unless that piece is itself a match.
      bool previous_match = false;
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->is_match && !previous_match && !out.empty()) {
          out.back().begin = it->begin;
        } else {
          out.push_back({it->begin, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      // Runs of consecutive matches (or of non-matches) become one piece.
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match == previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back({s.begin, s.end, false});
        }
        previous_match = s.is_match;
      }
      break;
    }
  }
}

size_t leading_white_space(std::string_view text, size_t pos) {
  size_t end = pos;
  while (end < text.size()) {
    size_t next = end;
    if (!tokenizer_detail::is_white_space(tokenizer_detail::next_code_point(text, next))) break;
    end = next;
  }
  return end - pos;
}

// Start of the run of white space that ends at `end`.
size_t white_space_run_start(std::string_view text, size_t end) {
  size_t start = end;
  while (start > 0) {
    size_t begin = 0;
    if (!tokenizer_detail::is_white_space(
            tokenizer_detail::previous_code_point(text, start, begin)))
      break;
    start = begin;
  }
  return start;
}

}  // namespace

// ---- TokenMatcher ----

namespace tokenizer_detail {

int32_t TokenMatcher::child(int32_t node, uint8_t byte) const {
  const auto& children = nodes_[node].children;
  const auto it =
      std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1}));
  return it != children.end() && it->first == byte ? it->second : -1;
}

void TokenMatcher::add(std::string_view pattern, int32_t value) {
  if (pattern.empty()) return;
  first_byte_[static_cast<uint8_t>(pattern[0])] = true;
  int32_t node = 0;
  for (char c : pattern) {
    const uint8_t byte = static_cast<uint8_t>(c);
    int32_t next = child(node, byte);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
      auto& children = nodes_[node].children;
      children.insert(
          std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1})),
          {byte, next});
    }
    node = next;
  }
  // The first pattern with a given content wins, like the first pattern of an Aho-Corasick set.
  if (nodes_[node].value < 0) nodes_[node].value = value;
}

bool TokenMatcher::find(std::string_view text, size_t from, size_t& match_begin, size_t& match_end,
                        int32_t& value) const {
  for (size_t start = from; start < text.size(); ++start) {
    if (!first_byte_[static_cast<uint8_t>(text[start])]) continue;
    int32_t node = 0;
    int32_t best = -1;
    size_t best_end = 0;
    for (size_t pos = start; pos < text.size(); ++pos) {
      node = child(node, static_cast<uint8_t>(text[pos]));
      if (node < 0) break;
      if (nodes_[node].value >= 0) {
        best = nodes_[node].value;
        best_end = pos + 1;
      }
    }
    if (best >= 0) {
      match_begin = start;
      match_end = best_end;
      value = best;
      return true;
    }
  }
  return false;
}

}  // namespace tokenizer_detail

// ---- encode ----

namespace {

class Encoder {
 public:
  Encoder(const Tokenizer::Impl& impl, std::vector<int32_t>& out) : impl_(impl), out_(out) {}

  // Step 2 of tokenizer.h: added tokens on the raw text, then normalization of the rest.
  void encode(std::string_view text) {
    split_added(text, impl_.raw_added, [this](std::string_view piece) {
      std::string normalized(piece);
      for (NormalForm form : impl_.normalizers)
        normalized = tokenizer_detail::normalize(normalized, form);
      split_added(normalized, impl_.normalized_added,
                  [this](std::string_view p) { pre_tokenize(p, 0); });
    });
  }

 private:
  // Emits the added tokens found in `sentence` and hands the text between them to `on_text`,
  // mirroring AddedVocabulary::find_matches of `tokenizers`.
  template <typename OnText>
  void split_added(std::string_view sentence, const tokenizer_detail::TokenMatcher& matcher,
                   OnText&& on_text) {
    if (matcher.empty()) {
      if (!sentence.empty()) on_text(sentence);
      return;
    }
    size_t start_offset = 0;  // end of the last emitted token
    size_t search_from = 0;   // matches never overlap
    size_t begin = 0, end = 0;
    int32_t index = 0;
    while (matcher.find(sentence, search_from, begin, end, index)) {
      search_from = end;
      const AddedToken& token = impl_.added_tokens[index];
      if (token.single_word) {
        size_t unused = 0;
        const bool word_before =
            begin > 0 && tokenizer_detail::is_word_char(
                             tokenizer_detail::previous_code_point(sentence, begin, unused));
        size_t next = end;
        const bool word_after =
            end < sentence.size() &&
            tokenizer_detail::is_word_char(tokenizer_detail::next_code_point(sentence, next));
        if (word_before || word_after) continue;
      }
      // Whitespace already swallowed by the previous token's rstrip stays with it.
      if (token.lstrip) begin = std::max(white_space_run_start(sentence, begin), start_offset);
      if (token.rstrip) end += leading_white_space(sentence, end);
      if (start_offset < begin) on_text(sentence.substr(start_offset, begin - start_offset));
      out_.push_back(token.id);
      start_offset = end;
    }
    if (start_offset < sentence.size()) on_text(sentence.substr(start_offset));
  }

  // Runs pre-tokenizer step `step` and the following ones on `piece`, then the model. Pieces are
  // handled depth-first, which keeps them in text order.
  void pre_tokenize(std::string_view piece, size_t step) {
    if (piece.empty()) return;  // `tokenizers` drops empty splits
    if (impl_.byte_level && impl_.byte_level_prefix_space && step == impl_.byte_level_step &&
        piece.front() != ' ') {
      // Where ByteLevel starts, add_prefix_space gives every piece that lacks one a leading space.
      const std::string prefixed = " " + std::string(piece);
      run_step(prefixed, step);
    } else {
      run_step(piece, step);
    }
  }

  void run_step(std::string_view piece, size_t step) {
    if (step == impl_.pre_tokenizers.size()) {
      impl_.model.tokenize(piece, out_);
      return;
    }
    const PreTokenizerStep& s = impl_.pre_tokenizers[step];
    std::vector<std::pair<size_t, size_t>> matches;
    s.regex->find_all(piece, matches);
    std::vector<Segment> segments;
    split_by_behavior(piece.size(), matches, s.behavior, s.invert, segments);
    for (const Segment& segment : segments) {
      pre_tokenize(piece.substr(segment.begin, segment.end - segment.begin), step + 1);
    }
  }

  const Tokenizer::Impl& impl_;
  std::vector<int32_t>& out_;
};

}  // namespace

// ---- Tokenizer ----

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::filesystem::path& dir_or_file) {
  std::error_code ec;
  if (std::filesystem::is_directory(dir_or_file, ec)) {
    const auto file = dir_or_file / "tokenizer.json";
    const auto tiktoken_file = dir_or_file / "tiktoken.model";
    const auto config = dir_or_file / "tokenizer_config.json";
    const bool has_config = std::filesystem::is_regular_file(config, ec);
    const std::string config_text = has_config ? read_file(config) : std::string();
    std::shared_ptr<Impl> impl;
    if (std::filesystem::is_regular_file(file, ec)) {
      impl = build_impl(read_file(file, kMaxTokenizerFileBytes), file.string());
    } else if (std::filesystem::is_regular_file(tiktoken_file, ec)) {
      // Kimi-K2 ships a tiktoken vocabulary instead (FORMATS.md §5.4); its special tokens are in
      // the config's added_tokens_decoder.
      impl = tokenizer_detail::build_tiktoken_impl(read_file(tiktoken_file, kMaxTokenizerFileBytes),
                                                   tiktoken_file.string(), config_text,
                                                   config.string());
    } else {
      MOELORA_THROW(ErrorCode::kNotFound, "no tokenizer.json or tiktoken.model in '",
                    dir_or_file.string(), "'");
    }
    if (has_config) apply_config(*impl, config_text, config.string());
    // transformers 5 writes the template beside the config; it takes precedence (FORMATS §5.3).
    const auto jinja = dir_or_file / "chat_template.jinja";
    if (std::filesystem::is_regular_file(jinja, ec)) impl->chat_template = read_file(jinja);
    const auto extra = dir_or_file / "additional_chat_templates";
    if (std::filesystem::is_directory(extra, ec)) {
      for (const auto& entry : std::filesystem::directory_iterator(extra)) {
        if (entry.is_regular_file() && entry.path().extension() == ".jinja") {
          impl->named_chat_templates[entry.path().stem().string()] = read_file(entry.path());
        }
      }
    }
    return Tokenizer(std::move(impl));
  }
  MOELORA_CHECK(std::filesystem::is_regular_file(dir_or_file, ec), ErrorCode::kNotFound,
                "tokenizer '", dir_or_file.string(), "' does not exist");
  if (dir_or_file.filename() == "tiktoken.model") {
    return Tokenizer(tokenizer_detail::build_tiktoken_impl(
        read_file(dir_or_file, kMaxTokenizerFileBytes), dir_or_file.string(), {}, {}));
  }
  return Tokenizer(
      build_impl(read_file(dir_or_file, kMaxTokenizerFileBytes), dir_or_file.string()));
}

Tokenizer Tokenizer::from_tiktoken(std::string_view tiktoken_model, std::string_view config_json,
                                   const std::string& source) {
  const std::string config_source = source + " (tokenizer_config.json)";
  auto impl =
      tokenizer_detail::build_tiktoken_impl(tiktoken_model, source, config_json, config_source);
  if (!config_json.empty()) apply_config(*impl, config_json, config_source);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& source) {
  auto impl = build_impl(tokenizer_json, source);
  if (!config_json.empty()) apply_config(*impl, config_json, source + " (tokenizer_config.json)");
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (const auto bad = find_invalid_utf8(text)) {
    char byte[8];
    std::snprintf(byte, sizeof(byte), "0x%02X",
                  static_cast<unsigned>(static_cast<uint8_t>(text[*bad])));
    MOELORA_THROW(ErrorCode::kInvalidArgument,
                  "tokenizer encode: the text is not valid UTF-8 at byte offset ", *bad, " (byte ",
                  byte, ")");
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (add_special_tokens) ids = impl_->special_prefix;
  if (impl_->tiktoken) {
    tokenizer_detail::encode_tiktoken(*impl_, text, ids);
  } else {
    Encoder(*impl_, ids).encode(text);
  }
  if (add_special_tokens)
    ids.insert(ids.end(), impl_->special_suffix.begin(), impl_->special_suffix.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string text;
  bool first = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(impl_->id_flags.size())) continue;
    const uint8_t flags = impl_->id_flags[id];
    if (!(flags & Impl::kHasToken)) continue;
    if (skip_special_tokens && (flags & Impl::kSpecial)) continue;
    // Without a decoder `tokenizers` joins the tokens with spaces.
    if (!impl_->byte_level_decoder && !first) text.push_back(' ');
    text += impl_->decoded_bytes[id];
    first = false;
  }
  return text;
}

std::string Tokenizer::decode_token(int32_t id, bool skip_special_tokens) const {
  return decode(std::span<const int32_t>(&id, 1), skip_special_tokens);
}

int64_t Tokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->id_to_token.size());
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->find_token(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  MOELORA_CHECK(id >= 0 && id < vocab_size() && (impl_->id_flags[id] & Impl::kHasToken),
                ErrorCode::kOutOfRange, "token id ", id, " has no token in ", impl_->source,
                " (vocabulary size ", vocab_size(), ")");
  return impl_->id_to_token[id];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && (impl_->id_flags[id] & Impl::kSpecial);
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return impl_->added_tokens;
}
std::optional<int32_t> Tokenizer::eos_token_id() const {
  return impl_->eos_id;
}
std::optional<int32_t> Tokenizer::bos_token_id() const {
  return impl_->bos_id;
}
std::optional<int32_t> Tokenizer::pad_token_id() const {
  return impl_->pad_id;
}
std::optional<int32_t> Tokenizer::unk_token_id() const {
  return impl_->unk_id;
}
std::optional<std::string> Tokenizer::eos_token() const {
  return impl_->eos_token;
}
std::optional<std::string> Tokenizer::bos_token() const {
  return impl_->bos_token;
}
std::optional<std::string> Tokenizer::pad_token() const {
  return impl_->pad_token;
}
const std::optional<std::string>& Tokenizer::chat_template() const {
  return impl_->chat_template;
}
const std::map<std::string, std::string>& Tokenizer::named_chat_templates() const {
  return impl_->named_chat_templates;
}
const std::string& Tokenizer::source() const {
  return impl_->source;
}

}  // namespace moelora::io
