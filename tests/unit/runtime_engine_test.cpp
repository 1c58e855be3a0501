// Unit tests of the serving Engine (src/runtime, include/moelora/engine.h) on the CPU executor,
// end to end on the committed tiny fixtures (Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3): greedy and
// sampled outputs equal model::generate of each request alone while requests join and leave at
// different steps with mixed adapters and chunked prompts; the per-step limits as the backend
// sees them; cancellation frees the KV cache and the slot; adapter eviction and reloads;
// unregistering; bad requests and options rejected with clear messages; a backend with a small KV
// page pool makes requests wait, never fail, and too large ones are rejected at submit; a broken
// backend stops the engine. The Executor contract the Engine relies on is in
// runtime_engine_contract_test.cpp.
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

// ================================================================ Engine on the fixtures

// AdapterSet in fixed-slot mode (what CpuExecutor uses for its slot pool).
TEST(AdapterSlots, SetClearResize) {
  model::Model m = load_quiet(fixture("qwen3_moe") / "base");
  const fs::path dir = fixture("qwen3_moe");
  model::AdapterSet& set = m.adapters();
  set.resize(3);
  EXPECT_EQ(set.size(), 3);
  EXPECT_TRUE(set.names().empty());
  const io::LoraAdapter a = io::load_adapter(dir / "lora_peft3d", m.config(), "a");
  const io::LoraAdapter b = io::load_adapter(dir / "lora_shared_outer", m.config(), "b");
  set.set(2, a);
  EXPECT_TRUE(set.occupied(2));
  EXPECT_FALSE(set.occupied(0));
  EXPECT_EQ(set.slot_of("a"), 2);
  EXPECT_EQ(set.names(), std::vector<std::string>{"a"});
  EXPECT_TRUE(contains(error_of([&] { set.set(0, a); }), "'a' is already loaded in slot 2"));
  EXPECT_TRUE(contains(error_of([&] { set.adapter(0); }), "adapter slot 0 is empty"));
  EXPECT_TRUE(contains(error_of([&] { set.set(3, b); }), "adapter slot 3 is not in [0, 3)"));
  EXPECT_TRUE(contains(error_of([&] { set.resize(2); }), "slot 2 holds adapter 'a'"));
  // Empty slots have no factors; the occupied one has them.
  const auto q = set.target(0, &io::LayerLora::q_proj);
  ASSERT_EQ(q.size(), 3u);
  EXPECT_EQ(q[0], nullptr);
  EXPECT_NE(q[2], nullptr);
  EXPECT_EQ(set.moe(0)[1].gate_up, nullptr);

  // A sequence on the slot sees the adapter; replacing the slot changes what a new sequence sees.
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  model::Sequence on_a = m.new_sequence(2), base = m.new_sequence(-1);
  const Tensor logits_a = m.forward(on_a, prompt);
  const Tensor logits_base = m.forward(base, prompt);
  EXPECT_GT(test::max_abs_diff(logits_a, logits_base), 1e-3);
  set.set(2, b);
  model::Sequence on_b = m.new_sequence(2);
  const Tensor logits_b = m.forward(on_b, prompt);
  EXPECT_GT(test::max_abs_diff(logits_b, logits_a), 1e-3);
  model::Model reference = load_quiet(fixture("qwen3_moe") / "base");
  const int32_t ref_slot = reference.load_adapter("b", dir / "lora_shared_outer");
  model::Sequence ref = reference.new_sequence(ref_slot);
  EXPECT_TRUE(test::all_close(logits_b, reference.forward(ref, prompt), 0.0f, 0.0f));
  set.clear(2);
  EXPECT_FALSE(set.occupied(2));
  EXPECT_FALSE(set.contains("b"));
  set.resize(1);
  EXPECT_EQ(set.size(), 1);
}

struct Case {
  std::vector<int32_t> prompt;
  std::string adapter;  // "" = base
  int64_t max_new = 0;
  int join_step = 0;  // submitted before this step
  double temperature = 0.0;
};

