// Attention-side references: embedding lookup, RMSNorm (both styles, per-head use), causal GQA
// attention with a KV cache, gated attention output, and MLA (un-absorbed against plain attention,
// absorbed against un-absorbed, transformers' de-interleaved RoPE layout against in-place pairs).
// The oracles here are written independently in double precision from the formulas in the headers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "ops/attention/attention.h"
#include "ops/embedding/embedding.h"
#include "ops/linear/linear.h"
#include "ops/mla/mla.h"
#include "ops/norm/norm.h"
#include "ops/rope/rope.h"
#include "support/test_support.h"

namespace moelora::ops {
namespace {

using test::all_close;
using test::random_normal;
using test::test_seed;

// Runs fn, expects a moelora::Error whose message contains every one of `needles`.
template <typename Fn>
void expect_error(Fn&& fn, ErrorCode code, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected a moelora::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

// ---- embedding ---------------------------------------------------------------------------------

TEST(Embedding, CopiesRowsFromF32AndBf16Tables) {
  std::mt19937_64 rng(test_seed(2001));
  const int64_t vocab = 37, hidden = 13;
  const Tensor table = random_normal({vocab, hidden}, rng);
  const Tensor table_bf16 = table.to(DType::kBF16);
  const std::vector<int32_t> ids = {5, 0, 36, 5, 17};
  const Tensor out = embedding_ref(table, Tensor::from_i32(ids, {5}));
  const Tensor out_bf16 = embedding_ref(table_bf16, ids);
  ASSERT_EQ(out.shape(), (Shape{5, hidden}));
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t h = 0; h < hidden; ++h) {
      EXPECT_EQ(out.data<float>()[t * hidden + h], table.data<float>()[ids[t] * hidden + h]);
      EXPECT_EQ(out_bf16.data<float>()[t * hidden + h],
                round_to_bf16(table.data<float>()[ids[t] * hidden + h]));
    }
  }
  // I64 ids give the same rows.
  Tensor wide = Tensor::empty(DType::kI64, {5});
  for (size_t t = 0; t < ids.size(); ++t) wide.data<int64_t>()[t] = ids[t];
  EXPECT_TRUE(all_close(embedding_ref(table, wide), out, 0, 0));
  EXPECT_EQ(embedding_ref(table, std::vector<int32_t>{}).shape(), (Shape{0, hidden}));
}

TEST(Embedding, OutOfRangeIdNamesTheIdAndVocab) {
  const Tensor table = Tensor::zeros(DType::kF32, {37, 4});
  expect_error(
      [&] {
        embedding_ref(table, std::vector<int32_t>{1, 37});
      },
      ErrorCode::kOutOfRange, {"token id 37", "position 1", "vocab size 37"});
  expect_error([&] { embedding_ref(table, std::vector<int32_t>{-3}); }, ErrorCode::kOutOfRange,
               {"token id -3", "vocab size 37"});
  Tensor wide = Tensor::empty(DType::kI64, {1});
  wide.data<int64_t>()[0] = int64_t{1} << 40;  // not truncated to 32 bits in the message
  expect_error([&] { embedding_ref(table, wide); }, ErrorCode::kOutOfRange, {"token id 1099511627776", "37"});
  expect_error([&] { embedding_ref(Tensor::zeros(DType::kF32, {37}), std::vector<int32_t>{0}); },
               ErrorCode::kInvalidArgument, {"embedding table"});
  expect_error([&] { embedding_ref(table, Tensor::zeros(DType::kF32, {2})); }, ErrorCode::kInvalidArgument,
               {"embedding ids"});
}

// ---- RMSNorm -----------------------------------------------------------------------------------

// Double-precision RMSNorm of each row of x [rows, D].
std::vector<double> norm_oracle(const Tensor& x, const Tensor& w, double eps, NormStyle style) {
  const int64_t dim = x.dim(-1), rows = x.numel() / dim;
  std::vector<double> y(static_cast<size_t>(x.numel()));
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t d = 0; d < dim; ++d) ms += double(x.item_f32(r * dim + d)) * x.item_f32(r * dim + d);
    const double inv = 1.0 / std::sqrt(ms / dim + eps);
    for (int64_t d = 0; d < dim; ++d) {
      const double wd = w.item_f32(d);
      y[r * dim + d] = x.item_f32(r * dim + d) * inv * (style == NormStyle::kWeight ? wd : 1.0 + wd);
    }
  }
  return y;
}

