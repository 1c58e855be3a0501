// The value type of the chat-template interpreter (jinja.h): what a Jinja2 expression evaluates
// to when Hugging Face transformers renders a chat template, modelled on the Python objects
// behind it so that output matches Python's jinja2 byte for byte:
//
//   undefined   jinja2's default Undefined: falsy, renders as "", iterates as empty; attribute
//               access, calls and arithmetic on it fail (the hint names what was missing);
//   none        Python None (renders "None");
//   bool, int   Python bool / int (int64 here; overflow is an error instead of a bigint);
//   float       Python float (rendered with repr()'s shortest round-trip digits);
//   string      Python str, UTF-8; length, indexing and slicing count code points;
//   array       Python list, or tuple (a flag: tuples print as "(a, b)" and differ from lists);
//   object      Python dict with string keys, in insertion order (JSON objects keep the key order
//               of the request, which tojson must reproduce);
//   namespace   jinja2's namespace(): the one mutable object, shared by reference;
//   callable    a macro, a builtin (range, namespace, raise_exception, ...) or caller().
//
// Strings, arrays and objects are immutable and shared (copying a Value is cheap), as the
// templates run in an immutable sandbox: nothing but namespace attributes can change.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moelora::chat::jinja {

class Value;
using Array = std::vector<Value>;

// A failure while rendering or parsing. `line` / `column` are filled in by the innermost syntax
// node that sees the error (0 = not yet known); ChatTemplate turns it into moelora::Error.
struct TemplateError {
  ErrorCode code;
  std::string message;
  int line = 0;
  int column = 0;
};

[[noreturn]] void fail(ErrorCode code, std::string message);

// Deepest nesting of lists / dicts a value may have. Printing, comparing and freeing values
// recurse over their nesting, so a bound keeps a loop like {% set ns.x = [ns.x] %} (or a deeply
// nested request) from exhausting the stack.
inline constexpr int kMaxValueDepth = 512;
// Python's TypeError / ValueError / ... raised by an operation on the template's data: the input
// (messages, tools) does not have the shape the template expects.
[[noreturn]] void type_error(std::string message);

// Insertion-ordered string-keyed map (Python dict). Lookups go through a hash index.
class Object {
 public:
  void set(std::string key, Value value);  // replaces in place when present (keeps the position)
  const Value* find(std::string_view key) const;
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  const std::vector<std::pair<std::string, Value>>& entries() const { return entries_; }

 private:
  std::vector<std::pair<std::string, Value>> entries_;
  // key -> position in entries_; searchable with a string_view (no allocation per lookup)
  struct KeyHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, size_t, KeyHash, std::equal_to<>> index_;
};

// jinja2 namespace(): attributes assignable with {% set ns.attr = value %} from any scope.
struct Namespace {
  Object attributes;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Callable {
  std::string name;  // for messages ("macro 'render_content'", "range")
  std::function<Value(CallArgs&)> call;
};

class Value {
 public:
  enum class Kind : uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kArray,
    kObject,
    kNamespace,
    kCallable
  };

  Value() = default;  // undefined, no hint
  static Value undefined(std::string hint);
  static Value none();
  Value(bool b) : kind_(Kind::kBool), int_(b) {}       // NOLINT: implicit like the Python literal
  Value(int64_t i) : kind_(Kind::kInt), int_(i) {}     // NOLINT
  Value(int i) : kind_(Kind::kInt), int_(i) {}         // NOLINT
  Value(double f) : kind_(Kind::kFloat), float_(f) {}  // NOLINT
  Value(std::string s);                                // NOLINT
  Value(const char* s) : Value(std::string(s)) {}      // NOLINT
  Value(Array a);                                      // NOLINT; fails past kMaxValueDepth
  static Value tuple(Array a);
  Value(Object o);  // NOLINT; fails past kMaxValueDepth
  explicit Value(std::shared_ptr<Namespace> ns);
  explicit Value(std::shared_ptr<const Callable> fn);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const {
    return kind_ == Kind::kBool || kind_ == Kind::kInt || kind_ == Kind::kFloat;
  }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_tuple() const { return kind_ == Kind::kArray && tuple_; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }  // bool and int
  double as_float() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& as_string() const { return *string_; }
  const Array& as_array() const { return *array_; }
  const Object& as_object() const { return *object_; }
  Namespace& as_namespace() const { return *namespace_; }
  const Callable& as_callable() const { return *callable_; }
  // What an undefined value stands for, as jinja2 words it ("'foo' is undefined").
  std::string undefined_message() const;

  // Python truth value (jinja2 `if x`).
  bool truthy() const;
  // Nesting depth: 0 for scalars, 1 + the deepest item for lists and dicts.
  int depth() const { return depth_; }

 private:
  Kind kind_ = Kind::kUndefined;
  bool tuple_ = false;
  int depth_ = 0;
  int64_t int_ = 0;
  double float_ = 0.0;
  std::shared_ptr<const std::string> string_;  // string value, or the undefined hint
  std::shared_ptr<const Array> array_;
  std::shared_ptr<const Object> object_;
  std::shared_ptr<Namespace> namespace_;
  std::shared_ptr<const Callable> callable_;
};

// Python type name for messages: "int", "str", "list", "dict", "NoneType", ...
const char* type_name(const Value& v);

// Fails with jinja2's UndefinedError when `v` is undefined (any use other than rendering,
// testing, iterating or comparing it).
void require_defined(const Value& v);

// JSON (request data) -> Value and back. Keys keep their order.
Value from_json(const nlohmann::ordered_json& j);

// Python str(v) (what {{ v }} prints; undefined prints "").
std::string to_str(const Value& v);
// Python repr(v) (str() of a list or dict prints its items with repr).
std::string to_repr(const Value& v);
// Python repr() of a float: shortest digits that round-trip, "1.0", "1e+16", "inf", "nan".
std::string float_repr(double f);

// Python ==, < (TypeError for unordered types).
bool equals(const Value& a, const Value& b);
bool less_than(const Value& a, const Value& b);

// transformers' tojson: json.dumps(x, ensure_ascii, indent, separators, sort_keys).
struct JsonStyle {
  bool ensure_ascii = false;
  std::string indent;  // empty: no newlines; else one level's indentation (json.dumps indent)
  bool has_indent = false;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonStyle& style);

// ---- UTF-8 helpers: Python str semantics on UTF-8 bytes ----

// Byte offsets of the code points of `s` (invalid bytes count as one character each), plus the
// end offset: code point i is s[offsets[i], offsets[i+1]).
std::vector<size_t> code_point_offsets(std::string_view s);
size_t code_point_count(std::string_view s);
// Decodes the code point at s[pos] and advances pos (an invalid byte decodes as itself).
char32_t decode_utf8(std::string_view s, size_t& pos);
void append_utf8(std::string& out, char32_t cp);
// Python str.isspace() for one code point.
bool is_python_space(char32_t cp);

}  // namespace moelora::chat::jinja
