// CPU reference of the batch sampler (see sample.h): the rule model::Sampler applies, with the
// uniform number passed in. Probabilities are computed in double from the fp32 logits, ranked by
// probability (descending) with ties broken by the lower token id, truncated by top-k and top-p,
// and the token is picked by walking the kept prefix until the cumulative mass exceeds u * kept.
#include "ops/sample/sample.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace moelora::ops {

namespace {

// First index of the largest logit; NaN and +inf logits are rejected because softmax of them
// has no meaning (a -inf logit is a masked token and is fine).
int32_t checked_argmax(std::span<const float> logits) {
  size_t best = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    MOELORA_CHECK(!std::isnan(logits[i]) && logits[i] != INFINITY, ErrorCode::kInvalidArgument,
                  "sample: logit of token ", i, " is ", logits[i],
                  "; logits must be finite or -inf");
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

}  // namespace

int32_t sample_row_ref(std::span<const float> logits, const SampleRowParams& params, double u) {
  MOELORA_CHECK(!logits.empty(), ErrorCode::kInvalidArgument, "sample: empty logits row");
  MOELORA_CHECK(logits.size() <= static_cast<size_t>(INT32_MAX), ErrorCode::kInvalidArgument,
                "sample: vocab of ", logits.size(), " tokens does not fit int32 ids");
  MOELORA_CHECK(std::isfinite(params.temperature), ErrorCode::kInvalidArgument,
                "sample: temperature must be finite, got ", params.temperature);
  const int32_t best = checked_argmax(logits);
  if (params.temperature <= 0.0f) return best;
  MOELORA_CHECK(params.top_p > 0.0f && params.top_p <= 1.0f, ErrorCode::kInvalidArgument,
                "sample: top_p must be in (0, 1], got ", params.top_p);
  MOELORA_CHECK(params.top_k >= 0, ErrorCode::kInvalidArgument,
                "sample: top_k must be >= 0 (0 = off), got ", params.top_k);
  MOELORA_CHECK(u >= 0.0 && u < 1.0, ErrorCode::kInvalidArgument,
                "sample: the uniform number must be in [0, 1), got ", u);

  // p [V]: unnormalized softmax in double, exp((l - max) / T); the largest entry is exactly 1.
  const double max_logit = logits[static_cast<size_t>(best)];
  const double temperature = params.temperature;
  std::vector<double> p(logits.size());
  for (size_t i = 0; i < logits.size(); ++i)
    p[i] = std::exp((static_cast<double>(logits[i]) - max_logit) / temperature);
  double total = 0.0;
  for (double v : p) total += v;

  // Ranking: probability descending, ties by lower id (stable sort of the ids in order).
  std::vector<int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });

  size_t kept = order.size();
  if (params.top_k > 0) kept = std::min(kept, static_cast<size_t>(params.top_k));
  if (params.top_p < 1.0f) {
    // A token is kept while the normalized mass ranked before it is below top_p.
    const double limit = static_cast<double>(params.top_p) * total;
    double before = 0.0;
    size_t n = 0;
    while (n < kept && (n == 0 || before < limit)) before += p[order[n++]];
    kept = n;
  }
  double kept_mass = 0.0;
  for (size_t i = 0; i < kept; ++i) kept_mass += p[order[i]];
  const double target = u * kept_mass;
  double cumulative = 0.0;
  for (size_t i = 0; i < kept; ++i) {
    cumulative += p[order[i]];
    if (target < cumulative) return order[i];
  }
  return order[kept - 1];  // rounding: the target reached the kept mass
}

}  // namespace moelora::ops
