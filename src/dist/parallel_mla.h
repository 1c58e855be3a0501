// Multi-head latent attention (DeepSeek-V3 / Kimi-K2, ops/mla/mla.h) in tensor parallelism over n
// ranks, on the CPU reference operators and a Communicator.
//
//   Replicated on every rank (they feed every head): q_a_proj [q_rank, H] and q_a_layernorm,
//     kv_a_proj_with_mqa [r + rope, H] and kv_a_layernorm; each rank computes the same latents.
//   Column-parallel by heads: q_b_proj [n (nope + rope), q_rank] (or q_proj [n (nope + rope), H]
//     without a query latent) and kv_b_proj [n (nope + dv), r]; rank r holds heads
//     [r n / N, (r + 1) n / N) and their rows. RoPE of q_rope and of the one shared k_rope needs
//     no communication.
//   Row-parallel: o_proj [H, n dv] by the same heads; one all-reduce of [T, H].
//   LoRA: on a replicated projection whole on every rank (A and B); on q_b / q_proj / kv_b B split
//     like its rows (A whole); on o_proj A split like its columns (B whole), its partial sums
//     reduced with the base output's.
//
// As SGLang and vLLM split it for Kimi-K2.5 at TP8 (64 heads, 8 a rank). A sequence's tokens in
// steps (a prefill, then decode steps) against a per-rank cache of its local heads.
#pragma once

#include <cstdint>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "dist/shard.h"
#include "ops/mla/mla.h"
#include "ops/norm/norm.h"
#include "ops/rope/rope.h"

namespace moelora::dist {

struct MlaWeights {
  ops::MlaDims dims;        // num_heads = the heads this struct holds (all, or a rank's share)
  int64_t q_lora_rank = 0;  // 0: q_proj instead of q_a_proj / q_a_layernorm / q_b_proj
  Tensor q_a_proj, q_a_layernorm, q_b_proj;  // F32 [q_rank, H], [q_rank], [n (nope + rope), q_rank]
  Tensor q_proj;                             // F32 [n (nope + rope), H] when q_lora_rank == 0
  Tensor kv_a_proj_with_mqa, kv_a_layernorm;  // F32 [r + rope, H], [r]
  Tensor kv_b_proj;                           // F32 [n (nope + dv), r]
  Tensor o_proj;                              // F32 [H, n dv]
  ops::RmsNormParams norm;
  ops::RopeTable rope;
  RopeStyle rope_style = RopeStyle::kInterleaved;  // Kimi and DeepSeek-V3: rope_interleave
  float scale = 0.0f;  // softmax scale; 0 = qk_head_dim^-0.5
};

// One slot's LoRA of the MLA block, as owned factors (undefined = not targeted).
struct MlaLora {
  LoraFactors q_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj;
};

// Rank tp.rank's share: the same struct with the local head count and sliced projections. The
// heads must divide evenly (an error names the heads and the ranks otherwise).
MlaWeights shard_mla(const MlaWeights& w, ShardSpec tp);
MlaLora shard_mla_lora(const MlaLora& lora, const MlaWeights& w, ShardSpec tp);

// One sequence's MLA state on this rank, per position so far: k_nope [S, h, nope] and v [S, h, dv]
// of the local heads, and the rotated shared k_rope [S, rope] (as the CPU model caches them).
struct MlaCache {
  std::vector<float> k_nope, k_rope, v;
  int64_t size = 0;
};

// out [T, H] on every rank: MLA of the sequence's next T tokens x [T, H] (replicated; positions
// follow the cache's) with per-token slots (-1 = base); their keys and values join the cache.
// With a group of one rank and the whole weights it is the unsharded block.
Tensor mla_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const MlaWeights& shard,
                      const std::vector<MlaLora>& lora, MlaCache& cache, Communicator& comm);
// A sequence's first T tokens (positions 0 .. T-1) from an empty cache.
Tensor mla_prefill_tp(const Tensor& x, const std::vector<int32_t>& slot, const MlaWeights& shard,
                      const std::vector<MlaLora>& lora, Communicator& comm);

}  // namespace moelora::dist
