// The sharding arithmetic of tensor parallelism (src/dist: slicing, the dense MLP, GQA and gated
// attention, MLA, Gated DeltaNet), with ranks as threads over the in-process communicator: every
// rank's output equals the unsharded CPU reference up to float reassociation, with adapters of
// every layout in one mixed batch, and a bad split is an error that names the tensor. The expert
// parallel MoE is in dist_expert_parallel_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/parallel_attention.h"
#include "dist/parallel_gdn.h"
#include "dist/parallel_layers.h"
#include "dist/parallel_mla.h"
#include "dist/shard.h"
#include "ops/attention/attention.h"
#include "ops/gdn/gdn.h"
#include "ops/linear/linear.h"
#include "ops/lora/lora.h"
#include "support/dist_helpers.h"
#include "support/test_support.h"

namespace moelora::dist {
namespace {

using namespace test_helpers;

// ============================================================================ slicing

TEST(DistShard, RangesAndDimensionBlocks) {
  EXPECT_EQ(shard_range(12, {2, 4}, "w").begin, 6);
  EXPECT_EQ(shard_range(12, {2, 4}, "w").end, 9);
  // [2, 6, 3] split on dimension 1 over 3 ranks: rank 1 holds rows 2..3 of each outer block.
  std::vector<float> values(36);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  const Tensor t = Tensor::from_f32(values, {2, 6, 3});
  const Tensor s = shard_dim(t, 1, {1, 3}, "t");
  ASSERT_EQ(s.shape(), (Shape{2, 2, 3}));
  const std::vector<float> expected = {6, 7, 8, 9, 10, 11, 24, 25, 26, 27, 28, 29};
  EXPECT_EQ(std::vector<float>(s.data<float>(), s.data<float>() + 12), expected);
  expect_error_mentions(
      [&] {
        shard_dim(t, 1, {0, 4}, "mlp gate weight");
      },
      {"mlp gate weight", "6 is not divisible by 4"});
  expect_error_mentions([&] { shard_dim(t, 3, {0, 2}, "x"); }, {"cannot split dimension 3"});
  expect_error_mentions([&] { shard_range(8, {4, 4}, "moe experts"); }, {"rank 4 of 4"});
  // Rows 0, 4..5 of dimension 1 of [2, 6, 3], concatenated: the blocks side by side per outer item.
  const Tensor r = slice_ranges(t, 1, {{0, 1}, {4, 6}}, "qkv");
  ASSERT_EQ(r.shape(), (Shape{2, 3, 3}));
  const std::vector<float> expected_ranges = {0,  1,  2,  12, 13, 14, 15, 16, 17,
                                              18, 19, 20, 30, 31, 32, 33, 34, 35};
  EXPECT_EQ(std::vector<float>(r.data<float>(), r.data<float>() + 18), expected_ranges);
  expect_error_mentions([&] { slice_ranges(t, 1, {{0, 1}, {3, 3}}, "conv1d"); },
                        {"conv1d", "an empty range [3, 3)"});
  expect_error_mentions([&] { slice_ranges(t, 1, {{4, 7}}, "in_proj_qkv"); },
                        {"in_proj_qkv", "items [4, 7) of dimension 1"});
}

TEST(DistShard, LoraFollowsTheBaseWeightsSplit) {
  std::mt19937_64 rng(test::test_seed(501));
  const LoraFactors f = random_lora(rng, 1, 1, 4, 8, 6, 0.5f);
  const LoraFactors column = shard_lora_column(f, {1, 2}, "q_proj");
  EXPECT_EQ(column.a.shape(), (Shape{1, 4, 8}));  // A whole
  EXPECT_EQ(column.b.shape(), (Shape{1, 3, 4}));  // B split on out
  const LoraFactors row = shard_lora_row(f, {1, 2}, "o_proj");
  EXPECT_EQ(row.a.shape(), (Shape{1, 4, 4}));  // A split on in
  EXPECT_EQ(row.b.shape(), (Shape{1, 6, 4}));  // B whole
  EXPECT_EQ(row.scaling, 0.5f);
  // Experts: per-expert factors split, shared-outer factors whole on every rank.
  const LoraFactors per_expert = random_lora(rng, 8, 1, 4, 8, 6, 1.0f);
  const LoraFactors e = shard_lora_experts(per_expert, 8, {3, 4}, "gate_up");
  EXPECT_EQ(e.a.shape(), (Shape{2, 4, 8}));
  EXPECT_EQ(e.b.shape(), (Shape{1, 6, 4}));
  EXPECT_TRUE(bitwise_equal(e.a, shard_dim(per_expert.a, 0, {3, 4}, "a")));
  EXPECT_FALSE(shard_lora_column(LoraFactors{}, {0, 2}, "none").defined());
  expect_error_mentions(
      [&] {
        shard_lora_experts(random_lora(rng, 3, 3, 2, 8, 6, 1.0f), 8, {0, 2}, "down");
      },
      {"down lora A", "expected 1 or 8 experts"});
}

// ============================================================================ dense MLP, TP

TEST(DistTensorParallel, MlpWithAdaptersEqualsTheUnshardedMlp) {
  std::mt19937_64 rng(test::test_seed(503));
  const int64_t hidden = 32, inter = 24, tokens = 9;
  const Tensor w_gate = test::random_normal({inter, hidden}, rng, 0.2f);
  const Tensor w_up = test::random_normal({inter, hidden}, rng, 0.2f);
  const Tensor w_down = test::random_normal({hidden, inter}, rng, 0.2f);
  // Slot 0: every target; slot 1: down only; tokens of slot -1 run the base MLP.
  const LoraFactors g = random_lora(rng, 1, 1, 4, hidden, inter, 0.8f);
  const LoraFactors u = random_lora(rng, 1, 1, 5, hidden, inter, 0.8f);
  const LoraFactors d = random_lora(rng, 1, 1, 6, inter, hidden, 1.2f);
  const LoraFactors d1 = random_lora(rng, 1, 1, 3, inter, hidden, 0.7f);
  const std::vector<ops::MlpLoraRef> lora = {{&g, &u, &d}, {nullptr, nullptr, &d1}};
  const Tensor x = test::random_normal({tokens, hidden}, rng);
  std::vector<int32_t> slot(tokens);
  for (int64_t t = 0; t < tokens; ++t)
    slot[static_cast<size_t>(t)] = static_cast<int32_t>(t % 3) - 1;
  const Tensor expected = ops::mlp_forward_ref(x, slot, w_gate, w_up, w_down, lora);

  for (int tp : {1, 2, 4}) {
    const std::vector<Tensor> outputs = on_ranks(tp, [&](Communicator& comm) {
      const ShardSpec me{comm.rank(), comm.size()};
      std::vector<MlpLora> mine;
      for (const ops::MlpLoraRef& l : lora) mine.push_back(shard_mlp_lora(l, me));
      return mlp_forward_tp(x, slot, shard_mlp(w_gate, w_up, w_down, me), mine, comm);
    });
    for (int r = 0; r < tp; ++r) {
      EXPECT_TRUE(bitwise_equal(outputs[static_cast<size_t>(r)], outputs[0]))
          << "tp " << tp << ": rank " << r << " differs from rank 0";
      EXPECT_TRUE(test::all_close(outputs[static_cast<size_t>(r)], expected, kAtol, kRtol))
          << "tp " << tp << " rank " << r;
    }
    if (tp == 1) {
      EXPECT_TRUE(bitwise_equal(outputs[0], expected));
    }
  }
  expect_error_mentions(
      [&] {
        shard_mlp(w_gate, w_up, w_down, {0, 5});
      },
      {"mlp gate weight", "24 is not divisible by 5"});
}

// ============================================================================ GQA attention, TP

// Qwen3.5's full attention when `gated`: q_proj rows per head [q | gate], RoPE on the first quarter
// of each head, (1 + w) norms.
GqaWeights random_gqa(std::mt19937_64& rng, int64_t heads, int64_t kv_heads, bool gated = false) {
  GqaWeights w;
  const int64_t hidden = 32, d = 16;
  w.num_heads = heads;
  w.num_kv_heads = kv_heads;
  w.head_dim = d;
  w.output_gate = gated;
  const float sh = 1.0f / std::sqrt(static_cast<float>(hidden));
  w.q_proj = test::random_normal({heads * d * (gated ? 2 : 1), hidden}, rng, sh);
  w.k_proj = test::random_normal({kv_heads * d, hidden}, rng, sh);
  w.v_proj = test::random_normal({kv_heads * d, hidden}, rng, sh);
  w.o_proj = test::random_normal({hidden, heads * d}, rng, 1.0f / std::sqrt(float(heads * d)));
  w.q_norm = test::random_uniform({d}, rng, 0.8f, 1.2f);
  w.k_norm = test::random_uniform({d}, rng, 0.8f, 1.2f);
  ops::RopeParams rope;
  rope.rotary_dim = gated ? d / 4 : d;
  rope.theta = 10000.0;
  w.rope = ops::make_rope_table(rope);
  if (gated) w.norm.style = NormStyle::kOnePlusWeight;
  return w;
}

// The unsharded block written out with the operators, independently of src/dist.
Tensor gqa_unsharded(const Tensor& x, const std::vector<int32_t>& slot, const GqaWeights& w,
                     const std::vector<GqaLora>& lora) {
  const int64_t t = x.dim(0), d = w.head_dim;
  auto proj = [&](const Tensor& in, const Tensor& weight, auto member) {
    Tensor y = ops::linear_ref(in, weight);
    std::vector<const LoraFactors*> adapters;
    for (const GqaLora& l : lora)
      adapters.push_back((l.*member).defined() ? &(l.*member) : nullptr);
    ops::lora_add_slots_ref(in, slot, adapters, y);
    return y;
  };
  const Tensor q_out = proj(x, w.q_proj, &GqaLora::q);
  Tensor q = Tensor::empty(DType::kF32, {t, w.num_heads, d});
  Tensor gate = Tensor::empty(DType::kF32, {t, w.num_heads, d});
  const int64_t per_head = w.output_gate ? 2 * d : d;
  for (int64_t i = 0; i < t * w.num_heads; ++i)
    for (int64_t j = 0; j < d; ++j) {
      q.data<float>()[i * d + j] = q_out.data<float>()[i * per_head + j];
      if (w.output_gate) gate.data<float>()[i * d + j] = q_out.data<float>()[i * per_head + d + j];
    }
  Tensor k = proj(x, w.k_proj, &GqaLora::k).reshape({t, w.num_kv_heads, d});
  Tensor v = proj(x, w.v_proj, &GqaLora::v).reshape({t, w.num_kv_heads, d});
  ops::rms_norm_inplace_ref(q, w.q_norm, w.norm);
  ops::rms_norm_inplace_ref(k, w.k_norm, w.norm);
  std::vector<int64_t> positions(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) positions[static_cast<size_t>(i)] = i;
  ops::apply_rope_inplace_ref(q, positions, w.rope, {});
  ops::apply_rope_inplace_ref(k, positions, w.rope, {});
  Tensor a = ops::attention_ref(q, k, v, {}).reshape({t, w.num_heads * d});
  if (w.output_gate)
    for (int64_t i = 0; i < a.numel(); ++i)
      a.data<float>()[i] *= 1.0f / (1.0f + std::exp(-gate.data<float>()[i]));
  return proj(a, w.o_proj, &GqaLora::o);
}

// Heads split over 1, 2 and 4 ranks (KV heads split too) and over 8 ranks (more ranks than the 4
// KV heads: each KV head on two ranks), adapters on q / k / v / o in one mixed batch.
// Qwen3-MoE's attention and Qwen3.5's gated one (q_proj rows [q | gate] per head, partial RoPE).
class DistGqaTensorParallel : public ::testing::TestWithParam<bool> {};

TEST_P(DistGqaTensorParallel, AttentionWithAdaptersEqualsTheUnshardedBlock) {
  const bool gated = GetParam();
  std::mt19937_64 rng(test::test_seed(gated ? 514 : 513));
  const GqaWeights w = random_gqa(rng, 8, 4, gated);
  const int64_t hidden = 32, qd = 8 * 16 * (gated ? 2 : 1), kvd = 4 * 16;
  GqaLora all{
      random_lora(rng, 1, 1, 4, hidden, qd, 0.8f), random_lora(rng, 1, 1, 3, hidden, kvd, 0.9f),
      random_lora(rng, 1, 1, 5, hidden, kvd, 1.1f),
      random_lora(rng, 1, 1, 4, 8 * 16, hidden, 1.2f)};
  GqaLora q_and_o{random_lora(rng, 1, 1, 2, hidden, qd, 1.0f),
                  {},
                  {},
                  random_lora(rng, 1, 1, 6, 8 * 16, hidden, 0.6f)};
  const std::vector<GqaLora> lora = {all, q_and_o};
  const int64_t tokens = 10;
  const Tensor x = test::random_normal({tokens, hidden}, rng);
  std::vector<int32_t> slot(tokens);
  for (int64_t t = 0; t < tokens; ++t)
    slot[static_cast<size_t>(t)] = static_cast<int32_t>(t % 3) - 1;
  const Tensor expected = gqa_unsharded(x, slot, w, lora);
  const Tensor base = gqa_unsharded(x, std::vector<int32_t>(tokens, -1), w, lora);
  ASSERT_GT(test::max_abs_diff(expected, base), 0.01) << "the adapters change the block";

  for (int tp : {1, 2, 4, 8}) {
    const std::vector<Tensor> outputs = on_ranks(tp, [&](Communicator& comm) {
      const ShardSpec me{comm.rank(), comm.size()};
      std::vector<GqaLora> mine;
      for (const GqaLora& l : lora) mine.push_back(shard_gqa_lora(l, w, me));
      const GqaWeights shard = shard_gqa(w, me);
      EXPECT_EQ(shard.num_heads, 8 / tp);
      EXPECT_EQ(shard.num_kv_heads, std::max(1, 4 / tp));
      return gqa_prefill_tp(x, slot, shard, mine, comm);
    });
    for (int r = 0; r < tp; ++r) {
      EXPECT_TRUE(bitwise_equal(outputs[static_cast<size_t>(r)], outputs[0]))
          << "tp " << tp << " rank " << r;
      EXPECT_TRUE(test::all_close(outputs[static_cast<size_t>(r)], expected, kAtol, kRtol))
          << "tp " << tp << " rank " << r;
    }
    if (tp == 1) {
      EXPECT_TRUE(bitwise_equal(outputs[0], expected));
    }
  }
  expect_error_mentions(
      [&] {
        shard_gqa(w, {0, 3});
      },
      {"attention query heads", "8 is not divisible by 3"});
  expect_error_mentions(
      [&] {
        shard_gqa(random_gqa(rng, 12, 4), {0, 6});
      },
      {"4 KV heads over 6 ranks"});
}

INSTANTIATE_TEST_SUITE_P(DistTensorParallel, DistGqaTensorParallel, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("GatedQwen35") : std::string("Qwen3");
                         });

// ============================================================================ MLA, TP

// A small DeepSeek-V3-style MLA block: 8 heads, nope 16, rope 8, dv 12, kv latent 24, and a query
// latent of 20 (or q_proj when q_rank is 0); interleaved RoPE with a YaRN table as Kimi's.
MlaWeights random_mla(std::mt19937_64& rng, int64_t q_rank) {
  MlaWeights w;
  const int64_t hidden = 32, heads = 8;
  w.dims = {heads, 16, 8, 12, 24};
  w.q_lora_rank = q_rank;
  const int64_t qk = w.dims.qk_head_dim(), r = w.dims.kv_lora_rank;
  auto scaled = [&](Shape shape, int64_t in) {
    return test::random_normal(shape, rng, 1.0f / std::sqrt(static_cast<float>(in)));
  };
  if (q_rank > 0) {
    w.q_a_proj = scaled({q_rank, hidden}, hidden);
    w.q_a_layernorm = test::random_uniform({q_rank}, rng, 0.8f, 1.2f);
    w.q_b_proj = scaled({heads * qk, q_rank}, q_rank);
  } else {
    w.q_proj = scaled({heads * qk, hidden}, hidden);
  }
  w.kv_a_proj_with_mqa = scaled({r + w.dims.qk_rope_head_dim, hidden}, hidden);
  w.kv_a_layernorm = test::random_uniform({r}, rng, 0.8f, 1.2f);
  w.kv_b_proj = scaled({heads * (w.dims.qk_nope_head_dim + w.dims.v_head_dim), r}, r);
  w.o_proj = scaled({hidden, heads * w.dims.v_head_dim}, heads * w.dims.v_head_dim);
  ops::RopeParams rope;
  rope.type = ops::RopeType::kYarn;
  rope.rotary_dim = w.dims.qk_rope_head_dim;
  rope.theta = 50000.0;
  rope.factor = 4.0;
  rope.original_max_position_embeddings = 64;
  w.rope = ops::make_rope_table(rope);
  w.scale = 0.17f;
  return w;
}

// The unsharded block written out with the operators, independently of src/dist, in the
// un-absorbed form transformers computes (keys and values expanded by kv_b_proj and its LoRA).
Tensor mla_unsharded(const Tensor& x, const std::vector<int32_t>& slot, const MlaWeights& w,
                     const std::vector<MlaLora>& lora) {
  const int64_t t = x.dim(0), heads = w.dims.num_heads, nope = w.dims.qk_nope_head_dim,
                rope = w.dims.qk_rope_head_dim, dv = w.dims.v_head_dim, r = w.dims.kv_lora_rank;
  auto proj = [&](const Tensor& in, const Tensor& weight, LoraFactors MlaLora::*member) {
    Tensor y = ops::linear_ref(in, weight);
    std::vector<const LoraFactors*> adapters;
    for (const MlaLora& l : lora)
      adapters.push_back((l.*member).defined() ? &(l.*member) : nullptr);
    ops::lora_add_slots_ref(in, slot, adapters, y);
    return y;
  };
  Tensor q;
  if (w.q_lora_rank > 0) {
    Tensor latent = proj(x, w.q_a_proj, &MlaLora::q_a_proj);
    ops::rms_norm_inplace_ref(latent, w.q_a_layernorm, w.norm);
    q = proj(latent, w.q_b_proj, &MlaLora::q_b_proj);
  } else {
    q = proj(x, w.q_proj, &MlaLora::q_proj);
  }
  q = q.reshape({t, heads, nope + rope});
  const Tensor kv_a = proj(x, w.kv_a_proj_with_mqa, &MlaLora::kv_a_proj_with_mqa);
  Tensor c_kv = Tensor::empty(DType::kF32, {t, r});
  Tensor k_rope = Tensor::empty(DType::kF32, {t, rope});
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < r + rope; ++j) {
      const float value = kv_a.data<float>()[i * (r + rope) + j];
      if (j < r)
        c_kv.data<float>()[i * r + j] = value;
      else
        k_rope.data<float>()[i * rope + j - r] = value;
    }
  ops::rms_norm_inplace_ref(c_kv, w.kv_a_layernorm, w.norm);
  const Tensor kv = proj(c_kv, w.kv_b_proj, &MlaLora::kv_b_proj);  // [T, n (nope + dv)]
  Tensor k_nope = Tensor::empty(DType::kF32, {t, heads, nope});
  Tensor v = Tensor::empty(DType::kF32, {t, heads, dv});
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < nope + dv; ++j) {
        const float value = kv.data<float>()[(i * heads + h) * (nope + dv) + j];
        if (j < nope)
          k_nope.data<float>()[(i * heads + h) * nope + j] = value;
        else
          v.data<float>()[(i * heads + h) * dv + j - nope] = value;
      }
  std::vector<int64_t> positions(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) positions[static_cast<size_t>(i)] = i;
  ops::apply_rope_inplace_ref(q, positions, w.rope, {w.rope_style, nope});
  ops::apply_rope_inplace_ref(k_rope, positions, w.rope, {w.rope_style, 0});
  ops::MlaAttentionParams params;
  params.dims = w.dims;
  params.softmax_scale = w.scale;
  const Tensor a = ops::mla_attention_ref(q, k_nope, k_rope, v, params).reshape({t, heads * dv});
  return proj(a, w.o_proj, &MlaLora::o_proj);
}

