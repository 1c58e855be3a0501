// Tests of the OpenAI-compatible request protocol (serve/protocol.h): every field's accept and
// reject paths with the exact error shape, each prompt form, each adapter-selection form, body
// parsing limits and the mapping onto the engine's sampling settings. The seeded random test that
// feeds arbitrary JSON into every field is serve_protocol_random_test.cpp.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/protocol.h"

namespace moelora::serve {
namespace {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

const StaticModelRegistry& registry() {
  static const StaticModelRegistry r("qwen3-moe", {"math", "sql", "team:b"});
  return r;
}

ojson completion_body() {
  return ojson{{"model", "qwen3-moe"}, {"prompt", "Hello"}};
}
ojson chat_body() {
  return ojson{{"model", "qwen3-moe"},
               {"messages", ojson::array({{{"role", "user"}, {"content", "Hi"}}})}};
}

// Checks an error's status, param, code, the words of its message, and that its JSON is exactly
// {"error": {"message", "type", "param", "code"}}.
template <typename T>
::testing::AssertionResult is_error(const ApiResult<T>& r, int status, const std::string& param,
                                    const std::string& code,
                                    const std::vector<std::string>& parts = {}) {
  if (r.is_ok())
    return ::testing::AssertionFailure() << "accepted; expected " << code << " on " << param;
  const ApiError& e = r.error();
  const json j = e.to_json();
  const json expected_shape = {
      {"error",
       {{"message", e.message},
        {"type", status == 404 || status == 400 ? "invalid_request_error" : e.type},
        {"param", param.empty() ? json() : json(param)},
        {"code", code.empty() ? json() : json(code)}}}};
  if (e.http_status != status || e.param != param || e.code != code || j != expected_shape) {
    return ::testing::AssertionFailure() << "got " << e.http_status << " " << j.dump();
  }
  for (const auto& p : parts) {
    if (e.message.find(p) == std::string::npos) {
      return ::testing::AssertionFailure() << "message '" << e.message << "' lacks '" << p << "'";
    }
  }
  return ::testing::AssertionSuccess();
}

ApiResult<CompletionRequest> completion_with(const std::string& key, const ojson& value,
                                             const ProtocolLimits& limits = {}) {
  ojson body = completion_body();
  body[key] = value;
  return parse_completion_request(body, registry(), limits);
}
ApiResult<ChatCompletionRequest> chat_with(const std::string& key, const ojson& value,
                                           const ProtocolLimits& limits = {}) {
  ojson body = chat_body();
  body[key] = value;
  return parse_chat_completion_request(body, registry(), limits);
}

// ---- fields shared by both endpoints ----

struct Reject {
  Reject(std::string k, ojson v, std::string c, std::vector<std::string> p, std::string par = "")
      : key(std::move(k)),
        value(std::move(v)),
        code(std::move(c)),
        parts(std::move(p)),
        param(std::move(par)) {}
  std::string key;
  ojson value;
  std::string code;
  std::vector<std::string> parts;
  std::string param;  // defaults to key
};

const std::vector<Reject>& shared_rejects() {
  static const std::vector<Reject> table = {
      {"max_tokens",
       "5",
       "invalid_type",
       {"'max_tokens' must be an integer in [1, 1073741824]; got a string \"5\""}},
      {"max_tokens", 0, "out_of_range", {"got an integer 0"}},
      {"max_tokens", -3, "out_of_range", {"got an integer -3"}},
      {"max_tokens", 5.5, "invalid_type", {"got a number 5.5"}},
      {"max_tokens", 1e30, "out_of_range", {"[1, 1073741824]"}},
      {"max_tokens", true, "invalid_type", {"got a boolean true"}},
      {"max_tokens", ojson::array({1}), "invalid_type", {"got an array of 1 elements"}},
      {"temperature",
       -0.1,
       "out_of_range",
       {"'temperature' must be a number in [0, 2]; got a number -0.1"}},
      {"temperature", 2.5, "out_of_range", {"got a number 2.5"}},
      {"temperature", "hot", "invalid_type", {"got a string \"hot\""}},
      {"top_p", 0, "out_of_range", {"'top_p' must be a number in (0, 1]"}},
      {"top_p", 1.5, "out_of_range", {"got a number 1.5"}},
      {"top_p", ojson::object(), "invalid_type", {"got an object"}},
      {"top_k", -2, "out_of_range", {"'top_k' must be an integer in [-1, 2147483647]"}},
      {"top_k", "5", "invalid_type", {}},
      {"top_k", 1.5, "invalid_type", {}},
      {"min_p",
       0.1,
       "unsupported_parameter",
       {"'min_p' is not supported", "only 0", "got a number 0.1"}},
      {"min_p", "x", "invalid_type", {}},
      {"min_p", 2, "out_of_range", {}},
      {"presence_penalty", 0.5, "unsupported_parameter", {"'presence_penalty' is not supported"}},
      {"presence_penalty", 3, "out_of_range", {"[-2, 2]"}},
      {"frequency_penalty", 1, "unsupported_parameter", {"'frequency_penalty'"}},
      {"frequency_penalty", "0", "invalid_type", {}},
      {"repetition_penalty", 1.2, "unsupported_parameter", {"only 1"}},
      {"seed", "1", "invalid_type", {}},
      {"seed", 1.5, "invalid_type", {}},
      {"seed", 1e20, "out_of_range", {}},
      {"stop",
       5,
       "invalid_type",
       {"'stop' must be a string or an array of strings; got an integer 5"}},
      {"stop", ojson::array({"a", 3}), "invalid_type", {"'stop[1]' must be a string"}, "stop[1]"},
      {"stop",
       ojson::array({""}),
       "invalid_value",
       {"'stop[0]' must not be an empty string"},
       "stop[0]"},
      {"stop", "", "invalid_value", {"must not be an empty string"}},
      {"stop",
       ojson(std::vector<std::string>(17, "x")),
       "out_of_range",
       {"17 strings; the limit is 16"}},
      {"stop", std::string(300, 'x'), "out_of_range", {"300 bytes long; the limit is 256"}},
      {"stop_token_ids", "1", "invalid_type", {"an array of token ids"}},
      {"stop_token_ids",
       ojson::array({-1}),
       "out_of_range",
       {"'stop_token_ids[0]'"},
       "stop_token_ids[0]"},
      {"stop_token_ids", ojson::array({1, 1.5}), "invalid_type", {}, "stop_token_ids[1]"},
      {"stop_token_ids",
       ojson(std::vector<int>(257, 1)),
       "out_of_range",
       {"257 token ids; the limit is 256"}},
      {"n", 0, "out_of_range", {"'n' must be an integer in [1, "}},
      {"n", 2, "out_of_range", {"'n' is 2 but this server generates at most 1 choice(s)"}},
      {"n", "2", "invalid_type", {}},
      {"best_of", 2, "unsupported_parameter", {"'best_of' other than n", "n = 1"}},
      {"stream", "yes", "invalid_type", {"'stream' must be a boolean; got a string \"yes\""}},
      {"stream_options",
       ojson{{"include_usage", true}},
       "invalid_value",
       {"only allowed when 'stream' is true"}},
      {"ignore_eos", 1, "invalid_type", {"a boolean"}},
      {"skip_special_tokens", "no", "invalid_type", {}},
      {"logit_bias", ojson{{"1", 5}}, "unsupported_parameter", {"'logit_bias' is not supported"}},
      {"logit_bias", ojson::array(), "invalid_type", {"an object"}},
      {"user", 5, "invalid_type", {"'user' must be a string"}},
  };
  return table;
}

TEST(ServeProtocol, SharedFieldsRejectWithExactShape) {
  for (const auto& r : shared_rejects()) {
    const std::string param = r.param.empty() ? r.key : r.param;
    SCOPED_TRACE(r.key + " = " + r.value.dump());
    EXPECT_TRUE(is_error(completion_with(r.key, r.value), 400, param, r.code, r.parts));
    EXPECT_TRUE(is_error(chat_with(r.key, r.value), 400, param, r.code, r.parts));
  }
}

TEST(ServeProtocol, ExactErrorJson) {
  const auto r = completion_with("temperature", 3.5);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.error().to_json(), json::parse(R"({"error": {
      "message": "'temperature' must be a number in [0, 2]; got a number 3.5",
      "type": "invalid_request_error", "param": "temperature", "code": "out_of_range"}})"));
  ApiError bare;
  bare.message = "x";
  EXPECT_EQ(bare.to_json(), json::parse(R"({"error": {"message": "x",
      "type": "invalid_request_error", "param": null, "code": null}})"));
}

