// RoPE reference (ops/rope): the frequency tables against numbers produced by transformers 5.17,
// the rotation against formulas written independently here (HF's cat(freqs, freqs) /
// rotate_half form, explicit pair rotation), relative-position invariance, partial rotary,
// attention_factor scaling and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "ops/mla/mla.h"
#include "ops/rope/rope.h"
#include "support/test_support.h"

namespace moelora::ops {
namespace {

using test::random_normal;
using test::test_seed;

// ---- transformers 5.17 goldens -----------------------------------------------------------------
// Each block below was printed by the python3 one-liner in its comment (transformers 5.17.0,
// torch 2.15, CPU); inv_freq is the fp32 tensor returned by ROPE_INIT_FUNCTIONS['yarn'], followed
// by attention_factor and DeepseekV3Attention.scaling (the MLA softmax scale). The commands stay on
// one line each so that they can be copied and re-run.
// clang-format off

// DeepSeek-V3: theta 1e4, rope dim 64, factor 40, original 4096, beta 32/1, mscale 1/1.
// python3 -c "from transformers import DeepseekV3Config as C; from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as R; from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as A; c=C(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)); f,a=R['yarn'](c); print(', '.join('%.9gf'%x for x in f.tolist()), repr(a), repr(A(c,0).scaling))"
const std::vector<float> kDeepseekV3InvFreq = {
    1.0f,           0.749894202f,    0.562341332f,    0.421696514f,   0.316227764f,    0.237137362f,
    0.177827939f,   0.133352146f,    0.100000001f,    0.0749894157f,  0.0562341288f,   0.0390069261f,
    0.0268793609f,  0.0183781441f,   0.012447956f,    0.0083345091f,  0.00550000044f,  0.00356199732f,
    0.00224936521f, 0.00137051346f,  0.000790569407f, 0.000414990413f, 0.00017782794f, 3.3338034e-05f,
    2.49999994e-05f, 1.87473543e-05f, 1.40585325e-05f, 1.05424124e-05f, 7.90569447e-06f, 5.92843435e-06f,
    4.44569832e-06f, 3.33380353e-06f};
constexpr double kDeepseekV3AttentionFactor = 1.0;
constexpr double kDeepseekV3MlaScale = 0.1352337788608801;

// Kimi-K2.5: theta 5e4, factor 64, original 4096, beta_fast = beta_slow = 1 (as in its config.json,
// which puts the whole correction range on one index: a hard step between j = 19 and j = 20).
// python3 -c "from transformers import DeepseekV3Config as C; from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as R; from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as A; c=C(qk_rope_head_dim=64, max_position_embeddings=262144, rope_parameters=dict(rope_type='yarn', rope_theta=50000.0, factor=64.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)); f,a=R['yarn'](c); print(', '.join('%.9gf'%x for x in f.tolist()), repr(a), repr(A(c,0).scaling))"
const std::vector<float> kKimiK25InvFreq = {
    1.0f,            0.713111103f,    0.508527458f,    0.362636536f,    0.258600146f,    0.184410617f,
    0.131505266f,    0.0937778577f,   0.0668740347f,   0.0476886146f,   0.0340072773f,   0.0242509674f,
    0.0172936339f,   0.0123322811f,   0.00879428629f,  0.00627130363f,  0.00447213603f,  0.00318912975f,
    0.00227420381f,  0.00162175996f,  1.80702336e-05f, 1.28860838e-05f, 9.18920978e-06f, 6.55292706e-06f,
    4.67296513e-06f, 3.33234311e-06f, 2.37633071e-06f, 1.69458781e-06f, 1.20842935e-06f, 8.61744411e-07f,
    6.14519479e-07f, 4.38220638e-07f};
constexpr double kKimiK25AttentionFactor = 1.0;
constexpr double kKimiK25MlaScale = 0.14467962580268923;

// The tiny DeepSeek-V3 test model (FORMATS §6.3): rope dim 16, nope 32, factor 4, original 128.
// python3 -c "from transformers import DeepseekV3Config as C; from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as R; from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as A; c=C(qk_rope_head_dim=16, qk_nope_head_dim=32, max_position_embeddings=512, rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)); f,a=R['yarn'](c); print(', '.join('%.9gf'%x for x in f.tolist()), repr(a), repr(A(c,0).scaling))"
const std::vector<float> kTinyInvFreq = {1.0f,           0.237170815f,    0.049999997f,    0.00790569466f,
                                         0.00249999994f, 0.000790569466f, 0.000250000012f, 7.90569466e-05f};
constexpr double kTinyAttentionFactor = 1.0;
constexpr double kTinyMlaScale = 0.18713033519502428;

// The tiny config without mscale keys and with truncate=False: attention_factor = 1 + 0.1 ln 4 and
// an un-rounded correction range.
// python3 -c "from transformers import DeepseekV3Config as C; from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as R; c=C(qk_rope_head_dim=16, max_position_embeddings=512, rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, truncate=False)); f,a=R['yarn'](c); print(', '.join('%.9gf'%x for x in f.tolist()), repr(a))"
const std::vector<float> kTinyNoMscaleInvFreq = {1.0f,           0.225637481f,    0.04270567f,     0.00790569466f,
                                                 0.00249999994f, 0.000790569466f, 0.000250000012f, 7.90569466e-05f};
constexpr double kTinyNoMscaleAttentionFactor = 1.138629436111989;

// cos / sin of DeepseekV3RotaryEmbedding (the DeepSeek-V3 config above) at positions
// {0, 1, 7, 4095, 163839} (rows) and frequency slots {0, 1, 5, 13, 31} (columns).
// python3 -c "import torch; from transformers import DeepseekV3Config as C; from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding as E; c=C(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)); cos,sin=E(c)(torch.zeros(1), torch.tensor([[0, 1, 7, 4095, 163839]])); print([['%.9gf'%v for v in t[0, :, [0, 1, 5, 13, 31]].flatten().tolist()] for t in (cos, sin)])"
const std::vector<int64_t> kDeepseekV3Positions = {0, 1, 7, 4095, 163839};
const std::vector<int64_t> kDeepseekV3Slots = {0, 1, 5, 13, 31};
const std::vector<float> kDeepseekV3Cos = {
    1.0f,          1.0f,           1.0f,           1.0f,          1.0f,
    0.540302336f,  0.731760979f,   0.972014427f,   0.99983114f,   1.0f,
    0.753902256f,  0.511449277f,   -0.0890471488f, 0.991736352f,  1.0f,
    -0.0659759939f, -0.0900463611f, -0.947527826f, 0.990254402f,  0.999906838f,
    0.228684649f,  0.873443723f,   -0.963420808f,  0.159237102f,  0.854500949f};
const std::vector<float> kDeepseekV3Sin = {
    0.0f,          0.0f,           0.0f,           0.0f,          0.0f,
    0.841470957f,  0.681561351f,   0.234921068f,   0.0183771104f, 3.33380353e-06f,
    0.656986594f,  -0.859313488f,  0.99602741f,    0.128292456f,  2.33366245e-05f,
    -0.997821212f, -0.995937586f,  -0.31967333f,   -0.13927035f,  0.0136515014f,
    -0.97350055f,  0.486925155f,   -0.267993093f,  0.987240374f,  0.51944989f};

// Qwen3 (default rope, theta 1e6, head_dim 128): inv_freq at slots {0, 1, 17, 63}, then cos / sin
// at positions {3, 40959} (rows) and the same slots (columns).
// python3 -c "import torch; from transformers import Qwen3MoeConfig as C; from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding as E; c=C(head_dim=128, rope_parameters=dict(rope_type='default', rope_theta=1000000.0)); e=E(c); cos,sin=e(torch.zeros(1), torch.tensor([[3, 40959]])); print(['%.9gf'%v for v in e.inv_freq[[0, 1, 17, 63]].tolist()], [['%.9gf'%v for v in t[0, :, [0, 1, 17, 63]].flatten().tolist()] for t in (cos, sin)])"
const std::vector<int64_t> kQwenSlots = {0, 1, 17, 63};
const std::vector<float> kQwenInvFreq = {1.0f, 0.805842221f, 0.0254829675f, 1.24093776e-06f};
const std::vector<int64_t> kQwenPositions = {3, 40959};
const std::vector<float> kQwenCos = {-0.989992499f, -0.749118507f, 0.997079194f, 1.0f,
                                     0.466897219f,  0.606004f,     0.732999682f, 0.998708546f};
const std::vector<float> kQwenSin = {0.141120002f,  0.662436008f, 0.0763744563f, 3.72281329e-06f,
                                     -0.884311616f, 0.795461595f, 0.680228949f,  0.0508056879f};

// clang-format on

RopeParams yarn_params(double theta, int64_t dim, double factor, int64_t original, int64_t max_positions,
                       double beta_fast, double beta_slow, double mscale, double mscale_all_dim) {
  RopeParams p;
  p.type = RopeType::kYarn;
  p.theta = theta;
  p.rotary_dim = dim;
  p.factor = factor;
  p.original_max_position_embeddings = original;
  p.max_position_embeddings = max_positions;
  p.beta_fast = beta_fast;
  p.beta_slow = beta_slow;
  p.mscale = mscale;
  p.mscale_all_dim = mscale_all_dim;
  return p;
}

// Every frequency within 2 ulp-ish (relative 2.5e-7) of the transformers value: the table mirrors
// the fp32 operation order, so only the last bit of torch's pow may differ.
void expect_inv_freq(const RopeTable& table, const std::vector<float>& expected) {
  ASSERT_EQ(table.inv_freq.size(), expected.size());
  for (size_t j = 0; j < expected.size(); ++j) {
    EXPECT_NEAR(table.inv_freq[j], expected[j], 2.5e-7 * std::fabs(expected[j])) << "slot " << j;
  }
}

TEST(RopeTable, DeepseekV3YarnMatchesTransformers) {
  const RopeParams p = yarn_params(10000.0, 64, 40.0, 4096, 163840, 32.0, 1.0, 1.0, 1.0);
  const RopeTable table = make_rope_table(p);
  expect_inv_freq(table, kDeepseekV3InvFreq);
  EXPECT_FLOAT_EQ(table.attention_factor, static_cast<float>(kDeepseekV3AttentionFactor));
  EXPECT_DOUBLE_EQ(mla_softmax_scale(128 + 64, p), kDeepseekV3MlaScale);
  // The worked example of FORMATS §1.2: 192^-0.5 (0.1 ln 40 + 1)^2.
  EXPECT_NEAR(mla_softmax_scale(192, p), std::pow(192.0, -0.5) * std::pow(0.1 * std::log(40.0) + 1.0, 2),
              1e-15);
}

TEST(RopeTable, KimiK25YarnMatchesTransformers) {
  const RopeParams p = yarn_params(50000.0, 64, 64.0, 4096, 262144, 1.0, 1.0, 1.0, 1.0);
  const RopeTable table = make_rope_table(p);
  expect_inv_freq(table, kKimiK25InvFreq);
  EXPECT_FLOAT_EQ(table.attention_factor, static_cast<float>(kKimiK25AttentionFactor));
  EXPECT_DOUBLE_EQ(mla_softmax_scale(192, p), kKimiK25MlaScale);
}

TEST(RopeTable, TinyDeepseekYarnMatchesTransformers) {
  const RopeParams p = yarn_params(10000.0, 16, 4.0, 128, 512, 32.0, 1.0, 1.0, 1.0);
  const RopeTable table = make_rope_table(p);
  expect_inv_freq(table, kTinyInvFreq);
  EXPECT_FLOAT_EQ(table.attention_factor, static_cast<float>(kTinyAttentionFactor));
  EXPECT_DOUBLE_EQ(mla_softmax_scale(32 + 16, p), kTinyMlaScale);
}

TEST(RopeTable, YarnWithoutMscaleAndTruncationMatchesTransformers) {
  // Absent beta and mscale keys are zeros (HF: `beta_fast or 32`, `if mscale and mscale_all_dim`).
  RopeParams p = yarn_params(10000.0, 16, 4.0, 128, 512, 0.0, 0.0, 0.0, 0.0);
  p.truncate = false;
  const RopeTable table = make_rope_table(p);
  expect_inv_freq(table, kTinyNoMscaleInvFreq);
  EXPECT_FLOAT_EQ(table.attention_factor, static_cast<float>(kTinyNoMscaleAttentionFactor));
  // Without mscale_all_dim the MLA scale is plain qk_head_dim^-0.5.
  EXPECT_DOUBLE_EQ(mla_softmax_scale(48, p), std::pow(48.0, -0.5));
}

TEST(RopeTable, YarnFactorDefaultsToContextRatioAndExplicitAttentionFactorWins) {
  // factor absent: max_position_embeddings / original = 512 / 128 = 4, same table as factor 4.
  const RopeTable with_factor = make_rope_table(yarn_params(10000.0, 16, 4.0, 128, 512, 32, 1, 1, 1));
  const RopeTable derived = make_rope_table(yarn_params(10000.0, 16, 0.0, 128, 512, 32, 1, 1, 1));
  EXPECT_EQ(derived.inv_freq, with_factor.inv_freq);
  // Only mscale given (no mscale_all_dim): mscale(factor) with m = 1, not the ratio.
  const RopeTable only_mscale = make_rope_table(yarn_params(10000.0, 16, 4.0, 128, 512, 32, 1, 0.5, 0.0));
  EXPECT_FLOAT_EQ(only_mscale.attention_factor, static_cast<float>(0.1 * std::log(4.0) + 1.0));
  // mscale / mscale_all_dim ratio.
  const RopeTable ratio = make_rope_table(yarn_params(10000.0, 16, 4.0, 128, 512, 32, 1, 0.707, 1.0));
  EXPECT_FLOAT_EQ(ratio.attention_factor,
                  static_cast<float>((0.1 * 0.707 * std::log(4.0) + 1.0) / (0.1 * std::log(4.0) + 1.0)));
  RopeParams p = yarn_params(10000.0, 16, 4.0, 128, 512, 32, 1, 1, 1);
  p.attention_factor = 0.75;
  EXPECT_FLOAT_EQ(make_rope_table(p).attention_factor, 0.75f);
}

TEST(RopeTable, DefaultRopeMatchesTransformers) {
  RopeParams p;
  p.theta = 1e6;
  p.rotary_dim = 128;
  p.attention_factor = 3.0;  // ignored by the default type, as in transformers
  const RopeTable table = make_rope_table(p);
  ASSERT_EQ(table.inv_freq.size(), 64u);
  EXPECT_EQ(table.attention_factor, 1.0f);
  for (size_t i = 0; i < kQwenSlots.size(); ++i) {
    EXPECT_NEAR(table.inv_freq[kQwenSlots[i]], kQwenInvFreq[i], 2.5e-7 * kQwenInvFreq[i])
        << "slot " << kQwenSlots[i];
  }
  std::vector<float> cos_v(64), sin_v(64);
  for (size_t r = 0; r < kQwenPositions.size(); ++r) {
    rope_cos_sin(table, kQwenPositions[r], cos_v.data(), sin_v.data());
    for (size_t c = 0; c < kQwenSlots.size(); ++c) {
      EXPECT_NEAR(cos_v[kQwenSlots[c]], kQwenCos[r * 4 + c], 1e-6) << "position " << kQwenPositions[r];
      EXPECT_NEAR(sin_v[kQwenSlots[c]], kQwenSin[r * 4 + c], 1e-6) << "position " << kQwenPositions[r];
    }
  }
}

TEST(RopeTable, CosSinMatchTransformersAtLongPositions) {
  // At position 163839 a one-ulp difference in inv_freq moves the angle by ~0.01 rad, so these
  // values only match when the table and the fp32 angle product are those of transformers.
  const RopeTable table = make_rope_table(yarn_params(10000.0, 64, 40.0, 4096, 163840, 32.0, 1.0, 1.0, 1.0));
  std::vector<float> cos_v(32), sin_v(32);
  for (size_t r = 0; r < kDeepseekV3Positions.size(); ++r) {
    rope_cos_sin(table, kDeepseekV3Positions[r], cos_v.data(), sin_v.data());
    for (size_t c = 0; c < kDeepseekV3Slots.size(); ++c) {
      const size_t k = r * kDeepseekV3Slots.size() + c;
      EXPECT_NEAR(cos_v[kDeepseekV3Slots[c]], kDeepseekV3Cos[k], 1e-6)
          << "position " << kDeepseekV3Positions[r] << " slot " << kDeepseekV3Slots[c];
      EXPECT_NEAR(sin_v[kDeepseekV3Slots[c]], kDeepseekV3Sin[k], 1e-6)
          << "position " << kDeepseekV3Positions[r] << " slot " << kDeepseekV3Slots[c];
    }
  }
}

TEST(RopeTable, RejectsBadParams) {
  RopeParams p;
  p.rotary_dim = 7;
  EXPECT_THROW(make_rope_table(p), Error);
  p.rotary_dim = 0;
  EXPECT_THROW(make_rope_table(p), Error);
  p.rotary_dim = 8;
  p.theta = 0.0;
  EXPECT_THROW(make_rope_table(p), Error);
  RopeParams y = yarn_params(10000.0, 16, 4.0, 0, 512, 32, 1, 1, 1);  // no original_max_position_embeddings
  try {
    make_rope_table(y);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("original_max_position_embeddings"), std::string::npos) << e.what();
  }
  y = yarn_params(10000.0, 16, 0.0, 128, 0, 32, 1, 1, 1);  // neither factor nor max positions
  EXPECT_THROW(make_rope_table(y), Error);
  EXPECT_EQ(rope_type_from_name("yarn"), RopeType::kYarn);
  EXPECT_EQ(rope_type_from_name("default"), RopeType::kDefault);
  try {
    rope_type_from_name("longrope");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("longrope"), std::string::npos) << e.what();
  }
  // MLA scale with mscale_all_dim needs the factor.
  RopeParams no_factor = yarn_params(10000.0, 16, 0.0, 128, 512, 32, 1, 1, 1);
  EXPECT_THROW(mla_softmax_scale(48, no_factor), Error);
}

