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
// Every adapter slot of the model is cut to the rank's share at construction, and one slot again
// by refresh_slot after the model's AdapterSet changed it (a serving executor loading and evicting
// adapters). The cuts are owned copies: nothing here points into the AdapterSet.
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
  // Bytes this rank holds for the sequence: the attention caches (its heads' K / V, MLA's
  // latents) and the Gated DeltaNet states (conv + recurrent), fp32 as the CPU model keeps them.
  uint64_t kv_bytes() const;
  uint64_t state_bytes() const;

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
  // What one sequence holds on each rank that attends it (every rank under tensor-parallel
  // attention, its owner under data parallelism), fp32 as ShardedSequence keeps it: the attention
  // caches per position (this rank's heads: under tensor parallelism every rank holds as many,
  // replicated KV heads included) and the linear-attention states. A live sequence of n positions
  // on such a rank holds kv_bytes() = n * cache_bytes_per_position() and state_bytes() =
  // state_bytes_per_sequence() (once it has run).
  uint64_t cache_bytes_per_position() const;
  uint64_t state_bytes_per_sequence() const;
  // Ranks that hold a sequence's caches: all of them, or its owner alone (data parallelism).
  int ranks_per_sequence() const {
    return options_.attention == AttentionSplit::kDataParallel ? 1 : shard_.size;
  }
  // The adapter slots cut so far (model.adapters().size() at construction or the last
  // refresh_slot).
  int32_t num_slots() const { return num_slots_; }

  // Re-cuts adapter slot `slot` of the model's AdapterSet in every layer after the caller changed
  // it (AdapterSet::set / clear through the model it was built from); the other slots and the
  // base weights are untouched. Also picks up a grown slot count (AdapterSet::resize): the new
  // slots are cut as they are now (a shrunk count drops the cuts of the slots gone). kOutOfRange
  // for a slot outside [0, model.adapters().size()). On an error nothing changes. Not concurrent
  // with forward on this rank; every rank refreshes the same slot before the next step. A
  // sequence in flight on the slot would continue with the new adapter over a cache built with
  // the old one: refresh only slots that no running sequence uses.
  void refresh_slot(int32_t slot);

  // Logits F32 [T, V] of every position of one sequence's prompt (positions 0 .. T-1) with
  // adapter `slot` (-1 = base), on every rank. comm must be the group the shares were cut for.
  Tensor prefill_logits(std::span<const int32_t> tokens, int32_t slot, Communicator& comm) const;

  // One batch of prompts (each from position 0, with its own adapter slot): logits F32 [T_i, V]
  // of every prompt, on every rank; the MoE and MLP layers see all the batch's tokens at once.
  std::vector<Tensor> prefill_batch_logits(const std::vector<std::vector<int32_t>>& prompts,
                                           const std::vector<int32_t>& slots,
                                           Communicator& comm) const;

  // A new sequence with adapter `slot` (-1 = base, or one of the num_slots() cut), attended on
  // rank `owner` under data-parallel attention (every rank makes it, with the same owner).
  ShardedSequence new_sequence(int32_t slot, int owner = 0) const;
  // The next tokens of each sequence (a prompt, a decode step's one token, or any mix) through
  // the model in one batch: logits F32 [T_i, V] of each, on every rank; the caches advance. Every
  // rank passes its own copies of the same sequences (made with the same owners) in the same
  // order. A sequence whose step threw part-way is refused afterwards (its layers' caches
  // disagree): start a new one; so is one whose slot a refresh_slot dropped.
  std::vector<Tensor> forward(const std::vector<ShardedSequence*>& sequences,
                              const std::vector<std::vector<int32_t>>& tokens,
                              Communicator& comm) const;

 private:
  // One layer's shares. The *_full descriptors are the whole layer as the LoRA cuts need it (the
  // split of an adapter's factors follows the base's); their tensors share the model's storage.
  // The per-slot LoRA vectors have num_slots_ entries (only those of the layer's kinds are used).
  struct Layer {
    Tensor input_layernorm, post_attention_layernorm;
    GqaWeights attention, attention_full;  // GQA models
    std::vector<GqaLora> attention_lora;   // per slot
    MlaWeights mla, mla_full;              // MLA models (use_mla)
    std::vector<MlaLora> mla_lora;         // per slot
    bool is_linear_attention = false;      // Qwen3.5 Gated DeltaNet layer
    GdnLayer gdn, gdn_full;
    std::vector<GdnLora> gdn_lora;  // per slot
    bool is_moe = false;
    MoeShard moe;
    ops::MoeParams moe_params;      // the whole layer's
    std::vector<MoeLora> moe_lora;  // per slot
    MlpShard mlp;
    std::vector<MlpLora> mlp_lora;  // per slot

    // Every per-slot vector to `slots` entries (the new ones adapt nothing until cut).
    void resize_slots(int32_t slots);
  };

  // The layer's attention share (constructor helpers, per attention kind), cut for heads_; the
  // whole layer kept in its *_full descriptor.
  void shard_gqa_layer(Layer& layer, const model::AttentionWeightsF32& src,
                       const ops::RopeTable& rope);
  void shard_mla_layer(Layer& layer, const model::AttentionWeightsF32& src,
                       const ops::RopeTable& rope, const ops::RopeParams& rope_params);
  void shard_gdn_layer(Layer& layer, const model::LinearAttentionWeightsF32& src);
  // Cuts adapter slot `slot` of layer `l` from the model's AdapterSet (attention for heads_, MoE
  // experts / MLP channels for shard_) into the layer's per-slot entries, which must exist. The
  // constructor's and refresh_slot's one cut.
  void cut_slot(Layer& layer, int64_t l, int32_t slot) const;
  // out [T, H] of the layer's attention on one sequence's next rows h [T, H], against its cache.
  Tensor attention(const Layer& layer, const Tensor& h, const std::vector<int32_t>& slots,
                   ShardedSequence::LayerCache& cache, Communicator& comm) const;

  const model::Model& model_;
  ShardSpec shard_;
  ShardedModelOptions options_;
  // The attention's heads: this rank of the group (tensor parallel) or the whole (data parallel).
  ShardSpec heads_;
  int32_t num_slots_ = 0;  // adapter slots cut (see num_slots())
  // Data-parallel attention runs the whole attention: its row-parallel reductions are over this
  // rank alone (a group of one).
  std::unique_ptr<InProcessGroup> solo_;
  ops::RmsNormParams norm_;
  std::vector<Layer> layers_;
  Tensor lm_head_;  // F32 [V / n, H]
};

}  // namespace moelora::dist