TEST(ServeProtocol, StreamOptionsRejects) {
  ojson body = completion_body();
  body["stream"] = true;
  body["stream_options"] = 5;
  EXPECT_TRUE(is_error(parse_completion_request(body, registry()), 400, "stream_options",
                       "invalid_type", {"an object"}));
  body["stream_options"] = ojson{{"include_usage", "yes"}};
  EXPECT_TRUE(is_error(parse_completion_request(body, registry()), 400,
                       "stream_options.include_usage", "invalid_type", {}));
}

TEST(ServeProtocol, SharedFieldsAccept) {
  struct Accept {
    std::string key;
    ojson value;
    std::function<void(const GenerationParams&)> check;
  };
  const std::vector<Accept> table = {
      {"max_tokens", 7, [](auto& p) { EXPECT_EQ(p.max_tokens, 7); }},
      {"max_tokens", 7.0, [](auto& p) { EXPECT_EQ(p.max_tokens, 7); }},
      {"max_tokens", 1073741824, [](auto& p) { EXPECT_EQ(p.max_tokens, 1073741824); }},
      {"max_tokens", nullptr, [](auto& p) { EXPECT_FALSE(p.max_tokens); }},
      {"temperature", 0, [](auto& p) { EXPECT_EQ(p.temperature, 0.0); }},
      {"temperature", 2, [](auto& p) { EXPECT_EQ(p.temperature, 2.0); }},
      {"temperature", 0.7, [](auto& p) { EXPECT_EQ(p.temperature, 0.7); }},
      {"top_p", 1, [](auto& p) { EXPECT_EQ(p.top_p, 1.0); }},
      {"top_p", 0.25, [](auto& p) { EXPECT_EQ(p.top_p, 0.25); }},
      {"top_k", -1, [](auto& p) { EXPECT_EQ(p.top_k, 0); }},
      {"top_k", 40, [](auto& p) { EXPECT_EQ(p.top_k, 40); }},
      {"min_p", 0, [](auto&) {}},
      {"presence_penalty", 0.0, [](auto&) {}},
      {"frequency_penalty", 0, [](auto&) {}},
      {"repetition_penalty", 1, [](auto&) {}},
      {"seed", 42, [](auto& p) { EXPECT_EQ(p.seed, 42u); }},
      {"seed", -1, [](auto& p) { EXPECT_EQ(p.seed, std::numeric_limits<uint64_t>::max()); }},
      {"seed", std::numeric_limits<uint64_t>::max(),
       [](auto& p) { EXPECT_EQ(p.seed, std::numeric_limits<uint64_t>::max()); }},
      {"seed", nullptr, [](auto& p) { EXPECT_FALSE(p.seed); }},
      {"stop", "\n\n", [](auto& p) { EXPECT_EQ(p.stop, std::vector<std::string>{"\n\n"}); }},
      {"stop", ojson::array({"a", "é"}),
       [](auto& p) {
         EXPECT_EQ(p.stop, (std::vector<std::string>{"a", "é"}));
       }},
      {"stop", ojson(std::vector<std::string>(16, "x")),
       [](auto& p) { EXPECT_EQ(p.stop.size(), 16u); }},
      {"stop", ojson::array(), [](auto& p) { EXPECT_TRUE(p.stop.empty()); }},
      {"stop", nullptr, [](auto& p) { EXPECT_TRUE(p.stop.empty()); }},
      {"stop_token_ids", ojson::array({1, 2}),
       [](auto& p) {
         EXPECT_EQ(p.stop_token_ids, (std::vector<int32_t>{1, 2}));
       }},
      {"n", 1, [](auto& p) { EXPECT_EQ(p.n, 1); }},
      {"best_of", 1, [](auto& p) { EXPECT_EQ(p.n, 1); }},
      {"stream", true,
       [](auto& p) {
         EXPECT_TRUE(p.stream);
         EXPECT_FALSE(p.include_usage);
       }},
      {"ignore_eos", true, [](auto& p) { EXPECT_TRUE(p.ignore_eos); }},
      {"skip_special_tokens", false, [](auto& p) { EXPECT_FALSE(p.skip_special_tokens); }},
      {"logit_bias", ojson::object(), [](auto&) {}},
      {"user", "someone", [](auto&) {}},
      {"some_vendor_extra", ojson{{"x", 1}}, [](auto&) {}},
  };
  for (const auto& a : table) {
    SCOPED_TRACE(a.key + " = " + a.value.dump());
    auto c = completion_with(a.key, a.value);
    ASSERT_TRUE(c.is_ok()) << c.error().message;
    a.check(c.value().params);
    auto h = chat_with(a.key, a.value);
    ASSERT_TRUE(h.is_ok()) << h.error().message;
    a.check(h.value().params);
  }
  // Defaults: OpenAI's temperature 1, no logprobs, one choice.
  auto d = parse_completion_request(completion_body(), registry());
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d.value().params.temperature, 1.0);
  EXPECT_FALSE(d.value().params.logprobs);
  EXPECT_FALSE(d.value().params.max_tokens);
  EXPECT_EQ(d.value().params.n, 1);
}

