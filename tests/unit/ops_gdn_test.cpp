// Gated DeltaNet reference (ops/gdn): the causal conv against its formula and across split calls,
// the gated delta rule's recurrent form against one step written out by hand, the chunked form
// against the recurrent one (several chunk sizes, chunks that end mid-sequence, a non-zero initial
// state, strong decay), the gated RMSNorm against its formula, and the whole layer: a prefill in
// chunks followed by decode steps equals one call over the sequence (the per-sequence state
// carries everything), recurrent == chunked, and argument errors that name the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ops/gdn/gdn.h"
#include "support/test_support.h"

namespace moelora::ops {
namespace {

using test::random_normal;
using test::random_uniform;
using test::test_seed;

// Largest |a - b| relative to the largest |b| (outputs of different summation orders).
double rel_diff(const Tensor& a, const Tensor& b) {
  double scale = 0;
  for (int64_t i = 0; i < b.numel(); ++i) scale = std::max(scale, double(std::abs(b.item_f32(i))));
  return test::max_abs_diff(a, b) / std::max(scale, 1e-30);
}

Tensor concat0(const Tensor& a, const Tensor& b) {
  Shape shape = a.shape();
  shape[0] += b.dim(0);
  Tensor out = Tensor::empty(DType::kF32, shape);
  std::copy(a.data<float>(), a.data<float>() + a.numel(), out.data<float>());
  std::copy(b.data<float>(), b.data<float>() + b.numel(), out.data<float>() + a.numel());
  return out;
}

TEST(GdnConv, MatchesFormulaAndCarriesStateAcrossCalls) {
  std::mt19937_64 rng(test_seed(901));
  const int64_t T = 9, C = 5, K = 4;
  Tensor x = random_normal({T, C}, rng), w = random_normal({C, 1, K}, rng);
  Tensor state0 = random_normal({C, K - 1}, rng);  // a sequence already under way
  Tensor state = state0.clone();
  Tensor y = causal_conv1d_silu_ref(x, w, state);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double s = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t src = t + j - (K - 1);  // input index; negative = the state
        const double u = src >= 0 ? x.item_f32(src * C + c) : state0.item_f32(c * (K - 1) + (K - 1 + src));
        s += w.item_f32(c * K + j) * u;
      }
      EXPECT_NEAR(y.item_f32(t * C + c), s / (1 + std::exp(-s)), 1e-5) << "t " << t << " c " << c;
    }
  for (int64_t c = 0; c < C; ++c)  // the state is the last K - 1 inputs
    for (int64_t j = 0; j < K - 1; ++j) EXPECT_EQ(state.item_f32(c * (K - 1) + j), x.item_f32((T - K + 1 + j) * C + c));
  // the same sequence in calls of 4, 1 and 4 tokens
  Tensor s2 = state0.clone();
  Tensor y1 = causal_conv1d_silu_ref(x.slice0(0, 4).clone(), w, s2);
  Tensor y2 = causal_conv1d_silu_ref(x.slice0(4, 5).clone(), w, s2);
  Tensor y3 = causal_conv1d_silu_ref(x.slice0(5, 9).clone(), w, s2);
  EXPECT_EQ(test::max_abs_diff(concat0(concat0(y1, y2), y3), y), 0.0);
  EXPECT_EQ(test::max_abs_diff(s2, state), 0.0);
  // K = 1: no state at all
  Tensor none = Tensor::zeros(DType::kF32, {C, 0});
  EXPECT_EQ(causal_conv1d_silu_ref(x, random_normal({C, 1}, rng), none).shape(), (Shape{T, C}));
}

struct RuleInputs {
  Tensor q, k, v, g, beta, state;
};

// Random inputs as the layer makes them: unit-norm k, q of norm 1/sqrt(dk), beta in (0, 1), g < 0.
RuleInputs random_rule_inputs(int64_t T, int64_t nv, int64_t dk, int64_t dv, std::mt19937_64& rng,
                              float g_lo, float g_hi) {
  RuleInputs in{random_normal({T, nv, dk}, rng), random_normal({T, nv, dk}, rng), random_normal({T, nv, dv}, rng),
                random_uniform({T, nv}, rng, g_lo, g_hi), random_uniform({T, nv}, rng, 0.05f, 0.95f),
                random_normal({nv, dk, dv}, rng, 0.3f)};
  for (int64_t r = 0; r < T * nv; ++r) {
    for (Tensor* t : {&in.q, &in.k}) {
      float* p = t->data<float>() + r * dk;
      double ss = 0;
      for (int64_t i = 0; i < dk; ++i) ss += p[i] * p[i];
      const float scale = (t == &in.q ? 1.f / std::sqrt(float(dk)) : 1.f) / float(std::sqrt(ss));
      for (int64_t i = 0; i < dk; ++i) p[i] *= scale;
    }
  }
  return in;
}

