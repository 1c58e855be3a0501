// `moelora serve` on the GPU engine: the same HTTP server as the CPU tests (ServeServer.*), over
// the bf16 GPU model with its paged KV cache, CUDA-graph decode steps and adapter slot pool. A
// request's answer must not depend on what else runs: concurrent mixed-adapter requests (streamed
// and whole) equal their answers served alone, decode steps replay graphs, and a client that
// leaves mid-stream frees its KV pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "chat/chat_template.h"
#include "io/tokenizer.h"
#include "moelora/engine.h"
#include "server/server.h"
#include "support/serve_client.h"
#include "support/test_support.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class ServeGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!check_device("cuda").is_ok()) return;
    root_ = fs::temp_directory_path() / ("moelora-serve-gpu-" + std::to_string(::getpid()));
    fs::remove_all(root_);
    const fs::path model = root_ / "tiny";
    auto run = [](const std::string& args) {
      const test::CommandResult r = test::run_moelora(args);
      if (r.exit_code != 0) throw std::runtime_error("moelora " + args + ": " + r.output);
    };
    run("synth --preset tiny-qwen3-moe --seed 5 --out " + model.string() + " --tokenizer " +
        (test::data_dir() / "tokenizer").string());
    // Every token through all experts: bf16 rounding of another batch size can then change a
    // greedy token only at a near-tie of the logits, not by flipping a top-2 expert choice (as
    // engine_gpu_test and cli_device_gpu_test do).
    {
      nlohmann::json config = nlohmann::json::parse(std::ifstream(model / "config.json"));
      config["num_experts_per_tok"] = config["num_experts"];
      std::ofstream(model / "config.json") << config.dump(2);
    }
    run("synth-adapter --model " + model.string() + " --targets all --rank 8 --seed 21 --out " +
        (root_ / "a").string());
    run("synth-adapter --model " + model.string() +
        " --targets all --rank 16 --seed 22 --layout peft-3d --out " + (root_ / "b").string());

    EngineOptions o;
    o.model_dir = model;
    o.device = "cuda";
    o.max_running = 32;
    o.max_loras_per_batch = 4;
    o.adapter_slots = 4;
    o.max_seq_len = 4096;
    o.kv_cache_bytes = uint64_t{256} << 20;
    auto engine = Engine::create(o);
    if (!engine.is_ok()) throw std::runtime_error(engine.status().message());
    if (!engine.value()->register_adapter("a", root_ / "a").is_ok() ||
        !engine.value()->register_adapter("b", root_ / "b").is_ok())
      throw std::runtime_error("adapter registration failed");
    server::ServerOptions so;
    so.port = 0;
    so.served_model_name = "tiny";
    so.http_threads = 48;
    auto s = server::Server::create(std::move(engine.value()), io::Tokenizer::load(model),
                                    chat::ChatTemplate::load(model), so);
    if (!s.is_ok()) throw std::runtime_error(s.status().message());
    if (!s.value()->start().is_ok()) throw std::runtime_error("cannot start the server");
    server_ = s.value().release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    if (!root_.empty()) fs::remove_all(root_);
  }
  void SetUp() override {
    if (!check_device("cuda").is_ok()) GTEST_SKIP() << "no CUDA device";
  }
  int port() const { return server_->port(); }
  static server::Server* server_;
  static fs::path root_;
};
server::Server* ServeGpu::server_ = nullptr;
fs::path ServeGpu::root_;

// bf16 GEMMs of other batch sizes round differently, so a greedy request served in a batch may
// leave its answer alone at a near-tie. Both runs report their log-probabilities (chat format:
// every alternative with its bytes): up to the first differing token they must agree exactly, and
// there the batched run's token must be within kNearTie nats of the best token of the run alone.
constexpr double kNearTie = 0.25;

struct Served {
  int status = 0;
  std::string error;
  std::vector<std::string> tokens;                          // token texts, in order
  std::vector<double> logprobs;                             // chosen token's
  std::vector<std::map<std::string, double>> alternatives;  // top alternatives by token text
};

Served served(const test::HttpAnswer& a) {
  Served s;
  s.status = a.status;
  if (a.status != 200) {
    s.error = a.error + " " + a.raw;
    return s;
  }
  for (const json& t : a.body["choices"][0]["logprobs"]["content"]) {
    s.tokens.push_back(t["token"]);
    s.logprobs.push_back(t["logprob"]);
    std::map<std::string, double> alt;
    for (const json& x : t["top_logprobs"])
      alt[x["token"]] =
          std::max(alt.count(x["token"]) ? alt[x["token"]] : -1e30, x["logprob"].get<double>());
    s.alternatives.push_back(std::move(alt));
  }
  return s;
}

