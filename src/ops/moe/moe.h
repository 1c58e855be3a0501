// The MoE layer with multi-LoRA, CPU reference (DESIGN.md §3), fp32 with plain loops.
//
// Inputs: x [T, H]; slot [T] (-1 = base only); per-slot LoRA of this layer.
//   1. route: logits = x Wg^T -> ids [T, k], w [T, k]            (ops/route)
//   2. for each pair p = (t, j), e = ids[t, j]:
//        h = x[t] W13[e]^T                                       [2I]  (gate rows [0, I), up [I,
//        2I)) seam 1: h += s13 * (x[t] A13[slot, e]^T) B13[slot, e]^T  (slot >= 0 and the adapter
//        has it) a = silu(h[:I]) * h[I:]                                  [I] y = a W2[e]^T [H]
//        seam 2: y += s2 * (a A2[slot, e]^T) B2[slot, e]^T
//        out[t] += w[t, j] * y
//   3. shared expert (with its own LoRA on gate/up/down), times sigmoid(x Wsg^T) when gated,
//      added to out.
// Expert e uses A13[Ea == 1 ? 0 : e] and B13[Eb == 1 ? 0 : e] (likewise for the down factors), so
// per-expert (Ea = Eb = E) and shared-outer (Ea = 1 or Eb = 1) adapters take the same path.
// Optionally (MoeParams::fp8_activations) GEMM1 sees dequant(quant(x)) and GEMM2 sees
// dequant(quant(a)), each quantized per token (pair) per 128 columns as in quant.h, so the
// reference sees exactly what the FP8 GEMMs see; the seams always use the unquantized x and a.
// The emulation covers the routed experts (and the shared expert with shared_fp8_activations);
// the router sees x.
//
// Numerics: fp32 throughout, GEMM elements are ops::dot_f32; out[t] starts at 0 and adds
// w[t, j] * y[t, j] for j = 0..k-1 in order, then the shared expert. Results do not depend on the
// thread count or on which other tokens are in the batch (a slot -1 token equals the base output
// bit for bit).
#pragma once

#include <cstdint>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "ops/route/route.h"

namespace moelora::ops {

struct MoeParams {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  RouteParams route;         // E, k, router kind
  // Emulate FP8 activations at GEMM1 and GEMM2 (dynamic per-token 1x128 quantization).
  bool fp8_activations = false;
  // The same for the shared expert's two GEMMs (its LoRA still from the unquantized x and a): what
  // the GPU layer computes when the shared expert runs among the routed experts
  // (ops::cuda::MoeLayerConfig::shared_in_experts).
  bool shared_fp8_activations = false;
};

struct MoeWeightsRef {
  Tensor router;           // F32 [E, H]
  Tensor correction_bias;  // F32 [E] or undefined
  Tensor w13;              // F32 [E, 2I, H]
  Tensor w2;               // F32 [E, H, I]
  // shared expert (undefined when absent)
  Tensor shared_w13;   // F32 [2Is, H] (gate rows then up rows)
  Tensor shared_w2;    // F32 [H, Is]
  Tensor shared_gate;  // F32 [1, H] (Qwen sigmoid gate) or undefined
};

// LoRA of one slot for one MoE layer; null pointers = not targeted by that adapter.
struct MoeLoraRef {
  const LoraFactors* gate_up = nullptr;      // A [Ea, R, H], B [Eb, 2I, R]
  const LoraFactors* down = nullptr;         // A [Ea, R, I], B [Eb, H, R]
  const LoraFactors* shared_gate = nullptr;  // plain [1, R, H] / [1, Is, R]
  const LoraFactors* shared_up = nullptr;
  const LoraFactors* shared_down = nullptr;
};

struct MoeTrace {  // optional outputs for tests
  Tensor logits;   // F32 [T, E]
  RouteResult route;
};

// Returns out [T, H] F32. `router_logits`, when defined (F32 [T, E]), replaces x Wg^T (the
// "routed experts only" configuration of the benchmarks); weights.router may then be undefined.
// `forced_ids`, when defined (I32 [T, k]), imposes the routing (route_ref's forced_ids).
// Validates every shape (x [T, H], w13 [E, 2I, H], w2 [E, H, I], router [E, H], shared_w13
// [2Is, H], shared_w2 [H, Is], shared_gate [1, H]; gate_up A [Ea, R, H] / B [Eb, 2I, R], down
// A [Ea, R, I] / B [Eb, H, R] with Ea, Eb in {1, E}; shared LoRA [1, R, H] / [1, Is, R] and
// [1, R, Is] / [1, H, R]), slot.size() == T and every slot in {-1} u [0, slots.size()); errors
// name the tensor (and slot) with the expected and actual shape.
Tensor moe_forward_ref(const Tensor& x, const std::vector<int32_t>& slot, const MoeWeightsRef& weights,
                       const std::vector<MoeLoraRef>& slots, const MoeParams& params,
                       MoeTrace* trace = nullptr, const Tensor& router_logits = Tensor(),
                       const Tensor& forced_ids = Tensor());

// The two halves of moe_forward_ref's routed experts, for callers that hold only some experts
// (expert parallelism, src/dist) and combine the rest elsewhere.
//
// moe_expert_outputs_ref: y [T * k, H] F32, row t * k + j = expert ids[t, j]'s output for token t
// (GEMM1, seam 1, SwiGLU, GEMM2, seam 2, exactly as moe_forward_ref computes it) when that expert
// is one of the local experts [expert_offset, expert_offset + E_local), and zeros otherwise.
// w13 [E_local, 2I, H], w2 [E_local, H, I]: the local experts' weights; the gate_up / down LoRA of
// each slot [Ea, R, in] / [Eb, out, R] with Ea, Eb in {1, E_local} (local expert e uses index e of
// a per-expert factor); shared-expert LoRA is ignored. route: route_ref's result over all
// params.route.num_experts experts.
Tensor moe_expert_outputs_ref(const Tensor& x, const std::vector<int32_t>& slot, const Tensor& w13,
                              const Tensor& w2, const std::vector<MoeLoraRef>& slots,
                              const MoeParams& params, const RouteResult& route,
                              int64_t expert_offset);

// out [T, H] = sum over j = 0..k-1 in order of route_weights[t, j] * expert_out[t * k + j], then
// + shared[t] when shared (F32 [T, H]) is defined: moe_forward_ref's finalize.
Tensor moe_combine_ref(const Tensor& expert_out, const Tensor& route_weights,
                       const Tensor& shared = Tensor());

// SwiGLU MLP with per-slot LoRA on gate/up/down (dense layers and the shared expert):
//   out = (silu(x Wg^T + dg) * (x Wu^T + du)) Wd^T + dd
// w_gate/w_up: F32 [I, H]; w_down: F32 [H, I]; lora[s] = {gate, up, down} of slot s (null or
// undefined = not targeted); slot values must be -1 or in [0, lora.size()). Deltas are computed
// with lora_add_slots_ref, the down delta from the fp32 activation. fp8_activations: the gate / up
// GEMMs see dequant(quant(x)) and the down GEMM dequant(quant(a)), per row per 128 columns (the
// deltas still read x and a).
struct MlpLoraRef {
  const LoraFactors* gate = nullptr;
  const LoraFactors* up = nullptr;
  const LoraFactors* down = nullptr;
};
Tensor mlp_forward_ref(const Tensor& x, const std::vector<int32_t>& slot, const Tensor& w_gate,
                       const Tensor& w_up, const Tensor& w_down,
                       const std::vector<MlpLoraRef>& lora, bool fp8_activations = false);

}  // namespace moelora::ops
