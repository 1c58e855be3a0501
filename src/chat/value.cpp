// Value semantics of the chat-template interpreter: Python's str(), repr(), ==, <, truth value
// and json.dumps() reproduced on the Value type (value.h), plus the UTF-8 helpers that give
// strings Python's code-point semantics.
#include "chat/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include <utf8proc.h>

namespace moelora::chat::jinja {

void fail(ErrorCode code, std::string message) {
  throw TemplateError{code, std::move(message)};
}
void type_error(std::string message) {
  fail(ErrorCode::kInvalidArgument, std::move(message));
}

// ---- Object ----

void Object::set(std::string key, Value value) {
  if (auto it = index_.find(key); it != index_.end()) {
    entries_[it->second].second = std::move(value);
    return;
  }
  index_.emplace(key, entries_.size());
  entries_.emplace_back(std::move(key), std::move(value));
}

const Value* Object::find(std::string_view key) const {
  const auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

// ---- Value ----

Value Value::undefined(std::string hint) {
  Value v;
  v.string_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}
Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value::Value(std::string s)
    : kind_(Kind::kString), string_(std::make_shared<const std::string>(std::move(s))) {}
namespace {
int nested_depth(int deepest_item) {
  if (deepest_item + 1 > kMaxValueDepth) {
    fail(ErrorCode::kOutOfRange,
         "value nested deeper than " + std::to_string(kMaxValueDepth) + " levels");
  }
  return deepest_item + 1;
}
}  // namespace

Value::Value(Array a) : kind_(Kind::kArray) {
  int deepest = 0;
  for (const Value& item : a) deepest = std::max(deepest, item.depth_);
  depth_ = nested_depth(deepest);
  array_ = std::make_shared<const Array>(std::move(a));
}
Value Value::tuple(Array a) {
  Value v(std::move(a));
  v.tuple_ = true;
  return v;
}
Value::Value(Object o) : kind_(Kind::kObject) {
  int deepest = 0;
  for (const auto& entry : o.entries()) deepest = std::max(deepest, entry.second.depth_);
  depth_ = nested_depth(deepest);
  object_ = std::make_shared<const Object>(std::move(o));
}
Value::Value(std::shared_ptr<Namespace> ns) : kind_(Kind::kNamespace), namespace_(std::move(ns)) {}
Value::Value(std::shared_ptr<const Callable> fn)
    : kind_(Kind::kCallable), callable_(std::move(fn)) {}

std::string Value::undefined_message() const {
  if (string_ && !string_->empty()) return *string_;
  return "value is undefined";
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool:
    case Kind::kInt: return int_ != 0;
    case Kind::kFloat: return float_ != 0.0;
    case Kind::kString: return !string_->empty();
    case Kind::kArray: return !array_->empty();
    case Kind::kObject: return !object_->empty();
    case Kind::kNamespace:
    case Kind::kCallable: return true;
  }
  return false;
}

const char* type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kArray: return v.is_tuple() ? "tuple" : "list";
    case Value::Kind::kObject: return "dict";
    case Value::Kind::kNamespace: return "Namespace";
    case Value::Kind::kCallable: return "function";
  }
  return "object";
}

void require_defined(const Value& v) {
  if (v.is_undefined()) fail(ErrorCode::kInvalidArgument, v.undefined_message());
}

namespace {
Value from_json_at(const nlohmann::ordered_json& j, int depth) {
  if (depth >= kMaxValueDepth) {  // checked before recursing: the recursion is the risk
    fail(ErrorCode::kOutOfRange,
         "JSON input nested deeper than " + std::to_string(kMaxValueDepth) + " levels");
  }
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) {
        fail(ErrorCode::kOutOfRange, "integer " + std::to_string(u) + " does not fit in 64 bits");
      }
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array a;
      a.reserve(j.size());
      for (const auto& item : j) a.push_back(from_json_at(item, depth + 1));
      return Value(std::move(a));
    }
    case nlohmann::ordered_json::value_t::object: {
      Object o;
      for (const auto& [key, item] : j.items()) o.set(key, from_json_at(item, depth + 1));
      return Value(std::move(o));
    }
    default: fail(ErrorCode::kInvalidArgument, "unsupported JSON value (binary or discarded)");
  }
}
}  // namespace

