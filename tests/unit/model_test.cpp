// Unit tests of the CPU model (src/model) on the tiny committed fixtures: the KV cache (incremental
// decode and chunked prefill equal a full recompute), batching (a sequence's logits do not depend
// on the rest of the batch), generation, the sampler, error handling, and the `logits` /
// `generate` commands run as a user would.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/generate.h"
#include "model/model.h"
#include "model/model_setup.h"
#include "model/sampler.h"
#include "support/test_support.h"

namespace moelora::model {
namespace {

namespace fs = std::filesystem;

fs::path fixture(const std::string& model) {
  return test::data_dir() / "parity" / model;
}

Model load_quiet(const fs::path& dir) {
  ModelOptions options;
  options.show_progress = false;
  return Model::load(dir, options);
}

using test::random_tokens;

// Row `r` of a [T, V] tensor as a [1, V] copy.
Tensor row(const Tensor& t, int64_t r) {
  return t.slice0(r, r + 1).clone();
}

// ---------------------------------------------------------------- KV cache and batching

struct ModelCase {
  std::string model;
  std::string adapter;  // "" = base
};

class ModelCacheTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(ModelCacheTest, IncrementalDecodeEqualsFullRecompute) {
  Model model = load_quiet(fixture(GetParam().model) / "base");
  int32_t slot = -1;
  if (!GetParam().adapter.empty()) {
    slot = model.load_adapter(GetParam().adapter, fixture(GetParam().model) / GetParam().adapter);
  }
  std::mt19937_64 rng(test::test_seed(11));
  const std::vector<int32_t> tokens = random_tokens(rng, 19, model.vocab_size());

  Sequence full = model.new_sequence(slot);
  const Tensor all = model.forward(full, tokens);  // [19, V]
  ASSERT_EQ(all.shape(), (Shape{19, model.vocab_size()}));
  EXPECT_EQ(full.length(), 19);
  EXPECT_EQ(full.tokens(), tokens);

  // Prefill 7, then one token at a time.
  Sequence inc = model.new_sequence(slot);
  const Tensor prefill = model.forward(inc, std::span<const int32_t>(tokens).first(7));
  EXPECT_TRUE(test::all_close(prefill, all.slice0(0, 7).clone(), 1e-6f, 0.0f));
  for (int64_t t = 7; t < 19; ++t) {
    const Tensor step = model.forward(inc, std::span<const int32_t>(&tokens[t], 1));
    EXPECT_TRUE(test::all_close(step, row(all, t), 1e-6f, 0.0f)) << "position " << t;
  }
  EXPECT_EQ(inc.length(), 19);

  // Chunked prefill (5 + 9 + 5) with last-token logits only.
  Sequence chunked = model.new_sequence(slot);
  ForwardOptions last;
  last.all_logits = false;
  int64_t done = 0;
  for (int64_t n : {5, 9, 5}) {
    const Tensor l = model.forward(chunked, std::span<const int32_t>(tokens).subspan(done, n), last);
    done += n;
    EXPECT_TRUE(test::all_close(l, row(all, done - 1), 1e-6f, 0.0f)) << "after " << done << " tokens";
  }

