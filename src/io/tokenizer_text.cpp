// Text-level helpers of the tokenizer: UTF-8 validation and decoding, the Unicode predicates that
// `tokenizers` uses for added tokens (Rust's \s and \w), Unicode normalization through utf8proc,
// the GPT-2 byte-level alphabet, and the PCRE2 wrapper used for the pre-tokenizer regexes.
#include <algorithm>
#include <cstdlib>
#include <memory>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include "core/error.h"
#include "io/tokenizer_internal.h"

namespace moelora::io {
namespace tokenizer_detail {
namespace {

// One step of a UTF-8 scan at `pos`: the length of a valid sequence, or for an invalid one the
// length of its longest valid prefix (at least 1, the unit that from_utf8_lossy replaces by one
// U+FFFD). `truncated` says the sequence was valid so far but the input ended inside it.
struct Utf8Step {
  size_t length = 1;
  bool valid = false;
  bool truncated = false;
};

Utf8Step utf8_step(std::string_view s, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = byte(pos);
  if (b0 < 0x80) return {1, true, false};
  size_t continuation = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    continuation = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    continuation = 2;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong 3-byte forms
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    continuation = 3;
    if (b0 == 0xF0) lo = 0x90;  // no overlong 4-byte forms
    if (b0 == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return {1, false, false};
  }
  for (size_t i = 1; i <= continuation; ++i) {
    if (pos + i >= s.size()) return {i, false, true};
    const uint8_t b = byte(pos + i);
    const bool ok = i == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return {i, false, false};
  }
  return {continuation + 1, true, false};
}

struct ByteLevelTables {
  std::array<std::string, 256> to_unicode;
  std::array<int16_t, 324> to_byte;  // the largest mapped code point is U+0143
};

const ByteLevelTables& byte_level_tables() {
  static const ByteLevelTables tables = [] {
    ByteLevelTables t;
    t.to_byte.fill(-1);
    int next_shifted = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next_shifted++);
      std::string utf8;
      if (cp < 0x80) {
        utf8.push_back(static_cast<char>(cp));
      } else {  // all mapped code points are below U+0800: two bytes
        utf8.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        utf8.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      t.to_unicode[b] = std::move(utf8);
      t.to_byte[cp] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return tables;
}

}  // namespace

char32_t next_code_point(std::string_view text, size_t& pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t b0 = byte(pos);
  if (b0 < 0x80) {
    pos += 1;
    return b0;
  }
  if (b0 < 0xE0) {
    const char32_t cp = ((b0 & 0x1Fu) << 6) | (byte(pos + 1) & 0x3Fu);
    pos += 2;
    return cp;
  }
  if (b0 < 0xF0) {
    const char32_t cp = ((b0 & 0x0Fu) << 12) | ((byte(pos + 1) & 0x3Fu) << 6) | (byte(pos + 2) & 0x3Fu);
    pos += 3;
    return cp;
  }
  const char32_t cp = ((b0 & 0x07u) << 18) | ((byte(pos + 1) & 0x3Fu) << 12) |
                      ((byte(pos + 2) & 0x3Fu) << 6) | (byte(pos + 3) & 0x3Fu);
  pos += 4;
  return cp;
}

char32_t previous_code_point(std::string_view text, size_t end, size_t& begin) {
  begin = end - 1;
  while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
  size_t pos = begin;
  return next_code_point(text, pos);
}

bool is_white_space(char32_t cp) {
  // The Unicode White_Space property (PropList.txt).
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

bool is_word_char(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
  }
  if (cp == 0x200C || cp == 0x200D) return true;  // Join_Control
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC: return true;
    default: return false;
  }
}

const char* normal_form_name(NormalForm form) {
  switch (form) {
    case NormalForm::kNfc: return "NFC";
    case NormalForm::kNfd: return "NFD";
    case NormalForm::kNfkc: return "NFKC";
    case NormalForm::kNfkd: return "NFKD";
  }
  return "?";
}

namespace {

std::string utf8proc_normalize(std::string_view text, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc: options |= UTF8PROC_COMPOSE; break;
    case NormalForm::kNfd: options |= UTF8PROC_DECOMPOSE; break;
    case NormalForm::kNfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::kNfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* output = nullptr;
  const utf8proc_ssize_t length = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                               static_cast<utf8proc_ssize_t>(text.size()), &output,
                                               static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(output, &std::free);
  MOELORA_CHECK(length >= 0, ErrorCode::kInternal, normal_form_name(form),
                " normalization failed: ", utf8proc_errmsg(length));
  return std::string(reinterpret_cast<const char*>(output), static_cast<size_t>(length));
}

// Characters that NFC leaves alone and that never combine with what precedes them: starters with
// NFC_Quick_Check=Yes that are no composition's second element. For such a character c,
// NFC(x + c + y) = NFC(x) + NFC(c + y), so text can be cut in front of it, and a run of them that
// is followed by another one (or the end) needs no work. The ranges are small and stable:
// ASCII, CJK Unified Ideographs, kana without the combining sound marks, Hangul syllables.
bool nfc_inert(char32_t cp) {
  return cp < 0x80 || (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0xAC00 && cp <= 0xD7A3) ||
         (cp >= 0x3041 && cp <= 0x3096) || (cp >= 0x30A1 && cp <= 0x30FA);
}

// NFC that hands utf8proc only the stretches around other characters (most text is inert).
std::string nfc(std::string_view text) {
  std::string out;
  size_t pending = 0;  // start of the text not yet copied or normalized
  size_t pos = 0;
  bool previous_inert = true;
  size_t previous_start = 0;
  while (pos < text.size()) {
    const size_t start = pos;
    const bool inert = nfc_inert(next_code_point(text, pos));
    if (!inert && previous_inert) {
      // A non-inert stretch begins; it includes the inert character in front of it (which a
      // combining mark may compose with). Copy what lies before that character.
      out.append(text.substr(pending, previous_start - pending));
      pending = previous_start;
    } else if (inert && !previous_inert) {
      // The non-inert stretch ends in front of this inert character: normalize it.
      out += utf8proc_normalize(text.substr(pending, start - pending), NormalForm::kNfc);
      pending = start;
    }
    previous_inert = inert;
    previous_start = start;
  }
  if (previous_inert) {
    out.append(text.substr(pending));
  } else {
    out += utf8proc_normalize(text.substr(pending), NormalForm::kNfc);
  }
  return out;
}

}  // namespace

std::string normalize(std::string_view text, NormalForm form) {
  bool ascii = true;
  for (char c : text) {
    if (static_cast<uint8_t>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return std::string(text);  // every normal form of ASCII text is the text itself
  return form == NormalForm::kNfc ? nfc(text) : utf8proc_normalize(text, form);
}

const std::array<std::string, 256>& byte_to_unicode_table() {
  return byte_level_tables().to_unicode;
}

int byte_from_code_point(char32_t cp) {
  const auto& to_byte = byte_level_tables().to_byte;
  return cp < to_byte.size() ? to_byte[cp] : -1;
}

// ---- Regex ----

namespace {

struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

// Per-thread match data: one ovector pair is enough, only the overall match is read (PCRE2 then
// returns 0 instead of the group count, which still means a match).
pcre2_match_data* thread_match_data() {
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(pcre2_match_data_create(1, nullptr));
  MOELORA_CHECK(data != nullptr, ErrorCode::kInternal, "out of memory creating PCRE2 match data");
  return data.get();
}

std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(error_code, buffer, sizeof(buffer));
  return n < 0 ? "PCRE2 error " + std::to_string(error_code) : std::string(reinterpret_cast<char*>(buffer));
}

// `tokenizers` compiles its patterns with Oniguruma, whose \s is exactly the Unicode White_Space
// property; PCRE2's \s (UCP mode) also matches U+180E MONGOLIAN VOWEL SEPARATOR. Spelling the
// property out makes both agree, inside and outside character classes.
std::string oniguruma_compatible(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 16);
  bool quoted = false;  // inside \Q...\E everything is literal
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c != '\\' || i + 1 == pattern.size()) {
      out.push_back(c);
      continue;
    }
    const char next = pattern[++i];
    if (quoted) {
      quoted = next != 'E';
    } else if (next == 'Q') {
      quoted = true;
    } else if (next == 's') {
      out += "\\p{White_Space}";
      continue;
    } else if (next == 'S') {
      out += "\\P{White_Space}";
      continue;
    }
    out.push_back(c);
    out.push_back(next);
  }
  return out;
}

}  // namespace

