// Filters ({{ x | name(args) }}) and tests ({% if x is name %}) of the chat-template
// interpreter, with the semantics of jinja2 3.1's builtins, except tojson, which is the one
// transformers installs: json.dumps(x, ensure_ascii=False, indent, separators, sort_keys) with no
// HTML escaping.
//
// Filters that produce sequences (map, select, reverse, ...) return lists where jinja2 returns
// generators; the templates only iterate them or pipe them into list / join / length.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "chat/jinja.h"

namespace moelora::chat::jinja {
namespace {

using FilterFn = Value (*)(const Value&, CallArgs&, size_t);

const Value* arg(CallArgs& args, size_t index, std::string_view name) {
  return find_arg(args, index, name);
}

bool bool_arg(const Value* v, bool fallback) {
  return v == nullptr ? fallback : v->truthy();
}

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

Value method(const Value& obj, std::string_view name, CallArgs args, size_t max_string) {
  Value result;
  call_method(obj, name, args, max_string, result);
  return result;
}

// jinja2 make_attrgetter: "a.b.0" looks up item by item (digits as list indices).
Value attribute_path(const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool digits =
        !part.empty() && part.size() < 19 &&
        std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    v = get_item(v, digits ? Value(static_cast<int64_t>(std::stoll(part))) : Value(part));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

// Sort key of sort / unique / min / max / dictsort: strings compare case-insensitively unless
// case_sensitive (jinja2 ignore_case).
Value sort_key(const Value& v, bool case_sensitive) {
  if (case_sensitive || !v.is_string()) return v;
  return method(v, "lower", {}, SIZE_MAX);
}

std::vector<Value> keyed(const Array& items, const Value* attribute, bool case_sensitive) {
  std::vector<Value> keys;
  keys.reserve(items.size());
  for (const Value& item : items) {
    const Value k =
        attribute && !attribute->is_none() ? attribute_path(item, to_str(*attribute)) : item;
    keys.push_back(sort_key(k, case_sensitive));
  }
  return keys;
}

// ---- filters ----

Value f_abs(const Value& v, CallArgs&, size_t) {
  require_defined(v);
  if (v.is_float()) return Value(std::fabs(v.as_float()));
  if (!v.is_number()) type_error(std::string("bad operand type for abs(): '") + type_name(v) + "'");
  if (v.as_int() == INT64_MIN) fail(ErrorCode::kOutOfRange, "integer overflow");
  return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
}

// jinja2's attr filter uses getattr only: dict keys are not attributes.
Value f_attr(const Value& v, CallArgs& args, size_t) {
  const Value* name = arg(args, 0, "name");
  if (name == nullptr) type_error("attr() needs an attribute name");
  return get_attribute(v, to_str(*name), /*items_too=*/false);
}

Value f_capitalize(const Value& v, CallArgs&, size_t max) {
  return method(Value(to_str(v)), "capitalize", {}, max);
}

Value f_default(const Value& v, CallArgs& args, size_t) {
  check_arg_count(args, "default", 2, {"default_value", "boolean"});
  const Value* fallback = arg(args, 0, "default_value");
  const bool boolean = bool_arg(arg(args, 1, "boolean"), false);
  if (v.is_undefined() || (boolean && !v.truthy()))
    return fallback ? *fallback : Value(std::string());
  return v;
}

Value f_dictsort(const Value& v, CallArgs& args, size_t) {
  check_arg_count(args, "dictsort", 3, {"case_sensitive", "by", "reverse"});
  if (!v.is_object()) type_error("dictsort: value must be a dict");
  const bool case_sensitive = bool_arg(arg(args, 0, "case_sensitive"), false);
  const Value* by = arg(args, 1, "by");
  const bool by_value = by != nullptr && to_str(*by) == "value";
  if (by != nullptr && !by_value && to_str(*by) != "key")
    type_error("You can only sort by either \"key\" or \"value\"");
  const bool reverse = bool_arg(arg(args, 2, "reverse"), false);
  Array pairs;
  for (const auto& [key, value] : v.as_object().entries())
    pairs.push_back(Value::tuple(Array{Value(key), value}));
  std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& a, const Value& b) {
    const Value& x = a.as_array()[by_value ? 1 : 0];
    const Value& y = b.as_array()[by_value ? 1 : 0];
    return reverse ? less_than(sort_key(y, case_sensitive), sort_key(x, case_sensitive))
                   : less_than(sort_key(x, case_sensitive), sort_key(y, case_sensitive));
  });
  return Value(std::move(pairs));
}

Value f_escape(const Value& v, CallArgs&, size_t) {
  return Value(html_escape(to_str(v)));
}

Value f_first(const Value& v, CallArgs&, size_t) {
  const Array items = iterate(v);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value f_last(const Value& v, CallArgs&, size_t) {
  const Array items = iterate(v);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

// Python float(str): optional whitespace, sign, digits / inf / nan; false when not a number.
bool parse_float(const std::string& text, double& out) {
  std::string s = method(Value(text), "strip", {}, SIZE_MAX).as_string();
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}

Value f_float(const Value& v, CallArgs& args, size_t) {
  check_arg_count(args, "float", 1, {"default"});
  const Value* fallback = arg(args, 0, "default");
  require_defined(v);  // float(Undefined) fails in jinja2
  double f;
  if (v.is_number()) return Value(v.as_float());
  if (v.is_string() && parse_float(v.as_string(), f)) return Value(f);
  return fallback ? *fallback : Value(0.0);
}

Value f_indent(const Value& v, CallArgs& args, size_t max) {
  check_arg_count(args, "indent", 3, {"width", "first", "blank"});
  const Value* width = arg(args, 0, "width");
  const std::string indention =
      width == nullptr ? "    "
      : width->is_string()
          ? width->as_string()
          : std::string(static_cast<size_t>(std::max<int64_t>(width->as_int(), 0)), ' ');
  const bool first = bool_arg(arg(args, 1, "first"), false);
  const bool blank = bool_arg(arg(args, 2, "blank"), false);
  require_defined(v);
  if (!v.is_string()) type_error(std::string("indent: expected a string, got ") + type_name(v));
  const Array lines = method(Value(v.as_string() + "\n"), "splitlines", {}, max).as_array();
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i].as_string();
    if (i > 0) {
      out += "\n";
      if (blank || !line.empty()) out += indention;
    }
    out += line;
    if (out.size() > max) fail(ErrorCode::kOutOfRange, "indent(): result too large");
  }
  return Value(first ? indention + out : out);
}

Value f_int(const Value& v, CallArgs& args, size_t) {
  check_arg_count(args, "int", 2, {"default", "base"});
  const Value* fallback = arg(args, 0, "default");
  const Value* base = arg(args, 1, "base");
  if (base != nullptr && !(base->is_int() && base->as_int() == 10)) {
    fail(ErrorCode::kUnsupported, "int(): only base 10 is supported");
  }
  require_defined(v);  // int(Undefined) fails in jinja2
  if (v.is_bool() || v.is_int()) return Value(v.as_int());
  double f = 0;
  if (v.is_float()) {
    f = v.as_float();
  } else if (v.is_string()) {
    std::string s = method(v, "strip", {}, SIZE_MAX).as_string();
    std::string digits = s;
    digits.erase(std::remove(digits.begin(), digits.end(), '_'), digits.end());
    size_t i = (!digits.empty() && (digits[0] == '+' || digits[0] == '-')) ? 1 : 0;
    const bool integral =
        i < digits.size() &&
        std::all_of(digits.begin() + i, digits.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (integral) {
      try {
        return Value(static_cast<int64_t>(std::stoll(digits)));
      } catch (const std::exception&) {
        fail(ErrorCode::kOutOfRange, "int(): " + s + " does not fit in 64 bits");
      }
    }
    if (!parse_float(s, f)) return fallback ? *fallback : Value(int64_t{0});
  } else {
    return fallback ? *fallback : Value(int64_t{0});
  }
  if (std::isnan(f)) return fallback ? *fallback : Value(int64_t{0});
  if (!(std::fabs(f) < 9.2e18))
    fail(ErrorCode::kOutOfRange, "int(): value does not fit in 64 bits");
  return Value(static_cast<int64_t>(f));  // truncation toward zero, as int(float)
}

Value f_items(const Value& v, CallArgs& args, size_t max) {
  check_arg_count(args, "items", 0, {});
  if (v.is_undefined()) return Value(Array{});
  if (!v.is_object()) type_error("Can only get item pairs from a mapping.");
  return method(v, "items", {}, max);
}

Value f_join(const Value& v, CallArgs& args, size_t max) {
  check_arg_count(args, "join", 2, {"d", "attribute"});
  const Value* sep = arg(args, 0, "d");
  const Value* attribute = arg(args, 1, "attribute");
  const std::string separator = sep ? to_str(*sep) : std::string();
  std::string out;
  size_t i = 0;
  for (const Value& item : iterate(v)) {
    if (i++ > 0) out += separator;
    out += to_str(attribute ? attribute_path(item, to_str(*attribute)) : item);
    if (out.size() > max) fail(ErrorCode::kOutOfRange, "join(): result too large");
  }
  return Value(std::move(out));
}

Value f_length(const Value& v, CallArgs&, size_t) {
  return Value(length(v));
}
Value f_list(const Value& v, CallArgs&, size_t) {
  return Value(iterate(v));
}
Value f_lower(const Value& v, CallArgs&, size_t max) {
  return method(Value(to_str(v)), "lower", {}, max);
}
Value f_upper(const Value& v, CallArgs&, size_t max) {
  return method(Value(to_str(v)), "upper", {}, max);
}

Value f_map(const Value& v, CallArgs& args, size_t max) {
  Array out;
  if (!v.truthy()) return Value(std::move(out));
  const Value* attribute = find_arg(args, SIZE_MAX, "attribute");
  if (attribute != nullptr) {
    const Value* fallback = find_arg(args, SIZE_MAX, "default");
    for (const Value& item : iterate(v)) {
      Value x = attribute_path(item, to_str(*attribute));
      out.push_back(x.is_undefined() && fallback ? *fallback : x);
    }
    return Value(std::move(out));
  }
  if (args.positional.empty()) type_error("map requires a filter argument");
  const std::string filter = to_str(args.positional[0]);
  if (!has_filter(filter)) fail(ErrorCode::kUnsupported, "no filter named '" + filter + "'");
  for (const Value& item : iterate(v)) {
    CallArgs rest;
    rest.positional.assign(args.positional.begin() + 1, args.positional.end());
    rest.keyword = args.keyword;
    out.push_back(apply_filter(filter, item, rest, max));
  }
  return Value(std::move(out));
}

Value min_max(const Value& v, CallArgs& args, bool want_max) {
  check_arg_count(args, want_max ? "max" : "min", 2, {"case_sensitive", "attribute"});
  const Array items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  const std::vector<Value> keys =
      keyed(items, arg(args, 1, "attribute"), bool_arg(arg(args, 0, "case_sensitive"), false));
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    if (want_max ? less_than(keys[best], keys[i]) : less_than(keys[i], keys[best])) best = i;
  }
  return items[best];
}
Value f_max(const Value& v, CallArgs& args, size_t) {
  return min_max(v, args, true);
}
Value f_min(const Value& v, CallArgs& args, size_t) {
  return min_max(v, args, false);
}

// select / reject / selectattr / rejectattr. Like map, they yield nothing for a falsy value
// (jinja2 tests `if value:` before iterating).
Value select_items(const Value& v, CallArgs& args, bool by_attribute, bool keep) {
  if (!v.truthy()) return Value(Array{});
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (args.positional.empty()) type_error("missing attribute argument");
    attribute = to_str(args.positional[next++]);
  }
  std::string test;
  if (next < args.positional.size()) test = to_str(args.positional[next++]);
  if (!test.empty() && !has_test(test))
    fail(ErrorCode::kUnsupported, "no test named '" + test + "'");
  Array out;
  for (const Value& item : iterate(v)) {
    const Value x = by_attribute ? attribute_path(item, attribute) : item;
    bool ok;
    if (test.empty()) {
      ok = x.truthy();
    } else {
      CallArgs rest;
      rest.positional.assign(args.positional.begin() + static_cast<long>(next),
                             args.positional.end());
      rest.keyword = args.keyword;
      ok = apply_test(test, x, rest);
    }
    if (ok == keep) out.push_back(item);
  }
  return Value(std::move(out));
}
Value f_select(const Value& v, CallArgs& args, size_t) {
  return select_items(v, args, false, true);
}
Value f_reject(const Value& v, CallArgs& args, size_t) {
  return select_items(v, args, false, false);
}
Value f_selectattr(const Value& v, CallArgs& args, size_t) {
  return select_items(v, args, true, true);
}
Value f_rejectattr(const Value& v, CallArgs& args, size_t) {
  return select_items(v, args, true, false);
}

