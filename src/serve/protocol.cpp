// Request parsing and validation for the OpenAI-compatible endpoints (see protocol.h).
//
// Internally a failed check throws Reject (an ApiError); the public functions catch it, and any
// other exception, so no exception leaves this file. Every check looks at a value's type before
// reading it and at an array's size before walking it.
#include "serve/protocol.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <utility>

#include "io/tokenizer.h"

namespace moelora::serve {
namespace {

using ojson = nlohmann::ordered_json;

struct Reject {
  ApiError error;
};

[[noreturn]] void reject(std::string param, std::string code, std::string message,
                         int status = 400) {
  ApiError e;
  e.http_status = status;
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  throw Reject{std::move(e)};
}

// A short description of a value for messages: its JSON type and (clipped) text.
std::string describe(const ojson& v) {
  std::string text = v.dump(-1, ' ', false, ojson::error_handler_t::replace);
  if (text.size() > 64) text = text.substr(0, 61) + "...";
  const char* kind = "a value";
  switch (v.type()) {
    case ojson::value_t::null: return "null";
    case ojson::value_t::boolean: kind = "a boolean"; break;
    case ojson::value_t::string: kind = "a string"; break;
    case ojson::value_t::number_integer:
    case ojson::value_t::number_unsigned: kind = "an integer"; break;
    case ojson::value_t::number_float: kind = "a number"; break;
    case ojson::value_t::array: return "an array of " + std::to_string(v.size()) + " elements";
    case ojson::value_t::object: return "an object";
    default: break;
  }
  return std::string(kind) + " " + text;
}

// A request value quoted in a message, clipped so that a huge value cannot make a huge answer.
std::string clip(const std::string& s) {
  return s.size() <= 128 ? s : s.substr(0, 125) + "...";
}

[[noreturn]] void reject_type(const std::string& param, const std::string& expected,
                              const ojson& actual) {
  reject(param, "invalid_type",
         "'" + param + "' must be " + expected + "; got " + describe(actual));
}

[[noreturn]] void reject_range(const std::string& param, const std::string& expected,
                               const ojson& actual) {
  reject(param, "out_of_range",
         "'" + param + "' must be " + expected + "; got " + describe(actual));
}

// The member `key` of object `obj`, nullptr when absent or null (OpenAI treats both as "not set").
const ojson* field(const ojson& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integer, or a float holding an integral value (5.0), within [lo, hi].
int64_t to_int(const ojson& v, const std::string& param, int64_t lo, int64_t hi) {
  const std::string expected =
      "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (hi < 0 || u > static_cast<uint64_t>(hi)) reject_range(param, expected, v);
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < lo || i > hi) reject_range(param, expected, v);
    return i;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::trunc(d) != d) reject_type(param, expected, v);
    // 2^63 is exactly representable; anything at or beyond it is out of every int64 range.
    if (d < static_cast<double>(lo) || d > static_cast<double>(hi) || d >= 9.2233720368547758e18) {
      reject_range(param, expected, v);
    }
    return static_cast<int64_t>(d);
  }
  reject_type(param, expected, v);
}

// A bound as people write it: "2", not "2.0".
std::string format_bound(double d) {
  if (std::trunc(d) == d && std::fabs(d) < 1e15) return std::to_string(static_cast<int64_t>(d));
  return nlohmann::json(d).dump();
}

double to_number(const ojson& v, const std::string& param, double lo, double hi,
                 bool lo_open = false) {
  const std::string expected = std::string("a number in ") + (lo_open ? "(" : "[") +
                               format_bound(lo) + ", " + format_bound(hi) + "]";
  if (!v.is_number()) reject_type(param, expected, v);
  const double d = v.get<double>();
  if (!std::isfinite(d) || d > hi || (lo_open ? d <= lo : d < lo)) reject_range(param, expected, v);
  return d;
}

bool to_bool(const ojson& v, const std::string& param) {
  if (!v.is_boolean()) reject_type(param, "a boolean", v);
  return v.get<bool>();
}

const std::string& to_string_ref(const ojson& v, const std::string& param) {
  if (!v.is_string()) reject_type(param, "a string", v);
  return v.get_ref<const std::string&>();
}

void check_utf8(const std::string& s, const std::string& param) {
  if (auto bad = io::find_invalid_utf8(s)) {
    reject(param, "invalid_value",
           "'" + param + "' is not valid UTF-8 (byte offset " + std::to_string(*bad) + ")");
  }
}

