// The byte model of one decode step (PERF.md "Byte roofline"): what a step of B sequences must read
// at least, so that a measured step time becomes a fraction of the copy-bandwidth roofline
// (`moelora bench`'s E1-E3). Counted once each: every non-expert weight as the GPU model holds it
// (attention, dense MLPs, shared experts and routers in bf16, lm_head; with fp8_shared_expert an
// FP8 checkpoint's shared expert of the routed experts' size in FP8, as the GPU runs it among them
// with EngineOptions::moe_shared_expert_in_experts), D(B) = E (1 - (1 - k/E)^B) routed experts per
// MoE layer (FP8: 1 byte per weight + 128 x 128 block scales; NVFP4 packed on the GPU: 0.5625 + a
// scale_2 per row; bf16: 2), the KV cache of every sequence at the mean context, the
// linear-attention states read and written; with LoRA each adapter's factors for its share of the
// batch (dense targets whole, routed experts for the D(B / K) experts its tokens touch;
// shared-outer: the shared factors once).
#pragma once

#include <cstdint>

#include "io/hf_config.h"

namespace moelora::runtime {

// Distinct experts B uniformly routed tokens touch: E (1 - (1 - k/E)^B).
double distinct_experts(double experts, double top_k, double tokens);

struct StepBytes {
  double base = 0;  // weights + KV (+ states) of a no-LoRA step
  double lora = 0;  // the adapters' factors on top
};

// One decode step of `batch` sequences at mean context `context`; `adapters` distinct adapters of
// rank `rank` share `adapter_tokens` of the rows evenly.
StepBytes decode_step_bytes(const io::ModelConfig& config, int64_t batch, double context,
                            int64_t adapters, int64_t adapter_tokens, int64_t rank,
                            bool shared_outer, bool fp8_shared_expert = false);

}  // namespace moelora::runtime
