// The Executor contract the serving Engine relies on (src/runtime/executor.h), on the CPU
// executor wrapped in a RecordingExecutor: sampling through forward_sample with one uniform per
// sampling request drawn from the request's own generator, a row whose sampling fails ends only
// its request, the backend's maximum sequence length, random adapters (register_random_adapter)
// drawn into slots and drawn again after an eviction, submits while steps run back to back, and
// the devices a CPU-only build accepts.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "model/generate.h"
#include "model/model.h"
#include "model/sampler.h"
#include "moelora/engine.h"
#include "runtime/cpu_executor.h"
#include "runtime/gpu_executor.h"
#include "support/engine_helpers.h"
#include "support/test_support.h"

namespace moelora::runtime {
namespace {

namespace fs = std::filesystem;

using namespace engine_test;
using test::contains;
using test::error_of;
using test::fixture;

// ================================================================ Executor contract

// One sampled request and one greedy request: the engine hands the executor one uniform per
// sampling request per step, drawn from that request's own generator (and none for greedy ones).
TEST(EngineContract, UniformsComeFromEachRequestsOwnSampler) {
  std::mt19937_64 rng(test::test_seed(81));
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  Collected sampled, greedy;
  Request a;
  a.prompt = random_tokens(rng, 9, 512);
  a.sampling = {0.8, 0.9, 5, 4242, 6, true, {}};
  Request b;
  b.prompt = random_tokens(rng, 3, 512);
  b.sampling.max_new_tokens = 4;
  b.sampling.ignore_eos = true;
  ASSERT_TRUE(t.engine->submit(a, collect_into(sampled)).is_ok());
  ASSERT_TRUE(t.engine->submit(b, collect_into(greedy)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  ASSERT_EQ(sampled.tokens.size(), 6u);
  ASSERT_EQ(greedy.tokens.size(), 4u);

  // The non-zero uniforms, in step order, are the sampler's draws for seed 4242.
  model::Sampler reference({0.8, 0.9, 5, 4242});
  std::vector<float> expected, got;
  for (int i = 0; i < 6; ++i) expected.push_back(static_cast<float>(reference.next_uniform()));
  for (size_t step = 0; step < t.executor->params_seen.size(); ++step) {
    const auto& params = t.executor->params_seen[step];
    const auto& uniforms = t.executor->uniforms_seen[step];
    ASSERT_EQ(params.size(), uniforms.size());
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].temperature > 0) {
        EXPECT_FLOAT_EQ(params[i].temperature, 0.8f);
        EXPECT_FLOAT_EQ(params[i].top_p, 0.9f);
        EXPECT_EQ(params[i].top_k, 5);
        got.push_back(uniforms[i]);
      } else {
        EXPECT_EQ(uniforms[i], 0.0f) << "a greedy row got a uniform at step " << step;
      }
    }
  }
  EXPECT_EQ(got, expected);
  // The CPU backend runs every forward eagerly and captures nothing.
  const EngineStats stats = t.engine->stats();
  EXPECT_EQ(stats.eager_forwards, stats.steps);
  EXPECT_EQ(stats.graph_captures, 0);
  EXPECT_EQ(stats.graph_replays, 0);
}

// A row the backend cannot sample (-1) ends that request with an error; the others go on.
TEST(EngineContract, FailedSamplingEndsOnlyItsRequest) {
  std::mt19937_64 rng(test::test_seed(82));
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  SequenceHandle victim = -1;
  t.executor->tamper = [&](std::span<const BatchEntry> batch, std::vector<int32_t>& tokens) {
    for (size_t i = 0; i < batch.size(); ++i) {
      if (victim < 0) victim = batch[i].sequence;  // the first request's sequence
      if (batch[i].sequence == victim) tokens[i] = -1;
    }
  };
  Collected first, second;
  Request r;
  r.prompt = random_tokens(rng, 4, 512);
  r.sampling.max_new_tokens = 3;
  r.sampling.ignore_eos = true;
  ASSERT_TRUE(t.engine->submit(r, collect_into(first)).is_ok());
  ASSERT_TRUE(t.engine->submit(r, collect_into(second)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(first.reason, FinishReason::kError);
  EXPECT_TRUE(contains(first.error, "sampling failed")) << first.error;
  EXPECT_TRUE(first.tokens.empty());
  EXPECT_EQ(second.reason, FinishReason::kLength);
  EXPECT_EQ(second.tokens.size(), 3u);
  EXPECT_EQ(t.engine->stats().requests_failed, 1);
}

TEST(EngineContract, BackendSequenceLengthLimitsRequests) {
  // The engine reads the backend's limit at creation.
  const EngineOptions o = small_options();
  auto recording = std::make_unique<RecordingExecutor>(std::make_unique<CpuExecutor>(
      load_quiet(fixture("qwen3_moe") / "base"),
      ExecutorLimits{o.max_batch_tokens, o.max_running, o.adapter_slots, o.max_lora_rank}));
  recording->max_length = 20;
  Result<std::unique_ptr<Engine>> created = Engine::create(std::move(recording), o);
  ASSERT_TRUE(created.is_ok());
  Engine& engine = *created.value();
  EXPECT_EQ(engine.model_info().max_sequence_length, 20);
  Request r;
  r.prompt = std::vector<int32_t>(15, 7);
  r.sampling.max_new_tokens = 6;
  const Result<RequestId> refused = engine.submit(r, nullptr);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kOutOfRange);
  EXPECT_TRUE(contains(refused.status().message(),
                       "= 21 exceeds the engine's maximum sequence "
                       "length of 20"))
      << refused.status().message();
  r.sampling.max_new_tokens = 5;
  EXPECT_TRUE(engine.submit(r, nullptr).is_ok());
  EXPECT_TRUE(engine.run_until_idle().is_ok());
}

TEST(EngineContract, RandomAdaptersAreDrawnIntoSlotsAndAgainAfterEviction) {
  std::mt19937_64 rng(test::test_seed(83));
  EngineOptions o = small_options();
  o.adapter_slots = 1;
  o.max_loras_per_batch = 1;
  o.host_adapter_cache = 0;  // the placeholder must come back without files
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  // A backend without random adapters refuses them at registration.
  Status refused = t.engine->register_random_adapter("r0", 4, false, 11);
  EXPECT_EQ(refused.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(refused.message(), "need device 'cuda'")) << refused.message();

  t.executor->random_adapters = true;
  t.executor->random_stand_in =
      io::load_adapter(fixture("qwen3_moe") / "lora_peft3d", t.executor->config(), "stand-in");
  ASSERT_TRUE(t.engine->register_random_adapter("r0", 4, false, 11).is_ok());
  ASSERT_TRUE(t.engine->register_random_adapter("r1", 4, true, 12).is_ok());
  EXPECT_EQ(t.engine->register_random_adapter("r0", 4, false, 13).code(),
            ErrorCode::kInvalidArgument);  // the name is taken
  EXPECT_EQ(t.engine->register_random_adapter("big", 17, false, 1).code(),
            ErrorCode::kOutOfRange);            // above max_lora_rank 16
  EXPECT_TRUE(t.executor->randomized.empty());  // nothing drawn before a request needs it

  // r0, r1, r0 one after the other through the single slot: three draws, same seeds again.
  std::vector<Collected> got(3);
  const std::vector<std::string> order = {"r0", "r1", "r0"};
  for (size_t i = 0; i < order.size(); ++i) {
    Request r;
    r.prompt = random_tokens(rng, 5, 512);
    r.adapter = order[i];
    r.sampling.max_new_tokens = 3;
    r.sampling.ignore_eos = true;
    ASSERT_TRUE(t.engine->submit(r, collect_into(got[i])).is_ok());
    ASSERT_TRUE(t.engine->run_until_idle().is_ok());
    EXPECT_EQ(got[i].reason, FinishReason::kLength) << got[i].error;
  }
  using Draw = std::tuple<int32_t, int64_t, bool, uint64_t>;
  EXPECT_EQ(t.executor->randomized,
            (std::vector<Draw>{{0, 4, false, 11}, {0, 4, true, 12}, {0, 4, false, 11}}));
  const std::vector<AdapterInfo> listed = t.engine->adapters();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_TRUE(contains(listed[0].dir.string(), "random:rank=4")) << listed[0].dir;
  ASSERT_TRUE(t.engine->unregister_adapter("r0").is_ok());
  ASSERT_TRUE(t.engine->register_random_adapter("r0", 8, false, 99).is_ok());
}

// A server's engine thread steps back to back while a request runs; a request submitted from
// another thread meanwhile must start at the next step, not when the running one finishes (the
// engine's lock is first come, first served).
TEST(EngineContract, SubmitWhileStepsRunBackToBackStartsAtTheNextStep) {
  std::mt19937_64 rng(test::test_seed(89));
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  t.executor->busy_forward = std::chrono::microseconds(1500);
  constexpr int64_t kLongTokens = 150;
  std::atomic<int64_t> long_tokens{0};
  std::atomic<bool> long_done{false};
  Request long_request;
  long_request.prompt = random_tokens(rng, 5, 512);
  long_request.sampling.max_new_tokens = kLongTokens;
  long_request.sampling.ignore_eos = true;
  ASSERT_TRUE(t.engine
                  ->submit(long_request,
                           [&](const TokenEvent& e) {
                             if (e.token >= 0) long_tokens.fetch_add(1);
                             if (e.finished) long_done.store(true);
                           })
                  .is_ok());
  std::atomic<bool> stop{false};
  Status loop_status = Status::ok();
  std::thread stepper([&] {
    while (!stop.load()) {
      if (t.engine->idle()) {
        std::this_thread::yield();
        continue;
      }
      loop_status = t.engine->step();
      if (!loop_status) return;
    }
  });
  while (long_tokens.load() < 3 && !long_done.load()) std::this_thread::yield();

  for (int i = 0; i < 5; ++i) {
    const int64_t before = long_tokens.load();
    std::atomic<int64_t> at_first_token{-1};
    std::atomic<bool> done{false};
    Request r;
    r.prompt = random_tokens(rng, 5, 512);
    r.sampling.max_new_tokens = 1;
    ASSERT_TRUE(t.engine
                    ->submit(r,
                             [&](const TokenEvent& e) {
                               if (e.token >= 0) at_first_token.store(long_tokens.load());
                               if (e.finished) done.store(true);
                             })
                    .is_ok());
    while (!done.load() && loop_status.is_ok()) std::this_thread::yield();
    ASSERT_TRUE(loop_status.is_ok()) << loop_status.message();
    // The step in progress when submit() asked for the lock, then the step that prefills the
    // new prompt and samples its first token (the long request decodes in both).
    EXPECT_LE(at_first_token.load() - before, 2)
        << "request " << i << " waited " << at_first_token.load() - before << " steps";
  }
  EXPECT_FALSE(long_done.load()) << "the long request ended before the check was over";
  stop.store(true);
  stepper.join();
  ASSERT_TRUE(loop_status.is_ok()) << loop_status.message();
}

TEST(EngineContract, DevicesAndRandomWeightsOnTheCpu) {
  EXPECT_TRUE(check_device("cpu").is_ok());
  EXPECT_EQ(check_device("tpu").code(), ErrorCode::kInvalidArgument);
  if (!cuda_device_available()) {
    const Status cuda = check_device("cuda");
    EXPECT_EQ(cuda.code(), ErrorCode::kUnsupported);
    EXPECT_TRUE(contains(cuda.message(), "use device 'cpu'")) << cuda.message();
    EXPECT_EQ(default_device(), "cpu");
  }
  EngineOptions o = small_options();
  o.model_dir = fixture("qwen3_moe") / "base";
  o.random_weights = true;
  const auto created = Engine::create(o);
  ASSERT_FALSE(created.is_ok());
  EXPECT_TRUE(contains(created.status().message(), "random_weights needs device 'cuda'"))
      << created.status().message();
  o.random_weights = false;
  o.gpu_memory_fraction = 1.5;
  EXPECT_TRUE(contains(Engine::create(o).status().message(), "gpu_memory_fraction"));
  o.gpu_memory_fraction = 0.9;
  o.max_layers = 2;  // the CPU backend honours max_layers too
  auto two = Engine::create(o);
  ASSERT_TRUE(two.is_ok()) << two.status().message();
  EXPECT_EQ(two.value()->model_info().num_layers, 2);
}

}  // namespace
}  // namespace moelora::runtime