// Heads split over 1, 2, 4 and 8 ranks, with and without the query latent, adapters on every
// projection (the replicated latents' too) and on some, base tokens among them, in one batch.
TEST(DistTensorParallel, MlaWithAdaptersEqualsTheUnshardedBlock) {
  std::mt19937_64 rng(test::test_seed(517));
  const int64_t hidden = 32, tokens = 9;
  for (int64_t q_rank : {20, 0}) {
    SCOPED_TRACE("q_lora_rank " + std::to_string(q_rank));
    const MlaWeights w = random_mla(rng, q_rank);
    const int64_t qk_rows = 8 * w.dims.qk_head_dim(), kv_rows = 8 * (16 + 12), r = 24;
    MlaLora all;
    if (q_rank > 0) {
      all.q_a_proj = random_lora(rng, 1, 1, 4, hidden, q_rank, 0.7f);
      all.q_b_proj = random_lora(rng, 1, 1, 3, q_rank, qk_rows, 1.1f);
    } else {
      all.q_proj = random_lora(rng, 1, 1, 4, hidden, qk_rows, 0.9f);
    }
    all.kv_a_proj_with_mqa = random_lora(rng, 1, 1, 5, hidden, r + 8, 0.8f);
    all.kv_b_proj = random_lora(rng, 1, 1, 4, r, kv_rows, 1.2f);
    all.o_proj = random_lora(rng, 1, 1, 6, 8 * 12, hidden, 0.6f);
    MlaLora some;  // the split projections only
    some.kv_b_proj = random_lora(rng, 1, 1, 2, r, kv_rows, 1.0f);
    some.o_proj = random_lora(rng, 1, 1, 3, 8 * 12, hidden, 1.3f);
    const std::vector<MlaLora> lora = {all, some};
    const Tensor x = test::random_normal({tokens, hidden}, rng);
    std::vector<int32_t> slot(tokens);
    for (int64_t t = 0; t < tokens; ++t)
      slot[static_cast<size_t>(t)] = static_cast<int32_t>(t % 3) - 1;
    const Tensor expected = mla_unsharded(x, slot, w, lora);
    const Tensor base = mla_unsharded(x, std::vector<int32_t>(tokens, -1), w, lora);
    ASSERT_GT(test::max_abs_diff(expected, base), 0.01) << "the adapters change the block";

    for (int tp : {1, 2, 4, 8}) {
      const std::vector<Tensor> outputs = on_ranks(tp, [&](Communicator& comm) {
        const ShardSpec me{comm.rank(), comm.size()};
        std::vector<MlaLora> mine;
        for (const MlaLora& l : lora) mine.push_back(shard_mla_lora(l, w, me));
        const MlaWeights shard = shard_mla(w, me);
        EXPECT_EQ(shard.dims.num_heads, 8 / tp);
        EXPECT_EQ(shard.kv_b_proj.dim(0), 8 / tp * (16 + 12));
        EXPECT_EQ(shard.o_proj.dim(1), 8 / tp * 12);
        if (q_rank > 0) {
          EXPECT_TRUE(bitwise_equal(shard.q_a_proj, w.q_a_proj)) << "the query latent is whole";
        }
        EXPECT_TRUE(bitwise_equal(shard.kv_a_proj_with_mqa, w.kv_a_proj_with_mqa));
        return mla_prefill_tp(x, slot, shard, mine, comm);
      });
      for (int rk = 0; rk < tp; ++rk) {
        EXPECT_TRUE(bitwise_equal(outputs[static_cast<size_t>(rk)], outputs[0]))
            << "tp " << tp << " rank " << rk;
        EXPECT_TRUE(test::all_close(outputs[static_cast<size_t>(rk)], expected, kAtol, kRtol))
            << "tp " << tp << " rank " << rk;
      }
      if (tp == 1) {
        EXPECT_TRUE(bitwise_equal(outputs[0], expected));
      }
    }
  }
  const MlaWeights w = random_mla(rng, 20);
  expect_error_mentions(
      [&] {
        shard_mla(w, {0, 3});
      },
      {"MLA heads", "8 is not divisible by 3"});
  MlaWeights mismatched = shard_mla(w, {1, 2});
  mismatched.kv_b_proj = w.kv_b_proj;  // all 8 heads' rows beside 4 local heads
  expect_error_mentions(
      [&] {
        run_ranks(1, [&](Communicator& comm) {
          mla_prefill_tp(test::random_normal({2, hidden}, rng), {-1, -1}, mismatched, {}, comm);
        });
      },
      {"MLA (the rank's heads) kv_b_proj", "expected F32 [112, 24]", "got F32 [224, 24]"});
  MlaWeights extra_rows = w;  // a whole block whose q_b_proj has a head too many
  extra_rows.q_b_proj = test::random_normal({9 * w.dims.qk_head_dim(), 20}, rng);
  expect_error_mentions([&] { shard_mla(extra_rows, {0, 2}); },
                        {"MLA (the whole block) q_b_proj", "expected F32 [192, 20]"});
}