TEST_F(ServeGpu, ConcurrentMixedAdapterRequestsMatchTheirAnswersAlone) {
  const std::vector<std::string> models = {"tiny", "a", "b", "tiny:a"};
  auto body_for = [](const std::string& model, int i) {
    // Messages of different lengths so that prefill chunks and decode steps mix in one batch.
    std::string text = "Tell me about";
    for (int k = 0; k < 1 + i % 6; ++k) text += " topic " + std::to_string(i * 7 + k);
    return json{
        {"model", model},     {"messages", json::array({{{"role", "user"}, {"content", text}}})},
        {"max_tokens", 24},   {"temperature", 0},
        {"ignore_eos", true}, {"logprobs", true},
        {"top_logprobs", 5}};
  };
  constexpr int kRequests = 40;
  std::vector<Served> alone;
  for (int i = 0; i < kRequests; ++i)
    alone.push_back(served(test::http_post(port(), "/v1/chat/completions",
                                           body_for(models[i % models.size()], i).dump())));
  const int64_t replays_before = server_->engine().stats().graph_replays;
  std::vector<std::future<Served>> together;
  for (int i = 0; i < kRequests; ++i)
    together.push_back(std::async(std::launch::async, [&, i] {
      return served(test::http_post(port(), "/v1/chat/completions",
                                    body_for(models[i % models.size()], i).dump()));
    }));
  int identical = 0;
  for (int i = 0; i < kRequests; ++i) {
    const Served t = together[i].get();
    const Served& s = alone[i];
    ASSERT_EQ(s.status, 200) << s.error;
    ASSERT_EQ(t.status, 200) << t.error;
    ASSERT_EQ(t.tokens.size(), 24u);
    size_t j = 0;
    while (j < s.tokens.size() && s.tokens[j] == t.tokens[j]) ++j;
    if (j == s.tokens.size()) {
      ++identical;
      continue;
    }
    // The first difference: the batched run's token is among the alone run's alternatives and
    // within kNearTie of its best.
    auto it = s.alternatives[j].find(t.tokens[j]);
    ASSERT_NE(it, s.alternatives[j].end())
        << "request " << i << " token " << j << ": '" << t.tokens[j] << "' is not among the top 5";
    EXPECT_LE(s.logprobs[j] - it->second, kNearTie)
        << "request " << i << " on " << models[i % models.size()] << " token " << j;
  }
  std::printf("[serve-gpu] %d of %d batched answers identical to their answers alone\n", identical,
              kRequests);
  EXPECT_GE(identical, kRequests / 2);
  EXPECT_GT(server_->engine().stats().graph_replays, replays_before)
      << "decode steps should replay CUDA graphs";
  EXPECT_GT(server_->engine().stats().peak_running, 4);
  EXPECT_NE(alone[0].tokens, alone[1].tokens) << "the adapter changes the answer";
}

TEST_F(ServeGpu, ChatStreamEndsWithUsageAndDone) {
  const json body = {
      {"model", "b"},    {"messages", json::array({{{"role", "user"}, {"content", "Hello"}}})},
      {"max_tokens", 8}, {"temperature", 0},
      {"stream", true},  {"stream_options", {{"include_usage", true}}}};
  const test::SseAnswer s = test::http_post_stream(port(), "/v1/chat/completions", body.dump());
  ASSERT_EQ(s.status, 200) << s.error;
  EXPECT_TRUE(s.done);
  ASSERT_GE(s.events.size(), 3u);
  EXPECT_EQ(s.events.front()["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(s.events.back()["choices"].empty());
  EXPECT_GT(s.events.back()["usage"]["completion_tokens"].get<int>(), 0);
}

TEST_F(ServeGpu, LogprobsComeFromTheLogitsTheTokenWasSampledFrom) {
  const json body = {{"model", "a"},
                     {"messages", json::array({{{"role", "user"}, {"content", "Count to five"}}})},
                     {"max_tokens", 8},
                     {"temperature", 0},
                     {"logprobs", true},
                     {"top_logprobs", 4},
                     {"ignore_eos", true}};
  const test::HttpAnswer a = test::http_post(port(), "/v1/chat/completions", body.dump());
  ASSERT_EQ(a.status, 200) << a.raw;
  const json& content = a.body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 8u);
  for (size_t j = 0; j < content.size(); ++j) {
    ASSERT_EQ(content[j]["top_logprobs"].size(), 4u);
    double mass = 0;
    for (const json& x : content[j]["top_logprobs"]) mass += std::exp(x["logprob"].get<double>());
    // Greedy on the device picks the argmax of the logits the log-probabilities come from: the
    // chosen token is the first alternative.
    EXPECT_EQ(content[j]["top_logprobs"][0]["bytes"], content[j]["bytes"]) << "token " << j;
    EXPECT_NEAR(content[j]["logprob"].get<double>(),
                content[j]["top_logprobs"][0]["logprob"].get<double>(), 1e-6)
        << "token " << j;
    EXPECT_LE(mass, 1.0 + 1e-5);
  }
}

TEST_F(ServeGpu, ClientThatLeavesFreesItsPages) {
  const int64_t cancelled = server_->engine().stats().requests_cancelled;
  httplib::Client cli("127.0.0.1", port());
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body =
      json{{"prompt", {5, 6, 7}}, {"max_tokens", 4000}, {"stream", true}, {"ignore_eos", true}}
          .dump();
  req.set_header("Content-Type", "application/json");
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
  (void)cli.send(req);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while ((server_->engine().stats().requests_cancelled == cancelled || !server_->engine().idle()) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(server_->engine().stats().requests_cancelled, cancelled + 1);
  EXPECT_EQ(server_->engine().stats().kv_pages_reserved, 0);
  const test::HttpAnswer m = test::http_get(port(), "/metrics");
  EXPECT_NE(m.raw.find("moelora_graph_replays_total"), std::string::npos);
}

}  // namespace
}  // namespace moelora
