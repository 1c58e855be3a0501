// Sm90 tensor- and expert-parallel GpuModel on one GPU: the ranks of a group as threads sharing
// the device (NCCL cannot place two ranks on one GPU, so the group here is SameDeviceGroup, which
// keeps NCCL's all-reduce and all-gather contracts), each rank a GpuModel loaded from its
// dist::shard_checkpoint share with its dist::shard_adapter adapters (the fixtures' vocabulary of
// 512 divides: every rank holds its rows of the embedding and lm_head, sums the lookup over the
// group and gathers the logits). On the parity fixtures (Qwen3-MoE with a dense
// layer, Qwen3.5-MoE with Gated DeltaNet and gated attention, DeepSeek-V3 and Kimi-like MLA, the
// FP8 DeepSeek checkpoint), 2 and 4 ranks (KV heads held by two ranks at 4), a batch of adapter and
// base sequences prefilled and decoded teacher-forced with the whole model's tokens:
//   - every rank's logits are bitwise equal to rank 0's (each rank sums in rank order);
//   - rank 0's logits equal the whole model's on one GPU within twice the bf16 bound of the GPU
//     model tests (cosine 0.996, 6 % of the logit range: each is a bf16 approximation of the same
//     fp32 model within that bound, and the ranks round their partial sums to bf16 before adding
//     them), on every step whose routing is the whole model's in every MoE layer; near-tied
//     experts flip on some steps of these small random fixtures (DeepSeek-V3's at 4 ranks: 5 of
//     15), a wrong expert range or a missing sum on nearly all of them.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <barrier>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/device_collectives.h"
#include "dist/gpu_rank_model.h"
#include "dist/shard_checkpoint.h"
#include "dist/sharded_executor.h"
#include "dist/socket_group.h"
#include "gpu/gpu_test_util.cuh"
#include "gpu/model_gpu_driver.cuh"
#include "io/checkpoint.h"
#include "io/peft.h"
#include "model/gpu_model_cuda.cuh"
#include "runtime/gpu_executor.h"
#include "support/test_support.h"

namespace moelora::model {
namespace {

namespace fs = std::filesystem;
using namespace gpu_model_test;

constexpr int kMaxRanks = 8;
// The ranks' buffers, passed by value to the sum kernel.
struct RankBuffers {
  const void* in[kMaxRanks];
};

// out[i] = sum over ranks of in[r][i], in rank order in fp32, rounded once.
template <typename T>
__global__ void sum_ranks_kernel(RankBuffers buffers, int ranks, T* out, size_t count) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int r = 0; r < ranks; ++r) {
      const T v = static_cast<const T*>(buffers.in[r])[i];
      if constexpr (std::is_same_v<T, float>)
        acc += v;
      else
        acc += __bfloat162float(v);
    }
    if constexpr (std::is_same_v<T, float>)
      out[i] = acc;
    else
      out[i] = __float2bfloat16(acc);
  }
}

