// Grouped-query attention (Qwen3-MoE's, and Qwen3.5's full-attention layers with their output
// gate) in tensor parallelism over n ranks, on the CPU reference operators and a Communicator.
//
//   q_proj [Hq D, H] (with the output gate [Hq 2D, H], per head [q (D) | gate (D)]), k_proj /
//     v_proj [Hkv D, H]: column-parallel by heads. Rank r holds query
//     heads [r Hq / n, (r + 1) Hq / n) and the KV heads they read: Hkv / n of them when n divides
//     Hkv, else (n a multiple of Hkv, more ranks than KV heads) the one KV head of its query heads,
//     held alike by the n / Hkv ranks that share it (as vLLM replicates KV heads).
//   q_norm / k_norm (per-head RMSNorm over D), RoPE (all of D or its first rotary_dim) and the
//   output gate (out * sigmoid(gate) per head, before o_proj) act per head: no communication.
//   o_proj [H, Hq D]: row-parallel by the same query heads; one all-reduce of [T, H].
//   LoRA: q / k / v B split like their rows (A whole), o A split like its columns (B whole).
//
// A sequence's tokens in steps (a prefill, then decode steps) against a per-rank cache of its local
// KV heads; the engine's paged decode reuses the same split.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "dist/shard.h"
#include "ops/attention/attention.h"
#include "ops/norm/norm.h"
#include "ops/rope/rope.h"

namespace moelora::dist {

struct GqaWeights {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool output_gate = false;               // Qwen3.5: q_proj rows per head [q | gate]
  Tensor q_proj, k_proj, v_proj, o_proj;  // F32 [Hq D (x2), H], [Hkv D, H], [Hkv D, H], [H, Hq D]
  Tensor q_norm, k_norm;                  // F32 [D] or undefined (no per-head norm)
  ops::RmsNormParams norm;
  ops::RopeTable rope;
  ops::RopeApplyParams rope_apply;  // the model's rotation style
  float scale = 0.0f;               // softmax scale; 0 = 1 / sqrt(D)
};

// One slot's LoRA of the attention block, as owned factors (undefined = not targeted).
struct GqaLora {
  LoraFactors q, k, v, o;
};

// Rank tp.rank's share: the same struct with the local head counts and sliced projections.
GqaWeights shard_gqa(const GqaWeights& w, ShardSpec tp);
GqaLora shard_gqa_lora(const GqaLora& lora, const GqaWeights& w, ShardSpec tp);

// One sequence's attention state on this rank: K and V of its local KV heads at every position
// so far (empty until the first call).
struct GqaCache {
  std::optional<ops::KvCacheRef> kv;
  int64_t size() const { return kv ? kv->size() : 0; }
};

// out [T, H] on every rank: attention of the sequence's next T tokens x [T, H] (replicated; their
// positions follow the cache's) with per-token slots (-1 = base); their K / V join the cache. With
// a group of one rank and the whole weights it is the unsharded block.
Tensor gqa_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const GqaWeights& shard,
                      const std::vector<GqaLora>& lora, GqaCache& cache, Communicator& comm);
// A sequence's first T tokens (positions 0 .. T-1) from an empty cache.
Tensor gqa_prefill_tp(const Tensor& x, const std::vector<int32_t>& slot, const GqaWeights& shard,
                      const std::vector<GqaLora>& lora, Communicator& comm);

}  // namespace moelora::dist
