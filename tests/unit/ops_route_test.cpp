// The routers' CPU reference (ops/route): softmax top-k and DeepSeek's sigmoid noaux_tc with group
// masking, against a sort-based oracle in double precision (ops_ref_oracles.h): hand-computed
// cases, ties, large logits, random cases, forced ids, validation.
#include <gtest/gtest.h>

#include "unit/ops_ref_oracles.h"

namespace moelora {
namespace {

using namespace ops_ref_test;

// ============================================================================ routing tests

TEST(RouteSoftmax, HandComputedTopKWithAndWithoutRenormalize) {
  const Tensor logits = Tensor::from_f32({1.0f, 3.0f, 2.0f, 0.0f}, {1, 4});
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + std::exp(0.0);
  ops::RouteResult r = ops::route_ref(logits, Tensor(), softmax_params(4, 2, false));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(r.weights.data<float>()[0], std::exp(3.0) / z, 1e-7);
  EXPECT_NEAR(r.weights.data<float>()[1], std::exp(2.0) / z, 1e-7);
  r = ops::route_ref(logits, Tensor(), softmax_params(4, 2, true));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(r.weights.data<float>()[0], std::exp(3.0) / (std::exp(3.0) + std::exp(2.0)), 1e-7);
  EXPECT_NEAR(r.weights.data<float>()[1], std::exp(2.0) / (std::exp(3.0) + std::exp(2.0)), 1e-7);
}

TEST(RouteSoftmax, LargeLogitsStayFinite) {
  // Max subtraction: exp(1000) would overflow without it.
  const Tensor logits = Tensor::from_f32({1000.0f, 999.0f, -1000.0f}, {1, 3});
  const ops::RouteResult r = ops::route_ref(logits, Tensor(), softmax_params(3, 2, false));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights.data<float>()[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(r.weights.data<float>()[1], std::exp(-1.0) / (1.0 + std::exp(-1.0)), 1e-6);
}

TEST(RouteSoftmax, TiesGoToTheLowerIndex) {
  const Tensor logits =
      Tensor::from_f32({2.0f, 5.0f, 5.0f, 1.0f, 5.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, {2, 5});
  ops::RouteResult r = ops::route_ref(logits, Tensor(), softmax_params(5, 2, false));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(ids_row(r, 1), (std::vector<int32_t>{0, 1}));
  r = ops::route_ref(logits, Tensor(), softmax_params(5, 3, true));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(ids_row(r, 1), (std::vector<int32_t>{0, 1, 2}));
  for (int j = 0; j < 3; ++j) EXPECT_NEAR(r.weights.data<float>()[3 + j], 1.0 / 3, 1e-7);
}

TEST(RouteNoauxTc, GroupMaskingChangesTheSelection) {
  // Groups of 2: g0 = {0.9, 0.1} (sum 1.0), g1 = {0.6, 0.6} (1.2), g2 = {0.7, 0.55} (1.25),
  // g3 = {0.2, 0.2}. Plain top-2 picks {0, 4}; keeping the 2 best groups (g2, g1) gives {4, 2}
  // (experts 2 and 3 tie: the lower index wins).
  const std::vector<double> s = {0.9, 0.1, 0.6, 0.6, 0.7, 0.55, 0.2, 0.2};
  std::vector<float> l;
  for (double v : s) l.push_back(logit_of(v));
  const Tensor logits = Tensor::from_f32(l, {1, 8});
  ops::RouteResult plain = ops::route_ref(logits, Tensor(), noaux_params(8, 2, 1, 1, false, 1.0f));
  EXPECT_EQ(ids_row(plain, 0), (std::vector<int32_t>{0, 4}));
  ops::RouteResult grouped =
      ops::route_ref(logits, Tensor(), noaux_params(8, 2, 4, 2, false, 1.0f));
  EXPECT_EQ(ids_row(grouped, 0), (std::vector<int32_t>{4, 2}));
  EXPECT_NEAR(grouped.weights.data<float>()[0], 0.7, 1e-6);
  EXPECT_NEAR(grouped.weights.data<float>()[1], 0.6, 1e-6);
  // Renormalized and scaled.
  grouped = ops::route_ref(logits, Tensor(), noaux_params(8, 2, 4, 2, true, 2.5f));
  EXPECT_NEAR(grouped.weights.data<float>()[0], 2.5 * 0.7 / 1.3, 1e-6);
  EXPECT_NEAR(grouped.weights.data<float>()[1], 2.5 * 0.6 / 1.3, 1e-6);
}

TEST(RouteNoauxTc, GroupScoreIsTheSumOfTheTopTwo) {
  // Groups of 4. By max: gA; by top-2 sum: gB; by full sum: gC. Only gB is right.
  const std::vector<double> s = {0.95, 0.1,  0.1,  0.1,   // gA: max 0.95, top-2 1.05, sum 1.25
                                 0.6,  0.55, 0.05, 0.05,  // gB: max 0.6,  top-2 1.15, sum 1.25
                                 0.5,  0.5,  0.5,  0.5,   // gC: max 0.5,  top-2 1.0,  sum 2.0
                                 0.2,  0.2,  0.2,  0.2};
  std::vector<float> l;
  for (double v : s) l.push_back(logit_of(v));
  const ops::RouteResult r = ops::route_ref(Tensor::from_f32(l, {1, 16}), Tensor(),
                                            noaux_params(16, 2, 4, 1, false, 1.0f));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{4, 5}));
}

TEST(RouteNoauxTc, BiasSelectsButDoesNotWeight) {
  const Tensor logits = Tensor::from_f32({1.0f, 0.5f, 0.0f, 0.0f}, {1, 4});
  const Tensor bias = Tensor::from_f32({0.0f, 0.3f, 0.0f, 0.0f}, {4});
  ops::RouteResult r = ops::route_ref(logits, Tensor(), noaux_params(4, 1, 1, 1, false, 1.0f));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{0}));
  EXPECT_NEAR(r.weights.data<float>()[0], sigmoid_d(1.0), 1e-7);
  // sigmoid(0.5) + 0.3 = 0.922 > sigmoid(1) = 0.731: expert 1 is chosen, weighted by sigmoid(0.5).
  r = ops::route_ref(logits, bias, noaux_params(4, 1, 1, 1, false, 1.0f));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{1}));
  EXPECT_NEAR(r.weights.data<float>()[0], sigmoid_d(0.5), 1e-7);
  // k = 2, renormalized over the unbiased scores, scaled by 2.827.
  r = ops::route_ref(logits, bias, noaux_params(4, 2, 1, 1, true, 2.827f));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{1, 0}));
  const double sum = sigmoid_d(0.5) + sigmoid_d(1.0);
  EXPECT_NEAR(r.weights.data<float>()[0], 2.827 * sigmoid_d(0.5) / sum, 1e-6);
  EXPECT_NEAR(r.weights.data<float>()[1], 2.827 * sigmoid_d(1.0) / sum, 1e-6);
  // Without renormalization the scale still applies.
  r = ops::route_ref(logits, bias, noaux_params(4, 2, 1, 1, false, 2.827f));
  EXPECT_NEAR(r.weights.data<float>()[0], 2.827 * sigmoid_d(0.5), 1e-6);
}

