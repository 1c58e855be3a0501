// Jinja2 lexer for chat templates (see lexer.h for the whitespace rules it reproduces).
#include "chat/lexer.h"

#include <algorithm>

#include "chat/value.h"

namespace moelora::chat::jinja {

const char* token_type_name(TokenType type) {
  switch (type) {
    case TokenType::kData: return "template data";
    case TokenType::kVariableBegin: return "'{{'";
    case TokenType::kVariableEnd: return "end of print statement";
    case TokenType::kBlockBegin: return "'{%'";
    case TokenType::kBlockEnd: return "end of statement block";
    case TokenType::kName: return "name";
    case TokenType::kString: return "string";
    case TokenType::kInteger: return "integer";
    case TokenType::kFloat: return "float";
    case TokenType::kOperator: return "operator";
    case TokenType::kEnd: return "end of template";
  }
  return "token";
}

namespace {

// jinja2 splits the source on \r\n, \r and \n, drops one empty last line and joins with "\n".
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_name_char(char c) {
  return is_name_start(c) || (c >= '0' && c <= '9');
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

class Lexer {
 public:
  Lexer(std::string_view source, const LexOptions& options)
      : src_(normalize_newlines(source)), options_(options) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (true) {
      const size_t p = next_tag(pos);
      if (p == std::string::npos) {
        emit_data(src_.substr(pos), pos);
        break;
      }
      const char kind = src_[p + 1];  // '{', '%' or '#'
      char sign = p + 2 < src_.size() ? src_[p + 2] : '\0';
      if (sign != '-' && sign != '+') sign = '\0';
      std::string text = src_.substr(pos, p - pos);
      strip_before_tag(text, sign, kind != '{', line_starting);
      emit_data(std::move(text), pos);
      const size_t inner = p + 2 + (sign ? 1 : 0);
      size_t after;
      if (kind == '#') {
        after = end_of_comment(p, inner);
      } else if (kind == '%' && is_raw_begin(inner, after)) {
        after = raw_block(after, after > 0 && src_[after - 1] == '\n');
      } else {
        after = tag(p, inner, kind == '{');
      }
      line_starting = after > 0 && src_[after - 1] == '\n';
      pos = after;
    }
    push(TokenType::kEnd, "", src_.size());
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void error(size_t offset, std::string message) {
    const auto [line, column] = location(offset);
    throw TemplateError{ErrorCode::kInvalidFile, std::move(message), line, column};
  }

  std::pair<int, int> location(size_t offset) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const size_t line = static_cast<size_t>(it - line_starts_.begin());  // 1-based
    const size_t start = line_starts_[line - 1];
    const std::string_view prefix(src_.data() + start, std::min(offset, src_.size()) - start);
    return {static_cast<int>(line), static_cast<int>(code_point_count(prefix)) + 1};
  }

  void push(TokenType type, std::string value, size_t offset) {
    Token t{type, std::move(value)};
    std::tie(t.line, t.column) = location(offset);
    tokens_.push_back(std::move(t));
  }

  void emit_data(std::string text, size_t offset) {
    if (!text.empty()) push(TokenType::kData, std::move(text), offset);
  }

  size_t next_tag(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  // Python str.rstrip() / "skip \s*" on UTF-8 text.
  static void rstrip_space(std::string& text) {
    size_t end = text.size();
    while (end > 0) {
      size_t begin = end - 1;
      while (begin > 0 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
      size_t pos = begin;
      if (!is_python_space(decode_utf8(text, pos))) break;
      end = begin;
    }
    text.resize(end);
  }
  size_t skip_space(size_t pos) const {
    while (pos < src_.size()) {
      size_t next = pos;
      if (!is_python_space(decode_utf8(src_, next))) break;
      pos = next;
    }
    return pos;
  }

  // The whitespace control of a tag applied to the text before it ("{%-", lstrip_blocks).
  void strip_before_tag(std::string& text, char sign, bool lstrip_kind, bool line_starting) const {
    if (sign == '-') {
      rstrip_space(text);
    } else if (sign != '+' && options_.lstrip_blocks && lstrip_kind) {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size()) {
        std::string tail = text.substr(l_pos);
        rstrip_space(tail);
        if (tail.empty()) text.resize(l_pos);
      }
    }
  }

  size_t end_of_comment(size_t open, size_t inner) {
    const size_t close = src_.find("#}", inner);
    if (close == std::string::npos) error(open, "missing end of comment tag");
    size_t after = close + 2;
    if (close > inner && src_[close - 1] == '-') {
      after = skip_space(after);
    } else if (!(close > inner && src_[close - 1] == '+') && options_.trim_blocks &&
               after < src_.size() && src_[after] == '\n') {
      ++after;
    }
    return after;
  }

  // "{%[-+]? raw [-]?%}" at `inner`; sets `after` past it.
  bool is_raw_begin(size_t inner, size_t& after) const {
    size_t i = skip_space(inner);
    if (src_.compare(i, 3, "raw") != 0 || (i + 3 < src_.size() && is_name_char(src_[i + 3])))
      return false;
    i = skip_space(i + 3);
    if (src_.compare(i, 3, "-%}") == 0) {
      after = skip_space(i + 3);
      return true;
    }
    if (src_.compare(i, 2, "%}") == 0) {
      after = i + 2;  // jinja2 applies no trim_blocks after {% raw %}
      return true;
    }
    return false;
  }

  // Raw text up to {% endraw %}, emitted as data; returns the offset after the end tag.
  size_t raw_block(size_t start, bool line_starting) {
    for (size_t p = src_.find("{%", start); p != std::string::npos; p = src_.find("{%", p + 1)) {
      char sign = p + 2 < src_.size() ? src_[p + 2] : '\0';
      if (sign != '-' && sign != '+') sign = '\0';
      size_t i = skip_space(p + 2 + (sign ? 1 : 0));
      if (src_.compare(i, 6, "endraw") != 0) continue;
      i = skip_space(i + 6);
      size_t after;
      if (src_.compare(i, 3, "-%}") == 0) {
        after = skip_space(i + 3);
      } else if (src_.compare(i, 3, "+%}") == 0) {
        after = i + 3;
      } else if (src_.compare(i, 2, "%}") == 0) {
        after = i + 2;
        if (options_.trim_blocks && after < src_.size() && src_[after] == '\n') ++after;
      } else {
        continue;
      }
      std::string text = src_.substr(start, p - start);
      strip_before_tag(text, sign, true, line_starting);
      emit_data(std::move(text), start);
      return after;
    }
    error(start, "missing end of raw directive");
  }

  // The tokens of one {{ }} or {% %} tag; returns the offset after its end marker.
  size_t tag(size_t open, size_t pos, bool variable) {
    push(variable ? TokenType::kVariableBegin : TokenType::kBlockBegin, "", open);
    std::string brackets;  // open brackets, innermost last
    while (true) {
      pos = skip_space(pos);
      if (pos >= src_.size()) {
        error(open, variable ? "unexpected end of template, expected '}}'"
                             : "unexpected end of template, expected '%}'");
      }
      if (brackets.empty()) {
        size_t after = std::string::npos;
        if (variable) {
          if (src_.compare(pos, 3, "-}}") == 0) {
            after = skip_space(pos + 3);
          } else if (src_.compare(pos, 2, "}}") == 0) {
            after = pos + 2;
          }
        } else {
          if (src_.compare(pos, 3, "-%}") == 0) {
            after = skip_space(pos + 3);
          } else if (src_.compare(pos, 3, "+%}") == 0) {
            after = pos + 3;
          } else if (src_.compare(pos, 2, "%}") == 0) {
            after = pos + 2;
            if (options_.trim_blocks && after < src_.size() && src_[after] == '\n') ++after;
          }
        }
        if (after != std::string::npos) {
          push(variable ? TokenType::kVariableEnd : TokenType::kBlockEnd, "", pos);
          return after;
        }
      }
      pos = expression_token(pos, brackets);
    }
  }

  size_t expression_token(size_t pos, std::string& brackets) {
    const char c = src_[pos];
    if (is_name_start(c)) {
      size_t end = pos + 1;
      while (end < src_.size() && is_name_char(src_[end])) ++end;
      push(TokenType::kName, src_.substr(pos, end - pos), pos);
      return end;
    }
    if (is_digit(c)) return number(pos);
    if (c == '\'' || c == '"') return string_literal(pos);
    static const char* const kTwoChar[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* op : kTwoChar) {
      if (src_.compare(pos, 2, op) == 0) {
        push(TokenType::kOperator, op, pos);
        return pos + 2;
      }
    }
    static const std::string kOneChar = "+-*/%~<>=.,:|;()[]{}";
    if (kOneChar.find(c) == std::string::npos) {
      size_t next = pos;
      std::string ch;
      append_utf8(ch, decode_utf8(src_, next));
      error(pos, "unexpected char '" + ch + "'");
    }
    if (c == '(' || c == '[' || c == '{') {
      brackets.push_back(c);
    } else if (c == ')' || c == ']' || c == '}') {
      const char expected = c == ')' ? '(' : c == ']' ? '[' : '{';
      if (brackets.empty()) error(pos, std::string("unexpected '") + c + "'");
      if (brackets.back() != expected) {
        const char want = brackets.back() == '(' ? ')' : brackets.back() == '[' ? ']' : '}';
        error(pos, std::string("unexpected '") + c + "', expected '" + want + "'");
      }
      brackets.pop_back();
    }
    push(TokenType::kOperator, std::string(1, c), pos);
    return pos + 1;
  }

  // Decimal integers and floats as jinja2 reads them ("1_000", "1.5", "2e-3"). After a dot only
  // integers: "x.0.1" is x[0][1].
  size_t number(size_t pos) {
    const bool after_dot = pos > 0 && src_[pos - 1] == '.';
    size_t end = pos;
    const auto digits = [&](size_t& i) {
      while (i < src_.size() && (is_digit(src_[i]) ||
                                 (src_[i] == '_' && i + 1 < src_.size() && is_digit(src_[i + 1]))))
        ++i;
    };
    digits(end);
    bool is_float = false;
    if (!after_dot && end + 1 < src_.size() && src_[end] == '.' && is_digit(src_[end + 1])) {
      ++end;
      digits(end);
      is_float = true;
    }
    if (!after_dot && end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t e = end + 1;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && is_digit(src_[e])) {
        end = e;
        digits(end);
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = pos; i < end; ++i) {
      if (src_[i] != '_') text.push_back(src_[i]);
    }
    Token t{is_float ? TokenType::kFloat : TokenType::kInteger, text};
    std::tie(t.line, t.column) = location(pos);
    try {
      if (is_float) {
        t.float_value = std::stod(text);
      } else {
        t.int_value = std::stoll(text);
      }
    } catch (const std::exception&) {
      error(pos, "number literal " + text + " out of range");
    }
    tokens_.push_back(std::move(t));
    return end;
  }

  // A quoted string; escapes decoded as Python's "unicode-escape" codec does (jinja2's rule).
  size_t string_literal(size_t pos) {
    const char quote = src_[pos];
    std::string value;
    size_t i = pos + 1;
    while (true) {
      if (i >= src_.size()) error(pos, "unexpected end of string literal");
      const char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        value.push_back(c);
        ++i;
        continue;
      }
      if (i + 1 >= src_.size()) error(pos, "unexpected end of string literal");
      const char e = src_[i + 1];
      i += 2;
      switch (e) {
        case '\n': break;  // line continuation
        case '\\': value.push_back('\\'); break;
        case '\'': value.push_back('\''); break;
        case '"': value.push_back('"'); break;
        case 'a': value.push_back('\a'); break;
        case 'b': value.push_back('\b'); break;
        case 'f': value.push_back('\f'); break;
        case 'n': value.push_back('\n'); break;
        case 'r': value.push_back('\r'); break;
        case 't': value.push_back('\t'); break;
        case 'v': value.push_back('\v'); break;
        case 'x':
        case 'u':
        case 'U': {
          const int width = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          char32_t cp = 0;
          for (int k = 0; k < width; ++k, ++i) {
            const char h = i < src_.size() ? src_[i] : '\0';
            int d;
            if (h >= '0' && h <= '9') {
              d = h - '0';
            } else if (h >= 'a' && h <= 'f') {
              d = h - 'a' + 10;
            } else if (h >= 'A' && h <= 'F') {
              d = h - 'A' + 10;
            } else {
              error(pos, std::string("truncated \\") + e + " escape in string literal");
            }
            cp = cp * 16 + d;
          }
          if (cp > 0x10FFFF) error(pos, "illegal Unicode character in string literal");
          append_utf8(value, cp);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {  // up to three octal digits
            char32_t cp = e - '0';
            for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7';
                 ++k, ++i) {
              cp = cp * 8 + (src_[i] - '0');
            }
            append_utf8(value, cp);
          } else {  // unknown escapes keep their backslash
            value.push_back('\\');
            value.push_back(e);
          }
      }
    }
    push(TokenType::kString, std::move(value), pos);
    return i + 1;
  }

  std::string src_;
  LexOptions options_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source, const LexOptions& options) {
  return Lexer(source, options).run();
}

}  // namespace moelora::chat::jinja
