// Seeded random test of the OpenAI-compatible request protocol (serve/protocol.h): arbitrary JSON
// values (wrong types, huge and negative integers, NaN, invalid UTF-8, long arrays, deep nesting)
// in every field of both endpoints, in the first message, and as truncated body text. Whatever
// comes in, the answer is a valid request (within the limits) or a 4xx error whose JSON
// serializes; nothing throws or crashes. MOELORA_TEST_SEED replays a run.
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/tokenizer.h"
#include "serve/protocol.h"
#include "support/test_support.h"

namespace moelora::serve {
namespace {

using ojson = nlohmann::ordered_json;

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

ojson random_json(std::mt19937_64& rng, int depth) {
  std::uniform_int_distribution<int> kind(0, depth > 3 ? 7 : 9);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  if (depth == 0 && pick(40) == 0) {  // deep nesting, past every depth limit
    ojson deep = "x";
    for (int i = 0, n = 65 + pick(400); i < n; ++i) {
      deep = pick(2) ? ojson::array({deep}) : ojson{{"content", deep}};
    }
    return deep;
  }
  switch (kind(rng)) {
    case 0: return nullptr;
    case 1: return pick(2) == 1;
    case 2: {
      static const int64_t edges[] = {0,
                                      1,
                                      -1,
                                      2,
                                      20,
                                      21,
                                      256,
                                      1 << 30,
                                      (int64_t{1} << 30) + 1,
                                      INT32_MAX,
                                      int64_t{INT32_MAX} + 1,
                                      INT64_MIN,
                                      INT64_MAX};
      return edges[pick(13)];
    }
    case 3: return std::numeric_limits<uint64_t>::max() - static_cast<uint64_t>(pick(3));
    case 4: {
      static const double edges[] = {0.0, 0.5, 1.0, 1.5, -0.1, 2.0, 2.5, 1e308, -1e308, 5.0, 1e19};
      return edges[pick(11)];
    }
    case 5: return std::numeric_limits<double>::quiet_NaN();
    case 6:
    case 7: {
      static const char* words[] = {"",         "user",      "assistant", "text",
                                    "function", "qwen3-moe", "math",      "qwen3-moe:sql",
                                    "\n",       "é",         "\xFF\xFE",  "a\xC3"};
      std::string s = words[pick(12)];
      if (pick(4) == 0) s += std::string(static_cast<size_t>(pick(400)), 'x');
      return s;
    }
    case 8: {
      ojson a = ojson::array();
      const int n = pick(pick(8) == 0 ? 300 : 5);
      for (int i = 0; i < n; ++i) a.push_back(random_json(rng, depth + 1));
      return a;
    }
    default: {
      static const char* keys[] = {"role", "content",   "type",          "text",       "function",
                                   "name", "arguments", "include_usage", "tool_calls", "x"};
      ojson o = ojson::object();
      const int n = pick(5);
      for (int i = 0; i < n; ++i) o[keys[pick(10)]] = random_json(rng, depth + 1);
      return o;
    }
  }
}

template <typename T>
void expect_valid_or_4xx(const ApiResult<T>& r, const std::string& trace) {
  if (r.is_ok()) return;
  const ApiError& e = r.error();
  EXPECT_GE(e.http_status, 400) << trace;
  EXPECT_LT(e.http_status, 500) << trace << ": " << e.message;
  EXPECT_FALSE(e.message.empty()) << trace;
  const std::string dumped = e.to_json().dump();  // must serialize whatever the input held
  EXPECT_FALSE(io::find_invalid_utf8(dumped)) << trace;
}

TEST(ServeProtocol, RandomValuesNeverCrash) {
  std::mt19937_64 rng(test::test_seed(20261202));
  const std::vector<std::string> fields = {"model",
                                           "lora_path",
                                           "prompt",
                                           "messages",
                                           "max_tokens",
                                           "max_completion_tokens",
                                           "temperature",
                                           "top_p",
                                           "top_k",
                                           "min_p",
                                           "seed",
                                           "stop",
                                           "stop_token_ids",
                                           "logprobs",
                                           "top_logprobs",
                                           "n",
                                           "best_of",
                                           "stream",
                                           "stream_options",
                                           "ignore_eos",
                                           "presence_penalty",
                                           "frequency_penalty",
                                           "repetition_penalty",
                                           "user",
                                           "echo",
                                           "suffix",
                                           "logit_bias",
                                           "tools",
                                           "tool_choice",
                                           "chat_template_kwargs",
                                           "response_format",
                                           "skip_special_tokens",
                                           "add_generation_prompt"};
  ProtocolLimits limits;
  limits.max_n = 2;
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    ojson c = completion_body();
    ojson h = chat_body();
    h["stream"] = true;  // so that stream_options is reachable
    const int changes = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < changes; ++k) {
      const std::string& f = fields[rng() % fields.size()];
      const ojson v = random_json(rng, 0);
      c[f] = v;
      h[f] = v;
    }
    // Also vary one field of the first message.
    static const char* msg_keys[] = {"role",       "content",      "name",
                                     "tool_calls", "tool_call_id", "reasoning_content"};
    if (h["messages"].is_array() && !h["messages"].empty() && h["messages"][0].is_object()) {
      h["messages"][0][msg_keys[rng() % 6]] = random_json(rng, 0);
    }
    const std::string trace =
        "iteration " + std::to_string(iter) + ": " +
        c.dump(-1, ' ', false, ojson::error_handler_t::replace).substr(0, 300);
    auto cr = parse_completion_request(c, registry(), limits);
    expect_valid_or_4xx(cr, trace);
    auto hr = parse_chat_completion_request(h, registry(), limits);
    expect_valid_or_4xx(hr, trace);
    if (cr.is_ok()) {
      ++accepted;
      const auto& p = cr.value().params;
      EXPECT_GE(p.n, 1);
      EXPECT_LE(p.n, limits.max_n);
      EXPECT_TRUE(p.temperature >= 0 && p.temperature <= 2);
      EXPECT_TRUE(p.top_p > 0 && p.top_p <= 1);
      EXPECT_GE(p.top_k, 0);
      EXPECT_TRUE(!p.max_tokens ||
                  (*p.max_tokens >= 1 && *p.max_tokens <= limits.max_tokens_limit));
      EXPECT_TRUE(!p.logprobs || (*p.logprobs >= 0 && *p.logprobs <= limits.max_logprobs));
      EXPECT_LE(p.stop.size(), limits.max_stop_strings);
      EXPECT_TRUE(cr.value().prompt_is_tokens ? !cr.value().prompt_tokens.empty()
                                              : !cr.value().prompt_text.empty());
    }
    if (hr.is_ok()) {
      EXPECT_FALSE(hr.value().messages.empty());
    }
    // The raw-body path too: text with random cuts.
    std::string text = c.dump(-1, ' ', false, ojson::error_handler_t::replace);
    text.resize(rng() % (text.size() + 1));
    auto body = parse_json_body(text);
    expect_valid_or_4xx(body, "body " + std::to_string(iter));
  }
  EXPECT_GT(accepted, 0);  // the generator reaches the accept paths too
}

}  // namespace
}  // namespace moelora::serve