// Nesting depth of `v`, walked with an explicit stack so a deep value cannot exhaust the call
// stack; stops counting once past `limit`.
int json_depth(const ojson& v, int limit) {
  std::vector<std::pair<const ojson*, int>> stack{{&v, 1}};
  int deepest = 0;
  while (!stack.empty()) {
    auto [node, depth] = stack.back();
    stack.pop_back();
    if (!node->is_structured()) continue;
    deepest = std::max(deepest, depth);
    if (deepest > limit) return deepest;
    for (const auto& child : *node) stack.push_back({&child, depth + 1});
  }
  return deepest;
}

void check_depth(const ojson& v, const std::string& param, const ProtocolLimits& limits) {
  if (json_depth(v, limits.max_json_depth) > limits.max_json_depth) {
    reject(
        param, "invalid_value",
        "'" + param + "' nests deeper than " + std::to_string(limits.max_json_depth) + " levels");
  }
}

// Token ids of `v` (an array of integers) within the vocabulary, at most `max_count` of them.
std::vector<int32_t> to_token_ids(const ojson& v, const std::string& param, size_t max_count,
                                  const ProtocolLimits& limits) {
  if (!v.is_array()) reject_type(param, "an array of token ids", v);
  if (v.size() > max_count) {
    reject(param, "out_of_range",
           "'" + param + "' has " + std::to_string(v.size()) + " token ids; the limit is " +
               std::to_string(max_count));
  }
  const int64_t hi = limits.vocab_size > 0 ? limits.vocab_size - 1 : INT32_MAX;
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    ids.push_back(static_cast<int32_t>(to_int(v[i], param + "[" + std::to_string(i) + "]", 0, hi)));
  }
  return ids;
}

// A field that the engine supports only at its neutral value: type and range are checked as for
// a supported one, then any other value is refused naming the field.
void neutral_only(const ojson& body, const char* key, double lo, double hi, double neutral) {
  const ojson* v = field(body, key);
  if (!v) return;
  const double d = to_number(*v, key, lo, hi);
  if (d != neutral) {
    reject(key, "unsupported_parameter",
           std::string("'") + key + "' is not supported by this server (only " +
               format_bound(neutral) + " is accepted); got " + describe(*v));
  }
}