TEST(ServeProtocol, StreamOptionsAndNLimit) {
  ojson body = chat_body();
  body["stream"] = true;
  body["stream_options"] = ojson{{"include_usage", true}};
  auto r = parse_chat_completion_request(body, registry());
  ASSERT_TRUE(r.is_ok()) << r.error().message;
  EXPECT_TRUE(r.value().params.include_usage);

  ProtocolLimits limits;
  limits.max_n = 4;
  auto four = completion_with("n", 4, limits);
  ASSERT_TRUE(four.is_ok());
  EXPECT_EQ(four.value().params.n, 4);
  EXPECT_TRUE(is_error(completion_with("n", 5, limits), 400, "n", "out_of_range", {"at most 4"}));
  ojson b = completion_body();
  b["n"] = 3;
  b["best_of"] = 3;
  EXPECT_TRUE(parse_completion_request(b, registry(), limits).is_ok());
}

TEST(ServeProtocol, VocabularyBoundsTokenIds) {
  ProtocolLimits limits;
  limits.vocab_size = 100;
  EXPECT_TRUE(completion_with("stop_token_ids", ojson::array({99}), limits).is_ok());
  EXPECT_TRUE(is_error(completion_with("stop_token_ids", ojson::array({100}), limits), 400,
                       "stop_token_ids[0]", "out_of_range", {"[0, 99]", "got an integer 100"}));
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array({5, 100}), limits), 400, "prompt[1]",
                       "out_of_range", {}));
}