// Runs `cases` through the engine, each submitted before its join_step, and checks every output
// against model::generate of that request alone (same adapter, same sampler seed).
// kv: a KV page pool for the backend (none by default); with one, no request may fail for lack
// of pages and the pool must have limited admission at least once.
void expect_engine_matches_generate(const std::string& model,
                                    const std::map<std::string, std::string>& adapters,
                                    const std::vector<Case>& cases, const EngineOptions& options,
                                    KvCapacity kv = {}) {
  TestEngine t = make_engine(fixture(model) / "base", options, kv);
  for (const auto& [name, dir] : adapters) {
    const Status s = t.engine->register_adapter(name, fixture(model) / dir);
    ASSERT_TRUE(s.is_ok()) << s.message();
  }
  std::vector<Collected> got(cases.size());
  size_t submitted = 0;
  for (int step = 0; submitted < cases.size() || !t.engine->idle(); ++step) {
    for (size_t i = 0; i < cases.size(); ++i) {
      if (cases[i].join_step != step) continue;
      Request r;
      r.prompt = cases[i].prompt;
      r.adapter = cases[i].adapter;
      r.sampling.max_new_tokens = cases[i].max_new;
      r.sampling.ignore_eos = true;
      r.sampling.temperature = cases[i].temperature;
      r.sampling.top_p = cases[i].temperature > 0 ? 0.9 : 1.0;
      r.sampling.seed = 1000 + i;
      ASSERT_TRUE(t.engine->submit(r, collect_into(got[i])).is_ok());
      ++submitted;
    }
    ASSERT_TRUE(t.engine->step().is_ok());
    ASSERT_LT(step, 500) << "the engine does not finish";
  }

  model::Model reference = load_quiet(fixture(model) / "base");
  for (const auto& [name, dir] : adapters) reference.load_adapter(name, fixture(model) / dir);
  for (size_t i = 0; i < cases.size(); ++i) {
    model::GenerationRequest g;
    g.prompt = cases[i].prompt;
    g.slot = cases[i].adapter.empty() ? -1 : reference.adapters().slot_of(cases[i].adapter);
    g.max_new_tokens = cases[i].max_new;
    g.sampling = {cases[i].temperature, cases[i].temperature > 0 ? 0.9 : 1.0, 0, 1000 + i};
    const model::GenerationResult alone = model::generate(reference, std::span(&g, 1));
    EXPECT_EQ(got[i].tokens, alone.outputs[0].tokens)
        << "request " << i << " (adapter '" << cases[i].adapter << "')";
    EXPECT_EQ(got[i].finals, 1) << "request " << i;
    EXPECT_EQ(got[i].reason, FinishReason::kLength) << "request " << i << ": " << got[i].error;
    std::vector<int64_t> expected_indices(got[i].tokens.size());
    std::iota(expected_indices.begin(), expected_indices.end(), 0);
    EXPECT_EQ(got[i].indices, expected_indices);
  }

  // What the backend saw: within the limits, and really mixed.
  bool mixed = false;
  for (const auto& f : t.executor->forwards) {
    EXPECT_LE(f.tokens, options.max_batch_tokens);
    EXPECT_LE(f.sequences, options.max_running);
    EXPECT_LE(static_cast<int32_t>(f.slots.size()), options.max_loras_per_batch);
    mixed = mixed || (f.slots.size() >= 2 && f.base_sequences > 0);
  }
  if (adapters.size() >= 2 && options.max_loras_per_batch >= 2) {
    EXPECT_TRUE(mixed) << "no step mixed two adapters and the base model";
  }
  const EngineStats stats = t.engine->stats();
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.kv_cache_bytes, 0u);
  EXPECT_EQ(stats.steps, static_cast<int64_t>(t.executor->forwards.size()));
  EXPECT_EQ(stats.requests_finished, static_cast<int64_t>(cases.size()));
  EXPECT_EQ(stats.requests_failed, 0);
  if (kv.limited()) {
    EXPECT_EQ(t.engine->model_info().kv_cache_pages, kv.pages);
    EXPECT_EQ(t.engine->model_info().kv_page_size, kv.page_size);
    EXPECT_GT(stats.kv_blocked_steps, 0) << "the page pool never limited admission";
    EXPECT_LE(stats.peak_kv_pages_reserved, kv.pages);
    EXPECT_LE(t.executor->peak_pages_in_use, stats.peak_kv_pages_reserved);
    EXPECT_EQ(stats.kv_pages_reserved, 0);
  }
}

TEST(Engine, ContinuousBatchingEqualsEachRequestAloneQwen) {
  std::mt19937_64 rng(test::test_seed(71));
  const int64_t vocab = 512;
  // Requests join at different steps, with prompts longer than prefill_chunk (7) so that prefill
  // chunks and decodes of other requests share steps, and leave at different steps.
  std::vector<Case> cases = {
      {random_tokens(rng, 19, vocab), "peft3d", 9, 0},
      {random_tokens(rng, 5, vocab), "", 12, 0},
      {random_tokens(rng, 11, vocab), "shared", 4, 0},
      {random_tokens(rng, 3, vocab), "peft3d", 6, 2},
      {random_tokens(rng, 23, vocab), "", 5, 3},
      {random_tokens(rng, 1, vocab), "shared", 7, 5},
      {random_tokens(rng, 8, vocab), "per_expert", 6, 6},
      {random_tokens(rng, 13, vocab), "peft3d", 3, 9},
      {random_tokens(rng, 6, vocab), "", 8, 9, /*temperature=*/0.8},
  };
  expect_engine_matches_generate("qwen3_moe",
                                 {{"peft3d", "lora_peft3d"},
                                  {"shared", "lora_shared_outer"},
                                  {"per_expert", "lora_per_expert"}},
                                 cases, small_options());
}

