// Batched generation loop (see generate.h).
#include "model/generate.h"

#include <algorithm>
#include <chrono>

namespace moelora::model {

double GenerationStats::tokens_per_second() const {
  const double seconds = prefill_seconds + decode_seconds;
  return seconds > 0 ? static_cast<double>(generated_tokens) / seconds : 0.0;
}

double GenerationStats::decode_tokens_per_second() const {
  // The prefill pass produced one token per request; the rest came from decode passes.
  return decode_seconds > 0 ? static_cast<double>(generated_tokens - first_tokens) / decode_seconds : 0.0;
}

GenerationResult generate(Model& model, std::span<const GenerationRequest> requests,
                          const TokenCallback& on_token) {
  using Clock = std::chrono::steady_clock;
  GenerationResult result;
  result.outputs.resize(requests.size());
  std::vector<Sampler> samplers;
  std::vector<Sequence> sequences;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    MOELORA_CHECK(!r.prompt.empty(), ErrorCode::kInvalidArgument, "request ", i, ": the prompt is empty");
    MOELORA_CHECK(r.max_new_tokens >= 0, ErrorCode::kInvalidArgument, "request ", i,
                  ": max_new_tokens must be >= 0, got ", r.max_new_tokens);
    samplers.emplace_back(r.sampling);
    sequences.push_back(model.new_sequence(r.slot));
    result.stats.prompt_tokens += static_cast<int64_t>(r.prompt.size());
  }

  // Requests still generating, and the token each must feed next.
  std::vector<size_t> active;
  std::vector<int32_t> next(requests.size(), 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].max_new_tokens > 0) active.push_back(i);
  }
  ForwardOptions options;
  options.all_logits = false;
  bool prefill = true;
  while (!active.empty()) {
    std::vector<SequenceInput> batch;
    for (size_t i : active) {
      batch.push_back({&sequences[i], prefill ? std::span<const int32_t>(requests[i].prompt)
                                              : std::span<const int32_t>(&next[i], 1)});
    }
    const auto start = Clock::now();
    const std::vector<Tensor> logits = model.forward(batch, options);
    std::vector<size_t> still;
    for (size_t b = 0; b < active.size(); ++b) {
      const size_t i = active[b];
      const int32_t token = samplers[i].sample(logits[b]);
      GenerationOutput& out = result.outputs[i];
      out.tokens.push_back(token);
      next[i] = token;
      if (on_token) on_token(i, token);
      const auto& stops = requests[i].stop_tokens;
      out.stopped = std::find(stops.begin(), stops.end(), token) != stops.end();
      if (!out.stopped && static_cast<int64_t>(out.tokens.size()) < requests[i].max_new_tokens)
        still.push_back(i);
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    (prefill ? result.stats.prefill_seconds : result.stats.decode_seconds) += seconds;
    if (prefill) result.stats.first_tokens = static_cast<int64_t>(active.size());
    result.stats.generated_tokens += static_cast<int64_t>(active.size());
    ++result.stats.steps;
    prefill = false;
    active = std::move(still);
  }
  return result;
}

}  // namespace moelora::model