// A group whose ranks are threads on one device. all_reduce_sum (all_gather alike, copying the
// ranks' blocks instead of summing them): each rank publishes its buffer
// and an event on its stream and meets the others at a host barrier; its stream then waits for
// every rank's event, sums all buffers in rank order into its own scratch and records a second
// event; after a second barrier it waits for every rank's sum to be done (so no rank overwrites a
// buffer another still reads) and copies the scratch back. Asynchronous like NCCL's, but eager
// only: a capture cannot wait on another thread's events.
class SameDeviceGroup {
 public:
  SameDeviceGroup(int size, size_t max_bytes) : shared_(std::make_shared<Shared>(size)) {
    EXPECT_LE(size, kMaxRanks);
    for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(shared_, r, max_bytes));
  }
  DeviceCollectives& rank(int r) { return *ranks_[static_cast<size_t>(r)]; }

 private:
  struct Shared {
    explicit Shared(int n) : size(n), barrier(n), buffers(n), sends(n), ready(n), summed(n) {
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(cudaEventCreateWithFlags(&ready[r], cudaEventDisableTiming), cudaSuccess);
        EXPECT_EQ(cudaEventCreateWithFlags(&summed[r], cudaEventDisableTiming), cudaSuccess);
      }
    }
    ~Shared() {
      for (int r = 0; r < size; ++r) {
        cudaEventDestroy(ready[r]);
        cudaEventDestroy(summed[r]);
      }
    }
    int size;
    std::barrier<> barrier;
    std::vector<void*> buffers;
    std::vector<const void*> sends;
    std::vector<cudaEvent_t> ready, summed;
  };

  class Rank final : public DeviceCollectives {
   public:
    Rank(std::shared_ptr<Shared> shared, int rank, size_t max_bytes)
        : shared_(std::move(shared)), rank_(rank), max_bytes_(max_bytes) {
      EXPECT_EQ(cudaMalloc(&scratch_, max_bytes), cudaSuccess);
    }
    ~Rank() override { cudaFree(scratch_); }
    int rank() const override { return rank_; }
    int size() const override { return shared_->size; }

    // Every rank passes both barriers whatever fails (EXPECT, no early return), so a failing rank
    // cannot leave the others waiting.
    void all_reduce_sum(void* inout, size_t count, DType dtype, CUstream_st* stream) override {
      const size_t bytes = count * (dtype == DType::kF32 ? 4 : 2);
      const bool fits = (dtype == DType::kF32 || dtype == DType::kBF16) && bytes <= max_bytes_;
      EXPECT_TRUE(fits) << "SameDeviceGroup: " << bytes << " bytes of dtype " << dtype_name(dtype)
                        << " (scratch " << max_bytes_ << ")";
      Shared& s = *shared_;
      s.buffers[rank_] = inout;
      EXPECT_EQ(cudaEventRecord(s.ready[rank_], stream), cudaSuccess);
      s.barrier.arrive_and_wait();
      RankBuffers in{};
      for (int r = 0; r < s.size; ++r) {
        EXPECT_EQ(cudaStreamWaitEvent(stream, s.ready[r], 0), cudaSuccess);
        in.in[r] = s.buffers[r];
      }
      const int blocks = static_cast<int>(std::min<size_t>((count + 255) / 256, 1024));
      if (fits && dtype == DType::kF32)
        sum_ranks_kernel<<<blocks, 256, 0, stream>>>(in, s.size, static_cast<float*>(scratch_),
                                                     count);
      else if (fits)
        sum_ranks_kernel<<<blocks, 256, 0, stream>>>(in, s.size,
                                                     static_cast<__nv_bfloat16*>(scratch_), count);
      EXPECT_EQ(cudaGetLastError(), cudaSuccess);
      EXPECT_EQ(cudaEventRecord(s.summed[rank_], stream), cudaSuccess);
      s.barrier.arrive_and_wait();  // every rank has read s.buffers and enqueued its sum
      for (int r = 0; r < s.size; ++r)
        EXPECT_EQ(cudaStreamWaitEvent(stream, s.summed[r], 0), cudaSuccess);
      if (fits)
        EXPECT_EQ(cudaMemcpyAsync(inout, scratch_, bytes, cudaMemcpyDeviceToDevice, stream),
                  cudaSuccess);
    }

    // Every rank copies each rank's block into its recv; the second barrier keeps a rank's send
    // alive until every copy of it is enqueued behind the events.
    void all_gather(const void* send, void* recv, size_t count, DType dtype,
                    CUstream_st* stream) override {
      EXPECT_TRUE(dtype == DType::kF32 || dtype == DType::kBF16) << dtype_name(dtype);
      const size_t bytes = count * (dtype == DType::kF32 ? 4 : 2);
      Shared& s = *shared_;
      s.sends[rank_] = send;
      EXPECT_EQ(cudaEventRecord(s.ready[rank_], stream), cudaSuccess);
      s.barrier.arrive_and_wait();
      for (int r = 0; r < s.size; ++r) {
        EXPECT_EQ(cudaStreamWaitEvent(stream, s.ready[r], 0), cudaSuccess);
        EXPECT_EQ(cudaMemcpyAsync(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes,
                                  s.sends[r], bytes, cudaMemcpyDeviceToDevice, stream),
                  cudaSuccess);
      }
      EXPECT_EQ(cudaEventRecord(s.summed[rank_], stream), cudaSuccess);
      s.barrier.arrive_and_wait();
      for (int r = 0; r < s.size; ++r)
        EXPECT_EQ(cudaStreamWaitEvent(stream, s.summed[r], 0), cudaSuccess);
    }

   private:
    std::shared_ptr<Shared> shared_;
    int rank_;
    size_t max_bytes_;
    void* scratch_ = nullptr;
  };

  std::shared_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