// Qwen3.5: Gated DeltaNet layers carry a per-sequence recurrent state instead of KV rows. Prompts
// longer than prefill_chunk (7) are prefilled over several steps beside other requests' decodes,
// so each state must survive its chunks untouched by the others; the state is freed with the
// request (kv_cache_bytes back to 0).
TEST(Engine, ContinuousBatchingEqualsEachRequestAloneQwen35) {
  std::mt19937_64 rng(test::test_seed(73));
  std::vector<Case> cases = {
      {random_tokens(rng, 17, 512), "all", 6, 0},
      {random_tokens(rng, 4, 512), "", 9, 0},
      {random_tokens(rng, 12, 512), "linear", 5, 1},
      {random_tokens(rng, 1, 512), "all", 7, 3},
      {random_tokens(rng, 9, 512), "", 4, 4, /*temperature=*/0.8},
      {random_tokens(rng, 21, 512), "linear", 3, 6},
  };
  expect_engine_matches_generate("qwen3_5_moe", {{"all", "lora_all"}, {"linear", "lora_linear"}},
                                 cases, small_options());
}

// The engine reports the linear-attention state apart from the KV cache: a fixed size per running
// sequence (it does not grow with the tokens, as the KV rows of the full-attention layers do),
// and nothing once the requests end. A model without such layers reports none.
TEST(Engine, LinearAttentionStateIsCountedApartFromTheKvCache) {
  std::mt19937_64 rng(test::test_seed(79));
  TestEngine t = make_engine(fixture("qwen3_5_moe") / "base", small_options());
  EXPECT_EQ(t.engine->model_info().state_slots, 0);  // the CPU backend allocates per sequence
  auto submit = [&](int64_t prompt_len, int64_t max_new) {
    Request r;
    r.prompt = random_tokens(rng, prompt_len, 512);
    r.sampling.max_new_tokens = max_new;
    r.sampling.ignore_eos = true;
    ASSERT_TRUE(t.engine->submit(r, [](const TokenEvent&) {}).is_ok());
  };
  submit(5, 6);
  ASSERT_TRUE(t.engine->step().is_ok());
  const EngineStats one = t.engine->stats();
  EXPECT_EQ(one.state_sequences, 1);
  EXPECT_GT(one.state_cache_bytes, 0u);
  EXPECT_GT(one.kv_cache_bytes, 0u);  // the fixture's full-attention layers
  ASSERT_TRUE(t.engine->step().is_ok());
  const EngineStats later = t.engine->stats();
  EXPECT_EQ(later.state_cache_bytes, one.state_cache_bytes);
  EXPECT_GT(later.kv_cache_bytes, one.kv_cache_bytes);
  submit(3, 2);
  ASSERT_TRUE(t.engine->step().is_ok());
  const EngineStats two = t.engine->stats();
  EXPECT_EQ(two.state_sequences, 2);
  EXPECT_EQ(two.state_cache_bytes, 2 * one.state_cache_bytes);
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(t.engine->stats().state_cache_bytes, 0u);
  EXPECT_EQ(t.engine->stats().state_sequences, 0);

  TestEngine q3 = make_engine(fixture("qwen3_moe") / "base", small_options());
  Request r;
  r.prompt = random_tokens(rng, 5, 512);
  r.sampling.max_new_tokens = 3;
  ASSERT_TRUE(q3.engine->submit(r, [](const TokenEvent&) {}).is_ok());
  ASSERT_TRUE(q3.engine->step().is_ok());
  EXPECT_EQ(q3.engine->stats().state_cache_bytes, 0u);
  EXPECT_EQ(q3.engine->stats().state_sequences, 0);
  EXPECT_GT(q3.engine->stats().kv_cache_bytes, 0u);
}