  // Truncation rolls the cache back: re-feeding the tail gives the same logits.
  chunked.truncate(12);
  EXPECT_EQ(chunked.length(), 12);
  const Tensor again = model.forward(chunked, std::span<const int32_t>(tokens).subspan(12));
  EXPECT_TRUE(test::all_close(again, all.slice0(12, 19).clone(), 1e-6f, 0.0f));
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, ModelCacheTest,
    ::testing::Values(ModelCase{"qwen3_moe", ""}, ModelCase{"qwen3_moe", "lora_per_expert"},
                      ModelCase{"deepseek_v3", ""}, ModelCase{"deepseek_v3", "lora_peft3d"},
                      ModelCase{"kimi_like", "lora_peft3d"}),
    [](const auto& info) {
      return info.param.model + "_" + (info.param.adapter.empty() ? "base" : info.param.adapter);
    });

TEST(ModelBatch, SequencesOfDifferentLengthsAndAdaptersAreIndependent) {
  Model model = load_quiet(fixture("deepseek_v3") / "base");
  const int32_t a = model.load_adapter("peft3d", fixture("deepseek_v3") / "lora_peft3d");
  const int32_t b = model.load_adapter("dense", fixture("deepseek_v3") / "lora_dense_shared");
  std::mt19937_64 rng(test::test_seed(23));
  const std::vector<int32_t> slots = {a, -1, b, a, -1};
  const std::vector<int64_t> lengths = {3, 11, 1, 7, 5};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<Sequence> batched, alone;
  for (size_t i = 0; i < slots.size(); ++i) {
    prompts.push_back(random_tokens(rng, lengths[i], model.vocab_size()));
    batched.push_back(model.new_sequence(slots[i]));
    alone.push_back(model.new_sequence(slots[i]));
  }
  // Two rounds: prefill of different lengths, then a step where sequences are at different positions.
  for (int round = 0; round < 2; ++round) {
    std::vector<SequenceInput> inputs;
    std::vector<std::vector<int32_t>> feed(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      feed[i] =
          round == 0 ? prompts[i] : random_tokens(rng, 1 + static_cast<int64_t>(i % 2), model.vocab_size());
      inputs.push_back({&batched[i], feed[i]});
    }
    const std::vector<Tensor> together = model.forward(inputs);
    for (size_t i = 0; i < slots.size(); ++i) {
      const Tensor separate = model.forward(alone[i], feed[i]);
      EXPECT_TRUE(test::all_close(together[i], separate, 1e-6f, 0.0f))
          << "round " << round << " sequence " << i;
    }
  }
  // The adapters change the output (the batch is really mixed).
  Sequence base = model.new_sequence(-1), adapted = model.new_sequence(a);
  EXPECT_GT(test::max_abs_diff(model.forward(base, prompts[0]), model.forward(adapted, prompts[0])), 0.05);
}

// Imposed routing: the model's own routing imposed gives the same logits bit for bit; another
// routing of one layer's tokens changes them, and only from that layer on.
TEST(ModelForcedRouting, OwnRoutingIsExactAndOtherRoutingTakesEffect) {
  Model model = load_quiet(fixture("deepseek_v3") / "base");
  std::mt19937_64 rng(test::test_seed(29));
  const std::vector<int32_t> prompt = random_tokens(rng, 6, model.vocab_size());
  ForwardTrace trace;
  ForwardOptions traced;
  traced.trace = &trace;
  Sequence a = model.new_sequence(-1);
  const Tensor own = model.forward(a, prompt, traced);
  ASSERT_FALSE(trace.routes.empty());
  std::map<int64_t, Tensor> routes;
  for (const auto& [layer, route] : trace.routes) routes[layer] = route.ids;
  ForwardOptions forced;
  forced.forced_routes = &routes;
  Sequence b = model.new_sequence(-1);
  EXPECT_EQ(test::max_abs_diff(model.forward(b, prompt, forced), own), 0.0);
  // Shift every token's experts by one in the last MoE layer.
  const int64_t last = routes.rbegin()->first;
  Tensor shifted = routes[last].clone();
  const int64_t experts = model.config().num_experts, k = shifted.dim(1);
  for (int64_t t = 0; t < shifted.dim(0); ++t)
    for (int64_t j = 0; j < k; ++j)
      shifted.data<int32_t>()[t * k + j] =
          static_cast<int32_t>((routes[last].data<int32_t>()[t * k] + 1 + j) % experts);
  routes[last] = shifted;
  ForwardTrace forced_trace;
  forced.trace = &forced_trace;
  Sequence c = model.new_sequence(-1);
  const Tensor moved = model.forward(c, prompt, forced);
  EXPECT_GT(test::max_abs_diff(moved, own), 1e-3);
  EXPECT_EQ(test::max_abs_diff(forced_trace.hidden[last], trace.hidden[last]), 0.0);
  EXPECT_EQ(std::memcmp(forced_trace.routes[last].ids.data<int32_t>(), shifted.data<int32_t>(),
                        shifted.numel() * 4),
            0);
}

TEST(ModelGenerate, BatchedGenerationEqualsSingleRequests) {
  Model model = load_quiet(fixture("qwen3_moe") / "base");
  const int32_t a = model.load_adapter("peft3d", fixture("qwen3_moe") / "lora_peft3d");
  const int32_t b = model.load_adapter("shared_outer", fixture("qwen3_moe") / "lora_shared_outer");
  std::mt19937_64 rng(test::test_seed(31));
  std::vector<GenerationRequest> requests(4);
  const std::vector<int32_t> slots = {a, -1, b, a};
  const std::vector<int64_t> lengths = {4, 9, 2, 6};
  const std::vector<int64_t> max_new = {7, 3, 10, 0};
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].prompt = random_tokens(rng, lengths[i], model.vocab_size());
    requests[i].slot = slots[i];
    requests[i].max_new_tokens = max_new[i];
    requests[i].sampling = {i == 2 ? 0.8 : 0.0, i == 2 ? 0.9 : 1.0, 0, 1234};
  }
  std::vector<std::pair<size_t, int32_t>> streamed;
  const GenerationResult together =
      generate(model, requests, [&](size_t r, int32_t t) { streamed.emplace_back(r, t); });
  int64_t total = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationResult alone = generate(model, std::span<const GenerationRequest>(&requests[i], 1));
    EXPECT_EQ(together.outputs[i].tokens, alone.outputs[0].tokens) << "request " << i;
    EXPECT_EQ(static_cast<int64_t>(together.outputs[i].tokens.size()), max_new[i]);
    total += max_new[i];
  }
  EXPECT_EQ(together.stats.generated_tokens, total);
  EXPECT_EQ(static_cast<int64_t>(streamed.size()), total);
  EXPECT_EQ(together.stats.steps, 10);  // the longest request: prefill + 9 decode steps
}

