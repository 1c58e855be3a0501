// The GPU sampler (ops/sample/sample_cuda.cuh) against sample_row_ref on random logits (seed
// printed): greedy bit-exact (ties, masked rows), sampled rows with random u equal to the
// reference except where the reference's own margin is below 1e-5 (counted, required rare), and
// the sampled distribution following the softmax with temperature, top-p and top-k.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "ops/sample/sample.h"
#include "ops/sample/sample_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

// Runs the GPU sampler on rows [B, V] (row stride `stride`), returning its tokens.
std::vector<int32_t> run_sampler(const std::vector<float>& logits, int rows, int vocab,
                                 int64_t stride, const std::vector<ops::SampleRowParams>& params,
                                 const std::vector<float>& u, int valid_rows) {
  auto logits_d = upload_vector(logits);
  auto params_d = upload_vector(params);
  auto u_d = upload_vector(u);
  auto tokens_d = upload_vector(std::vector<int32_t>(rows, -7));
  auto count_d = upload_vector(std::vector<int32_t>{valid_rows});
  ops::cuda::SampleArgs a;
  a.logits = logits_d.as<float>();
  a.stride = stride;
  a.params = params_d.as<ops::SampleRowParams>();
  a.uniform = u_d.as<float>();
  a.tokens = tokens_d.as<int32_t>();
  a.rows = rows;
  a.num_rows = count_d.as<int32_t>();
  a.vocab = vocab;
  ops::cuda::launch_sample(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  return download_vector<int32_t>(tokens_d, static_cast<size_t>(rows));
}

TEST(Sm90_Sample, GreedySampleIsBitExact) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(371));
  for (int vocab : {151936, 163840, 1001, 7}) {
    SCOPED_TRACE(vocab);
    const int rows = 9, valid = 8;
    const int64_t stride = vocab + 5;
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<float> logits(static_cast<size_t>(rows) * stride,
                              1e30f);  // padding must be ignored
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < vocab; ++i)
        logits[static_cast<size_t>(r) * stride + i] = round_to_bf16(dist(rng));
    std::uniform_int_distribution<int> pick(0, vocab - 1);
    // Row 1: the maximum planted three times; row 2: all equal; row 3: all -inf but one late token.
    const float top = 40.0f;
    for (int k = 0; k < 3; ++k) logits[static_cast<size_t>(stride) + pick(rng)] = top;
    for (int i = 0; i < vocab; ++i) logits[static_cast<size_t>(2) * stride + i] = -1.5f;
    for (int i = 0; i < vocab; ++i) logits[static_cast<size_t>(3) * stride + i] = -INFINITY;
    logits[static_cast<size_t>(3) * stride + vocab - 1] = -100.0f;
    std::vector<ops::SampleRowParams> params(rows, ops::SampleRowParams{0.0f, 0.5f, 7});
    params[4].temperature = -1.0f;
    std::vector<float> u(rows, 0.73f);
    const std::vector<int32_t> got = run_sampler(logits, rows, vocab, stride, params, u, valid);
    for (int r = 0; r < valid; ++r) {
      const std::span<const float> row(logits.data() + static_cast<size_t>(r) * stride,
                                       static_cast<size_t>(vocab));
      EXPECT_EQ(got[r], ops::sample_row_ref(row, params[r], u[r])) << "row " << r;
    }
    EXPECT_EQ(got[rows - 1], -7) << "a row past num_rows was written";
  }
}

// Whether the reference's decision for this row is within `margin` (relative to the masses
// involved) of flipping: a cumulative mass near u * kept, a top-p prefix near top_p, or a
// probability tie between distinct logits at the top-k / top-p boundary.
bool near_decision_boundary(std::span<const float> logits, const ops::SampleRowParams& params,
                            double u, double margin) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double total = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - max_logit) / params.temperature);
    total += p[i];
  }
  std::vector<int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  size_t kept = order.size();
  if (params.top_k > 0) kept = std::min(kept, static_cast<size_t>(params.top_k));
  bool near = false;
  if (params.top_p < 1.0f) {
    const double limit = static_cast<double>(params.top_p) * total;
    double before = 0;
    size_t n = 0;
    while (n < kept && (n == 0 || before < limit)) {
      if (n > 0 && std::fabs(before - limit) <= margin * total) near = true;
      before += p[order[n++]];
    }
    if (n < kept && std::fabs(before - limit) <= margin * total) near = true;
    kept = n;
  }
  if (kept < order.size() && p[order[kept - 1]] == p[order[kept]] &&
      logits[order[kept - 1]] != logits[order[kept]])
    near = true;
  double kept_mass = 0;
  for (size_t i = 0; i < kept; ++i) kept_mass += p[order[i]];
  const double target = u * kept_mass;
  double cumulative = 0;
  for (size_t i = 0; i < kept; ++i) {
    cumulative += p[order[i]];
    if (std::fabs(cumulative - target) <= margin * kept_mass) near = true;
    if (i + 1 < kept && p[order[i]] == p[order[i + 1]] &&
        logits[order[i]] != logits[order[i + 1]] && cumulative >= target &&
        cumulative - p[order[i]] <= target)
      near = true;
  }
  return near;
}

