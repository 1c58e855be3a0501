// Layers split over ranks, on the CPU reference operators and a Communicator: the arithmetic that
// the multi-GPU engine runs with NCCL, here checkable against the unsharded layers with ranks as
// threads (dist/communicator.h).
//
// Dense SwiGLU MLP (and the MoE shared expert), tensor parallel over n ranks:
//   gate / up column-parallel (rows [r I / n, (r + 1) I / n)), down row-parallel (the same
//   columns); rank r computes the full MLP on its I / n intermediate channels with its LoRA shares
//   (B of gate / up split, A of down split; shard.h), which gives a partial sum of the output; one
//   all-reduce adds the partial sums of the base and of the deltas together.
//
// MoE routed experts, expert parallel over n ranks, activations replicated (every rank holds
// x [T, H] of all tokens, as after tensor-parallel attention):
//   every rank routes all tokens with the whole router (the same result everywhere), runs the
//   pairs of its E / n experts (moe_expert_outputs_ref: zero rows for the other pairs), then
//   MoeCombine::kPairRows     all-reduce the pair rows y [T * k, H] (each row has one nonzero
//                             contribution, so the sum is exact) and combine them on every rank
//                             in moe_forward_ref's order: bit-identical to the unsharded layer;
//                             moves k times the bytes of
//   MoeCombine::kPartialSums  combine the local pairs into out_r [T, H] and all-reduce those:
//                             what a GPU implementation does at decode sizes (T H floats per rank);
//                             equal to the unsharded layer up to float reassociation.
//   The shared expert is either replicated (every rank runs all of it; added once) or tensor
//   parallel as the dense MLP above (its sigmoid gate scales each partial sum).
#pragma once

#include <cstdint>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "dist/shard.h"
#include "ops/moe/moe.h"

namespace moelora::dist {

// ---------------------------------------------------------------------------- dense MLP, TP

// One rank's share of an MLP: w_gate / w_up [I / n, H], w_down [H, I / n].
struct MlpShard {
  Tensor w_gate, w_up, w_down;
};
// One slot's LoRA of an MLP, as owned factors (undefined = not targeted).
struct MlpLora {
  LoraFactors gate, up, down;
  ops::MlpLoraRef ref() const;
};

MlpShard shard_mlp(const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down, ShardSpec tp);
MlpLora shard_mlp_lora(const ops::MlpLoraRef& lora, ShardSpec tp);

// out [T, H] on every rank: the MLP of x [T, H] (replicated) with per-token slots (-1 = base).
// `comm` is the tensor-parallel group; its size and rank must be those the shards were cut for.
Tensor mlp_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const MlpShard& shard,
                      const std::vector<MlpLora>& lora, Communicator& comm);

// ---------------------------------------------------------------------------- MoE, EP

// kDispatch: moe_forward_dispatch, each rank with only its own tokens (data-parallel attention).
enum class MoeCombine { kPairRows, kPartialSums, kDispatch };
enum class SharedExpertSplit { kReplicated, kTensorParallel };

// One rank's share of an MoE layer. params keep the whole layer's E (routing covers all experts).
struct MoeShard {
  ops::MoeParams params;
  SharedExpertSplit shared_split = SharedExpertSplit::kReplicated;
  int64_t expert_offset = 0;  // the first local expert
  Tensor router;              // F32 [E, H], whole
  Tensor correction_bias;     // F32 [E] or undefined, whole
  Tensor w13;                 // F32 [E / n, 2I, H]
  Tensor w2;                  // F32 [E / n, H, I]
  MlpShard shared;            // the shared expert (undefined tensors when the layer has none)
  Tensor shared_gate;         // F32 [1, H] or undefined, whole
};
// One slot's LoRA of an MoE layer, as owned factors.
struct MoeLora {
  LoraFactors gate_up, down;
  MlpLora shared;
  ops::MoeLoraRef ref() const;
};

// The experts of rank ep.rank of ep.size; the shared expert whole (kReplicated) or split over
// the same ranks (kTensorParallel).
MoeShard shard_moe(const ops::MoeWeightsRef& layer, const ops::MoeParams& params, ShardSpec ep,
                   SharedExpertSplit shared_split);
MoeLora shard_moe_lora(const ops::MoeLoraRef& lora, const ops::MoeParams& params, ShardSpec ep,
                       SharedExpertSplit shared_split);

// out [T, H] on every rank: the layer of x [T, H] (replicated) with per-token slots.
Tensor moe_forward_ep(const Tensor& x, const std::vector<int32_t>& slot, const MoeShard& shard,
                      const std::vector<MoeLora>& lora, MoeCombine combine, Communicator& comm);

// MoE expert parallel with token dispatch, for data-parallel attention (each rank holds only its
// own tokens, as DeepEP's dispatch / combine serve SGLang's DP attention):
//   x [T_r, H] and slot (T_r) are this rank's tokens (T_r may differ per rank, 0 included);
//   1. route them with the whole router;
//   2. send each pair (t, j) to the rank holding expert ids[t, j]: an all_to_all_v of the pair
//      counts, then one of the pair rows [x_t | expert | slot] (H + 2 floats; expert ids and slots
//      are exact in a float);
//   3. each rank runs its experts on the pairs it received (moe_expert_outputs_ref, a pair a
//      row);
//   4. the outputs travel back the same way (all_to_all_v of H floats per pair) into the token's
//      pair row t * k + j;
//   5. each rank combines its own tokens in moe_forward_ref's order and adds the shared expert,
//      which must be replicated (kInvalidArgument otherwise: a split one needs every token).
// out [T_r, H] of this rank's tokens only: the unsharded layer's rows of those tokens bit for bit
// (each pair's expert output is the same arithmetic, and the combine runs in the same order).
Tensor moe_forward_dispatch(const Tensor& x, const std::vector<int32_t>& slot,
                            const MoeShard& shard, const std::vector<MoeLora>& lora,
                            Communicator& comm);

}  // namespace moelora::dist
