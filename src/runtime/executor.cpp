// Default implementations of the Executor interface (executor.h): sampling on the host from the
// logits of forward(), and the refusal of random adapters by backends that cannot make them.
#include "runtime/executor.h"

#include <string>

namespace moelora::runtime {

std::vector<int32_t> Executor::forward_sample(std::span<const BatchEntry> batch,
                                              std::span<const ops::SampleRowParams> params,
                                              std::span<const float> uniforms) {
  MOELORA_CHECK(params.size() == batch.size() && uniforms.size() == batch.size(),
                ErrorCode::kInternal, "forward_sample of ", batch.size(), " entries with ",
                params.size(), " sampling params and ", uniforms.size(), " uniforms");
  last_forward_logits_ = forward(batch);
  const std::vector<Tensor>& logits = last_forward_logits_;
  std::vector<int32_t> tokens(batch.size(), -1);
  for (size_t i = 0; i < batch.size(); ++i) {
    const Tensor& row = logits[i];
    try {
      tokens[i] = ops::sample_row_ref(
          std::span<const float>(row.data<float>(), static_cast<size_t>(row.numel())), params[i],
          static_cast<double>(uniforms[i]));
    } catch (const Error&) {
      tokens[i] = -1;  // this row alone fails (e.g. NaN logits); see forward_sample()
    }
  }
  return tokens;
}

std::vector<Tensor> Executor::last_logits(std::span<const size_t> rows) {
  std::vector<Tensor> out;
  for (size_t row : rows) {
    MOELORA_CHECK(row < last_forward_logits_.size(), ErrorCode::kInternal, "last_logits: row ", row,
                  " of a batch of ", last_forward_logits_.size());
    out.push_back(last_forward_logits_[row]);
  }
  return out;
}

void Executor::randomize_slot(int32_t slot, int64_t rank, bool shared_outer, uint64_t seed) {
  MOELORA_THROW(ErrorCode::kUnsupported,
                "random adapters need the GPU backend with random weights (EngineOptions "
                "random_weights on device cuda); this backend cannot fill slot ",
                slot, " with a random rank-", rank, " adapter");
}

}  // namespace moelora::runtime