// Fields both endpoints share. `chat` selects the chat spelling of logprobs / max tokens.
GenerationParams parse_generation(const ojson& body, const ProtocolLimits& limits, bool chat) {
  GenerationParams p;
  // max_completion_tokens is the chat API's current name; max_tokens its deprecated alias.
  const char* max_key = "max_tokens";
  if (chat && field(body, "max_completion_tokens")) max_key = "max_completion_tokens";
  if (const ojson* v = field(body, max_key))
    p.max_tokens = to_int(*v, max_key, 1, limits.max_tokens_limit);
  if (chat && max_key != std::string("max_tokens") && field(body, "max_tokens")) {
    to_int(body["max_tokens"], "max_tokens", 1, limits.max_tokens_limit);  // still type-checked
  }
  if (const ojson* v = field(body, "temperature"))
    p.temperature = to_number(*v, "temperature", 0, 2);
  if (const ojson* v = field(body, "top_p")) p.top_p = to_number(*v, "top_p", 0, 1, true);
  if (const ojson* v = field(body, "top_k")) {
    p.top_k = to_int(*v, "top_k", -1, INT32_MAX);
    if (p.top_k < 0) p.top_k = 0;  // vLLM spells "off" as -1
  }
  neutral_only(body, "min_p", 0, 1, 0);
  neutral_only(body, "presence_penalty", -2, 2, 0);
  neutral_only(body, "frequency_penalty", -2, 2, 0);
  neutral_only(body, "repetition_penalty", 0, 2, 1);
  if (const ojson* v = field(body, "seed")) {
    if (v->is_number_unsigned()) {
      p.seed = v->get<uint64_t>();
    } else {
      // Negative seeds (OpenAI's type is a signed integer) keep their two's-complement bits.
      p.seed = static_cast<uint64_t>(to_int(*v, "seed", std::numeric_limits<int64_t>::min(),
                                            std::numeric_limits<int64_t>::max()));
    }
  }
  if (const ojson* v = field(body, "stop")) {
    std::vector<const ojson*> items;
    if (v->is_string()) {
      items.push_back(v);
    } else if (v->is_array()) {
      if (v->size() > limits.max_stop_strings) {
        reject("stop", "out_of_range",
               "'stop' has " + std::to_string(v->size()) + " strings; the limit is " +
                   std::to_string(limits.max_stop_strings));
      }
      for (const auto& s : *v) items.push_back(&s);
    } else {
      reject_type("stop", "a string or an array of strings", *v);
    }
    for (size_t i = 0; i < items.size(); ++i) {
      const std::string param = v->is_array() ? "stop[" + std::to_string(i) + "]" : "stop";
      const std::string& s = to_string_ref(*items[i], param);
      if (s.empty()) reject(param, "invalid_value", "'" + param + "' must not be an empty string");
      if (s.size() > limits.max_stop_bytes) {
        reject(param, "out_of_range",
               "'" + param + "' is " + std::to_string(s.size()) + " bytes long; the limit is " +
                   std::to_string(limits.max_stop_bytes));
      }
      check_utf8(s, param);
      p.stop.push_back(s);
    }
  }
  if (const ojson* v = field(body, "stop_token_ids")) {
    p.stop_token_ids = to_token_ids(*v, "stop_token_ids", limits.max_stop_token_ids, limits);
  }
  if (const ojson* v = field(body, "ignore_eos")) p.ignore_eos = to_bool(*v, "ignore_eos");
  if (const ojson* v = field(body, "skip_special_tokens")) {
    p.skip_special_tokens = to_bool(*v, "skip_special_tokens");
  }
  if (const ojson* v = field(body, "n")) {
    const int64_t n = to_int(*v, "n", 1, std::numeric_limits<int64_t>::max());
    if (n > limits.max_n) {
      reject("n", "out_of_range",
             "'n' is " + std::to_string(n) + " but this server generates at most " +
                 std::to_string(limits.max_n) + " choice(s) per request");
    }
    p.n = static_cast<int32_t>(n);
  }
  if (const ojson* v = field(body, "best_of")) {
    const int64_t best_of = to_int(*v, "best_of", 1, std::numeric_limits<int64_t>::max());
    if (best_of != p.n) {
      reject("best_of", "unsupported_parameter",
             "'best_of' other than n is not supported; got " + describe(*v) +
                 " with n = " + std::to_string(p.n));
    }
  }
  if (const ojson* v = field(body, "stream")) p.stream = to_bool(*v, "stream");
  if (const ojson* v = field(body, "stream_options")) {
    if (!v->is_object()) reject_type("stream_options", "an object", *v);
    if (!p.stream) {
      reject("stream_options", "invalid_value",
             "'stream_options' is only allowed when 'stream' is true");
    }
    if (const ojson* u = field(*v, "include_usage")) {
      p.include_usage = to_bool(*u, "stream_options.include_usage");
    }
  }
  if (const ojson* v = field(body, "logit_bias")) {
    if (!v->is_object()) reject_type("logit_bias", "an object", *v);
    if (!v->empty()) {
      reject("logit_bias", "unsupported_parameter", "'logit_bias' is not supported by this server");
    }
  }
  if (const ojson* v = field(body, "user")) to_string_ref(*v, "user");  // accepted, unused
  const int64_t max_lp = limits.max_logprobs;
  if (!chat) {
    if (const ojson* v = field(body, "logprobs")) {
      p.logprobs = static_cast<int32_t>(to_int(*v, "logprobs", 0, max_lp));
    }
  } else {
    const ojson* lp = field(body, "logprobs");
    const bool want = lp && to_bool(*lp, "logprobs");
    if (const ojson* v = field(body, "top_logprobs")) {
      const int64_t top = to_int(*v, "top_logprobs", 0, max_lp);
      if (!want) {
        reject("top_logprobs", "invalid_value", "'top_logprobs' requires 'logprobs' to be true");
      }
      p.logprobs = static_cast<int32_t>(top);
    } else if (want) {
      p.logprobs = 0;
    }
  }
  if (p.logprobs && !limits.logprobs_supported) {
    reject("logprobs", "unsupported_parameter", "'logprobs' is not supported by this server");
  }
  return p;
}