// ---- completions-only fields ----

TEST(ServeProtocol, CompletionLogprobsEchoSuffix) {
  for (int k : {0, 5, 20}) {
    auto r = completion_with("logprobs", k);
    ASSERT_TRUE(r.is_ok());
    EXPECT_EQ(r.value().params.logprobs, k);
  }
  EXPECT_FALSE(completion_with("logprobs", nullptr).value().params.logprobs);
  EXPECT_TRUE(is_error(completion_with("logprobs", 21), 400, "logprobs", "out_of_range",
                       {"'logprobs' must be an integer in [0, 20]; got an integer 21"}));
  EXPECT_TRUE(is_error(completion_with("logprobs", -1), 400, "logprobs", "out_of_range", {}));
  EXPECT_TRUE(is_error(completion_with("logprobs", true), 400, "logprobs", "invalid_type", {}));
  EXPECT_TRUE(completion_with("echo", false).is_ok());
  EXPECT_TRUE(is_error(completion_with("echo", true), 400, "echo", "unsupported_parameter", {}));
  EXPECT_TRUE(is_error(completion_with("echo", "x"), 400, "echo", "invalid_type", {}));
  EXPECT_TRUE(completion_with("suffix", "").is_ok());
  EXPECT_TRUE(
      is_error(completion_with("suffix", "end"), 400, "suffix", "unsupported_parameter", {}));
}

TEST(ServeProtocol, PromptForms) {
  auto text = completion_with("prompt", "Hello");
  ASSERT_TRUE(text.is_ok());
  EXPECT_FALSE(text.value().prompt_is_tokens);
  EXPECT_EQ(text.value().prompt_text, "Hello");
  auto one = completion_with("prompt", ojson::array({"Héllo"}));
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one.value().prompt_text, "Héllo");
  auto ids = completion_with("prompt", ojson::array({1, 2, 3}));
  ASSERT_TRUE(ids.is_ok());
  EXPECT_TRUE(ids.value().prompt_is_tokens);
  EXPECT_EQ(ids.value().prompt_tokens, (std::vector<int32_t>{1, 2, 3}));
  auto nested = completion_with("prompt", ojson::array({ojson::array({4, 5})}));
  ASSERT_TRUE(nested.is_ok());
  EXPECT_EQ(nested.value().prompt_tokens, (std::vector<int32_t>{4, 5}));
}

TEST(ServeProtocol, PromptRejects) {
  const std::string forms =
      "'prompt' must be a string, an array of one string, an array of token ids or an array of "
      "one token-id array";
  ojson missing = completion_body();
  missing.erase("prompt");
  EXPECT_TRUE(is_error(parse_completion_request(missing, registry()), 400, "prompt",
                       "missing_required_parameter", {"'prompt' is required"}));
  EXPECT_TRUE(
      is_error(completion_with("prompt", nullptr), 400, "prompt", "missing_required_parameter"));
  EXPECT_TRUE(is_error(completion_with("prompt", 5), 400, "prompt", "invalid_type",
                       {forms, "got an integer 5"}));
  EXPECT_TRUE(is_error(completion_with("prompt", true), 400, "prompt", "invalid_type", {forms}));
  EXPECT_TRUE(
      is_error(completion_with("prompt", ojson::object()), 400, "prompt", "invalid_type", {forms}));
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array({ojson::object()})), 400, "prompt",
                       "invalid_type", {forms}));
  EXPECT_TRUE(
      is_error(completion_with("prompt", ojson::array({nullptr})), 400, "prompt", "invalid_type"));
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array()), 400, "prompt", "invalid_value",
                       {"must not be an empty array"}));
  EXPECT_TRUE(is_error(completion_with("prompt", ""), 400, "prompt", "invalid_value",
                       {"must not be empty"}));
  EXPECT_TRUE(
      is_error(completion_with("prompt", ojson::array({""})), 400, "prompt[0]", "invalid_value"));
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array({"a", "b"})), 400, "prompt",
                       "invalid_value", {"only one prompt per request", "array of 2 elements"}));
  EXPECT_TRUE(
      is_error(completion_with("prompt", ojson::array({ojson::array({1}), ojson::array({2})})), 400,
               "prompt", "invalid_value", {"only one prompt"}));
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array({1, "a"})), 400, "prompt[1]",
                       "invalid_type"));
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array({ojson::array()})), 400, "prompt[0]",
                       "invalid_value"));
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array({ojson::array({1, "x"})})), 400,
                       "prompt[0][1]", "invalid_type"));
  EXPECT_TRUE(
      is_error(completion_with("prompt", ojson::array({-1})), 400, "prompt[0]", "out_of_range"));
  EXPECT_TRUE(
      is_error(completion_with("prompt", ojson::array({1.5})), 400, "prompt[0]", "invalid_type"));
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array({int64_t{1} << 40})), 400,
                       "prompt[0]", "out_of_range"));
  ProtocolLimits limits;
  limits.max_prompt_tokens = 4;
  limits.max_prompt_bytes = 8;
  EXPECT_TRUE(is_error(completion_with("prompt", ojson::array({1, 2, 3, 4, 5}), limits), 400,
                       "prompt", "out_of_range", {"5 token ids; the limit is 4"}));
  EXPECT_TRUE(is_error(completion_with("prompt", "123456789", limits), 400, "prompt",
                       "out_of_range", {"9 bytes; the limit is 8"}));
  EXPECT_TRUE(is_error(completion_with("prompt", std::string("a\xC3", 2)), 400, "prompt",
                       "invalid_value", {"not valid UTF-8 (byte offset 1)"}));
}