// ---- application --------------------------------------------------------------------------------

// transformers' form for rotate-half: emb = cat(freqs, freqs); out = x*cos(emb) + rotate_half(x)*sin(emb)
// on the first rot dims, with cos/sin from rope_cos_sin (whose values are checked above).
std::vector<float> hf_rotate_half(const std::vector<float>& x, int64_t rot, const float* cos_half,
                                  const float* sin_half) {
  std::vector<float> out = x;
  const int64_t half = rot / 2;
  for (int64_t d = 0; d < rot; ++d) {
    const float c = cos_half[d % half], s = sin_half[d % half];
    const float rotated = d < half ? -x[d + half] : x[d - half];  // rotate_half = cat(-x2, x1)
    out[d] = x[d] * c + rotated * s;
  }
  return out;
}

struct ApplyCase {
  RopeStyle style;
  int64_t head_dim, rotary_dim, offset;
};

TEST(RopeApply, MatchesDirectFormulaForBothStylesAndPartialRotary) {
  std::mt19937_64 rng(test_seed(1101));
  const std::vector<ApplyCase> cases = {
      {RopeStyle::kRotateHalf, 10, 10, 0},   // full rotary
      {RopeStyle::kRotateHalf, 22, 6, 0},    // partial (Qwen3.5-style: leading dims rotated)
      {RopeStyle::kInterleaved, 14, 14, 0},  // full interleaved
      {RopeStyle::kInterleaved, 18, 8, 10},  // MLA query [nope 10 | rope 8]
      {RopeStyle::kRotateHalf, 18, 8, 10},   // rope_interleave=False MLA
  };
  const int64_t tokens = 5, heads = 3;
  const std::vector<int64_t> positions = {0, 1, 2, 97, 4099};
  for (const ApplyCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "style "
                                    << (c.style == RopeStyle::kRotateHalf ? "rotate_half" : "interleaved")
                                    << " head_dim " << c.head_dim << " rot " << c.rotary_dim << " offset "
                                    << c.offset);
    RopeParams p = yarn_params(10000.0, c.rotary_dim, 4.0, 128, 512, 32, 1, 0, 0);  // attention_factor 1.1386
    const RopeTable table = make_rope_table(p);
    const Tensor x = random_normal({tokens, heads, c.head_dim}, rng);
    Tensor y = x.clone();
    apply_rope_inplace_ref(y, positions, table, {c.style, c.offset});
    const int64_t half = c.rotary_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* xin = x.data<float>() + (t * heads + h) * c.head_dim;
        const float* yout = y.data<float>() + (t * heads + h) * c.head_dim;
        // Pass-through dims are untouched, bit for bit.
        for (int64_t d = 0; d < c.head_dim; ++d) {
          if (d < c.offset || d >= c.offset + c.rotary_dim) {
            EXPECT_EQ(yout[d], xin[d]) << "dim " << d;
          }
        }
        // Each pair rotated by angle pos * inv_freq[j] (double precision here) and scaled.
        for (int64_t j = 0; j < half; ++j) {
          const int64_t ia = c.offset + (c.style == RopeStyle::kRotateHalf ? j : 2 * j);
          const int64_t ib = c.offset + (c.style == RopeStyle::kRotateHalf ? j + half : 2 * j + 1);
          const double angle = static_cast<double>(static_cast<float>(positions[t]) * table.inv_freq[j]);
          const double af = table.attention_factor;
          const double ya = af * (xin[ia] * std::cos(angle) - xin[ib] * std::sin(angle));
          const double yb = af * (xin[ia] * std::sin(angle) + xin[ib] * std::cos(angle));
          EXPECT_NEAR(yout[ia], ya, 2e-6) << "token " << t << " head " << h << " pair " << j;
          EXPECT_NEAR(yout[ib], yb, 2e-6) << "token " << t << " head " << h << " pair " << j;
        }
        if (c.style == RopeStyle::kRotateHalf && c.offset == 0) {
          // transformers' literal formula on the rotated prefix.
          std::vector<float> cos_v(half), sin_v(half);
          rope_cos_sin(table, positions[t], cos_v.data(), sin_v.data());
          const std::vector<float> hf = hf_rotate_half(std::vector<float>(xin, xin + c.head_dim),
                                                       c.rotary_dim, cos_v.data(), sin_v.data());
          for (int64_t d = 0; d < c.head_dim; ++d) EXPECT_EQ(yout[d], hf[d]) << "dim " << d;
        }
      }
    }
  }
}