// The prompt of /v1/completions: a string, [string], [int, ...] or [[int, ...]].
void parse_prompt(const ojson& body, const ProtocolLimits& limits, CompletionRequest& out) {
  const ojson* v = field(body, "prompt");
  if (!v) reject("prompt", "missing_required_parameter", "'prompt' is required");
  const std::string expected =
      "a string, an array of one string, an array of token ids or an array of one token-id array";
  auto set_text = [&](const ojson& s, const std::string& param) {
    const std::string& text = s.get_ref<const std::string&>();
    if (text.empty()) reject(param, "invalid_value", "'" + param + "' must not be empty");
    if (text.size() > limits.max_prompt_bytes) {
      reject(param, "out_of_range",
             "'" + param + "' is " + std::to_string(text.size()) + " bytes; the limit is " +
                 std::to_string(limits.max_prompt_bytes));
    }
    check_utf8(text, param);
    out.prompt_text = text;
  };
  auto set_tokens = [&](const ojson& arr, const std::string& param) {
    if (arr.empty()) reject(param, "invalid_value", "'" + param + "' must not be empty");
    out.prompt_tokens = to_token_ids(arr, param, limits.max_prompt_tokens, limits);
    out.prompt_is_tokens = true;
  };
  if (v->is_string()) return set_text(*v, "prompt");
  if (!v->is_array()) reject_type("prompt", expected, *v);
  if (v->empty()) reject("prompt", "invalid_value", "'prompt' must not be an empty array");
  const ojson& first = (*v)[0];
  if (first.is_number()) return set_tokens(*v, "prompt");
  if (first.is_string() || first.is_array()) {
    if (v->size() != 1) {
      reject("prompt", "invalid_value",
             "'prompt' may hold only one prompt per request; got " + describe(*v));
    }
    if (first.is_string()) return set_text(first, "prompt[0]");
    return set_tokens(first, "prompt[0]");
  }
  reject_type("prompt", expected, *v);
}

// Roles a message may have; "developer" (OpenAI's newer name for system) is passed to templates
// as "system", since the model templates only know the older role.
bool known_role(const std::string& role) {
  return role == "system" || role == "developer" || role == "user" || role == "assistant" ||
         role == "tool";
}