TEST(RmsNorm, BothStylesMatchTheFormula) {
  std::mt19937_64 rng(test_seed(2101));
  for (NormStyle style : {NormStyle::kWeight, NormStyle::kOnePlusWeight}) {
    for (DType wdt : {DType::kF32, DType::kBF16}) {
      const Tensor x = random_normal({7, 33}, rng, 3.0f);
      const Tensor w = random_normal({33}, rng, 0.5f).to(wdt);
      const RmsNormParams params{1e-5, style};
      const Tensor y = rms_norm_ref(x, w, params);
      const std::vector<double> ref = norm_oracle(x, w, 1e-5, style);
      ASSERT_EQ(y.shape(), x.shape());
      for (int64_t i = 0; i < y.numel(); ++i)
        EXPECT_NEAR(y.data<float>()[i], ref[i], 1e-6 + 1e-6 * std::fabs(ref[i]));
    }
  }
}

TEST(RmsNorm, OnePlusWeightWithZeroWeightIsPlainNormAndStylesDiffer) {
  std::mt19937_64 rng(test_seed(2102));
  const Tensor x = random_normal({3, 16}, rng);
  const Tensor zeros = Tensor::zeros(DType::kF32, {16});
  const Tensor ones = Tensor::from_f32(std::vector<float>(16, 1.0f), {16});
  EXPECT_TRUE(all_close(rms_norm_ref(x, zeros, {1e-6, NormStyle::kOnePlusWeight}),
                        rms_norm_ref(x, ones, {1e-6, NormStyle::kWeight}), 0, 0));
  const Tensor w = random_normal({16}, rng);
  EXPECT_GT(test::max_abs_diff(rms_norm_ref(x, w, {1e-6, NormStyle::kOnePlusWeight}),
                               rms_norm_ref(x, w, {1e-6, NormStyle::kWeight})),
            0.1);
}

TEST(RmsNorm, EpsMattersForSmallInputs) {
  // mean(x^2) = 1e-6 here: eps 1e-6 halves the variance's reciprocal, so y = x / sqrt(2e-6).
  const Tensor x = Tensor::from_f32({1e-3f, -1e-3f, 1e-3f, -1e-3f}, {1, 4});
  const Tensor w = Tensor::from_f32({1, 1, 1, 1}, {4});
  const Tensor y = rms_norm_ref(x, w, {1e-6, NormStyle::kWeight});
  EXPECT_NEAR(y.data<float>()[0], 1e-3 / std::sqrt(2e-6), 1e-5);
  EXPECT_NEAR(y.data<float>()[1], -1e-3 / std::sqrt(2e-6), 1e-5);
}

TEST(RmsNorm, PerHeadNormIsRowNormOfTheReshapedInput) {
  // Qwen3 q_norm: x [T, heads, head_dim] with w [head_dim] normalizes each head on its own.
  std::mt19937_64 rng(test_seed(2103));
  const int64_t tokens = 5, heads = 3, head_dim = 10;
  const Tensor q = random_normal({tokens, heads, head_dim}, rng);
  const Tensor w = random_normal({head_dim}, rng);
  const Tensor per_head = rms_norm_ref(q, w, {1e-6, NormStyle::kWeight});
  const Tensor rows = rms_norm_ref(q.reshape({tokens * heads, head_dim}), w, {1e-6, NormStyle::kWeight});
  ASSERT_EQ(per_head.shape(), q.shape());
  EXPECT_TRUE(all_close(per_head.reshape({tokens * heads, head_dim}), rows, 0, 0));
  const std::vector<double> ref = norm_oracle(q, w, 1e-6, NormStyle::kWeight);
  for (int64_t i = 0; i < q.numel(); ++i) EXPECT_NEAR(per_head.data<float>()[i], ref[i], 1e-5);
  // In place gives the same bits.
  Tensor inplace = q.clone();
  rms_norm_inplace_ref(inplace, w, {1e-6, NormStyle::kWeight});
  EXPECT_TRUE(all_close(inplace, per_head, 0, 0));
}

TEST(RmsNorm, RejectsMismatchedWeight) {
  const Tensor x = Tensor::zeros(DType::kF32, {2, 8});
  expect_error([&] { rms_norm_ref(x, Tensor::zeros(DType::kF32, {7}), {}); }, ErrorCode::kInvalidArgument,
               {"rms_norm weight", "[8]", "[7]"});
  expect_error([&] { rms_norm_ref(x.to(DType::kBF16), Tensor::zeros(DType::kF32, {8}), {}); },
               ErrorCode::kInvalidArgument, {"rms_norm input", "BF16"});
}

// ---- GQA attention -----------------------------------------------------------------------------

