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
using tokenizer_detail::Regex;
using tokenizer_detail::SplitBehavior;

namespace {

// The pre-tokenization regex of GPT-2 that ByteLevel applies when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// tokenizer.json may be large (kMaxTokenizerFileBytes); its config and templates are small files.
std::string read_file(const std::filesystem::path& path, uint64_t max_bytes = kMaxJsonFileBytes) {
  std::error_code ec;
  MOELORA_CHECK(std::filesystem::exists(path, ec), ErrorCode::kNotFound, "cannot open '",
                path.string(), "'");
  return read_limited_text(path, max_bytes, "the file");
}

json parse_json(std::string_view text, const std::string& source) {
  check_json_depth(text, source);
  // Every JSON exception, not only parse_error: a number too large for a double is out_of_range
  // (406) and would otherwise escape as a crash (found by fuzz/fuzz_tokenizer's family).
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    MOELORA_THROW(ErrorCode::kInvalidFile, source, ": not valid JSON: ", e.what());
  }
}

// Short quoted rendering of a JSON value for messages.
std::string show(const json& value) {
  std::string text = value.is_string() ? value.get<std::string>() : value.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return "'" + text + "'";
}

// Typed access to JSON fields with messages naming the source file and the field path.
class Fields {
 public:
  Fields(const json& object, std::string path, const std::string& source)
      : object_(object), path_(std::move(path)), source_(source) {
    MOELORA_CHECK(object.is_object(), ErrorCode::kInvalidFile, source_, ": field '", path_,
                  "' must be an object, got ", show(object));
  }
  std::string path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const json* find(const std::string& key) const {
    const auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }
  const json& require(const std::string& key) const {
    const json* value = find(key);
    MOELORA_CHECK(value != nullptr, ErrorCode::kInvalidFile, source_, ": missing field '",
                  path(key), "'");
    return *value;
  }
  std::string string(const std::string& key) const {
    const json& value = require(key);
    MOELORA_CHECK(value.is_string(), ErrorCode::kInvalidFile, source_, ": field '", path(key),
                  "' must be a string, got ", show(value));
    return value.get<std::string>();
  }
  // A string or null/absent (returned as nullopt).
  std::optional<std::string> optional_string(const std::string& key) const {
    const json* value = find(key);
    if (value == nullptr || value->is_null()) return std::nullopt;
    MOELORA_CHECK(value->is_string(), ErrorCode::kInvalidFile, source_, ": field '", path(key),
                  "' must be a string or null, got ", show(*value));
    return value->get<std::string>();
  }
  bool boolean(const std::string& key, bool fallback) const {
    const json* value = find(key);
    if (value == nullptr || value->is_null()) return fallback;
    MOELORA_CHECK(value->is_boolean(), ErrorCode::kInvalidFile, source_, ": field '", path(key),
                  "' must be true or false, got ", show(*value));
    return value->get<bool>();
  }
  int32_t id(const std::string& key) const { return to_id(require(key), path(key), source_); }
  const json& array(const std::string& key) const {
    const json& value = require(key);
    MOELORA_CHECK(value.is_array(), ErrorCode::kInvalidFile, source_, ": field '", path(key),
                  "' must be a list, got ", show(value));
    return value;
  }
  // The "type" tag of a component (normalizer, pre-tokenizer, ...).
  std::string type() const { return string("type"); }
  const std::string& source() const { return source_; }

  static int32_t to_id(const json& value, const std::string& path, const std::string& source) {
    MOELORA_CHECK(value.is_number_integer(), ErrorCode::kInvalidFile, source, ": field '", path,
                  "' must be an integer token id, got ", show(value));
    // Tables are indexed by id, so an id bounds what the tokenizer allocates: ids past
    // kMaxTokenId (io/input_limits.h) are refused (a lying file once asked for 64 GB).
    const int64_t id = value.get<int64_t>();
    MOELORA_CHECK(id >= 0 && id < kMaxTokenId, ErrorCode::kInvalidFile, source, ": field '", path,
                  "' holds token id ", id, ", outside the [0, ", kMaxTokenId,
                  ") accepted (io/input_limits.h)");
    return static_cast<int32_t>(id);
  }