// ---- chat-only fields ----

TEST(ServeProtocol, ChatLogprobsAndMaxCompletionTokens) {
  EXPECT_EQ(chat_with("logprobs", true).value().params.logprobs, 0);
  EXPECT_FALSE(chat_with("logprobs", false).value().params.logprobs);
  ojson b = chat_body();
  b["logprobs"] = true;
  b["top_logprobs"] = 3;
  EXPECT_EQ(parse_chat_completion_request(b, registry()).value().params.logprobs, 3);
  b["top_logprobs"] = 21;
  EXPECT_TRUE(is_error(parse_chat_completion_request(b, registry()), 400, "top_logprobs",
                       "out_of_range", {"[0, 20]"}));
  EXPECT_TRUE(is_error(chat_with("top_logprobs", 2), 400, "top_logprobs", "invalid_value",
                       {"requires 'logprobs' to be true"}));
  EXPECT_TRUE(is_error(chat_with("logprobs", 1), 400, "logprobs", "invalid_type", {"a boolean"}));
  ProtocolLimits no_logprobs;
  no_logprobs.logprobs_supported = false;
  EXPECT_TRUE(is_error(chat_with("logprobs", true, no_logprobs), 400, "logprobs",
                       "unsupported_parameter", {"'logprobs' is not supported"}));
  EXPECT_TRUE(chat_with("logprobs", false, no_logprobs).is_ok());
  EXPECT_TRUE(is_error(completion_with("logprobs", 0, no_logprobs), 400, "logprobs",
                       "unsupported_parameter"));
  EXPECT_TRUE(completion_with("logprobs", nullptr, no_logprobs).is_ok());

  b = chat_body();
  b["max_tokens"] = 9;
  b["max_completion_tokens"] = 7;
  EXPECT_EQ(parse_chat_completion_request(b, registry()).value().params.max_tokens, 7);
  EXPECT_TRUE(is_error(chat_with("max_completion_tokens", 0), 400, "max_completion_tokens",
                       "out_of_range"));
  b["max_tokens"] = "9";  // the alias is still type-checked
  EXPECT_TRUE(
      is_error(parse_chat_completion_request(b, registry()), 400, "max_tokens", "invalid_type"));
  EXPECT_TRUE(chat_with("response_format", ojson{{"type", "text"}}).is_ok());
  EXPECT_TRUE(is_error(chat_with("response_format", ojson{{"type", "json_object"}}), 400,
                       "response_format.type", "unsupported_parameter", {"structured output"}));
  EXPECT_TRUE(
      is_error(chat_with("response_format", "text"), 400, "response_format", "invalid_type"));
  EXPECT_TRUE(chat_with("tool_choice", "auto").is_ok());
  EXPECT_TRUE(is_error(chat_with("tool_choice", 5), 400, "tool_choice", "invalid_type"));
  EXPECT_TRUE(
      is_error(chat_with("parallel_tool_calls", "x"), 400, "parallel_tool_calls", "invalid_type"));
  EXPECT_FALSE(chat_with("add_generation_prompt", false).value().add_generation_prompt);
}