// Textbook attention in double: HF's repeat_kv + full score matrix + additive causal mask.
// q [T, Hq, D] at positions [S - T, S); k [S, Hkv, D]; v [S, Hkv, Dv].
Tensor attention_oracle(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  const int64_t tokens = q.dim(0), hq = q.dim(1), dim = q.dim(2);
  const int64_t positions = k.dim(0), hkv = k.dim(1), dv = v.dim(2);
  const int64_t n_rep = hq / hkv;
  Tensor out = Tensor::zeros(DType::kF32, {tokens, hq, dv});
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kvh = h / n_rep;  // repeat_kv: expanded head h is a copy of KV head h // n_rep
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t pos = positions - tokens + t;
      std::vector<double> scores(static_cast<size_t>(positions));
      double max_s = -std::numeric_limits<double>::infinity();
      for (int64_t s = 0; s < positions; ++s) {
        double dot = 0;
        for (int64_t d = 0; d < dim; ++d)
          dot += double(q.item_f32((t * hq + h) * dim + d)) * k.item_f32((s * hkv + kvh) * dim + d);
        scores[s] = s <= pos ? dot * scale : -std::numeric_limits<double>::infinity();
        max_s = std::max(max_s, scores[s]);
      }
      double sum = 0;
      for (double& sc : scores) sum += (sc = std::exp(sc - max_s));
      for (int64_t d = 0; d < dv; ++d) {
        double acc = 0;
        for (int64_t s = 0; s < positions; ++s) acc += scores[s] / sum * v.item_f32((s * hkv + kvh) * dv + d);
        out.data<float>()[(t * hq + h) * dv + d] = static_cast<float>(acc);
      }
    }
  }
  return out;
}

TEST(Attention, MatchesTextbookAttentionWithGqaAndCausalMask) {
  std::mt19937_64 rng(test_seed(2201));
  struct Case {
    int64_t tokens, positions, hq, hkv, dim, dv;
  };
  for (const Case& c :
       {Case{7, 7, 6, 2, 9, 5}, Case{3, 11, 4, 4, 8, 8}, Case{1, 13, 5, 1, 7, 3}, Case{5, 9, 6, 3, 16, 11}}) {
    SCOPED_TRACE(testing::Message() << "T " << c.tokens << " S " << c.positions << " Hq " << c.hq << " Hkv "
                                    << c.hkv);
    const Tensor q = random_normal({c.tokens, c.hq, c.dim}, rng);
    const Tensor k = random_normal({c.positions, c.hkv, c.dim}, rng);
    const Tensor v = random_normal({c.positions, c.hkv, c.dv}, rng);
    const Tensor out = attention_ref(q, k, v, {});
    EXPECT_TRUE(all_close(out, attention_oracle(q, k, v, 1.0 / std::sqrt(double(c.dim))), 1e-5f, 1e-5f));
    const Tensor scaled = attention_ref(q, k, v, {0.37f});
    EXPECT_TRUE(all_close(scaled, attention_oracle(q, k, v, 0.37f), 1e-5f, 1e-5f));
    EXPECT_GT(test::max_abs_diff(scaled, out), 1e-3) << "the scale must change the result";
  }
}

TEST(Attention, FuturePositionsAreInvisible) {
  std::mt19937_64 rng(test_seed(2202));
  const int64_t tokens = 6, hq = 4, hkv = 2, dim = 8;
  const Tensor q = random_normal({tokens, hq, dim}, rng);
  const Tensor k = random_normal({tokens, hkv, dim}, rng);
  const Tensor v = random_normal({tokens, hkv, dim}, rng);
  const Tensor base = attention_ref(q, k, v, {});
  // Overwrite K/V of position 3 onwards (keys 0: score 0, a fair share of the probability; values
  // -1000): tokens 0..2 must not change at all, the others must change a lot.
  Tensor k2 = k.clone(), v2 = v.clone();
  for (int64_t i = 3 * hkv * dim; i < k2.numel(); ++i) {
    k2.data<float>()[i] = 0.0f;
    v2.data<float>()[i] = -1000.0f;
  }
  const Tensor changed = attention_ref(q, k2, v2, {});
  const int64_t row = hq * dim;
  for (int64_t i = 0; i < 3 * row; ++i)
    EXPECT_EQ(changed.data<float>()[i], base.data<float>()[i]) << "element " << i;
  for (int64_t t = 3; t < tokens; ++t) {
    EXPECT_GT(std::fabs(changed.data<float>()[t * row] - base.data<float>()[t * row]), 1.0) << "token " << t;
  }
  // The first token sees only itself: its output is exactly V[0] of its KV head.
  for (int64_t h = 0; h < hq; ++h) {
    for (int64_t d = 0; d < dim; ++d) {
      EXPECT_EQ(base.data<float>()[h * dim + d], v.data<float>()[(h / (hq / hkv)) * dim + d]);
    }
  }
}

