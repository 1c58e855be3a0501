// Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) between its projections on the GPU;
// gdn.h's gdn_mix_ref is the oracle. One call runs a batch of sequences, each with any number of
// new tokens (decode steps: one each; prefill chunks: many; both may share a batch), each owning a
// state slot:
//
//   per sequence b, slot s = slots[b], rows [cu_seqlens[b], cu_seqlens[b + 1]) of the inputs:
//     conv:  u = [conv_state[s] ; qkv rows], y = silu(depthwise causal conv(u)), conv_state[s] =
//            the last K - 1 rows of u;
//     q, k:  L2-normalised per key head (eps 1e-6), q scaled by 1 / sqrt(dk); value head h reads
//            key head h / (nv / nk);
//     gates: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias);
//     rule:  per token, S = recurrent_state[s, h] (fp32 [dk, dv]):
//            S = exp(g) S; delta = beta (v - S^T k); S += k delta^T; o = S^T q;
//     out:   y = w * o / sqrt(mean(o^2) + eps) * silu(z) per value head, bf16, ready for out_proj.
//
// Two kernels (gdn_cuda.cu), and a third for long sequences: a conv kernel writes the normalised q,
// k, the v and the gates of every row to the workspace in fp32; a recurrent rule kernel, one CTA
// at a time per (sequence, value head), keeps S in registers over the sequence's tokens (read and
// written once per call) and writes y; sequences of chunked_min_tokens tokens or more instead go to
// the chunked rule kernel (gdn_chunk_cuda.cu), which runs the rule over 64-token chunks as matrix
// products on the tensor cores (TF32, fp32 accumulation) with S in shared memory. The new conv
// state is written by the conv kernel for one-row sequences and by the rule kernels for longer
// ones. The recurrent rule kernel is a programmatic dependent of the conv kernel: it starts copying
// S in before waiting for it; the chunked one follows it the same way. With the recurrent kernel a
// sequence fed in several calls gives bitwise the outputs and states of one call (the per-token
// arithmetic does not depend on the split); the chunked kernel's results depend on where its
// chunks start, within its TF32 bounds (tests/gpu/gdn_rig.cuh).
//
// States: conv_state is bf16 because it only ever holds copies of bf16 conv inputs (the in_proj_qkv
// output rows), so bf16 is exact and half the bytes of fp32; the recurrent state is fp32 (it
// accumulates over the whole sequence).
//
// Graph-friendly: grids are sized by capacity (max_seqs, max_tokens); token offsets and slots are
// device arrays, so a decode step of any batch is one replay. A sequence with slot < 0 (or >=
// num_slots) or no tokens is skipped: its output rows and every state it would touch stay as they
// are, and so do the slots of sequences not in the batch. Two sequences of one call must not share
// a slot. Nothing allocates or synchronizes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "ops/gdn/gdn.h"

namespace moelora::ops::cuda {

// The chunked rule's chunk length (tokens) and the sequence length from which the model uses it.
// Measured on an H200 at Qwen3.5's shape, one prefill call of 2048 tokens (Sm90_Gdn.
// PrefillQwen35Shape), chunked against recurrent: 2.08x as 1 x 2048 prompts, 2.11x as 4 x 512,
// 1.20x as 16 x 128, 1.16x as 32 x 64, 0.87x as 64 x 32; so from one whole chunk on.
inline constexpr int kGdnChunkTokens = 64;
inline constexpr int kGdnChunkedMinTokens = 64;

// Widest causal conv the kernels take (Qwen3.5 / Qwen3-Next use K = 4); the narrowest is 2.
inline constexpr int kGdnMaxConvKernel = 4;

// LoRA deltas of the mix's four inputs, added as they are read: the model's expand writes them on
// the side stream while the projection GEMM runs (instead of adding them in place after it, on the
// critical path). Rows [max_tokens, stride] bf16 with the inputs' columns (qkv .. a point into
// them); a row counts only where row_slot[row] >= 0, since the expand writes no delta for a
// base-model row. Each input is then read as bf16(input + delta), what the in-place add leaves.
struct GdnInputDelta {
  const __nv_bfloat16* qkv = nullptr;  // [max_tokens, conv_dim] at stride; nullptr = no deltas
  const __nv_bfloat16* z = nullptr;    // [max_tokens, value_dim]
  const __nv_bfloat16* b = nullptr;    // [max_tokens, nv]
  const __nv_bfloat16* a = nullptr;    // [max_tokens, nv]
  int64_t stride = 0;                  // elements between rows, >= conv_dim
  const int32_t* row_slot = nullptr;   // [max_tokens] adapter slot of each row, < 0 = none
};

struct GdnMixArgs {
  // nk, nv (a multiple of nk), dk and dv in {64, 128}, K in [2, kGdnMaxConvKernel], norm_eps;
  // shape.hidden is not used. conv_dim = 2 nk dk + nv dv, value_dim = nv dv.
  GdnShape shape;

