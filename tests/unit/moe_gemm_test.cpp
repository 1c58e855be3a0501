// CPU reference of the grouped FP8 expert GEMM (ops/gemm/moe_gemm.h) and the pure kernel-selection
// functions of the GPU paths.
#include <gtest/gtest.h>

#include <random>

#include "ops/gemm/moe_gemm.h"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora {
namespace {

TEST(MoeGemmFp8Ref, MatchesDequantizedDenseProductPerExpert) {
  std::mt19937_64 rng(test::test_seed(5));
  const int E = 3, N = 130, K = 256, rows = 4;
  Tensor w = test::random_normal({E * N, K}, rng, 0.1f);
  Tensor weight = Tensor::empty(DType::kF8E4M3, {E, N, K});
  Tensor wscale = Tensor::empty(DType::kF32, {E, 2, 2});
  std::vector<Tensor> deq;
  for (int e = 0; e < E; ++e) {
    auto q = ops::quantize_fp8_block_ref(w.slice0(e * N, (e + 1) * N));
    std::memcpy(weight.data<uint8_t>() + e * N * K, q.q.raw_data(), q.q.nbytes());
    std::memcpy(wscale.data<float>() + e * 4, q.scale_inv.raw_data(), q.scale_inv.nbytes());
    deq.push_back(ops::dequant_fp8_block_ref(q.q, q.scale_inv));
  }
  auto xq = ops::quantize_fp8_per_token_ref(test::random_normal({rows, K}, rng));
  Tensor x = ops::dequant_fp8_per_token_ref(xq);
  ops::MoeGemmFp8Ref args{xq.q, xq.scale, weight, wscale, {0, 2, 2, 5}, {3, 0, 1, 1, 2}};
  Tensor out = ops::moe_gemm_fp8_ref(args);
  ASSERT_EQ(out.shape(), (Shape{5, N}));
  const int expert_of[5] = {0, 0, 2, 2, 2};
  for (int q = 0; q < 5; ++q)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k)
        acc += double(x.item_f32(args.gather[q] * K + k)) * deq[expert_of[q]].item_f32(n * K + k);
      ASSERT_NEAR(out.item_f32(q * N + n), acc, 1e-4 * (1 + std::fabs(acc))) << q << "," << n;
    }
}

TEST(MoeGemmFp8Ref, RejectsBadShapes) {
  Tensor act = Tensor::zeros(DType::kF8E4M3, {2, 100});
  ops::MoeGemmFp8Ref args{act, Tensor::zeros(DType::kF32, {2, 1}), Tensor::zeros(DType::kF8E4M3, {1, 16, 100}),
                          Tensor::zeros(DType::kF32, {1, 1, 1}), {0, 2}, {}};
  try {
    ops::moe_gemm_fp8_ref(args);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("K = 100"), std::string::npos) << e.what();
  }
}

TEST(MoeGemmHeuristics, DecodeConfigIsValid) {
  for (int n : {16, 200, 1024, 4096})
    for (int k : {128, 512, 2048, 7168})
      for (int active : {1, 8, 256})
        for (int tokens : {1, 8, 9, 16, 17, 128}) {
          auto c = ops::choose_decode_gemm_config(n, k, active, tokens, 132);
          EXPECT_EQ(c.warps_n * c.warps_k, 8);
          EXPECT_LE(c.warps_k, std::max(1, k / 128));
          EXPECT_EQ(c.token_subtiles, tokens <= 8 ? 1 : tokens <= 16 ? 2 : 4);
        }
}
TEST(MoeGemmHeuristics, DecodeWhileFewTokensPerExpert) {
  EXPECT_TRUE(ops::should_use_decode_gemm(1, 8, 256));
  EXPECT_TRUE(ops::should_use_decode_gemm(128, 8, 256));
  EXPECT_TRUE(ops::should_use_decode_gemm(128, 8, 48));   // 21 tokens per expert
  EXPECT_FALSE(ops::should_use_decode_gemm(4096, 8, 256));
  EXPECT_FALSE(ops::should_use_decode_gemm(512, 8, 48));
}

}  // namespace
}  // namespace moelora