TEST(Attention, QueryHeadsShareKvHeadsInConsecutiveGroups) {
  // Hq = 6, Hkv = 2: heads 0-2 read KV head 0 and heads 3-5 read KV head 1 (repeat_kv), not h % 2.
  std::mt19937_64 rng(test_seed(2203));
  const int64_t tokens = 4, dim = 6;
  const Tensor q = random_normal({tokens, 6, dim}, rng);
  const Tensor k = random_normal({tokens, 2, dim}, rng);
  const Tensor v = random_normal({tokens, 2, dim}, rng);
  const Tensor out = attention_ref(q, k, v, {});
  for (int64_t h = 0; h < 6; ++h) {
    // Single-head attention of query head h against KV head h / 3 alone.
    Tensor qh = Tensor::empty(DType::kF32, {tokens, 1, dim});
    Tensor kh = Tensor::empty(DType::kF32, {tokens, 1, dim});
    Tensor vh = Tensor::empty(DType::kF32, {tokens, 1, dim});
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t d = 0; d < dim; ++d) {
        qh.data<float>()[t * dim + d] = q.data<float>()[(t * 6 + h) * dim + d];
        kh.data<float>()[t * dim + d] = k.data<float>()[(t * 2 + h / 3) * dim + d];
        vh.data<float>()[t * dim + d] = v.data<float>()[(t * 2 + h / 3) * dim + d];
      }
    }
    const Tensor single = attention_ref(qh, kh, vh, {});
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t d = 0; d < dim; ++d) {
        EXPECT_EQ(out.data<float>()[(t * 6 + h) * dim + d], single.data<float>()[t * dim + d])
            << "head " << h;
      }
    }
  }
}

TEST(Attention, IncrementalDecodeEqualsPrefill) {
  std::mt19937_64 rng(test_seed(2204));
  const int64_t tokens = 9, hq = 6, hkv = 2, dim = 12, dv = 7;
  const Tensor q = random_normal({tokens, hq, dim}, rng);
  const Tensor k = random_normal({tokens, hkv, dim}, rng);
  const Tensor v = random_normal({tokens, hkv, dv}, rng);

  KvCacheRef full(hkv, dim, dv);
  full.append(k, v);
  const Tensor prefill = attention_ref(q, full, {});

  // Prefill T - 1 tokens, then decode the last one; then decode token by token from scratch.
  KvCacheRef cache(hkv, dim, dv);
  cache.append(k.slice0(0, tokens - 1), v.slice0(0, tokens - 1));
  const Tensor first = attention_ref(q.slice0(0, tokens - 1), cache, {});
  cache.append(k.slice0(tokens - 1, tokens), v.slice0(tokens - 1, tokens));
  const Tensor last = attention_ref(q.slice0(tokens - 1, tokens), cache, {});
  EXPECT_TRUE(all_close(first, prefill.slice0(0, tokens - 1), 1e-6f, 1e-6f));
  EXPECT_TRUE(all_close(last, prefill.slice0(tokens - 1, tokens), 1e-6f, 1e-6f));

  KvCacheRef step(hkv, dim, dv);
  for (int64_t t = 0; t < tokens; ++t) {
    step.append(k.slice0(t, t + 1), v.slice0(t, t + 1));
    EXPECT_TRUE(
        all_close(attention_ref(q.slice0(t, t + 1), step, {}), prefill.slice0(t, t + 1), 1e-6f, 1e-6f))
        << "token " << t;
  }
  EXPECT_TRUE(all_close(step.keys(), k, 0, 0));
  EXPECT_TRUE(all_close(step.values(), v, 0, 0));

  // Rolling back two tokens and re-appending them reproduces the same outputs.
  step.truncate(tokens - 2);
  EXPECT_EQ(step.size(), tokens - 2);
  step.append(k.slice0(tokens - 2, tokens), v.slice0(tokens - 2, tokens));
  EXPECT_TRUE(all_close(attention_ref(q.slice0(tokens - 2, tokens), step, {}),
                        prefill.slice0(tokens - 2, tokens), 1e-6f, 1e-6f));
}

TEST(Attention, RejectsInconsistentShapes) {
  const Tensor q = Tensor::zeros(DType::kF32, {4, 6, 8});
  expect_error(
      [&] {
        attention_ref(q, Tensor::zeros(DType::kF32, {3, 2, 8}), Tensor::zeros(DType::kF32, {3, 2, 8}), {});
      },
      ErrorCode::kInvalidArgument, {"4 query tokens", "3 positions"});
  expect_error(
      [&] {
        attention_ref(q, Tensor::zeros(DType::kF32, {4, 4, 8}), Tensor::zeros(DType::kF32, {4, 4, 8}), {});
      },
      ErrorCode::kInvalidArgument, {"6 query heads", "4 KV heads"});
  expect_error(
      [&] {
        attention_ref(q, Tensor::zeros(DType::kF32, {4, 2, 7}), Tensor::zeros(DType::kF32, {4, 2, 8}), {});
      },
      ErrorCode::kInvalidArgument, {"head_dim 8", "7"});
  KvCacheRef cache(2, 8, 5);
  expect_error(
      [&] {
        cache.append(Tensor::zeros(DType::kF32, {1, 2, 8}), Tensor::zeros(DType::kF32, {1, 2, 4}));
      },
      ErrorCode::kInvalidArgument, {"values", "[1, 2, 5]", "[1, 2, 4]"});
  EXPECT_EQ(cache.size(), 0);
  EXPECT_THROW(cache.truncate(1), Error);
}