TEST(Sm90_Sample, SampledRowsMatchTheReference) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(381));
  const std::vector<ops::SampleRowParams> settings = {
      {1.0f, 1.0f, 0},    {0.7f, 0.9f, 0}, {0.6f, 0.95f, 20}, {1.3f, 0.5f, 50}, {1.0f, 1.0f, 1},
      {0.8f, 0.8f, 5000}, {2.0f, 1.0f, 0}, {0.3f, 0.99f, 0},  {1.0f, 0.05f, 0}, {1.1f, 1.0f, 3},
  };
  int rows_checked = 0, skipped = 0;
  for (int vocab : {163840, 151936, 1001, 37}) {
    SCOPED_TRACE(vocab);
    const int rows = vocab > 10000 ? 64 : 128;
    for (int trial = 0; trial < 2; ++trial) {
      std::vector<float> logits(static_cast<size_t>(rows) * vocab);
      std::vector<ops::SampleRowParams> params(rows);
      std::vector<float> u(rows);
      std::uniform_real_distribution<float> unit(0.0f, 1.0f);
      for (int r = 0; r < rows; ++r) {
        // Logit scales of real models (std 2-4); every third row rounded to bf16 (many exact ties),
        // every fifth with a block of masked tokens.
        std::normal_distribution<float> dist(0.0f, 2.0f + static_cast<float>(r % 3));
        for (int i = 0; i < vocab; ++i) {
          float v = dist(rng);
          if (r % 3 == 0) v = round_to_bf16(v);
          if (r % 5 == 0 && i % 7 == 0) v = -INFINITY;
          logits[static_cast<size_t>(r) * vocab + i] = v;
        }
        params[r] = settings[static_cast<size_t>(r) % settings.size()];
        u[r] = std::min(unit(rng), std::nextafter(1.0f, 0.0f));
      }
      const std::vector<int32_t> got = run_sampler(logits, rows, vocab, 0, params, u, rows);
      for (int r = 0; r < rows; ++r) {
        const std::span<const float> row(logits.data() + static_cast<size_t>(r) * vocab,
                                         static_cast<size_t>(vocab));
        const int32_t expected = ops::sample_row_ref(row, params[r], static_cast<double>(u[r]));
        ++rows_checked;
        ASSERT_GE(got[r], 0);
        ASSERT_LT(got[r], vocab);
        if (got[r] == expected) continue;
        ASSERT_TRUE(near_decision_boundary(row, params[r], static_cast<double>(u[r]), 1e-5))
            << "row " << r << " (T " << params[r].temperature << ", top_p " << params[r].top_p
            << ", top_k " << params[r].top_k << ", u " << u[r] << "): GPU token " << got[r]
            << " (p-rank by logit " << row[got[r]] << "), reference " << expected << " (logit "
            << row[expected] << ")";
        ++skipped;
      }
    }
  }
  std::printf("sampled rows checked: %d, differences at a decision boundary: %d\n", rows_checked,
              skipped);
  EXPECT_LE(skipped * 100, rows_checked) << "boundary differences must be rare (<= 1%)";
}

TEST(Sm90_Sample, SampledDistributionFollowsSoftmax) {
  MOELORA_REQUIRE_SM90();
  // One logits row repeated over many rows with u on a stratified grid: the GPU's token counts
  // reproduce the renormalized top-k / top-p distribution of the reference token by token.
  std::mt19937_64 rng(test::test_seed(391));
  const int vocab = 4099, rows = 2048;
  std::normal_distribution<float> dist(0.0f, 2.5f);
  std::vector<float> one(vocab);
  for (float& v : one) v = dist(rng);
  for (const ops::SampleRowParams& p :
       {ops::SampleRowParams{0.9f, 1.0f, 0}, ops::SampleRowParams{1.0f, 0.8f, 0},
        ops::SampleRowParams{0.7f, 1.0f, 10}}) {
    std::vector<float> logits(static_cast<size_t>(rows) * vocab);
    for (int r = 0; r < rows; ++r)
      std::copy(one.begin(), one.end(), logits.begin() + static_cast<int64_t>(r) * vocab);
    std::vector<float> u(rows);
    for (int r = 0; r < rows; ++r) u[r] = (static_cast<float>(r) + 0.5f) / rows;
    const std::vector<int32_t> got =
        run_sampler(logits, rows, vocab, 0, std::vector<ops::SampleRowParams>(rows, p), u, rows);
    std::vector<int> gpu_counts(vocab, 0), ref_counts(vocab, 0);
    for (int r = 0; r < rows; ++r) {
      ++gpu_counts[got[r]];
      ++ref_counts[ops::sample_row_ref(one, p, static_cast<double>(u[r]))];
    }
    int differing = 0;
    for (int i = 0; i < vocab; ++i) differing += std::abs(gpu_counts[i] - ref_counts[i]);
    // A grid point that sits within rounding of a boundary may move to the neighbour token.
    EXPECT_LE(differing, 4) << "T " << p.temperature << " top_p " << p.top_p << " top_k "
                            << p.top_k;
  }
}

}  // namespace
}  // namespace moelora