// One message -> its normalized form (see ChatCompletionRequest::messages); `text_bytes` sums the
// message text for the whole-request limit.
ojson parse_message(const ojson& m, const std::string& param, const ProtocolLimits& limits,
                    size_t& text_bytes) {
  if (!m.is_object()) reject_type(param, "an object", m);
  const ojson* role_v = field(m, "role");
  if (!role_v)
    reject(param + ".role", "missing_required_parameter", "'" + param + ".role' is required");
  const std::string& role = to_string_ref(*role_v, param + ".role");
  if (!known_role(role)) {
    reject(param + ".role", "invalid_value",
           "'" + param + ".role' must be one of system, developer, user, assistant, tool; got " +
               describe(*role_v));
  }
  ojson out = ojson::object();
  out["role"] = role == "developer" ? std::string("system") : role;
  const std::string content_param = param + ".content";
  if (const ojson* c = field(m, "content")) {
    if (c->is_string()) {
      check_utf8(c->get_ref<const std::string&>(), content_param);
      out["content"] = *c;
      text_bytes += c->get_ref<const std::string&>().size();
    } else if (c->is_array()) {
      if (c->size() > limits.max_content_parts) {
        reject(content_param, "out_of_range",
               "'" + content_param + "' has " + std::to_string(c->size()) +
                   " parts; the limit is " + std::to_string(limits.max_content_parts));
      }
      std::string joined;
      for (size_t i = 0; i < c->size(); ++i) {
        const std::string pp = content_param + "[" + std::to_string(i) + "]";
        const ojson& part = (*c)[i];
        if (!part.is_object())
          reject_type(pp, "an object {\"type\": \"text\", \"text\": ...}", part);
        const ojson* type = field(part, "type");
        if (!type)
          reject(pp + ".type", "missing_required_parameter", "'" + pp + ".type' is required");
        const std::string& t = to_string_ref(*type, pp + ".type");
        if (t != "text") {
          reject(pp + ".type", "unsupported_parameter",
                 "'" + pp + ".type' must be \"text\" (this server reads text only); got " +
                     describe(*type));
        }
        const ojson* text = field(part, "text");
        if (!text)
          reject(pp + ".text", "missing_required_parameter", "'" + pp + ".text' is required");
        const std::string& s = to_string_ref(*text, pp + ".text");
        check_utf8(s, pp + ".text");
        if (i > 0) joined += "\n";
        joined += s;
        text_bytes += s.size() + 1;
        if (text_bytes > limits.max_prompt_bytes) break;  // reported below
      }
      out["content"] = std::move(joined);
    } else {
      reject_type(content_param, "a string, an array of text parts or null", *c);
    }
  } else if (role != "assistant") {
    // Only an assistant turn (typically one that made tool calls) may come without content.
    reject(content_param, "missing_required_parameter", "'" + content_param + "' is required");
  } else {
    out["content"] = nullptr;
  }
  if (const ojson* v = field(m, "name")) out["name"] = to_string_ref(*v, param + ".name");
  if (const ojson* v = field(m, "reasoning_content")) {
    const std::string& s = to_string_ref(*v, param + ".reasoning_content");
    check_utf8(s, param + ".reasoning_content");
    text_bytes += s.size();
    out["reasoning_content"] = s;
  }
  if (const ojson* v = field(m, "tool_call_id")) {
    out["tool_call_id"] = to_string_ref(*v, param + ".tool_call_id");
  }
  if (const ojson* v = field(m, "tool_calls")) {
    const std::string tp = param + ".tool_calls";
    if (role != "assistant") {
      reject(tp, "invalid_value", "'" + tp + "' is only allowed in assistant messages");
    }
    if (!v->is_array()) reject_type(tp, "an array", *v);
    check_depth(*v, tp, limits);
    for (size_t i = 0; i < v->size(); ++i) {
      const std::string cp = tp + "[" + std::to_string(i) + "]";
      const ojson& call = (*v)[i];
      if (!call.is_object()) reject_type(cp, "an object", call);
      const ojson* fn = field(call, "function");
      if (!fn)
        reject(cp + ".function", "missing_required_parameter", "'" + cp + ".function' is required");
      if (!fn->is_object()) reject_type(cp + ".function", "an object", *fn);
      const ojson* name = field(*fn, "name");
      if (!name) {
        reject(cp + ".function.name", "missing_required_parameter",
               "'" + cp + ".function.name' is required");
      }
      to_string_ref(*name, cp + ".function.name");
      if (const ojson* args = field(*fn, "arguments");
          args && !args->is_string() && !args->is_object()) {
        reject_type(cp + ".function.arguments", "a string or an object", *args);
      }
    }
    out["tool_calls"] = *v;
  }
  return out;
}

void parse_chat_fields(const ojson& body, const ProtocolLimits& limits,
                       ChatCompletionRequest& out) {
  const ojson* msgs = field(body, "messages");
  if (!msgs) reject("messages", "missing_required_parameter", "'messages' is required");
  if (!msgs->is_array()) reject_type("messages", "an array of message objects", *msgs);
  if (msgs->empty()) reject("messages", "invalid_value", "'messages' must not be empty");
  if (msgs->size() > limits.max_messages) {
    reject("messages", "out_of_range",
           "'messages' has " + std::to_string(msgs->size()) + " messages; the limit is " +
               std::to_string(limits.max_messages));
  }
  size_t text_bytes = 0;
  for (size_t i = 0; i < msgs->size(); ++i) {
    out.messages.push_back(
        parse_message((*msgs)[i], "messages[" + std::to_string(i) + "]", limits, text_bytes));
    if (text_bytes > limits.max_prompt_bytes) {
      reject("messages", "out_of_range",
             "the message text is over " + std::to_string(limits.max_prompt_bytes) +
                 " bytes, the limit");
    }
  }
  if (const ojson* v = field(body, "tools")) {
    if (!v->is_array()) reject_type("tools", "an array of tool objects", *v);
    check_depth(*v, "tools", limits);
    for (size_t i = 0; i < v->size(); ++i) {
      const std::string tp = "tools[" + std::to_string(i) + "]";
      const ojson& tool = (*v)[i];
      if (!tool.is_object()) reject_type(tp, "an object", tool);
      const ojson* type = field(tool, "type");
      if (!type || !type->is_string() || type->get_ref<const std::string&>() != "function") {
        reject(
            tp + ".type", "invalid_value",
            "'" + tp + ".type' must be \"function\"; got " + (type ? describe(*type) : "nothing"));
      }
      const ojson* fn = field(tool, "function");
      if (!fn)
        reject(tp + ".function", "missing_required_parameter", "'" + tp + ".function' is required");
      if (!fn->is_object()) reject_type(tp + ".function", "an object", *fn);
      const ojson* name = field(*fn, "name");
      if (!name) {
        reject(tp + ".function.name", "missing_required_parameter",
               "'" + tp + ".function.name' is required");
      }
      to_string_ref(*name, tp + ".function.name");
    }
    out.tools = *v;
  }
  if (const ojson* v = field(body, "tool_choice")) {
    if (!v->is_string() && !v->is_object()) reject_type("tool_choice", "a string or an object", *v);
  }
  if (const ojson* v = field(body, "parallel_tool_calls")) to_bool(*v, "parallel_tool_calls");
  if (const ojson* v = field(body, "chat_template_kwargs")) {
    if (!v->is_object()) reject_type("chat_template_kwargs", "an object", *v);
    check_depth(*v, "chat_template_kwargs", limits);
    out.chat_template_kwargs = *v;
  }
  if (const ojson* v = field(body, "add_generation_prompt")) {
    out.add_generation_prompt = to_bool(*v, "add_generation_prompt");
  }
  if (const ojson* v = field(body, "response_format")) {
    if (!v->is_object()) reject_type("response_format", "an object", *v);
    const ojson* type = field(*v, "type");
    if (!type || !type->is_string() || type->get_ref<const std::string&>() != "text") {
      reject("response_format.type", "unsupported_parameter",
             "'response_format.type' must be \"text\" (structured output is not supported); got " +
                 (type ? describe(*type) : std::string("nothing")));
    }
  }
}

