// Sm90 expert GEMV kernels (ops/moe_gemv: the up kernel = GEMM1 + SwiGLU per (token, expert)
// pair, the down kernel = GEMM2 + the routing-weighted sum + the shared expert) against their CPU
// reference moe_gemv.h on random FP8 experts: each kernel on its own (the down kernel fed the up
// kernel's bf16 output, which the up kernel's last CTA per expert quantizes), the chain end to
// end, padding tokens and pairs without an expert left untouched, the per-expert tickets back at
// zero after every launch, shapes whose K blocks split unevenly over the CTA's warps, more than 256
// experts, 256 pairs (8 tokens x top-32), bitwise determinism, and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>

#include "gpu/gpu_test_util.cuh"
#include "ops/linear/linear.h"
#include "ops/moe_gemv/moe_gemv.h"
#include "ops/moe_gemv/moe_gemv_cuda.cuh"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

constexpr uint16_t kSentinel = 0x7fc1;  // a bf16 NaN no kernel writes

Tensor bf16_round(const Tensor& t) {
  return t.to(DType::kBF16).to_f32();
}

// FP8 codes and block scales of E random [rows, cols] matrices.
void quantize_stack(int E, int rows, int cols, std::mt19937_64& rng, Tensor& q, Tensor& scale) {
  q = Tensor::empty(DType::kF8E4M3, {E, rows, cols});
  scale = Tensor::empty(DType::kF32, {E, rows / 128, cols / 128});
  for (int e = 0; e < E; ++e) {
    Tensor w = test::random_normal({rows, cols}, rng, 1.0f / std::sqrt(static_cast<float>(cols)));
    auto qb = ops::quantize_fp8_block_ref(w);
    std::memcpy(q.data<uint8_t>() + static_cast<size_t>(e) * rows * cols, qb.q.raw_data(),
                qb.q.nbytes());
    std::memcpy(scale.data<float>() + static_cast<size_t>(e) * qb.scale_inv.numel(),
                qb.scale_inv.raw_data(), qb.scale_inv.nbytes());
  }
}

struct Case {
  int tokens, valid, top_k, experts, hidden, inter;
  bool shared;
};

struct Fixture {
  Case c;
  ops::MoeGemvWeightsRef w;
  Tensor x;                  // F32 [T, H], bf16 values
  std::vector<int32_t> ids;  // [T * k], -1 for padding tokens
  Tensor weights;            // F32 [T, k]
  Tensor shared, gate;       // F32 [T, H] / [1, H], bf16 values (shared cases)
};

Fixture make_fixture(const Case& c, std::mt19937_64& rng) {
  Fixture f;
  f.c = c;
  quantize_stack(c.experts, 2 * c.inter, c.hidden, rng, f.w.w13, f.w.w13_scale);
  quantize_stack(c.experts, c.hidden, c.inter, rng, f.w.w2, f.w.w2_scale);
  f.x = bf16_round(test::random_normal({c.tokens, c.hidden}, rng));
  f.ids.assign(static_cast<size_t>(c.tokens) * c.top_k, -1);
  f.weights = Tensor::zeros(DType::kF32, {c.tokens, c.top_k});
  std::vector<int32_t> perm(c.experts);
  std::iota(perm.begin(), perm.end(), 0);
  std::uniform_real_distribution<float> w01(0.05f, 1.0f);
  for (int t = 0; t < c.valid; ++t) {
    // Token 1 shares its first experts with token 0, so some experts serve several tokens.
    if (t != 1) std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < c.top_k; ++j) {
      f.ids[t * c.top_k + j] = perm[j];
      f.weights.data<float>()[t * c.top_k + j] = w01(rng);
    }
  }
  if (c.shared) {
    f.shared = bf16_round(test::random_normal({c.tokens, c.hidden}, rng));
    f.gate = bf16_round(
        test::random_normal({1, c.hidden}, rng, 1.0f / std::sqrt(static_cast<float>(c.hidden))));
  }
  return f;
}

double row_rel_error(const Tensor& got, const Tensor& want, int64_t row) {
  const int64_t n = got.dim(1);
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = double(got.item_f32(row * n + i)) - want.item_f32(row * n + i);
    num += d * d;
    den += double(want.item_f32(row * n + i)) * want.item_f32(row * n + i);
  }
  return std::sqrt(num / (den + 1e-30));
}

struct GpuResult {
  std::vector<uint16_t> act, out;  // raw bf16
};