TEST(GdnRule, RecurrentStepMatchesTheFormula) {
  std::mt19937_64 rng(test_seed(902));
  const int64_t nv = 2, dk = 3, dv = 4;
  RuleInputs in = random_rule_inputs(1, nv, dk, dv, rng, -1.f, -0.1f);
  const Tensor s0 = in.state.clone();
  Tensor o = gated_delta_rule_recurrent_ref(in.q, in.k, in.v, in.g, in.beta, in.state);
  for (int64_t h = 0; h < nv; ++h) {
    const double decay = std::exp(double(in.g.item_f32(h))), b = in.beta.item_f32(h);
    std::vector<double> S(dk * dv), delta(dv, 0.0);
    for (int64_t i = 0; i < dk * dv; ++i) S[i] = decay * s0.item_f32(h * dk * dv + i);
    for (int64_t j = 0; j < dv; ++j) {
      double kv = 0;
      for (int64_t i = 0; i < dk; ++i) kv += S[i * dv + j] * in.k.item_f32(h * dk + i);
      delta[j] = b * (in.v.item_f32(h * dv + j) - kv);
    }
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += in.k.item_f32(h * dk + i) * delta[j];
    for (int64_t j = 0; j < dv; ++j) {
      double oj = 0;
      for (int64_t i = 0; i < dk; ++i) oj += S[i * dv + j] * in.q.item_f32(h * dk + i);
      EXPECT_NEAR(o.item_f32(h * dv + j), oj, 1e-5) << "head " << h << " column " << j;
    }
    for (int64_t i = 0; i < dk * dv; ++i) EXPECT_NEAR(in.state.item_f32(h * dk * dv + i), S[i], 1e-5);
  }
}

TEST(GdnRule, ChunkedEqualsRecurrent) {
  std::mt19937_64 rng(test_seed(903));
  const int64_t T = 150, nv = 3, dk = 16, dv = 8;
  for (auto [g_lo, g_hi] : {std::pair{-0.3f, -0.01f}, std::pair{-8.f, -2.f}}) {  // mild and strong decay
    RuleInputs in = random_rule_inputs(T, nv, dk, dv, rng, g_lo, g_hi);
    Tensor s_rec = in.state.clone();
    const Tensor want = gated_delta_rule_recurrent_ref(in.q, in.k, in.v, in.g, in.beta, s_rec);
    for (int64_t chunk : {1, 5, 64, 150, 256}) {
      Tensor s = in.state.clone();
      const Tensor got = gated_delta_rule_chunked_ref(in.q, in.k, in.v, in.g, in.beta, s, chunk);
      EXPECT_LT(rel_diff(got, want), 2e-5) << "chunk " << chunk << ", g in [" << g_lo << ", " << g_hi << "]";
      EXPECT_LT(rel_diff(s, s_rec), 2e-5) << "final state, chunk " << chunk;
    }
  }
}

TEST(GdnNorm, GatedRmsNormMatchesFormula) {
  std::mt19937_64 rng(test_seed(904));
  const int64_t D = 7;
  Tensor x = random_normal({2, 3, D}, rng), z = random_normal({2, 3, D}, rng), w = random_normal({D}, rng);
  Tensor y = rms_norm_gated_ref(x, z, w.to(DType::kBF16), 1e-6);
  const Tensor wb = w.to(DType::kBF16).to_f32();
  for (int64_t r = 0; r < 6; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(x.item_f32(r * D + i)) * x.item_f32(r * D + i);
    const double inv = 1 / std::sqrt(ss / D + 1e-6);
    for (int64_t i = 0; i < D; ++i) {
      const double zi = z.item_f32(r * D + i);
      EXPECT_NEAR(y.item_f32(r * D + i), wb.item_f32(i) * x.item_f32(r * D + i) * inv * zi / (1 + std::exp(-zi)), 1e-5);
    }
  }
}

struct LayerFixture {
  GdnShape shape;
  GdnWeights w;
};

LayerFixture random_layer(std::mt19937_64& rng) {
  LayerFixture f;
  f.shape.hidden = 48;
  f.shape.num_k_heads = 2;
  f.shape.num_v_heads = 4;
  f.shape.head_k_dim = 8;
  f.shape.head_v_dim = 6;
  f.shape.conv_kernel = 4;
  const GdnShape& s = f.shape;
  const float ws = 1.f / std::sqrt(float(s.hidden));
  f.w.in_proj_qkv = random_normal({s.conv_dim(), s.hidden}, rng, ws).to(DType::kBF16);
  f.w.in_proj_z = random_normal({s.value_dim(), s.hidden}, rng, ws).to(DType::kBF16);
  f.w.in_proj_b = random_normal({s.num_v_heads, s.hidden}, rng, ws).to(DType::kBF16);
  f.w.in_proj_a = random_normal({s.num_v_heads, s.hidden}, rng, ws).to(DType::kBF16);
  f.w.conv1d = random_normal({s.conv_dim(), 1, s.conv_kernel}, rng, 0.5f).to(DType::kBF16);
  f.w.a_log = random_uniform({s.num_v_heads}, rng, -1.f, 1.f);
  f.w.dt_bias = random_uniform({s.num_v_heads}, rng, -0.5f, 0.5f);
  f.w.norm = random_uniform({s.head_v_dim}, rng, 0.5f, 1.5f);
  f.w.out_proj = random_normal({s.hidden, s.value_dim()}, rng, 1.f / std::sqrt(float(s.value_dim()))).to(DType::kBF16);
  return f;
}

