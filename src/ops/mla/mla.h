// Multi-head latent attention (MLA) of DeepSeek-V3 / Kimi-K2: the attention core in two equivalent
// forms. The un-absorbed form is what transformers (modeling_deepseek_v3) computes; the absorbed
// form is what the GPU engine runs, with a cache of 576 values per token instead of per-head K/V.
//
// Whole dataflow of one MLA layer (x [T, H_model]; per-head sizes nope = qk_nope_head_dim,
// rope = qk_rope_head_dim, dv = v_head_dim, r = kv_lora_rank, n = num_heads):
//   query:  q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (q_lora_rank > 0; q_a_layernorm is RMSNorm)
//           q = q_proj(x)                              (q_lora_rank absent / 0)
//           q viewed [T, n, nope + rope] = per head [q_nope | q_rope]
//   kv:     kv_a_proj_with_mqa(x) -> [T, r + rope], split [c_kv | k_rope]
//           c_kv = kv_a_layernorm(c_kv)                (RMSNorm over r)
//           k_rope [T, rope] is shared by all heads
//   rope:   q_rope and k_rope rotated at each token's position (ops/rope, RopeStyle::kInterleaved
//           when rope_interleave is true (the default), kRotateHalf otherwise; YaRN with
//           rotary_dim = rope, cos/sin times the YaRN attention_factor). transformers writes the
//           interleaved result de-interleaved for q and k alike; the engine keeps pairs in place.
//           Both orders give the same q.k (rope.h).
//   cache:  c_kv [S, r] and rotated k_rope [S, rope] per token (MlaLatentCacheRef).
//   un-absorbed (transformers): kv_b_proj(c_kv) -> [S, n, nope + dv] = per head [k_nope | v];
//           key = [k_nope | k_rope]; out[t, h] = softmax_causal(q[t, h] . key * scale) v
//   absorbed (serving engines): with kv_b_proj.weight [n * (nope + dv), r] split per head into
//           W_UK[h] = rows [h (nope + dv), h (nope + dv) + nope)       [nope, r]
//           W_UV[h] = rows [h (nope + dv) + nope, (h + 1) (nope + dv)) [dv, r]
//           q_lat[t, h]  = W_UK[h]^T q_nope[t, h]                      [r]
//           score[t,h,s] = (q_lat[t, h] . c_kv[s] + q_rope[t, h] . k_rope[s]) * scale
//           o_lat[t, h]  = sum_s softmax(score)[s] c_kv[s]             [r]
//           out[t, h]    = W_UV[h] o_lat[t, h]                         [dv]
//           Since q_nope . (W_UK c) = (W_UK^T q_nope) . c and W_UV is linear, the two forms are
//           equal up to rounding. A LoRA on kv_b_proj must be folded into W_UK / W_UV (or applied
//           in factored form) because kv_b_proj never runs as a linear here.
//   output: out [T, n * dv] -> o_proj.
//   scale:  mla_softmax_scale: qk_head_dim^-0.5, times mscale^2 where mscale = 0.1 mscale_all_dim
//           ln(factor) + 1 when the rope type is not "default", mscale_all_dim is non-zero and
//           factor > 1 (transformers' yarn_apply_mscale). DeepSeek-V3: 192^-0.5 (1 + 0.1 ln 40)^2.
//
// Causality as in ops/attention: the T queries are the last T of the S cached positions.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/rope/rope.h"

namespace moelora::ops {

struct MlaDims {
  int64_t num_heads = 0;         // n
  int64_t qk_nope_head_dim = 0;  // nope
  int64_t qk_rope_head_dim = 0;  // rope
  int64_t v_head_dim = 0;        // dv
  int64_t kv_lora_rank = 0;      // r (only the latent and absorbed entry points read it)
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

struct MlaAttentionParams {
  MlaDims dims;
  float softmax_scale = 0.0f;  // 0 = qk_head_dim^-0.5; models pass mla_softmax_scale(...)
};

// The softmax scale transformers uses for MLA (yarn_apply_mscale, double arithmetic). Throws
// kInvalidArgument when the rope type needs a factor (mscale_all_dim set) and none is given.
double mla_softmax_scale(int64_t qk_head_dim, const RopeParams& rope);

// Un-absorbed MLA attention.
//   q:      F32 [T, n, nope + rope], rope part already rotated
//   k_nope: F32 [S, n, nope]
//   k_rope: F32 [S, rope] (rotated, shared by all heads)
//   v:      F32 [S, n, dv]
// Returns F32 [T, n, dv]; the T queries sit at positions [S - T, S).
Tensor mla_attention_ref(const Tensor& q, const Tensor& k_nope, const Tensor& k_rope, const Tensor& v,
                         const MlaAttentionParams& params);

// kv_b_proj of the latents: c_kv F32 [S, r], kv_b_weight F32 [n * (nope + dv), r]
// -> k_nope F32 [S, n, nope], v F32 [S, n, dv].
struct MlaKeyValue {
  Tensor k_nope;
  Tensor v;
};
MlaKeyValue mla_expand_kv_ref(const Tensor& c_kv, const Tensor& kv_b_weight, const MlaDims& dims);

// Absorbed MLA attention, same inputs as the model holds them:
//   q: F32 [T, n, nope + rope]; c_kv: F32 [S, r] (after kv_a_layernorm); k_rope: F32 [S, rope];
//   kv_b_weight: F32 [n * (nope + dv), r]. Returns F32 [T, n, dv].
// It is the composition of the three steps below, which a GPU implementation can test one by one.
Tensor mla_attention_absorbed_ref(const Tensor& q, const Tensor& c_kv, const Tensor& k_rope,
                                  const Tensor& kv_b_weight, const MlaAttentionParams& params);
// Step 1: q_lat[t, h] = W_UK[h]^T q_nope[t, h]. q: F32 [T, n, nope + rope] -> F32 [T, n, r].
Tensor mla_absorb_query_ref(const Tensor& q, const Tensor& kv_b_weight, const MlaDims& dims);
// Step 2: attention over the latent cache. q_lat: F32 [T, n, r]; q: F32 [T, n, nope + rope] (only
// the rope part is read); c_kv: F32 [S, r]; k_rope: F32 [S, rope] -> o_lat F32 [T, n, r].
Tensor mla_latent_attention_ref(const Tensor& q_lat, const Tensor& q, const Tensor& c_kv,
                                const Tensor& k_rope, const MlaAttentionParams& params);
// Step 3: out[t, h] = W_UV[h] o_lat[t, h]. o_lat: F32 [T, n, r] -> F32 [T, n, dv].
Tensor mla_project_output_ref(const Tensor& o_lat, const Tensor& kv_b_weight, const MlaDims& dims);

// Latent cache of one sequence for one layer: c_kv [S, r] and rotated k_rope [S, rope], fp32.
class MlaLatentCacheRef {
 public:
  MlaLatentCacheRef(int64_t kv_lora_rank, int64_t qk_rope_head_dim);
  int64_t size() const { return size_; }
  // c_kv: F32 [T, r]; k_rope: F32 [T, rope]; stored at positions [size(), size() + T).
  void append(const Tensor& c_kv, const Tensor& k_rope);
  void truncate(int64_t new_size);
  Tensor latent() const;  // copy, F32 [S, r]
  Tensor k_rope() const;  // copy, F32 [S, rope]

 private:
  int64_t rank_, rope_dim_;
  int64_t size_ = 0;
  std::vector<float> latent_;  // [S, r]
  std::vector<float> k_rope_;  // [S, rope]
};

}  // namespace moelora::ops