TEST(Attention, GatedOutput) {
  // q_proj output per head is [q | gate]; out *= sigmoid(gate) (Qwen3-Next / Qwen3.5).
  std::mt19937_64 rng(test_seed(2205));
  const int64_t tokens = 3, heads = 2, dim = 5;
  const Tensor proj = random_normal({tokens, heads * 2 * dim}, rng);
  const GatedQuery split = split_gated_query_ref(proj, heads, dim);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        EXPECT_EQ(split.query.data<float>()[(t * heads + h) * dim + d],
                  proj.data<float>()[t * 20 + h * 10 + d]);
        EXPECT_EQ(split.gate.data<float>()[(t * heads + h) * dim + d],
                  proj.data<float>()[t * 20 + h * 10 + 5 + d]);
      }
    }
  }
  Tensor out = random_normal({tokens, heads, dim}, rng);
  const Tensor before = out.clone();
  apply_output_gate_inplace_ref(out, split.gate);
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double g = split.gate.data<float>()[i];
    EXPECT_NEAR(out.data<float>()[i], before.data<float>()[i] / (1.0 + std::exp(-g)), 1e-6);
  }
  EXPECT_THROW(split_gated_query_ref(proj, heads, 4), Error);
  EXPECT_THROW(apply_output_gate_inplace_ref(out, Tensor::zeros(DType::kF32, {3})), Error);
}

// ---- MLA ---------------------------------------------------------------------------------------

// Odd sizes on purpose: n 3 heads, nope 10, rope 6, dv 7, kv_lora_rank 11.
MlaDims small_mla_dims() {
  return MlaDims{3, 10, 6, 7, 11};
}

// Un-absorbed MLA equals plain multi-head attention with key = [k_nope | k_rope broadcast].
TEST(Mla, UnabsorbedEqualsAttentionOnConcatenatedKeys) {
  std::mt19937_64 rng(test_seed(2301));
  const MlaDims d = small_mla_dims();
  const int64_t tokens = 4, positions = 9, qk = d.qk_head_dim();
  const Tensor q = random_normal({tokens, d.num_heads, qk}, rng);
  const Tensor k_nope = random_normal({positions, d.num_heads, d.qk_nope_head_dim}, rng);
  const Tensor k_rope = random_normal({positions, d.qk_rope_head_dim}, rng);
  const Tensor v = random_normal({positions, d.num_heads, d.v_head_dim}, rng);
  Tensor key = Tensor::empty(DType::kF32, {positions, d.num_heads, qk});
  for (int64_t s = 0; s < positions; ++s) {
    for (int64_t h = 0; h < d.num_heads; ++h) {
      float* dst = key.data<float>() + (s * d.num_heads + h) * qk;
      for (int64_t i = 0; i < d.qk_nope_head_dim; ++i)
        dst[i] = k_nope.data<float>()[(s * d.num_heads + h) * 10 + i];
      for (int64_t i = 0; i < d.qk_rope_head_dim; ++i) dst[10 + i] = k_rope.data<float>()[s * 6 + i];
    }
  }
  const float scale = 0.23f;
  const Tensor mla = mla_attention_ref(q, k_nope, k_rope, v, {d, scale});
  EXPECT_TRUE(all_close(mla, attention_oracle(q, key, v, scale), 1e-5f, 1e-5f));
  // Default scale is qk_head_dim^-0.5.
  EXPECT_TRUE(all_close(mla_attention_ref(q, k_nope, k_rope, v, {d, 0.0f}),
                        attention_oracle(q, key, v, 1.0 / std::sqrt(double(qk))), 1e-5f, 1e-5f));
}

