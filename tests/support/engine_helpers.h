// Helpers of the Engine's unit tests (tests/unit/runtime_engine*_test.cpp): the committed
// fixtures loaded quietly, a RecordingExecutor that wraps the CPU executor and records every
// forward (with an optional fixed KV page pool, tampering and a broken flag), small engine
// options, and a client's view of one request's events.
#pragma once

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
#include "support/test_support.h"

namespace moelora::runtime::engine_test {

namespace fs = std::filesystem;

using ::moelora::test::random_tokens;

inline model::Model load_quiet(const fs::path& dir) {
  model::ModelOptions options;
  options.show_progress = false;
  return model::Model::load(dir, options);
}

// Wraps the CPU executor and records what every forward looked like.
class RecordingExecutor final : public Executor {
 public:
  explicit RecordingExecutor(std::unique_ptr<Executor> inner) : inner_(std::move(inner)) {}
  struct Forward {
    int64_t tokens = 0;
    int64_t sequences = 0;
    std::set<int32_t> slots;  // adapter slots (>= 0) in the batch
    int64_t base_sequences = 0;
  };
  std::vector<Forward> forwards;

  const io::ModelConfig& config() const override { return inner_->config(); }
  const ExecutorLimits& limits() const override { return inner_->limits(); }
  void check_adapter(const io::LoraAdapter& a) const override { inner_->check_adapter(a); }
  void write_slot(int32_t slot, const io::LoraAdapter& a) override { inner_->write_slot(slot, a); }
  void clear_slot(int32_t slot) override { inner_->clear_slot(slot); }
  SequenceHandle new_sequence() override {
    const SequenceHandle s = inner_->new_sequence();
    if (pages_) page_of_[s] = pages_->new_sequence();
    return s;
  }
  void free_sequence(SequenceHandle s) override {
    inner_->free_sequence(s);
    if (pages_) {
      pages_->free_sequence(page_of_.at(s));
      page_of_.erase(s);
    }
  }
  int64_t sequence_length(SequenceHandle s) const override { return inner_->sequence_length(s); }
  int64_t live_sequences() const override { return inner_->live_sequences(); }
  uint64_t cache_bytes() const override { return inner_->cache_bytes(); }
  uint64_t state_bytes() const override { return inner_->state_bytes(); }
  int64_t state_slots() const override { return inner_->state_slots(); }
  // Knobs of the contract tests: a backend sequence-length limit, random adapters (drawn as the
  // stand-in adapter under a per-seed name), and a hook that may spoil sampled tokens.
  int64_t max_length = 0;
  bool random_adapters = false;
  io::LoraAdapter random_stand_in;
  std::vector<std::tuple<int32_t, int64_t, bool, uint64_t>> randomized;
  std::function<void(std::span<const BatchEntry>, std::vector<int32_t>&)> tamper;
  std::string broken;  // broken_reason(): a backend that lost a rank
  std::string broken_reason() const override { return broken; }
  // check_health(): counted; sets `broken` to break_on_health_check when that is not empty.
  int health_checks = 0;
  std::string break_on_health_check;
  void check_health() override {
    ++health_checks;
    if (!break_on_health_check.empty()) broken = break_on_health_check;
  }
  std::vector<std::vector<ops::SampleRowParams>> params_seen;
  std::vector<std::vector<float>> uniforms_seen;

  int64_t max_sequence_length() const override { return max_length; }

  // A fixed KV page pool like the GPU executor's: every forward takes the pages its tokens need
  // from a PageAllocator first and throws (as the GPU executor does) when too few are free.
  // Set before Engine::create, which reads kv_capacity().
  void use_page_pool(int64_t pages, int page_size) {
    pages_.emplace(pages, page_size, static_cast<int>(pages));
  }
  KvCapacity kv_capacity() const override { return pages_ ? pages_->capacity() : KvCapacity{}; }
  int64_t peak_pages_in_use = 0;
  bool supports_random_adapters() const override { return random_adapters; }
  void randomize_slot(int32_t slot, int64_t rank, bool shared_outer, uint64_t seed) override {
    if (!random_adapters) Executor::randomize_slot(slot, rank, shared_outer, seed);
    randomized.emplace_back(slot, rank, shared_outer, seed);
    io::LoraAdapter a = random_stand_in;
    a.name = "random-" + std::to_string(seed);
    inner_->clear_slot(slot);
    inner_->write_slot(slot, a);
  }
  std::vector<int32_t> forward_sample(std::span<const BatchEntry> batch,
                                      std::span<const ops::SampleRowParams> params,
                                      std::span<const float> uniforms) override {
    params_seen.emplace_back(params.begin(), params.end());
    uniforms_seen.emplace_back(uniforms.begin(), uniforms.end());
    std::vector<int32_t> tokens = Executor::forward_sample(batch, params, uniforms);
    if (tamper) tamper(batch, tokens);
    return tokens;
  }
  ExecutorCounters counters() const override { return inner_->counters(); }