constexpr int kDecodeSteps = 4;

// What one model produced for the batch: logits and routing per step (prefill, then decode steps)
// per item.
struct Run {
  std::vector<std::vector<std::vector<float>>> logits;  // [step][item][V]
  std::vector<std::vector<RouteMap>> routes;            // [step][item]
  std::vector<std::vector<int32_t>> tokens;             // [step][item]: greedy tokens
};

// The batch: item i with adapter slot slots[i] and prompt prompts[i]; decode steps fed with
// `feed` (the whole model's greedy tokens) or, for the whole model itself, its own.
Run run_batch(GpuModel& model, const std::vector<int32_t>& slots,
              const std::vector<std::vector<int32_t>>& prompts, const Run* feed) {
  Driver driver(model);
  driver.capture_routes(true);
  std::vector<Driver::Item> items;
  for (size_t i = 0; i < slots.size(); ++i)
    items.push_back({driver.add_sequence(slots[i]), prompts[i]});
  Run run;
  for (int step = 0; step <= kDecodeSteps; ++step) {
    Driver::Output out = driver.step(items);
    run.logits.push_back(std::move(out.logits));
    run.routes.push_back(std::move(out.routes));
    run.tokens.push_back(out.sampled);
    for (size_t i = 0; i < items.size(); ++i)
      items[i].tokens = {feed ? feed->tokens[static_cast<size_t>(step)][i] : out.sampled[i]};
  }
  return run;
}

// Two bf16 models of one fp32 model: twice the bound each keeps to it (model_gpu_driver.cuh).
struct ScopedTwoModelBound {
  double cosine = g_min_logit_cosine, fraction = g_max_diff_fraction;
  ScopedTwoModelBound() {
    g_min_logit_cosine = 1.0 - 2.0 * (1.0 - cosine);
    g_max_diff_fraction = 2.0 * fraction;
  }
  ~ScopedTwoModelBound() {
    g_min_logit_cosine = cosine;
    g_max_diff_fraction = fraction;
  }
};

