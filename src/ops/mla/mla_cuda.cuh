// MLA on the GPU in its absorbed form (mla.h is the oracle, steps 1-3 of
// mla_attention_absorbed_ref), over a paged latent cache, for prefill chunks and decode steps in
// one batch. Sizes: n heads, nope = qk_nope_head_dim, rope = qk_rope_head_dim, dv = v_head_dim,
// r = kv_lora_rank (Kimi / DeepSeek-V3: 128 / 64 / 128 / 512).
//
//   latent cache (one layer): [num_pages, page_size, r + rope] bf16 = per token [c_kv | k_rope]
//   absorb:   q_full[t, h] = [W_UK[h]^T q_nope[t, h] | q_rope[t, h]]        [T, n, r + rope]
//   attend:   o_lat[t, h] = sum_s softmax_s((q_full[t, h] . cache[s]) * scale) c_kv[s]   [T, n, r]
//             (one KV head shared by all n heads: MQA with a 576-wide key and a 512-wide value)
//   project:  out[t, h] = W_UV[h] o_lat[t, h]                               [T, n * dv]
// with W_UK[h] / W_UV[h] the rows of kv_b_proj [n (nope + dv), r] as in mla.h. Causality and the
// batch layout are those of attention_cuda.cuh (AttentionBatch).
//
// LoRA on kv_b_proj (A [R, r], B [n (nope + dv), R], scaling s, per token slot) cannot run as a
// linear since kv_b_proj never does; it is applied in factored form on both sides:
//   query:   q_full[t, h, :r] += s * A^T (B_k[h]^T q_nope[t, h])     B_k[h] = B rows of W_UK[h]
//   output:  out[t, h]       += s * B_v[h] (A o_lat[t, h])            B_v[h] = B rows of W_UV[h]
// Tokens with slot -1 (or a slot whose adapter does not target kv_b_proj: rank 0) are untouched.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attention/attention_cuda.cuh"
#include "ops/lora/lora_cuda.cuh"

namespace moelora::ops::cuda {

struct MlaShape {
  int num_heads = 0;  // n
  int nope = 0;       // qk_nope_head_dim
  int rope = 0;       // qk_rope_head_dim
  int v_dim = 0;      // v_head_dim
  int rank = 0;       // kv_lora_rank, multiple of 8 (<= 512)
};

struct MlaLatentCache {
  __nv_bfloat16* kv = nullptr;  // [num_pages, page_size, rank + rope]
  int page_size = 0;
};

// Writes c_kv [T, r] (after kv_a_layernorm) and the rotated k_rope [T, rope] of the new rows.
struct MlaAppendArgs {
  MlaLatentCache cache;
  MlaShape shape;
  AttentionBatch batch;
  const __nv_bfloat16* c_kv = nullptr;
  int64_t c_kv_stride = 0;
  const __nv_bfloat16* k_rope = nullptr;
  int64_t k_rope_stride = 0;
};
void launch_mla_cache_append(const MlaAppendArgs& args, cudaStream_t stream);

// q [T, n, nope + rope] (rope part rotated), row stride q_stride -> q_full [T, n, r + rope].
// Uses cuBLAS (strided-batched over heads) on `stream`; `tokens` rows (capacity; padding rows give
// garbage that nothing reads).
struct MlaAbsorbArgs {
  MlaShape shape;
  const __nv_bfloat16* q = nullptr;
  int64_t q_stride = 0;
  const __nv_bfloat16* kv_b = nullptr;  // [n (nope + dv), r]
  __nv_bfloat16* q_full = nullptr;      // [T, n, r + rope]
  int tokens = 0;
};
void launch_mla_absorb_query(cublasHandle_t handle, const MlaAbsorbArgs& args, cudaStream_t stream);

struct MlaAttentionArgs {
  MlaLatentCache cache;
  MlaShape shape;
  AttentionBatch batch;
  const __nv_bfloat16* q_full = nullptr;  // [T, n, r + rope]
  float scale = 0.0f;                     // softmax scale (mla_softmax_scale)
  __nv_bfloat16* o_lat = nullptr;         // [T, n, r]
  void* workspace = nullptr;              // mla_attention_workspace_bytes(...)
};
size_t mla_attention_workspace_bytes(const MlaShape& shape, int max_tokens, int max_seqs);
void launch_mla_attention(const MlaAttentionArgs& args, cudaStream_t stream);

// o_lat [T, n, r] -> out [T, n * dv] (cuBLAS strided-batched over heads).
struct MlaProjectArgs {
  MlaShape shape;
  const __nv_bfloat16* o_lat = nullptr;
  const __nv_bfloat16* kv_b = nullptr;
  __nv_bfloat16* out = nullptr;
  int tokens = 0;
};
void launch_mla_project_output(cublasHandle_t handle, const MlaProjectArgs& args,
                               cudaStream_t stream);

// The factored kv_b LoRA (see the file comment). pool: the kv_b target of the adapter pool
// (in = r, out = n (nope + dv), ea = eb = 1); token_slot [T] (-1 = base).
struct MlaKvbLoraArgs {
  MlaShape shape;
  LoraPoolTarget pool;
  const int32_t* token_slot = nullptr;
  int tokens = 0;
  const int32_t* num_tokens = nullptr;  // nullptr = tokens
  // query side: q [T, n, nope + rope] (stride q_stride) adds into q_full [T, n, r + rope]
  const __nv_bfloat16* q = nullptr;
  int64_t q_stride = 0;
  __nv_bfloat16* q_full = nullptr;
  // output side: o_lat [T, n, r] adds into out [T, n * dv]
  const __nv_bfloat16* o_lat = nullptr;
  __nv_bfloat16* out = nullptr;
};
void launch_mla_kvb_lora_query(const MlaKvbLoraArgs& args, cudaStream_t stream);
void launch_mla_kvb_lora_output(const MlaKvbLoraArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
