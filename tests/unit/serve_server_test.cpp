// `moelora serve` end to end on the CPU engine: a real HTTP server on a free port, a synthesized
// tiny Qwen3-MoE with the test tokenizer and chat template, two LoRA adapters in different
// layouts, and cpp-httplib's client. Every answer is checked against the engine run directly.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "chat/chat_template.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "model/model_setup.h"
#include "moelora/engine.h"
#include "serve/stop_matcher.h"
#include "server/server.h"
#include "support/serve_client.h"
#include "support/test_support.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The model, its adapters and a scratch root, made once for the whole suite.
struct Fixture {
  fs::path root;
  fs::path model;
  fs::path lora_root;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture x;
    x.root = fs::temp_directory_path() / ("moelora-serve-test-" + std::to_string(::getpid()));
    fs::remove_all(x.root);
    x.model = x.root / "tiny";
    x.lora_root = x.root / "loras";
    auto check = [](const test::CommandResult& r) {
      if (r.exit_code != 0) throw std::runtime_error("setup failed: " + r.output);
    };
    check(test::run_moelora("synth --preset tiny-qwen3-moe --seed 3 --out " + x.model.string() +
                            " --tokenizer " + (test::data_dir() / "tokenizer").string()));
    check(test::run_moelora("synth-adapter --model " + x.model.string() +
                            " --targets all --rank 8 --seed 11 --out " +
                            (x.lora_root / "a").string()));
    check(test::run_moelora("synth-adapter --model " + x.model.string() +
                            " --targets all --rank 4 --seed 12 --layout peft-3d --out " +
                            (x.lora_root / "b").string()));
    return x;
  }();
  return f;
}

std::unique_ptr<Engine> make_engine(int32_t max_running = 16) {
  EngineOptions o;
  o.model_dir = fixture().model;
  o.device = "cpu";
  o.max_running = max_running;
  o.max_loras_per_batch = 4;
  o.adapter_slots = 4;
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  if (!e.is_ok()) throw std::runtime_error(e.status().message());
  return std::move(e.value());
}

std::unique_ptr<server::Server> start_server(server::ServerOptions options,
                                             bool with_adapters = true, int32_t max_running = 16) {
  std::unique_ptr<Engine> engine = make_engine(max_running);
  if (with_adapters) {
    EXPECT_TRUE(engine->register_adapter("a", fixture().lora_root / "a").is_ok());
    EXPECT_TRUE(engine->register_adapter("b", fixture().lora_root / "b").is_ok());
  }
  options.host = "127.0.0.1";
  options.port = 0;
  options.served_model_name = "tiny";
  options.http_threads = 8;
  options.limits.max_n = 4;
  auto s = server::Server::create(std::move(engine), io::Tokenizer::load(fixture().model),
                                  chat::ChatTemplate::load(fixture().model), options);
  if (!s.is_ok()) throw std::runtime_error(s.status().message());
  Status started = s.value()->start();
  if (!started.is_ok()) throw std::runtime_error(started.message());
  return std::move(s.value());
}

using Answer = test::HttpAnswer;
using Stream = test::SseAnswer;
Answer post(int port, const std::string& path, const std::string& body,
            const httplib::Headers& headers = {}) {
  return test::http_post(port, path, body, headers);
}
Answer get(int port, const std::string& path, const httplib::Headers& headers = {}) {
  return test::http_get(port, path, headers);
}
Stream post_stream(int port, const std::string& path, const std::string& body) {
  return test::http_post_stream(port, path, body);
}

// What the engine generates for these ids when run directly (same options, no server).
std::vector<int32_t> engine_tokens(const std::vector<int32_t>& prompt, const std::string& adapter,
                                   int64_t max_new_tokens, double temperature = 0.0,
                                   uint64_t seed = 0) {
  std::unique_ptr<Engine> engine = make_engine();
  if (!adapter.empty()) {
    EXPECT_TRUE(engine->register_adapter(adapter, fixture().lora_root / adapter).is_ok());
  }
  Request r;
  r.prompt = prompt;
  r.adapter = adapter;
  r.sampling.max_new_tokens = max_new_tokens;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  std::vector<int32_t> out;
  EXPECT_TRUE(engine
                  ->submit(r,
                           [&](const TokenEvent& e) {
                             if (e.token >= 0) out.push_back(e.token);
                           })
                  .is_ok());
  EXPECT_TRUE(engine->run_until_idle().is_ok());
  return out;
}