// ============================================================================ Gated DeltaNet, TP

// A small Qwen3.5 linear-attention layer: 4 key heads of 8, 8 value heads of 6, conv kernel 4.
GdnLayer random_gdn(std::mt19937_64& rng) {
  GdnLayer l;
  l.shape = {32, 4, 8, 8, 6, 4, 1e-6};
  const ops::GdnShape& s = l.shape;
  const float sh = 1.0f / std::sqrt(static_cast<float>(s.hidden));
  l.weights.in_proj_qkv = test::random_normal({s.conv_dim(), s.hidden}, rng, sh);
  l.weights.in_proj_z = test::random_normal({s.value_dim(), s.hidden}, rng, sh);
  l.weights.in_proj_b = test::random_normal({s.num_v_heads, s.hidden}, rng, sh);
  l.weights.in_proj_a = test::random_normal({s.num_v_heads, s.hidden}, rng, sh);
  l.weights.conv1d = test::random_normal({s.conv_dim(), s.conv_kernel}, rng, 0.5f);
  l.weights.a_log = test::random_uniform({s.num_v_heads}, rng, -1.0f, 0.5f);
  l.weights.dt_bias = test::random_uniform({s.num_v_heads}, rng, -0.5f, 0.5f);
  l.weights.norm = test::random_uniform({s.head_v_dim}, rng, 0.8f, 1.2f);
  l.weights.out_proj =
      test::random_normal({s.hidden, s.value_dim()}, rng, 1.0f / std::sqrt(float(s.value_dim())));
  return l;
}