void check_tensor_parallel(const std::string& fixture, const std::string& checkpoint,
                           const std::vector<std::string>& adapters, int ranks) {
  const ScopedTwoModelBound bound;
  const std::string label =
      fixture + "/" + checkpoint + " over " + std::to_string(ranks) + " ranks";
  SCOPED_TRACE(label);
  const fs::path dir = test::data_dir() / "parity" / fixture;
  io::LoadOptions load;
  load.show_progress = false;
  const io::ModelWeights weights = io::load_checkpoint(dir / checkpoint, load);
  const io::ModelConfig& config = weights.config;
  const GpuModelLimits limits = small_limits();
  GpuModelOptions options;
  options.show_progress = false;

  std::vector<io::LoraAdapter> loaded;
  for (const std::string& name : adapters)
    loaded.push_back(io::load_adapter(dir / name, config, name));
  // Each adapter on its own sequences, two base sequences beside them.
  std::vector<int32_t> slots;
  for (size_t a = 0; a < loaded.size(); ++a) slots.push_back(static_cast<int32_t>(a));
  slots.push_back(-1);
  slots.push_back(-1);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(1, static_cast<int32_t>(config.vocab_size) - 1);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < slots.size(); ++i) {
    std::vector<int32_t> p(static_cast<size_t>(kPromptTokens - static_cast<int>(i)));
    for (int32_t& t : p) t = token(rng);
    prompts.push_back(std::move(p));
  }

  std::unique_ptr<GpuModel> whole = GpuModel::load(weights, limits, options);
  for (size_t a = 0; a < loaded.size(); ++a) whole->write_slot(static_cast<int32_t>(a), loaded[a]);
  const Run want = run_batch(*whole, slots, prompts, nullptr);
  whole.reset();

  SameDeviceGroup group(ranks, static_cast<size_t>(limits.max_tokens) * config.hidden_size * 4);
  std::vector<std::unique_ptr<GpuModel>> rank_models;
  for (int r = 0; r < ranks; ++r) {
    const dist::ShardSpec shard{r, ranks};
    const io::ModelWeights share = dist::shard_checkpoint(weights, shard);
    GpuModelOptions o = options;
    o.collectives = &group.rank(r);
    rank_models.push_back(GpuModel::load(share, limits, o));
    for (size_t a = 0; a < loaded.size(); ++a)
      rank_models.back()->write_slot(static_cast<int32_t>(a),
                                     dist::shard_adapter(loaded[a], config, shard));
  }
  std::vector<Run> got(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] { got[r] = run_batch(*rank_models[r], slots, prompts, &want); });
  for (std::thread& t : threads) t.join();
  if (::testing::Test::HasFatalFailure()) return;

  int steps = 0, rerouted = 0;
  for (int step = 0; step <= kDecodeSteps; ++step) {
    for (size_t i = 0; i < slots.size(); ++i) {
      const std::string where = "step " + std::to_string(step) + " item " + std::to_string(i) +
                                " (slot " + std::to_string(slots[i]) + ")";
      const std::vector<float>& rank0 = got[0].logits[step][i];
      for (int r = 1; r < ranks; ++r) {
        ASSERT_EQ(got[r].logits[step][i].size(), rank0.size());
        EXPECT_EQ(0, std::memcmp(got[r].logits[step][i].data(), rank0.data(), rank0.size() * 4))
            << where << ": rank " << r << "'s logits differ from rank 0's";
      }
      ++steps;
      if (got[0].routes[step][i] != want.routes[step][i]) {
        ++rerouted;  // a near-tied expert flipped by the partial sums' rounding
        continue;
      }
      expect_logits_close(rank0, want.logits[step][i], where);
    }
  }
  // Routing flips follow near ties (a wrong expert range or a missing reduction reroutes nearly
  // every step).
  EXPECT_LE(rerouted * 2, steps) << rerouted << " of " << steps
                                 << " steps routed differently from the whole model";
}

TEST(Sm90_GpuModelTensorParallel, Qwen3MoeTwoAndFourRanks) {
  MOELORA_REQUIRE_SM90();
  check_tensor_parallel("qwen3_moe", "base",
                        {"lora_peft3d", "lora_per_expert", "lora_shared_outer"}, 2);
  check_tensor_parallel("qwen3_moe", "base", {"lora_per_expert"}, 4);  // KV heads on two ranks
}

TEST(Sm90_GpuModelTensorParallel, Qwen35MoeTwoRanks) {
  MOELORA_REQUIRE_SM90();
  ScopedQwen35Bound bound;
  check_tensor_parallel("qwen3_5_moe", "base", {"lora_all", "lora_linear"}, 2);
}

TEST(Sm90_GpuModelTensorParallel, DeepseekV3TwoAndFourRanks) {
  MOELORA_REQUIRE_SM90();
  check_tensor_parallel("deepseek_v3", "base",
                        {"lora_peft3d", "lora_per_expert", "lora_dense_shared"}, 2);
  check_tensor_parallel("deepseek_v3", "base", {"lora_dense_shared"}, 4);
}

TEST(Sm90_GpuModelTensorParallel, KimiLikeAndFp8ExpertsTwoRanks) {
  MOELORA_REQUIRE_SM90();
  check_tensor_parallel("kimi_like", "base", {"lora_peft3d"}, 2);
  check_tensor_parallel("fp8", "deepseek_v3_fp8", {}, 2);
}

