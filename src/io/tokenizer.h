// Byte-level BPE tokenizer read from a Hugging Face `tokenizer.json` (FORMATS.md §5.2-5.3).
//
// The engine needs text -> ids for prompts and ids -> text for generated tokens, with exactly the
// ids that the `tokenizers` library produces for the same file, because a model only understands
// the ids it was trained on. This reader covers the files shipped with Qwen2/Qwen3/Qwen3.5,
// DeepSeek-V3 and other GPT-2-style byte-level BPE vocabularies:
//
//   encode(text):
//     1. the text must be valid UTF-8 (else kInvalidArgument naming the byte offset);
//     2. added tokens with normalized=false (all special tokens, Qwen3's <think>, ...) are cut out
//        of the raw text atomically: leftmost match first, the longest one at a position, with the
//        lstrip / rstrip / single_word flags honoured;
//     3. every remaining piece is normalized (NFC, NFD, NFKC, NFKD, a Sequence of them, or none)
//        and then searched for the added tokens with normalized=true (matched in normalized form);
//     4. the pre-tokenizer splits each piece: Split (Regex or String pattern, any behavior,
//     invert),
//        ByteLevel (optionally with the GPT-2 regex and add_prefix_space), or a Sequence of those;
//     5. ByteLevel maps each byte to one printable character (GPT-2 bytes_to_unicode), and the BPE
//        model merges each pre-token by rank: lowest rank first, leftmost first among equal ranks;
//     6. with add_special_tokens, the post-processor adds its tokens (TemplateProcessing with one
//        sequence, RobertaProcessing, BertProcessing); ByteLevel post-processing adds nothing.
//   decode(ids): each id becomes its token (special tokens as their content unless skipped), the
//     ByteLevel decoder maps the characters back to bytes, and the bytes are concatenated.
//
// Regexes are compiled with PCRE2 (UTF + UCP, JIT when available). The patterns of the supported
// families are plain Perl syntax; Oniguruma-only constructs in other files are not supported.
//
// Not supported (load() throws kUnsupported naming the field and the value): models other than
// BPE (Unigram, WordPiece, WordLevel), BPE with byte_fallback, dropout, a continuing-subword prefix
// or an end-of-word suffix, normalizers other than the NF* forms, pre-tokenizers other than Split
// and ByteLevel (or a Split after ByteLevel), decoders other than ByteLevel (a null decoder joins
// the tokens with spaces, as `tokenizers` does). "truncation" and "padding" are ignored: the
// engine never truncates or pads. PCRE2 10.42 knows Unicode 14, Oniguruma in `tokenizers` 0.23
// Unicode 16: characters assigned since (CJK Extension H/I, a few new scripts) do not match
// \p{L}, \p{N}, ... here, so the pieces around them can differ.
//
// tiktoken tokenizers (Kimi-K2 / K2.5, FORMATS.md §5.4): a folder without tokenizer.json but with
// tiktoken.model ("base64(token bytes) rank" per line, rank = id) is read with the special tokens
// of tokenizer_config.json (added_tokens_decoder; the 258 ids after the ranks, unnamed ones being
// "<|reserved_token_{id}|>"). encode() then follows Kimi's TikTokenTokenizer.encode with Python
// `tiktoken`: long whitespace / non-whitespace runs cut as that code does, special tokens
// recognised anywhere in the text (allowed_special="all"), Kimi's pre-tokenization regex, and BPE
// over raw bytes by rank. add_special_tokens adds nothing (Kimi's tokenizer adds no BOS/EOS).
// decode() concatenates token bytes, special tokens as their content; skip_special_tokens skips
// the ids whose added_tokens_decoder entry says "special": true. Vocabulary forms
// (token_to_id/id_to_token) are the GPT-2 byte-level strings, as transformers shows them.
//
// Thread safety: a loaded Tokenizer is immutable apart from an internal, mutex-protected cache of
// recently seen pre-tokens, so encode/decode may run concurrently from many threads. Copies are
// cheap and share the loaded tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moelora::io {

// One entry of tokenizer.json "added_tokens". Matched on the input text before the BPE model.
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;      // skipped by decode(..., skip_special_tokens=true)
  bool single_word = false;  // only matches when not glued to a word character on either side
  bool lstrip = false;       // also swallows the whitespace on its left
  bool rstrip = false;       // also swallows the whitespace on its right
  bool normalized = false;   // matched against the normalized text (in normalized form)
};

class Tokenizer {
 public:
  // Loads a tokenizer.
  //   dir_or_file a directory: reads dir/tokenizer.json, plus, when present,
  //               dir/tokenizer_config.json (eos/bos/pad/unk tokens, chat_template) and
  //               dir/chat_template.jinja (preferred over tokenizer_config's template) and
  //               dir/additional_chat_templates/<name>.jinja (named templates).
  //               Without tokenizer.json, dir/tiktoken.model is read instead (see the file
  //               comment).
  //   dir_or_file a file: reads that tokenizer.json only (no special-token roles, no template); a
  //               file named tiktoken.model is read as such, without special-token names.
  // Throws moelora::Error: kNotFound (missing file), kInvalidFile (bad JSON, missing or
  // ill-typed field, merge referencing a token not in the vocabulary, bad regex, ...),
  // kUnsupported (a type or option this reader does not implement, see the file comment).
  static Tokenizer load(const std::filesystem::path& dir_or_file);