Value from_json(const nlohmann::ordered_json& j) {
  return from_json_at(j, 0);
}

// ---- UTF-8 ----

char32_t decode_utf8(std::string_view s, size_t& pos) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  int len = 0;
  char32_t cp = 0;
  if (b0 < 0x80) {
    ++pos;
    return b0;
  } else if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07;
  } else {
    ++pos;
    return b0;  // stray byte: one character of its own
  }
  if (pos + len > s.size()) {
    ++pos;
    return b0;
  }
  for (int i = 1; i < len; ++i) {
    const auto b = static_cast<unsigned char>(s[pos + i]);
    if ((b & 0xC0) != 0x80) {
      ++pos;
      return b0;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  pos += len;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::vector<size_t> code_point_offsets(std::string_view s) {
  std::vector<size_t> offsets;
  offsets.reserve(s.size() + 1);
  size_t pos = 0;
  while (pos < s.size()) {
    offsets.push_back(pos);
    decode_utf8(s, pos);
  }
  offsets.push_back(s.size());
  return offsets;
}

size_t code_point_count(std::string_view s) {
  size_t n = 0;
  for (size_t pos = 0; pos < s.size(); ++n) decode_utf8(s, pos);
  return n;
}

bool is_python_space(char32_t cp) {
  // str.isspace(): the characters of bidirectional class WS, B or S, or category Zs.
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// ---- str / repr ----

std::string float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  if (f == 0.0) return std::signbit(f) ? "-0.0" : "0.0";
  // Shortest round-trip digits in scientific form ("d.ddde+XX"), then Python's layout rules.
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string out;
  size_t i = 0;
  if (sci[0] == '-') {
    out.push_back('-');
    i = 1;
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (size_t k = i; k < e; ++k) {
    if (sci[k] != '.') digits.push_back(sci[k]);
  }
  const int exponent = std::stoi(sci.substr(e + 1));
  const int decpt = exponent + 1;  // digits d1 d2 ... stand for 0.d1d2... x 10^decpt
  const int ndigits = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0.";
      out.append(static_cast<size_t>(-decpt), '0');
      out += digits;
    } else if (decpt < ndigits) {
      out.append(digits, 0, static_cast<size_t>(decpt));
      out += '.';
      out.append(digits, static_cast<size_t>(decpt));
    } else {
      out += digits;
      out.append(static_cast<size_t>(decpt - ndigits), '0');
      out += ".0";
    }
  } else {
    out += digits[0];
    if (ndigits > 1) {
      out += '.';
      out.append(digits, 1);
    }
    char exp[16];
    std::snprintf(exp, sizeof(exp), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp;
  }
  return out;
}

namespace {

bool is_printable(char32_t cp) {
  // str.isprintable(): not in categories Cc, Cf, Cs, Co, Cn, Zl, Zp, Zs (space excepted).
  if (cp == ' ') return true;
  if (cp < 0x20 || cp == 0x7F) return false;
  if (cp < 0x7F) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return false;
    default: return true;
  }
}

std::string string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (size_t pos = 0; pos < s.size();) {
    const size_t start = pos;
    const char32_t cp = decode_utf8(s, pos);
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(cp));
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (is_printable(cp)) {
      out.append(s, start, pos - start);
    } else {
      char buf[16];
      if (cp < 0x100) {
        std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(cp));
      } else if (cp < 0x10000) {
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(cp));
      } else {
        std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(cp));
      }
      out += buf;
    }
  }
  out.push_back(quote);
  return out;
}

}  // namespace

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kString: return v.as_string();
    default: return to_repr(v);
  }
}

std::string to_repr(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.as_int());
    case Value::Kind::kFloat: return float_repr(v.as_float());
    case Value::Kind::kString: return string_repr(v.as_string());
    case Value::Kind::kArray: {
      std::string out = v.is_tuple() ? "(" : "[";
      bool first = true;
      for (const Value& item : v.as_array()) {
        if (!first) out += ", ";
        first = false;
        out += to_repr(item);
      }
      if (v.is_tuple()) return out + (v.as_array().size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Value::Kind::kObject: {
      std::string out = "{";
      bool first = true;
      for (const auto& [key, item] : v.as_object().entries()) {
        if (!first) out += ", ";
        first = false;
        out += string_repr(key) + ": " + to_repr(item);
      }
      return out + "}";
    }
    case Value::Kind::kNamespace: return "<Namespace>";
    case Value::Kind::kCallable: return "<function " + v.as_callable().name + ">";
  }
  return "";
}

