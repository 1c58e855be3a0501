// Paged causal GQA attention on the GPU (attention.h is the oracle), for prefill chunks and decode
// steps in one batch.
//
// KV cache (one layer): K [num_pages, page_size, Hkv, D], V [num_pages, page_size, Hkv, Dv], bf16.
// Each batch sequence b owns pages page_table[b * max_pages_per_seq + i], i = 0, 1, ...; position
// p of the sequence lives in page p / page_size, row p % page_size.
//
// Batch layout: tokens of sequence b are rows [q_start[b], q_start[b] + q_len[b]) of q / out, at
// positions [kv_len[b] - q_len[b], kv_len[b]) (the new tokens' K/V are appended first, by
// launch_paged_kv_append). Query head h reads KV head h / (Hq / Hkv). The token at position p
// attends to positions 0 .. p. Sequences with q_len 0 (padding of a captured bucket) do nothing.
//
// Graph-friendly: grids are sized by capacity (max sequences, max tokens); the counts are device
// values; nothing allocates (split-KV partials live in the caller's workspace).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::ops::cuda {

struct PagedKv {
  __nv_bfloat16* k = nullptr;  // [num_pages, page_size, Hkv, D]
  __nv_bfloat16* v = nullptr;  // [num_pages, page_size, Hkv, Dv]
  int page_size = 0;           // tokens per page (power of two, >= 16)
  int num_kv_heads = 0;
  int head_dim = 0;    // D <= 256, multiple of 8
  int v_head_dim = 0;  // Dv <= 256, multiple of 8
};

struct AttentionBatch {
  const int32_t* page_table = nullptr;  // [max_seqs, max_pages_per_seq]
  int max_pages_per_seq = 0;
  const int32_t* q_start = nullptr;    // [max_seqs]
  const int32_t* q_len = nullptr;      // [max_seqs]
  const int32_t* kv_len = nullptr;     // [max_seqs] length after this step's append
  const int32_t* token_seq = nullptr;  // [max_tokens] batch sequence of each row (-1 = padding)
  const int32_t* token_pos = nullptr;  // [max_tokens] position of each row
  int max_seqs = 0;                    // grid capacity
  int max_tokens = 0;                  // grid capacity (rows of q / k / v / out)
  int max_q_len = 0;                   // longest q_len this call can see (host bound: 1 for decode)
  int max_kv_len = 0;                  // longest kv_len this call can see (host bound)
};

// Writes the new rows' K [T, Hkv, D] and V [T, Hkv, Dv] (row strides in elements, so they can be
// slices of a fused qkv projection) into their pages. Rows with token_seq < 0 are skipped.
struct PagedKvAppendArgs {
  PagedKv cache;
  AttentionBatch batch;
  const __nv_bfloat16* k = nullptr;
  int64_t k_stride = 0;
  const __nv_bfloat16* v = nullptr;
  int64_t v_stride = 0;
};
void launch_paged_kv_append(const PagedKvAppendArgs& args, cudaStream_t stream);

struct PagedAttentionArgs {
  PagedKv cache;
  AttentionBatch batch;
  const __nv_bfloat16* q = nullptr;  // [T, Hq, D], row stride q_stride (elements)
  int64_t q_stride = 0;
  int num_q_heads = 0;
  float scale = 0.0f;            // softmax scale (0 = D^-0.5)
  __nv_bfloat16* out = nullptr;  // [T, Hq, Dv] contiguous
  void* workspace = nullptr;     // paged_attention_workspace_bytes(...) bytes
};
size_t paged_attention_workspace_bytes(int max_tokens, int num_q_heads, int v_head_dim,
                                       int max_seqs);
void launch_paged_attention(const PagedAttentionArgs& args, cudaStream_t stream);

namespace detail {
// Argument checks shared by the attention launchers: kInvalidArgument naming `where` and the field.
void check_paged_kv(const PagedKv& cache, const char* where);
void check_attention_batch(const AttentionBatch& batch, const char* where);
}  // namespace detail

}  // namespace moelora::ops::cuda
