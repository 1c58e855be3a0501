// Python object behaviour the chat templates rely on: attribute and item access as jinja2's
// sandbox performs it, slicing, iteration, the str / dict / list methods
// (content.split('</think>'), message.get('name'), ...) and the range / namespace / dict globals.
//
// The sandbox is jinja2's ImmutableSandboxedEnvironment: methods that would change a list or a
// dict (append, pop, update, ...) are refused, as transformers renders with it.
#include <algorithm>
#include <cmath>

#include <utf8proc.h>

#include "chat/jinja.h"

namespace moelora::chat::jinja {
namespace {

const char* const kStringMethods[] = {"startswith", "endswith", "strip",      "lstrip",  "rstrip",
                                      "split",      "rsplit",   "splitlines", "replace", "upper",
                                      "lower",      "title",    "capitalize", "find",    "rfind",
                                      "count",      "join",     "isspace",    "isdigit", "isalpha",
                                      "isalnum",    "islower",  "isupper",    "format"};
const char* const kDictMethods[] = {"get", "items", "keys", "values", "copy"};
const char* const kDictUnsafe[] = {"pop", "popitem", "setdefault", "update", "clear"};
const char* const kListMethods[] = {"index", "count", "copy"};
const char* const kListUnsafe[] = {"append", "extend",  "insert", "pop",
                                   "remove", "reverse", "sort",   "clear"};

template <size_t N>
bool in(const char* const (&names)[N], std::string_view name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

bool has_method(const Value& obj, std::string_view name) {
  if (obj.is_string()) return in(kStringMethods, name);
  if (obj.is_object()) return in(kDictMethods, name);
  if (obj.is_array()) return in(kListMethods, name);
  return false;
}

bool is_unsafe(const Value& obj, std::string_view name) {
  return (obj.is_object() && in(kDictUnsafe, name)) || (obj.is_array() && in(kListUnsafe, name));
}

std::string unsafe_message(const Value& obj, std::string_view name) {
  return "access to attribute '" + std::string(name) + "' of '" + type_name(obj) +
         "' object is unsafe (templates render in an immutable sandbox)";
}

// obj.name as a value (a bound method), for `{% if text.startswith %}` or `f = text.split`.
Value bound_method(const Value& obj, std::string_view name) {
  return Value(std::make_shared<const Callable>(
      Callable{std::string(name), [obj, method = std::string(name)](CallArgs& args) {
                 Value result;
                 call_method(obj, method, args, SIZE_MAX, result);
                 return result;
               }}));
}

Value missing_attribute(const Value& obj, std::string_view name) {
  const std::string what = obj.is_none() ? "None" : std::string(type_name(obj)) + " object";
  return Value::undefined("'" + what + "' has no attribute '" + std::string(name) + "'");
}

int64_t int_arg(const Value* v, int64_t fallback, const char* what) {
  if (v == nullptr || v->is_none()) return fallback;
  if (!v->is_int() && !v->is_bool())
    type_error(std::string(what) + " must be an integer, not " + type_name(*v));
  return v->as_int();
}

const std::string& string_arg(const Value* v, const char* what) {
  if (v == nullptr || !v->is_string()) {
    type_error(std::string(what) + " must be str, not " + (v ? type_name(*v) : "nothing"));
  }
  return v->as_string();
}

// ---- str helpers (code-point aware) ----

std::vector<char32_t> decode_all(std::string_view s) {
  std::vector<char32_t> cps;
  for (size_t pos = 0; pos < s.size();) cps.push_back(decode_utf8(s, pos));
  return cps;
}

std::string strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::vector<char32_t> set;
  const bool whitespace = chars == nullptr || chars->is_none();
  if (!whitespace) set = decode_all(string_arg(chars, "strip arg"));
  const auto strip_it = [&](char32_t cp) {
    return whitespace ? is_python_space(cp) : std::find(set.begin(), set.end(), cp) != set.end();
  };
  const std::vector<size_t> offsets = code_point_offsets(s);
  size_t begin = 0;
  size_t end = offsets.size() - 1;
  while (left && begin < end) {
    size_t pos = offsets[begin];
    if (!strip_it(decode_utf8(s, pos))) break;
    ++begin;
  }
  while (right && end > begin) {
    size_t pos = offsets[end - 1];
    if (!strip_it(decode_utf8(s, pos))) break;
    --end;
  }
  return s.substr(offsets[begin], offsets[end] - offsets[begin]);
}

Array split(const std::string& s, const Value* sep_arg, int64_t maxsplit, bool from_right) {
  Array parts;
  if (sep_arg == nullptr || sep_arg->is_none()) {  // runs of whitespace, no empty strings
    std::vector<std::pair<size_t, size_t>> words;
    size_t pos = 0;
    while (pos < s.size()) {
      size_t next = pos;
      if (is_python_space(decode_utf8(s, next))) {
        pos = next;
        continue;
      }
      size_t end = pos;
      while (end < s.size()) {
        size_t after = end;
        if (is_python_space(decode_utf8(s, after))) break;
        end = after;
      }
      words.emplace_back(pos, end);
      pos = end;
    }
    if (maxsplit >= 0 && static_cast<size_t>(maxsplit) < words.size()) {
      // The unsplit remainder keeps its whitespace on the side away from the split.
      if (from_right) {
        const size_t keep = words.size() - static_cast<size_t>(maxsplit);
        parts.push_back(Value(s.substr(0, words[keep - 1].second)));
        for (size_t i = keep; i < words.size(); ++i) {
          parts.push_back(Value(s.substr(words[i].first, words[i].second - words[i].first)));
        }
      } else {
        for (size_t i = 0; i < static_cast<size_t>(maxsplit); ++i) {
          parts.push_back(Value(s.substr(words[i].first, words[i].second - words[i].first)));
        }
        parts.push_back(Value(s.substr(words[maxsplit].first)));
      }
      return parts;
    }
    for (const auto& [b, e] : words) parts.push_back(Value(s.substr(b, e - b)));
    return parts;
  }
  const std::string& sep = string_arg(sep_arg, "separator");
  if (sep.empty()) type_error("empty separator");
  std::vector<std::string> pieces;
  if (!from_right) {
    size_t start = 0;
    while (maxsplit < 0 || static_cast<int64_t>(pieces.size()) < maxsplit) {
      const size_t hit = s.find(sep, start);
      if (hit == std::string::npos) break;
      pieces.push_back(s.substr(start, hit - start));
      start = hit + sep.size();
    }
    pieces.push_back(s.substr(start));
  } else {
    size_t end = s.size();
    std::vector<std::string> reversed;
    while (maxsplit < 0 || static_cast<int64_t>(reversed.size()) < maxsplit) {
      if (end < sep.size()) break;
      const size_t hit = s.rfind(sep, end - sep.size());
      if (hit == std::string::npos) break;
      reversed.push_back(s.substr(hit + sep.size(), end - hit - sep.size()));
      end = hit;
    }
    pieces.push_back(s.substr(0, end));
    pieces.insert(pieces.end(), reversed.rbegin(), reversed.rend());
  }
  for (std::string& p : pieces) parts.push_back(Value(std::move(p)));
  return parts;
}

char32_t map_case(char32_t cp, int how) {  // 0 lower, 1 upper, 2 title
  const auto c = static_cast<utf8proc_int32_t>(cp);
  return static_cast<char32_t>(how == 0   ? utf8proc_tolower(c)
                               : how == 1 ? utf8proc_toupper(c)
                                          : utf8proc_totitle(c));
}
bool is_cased(char32_t cp) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

std::string change_case(const std::string& s, int how) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) append_utf8(out, map_case(decode_utf8(s, pos), how));
  return out;
}