Regex::Regex(std::string_view pattern, bool literal, const std::string& what)
    : pattern_(pattern), what_(what) {
  const std::string compiled = literal ? std::string(pattern) : oniguruma_compatible(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  // PCRE2_LITERAL accepts UTF but not UCP (which only affects classes a literal does not have).
  const uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(), options,
                                   &error_code, &error_offset, nullptr);
  MOELORA_CHECK(code != nullptr, ErrorCode::kInvalidFile, what, ": the regex '", pattern,
                "' does not compile (PCRE2, at pattern offset ", error_offset,
                "): ", pcre2_message(error_code));
  code_ = code;
  // JIT is an optimisation only: without it (unsupported platform) the interpreter matches the same.
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() {
  pcre2_code_free(static_cast<pcre2_code*>(code_));
}

void Regex::find_all(std::string_view subject, std::vector<std::pair<size_t, size_t>>& matches) const {
  auto* code = static_cast<const pcre2_code*>(code_);
  pcre2_match_data* data = thread_match_data();
  const auto* bytes = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const size_t n = subject.size();
  size_t offset = 0;
  while (offset <= n) {
    // The subject was validated as UTF-8 before splitting, and splits fall on character boundaries.
    int rc = pcre2_match(code, bytes, n, offset, PCRE2_NO_UTF_CHECK, data, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The default JIT stack is small; the interpreter keeps its backtracking state on the heap.
      rc = pcre2_match(code, bytes, n, offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, data, nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    MOELORA_CHECK(rc >= 0, ErrorCode::kInvalidArgument, what_, ": matching the regex '", pattern_, "' on a ",
                  n, "-byte piece of text failed: ", pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end <= begin || begin < offset) {
      // Empty match: `tokenizers` drops empty pieces; search again one character further on.
      const size_t at = std::max(begin, offset);
      if (at >= n) break;
      offset = at + utf8_step(subject, at).length;
      continue;
    }
    matches.emplace_back(begin, end);
    offset = end;
  }
}

}  // namespace tokenizer_detail

// ---- public helpers ----

std::string byte_level_encode(std::string_view bytes) {
  const auto& table = tokenizer_detail::byte_to_unicode_table();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += table[static_cast<uint8_t>(c)];
  return out;
}

std::optional<std::string> byte_level_decode(std::string_view text) {
  if (find_invalid_utf8(text)) return std::nullopt;
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const int b = tokenizer_detail::byte_from_code_point(tokenizer_detail::next_code_point(text, pos));
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
  }
  return out;
}

std::optional<size_t> find_invalid_utf8(std::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (static_cast<uint8_t>(bytes[pos]) < 0x80) {  // fast path for ASCII runs
      ++pos;
      continue;
    }
    const auto step = tokenizer_detail::utf8_step(bytes, pos);
    if (!step.valid) return pos;
    pos += step.length;
  }
  return std::nullopt;
}

size_t utf8_complete_prefix(std::string_view bytes) {
  // Only the last (at most 3) bytes can start an unfinished sequence.
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t pos = n - back;
    const uint8_t b = static_cast<uint8_t>(bytes[pos]);
    if ((b & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const auto step = tokenizer_detail::utf8_step(bytes, pos);
    return step.truncated ? pos : n;
  }
  return n;
}

std::string sanitize_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const auto step = tokenizer_detail::utf8_step(bytes, pos);
    if (step.valid) {
      out.append(bytes.substr(pos, step.length));
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
    }
    pos += step.length;
  }
  return out;
}

}  // namespace moelora::io