  // Same as load() on in-memory texts. `config_json` may be empty (no tokenizer_config.json);
  // `source` names the origin in error messages.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json = {},
                             const std::string& source = "tokenizer.json");

  // A tiktoken tokenizer (see the file comment) from the text of a tiktoken.model file and of its
  // tokenizer_config.json (may be empty). Throws kInvalidFile naming `source`, the line and the
  // problem (bad base64, duplicate token or rank, ranks not 0..n-1, a byte without a rank, ...).
  static Tokenizer from_tiktoken(std::string_view tiktoken_model, std::string_view config_json = {},
                                 const std::string& source = "tiktoken.model");

  // Text -> token ids, identical to `tokenizers` Tokenizer.encode(text, add_special_tokens).
  // Throws kInvalidArgument if `text` is not valid UTF-8 (the message names the byte offset).
  // Characters whose byte-level form is missing from the vocabulary are dropped, as in
  // `tokenizers` when the model has no unk token; with an unk token they become unk.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;

  // Ids -> bytes. Added tokens are emitted as their content (normalized=true ones in normalized
  // form, as `tokenizers` does), special ones only without `skip_special_tokens`; ids that have
  // no token (negative, past the vocabulary or holes in it) are skipped, as in `tokenizers`.
  // Unlike `tokenizers`, which replaces invalid UTF-8 with U+FFFD, the bytes are returned
  // unchanged: decoding a single token can yield part of a multi-byte character, and a streaming
  // caller joins such parts (see utf8_complete_prefix) or cleans the result with sanitize_utf8().
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // Bytes of one token as decode({id}) would give them ("" for an id without a token).
  std::string decode_token(int32_t id, bool skip_special_tokens = false) const;

  // One past the largest id used by the vocabulary or an added token (the embedding rows the
  // tokenizer can address; a model may have more).
  int64_t vocab_size() const;
  // Id of a token string in its vocabulary form (added tokens first, then the model vocabulary:
  // "Ġthe", "<|im_end|>"), or nullopt.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Token string of an id in its vocabulary form. Throws kOutOfRange for an id without a token.
  std::string id_to_token(int32_t id) const;
  // Whether `id` is an added token marked special.
  bool is_special(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;

  // Special-token roles from tokenizer_config.json (nullopt when absent, null or no config).
  std::optional<int32_t> eos_token_id() const;
  std::optional<int32_t> bos_token_id() const;
  std::optional<int32_t> pad_token_id() const;
  std::optional<int32_t> unk_token_id() const;
  std::optional<std::string> eos_token() const;
  std::optional<std::string> bos_token() const;
  std::optional<std::string> pad_token() const;

  // The default chat template (Jinja source), nullopt when none was found; named templates
  // (tokenizer_config "chat_template" as a list of {name, template}, or
  // additional_chat_templates/<name>.jinja) by name, without the default one.
  const std::optional<std::string>& chat_template() const;
  const std::map<std::string, std::string>& named_chat_templates() const;

  // Where the tokenizer came from (for messages).
  const std::string& source() const;

  Tokenizer(const Tokenizer&) = default;
  Tokenizer& operator=(const Tokenizer&) = default;
  Tokenizer(Tokenizer&&) noexcept = default;
  Tokenizer& operator=(Tokenizer&&) noexcept = default;
  ~Tokenizer();

  struct Impl;  // defined in tokenizer_internal.h

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

// ---- byte-level and UTF-8 helpers (also used by the CLI and the server) ----

// GPT-2 bytes_to_unicode applied to every byte: bytes 33-126, 161-172 and 174-255 map to the same
// code point, the other 68 bytes to U+0100.. in increasing byte order (space -> "Ġ", '\n' -> "Ċ").
std::string byte_level_encode(std::string_view bytes);
// Inverse of byte_level_encode; nullopt if `text` holds a character outside the 256 used ones
// or is not valid UTF-8.
std::optional<std::string> byte_level_decode(std::string_view text);

// Byte offset of the first invalid UTF-8 sequence (overlong forms, surrogates and code points
// past U+10FFFF are invalid, as in Rust's str), or nullopt when `bytes` is valid.
std::optional<size_t> find_invalid_utf8(std::string_view bytes);
// Length of the longest prefix of `bytes` that does not end inside an incomplete (but so far
// valid) multi-byte sequence: what a streaming decoder can emit now.
size_t utf8_complete_prefix(std::string_view bytes);
// `bytes` with every maximal invalid subsequence replaced by U+FFFD (the result of Rust's
// String::from_utf8_lossy, which `tokenizers` applies in decode).
std::string sanitize_utf8(std::string_view bytes);

}  // namespace moelora::io
