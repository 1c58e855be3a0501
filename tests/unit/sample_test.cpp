// Sampling reference (ops/sample): sample_row_ref against independently written expectations.
//   - greedy: first index of the maximum, u ignored, ties to the lower id;
//   - temperature: a stratified sweep of u reproduces softmax(logits / T) token by token (each
//     token's share of the sweep is within one step of its probability), random u passes a
//     chi-square bound;
//   - top-k and top-p: only the kept prefix is ever returned and it is renormalized; top_p just
//     below / above a cumulative mass moves the boundary by one token;
//   - ties in probability: ranked by lower id (top-k cuts through a tie, u = 0 picks the lowest);
//   - model::Sampler draws through the same rule (next_uniform + sample_row_ref);
//   - argument errors name the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "model/sampler.h"
#include "ops/sample/sample.h"
#include "support/test_support.h"

namespace moelora::ops {
namespace {

using test::test_seed;

std::vector<float> random_logits(std::mt19937_64& rng, int64_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(static_cast<size_t>(n));
  for (float& v : out) v = dist(rng);
  return out;
}

// softmax(logits / T) in long double, written without the reference's code path.
std::vector<double> softmax(const std::vector<float>& logits, double temperature) {
  long double max = logits[0];
  for (float v : logits) max = std::max<long double>(max, v);
  std::vector<long double> e(logits.size());
  long double sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    e[i] = std::exp((static_cast<long double>(logits[i]) - max) / temperature);
    sum += e[i];
  }
  std::vector<double> p(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) p[i] = static_cast<double>(e[i] / sum);
  return p;
}

// counts[token] over u = (i + 0.5) / n, i < n.
std::vector<int> stratified_counts(const std::vector<float>& logits, const SampleRowParams& params,
                                   int n) {
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    const double u = (static_cast<double>(i) + 0.5) / n;
    const int32_t token = sample_row_ref(logits, params, u);
    EXPECT_GE(token, 0);
    EXPECT_LT(token, static_cast<int32_t>(logits.size()));
    ++counts[static_cast<size_t>(token)];
  }
  return counts;
}

TEST(SampleRef, GreedyIsTheFirstMaximumAndIgnoresU) {
  std::mt19937_64 rng(test_seed(101));
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> logits = random_logits(rng, 37 + trial, 2.5f);
    // Plant a tie of the maximum at two positions: the lower one must win.
    const auto max_it = std::max_element(logits.begin(), logits.end());
    const size_t first = static_cast<size_t>(max_it - logits.begin());
    const size_t other = (first + 5 + static_cast<size_t>(trial)) % logits.size();
    logits[other] = *max_it;
    const int32_t expected = static_cast<int32_t>(std::min(first, other));
    for (double u : {0.0, 0.3, 0.999999}) {
      EXPECT_EQ(sample_row_ref(logits, {0.0f, 1.0f, 0}, u), expected);
      EXPECT_EQ(sample_row_ref(logits, {-1.0f, 0.2f, 3}, u), expected);  // T <= 0: greedy
    }
  }
  // -inf logits (masked tokens) are fine.
  EXPECT_EQ(sample_row_ref(std::vector<float>{-INFINITY, -3.0f, -INFINITY}, {0.0f, 1.0f, 0}, 0.5),
            1);
}

TEST(SampleRef, TemperatureSweepReproducesSoftmax) {
  std::mt19937_64 rng(test_seed(103));
  for (float temperature : {0.3f, 1.0f, 1.7f}) {
    const std::vector<float> logits = random_logits(rng, 53, 2.0f);
    const std::vector<double> p = softmax(logits, temperature);
    const int n = 20011;
    const std::vector<int> counts = stratified_counts(logits, {temperature, 1.0f, 0}, n);
    // The pick maps u to the token whose cumulative interval contains it, so a grid of n points
    // lands ceil/floor(n p) times on each token: one grid step of slack (plus rounding).
    for (size_t i = 0; i < logits.size(); ++i) {
      EXPECT_NEAR(static_cast<double>(counts[i]) / n, p[i], 1.0 / n + 1e-9)
          << "token " << i << " at temperature " << temperature;
    }
  }
}