TEST(Mla, AbsorbedEqualsUnabsorbed) {
  std::mt19937_64 rng(test_seed(2302));
  for (const MlaDims& d : {small_mla_dims(), MlaDims{4, 32, 16, 32, 32}, MlaDims{2, 16, 8, 12, 48}}) {
    for (int64_t tokens : {int64_t{1}, int64_t{5}}) {
      SCOPED_TRACE(testing::Message()
                   << "heads " << d.num_heads << " rank " << d.kv_lora_rank << " T " << tokens);
      const int64_t positions = 13;
      const Tensor q = random_normal({tokens, d.num_heads, d.qk_head_dim()}, rng);
      const Tensor c_kv = random_normal({positions, d.kv_lora_rank}, rng);
      const Tensor k_rope = random_normal({positions, d.qk_rope_head_dim}, rng);
      const Tensor kv_b = random_normal({d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank},
                                        rng, 1.0f / std::sqrt(float(d.kv_lora_rank)));
      const MlaAttentionParams params{d, static_cast<float>(1.0 / std::sqrt(double(d.qk_head_dim())))};
      const MlaKeyValue kv = mla_expand_kv_ref(c_kv, kv_b, d);
      const Tensor unabsorbed = mla_attention_ref(q, kv.k_nope, k_rope, kv.v, params);
      const Tensor absorbed = mla_attention_absorbed_ref(q, c_kv, k_rope, kv_b, params);
      EXPECT_TRUE(all_close(absorbed, unabsorbed, 1e-5f, 1e-5f));
      // W_UV of head 0 (kv_b rows [nope, nope + dv)) doubled: head 0's output doubles, the other
      // heads do not move.
      Tensor kv_b2 = kv_b.clone();
      for (int64_t i = d.qk_nope_head_dim * d.kv_lora_rank;
           i < (d.qk_nope_head_dim + d.v_head_dim) * d.kv_lora_rank; ++i) {
        kv_b2.data<float>()[i] *= 2.0f;
      }
      const Tensor doubled = mla_attention_absorbed_ref(q, c_kv, k_rope, kv_b2, params);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < d.num_heads; ++h) {
          for (int64_t j = 0; j < d.v_head_dim; ++j) {
            const int64_t i = (t * d.num_heads + h) * d.v_head_dim + j;
            EXPECT_FLOAT_EQ(doubled.data<float>()[i], (h == 0 ? 2.0f : 1.0f) * absorbed.data<float>()[i]);
          }
        }
      }
    }
  }
}

TEST(Mla, ExpandKvSplitsEachHeadIntoKeyThenValue) {
  std::mt19937_64 rng(test_seed(2303));
  const MlaDims d = small_mla_dims();
  const int64_t positions = 4, per_head = d.qk_nope_head_dim + d.v_head_dim;
  const Tensor c_kv = random_normal({positions, d.kv_lora_rank}, rng);
  const Tensor kv_b = random_normal({d.num_heads * per_head, d.kv_lora_rank}, rng);
  const MlaKeyValue kv = mla_expand_kv_ref(c_kv, kv_b, d);
  for (int64_t s = 0; s < positions; ++s) {
    for (int64_t h = 0; h < d.num_heads; ++h) {
      for (int64_t o = 0; o < per_head; ++o) {
        double ref = 0;
        for (int64_t r = 0; r < d.kv_lora_rank; ++r) {
          ref += double(c_kv.data<float>()[s * d.kv_lora_rank + r]) *
                 kv_b.data<float>()[(h * per_head + o) * d.kv_lora_rank + r];
        }
        const float got =
            o < d.qk_nope_head_dim
                ? kv.k_nope.data<float>()[(s * d.num_heads + h) * d.qk_nope_head_dim + o]
                : kv.v.data<float>()[(s * d.num_heads + h) * d.v_head_dim + o - d.qk_nope_head_dim];
        EXPECT_NEAR(got, ref, 1e-5) << "position " << s << " head " << h << " row " << o;
      }
    }
  }
}

TEST(Mla, LatentCacheDecodeEqualsPrefill) {
  std::mt19937_64 rng(test_seed(2304));
  const MlaDims d = small_mla_dims();
  const int64_t tokens = 6;
  const Tensor q = random_normal({tokens, d.num_heads, d.qk_head_dim()}, rng);
  const Tensor c_kv = random_normal({tokens, d.kv_lora_rank}, rng);
  const Tensor k_rope = random_normal({tokens, d.qk_rope_head_dim}, rng);
  const Tensor kv_b =
      random_normal({d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank}, rng, 0.3f);
  const MlaAttentionParams params{d, 0.2f};
  const Tensor prefill = mla_attention_absorbed_ref(q, c_kv, k_rope, kv_b, params);
  MlaLatentCacheRef cache(d.kv_lora_rank, d.qk_rope_head_dim);
  cache.append(c_kv.slice0(0, tokens - 1), k_rope.slice0(0, tokens - 1));
  cache.append(c_kv.slice0(tokens - 1, tokens), k_rope.slice0(tokens - 1, tokens));
  EXPECT_EQ(cache.size(), tokens);
  EXPECT_TRUE(all_close(cache.latent(), c_kv, 0, 0));
  const Tensor decode =
      mla_attention_absorbed_ref(q.slice0(tokens - 1, tokens), cache.latent(), cache.k_rope(), kv_b, params);
  EXPECT_TRUE(all_close(decode, prefill.slice0(tokens - 1, tokens), 1e-6f, 1e-6f));
  cache.truncate(2);
  EXPECT_EQ(cache.k_rope().shape(), (Shape{2, d.qk_rope_head_dim}));
  EXPECT_THROW(cache.append(c_kv.slice0(0, 1), k_rope.slice0(0, 2)), Error);
}