 private:
  const json& object_;
  std::string path_;
  const std::string& source_;
};

[[noreturn]] void unsupported(const std::string& source, const std::string& field,
                              const std::string& value, const char* supported) {
  MOELORA_THROW(ErrorCode::kUnsupported, source, ": field '", field, "' is '", value,
                "', which this tokenizer does not support; supported: ", supported);
}

// ---- normalizer ----

void parse_normalizer(const json& node, const std::string& path, const std::string& source,
                      std::vector<NormalForm>& out) {
  if (node.is_null()) return;
  const Fields fields(node, path, source);
  const std::string type = fields.type();
  if (type == "NFC") {
    out.push_back(NormalForm::kNfc);
  } else if (type == "NFD") {
    out.push_back(NormalForm::kNfd);
  } else if (type == "NFKC") {
    out.push_back(NormalForm::kNfkc);
  } else if (type == "NFKD") {
    out.push_back(NormalForm::kNfkd);
  } else if (type == "Sequence") {
    const json& list = fields.array("normalizers");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_normalizer(list[i], fields.path("normalizers") + "[" + std::to_string(i) + "]", source,
                       out);
    }
  } else {
    unsupported(source, fields.path("type"), type, "NFC, NFD, NFKC, NFKD, Sequence, null");
  }
}

// ---- pre-tokenizer ----