TEST(RouteNoauxTc, GroupTiesGoToTheLowerGroup) {
  // All four groups score the same; topk_group 2 keeps groups 0 and 1 -> experts from {0..3}.
  const std::vector<float> l(8, 0.25f);
  const ops::RouteResult r =
      ops::route_ref(Tensor::from_f32(l, {1, 8}), Tensor(), noaux_params(8, 3, 4, 2, true, 1.0f));
  EXPECT_EQ(ids_row(r, 0), (std::vector<int32_t>{0, 1, 2}));
}

struct RandomRouteCase {
  RouteParams params;
  bool with_bias;
  bool coarse;  // logits on a 0.5 grid: many exact ties
};

TEST(Route, RandomCasesMatchSortingOracle) {
  std::mt19937_64 rng(test::test_seed(101));
  const std::vector<RandomRouteCase> cases = {
      {softmax_params(12, 3, false), false, false},
      {softmax_params(12, 3, true), false, false},
      {softmax_params(7, 7, true), false, false},
      {softmax_params(9, 4, true), false, true},
      {noaux_params(16, 4, 4, 2, true, 2.5f), true, false},
      {noaux_params(24, 5, 1, 1, true, 2.827f), true, false},
      {noaux_params(12, 3, 6, 3, false, 1.5f), true, true},
      {noaux_params(32, 8, 8, 4, true, 2.5f), false, false},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    const RouteParams& p = cases[c].params;
    const int64_t tokens = 37;
    Tensor logits = test::random_normal({tokens, p.num_experts}, rng, 1.5f);
    if (cases[c].coarse) {
      for (int64_t i = 0; i < logits.numel(); ++i)
        logits.data<float>()[i] = std::round(logits.data<float>()[i] * 2) / 2;
    }
    Tensor bias;
    std::vector<double> bias_d;
    if (cases[c].with_bias) {
      bias = test::random_normal({p.num_experts}, rng, 0.1f);
      if (cases[c].coarse) {
        for (int64_t i = 0; i < bias.numel(); ++i)
          bias.data<float>()[i] = std::round(bias.data<float>()[i] * 8) / 8;
      }
      bias_d = to_double(bias);
    }
    const ops::RouteResult r = ops::route_ref(logits, bias, p);
    ASSERT_EQ(r.ids.shape(), (Shape{tokens, p.top_k}));
    ASSERT_EQ(r.weights.shape(), (Shape{tokens, p.top_k}));
    const std::vector<double> ld = to_double(logits);
    for (int64_t t = 0; t < tokens; ++t) {
      const std::vector<double> row(ld.begin() + t * p.num_experts,
                                    ld.begin() + (t + 1) * p.num_experts);
      const OracleRoute o = oracle_route(row, bias_d, p);
      ASSERT_EQ(ids_row(r, t), o.ids) << "case " << c << " token " << t;
      for (int64_t j = 0; j < p.top_k; ++j)
        EXPECT_NEAR(r.weights.data<float>()[t * p.top_k + j], o.weights[j],
                    2e-6 * (1 + std::fabs(o.weights[j])))
            << "case " << c << " token " << t << " j " << j;
    }
  }
}