TEST(RopeApply, ScoresDependOnlyOnRelativePosition) {
  // q at position m and k at position n: q.k is a function of m - n (for attention_factor 1).
  std::mt19937_64 rng(test_seed(1102));
  for (RopeStyle style : {RopeStyle::kRotateHalf, RopeStyle::kInterleaved}) {
    RopeParams p;
    p.theta = 10000.0;
    p.rotary_dim = 12;
    const RopeTable table = make_rope_table(p);
    const Tensor q = random_normal({1, 1, 12}, rng), k = random_normal({1, 1, 12}, rng);
    auto score = [&](int64_t m, int64_t n) {
      Tensor qr = q.clone(), kr = k.clone();
      const int64_t pm[] = {m}, pn[] = {n};
      apply_rope_inplace_ref(qr, pm, table, {style, 0});
      apply_rope_inplace_ref(kr, pn, table, {style, 0});
      double s = 0;
      for (int d = 0; d < 12; ++d) s += double(qr.data<float>()[d]) * kr.data<float>()[d];
      return s;
    };
    const double base = score(9, 4);
    EXPECT_NEAR(score(105, 100), base, 1e-4);
    EXPECT_NEAR(score(5, 0), base, 1e-4);
    EXPECT_GT(std::fabs(score(9, 8) - base), 1e-3) << "different offsets must give different scores";
  }
}