Value f_replace(const Value& v, CallArgs& args, size_t max) {
  check_arg_count(args, "replace", 3, {"old", "new", "count"});
  const Value* old = arg(args, 0, "old");
  const Value* with = arg(args, 1, "new");
  if (old == nullptr || with == nullptr) type_error("replace() needs old and new strings");
  CallArgs call;
  call.positional = {Value(to_str(*old)), Value(to_str(*with))};
  if (const Value* count = arg(args, 2, "count"); count && !count->is_none())
    call.positional.push_back(*count);
  return method(Value(to_str(v)), "replace", std::move(call), max);
}

Value f_reverse(const Value& v, CallArgs&, size_t) {
  if (v.is_string()) return slice(v, Value(), Value(), Value(int64_t{-1}));
  Array items = iterate(v);
  std::reverse(items.begin(), items.end());
  return Value(std::move(items));
}

Value f_round(const Value& v, CallArgs& args, size_t) {
  check_arg_count(args, "round", 2, {"precision", "method"});
  const Value* p = arg(args, 0, "precision");
  const int64_t precision = p ? p->as_int() : 0;
  const Value* m = arg(args, 1, "method");
  const std::string how = m ? to_str(*m) : "common";
  if (how != "common" && how != "ceil" && how != "floor")
    type_error("method must be common, ceil or floor");
  require_defined(v);
  if (!v.is_number()) type_error(std::string("round(): '") + type_name(v) + "' is not a number");
  if (precision < 0 || precision > 17)
    fail(ErrorCode::kUnsupported, "round(): precision must be 0..17");
  if (how == "common" && !v.is_float())
    return Value(v.as_int());  // Python round(int, n) stays an int
  const double x = v.as_float();
  const double scale = std::pow(10.0, static_cast<double>(precision));
  if (how == "ceil") return Value(std::ceil(x * scale) / scale);
  if (how == "floor") return Value(std::floor(x * scale) / scale);
  char buf[64];  // correctly rounded decimal, ties to even on the exact binary value, as Python
  std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), x);
  return Value(std::strtod(buf, nullptr));
}