void parse_completion_fields(const ojson& body, CompletionRequest& out) {
  if (const ojson* v = field(body, "echo"); v && to_bool(*v, "echo")) {
    reject("echo", "unsupported_parameter", "'echo' is not supported by this server");
  }
  if (const ojson* v = field(body, "suffix"); v && !to_string_ref(*v, "suffix").empty()) {
    reject("suffix", "unsupported_parameter", "'suffix' is not supported by this server");
  }
}

ModelSelection resolve(const ojson& body, const ModelRegistry& registry) {
  ModelSelection sel;
  sel.base = registry.base_model();
  const ojson* model = field(body, "model");
  const ojson* lora = field(body, "lora_path");
  const std::string* name = model ? &to_string_ref(*model, "model") : nullptr;
  sel.requested = name ? *name : sel.base;
  // The adapter `name` selects, or "" for the base; nullopt when it names nothing known.
  auto adapter_of = [&](const std::string& n) -> std::optional<std::string> {
    if (n == sel.base) return std::string();
    if (registry.has_adapter(n)) return n;
    const std::string prefix = sel.base + ":";
    if (n.size() > prefix.size() && n.compare(0, prefix.size(), prefix) == 0) {
      std::string a = n.substr(prefix.size());
      if (registry.has_adapter(a)) return a;
    }
    return std::nullopt;
  };
  if (lora) {
    const std::string& a = to_string_ref(*lora, "lora_path");
    if (!registry.has_adapter(a)) {
      reject("lora_path", "model_not_found",
             "The adapter '" + clip(a) + "' (lora_path) does not exist", 404);
    }
    if (name) {
      auto from_model = adapter_of(*name);
      if (from_model && !from_model->empty() && *from_model != a) {
        reject("lora_path", "invalid_value",
               "'lora_path' names adapter '" + clip(a) + "' but 'model' names adapter '" +
                   clip(*from_model) + "'");
      }
    }
    sel.adapter = a;
    return sel;
  }
  if (!name) return sel;
  auto a = adapter_of(*name);
  if (!a) reject("model", "model_not_found", "The model '" + clip(*name) + "' does not exist", 404);
  sel.adapter = *a;
  return sel;
}

// Runs fn, turning Reject and every other exception into an ApiError.
template <typename T, typename Fn>
ApiResult<T> guarded(Fn&& fn) {
  try {
    return fn();
  } catch (const Reject& r) {
    return r.error;
  } catch (const std::bad_alloc&) {
    ApiError e;
    e.http_status = 413;
    e.message = "the request is too large to process";
    e.code = "request_too_large";
    return e;
  } catch (const std::exception& ex) {
    // A bug, not bad input: still an answer, never a crash.
    ApiError e;
    e.http_status = 500;
    e.type = "internal_error";
    e.message = std::string("internal error while reading the request: ") + ex.what();
    return e;
  }
}