// The options of the executor tests: a parity fixture's checkpoint, eager steps (the test group
// cannot be captured), room for two adapter slots.
runtime::GpuExecutorOptions executor_options(const fs::path& dir) {
  runtime::GpuExecutorOptions options;
  options.model_dir = dir / "base";
  options.limits = {256, 8, 2, 16};
  options.cuda_graphs = false;
  options.gpu_memory_fraction = 0.2;
  return options;
}

// The executor as a rank (GpuExecutorOptions::collectives): each rank's executor, built
// concurrently (the ranks agree on the KV pool through the group), cuts its share of the
// checkpoint and of the adapter and runs the same steps as the whole model's executor. Eager
// steps: the test group cannot be captured into a graph.
TEST(Sm90_GpuModelTensorParallel, ExecutorRanksFollowTheWholeExecutor) {
  MOELORA_REQUIRE_SM90();
  const ScopedTwoModelBound bound;
  constexpr int kRanks = 2;
  const fs::path dir = test::data_dir() / "parity" / "deepseek_v3";
  const runtime::GpuExecutorOptions options = executor_options(dir);
  std::unique_ptr<runtime::Executor> whole = runtime::make_gpu_executor(options);
  const io::ModelConfig config = whole->config();
  const io::LoraAdapter adapter = io::load_adapter(dir / "lora_per_expert", config, "per_expert");
  whole->write_slot(1, adapter);

  SameDeviceGroup group(kRanks, static_cast<size_t>(256) * config.hidden_size * 4);
  std::vector<std::unique_ptr<runtime::Executor>> ranks(kRanks);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] {
        runtime::GpuExecutorOptions o = options;
        o.collectives = &group.rank(r);
        o.shard_checkpoint = [r](const io::ModelWeights& w) {
          return dist::shard_checkpoint(w, {r, kRanks});
        };
        o.shard_config = [r](const io::ModelConfig& c) {
          return dist::rank_config(c, {r, kRanks});
        };
        ranks[r] = runtime::make_gpu_executor(o);
      });
    for (std::thread& t : threads) t.join();
  }
  ASSERT_TRUE(ranks[0] && ranks[1]);
  EXPECT_EQ(ranks[0]->kv_capacity().pages, ranks[1]->kv_capacity().pages);
  EXPECT_EQ(ranks[0]->config().num_attention_heads, config.num_attention_heads / kRanks);
  for (int r = 0; r < kRanks; ++r)
    ranks[r]->write_slot(1, dist::shard_adapter(adapter, config, {r, kRanks}));

  // Three sequences (the adapter, the base, the adapter), prefilled together, then decode steps
  // fed with the whole executor's greedy tokens.
  const std::vector<int32_t> slots = {1, -1, 1};
  std::vector<std::vector<int32_t>> tokens = {{5, 9, 14, 3, 7, 21, 8}, {11, 2, 30, 6}, {4, 4, 19}};
  std::vector<runtime::SequenceHandle> whole_seqs;
  std::vector<std::vector<runtime::SequenceHandle>> rank_seqs(kRanks);
  for (size_t i = 0; i < slots.size(); ++i) {
    whole_seqs.push_back(whole->new_sequence());
    for (int r = 0; r < kRanks; ++r) rank_seqs[r].push_back(ranks[r]->new_sequence());
  }
  int steps = 0, close = 0;
  for (int step = 0; step < 5; ++step) {
    auto batch_of = [&](const std::vector<runtime::SequenceHandle>& seqs) {
      std::vector<runtime::BatchEntry> batch;
      for (size_t i = 0; i < slots.size(); ++i) batch.push_back({seqs[i], tokens[i], slots[i]});
      return batch;
    };
    const std::vector<Tensor> want = whole->forward(batch_of(whole_seqs));
    std::vector<std::vector<Tensor>> got(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] { got[r] = ranks[r]->forward(batch_of(rank_seqs[r])); });
    for (std::thread& t : threads) t.join();
    for (size_t i = 0; i < slots.size(); ++i) {
      const std::string where = "step " + std::to_string(step) + " sequence " + std::to_string(i);
      ASSERT_EQ(got[0][i].numel(), want[i].numel()) << where;
      const std::vector<float> a(got[0][i].data<float>(),
                                 got[0][i].data<float>() + want[i].numel()),
          b(got[1][i].data<float>(), got[1][i].data<float>() + want[i].numel()),
          w(want[i].data<float>(), want[i].data<float>() + want[i].numel());
      EXPECT_EQ(a, b) << where << ": the ranks' logits differ";
      // Routing is not visible through the executor: count the steps within the bound instead
      // (a near-tied expert flipped by the partial sums moves a step out of it).
      ++steps;
      if (logits_within_bf16(expect_logits_close(a, w, where, /*strict=*/false))) ++close;
      tokens[i] = {argmax(std::span<const float>(w))};
    }
  }
  EXPECT_GE(close * 4, steps * 3) << close << " of " << steps
                                  << " steps within the bf16 bound of the whole executor";
}