TEST(Route, ParamValidationNamesTheField) {
  EXPECT_ERROR_MENTIONS(ops::check_route_params(softmax_params(0, 1, false)), "num_experts");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(softmax_params(8, 0, false)), "top_k");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(softmax_params(8, 9, false)), "top_k 9",
                        "num_experts 8");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(noaux_params(10, 2, 4, 2, true, 1.0f)),
                        "num_experts 10", "n_group 4");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(noaux_params(8, 2, 8, 2, true, 1.0f)), "n_group",
                        "at least 2");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(noaux_params(16, 2, 4, 5, true, 1.0f)),
                        "topk_group 5");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(noaux_params(16, 2, 4, 0, true, 1.0f)),
                        "topk_group 0");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(noaux_params(16, 9, 4, 2, true, 1.0f)),
                        "topk_group", "top_k 9");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(noaux_params(16, 2, 0, 1, true, 1.0f)), "n_group");
  EXPECT_ERROR_MENTIONS(ops::check_route_params(noaux_params(16, 2, 4, 2, true, NAN)),
                        "routed_scaling_factor");
  EXPECT_NO_THROW(ops::check_route_params(noaux_params(16, 8, 4, 2, true, 2.5f)));
  EXPECT_NO_THROW(ops::check_route_params(noaux_params(384, 8, 1, 1, true, 2.827f)));  // Kimi
  // Route-time checks: logits width, bias shape, non-finite logits.
  EXPECT_ERROR_MENTIONS(
      ops::route_ref(Tensor::zeros(DType::kF32, {2, 5}), Tensor(), softmax_params(4, 2, false)),
      "num_experts is 4");
  EXPECT_ERROR_MENTIONS(
      ops::route_ref(Tensor::zeros(DType::kF32, {2, 4}), Tensor::zeros(DType::kF32, {3}),
                     noaux_params(4, 2, 1, 1, false, 1.0f)),
      "e_score_correction_bias", "[4]", "[3]");
  Tensor bad = Tensor::zeros(DType::kF32, {2, 4});
  bad.data<float>()[6] = NAN;
  EXPECT_ERROR_MENTIONS(ops::route_ref(bad, Tensor(), softmax_params(4, 2, false)), "token 1",
                        "expert 2");
}

