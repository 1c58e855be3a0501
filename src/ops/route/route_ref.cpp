// CPU reference of the MoE routers (see route.h). Selection is a k-round argmax with a strict
// `>`, so among equal scores the lower index is taken first: the tie rule of the fast softmax
// top-k kernels (KERNELS.md §7.1). All math is fp32, per token, with a fixed order.
#include "ops/route/route.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/threads.h"

namespace moelora::ops {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Writes the indices of the k largest scores[0, n) to out[0, k), in descending order, ties to the
// lower index. Entries equal to -inf are never chosen (they mark excluded experts); k must not
// exceed the number of eligible entries (guaranteed by check_route_params).
void select_top_k(const float* scores, int64_t n, int64_t k, std::vector<char>& taken, int32_t* out) {
  taken.assign(n, 0);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    float best_score = kNegInf;
    for (int64_t i = 0; i < n; ++i) {
      if (taken[i] || scores[i] == kNegInf) continue;
      if (best < 0 || scores[i] > best_score) {
        best = i;
        best_score = scores[i];
      }
    }
    MOELORA_ASSERT(best >= 0, "top-k ran out of eligible entries");
    taken[best] = 1;
    out[j] = static_cast<int32_t>(best);
  }
}

// `forced` (k ids or nullptr) replaces the selection; the weights follow from the scores as usual.
void route_softmax_token(const float* logits, const RouteParams& p, const int32_t* forced,
                         std::vector<float>& probs, std::vector<char>& taken, int32_t* ids,
                         float* weights) {
  const int64_t num_experts = p.num_experts;
  float max_logit = logits[0];
  for (int64_t e = 1; e < num_experts; ++e) max_logit = std::max(max_logit, logits[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < num_experts; ++e) {
    probs[e] = std::exp(logits[e] - max_logit);
    sum += probs[e];
  }
  for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
  if (forced) {
    std::copy_n(forced, p.top_k, ids);
  } else {
    select_top_k(probs.data(), num_experts, p.top_k, taken, ids);
  }
  float selected = 0.0f;
  for (int64_t j = 0; j < p.top_k; ++j) {
    weights[j] = probs[ids[j]];
    selected += weights[j];
  }
  if (p.renormalize) {
    for (int64_t j = 0; j < p.top_k; ++j) weights[j] /= selected;
  }
}

void route_noaux_tc_token(const float* logits, const float* bias, const RouteParams& p,
                          const int32_t* forced, std::vector<float>& scores, std::vector<float>& biased,
                          std::vector<float>& group_scores, std::vector<int32_t>& kept_groups,
                          std::vector<char>& taken, int32_t* ids, float* weights) {
  const int64_t num_experts = p.num_experts;
  const int64_t group_size = num_experts / p.n_group;
  for (int64_t e = 0; e < num_experts; ++e) {
    scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    biased[e] = scores[e] + (bias ? bias[e] : 0.0f);
  }
  if (forced) {
    std::copy_n(forced, p.top_k, ids);
  } else if (p.topk_group < p.n_group) {
    // Group score: sum of the two largest biased scores of the group (group_size >= 2).
    for (int64_t g = 0; g < p.n_group; ++g) {
      const float* b = biased.data() + g * group_size;
      float first = kNegInf, second = kNegInf;
      for (int64_t i = 0; i < group_size; ++i) {
        if (b[i] > first) {
          second = first;
          first = b[i];
        } else if (b[i] > second) {
          second = b[i];
        }
      }
      group_scores[g] = first + second;
    }
    select_top_k(group_scores.data(), p.n_group, p.topk_group, taken, kept_groups.data());
    std::vector<char> keep_group(p.n_group, 0);
    for (int64_t g = 0; g < p.topk_group; ++g) keep_group[kept_groups[g]] = 1;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (!keep_group[e / group_size]) biased[e] = kNegInf;
    }
  }
  if (!forced) select_top_k(biased.data(), num_experts, p.top_k, taken, ids);
  float selected = 0.0f;
  for (int64_t j = 0; j < p.top_k; ++j) {
    weights[j] = scores[ids[j]];
    selected += weights[j];
  }
  if (p.renormalize) {
    const float denominator = selected + 1e-20f;
    for (int64_t j = 0; j < p.top_k; ++j) weights[j] /= denominator;
  }
  for (int64_t j = 0; j < p.top_k; ++j) weights[j] *= p.routed_scaling_factor;
}

}  // namespace