// The serving path of `moelora serve --tp 2 --device cuda` on one GPU: rank 0's ShardedExecutor
// and a worker thread running run_sharded_worker, joined by a SocketGroup over localhost for the
// commands, each holding a GpuRankModel whose collectives are the test group (NCCL's place). An
// adapter written through rank 0 (each rank loads it from its folder and cuts its share), then
// prefill and decode steps: rank 0's logits against the whole executor's.
TEST(Sm90_GpuModelTensorParallel, ShardedExecutorOverGpuRanks) {
  MOELORA_REQUIRE_SM90();
  const ScopedTwoModelBound bound;
  constexpr int kRanks = 2;
  const fs::path dir = test::data_dir() / "parity" / "qwen3_moe";
  const runtime::GpuExecutorOptions options = executor_options(dir);
  std::unique_ptr<runtime::Executor> whole = runtime::make_gpu_executor(options);
  const io::ModelConfig config = whole->config();
  const io::LoraAdapter adapter = io::load_adapter(dir / "lora_peft3d", config, "peft3d");
  whole->write_slot(0, adapter);

  SameDeviceGroup devices(kRanks, static_cast<size_t>(256) * config.hidden_size * 4);
  const std::chrono::milliseconds timeout(60000);
  dist::Listener listener = dist::Listener::bind({"127.0.0.1", 0});
  const int port = listener.port();
  std::vector<std::string> errors(kRanks);
  std::vector<std::vector<std::vector<float>>> got;  // [step][sequence][V], rank 0's
  std::vector<std::vector<int32_t>> fed;             // [step][sequence]: tokens fed after it
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        dist::SocketGroupOptions o;
        o.rank = r;
        o.size = kRanks;
        o.address = {"127.0.0.1", port};
        o.listen_fd = r == 0 ? dup(listener.fd()) : -1;
        o.join_timeout = timeout;
        o.collective_timeout = timeout;
        std::unique_ptr<dist::SocketGroup> group = dist::SocketGroup::join(o);
        auto make = [&] {
          return std::make_unique<dist::GpuRankModel>(options, devices.rank(r),
                                                      dist::ShardSpec{r, kRanks});
        };
        if (r != 0) {
          dist::run_sharded_worker([&]() -> std::unique_ptr<dist::RankModel> { return make(); },
                                   *group);
          return;
        }
        dist::ShardedExecutor ex(make(), std::move(group), options.limits, timeout);
        EXPECT_EQ(ex.kv_capacity().pages, whole->kv_capacity().pages);
        EXPECT_EQ(ex.config().num_attention_heads, config.num_attention_heads);  // the whole's
        ex.write_slot(0, adapter);
        const std::vector<int32_t> slots = {0, -1};
        std::vector<std::vector<int32_t>> tokens = {{5, 9, 14, 3, 7}, {11, 2, 30}};
        const std::vector<runtime::SequenceHandle> seqs = {ex.new_sequence(), ex.new_sequence()};
        for (int step = 0; step < 4; ++step) {
          std::vector<runtime::BatchEntry> batch;
          for (size_t i = 0; i < seqs.size(); ++i) batch.push_back({seqs[i], tokens[i], slots[i]});
          const std::vector<Tensor> logits = ex.forward(batch);
          got.emplace_back();
          fed.emplace_back();
          for (size_t i = 0; i < seqs.size(); ++i) {
            got.back().emplace_back(logits[i].data<float>(),
                                    logits[i].data<float>() + logits[i].numel());
            tokens[i] = {argmax(std::span<const float>(got.back().back()))};
            fed.back().push_back(tokens[i][0]);
          }
        }
        // The engine's path: tokens sampled on rank 0's device, the workers stepping alike.
        std::vector<runtime::BatchEntry> batch;
        for (size_t i = 0; i < seqs.size(); ++i) batch.push_back({seqs[i], tokens[i], slots[i]});
        const std::vector<ops::SampleRowParams> greedy(seqs.size());
        const std::vector<float> uniforms(seqs.size(), 0.5f);
        const std::vector<int32_t> sampled = ex.forward_sample(batch, greedy, uniforms);
        const std::vector<size_t> rows = {0, 1};
        const std::vector<Tensor> last = ex.last_logits(rows);
        for (size_t i = 0; i < seqs.size(); ++i)
          EXPECT_EQ(sampled[i], argmax(std::span<const float>(
                                    last[i].data<float>(), static_cast<size_t>(last[i].numel()))))
              << "sequence " << i << ": the device's greedy token is not its logits' argmax";
        for (runtime::SequenceHandle h : seqs) ex.free_sequence(h);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  ASSERT_EQ(got.size(), 4u);

  // The whole executor fed the same tokens (rank 0's greedy ones).
  const std::vector<int32_t> slots = {0, -1};
  std::vector<std::vector<int32_t>> tokens = {{5, 9, 14, 3, 7}, {11, 2, 30}};
  const std::vector<runtime::SequenceHandle> seqs = {whole->new_sequence(), whole->new_sequence()};
  int steps = 0, close = 0;
  for (int step = 0; step < 4; ++step) {
    std::vector<runtime::BatchEntry> batch;
    for (size_t i = 0; i < seqs.size(); ++i) batch.push_back({seqs[i], tokens[i], slots[i]});
    const std::vector<Tensor> want = whole->forward(batch);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const std::vector<float> w(want[i].data<float>(), want[i].data<float>() + want[i].numel());
      ++steps;
      if (logits_within_bf16(expect_logits_close(
              got[step][i], w, "step " + std::to_string(step) + " sequence " + std::to_string(i),
              /*strict=*/false)))
        ++close;
      tokens[i] = {fed[step][i]};
    }
  }
  EXPECT_GE(close * 4, steps * 3) << close << " of " << steps
                                  << " steps within the bf16 bound of the whole executor";
}