Value f_safe(const Value& v, CallArgs&, size_t) {
  return Value(to_str(v));
}
Value f_string(const Value& v, CallArgs&, size_t) {
  return Value(to_str(v));
}

Value f_sort(const Value& v, CallArgs& args, size_t) {
  check_arg_count(args, "sort", 3, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = bool_arg(arg(args, 0, "reverse"), false);
  Array items = iterate(v);
  const std::vector<Value> keys =
      keyed(items, arg(args, 2, "attribute"), bool_arg(arg(args, 1, "case_sensitive"), false));
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return reverse ? less_than(keys[b], keys[a]) : less_than(keys[a], keys[b]);
  });
  Array out;
  out.reserve(items.size());
  for (size_t i : order) out.push_back(items[i]);
  return Value(std::move(out));
}

Value f_sum(const Value& v, CallArgs& args, size_t) {
  check_arg_count(args, "sum", 2, {"attribute", "start"});
  const Value* attribute = arg(args, 0, "attribute");
  const Value* start = arg(args, 1, "start");
  Value total = start ? *start : Value(int64_t{0});
  for (const Value& item : iterate(v)) {
    const Value x = attribute ? attribute_path(item, to_str(*attribute)) : item;
    require_defined(x);
    if (!x.is_number() || !total.is_number()) {
      type_error(std::string("unsupported operand type(s) for +: '") + type_name(total) +
                 "' and '" + type_name(x) + "'");
    }
    if (x.is_float() || total.is_float()) {
      total = Value(total.as_float() + x.as_float());
    } else {
      int64_t r;
      if (__builtin_add_overflow(total.as_int(), x.as_int(), &r))
        fail(ErrorCode::kOutOfRange, "integer overflow");
      total = Value(r);
    }
  }
  return total;
}