// transformers' apply_rotary_pos_emb_interleave, literally: x1 = x[0::2], x2 = x[1::2] of the rope
// dims, result cat(x1*cos - x2*sin, x2*cos + x1*sin). x [rows, rope], one position per row.
Tensor hf_rope_interleave(const Tensor& x, const std::vector<int64_t>& positions, const RopeTable& table) {
  const int64_t rows = x.dim(0), rope = x.dim(1), half = rope / 2;
  Tensor out = Tensor::empty(DType::kF32, {rows, rope});
  std::vector<float> c(half), s(half);
  for (int64_t r = 0; r < rows; ++r) {
    rope_cos_sin(table, positions[r], c.data(), s.data());
    const float* in = x.data<float>() + r * rope;
    float* o = out.data<float>() + r * rope;
    for (int64_t j = 0; j < half; ++j) {
      o[j] = in[2 * j] * c[j] - in[2 * j + 1] * s[j];
      o[half + j] = in[2 * j + 1] * c[j] + in[2 * j] * s[j];
    }
  }
  return out;
}

TEST(Mla, DeinterleavedRopeLayoutGivesTheSameScores) {
  // The engine rotates interleaved pairs in place; transformers writes them de-interleaved. Both
  // q and k get the same permutation, so every q.k product is equal.
  std::mt19937_64 rng(test_seed(2305));
  RopeParams p;
  p.type = RopeType::kYarn;
  p.theta = 10000.0;
  p.rotary_dim = 16;
  p.factor = 4.0;
  p.original_max_position_embeddings = 128;
  p.mscale = 1.0;
  p.mscale_all_dim = 1.0;
  const RopeTable table = make_rope_table(p);
  const int64_t tokens = 5, positions = 8, rope = 16;
  const Tensor q = random_normal({tokens, rope}, rng);
  const Tensor k = random_normal({positions, rope}, rng);
  const std::vector<int64_t> q_pos = {3, 4, 5, 6, 7}, k_pos = {0, 1, 2, 3, 4, 5, 6, 7};

  Tensor q_engine = q.clone(), k_engine = k.clone();
  apply_rope_inplace_ref(q_engine, q_pos, table, {RopeStyle::kInterleaved, 0});
  apply_rope_inplace_ref(k_engine, k_pos, table, {RopeStyle::kInterleaved, 0});
  const Tensor q_hf = hf_rope_interleave(q, q_pos, table);
  const Tensor k_hf = hf_rope_interleave(k, k_pos, table);

  for (int64_t r = 0; r < tokens; ++r) {
    // Same numbers, permuted: hf[j] = engine[2j], hf[half + j] = engine[2j + 1].
    for (int64_t j = 0; j < rope / 2; ++j) {
      EXPECT_EQ(q_hf.data<float>()[r * rope + j], q_engine.data<float>()[r * rope + 2 * j]);
      EXPECT_EQ(q_hf.data<float>()[r * rope + rope / 2 + j], q_engine.data<float>()[r * rope + 2 * j + 1]);
    }
    for (int64_t s = 0; s < positions; ++s) {
      double dot_engine = 0, dot_hf = 0;
      for (int64_t i = 0; i < rope; ++i) {
        dot_engine += double(q_engine.data<float>()[r * rope + i]) * k_engine.data<float>()[s * rope + i];
        dot_hf += double(q_hf.data<float>()[r * rope + i]) * k_hf.data<float>()[s * rope + i];
      }
      EXPECT_NEAR(dot_engine, dot_hf, 1e-6 * (1.0 + std::fabs(dot_hf))) << "query " << r << " key " << s;
    }
  }
  // ... but mixing the layouts (one side de-interleaved, the other not) changes the scores.
  double mixed = 0, right = 0;
  for (int64_t i = 0; i < rope; ++i) {
    mixed += double(q_hf.data<float>()[rope + i]) * k_engine.data<float>()[2 * rope + i];
    right += double(q_hf.data<float>()[rope + i]) * k_hf.data<float>()[2 * rope + i];
  }
  EXPECT_GT(std::fabs(mixed - right), 1e-3);
}

