// DistShardedExecutor: the serving runtime's backend over processes (dist/sharded_executor.h):
// rank 0's ShardedExecutor and run_sharded_worker on the other ranks, joined by a SocketGroup
// over 127.0.0.1 (threads playing the processes), driven through one script of executor calls
// that a serving engine makes (adapter slots written and cleared, prompts of mixed adapters,
// decode steps, sequences freed between steps), against the CpuExecutor on the same parity
// fixtures: every step's logits within float reassociation. Qwen3-MoE (tensor-parallel
// attention, 2 and 4 ranks), DeepSeek-V3 MLA (2 ranks, data-parallel attention, the MoE tokens
// all-reduced or dispatched) and Qwen3.5-MoE (2 ranks). Also: an adapter a worker cannot read is
// refused naming the rank, with the slot left empty on every rank (an occupied one too) and the
// group still serving; an adapter without a folder is refused; bad batches are refused before
// any rank sees them; a lost worker breaks the executor with the cause.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <thread>

#include "core/error.h"
#include "dist/sharded_executor.h"
#include "dist/socket_group.h"
#include "io/peft.h"
#include "runtime/cpu_executor.h"
#include "support/test_support.h"

namespace moelora::dist {
namespace {

namespace fs = std::filesystem;
using runtime::BatchEntry;
using runtime::Executor;
using runtime::SequenceHandle;

constexpr float kAtol = 2e-4f, kRtol = 2e-4f;
constexpr std::chrono::milliseconds kTestTimeout{30000};
const runtime::ExecutorLimits kLimits{64, 4, 2, 16};

fs::path fixture(const std::string& model) {
  return test::data_dir() / "parity" / model;
}

std::unique_ptr<model::Model> load_quiet(const fs::path& dir) {
  model::ModelOptions o;
  o.show_progress = false;
  return std::make_unique<model::Model>(model::Model::load(dir, o));
}

int32_t argmax(const Tensor& logits) {
  const float* p = logits.data<float>();
  return static_cast<int32_t>(std::max_element(p, p + logits.numel()) - p);
}

// What an engine does over a few steps: two adapters into slots 0 and 1, three prompts of mixed
// adapters in one forward, greedy decode steps for all, one sequence freed half-way and a new
// prompt joining, then both slots cleared and slot 1 written with slot 0's adapter. Returns every
// forward's logits in order. Decode steps feed chosen[k], forward k's greedy tokens, recorded on
// the reference executor (record_choices) and replayed on the other, so both see the same tokens.
std::vector<Tensor> run_script(Executor& ex, const std::vector<io::LoraAdapter>& adapters,
                               std::vector<std::vector<int32_t>>& chosen, bool record_choices) {
  std::vector<Tensor> all;
  ex.write_slot(0, adapters[0]);
  ex.write_slot(1, adapters[1]);
  const std::vector<int32_t> p0 = {3, 17, 5, 9, 11, 2, 40}, p1 = {8, 1, 12, 30, 4},
                             p2 = {21, 6, 6, 13, 7, 19, 2, 5, 33};
  const SequenceHandle a = ex.new_sequence(), b = ex.new_sequence(), c = ex.new_sequence();
  size_t steps = 0;  // forwards so far; chosen[k] holds forward k's greedy tokens
  auto step = [&](std::vector<BatchEntry> batch) {
    ++steps;
    std::vector<Tensor> logits = ex.forward(batch);
    if (record_choices) {
      std::vector<int32_t> picks;
      for (const Tensor& l : logits) picks.push_back(argmax(l));
      chosen.push_back(picks);
    }
    for (Tensor& l : logits) all.push_back(std::move(l));
  };
  step({{a, p0, 0}, {b, p1, -1}, {c, p2, 1}});
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t>& prev = chosen[steps - 1];
    const std::vector<int32_t> ta = {prev[0]}, tb = {prev[1]}, tc = {prev[2]};
    step({{a, ta, 0}, {b, tb, -1}, {c, tc, 1}});
  }
  ex.free_sequence(b);
  const SequenceHandle d = ex.new_sequence();
  const std::vector<int32_t> p3 = {14, 15, 16};
  const std::vector<int32_t> ta = {chosen[steps - 1][0]}, tc = {chosen[steps - 1][2]};
  step({{d, p3, -1}, {a, ta, 0}, {c, tc, 1}});
  ex.free_sequence(c);
  ex.free_sequence(a);
  ex.clear_slot(0);
  ex.clear_slot(1);
  ex.write_slot(1, adapters[0]);  // slot 1 now holds the other adapter
  const SequenceHandle e = ex.new_sequence();
  const std::vector<int32_t> p4 = {5, 4, 3, 2, 1};
  const std::vector<int32_t> td = {chosen[steps - 1][0]};
  step({{e, p4, 1}, {d, td, -1}});
  return all;
}

// Joins `ranks` threads into a SocketGroup; rank 0 runs `rank0` with its ShardedExecutor, the
// others run_sharded_worker. Returns each rank's error ("" when none).
std::vector<std::string> run_sharded(const fs::path& base, int ranks,
                                     const ShardedModelOptions& options,
                                     const std::function<void(ShardedExecutor&)>& rank0) {
  Listener listener = Listener::bind({"127.0.0.1", 0});
  const int port = listener.port();
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        SocketGroupOptions o;
        o.rank = r;
        o.size = ranks;
        o.address = {"127.0.0.1", port};
        o.listen_fd = r == 0 ? dup(listener.fd()) : -1;
        o.join_timeout = kTestTimeout;
        o.collective_timeout = kTestTimeout;
        std::unique_ptr<SocketGroup> group = SocketGroup::join(o);
        if (r == 0) {
          ShardedExecutor ex(load_quiet(base), std::move(group), kLimits, options, kTestTimeout);
          rank0(ex);
        } else {
          run_sharded_worker(load_quiet(base), *group, kLimits, options);
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

// kv_copies: how many copies of each KV head the ranks hold together (2 when 4 ranks share a
// model's 2 KV heads, each holding the one of its query heads; 1 when the heads divide).
void expect_script_matches_cpu(const std::string& name, const std::string& adapter0,
                               const std::string& adapter1, int ranks,
                               const ShardedModelOptions& options, int kv_copies = 1) {
  const fs::path base = fixture(name) / "base";
  std::unique_ptr<model::Model> reference_model = load_quiet(base);
  const io::ModelConfig config = reference_model->config();
  const std::vector<io::LoraAdapter> adapters = {
      io::load_adapter(fixture(name) / adapter0, config, adapter0),
      io::load_adapter(fixture(name) / adapter1, config, adapter1)};
  runtime::CpuExecutor cpu(std::move(*reference_model), kLimits);
  std::vector<std::vector<int32_t>> chosen;
  const std::vector<Tensor> expected = run_script(cpu, adapters, chosen, true);
  const uint64_t cpu_cache = cpu.cache_bytes(), cpu_state = cpu.state_bytes();

  std::vector<Tensor> got;
  const std::vector<std::string> errors =
      run_sharded(base, ranks, options, [&](ShardedExecutor& ex) {
        std::vector<std::vector<int32_t>> replay = chosen;
        got = run_script(ex, adapters, replay, false);
        EXPECT_EQ(ex.live_sequences(), 2);
        // The job's caches over all ranks, as the single executor holds them (the KV heads that
        // several ranks hold counted on each), and the Gated DeltaNet states (Qwen3.5 only).
        EXPECT_GT(cpu_cache, 0u);
        EXPECT_EQ(ex.cache_bytes(), cpu_cache * static_cast<uint64_t>(kv_copies));
        EXPECT_EQ(ex.state_bytes(), cpu_state);
        EXPECT_EQ(ex.state_bytes() > 0, name == "qwen3_5_moe");
      });
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(test::all_close(got[i], expected[i], kAtol, kRtol)) << "logits " << i;
}

TEST(DistShardedExecutor, Qwen3MoeScriptEqualsTheCpuExecutor) {
  expect_script_matches_cpu("qwen3_moe", "lora_peft3d", "lora_per_expert", 2, {});
  expect_script_matches_cpu("qwen3_moe", "lora_peft3d", "lora_shared_outer", 4, {},
                            /*kv_copies=*/2);
}

TEST(DistShardedExecutor, DeepSeekV3WithDataParallelAttentionEqualsTheCpuExecutor) {
  ShardedModelOptions options;
  options.attention = AttentionSplit::kDataParallel;
  expect_script_matches_cpu("deepseek_v3", "lora_peft3d", "lora_dense_shared", 2, options);
  // The MoE tokens dispatched to the experts' ranks instead of all-reduced everywhere.
  options.moe_combine = MoeCombine::kDispatch;
  options.shared_expert = SharedExpertSplit::kReplicated;
  expect_script_matches_cpu("deepseek_v3", "lora_peft3d", "lora_dense_shared", 2, options);
}

TEST(DistShardedExecutor, Qwen35ScriptEqualsTheCpuExecutor) {
  expect_script_matches_cpu("qwen3_5_moe", "lora_all", "lora_linear", 2, {});
}

TEST(DistShardedExecutor, AnAdapterAWorkerCannotReadIsRefusedNamingTheRank) {
  const fs::path base = fixture("qwen3_moe") / "base";
  const io::ModelConfig config = load_quiet(base)->config();
  test::TempDir tmp;
  fs::copy(fixture("qwen3_moe") / "lora_peft3d", tmp / "gone");
  // Rank 0 has the adapter in memory; its folder is removed before the workers read it.
  const io::LoraAdapter vanished = io::load_adapter(tmp / "gone", config, "gone");
  fs::remove_all(tmp / "gone");
  io::LoraAdapter no_folder = vanished;
  no_folder.dir.clear();
  const std::vector<int32_t> prompt = {3, 17, 5, 9};
  runtime::CpuExecutor cpu(std::move(*load_quiet(base)), kLimits);
  const Tensor expected = cpu.forward(std::vector<BatchEntry>{{cpu.new_sequence(), prompt, -1}})[0];
  std::string refused, unsupported, empty_slot;
  Tensor after;
  const std::vector<std::string> errors = run_sharded(base, 2, {}, [&](ShardedExecutor& ex) {
    refused = test::error_message([&] { ex.write_slot(0, vanished); });
    unsupported =
        test::error_message([&] { ex.check_adapter(no_folder); }, ErrorCode::kUnsupported);
    // The slot stayed empty, and the group still serves.
    const SequenceHandle s = ex.new_sequence();
    empty_slot = test::error_message(
        [&] {
          ex.forward(std::vector<BatchEntry>{{s, prompt, 0}});
        },
        ErrorCode::kInternal);
    after = ex.forward(std::vector<BatchEntry>{{s, prompt, -1}})[0];
  });
  EXPECT_NE(refused.find("adapter 'gone' could not be loaded on every rank: rank 1: "),
            std::string::npos)
      << refused;
  EXPECT_NE(unsupported.find("adapter 'gone' has no folder"), std::string::npos) << unsupported;
  EXPECT_NE(empty_slot.find("runs on adapter slot 0, which is empty"), std::string::npos)
      << empty_slot;
  EXPECT_TRUE(test::all_close(after, expected, kAtol, kRtol));
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

// A load that fails into a slot that held another adapter: the slot is emptied on every rank
// (rank 0 included, so no rank keeps the old adapter there), and a later load into it serves the
// new adapter on every rank.
TEST(DistShardedExecutor, AFailedLoadIntoAnOccupiedSlotEmptiesItOnEveryRank) {
  const fs::path base = fixture("qwen3_moe") / "base";
  const io::ModelConfig config = load_quiet(base)->config();
  test::TempDir tmp;
  fs::copy(fixture("qwen3_moe") / "lora_per_expert", tmp / "gone");
  const io::LoraAdapter vanished = io::load_adapter(tmp / "gone", config, "gone");
  fs::remove_all(tmp / "gone");
  const io::LoraAdapter first =
      io::load_adapter(fixture("qwen3_moe") / "lora_peft3d", config, "first");
  const io::LoraAdapter second =
      io::load_adapter(fixture("qwen3_moe") / "lora_shared_outer", config, "second");
  const std::vector<int32_t> prompt = {3, 17, 5, 9};
  runtime::CpuExecutor cpu(std::move(*load_quiet(base)), kLimits);
  cpu.write_slot(0, second);
  const Tensor expected = cpu.forward(std::vector<BatchEntry>{{cpu.new_sequence(), prompt, 0}})[0];
  std::string refused, empty_slot;
  Tensor got;
  const std::vector<std::string> errors = run_sharded(base, 2, {}, [&](ShardedExecutor& ex) {
    ex.write_slot(0, first);
    refused = test::error_message([&] { ex.write_slot(0, vanished); });
    const SequenceHandle a = ex.new_sequence();
    empty_slot = test::error_message(
        [&] {
          ex.forward(std::vector<BatchEntry>{{a, prompt, 0}});
        },
        ErrorCode::kInternal);
    ex.write_slot(0, second);
    got = ex.forward(std::vector<BatchEntry>{{a, prompt, 0}})[0];
    EXPECT_EQ(ex.broken_reason(), "");
  });
  EXPECT_NE(refused.find("could not be loaded on every rank: rank 1: "), std::string::npos)
      << refused;
  EXPECT_NE(empty_slot.find("runs on adapter slot 0, which is empty"), std::string::npos)
      << empty_slot;
  EXPECT_TRUE(test::all_close(got, expected, kAtol, kRtol));
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

// Bad arguments are refused on rank 0 before any rank sees them, so the group keeps serving.
TEST(DistShardedExecutor, BadBatchesAreRefusedBeforeTheRanksSeeThem) {
  const fs::path base = fixture("qwen3_moe") / "base";
  std::vector<std::string> messages;
  const std::vector<std::string> errors = run_sharded(base, 2, {}, [&](ShardedExecutor& ex) {
    const SequenceHandle a = ex.new_sequence();
    const std::vector<int32_t> good = {1, 2}, bad = {1, 1 << 20}, none = {};
    messages.push_back(test::error_message(
        [&] {
          ex.forward(std::vector<BatchEntry>{{a, bad, -1}});
        },
        ErrorCode::kInvalidArgument));
    messages.push_back(test::error_message(
        [&] {
          ex.forward(std::vector<BatchEntry>{{a, none, -1}});
        },
        ErrorCode::kInternal));
    messages.push_back(test::error_message(
        [&] {
          ex.forward(std::vector<BatchEntry>{{a, good, 5}});
        },
        ErrorCode::kInternal));
    ex.forward(std::vector<BatchEntry>{{a, good, -1}});
    EXPECT_EQ(ex.broken_reason(), "");
  });
  ASSERT_EQ(messages.size(), 3u);
  EXPECT_NE(messages[0].find("token id 1048576 is out of range for the vocabulary of"),
            std::string::npos)
      << messages[0];
  EXPECT_NE(messages[1].find("has no tokens in this forward"), std::string::npos) << messages[1];
  EXPECT_NE(messages[2].find("runs on adapter slot 5, not -1 (base) or one of the 2 slots"),
            std::string::npos)
      << messages[2];
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

// A worker that goes away (its process died): the next forward fails naming it, or, while the
// engine is idle, the health check between steps notices it first; either way the executor
// reports itself broken with the cause, which stops the engine (Engine.ABrokenBackendStops...).
TEST(DistShardedExecutor, ALostWorkerBreaksTheExecutor) {
  for (const bool idle_check : {false, true}) {
    SCOPED_TRACE(idle_check ? "noticed between steps" : "noticed by a forward");
    const fs::path base = fixture("qwen3_moe") / "base";
    Listener listener = Listener::bind({"127.0.0.1", 0});
    const int port = listener.port();
    std::string failed, reason;
    std::thread worker([&] {
      SocketGroupOptions o;
      o.rank = 1;
      o.size = 2;
      o.address = {"127.0.0.1", port};
      o.join_timeout = kTestTimeout;
      auto group = SocketGroup::join(o);
      group->send_reply("");  // "my share is cut", then the process is gone
    });
    {
      SocketGroupOptions o;
      o.size = 2;
      o.listen_fd = dup(listener.fd());
      o.join_timeout = kTestTimeout;
      o.collective_timeout = kTestTimeout;
      ShardedExecutor ex(load_quiet(base), SocketGroup::join(o), kLimits, {}, kTestTimeout);
      worker.join();
      if (idle_check) {
        ex.check_health();  // nothing to notice while rank 1 is connected: returns at once
        for (int i = 0; i < 100 && ex.broken_reason().empty(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          ex.check_health();
        }
        EXPECT_NE(ex.broken_reason(), "") << "the lost worker was not noticed between steps";
      }
      const SequenceHandle a = ex.new_sequence();
      const std::vector<int32_t> prompt = {1, 2, 3};
      failed = test::error_message([&] { ex.forward(std::vector<BatchEntry>{{a, prompt, -1}}); });
      reason = ex.broken_reason();
    }
    EXPECT_NE(failed.find("rank 1"), std::string::npos) << failed;
    EXPECT_NE(reason.find("rank 1"), std::string::npos) << reason;
  }
}

}  // namespace
}  // namespace moelora::dist
