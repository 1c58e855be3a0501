// Model weights by name, normalized into the canonical layouts of DESIGN.md §2.
//
// load_checkpoint(dir) reads dir/config.json (+ hf_quant_config.json), opens dir/model.safetensors
// or the shards named by dir/model.safetensors.index.json, and hands every weight of the decoder
// out as a typed, shape-checked view. Nothing is copied or converted: tensors keep the dtype they
// have on disk and point straight into the mmap'ed files (the SafetensorsStore in ModelWeights
// keeps the mappings alive; every Tensor also holds its mapping on its own). Dequantization and
// stacking are done by the consumer (the CPU model dequantizes to fp32; the GPU upload stacks into
// W13 [E, 2I, H] / W2 [E, H, I]).
//
// Tensor names, relative to the decoder prefix P (config.weight_prefix: "model." normally,
// "model.language_model." for the Qwen3.5 VLM, "language_model.model." for Kimi-K2.5; when the
// checkpoint has no P.embed_tokens.weight the other two prefixes are tried, so a text config can
// read a checkpoint saved from the VLM and vice versa):
//   P.embed_tokens.weight [V, H]          P.norm.weight [H]          lm_head.weight [V, H]
//   P.layers.L.input_layernorm.weight [H], P.layers.L.post_attention_layernorm.weight [H]
//   GQA (Qwen3-MoE, Qwen3.5 full-attention layers):
//     self_attn.q_proj [heads*head_dim (x2 with Qwen3.5's output gate), H],
//     self_attn.{k,v}_proj [kv_heads*head_dim, H], self_attn.o_proj [H, heads*head_dim],
//     self_attn.{q,k}_norm [head_dim]
//   Gated DeltaNet (Qwen3.5 linear-attention layers), with key_dim = nk*dk, value_dim = nv*dv:
//     linear_attn.in_proj_qkv [2*key_dim + value_dim, H], in_proj_z [value_dim, H],
//     in_proj_b / in_proj_a [nv, H], conv1d.weight [2*key_dim + value_dim, 1, K], A_log [nv],
//     dt_bias [nv], norm.weight [dv], out_proj [H, value_dim]
//   MLA (DeepSeek-V3, Kimi), with qk = qk_nope + qk_rope:
//     self_attn.q_proj [heads*qk, H] when q_lora_rank is 0/null, else
//     self_attn.q_a_proj [q_lora_rank, H] + q_a_layernorm [q_lora_rank] + q_b_proj [heads*qk,
//     q_lora_rank]; self_attn.kv_a_proj_with_mqa [kv_lora_rank + qk_rope, H], kv_a_layernorm
//     [kv_lora_rank], self_attn.kv_b_proj [heads*(qk_nope + v_head), kv_lora_rank],
//     self_attn.o_proj [H, heads*v_head]
//   Dense MLP layers (Qwen mlp_only_layers / decoder_sparse_step, DeepSeek first_k_dense_replace /
//   moe_layer_freq): mlp.{gate,up}_proj [intermediate_size, H], mlp.down_proj [H,
//   intermediate_size] MoE layers: mlp.gate.weight [E, H] (router); DeepSeek
//   mlp.gate.e_score_correction_bias [E];
//     routed experts, either per expert (the Hugging Face default)
//       mlp.experts.{e}.{gate,up}_proj.weight [I, H], mlp.experts.{e}.down_proj.weight [H, I]
//     or fused (transformers' save_original_format=False, Qwen3.5 releases; no ".weight" suffix)
//       mlp.experts.gate_up_proj [E, 2I, H] (gate rows [0, I), up rows [I, 2I)),
//       mlp.experts.down_proj [E, H, I]
//     which load as per-expert views (expert e's gate and up rows are contiguous: zero-copy);
//     shared expert: Qwen mlp.shared_expert.{gate,up,down}_proj + mlp.shared_expert_gate.weight [1,
//     H], DeepSeek mlp.shared_experts.{gate,up,down}_proj, with intermediate
//     shared_expert_intermediate_size.
//
// Every linear X (a name above without ".weight") is stored in one of three formats, recognised by
// its companion tensors:
//   - dense:  X.weight BF16 / F16 / F32 [N, K]
//   - FP8 block (quantization_config.quant_method "fp8"): X.weight F8_E4M3 [N, K] and
//     X.weight_scale_inv F32 [ceil(N/128), ceil(K/128)] (dequant multiplier; partial last blocks
//     allowed). Fused experts: experts.gate_up_proj F8_E4M3 + experts.gate_up_proj_scale_inv F32
//     [E, ceil(2I/128), ceil(H/128)] (likewise down_proj); they split into gate and up only when I
//     is a multiple of 128, else kUnsupported (a scale block would straddle gate and up rows).
//   - NVFP4 (ModelOpt, quantization_config quant_method "modelopt" or hf_quant_config.json):
//     X.weight U8 [N, K/2] (low nibble = even element), X.weight_scale F8_E4M3 [N, K/16],
//     X.weight_scale_2 F32 [] or [1], X.input_scale F32 [] or [1] (optional: W4A16 exports omit
//     it). Fused NVFP4 experts are not supported (kUnsupported).
// A quantized linear needs the matching quantization config (else kInvalidFile); a module matched
// by modules_to_not_convert / ignore / exclude_modules must be dense. A dense linear in a
// quantized checkpoint is accepted (quantizers skip shapes they cannot block). Embeddings, norms,
// routers, e_score_correction_bias and shared_expert_gate are always dense float tensors.
//
// Tied embeddings: with tie_word_embeddings, lm_head aliases embed_tokens (an lm_head.weight in the
// file is then ignored, as transformers ties over it); without it lm_head.weight is required.
//
// Validation: every tensor's dtype and shape is checked against config.json. A mismatch throws
// moelora::Error (kInvalidFile) naming the file, the tensor, the expected shape with the config
// fields it comes from, and the actual shape; a missing tensor throws kNotFound naming the tensor,
// the directory and what was expected. Tensors the checkpoint holds but the model does not use
// are an error too (kInvalidFile, listing them: usually config.json and the weights disagree, e.g.
// more experts on disk than num_experts), except those transformers ignores as well:
//   - P.layers.{n}.* with n >= num_hidden_layers for DeepSeek-V3 / Kimi (the MTP layer), and
//     layers beyond LoadOptions::max_layers;
//   - mtp.* (Qwen3.5 MTP), *.rotary_emb.inv_freq, attention *.k_scale / *.v_scale (ModelOpt FP8
//     KV-cache scales; the engine keeps a bf16 cache);
//   - for the VLM configs (qwen3_5_moe, kimi_k25): everything outside the text decoder and lm_head
//     (vision tower, projector); for the Qwen3.5 text config, model.visual.* (a VLM checkpoint
//     read as qwen3_5_moe_text);
//   - lm_head.weight when the embeddings are tied.
// LoadOptions::allow_unused_tensors turns the unused-tensor error into a skip. The names skipped
// are listed in ModelWeights::ignored_tensors either way.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/hf_config.h"
#include "io/safetensors.h"

