// The GQA attention input stage on the GPU in one kernel (qkv_prologue.h is the oracle): per-head
// RMSNorm of q and k, RoPE, and the append of k and v to the paged KV cache, over the rows of a
// fused qkv projection. It replaces four or five launches per layer (two head norms, two RoPE
// launches, the append) that each cost ~2.5 us at decode sizes (13.5 us per Qwen3-30B-A3B layer
// at 16 tokens on the H200, 4.8 us for this kernel), with their arithmetic expression for
// expression (fp32, the same two bf16 roundings).
//
// One warp per (row, head), four heads per CTA (grid y = batch.max_tokens rows): the warp
// normalizes its head into shared memory (rounded to bf16), rotates the pairs there, then writes
// the head back to qkv and, for k, to the cache; the first CTA of a row copies its v heads. Rows at
// or past *num_tokens are left alone; rows whose sequence, position or page is invalid are
// processed but not appended (paged_kv_append's rule). No allocation, no synchronization;
// graph-capturable.
//
// With `delta` (the projection's LoRA delta, written by an expand on the side stream while the
// base GEMM ran), each row whose delta_slot >= 0 first becomes bf16(qkv + delta) over its whole
// width: q and k before their norms, v before the append, and the columns the kernel does not
// otherwise touch (Qwen3.5's gate block) in place. The rounding is add_rows' (and the kAdd
// expand's), so the outputs are those of adding the delta into qkv first, without that launch
// on the critical path.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/model_enums.h"
#include "ops/attention/attention_cuda.cuh"

namespace moelora::ops::cuda {

struct QkvPrologueArgs {
  __nv_bfloat16* qkv = nullptr;  // [tokens, row_stride]: q at 0, k at k_offset, v at v_offset
  int64_t row_stride = 0;        // elements between rows
  const int32_t* num_tokens = nullptr;  // [1] valid rows (device); rows past it are untouched
  int q_heads = 0;
  int64_t k_offset = 0;
  int64_t v_offset = 0;
  // Per-head RMSNorm weights [head_dim] of q and k; both null = no norm.
  const __nv_bfloat16* q_norm = nullptr;
  const __nv_bfloat16* k_norm = nullptr;
  float eps = 1e-6f;
  NormStyle norm_style = NormStyle::kWeight;
  // RoPE on dims [0, rotary_dim) of every q and k head at batch.token_pos[row].
  int rotary_dim = 0;               // even, <= head_dim
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  float attention_factor = 1.0f;
  RopeStyle rope_style = RopeStyle::kRotateHalf;
  // The cache (kv heads, head_dim = v_head_dim <= 256) and the batch (token_seq, token_pos,
  // page_table, max_tokens = the grid).
  PagedKv cache;
  AttentionBatch batch;
  // Optional LoRA delta [tokens, row_stride] bf16 and the rows' adapter slots [tokens] (rows
  // with slot < 0 have no delta); both or neither.
  const __nv_bfloat16* delta = nullptr;
  const int32_t* delta_slot = nullptr;
};

void launch_qkv_prologue(const QkvPrologueArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