std::string python_title(const std::string& s) {
  std::string out;
  bool previous_cased = false;
  for (size_t pos = 0; pos < s.size();) {
    const char32_t cp = decode_utf8(s, pos);
    const bool cased = is_cased(cp);
    append_utf8(out, cased ? map_case(cp, previous_cased ? 0 : 2) : cp);
    previous_cased = cased;
  }
  return out;
}

bool all_chars(const std::string& s, bool (*pred)(char32_t)) {
  if (s.empty()) return false;
  for (size_t pos = 0; pos < s.size();) {
    if (!pred(decode_utf8(s, pos))) return false;
  }
  return true;
}
bool category_is(char32_t cp, std::initializer_list<utf8proc_category_t> cats) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return std::find(cats.begin(), cats.end(), cat) != cats.end();
}

// Code-point index of byte offset `byte` in `s`.
int64_t char_index(const std::string& s, size_t byte) {
  return static_cast<int64_t>(code_point_count(std::string_view(s).substr(0, byte)));
}

// [start, end) window of str.find / startswith arguments, as byte offsets.
std::pair<size_t, size_t> window(const std::string& s, const Value* start, const Value* end) {
  const std::vector<size_t> offsets = code_point_offsets(s);
  const auto n = static_cast<int64_t>(offsets.size() - 1);
  const auto clamp = [&](int64_t i) {
    if (i < 0) i += n;
    return std::clamp<int64_t>(i, 0, n);
  };
  const int64_t b = clamp(int_arg(start, 0, "start"));
  const int64_t e = clamp(int_arg(end, n, "end"));
  return {offsets[b], offsets[std::max(b, e)]};
}