TEST(ModelGenerate, StopsAtStopToken) {
  Model model = load_quiet(fixture("qwen3_moe") / "base");
  GenerationRequest request;
  request.prompt = {5, 17, 33};
  request.max_new_tokens = 8;
  const std::vector<int32_t> free_run = generate(model, std::span(&request, 1)).outputs[0].tokens;
  ASSERT_EQ(free_run.size(), 8u);
  request.stop_tokens = {free_run[3]};
  const GenerationResult stopped = generate(model, std::span(&request, 1));
  const auto first = std::find(free_run.begin(), free_run.end(), free_run[3]);
  const std::vector<int32_t> expected(free_run.begin(), first + 1);
  EXPECT_EQ(stopped.outputs[0].tokens, expected);
  EXPECT_TRUE(stopped.outputs[0].stopped);
}

// ---------------------------------------------------------------- errors

TEST(ModelErrors, BadTokenIdLeavesTheSequenceUnchanged) {
  Model model = load_quiet(fixture("qwen3_moe") / "base");
  Sequence seq = model.new_sequence();
  model.forward(seq, std::vector<int32_t>{1, 2, 3});
  const std::vector<int32_t> bad = {4, 512};
  const std::string msg = test::error_message([&] { model.forward(seq, bad); });
  EXPECT_NE(msg.find("token id 512 at position 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[0, 512)"), std::string::npos) << msg;
  EXPECT_NE(test::error_message([&] { model.forward(seq, std::vector<int32_t>{-1}); }).find("token id -1"),
            std::string::npos);
  EXPECT_EQ(seq.length(), 3);
  // The cache is intact: continuing gives the same logits as a fresh run.
  Sequence fresh = model.new_sequence();
  const Tensor want = model.forward(fresh, std::vector<int32_t>{1, 2, 3, 4});
  EXPECT_TRUE(test::all_close(model.forward(seq, std::vector<int32_t>{4}), row(want, 3), 1e-6f, 0.0f));
}

TEST(ModelErrors, BatchValidation) {
  Model model = load_quiet(fixture("qwen3_moe") / "base");
  Model other = load_quiet(fixture("qwen3_moe") / "base");
  Sequence s = model.new_sequence(), foreign = other.new_sequence();
  const std::vector<int32_t> ids = {1, 2};
  EXPECT_NE(test::error_message([&] { model.forward(std::span<const SequenceInput>()); }).find("batch is empty"),
            std::string::npos);
  const std::vector<SequenceInput> twice = {{&s, ids}, {&s, ids}};
  EXPECT_NE(test::error_message([&] { model.forward(twice); }).find("appears twice"), std::string::npos);
  const std::vector<SequenceInput> empty_tokens = {{&s, {}}};
  EXPECT_NE(test::error_message([&] { model.forward(empty_tokens); }).find("no new tokens"), std::string::npos);
  EXPECT_NE(test::error_message([&] { model.forward(foreign, ids); }).find("not made by this model"), std::string::npos);
  EXPECT_EQ(s.length(), 0);
}