void check_route_params(const RouteParams& p) {
  const auto bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(p.num_experts > 0, bad, "route params: num_experts must be positive, got ", p.num_experts);
  MOELORA_CHECK(p.num_experts <= std::numeric_limits<int32_t>::max(), bad, "route params: num_experts ",
                p.num_experts, " does not fit the int32 expert ids");
  MOELORA_CHECK(p.top_k > 0, bad, "route params: top_k must be positive, got ", p.top_k);
  MOELORA_CHECK(p.top_k <= p.num_experts, bad, "route params: top_k ", p.top_k, " exceeds num_experts ",
                p.num_experts);
  if (p.kind != RouterKind::kSigmoidNoauxTc) return;  // softmax top-k has no groups
  MOELORA_CHECK(p.n_group > 0, bad, "route params: n_group must be positive, got ", p.n_group);
  MOELORA_CHECK(p.num_experts % p.n_group == 0, bad, "route params: num_experts ", p.num_experts,
                " is not divisible by n_group ", p.n_group);
  const int64_t group_size = p.num_experts / p.n_group;
  MOELORA_CHECK(p.n_group == 1 || group_size >= 2, bad,
                "route params: num_experts / n_group = ", p.num_experts, " / ", p.n_group, " = ", group_size,
                " experts per group; the group score needs at least 2");
  MOELORA_CHECK(p.topk_group > 0 && p.topk_group <= p.n_group, bad, "route params: topk_group ", p.topk_group,
                " must be in [1, n_group = ", p.n_group, "]");
  MOELORA_CHECK(p.topk_group * group_size >= p.top_k, bad,
                "route params: topk_group * num_experts / n_group = ", p.topk_group, " * ", group_size, " = ",
                p.topk_group * group_size, " kept experts is fewer than top_k ", p.top_k);
  MOELORA_CHECK(std::isfinite(p.routed_scaling_factor), bad,
                "route params: routed_scaling_factor must be finite, got ", p.routed_scaling_factor);
}

RouteResult route_ref(const Tensor& logits, const Tensor& correction_bias, const RouteParams& params,
                      const Tensor& forced_ids) {
  check_route_params(params);
  const auto bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(logits.defined() && logits.dtype() == DType::kF32 && logits.ndim() == 2, bad,
                "router logits must be F32 [T, E]");
  MOELORA_CHECK(logits.dim(1) == params.num_experts, bad, "router logits ", shape_str(logits.shape()),
                " have ", logits.dim(1), " experts but num_experts is ", params.num_experts);
  const float* bias = nullptr;
  if (correction_bias.defined()) {
    MOELORA_CHECK(params.kind == RouterKind::kSigmoidNoauxTc, bad,
                  "correction_bias is only used by the sigmoid noaux_tc router");
    check_dtype(correction_bias, DType::kF32, "e_score_correction_bias");
    check_shape(correction_bias, {params.num_experts}, "e_score_correction_bias");
    bias = correction_bias.data<float>();
    for (int64_t e = 0; e < params.num_experts; ++e) {
      MOELORA_CHECK(std::isfinite(bias[e]), bad, "e_score_correction_bias[", e, "] is not finite: ", bias[e]);
    }
  }
  const int64_t tokens = logits.dim(0), k = params.top_k, num_experts = params.num_experts;
  const float* lp = logits.data<float>();
  for (int64_t i = 0; i < tokens * num_experts; ++i) {
    MOELORA_CHECK(std::isfinite(lp[i]), bad, "router logit of token ", i / num_experts, ", expert ",
                  i % num_experts, " is not finite: ", lp[i]);
  }
  const int32_t* forced = nullptr;
  if (forced_ids.defined()) {
    check_dtype(forced_ids, DType::kI32, "forced routing ids");
    check_shape(forced_ids, {tokens, k}, "forced routing ids");
    forced = forced_ids.data<int32_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = forced[t * k + j];
        MOELORA_CHECK(e >= 0 && e < num_experts, ErrorCode::kOutOfRange, "forced routing id [", t, ", ", j,
                      "] = ", e, " is outside [0, ", num_experts, ")");
        for (int64_t i = 0; i < j; ++i) {
          MOELORA_CHECK(forced[t * k + i] != e, bad, "forced routing ids of token ", t, " repeat expert ", e);
        }
      }
    }
  }

  RouteResult result{Tensor::empty(DType::kI32, {tokens, k}), Tensor::empty(DType::kF32, {tokens, k})};
  int32_t* ids = result.ids.data<int32_t>();
  float* weights = result.weights.data<float>();
  parallel_for(
      tokens,
      [&](int64_t begin, int64_t end) {
        const int64_t groups = params.kind == RouterKind::kSigmoidNoauxTc ? params.n_group : 0;
        std::vector<float> scores(num_experts), biased(num_experts), group_scores(groups);
        std::vector<int32_t> kept_groups(groups);
        std::vector<char> taken;
        for (int64_t t = begin; t < end; ++t) {
          const float* row = lp + t * num_experts;
          const int32_t* forced_row = forced ? forced + t * k : nullptr;
          if (params.kind == RouterKind::kSoftmaxTopK) {
            route_softmax_token(row, params, forced_row, scores, taken, ids + t * k, weights + t * k);
          } else {
            route_noaux_tc_token(row, bias, params, forced_row, scores, biased, group_scores, kept_groups,
                                 taken, ids + t * k, weights + t * k);
          }
        }
      },
      /*min_chunk=*/std::max<int64_t>(1, 65536 / (num_experts * (k + 4))));
  return result;
}

}  // namespace moelora::ops
