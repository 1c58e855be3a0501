// The sharding arithmetic of expert parallelism (src/dist/parallel_layers.h), with ranks as
// threads over the in-process communicator: the MoE layer with its routed experts split over the
// ranks equals the unsharded CPU reference (bit for bit where the combine only adds zeros or the
// tokens are dispatched, else up to float reassociation), with adapters of every layout in one
// mixed batch, and a bad split is an error that names the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/parallel_layers.h"
#include "dist/shard.h"
#include "ops/moe/moe.h"
#include "ops/route/route.h"
#include "support/dist_helpers.h"
#include "support/test_support.h"

namespace moelora::dist {
namespace {

using namespace test_helpers;
using ops::MoeLoraRef;
using ops::MoeParams;
using ops::MoeWeightsRef;

// ============================================================================ MoE, EP

struct MoeLayer {
  MoeParams params;
  MoeWeightsRef weights;
};

MoeLayer random_moe(std::mt19937_64& rng, int64_t experts, int64_t top_k, bool shared_gate) {
  MoeLayer m;
  const int64_t hidden = 32, inter = 16, shared_inter = 24;
  m.params.hidden = hidden;
  m.params.intermediate = inter;
  m.params.route.kind = RouterKind::kSoftmaxTopK;
  m.params.route.num_experts = experts;
  m.params.route.top_k = top_k;
  m.params.route.renormalize = true;
  const float sh = 1.0f / std::sqrt(static_cast<float>(hidden));
  m.weights.router = test::random_normal({experts, hidden}, rng, 1.5f * sh);
  m.weights.w13 = test::random_normal({experts, 2 * inter, hidden}, rng, sh);
  m.weights.w2 = test::random_normal({experts, hidden, inter}, rng, 0.25f);
  m.weights.shared_w13 = test::random_normal({2 * shared_inter, hidden}, rng, sh);
  m.weights.shared_w2 = test::random_normal({hidden, shared_inter}, rng, 0.2f);
  if (shared_gate) m.weights.shared_gate = test::random_normal({1, hidden}, rng, sh);
  return m;
}

// One slot's factors for every target of the layer, owning them.
struct MoeAdapter {
  LoraFactors gate_up, down, shared_gate, shared_up, shared_down;
  MoeLoraRef ref() const {
    auto p = [](const LoraFactors& f) { return f.defined() ? &f : nullptr; };
    return {p(gate_up), p(down), p(shared_gate), p(shared_up), p(shared_down)};
  }
};

// The adapter layouts PEFT checkpoints come in, as the loader canonicalizes them: per-expert
// factors, shared-outer (one gate_up A and one down B for all experts), the reverse (one gate_up B
// and one down A), and routed experts only (no shared-expert targets).
enum class Layout { kPerExpert, kSharedOuter, kSharedInner, kRoutedOnly };

MoeAdapter random_adapter(std::mt19937_64& rng, const MoeLayer& m, Layout layout, int64_t rank) {
  const int64_t e = m.params.route.num_experts, h = m.params.hidden, i = m.params.intermediate;
  const int64_t is = m.weights.shared_w2.dim(1);
  MoeAdapter a;
  const bool outer = layout == Layout::kSharedOuter, inner = layout == Layout::kSharedInner;
  a.gate_up = random_lora(rng, outer ? 1 : e, inner ? 1 : e, rank, h, 2 * i, 0.9f);
  a.down = random_lora(rng, inner ? 1 : e, outer ? 1 : e, rank, i, h, 1.1f);
  if (layout != Layout::kRoutedOnly) {
    a.shared_gate = random_lora(rng, 1, 1, rank, h, is, 0.7f);
    a.shared_up = random_lora(rng, 1, 1, rank + 1, h, is, 0.7f);
    a.shared_down = random_lora(rng, 1, 1, rank + 2, is, h, 1.3f);
  }
  return a;
}

struct MoeBatch {
  Tensor x;
  std::vector<int32_t> slot;
};

MoeBatch random_batch(std::mt19937_64& rng, int64_t tokens, int64_t hidden, int32_t slots) {
  MoeBatch b{test::random_normal({tokens, hidden}, rng), std::vector<int32_t>(tokens)};
  for (int64_t t = 0; t < tokens; ++t)
    b.slot[static_cast<size_t>(t)] = static_cast<int32_t>(t % (slots + 1)) - 1;  // -1 = base
  return b;
}

std::vector<Tensor> run_moe_ep(int ep, const MoeLayer& m, const std::vector<MoeAdapter>& adapters,
                               const MoeBatch& batch, MoeCombine combine, SharedExpertSplit split) {
  return on_ranks(ep, [&](Communicator& comm) {
    const ShardSpec me{comm.rank(), comm.size()};
    std::vector<MoeLora> mine;
    for (const MoeAdapter& a : adapters)
      mine.push_back(shard_moe_lora(a.ref(), m.params, me, split));
    return moe_forward_ep(batch.x, batch.slot, shard_moe(m.weights, m.params, me, split), mine,
                          combine, comm);
  });
}

// All pair rows gathered before the combine, shared expert on every rank: the layer of every
// rank is the unsharded layer bit for bit, for every adapter layout in one mixed batch.
TEST(DistExpertParallel, PairRowsCombineIsTheUnshardedLayerBitForBit) {
  std::mt19937_64 rng(test::test_seed(505));
  const MoeLayer m = random_moe(rng, 8, 3, /*shared_gate=*/true);
  std::vector<MoeAdapter> adapters;
  for (Layout l :
       {Layout::kPerExpert, Layout::kSharedOuter, Layout::kSharedInner, Layout::kRoutedOnly})
    adapters.push_back(random_adapter(rng, m, l, 4));
  const MoeBatch batch = random_batch(rng, 15, m.params.hidden, 4);
  std::vector<MoeLoraRef> refs;
  for (const MoeAdapter& a : adapters) refs.push_back(a.ref());
  const Tensor expected = ops::moe_forward_ref(batch.x, batch.slot, m.weights, refs, m.params);
  const Tensor base =
      ops::moe_forward_ref(batch.x, std::vector<int32_t>(15, -1), m.weights, refs, m.params);
  ASSERT_GT(test::max_abs_diff(expected, base), 0.01) << "the adapters change the layer";

  for (int ep : {1, 2, 4, 8}) {
    const std::vector<Tensor> outputs =
        run_moe_ep(ep, m, adapters, batch, MoeCombine::kPairRows, SharedExpertSplit::kReplicated);
    for (int r = 0; r < ep; ++r)
      EXPECT_TRUE(bitwise_equal(outputs[static_cast<size_t>(r)], expected))
          << "ep " << ep << " rank " << r << ": max |diff| "
          << test::max_abs_diff(outputs[static_cast<size_t>(r)], expected);
  }
}

// Partial sums combined per rank and reduced once (the decode-size scheme), with the shared
// expert replicated or tensor parallel over the same ranks: equal to the unsharded layer up to
// float reassociation, and every rank holds the same result.
TEST(DistExpertParallel, PartialSumsAndTensorParallelSharedExpertMatchTheUnshardedLayer) {
  std::mt19937_64 rng(test::test_seed(507));
  const MoeLayer m = random_moe(rng, 8, 2, /*shared_gate=*/true);
  std::vector<MoeAdapter> adapters;
  for (Layout l : {Layout::kSharedOuter, Layout::kPerExpert})
    adapters.push_back(random_adapter(rng, m, l, 3));
  const MoeBatch batch = random_batch(rng, 11, m.params.hidden, 2);
  std::vector<MoeLoraRef> refs;
  for (const MoeAdapter& a : adapters) refs.push_back(a.ref());
  const Tensor expected = ops::moe_forward_ref(batch.x, batch.slot, m.weights, refs, m.params);

  for (MoeCombine combine : {MoeCombine::kPartialSums, MoeCombine::kPairRows}) {
    for (SharedExpertSplit split :
         {SharedExpertSplit::kReplicated, SharedExpertSplit::kTensorParallel}) {
      for (int ep : {2, 4}) {
        const std::vector<Tensor> outputs = run_moe_ep(ep, m, adapters, batch, combine, split);
        const std::string label =
            std::string(combine == MoeCombine::kPartialSums ? "partial sums" : "pair rows") +
            (split == SharedExpertSplit::kReplicated ? ", shared replicated" : ", shared TP") +
            ", ep " + std::to_string(ep);
        for (int r = 0; r < ep; ++r) {
          EXPECT_TRUE(bitwise_equal(outputs[static_cast<size_t>(r)], outputs[0]))
              << label << " rank " << r;
          EXPECT_TRUE(test::all_close(outputs[static_cast<size_t>(r)], expected, kAtol, kRtol))
              << label << " rank " << r;
        }
      }
    }
  }
}

// Token dispatch (data-parallel attention): each rank holds only its own tokens, a different
// number on each (none on some), sends every pair to its expert's rank and gets the output back;
// each rank's rows are the unsharded layer's rows of those tokens bit for bit, for every adapter
// layout in one mixed batch, with plain and grouped (noaux_tc, correction bias) routing.
TEST(DistExpertParallel, DispatchedTokensEqualTheUnshardedLayerOnEachRanksRows) {
  std::mt19937_64 rng(test::test_seed(513));
  for (bool grouped : {false, true}) {
    MoeLayer m = random_moe(rng, 16, 4, /*shared_gate=*/true);
    if (grouped) {
      m.params.route.kind = RouterKind::kSigmoidNoauxTc;
      m.params.route.n_group = 4;
      m.params.route.topk_group = 2;
      m.params.route.routed_scaling_factor = 2.5f;
      m.weights.correction_bias = test::random_normal({16}, rng, 0.05f);
    }
    std::vector<MoeAdapter> adapters;
    for (Layout l :
         {Layout::kPerExpert, Layout::kSharedOuter, Layout::kSharedInner, Layout::kRoutedOnly})
      adapters.push_back(random_adapter(rng, m, l, 4));
    const MoeBatch batch = random_batch(rng, 15, m.params.hidden, 4);
    std::vector<MoeLoraRef> refs;
    for (const MoeAdapter& a : adapters) refs.push_back(a.ref());
    const Tensor expected = ops::moe_forward_ref(batch.x, batch.slot, m.weights, refs, m.params);
    // Tokens [cut[r], cut[r + 1]) are rank r's.
    const std::vector<std::vector<int64_t>> cuts = {
        {0, 15}, {0, 9, 15}, {0, 0, 5, 7, 15}, {0, 3, 3, 4, 9, 9, 12, 15, 15}};
    for (const std::vector<int64_t>& cut : cuts) {
      const int ep = static_cast<int>(cut.size()) - 1;
      const std::vector<Tensor> outputs = on_ranks(ep, [&](Communicator& comm) {
        const ShardSpec me{comm.rank(), comm.size()};
        std::vector<MoeLora> mine;
        for (const MoeAdapter& a : adapters)
          mine.push_back(shard_moe_lora(a.ref(), m.params, me, SharedExpertSplit::kReplicated));
        const int64_t begin = cut[static_cast<size_t>(comm.rank())],
                      end = cut[static_cast<size_t>(comm.rank()) + 1];
        const std::vector<int32_t> slots(batch.slot.begin() + begin, batch.slot.begin() + end);
        return moe_forward_dispatch(
            batch.x.slice0(begin, end).clone(), slots,
            shard_moe(m.weights, m.params, me, SharedExpertSplit::kReplicated), mine, comm);
      });
      for (int r = 0; r < ep; ++r) {
        const int64_t begin = cut[static_cast<size_t>(r)], end = cut[static_cast<size_t>(r) + 1];
        const Tensor& got = outputs[static_cast<size_t>(r)];
        ASSERT_EQ(got.dim(0), end - begin);
        if (end == begin) continue;
        EXPECT_TRUE(bitwise_equal(got, expected.slice0(begin, end).clone()))
            << (grouped ? "grouped" : "softmax") << " routing, ep " << ep << " rank " << r;
      }
    }
  }
}

TEST(DistExpertParallel, DispatchNeedsAReplicatedSharedExpert) {
  std::mt19937_64 rng(test::test_seed(515));
  const MoeLayer m = random_moe(rng, 8, 2, false);
  const MoeBatch batch = random_batch(rng, 3, m.params.hidden, 0);
  expect_error_mentions(
      [&] {
        run_ranks(2, [&](Communicator& comm) {
          const ShardSpec me{comm.rank(), comm.size()};
          moe_forward_dispatch(
              batch.x, batch.slot,
              shard_moe(m.weights, m.params, me, SharedExpertSplit::kTensorParallel), {}, comm);
        });
      },
      {"moe dispatch: the shared expert is split over the ranks", "kReplicated"});
  expect_error_mentions(
      [&] {
        run_ranks(1, [&](Communicator& comm) {
          moe_forward_ep(batch.x, batch.slot,
                         shard_moe(m.weights, m.params, {0, 1}, SharedExpertSplit::kReplicated), {},
                         MoeCombine::kDispatch, comm);
        });
      },
      {"MoeCombine::kDispatch runs through moe_forward_dispatch"});
}

TEST(DistExpertParallel, NoauxTcRoutingWithCorrectionBias) {
  std::mt19937_64 rng(test::test_seed(509));
  MoeLayer m = random_moe(rng, 16, 4, /*shared_gate=*/false);
  m.params.route.kind = RouterKind::kSigmoidNoauxTc;
  m.params.route.n_group = 4;
  m.params.route.topk_group = 2;
  m.params.route.routed_scaling_factor = 2.5f;
  m.weights.correction_bias = test::random_normal({16}, rng, 0.05f);
  const std::vector<MoeAdapter> adapters = {random_adapter(rng, m, Layout::kPerExpert, 4)};
  const MoeBatch batch = random_batch(rng, 7, m.params.hidden, 1);
  const Tensor expected =
      ops::moe_forward_ref(batch.x, batch.slot, m.weights, {adapters[0].ref()}, m.params);
  for (int ep : {2, 8}) {
    const std::vector<Tensor> outputs =
        run_moe_ep(ep, m, adapters, batch, MoeCombine::kPairRows, SharedExpertSplit::kReplicated);
    for (const Tensor& out : outputs) EXPECT_TRUE(bitwise_equal(out, expected)) << "ep " << ep;
  }
}

TEST(DistExpertParallel, BadSplitsNameTheProblem) {
  std::mt19937_64 rng(test::test_seed(511));
  const MoeLayer m = random_moe(rng, 8, 2, false);
  expect_error_mentions(
      [&] {
        shard_moe(m.weights, m.params, {0, 3}, SharedExpertSplit::kReplicated);
      },
      {"moe experts", "8 is not divisible by 3"});
  // The shared expert's 24 channels over 16 ranks.
  MoeLayer wide = random_moe(rng, 16, 2, false);
  expect_error_mentions(
      [&] {
        shard_moe(wide.weights, wide.params, {0, 16}, SharedExpertSplit::kTensorParallel);
      },
      {"mlp gate weight", "24 is not divisible by 16"});
  // Shards cut for 4 ranks run on a group of 2.
  const MoeShard quarter = shard_moe(m.weights, m.params, {1, 4}, SharedExpertSplit::kReplicated);
  const MoeBatch batch = random_batch(rng, 3, m.params.hidden, 0);
  std::mutex mutex;
  std::vector<std::string> errors;
  run_ranks(2, [&](Communicator& comm) {
    try {
      moe_forward_ep(batch.x, batch.slot, quarter, {}, MoeCombine::kPairRows, comm);
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const std::string& e : errors)
    EXPECT_NE(e.find("holds experts [2, 4) of 8"), std::string::npos) << e;
}

}  // namespace
}  // namespace moelora::dist
