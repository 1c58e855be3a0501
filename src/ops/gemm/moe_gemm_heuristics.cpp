#include <algorithm>

#include "ops/gemm/moe_gemm.h"

namespace moelora::ops {

DecodeGemmConfig choose_decode_gemm_config(int n, int k, int max_active_experts, int max_tokens_per_expert,
                                           int num_sms) {
  DecodeGemmConfig c;
  c.token_subtiles = max_tokens_per_expert <= 8 ? 1 : max_tokens_per_expert <= 16 ? 2 : 4;
  const int k_blocks = std::max(1, k / 128);
  const int n_tiles = (n + 15) / 16;
  const int active = std::max(1, max_active_experts);
  // Try 8, 4, 2, 1 tiles per CTA; keep the first with enough CTAs and a valid K split.
  for (int warps_n : {8, 4, 2, 1}) {
    const int warps_k = 8 / warps_n;
    if (warps_k > k_blocks) continue;
    const int64_t ctas = static_cast<int64_t>((n_tiles + warps_n - 1) / warps_n) * active;
    c.warps_n = warps_n;
    c.warps_k = warps_k;
    if (ctas >= 2LL * num_sms) return c;
  }
  // Small problems: the narrowest valid CTA maximizes parallelism.
  for (int warps_n : {1, 2, 4, 8}) {
    if (8 / warps_n <= k_blocks) {
      c.warps_n = warps_n;
      c.warps_k = 8 / warps_n;
      return c;
    }
  }
  return c;
}

bool should_use_decode_gemm(int64_t tokens, int64_t top_k, int64_t num_experts) {
  if (num_experts <= 0) return true;
  const double avg = static_cast<double>(tokens) * static_cast<double>(top_k) / static_cast<double>(num_experts);
  return avg <= 24.0;
}

}  // namespace moelora::ops
