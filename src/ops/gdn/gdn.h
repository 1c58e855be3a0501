// Gated DeltaNet (the linear attention of Qwen3-Next and Qwen3.5-MoE, reference/FORMATS.md §1.4 -
// 1.5): CPU reference of its parts and of the whole layer, fp32 throughout (the fp32 goldens are
// made with transformers' pure-torch path).
//
// Notation: T tokens of one sequence, H hidden, nk / nv key / value heads (nv a multiple of nk),
// dk / dv head dims, key_dim = nk dk, value_dim = nv dv, K the conv kernel width, conv_dim =
// 2 key_dim + value_dim (the channels [q | k | v] the conv runs over).
//
// Per sequence the layer carries a state across calls: the conv state (the last K - 1 conv inputs)
// and the recurrent state S [nv, dk, dv]. A new sequence starts from zeros; a prefill split into
// chunks, then decode steps, gives the outputs of one call over the whole sequence.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moelora::ops {

struct GdnShape {
  int64_t hidden = 0;       // H
  int64_t num_k_heads = 0;  // nk
  int64_t num_v_heads = 0;  // nv
  int64_t head_k_dim = 0;   // dk
  int64_t head_v_dim = 0;   // dv
  int64_t conv_kernel = 0;  // K
  double norm_eps = 1e-6;   // the gated RMSNorm's eps (config rms_norm_eps)

  int64_t key_dim() const { return num_k_heads * head_k_dim; }
  int64_t value_dim() const { return num_v_heads * head_v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

// Weights of one layer as on disk (Qwen3.5's separate projections), any float dtype (used as
// fp32).
struct GdnWeights {
  Tensor in_proj_qkv;  // [conv_dim, H], rows [q (key_dim) | k (key_dim) | v (value_dim)]
  Tensor in_proj_z;    // [value_dim, H]
  Tensor in_proj_b;    // [nv, H]
  Tensor in_proj_a;    // [nv, H]
  Tensor conv1d;       // [conv_dim, 1, K] or [conv_dim, K] (depthwise, no bias)
  Tensor a_log;        // [nv]  A_log
  Tensor dt_bias;      // [nv]
  Tensor norm;         // [dv]  the gated RMSNorm's weight (plain w, not 1 + w)
  Tensor out_proj;     // [H, value_dim]
};

// Per-sequence state, F32.
struct GdnState {
  Tensor conv;       // [conv_dim, K - 1], oldest input first
  Tensor recurrent;  // [nv, dk, dv]
  static GdnState zeros(const GdnShape& shape);
};

// Causal depthwise conv over time followed by SiLU, with a rolling state:
//   y[t, c] = silu(sum_j w[c, j] * u[t + j, c]),  u = [state (K - 1 rows) ; x (T rows)]
// x: F32 [T, C]; weight [C, K] (or [C, 1, K]); state: F32 [C, K - 1], replaced by the last K - 1
// rows of u. Returns F32 [T, C].
Tensor causal_conv1d_silu_ref(const Tensor& x, const Tensor& weight, Tensor& state);

// The gated delta rule per value head h, state S [dk, dv], for t = 0 .. T-1:
//   S = exp(g[t, h]) S
//   S = S + k[t, h] (beta[t, h] (v[t, h] - S^T k[t, h]))^T
//   o[t, h] = S^T q[t, h]
// q, k: F32 [T, nv, dk] (normalised and scaled by the caller), v: F32 [T, nv, dv], g, beta: F32
// [T, nv]; state: F32 [nv, dk, dv], updated. Returns o: F32 [T, nv, dv].
Tensor gated_delta_rule_recurrent_ref(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& g, const Tensor& beta, Tensor& state);

// The same recurrence over chunks of `chunk` tokens (prefill): inside a chunk the deltas solve
// one unit lower-triangular system and the outputs and the next state are sums over the chunk
// (gdn_ref.cpp derives it). Equal to the recurrent form up to fp32 rounding.
Tensor gated_delta_rule_chunked_ref(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& g, const Tensor& beta, Tensor& state,
                                    int64_t chunk = 64);

// Gated RMSNorm of the linear attention's output, per row of the last dimension D:
//   y = w * (x / sqrt(mean(x^2) + eps)) * silu(z)
// x, z: F32 [..., D] of one shape, w [D] (any float dtype). Returns F32 with x's shape.
Tensor rms_norm_gated_ref(const Tensor& x, const Tensor& z, const Tensor& w, double eps);

// The layer between its projections (what a model runs per sequence once the projections, and
// their LoRA deltas, have been computed for the whole batch), for T tokens of one sequence:
//   qkv F32 [T, conv_dim] (in_proj_qkv output, before the conv), z F32 [T, value_dim],
//   b, a F32 [T, nv] -> F32 [T, value_dim], the gated RMSNorm output that out_proj takes.
// Uses weights.conv1d, a_log, dt_bias and norm (the projections may be left undefined); the
// state is updated.
Tensor gdn_mix_ref(const Tensor& qkv, const Tensor& z, const Tensor& b, const Tensor& a,
                   const GdnWeights& weights, const GdnShape& shape, GdnState& state, bool chunked);

// The whole layer for T tokens of one sequence: x F32 [T, H] -> F32 [T, H], the state updated.
//   qkv = conv_silu(x Wqkv^T); z = x Wz^T; beta = sigmoid(x Wb^T);
//   g = -exp(A_log) softplus(x Wa^T + dt_bias);
//   q, k L2-normalised per head (eps 1e-6), q scaled by 1/sqrt(dk), both repeated to the value
//   heads (value head h reads key head h / (nv / nk));
//   o = gated delta rule (chunked when `chunked`, else recurrent);
//   out = rms_norm_gated(o, z, norm) Wout^T.
Tensor gdn_forward_ref(const Tensor& x, const GdnWeights& weights, const GdnShape& shape,
                       GdnState& state, bool chunked);

}  // namespace moelora::ops
