// The model presets of `moelora synth` (and of `moelora bench --preset`): each one a complete
// ModelConfig, written to config.json as transformers would save it. Tiny presets are for tests
// (hidden and expert sizes multiples of 128 so every quantization applies), small ones for CPU
// demos, the others carry the real models' shapes. Also here: --layers, and the quantization
// configs synth writes (which modules each format leaves in bf16, and where those lists come from).
#include <algorithm>

#include "core/error.h"
#include "synth.h"

namespace moelora::cli {
namespace synth {
namespace {

using io::Architecture;
using io::ModelConfig;
using io::QuantConfig;
using io::QuantMethod;

ModelConfig qwen3_moe_base() {
  ModelConfig c;
  c.arch = Architecture::kQwen3Moe;
  c.model_type = c.text_model_type = "qwen3_moe";
  c.dtype = "bfloat16";
  c.qk_norm = true;
  c.norm_topk_prob = true;
  c.router = RouterKind::kSoftmaxTopK;
  c.rope.type = "default";
  c.rope.theta = 1e6;
  c.rms_norm_eps = 1e-6;
  return c;
}

ModelConfig preset_tiny_qwen3_moe() {
  ModelConfig c = qwen3_moe_base();
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.intermediate_size = 384;
  c.moe_intermediate_size = 128;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.mlp_only_layers = {1};
  c.bos_token_id = 0;
  c.eos_token_ids = {2};
  return c;
}

ModelConfig preset_small_qwen3_moe() {
  ModelConfig c = qwen3_moe_base();
  // 512 ids: the 500-token tokenizer of tests/data/tokenizer (what the demo passes with
  // --tokenizer) covers almost all of them, so generated text decodes.
  c.vocab_size = 512;
  c.hidden_size = 512;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.moe_intermediate_size = 256;
  c.num_experts = 32;
  c.num_experts_per_tok = 4;
  c.bos_token_id = 0;
  c.eos_token_ids = {2};
  return c;
}

ModelConfig preset_qwen3_30b_a3b() {
  ModelConfig c = qwen3_moe_base();
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.num_hidden_layers = 48;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.max_position_embeddings = 40960;
  c.intermediate_size = 6144;  // only used by mlp_only_layers, which this model has none of
  c.moe_intermediate_size = 768;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.bos_token_id = 151643;
  c.eos_token_ids = {151645};
  return c;
}

// The Qwen3.5-MoE text model (qwen3_5_moe_text, keys under "model."): gated full attention with
// q/k norms and partial RoPE, (1+w) RMSNorms, every layer MoE with a sigmoid-gated shared
// expert, and `layers` decoder layers repeating 3 Gated DeltaNet ("linear_attention") layers and
// 1 full-attention layer, like the real models (full_attention_interval 4).
ModelConfig qwen35_moe_base(int64_t layers) {
  ModelConfig c;
  c.arch = Architecture::kQwen35Moe;
  c.model_type = c.text_model_type = "qwen3_5_moe_text";
  c.dtype = "bfloat16";
  c.num_hidden_layers = layers;
  c.qk_norm = true;
  c.attention_output_gate = true;
  c.norm_style = NormStyle::kOnePlusWeight;
  c.rms_norm_eps = 1e-6;
  c.rope.type = "default";
  c.rope.theta = 1e7;
  c.rope.partial_rotary_factor = 0.25;
  c.shared_expert_gate = true;
  c.norm_topk_prob = true;  // Qwen3.5 always renormalizes the top-k (no config field)
  c.router = RouterKind::kSoftmaxTopK;
  for (int64_t l = 0; l < layers; ++l)
    c.layer_types.push_back((l + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  return c;
}

ModelConfig preset_tiny_qwen35_moe() {
  ModelConfig c = qwen35_moe_base(4);
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;  // rotary width 16
  c.rope.mrope_section = {3, 3, 2};
  c.max_position_embeddings = 4096;
  c.moe_intermediate_size = 128;
  c.shared_expert_intermediate_size = 128;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.linear_attention = {/*conv_kernel_dim=*/4, /*key_head_dim=*/32, /*value_head_dim=*/32,
                        /*num_key_heads=*/2, /*num_value_heads=*/4};
  c.bos_token_id = 0;
  c.eos_token_ids = {2};
  return c;
}

ModelConfig preset_small_qwen35_moe() {
  ModelConfig c = qwen35_moe_base(8);
  c.vocab_size = 512;  // the 500-token tokenizer of tests/data/tokenizer, as small-qwen3-moe
  c.hidden_size = 512;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 128;  // rotary width 32
  c.rope.mrope_section = {6, 5, 5};
  c.max_position_embeddings = 4096;
  c.moe_intermediate_size = 256;
  c.shared_expert_intermediate_size = 256;
  c.num_experts = 32;
  c.num_experts_per_tok = 4;
  c.linear_attention = {/*conv_kernel_dim=*/4, /*key_head_dim=*/64, /*value_head_dim=*/64,
                        /*num_key_heads=*/4, /*num_value_heads=*/8};
  c.bos_token_id = 0;
  c.eos_token_ids = {2};
  return c;
}

ModelConfig preset_qwen35_35b_a3b() {
  ModelConfig c = qwen35_moe_base(40);
  c.vocab_size = 248320;
  c.hidden_size = 2048;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 2;
  c.head_dim = 256;
  c.max_position_embeddings = 262144;
  c.rope.mrope_section = {11, 11, 10};
  c.moe_intermediate_size = 512;
  c.shared_expert_intermediate_size = 512;
  c.num_experts = 256;
  c.num_experts_per_tok = 8;
  c.linear_attention = {/*conv_kernel_dim=*/4, /*key_head_dim=*/128, /*value_head_dim=*/128,
                        /*num_key_heads=*/16, /*num_value_heads=*/32};
  c.eos_token_ids = {248044};
  return c;
}

ModelConfig deepseek_base() {
  ModelConfig c;
  c.arch = Architecture::kDeepseekV3;
  c.model_type = c.text_model_type = "deepseek_v3";
  c.dtype = "bfloat16";
  c.use_mla = true;
  c.rope_style = RopeStyle::kInterleaved;
  c.router = RouterKind::kSigmoidNoauxTc;
  c.norm_topk_prob = true;
  c.rope.type = "yarn";
  c.rope.beta_fast = 32;
  c.rope.beta_slow = 1;
  c.rope.mscale = 1.0;
  c.rope.mscale_all_dim = 1.0;
  return c;
}

ModelConfig preset_tiny_deepseek_v3() {
  ModelConfig c = deepseek_base();
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.q_lora_rank = 128;
  c.kv_lora_rank = 128;
  c.qk_nope_head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.head_dim = 16;
  c.v_head_dim = 32;
  c.max_position_embeddings = 512;
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 10000;
  c.rope.factor = 4;
  c.rope.original_max_position_embeddings = 128;
  c.intermediate_size = 384;
  c.moe_intermediate_size = 128;
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  c.first_k_dense_replace = 1;
  c.shared_expert_intermediate_size = 128;  // n_shared_experts 1
  c.bos_token_id = 0;
  c.eos_token_ids = {2};
  return c;
}

ModelConfig preset_kimi_k25() {
  ModelConfig c = deepseek_base();
  c.vocab_size = 163840;
  c.hidden_size = 7168;
  c.num_hidden_layers = 61;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 64;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.head_dim = 64;
  c.v_head_dim = 128;
  c.max_position_embeddings = 262144;
  c.rms_norm_eps = 1e-5;
  c.rope.theta = 50000;
  c.rope.factor = 64;
  c.rope.original_max_position_embeddings = 4096;
  c.intermediate_size = 18432;
  c.moe_intermediate_size = 2048;
  c.num_experts = 384;
  c.num_experts_per_tok = 8;
  c.n_group = 1;
  c.topk_group = 1;
  c.routed_scaling_factor = 2.827;
  c.first_k_dense_replace = 1;
  c.shared_expert_intermediate_size = 2048;  // n_shared_experts 1
  c.bos_token_id = 163584;
  c.eos_token_ids = {163585};
  return c;
}

bool is_linear_attention(const ModelConfig& c, int64_t layer) {
  return !c.layer_types.empty() && c.layer_types[static_cast<size_t>(layer)] == "linear_attention";
}

// FP8 of the Qwen3.5 family: modules_to_not_convert as the Qwen FP8 releases
// (Qwen/Qwen3.5-35B-A3B-FP8, Qwen3.6-35B-A3B-FP8) write it, explicit module names layer by layer:
// lm_head, the embeddings, both RMSNorms of every layer, the routers (mlp.gate) and
// mlp.shared_expert_gate, q_norm / k_norm of full-attention layers, and the small Gated DeltaNet
// parameters of linear-attention layers (A_log, conv1d, dt_bias, in_proj_a, in_proj_b, norm).
// Everything else -- self_attn q/k/v/o, linear_attn in_proj_qkv / in_proj_z / out_proj, the shared
// expert and the routed experts -- is FP8. Sources: FORMATS.md §4.1 (Qwen FP8 repos: lm_head,
// norms, routers; Qwen3.5 also embeddings, q/k norms, shared_expert_gate and the GDN parameters
// above) and re-exports that copy the official list (the card of
// gsting/Qwen3.6-35B-A3B-abliterated-FP8); the official config.json itself could not be read here,
// so its order may differ. The releases also list the vision tower and the MTP layer, which synth
// does not write.
void qwen35_fp8_not_converted(const ModelConfig& c, QuantConfig& q) {
  const std::string P = c.weight_prefix;
  q.modules_to_not_convert = {c.lm_head_name, P + "embed_tokens"};
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = P + "layers." + std::to_string(layer) + ".";
    auto add = [&](const std::string& module) { q.modules_to_not_convert.push_back(p + module); };
    add("input_layernorm");
    if (is_linear_attention(c, layer)) {
      for (const char* m : {"A_log", "conv1d", "dt_bias", "in_proj_a", "in_proj_b", "norm"})
        add(std::string("linear_attn.") + m);
    } else {
      add("self_attn.q_norm");
      add("self_attn.k_norm");
    }
    if (c.is_moe_layer(layer)) {
      add("mlp.gate");
      if (c.shared_expert_gate) add("mlp.shared_expert_gate");
    }
    add("post_attention_layernorm");
  }
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> list = {
      {"tiny-qwen3-moe",
       "Qwen3-MoE for tests: 3 layers (layer 1 a dense MLP), hidden 256, 8 experts top-2, "
       "expert I 128, 4 query / 2 KV heads of 64, vocab 512; H and I are multiples of 128 so "
       "every quantization applies.",
       preset_tiny_qwen3_moe},
      {"tiny-deepseek-v3",
       "DeepSeek-V3 for tests: MLA (q_lora_rank 128, kv_lora_rank 128, nope 32 / rope 16 / v "
       "32, 4 heads), 3 layers with first_k_dense_replace 1, 16 experts top-4 + 1 shared, "
       "noaux_tc routing with 4 groups (top 2), YaRN factor 4, vocab 512. kv_a_proj_with_mqa "
       "has 144 rows: a partial FP8 block.",
       preset_tiny_deepseek_v3},
      {"tiny-qwen3.5-moe",
       "Qwen3.5-MoE for tests: 4 layers = 3 Gated DeltaNet + 1 gated full attention (the real "
       "pattern), hidden 256, 8 experts top-2, expert I 128 + a gated shared expert of 128, 4 "
       "query / 2 KV heads of 64 (partial RoPE 0.25: rotary width 16), linear attention conv "
       "kernel 4, 2 key / 4 value heads of 32, vocab 512.",
       preset_tiny_qwen35_moe},
      {"small-qwen3-moe",
       "Qwen3-MoE for the CPU demo: 8 layers, hidden 512, 32 experts top-4, expert I 256, 8 "
       "query / 2 KV heads of 64, vocab 512 (the 500-token tokenizer of tests/data/tokenizer "
       "covers it); about 106 M parameters, 18 M active per token, so the CPU backend "
       "generates on the order of a hundred tokens/s.",
       preset_small_qwen3_moe},
      {"small-qwen3.5-moe",
       "Qwen3.5-MoE for CPU demos: 8 layers = 2 x (3 Gated DeltaNet + 1 gated full attention), "
       "hidden 512, 32 experts top-4, expert I 256 + a gated shared expert of 256, 8 query / 2 "
       "KV heads of 128 (rotary width 32), linear attention 4 key / 8 value heads of 64, vocab "
       "512 (the 500-token tokenizer of tests/data/tokenizer covers it); about 114 M "
       "parameters, 26 M active per token.",
       preset_small_qwen35_moe},
      {"qwen3-30b-a3b",
       "Qwen3-30B-A3B shapes: 48 layers, hidden 2048, 128 experts top-8, expert I 768, 32 "
       "query / 4 KV heads of 128, vocab 151936, RoPE theta 1e6.",
       preset_qwen3_30b_a3b},
      {"qwen3.5-35b-a3b",
       "Qwen3.5-35B-A3B: 40 layers = 10 x (3 Gated DeltaNet + 1 gated full attention), hidden "
       "2048, 256 experts top-8, expert I 512 + a gated shared expert of 512; full attention 16 "
       "query / 2 KV heads of 256 (partial RoPE 0.25), linear attention conv kernel 4, 16 key / "
       "32 value heads of 128; vocab 248320. Written as the text model (qwen3_5_moe_text, keys "
       "under model.) with per-expert weights, without the vision tower and the MTP layer. The "
       "GPU model does not run Gated DeltaNet layers yet.",
       preset_qwen35_35b_a3b},
      {"kimi-k2.5",
       "Kimi-K2.5 language model shapes (DeepSeek-V3 architecture): MLA with 64 heads, "
       "q_lora_rank 1536, kv_lora_rank 512, nope 128 / rope 64 / v 128; 61 layers with "
       "first_k_dense_replace 1, hidden 7168, 384 experts top-8 (I 2048) + 1 shared, n_group "
       "1, routed_scaling_factor 2.827, YaRN factor 64 (original 4096, theta 50000), vocab "
       "163840. Written as a text-only DeepseekV3ForCausalLM (model_type deepseek_v3); the "
       "vision tower is not synthesized.",
       preset_kimi_k25},
  };
  return list;
}

std::string preset_names() {
  std::string names;
  for (const Preset& p : presets()) names += (names.empty() ? "" : ", ") + std::string(p.name);
  return names;
}

const Preset& find_preset(const std::string& name) {
  for (const Preset& p : presets()) {
    if (name == p.name) return p;
  }
  MOELORA_THROW(ErrorCode::kInvalidArgument, "--preset: unknown preset '", name,
                "'; presets: ", preset_names());
}

void set_layers(ModelConfig& c, int64_t layers) {
  // layer_types: cut, or (more layers than the preset) continued with the preset's own pattern
  if (!c.layer_types.empty()) {
    const size_t kinds = c.layer_types.size(), wanted = static_cast<size_t>(layers);
    for (size_t l = kinds; l < wanted; ++l) c.layer_types.push_back(c.layer_types[l % kinds]);
    c.layer_types.resize(wanted);
  }
  c.num_hidden_layers = layers;
  c.mlp_only_layers.erase(std::remove_if(c.mlp_only_layers.begin(), c.mlp_only_layers.end(),
                                         [&](int64_t l) { return l >= layers; }),
                          c.mlp_only_layers.end());
  c.first_k_dense_replace = std::min(c.first_k_dense_replace, layers);
}

QuantMethod parse_quant(const std::string& name) {
  if (name == "bf16") return QuantMethod::kNone;
  if (name == "fp8") return QuantMethod::kFp8Block;
  if (name == "nvfp4") return QuantMethod::kNvfp4;
  MOELORA_THROW(ErrorCode::kInvalidArgument, "--quant: unknown value '", name,
                "'; expected bf16, fp8 or nvfp4");
}

// FP8: explicit module names, like the Qwen FP8 releases (every matcher -- transformers' prefix
// and suffix rules, vLLM's, ours -- reads them the same way): the output projection, the routers
// and Qwen's shared_expert_gate; for Qwen3.5 the list of its releases (qwen35_fp8_not_converted).
// NVFP4: ModelOpt-style wildcards for the same modules, plus any linear whose in_features is not
// a multiple of 16; for Qwen3.5 only the routed experts are NVFP4 (attention, Gated DeltaNet and
// the shared expert stay bf16, as attention and shared experts do in the Kimi-K2.5 NVFP4 export),
// per expert on disk since the loader takes no fused NVFP4 experts.
QuantConfig make_quant(const ModelConfig& c, QuantMethod method) {
  QuantConfig q;
  q.method = method;
  if (method == QuantMethod::kNone) return q;
  const bool qwen35 = c.arch == Architecture::kQwen35Moe;
  if (method == QuantMethod::kFp8Block) {
    q.source = "config.json";
    q.activation_scheme = "dynamic";
    if (qwen35) {
      qwen35_fp8_not_converted(c, q);
      return q;
    }
    q.modules_to_not_convert.push_back(c.lm_head_name);
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
      if (!c.is_moe_layer(layer)) continue;
      const std::string p = c.weight_prefix + "layers." + std::to_string(layer) + ".mlp.";
      q.modules_to_not_convert.push_back(p + "gate");
      if (c.shared_expert_gate) q.modules_to_not_convert.push_back(p + "shared_expert_gate");
    }
    return q;
  }
  q.source = "hf_quant_config.json";
  const std::string layers = c.weight_prefix + "layers.*.";
  q.modules_to_not_convert = {c.lm_head_name, layers + "mlp.gate"};
  if (c.shared_expert_gate) q.modules_to_not_convert.push_back(layers + "mlp.shared_expert_gate");
  if (qwen35) {
    for (const char* m : {"self_attn", "linear_attn", "mlp.shared_expert"})
      q.modules_to_not_convert.push_back(layers + m);
  }
  plan_model(c, [&](Planned t) {
    if (t.linear && t.shape[1] % kNvfp4Group != 0 && !q.is_excluded(t.module))
      q.modules_to_not_convert.push_back(t.module);
  });
  return q;
}

}  // namespace synth

io::ModelConfig preset_config(const std::string& preset, int64_t layers, const std::string& quant) {
  io::ModelConfig c = synth::find_preset(preset).make();
  MOELORA_CHECK(layers >= 0, ErrorCode::kInvalidArgument, "layers must be >= 0 (0 = all), got ",
                layers);
  if (layers > 0 && layers < c.num_hidden_layers) synth::set_layers(c, layers);
  c.quant = synth::make_quant(c, synth::parse_quant(quant));
  c.validate("preset " + preset);
  return c;
}

}  // namespace moelora::cli
