// Grouping of the (token, expert) pairs of a MoE layer (docs/gpu_moe.md §2), CPU reference.
//
// Pairs p = t * k + j with ids[t, j] >= 0 are sorted by (expert, slot + 1) with a stable counting
// sort; base pairs (slot -1) come first inside each expert. From that one order:
//   expert_offsets [E + 1]  pairs of expert e are sorted positions [off[e], off[e + 1])
//   sorted_pair [P], sorted_token [P], pair_pos [T * k] (sorted position of pair p, -1 if none)
//   active_experts: experts with pairs, ascending
//   lora_segments: {slot, expert, begin, end} for every (slot >= 0, expert) with pairs, in order
// so the base GEMMs group by expert and the LoRA GEMMs by (slot, expert) over contiguous ranges.
// Tokens are also sorted by slot (stable) for the plain LoRA targets (shared expert, attention):
//   token_sorted [T], token_pos [T] (position of token t), token_segments {slot, 0, begin, end}
// for every slot >= 0 with tokens.
#pragma once

#include <cstdint>
#include <vector>

namespace moelora::ops {

struct LoraSegment {
  int32_t slot, expert, begin, end;
};

struct MoeAlignment {
  std::vector<int32_t> expert_offsets;  // [E + 1]
  std::vector<int32_t> sorted_pair;     // [P]
  std::vector<int32_t> sorted_token;    // [P]
  std::vector<int32_t> pair_pos;        // [T * k], -1 for pairs without an expert
  std::vector<int32_t> active_experts;  // ascending
  std::vector<LoraSegment> lora_segments;
  std::vector<int32_t> token_sorted;  // [T]
  std::vector<int32_t> token_pos;     // [T]
  std::vector<LoraSegment> token_segments;
};

// ids: [T * k] (-1 = no pair, e.g. a padding token); slot: [T] (-1 = base); num_slots: S.
// base_expert >= 0: that expert's pairs go to its base bin whatever their token's slot (the shared
// expert among the routed ones, whose LoRA runs over the token segments).
MoeAlignment moe_align_ref(const std::vector<int32_t>& ids, const std::vector<int32_t>& slot,
                           int top_k, int num_experts, int num_slots, int base_expert = -1);

}  // namespace moelora::ops
