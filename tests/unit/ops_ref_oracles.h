// Oracles of the CPU reference tests of ops/route, ops/linear, ops/lora and ops/moe, written
// differently from the references on purpose: routing by sorting (std::stable_sort) in double
// precision, dense double loops, LoRA as an explicit merged delta W + s B A
// (ops_route_test.cpp, ops_linear_lora_test.cpp, ops_moe_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "ops/linear/linear.h"
#include "ops/lora/lora.h"
#include "ops/moe/moe.h"
#include "ops/quant/quant.h"
#include "ops/route/route.h"
#include "support/test_support.h"

namespace moelora::ops_ref_test {

using ops::MoeLoraRef;
using ops::MoeParams;
using ops::MoeWeightsRef;
using ops::RouteParams;

#define EXPECT_ERROR_MENTIONS(stmt, ...)                                                      \
  do {                                                                                        \
    const std::string msg_ = test::error_message([&] { stmt; });                              \
    for (const char* part_ : {__VA_ARGS__})                                                   \
      EXPECT_NE(msg_.find(part_), std::string::npos) << "'" << part_ << "' not in: " << msg_; \
  } while (0)

inline std::vector<double> to_double(const Tensor& t) {
  std::vector<double> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.data<float>()[i];
  return v;
}

inline Tensor to_tensor(const std::vector<double>& v, Shape shape) {
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_f32(f, std::move(shape));
}

inline bool rows_bitwise_equal(const Tensor& a, int64_t row_a, const Tensor& b, int64_t row_b) {
  const int64_t n = a.dim(1);
  return std::memcmp(a.data<float>() + row_a * n, b.data<float>() + row_b * n, n * sizeof(float)) ==
         0;
}

inline double sigmoid_d(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}
inline double silu_d(double v) {
  return v * sigmoid_d(v);
}

// ============================================================================ routing oracle

struct OracleRoute {
  std::vector<int32_t> ids;
  std::vector<double> weights;
};

// Sort-based routing in double precision: stable_sort keeps the lower index first among equal
// scores, which is the reference's tie rule.
inline OracleRoute oracle_route(const std::vector<double>& logits, const std::vector<double>& bias,
                                const RouteParams& p) {
  const int64_t num_experts = p.num_experts;
  OracleRoute r;
  std::vector<double> score(num_experts), choice(num_experts);
  if (p.kind == RouterKind::kSoftmaxTopK) {
    const double mx = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (int64_t e = 0; e < num_experts; ++e) z += std::exp(logits[e] - mx);
    for (int64_t e = 0; e < num_experts; ++e) score[e] = choice[e] = std::exp(logits[e] - mx) / z;
  } else {
    for (int64_t e = 0; e < num_experts; ++e) {
      score[e] = sigmoid_d(logits[e]);
      choice[e] = score[e] + (bias.empty() ? 0.0 : bias[e]);
    }
  }
  std::vector<int64_t> eligible(num_experts);
  std::iota(eligible.begin(), eligible.end(), 0);
  if (p.kind == RouterKind::kSigmoidNoauxTc && p.topk_group < p.n_group) {
    const int64_t size = num_experts / p.n_group;
    std::vector<double> group_score(p.n_group);
    for (int64_t g = 0; g < p.n_group; ++g) {
      std::vector<double> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
      std::partial_sort(members.begin(), members.begin() + 2, members.end(),
                        std::greater<double>());
      group_score[g] = members[0] + members[1];
    }
    std::vector<int64_t> groups(p.n_group);
    std::iota(groups.begin(), groups.end(), 0);
    std::stable_sort(groups.begin(), groups.end(),
                     [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
    eligible.clear();
    for (int64_t e = 0; e < num_experts; ++e) {
      if (std::find(groups.begin(), groups.begin() + p.topk_group, e / size) !=
          groups.begin() + p.topk_group)
        eligible.push_back(e);
    }
  }
  std::stable_sort(eligible.begin(), eligible.end(),
                   [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
  double sum = 0;
  for (int64_t j = 0; j < p.top_k; ++j) {
    r.ids.push_back(static_cast<int32_t>(eligible[j]));
    r.weights.push_back(score[eligible[j]]);
    sum += score[eligible[j]];
  }
  for (double& w : r.weights) {
    if (p.renormalize) w /= (p.kind == RouterKind::kSigmoidNoauxTc ? sum + 1e-20 : sum);
    if (p.kind == RouterKind::kSigmoidNoauxTc) w *= p.routed_scaling_factor;
  }
  return r;
}

inline RouteParams softmax_params(int64_t e, int64_t k, bool renorm) {
  RouteParams p;
  p.kind = RouterKind::kSoftmaxTopK;
  p.num_experts = e;
  p.top_k = k;
  p.renormalize = renorm;
  return p;
}

inline RouteParams noaux_params(int64_t e, int64_t k, int64_t n_group, int64_t topk_group,
                                bool renorm, float scale) {
  RouteParams p;
  p.kind = RouterKind::kSigmoidNoauxTc;
  p.num_experts = e;
  p.top_k = k;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.renormalize = renorm;
  p.routed_scaling_factor = scale;
  return p;
}

inline std::vector<int32_t> ids_row(const ops::RouteResult& r, int64_t t) {
  const int64_t k = r.ids.dim(1);
  return std::vector<int32_t>(r.ids.data<int32_t>() + t * k, r.ids.data<int32_t>() + (t + 1) * k);
}

inline float logit_of(double s) {
  return static_cast<float>(std::log(s / (1 - s)));
}

// ============================================================================ linear

inline std::vector<double> matmul_nt(const std::vector<double>& x, int64_t rows, int64_t in,
                                     const std::vector<double>& w, int64_t out) {
  std::vector<double> y(rows * out, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) y[r * out + o] += x[r * in + i] * w[o * in + i];
  return y;
}

// ============================================================================ LoRA helpers

inline LoraFactors random_lora(std::mt19937_64& rng, int64_t ea, int64_t eb, int64_t rank,
                               int64_t in, int64_t out, float scaling) {
  LoraFactors f;
  f.a = test::random_normal({ea, rank, in}, rng, 1.0f / std::sqrt(static_cast<float>(in)));
  f.b = test::random_normal({eb, out, rank}, rng, 1.0f / std::sqrt(static_cast<float>(rank)));
  f.scaling = scaling;
  return f;
}

// s * B_e A_e as a dense [out, in] matrix, in double.
inline std::vector<double> dense_delta(const LoraFactors& f, int64_t e) {
  const int64_t rank = f.a.dim(1), in = f.a.dim(2), out = f.b.dim(1);
  const float* a = f.a.data<float>() + (f.a.dim(0) == 1 ? 0 : e) * rank * in;
  const float* b = f.b.data<float>() + (f.b.dim(0) == 1 ? 0 : e) * out * rank;
  std::vector<double> d(out * in, 0.0);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double s = 0;
      for (int64_t r = 0; r < rank; ++r) s += double(b[o * rank + r]) * a[r * in + i];
      d[o * in + i] = f.scaling * s;
    }
  return d;
}

// W [out, in] + s B_e A_e, rounded to fp32.
inline Tensor merged(const Tensor& w, const LoraFactors* f, int64_t e) {
  if (f == nullptr) return w.clone();
  std::vector<double> m = to_double(w);
  const std::vector<double> d = dense_delta(*f, e);
  for (size_t i = 0; i < m.size(); ++i) m[i] += d[i];
  return to_tensor(m, w.shape());
}

}  // namespace moelora::ops_ref_test