TEST(Route, ZeroTokens) {
  const ops::RouteResult r =
      ops::route_ref(Tensor::zeros(DType::kF32, {0, 6}), Tensor(), softmax_params(6, 2, true));
  EXPECT_EQ(r.ids.shape(), (Shape{0, 2}));
  EXPECT_EQ(r.weights.shape(), (Shape{0, 2}));
}

// Forced routing: the own selection reproduces route_ref bit for bit; another selection gets the
// weights the router gives those experts (softmax probabilities / unbiased sigmoid scores,
// renormalized and scaled), computed here in double.
TEST(Route, ForcedIdsKeepTheWeightRule) {
  std::mt19937_64 rng(test::test_seed(131));
  const std::vector<RouteParams> cases = {softmax_params(12, 3, false), softmax_params(12, 3, true),
                                          noaux_params(16, 4, 4, 2, true, 2.5f),
                                          noaux_params(12, 3, 6, 3, false, 1.5f)};
  for (size_t c = 0; c < cases.size(); ++c) {
    const RouteParams& p = cases[c];
    const int64_t tokens = 9, k = p.top_k, e_count = p.num_experts;
    const Tensor logits = test::random_normal({tokens, e_count}, rng, 1.5f);
    Tensor bias;
    if (p.kind == RouterKind::kSigmoidNoauxTc) bias = test::random_normal({e_count}, rng, 0.1f);
    const ops::RouteResult own = ops::route_ref(logits, bias, p);
    const ops::RouteResult again = ops::route_ref(logits, bias, p, own.ids);
    EXPECT_EQ(std::memcmp(own.ids.data<int32_t>(), again.ids.data<int32_t>(), tokens * k * 4), 0);
    EXPECT_EQ(std::memcmp(own.weights.data<float>(), again.weights.data<float>(), tokens * k * 4),
              0);
    // Another selection: the k experts right after the own choice's first one (mod E).
    Tensor other = Tensor::empty(DType::kI32, {tokens, k});
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < k; ++j)
        other.data<int32_t>()[t * k + j] =
            static_cast<int32_t>((own.ids.data<int32_t>()[t * k] + 1 + j) % e_count);
    const ops::RouteResult forced = ops::route_ref(logits, bias, p, other);
    for (int64_t t = 0; t < tokens; ++t) {
      const float* row = logits.data<float>() + t * e_count;
      std::vector<double> score(e_count);
      double denom = 0, max_logit = row[0];
      for (int64_t e = 1; e < e_count; ++e) max_logit = std::max<double>(max_logit, row[e]);
      for (int64_t e = 0; e < e_count; ++e) {
        score[e] = p.kind == RouterKind::kSoftmaxTopK ? std::exp(row[e] - max_logit)
                                                      : 1.0 / (1.0 + std::exp(-double(row[e])));
        denom += score[e];
      }
      if (p.kind == RouterKind::kSoftmaxTopK)
        for (double& v : score) v /= denom;
      double selected = 0;
      for (int64_t j = 0; j < k; ++j) selected += score[other.data<int32_t>()[t * k + j]];
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = other.data<int32_t>()[t * k + j];
        EXPECT_EQ(forced.ids.data<int32_t>()[t * k + j], e) << "case " << c << " token " << t;
        double w = score[e];
        if (p.renormalize) w /= selected;
        if (p.kind == RouterKind::kSigmoidNoauxTc) w *= p.routed_scaling_factor;
        EXPECT_NEAR(forced.weights.data<float>()[t * k + j], w, 2e-6 * (1 + std::fabs(w)))
            << "case " << c << " token " << t << " j " << j;
      }
    }
  }
  // Bad forced ids name the problem.
  const RouteParams p = softmax_params(6, 2, true);
  const Tensor logits = test::random_normal({2, 6}, rng);
  Tensor repeat = Tensor::zeros(DType::kI32, {2, 2});
  EXPECT_ERROR_MENTIONS(ops::route_ref(logits, Tensor(), p, repeat), "repeat expert 0");
  repeat.data<int32_t>()[1] = 6;
  EXPECT_ERROR_MENTIONS(ops::route_ref(logits, Tensor(), p, repeat), "outside [0, 6)");
  EXPECT_ERROR_MENTIONS(ops::route_ref(logits, Tensor(), p, Tensor::zeros(DType::kI32, {2, 3})),
                        "forced routing ids");
}

}  // namespace
}  // namespace moelora
