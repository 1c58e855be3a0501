// Causal grouped-query attention (GQA) for one sequence, with a growable fp32 KV cache: the oracle
// for the paged GPU attention of Qwen3-MoE and the full-attention layers of Qwen3.5.
//
// Semantics (HF eager_attention_forward with repeat_kv and a causal mask):
//   q [T, Hq, D] holds the new tokens at positions [p0, p0 + T); the cache holds K [S, Hkv, D] and
//   V [S, Hkv, Dv] for positions [0, S) with S = p0 + T (the new tokens' K/V already appended).
//   Query head h reads KV head h / (Hq / Hkv) (repeat_kv: consecutive query heads share a KV head).
//   For the token at position p = p0 + t:
//     score[i] = (q[t, h] . K[i, kvh]) * scale             for i = 0 .. p (causal: nothing later)
//     prob     = softmax(score) in fp32 (max subtracted, exp, divided by the sum)
//     out[t, h] = sum_i prob[i] * V[i, kvh]                -> out [T, Hq, Dv]
//   scale defaults to 1 / sqrt(D) (Qwen3: head_dim^-0.5).
//
// Prefill and decode are the same call: prefill appends T tokens then attends with q [T, ...];
// decode appends one and attends with q [1, ...]. Every (token, head) output is computed the same
// way whatever T is, so "prefill T" and "prefill T - 1, decode 1" give identical bits.
//
// Qwen3-Next / Qwen3.5 gated attention: q_proj yields per head [q (D) | gate (D)]; after attention,
// out *= sigmoid(gate) before o_proj (split_gated_query_ref, apply_output_gate_inplace_ref).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace moelora::ops {

struct AttentionParams {
  float scale = 0.0f;  // softmax scale applied to q.k; 0 = 1 / sqrt(head_dim)
};

// K/V of one sequence for one layer, fp32, appended token by token (positions [0, size())).
class KvCacheRef {
 public:
  KvCacheRef(int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim);

  int64_t size() const { return size_; }  // S: number of positions stored
  int64_t num_kv_heads() const { return num_kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t v_head_dim() const { return v_head_dim_; }

  // k: F32 [T, Hkv, D], v: F32 [T, Hkv, Dv]; stored at positions [size(), size() + T).
  void append(const Tensor& k, const Tensor& v);
  // Keeps positions [0, new_size) (rolls back tokens that were not accepted).
  void truncate(int64_t new_size);

  // Row of position `pos` and KV head `kv_head`: D (key) or Dv (value) floats.
  const float* key(int64_t pos, int64_t kv_head) const {
    return keys_.data() + (pos * num_kv_heads_ + kv_head) * head_dim_;
  }
  const float* value(int64_t pos, int64_t kv_head) const {
    return values_.data() + (pos * num_kv_heads_ + kv_head) * v_head_dim_;
  }
  // Copies of the stored K [S, Hkv, D] and V [S, Hkv, Dv].
  Tensor keys() const;
  Tensor values() const;

 private:
  int64_t num_kv_heads_, head_dim_, v_head_dim_;
  int64_t size_ = 0;
  std::vector<float> keys_;    // [S, Hkv, D]
  std::vector<float> values_;  // [S, Hkv, Dv]
};

// q: F32 [T, Hq, D] at positions [S - T, S); k: F32 [S, Hkv, D]; v: F32 [S, Hkv, Dv].
// Requires T <= S and Hq % Hkv == 0. Returns F32 [T, Hq, Dv].
Tensor attention_ref(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params);
// Same, with K/V read from the cache (S = cache.size()).
Tensor attention_ref(const Tensor& q, const KvCacheRef& cache, const AttentionParams& params);

// Gated attention (Qwen3-Next / Qwen3.5).
struct GatedQuery {
  Tensor query;  // F32 [T, H, D]
  Tensor gate;   // F32 [T, H, D]
};
// q_proj_out: F32 [T, H * 2 * D], laid out per head as [q (D) | gate (D)].
GatedQuery split_gated_query_ref(const Tensor& q_proj_out, int64_t num_heads, int64_t head_dim);
// out: F32 [T, H, Dv] (or any shape) *= sigmoid(gate), gate with out's element count.
void apply_output_gate_inplace_ref(Tensor& out, const Tensor& gate);

namespace detail {
// Serial kernel shared with MLA: x[0 .. n) <- softmax(x) in fp32 (max subtracted, exp, each value
// divided by the sum, like torch's softmax). n >= 1.
void softmax_inplace_f32(float* x, int64_t n);
}  // namespace detail

}  // namespace moelora::ops