class Sm90_MoeGemv : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0 || cuda::device_info(0).sm_major < 9)
      GTEST_SKIP() << "needs an sm_90 device";
    stream_ = std::make_unique<cuda::Stream>();  // not a member object: no stream without a device
  }

  GpuResult run(const Fixture& f) {
    const Case& c = f.c;
    auto ids = upload_vector(f.ids);
    auto tw = cuda::to_device(f.weights);
    auto count = upload_vector(std::vector<int32_t>{c.valid});
    auto x = cuda::to_device(f.x.to(DType::kBF16));
    // x's codes as the route kernel writes them (quant.h's per-token groups; tested bitwise there)
    const auto xq = ops::quantize_fp8_per_token_ref(f.x);
    auto xq_d = cuda::to_device(xq.q), sx_d = cuda::to_device(xq.scale);
    cuda::DeviceBuffer aq(static_cast<size_t>(c.tokens) * c.top_k * c.inter),
        sa(static_cast<size_t>(c.tokens) * c.top_k * (c.inter / 128) * 4);
    auto tickets = upload_vector(std::vector<int32_t>(ops::cuda::kMoeGemvMaxTickets, 0));
    auto w13 = cuda::to_device(f.w.w13), w13s = cuda::to_device(f.w.w13_scale);
    auto w2 = cuda::to_device(f.w.w2), w2s = cuda::to_device(f.w.w2_scale);
    const size_t act_n = static_cast<size_t>(c.tokens) * c.top_k * c.inter,
                 out_n = static_cast<size_t>(c.tokens) * c.hidden;
    auto act = upload_vector(std::vector<uint16_t>(act_n, kSentinel));
    auto out = upload_vector(std::vector<uint16_t>(out_n, kSentinel));
    cuda::DeviceBuffer shared, gate;
    ops::cuda::MoeGemvArgs a;
    if (c.shared) {
      shared = cuda::to_device(f.shared.to(DType::kBF16));
      gate = cuda::to_device(f.gate.to(DType::kBF16));
      a.shared = shared.as<__nv_bfloat16>();
      a.shared_gate = gate.as<__nv_bfloat16>();
    }
    a.topk_ids = ids.as<int32_t>();
    a.topk_weights = tw.as<float>();
    a.num_tokens = count.as<int32_t>();
    a.tokens = c.tokens;
    a.top_k = c.top_k;
    a.num_experts = c.experts;
    a.hidden = c.hidden;
    a.inter = c.inter;
    a.x = x.as<__nv_bfloat16>();
    a.xq = xq_d.as<uint8_t>();
    a.sx = sx_d.as<float>();
    a.aq = aq.as<uint8_t>();
    a.sa = sa.as<float>();
    a.tickets = tickets.as<int32_t>();
    a.w13 = w13.as<uint8_t>();
    a.w13_scale = w13s.as<float>();
    a.act = act.as<__nv_bfloat16>();
    a.w2 = w2.as<uint8_t>();
    a.w2_scale = w2s.as<float>();
    a.out = out.as<__nv_bfloat16>();
    a.prefetch_experts = 2;
    a.num_sms = num_sms_;
    a.pdl = true;  // as in the layer: both programmatic dependents of the previous kernel
    ops::cuda::launch_moe_gemv_up(a, stream_->get());
    ops::cuda::launch_moe_gemv_down(a, stream_->get());
    stream_->synchronize();
    for (int32_t t : download_vector<int32_t>(tickets, ops::cuda::kMoeGemvMaxTickets))
      EXPECT_EQ(t, 0) << "the up kernel left a ticket counter non-zero";
    return {download_vector<uint16_t>(act, act_n), download_vector<uint16_t>(out, out_n)};
  }

  // Runs the case and checks both kernels against the reference; the raw result to `result`.
  void check(const Case& c, uint64_t seed, GpuResult* result = nullptr) {
    std::mt19937_64 rng(test::test_seed(seed));
    const Fixture f = make_fixture(c, rng);
    const GpuResult r = run(f);
    if (result) *result = r;
    const int P = c.tokens * c.top_k;
    const Tensor want_act = ops::moe_gemv_up_ref(f.x, f.ids, c.top_k, f.w);
    Tensor got_act = Tensor::empty(DType::kF32, {P, c.inter});
    for (int p = 0; p < P; ++p) {
      for (int i = 0; i < c.inter; ++i) {
        const uint16_t bits = r.act[static_cast<size_t>(p) * c.inter + i];
        if (f.ids[p] < 0) {
          ASSERT_EQ(bits, kSentinel)
              << "pair " << p << " has no expert but its act row was written";
          got_act.data<float>()[p * c.inter + i] = 0.f;
        } else {
          got_act.data<float>()[p * c.inter + i] = bf16_bits_to_f32(bits);
        }
      }
      // x is quantized as the reference does (same codes); h sums in another order; act is bf16
      if (f.ids[p] >= 0)
        EXPECT_LT(row_rel_error(got_act, want_act, p), 4e-3) << "act of pair " << p;
    }
    // The down kernel against the reference fed the up kernel's own (bf16) output.
    Tensor want_out = ops::moe_gemv_down_ref(got_act, f.ids, f.weights, f.w);
    // End to end against the reference chain (bf16 act rounding may flip FP8 codes of act).
    Tensor want_chain = ops::moe_gemv_down_ref(want_act, f.ids, f.weights, f.w);
    if (c.shared) {
      for (int t = 0; t < c.tokens; ++t) {
        const float g = 1.f / (1.f + std::exp(-ops::dot_f32(f.x.data<float>() + t * c.hidden,
                                                            f.gate.data<float>(), c.hidden)));
        for (int h = 0; h < c.hidden; ++h) {
          want_out.data<float>()[t * c.hidden + h] += g * f.shared.data<float>()[t * c.hidden + h];
          want_chain.data<float>()[t * c.hidden + h] +=
              g * f.shared.data<float>()[t * c.hidden + h];
        }
      }
    }
    Tensor got_out = Tensor::zeros(DType::kF32, {c.tokens, c.hidden});
    for (int t = 0; t < c.tokens; ++t) {
      for (int h = 0; h < c.hidden; ++h) {
        const uint16_t bits = r.out[static_cast<size_t>(t) * c.hidden + h];
        if (t >= c.valid) {
          ASSERT_EQ(bits, kSentinel) << "padding token " << t << " got an output";
        } else {
          got_out.data<float>()[t * c.hidden + h] = bf16_bits_to_f32(bits);
        }
      }
      if (t >= c.valid) continue;
      EXPECT_LT(row_rel_error(got_out, want_out, t), 4e-3) << "out of token " << t;
      EXPECT_LT(row_rel_error(got_out, want_chain, t), 2e-2)
          << "out of token " << t << " (whole chain)";
    }
  }

  std::unique_ptr<cuda::Stream> stream_;
  int num_sms_ = 0;  // the up kernel's persistent grid: 0 = one CTA per item
};

