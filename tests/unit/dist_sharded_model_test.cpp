// A whole model sharded over ranks (dist/sharded_model.h) against the CPU model on the parity
// fixtures and their PEFT adapters of every layout: the logits of every position of a prompt, on
// every rank, equal model::Model's up to float reassociation, for 1, 2 and 4 ranks and both MoE
// combines. Qwen3-MoE (GQA; 4 ranks: one query head each, the 2 KV heads held by two ranks each),
// DeepSeek-V3 (MLA with query and KV latents, grouped routing, a dense first layer and a shared
// expert; 4 ranks: one head each) and Qwen3.5-MoE (Gated DeltaNet and gated attention; 2 ranks).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "dist/sharded_model.h"
#include "io/peft.h"
#include "model/model.h"
#include "support/test_support.h"

namespace moelora::dist {
namespace {

namespace fs = std::filesystem;

fs::path fixture(const std::string& model) {
  return test::data_dir() / "parity" / model;
}

model::Model load_quiet(const fs::path& dir) {
  model::ModelOptions o;
  o.show_progress = false;
  return model::Model::load(dir, o);
}

// Logits of several fp32 layers whose partial sums are added across ranks.
constexpr float kAtol = 2e-4f, kRtol = 2e-4f;

// The fixture `name` with `adapters` loaded: every slot's logits of one random prompt, sharded
// over every configuration, against model::Model's.
void expect_sharded_logits_match(const std::string& name, const std::vector<std::string>& adapters,
                                 uint64_t seed, int max_ranks = 4) {
  model::Model model = load_quiet(fixture(name) / "base");
  for (const std::string& a : adapters) model.load_adapter(a, fixture(name) / a);
  std::mt19937_64 rng(test::test_seed(seed));
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(model.vocab_size()) - 1);
  std::vector<int32_t> prompt(11);
  for (int32_t& t : prompt) t = id(rng);

  std::vector<Tensor> expected;  // per slot -1, 0, 1, 2
  for (int32_t slot = -1; slot < static_cast<int32_t>(adapters.size()); ++slot) {
    model::Sequence seq = model.new_sequence(slot);
    expected.push_back(model.forward(seq, prompt));
  }
  for (size_t s = 1; s < expected.size(); ++s)
    ASSERT_GT(test::max_abs_diff(expected[s], expected[0]), 1e-3)
        << "adapter " << s - 1 << " changes nothing";