TEST(Engine, ContinuousBatchingEqualsEachRequestAloneDeepseek) {
  std::mt19937_64 rng(test::test_seed(72));
  std::vector<Case> cases = {
      {random_tokens(rng, 9, 512), "dense", 6, 0},       {random_tokens(rng, 14, 512), "", 5, 0},
      {random_tokens(rng, 4, 512), "peft3d", 8, 1},      {random_tokens(rng, 2, 512), "", 4, 4},
      {random_tokens(rng, 10, 512), "dense", 3, 4, 0.7},
  };
  EngineOptions o = small_options();
  o.max_batch_tokens = 16;
  o.prefill_chunk = 0;  // only the step budget chunks
  expect_engine_matches_generate(
      "deepseek_v3", {{"dense", "lora_dense_shared"}, {"peft3d", "lora_peft3d"}}, cases, o);
}

// A backend whose KV pool holds 9 pages of 5 tokens (45 tokens) while the requests want 103
// tokens together: they wait at submission order and join as others finish; none fails, and each
// output is still the one of the request alone.
TEST(Engine, SmallKvPoolMakesRequestsWaitNeverFail) {
  std::mt19937_64 rng(test::test_seed(73));
  const int64_t vocab = 512;
  std::vector<Case> cases = {
      {random_tokens(rng, 19, vocab), "peft3d", 9, 0},  // 28 tokens: 6 pages
      {random_tokens(rng, 5, vocab), "", 12, 0},        // 17: 4
      {random_tokens(rng, 11, vocab), "shared", 4, 0},  // 15: 3
      {random_tokens(rng, 3, vocab), "peft3d", 6, 1},   // 9: 2
      {random_tokens(rng, 23, vocab), "", 5, 1},        // 28: 6
      {random_tokens(rng, 1, vocab), "shared", 7, 2},   // 8: 2
      {random_tokens(rng, 8, vocab), "", 6, 2, 0.8},    // 14: 3
  };
  expect_engine_matches_generate("qwen3_moe",
                                 {{"peft3d", "lora_peft3d"}, {"shared", "lora_shared_outer"}},
                                 cases, small_options(), KvCapacity{9, 5});
}

