// Token sampling for a batch of rows, given one uniform number per row: the oracle of the GPU
// sampler. The randomness stays on the host (each request's seeded generator draws u in [0, 1)),
// so the GPU kernel is deterministic, graph-friendly and testable against this reference.
//
// Per row (logits [V] fp32):
//   temperature <= 0: greedy, the first index of the largest logit (u unused)
//   else p = softmax(logits / temperature); keep the top_k most probable (top_k > 0); keep the
//        smallest prefix of the ranking (probability descending, ties by lower id) whose mass
//        reaches top_p (a token is kept while the mass ranked before it is < top_p); renormalize;
//        return the first kept token (in ranking order) whose cumulative mass exceeds u * total.
// This is exactly model::Sampler's rule with its draw replaced by u.
#pragma once

#include <cstdint>
#include <span>

namespace moelora::ops {

struct SampleRowParams {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;  // 0 = no limit
};

// logits: [V]; u in [0, 1). Returns the token id.
int32_t sample_row_ref(std::span<const float> logits, const SampleRowParams& params, double u);

}  // namespace moelora::ops
