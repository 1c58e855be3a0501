// Model weights by name, normalized into the canonical layouts of DESIGN.md §2.
//
// Tensors keep the dtype they have on disk and are zero-copy views into the mmap'ed files
// wherever possible (per-expert weights are views even when the file stores fused
// `experts.gate_up_proj [E, 2I, H]`: expert e's gate rows [0, I) and up rows [I, 2I) are
// contiguous). Dequantization and stacking are done by the consumer (the CPU model dequantizes
// to fp32; the GPU upload stacks into W13 [E, 2I, H] / W2 [E, H, I]).
//
// Accepted on disk:
//   - per-expert keys  mlp.experts.{e}.{gate,up,down}_proj.weight
//   - fused keys       mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]
//   - FP8 block:       X.weight F8_E4M3 [N, K] + X.weight_scale_inv F32 [ceil(N/128), ceil(K/128)]
//   - NVFP4 (ModelOpt): X.weight U8 [N, K/2], X.weight_scale F8_E4M3 [N, K/16],
//                       X.weight_scale_2 F32 [] or [1], X.input_scale F32 [] or [1]
//   - dense bf16 / f16 / f32 weights; tied embeddings (lm_head = embed_tokens)
// Every tensor's shape is checked against config.json; a mismatch names the tensor, the
// expected and the actual shape.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/hf_config.h"
#include "io/safetensors.h"

namespace moelora::io {

enum class WeightFormat { kDense, kFp8Block, kNvfp4 };
const char* weight_format_name(WeightFormat f);

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
  float input_scale = 1.0f;          // kNvfp4 input_scale (static activation scale; unused in W4A16)
  std::string name;                  // checkpoint name of the weight tensor, for messages

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

struct LayerWeights {
  Tensor input_layernorm;           // [H]
  Tensor post_attention_layernorm;  // [H]

  // GQA attention
  LinearWeight q_proj, k_proj, v_proj, o_proj;
  Tensor q_norm, k_norm;  // [head_dim] (Qwen3 per-head norms)
  // MLA attention (q_proj is used instead of q_a/q_b when q_lora_rank == 0)
  LinearWeight q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj;
  Tensor q_a_layernorm;   // [q_lora_rank]
  Tensor kv_a_layernorm;  // [kv_lora_rank]

  bool is_moe = false;
  MlpWeights mlp;  // dense layers
  // MoE layers
  Tensor router;                   // mlp.gate.weight [E, H]
  Tensor e_score_correction_bias;  // [E] F32 (DeepSeek), undefined otherwise
  ExpertWeights experts;
  MlpWeights shared_expert;        // Qwen shared_expert / DeepSeek shared_experts
  Tensor shared_expert_gate;       // [1, H] (Qwen), undefined otherwise
};

struct ModelWeights {
  ModelConfig config;
  std::filesystem::path dir;
  Tensor embed_tokens;  // [V, H]
  std::vector<LayerWeights> layers;
  Tensor final_norm;    // [H]
  LinearWeight lm_head; // [V, H]; aliases embed_tokens when tied
  SafetensorsStore store;  // keeps the mappings alive and answers `inspect`
};

struct LoadOptions {
  bool show_progress = true;
  // Load only the first N decoder layers (0 = all); config.num_hidden_layers is reduced to match.
  int64_t max_layers = 0;
};

ModelWeights load_checkpoint(const std::filesystem::path& dir, const LoadOptions& options = {});

}  // namespace moelora::io