  struct Config {
    int ranks;
    ShardedModelOptions options;
  };
  const std::vector<Config> configs = {
      {1, {}},
      {2, {}},
      {4, {}},
      {2, {MoeCombine::kPartialSums, SharedExpertSplit::kTensorParallel}},
      {4, {MoeCombine::kPartialSums, SharedExpertSplit::kReplicated}},
  };
  for (const Config& c : configs) {
    if (c.ranks > max_ranks) continue;
    std::vector<std::vector<Tensor>> logits(static_cast<size_t>(c.ranks));
    run_ranks(c.ranks, [&](Communicator& comm) {
      const ShardedModel sharded(model, {comm.rank(), comm.size()}, c.options);
      for (int32_t slot = -1; slot < static_cast<int32_t>(adapters.size()); ++slot)
        logits[static_cast<size_t>(comm.rank())].push_back(
            sharded.prefill_logits(prompt, slot, comm));
    });
    for (int r = 0; r < c.ranks; ++r) {
      for (size_t s = 0; s < expected.size(); ++s) {
        const Tensor& got = logits[static_cast<size_t>(r)][s];
        const std::string label =
            std::to_string(c.ranks) + " ranks (" +
            (c.options.moe_combine == MoeCombine::kPairRows ? "pair rows" : "partial sums") +
            "), rank " + std::to_string(r) + ", slot " + std::to_string(int(s) - 1);
        EXPECT_TRUE(test::all_close(got, expected[s], kAtol, kRtol)) << label;
        EXPECT_EQ(std::memcmp(got.raw_data(), logits[0][s].raw_data(), got.nbytes()), 0)
            << label << ": differs from rank 0";
      }
    }
  }
}

TEST(DistShardedModel, QwenLogitsEqualTheCpuModelWithEveryAdapterLayout) {
  expect_sharded_logits_match("qwen3_moe", {"lora_peft3d", "lora_shared_outer", "lora_per_expert"},
                              521);
}

// Adapters on the MLA projections (the replicated q_a / kv_a latents' and the split q_b / kv_b /
// o_proj), the routed experts in both layouts, the dense first layer and the shared expert.
TEST(DistShardedModel, DeepSeekV3MlaLogitsEqualTheCpuModelWithEveryAdapterLayout) {
  expect_sharded_logits_match("deepseek_v3", {"lora_peft3d", "lora_per_expert", "lora_dense_shared"},
                              523);
}

// Gated DeltaNet layers (adapters on in_proj_qkv / z / b / a and out_proj), gated full attention
// with partial RoPE and (1 + w) norms, the sigmoid-gated shared expert.
TEST(DistShardedModel, Qwen35LogitsEqualTheCpuModelWithEveryAdapterLayout) {
  // 2 linear key heads: at most 2 ranks
  expect_sharded_logits_match("qwen3_5_moe", {"lora_all", "lora_linear"}, 525, 2);
}

// One sharded configuration: ranks, the attention split, and whether the MoE dispatches each
// rank's tokens to the experts' ranks (data-parallel attention only; the shared expert then
// replicated).
struct Split {
  int ranks;
  AttentionSplit attention;
  bool dispatch = false;
  ShardedModelOptions options() const {
    ShardedModelOptions o;
    o.attention = attention;
    if (dispatch) {
      o.moe_combine = MoeCombine::kDispatch;
      o.shared_expert = SharedExpertSplit::kReplicated;
    }
    return o;
  }
  std::string label() const {
    return std::to_string(ranks) + " ranks, " +
           (attention == AttentionSplit::kDataParallel ? "data" : "tensor") +
           "-parallel attention" + (dispatch ? ", token dispatch" : "");
  }
};

// A batch of prompts of different lengths and adapters (one base) through one forward: the
// logits of each prompt equal model::Model's of that prompt alone, with the attention tensor
// parallel and data parallel (each prompt attended on its own rank, the MoE over the whole
// batch), on ranks the heads could not be split over too.
void expect_batch_logits_match(const std::string& name, const std::vector<std::string>& adapters,
                               uint64_t seed, const std::vector<Split>& runs) {
  model::Model model = load_quiet(fixture(name) / "base");
  for (const std::string& a : adapters) model.load_adapter(a, fixture(name) / a);
  std::mt19937_64 rng(test::test_seed(seed));
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(model.vocab_size()) - 1);
  const std::vector<size_t> lengths = {7, 3, 10, 5, 1};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int32_t> slots;
  std::vector<Tensor> expected;
  for (size_t i = 0; i < lengths.size(); ++i) {
    prompts.emplace_back(lengths[i]);
    for (int32_t& t : prompts.back()) t = id(rng);
    slots.push_back(static_cast<int32_t>(i % (adapters.size() + 1)) - 1);
    model::Sequence seq = model.new_sequence(slots.back());
    expected.push_back(model.forward(seq, prompts.back()));
  }
  for (const Split& run : runs) {
    const int ranks = run.ranks;
    std::vector<std::vector<Tensor>> logits(static_cast<size_t>(ranks));
    run_ranks(ranks, [&](Communicator& comm) {
      const ShardedModel sharded(model, {comm.rank(), comm.size()}, run.options());
      logits[static_cast<size_t>(comm.rank())] = sharded.prefill_batch_logits(prompts, slots, comm);
    });
    for (int r = 0; r < ranks; ++r)
      for (size_t i = 0; i < prompts.size(); ++i) {
        const Tensor& got = logits[static_cast<size_t>(r)][i];
        const std::string label =
            run.label() + ", rank " + std::to_string(r) + ", prompt " + std::to_string(i);
        EXPECT_TRUE(test::all_close(got, expected[i], kAtol, kRtol)) << label;
        EXPECT_EQ(std::memcmp(got.raw_data(), logits[0][i].raw_data(), got.nbytes()), 0)
            << label << ": differs from rank 0";
      }
  }
}