// The text the server streams for these tokens.
std::string text_of(const std::vector<int32_t>& tokens) {
  io::Tokenizer tok = io::Tokenizer::load(fixture().model);
  serve::IncrementalDetokenizer d(tok);
  std::string s;
  for (int32_t t : tokens) s += d.add(t);
  return s + d.finish();
}

class ServeServer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = start_server({}).release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  int port() const { return server_->port(); }
  static server::Server* server_;
};
server::Server* ServeServer::server_ = nullptr;

const std::vector<int32_t> kPrompt = {11, 305, 489, 77, 3};

TEST_F(ServeServer, ModelsListsBaseAndAdaptersWithParent) {
  Answer a = get(port(), "/v1/models");
  ASSERT_EQ(a.status, 200) << a.raw;
  ASSERT_EQ(a.body["object"], "list");
  std::map<std::string, json> by_id;
  for (const json& m : a.body["data"]) by_id[m["id"]] = m;
  ASSERT_EQ(by_id.size(), 3u) << a.raw;
  EXPECT_TRUE(by_id["tiny"]["parent"].is_null());
  EXPECT_EQ(by_id["a"]["parent"], "tiny");
  EXPECT_EQ(by_id["b"]["parent"], "tiny");
}

TEST_F(ServeServer, CompletionTokensEqualTheEngineRunDirectly) {
  for (const std::string adapter : {"", "a", "b"}) {
    json body = {{"prompt", kPrompt}, {"max_tokens", 12}, {"temperature", 0}};
    if (!adapter.empty()) body["model"] = adapter;
    Answer a = post(port(), "/v1/completions", body.dump());
    ASSERT_EQ(a.status, 200) << a.raw;
    const std::vector<int32_t> expected = engine_tokens(kPrompt, adapter, 12);
    EXPECT_EQ(a.body["choices"][0]["text"], text_of(expected)) << "adapter '" << adapter << "'";
    EXPECT_EQ(a.body["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(a.body["usage"]["prompt_tokens"], 5);
    EXPECT_EQ(a.body["usage"]["completion_tokens"], 12);
    EXPECT_EQ(a.body["usage"]["total_tokens"], 17);
    EXPECT_EQ(a.body["object"], "text_completion");
    EXPECT_EQ(a.body["model"], adapter.empty() ? "tiny" : adapter);
  }
}

TEST_F(ServeServer, AdapterSelectionFormsAgree) {
  auto text = [&](json body) {
    body["prompt"] = kPrompt;
    body["max_tokens"] = 10;
    body["temperature"] = 0;
    Answer a = post(port(), "/v1/completions", body.dump());
    EXPECT_EQ(a.status, 200) << a.raw;
    return a.body["choices"][0]["text"].get<std::string>();
  };
  const std::string by_name = text({{"model", "a"}});
  EXPECT_EQ(text({{"model", "tiny:a"}}), by_name);
  EXPECT_EQ(text({{"lora_path", "a"}}), by_name);
  EXPECT_EQ(text({{"model", "tiny"}, {"lora_path", "a"}}), by_name);
  EXPECT_NE(text({{"model", "tiny"}}), by_name);
  EXPECT_NE(text({{"model", "b"}}), by_name);
  Answer unknown = post(port(), "/v1/completions",
                        json{{"model", "nope"}, {"prompt", "x"}, {"max_tokens", 1}}.dump());
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(unknown.body["error"]["code"], "model_not_found");
  Answer unknown_sglang =
      post(port(), "/v1/completions", json{{"model", "tiny:nope"}, {"prompt", "x"}}.dump());
  EXPECT_EQ(unknown_sglang.status, 404);
}

TEST_F(ServeServer, StreamedChunksConcatenateToTheWholeAnswer) {
  for (const bool chat : {false, true}) {
    json body = {{"max_tokens", 9}, {"temperature", 0}, {"model", "b"}};
    if (chat)
      body["messages"] = json::array({{{"role", "user"}, {"content", "Hello there"}}});
    else
      body["prompt"] = "Hello there";
    const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
    Answer whole = post(port(), path, body.dump());
    ASSERT_EQ(whole.status, 200) << whole.raw;
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
    Stream s = post_stream(port(), path, body.dump());
    ASSERT_EQ(s.status, 200);
    EXPECT_TRUE(s.done) << "no [DONE]";
    ASSERT_GE(s.events.size(), 3u);
    std::string text;
    std::string finish;
    for (size_t i = 0; i + 1 < s.events.size(); ++i) {
      const json& c = s.events[i]["choices"][0];
      EXPECT_TRUE(s.events[i]["usage"].is_null());
      EXPECT_EQ(s.events[i]["id"], s.events[0]["id"]);
      if (chat) {
        EXPECT_EQ(s.events[i]["object"], "chat.completion.chunk");
        if (i == 0) {
          EXPECT_EQ(c["delta"]["role"], "assistant");
        }
        if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
      } else {
        text += c["text"].get<std::string>();
      }
      if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
    }
    const json& usage_event = s.events.back();
    EXPECT_TRUE(usage_event["choices"].empty());
    EXPECT_EQ(usage_event["usage"], whole.body["usage"]);
    EXPECT_EQ(finish, "length");
    const json& c = whole.body["choices"][0];
    EXPECT_EQ(text,
              chat ? c["message"]["content"].get<std::string>() : c["text"].get<std::string>())
        << (chat ? "chat" : "completions");
  }
}

TEST_F(ServeServer, ChatPromptIsTheRenderedTemplate) {
  const json messages = json::array(
      {{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "Hi"}}});
  Answer tok = post(port(), "/v1/tokenize", json{{"messages", messages}}.dump());
  ASSERT_EQ(tok.status, 200) << tok.raw;
  const std::string rendered = chat::ChatTemplate::load(fixture().model)
                                   .render(nlohmann::ordered_json::parse(messages.dump()), true);
  const std::vector<int32_t> ids = io::Tokenizer::load(fixture().model).encode(rendered, false);
  EXPECT_EQ(tok.body["tokens"].get<std::vector<int32_t>>(), ids);
  Answer chat = post(port(), "/v1/chat/completions",
                     json{{"messages", messages}, {"max_tokens", 6}, {"temperature", 0}}.dump());
  ASSERT_EQ(chat.status, 200) << chat.raw;
  EXPECT_EQ(chat.body["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(chat.body["choices"][0]["message"]["content"], text_of(engine_tokens(ids, "", 6)));
  EXPECT_EQ(chat.body["choices"][0]["message"]["role"], "assistant");
}

TEST_F(ServeServer, StopStringsAndStopTokenIdsEndTheChoice) {
  const std::vector<int32_t> full = engine_tokens(kPrompt, "", 16);
  // stop_token_ids: the 4th generated token ends it; its text is not in the answer.
  Answer a = post(port(), "/v1/completions",
                  json{{"prompt", kPrompt},
                       {"max_tokens", 16},
                       {"temperature", 0},
                       {"stop_token_ids", {full[3]}}}
                      .dump());
  ASSERT_EQ(a.status, 200) << a.raw;
  size_t first = 0;
  while (full[first] != full[3]) ++first;
  EXPECT_EQ(a.body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(a.body["usage"]["completion_tokens"], first + 1);
  EXPECT_EQ(a.body["choices"][0]["text"],
            text_of(std::vector<int32_t>(full.begin(), full.begin() + first)));

  // A stop string from the middle of the text: the answer ends before its first occurrence.
  const std::string text = text_of(full);
  std::string stop;
  for (size_t at = 2; at + 2 < text.size() && stop.empty(); ++at) {
    std::string cand = text.substr(at, 2);
    if (serve::Utf8StreamJoiner().push(cand) == cand) stop = cand;  // whole characters only
  }
  ASSERT_FALSE(stop.empty()) << text;
  for (const bool stream : {false, true}) {
    json body = {{"prompt", kPrompt}, {"max_tokens", 16}, {"temperature", 0}, {"stop", {stop}}};
    std::string got;
    std::string finish;
    if (stream) {
      body["stream"] = true;
      Stream s = post_stream(port(), "/v1/completions", body.dump());
      for (const json& e : s.events) {
        got += e["choices"][0]["text"].get<std::string>();
        if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
      }
      EXPECT_TRUE(s.done);
    } else {
      Answer r = post(port(), "/v1/completions", body.dump());
      got = r.body["choices"][0]["text"];
      finish = r.body["choices"][0]["finish_reason"];
    }
    EXPECT_EQ(got, text.substr(0, text.find(stop))) << "stop '" << stop << "' stream " << stream;
    EXPECT_EQ(finish, "stop");
  }
}

TEST_F(ServeServer, SeededSamplingAndSeveralChoices) {
  json body = {{"prompt", kPrompt}, {"max_tokens", 8}, {"temperature", 1.0},
               {"top_k", 50},       {"seed", 1234},    {"n", 3}};
  Answer a = post(port(), "/v1/completions", body.dump());
  Answer b = post(port(), "/v1/completions", body.dump());
  ASSERT_EQ(a.status, 200) << a.raw;
  ASSERT_EQ(a.body["choices"].size(), 3u);
  EXPECT_EQ(a.body["choices"], b.body["choices"]) << "same seed, same answer";
  EXPECT_EQ(a.body["usage"]["completion_tokens"], 24);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a.body["choices"][i]["index"], i);
  body["n"] = 5;
  Answer too_many = post(port(), "/v1/completions", body.dump());
  EXPECT_EQ(too_many.status, 400);
  EXPECT_EQ(too_many.body["error"]["param"], "n");
}

TEST_F(ServeServer, LogprobsAreTheModelsLogSoftmax) {
  // Greedy through adapter b with 3 alternatives per token, whole and streamed.
  const json body = {{"model", "b"},     {"prompt", kPrompt}, {"max_tokens", 6},
                     {"temperature", 0}, {"logprobs", 3},     {"ignore_eos", true}};
  Answer a = post(port(), "/v1/completions", body.dump());
  ASSERT_EQ(a.status, 200) << a.raw;
  const json& lp = a.body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), 6u) << a.raw;
  const std::vector<int32_t> tokens = engine_tokens(kPrompt, "b", 6);
  // The reference: one forward of the CPU model over prompt + tokens, log-softmax per row.
  model::Model m = model::load_model(fixture().model, {{"b", fixture().lora_root / "b"}});
  std::vector<int32_t> input = kPrompt;
  input.insert(input.end(), tokens.begin(), tokens.end() - 1);
  model::Sequence seq = m.new_sequence("b");
  const Tensor logits = m.forward(seq, input);
  const int64_t V = logits.dim(1);
  io::Tokenizer tok = io::Tokenizer::load(fixture().model);
  size_t offset = 0;
  for (size_t j = 0; j < tokens.size(); ++j) {
    const float* row = logits.data<float>() + (static_cast<int64_t>(kPrompt.size()) - 1 + j) * V;
    double max = row[0], sum = 0;
    for (int64_t v = 0; v < V; ++v) max = std::max<double>(max, row[v]);
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - max);
    const double lse = max + std::log(sum);
    EXPECT_NEAR(lp["token_logprobs"][j].get<double>(), row[tokens[j]] - lse, 1e-4) << "token " << j;
    EXPECT_EQ(lp["tokens"][j], io::sanitize_utf8(tok.decode_token(tokens[j])));
    EXPECT_EQ(lp["text_offset"][j], offset);
    offset += tok.decode_token(tokens[j]).size();  // offsets count the tokens' bytes
    // Greedy: the chosen token is the most likely one, and the alternatives are the top 3.
    std::vector<double> top;
    for (auto& [text, value] : lp["top_logprobs"][j].items()) top.push_back(value.get<double>());
    ASSERT_EQ(top.size(), 3u);
    std::sort(top.rbegin(), top.rend());
    EXPECT_NEAR(top[0], lp["token_logprobs"][j].get<double>(), 1e-6);
    std::vector<double> ref(row, row + V);
    std::sort(ref.rbegin(), ref.rend());
    for (int k = 0; k < 3; ++k)
      EXPECT_NEAR(top[k], ref[k] - lse, 1e-4) << "token " << j << " top " << k;
  }
  // Streamed: the same logprobs, spread over the chunks.
  json stream_body = body;
  stream_body["stream"] = true;
  Stream s = post_stream(port(), "/v1/completions", stream_body.dump());
  std::vector<double> streamed;
  for (const json& e : s.events)
    if (!e["choices"].empty() && e["choices"][0]["logprobs"].is_object())
      for (const json& v : e["choices"][0]["logprobs"]["token_logprobs"]) streamed.push_back(v);
  EXPECT_EQ(streamed, lp["token_logprobs"].get<std::vector<double>>());
  // Chat: logprobs=true with top_logprobs; greedy, so the answer is the same on every run. The
  // end-of-sequence token that stops a choice counts in usage but is not content, so it has no
  // logprobs entry (a sampled first token could be exactly that).
  Answer c = post(port(), "/v1/chat/completions",
                  json{{"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})},
                       {"max_tokens", 3},
                       {"temperature", 0},
                       {"logprobs", true},
                       {"top_logprobs", 2}}
                      .dump());
  ASSERT_EQ(c.status, 200) << c.raw;
  const json& content = c.body["choices"][0]["logprobs"]["content"];
  const bool stopped = c.body["choices"][0]["finish_reason"] == "stop";
  ASSERT_EQ(content.size() + (stopped ? 1 : 0), c.body["usage"]["completion_tokens"].get<size_t>())
      << c.raw;
  ASSERT_FALSE(content.empty()) << c.raw;  // the greedy answer has content tokens to check
  for (const json& t : content) {
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_TRUE(t["bytes"].is_array());
  }
}

TEST_F(ServeServer, BadRequestsGetOpenAIErrorsNamingTheField) {
  struct Case {
    std::string path, body;
    int status;
    std::string param;
  };
  const std::vector<Case> cases = {
      {"/v1/completions", "{not json", 400, ""},
      {"/v1/completions", "[1, 2]", 400, ""},
      {"/v1/completions", R"({"prompt": 5})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": "x", "temperature": -1})", 400, "temperature"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 1000000})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": [1, 2, 99999]})", 400, "prompt[2]"},
      {"/v1/completions", R"({"prompt": "x", "logprobs": 21})", 400, "logprobs"},
      {"/v1/chat/completions", R"({"messages": "hi"})", 400, "messages"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "stream": "yes"})", 400, "stream"},
      {"/v1/chat/completions",
       R"({"model": "zzz", "messages": [{"role": "user", "content": "x"}]})", 404, "model"},
  };
  for (const Case& c : cases) {
    Answer a = post(port(), c.path, c.body);
    EXPECT_EQ(a.status, c.status) << c.body << " -> " << a.raw;
    ASSERT_TRUE(a.body.contains("error")) << a.raw;
    EXPECT_FALSE(a.body["error"]["message"].get<std::string>().empty());
    EXPECT_TRUE(a.body["error"].contains("type"));
    if (!c.param.empty()) {
      EXPECT_EQ(a.body["error"]["param"], c.param) << a.raw;
    }
  }
  // A prompt longer than the context.
  std::vector<int32_t> huge(5000, 7);
  Answer a = post(port(), "/v1/completions", json{{"prompt", huge}, {"max_tokens", 1}}.dump());
  EXPECT_EQ(a.status, 400);
  EXPECT_EQ(a.body["error"]["code"], "context_length_exceeded");
  Answer route = get(port(), "/v1/nothing");
  EXPECT_EQ(route.status, 404);
  EXPECT_TRUE(route.body.contains("error"));
  EXPECT_EQ(get(port(), "/health").status, 200);
}

