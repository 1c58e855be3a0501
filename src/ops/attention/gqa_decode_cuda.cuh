// Paged GQA attention for decode steps (one new token per sequence) over a flat, balanced split of
// the whole batch's KV: attention.h is the oracle, attention_cuda.cuh holds the cache and batch
// layouts (same PagedAttentionArgs).
//
// Why a second decode kernel: a decode step is a pure KV stream (Qwen3-30B-A3B, 16 sequences of
// 2048 tokens: 67 MB per layer, 15.8 us at the H200's copy bandwidth). Splitting each (sequence,
// KV head) into a fixed number of chunks, as flash-decoding and FlashInfer's planner do, leaves
// 64 such pairs at 16 sequences short of work for 132 SMs or cut into more CTAs than one wave
// holds; both measured at 1.3-1.8 TB/s there (bench/results/h200/attention.md). Here the KV of
// the whole batch is one list of 64-key tiles ordered (sequence, KV head, tile), and CTA i of a
// fixed grid (the SMs times the CTAs one SM holds; fewer when U is under 4 tiles per CTA) takes
// tiles [i * U / N, (i + 1) * U / N): every CTA streams the same number of tiles through one
// multi-stage cp.async ring, across (sequence, KV head) boundaries, in a single wave.
//
// A CTA (4 warps) keeps the G <= 16 query heads of the current (sequence, KV head) as the m16
// rows of mma.sync m16n8k16 (bf16 in, fp32 accumulate); warps 0 / 1 take keys 0-31 of each tile,
// warps 2 / 3 keys 32-63, each warp of a pair half of the value dims, so the two warps of a key
// group compute the same scores and softmax state and the two key groups meet once per pair. A
// (sequence, KV head) that a CTA covers entirely is normalized and stored as bf16; one cut by a
// range boundary leaves an fp32 partial (unnormalized output, running max, sum) in the workspace,
// and the CTA that completes its tile count (a per-pair ticket, reset by that CTA) merges the
// partials in CTA order and stores the row: no second kernel, and the same bits on every run and
// graph replay.
//
// Graph-friendly: the grid depends only on the device and the head dims; counts are read on the
// device. No allocation, no synchronization. Sequences with q_len 0 (a graph bucket's padding)
// read nothing and leave their rows alone.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "ops/attention/attention_cuda.cuh"

namespace moelora::ops::cuda {

// Shapes served: D == Dv in {64, 128, 256}, Hq a multiple of Hkv with G = Hq / Hkv <= 16.
bool gqa_decode_supports(int num_q_heads, int num_kv_heads, int head_dim, int v_head_dim);

// The default grid on the current device: its SMs times the CTAs of this head dim one SM holds.
int gqa_decode_default_ctas(int head_dim);

// Workspace of launch_gqa_decode_attention: per-(sequence, KV head) tickets, then two fp32
// partial slots per CTA. num_ctas 0 = gqa_decode_default_ctas(head_dim). The tickets must be zero
// before the first launch (reset_gqa_decode_workspace); every launch leaves them at zero.
size_t gqa_decode_workspace_bytes(int max_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                  int num_ctas = 0);
void reset_gqa_decode_workspace(void* workspace, int max_seqs, int num_kv_heads,
                                cudaStream_t stream);

// One decode attention call: every sequence b with q_len[b] == 1 attends its query row q_start[b]
// to positions [0, kv_len[b]). args.batch.max_q_len must be 1. num_ctas 0 = the default grid
// (tests pass small and large grids to exercise the splits). kUnsupported for a shape outside
// gqa_decode_supports, kInvalidArgument for other bad arguments.
void launch_gqa_decode_attention(const PagedAttentionArgs& args, cudaStream_t stream,
                                 int num_ctas = 0);

}  // namespace moelora::ops::cuda