TEST(ServeProtocol, ChatMessagesNormalized) {
  // Parsed as ordered_json, as the server does, so key order survives (templates tojson the tool
  // schemas).
  const ojson body = ojson::parse(R"({
    "model": "qwen3-moe",
    "messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "name": "ann",
       "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": null, "reasoning_content": "think",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "42"},
      {"role": "assistant"}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}}],
    "chat_template_kwargs": {"enable_thinking": false}
  })");
  auto c = parse_chat_completion_request(body, registry());
  ASSERT_TRUE(c.is_ok()) << c.error().message;
  EXPECT_EQ(c.value().tools->at(0)["function"]["parameters"].dump(), R"({"z":1,"a":2})");
  const json expected = json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi\nthere", "name": "ann"},
    {"role": "assistant", "content": null, "reasoning_content": "think",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
    {"role": "assistant", "content": null}
  ])");
  EXPECT_EQ(json::parse(c.value().messages.dump()), expected);
  EXPECT_EQ(json::parse(c.value().chat_template_kwargs.dump()), json({{"enable_thinking", false}}));
  EXPECT_TRUE(c.value().add_generation_prompt);
}

TEST(ServeProtocol, ChatMessageRejects) {
  auto with_messages = [](const ojson& messages, const ProtocolLimits& limits = {}) {
    return chat_with("messages", messages, limits);
  };
  auto one = [&](const ojson& m) { return with_messages(ojson::array({m})); };
  ojson missing = chat_body();
  missing.erase("messages");
  EXPECT_TRUE(is_error(parse_chat_completion_request(missing, registry()), 400, "messages",
                       "missing_required_parameter"));
  EXPECT_TRUE(is_error(with_messages("hi"), 400, "messages", "invalid_type",
                       {"an array of message objects"}));
  EXPECT_TRUE(is_error(with_messages(ojson::array()), 400, "messages", "invalid_value",
                       {"must not be empty"}));
  EXPECT_TRUE(is_error(with_messages(ojson::array({5})), 400, "messages[0]", "invalid_type",
                       {"an object"}));
  EXPECT_TRUE(
      is_error(one({{"content", "x"}}), 400, "messages[0].role", "missing_required_parameter"));
  EXPECT_TRUE(
      is_error(one({{"role", 5}, {"content", "x"}}), 400, "messages[0].role", "invalid_type"));
  EXPECT_TRUE(is_error(one({{"role", "robot"}, {"content", "x"}}), 400, "messages[0].role",
                       "invalid_value", {"system, developer, user, assistant, tool", "\"robot\""}));
  EXPECT_TRUE(
      is_error(one({{"role", "user"}}), 400, "messages[0].content", "missing_required_parameter"));
  EXPECT_TRUE(is_error(one({{"role", "user"}, {"content", 5}}), 400, "messages[0].content",
                       "invalid_type", {"a string, an array of text parts or null"}));
  EXPECT_TRUE(is_error(one({{"role", "user"}, {"content", std::string("\xFF")}}), 400,
                       "messages[0].content", "invalid_value", {"UTF-8"}));
  const ojson image = {{"type", "image_url"}, {"image_url", {{"url", "x"}}}};
  EXPECT_TRUE(is_error(one({{"role", "user"}, {"content", ojson::array({image})}}), 400,
                       "messages[0].content[0].type", "unsupported_parameter", {"text only"}));
  EXPECT_TRUE(is_error(one({{"role", "user"}, {"content", ojson::array({{{"type", "text"}}})}}),
                       400, "messages[0].content[0].text", "missing_required_parameter"));
  EXPECT_TRUE(is_error(
      one({{"role", "user"}, {"content", ojson::array({{{"type", "text"}, {"text", 1}}})}}), 400,
      "messages[0].content[0].text", "invalid_type"));
  EXPECT_TRUE(is_error(one({{"role", "user"}, {"content", ojson::array({"x"})}}), 400,
                       "messages[0].content[0]", "invalid_type"));
  EXPECT_TRUE(is_error(one({{"role", "user"}, {"content", ojson::array({{{"text", "x"}}})}}), 400,
                       "messages[0].content[0].type", "missing_required_parameter"));
  EXPECT_TRUE(is_error(one({{"role", "user"}, {"content", "x"}, {"name", 3}}), 400,
                       "messages[0].name", "invalid_type"));
  EXPECT_TRUE(is_error(one({{"role", "tool"}, {"content", "x"}, {"tool_call_id", 3}}), 400,
                       "messages[0].tool_call_id", "invalid_type"));
  EXPECT_TRUE(is_error(one({{"role", "assistant"}, {"reasoning_content", 3}}), 400,
                       "messages[0].reasoning_content", "invalid_type"));
  EXPECT_TRUE(is_error(one({{"role", "user"}, {"content", "x"}, {"tool_calls", ojson::array()}}),
                       400, "messages[0].tool_calls", "invalid_value",
                       {"only allowed in assistant messages"}));
  EXPECT_TRUE(is_error(one({{"role", "assistant"}, {"tool_calls", "x"}}), 400,
                       "messages[0].tool_calls", "invalid_type"));
  EXPECT_TRUE(
      is_error(one({{"role", "assistant"}, {"tool_calls", ojson::array({ojson::object()})}}), 400,
               "messages[0].tool_calls[0].function", "missing_required_parameter"));
  EXPECT_TRUE(is_error(one({{"role", "assistant"},
                            {"tool_calls", ojson::array({{{"function", {{"arguments", "{}"}}}}})}}),
                       400, "messages[0].tool_calls[0].function.name",
                       "missing_required_parameter"));
  EXPECT_TRUE(is_error(
      one({{"role", "assistant"},
           {"tool_calls", ojson::array({{{"function", {{"name", "f"}, {"arguments", 5}}}}})}}),
      400, "messages[0].tool_calls[0].function.arguments", "invalid_type"));
  ProtocolLimits limits;
  limits.max_messages = 2;
  const ojson m = {{"role", "user"}, {"content", "x"}};
  EXPECT_TRUE(is_error(with_messages(ojson::array({m, m, m}), limits), 400, "messages",
                       "out_of_range", {"3 messages; the limit is 2"}));
  limits = {};
  limits.max_prompt_bytes = 3;
  EXPECT_TRUE(is_error(with_messages(ojson::array({m, m, m, m}), limits), 400, "messages",
                       "out_of_range", {"over 3 bytes"}));
  limits = {};
  limits.max_content_parts = 1;
  const ojson part = {{"type", "text"}, {"text", "x"}};
  EXPECT_TRUE(is_error(
      with_messages(ojson::array({{{"role", "user"}, {"content", ojson::array({part, part})}}}),
                    limits),
      400, "messages[0].content", "out_of_range", {"2 parts; the limit is 1"}));
}

