// One rank's share of a whole model, run over a Communicator: the layers of parallel_layers.h and
// parallel_attention.h stacked as the CPU model stacks them, so that a sharded forward can be
// checked against model::Model on real checkpoints and PEFT adapters.
//
// Split (n ranks, one group for TP and EP as the anchor serves Qwen3.5 TP4 / EP4):
//   embedding, norms, router: whole on every rank;
//   attention: GQA heads tensor parallel, Qwen3.5's output gate with its heads
//     (parallel_attention.h), MLA heads tensor parallel with the query and KV latents replicated
//     (parallel_mla.h), Gated DeltaNet key and value heads tensor parallel (parallel_gdn.h);
//   dense MLP layers and the shared expert: tensor parallel; routed experts: expert parallel with
//   the pair rows combined exactly (MoeCombine::kPairRows) or per-rank partial sums;
//   lm_head: vocab parallel (rows [r V / n, (r + 1) V / n)), logits all-gathered.
// Every adapter slot of the model is cut to the rank's share at construction.
//
// Supported: Qwen3-MoE (GQA), Qwen3.5-MoE (gated GQA and Gated DeltaNet layers) and DeepSeek-V3 /
// Kimi-K2 (MLA), with their MoE and dense layers.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "dist/parallel_attention.h"
#include "dist/parallel_gdn.h"
#include "dist/parallel_layers.h"
#include "dist/parallel_mla.h"
#include "dist/shard.h"
#include "model/model.h"

namespace moelora::dist {

// How the attention layers use the ranks.
//   kTensorParallel: heads split (parallel_attention.h / parallel_mla.h / parallel_gdn.h); every
//     rank works on every sequence.
//   kDataParallel: every rank holds the whole attention and its adapters and attends only its own
//     sequences (sequence i on rank i % n, as SGLang's DP attention places requests); the rows are
//     all-reduced (each has one nonzero contribution, so exactly) before the MoE / MLP, which
//     stays expert / tensor parallel over all tokens. For models whose heads are too few to split
//     over the ranks (Qwen3.5's 2 linear-attention key heads at TP4, MLA at TP8 and beyond).
enum class AttentionSplit { kTensorParallel, kDataParallel };

struct ShardedModelOptions {
  MoeCombine moe_combine = MoeCombine::kPairRows;
  SharedExpertSplit shared_expert = SharedExpertSplit::kTensorParallel;
  AttentionSplit attention = AttentionSplit::kTensorParallel;
};

// One sequence on one rank: its adapter slot and, per layer, the cache of that layer's attention
// kind (the rank's heads; under data-parallel attention the whole attention, on the sequence's
// owner rank only). Made by ShardedModel::new_sequence, advanced by ShardedModel::forward.
class ShardedSequence {
 public:
  int32_t slot() const { return slot_; }
  int owner() const { return owner_; }       // the rank that attends it under DP attention
  int64_t length() const { return length_; }  // positions so far

 private:
  friend class ShardedModel;
  struct LayerCache {
    GqaCache gqa;
    MlaCache mla;
    GdnCache gdn;
  };
  const void* model_ = nullptr;  // the ShardedModel that made it
  int32_t slot_ = -1;
  int owner_ = 0;
  int64_t length_ = 0;
  bool broken_ = false;  // a step failed part-way: the layers' caches disagree
  std::vector<LayerCache> layers_;
};

class ShardedModel {
 public:
  // Rank `shard.rank` of `shard.size`: cuts its share of `model`'s weights and of every adapter
  // slot of model.adapters(). kInvalidArgument naming the tensor (or the heads) when n does not
  // divide a split dimension.
  ShardedModel(const model::Model& model, ShardSpec shard, const ShardedModelOptions& options = {});

  ShardSpec shard() const { return shard_; }

  // Logits F32 [T, V] of every position of one sequence's prompt (positions 0 .. T-1) with
  // adapter `slot` (-1 = base), on every rank. comm must be the group the shares were cut for.
  Tensor prefill_logits(std::span<const int32_t> tokens, int32_t slot, Communicator& comm) const;

  // One batch of prompts (each from position 0, with its own adapter slot): logits F32 [T_i, V]
  // of every prompt, on every rank; the MoE and MLP layers see all the batch's tokens at once.
  std::vector<Tensor> prefill_batch_logits(const std::vector<std::vector<int32_t>>& prompts,
                                           const std::vector<int32_t>& slots,
                                           Communicator& comm) const;

  // A new sequence with adapter `slot` (-1 = base), attended on rank `owner` under data-parallel
  // attention (every rank makes it, with the same owner).
  ShardedSequence new_sequence(int32_t slot, int owner = 0) const;
  // The next tokens of each sequence (a prompt, a decode step's one token, or any mix) through
  // the model in one batch: logits F32 [T_i, V] of each, on every rank; the caches advance. Every
  // rank passes its own copies of the same sequences (made with the same owners) in the same
  // order. A sequence whose step threw part-way is refused afterwards (its layers' caches
  // disagree): start a new one.
  std::vector<Tensor> forward(const std::vector<ShardedSequence*>& sequences,
                              const std::vector<std::vector<int32_t>>& tokens,
                              Communicator& comm) const;

 private:
  struct Layer {
    Tensor input_layernorm, post_attention_layernorm;
    GqaWeights attention;                 // GQA models
    std::vector<GqaLora> attention_lora;  // per slot
    MlaWeights mla;                       // MLA models (use_mla)
    std::vector<MlaLora> mla_lora;        // per slot
    bool is_linear_attention = false;     // Qwen3.5 Gated DeltaNet layer
    GdnLayer gdn;
    std::vector<GdnLora> gdn_lora;  // per slot
    bool is_moe = false;
    MoeShard moe;
    std::vector<MoeLora> moe_lora;  // per slot
    MlpShard mlp;
    std::vector<MlpLora> mlp_lora;  // per slot
  };

  // The layer's attention share and its adapters' (constructor helpers, per attention kind), cut
  // for `heads`: this rank of the group (tensor parallel) or the whole (data parallel).
  void shard_gqa_layer(Layer& layer, const model::AttentionWeightsF32& src, int64_t l,
                       const ops::RopeTable& rope, ShardSpec heads);
  void shard_mla_layer(Layer& layer, const model::AttentionWeightsF32& src, int64_t l,
                       const ops::RopeTable& rope, const ops::RopeParams& rope_params,
                       ShardSpec heads);
  void shard_gdn_layer(Layer& layer, const model::LinearAttentionWeightsF32& src, int64_t l,
                       ShardSpec heads);
  // out [T, H] of the layer's attention on one sequence's next rows h [T, H], against its cache.
  Tensor attention(const Layer& layer, const Tensor& h, const std::vector<int32_t>& slots,
                   ShardedSequence::LayerCache& cache, Communicator& comm) const;

  const model::Model& model_;
  ShardSpec shard_;
  ShardedModelOptions options_;
  // Data-parallel attention runs the whole attention: its row-parallel reductions are over this
  // rank alone (a group of one).
  std::unique_ptr<InProcessGroup> solo_;
  ops::RmsNormParams norm_;
  std::vector<Layer> layers_;
  Tensor lm_head_;  // F32 [V / n, H]
};

}  // namespace moelora::dist