TEST(Mla, WholeLayerDataflowAbsorbedEqualsUnabsorbed) {
  // The dataflow of mla.h from the hidden states: q_a -> norm -> q_b; kv_a -> [c_kv | k_rope];
  // norm(c_kv); interleaved YaRN RoPE on q_rope and k_rope; then both attention forms.
  std::mt19937_64 rng(test_seed(2306));
  const MlaDims d{3, 12, 8, 10, 20};
  const int64_t hidden = 24, q_lora = 18, tokens = 7, qk = d.qk_head_dim();
  const Tensor x = random_normal({tokens, hidden}, rng);
  const float ws = 1.0f / std::sqrt(float(hidden));
  const Tensor q_a = random_normal({q_lora, hidden}, rng, ws);
  const Tensor q_a_norm = random_normal({q_lora}, rng, 0.1f);
  const Tensor q_b = random_normal({d.num_heads * qk, q_lora}, rng, 1.0f / std::sqrt(float(q_lora)));
  const Tensor kv_a = random_normal({d.kv_lora_rank + d.qk_rope_head_dim, hidden}, rng, ws);
  const Tensor kv_a_norm = random_normal({d.kv_lora_rank}, rng, 0.1f);
  const Tensor kv_b = random_normal({d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank}, rng,
                                    1.0f / std::sqrt(float(d.kv_lora_rank)));
  RopeParams rp;
  rp.type = RopeType::kYarn;
  rp.theta = 10000.0;
  rp.rotary_dim = d.qk_rope_head_dim;
  rp.factor = 4.0;
  rp.original_max_position_embeddings = 128;
  rp.mscale = rp.mscale_all_dim = 1.0;
  const RopeTable table = make_rope_table(rp);
  std::vector<int64_t> pos(tokens);
  for (int64_t t = 0; t < tokens; ++t) pos[t] = t;

  Tensor q = linear_ref(rms_norm_ref(linear_ref(x, q_a), q_a_norm, {1e-6, NormStyle::kWeight}), q_b)
                 .reshape({tokens, d.num_heads, qk});
  apply_rope_inplace_ref(q, pos, table, {RopeStyle::kInterleaved, d.qk_nope_head_dim});
  const Tensor kv_lat = linear_ref(x, kv_a);  // [T, rank + rope]
  const int64_t lat_width = d.kv_lora_rank + d.qk_rope_head_dim;
  Tensor c_kv = Tensor::empty(DType::kF32, {tokens, d.kv_lora_rank});
  Tensor k_rope = Tensor::empty(DType::kF32, {tokens, d.qk_rope_head_dim});
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < d.kv_lora_rank; ++i)
      c_kv.data<float>()[t * d.kv_lora_rank + i] = kv_lat.data<float>()[t * lat_width + i];
    for (int64_t i = 0; i < d.qk_rope_head_dim; ++i) {
      k_rope.data<float>()[t * d.qk_rope_head_dim + i] =
          kv_lat.data<float>()[t * lat_width + d.kv_lora_rank + i];
    }
  }
  rms_norm_inplace_ref(c_kv, kv_a_norm, {1e-6, NormStyle::kWeight});
  apply_rope_inplace_ref(k_rope, pos, table, {RopeStyle::kInterleaved, 0});

  const MlaAttentionParams params{d, static_cast<float>(mla_softmax_scale(qk, rp))};
  const MlaKeyValue kv = mla_expand_kv_ref(c_kv, kv_b, d);
  const Tensor unabsorbed = mla_attention_ref(q, kv.k_nope, k_rope, kv.v, params);
  const Tensor absorbed = mla_attention_absorbed_ref(q, c_kv, k_rope, kv_b, params);
  EXPECT_TRUE(all_close(absorbed, unabsorbed, 1e-5f, 1e-5f));
}

TEST(Mla, RejectsInconsistentShapes) {
  const MlaDims d = small_mla_dims();
  const Tensor q = Tensor::zeros(DType::kF32, {2, 3, 16});
  const Tensor k_nope = Tensor::zeros(DType::kF32, {5, 3, 10});
  const Tensor k_rope = Tensor::zeros(DType::kF32, {5, 6});
  const Tensor v = Tensor::zeros(DType::kF32, {5, 3, 7});
  EXPECT_NO_THROW(mla_attention_ref(q, k_nope, k_rope, v, {d, 0.0f}));
  expect_error(
      [&] {
        mla_attention_ref(q, k_nope, Tensor::zeros(DType::kF32, {5, 8}), v, {d, 0.0f});
      },
      ErrorCode::kInvalidArgument, {"k_rope", "[5, 6]", "[5, 8]"});
  expect_error(
      [&] {
        mla_attention_ref(Tensor::zeros(DType::kF32, {6, 3, 16}), k_nope, k_rope, v, {d, 0.0f});
      },
      ErrorCode::kInvalidArgument, {"6 query tokens", "5 positions"});
  expect_error(
      [&] {
        mla_attention_absorbed_ref(q, Tensor::zeros(DType::kF32, {5, 11}), k_rope,
                                   Tensor::zeros(DType::kF32, {50, 11}), {d, 0.0f});
      },
      ErrorCode::kInvalidArgument, {"kv_b_proj weight", "[51, 11]", "[50, 11]"});
}

}  // namespace
}  // namespace moelora::ops