void require_object(const ojson& body) {
  if (!body.is_object()) reject_type("body", "a JSON object", body);
}

}  // namespace

nlohmann::json ApiError::to_json() const {
  // Messages quote request values; whatever they hold, the error must serialize.
  nlohmann::json e = {{"message", io::sanitize_utf8(message)},
                      {"type", type},
                      {"param", nullptr},
                      {"code", nullptr}};
  if (!param.empty()) e["param"] = io::sanitize_utf8(param);
  if (!code.empty()) e["code"] = code;
  return nlohmann::json{{"error", std::move(e)}};
}

StaticModelRegistry::StaticModelRegistry(std::string base, std::vector<std::string> adapters)
    : base_(std::move(base)), adapters_(std::move(adapters)) {
  std::sort(adapters_.begin(), adapters_.end());
  adapters_.erase(std::unique(adapters_.begin(), adapters_.end()), adapters_.end());
}

bool StaticModelRegistry::has_adapter(std::string_view name) const {
  return std::binary_search(adapters_.begin(), adapters_.end(), name);
}

ApiResult<nlohmann::ordered_json> parse_json_body(std::string_view body,
                                                  const ProtocolLimits& limits) {
  return guarded<ojson>([&]() -> ojson {
    if (body.size() > limits.max_body_bytes) {
      reject("", "invalid_json",
             "the request body is " + std::to_string(body.size()) + " bytes; the limit is " +
                 std::to_string(limits.max_body_bytes));
    }
    // Bracket depth first, in one flat pass: nlohmann's parser recurses per level.
    int depth = 0;
    bool in_string = false;
    for (size_t i = 0; i < body.size(); ++i) {
      const char c = body[i];
      if (in_string) {
        if (c == '\\')
          ++i;
        else if (c == '"')
          in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if (c == '[' || c == '{') {
        if (++depth > limits.max_json_depth) {
          reject("", "invalid_json",
                 "the request body nests deeper than " + std::to_string(limits.max_json_depth) +
                     " levels");
        }
      } else if (c == ']' || c == '}') {
        --depth;
      }
    }
    ojson j = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) reject("", "invalid_json", "the request body is not valid JSON");
    return j;
  });
}

ApiResult<ModelSelection> resolve_model(const nlohmann::ordered_json& body,
                                        const ModelRegistry& registry) {
  return guarded<ModelSelection>([&] {
    require_object(body);
    return resolve(body, registry);
  });
}

ApiResult<CompletionRequest> parse_completion_request(const nlohmann::ordered_json& body,
                                                      const ModelRegistry& registry,
                                                      const ProtocolLimits& limits) {
  return guarded<CompletionRequest>([&] {
    require_object(body);
    CompletionRequest out;
    // Field checks before the model lookup: a malformed request is a 400 whatever it names.
    parse_prompt(body, limits, out);
    parse_completion_fields(body, out);
    out.params = parse_generation(body, limits, /*chat=*/false);
    out.model = resolve(body, registry);
    return out;
  });
}

ApiResult<ChatCompletionRequest> parse_chat_completion_request(const nlohmann::ordered_json& body,
                                                               const ModelRegistry& registry,
                                                               const ProtocolLimits& limits) {
  return guarded<ChatCompletionRequest>([&] {
    require_object(body);
    ChatCompletionRequest out;
    parse_chat_fields(body, limits, out);
    out.params = parse_generation(body, limits, /*chat=*/true);
    out.model = resolve(body, registry);
    return out;
  });
}

moelora::SamplingParams to_engine_sampling(const GenerationParams& params,
                                           int64_t default_max_tokens, uint64_t default_seed,
                                           int32_t choice) {
  moelora::SamplingParams s;
  s.temperature = params.temperature;
  s.top_p = params.top_p;
  s.top_k = params.top_k;
  s.seed = params.seed.value_or(default_seed) + static_cast<uint64_t>(choice);
  s.max_new_tokens = params.max_tokens.value_or(default_max_tokens);
  s.ignore_eos = params.ignore_eos;
  s.stop_token_ids = params.stop_token_ids;
  s.logprobs = params.logprobs ? *params.logprobs : -1;
  return s;
}

}  // namespace moelora::serve
