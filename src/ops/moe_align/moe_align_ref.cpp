#include "ops/moe_align/moe_align.h"

#include "core/error.h"

namespace moelora::ops {

MoeAlignment moe_align_ref(const std::vector<int32_t>& ids, const std::vector<int32_t>& slot,
                           int top_k, int num_experts, int num_slots, int base_expert) {
  MOELORA_CHECK(top_k > 0 && ids.size() == slot.size() * static_cast<size_t>(top_k), ErrorCode::kInvalidArgument,
                "moe_align_ref: ids has ", ids.size(), " entries, expected T * k = ", slot.size(), " * ", top_k);
  const int bins_per_expert = num_slots + 1;
  std::vector<std::vector<int32_t>> bins(static_cast<size_t>(num_experts) * bins_per_expert);
  for (size_t p = 0; p < ids.size(); ++p) {
    const int e = ids[p];
    if (e < 0) continue;
    MOELORA_CHECK(e < num_experts, ErrorCode::kOutOfRange, "moe_align_ref: expert id ", e, " of pair ", p,
                  " is outside [0, ", num_experts, ")");
    const int s = slot[p / top_k];
    MOELORA_CHECK(s >= -1 && s < num_slots, ErrorCode::kOutOfRange, "moe_align_ref: slot ", s, " of token ",
                  p / top_k, " is outside [-1, ", num_slots, ")");
    const int bin = e == base_expert ? 0 : s + 1;
    bins[static_cast<size_t>(e) * bins_per_expert + bin].push_back(static_cast<int32_t>(p));
  }
  MoeAlignment a;
  a.expert_offsets.assign(num_experts + 1, 0);
  a.pair_pos.assign(ids.size(), -1);
  for (int e = 0; e < num_experts; ++e) {
    a.expert_offsets[e] = static_cast<int32_t>(a.sorted_pair.size());
    for (int b = 0; b < bins_per_expert; ++b) {
      const auto& bin = bins[static_cast<size_t>(e) * bins_per_expert + b];
      const int32_t begin = static_cast<int32_t>(a.sorted_pair.size());
      for (int32_t p : bin) {
        a.pair_pos[p] = static_cast<int32_t>(a.sorted_pair.size());
        a.sorted_pair.push_back(p);
        a.sorted_token.push_back(p / top_k);
      }
      if (b > 0 && !bin.empty())
        a.lora_segments.push_back({b - 1, e, begin, static_cast<int32_t>(a.sorted_pair.size())});
    }
    if (static_cast<int32_t>(a.sorted_pair.size()) > a.expert_offsets[e]) a.active_experts.push_back(e);
  }
  a.expert_offsets[num_experts] = static_cast<int32_t>(a.sorted_pair.size());

  const int T = static_cast<int>(slot.size());
  a.token_pos.assign(T, -1);
  for (int s = -1; s < num_slots; ++s) {
    const int32_t begin = static_cast<int32_t>(a.token_sorted.size());
    for (int t = 0; t < T; ++t) {
      if (slot[t] != s) continue;
      a.token_pos[t] = static_cast<int32_t>(a.token_sorted.size());
      a.token_sorted.push_back(t);
    }
    const int32_t end = static_cast<int32_t>(a.token_sorted.size());
    if (s >= 0 && end > begin) a.token_segments.push_back({s, 0, begin, end});
  }
  return a;
}

}  // namespace moelora::ops