TEST_F(ServeServer, HostileBodiesNeverBreakTheServer) {
  std::mt19937_64 rng(test::test_seed(77));
  const std::vector<std::string> pieces = {"{",
                                           "}",
                                           "[",
                                           "]",
                                           "\"prompt\"",
                                           "\"messages\"",
                                           ":",
                                           ",",
                                           "\"model\"",
                                           "\"a\"",
                                           "null",
                                           "1e999",
                                           "-1",
                                           "\"\\ud800\"",
                                           "\"max_tokens\"",
                                           "99999999999999999999",
                                           "true",
                                           "{\"role\":\"user\",\"content\":\"x\"}",
                                           "\"stream\"",
                                           "\"n\"",
                                           "\"stop\"",
                                           "\xff",
                                           "0"};
  for (int i = 0; i < 150; ++i) {
    std::string body;
    const int n = static_cast<int>(rng() % 24);
    for (int k = 0; k < n; ++k) body += pieces[rng() % pieces.size()];
    const char* path = (i % 2) ? "/v1/completions" : "/v1/chat/completions";
    Answer a = post(port(), path, body);
    ASSERT_NE(a.status, 0) << "no answer to " << body;
    EXPECT_TRUE(a.status == 200 || (a.status >= 400 && a.status < 500)) << a.status << " " << body;
    if (a.status != 200) {
      EXPECT_TRUE(a.body.contains("error")) << body;
    }
  }
  // Deep nesting is refused before parsing.
  Answer deep =
      post(port(), "/v1/completions", std::string(100000, '[') + std::string(100000, ']'));
  EXPECT_EQ(deep.status, 400);
  EXPECT_EQ(get(port(), "/health").status, 200);
}