namespace moelora::io {

enum class WeightFormat { kDense, kFp8Block, kNvfp4 };
const char* weight_format_name(WeightFormat f);  // "dense", "fp8-block", "nvfp4"

// One linear layer's weight, y = x W^T, W [out, in].
struct LinearWeight {
  WeightFormat format = WeightFormat::kDense;
  int64_t out_features = 0;
  int64_t in_features = 0;
  // kDense: BF16/F16/F32 [out, in]; kFp8Block: F8_E4M3 [out, in]; kNvfp4: U8 [out, in/2]
  // (low nibble = even element).
  Tensor weight;
  // kFp8Block: F32 weight_scale_inv [ceil(out/block_n), ceil(in/block_k)] (dequant multiplier);
  // kNvfp4: F8_E4M3 weight_scale [out, in/16].
  Tensor scale;
  int block_n = 128, block_k = 128;  // kFp8Block
  float scale_2 = 1.0f;              // kNvfp4 weight_scale_2 (per tensor)
  float input_scale = 1.0f;      // kNvfp4 input_scale (static activation scale; unused in W4A16)
  bool has_input_scale = false;  // kNvfp4: the checkpoint holds X.input_scale
  // Checkpoint name of the weight tensor, for messages. Views of fused experts are named
  // "P.layers.L.mlp.experts.gate_up_proj[e][0:I]" and similar.
  std::string name;

