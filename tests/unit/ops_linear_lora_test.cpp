// The dense linear (ops/linear) against double loops, and LoRA on plain linears (ops/lora) against
// the merged weight W + s B A, several slots with base rows and missing adapters, its errors.
#include <gtest/gtest.h>

#include "unit/ops_ref_oracles.h"

namespace moelora {
namespace {

using namespace ops_ref_test;

// ============================================================================ linear

TEST(Linear, MatchesDoubleLoopsOnOddSizes) {
  std::mt19937_64 rng(test::test_seed(201));
  for (auto [tokens, in, out] :
       std::vector<std::array<int64_t, 3>>{{1, 1, 1}, {7, 13, 5}, {19, 131, 67}, {3, 8, 300}}) {
    const Tensor x = test::random_normal({tokens, in}, rng);
    const Tensor w = test::random_normal({out, in}, rng);
    const Tensor y = ops::linear_ref(x, w);
    const Tensor expect =
        to_tensor(matmul_nt(to_double(x), tokens, in, to_double(w), out), {tokens, out});
    EXPECT_TRUE(test::all_close(y, expect, 1e-5f, 1e-5f)) << tokens << "x" << in << "x" << out;
    Tensor acc = test::random_normal({tokens, out}, rng);
    const std::vector<double> before = to_double(acc);
    ops::linear_add_ref(x, w, acc);
    std::vector<double> sum = matmul_nt(to_double(x), tokens, in, to_double(w), out);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += before[i];
    EXPECT_TRUE(test::all_close(acc, to_tensor(sum, {tokens, out}), 1e-5f, 1e-5f));
  }
  EXPECT_EQ(ops::linear_ref(Tensor::zeros(DType::kF32, {0, 4}), Tensor::zeros(DType::kF32, {3, 4}))
                .shape(),
            (Shape{0, 3}));
}

TEST(Linear, ElementsDoNotDependOnTheBatch) {
  // Each output element is one dot_f32: a row computed alone equals the same row in a batch.
  std::mt19937_64 rng(test::test_seed(202));
  const Tensor x = test::random_normal({23, 77}, rng);
  const Tensor w = test::random_normal({41, 77}, rng);
  const Tensor y = ops::linear_ref(x, w);
  for (int64_t t = 0; t < 23; ++t) {
    const Tensor yt = ops::linear_ref(x.slice0(t, t + 1), w);
    EXPECT_TRUE(rows_bitwise_equal(y, t, yt, 0)) << "token " << t;
  }
}

TEST(Linear, SiluMulAndErrors) {
  const Tensor g = Tensor::from_f32({-2.0f, 0.0f, 1.5f, 30.0f}, {2, 2});
  const Tensor u = Tensor::from_f32({1.0f, 2.0f, -3.0f, 0.5f}, {2, 2});
  const Tensor a = ops::silu_mul_ref(g, u);
  const std::vector<double> gd = {-2, 0, 1.5, 30}, ud = {1, 2, -3, 0.5};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(a.data<float>()[i], silu_d(gd[i]) * ud[i], 1e-6) << i;
  const Tensor fused = ops::silu_mul_fused_ref(
      Tensor::from_f32({-2.0f, 0.0f, 1.0f, 2.0f, 1.5f, 30.0f, -3.0f, 0.5f}, {2, 4}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(fused.data<float>()[i], a.data<float>()[i]) << i;
  EXPECT_ERROR_MENTIONS(
      ops::linear_ref(Tensor::zeros(DType::kF32, {2, 5}), Tensor::zeros(DType::kF32, {3, 4})),
      "[2, 5]", "[3, 4]");
  EXPECT_ERROR_MENTIONS(
      ops::linear_ref(Tensor::zeros(DType::kBF16, {2, 4}), Tensor::zeros(DType::kF32, {3, 4})),
      "F32", "BF16");
  Tensor y = Tensor::zeros(DType::kF32, {2, 4});
  EXPECT_ERROR_MENTIONS(ops::linear_add_ref(Tensor::zeros(DType::kF32, {2, 4}),
                                            Tensor::zeros(DType::kF32, {3, 4}), y),
                        "[2, 3]", "[2, 4]");
}

// ============================================================================ LoRA tests

TEST(Lora, EqualsTheMergedDenseWeight) {
  std::mt19937_64 rng(test::test_seed(301));
  const int64_t tokens = 7, in = 19, out = 13, rank = 5;
  const Tensor x = test::random_normal({tokens, in}, rng);
  const Tensor w = test::random_normal({out, in}, rng, 0.3f);
  const LoraFactors f = random_lora(rng, 1, 1, rank, in, out, 0.75f);
  Tensor y = ops::linear_ref(x, w);
  ops::lora_add_ref(x, f.a.select0(0), f.b.select0(0), f.scaling, y);  // 2-D factors
  const Tensor expect = ops::linear_ref(x, merged(w, &f, 0));
  EXPECT_TRUE(test::all_close(y, expect, 1e-5f, 1e-5f));
  // The delta is not negligible (the test could fail).
  EXPECT_GT(test::max_abs_diff(y, ops::linear_ref(x, w)), 0.05);
  // 3-D [1, R, in] factors give the same bits.
  Tensor y3 = ops::linear_ref(x, w);
  ops::lora_add_ref(x, f.a, f.b, f.scaling, y3);
  EXPECT_EQ(test::max_abs_diff(y, y3), 0.0);
}

TEST(Lora, MultiSlotWithBaseAndMissingAdapters) {
  std::mt19937_64 rng(test::test_seed(302));
  const int64_t in = 24, out = 10;
  const Tensor w = test::random_normal({out, in}, rng, 0.3f);
  const LoraFactors f0 = random_lora(rng, 1, 1, 3, in, out, 2.0f);
  const LoraFactors f1 = random_lora(rng, 1, 1, 7, in, out, 0.5f);
  const LoraFactors undefined_factors;
  const std::vector<const LoraFactors*> adapters = {&f0, &f1, nullptr, &undefined_factors};
  const std::vector<int32_t> slot = {-1, 0, 1, 2, 3, 0, -1, 1, 1};
  const int64_t tokens = static_cast<int64_t>(slot.size());
  const Tensor x = test::random_normal({tokens, in}, rng);
  const Tensor base = ops::linear_ref(x, w);
  Tensor y = base.clone();
  ops::lora_add_slots_ref(x, slot, adapters, y);
  const Tensor with0 = ops::linear_ref(x, merged(w, &f0, 0));
  const Tensor with1 = ops::linear_ref(x, merged(w, &f1, 0));
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] == 0 || slot[t] == 1) {
      const Tensor& ref = slot[t] == 0 ? with0 : with1;
      for (int64_t o = 0; o < out; ++o)
        EXPECT_NEAR(y.data<float>()[t * out + o], ref.data<float>()[t * out + o], 1e-5)
            << "token " << t;
      EXPECT_FALSE(rows_bitwise_equal(y, t, base, t)) << "token " << t << " got no delta";
    } else {
      EXPECT_TRUE(rows_bitwise_equal(y, t, base, t))
          << "token " << t << " (slot " << slot[t] << ") changed";
    }
  }
}

TEST(Lora, ErrorsNameTheProblem) {
  std::mt19937_64 rng(test::test_seed(303));
  const Tensor x = test::random_normal({3, 8}, rng);
  Tensor y = Tensor::zeros(DType::kF32, {3, 5});
  const LoraFactors good = random_lora(rng, 1, 1, 2, 8, 5, 1.0f);
  const LoraFactors wrong_in = random_lora(rng, 1, 1, 2, 9, 5, 1.0f);
  const LoraFactors wrong_out = random_lora(rng, 1, 1, 2, 8, 6, 1.0f);
  LoraFactors wrong_rank = good;
  wrong_rank.b = test::random_normal({1, 5, 3}, rng);
  EXPECT_ERROR_MENTIONS(ops::lora_add_slots_ref(x, {0, 2, -1}, {&good, &good}, y), "token 1",
                        "is 2");
  EXPECT_ERROR_MENTIONS(ops::lora_add_slots_ref(x, {0, -2, -1}, {&good}, y), "token 1", "-2");
  EXPECT_ERROR_MENTIONS(ops::lora_add_slots_ref(x, {0, -1}, {&good}, y), "2 entries", "3 tokens");
  EXPECT_ERROR_MENTIONS(ops::lora_add_slots_ref(x, {-1, 1, -1}, {&good, &wrong_in}, y), "slot 1",
                        "9", "8");
  EXPECT_ERROR_MENTIONS(ops::lora_add_slots_ref(x, {0, 0, 0}, {&wrong_out}, y), "output features",
                        "6", "5");
  EXPECT_ERROR_MENTIONS(ops::lora_add_ref(x, wrong_rank.a, wrong_rank.b, 1.0f, y), "rank 3",
                        "rank 2");
  // An adapter referenced by no token is not touched (and not an error to be malformed).
  EXPECT_NO_THROW(ops::lora_add_slots_ref(x, {-1, -1, -1}, {&wrong_in}, y));
}

}  // namespace
}  // namespace moelora
