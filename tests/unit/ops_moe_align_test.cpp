// The CPU pair grouping (ops/moe_align/moe_align.h) on a hand-made batch: expert offsets, the
// (expert, slot) order with base pairs first, LoRA segments, tokens by slot, and a base expert
// (the shared expert among the routed ones) whose pairs stay in its base bin whatever their
// token's slot.
#include <gtest/gtest.h>

#include <vector>

#include "ops/moe_align/moe_align.h"

namespace moelora::ops {
namespace {

// 3 tokens, k = 2 over experts 0..2; token 1 base, tokens 0 and 2 in slots 1 and 0.
const std::vector<int32_t> kIds = {2, 0, 0, 1, 2, -1};
const std::vector<int32_t> kSlot = {1, -1, 0};

TEST(OpsMoeAlign, GroupsPairsByExpertThenSlot) {
  const MoeAlignment a = moe_align_ref(kIds, kSlot, 2, 3, 2);
  EXPECT_EQ(a.expert_offsets, (std::vector<int32_t>{0, 2, 3, 5}));
  // expert 0: pair 2 (base), pair 1 (slot 1); expert 1: pair 3 (base); expert 2: pair 4 (slot 0),
  // pair 0 (slot 1)
  EXPECT_EQ(a.sorted_pair, (std::vector<int32_t>{2, 1, 3, 4, 0}));
  EXPECT_EQ(a.sorted_token, (std::vector<int32_t>{1, 0, 1, 2, 0}));
  EXPECT_EQ(a.pair_pos, (std::vector<int32_t>{4, 1, 0, 2, 3, -1}));
  EXPECT_EQ(a.active_experts, (std::vector<int32_t>{0, 1, 2}));
  ASSERT_EQ(a.lora_segments.size(), 3u);
  EXPECT_EQ(a.lora_segments[0].slot, 1);
  EXPECT_EQ(a.lora_segments[0].expert, 0);
  EXPECT_EQ(a.lora_segments[1].slot, 0);
  EXPECT_EQ(a.lora_segments[1].expert, 2);
  EXPECT_EQ(a.lora_segments[2].slot, 1);
  EXPECT_EQ(a.lora_segments[2].expert, 2);
  EXPECT_EQ(a.token_sorted, (std::vector<int32_t>{1, 2, 0}));
  EXPECT_EQ(a.token_pos, (std::vector<int32_t>{2, 0, 1}));
  ASSERT_EQ(a.token_segments.size(), 2u);
}

// The shared expert as expert 3, pair k = 2 of every token (k + 1 = 3 ids per token): its three
// pairs fill expert 3's base bin and form no LoRA segment, although tokens 0 and 2 have slots.
TEST(OpsMoeAlign, BaseExpertPairsStayInTheBaseBin) {
  const std::vector<int32_t> ids = {2, 0, 3, 0, 1, 3, 2, -1, 3};
  const MoeAlignment a = moe_align_ref(ids, kSlot, 3, 4, 2, /*base_expert=*/3);
  EXPECT_EQ(a.expert_offsets, (std::vector<int32_t>{0, 2, 3, 5, 8}));
  EXPECT_EQ(std::vector<int32_t>(a.sorted_pair.begin() + 5, a.sorted_pair.end()),
            (std::vector<int32_t>{2, 5, 8}));  // token order inside the one bin
  ASSERT_EQ(a.lora_segments.size(), 3u);
  for (const LoraSegment& s : a.lora_segments) EXPECT_NE(s.expert, 3);
  // without the option the same ids put tokens 0 and 2's shared pairs into slot segments
  const MoeAlignment plain = moe_align_ref(ids, kSlot, 3, 4, 2);
  EXPECT_EQ(plain.lora_segments.size(), 5u);
}

}  // namespace
}  // namespace moelora::ops