  bool defined() const { return weight.defined(); }
  uint64_t nbytes() const { return weight.nbytes() + (scale.defined() ? scale.nbytes() : 0); }
};

// Routed experts of one MoE layer; gate/up [I, H], down [H, I] per expert.
struct ExpertWeights {
  int64_t num_experts = 0;
  std::vector<LinearWeight> gate, up, down;  // each of size num_experts
  bool fused_on_disk = false;                // came from experts.gate_up_proj / down_proj
};

struct MlpWeights {  // SwiGLU MLP: down(silu(gate x) * up x)
  LinearWeight gate, up, down;
  bool defined() const { return gate.defined(); }
};

// Qwen3.5 Gated DeltaNet ("linear_attention") layer; key_dim = nk*dk, value_dim = nv*dv.
struct LinearAttentionWeights {
  LinearWeight in_proj_qkv;  // [2*key_dim + value_dim, H], rows [q | k | v]
  LinearWeight in_proj_z;    // [value_dim, H]
  LinearWeight in_proj_b;    // [nv, H]
  LinearWeight in_proj_a;    // [nv, H]
  Tensor conv1d;             // [2*key_dim + value_dim, 1, linear_conv_kernel_dim] (depthwise)
  Tensor a_log;              // A_log [nv]
  Tensor dt_bias;            // [nv]
  Tensor norm;               // [dv] (gated RMSNorm, plain weight)
  LinearWeight out_proj;     // [H, value_dim]
  bool defined() const { return in_proj_qkv.defined(); }
};

struct LayerWeights {
  Tensor input_layernorm;           // [H]
  Tensor post_attention_layernorm;  // [H]

  // GQA attention (and Qwen3.5 gated attention: q_proj has 2*heads*head_dim rows, per head
  // [q (head_dim) | gate (head_dim)])
  LinearWeight q_proj, k_proj, v_proj, o_proj;
  Tensor q_norm, k_norm;  // [head_dim] (Qwen3 per-head norms)
  // MLA attention (q_proj is used instead of q_a/q_b when q_lora_rank == 0)
  LinearWeight q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj;
  Tensor q_a_layernorm;   // [q_lora_rank]
  Tensor kv_a_layernorm;  // [kv_lora_rank]
  // Qwen3.5 linear-attention layers use linear_attn instead of the attention fields above.
  bool is_linear_attention = false;
  LinearAttentionWeights linear_attn;

  bool is_moe = false;
  MlpWeights mlp;  // dense layers
  // MoE layers
  Tensor router;                   // mlp.gate.weight [E, H]
  Tensor e_score_correction_bias;  // [E] F32 (DeepSeek), undefined otherwise
  ExpertWeights experts;
  MlpWeights shared_expert;   // Qwen shared_expert / DeepSeek shared_experts
  Tensor shared_expert_gate;  // [1, H] (Qwen), undefined otherwise
};

struct ModelWeights {
  ModelConfig config;  // num_hidden_layers (and the per-layer lists) cut to LoadOptions::max_layers
  std::filesystem::path dir;
  std::string weight_prefix;  // the decoder prefix actually found in the checkpoint ("model.", ...)
  Tensor embed_tokens;        // [V, H]
  std::vector<LayerWeights> layers;
  Tensor final_norm;     // [H]
  LinearWeight lm_head;  // [V, H]; aliases embed_tokens when tied
  bool tied_embeddings = false;
  SafetensorsStore store;  // keeps the mappings alive and answers `inspect`
  // Tensors of the checkpoint that the model does not use (see the header comment), sorted.
  std::vector<std::string> ignored_tensors;
};

struct LoadOptions {
  // A ProgressBar over the decoder layers on stderr (MOELORA_NO_PROGRESS=1 silences it).
  bool show_progress = true;
  // Load only the first N decoder layers (0 = all); config.num_hidden_layers is reduced to match
  // (and layer_types, mlp_only_layers, first_k_dense_replace with it). Negative: kInvalidArgument.
  int64_t max_layers = 0;
  // Skip tensors the model does not use instead of failing (they are still listed in
  // ModelWeights::ignored_tensors).
  bool allow_unused_tensors = false;
};

// Loads and validates the checkpoint in `dir` (see the header comment). Throws moelora::Error:
// kNotFound (no directory, config.json, weights file or tensor), kInvalidFile (malformed or
// inconsistent files), kUnsupported (a valid layout the engine does not implement).
ModelWeights load_checkpoint(const std::filesystem::path& dir, const LoadOptions& options = {});

}  // namespace moelora::io