// jinja2's title filter (not str.title): upper-case after "-", whitespace, "(", "{", "[", "<".
Value f_title(const Value& v, CallArgs&, size_t) {
  const std::string s = to_str(v);
  std::string out;
  bool word_start = true;
  for (size_t pos = 0; pos < s.size();) {
    const size_t start = pos;
    const char32_t cp = decode_utf8(s, pos);
    const bool delimiter =
        cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || is_python_space(cp);
    const std::string ch = s.substr(start, pos - start);
    out += method(Value(ch), word_start ? "upper" : "lower", {}, SIZE_MAX).as_string();
    word_start = delimiter;
  }
  return Value(std::move(out));
}

Value f_tojson(const Value& v, CallArgs& args, size_t max) {
  check_arg_count(args, "tojson", 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonStyle style;
  style.ensure_ascii = bool_arg(arg(args, 0, "ensure_ascii"), false);
  if (const Value* indent = arg(args, 1, "indent"); indent != nullptr && !indent->is_none()) {
    style.has_indent = true;
    style.item_separator = ",";
    if (indent->is_string()) {
      style.indent = indent->as_string();
    } else if (indent->is_int()) {
      style.indent =
          std::string(static_cast<size_t>(std::clamp<int64_t>(indent->as_int(), 0, 1024)), ' ');
    } else {
      type_error("tojson: indent must be an int or a string");
    }
  }
  if (const Value* separators = arg(args, 2, "separators");
      separators != nullptr && !separators->is_none()) {
    if (!separators->is_array() || separators->as_array().size() != 2 ||
        !separators->as_array()[0].is_string() || !separators->as_array()[1].is_string()) {
      type_error("tojson: separators must be a pair of strings");
    }
    style.item_separator = separators->as_array()[0].as_string();
    style.key_separator = separators->as_array()[1].as_string();
  }
  style.sort_keys = bool_arg(arg(args, 3, "sort_keys"), false);
  std::string out = to_json(v, style);
  if (out.size() > max) fail(ErrorCode::kOutOfRange, "tojson(): result too large");
  return Value(std::move(out));
}

Value f_trim(const Value& v, CallArgs& args, size_t max) {
  check_arg_count(args, "trim", 1, {"chars"});
  CallArgs call;
  if (const Value* chars = arg(args, 0, "chars")) call.positional.push_back(*chars);
  return method(Value(to_str(v)), "strip", std::move(call), max);
}

Value f_unique(const Value& v, CallArgs& args, size_t) {
  check_arg_count(args, "unique", 2, {"case_sensitive", "attribute"});
  const Array items = iterate(v);
  const std::vector<Value> keys =
      keyed(items, arg(args, 1, "attribute"), bool_arg(arg(args, 0, "case_sensitive"), false));
  Array out;
  std::vector<Value> seen;
  for (size_t i = 0; i < items.size(); ++i) {
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& k) { return equals(k, keys[i]); }))
      continue;
    seen.push_back(keys[i]);
    out.push_back(items[i]);
  }
  return Value(std::move(out));
}

