// Lexer of the chat-template interpreter: Jinja2 template source -> a flat token stream, with
// jinja2's whitespace handling applied to the text between tags.
//
// The token stream has the shape of jinja2's own: text (kData), then for each tag its begin
// marker, the expression tokens inside it and its end marker. Comments vanish and
// {% raw %}...{% endraw %} becomes text. Whitespace rules, as jinja2.Environment applies them:
//   - the source's newlines are normalized to "\n" and one trailing newline is dropped
//     (keep_trailing_newline=False);
//   - "{%-", "{{-", "{#-" remove all whitespace before the tag, "-%}", "-}}", "-#}" all after;
//   - trim_blocks: the first newline right after a block or comment tag is removed;
//   - lstrip_blocks: spaces and tabs from the start of a line to a block or comment tag are
//     removed; "{%+" and "+%}" turn these two off for one tag.
// Inside a tag, an end marker only counts outside brackets, so "{{ {'a': {'b': 1}} }}" works.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moelora::chat::jinja {

enum class TokenType {
  kData,           // template text (already whitespace-processed)
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,           // identifier or keyword (if, for, in, not, and, or, is, true, none, ...)
  kString,         // string literal, escapes already decoded
  kInteger,
  kFloat,
  kOperator,  // + - * / // % ** ~ == != < <= > >= = . , : | ( ) [ ] { }
  kEnd,       // end of template
};

struct Token {
  TokenType type;
  std::string value;  // text for kData / kName / kString / kOperator
  int64_t int_value = 0;
  double float_value = 0.0;
  int line = 1;    // 1-based line of the token's first character
  int column = 1;  // 1-based column (in code points)
};

struct LexOptions {
  bool trim_blocks = true;  // transformers sets both
  bool lstrip_blocks = true;
};

// Throws TemplateError (kInvalidFile) with line and column on malformed tags: an unclosed tag,
// comment or string, an unknown character inside a tag, unbalanced brackets.
std::vector<Token> tokenize(std::string_view source, const LexOptions& options = {});

const char* token_type_name(TokenType type);

}  // namespace moelora::chat::jinja