  // Batch. Rows [cu_seqlens[b], cu_seqlens[b + 1]) of qkv / z / b / a / out are sequence b's new
  // tokens, in order; cu_seqlens is non-decreasing with cu_seqlens[max_seqs] <= max_tokens.
  const int32_t* cu_seqlens = nullptr;  // [max_seqs + 1] token offsets (device)
  const int32_t* slots = nullptr;       // [max_seqs] state slot per sequence, < 0 = skip (device)
  int max_seqs = 0;                     // grid capacity (sequences)
  int max_tokens = 0;                   // grid capacity (rows)

  // Inputs, bf16 rows with strides in elements (so they may be column slices of one projection).
  const __nv_bfloat16* qkv = nullptr;  // [max_tokens, conv_dim] in_proj_qkv output [q | k | v]
  int64_t qkv_stride = 0;              // >= conv_dim
  const __nv_bfloat16* z = nullptr;    // [max_tokens, value_dim] in_proj_z output
  int64_t z_stride = 0;                // >= value_dim
  const __nv_bfloat16* b = nullptr;    // [max_tokens, nv] in_proj_b output
  int64_t b_stride = 0;                // >= nv
  const __nv_bfloat16* a = nullptr;    // [max_tokens, nv] in_proj_a output
  int64_t a_stride = 0;                // >= nv
  // Their LoRA deltas (see GdnInputDelta); not with chunked_min_tokens > 0 (decode-sized calls).
  GdnInputDelta delta;

  // Weights of the layer.
  const __nv_bfloat16* conv_weight = nullptr;  // [conv_dim, K] (conv1d.weight [conv_dim, 1, K])
  const float* a_log = nullptr;                // [nv] A_log
  const float* dt_bias = nullptr;              // [nv]
  const float* norm_weight = nullptr;          // [dv] the gated RMSNorm's weight (plain w)

  // Per-slot states, updated in place for the batch's slots only.
  __nv_bfloat16* conv_state = nullptr;  // [num_slots, conv_dim, K - 1], oldest input first
  float* recurrent_state = nullptr;     // [num_slots, nv, dk, dv], 16-byte aligned
  int num_slots = 0;

  // Output: the gated-norm rows, bf16.
  __nv_bfloat16* out = nullptr;  // [max_tokens, value_dim], 8-byte aligned
  int64_t out_stride = 0;        // >= value_dim, multiple of 4

  void* workspace = nullptr;   // gdn_mix_workspace_bytes(shape, max_tokens) bytes, 256-aligned
  size_t workspace_bytes = 0;  // its size (checked)

  // The device's SM count (DeviceInfo::num_sms): the rule kernel then runs two CTAs per SM that
  // loop over the (sequence, value head) items, each streaming the next item's state in while it
  // works on the current one. 0: one CTA per item.
  int num_sms = 0;

  // Prefill: sequences with at least this many tokens in the call run the gated delta rule in its
  // chunked form (kGdnChunkTokens-token chunks on the tensor cores, see the file comment), the
  // others token by token. 0: every sequence token by token (what decode steps pass: the chunked
  // kernel is then not launched at all). kGdnChunkedMinTokens is the default the model uses.
  int chunked_min_tokens = 0;

  // Launch the conv kernel with programmatic stream serialization: it waits for the previous
  // kernel in the stream (griddepcontrol.wait) before reading anything. (The rule kernel is always
  // a programmatic dependent of the conv kernel.)
  bool pdl = false;
};

// fp32 scratch of one call: q, k [max_tokens, nk dk], v [max_tokens, nv dv], beta, g
// [max_tokens, nv] and q.k [max_tokens, nk].
size_t gdn_mix_workspace_bytes(const GdnShape& shape, int max_tokens);

// Whether launch_gdn_mix takes these arguments; the error names the argument, the value and what
// is supported. Host-only checks (no device access).
Status can_implement_gdn_mix(const GdnMixArgs& args);

// Runs the layer's mix for the batch on `stream` (see the file comment). Throws moelora::Error
// (kInvalidArgument / kUnsupported) with can_implement_gdn_mix's message if it does not apply.
// Also raises the rule kernel's dynamic shared-memory limit (a function attribute, not a stream
// operation: capturable).
void launch_gdn_mix(const GdnMixArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