TEST(ServeProtocol, ToolsAndKwargsRejects) {
  EXPECT_TRUE(is_error(chat_with("tools", "x"), 400, "tools", "invalid_type"));
  EXPECT_TRUE(is_error(chat_with("tools", ojson::array({5})), 400, "tools[0]", "invalid_type"));
  EXPECT_TRUE(is_error(chat_with("tools", ojson::array({{{"type", "code"}}})), 400, "tools[0].type",
                       "invalid_value", {"must be \"function\"", "\"code\""}));
  EXPECT_TRUE(is_error(chat_with("tools", ojson::array({{{"type", "function"}}})), 400,
                       "tools[0].function", "missing_required_parameter"));
  EXPECT_TRUE(is_error(
      chat_with("tools", ojson::array({{{"type", "function"}, {"function", ojson::object()}}})),
      400, "tools[0].function.name", "missing_required_parameter"));
  EXPECT_TRUE(is_error(chat_with("chat_template_kwargs", ojson::array()), 400,
                       "chat_template_kwargs", "invalid_type", {"an object"}));
  ojson deep = 1;
  for (int i = 0; i < 80; ++i) deep = ojson{{"k", deep}};
  EXPECT_TRUE(is_error(chat_with("chat_template_kwargs", deep), 400, "chat_template_kwargs",
                       "invalid_value", {"deeper than 64 levels"}));
}

// ---- adapter selection ----

TEST(ServeProtocol, AdapterSelectionForms) {
  struct Case {
    ojson fields;
    std::string adapter;
    std::string requested;
  };
  const std::vector<Case> cases = {
      {{{"model", "qwen3-moe"}}, "", "qwen3-moe"},
      {ojson::object(), "", "qwen3-moe"},  // no model: the base
      {{{"model", nullptr}}, "", "qwen3-moe"},
      {{{"model", "math"}}, "math", "math"},                   // vLLM: adapter name
      {{{"model", "qwen3-moe:sql"}}, "sql", "qwen3-moe:sql"},  // SGLang: BASE:ADAPTER
      {{{"model", "team:b"}}, "team:b", "team:b"},             // a name with ':' is a name first
      {{{"lora_path", "sql"}}, "sql", "qwen3-moe"},            // SGLang: lora_path
      {{{"model", "qwen3-moe"}, {"lora_path", "sql"}}, "sql", "qwen3-moe"},
      {{{"model", "sql"}, {"lora_path", "sql"}}, "sql", "sql"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.fields.dump());
    ojson body = completion_body();
    body.erase("model");
    for (auto it = c.fields.begin(); it != c.fields.end(); ++it) body[it.key()] = it.value();
    auto r = parse_completion_request(body, registry());
    ASSERT_TRUE(r.is_ok()) << r.error().message;
    EXPECT_EQ(r.value().model.adapter, c.adapter);
    EXPECT_EQ(r.value().model.base, "qwen3-moe");
    EXPECT_EQ(r.value().model.requested, c.requested);
    body.erase("prompt");
    body["messages"] = chat_body()["messages"];
    auto h = parse_chat_completion_request(body, registry());
    ASSERT_TRUE(h.is_ok()) << h.error().message;
    EXPECT_EQ(h.value().model.adapter, c.adapter);
    auto m = resolve_model(body, registry());
    ASSERT_TRUE(m.is_ok());
    EXPECT_EQ(m.value().adapter, c.adapter);
  }
}