TEST(Engine, RequestLargerThanTheKvPoolIsRejectedAtSubmit) {
  TestEngine t =
      make_engine(fixture("qwen3_moe") / "base", small_options(), KvCapacity{4, 6});  // 24 tokens
  Request r;
  r.prompt = std::vector<int32_t>(20, 11);
  r.sampling.max_new_tokens = 5;
  r.sampling.ignore_eos = true;
  const Result<RequestId> refused = t.engine->submit(r, nullptr);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kOutOfRange);
  EXPECT_TRUE(contains(refused.status().message(),
                       "request: prompt (20 tokens) + max_new_tokens (5) = 25 tokens need 5 KV "
                       "cache pages of 6 tokens, but the whole KV cache has 4 pages (24 tokens)"))
      << refused.status().message();
  EXPECT_EQ(t.engine->stats().waiting, 0);
  // Exactly the pool fits, and runs to its end.
  r.sampling.max_new_tokens = 4;
  Collected c;
  ASSERT_TRUE(t.engine->submit(r, collect_into(c)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(c.reason, FinishReason::kLength) << c.error;
  EXPECT_EQ(c.tokens.size(), 4u);
  EXPECT_EQ(t.engine->stats().peak_kv_pages_reserved, 4);
}

TEST(Engine, OneSlotEvictsAndReloadsFromTheHostCache) {
  std::mt19937_64 rng(test::test_seed(73));
  std::vector<Case> cases;
  const std::vector<std::string> order = {"a", "b", "", "a", "b", "a"};
  for (size_t i = 0; i < order.size(); ++i) {
    cases.push_back(
        {random_tokens(rng, 4 + static_cast<int64_t>(i), 512), order[i], 3, static_cast<int>(i)});
  }
  EngineOptions o = small_options();
  o.adapter_slots = 1;
  o.max_loras_per_batch = 1;
  expect_engine_matches_generate("qwen3_moe", {{"a", "lora_peft3d"}, {"b", "lora_per_expert"}},
                                 cases, o);
}

TEST(Engine, PoolStatsAfterEvictions) {
  EngineOptions o = small_options();
  o.adapter_slots = 1;
  o.max_loras_per_batch = 1;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  ASSERT_TRUE(t.engine->register_adapter("b", fixture("qwen3_moe") / "lora_shared_outer").is_ok());
  for (const char* name : {"a", "b", "a", "b"}) {
    Request r;
    r.prompt = {1, 2, 3};
    r.adapter = name;
    r.sampling.max_new_tokens = 2;
    ASSERT_TRUE(t.engine->submit(r, {}).is_ok());
    ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  }
  const EngineStats s = t.engine->stats();
  EXPECT_EQ(s.pool_misses, 4);  // one slot: every request loads its adapter
  EXPECT_EQ(s.pool_hits, 0);
  EXPECT_EQ(s.pool_evictions, 3);
  EXPECT_EQ(s.host_misses, 2);  // the two registrations read the files; no slot load did
  EXPECT_EQ(s.host_hits, 4);
}

TEST(Engine, CancelMidPrefillAndMidDecodeFreesCacheAndSlot) {
  EngineOptions o = small_options();
  o.prefill_chunk = 4;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  std::mt19937_64 rng(test::test_seed(74));
  Collected prefilling, decoding, other;
  Request long_prompt{random_tokens(rng, 30, 512), "a", {}};
  long_prompt.sampling.max_new_tokens = 5;
  Request short_prompt{random_tokens(rng, 3, 512), "a", {}};
  short_prompt.sampling.max_new_tokens = 50;
  Request base{random_tokens(rng, 5, 512), "", {}};
  base.sampling.max_new_tokens = 12;
  for (Request* r : {&long_prompt, &short_prompt, &base}) r->sampling.ignore_eos = true;
  const RequestId p = t.engine->submit(long_prompt, collect_into(prefilling)).value();
  const RequestId d = t.engine->submit(short_prompt, collect_into(decoding)).value();
  const RequestId b = t.engine->submit(base, collect_into(other)).value();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(t.engine->step().is_ok());
  ASSERT_EQ(decoding.tokens.size(), 3u);  // d is decoding, p is still in prefill (30 > 3 * 4)
  ASSERT_TRUE(prefilling.tokens.empty());
  EXPECT_EQ(t.executor->live_sequences(), 3);
  const auto adapter_users = [&] {
    for (const AdapterInfo& a : t.engine->adapters())
      if (a.name == "a") return a.running_requests;
    return -1;
  };
  EXPECT_EQ(adapter_users(), 2);
  const uint64_t bytes_before = t.engine->stats().kv_cache_bytes;

  ASSERT_TRUE(t.engine->cancel(p).is_ok());
  EXPECT_EQ(t.executor->live_sequences(), 2);
  EXPECT_EQ(adapter_users(), 1);
  EXPECT_LT(t.engine->stats().kv_cache_bytes, bytes_before);
  ASSERT_TRUE(t.engine->cancel(d).is_ok());
  EXPECT_EQ(t.executor->live_sequences(), 1);
  EXPECT_EQ(adapter_users(), 0);
  const Status again = t.engine->cancel(d);
  EXPECT_EQ(again.code(), ErrorCode::kNotFound);
  EXPECT_TRUE(contains(again.message(), "is not waiting or running")) << again.message();

  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(prefilling.finals, 1);
  EXPECT_EQ(prefilling.reason, FinishReason::kCancelled);
  EXPECT_EQ(decoding.reason, FinishReason::kCancelled);
  EXPECT_EQ(decoding.tokens.size(), 3u);  // nothing after the cancel
  EXPECT_EQ(other.reason, FinishReason::kLength);
  EXPECT_EQ(other.tokens.size(), 12u);
  EXPECT_EQ(t.executor->live_sequences(), 0);
  EXPECT_EQ(t.engine->stats().requests_cancelled, 2);
  (void)b;

  // The base request ran undisturbed: same tokens as alone.
  model::Model reference = load_quiet(fixture("qwen3_moe") / "base");
  model::GenerationRequest g;
  g.prompt = base.prompt;
  g.max_new_tokens = 12;
  EXPECT_EQ(other.tokens, model::generate(reference, std::span(&g, 1)).outputs[0].tokens);
}

TEST(Engine, CancelWhileWaitingAndFromACallback) {
  EngineOptions o = small_options();
  o.max_running = 1;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  Collected first, queued;
  Request r{{4, 5, 6}, "", {}};
  r.sampling.max_new_tokens = 20;
  r.sampling.ignore_eos = true;
  RequestId first_id = 0;
  first_id = t.engine
                 ->submit(r,
                          [&](const TokenEvent& e) {
                            collect_into(first)(e);
                            if (e.index == 2) {
                              EXPECT_TRUE(t.engine->cancel(first_id).is_ok());
                            }
                          })
                 .value();
  const RequestId q = t.engine->submit(r, collect_into(queued)).value();
  ASSERT_TRUE(t.engine->cancel(q).is_ok());  // still waiting
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(first.tokens.size(), 3u);
  EXPECT_EQ(first.reason, FinishReason::kCancelled);
  EXPECT_EQ(first.finals, 1);
  EXPECT_TRUE(queued.tokens.empty());
  EXPECT_EQ(queued.reason, FinishReason::kCancelled);
  EXPECT_TRUE(t.engine->idle());
}

TEST(Engine, ThrowingCallbackCancelsOnlyItsRequest) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  Request r{{7, 8, 9}, "", {}};
  r.sampling.max_new_tokens = 6;
  r.sampling.ignore_eos = true;
  int thrower_calls = 0;
  Collected good;
  ASSERT_TRUE(t.engine
                  ->submit(r,
                           [&](const TokenEvent&) {
                             ++thrower_calls;
                             throw std::runtime_error("client went away");
                           })
                  .is_ok());
  ASSERT_TRUE(t.engine->submit(r, collect_into(good)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(thrower_calls, 1);
  EXPECT_EQ(good.tokens.size(), 6u);
  EXPECT_EQ(t.engine->stats().requests_cancelled, 1);
  EXPECT_EQ(t.executor->live_sequences(), 0);
}

// A backend that can run no more forwards (a multi-process backend that lost a rank) stops the
// engine: the step whose forward failed ends its requests with the error and returns it, so the
// server's engine loop stops and reports it; a backend that failed one batch but is not broken
// keeps the engine going.
TEST(Engine, ABrokenBackendStopsTheEngine) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  Request r{{7, 8, 9}, "", {}};
  r.sampling.max_new_tokens = 6;
  r.sampling.ignore_eos = true;
  Collected first, second;
  ASSERT_TRUE(t.engine->submit(r, collect_into(first)).is_ok());
  t.executor->tamper = [](std::span<const BatchEntry>, std::vector<int32_t>&) {
    throw Error(ErrorCode::kInternal, "one bad batch");
  };
  EXPECT_TRUE(t.engine->step().is_ok()) << "a failed batch alone does not stop the engine";
  ASSERT_TRUE(t.engine->submit(r, collect_into(second)).is_ok());
  t.executor->tamper = [&](std::span<const BatchEntry>, std::vector<int32_t>&) {
    t.executor->broken = "rank 3 was lost";
    throw Error(ErrorCode::kInternal, "the connection to rank 3 closed");
  };
  const Status s = t.engine->step();
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(s.message(), "the backend cannot run any more steps: rank 3 was lost");
  EXPECT_EQ(second.finals, 1);
  EXPECT_NE(second.error.find("the connection to rank 3 closed"), std::string::npos)
      << second.error;
}

// Between requests the engine asks the backend whether it can still run: OK while it can, the
// backend's reason once it broke (a lost rank noticed by its health check, with no step to run).
TEST(Engine, CheckBackendAsksTheIdleBackend) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  EXPECT_TRUE(t.engine->check_backend().is_ok());
  EXPECT_EQ(t.executor->health_checks, 1);
  t.executor->break_on_health_check = "rank 2 closed its connection";
  const Status s = t.engine->check_backend();
  EXPECT_EQ(s.message(), "the backend cannot run any more steps: rank 2 closed its connection");
  EXPECT_EQ(t.executor->health_checks, 2);
}

