// MoE routers: logits [T, E] -> top-k expert ids and weights.
//
//   kSoftmaxTopK (Qwen3-MoE, Qwen3.5): p = softmax(logits) in fp32; ids = top-k of p (descending,
//     ties to the lower index); w = p[ids]; if renormalize: w /= sum(w).
//   kSigmoidNoauxTc (DeepSeek-V3, Kimi): s = sigmoid(logits); b = s + correction_bias (selection
//     only); experts split into n_group consecutive groups, group score = sum of the top-2 b in
//     the group; keep the topk_group best groups; ids = top-k of b over kept experts (descending,
//     ties to the lower index); w = s[ids] (unbiased); if renormalize: w /= (sum(w) + 1e-20);
//     w *= routed_scaling_factor.
//
// Experts of dropped groups are excluded from the final top-k (as if their score were -inf), as
// in the vLLM / SGLang / TensorRT-LLM kernels. transformers masks them with 0.0 instead, which
// only differs when fewer than k kept experts have a positive biased score (bias < -sigmoid).
// Group ties also go to the lower group index. Logits must be finite (an Error names the token
// and expert otherwise).
#pragma once

#include <cstdint>

#include "core/model_enums.h"
#include "core/tensor.h"

namespace moelora::ops {

struct RouteParams {
  RouterKind kind = RouterKind::kSoftmaxTopK;
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // k
  bool renormalize = false;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  float routed_scaling_factor = 1.0f;
};

struct RouteResult {
  Tensor ids;      // I32 [T, k], each row sorted by descending selection score
  Tensor weights;  // F32 [T, k], aligned with ids
};

// Throws kInvalidArgument on inconsistent params, naming the field and its value: E > 0,
// 0 < k <= E; for kSigmoidNoauxTc also E % n_group == 0, E / n_group >= 2 (when n_group > 1),
// 1 <= topk_group <= n_group, topk_group * E / n_group >= k, finite routed_scaling_factor.
// n_group / topk_group are ignored by kSoftmaxTopK.
void check_route_params(const RouteParams& params);

// logits: F32 [T, E]; correction_bias: F32 [E] (kSigmoidNoauxTc only; undefined = zeros).
// forced_ids, when defined (I32 [T, k], distinct experts per row), replaces the selection: ids =
// forced_ids and the weights are what the router gives those experts (softmax probabilities or
// unbiased sigmoid scores, renormalized and scaled as above). Tests use it to run the reference
// with another implementation's routing, separating near-tie routing flips from other errors.
// Parallel over tokens; deterministic.
RouteResult route_ref(const Tensor& logits, const Tensor& correction_bias, const RouteParams& params,
                      const Tensor& forced_ids = Tensor());

}  // namespace moelora::ops
