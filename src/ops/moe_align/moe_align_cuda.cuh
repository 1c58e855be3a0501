// Pair grouping on the GPU (one launch, one CTA): the device version of ops/moe_align/moe_align.h.
// Bins are (expert, slot + 1). Up to 128 pairs (decode) the pairs are ranked by (bin, pair), the
// reference's order; past that they are counted into the bins with shared-memory atomics, so the
// order of pairs inside one bin may differ from run to run. Every pair's own result is independent
// of its position (GEMM rows and LoRA rows never mix), so layer outputs stay bitwise deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moelora::ops::cuda {

struct MoeAlignDeviceArgs {
  const int32_t* topk_ids = nullptr;  // [T * k], -1 = no pair
  const int32_t* slot = nullptr;      // [T] adapter slot per token (-1 = base); nullptr = all base
  int max_tokens = 0;                 // T
  int top_k = 0;
  int num_experts = 0;  // E
  // Expert parallelism: topk_ids are ids among all the router's experts and this launch aligns
  // experts [expert_begin, expert_begin + E) as 0 .. E-1; pairs routed to any other expert are
  // dropped like pairs without one (pair_pos -1): another rank computes them. 0 otherwise.
  int expert_begin = 0;
  // The shared expert as one more local expert (MoeLayerConfig::shared_in_experts): >= 0 gives
  // every valid token (t < num_tokens) a pair k for this expert after its k routed ones, always in
  // the expert's base bin whatever the token's slot (the shared expert's LoRA runs over the token
  // segments, not the (slot, expert) ones). Pair indices then run over T * (k + 1) (sorted_pair,
  // pair_pos) and num_experts counts this expert. -1: routed pairs only.
  int shared_expert = -1;
  int num_slots = 0;    // S
  int32_t* expert_offsets = nullptr;  // [E + 1]
  // [T * kp] each, kp = k (+ 1 with a shared expert)
  int32_t* sorted_pair = nullptr;
  int32_t* sorted_token = nullptr;
  int32_t* pair_pos = nullptr;
  // [T * kp] {slot, expert} of each sorted position, or nullptr: lets the kernels that fuse the
  // LoRA shrink find their row's adapter factors with one load.
  int2* sorted_slot_expert = nullptr;
  int32_t* active_experts = nullptr;  // [E], ascending, -1 past *num_active
  int32_t* num_active = nullptr;      // [1]
  int4* lora_segments = nullptr;      // [max_lora_segments] {slot, expert, begin, end}; may be nullptr if S == 0
  int32_t* num_lora_segments = nullptr;  // [1]
  int max_lora_segments = 0;          // capacity: min(T * k, S * E)
  // Tokens sorted by slot (plain LoRA targets); all may be nullptr when S == 0.
  const int32_t* num_tokens = nullptr;  // [1] valid tokens; tokens past it get token_pos -1
  int32_t* token_sorted = nullptr;      // [T]
  int32_t* token_pos = nullptr;         // [T]
  int4* token_segments = nullptr;       // [S] {slot, 0, begin, end}
  int32_t* num_token_segments = nullptr;  // [1]
  // With shared_expert >= 0 and token_sorted: [T] the sorted position of the shared-expert pair of
  // the token at token_sorted[i] (the gather of the shared expert's down LoRA shrink), or nullptr.
  int32_t* token_shared_row = nullptr;
  // Launch with programmatic stream serialization after the router kernel: the launch overlaps the
  // router's tail; the kernel waits for it (griddepcontrol.wait) before reading topk_ids.
  bool pdl = false;
};

// Shared memory the launch needs (3 int32 per bin, bins = E * (S + 1), plus 2 per slot); at most
// 200 KB.
size_t moe_align_smem_bytes(int num_experts, int num_slots);
// Forwards of up to this many (token, expert) pairs (max_tokens x (top_k + 1 with a shared
// expert)) take the ranked form: one CTA of this many threads (a multiple of 32) that sorts the
// pairs by rank instead of counting them into bins: 16 tokens at k = 8, 14 with the shared expert
// among the pairs. 160 would let Qwen3.5's engine layers at 16 sequences (144 pairs) rank too;
// that build is not measured yet (docs/gpu_moe.md §6.0p).
constexpr int kMoeAlignRankedMaxPairs = 128;
void launch_moe_align(const MoeAlignDeviceArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