TEST(Engine, StopTokensEndARequest) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  Request r{{11, 12, 13, 14}, "", {}};
  r.sampling.max_new_tokens = 10;
  r.sampling.ignore_eos = true;
  Collected free_run;
  ASSERT_TRUE(t.engine->submit(r, collect_into(free_run)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  ASSERT_EQ(free_run.tokens.size(), 10u);
  r.sampling.stop_token_ids = {free_run.tokens[4]};
  Collected stopped;
  ASSERT_TRUE(t.engine->submit(r, collect_into(stopped)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  const auto first = std::find(free_run.tokens.begin(), free_run.tokens.end(), free_run.tokens[4]);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(free_run.tokens.begin(), first + 1));
  EXPECT_EQ(stopped.reason, FinishReason::kStop);
}

TEST(Engine, EndOfSequenceStopsUnlessIgnored) {
  // Find prompts whose greedy continuation contains the model's EOS id: every one-token prompt,
  // 6 tokens each (deterministic: the same candidates on every run).
  EngineOptions o = small_options();
  o.max_running = 64;
  o.max_batch_tokens = 64;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  const int32_t eos = t.engine->model_info().eos_token_ids.at(0);
  std::vector<Request> candidates(512);
  std::vector<Collected> free_runs(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) {
    candidates[i].prompt = {static_cast<int32_t>(i)};
    candidates[i].sampling.max_new_tokens = 6;
    candidates[i].sampling.ignore_eos = true;
    ASSERT_TRUE(t.engine->submit(candidates[i], collect_into(free_runs[i])).is_ok());
  }
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  int checked = 0;
  for (size_t i = 0; i < candidates.size() && checked < 3; ++i) {
    const std::vector<int32_t>& free_run = free_runs[i].tokens;
    const auto first = std::find(free_run.begin(), free_run.end(), eos);
    if (first == free_run.end()) continue;
    Request r = candidates[i];
    r.sampling.ignore_eos = false;
    Collected stopped;
    ASSERT_TRUE(t.engine->submit(r, collect_into(stopped)).is_ok());
    ASSERT_TRUE(t.engine->run_until_idle().is_ok());
    EXPECT_EQ(stopped.tokens, std::vector<int32_t>(free_run.begin(), first + 1))
        << "candidate " << i;
    EXPECT_EQ(stopped.reason, FinishReason::kStop);
    ++checked;
  }
  EXPECT_EQ(checked, 3) << "too few candidate prompts generate the EOS token";
}

TEST(Engine, UnregisterRefusedWhileInUseAllowedAfter) {
  EngineOptions o = small_options();
  o.max_running = 1;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  Request r{{1, 2, 3}, "a", {}};
  r.sampling.max_new_tokens = 3;
  ASSERT_TRUE(t.engine->submit(r, {}).is_ok());
  ASSERT_TRUE(t.engine->submit(r, {}).is_ok());
  Status s = t.engine->unregister_adapter("a");  // both waiting
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "'a' is in use by 2 requests (0 running, 2 waiting)"))
      << s.message();
  ASSERT_TRUE(t.engine->step().is_ok());
  s = t.engine->unregister_adapter("a");
  EXPECT_TRUE(contains(s.message(), "(1 running, 1 waiting)")) << s.message();
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_TRUE(t.engine->unregister_adapter("a").is_ok());
  EXPECT_TRUE(t.engine->adapters().empty());
  EXPECT_EQ(t.engine->unregister_adapter("a").code(), ErrorCode::kNotFound);
  const Result<RequestId> late = t.engine->submit(r, {});
  EXPECT_FALSE(late.is_ok());
  EXPECT_TRUE(contains(late.status().message(), "unknown adapter 'a'; no adapters are registered"))
      << late.status().message();
  // Registering again under the same name works.
  EXPECT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_shared_outer").is_ok());
}