TEST(RopeApply, PositionZeroIsIdentityTimesAttentionFactor) {
  std::mt19937_64 rng(test_seed(1103));
  RopeParams p = yarn_params(10000.0, 8, 4.0, 128, 512, 32, 1, 0, 0);
  p.attention_factor = 0.5;
  const RopeTable table = make_rope_table(p);
  const Tensor x = random_normal({1, 2, 8}, rng);
  Tensor y = x.clone();
  const int64_t pos[] = {0};
  apply_rope_inplace_ref(y, pos, table, {RopeStyle::kInterleaved, 0});
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(y.data<float>()[i], 0.5f * x.data<float>()[i]);
}

TEST(RopeApply, TwoDimensionalInputIsOneHead) {
  // MLA's shared k_rope [S, rope] goes through the same call as [S, 1, rope].
  std::mt19937_64 rng(test_seed(1104));
  RopeParams p;
  p.rotary_dim = 6;
  const RopeTable table = make_rope_table(p);
  const Tensor x = random_normal({3, 6}, rng);
  Tensor flat = x.clone();
  Tensor heads = x.clone().reshape({3, 1, 6});
  const std::vector<int64_t> pos = {4, 0, 11};
  apply_rope_inplace_ref(flat, pos, table, {RopeStyle::kInterleaved, 0});
  apply_rope_inplace_ref(heads, pos, table, {RopeStyle::kInterleaved, 0});
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_EQ(flat.data<float>()[i], heads.data<float>()[i]);
  EXPECT_NE(flat.data<float>()[0], x.data<float>()[0]);
}

TEST(RopeApply, RejectsBadArguments) {
  RopeParams p;
  p.rotary_dim = 8;
  const RopeTable table = make_rope_table(p);
  Tensor x = Tensor::zeros(DType::kF32, {2, 3, 12});
  const std::vector<int64_t> two = {0, 1}, one = {0}, negative = {0, -1};
  EXPECT_THROW(apply_rope_inplace_ref(x, one, table, {}), Error);       // positions vs tokens
  EXPECT_THROW(apply_rope_inplace_ref(x, negative, table, {}), Error);  // negative position
  EXPECT_THROW(apply_rope_inplace_ref(x, two, table, {RopeStyle::kRotateHalf, 5}), Error);  // 5 + 8 > 12
  EXPECT_NO_THROW(apply_rope_inplace_ref(x, two, table, {RopeStyle::kRotateHalf, 4}));
  Tensor bf16 = Tensor::zeros(DType::kBF16, {2, 3, 12});
  EXPECT_THROW(apply_rope_inplace_ref(bf16, two, table, {}), Error);
}

}  // namespace
}  // namespace moelora::ops