Value string_method(const std::string& s, std::string_view name, CallArgs& args,
                    size_t max_string) {
  if (name == "startswith" || name == "endswith") {
    check_arg_count(args, name, 3, {});
    const Value* prefix = find_arg(args, 0, "");
    const auto [b, e] = window(s, find_arg(args, 1, ""), find_arg(args, 2, ""));
    const std::string_view text = std::string_view(s).substr(b, e - b);
    const auto matches = [&](const Value& p) {
      const std::string& affix =
          string_arg(&p, name == "startswith" ? "startswith arg" : "endswith arg");
      if (affix.size() > text.size()) return false;
      return name == "startswith" ? text.substr(0, affix.size()) == affix
                                  : text.substr(text.size() - affix.size()) == affix;
    };
    if (prefix != nullptr && prefix->is_array()) {
      for (const Value& p : prefix->as_array()) {
        if (matches(p)) return Value(true);
      }
      return Value(false);
    }
    if (prefix == nullptr) type_error(std::string(name) + "() takes at least 1 argument (0 given)");
    return Value(matches(*prefix));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    check_arg_count(args, name, 1, {});
    return Value(strip(s, find_arg(args, 0, ""), name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    check_arg_count(args, name, 2, {"sep", "maxsplit"});
    return Value(split(s, find_arg(args, 0, "sep"),
                       int_arg(find_arg(args, 1, "maxsplit"), -1, "maxsplit"), name == "rsplit"));
  }
  if (name == "splitlines") {
    check_arg_count(args, name, 1, {"keepends"});
    const Value* keep = find_arg(args, 0, "keepends");
    const bool keepends = keep != nullptr && keep->truthy();
    Array lines;
    size_t start = 0;
    for (size_t pos = 0; pos < s.size();) {
      const size_t at = pos;
      const char32_t cp = decode_utf8(s, pos);
      const bool brk = cp == '\n' || cp == '\r' || cp == '\v' || cp == '\f' || cp == 0x1C ||
                       cp == 0x1D || cp == 0x1E || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
      if (!brk) continue;
      if (cp == '\r' && pos < s.size() && s[pos] == '\n') ++pos;
      lines.push_back(Value(s.substr(start, (keepends ? pos : at) - start)));
      start = pos;
    }
    if (start < s.size()) lines.push_back(Value(s.substr(start)));
    return Value(std::move(lines));
  }
  if (name == "replace") {
    check_arg_count(args, name, 3, {"count"});
    const std::string& old = string_arg(find_arg(args, 0, ""), "replace() argument 1");
    const std::string& with = string_arg(find_arg(args, 1, ""), "replace() argument 2");
    int64_t count = int_arg(find_arg(args, 2, "count"), -1, "count");
    std::string out;
    if (old.empty()) {  // Python inserts `with` around every character
      const std::vector<size_t> offsets = code_point_offsets(s);
      const size_t n = offsets.size() - 1;
      for (size_t i = 0; i <= n && out.size() <= max_string; ++i) {
        if (count != 0) {
          out += with;
          --count;
        }
        if (i < n) out.append(s, offsets[i], offsets[i + 1] - offsets[i]);
      }
    } else {
      size_t start = 0;
      while (count != 0) {
        const size_t hit = s.find(old, start);
        if (hit == std::string::npos) break;
        out.append(s, start, hit - start);
        out += with;
        start = hit + old.size();
        --count;
        if (out.size() > max_string) break;
      }
      out.append(s, start, std::string::npos);
    }
    if (out.size() > max_string) fail(ErrorCode::kOutOfRange, "replace(): result too large");
    return Value(std::move(out));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    check_arg_count(args, name, 0, {});
    if (name == "upper") return Value(change_case(s, 1));
    if (name == "lower") return Value(change_case(s, 0));
    if (name == "title") return Value(python_title(s));
    std::string out;
    size_t pos = 0;
    if (!s.empty()) append_utf8(out, map_case(decode_utf8(s, pos), 2));
    return Value(out + change_case(s.substr(pos), 0));
  }
  if (name == "find" || name == "rfind" || name == "count") {
    check_arg_count(args, name, 3, {});
    const std::string& sub = string_arg(find_arg(args, 0, ""), std::string(name).c_str());
    const auto [b, e] = window(s, find_arg(args, 1, ""), find_arg(args, 2, ""));
    const std::string text = s.substr(b, e - b);
    if (name == "count") {
      if (sub.empty()) return Value(static_cast<int64_t>(code_point_count(text) + 1));
      int64_t n = 0;
      for (size_t at = text.find(sub); at != std::string::npos;
           at = text.find(sub, at + sub.size()))
        ++n;
      return Value(n);
    }
    const size_t hit = name == "find" ? text.find(sub) : text.rfind(sub);
    if (hit == std::string::npos) return Value(int64_t{-1});
    return Value(char_index(s, b + hit));
  }
  if (name == "join") {
    check_arg_count(args, name, 1, {});
    const Value* items = find_arg(args, 0, "");
    if (items == nullptr) type_error("join() takes exactly one argument (0 given)");
    std::string out;
    size_t i = 0;
    for (const Value& item : iterate(*items)) {
      if (!item.is_string()) {
        type_error("sequence item " + std::to_string(i) + ": expected str instance, " +
                   type_name(item) + " found");
      }
      if (i++ > 0) out += s;
      out += item.as_string();
      if (out.size() > max_string) fail(ErrorCode::kOutOfRange, "join(): result too large");
    }
    return Value(std::move(out));
  }
  if (name == "format") {
    fail(ErrorCode::kUnsupported, "str.format() is not supported in chat templates; use ~ or +");
  }
  check_arg_count(args, name, 0, {});
  if (name == "isspace") return Value(all_chars(s, is_python_space));
  if (name == "isdigit") {
    return Value(all_chars(s, [](char32_t cp) { return category_is(cp, {UTF8PROC_CATEGORY_ND}); }));
  }
  if (name == "isalpha") {
    return Value(all_chars(s, [](char32_t cp) {
      return category_is(cp, {UTF8PROC_CATEGORY_LU, UTF8PROC_CATEGORY_LL, UTF8PROC_CATEGORY_LT,
                              UTF8PROC_CATEGORY_LM, UTF8PROC_CATEGORY_LO});
    }));
  }
  if (name == "isalnum") {
    return Value(all_chars(s, [](char32_t cp) {
      return category_is(cp, {UTF8PROC_CATEGORY_LU, UTF8PROC_CATEGORY_LL, UTF8PROC_CATEGORY_LT,
                              UTF8PROC_CATEGORY_LM, UTF8PROC_CATEGORY_LO, UTF8PROC_CATEGORY_ND,
                              UTF8PROC_CATEGORY_NL, UTF8PROC_CATEGORY_NO});
    }));
  }
  // islower / isupper: some cased character, and none of the other case.
  const bool want_lower = name == "islower";
  bool any_cased = false;
  for (size_t pos = 0; pos < s.size();) {
    const char32_t cp = decode_utf8(s, pos);
    const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    if (cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LT) {
      if (want_lower) return Value(false);
      any_cased = true;
    } else if (cat == UTF8PROC_CATEGORY_LL) {
      if (!want_lower) return Value(false);
      any_cased = true;
    }
  }
  return Value(any_cased);
}

Value dict_method(const Value& obj, std::string_view name, CallArgs& args) {
  const Object& o = obj.as_object();
  if (name == "get") {
    check_arg_count(args, name, 2, {});
    const Value* key = find_arg(args, 0, "");
    if (key == nullptr) type_error("get expected at least 1 argument, got 0");
    const Value* fallback = find_arg(args, 1, "");
    const Value* found = key->is_string() ? o.find(key->as_string()) : nullptr;
    if (found != nullptr) return *found;
    return fallback ? *fallback : Value::none();
  }
  check_arg_count(args, name, 0, {});
  if (name == "copy") return obj;
  Array out;
  out.reserve(o.size());
  for (const auto& [key, value] : o.entries()) {
    if (name == "items") {
      out.push_back(Value::tuple(Array{Value(key), value}));
    } else {
      out.push_back(name == "keys" ? Value(key) : value);
    }
  }
  return Value(std::move(out));
}

Value list_method(const Value& obj, std::string_view name, CallArgs& args) {
  const Array& a = obj.as_array();
  if (name == "copy") {
    check_arg_count(args, name, 0, {});
    return obj;
  }
  check_arg_count(args, name, 1, {});
  const Value* x = find_arg(args, 0, "");
  if (x == nullptr) type_error(std::string(name) + "() takes exactly one argument (0 given)");
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!equals(a[i], *x)) continue;
    if (name == "index") return Value(static_cast<int64_t>(i));
    ++n;
  }
  if (name == "index") type_error(to_repr(*x) + " is not in list");
  return Value(n);
}

}  // namespace

