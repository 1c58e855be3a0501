// Gated DeltaNet (Qwen3.5's linear-attention layers, ops/gdn/gdn.h) in tensor parallelism over n
// ranks, on the CPU reference operators and a Communicator.
//
//   Split by heads: rank r holds key heads [r nk / n, (r + 1) nk / n) and value heads
//   [r nv / n, (r + 1) nv / n); value head h reads key head h / (nv / nk) on the rank that holds
//   it, so the rule, its state and the gated RMSNorm run on local heads only.
//     in_proj_qkv [conv_dim, H], rows [q (nk dk) | k (nk dk) | v (nv dv)]: the rank's rows of each
//       of the three blocks, concatenated (the same [q | k | v] layout at the local sizes), and
//       the conv1d channels alike;
//     in_proj_z [nv dv, H], in_proj_b / in_proj_a [nv, H], A_log / dt_bias [nv]: by value heads;
//     norm [dv]: whole;
//     out_proj [H, nv dv]: row-parallel by value heads; one all-reduce of [T, H].
//   LoRA: B of in_proj_qkv / z / b / a split like their rows (A whole), A of out_proj split like
//   its columns (B whole).
//
// A sequence's tokens in steps (a prefill, then decode steps); each rank's conv and recurrent
// state hold its heads only, so no step communicates inside the layer but out_proj's all-reduce.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "dist/shard.h"
#include "ops/gdn/gdn.h"

namespace moelora::dist {

// A layer's weights and the sizes they have (the whole layer, or a rank's share).
struct GdnLayer {
  ops::GdnShape shape;
  ops::GdnWeights weights;  // every tensor defined; conv1d [conv_dim, K]
};

// One slot's LoRA of the layer, as owned factors (undefined = not targeted).
struct GdnLora {
  LoraFactors in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj;
};

// Rank tp.rank's share; the key and value heads must both divide evenly (an error names them).
GdnLayer shard_gdn(const GdnLayer& layer, ShardSpec tp);
GdnLora shard_gdn_lora(const GdnLora& lora, const GdnLayer& layer, ShardSpec tp);

// One sequence's state on this rank: the conv and recurrent state of the local heads (zeros
// until the first call).
struct GdnCache {
  std::optional<ops::GdnState> state;
};

// out [T, H] on every rank: the layer over the sequence's next T tokens x [T, H] (replicated),
// chunked for more than one token and recurrent for one, as the CPU model; the state advances.
// With a group of one rank and the whole layer it is the unsharded layer.
Tensor gdn_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const GdnLayer& shard,
                      const std::vector<GdnLora>& lora, GdnCache& cache, Communicator& comm);
// A sequence's first T tokens from a zero state.
Tensor gdn_prefill_tp(const Tensor& x, const std::vector<int32_t>& slot, const GdnLayer& shard,
                      const std::vector<GdnLora>& lora, Communicator& comm);

}  // namespace moelora::dist