TEST(SampleRef, RandomUniformsFollowSoftmaxChiSquare) {
  std::mt19937_64 rng(test_seed(107));
  const std::vector<float> logits = {0.5f, -1.0f, 2.0f, 1.25f, 0.0f, -0.5f, 1.5f};
  const float temperature = 0.8f;
  const std::vector<double> p = softmax(logits, temperature);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const int n = 40000;
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i)
    ++counts[sample_row_ref(logits, {temperature, 1.0f, 0}, uniform(rng))];
  double chi2 = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double expected = n * p[i];
    chi2 += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  // 6 degrees of freedom: P(chi2 > 30) ~ 4e-5.
  EXPECT_LT(chi2, 30.0);
}

TEST(SampleRef, TopKKeepsTheKMostProbableRenormalized) {
  std::mt19937_64 rng(test_seed(109));
  const std::vector<float> logits = random_logits(rng, 41, 1.5f);
  const std::vector<double> p = softmax(logits, 1.0);
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  for (int32_t k : {1, 2, 5, 40, 41, 1000}) {
    const size_t kept = std::min<size_t>(static_cast<size_t>(k), logits.size());
    double mass = 0;
    for (size_t i = 0; i < kept; ++i) mass += p[order[i]];
    const int n = 10007;
    const std::vector<int> counts = stratified_counts(logits, {1.0f, 1.0f, k}, n);
    for (size_t r = 0; r < logits.size(); ++r) {
      const int32_t token = order[r];
      const double expected = r < kept ? p[token] / mass : 0.0;
      EXPECT_NEAR(static_cast<double>(counts[token]) / n, expected, 1.0 / n + 1e-9)
          << "top_k " << k << " rank " << r;
    }
  }
}