TEST(ServeProtocol, AdapterSelectionRejects) {
  EXPECT_TRUE(is_error(completion_with("model", "nope"), 404, "model", "model_not_found",
                       {"The model 'nope' does not exist"}));
  EXPECT_TRUE(
      is_error(completion_with("model", "qwen3-moe:nope"), 404, "model", "model_not_found", {}));
  EXPECT_TRUE(is_error(completion_with("model", "other:sql"), 404, "model", "model_not_found", {}));
  EXPECT_TRUE(
      is_error(completion_with("model", "qwen3-moe:"), 404, "model", "model_not_found", {}));
  EXPECT_TRUE(is_error(chat_with("lora_path", "nope"), 404, "lora_path", "model_not_found",
                       {"adapter 'nope'"}));
  EXPECT_TRUE(
      is_error(chat_with("model", 5), 400, "model", "invalid_type", {"'model' must be a string"}));
  EXPECT_TRUE(is_error(chat_with("lora_path", 5), 400, "lora_path", "invalid_type", {}));
  ojson both = chat_body();
  both["model"] = "math";
  both["lora_path"] = "sql";
  EXPECT_TRUE(is_error(parse_chat_completion_request(both, registry()), 400, "lora_path",
                       "invalid_value", {"'sql'", "'math'"}));
  // A huge name is clipped in the message.
  auto big = completion_with("model", std::string(100000, 'm'));
  ASSERT_FALSE(big.is_ok());
  EXPECT_LT(big.error().message.size(), 300u);
  // A malformed request is a 400 even when it also names an unknown model.
  ojson bad = completion_body();
  bad["model"] = "nope";
  bad["temperature"] = -1;
  EXPECT_TRUE(
      is_error(parse_completion_request(bad, registry()), 400, "temperature", "out_of_range"));
  EXPECT_TRUE(is_error(resolve_model(ojson::array(), registry()), 400, "body", "invalid_type"));
}

TEST(ServeProtocol, RegistryIsSortedAndUnique) {
  StaticModelRegistry r("base", {"b", "a", "b"});
  EXPECT_EQ(r.adapter_names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(r.has_adapter("a"));
  EXPECT_FALSE(r.has_adapter("c"));
  EXPECT_EQ(r.base_model(), "base");
}

// ---- body parsing ----

TEST(ServeProtocol, JsonBody) {
  auto ok = parse_json_body(R"({"b": 1, "a": "[[{"})");
  ASSERT_TRUE(ok.is_ok());
  EXPECT_EQ(ok.value().dump(), R"({"b":1,"a":"[[{"})");  // order kept; brackets in strings ignored
  EXPECT_TRUE(is_error(parse_json_body("{\"a\": "), 400, "", "invalid_json", {"not valid JSON"}));
  EXPECT_TRUE(is_error(parse_json_body(""), 400, "", "invalid_json", {}));
  EXPECT_TRUE(is_error(parse_json_body(std::string(65, '[') + std::string(65, ']')), 400, "",
                       "invalid_json", {"deeper than 64"}));
  EXPECT_TRUE(parse_json_body(std::string(64, '[') + std::string(64, ']')).is_ok());
  EXPECT_TRUE(is_error(parse_json_body(std::string(1000000, '[')), 400, "", "invalid_json", {}));
  ProtocolLimits limits;
  limits.max_body_bytes = 4;
  EXPECT_TRUE(is_error(parse_json_body("{\"a\":1}", limits), 400, "", "invalid_json",
                       {"7 bytes; the limit is 4"}));
  EXPECT_TRUE(is_error(parse_completion_request(ojson::array(), registry()), 400, "body",
                       "invalid_type", {"a JSON object"}));
  EXPECT_TRUE(
      is_error(parse_chat_completion_request("x", registry()), 400, "body", "invalid_type"));
}

TEST(ServeProtocol, EngineSamplingMapping) {
  GenerationParams p;
  p.temperature = 0.5;
  p.top_p = 0.9;
  p.top_k = 7;
  p.stop_token_ids = {3, 4};
  p.ignore_eos = true;
  moelora::SamplingParams s = to_engine_sampling(p, 128, 1000, 2);
  EXPECT_EQ(s.temperature, 0.5);
  EXPECT_EQ(s.top_p, 0.9);
  EXPECT_EQ(s.top_k, 7);
  EXPECT_EQ(s.max_new_tokens, 128);
  EXPECT_EQ(s.seed, 1002u);
  EXPECT_TRUE(s.ignore_eos);
  EXPECT_EQ(s.stop_token_ids, (std::vector<int32_t>{3, 4}));
  p.max_tokens = 9;
  p.seed = 5;
  s = to_engine_sampling(p, 128, 1000, 0);
  EXPECT_EQ(s.max_new_tokens, 9);
  EXPECT_EQ(s.seed, 5u);
}

}  // namespace
}  // namespace moelora::serve