TEST(ModelErrors, UnknownAdapter) {
  Model model = load_quiet(fixture("qwen3_moe") / "base");
  EXPECT_EQ(test::error_message([&] { model.new_sequence("nope"); }), "unknown adapter 'nope'; no adapters are loaded");
  model.load_adapter("peft3d", fixture("qwen3_moe") / "lora_peft3d");
  EXPECT_EQ(test::error_message([&] { model.new_sequence("nope"); }), "unknown adapter 'nope'; loaded: peft3d");
  EXPECT_NE(test::error_message([&] { model.new_sequence(3); }).find("adapter slot 3 is not loaded"), std::string::npos);
  EXPECT_NE(test::error_message([&] {
              model.load_adapter("peft3d", fixture("qwen3_moe") / "lora_per_expert");
            }).find("already loaded"),
            std::string::npos);
}

TEST(ModelErrors, AdapterForAnotherArchitecture) {
  Model qwen = load_quiet(fixture("qwen3_moe") / "base");
  // A DeepSeek adapter on Qwen3-MoE: rejected by the loader or by the binding, never applied.
  const std::string msg = test::error_message([&] { qwen.load_adapter("ds", fixture("deepseek_v3") / "lora_peft3d"); });
  EXPECT_FALSE(msg.empty());
  EXPECT_EQ(qwen.adapters().size(), 0);

  // An adapter built in memory with an MLA target: the binding names the target and the reason.
  io::LoraAdapter adapter;
  adapter.name = "mla_on_gqa";
  adapter.layers.resize(static_cast<size_t>(qwen.num_layers()));
  adapter.layers[1].kv_b_proj.a = Tensor::zeros(DType::kF32, {1, 4, 32});
  adapter.layers[1].kv_b_proj.b = Tensor::zeros(DType::kF32, {1, 64, 4});
  const std::string binding = test::error_message([&] { qwen.adapters().add(adapter); });
  EXPECT_NE(binding.find("adapts kv_b_proj of layer 1"), std::string::npos) << binding;
  EXPECT_NE(binding.find("another architecture"), std::string::npos) << binding;

  // Right module, wrong shape.
  io::LoraAdapter shaped;
  shaped.name = "bad_shape";
  shaped.layers.resize(static_cast<size_t>(qwen.num_layers()));
  shaped.layers[0].q_proj.a = Tensor::zeros(DType::kF32, {1, 4, 63});
  shaped.layers[0].q_proj.b = Tensor::zeros(DType::kF32, {1, 64, 4});
  const std::string shape_msg = test::error_message([&] { qwen.adapters().add(shaped); });
  EXPECT_NE(shape_msg.find("layer 0 q_proj: lora A has shape [1, 4, 63], expected [1, R, 64]"),
            std::string::npos)
      << shape_msg;

  // Wrong layer count.
  io::LoraAdapter short_adapter;
  short_adapter.name = "short";
  short_adapter.layers.resize(1);
  EXPECT_NE(test::error_message([&] { qwen.adapters().add(short_adapter); }).find("for 1 layers but the model has 3"),
            std::string::npos);
  EXPECT_EQ(qwen.adapters().size(), 0);
}

TEST(ModelSetup, AdapterSpecs) {
  const AdapterSpec spec = parse_adapter_spec("math=/tmp/a=b");
  EXPECT_EQ(spec.name, "math");
  EXPECT_EQ(spec.dir, fs::path("/tmp/a=b"));
  EXPECT_NE(test::error_message([] { parse_adapter_spec("nodir"); }).find("NAME=DIR"), std::string::npos);
  EXPECT_NE(test::error_message([] { parse_adapter_spec("=dir"); }).find("NAME before '=' is empty"), std::string::npos);
  EXPECT_NE(test::error_message([] { parse_adapter_spec("x="); }).find("DIR after '=' is empty"), std::string::npos);
}