TEST_F(ServeServer, ConcurrentMixedRequestsEqualTheirSerialAnswers) {
  const std::vector<std::string> models = {"tiny", "a", "b"};
  std::map<std::string, std::string> serial;
  for (const std::string& m : models) {
    Answer a = post(
        port(), "/v1/completions",
        json{{"model", m}, {"prompt", kPrompt}, {"max_tokens", 10}, {"temperature", 0}}.dump());
    serial[m] = a.body["choices"][0]["text"];
  }
  std::vector<std::future<std::pair<std::string, std::string>>> futures;
  for (int i = 0; i < 24; ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      const std::string m = models[i % 3];
      json body = {{"model", m}, {"prompt", kPrompt}, {"max_tokens", 10}, {"temperature", 0}};
      if (i % 4 == 0) {
        body["stream"] = true;
        return std::make_pair(
            m, test::streamed_completion_text(post_stream(port(), "/v1/completions", body.dump())));
      }
      Answer a = post(port(), "/v1/completions", body.dump());
      if (a.status != 200)
        return std::make_pair(m, "status " + std::to_string(a.status) + ": " + a.raw);
      return std::make_pair(m, a.body["choices"][0]["text"].get<std::string>());
    }));
  }
  for (auto& f : futures) {
    auto [m, text] = f.get();
    EXPECT_EQ(text, serial[m]) << "model " << m;
  }
}

