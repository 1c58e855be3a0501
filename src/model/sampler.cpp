// Seeded CPU sampling (see sampler.h).
#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "ops/sample/sample.h"

namespace moelora::model {

namespace {

// Token ids sorted by descending probability, ties by lower id, and the kept prefix length.
struct Ranked {
  std::vector<int32_t> order;
  size_t kept = 0;
};

Ranked rank_and_truncate(const std::vector<double>& p, const SamplingParams& params) {
  Ranked r;
  r.order.resize(p.size());
  std::iota(r.order.begin(), r.order.end(), 0);
  std::stable_sort(r.order.begin(), r.order.end(),
                   [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  r.kept = r.order.size();
  if (params.top_k > 0) r.kept = std::min<size_t>(r.kept, static_cast<size_t>(params.top_k));
  if (params.top_p < 1.0) {
    double before = 0.0;
    size_t n = 0;
    while (n < r.kept && (n == 0 || before < params.top_p)) before += p[r.order[n++]];
    r.kept = n;
  }
  return r;
}

std::vector<double> softmax_with_temperature(std::span<const float> logits, double temperature) {
  const double max = logits[argmax(logits)];
  std::vector<double> p(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - max) / temperature);
    sum += p[i];
  }
  for (double& v : p) v /= sum;
  return p;
}

}  // namespace

void check_sampling_params(const SamplingParams& params) {
  MOELORA_CHECK(std::isfinite(params.temperature) && params.temperature >= 0.0,
                ErrorCode::kInvalidArgument,
                "temperature must be a finite value >= 0 (0 = greedy), got ", params.temperature);
  MOELORA_CHECK(params.top_p > 0.0 && params.top_p <= 1.0, ErrorCode::kInvalidArgument,
                "top_p must be in (0, 1], got ", params.top_p);
  MOELORA_CHECK(params.top_k >= 0, ErrorCode::kInvalidArgument,
                "top_k must be >= 0 (0 = off), got ", params.top_k);
}

int32_t argmax(std::span<const float> logits) {
  MOELORA_CHECK(!logits.empty(), ErrorCode::kInvalidArgument, "argmax of an empty logits row");
  size_t best = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    MOELORA_CHECK(!std::isnan(logits[i]), ErrorCode::kInvalidArgument, "logit of token ", i,
                  " is NaN");
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

std::vector<double> sampling_probabilities(std::span<const float> logits,
                                           const SamplingParams& params) {
  check_sampling_params(params);
  std::vector<double> out(logits.size(), 0.0);
  if (params.temperature == 0.0) {
    out[argmax(logits)] = 1.0;
    return out;
  }
  const std::vector<double> p = softmax_with_temperature(logits, params.temperature);
  const Ranked r = rank_and_truncate(p, params);
  double mass = 0.0;
  for (size_t i = 0; i < r.kept; ++i) mass += p[r.order[i]];
  for (size_t i = 0; i < r.kept; ++i) out[r.order[i]] = p[r.order[i]] / mass;
  return out;
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  check_sampling_params(params);
}

double Sampler::next_uniform() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

int32_t Sampler::sample(std::span<const float> logits) {
  // Greedy rows draw nothing, so switching a request between greedy and sampled decoding does not
  // shift the stream of the others.
  if (params_.temperature == 0.0) return argmax(logits);
  ops::SampleRowParams row;
  row.temperature = static_cast<float>(params_.temperature);
  row.top_p = static_cast<float>(params_.top_p);
  row.top_k =
      static_cast<int32_t>(std::min<int64_t>(params_.top_k, std::numeric_limits<int32_t>::max()));
  return ops::sample_row_ref(logits, row, next_uniform());
}

int32_t Sampler::sample(const Tensor& logits) {
  check_dtype(logits, DType::kF32, "sampler logits");
  MOELORA_CHECK(logits.ndim() == 1 || (logits.ndim() == 2 && logits.dim(0) == 1),
                ErrorCode::kInvalidArgument, "sampler logits: expected [V] or [1, V], got ",
                shape_str(logits.shape()));
  return sample(std::span<const float>(logits.data<float>(), static_cast<size_t>(logits.numel())));
}

}  // namespace moelora::model