TEST(Sm90_GpuModelTensorParallel, ShareWithTheWrongExpertCountIsRefused) {
  MOELORA_REQUIRE_SM90();
  io::LoadOptions load;
  load.show_progress = false;
  const io::ModelWeights weights =
      io::load_checkpoint(test::data_dir() / "parity" / "qwen3_moe" / "base", load);
  SameDeviceGroup group(4, 1024);
  GpuModelOptions o;
  o.show_progress = false;
  o.collectives = &group.rank(1);
  // Rank 1 of 4 given the share cut for 2 ranks: its vocabulary rows are refused first (256
  // where a rank of 4 holds 128 of the 512) ...
  io::ModelWeights share = dist::shard_checkpoint(weights, {1, 2});
  std::string message = test::error_message([&] { GpuModel::load(share, small_limits(), o); },
                                            ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("embed_tokens (this rank's vocabulary rows): expected shape [128, "),
            std::string::npos)
      << message;
  // ... and with the right rows, its 4 experts where 2 are expected.
  const io::ModelWeights right_vocabulary = dist::shard_checkpoint(weights, {1, 4});
  share.embed_tokens = right_vocabulary.embed_tokens;
  share.lm_head = right_vocabulary.lm_head;
  message = test::error_message([&] { GpuModel::load(share, small_limits(), o); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("rank 1 of 4 holds 4 routed experts of 8"), std::string::npos) << message;
}

}  // namespace
}  // namespace moelora::model