  // A forward that keeps the thread busy this long, like a GPU step's wait for the device.
  std::chrono::microseconds busy_forward{0};

  std::vector<Tensor> forward(std::span<const BatchEntry> batch) override {
    const auto busy_until = std::chrono::steady_clock::now() + busy_forward;
    while (std::chrono::steady_clock::now() < busy_until) {
    }
    Forward f;
    for (const BatchEntry& b : batch) {
      f.tokens += static_cast<int64_t>(b.tokens.size());
      ++f.sequences;
      if (b.slot >= 0) {
        f.slots.insert(b.slot);
      } else {
        ++f.base_sequences;
      }
    }
    forwards.push_back(f);
    if (!pages_) return inner_->forward(batch);
    size_t reserved = 0;
    try {
      for (; reserved < batch.size(); ++reserved) {
        const SequenceHandle p = page_of_.at(batch[reserved].sequence);
        pages_->reserve(p, pages_->length(p) + static_cast<int64_t>(batch[reserved].tokens.size()));
      }
    } catch (...) {
      for (size_t i = 0; i < reserved; ++i) pages_->rollback(page_of_.at(batch[i].sequence));
      throw;
    }
    peak_pages_in_use = std::max(peak_pages_in_use, pages_->pages_in_use());
    std::vector<Tensor> logits = inner_->forward(batch);
    for (const BatchEntry& b : batch) {
      const SequenceHandle p = page_of_.at(b.sequence);
      pages_->commit(p, pages_->length(p) + static_cast<int64_t>(b.tokens.size()));
    }
    return logits;
  }

 private:
  std::unique_ptr<Executor> inner_;
  std::optional<PageAllocator> pages_;
  std::map<SequenceHandle, SequenceHandle> page_of_;  // inner handle -> page allocator handle
};

inline EngineOptions small_options() {
  EngineOptions o;
  o.max_batch_tokens = 24;
  o.max_running = 4;
  o.max_loras_per_batch = 2;
  o.adapter_slots = 2;
  o.max_lora_rank = 16;
  o.host_adapter_cache = 4;
  o.prefill_chunk = 7;
  return o;
}

struct TestEngine {
  std::unique_ptr<Engine> engine;
  RecordingExecutor* executor = nullptr;  // owned by the engine
};

// kv: a fixed KV page pool for the backend (RecordingExecutor::use_page_pool); none by default.
inline TestEngine make_engine(const fs::path& model_dir, const EngineOptions& options,
                              KvCapacity kv = {}) {
  const ExecutorLimits limits{options.max_batch_tokens, options.max_running, options.adapter_slots,
                              options.max_lora_rank};
  auto recording = std::make_unique<RecordingExecutor>(
      std::make_unique<CpuExecutor>(load_quiet(model_dir), limits));
  if (kv.limited()) recording->use_page_pool(kv.pages, static_cast<int>(kv.page_size));
  TestEngine t;
  t.executor = recording.get();
  Result<std::unique_ptr<Engine>> created = Engine::create(std::move(recording), options);
  EXPECT_TRUE(created.is_ok()) << created.status().message();
  t.engine = std::move(created.value());
  return t;
}

// Events of one request, as a client would collect them.
struct Collected {
  std::vector<int32_t> tokens;
  std::vector<int64_t> indices;
  int finals = 0;
  FinishReason reason = FinishReason::kNone;
  std::string error;
};

inline TokenCallback collect_into(Collected& c) {
  return [&c](const TokenEvent& e) {
    if (e.token >= 0) {
      c.tokens.push_back(e.token);
      c.indices.push_back(e.index);
    }
    if (e.finished) {
      ++c.finals;
      c.reason = e.finish_reason;
      c.error = e.error;
    }
  };
}

}  // namespace moelora::runtime::engine_test