TEST(DistShardedModel, BatchWithDataOrTensorParallelAttentionEqualsTheCpuModel) {
  {
    SCOPED_TRACE("qwen3_moe");
    expect_batch_logits_match("qwen3_moe", {"lora_peft3d", "lora_per_expert"}, 527,
                              {{2, AttentionSplit::kTensorParallel},
                               {2, AttentionSplit::kDataParallel},
                               {4, AttentionSplit::kDataParallel},
                               {2, AttentionSplit::kDataParallel, true},
                               {4, AttentionSplit::kDataParallel, true}});
  }
  {
    // 2 linear-attention key heads: tensor parallel up to 2 ranks, data parallel on 4 (and 8:
    // more ranks than prompts, some attend nothing).
    SCOPED_TRACE("qwen3_5_moe");
    expect_batch_logits_match("qwen3_5_moe", {"lora_all"}, 529,
                              {{2, AttentionSplit::kTensorParallel},
                               {4, AttentionSplit::kDataParallel},
                               {8, AttentionSplit::kDataParallel},
                               {8, AttentionSplit::kDataParallel, true}});
  }
  {
    SCOPED_TRACE("deepseek_v3");
    expect_batch_logits_match(
        "deepseek_v3", {"lora_peft3d"}, 531,
        {{4, AttentionSplit::kDataParallel}, {4, AttentionSplit::kDataParallel, true}});
  }
}

// The index of the largest value of the last row of logits [T, V].
int32_t greedy_token(const Tensor& logits) {
  const int64_t v = logits.dim(1);
  const float* row = logits.data<float>() + (logits.dim(0) - 1) * v;
  return static_cast<int32_t>(std::max_element(row, row + v) - row);
}

// Decoding through the per-rank caches: two sequences (an adapter and the base; prompts of 6 and 3
// tokens) prefilled in one batch, then five steps of one token each for both, fed the CPU model's
// greedy tokens; every step's logits equal the CPU model's continuing each sequence alone, and the
// sharded model's own greedy picks are the same tokens.
void expect_decode_matches(const std::string& name, const std::string& adapter, uint64_t seed,
                           const std::vector<Split>& runs) {
  model::Model model = load_quiet(fixture(name) / "base");
  model.load_adapter(adapter, fixture(name) / adapter);
  std::mt19937_64 rng(test::test_seed(seed));
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(model.vocab_size()) - 1);
  const std::vector<int32_t> slots = {0, -1};
  std::vector<std::vector<int32_t>> prompts = {std::vector<int32_t>(6), std::vector<int32_t>(3)};
  for (auto& p : prompts)
    for (int32_t& t : p) t = id(rng);
  constexpr int kSteps = 5;
  // expected[i][0] = the prompt's logits, expected[i][s] = step s's; fed[i][s - 1] = the tokens of
  // step s: one greedy token, and in a last step two tokens for the first sequence (a multi-token
  // continuation beside the other's one-token step).
  std::vector<std::vector<Tensor>> expected(2);
  std::vector<std::vector<std::vector<int32_t>>> fed(2);
  for (size_t i = 0; i < 2; ++i) {
    model::Sequence seq = model.new_sequence(slots[i]);
    expected[i].push_back(model.forward(seq, prompts[i]));
    for (int step = 1; step <= kSteps + 1; ++step) {
      fed[i].push_back({greedy_token(expected[i].back())});
      if (step == kSteps + 1 && i == 0) fed[i].back().push_back(id(rng));
      expected[i].push_back(model.forward(seq, fed[i].back()));
    }
  }
  for (const Split& run : runs) {
    const int ranks = run.ranks;
    const std::string label = run.label();
    std::vector<std::vector<std::vector<Tensor>>> got(static_cast<size_t>(ranks));
    run_ranks(ranks, [&](Communicator& comm) {
      const ShardedModel sharded(model, {comm.rank(), comm.size()}, run.options());
      ShardedSequence a = sharded.new_sequence(slots[0], 0);
      ShardedSequence b = sharded.new_sequence(slots[1], comm.size() - 1);
      auto& mine = got[static_cast<size_t>(comm.rank())];
      mine.push_back(sharded.forward({&a, &b}, prompts, comm));
      for (int step = 0; step <= kSteps; ++step)
        mine.push_back(sharded.forward({&a, &b}, {fed[0][step], fed[1][step]}, comm));
      EXPECT_EQ(a.length(), 6 + kSteps + 2);
      EXPECT_EQ(b.length(), 3 + kSteps + 1);
    });
    for (int r = 0; r < ranks; ++r)
      for (int step = 0; step <= kSteps + 1; ++step)
        for (size_t i = 0; i < 2; ++i) {
          const auto at = static_cast<size_t>(step);
          const Tensor& logits = got[static_cast<size_t>(r)][at][i];
          const std::string where = label + ", rank " + std::to_string(r) + ", sequence " +
                                    std::to_string(i) + ", step " + std::to_string(step);
          EXPECT_TRUE(test::all_close(logits, expected[i][at], kAtol, kRtol)) << where;
          EXPECT_EQ(std::memcmp(logits.raw_data(), got[0][at][i].raw_data(), logits.nbytes()), 0)
              << where << ": differs from rank 0";
          if (step <= kSteps) {
            EXPECT_EQ(greedy_token(logits), fed[i][at].front()) << where;
          }
        }
  }
}

