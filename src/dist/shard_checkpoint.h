// A rank's share of a loaded checkpoint and of a PEFT adapter, for a tensor- / expert-parallel
// GPU model: the same split as dist::ShardedModel (sharded_model.h; the rules of shard.h), cut
// from io::ModelWeights as the checkpoint stores them, so that one GPU rank uploads its share with
// the ordinary GpuModel::load and a DeviceCollectives group sums the partial outputs.
//
// Split over n ranks (one group for TP and EP, as the anchor serves Qwen3.5 TP4 / EP4):
//   embedding and lm_head: vocabulary rows [r V / n, (r + 1) V / n) when n divides V (the GPU
//     model looks up its rows and sums the embedding over the ranks, and gathers the logits),
//     else whole (vocab_shard, core/device_collectives.h);
//   norms, router (and its correction bias), MLA's query and KV latent projections (q_a_proj,
//   kv_a_proj_with_mqa): whole on every rank;
//   GQA attention: query heads [r Hq / n, (r + 1) Hq / n) with their q_proj rows (Qwen3.5's
//     [q | gate] per head) and KV heads [r Hkv / n, ...), or the one KV head the rank's query
//     heads read when n > Hkv (held alike by n / Hkv ranks); o_proj's columns of the query heads;
//   MLA: q_b_proj (or q_proj) and kv_b_proj rows of the rank's heads, o_proj's columns;
//   Gated DeltaNet: key and value heads, in_proj_qkv's and the conv's [q | k | v] channels of
//     them, z / b / a rows, A_log, dt_bias by value heads, out_proj's columns; the norm whole;
//   dense MLP and shared expert: gate / up rows, down columns ([r I / n, (r + 1) I / n));
//   routed experts: experts [r E / n, (r + 1) E / n) as they are (FP8, NVFP4 or bf16).
// Dense projections that are split come out dequantized (F32, as GpuModel::load rounds every dense
// weight to bf16 anyway, so a rank uploads the bits of the whole model's rows); whole ones and the
// experts keep their format. Unsplit tensors share storage with the source, which must outlive
// the share (a GPU rank uploads it and drops both).
//
// The rank's config (rank_config) has the local counts: num_attention_heads, num_key_value_heads,
// linear_num_key_heads / linear_num_value_heads, intermediate_size and
// shared_expert_intermediate_size divided among the ranks; num_experts stays E (the router scores
// all experts); the rank's experts are expert_range's. Every split must be even: an error names
// the tensor or the heads and both numbers otherwise.
#pragma once

#include "dist/shard.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/peft.h"

namespace moelora::dist {

io::ModelConfig rank_config(const io::ModelConfig& config, ShardSpec tp);

// The routed experts rank ep.rank holds: [r E / n, (r + 1) E / n).
ShardRange expert_range(const io::ModelConfig& config, ShardSpec ep);

io::ModelWeights shard_checkpoint(const io::ModelWeights& weights, ShardSpec tp);

// The adapter's share for rank tp.rank of a model of `config` (the whole model's): LoRA B of a
// split projection cut like its rows, A of a row-parallel one (o_proj, out_proj, down) like its
// columns, per-expert factors by experts (shared-outer ones whole), everything else whole.
io::LoraAdapter shard_adapter(const io::LoraAdapter& adapter, const io::ModelConfig& config,
                              ShardSpec tp);

}  // namespace moelora::dist