// ---------------------------------------------------------------- sampler

std::vector<float> random_logits(std::mt19937_64& rng, int64_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (auto& v : out) v = dist(rng);
  return out;
}

TEST(Sampler, SeededDeterminism) {
  std::mt19937_64 rng(test::test_seed(41));
  const std::vector<float> logits = random_logits(rng, 97, 2.0f);
  auto draw = [&](uint64_t seed) {
    Sampler s({1.0, 0.95, 0, seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 200; ++i) out.push_back(s.sample(logits));
    return out;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
  // Not degenerate: many different tokens are drawn.
  const std::vector<int32_t> d = draw(7);
  EXPECT_GT(std::set<int32_t>(d.begin(), d.end()).size(), 10u);
}

TEST(Sampler, TemperatureZeroIsGreedy) {
  std::mt19937_64 rng(test::test_seed(43));
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> logits = random_logits(rng, 61, 3.0f);
    const int32_t best =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    Sampler greedy({0.0, 0.3, 5, static_cast<uint64_t>(trial)});
    for (int i = 0; i < 5; ++i) EXPECT_EQ(greedy.sample(logits), best);
    EXPECT_EQ(argmax(logits), best);
    const std::vector<double> p = sampling_probabilities(logits, {0.0, 1.0, 0, 0});
    EXPECT_EQ(p[best], 1.0);
  }
  // Ties go to the lower index.
  EXPECT_EQ(argmax(std::vector<float>{1.0f, 3.0f, 3.0f, -2.0f}), 1);
}

TEST(Sampler, TopPTruncation) {
  // softmax of log(p) = p: probabilities 0.4, 0.3, 0.2, 0.1 (ranked 2, 0, 3, 1).
  const std::vector<float> logits = {std::log(0.3f), std::log(0.1f), std::log(0.4f), std::log(0.2f)};
  auto kept = [&](double top_p) {
    const std::vector<double> p = sampling_probabilities(logits, {1.0, top_p, 0, 0});
    std::vector<int32_t> ids;
    for (size_t i = 0; i < p.size(); ++i)
      if (p[i] > 0) ids.push_back(static_cast<int32_t>(i));
    return ids;
  };
  EXPECT_EQ(kept(0.35), (std::vector<int32_t>{2}));        // 0.4 alone reaches 0.35
  EXPECT_EQ(kept(0.5), (std::vector<int32_t>{0, 2}));      // 0.4 < 0.5: add 0.3
  EXPECT_EQ(kept(0.75), (std::vector<int32_t>{0, 2, 3}));  // 0.7 < 0.75: add 0.2
  EXPECT_EQ(kept(1.0), (std::vector<int32_t>{0, 1, 2, 3}));
  const std::vector<double> p = sampling_probabilities(logits, {1.0, 0.5, 0, 0});
  EXPECT_NEAR(p[2], 0.4 / 0.7, 1e-6);
  EXPECT_NEAR(p[0], 0.3 / 0.7, 1e-6);
  // top_k on top of that.
  const std::vector<double> k1 = sampling_probabilities(logits, {1.0, 1.0, 1, 0});
  EXPECT_EQ(k1[2], 1.0);

  // Draws stay inside the nucleus and follow its distribution.
  Sampler s({1.0, 0.5, 0, test::test_seed(47)});
  std::map<int32_t, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[s.sample(logits)];
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_NEAR(static_cast<double>(counts[2]) / n, 0.4 / 0.7, 0.02);
  EXPECT_NEAR(static_cast<double>(counts[0]) / n, 0.3 / 0.7, 0.02);
}

TEST(Sampler, TemperatureSharpensAndFlattens) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f};
  const std::vector<double> cold = sampling_probabilities(logits, {0.25, 1.0, 0, 0});
  const std::vector<double> warm = sampling_probabilities(logits, {4.0, 1.0, 0, 0});
  // logits / 0.25 = 0, 4, 8: p = e^8 / (1 + e^4 + e^8) = 0.9817; / 4 = 0, 0.25, 0.5: p = 0.4011.
  EXPECT_NEAR(cold[2], std::exp(8.0) / (1 + std::exp(4.0) + std::exp(8.0)), 1e-9);
  EXPECT_NEAR(warm[2], std::exp(0.5) / (1 + std::exp(0.25) + std::exp(0.5)), 1e-9);
  EXPECT_NEAR(warm[0] + warm[1] + warm[2], 1.0, 1e-12);
  EXPECT_NEAR(cold[2] / cold[1], std::exp(4.0), 1e-6 * std::exp(4.0));
}