TEST(DistShardedModel, DecodeStepsThroughTheCachesEqualTheCpuModel) {
  {
    SCOPED_TRACE("qwen3_moe");
    expect_decode_matches("qwen3_moe", "lora_per_expert", 533,
                          {{2, AttentionSplit::kTensorParallel},
                           {4, AttentionSplit::kDataParallel},
                           {2, AttentionSplit::kDataParallel, true}});
  }
  {
    SCOPED_TRACE("qwen3_5_moe: Gated DeltaNet state and gated attention's KV");
    expect_decode_matches("qwen3_5_moe", "lora_all", 535,
                          {{2, AttentionSplit::kTensorParallel},
                           {4, AttentionSplit::kDataParallel},
                           {4, AttentionSplit::kDataParallel, true}});
  }
  {
    SCOPED_TRACE("deepseek_v3: MLA caches");
    expect_decode_matches("deepseek_v3", "lora_peft3d", 537,
                          {{4, AttentionSplit::kTensorParallel},
                           {2, AttentionSplit::kDataParallel},
                           {2, AttentionSplit::kDataParallel, true}});
  }
}

// A serving executor's fixed slots changing under ShardedModels that live on: the model resized to
// two empty slots and sharded on 2 ranks (tensor-parallel attention, then data parallel), then
// slot 1 set to adapter `first`, cleared, and set to `second` through the model's AdapterSet,
// each change followed by refresh_slot(1) on every rank; after each, a batch of the slot-1 prompt
// and a base prompt equals model::Model's logits, and the slot-1 prompt's differ from the base's
// while an adapter is set and equal them when none is. Then the slot count grows to 3: slot 2 is
// refused until a refresh picks it up, and serves `first` after.
void expect_refresh_follows_adapter_set(const std::string& name, const std::string& first,
                                        const std::string& second, uint64_t seed) {
  model::Model model = load_quiet(fixture(name) / "base");
  model.adapters().resize(2);
  std::mt19937_64 rng(test::test_seed(seed));
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(model.vocab_size()) - 1);
  std::vector<std::vector<int32_t>> prompts = {std::vector<int32_t>(7), std::vector<int32_t>(4)};
  for (auto& p : prompts)
    for (int32_t& t : p) t = id(rng);
  auto cpu_logits = [&](int32_t slot, const std::vector<int32_t>& prompt) {
    model::Sequence seq = model.new_sequence(slot);
    return model.forward(seq, prompt);
  };
  auto load = [&](const std::string& adapter) {
    return io::load_adapter(fixture(name) / adapter, model.config(), adapter);
  };
  const Tensor base0 = cpu_logits(-1, prompts[0]);

  for (const AttentionSplit split :
       {AttentionSplit::kTensorParallel, AttentionSplit::kDataParallel}) {
    constexpr int kRanks = 2;
    ShardedModelOptions options;
    options.attention = split;
    // Kept for the whole run, as the executor keeps them.
    std::vector<std::unique_ptr<ShardedModel>> sharded;
    for (int r = 0; r < kRanks; ++r)
      sharded.push_back(std::make_unique<ShardedModel>(model, ShardSpec{r, kRanks}, options));
    const std::string mode =
        split == AttentionSplit::kDataParallel ? "data-parallel" : "tensor-parallel";

    // Refreshes `slot` on every rank, runs `prompts` with `slots` and checks them against the CPU
    // model; returns rank 0's logits.
    auto refresh_and_check = [&](int32_t slot, const std::vector<std::vector<int32_t>>& batch,
                                 const std::vector<int32_t>& slots, const std::string& step) {
      std::vector<std::vector<Tensor>> logits(kRanks);
      run_ranks(kRanks, [&](Communicator& comm) {
        ShardedModel& mine = *sharded[static_cast<size_t>(comm.rank())];
        mine.refresh_slot(slot);
        logits[static_cast<size_t>(comm.rank())] = mine.prefill_batch_logits(batch, slots, comm);
      });
      for (size_t i = 0; i < batch.size(); ++i) {
        const Tensor expected = cpu_logits(slots[i], batch[i]);
        for (int r = 0; r < kRanks; ++r) {
          const Tensor& got = logits[static_cast<size_t>(r)][i];
          const std::string label = mode + ", " + step + ", rank " + std::to_string(r) +
                                    ", prompt " + std::to_string(i) + " (slot " +
                                    std::to_string(slots[i]) + ")";
          EXPECT_TRUE(test::all_close(got, expected, kAtol, kRtol)) << label;
          EXPECT_EQ(std::memcmp(got.raw_data(), logits[0][i].raw_data(), got.nbytes()), 0)
              << label << ": differs from rank 0";
        }
      }
      return logits[0];
    };
    const std::vector<int32_t> mixed = {1, -1};

    model.adapters().set(1, load(first));
    const std::vector<Tensor> with_first = refresh_and_check(1, prompts, mixed, "set " + first);
    EXPECT_GT(test::max_abs_diff(with_first[0], base0), 1e-3)
        << mode << ": slot 1 with " << first << " equals the base";

    model.adapters().clear(1);
    const std::vector<Tensor> cleared = refresh_and_check(1, prompts, mixed, "cleared");
    EXPECT_TRUE(test::all_close(cleared[0], base0, kAtol, kRtol))
        << mode << ": the cleared slot 1 still adapts";

    model.adapters().set(1, load(second));
    const std::vector<Tensor> with_second = refresh_and_check(1, prompts, mixed, "set " + second);
    EXPECT_GT(test::max_abs_diff(with_second[0], base0), 1e-3)
        << mode << ": slot 1 with " << second << " equals the base";
    EXPECT_GT(test::max_abs_diff(with_second[0], with_first[0]), 1e-3)
        << mode << ": slot 1 with " << second << " equals " << first << "'s";

    // A grown slot count: slot 2 exists in the AdapterSet but has no cut until a refresh.
    model.adapters().resize(3);
    model.adapters().set(2, load(first));
    EXPECT_TRUE(test::contains(test::error_message([&] { sharded[0]->new_sequence(2); }),
                               "refresh_slot cuts them"))
        << mode;
    refresh_and_check(0, {prompts[0], prompts[1], prompts[0]}, {2, 1, -1}, "grown to 3 slots");
    EXPECT_EQ(sharded[1]->num_slots(), 3);
    EXPECT_TRUE(test::contains(test::error_message([&] { sharded[0]->refresh_slot(3); }),
                               "adapter slot 3 to refresh is not in [0, 3)"))
        << mode;

    // Back to two empty slots for the next split.
    model.adapters().clear(1);
    model.adapters().clear(2);
    model.adapters().resize(2);
  }
}

