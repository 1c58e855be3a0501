// The expert GEMV reference (ops/moe_gemv): the up and down GEMVs chained equal the routed
// experts of the MoE layer reference (moe_forward_ref with FP8 activations, no shared expert, no
// LoRA) fed the dequantized weights; pairs without an expert give zero rows and add nothing;
// bad shapes and ids are refused with messages that name them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/moe/moe.h"
#include "ops/moe_gemv/moe_gemv.h"
#include "ops/quant/quant.h"
#include "ops/route/route.h"
#include "support/test_support.h"

namespace moelora {
namespace {

// E random FP8 [rows, cols] matrices: codes and scales for the GEMV reference, their dequantized
// values for the layer reference.
void quantize_stack(int E, int rows, int cols, std::mt19937_64& rng, Tensor& q, Tensor& scale,
                    Tensor& deq) {
  q = Tensor::empty(DType::kF8E4M3, {E, rows, cols});
  scale = Tensor::empty(DType::kF32, {E, rows / 128, cols / 128});
  deq = Tensor::empty(DType::kF32, {E, rows, cols});
  for (int e = 0; e < E; ++e) {
    Tensor w = test::random_normal({rows, cols}, rng, 1.0f / std::sqrt(static_cast<float>(cols)));
    auto qb = ops::quantize_fp8_block_ref(w);
    Tensor d = ops::dequant_fp8_block_ref(qb.q, qb.scale_inv);
    std::memcpy(q.data<uint8_t>() + static_cast<size_t>(e) * rows * cols, qb.q.raw_data(),
                qb.q.nbytes());
    std::memcpy(scale.data<float>() + static_cast<size_t>(e) * qb.scale_inv.numel(),
                qb.scale_inv.raw_data(), qb.scale_inv.nbytes());
    std::memcpy(deq.data<float>() + static_cast<size_t>(e) * rows * cols, d.raw_data(), d.nbytes());
  }
}

struct Layer {
  ops::MoeGemvWeightsRef gemv;
  ops::MoeWeightsRef ref;
  ops::MoeParams params;
};

Layer make_layer(int E, int k, int H, int I, std::mt19937_64& rng) {
  Layer l;
  quantize_stack(E, 2 * I, H, rng, l.gemv.w13, l.gemv.w13_scale, l.ref.w13);
  quantize_stack(E, H, I, rng, l.gemv.w2, l.gemv.w2_scale, l.ref.w2);
  l.params.hidden = H;
  l.params.intermediate = I;
  l.params.route.kind = RouterKind::kSoftmaxTopK;
  l.params.route.num_experts = E;
  l.params.route.top_k = k;
  l.params.route.renormalize = true;
  l.params.fp8_activations = true;
  return l;
}

std::vector<int32_t> to_ids(const Tensor& t) {
  std::vector<int32_t> ids(static_cast<size_t>(t.numel()));
  std::memcpy(ids.data(), t.raw_data(), ids.size() * sizeof(int32_t));
  return ids;
}

TEST(MoeGemvRef, ChainEqualsRoutedExpertsOfTheLayerReference) {
  std::mt19937_64 rng(test::test_seed(901));
  const int E = 6, k = 2, H = 256, I = 256, T = 3;
  Layer l = make_layer(E, k, H, I, rng);
  const Tensor x = test::random_normal({T, H}, rng);
  const Tensor logits = test::random_normal({T, E}, rng, 3.0f);
  const ops::RouteResult route = ops::route_ref(logits, Tensor(), l.params.route, Tensor());
  const std::vector<int32_t> ids = to_ids(route.ids);
  const Tensor got =
      ops::moe_gemv_down_ref(ops::moe_gemv_up_ref(x, ids, k, l.gemv), ids, route.weights, l.gemv);
  const Tensor want =
      ops::moe_forward_ref(x, std::vector<int32_t>(T, -1), l.ref, {}, l.params, nullptr, logits);
  // Same FP8 codes of x, h summed per 128-column block instead of in one run: the act values
  // differ in the last bits, which can move an act code across a rounding boundary.
  EXPECT_LT(test::max_abs_diff(got, want), 1e-3);
  EXPECT_GE(test::cosine_similarity(got, want), 0.999999);
}

TEST(MoeGemvRef, PairsWithoutAnExpertAreZeroAndAddNothing) {
  std::mt19937_64 rng(test::test_seed(902));
  const int E = 4, k = 2, H = 128, I = 128, T = 2;
  Layer l = make_layer(E, k, H, I, rng);
  const Tensor x = test::random_normal({T, H}, rng);
  const std::vector<int32_t> ids = {3, -1, -1, -1};  // token 1 is a padding token
  const Tensor weights = Tensor::from_f32({0.7f, 0.3f, 0.f, 0.f}, {T, k});
  const Tensor act = ops::moe_gemv_up_ref(x, ids, k, l.gemv);
  for (int p = 1; p < 4; ++p)
    for (int i = 0; i < I; ++i) ASSERT_EQ(act.item_f32(p * I + i), 0.f) << "pair " << p;
  const Tensor out = ops::moe_gemv_down_ref(act, ids, weights, l.gemv);
  for (int h = 0; h < H; ++h) ASSERT_EQ(out.item_f32(H + h), 0.f);
  // token 0 = 0.7 * its one expert's output: the same as the chain with weight 1, scaled
  const Tensor one =
      ops::moe_gemv_down_ref(act, ids, Tensor::from_f32({1.f, 0.f, 0.f, 0.f}, {T, k}), l.gemv);
  for (int h = 0; h < H; ++h) EXPECT_NEAR(out.item_f32(h), 0.7f * one.item_f32(h), 1e-5f);
}

TEST(MoeGemvRef, RefusesBadShapesAndIds) {
  std::mt19937_64 rng(test::test_seed(903));
  Layer l = make_layer(4, 2, 128, 128, rng);
  const std::vector<int32_t> ids = {0, 1};
  auto mentions = [](const std::function<void()>& fn, const char* part) {
    const std::string msg = test::error_message(fn);
    EXPECT_TRUE(test::contains(msg, part)) << "'" << part << "' not in: " << msg;
  };
  mentions(
      [&] {
        ops::moe_gemv_up_ref(test::random_normal({1, 200}, rng), ids, 2, l.gemv);
      },
      "H = 200");
  mentions(
      [&] {
        ops::moe_gemv_up_ref(test::random_normal({1, 128}, rng), {0, 9}, 2, l.gemv);
      },
      "ids[1] = 9");
  mentions(
      [&] {
        ops::moe_gemv_up_ref(test::random_normal({1, 128}, rng), {0}, 2, l.gemv);
      },
      "ids has 1 entries, expected T * k = 2");
  mentions(
      [&] {
        ops::moe_gemv_up_ref(test::random_normal({1, 256}, rng), ids, 2, l.gemv);
      },
      "w13");
  mentions(
      [&] {
        ops::moe_gemv_down_ref(Tensor::zeros(DType::kF32, {3, 128}), ids,
                               Tensor::zeros(DType::kF32, {1, 2}), l.gemv);
      },
      "a has 3 rows, expected T * k = 2");
}

}  // namespace
}  // namespace moelora