TEST(GdnLayer, PrefillInChunksThenDecodeEqualsOneCall) {
  std::mt19937_64 rng(test_seed(905));
  LayerFixture f = random_layer(rng);
  const int64_t T = 77;
  Tensor x = random_normal({T, f.shape.hidden}, rng);
  GdnState whole = GdnState::zeros(f.shape);
  const Tensor want = gdn_forward_ref(x, f.w, f.shape, whole, /*chunked=*/false);
  EXPECT_EQ(want.shape(), (Shape{T, f.shape.hidden}));
  GdnState whole_chunked = GdnState::zeros(f.shape);
  EXPECT_LT(rel_diff(gdn_forward_ref(x, f.w, f.shape, whole_chunked, /*chunked=*/true), want), 2e-5);

  // prefill of 40 tokens in chunks of 32 and 8, then 37 decode steps of one token
  GdnState st = GdnState::zeros(f.shape);
  Tensor got = gdn_forward_ref(x.slice0(0, 32).clone(), f.w, f.shape, st, true);
  got = concat0(got, gdn_forward_ref(x.slice0(32, 40).clone(), f.w, f.shape, st, true));
  for (int64_t t = 40; t < T; ++t) got = concat0(got, gdn_forward_ref(x.slice0(t, t + 1).clone(), f.w, f.shape, st, false));
  EXPECT_LT(rel_diff(got, want), 2e-5);
  EXPECT_EQ(test::max_abs_diff(st.conv, whole.conv), 0.0);  // the conv state is exact
  EXPECT_LT(rel_diff(st.recurrent, whole.recurrent), 2e-5);

  // a second sequence does not see the first one's state
  GdnState fresh = GdnState::zeros(f.shape);
  const Tensor first = gdn_forward_ref(x.slice0(0, 5).clone(), f.w, f.shape, fresh, false);
  EXPECT_LT(rel_diff(first, want.slice0(0, 5).clone()), 2e-5);
  EXPECT_GT(rel_diff(gdn_forward_ref(x.slice0(0, 5).clone(), f.w, f.shape, st, false), first), 1e-3)
      << "the state of a sequence under way must change the outputs";
}

TEST(GdnLayer, ArgumentErrorsNameTheTensor) {
  std::mt19937_64 rng(test_seed(906));
  LayerFixture f = random_layer(rng);
  GdnState st = GdnState::zeros(f.shape);
  Tensor x = random_normal({3, f.shape.hidden}, rng);
  auto expect_error = [&](GdnWeights w, GdnShape s, const Tensor& input, const std::string& what) {
    GdnState state = GdnState::zeros(f.shape);
    try {
      gdn_forward_ref(input, w, s, state, false);
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  GdnWeights bad = f.w;
  bad.in_proj_z = random_normal({3, f.shape.hidden}, rng);
  expect_error(bad, f.shape, x, "in_proj_z");
  bad = f.w;
  bad.out_proj = random_normal({f.shape.hidden, 5}, rng);
  expect_error(bad, f.shape, x, "out_proj");
  bad = f.w;
  bad.conv1d = random_normal({f.shape.conv_dim() + 1, 1, 4}, rng);
  expect_error(bad, f.shape, x, "conv1d weight");
  GdnShape odd = f.shape;
  odd.num_v_heads = 3;  // not a multiple of nk = 2
  expect_error(f.w, odd, x, "multiple of nk");
  expect_error(f.w, f.shape, random_normal({3, f.shape.hidden + 1}, rng), "gated deltanet input");
  Tensor wrong_state = Tensor::zeros(DType::kF32, {1, 2, 3});
  RuleInputs in = random_rule_inputs(2, 2, 3, 4, rng, -1.f, -0.1f);
  EXPECT_THROW(gated_delta_rule_recurrent_ref(in.q, in.k, in.v, in.g, in.beta, wrong_state), Error);
  EXPECT_THROW(gated_delta_rule_chunked_ref(in.q, in.k, in.v, in.g, in.beta, in.state, 0), Error);
}

}  // namespace
}  // namespace moelora::ops
