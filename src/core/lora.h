// LoRA factors in the canonical form shared by the adapter loader (io/peft) and the operators.
//
//   A [Ea, R, in], B [Eb, out, R], fp32; delta(x) = scaling * (x A_e^T) B_e^T for expert e, where
//   A_e = A[Ea == 1 ? 0 : e] and B_e = B[Eb == 1 ? 0 : e]. Plain (non-expert) targets have
//   Ea = Eb = 1. Ranks below the pool's maximum are zero-padded by the consumer, never here.
#pragma once

#include "core/tensor.h"

namespace moelora {

struct LoraFactors {
  Tensor a;  // F32 [Ea, R, in]
  Tensor b;  // F32 [Eb, out, R]
  float scaling = 1.0f;

  bool defined() const { return a.defined(); }
  int64_t rank() const { return a.dim(1); }
  int64_t in_features() const { return a.dim(2); }
  int64_t out_features() const { return b.dim(1); }
  // Ea == 1 while experts > 1: the A factor is shared by all experts (shared-outer gate_up).
  bool shared_a() const { return a.dim(0) == 1; }
  bool shared_b() const { return b.dim(0) == 1; }
};

}  // namespace moelora