TEST(DistShardedModel, RefreshSlotFollowsAdapterSetChanges) {
  {
    SCOPED_TRACE("qwen3_moe");
    expect_refresh_follows_adapter_set("qwen3_moe", "lora_peft3d", "lora_per_expert", 539);
  }
  {
    SCOPED_TRACE("deepseek_v3: MLA, a dense first layer and the shared expert's adapter");
    expect_refresh_follows_adapter_set("deepseek_v3", "lora_peft3d", "lora_dense_shared", 541);
  }
  {
    SCOPED_TRACE("qwen3_5_moe: Gated DeltaNet and gated attention");
    expect_refresh_follows_adapter_set("qwen3_5_moe", "lora_all", "lora_linear", 543);
  }
}

// Sequences are tied to the rank's model that made them, need new tokens, and a step that threw
// part-way leaves them refused rather than silently inconsistent.
TEST(DistShardedModel, SequenceMisuseIsNamed) {
  const model::Model model = load_quiet(fixture("qwen3_moe") / "base");
  run_ranks(1, [&](Communicator& comm) {
    const ShardedModel sharded(model, {0, 1}), other(model, {0, 1});
    ShardedSequence seq = sharded.new_sequence(-1);
    ShardedSequence foreign = other.new_sequence(-1);
    auto expect_error = [](const std::function<void()>& fn, const std::string& part) {
      const std::string message = test::error_message(fn);
      EXPECT_TRUE(test::contains(message, part)) << "'" << part << "' not in: " << message;
    };
    expect_error([&] { sharded.forward({&foreign}, {{1, 2}}, comm); },
                 "sequence 0 was not made by this rank's model");
    expect_error([&] { sharded.forward({&seq}, {{}}, comm); }, "sequence 0 has no new tokens");
    expect_error([&] { sharded.new_sequence(5); }, "adapter slot 5");
    expect_error([&] { sharded.new_sequence(-1, 1); }, "owner rank 1 is not a rank of 1");
    const int32_t beyond_vocab = static_cast<int32_t>(model.vocab_size());
    test::error_message([&] { sharded.forward({&seq}, {{1, beyond_vocab}}, comm); });
    expect_error([&] { sharded.forward({&seq}, {{1, 2}}, comm); }, "sequence 0 is broken");
    EXPECT_EQ(seq.length(), 0);
  });
}

TEST(DistShardedModel, SplitsThatDoNotDivideAreNamed) {
  const model::Model mla = load_quiet(fixture("deepseek_v3") / "base");
  // 4 MLA heads over 8 ranks.
  EXPECT_TRUE(test::contains(test::error_message([&] {
                               ShardedModel sharded(mla, {0, 8});
                             }),
                             "MLA heads"));
  const model::Model qwen35 = load_quiet(fixture("qwen3_5_moe") / "base");
  // 2 linear-attention key heads over 4 ranks.
  EXPECT_TRUE(test::contains(test::error_message([&] {
                               ShardedModel sharded(qwen35, {0, 4});
                             }),
                             "Gated DeltaNet key heads"));
  const model::Model qwen = load_quiet(fixture("qwen3_moe") / "base");
  // 4 query heads over 3 ranks.
  EXPECT_TRUE(test::contains(test::error_message([&] {
                               ShardedModel sharded(qwen, {0, 3});
                             }),
                             "4 is not divisible by 3"));
}

}  // namespace
}  // namespace moelora::dist