TEST(Engine, PinnedAdapterAndAdapterErrors) {
  EngineOptions o = small_options();
  o.max_lora_rank = 6;  // lora_peft3d: r 4, and 6 on one o_proj
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(
      t.engine->register_adapter("p", fixture("qwen3_moe") / "lora_peft3d", /*pin=*/true).is_ok());
  const std::vector<AdapterInfo> list = t.engine->adapters();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_TRUE(list[0].pinned);
  EXPECT_GE(list[0].slot, 0);

  // per-expert gate and up LoRA of rank 4 are one rank-8 gate_up LoRA: above max_lora_rank 6.
  Status s = t.engine->register_adapter("big", fixture("qwen3_moe") / "lora_per_expert");
  EXPECT_EQ(s.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(s.message(), "rank")) << s.message();
  s = t.engine->register_adapter("p", fixture("qwen3_moe") / "lora_shared_outer");
  EXPECT_TRUE(contains(s.message(), "'p' is already registered")) << s.message();
  s = t.engine->register_adapter("missing", fixture("qwen3_moe") / "no_such_adapter");
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_TRUE(contains(s.message(), "no_such_adapter")) << s.message();
  // An adapter made for the other architecture.
  s = t.engine->register_adapter("other", fixture("deepseek_v3") / "lora_peft3d");
  EXPECT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "other")) << s.message();
  EXPECT_EQ(t.engine->adapters().size(), 1u);
}