const Value* find_arg(const CallArgs& args, size_t index, std::string_view name) {
  if (index < args.positional.size()) return &args.positional[index];
  if (!name.empty()) {
    for (const auto& [key, value] : args.keyword) {
      if (key == name) return &value;
    }
  }
  return nullptr;
}

void check_arg_count(const CallArgs& args, std::string_view what, size_t max_positional,
                     std::initializer_list<std::string_view> keywords) {
  if (args.positional.size() > max_positional) {
    type_error(std::string(what) + "() takes at most " + std::to_string(max_positional) +
               " argument(s) (" + std::to_string(args.positional.size()) + " given)");
  }
  for (const auto& [key, value] : args.keyword) {
    if (std::find(keywords.begin(), keywords.end(), key) == keywords.end()) {
      type_error(std::string(what) + "() got an unexpected keyword argument '" + key + "'");
    }
  }
}

bool call_method(const Value& obj, std::string_view name, CallArgs& args, size_t max_string,
                 Value& result) {
  if (is_unsafe(obj, name)) fail(ErrorCode::kInvalidArgument, unsafe_message(obj, name));
  if (!has_method(obj, name)) return false;
  if (obj.is_string()) {
    result = string_method(obj.as_string(), name, args, max_string);
  } else if (obj.is_object()) {
    result = dict_method(obj, name, args);
  } else {
    result = list_method(obj, name, args);
  }
  return true;
}