struct FilterEntry {
  const char* name;
  FilterFn fn;
};
const FilterEntry kFilters[] = {
    {"abs", f_abs},
    {"attr", f_attr},
    {"capitalize", f_capitalize},
    {"count", f_length},
    {"d", f_default},
    {"default", f_default},
    {"dictsort", f_dictsort},
    {"e", f_escape},
    {"escape", f_escape},
    {"first", f_first},
    {"float", f_float},
    {"forceescape", f_escape},
    {"indent", f_indent},
    {"int", f_int},
    {"items", f_items},
    {"join", f_join},
    {"last", f_last},
    {"length", f_length},
    {"list", f_list},
    {"lower", f_lower},
    {"map", f_map},
    {"max", f_max},
    {"min", f_min},
    {"reject", f_reject},
    {"rejectattr", f_rejectattr},
    {"replace", f_replace},
    {"reverse", f_reverse},
    {"round", f_round},
    {"safe", f_safe},
    {"select", f_select},
    {"selectattr", f_selectattr},
    {"sort", f_sort},
    {"string", f_string},
    {"sum", f_sum},
    {"title", f_title},
    {"tojson", f_tojson},
    {"trim", f_trim},
    {"unique", f_unique},
    {"upper", f_upper},
};

const FilterEntry* find_filter(std::string_view name) {
  for (const FilterEntry& f : kFilters) {
    if (name == f.name) return &f;
  }
  return nullptr;
}