TEST_F(ServeServer, ClientThatLeavesMidStreamCancelsItsRequest) {
  const int64_t cancelled_before = server_->engine().stats().requests_cancelled;
  httplib::Client cli("127.0.0.1", port());
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = json{{"prompt", kPrompt}, {"max_tokens", 3000}, {"stream", true}, {"ignore_eos", true}}
                 .dump();
  req.set_header("Content-Type", "application/json");
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
  (void)cli.send(req);  // the receiver's false closes the connection
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (server_->engine().stats().requests_cancelled == cancelled_before &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(server_->engine().stats().requests_cancelled, cancelled_before + 1);
  EXPECT_LT(server_->engine().stats().generated_tokens, 3000) << "it ran to the end";
}

TEST_F(ServeServer, TokenizeAndDetokenizeRoundTrip) {
  Answer t = post(port(), "/v1/tokenize", R"({"prompt": "Hello world"})");
  ASSERT_EQ(t.status, 200) << t.raw;
  EXPECT_EQ(t.body["tokens"].get<std::vector<int32_t>>(),
            io::Tokenizer::load(fixture().model).encode("Hello world", true));
  EXPECT_EQ(t.body["count"], t.body["tokens"].size());
  EXPECT_GT(t.body["max_model_len"].get<int64_t>(), 0);
  Answer d = post(port(), "/v1/detokenize", json{{"tokens", t.body["tokens"]}}.dump());
  ASSERT_EQ(d.status, 200) << d.raw;
  EXPECT_EQ(d.body["prompt"], "Hello world");
  EXPECT_EQ(post(port(), "/v1/detokenize", R"({"tokens": [1, -4]})").status, 400);
}

TEST_F(ServeServer, MetricsCountRequestsTokensAndLatency) {
  auto metric = [&](const std::string& text, const std::string& series) {
    const size_t at = text.find("\n" + series + " ");
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + series.size() + 2));
  };
  const std::string before = get(port(), "/metrics").raw;
  const std::string series =
      R"(moelora_requests_total{endpoint="completions",status="200",adapter="b"})";
  const double n0 = std::max(0.0, metric(before, series));
  const double tok0 =
      std::max(0.0, metric(before, R"(moelora_generation_tokens_total{adapter="b"})"));
  for (int i = 0; i < 2; ++i)
    ASSERT_EQ(
        post(port(), "/v1/completions",
             json{{"model", "b"}, {"prompt", kPrompt}, {"max_tokens", 5}, {"ignore_eos", true}}
                 .dump())
            .status,
        200);
  (void)post(port(), "/v1/completions", R"({"prompt": "x", "temperature": 9})");
  Answer m = get(port(), "/metrics");
  ASSERT_EQ(m.status, 200);
  EXPECT_NE(m.content_type.find("text/plain"), std::string::npos);
  EXPECT_EQ(metric(m.raw, series), n0 + 2);
  EXPECT_EQ(metric(m.raw, R"(moelora_generation_tokens_total{adapter="b"})"), tok0 + 10);
  EXPECT_GE(
      metric(m.raw, R"(moelora_requests_total{endpoint="completions",status="400",adapter=""})"),
      1);
  EXPECT_GT(metric(m.raw, "moelora_time_to_first_token_seconds_count"), 0);
  EXPECT_GT(metric(m.raw, "moelora_inter_token_latency_seconds_count"), 0);
  EXPECT_GE(metric(m.raw, "moelora_lora_slots_total"), 4);
  EXPECT_EQ(metric(m.raw, "moelora_requests_running"), 0);
  // A Qwen3 model has no linear-attention state; the CPU backend has no fixed state pool.
  EXPECT_EQ(metric(m.raw, "moelora_state_cache_bytes"), 0);
  EXPECT_EQ(metric(m.raw, "moelora_state_slots_in_use"), 0);
  EXPECT_EQ(metric(m.raw, "moelora_state_slots_total"), 0);
  EXPECT_NE(m.raw.find("# TYPE moelora_e2e_request_latency_seconds histogram"), std::string::npos);
}

