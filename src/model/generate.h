// Batched text generation on the CPU model: several requests, each with its own prompt, adapter
// slot, sampling settings and length, decoded together.
//
// Step 0 (prefill) runs every prompt through the model in one forward() and samples each
// request's first token from its last prompt position; every later step runs one forward() with
// the previous token of each unfinished request. So a batch of base-only and adapter requests is
// exactly the mixed-adapter batch of DESIGN.md §3, and each request's tokens equal what it would
// get alone (a token's logits do not depend on the rest of the batch).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "model/model.h"
#include "model/sampler.h"

namespace moelora::model {

struct GenerationRequest {
  std::vector<int32_t> prompt;       // at least one token
  int32_t slot = -1;                 // adapter slot, -1 = base
  int64_t max_new_tokens = 16;       // >= 0
  SamplingParams sampling;           // greedy by default
  std::vector<int32_t> stop_tokens;  // generation ends after emitting one of these (kept in the output)
};

struct GenerationOutput {
  std::vector<int32_t> tokens;  // generated tokens only
  bool stopped = false;         // ended on a stop token rather than max_new_tokens
};

struct GenerationStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t first_tokens = 0;      // tokens sampled from the prefill pass (one per request)
  int64_t steps = 0;             // forward passes, prefill included
  double prefill_seconds = 0.0;  // the prompt pass (it also yields the first tokens)
  double decode_seconds = 0.0;   // all later passes
  // Generated tokens over the whole generation time (prefill + decode).
  double tokens_per_second() const;
  // Tokens produced by the decode passes over their time (0 when there were none).
  double decode_tokens_per_second() const;
};

struct GenerationResult {
  std::vector<GenerationOutput> outputs;  // one per request, in request order
  GenerationStats stats;
};

// Called after every generated token: (request index, token).
using TokenCallback = std::function<void(size_t, int32_t)>;

// Validates every request first (kInvalidArgument naming the request: empty prompt, negative
// max_new_tokens, bad sampling settings; plus everything Model::forward checks).
GenerationResult generate(Model& model, std::span<const GenerationRequest> requests,
                          const TokenCallback& on_token = {});

}  // namespace moelora::model