// The unsharded layer written out with the operators, independently of src/dist.
Tensor gdn_unsharded(const Tensor& x, const std::vector<int32_t>& slot, const GdnLayer& l,
                     const std::vector<GdnLora>& lora) {
  auto proj = [&](const Tensor& in, const Tensor& weight, LoraFactors GdnLora::*member) {
    Tensor y = ops::linear_ref(in, weight);
    std::vector<const LoraFactors*> adapters;
    for (const GdnLora& a : lora)
      adapters.push_back((a.*member).defined() ? &(a.*member) : nullptr);
    ops::lora_add_slots_ref(in, slot, adapters, y);
    return y;
  };
  ops::GdnState state = ops::GdnState::zeros(l.shape);
  const Tensor mixed = ops::gdn_mix_ref(
      proj(x, l.weights.in_proj_qkv, &GdnLora::in_proj_qkv),
      proj(x, l.weights.in_proj_z, &GdnLora::in_proj_z),
      proj(x, l.weights.in_proj_b, &GdnLora::in_proj_b),
      proj(x, l.weights.in_proj_a, &GdnLora::in_proj_a), l.weights, l.shape, state, true);
  return proj(mixed, l.weights.out_proj, &GdnLora::out_proj);
}

// Key and value heads split over 1, 2 and 4 ranks, adapters on all five projections and on some,
// base tokens among them; the base tokens alone also against the whole-layer reference.
TEST(DistTensorParallel, GatedDeltaNetWithAdaptersEqualsTheUnshardedLayer) {
  std::mt19937_64 rng(test::test_seed(519));
  const GdnLayer l = random_gdn(rng);
  const ops::GdnShape& s = l.shape;
  const int64_t h = s.hidden, nv = s.num_v_heads, vd = s.value_dim();
  GdnLora all{random_lora(rng, 1, 1, 4, h, s.conv_dim(), 0.9f),
              random_lora(rng, 1, 1, 3, h, vd, 1.1f), random_lora(rng, 1, 1, 2, h, nv, 1.3f),
              random_lora(rng, 1, 1, 5, h, nv, 0.7f), random_lora(rng, 1, 1, 4, vd, h, 1.2f)};
  GdnLora qkv_and_out{random_lora(rng, 1, 1, 6, h, s.conv_dim(), 1.0f), {}, {}, {},
                      random_lora(rng, 1, 1, 3, vd, h, 0.8f)};
  const std::vector<GdnLora> lora = {all, qkv_and_out};
  const int64_t tokens = 11;  // the chunked rule over part of a chunk, the conv past its width
  const Tensor x = test::random_normal({tokens, h}, rng);
  std::vector<int32_t> slot(tokens);
  for (int64_t t = 0; t < tokens; ++t)
    slot[static_cast<size_t>(t)] = static_cast<int32_t>(t % 3) - 1;
  const std::vector<int32_t> base_slots(tokens, -1);
  const Tensor expected = gdn_unsharded(x, slot, l, lora);
  const Tensor base = gdn_unsharded(x, base_slots, l, lora);
  ASSERT_GT(test::max_abs_diff(expected, base), 0.01) << "the adapters change the layer";
  ops::GdnState whole_state = ops::GdnState::zeros(s);
  const Tensor whole_layer = ops::gdn_forward_ref(x, l.weights, s, whole_state, true);
  ASSERT_TRUE(test::all_close(base, whole_layer, kAtol, kRtol)) << "the test's layer is the op's";

  for (int tp : {1, 2, 4}) {
    std::vector<Tensor> with_lora(static_cast<size_t>(tp)), base_only(static_cast<size_t>(tp));
    run_ranks(tp, [&](Communicator& comm) {
      const ShardSpec me{comm.rank(), comm.size()};
      std::vector<GdnLora> mine;
      for (const GdnLora& a : lora) mine.push_back(shard_gdn_lora(a, l, me));
      const GdnLayer shard = shard_gdn(l, me);
      EXPECT_EQ(shard.shape.num_k_heads, 4 / tp);
      EXPECT_EQ(shard.shape.num_v_heads, 8 / tp);
      EXPECT_EQ(shard.weights.in_proj_qkv.dim(0), shard.shape.conv_dim());
      EXPECT_EQ(shard.weights.out_proj.dim(1), shard.shape.value_dim());
      const auto r = static_cast<size_t>(comm.rank());
      with_lora[r] = gdn_prefill_tp(x, slot, shard, mine, comm);
      base_only[r] = gdn_prefill_tp(x, base_slots, shard, mine, comm);
    });
    for (int r = 0; r < tp; ++r) {
      const auto i = static_cast<size_t>(r);
      EXPECT_TRUE(bitwise_equal(with_lora[i], with_lora[0])) << "tp " << tp << " rank " << r;
      EXPECT_TRUE(test::all_close(with_lora[i], expected, kAtol, kRtol)) << "tp " << tp << " rank " << r;
      EXPECT_TRUE(test::all_close(base_only[i], whole_layer, kAtol, kRtol))
          << "tp " << tp << " rank " << r << ", base tokens";
    }
  }
  expect_error_mentions([&] { shard_gdn(l, {0, 8}); },
                        {"Gated DeltaNet key heads", "4 is not divisible by 8"});
  GdnLayer extra_rows = l;  // in_proj_qkv with a channel too many is not cut short
  extra_rows.weights.in_proj_qkv = test::random_normal({s.conv_dim() + 1, h}, rng);
  expect_error_mentions([&] { shard_gdn(extra_rows, {0, 2}); },
                        {"Gated DeltaNet (the whole layer) in_proj_qkv", "expected F32 [112, 32]",
                         "got F32 [113, 32]"});
  GdnLayer no_norm = shard_gdn(l, {0, 2});
  no_norm.weights.norm = Tensor();
  expect_error_mentions(
      [&] {
        run_ranks(1, [&](Communicator& comm) {
          gdn_prefill_tp(x, base_slots, no_norm, {}, comm);
        });
      },
      {"Gated DeltaNet (the rank's share) norm", "undefined"});
}

}  // namespace
}  // namespace moelora::dist