TEST(ServeServerAuth, ApiKeyGuardsTheApiRoutes) {
  server::ServerOptions o;
  o.api_key = "sekret";
  auto s = start_server(o, false);
  const std::string body = R"({"prompt": [1, 2], "max_tokens": 1})";
  Answer none = post(s->port(), "/v1/completions", body);
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.body["error"]["type"], "authentication_error");
  EXPECT_EQ(post(s->port(), "/v1/completions", body, {{"Authorization", "Bearer wrong"}}).status,
            401);
  EXPECT_EQ(post(s->port(), "/v1/completions", body, {{"Authorization", "Bearer sekret"}}).status,
            200);
  EXPECT_EQ(get(s->port(), "/v1/models").status, 401);
  EXPECT_EQ(get(s->port(), "/metrics").status, 401);
  EXPECT_EQ(get(s->port(), "/metrics", {{"Authorization", "Bearer sekret"}}).status, 200);
  EXPECT_EQ(get(s->port(), "/health").status, 200);
}

TEST(ServeServerLimits, FullQueueAnswers503WithRetryAfter) {
  server::ServerOptions o;
  o.max_queued_requests = 2;
  auto s = start_server(o, false, /*max_running=*/1);
  const int port = s->port();
  const std::string long_body =
      json{{"prompt", kPrompt}, {"max_tokens", 2000}, {"ignore_eos", true}}.dump();
  // Requests that left the engine (finished, cancelled or failed): each one frees a place.
  auto left = [](const EngineStats& st) {
    return st.requests_finished + st.requests_cancelled + st.requests_failed;
  };
  httplib::Client cli("127.0.0.1", port);
  // The answer is immediate, but a loaded machine (sanitizers, tests in parallel) may not run the
  // server's handler within httplib's default 5 s.
  cli.set_read_timeout(std::chrono::seconds(120));
  std::vector<std::future<Answer>> held;
  int64_t posted = 0;
  // Posts a held request whenever the engine has seen every earlier one (one snapshot of its
  // counters), until two wait; one that finished before the queue filled is replaced.
  auto fill_queue = [&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      const EngineStats st = s->engine().stats();
      if (st.waiting >= 2) return;
      if (st.running + st.waiting + left(st) == posted) {
        held.push_back(std::async(std::launch::async,
                                  [&] { return post(port, "/v1/completions", long_body); }));
        ++posted;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  // One runs, two wait: the queue is full, and the next request must be refused. Under a
  // sanitizer the running request may finish its 2000 tokens between the check and the probe, and
  // the probe then rightly takes the freed place: that round is repeated. A server that admitted
  // past a full queue would answer every round's probe (after the held requests ahead of it in
  // the queue), so four rounds without a refusal fail.
  bool refused = false;
  for (int round = 0; round < 4 && !refused; ++round) {
    fill_queue();
    ASSERT_EQ(s->engine().stats().waiting, 2) << "round " << round;
    auto r =
        cli.Post("/v1/completions", R"({"prompt": [1, 2], "max_tokens": 1})", "application/json");
    ASSERT_TRUE(r) << "no answer: " << httplib::to_string(r.error());
    if (r->status == 503) {
      refused = true;
      EXPECT_EQ(r->get_header_value("Retry-After"), "1");
      EXPECT_EQ(json::parse(r->body)["error"]["code"], "queue_full");
    } else {
      EXPECT_EQ(r->status, 200) << r->body;
      ++posted;  // the probe was admitted: the engine counts it like a held request
    }
  }
  EXPECT_TRUE(refused) << "four rounds, the running request finished before every probe";
  EXPECT_EQ(get(port, "/health").status, 200);
  s->shutdown();  // the held requests end (cancelled) rather than run 2000 tokens each
  for (auto& h : held) EXPECT_NE(h.get().status, 0);
}

TEST(ServeServerAdapters, RuntimeLoadsStayUnderTheRootAndUnloadWaitsForRunningRequests) {
  {
    auto off = start_server({}, false);
    Answer a = post(off->port(), "/v1/load_lora_adapter",
                    json{{"lora_name", "a"}, {"lora_path", "a"}}.dump());
    EXPECT_EQ(a.status, 403);
    EXPECT_NE(a.raw.find("--enable-lora-updates"), std::string::npos);
  }
  // A root with one good adapter, a broken one, and a symlink that points outside.
  const fs::path root = fixture().root / "runtime_root";
  fs::remove_all(root);
  fs::create_directories(root / "broken");
  fs::copy(fixture().lora_root / "a", root / "good", fs::copy_options::recursive);
  test::write_text_file(root / "broken" / "adapter_config.json", "{\"peft_type\": \"LORA\"");
  fs::create_directory_symlink(fixture().lora_root / "b", root / "escape");

  server::ServerOptions o;
  o.enable_lora_updates = true;
  o.lora_root = root;
  auto s = start_server(o, false);
  const int port = s->port();
  auto load = [&](const std::string& name, const std::string& path) {
    return post(port, "/v1/load_lora_adapter",
                json{{"lora_name", name}, {"lora_path", path}}.dump());
  };
  EXPECT_EQ(load("x", "../loras/a").status, 403);
  EXPECT_EQ(load("x", (fixture().lora_root / "a").string()).status, 403);
  Answer esc = load("x", "escape");
  EXPECT_EQ(esc.status, 403) << "a symlink out of the root: " << esc.raw;
  Answer broken = load("x", "broken");
  EXPECT_EQ(broken.status, 400);
  EXPECT_NE(broken.raw.find("adapter_config.json"), std::string::npos) << broken.raw;
  EXPECT_EQ(load("bad:name", "good").status, 400);
  EXPECT_EQ(load("tiny", "good").status, 400);
  ASSERT_EQ(load("g", "good").status, 200);
  EXPECT_EQ(load("g", "good").status, 400) << "already loaded";
  // SGLang's route loads too.
  ASSERT_EQ(
      post(port, "/load_lora_adapter", json{{"lora_name", "g2"}, {"lora_path", "good"}}.dump())
          .status,
      200);
  Answer models = get(port, "/v1/models");
  EXPECT_NE(models.raw.find("\"g2\""), std::string::npos);

  // The served answer through the runtime-loaded adapter equals adapter a's (the same files).
  Answer through =
      post(port, "/v1/completions",
           json{{"model", "g"}, {"prompt", kPrompt}, {"max_tokens", 8}, {"temperature", 0}}.dump());
  ASSERT_EQ(through.status, 200) << through.raw;
  EXPECT_EQ(through.body["choices"][0]["text"], text_of(engine_tokens(kPrompt, "a", 8)));

  // Unload while a long request runs on it: the request finishes in full, new ones get 404, and
  // the adapter leaves the engine afterwards.
  auto running = std::async(std::launch::async, [&] {
    return post(port, "/v1/completions",
                json{{"model", "g"}, {"prompt", kPrompt}, {"max_tokens", 400}, {"ignore_eos", true}}
                    .dump());
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (s->engine().stats().running == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  Answer unload = post(port, "/v1/unload_lora_adapter", json{{"lora_name", "g"}}.dump());
  EXPECT_EQ(unload.status, 200) << unload.raw;
  EXPECT_EQ(post(port, "/v1/completions", json{{"model", "g"}, {"prompt", "x"}}.dump()).status,
            404);
  EXPECT_EQ(load("g", "good").status, 400) << "still being unloaded";
  Answer done = running.get();
  ASSERT_EQ(done.status, 200) << done.raw;
  EXPECT_EQ(done.body["usage"]["completion_tokens"], 400);
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    gone = true;
    for (const AdapterInfo& a : s->engine().adapters()) gone = gone && a.name != "g";
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(gone);
  EXPECT_EQ(post(port, "/unload_lora_adapter", json{{"lora_name", "g"}}.dump()).status, 404);
  EXPECT_EQ(load("g", "good").status, 200) << "the name is free again";
}

TEST(ServeServerLifecycle, ShutdownEndsStreamsInFlight) {
  auto s = start_server({}, false);
  const int port = s->port();
  std::atomic<bool> got_data{false};
  auto client = std::async(std::launch::async, [&] {
    httplib::Client cli("127.0.0.1", port);
    cli.set_read_timeout(std::chrono::seconds(60));
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body =
        json{{"prompt", kPrompt}, {"max_tokens", 3000}, {"stream", true}, {"ignore_eos", true}}
            .dump();
    req.set_header("Content-Type", "application/json");
    std::string text;
    req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
      text.append(d, n);
      got_data = true;
      return true;
    };
    (void)cli.send(req);
    return text;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!got_data && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto t0 = std::chrono::steady_clock::now();
  s->shutdown();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
  const std::string text = client.get();
  EXPECT_NE(text.find("\"error\""), std::string::npos)
      << "the stream should end with an error event";
  EXPECT_NE(text.find("[DONE]"), std::string::npos);
  EXPECT_TRUE(s->engine().idle());
}

}  // namespace
}  // namespace moelora
