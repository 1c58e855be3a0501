// The byte model of a decode step (step_bytes.h).
#include "runtime/step_bytes.h"

#include <algorithm>
#include <cmath>

#include "runtime/gpu_executor.h"

namespace moelora::runtime {

double distinct_experts(double experts, double top_k, double tokens) {
  if (experts <= 0 || tokens <= 0) return 0;
  return experts * (1.0 - std::pow(1.0 - std::min(top_k, experts) / experts, tokens));
}

StepBytes decode_step_bytes(const io::ModelConfig& c, int64_t batch, double context,
                            int64_t adapters, int64_t adapter_tokens, int64_t rank,
                            bool shared_outer, bool fp8_shared_expert) {
  const bool fp8 =
      c.quant.method == io::QuantMethod::kFp8Block && c.moe_intermediate_size % 128 == 0;
  const double H = static_cast<double>(c.hidden_size), V = static_cast<double>(c.vocab_size);
  const double E = static_cast<double>(c.num_experts),
               k = static_cast<double>(c.num_experts_per_tok);
  const double I = static_cast<double>(c.moe_intermediate_size);
  const double R = static_cast<double>(rank);
  StepBytes b;
  b.base = V * H * 2;  // lm_head
  double dense_lora = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for_each_dense_linear(c, l, [&](int64_t out, int64_t in) {
      b.base += static_cast<double>(out) * static_cast<double>(in) * 2;
      dense_lora += static_cast<double>(out + in) * R * 2;
    });
    if (!c.is_moe_layer(l)) continue;
    // NVFP4 experts stay packed on the GPU where H and I are multiples of 128 (codes, an e4m3
    // scale per 16, scale_2 per row)
    const bool nvfp4 = c.quant.method == io::QuantMethod::kNvfp4 && c.hidden_size % 128 == 0 &&
                       c.moe_intermediate_size % 128 == 0;
    const double expert_bytes = nvfp4 ? 3 * H * I * 0.5625 + (2 * I + H) * 4
                                : fp8 ? 3 * H * I * (1.0 + 4.0 / (128 * 128))
                                      : 3 * H * I * 2;
    b.base += E * H * 2 + distinct_experts(E, k, static_cast<double>(batch)) * expert_bytes;
    // An FP8 shared expert of the routed experts' size that the GPU runs among them stays FP8, not
    // the bf16 that for_each_dense_linear counted.
    if (fp8_shared_expert && fp8 && c.shared_expert_intermediate_size == c.moe_intermediate_size)
      b.base += expert_bytes - 3 * H * I * 2;
    if (adapters > 0) {
      const double touched = distinct_experts(
          E, k, static_cast<double>(adapter_tokens) / static_cast<double>(adapters));
      // gate_up: A [R, H], B [2I, R]; down: A [R, I], B [H, R]; bf16
      const double per_expert =
          shared_outer ? (2 * I * R + R * I) * 2 : (R * H + 2 * I * R + R * I + H * R) * 2;
      const double shared = shared_outer ? (R * H + H * R) * 2 : 0;
      b.lora += static_cast<double>(adapters) * (touched * per_expert + shared);
    }
  }
  b.lora += static_cast<double>(adapters) * dense_lora;
  b.base +=
      static_cast<double>(batch) * context * static_cast<double>(estimate_kv_bytes_per_token(c));
  // Linear-attention layers read and write each sequence's state once per step.
  b.base += 2.0 * static_cast<double>(batch) * static_cast<double>(linear_attention_state_bytes(c));
  return b;
}

}  // namespace moelora::runtime