// ---- comparisons ----

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.as_string() == b.as_string();
    case Value::Kind::kArray: {
      const Array& x = a.as_array();
      const Array& y = b.as_array();
      if (x.size() != y.size() || a.is_tuple() != b.is_tuple()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!equals(x[i], y[i])) return false;
      }
      return true;
    }
    case Value::Kind::kObject: {
      const Object& x = a.as_object();
      const Object& y = b.as_object();
      if (x.size() != y.size()) return false;
      for (const auto& [key, item] : x.entries()) {
        const Value* other = y.find(key);
        if (other == nullptr || !equals(item, *other)) return false;
      }
      return true;
    }
    case Value::Kind::kNamespace: return &a.as_namespace() == &b.as_namespace();
    case Value::Kind::kCallable: return &a.as_callable() == &b.as_callable();
    default: return false;
  }
}

bool less_than(const Value& a, const Value& b) {
  require_defined(a);
  require_defined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() < b.as_float();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();  // code point order
  if (a.is_array() && b.is_array() && a.is_tuple() == b.is_tuple()) {
    const Array& x = a.as_array();
    const Array& y = b.as_array();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return less_than(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  type_error(std::string("'<' not supported between instances of '") + type_name(a) + "' and '" +
             type_name(b) + "'");
}

// ---- json.dumps ----

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out.push_back('"');
  for (size_t pos = 0; pos < s.size();) {
    const size_t start = pos;
    const char32_t cp = decode_utf8(s, pos);
    char buf[16];
    switch (cp) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (cp < 0x20 || (ensure_ascii && cp >= 0x7F)) {
          if (cp >= 0x10000) {  // UTF-16 surrogate pair, as json.dumps writes it
            const char32_t v = cp - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x",
                          static_cast<unsigned>(0xD800 + (v >> 10)),
                          static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(cp));
          }
          out += buf;
        } else {
          out.append(s, start, pos - start);
        }
    }
  }
  out.push_back('"');
}

void json_value(std::string& out, const Value& v, const JsonStyle& style, int depth) {
  if (depth > 512) fail(ErrorCode::kOutOfRange, "tojson: value nested deeper than 512 levels");
  const auto newline = [&](int level) {
    out.push_back('\n');
    for (int i = 0; i < level; ++i) out += style.indent;
  };
  switch (v.kind()) {
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.as_int()); return;
    case Value::Kind::kFloat: {
      const double f = v.as_float();
      if (std::isnan(f)) {
        out += "NaN";
      } else if (std::isinf(f)) {
        out += f > 0 ? "Infinity" : "-Infinity";
      } else {
        out += float_repr(f);
      }
      return;
    }
    case Value::Kind::kString: json_string(out, v.as_string(), style.ensure_ascii); return;
    case Value::Kind::kArray: {
      const Array& a = v.as_array();
      if (a.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < a.size(); ++i) {
        if (i > 0) out += style.item_separator;
        if (style.has_indent) newline(depth + 1);
        json_value(out, a[i], style, depth + 1);
      }
      if (style.has_indent) newline(depth);
      out.push_back(']');
      return;
    }
    case Value::Kind::kObject: {
      const Object& o = v.as_object();
      if (o.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& entry : o.entries()) entries.push_back(&entry);
      if (style.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](const auto* x, const auto* y) { return x->first < y->first; });
      }
      out.push_back('{');
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i > 0) out += style.item_separator;
        if (style.has_indent) newline(depth + 1);
        json_string(out, entries[i]->first, style.ensure_ascii);
        out += style.key_separator;
        json_value(out, entries[i]->second, style, depth + 1);
      }
      if (style.has_indent) newline(depth);
      out.push_back('}');
      return;
    }
    default:
      type_error(std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonStyle& style) {
  std::string out;
  json_value(out, v, style, 0);
  return out;
}

}  // namespace moelora::chat::jinja