TEST(Sampler, InvalidParams) {
  EXPECT_NE(test::error_message([] { Sampler({-1.0, 1.0, 0, 0}); }).find("temperature"), std::string::npos);
  EXPECT_NE(test::error_message([] {
              Sampler({1.0, 0.0, 0, 0});
            }).find("top_p must be in (0, 1], got 0"),
            std::string::npos);
  EXPECT_NE(test::error_message([] { Sampler({1.0, 1.5, 0, 0}); }).find("top_p"), std::string::npos);
  EXPECT_NE(test::error_message([] { Sampler({1.0, 1.0, -2, 0}); }).find("top_k"), std::string::npos);
  EXPECT_NE(test::error_message([] { argmax(std::vector<float>{1.0f, NAN}); }).find("NaN"), std::string::npos);
}

// ---------------------------------------------------------------- CLI

std::string quote(const fs::path& p) {
  return "'" + p.string() + "'";
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(line);
  return out;
}

TEST(ModelCli, LogitsMatchesTheLibrary) {
  test::TempDir tmp;
  const fs::path dir = fixture("qwen3_moe");
  const auto r = test::run_moelora("logits --model " + quote(dir / "base") +
                                   " --adapter pe=" + quote(dir / "lora_per_expert") +
                                   " --use pe --tokens 3,14,15,92,65 --out " + quote(tmp / "l.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const io::SafetensorsFile file = io::SafetensorsFile::open(tmp / "l.safetensors");
  ASSERT_EQ(file.tensors().size(), 1u);
  const Tensor written = file.tensor("logits").clone();
  EXPECT_EQ(written.dtype(), DType::kF32);

  Model model = load_quiet(dir / "base");
  Sequence seq = model.new_sequence(model.load_adapter("pe", dir / "lora_per_expert"));
  const Tensor expected = model.forward(seq, std::vector<int32_t>{3, 14, 15, 92, 65});
  ASSERT_EQ(written.shape(), expected.shape());
  EXPECT_EQ(test::max_abs_diff(written, expected), 0.0);
}

TEST(ModelCli, LogitsBatchIsOneMixedBatch) {
  test::TempDir tmp;
  const fs::path dir = fixture("deepseek_v3");
  test::write_text_file(tmp / "batch.json",
                        R"([{"tokens": [5, 6, 7, 8], "adapter": "a"}, {"tokens": [9, 10], "adapter": null},
                            {"tokens": [11, 12, 13], "adapter": "b"}, {"tokens": [5, 6, 7, 8]}])");
  const auto r = test::run_moelora("logits --model " + quote(dir / "base") +
                                   " --adapter a=" + quote(dir / "lora_peft3d") +
                                   " --adapter b=" + quote(dir / "lora_per_expert") + " --batch " +
                                   quote(tmp / "batch.json") + " --out " + quote(tmp / "b.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const io::SafetensorsFile file = io::SafetensorsFile::open(tmp / "b.safetensors");
  ASSERT_EQ(file.tensors().size(), 4u);

  Model model = load_quiet(dir / "base");
  model.load_adapter("a", dir / "lora_peft3d");
  model.load_adapter("b", dir / "lora_per_expert");
  const std::vector<std::pair<std::string, std::vector<int32_t>>> entries = {
      {"a", {5, 6, 7, 8}}, {"", {9, 10}}, {"b", {11, 12, 13}}, {"", {5, 6, 7, 8}}};
  for (size_t i = 0; i < entries.size(); ++i) {
    Sequence seq = model.new_sequence(entries[i].first);
    const Tensor expected = model.forward(seq, entries[i].second);
    const Tensor written = file.tensor("logits." + std::to_string(i)).clone();
    ASSERT_EQ(written.shape(), expected.shape()) << i;
    EXPECT_LE(test::max_abs_diff(written, expected), 1e-6) << i;
  }
  // The adapter row differs from the same tokens without it.
  EXPECT_GT(test::max_abs_diff(file.tensor("logits.0").clone(), file.tensor("logits.3").clone()), 0.05);
}

TEST(ModelCli, GenerateJsonMatchesGreedyReference) {
  const fs::path dir = fixture("qwen3_moe");
  const io::SafetensorsFile ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  const Tensor prompt = ref.tensor("input_ids").clone();
  const Tensor greedy = ref.tensor("greedy.lora_peft3d").clone();
  std::string ids;
  for (int64_t i = 0; i < prompt.dim(1); ++i)
    ids += (i ? "," : "") + std::to_string(prompt.data<int32_t>()[i]);

  const auto r = test::run_moelora("generate --model " + quote(dir / "base") +
                                   " --adapter p=" + quote(dir / "lora_peft3d") + " --use p --tokens " + ids +
                                   " --max-new-tokens 16 --ignore-eos --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::string> lines = lines_of(r.output);
  ASSERT_EQ(lines.size(), 1u) << r.output;
  const nlohmann::json j = nlohmann::json::parse(lines[0]);
  ASSERT_TRUE(j.is_object());
  ASSERT_TRUE(j["tokens"].is_array());
  std::vector<int32_t> tokens = j["tokens"].get<std::vector<int32_t>>();
  std::vector<int32_t> want(greedy.data<int32_t>() + prompt.dim(1), greedy.data<int32_t>() + greedy.dim(1));
  EXPECT_EQ(tokens, want);
  EXPECT_TRUE(j["text"].is_string());  // the fixture has a tokenizer
  EXPECT_TRUE(j["tokens_per_s"].is_number());
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0.0);
  EXPECT_EQ(j["prompt_tokens"], prompt.dim(1));
  EXPECT_EQ(j["adapter"], "p");
  EXPECT_EQ(j["stopped"], false);
}

TEST(ModelCli, GenerateTextPromptAndSampling) {
  const fs::path dir = fixture("qwen3_moe");
  const std::string base =
      "generate --model " + quote(dir / "base") + " --prompt 'Hello world' --ignore-eos ";
  const auto a = test::run_moelora(base + "--max-new-tokens 6 --temperature 0.9 --top-p 0.9 --seed 5 --json");
  const auto b = test::run_moelora(base + "--max-new-tokens 6 --temperature 0.9 --top-p 0.9 --seed 5 --json");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(nlohmann::json::parse(a.output)["tokens"], nlohmann::json::parse(b.output)["tokens"]);
  EXPECT_EQ(nlohmann::json::parse(a.output)["tokens"].size(), 6u);
  const auto text = test::run_moelora(base + "--max-new-tokens 4");
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("tokens/s"), std::string::npos) << text.output;
}

TEST(ModelCli, BadArgumentsGiveOneClearLine) {
  const fs::path dir = fixture("qwen3_moe");
  const std::string model = " --model " + quote(dir / "base");
  struct BadCase {
    std::string args;
    std::string message;
  };
  test::TempDir tmp;
  test::write_text_file(tmp / "bad.json", R"([{"tokens": []}])");
  test::write_text_file(tmp / "typo.json", R"([{"tokens": [1], "adaptr": "a"}])");
  test::write_text_file(tmp / "deep.json", std::string(65, '[') + std::string(65, ']'));
  const std::vector<BadCase> cases = {
      {"logits" + model + " --tokens 1,2,600 --out " + quote(tmp / "x"),
       "token id 600 at position 2 is outside the vocabulary [0, 512)"},
      {"logits" + model + " --tokens 1,x --out " + quote(tmp / "x"), "--tokens: 'x' is not an integer"},
      {"logits" + model + " --tokens 1 --use nope --out " + quote(tmp / "x"),
       "unknown adapter 'nope'; no --adapter NAME=DIR was given"},
      {"logits" + model + " --tokens 1 --batch " + quote(tmp / "bad.json") + " --out " + quote(tmp / "x"),
       "give exactly one of --tokens and --batch"},
      {"logits" + model + " --batch " + quote(tmp / "bad.json") + " --out " + quote(tmp / "x"),
       "entry 0: \"tokens\" must be a non-empty list of token ids"},
      {"logits" + model + " --batch " + quote(tmp / "typo.json") + " --out " + quote(tmp / "x"),
       "unknown key 'adaptr'"},
      {"logits" + model + " --batch " + quote(tmp / "deep.json") + " --out " + quote(tmp / "x"),
       "nest deeper than the 64 levels accepted"},
      {"logits --model " + quote(tmp / "missing") + " --tokens 1 --out " + quote(tmp / "x"), "missing"},
      {"logits" + model + " --adapter broken --tokens 1 --out " + quote(tmp / "x"),
       "must be given as NAME=DIR"},
      {"generate" + model + " --tokens 1 --use nope", "--use nope: no --adapter nope=DIR was given"},
      {"generate" + model + " --tokens 1 --prompt hi", "give exactly one of --prompt and --tokens"},
      {"generate" + model + " --tokens 1 --top-p 0", "top_p must be in (0, 1], got 0"},
      {"generate" + model + " --tokens 1 --temperature -1", "temperature must be a finite value >= 0"},
      {"generate --model " + quote(fixture("fp8") / "deepseek_v3_fp8") + " --prompt hi",
       "--prompt needs a tokenizer"},
  };
  for (const BadCase& c : cases) {
    const auto r = test::run_moelora(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    const std::vector<std::string> lines = lines_of(r.output);
    ASSERT_EQ(lines.size(), 1u) << c.args << "\n" << r.output;
    EXPECT_NE(lines[0].find("error: "), std::string::npos) << lines[0];
    EXPECT_NE(lines[0].find(c.message), std::string::npos) << c.args << "\n" << lines[0];
  }
  // A missing required option is reported by the parser (non-zero exit, names the option).
  const auto r = test::run_moelora("logits --tokens 1 --out x");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--model"), std::string::npos) << r.output;
}

TEST(ModelCli, RunDemoOnTinyPresets) {
  for (const std::string preset : {"tiny-qwen3-moe", "tiny-deepseek-v3"}) {
    test::TempDir tmp;
    const auto r =
        test::run_moelora("run --preset " + preset + " --max-new-tokens 5 --out " + quote(tmp.path()));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("mixed batch == each request alone: yes (3 of 3"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("adapters change the output:"), std::string::npos) << r.output;
    EXPECT_TRUE(fs::exists(tmp / "model" / "config.json"));  // --out keeps the files
    EXPECT_TRUE(fs::exists(tmp / "per-expert-r8" / "adapter_config.json"));
  }
}

// Checkpoints written by `moelora synth --quant fp8|nvfp4` run through the model and stay close to
// the bf16 checkpoint of the same seed (whose weights they quantize): a dequantization wired
// wrong (a divided scale, a swapped nibble, a misplaced block) would destroy the similarity.
TEST(ModelSynth, QuantizedCheckpointsTrackTheirBf16Source) {
  test::TempDir tmp;
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9, 10, 11};
  struct QuantCase {
    std::string preset, quant;
    double min_cosine;
  };
  for (const QuantCase& c :
       {QuantCase{"tiny-qwen3-moe", "fp8", 0.99}, QuantCase{"tiny-qwen3-moe", "nvfp4", 0.95},
        QuantCase{"tiny-deepseek-v3", "fp8", 0.98}, QuantCase{"tiny-deepseek-v3", "nvfp4", 0.8}}) {
    SCOPED_TRACE(c.preset + " " + c.quant);
    Tensor logits[2];
    for (int q = 0; q < 2; ++q) {
      const std::string quant = q == 0 ? "bf16" : c.quant;
      const fs::path dir = tmp / (c.preset + "-" + quant);
      const auto r = test::run_moelora("synth --preset " + c.preset + " --quant " + quant +
                                       " --seed 3 --out " + quote(dir));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      Model model = load_quiet(dir);
      Sequence seq = model.new_sequence();
      logits[q] = model.forward(seq, tokens);
    }
    EXPECT_GT(test::cosine_similarity(logits[1], logits[0]), c.min_cosine);
    EXPECT_GT(test::max_abs_diff(logits[1], logits[0]), 0.0);  // really quantized
  }
}

}  // namespace
}  // namespace moelora::model