TEST(Engine, BadRequestsAreRejectedWithClearMessages) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  const auto rejected = [&](Request r) {
    const Result<RequestId> id = t.engine->submit(std::move(r), {});
    EXPECT_FALSE(id.is_ok());
    return id.status().message();
  };
  Request good{{1, 2, 3}, "", {}};
  good.sampling.ignore_eos = true;
  Request r = good;
  r.prompt.clear();
  EXPECT_EQ(rejected(r), "request: the prompt is empty");
  r = good;
  r.prompt = {1, 2, 512, 3};
  EXPECT_EQ(rejected(r),
            "request: token id 512 at prompt position 2 is outside the vocabulary [0, 512)");
  r.prompt = {-4};
  EXPECT_TRUE(contains(rejected(r), "token id -4 at prompt position 0"));
  r = good;
  r.adapter = "zzz";
  EXPECT_EQ(rejected(r), "request: unknown adapter 'zzz'; registered: a");
  r = good;
  r.sampling.max_new_tokens = 0;
  EXPECT_EQ(rejected(r), "request: max_new_tokens must be >= 1, got 0");
  r = good;
  r.sampling.max_new_tokens = 510;
  EXPECT_TRUE(contains(rejected(r), "= 513 exceeds the model's context of 512 tokens"));
  r = good;
  r.sampling.temperature = -1;
  EXPECT_TRUE(contains(rejected(r), "request: temperature must be"));
  r = good;
  r.sampling.top_p = 0;
  EXPECT_TRUE(contains(rejected(r), "top_p"));
  r = good;
  r.sampling.stop_token_ids = {600};
  EXPECT_TRUE(contains(rejected(r), "stop token id 600"));
  // Nothing was queued, and the engine still works.
  EXPECT_TRUE(t.engine->idle());
  Collected c;
  ASSERT_TRUE(t.engine->submit(good, collect_into(c)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(c.tokens.size(), 16u);  // the default max_new_tokens
}

TEST(Engine, BadOptionsAreRejected) {
  EngineOptions o;
  o.model_dir = fixture("qwen3_moe") / "base";
  const auto error = [](const EngineOptions& options) {
    const Result<std::unique_ptr<Engine>> e = Engine::create(options);
    EXPECT_FALSE(e.is_ok());
    return e.status().message();
  };
  EngineOptions bad = o;
  bad.device = "cuda";
  EXPECT_TRUE(contains(error(bad), "device 'cuda'"));
  EXPECT_EQ(check_device("cuda").code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(check_device("cpu").is_ok());
  bad.device = "tpu";
  EXPECT_TRUE(contains(error(bad), "device 'tpu' is unknown"));
  bad = o;
  bad.max_batch_tokens = 8;
  bad.max_running = 16;
  EXPECT_TRUE(contains(error(bad), "max_batch_tokens (8) must be >= max_running (16)"));
  bad = o;
  bad.max_loras_per_batch = 9;
  EXPECT_TRUE(contains(error(bad), "max_loras_per_batch (9) exceeds adapter_slots (8)"));
  bad = o;
  bad.model_dir = fixture("qwen3_moe") / "does_not_exist";
  EXPECT_TRUE(contains(error(bad), "does_not_exist"));
  bad = o;
  bad.attention = "flash";
  EXPECT_TRUE(contains(error(bad), "attention must be auto, flashinfer or moelora, got 'flash'"));
  // The defaults work and describe the model.
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  ASSERT_TRUE(e.is_ok()) << e.status().message();
  EXPECT_EQ(e.value()->model_info().vocab_size, 512);
  EXPECT_EQ(e.value()->model_info().model_type, "qwen3_moe");
  EXPECT_EQ(e.value()->model_info().eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(e.value()->model_info().attention_kernel, "reference");
}

TEST(Engine, LoraOffRejectsAdapterRequests) {
  EngineOptions o = small_options();
  o.max_loras_per_batch = 0;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  const Result<RequestId> id = t.engine->submit({{1, 2}, "a", {}}, {});
  EXPECT_FALSE(id.is_ok());
  EXPECT_TRUE(contains(id.status().message(), "LoRA is off")) << id.status().message();
}

TEST(Engine, SubmitFromAnotherThreadWhileStepping) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  constexpr int kRequests = 6;
  std::vector<Collected> got(kRequests);
  std::atomic<int> submitted{0};
  std::thread client([&] {
    for (int i = 0; i < kRequests; ++i) {
      Request r{{static_cast<int32_t>(10 + i), 20, 30}, "", {}};
      r.sampling.max_new_tokens = 4;
      r.sampling.ignore_eos = true;
      EXPECT_TRUE(t.engine->submit(r, collect_into(got[i])).is_ok());
      ++submitted;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  while (submitted < kRequests || !t.engine->idle()) {
    ASSERT_TRUE(t.engine->step().is_ok());
    std::this_thread::yield();
  }
  client.join();
  model::Model reference = load_quiet(fixture("qwen3_moe") / "base");
  for (int i = 0; i < kRequests; ++i) {
    model::GenerationRequest g;
    g.prompt = {static_cast<int32_t>(10 + i), 20, 30};
    g.max_new_tokens = 4;
    EXPECT_EQ(got[i].tokens, model::generate(reference, std::span(&g, 1)).outputs[0].tokens) << i;
  }
}

}  // namespace
}  // namespace moelora::runtime
