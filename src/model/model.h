// The CPU reference model: Qwen3-MoE, Qwen3.5-MoE and DeepSeek-V3 / Kimi-K2 built from a loaded
// checkpoint, fp32 throughout, with any number of LoRA adapters served at once.
//
// A Model is made once from io::ModelWeights (every weight dequantized to fp32, weights.h) and is
// then read-only apart from its AdapterSet. Generation state lives in Sequence objects (one per
// request: token history, KV cache, adapter slot). forward() advances a BATCH of sequences by
// their new tokens in one pass: every layer runs over all tokens of all sequences together (the
// projections and the MoE layer see one [T_total, H] activation and a per-token slot vector, so a
// batch may mix adapters and base-only sequences freely); only the attention core runs per
// sequence, against that sequence's cache. Prefill (many tokens) and decode (one token) are the
// same call, and a token's result does not depend on what else is in the batch.
//
// Layer structure (pre-norm residual, as in transformers):
//   x = embed(ids)
//   for each layer: x += attention(rms_norm(x, input_layernorm))
//                   x += ffn(rms_norm(x, post_attention_layernorm))     (dense MLP or MoE)
//   logits = lm_head(rms_norm(x, norm))
// attention is GQA with per-head q/k RMSNorm and rotate_half RoPE (Qwen3-MoE, qwen3_moe.cpp;
// Qwen3.5's full-attention layers add the sigmoid output gate and partial RoPE), MLA with
// interleaved RoPE on the rope dims and YaRN (DeepSeek-V3 / Kimi, deepseek_v3.cpp), or Gated
// DeltaNet linear attention (Qwen3.5's "linear_attention" layers, gated_deltanet.cpp), whose
// per-sequence state (conv + recurrent) lives in the Sequence beside the KV caches of the
// full-attention layers. Qwen3.5 norms are (1 + w) RMSNorms and its shared expert is sigmoid-gated
// (ops::moe_forward_ref). ffn is ops::mlp_forward_ref on dense layers (Qwen mlp_only_layers /
// decoder_sparse_step, DeepSeek first_k_dense_replace) and ops::moe_forward_ref on MoE layers
// (softmax top-k or noaux_tc router, shared experts, both LoRA seams).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "model/kv_cache.h"
#include "model/lora_binding.h"
#include "model/weights.h"
#include "ops/gdn/gdn.h"
#include "ops/rope/rope.h"
#include "ops/route/route.h"

namespace moelora::model {

struct ModelOptions {
  bool show_progress = true;  // progress bars on stderr while loading and converting
  int64_t max_layers = 0;     // load only the first N decoder layers (0 = all)
};

// New tokens of one sequence in a batch.
struct SequenceInput {
  Sequence* sequence = nullptr;
  std::span<const int32_t> tokens;
};

// Optional outputs of forward() for tests and tools, in batch token order (sequence 0's tokens,
// then sequence 1's, ...).
struct ForwardTrace {
  // hidden[0] = embedding output; hidden[i] (1 <= i < L) = output of layer i - 1;
  // hidden[L] = the final RMSNorm of the last layer's output (transformers' output_hidden_states).
  std::vector<Tensor> hidden;  // each F32 [T_total, H]
  // Routing of every MoE layer (ids I32 [T_total, k], weights F32 [T_total, k]), by layer index.
  std::map<int64_t, ops::RouteResult> routes;
};

struct ForwardOptions {
  // true: logits for every new token ([T_i, V] per sequence); false: only for each sequence's
  // last token ([1, V]), which is all generation needs (skips most of the lm_head work).
  bool all_logits = true;
  ForwardTrace* trace = nullptr;
  // Imposed routing by MoE layer index (I32 [T_total, k] in batch token order), e.g. another
  // implementation's routing of the same tokens; layers without an entry route themselves.
  const std::map<int64_t, Tensor>* forced_routes = nullptr;
};

class Model {
 public:
  // load_checkpoint(dir) then Model(weights).
  static Model load(const std::filesystem::path& dir, const ModelOptions& options = {});
  // Converts the weights to fp32. kUnsupported for a DeepSeek-V3 model without MLA;
  // kInvalidArgument naming the layer and tensor for weights that do not match the config.
  explicit Model(const io::ModelWeights& weights, const ModelOptions& options = {});

  const io::ModelConfig& config() const { return config_; }
  int64_t vocab_size() const { return config_.vocab_size; }
  int64_t num_layers() const { return static_cast<int64_t>(weights_->layers.size()); }
  const ModelWeightsF32& weights() const { return *weights_; }
  const std::filesystem::path& dir() const { return dir_; }

  AdapterSet& adapters() { return adapters_; }
  const AdapterSet& adapters() const { return adapters_; }
  // adapters().load(name, dir); returns the slot.
  int32_t load_adapter(const std::string& name, const std::filesystem::path& dir);

  // A fresh, empty sequence using adapter `slot` (-1 = base). kOutOfRange for an unknown slot.
  Sequence new_sequence(int32_t slot = -1) const;
  // Same, by adapter name ("" = base). kNotFound for an unknown name.
  Sequence new_sequence(const std::string& adapter_name) const;

  // Runs the new tokens of every sequence in `batch` through the model, appends them to the
  // sequences' caches and returns one F32 logits tensor per sequence ([T_i, V], or [1, V] when
  // !options.all_logits). Everything is validated before any cache changes: token ids in
  // [0, vocab) (kOutOfRange naming the sequence, position and id), non-empty inputs, sequences
  // of this model, no sequence twice, slots that are loaded.
  std::vector<Tensor> forward(std::span<const SequenceInput> batch,
                              const ForwardOptions& options = {});
  // One sequence.
  Tensor forward(Sequence& sequence, std::span<const int32_t> tokens,
                 const ForwardOptions& options = {});

 private:
  io::ModelConfig config_;
  std::filesystem::path dir_;
  std::shared_ptr<const ModelWeightsF32> weights_;
  AdapterSet adapters_;
  ops::RopeTable rope_;
  float attention_scale_ = 0.0f;  // softmax scale (GQA: D^-0.5; MLA: mla_softmax_scale)
  uint64_t id_ = 0;               // identifies the model a Sequence belongs to
};

// The ops::MoeParams of an MoE layer of a config (H, I from the layer's W13, router kind, E, k,
// renormalization, groups, scaling).
ops::MoeParams moe_params(const io::ModelConfig& config, const LayerWeightsF32& layer);

// The ops::RopeParams of a config (type, theta, rotary width, YaRN fields).
ops::RopeParams rope_params(const io::ModelConfig& config);

// The Gated DeltaNet shape of a config's linear-attention layers (heads, head dims, conv width,
// the gated norm's eps), as the CPU and GPU models and the engine's memory estimates use it.
ops::GdnShape linear_attention_shape(const io::ModelConfig& config);

}  // namespace moelora::model
