// Next-token sampling on the CPU: greedy, temperature, top-k and top-p (nucleus), seeded.
//
//   temperature == 0            greedy: the first index of the largest logit
//   temperature  > 0            p = softmax(logits / temperature) (double precision), then
//     top_k > 0                 keep the k most probable tokens
//     top_p < 1                 keep the smallest set of most probable tokens whose mass reaches
//                               top_p: a token is kept while the mass of the tokens ranked before
//                               it is below top_p (the most probable token is always kept)
//                               and draw from the kept tokens in proportion to p.
// Ties in probability are ranked by lower token id. The draw uses std::mt19937_64 seeded with
// `seed` and maps its 64-bit output to [0, 1) as (x >> 11) * 2^-53, so a seed gives the same
// tokens on every platform and standard library. The rule itself is ops::sample_row_ref (the
// oracle of the GPU sampler), so a request's draws give the same tokens on the CPU and the GPU
// path up to fp32-vs-double rounding at a decision boundary.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "core/tensor.h"

namespace moelora::model {

struct SamplingParams {
  double temperature = 0.0;  // 0 = greedy
  double top_p = 1.0;        // in (0, 1]
  int64_t top_k = 0;         // 0 = no top-k limit
  uint64_t seed = 0;
};

// kInvalidArgument naming the field for a negative or non-finite temperature, top_p outside
// (0, 1] or a negative top_k.
void check_sampling_params(const SamplingParams& params);

// First index of the largest value; kInvalidArgument for an empty span or a NaN logit.
int32_t argmax(std::span<const float> logits);

// The distribution a non-greedy draw uses: probabilities after temperature, top-k and top-p,
// renormalized over the kept tokens, 0 for the others ([V], double). For temperature 0: a one-hot
// vector at argmax.
std::vector<double> sampling_probabilities(std::span<const float> logits,
                                           const SamplingParams& params);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params = {});
  const SamplingParams& params() const { return params_; }
  // logits: [V] of one position.
  int32_t sample(std::span<const float> logits);
  // logits: F32 [V] or [1, V].
  int32_t sample(const Tensor& logits);
  // The next number of the seeded stream, in [0, 1): what sample() consumes for a non-greedy
  // row, and what the engine hands to the GPU sampler instead.
  double next_uniform();

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

}  // namespace moelora::model
