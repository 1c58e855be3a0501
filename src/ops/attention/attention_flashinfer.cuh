// Paged causal GQA attention through FlashInfer's FA2 paged-prefill kernel (tensor cores; the
// query heads that share a KV head are packed into one query tile), on moelora's KV cache and
// batch layout (attention_cuda.cuh). Same semantics as launch_paged_attention.
//
// Why: bench/attention.cu measures both on one cache (bench/results/h200/attention.md). For
// Qwen3-30B-A3B's 32/4 heads of 128 the GQA group of 8 makes decode compute-bound on CUDA cores
// (8 query heads x 128 x 2 FMAs per KV element): moelora's split-KV decode kernel, like
// FlashInfer's own CUDA-core decode, stays at 25-45 % of the copy bandwidth, FlashInfer's
// tensor-core kernel reaches 60-93 %; at prefill it runs 220-330 TFLOP/s against moelora's 60-110.
// The engine therefore takes this path whenever it is built in and the shape is supported, and
// keeps launch_paged_attention for the rest (other head dims, builds without FlashInfer).
//
// Two halves:
//   plan()   host, once per forward, before the forward or before replaying a CUDA graph of it:
//            reads the host copy of the batch, builds FlashInfer's CSR view of the page table
//            (page list, page offsets, last-page lengths, query offsets) and its work schedule,
//            and enqueues one host-to-device copy of each on `stream`.
//   launch() enqueues the kernels of one layer (attention, and the merge of KV splits) using the
//            last plan. No allocation, no synchronization: capturable after a decode plan (a
//            general plan's launch configuration fits its own batch only; launch refuses to be
//            captured after one).
//
// Decode mode (plan with decode = true): every sequence has one query row, row b belongs to
// sequence b; sequences with q_len 0 are padding (a CUDA-graph bucket's unused entries) and are
// given one position of page 0 (rows b of q and out must exist: the bucket's padding rows), so
// their output rows receive values, as every other padding row of a forward does. All plans with the same number of sequences then
// give the same launch configuration, which is what lets a graph captured after one plan replay
// after another (FlashInfer's CUDA-graph mode with a uniform query length).
// General mode: sequences' rows must be back to back in sequence order (q_start[b] = the sum of
// the earlier q_len); sequences with q_len 0 read nothing; rows after the last sequence's are left
// untouched.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "ops/attention/attention_cuda.cuh"

namespace moelora::ops::cuda {

struct FlashInferAttentionShape {
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // = v_head_dim
  int page_size = 0;
  int max_seqs = 0;           // sequences of one forward (capacity)
  int max_tokens = 0;         // query rows of one forward (capacity)
  int max_pages_per_seq = 0;  // page-table width
  // Launch the attention kernel and the merge of KV splits as programmatic dependents of the
  // kernel before each (FlashInfer's PDL mode): a CTA reads its plan entries and sets up before
  // griddepcontrol.wait, so the launch and that set-up overlap the predecessor's tail when the
  // predecessor triggers early (the engine's qkv prologue does, at its start). Same bits either
  // way.
  bool programmatic_launch = false;
};

// Host copy of one forward's batch (the arrays of AttentionBatch, same meaning).
struct FlashInferHostBatch {
  const int32_t* q_start = nullptr;     // [seqs]
  const int32_t* q_len = nullptr;       // [seqs]
  const int32_t* kv_len = nullptr;      // [seqs]
  const int32_t* page_table = nullptr;  // [seqs, max_pages_per_seq]
  int seqs = 0;                         // sequences of this forward (a graph bucket: its size)
};

class FlashInferAttention {
 public:
  // Whether this build has FlashInfer's kernels (CMake found the headers).
  static bool compiled();
  // Shapes the built kernels serve: head_dim 64, 128 or 256 (same for V), Hq % Hkv == 0.
  static bool supports(int num_q_heads, int num_kv_heads, int head_dim);

  // Allocates the schedule workspaces, the device CSR arrays and a pinned staging buffer.
  // kUnsupported when !compiled() or !supports(...); kInvalidArgument for a bad shape.
  explicit FlashInferAttention(const FlashInferAttentionShape& shape);
  ~FlashInferAttention();
  FlashInferAttention(const FlashInferAttention&) = delete;
  FlashInferAttention& operator=(const FlashInferAttention&) = delete;

  const FlashInferAttentionShape& shape() const;

  // See the file comment. kInvalidArgument (naming the field, the sequence and the values) for a
  // batch beyond the capacities, rows that are not back to back, or a kv_len beyond the page table.
  void plan(const FlashInferHostBatch& batch, bool decode, cudaStream_t stream);

  // One layer on `args.cache` with args.q / q_stride / num_q_heads / scale / out (args.batch and
  // args.workspace are not read: the plan holds the batch). kInvalidArgument before any plan or for
  // a cache / head count other than the shape's.
  void launch(const PagedAttentionArgs& args, cudaStream_t stream) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelora::ops::cuda