// ---- tests ----

bool t_compare(std::string_view name, const Value& v, const Value& other) {
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, other);
  if (name == "ne" || name == "!=") return !equals(v, other);
  if (name == "lt" || name == "lessthan" || name == "<") return less_than(v, other);
  if (name == "le" || name == "<=") return !less_than(other, v);
  if (name == "gt" || name == "greaterthan" || name == ">") return less_than(other, v);
  return !less_than(v, other);  // ge, >=
}

const char* const kTests[] = {
    "boolean",  "callable", "defined", "divisibleby", "eq",   "equalto",   "==",     "escaped",
    "even",     "false",    "filter",  "float",       "ge",   ">=",        "gt",     "greaterthan",
    ">",        "in",       "integer", "iterable",    "le",   "<=",        "lower",  "lt",
    "lessthan", "<",        "mapping", "ne",          "!=",   "none",      "number", "odd",
    "sameas",   "sequence", "string",  "test",        "true", "undefined", "upper"};

}  // namespace

bool has_filter(std::string_view name) {
  return find_filter(name) != nullptr;
}

bool has_test(std::string_view name) {
  return std::find(std::begin(kTests), std::end(kTests), name) != std::end(kTests);
}

Value apply_filter(std::string_view name, const Value& operand, CallArgs& args, size_t max_string) {
  const FilterEntry* f = find_filter(name);
  if (f == nullptr) fail(ErrorCode::kUnsupported, "no filter named '" + std::string(name) + "'");
  return f->fn(operand, args, max_string);
}

bool apply_test(std::string_view name, const Value& v, CallArgs& args) {
  const Value* other = find_arg(args, 0, "");
  const auto need_other = [&]() -> const Value& {
    if (other == nullptr) type_error("test '" + std::string(name) + "' needs an argument");
    return *other;
  };
  using K = Value::Kind;
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_object();
  if (name == "iterable" || name == "sequence") {
    return v.kind() == K::kUndefined || v.is_string() || v.is_array() || v.is_object();
  }
  if (name == "callable") return v.is_callable();
  if (name == "escaped") return false;  // no Markup values: every string is plain
  if (name == "filter") return v.is_string() && has_filter(v.as_string());
  if (name == "test") return v.is_string() && has_test(v.as_string());
  if (name == "sameas") {
    const Value& o = need_other();
    if (v.kind() != o.kind()) return false;
    switch (v.kind()) {
      case K::kUndefined:
      case K::kNone: return true;
      case K::kBool:
      case K::kInt: return v.as_int() == o.as_int();
      case K::kFloat: return v.as_float() == o.as_float();
      case K::kString: return &v.as_string() == &o.as_string();
      case K::kArray: return &v.as_array() == &o.as_array();
      case K::kObject: return &v.as_object() == &o.as_object();
      default: return equals(v, o);
    }
  }
  if (name == "in") return contains(need_other(), v);
  if (name == "lower" || name == "upper") {
    Value result;
    CallArgs none;
    call_method(Value(to_str(v)), name == "lower" ? "islower" : "isupper", none, SIZE_MAX, result);
    return result.as_bool();
  }
  if (name == "odd" || name == "even" ||
      name == "divisibleby") {  // value % n with Python's sign rule
    require_defined(v);
    const Value divisor = name == "divisibleby" ? need_other() : Value(int64_t{2});
    if (!v.is_number() || !divisor.is_number())
      type_error(std::string("test '") + std::string(name) + "' needs numbers");
    if (divisor.as_float() == 0.0) type_error("integer division or modulo by zero");
    double r;
    if (v.is_float() || divisor.is_float()) {
      r = std::fmod(v.as_float(), divisor.as_float());
      if (r != 0.0 && ((r < 0) != (divisor.as_float() < 0))) r += divisor.as_float();
    } else {
      const int64_t d = divisor.as_int();
      int64_t m = v.as_int() % d;
      if (m != 0 && ((m < 0) != (d < 0))) m += d;
      r = static_cast<double>(m);
    }
    return name == "odd" ? r == 1.0 : r == 0.0;
  }
  return t_compare(name, v, need_other());
}

}  // namespace moelora::chat::jinja