SplitBehavior parse_behavior(const std::string& value, const std::string& field,
                             const std::string& source) {
  if (value == "Isolated") return SplitBehavior::kIsolated;
  if (value == "Removed") return SplitBehavior::kRemoved;
  if (value == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (value == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (value == "Contiguous") return SplitBehavior::kContiguous;
  unsupported(source, field, value,
              "Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous");
}

void parse_pre_tokenizer(const json& node, const std::string& path, const std::string& source,
                         Tokenizer::Impl& impl) {
  if (node.is_null()) return;
  const Fields fields(node, path, source);
  const std::string type = fields.type();
  // ByteLevel rewrites the text into its byte alphabet; a split after it would see that alphabet
  // instead of the text, which no supported family does.
  MOELORA_CHECK(!impl.byte_level || type == "Sequence", ErrorCode::kUnsupported, source,
                ": pre-tokenizer '", path, "' (", type,
                ") follows a ByteLevel pre-tokenizer; ByteLevel must come last");
  if (type == "Sequence") {
    const json& list = fields.array("pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_pre_tokenizer(list[i], fields.path("pretokenizers") + "[" + std::to_string(i) + "]",
                          source, impl);
    }
  } else if (type == "Split") {
    const Fields pattern(fields.require("pattern"), fields.path("pattern"), source);
    PreTokenizerStep step;
    if (pattern.find("Regex")) {
      step.regex = std::make_shared<Regex>(pattern.string("Regex"), false,
                                           source + " " + pattern.path("Regex"));
    } else if (pattern.find("String")) {
      step.regex = std::make_shared<Regex>(pattern.string("String"), true,
                                           source + " " + pattern.path("String"));
    } else {
      MOELORA_THROW(ErrorCode::kInvalidFile, source, ": field '", fields.path("pattern"),
                    "' must hold \"Regex\" or \"String\", got ", show(fields.require("pattern")));
    }
    step.behavior = parse_behavior(fields.string("behavior"), fields.path("behavior"), source);
    step.invert = fields.boolean("invert", false);
    impl.pre_tokenizers.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    impl.byte_level = true;
    impl.byte_level_step = impl.pre_tokenizers.size();
    // Defaults of `tokenizers` ByteLevel::default().
    impl.byte_level_prefix_space = fields.boolean("add_prefix_space", true);
    if (fields.boolean("use_regex", true)) {
      PreTokenizerStep step;
      step.regex = std::make_shared<Regex>(kGpt2Pattern, false, source + " ByteLevel regex");
      impl.pre_tokenizers.push_back(std::move(step));
    }
  } else {
    unsupported(source, fields.path("type"), type, "Split, ByteLevel, Sequence, null");
  }
}

// ---- post-processor: the ids added around the sequence with add_special_tokens ----

void parse_post_processor(const json& node, const std::string& path, const std::string& source,
                          Tokenizer::Impl& impl) {
  if (node.is_null()) return;
  const Fields fields(node, path, source);
  const std::string type = fields.type();
  std::vector<int32_t> prefix, suffix;
  if (type == "ByteLevel") {
    return;  // only trims offsets
  } else if (type == "Sequence") {
    const json& list = fields.array("processors");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_post_processor(list[i], fields.path("processors") + "[" + std::to_string(i) + "]",
                           source, impl);
    }
    return;
  } else if (type == "TemplateProcessing") {
    const json& single = fields.array("single");
    const Fields specials(fields.require("special_tokens"), fields.path("special_tokens"), source);
    bool seen_sequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string piece_path = fields.path("single") + "[" + std::to_string(i) + "]";
      const Fields piece(single[i], piece_path, source);
      if (piece.find("Sequence")) {
        const Fields sequence(piece.require("Sequence"), piece.path("Sequence"), source);
        const std::string id = sequence.string("id");
        MOELORA_CHECK(id == "A" && !seen_sequence, ErrorCode::kUnsupported, source, ": field '",
                      sequence.path("id"), "' is '", id,
                      "'; a single-sequence template must hold sequence 'A' exactly once");
        seen_sequence = true;
      } else if (piece.find("SpecialToken")) {
        const Fields special(piece.require("SpecialToken"), piece.path("SpecialToken"), source);
        const std::string name = special.string("id");
        MOELORA_CHECK(specials.find(name) != nullptr, ErrorCode::kInvalidFile, source, ": field '",
                      special.path("id"), "' names special token '", name, "', which is not in '",
                      fields.path("special_tokens"), "'");
        const Fields entry(specials.require(name), specials.path(name), source);
        const json& ids = entry.array("ids");
        for (size_t k = 0; k < ids.size(); ++k) {
          (seen_sequence ? suffix : prefix)
              .push_back(
                  Fields::to_id(ids[k], entry.path("ids") + "[" + std::to_string(k) + "]", source));
        }
      } else {
        MOELORA_THROW(ErrorCode::kInvalidFile, source, ": field '", piece_path,
                      "' must hold \"Sequence\" or \"SpecialToken\", got ", show(single[i]));
      }
    }
    MOELORA_CHECK(seen_sequence, ErrorCode::kInvalidFile, source, ": field '",
                  fields.path("single"), "' has no {\"Sequence\": {\"id\": \"A\"}} entry");
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const json& pair = fields.require(key);
      MOELORA_CHECK(pair.is_array() && pair.size() == 2, ErrorCode::kInvalidFile, source,
                    ": field '", fields.path(key), "' must be [token, id], got ", show(pair));
      const int32_t id = Fields::to_id(pair[1], fields.path(key) + "[1]", source);
      (std::string(key) == "cls" ? prefix : suffix).push_back(id);
    }
  } else {
    unsupported(source, fields.path("type"), type,
                "ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing, Sequence, null");
  }
  // Processors of a Sequence apply one after the other: later ones wrap the earlier result.
  impl.special_prefix.insert(impl.special_prefix.begin(), prefix.begin(), prefix.end());
  impl.special_suffix.insert(impl.special_suffix.end(), suffix.begin(), suffix.end());
}

// ---- model ----

std::vector<std::pair<std::string, std::string>> parse_merges(const json& list,
                                                              const std::string& path,
                                                              const std::string& source) {
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const json& merge = list[i];
    if (merge.is_string()) {  // legacy "left right"
      const std::string& text = merge.get_ref<const std::string&>();
      const size_t space = text.find(' ');
      MOELORA_CHECK(space != std::string::npos && text.find(' ', space + 1) == std::string::npos,
                    ErrorCode::kInvalidFile, source, ": ", path, "[", i, "] is ", show(merge),
                    "; a merge string must be two tokens separated by one space");
      merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      MOELORA_THROW(ErrorCode::kInvalidFile, source, ": ", path, "[", i, "] is ", show(merge),
                    "; expected [\"left\", \"right\"] or \"left right\"");
    }
  }
  return merges;
}