Value get_attribute(const Value& obj, std::string_view name, bool items_too) {
  require_defined(obj);
  if (is_unsafe(obj, name)) return Value::undefined(unsafe_message(obj, name));
  if (has_method(obj, name)) return bound_method(obj, name);  // Python getattr comes first
  if (obj.is_object() && items_too) {
    if (const Value* v = obj.as_object().find(name)) return *v;
  } else if (obj.is_namespace()) {
    if (const Value* v = obj.as_namespace().attributes.find(name)) return *v;
  }
  return missing_attribute(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  require_defined(obj);
  if (obj.is_object() && key.is_string()) {  // obj[key] first, then getattr
    if (const Value* v = obj.as_object().find(key.as_string())) return *v;
    return get_attribute(obj, key.as_string());
  }
  if ((obj.is_array() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    const auto n = obj.is_array() ? static_cast<int64_t>(obj.as_array().size())
                                  : static_cast<int64_t>(code_point_count(obj.as_string()));
    int64_t i = key.as_int();
    if (i < 0) i += n;
    if (i < 0 || i >= n)
      return Value::undefined(std::string(type_name(obj)) + " index out of range");
    if (obj.is_array()) return obj.as_array()[static_cast<size_t>(i)];
    const std::vector<size_t> offsets = code_point_offsets(obj.as_string());
    return Value(obj.as_string().substr(offsets[i], offsets[i + 1] - offsets[i]));
  }
  if (key.is_string()) return get_attribute(obj, key.as_string());
  return Value::undefined(std::string("'") + type_name(obj) + " object' has no item " +
                          to_repr(key));
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  require_defined(obj);
  if (!obj.is_array() && !obj.is_string())
    return Value::undefined(std::string(type_name(obj)) + " cannot be sliced");
  const auto bound = [](const Value& v, bool& present) -> int64_t {
    present = !v.is_undefined() && !v.is_none();
    if (!present) return 0;
    if (!v.is_int() && !v.is_bool()) type_error("slice indices must be integers or None");
    return v.as_int();
  };
  bool has_start, has_stop, has_step;
  int64_t b = bound(start, has_start);
  int64_t e = bound(stop, has_stop);
  const int64_t s = bound(step, has_step);
  const int64_t stride = has_step ? s : 1;
  if (stride == 0) type_error("slice step cannot be zero");
  std::vector<size_t> offsets;
  int64_t n;
  if (obj.is_array()) {
    n = static_cast<int64_t>(obj.as_array().size());
  } else {
    offsets = code_point_offsets(obj.as_string());
    n = static_cast<int64_t>(offsets.size()) - 1;
  }
  // CPython PySlice_AdjustIndices.
  const auto adjust = [&](int64_t& i, bool present, int64_t fallback) {
    if (!present) {
      i = fallback;
    } else if (i < 0) {
      i += n;
      if (i < 0) i = stride < 0 ? -1 : 0;
    } else if (i >= n) {
      i = stride < 0 ? n - 1 : n;
    }
  };
  adjust(b, has_start, stride < 0 ? n - 1 : 0);
  adjust(e, has_stop, stride < 0 ? -1 : n);
  std::vector<int64_t> picked;
  for (int64_t i = b; stride > 0 ? i < e : i > e; i += stride) picked.push_back(i);
  if (obj.is_array()) {
    Array out;
    out.reserve(picked.size());
    for (int64_t i : picked) out.push_back(obj.as_array()[static_cast<size_t>(i)]);
    return obj.is_tuple() ? Value::tuple(std::move(out)) : Value(std::move(out));
  }
  std::string out;
  if (stride == 1 && !picked.empty())
    return Value(obj.as_string().substr(offsets[b], offsets[e] - offsets[b]));
  for (int64_t i : picked) out.append(obj.as_string(), offsets[i], offsets[i + 1] - offsets[i]);
  return Value(std::move(out));
}

Array iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return {};
    case Value::Kind::kArray: return v.as_array();
    case Value::Kind::kObject: {
      Array keys;
      keys.reserve(v.as_object().size());
      for (const auto& [key, value] : v.as_object().entries()) keys.push_back(Value(key));
      return keys;
    }
    case Value::Kind::kString: {
      Array chars;
      const std::string& s = v.as_string();
      for (size_t pos = 0; pos < s.size();) {
        const size_t start = pos;
        decode_utf8(s, pos);
        chars.push_back(Value(s.substr(start, pos - start)));
      }
      return chars;
    }
    default: type_error(std::string("'") + type_name(v) + "' object is not iterable");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined: return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        type_error(std::string("'in <string>' requires string as left operand, not ") +
                   type_name(item));
      }
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kArray:
      for (const Value& v : container.as_array()) {
        if (equals(v, item)) return true;
      }
      return false;
    case Value::Kind::kObject:
      return item.is_string() && container.as_object().find(item.as_string()) != nullptr;
    default:
      type_error(std::string("argument of type '") + type_name(container) + "' is not iterable");
  }
}

