// Tokenizer loading: tokenizer.json (normalizer, pre-tokenizer, post-processor, BPE model, added
// tokens) and tokenizer_config.json into Tokenizer::Impl; the encode / decode pipelines are in
// tokenizer.cpp, the tiktoken backend in tokenizer_tiktoken.cpp. The order of the steps and the
// treatment of edge cases (empty pieces, whitespace swallowed by lstrip/rstrip, unknown ids) follow
// the `tokenizers` library, whose ids are the ground truth for every model we serve.
#include "io/input_limits.h"
#include "io/tokenizer.h"

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

namespace tokenizer_detail {
namespace {

// The pre-tokenization regex of GPT-2 that ByteLevel applies when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

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

}  // namespace

// tokenizer.json may be large (kMaxTokenizerFileBytes); its config and templates are small files.
std::string read_file(const std::filesystem::path& path, uint64_t max_bytes) {
  std::error_code ec;
  MOELORA_CHECK(std::filesystem::exists(path, ec), ErrorCode::kNotFound, "cannot open '",
                path.string(), "'");
  return read_limited_text(path, max_bytes, "the file");
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

}  // namespace tokenizer_detail
}  // namespace moelora::io
