// Random MoE adapters for the GPU MoE layer tests (moe_layer_fixture.cuh, moe_layer_case.cuh):
// per-expert or shared-outer routed-expert factors and, where the layer has a shared expert, its
// gate / up / down factors (up with another rank and scaling), all bf16-representable and with
// strong deltas, so that a wrong slot or expert is obvious.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>

#include "core/lora.h"
#include "core/tensor.h"
#include "ops/moe/moe.h"
#include "ops/moe/moe_layer_cuda.cuh"
#include "support/test_support.h"

namespace moelora::moe_adapter_case {

inline Tensor bf16_round(const Tensor& t) {
  return t.to(DType::kBF16).to_f32();
}

struct HostAdapter {
  LoraFactors gate_up, down, shared_gate, shared_up, shared_down;
  ops::MoeLoraRef ref() const { return {&gate_up, &down, &shared_gate, &shared_up, &shared_down}; }
  ops::cuda::MoeLayerAdapter gpu() const {
    return {&gate_up, &down, &shared_gate, &shared_up, &shared_down};
  }
};

// A [ea, r, in], B [eb, out, r], normal with 1 / sqrt(fan-in) scales, rounded to bf16.
inline LoraFactors random_factors(int ea, int eb, int r, int in, int out, float scaling,
                                  std::mt19937_64& rng) {
  LoraFactors f;
  f.a = bf16_round(test::random_normal({ea, r, in}, rng, 1.0f / std::sqrt(static_cast<float>(in))));
  f.b = bf16_round(test::random_normal({eb, out, r}, rng, 1.0f / std::sqrt(static_cast<float>(r))));
  f.scaling = scaling;
  return f;
}

// shared_outer: the gate_up A and the down B shared by all experts (Ea / Eb = 1).
inline HostAdapter make_adapter(const ops::cuda::MoeLayerConfig& c, int rank, bool shared_outer,
                                std::mt19937_64& rng) {
  const int E = c.num_experts, H = c.hidden, I = c.inter, Is = c.shared_inter;
  HostAdapter a;
  a.gate_up = random_factors(shared_outer ? 1 : E, E, rank, H, 2 * I, 0.8f, rng);
  a.down = random_factors(E, shared_outer ? 1 : E, rank, I, H, 0.8f, rng);
  if (Is > 0) {
    a.shared_gate = random_factors(1, 1, rank, H, Is, 0.7f, rng);
    a.shared_up =
        random_factors(1, 1, std::max(1, rank / 2), H, Is, 1.1f, rng);  // other rank and scaling
    a.shared_down = random_factors(1, 1, rank, Is, H, 0.7f, rng);
  }
  return a;
}

}  // namespace moelora::moe_adapter_case