int64_t length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return 0;
    case Value::Kind::kString: return static_cast<int64_t>(code_point_count(v.as_string()));
    case Value::Kind::kArray: return static_cast<int64_t>(v.as_array().size());
    case Value::Kind::kObject: return static_cast<int64_t>(v.as_object().size());
    default: type_error(std::string("object of type '") + type_name(v) + "' has no len()");
  }
}

Value builtin_global(std::string_view name) {
  static const Value kRange(std::make_shared<const Callable>(Callable{
      "range", [](CallArgs& args) -> Value {
        check_arg_count(args, "range", 3, {});
        if (args.positional.empty()) type_error("range expected at least 1 argument, got 0");
        int64_t start = 0, stop, step = 1;
        if (args.positional.size() == 1) {
          stop = int_arg(&args.positional[0], 0, "range() argument");
        } else {
          start = int_arg(&args.positional[0], 0, "range() argument");
          stop = int_arg(&args.positional[1], 0, "range() argument");
          if (args.positional.size() == 3)
            step = int_arg(&args.positional[2], 1, "range() argument");
        }
        if (step == 0) type_error("range() arg 3 must not be zero");
        // jinja2's sandbox refuses ranges of more than MAX_RANGE = 100000 items.
        const double count =
            std::max(0.0, std::ceil((static_cast<double>(stop) - static_cast<double>(start)) /
                                    static_cast<double>(step)));
        if (count > 100000) {
          fail(ErrorCode::kOutOfRange, "range too big: the sandbox allows at most 100000 items");
        }
        Array items;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
          items.push_back(Value(i));
        return Value(std::move(items));
      }}));
  static const Value kNamespace(std::make_shared<const Callable>(
      Callable{"namespace", [](CallArgs& args) -> Value {
                 auto ns = std::make_shared<Namespace>();
                 if (args.positional.size() > 1)
                   type_error("namespace() takes at most 1 positional argument");
                 if (!args.positional.empty()) {
                   if (!args.positional[0].is_object())
                     type_error("namespace() positional argument must be a dict");
                   for (const auto& [key, value] : args.positional[0].as_object().entries())
                     ns->attributes.set(key, value);
                 }
                 for (auto& [key, value] : args.keyword) ns->attributes.set(key, value);
                 return Value(std::move(ns));
               }}));
  static const Value kDict(std::make_shared<const Callable>(
      Callable{"dict", [](CallArgs& args) -> Value {
                 Object o;
                 if (args.positional.size() > 1) type_error("dict expected at most 1 argument");
                 if (!args.positional.empty()) {
                   const Value& src = args.positional[0];
                   if (src.is_object()) {
                     o = src.as_object();
                   } else {
                     for (const Value& pair : iterate(src)) {
                       const Array kv = iterate(pair);
                       if (kv.size() != 2 || !kv[0].is_string())
                         type_error("dict() needs (str key, value) pairs");
                       o.set(kv[0].as_string(), kv[1]);
                     }
                   }
                 }
                 for (auto& [key, value] : args.keyword) o.set(key, value);
                 return Value(std::move(o));
               }}));
  if (name == "range") return kRange;
  if (name == "namespace") return kNamespace;
  if (name == "dict") return kDict;
  return Value();
}

}  // namespace moelora::chat::jinja