void parse_model(const json& node, const std::string& source, Tokenizer::Impl& impl) {
  const Fields model(node, "model", source);
  // Old files omit the tag; the merges list identifies BPE.
  const std::string type = model.find("type") ? model.type() : "BPE";
  if (type != "BPE") unsupported(source, "model.type", type, "BPE");

  if (const json* dropout = model.find("dropout"); dropout && !dropout->is_null()) {
    MOELORA_CHECK(dropout->is_number(), ErrorCode::kInvalidFile, source,
                  ": field 'model.dropout' must be a number or null, got ", show(*dropout));
    if (dropout->get<double>() != 0.0)
      unsupported(source, "model.dropout", dropout->dump(), "null (no dropout)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto value = model.optional_string(key);
    if (value && !value->empty()) unsupported(source, model.path(key), *value, "null or \"\"");
  }
  if (model.boolean("byte_fallback", false))
    unsupported(source, "model.byte_fallback", "true", "false");

  const Fields vocab_fields(model.require("vocab"), "model.vocab", source);
  tokenizer_detail::StringMap<int32_t> vocab;
  const json& vocab_json = model.require("vocab");
  vocab.reserve(vocab_json.size());
  for (const auto& [token, id] : vocab_json.items()) {
    vocab.emplace(token, Fields::to_id(id, "model.vocab[\"" + token + "\"]", source));
  }

  tokenizer_detail::BpeModel::Options options;
  options.byte_level = impl.byte_level;
  options.ignore_merges = model.boolean("ignore_merges", false);
  options.fuse_unk = model.boolean("fuse_unk", false);
  if (const auto unk = model.optional_string("unk_token")) {
    const auto it = vocab.find(*unk);
    MOELORA_CHECK(it != vocab.end(), ErrorCode::kInvalidFile, source, ": model.unk_token '", *unk,
                  "' is not in model.vocab");
    options.unk_id = it->second;
  }
  const json* merges_json = model.find("merges");
  std::vector<std::pair<std::string, std::string>> merges;
  if (merges_json && !merges_json->is_null())
    merges = parse_merges(model.array("merges"), "model.merges", source);
  impl.model = tokenizer_detail::BpeModel(std::move(vocab), merges, options, source);
}

void parse_added_tokens(const json& list, const std::string& source, Tokenizer::Impl& impl) {
  for (size_t i = 0; i < list.size(); ++i) {
    const Fields fields(list[i], "added_tokens[" + std::to_string(i) + "]", source);
    AddedToken token;
    token.id = fields.id("id");
    token.content = fields.string("content");
    token.special = fields.boolean("special", false);
    token.single_word = fields.boolean("single_word", false);
    token.lstrip = fields.boolean("lstrip", false);
    token.rstrip = fields.boolean("rstrip", false);
    token.normalized = fields.boolean("normalized", !token.special);
    impl.added_tokens.push_back(std::move(token));
  }
}

// Builds the id tables and the added-token matchers once the model and the added tokens are known.
void build_tables(Tokenizer::Impl& impl) {
  int64_t size = 0;
  for (const auto& [token, id] : impl.model.vocab())
    size = std::max<int64_t>(size, int64_t{id} + 1);
  for (const AddedToken& token : impl.added_tokens)
    size = std::max<int64_t>(size, int64_t{token.id} + 1);
  impl.id_to_token.assign(size, std::string());
  impl.id_flags.assign(size, 0);
  for (const auto& [token, id] : impl.model.vocab()) {
    impl.id_to_token[id] = token;
    impl.id_flags[id] = Tokenizer::Impl::kHasToken;
  }
  for (size_t i = 0; i < impl.added_tokens.size(); ++i) {
    const AddedToken& token = impl.added_tokens[i];
    // A normalized token is matched, and decoded, in its normalized form; token_to_id still
    // takes the content as written (both as `tokenizers` does).
    std::string content = token.content;
    if (token.normalized) {
      for (NormalForm form : impl.normalizers) content = tokenizer_detail::normalize(content, form);
    }
    impl.id_flags[token.id] =
        Tokenizer::Impl::kHasToken | (token.special ? Tokenizer::Impl::kSpecial : 0);
    impl.added_by_content.emplace(token.content, token.id);
    if (!token.content.empty()) {  // an empty token is never matched, as in `tokenizers`
      (token.normalized ? impl.normalized_added : impl.raw_added)
          .add(content, static_cast<int32_t>(i));
    }
    impl.id_to_token[token.id] = std::move(content);
  }
  // What the decoder makes of each token, computed once so decoding is a concatenation.
  impl.decoded_bytes.assign(size, std::string());
  for (int64_t id = 0; id < size; ++id) {
    if (!(impl.id_flags[id] & Tokenizer::Impl::kHasToken)) continue;
    const std::string& token = impl.id_to_token[id];
    std::optional<std::string> bytes;
    if (impl.byte_level_decoder) bytes = byte_level_decode(token);
    // ByteLevel keeps a token with characters outside its alphabet (e.g. "<｜end▁of▁sentence｜>")
    // as its own UTF-8 bytes.
    impl.decoded_bytes[id] = bytes ? std::move(*bytes) : token;
  }
}

std::optional<std::string> special_token_content(const Fields& config, const std::string& key) {
  const json* value = config.find(key);
  if (value == nullptr || value->is_null()) return std::nullopt;
  if (value->is_string()) return value->get<std::string>();
  // Serialized AddedToken: {"__type": "AddedToken", "content": "...", ...}
  return Fields(*value, config.path(key), config.source()).string("content");
}

void apply_config(Tokenizer::Impl& impl, std::string_view config_text,
                  const std::string& config_source) {
  const json config = parse_json(config_text, config_source);
  const Fields fields(config, "", config_source);
  const auto role = [&](const char* key, std::optional<std::string>& token,
                        std::optional<int32_t>& id) {
    token = special_token_content(fields, key);
    if (!token) return;
    id = impl.find_token(*token);
    MOELORA_CHECK(id.has_value(), ErrorCode::kInvalidFile, config_source, ": ", key, " '", *token,
                  "' is not a token of ", impl.source);
  };
  role("eos_token", impl.eos_token, impl.eos_id);
  role("bos_token", impl.bos_token, impl.bos_id);
  role("pad_token", impl.pad_token, impl.pad_id);
  role("unk_token", impl.unk_token, impl.unk_id);

  if (const json* templates = fields.find("chat_template"); templates && !templates->is_null()) {
    if (templates->is_string()) {
      impl.chat_template = templates->get<std::string>();
    } else {
      MOELORA_CHECK(templates->is_array(), ErrorCode::kInvalidFile, config_source,
                    ": field 'chat_template' must be a string or a list of {name, template}, got ",
                    show(*templates));
      for (size_t i = 0; i < templates->size(); ++i) {
        const Fields entry((*templates)[i], "chat_template[" + std::to_string(i) + "]",
                           config_source);
        const std::string name = entry.string("name");
        std::string text = entry.string("template");
        if (name == "default") {
          impl.chat_template = std::move(text);
        } else {
          impl.named_chat_templates[name] = std::move(text);
        }
      }
    }
  }
}

std::shared_ptr<Tokenizer::Impl> build_impl(std::string_view json_text, const std::string& source) {
  auto impl = std::make_shared<Tokenizer::Impl>();
  impl->source = source;
  const json root = parse_json(json_text, source);
  const Fields top(root, "", source);

  if (const json* normalizer = top.find("normalizer"))
    parse_normalizer(*normalizer, "normalizer", source, impl->normalizers);
  if (const json* pre = top.find("pre_tokenizer"))
    parse_pre_tokenizer(*pre, "pre_tokenizer", source, *impl);
  if (const json* post = top.find("post_processor"))
    parse_post_processor(*post, "post_processor", source, *impl);
  if (const json* decoder = top.find("decoder"); decoder && !decoder->is_null()) {
    const Fields fields(*decoder, "decoder", source);
    const std::string type = fields.type();
    if (type != "ByteLevel") unsupported(source, "decoder.type", type, "ByteLevel, null");
    impl->byte_level_decoder = true;
  }
  MOELORA_CHECK(top.find("model") != nullptr, ErrorCode::kInvalidFile, source,
                ": missing field 'model'");
  parse_model(top.require("model"), source, *impl);
  if (const json* added = top.find("added_tokens"); added && !added->is_null()) {
    parse_added_tokens(top.array("added_tokens"), source, *impl);
  }
  build_tables(*impl);
  return impl;
}

}  // namespace

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