TEST(SampleRef, TopPBoundaryMovesByOneToken) {
  // Probabilities 0.4, 0.3, 0.2, 0.1 at ids 2, 0, 3, 1.
  const std::vector<float> logits = {std::log(0.3f), std::log(0.1f), std::log(0.4f),
                                     std::log(0.2f)};
  const std::vector<double> p = softmax(logits, 1.0);
  auto kept = [&](float top_p) {
    const std::vector<int> counts = stratified_counts(logits, {1.0f, top_p, 0}, 4001);
    std::vector<int32_t> ids;
    for (size_t i = 0; i < counts.size(); ++i)
      if (counts[i] > 0) ids.push_back(static_cast<int32_t>(i));
    return ids;
  };
  const double first = p[2], two = p[2] + p[0], three = two + p[3];
  EXPECT_EQ(kept(0.05f), (std::vector<int32_t>{2}));  // the most probable token is always kept
  EXPECT_EQ(kept(static_cast<float>(first) - 1e-4f), (std::vector<int32_t>{2}));
  EXPECT_EQ(kept(static_cast<float>(first) + 1e-4f), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(kept(static_cast<float>(two) - 1e-4f), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(kept(static_cast<float>(two) + 1e-4f), (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(kept(static_cast<float>(three) + 1e-4f), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(kept(1.0f), (std::vector<int32_t>{0, 1, 2, 3}));
  // Renormalized over the kept pair, and top_k applies on top of top_p.
  const std::vector<int> counts = stratified_counts(logits, {1.0f, 0.5f, 0}, 7001);
  EXPECT_NEAR(counts[2] / 7001.0, p[2] / two, 1.0 / 7001 + 1e-9);
  EXPECT_NEAR(counts[0] / 7001.0, p[0] / two, 1.0 / 7001 + 1e-9);
  EXPECT_EQ(stratified_counts(logits, {1.0f, 0.9f, 1}, 101)[2], 101);
}

TEST(SampleRef, UWalksTheRankingInOrder) {
  // Probabilities 0.4, 0.3, 0.2, 0.1 at ids 2, 0, 3, 1: u in [0, .4) -> 2, [.4, .7) -> 0, ...
  const std::vector<float> logits = {std::log(0.3f), std::log(0.1f), std::log(0.4f),
                                     std::log(0.2f)};
  const SampleRowParams params{1.0f, 1.0f, 0};
  EXPECT_EQ(sample_row_ref(logits, params, 0.0), 2);
  EXPECT_EQ(sample_row_ref(logits, params, 0.39), 2);
  EXPECT_EQ(sample_row_ref(logits, params, 0.41), 0);
  EXPECT_EQ(sample_row_ref(logits, params, 0.69), 0);
  EXPECT_EQ(sample_row_ref(logits, params, 0.71), 3);
  EXPECT_EQ(sample_row_ref(logits, params, 0.89), 3);
  EXPECT_EQ(sample_row_ref(logits, params, 0.91), 1);
  EXPECT_EQ(sample_row_ref(logits, params, std::nextafter(1.0, 0.0)), 1);
}

TEST(SampleRef, ProbabilityTiesRankByLowerId) {
  // ids 1, 3, 4, 6 share the top logit; 0 is next; the rest far below.
  const std::vector<float> logits = {1.0f, 3.0f, -5.0f, 3.0f, 3.0f, -6.0f, 3.0f};
  // u = 0 picks the first of the ranking: the lowest tied id.
  EXPECT_EQ(sample_row_ref(logits, {0.7f, 1.0f, 0}, 0.0), 1);
  // top_k = 3 cuts through the tie: ids 1, 3, 4, each a third.
  std::vector<int> counts = stratified_counts(logits, {0.7f, 1.0f, 3}, 3000);
  EXPECT_EQ(counts[1], 1000);
  EXPECT_EQ(counts[3], 1000);
  EXPECT_EQ(counts[4], 1000);
  EXPECT_EQ(counts[6], 0);
  // top_p = 0.3 with four equal tokens of ~0.25 each (the rest is tiny): two tokens are kept.
  counts = stratified_counts(logits, {0.25f, 0.3f, 0}, 2000);
  EXPECT_EQ(counts[1], 1000);
  EXPECT_EQ(counts[3], 1000);
  EXPECT_EQ(counts[4] + counts[6] + counts[0], 0);
}

TEST(SampleRef, SamplerUsesTheSameRule) {
  std::mt19937_64 rng(test_seed(113));
  const std::vector<float> logits = random_logits(rng, 97, 2.0f);
  const uint64_t seed = rng();
  model::Sampler sampler({0.9, 0.85, 20, seed});
  model::Sampler draws({0.9, 0.85, 20, seed});
  for (int i = 0; i < 300; ++i) {
    const double u = draws.next_uniform();
    ASSERT_EQ(sampler.sample(logits), sample_row_ref(logits, {0.9f, 0.85f, 20}, u)) << "draw " << i;
  }
  // Greedy requests consume nothing from the stream.
  model::Sampler greedy({0.0, 1.0, 0, seed});
  model::Sampler fresh({0.0, 1.0, 0, seed});
  for (int i = 0; i < 5; ++i) greedy.sample(logits);
  EXPECT_EQ(greedy.next_uniform(), fresh.next_uniform());
}

TEST(SampleRef, BadArgumentsNameTheField) {
  const std::vector<float> logits = {0.0f, 1.0f};
  EXPECT_NE(test::error_message([&] {
              sample_row_ref(std::vector<float>{}, {1.0f, 1.0f, 0}, 0.5);
            }).find("empty"),
            std::string::npos);
  EXPECT_NE(test::error_message([&] {
              sample_row_ref(std::vector<float>{0.0f, NAN}, {1.0f, 1.0f, 0}, 0.5);
            }).find("logit of token 1"),
            std::string::npos);
  EXPECT_NE(test::error_message([&] {
              sample_row_ref(logits, {1.0f, 0.0f, 0}, 0.5);
            }).find("top_p"),
            std::string::npos);
  EXPECT_NE(test::error_message([&] {
              sample_row_ref(logits, {1.0f, 1.0f, -1}, 0.5);
            }).find("top_k"),
            std::string::npos);
  EXPECT_NE(test::error_message([&] {
              sample_row_ref(logits, {1.0f, 1.0f, 0}, 1.0);
            }).find("uniform"),
            std::string::npos);
  EXPECT_NE(test::error_message([&] {
              sample_row_ref(logits, {NAN, 1.0f, 0}, 0.5);
            }).find("temperature"),
            std::string::npos);
}

}  // namespace
}  // namespace moelora::ops