// Qwen3.5-like routing (top-8 of 64), one token: the batch's decode step at B = 1.
TEST_F(Sm90_MoeGemv, OneTokenTop8) {
  check({1, 1, 8, 64, 512, 256, false}, 801);
}

// H = 640 and I = 384: 5 and 3 K blocks over 4 warps (one down warp has none); 5 tokens, the
// last a padding token of a captured batch (ids -1, not counted in num_tokens).
TEST_F(Sm90_MoeGemv, UnevenBlocksAndPaddingToken) {
  check({5, 4, 4, 12, 640, 384, false}, 802);
}

// 384 experts (12 mask words), 8 tokens, gated shared expert added by the down kernel.
TEST_F(Sm90_MoeGemv, KimiExpertCountEightTokensGatedShared) {
  check({8, 8, 8, 384, 256, 128, true}, 803);
}

// 8 tokens x top-32 of 40 experts: the largest pair count (256), most experts shared by every
// token.
TEST_F(Sm90_MoeGemv, TwoHundredFiftySixPairs) {
  check({8, 8, 32, 40, 128, 128, false}, 804);
}

// The up kernel's persistent grid on 3 "SMs" (6 CTAs, each looping over many (tile, expert)
// items, its ring streaming across item boundaries) equals the one-CTA-per-item grid bitwise.
TEST_F(Sm90_MoeGemv, PersistentUpGridMatchesOneCtaPerItem) {
  const Case c{6, 6, 4, 24, 384, 256, false};
  GpuResult wide, narrow;
  check(c, 806, &wide);
  num_sms_ = 3;
  check(c, 806, &narrow);
  EXPECT_EQ(wide.act, narrow.act);
  EXPECT_EQ(wide.out, narrow.out);
}

TEST_F(Sm90_MoeGemv, DeterministicBitwise) {
  const Case c{7, 7, 6, 48, 384, 256, true};
  GpuResult a, b;
  check(c, 805, &a);
  check(c, 805, &b);
  EXPECT_EQ(a.act, b.act);
  EXPECT_EQ(a.out, b.out);
}

// Host-side checks only: runs without a device.
TEST(MoeGemvArgs, RefusesArgumentsOutsideItsRange) {
  ops::cuda::MoeGemvArgs a;
  int32_t dummy = 0;
  float fdummy = 0;
  a.topk_ids = &dummy;
  a.topk_weights = &fdummy;
  a.tokens = 1;
  a.top_k = 8;
  a.num_experts = 64;
  a.hidden = 256;
  a.inter = 128;
  EXPECT_NO_THROW(ops::cuda::check_moe_gemv_args(a));
  auto refused = [&](ops::cuda::MoeGemvArgs b, const char* part) {
    const std::string msg = test::error_message([&] { ops::cuda::check_moe_gemv_args(b); },
                                                ErrorCode::kInvalidArgument);
    EXPECT_TRUE(test::contains(msg, part)) << msg;
  };
  auto b = a;
  b.tokens = 9;
  refused(b, "tokens = 9");
  b = a;
  b.hidden = 200;
  refused(b, "H = 200");
  b = a;
  b.inter = 96;
  refused(b, "I = 96");
  b = a;
  b.num_experts = 2000;
  refused(b, "num_experts = 2000");
  b = a;
  b.top_k = 33;
  refused(b, "top_k = 33");
  b = a;
  b.topk_ids = nullptr;
  refused(b, "topk_ids");
}

}  // namespace
}  // namespace moelora
