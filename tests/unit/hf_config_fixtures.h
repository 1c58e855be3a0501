// Hand-written copies of the published config.json files of every supported family (values as in
// FORMATS.md §1.3-1.6), their quantization configs and the helpers the config.json tests share
// (hf_config_test.cpp, hf_quant_config_test.cpp).
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/hf_config.h"
#include "support/test_support.h"

namespace moelora::io::hf_config_test {

using json = nlohmann::json;
using test::error_message;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---------------------------------------------------------------------------------------------
// fixtures

inline constexpr const char* kQwen3_30B_A3B = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

inline constexpr const char* kQwen35_35B_A3B = R"({
  "architectures": ["Qwen3_5MoeForConditionalGeneration"],
  "image_token_id": 248056,
  "model_type": "qwen3_5_moe",
  "text_config": {
    "attention_bias": false,
    "attention_dropout": 0.0,
    "attn_output_gate": true,
    "dtype": "bfloat16",
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "layer_types": [
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention",
      "linear_attention", "linear_attention", "linear_attention", "full_attention"
    ],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 512,
    "mtp_num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
      "mrope_interleaved": true,
      "mrope_section": [11, 11, 10],
      "rope_type": "default",
      "rope_theta": 10000000,
      "partial_rotary_factor": 0.25
    },
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "use_cache": true,
    "vocab_size": 248320
  },
  "tie_word_embeddings": false,
  "transformers_version": "4.57.0.dev0",
  "video_token_id": 248057,
  "vision_config": {
    "deepstack_visual_indexes": [],
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "model_type": "qwen3_5_moe",
    "num_heads": 16,
    "out_hidden_size": 2048,
    "patch_size": 16
  },
  "vision_end_token_id": 248054,
  "vision_start_token_id": 248053
})";

inline constexpr const char* kDeepseekV3 = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})";

inline constexpr const char* kKimiK2 = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 163584,
  "eos_token_id": 163585,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 131072,
  "model_type": "kimi_k2",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 384,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 64,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 64,
  "num_nextn_predict_layers": 0,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 50000.0,
  "routed_scaling_factor": 2.827,
  "scoring_func": "sigmoid",
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "v_head_dim": 128,
  "vocab_size": 163840
})";

// Kimi-K2.5 without a quantization block (the tests add one).
inline constexpr const char* kKimiK25 = R"({
  "architectures": ["KimiK25ForConditionalGeneration"],
  "model_type": "kimi_k25",
  "media_placeholder_token_id": 163605,
  "pad_token_id": 163839,
  "tie_word_embeddings": false,
  "text_config": {
    "attention_bias": false,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 262144,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 2048,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": true,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
      "beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 4096, "type": "yarn"
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 163840
  },
  "vision_config": {"mm_hidden_size": 1152, "model_type": "kimi_k25_vision"}
})";

inline constexpr const char* kModeloptQuantizationConfig = R"({
  "config_groups": {
    "group_0": {
      "input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
      "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
      "targets": ["Linear"]
    }
  },
  "ignore": ["language_model.lm_head", "language_model.model.layers.*.self_attn*",
             "language_model.model.layers.*.mlp.shared_experts*", "language_model.model.layers.0.mlp*",
             "*.mlp.gate", "vision_tower*"],
  "kv_cache_scheme": {"dynamic": false, "num_bits": 8, "type": "float"},
  "producer": {"name": "modelopt", "version": "0.39.0"},
  "quant_algo": "NVFP4",
  "quant_method": "modelopt"
})";

inline constexpr const char* kHfQuantConfig = R"({
  "producer": {"name": "modelopt", "version": "0.29.0"},
  "quantization": {
    "quant_algo": "NVFP4",
    "kv_cache_quant_algo": null,
    "group_size": 16,
    "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]
  }
})";

// ---------------------------------------------------------------------------------------------
// helpers

inline json parse(const char* text) {
  return json::parse(text);
}

inline ModelConfig parse_config(const json& j,
                                const std::string& source = "/models/x/config.json") {
  return parse_model_config(j, source);
}

// Parses `config` expecting an error of `code` whose message names the source and every word.
inline void expect_config_error(const json& config, ErrorCode code,
                                const std::vector<std::string>& words) {
  const std::string source = "/models/broken/config.json";
  const std::string msg = error_message([&] { parse_model_config(config, source); }, code);
  EXPECT_THAT(msg, StartsWith(source)) << config.dump();
  for (const std::string& w : words) EXPECT_THAT(msg, HasSubstr(w)) << config.dump();
}

// parse(to_json(c)) == c, and serialising again gives the same JSON.
inline void expect_round_trip(const ModelConfig& config) {
  const json written = model_config_to_json(config);
  const ModelConfig again = parse_model_config(written, "round-trip");
  EXPECT_TRUE(again == config) << written.dump(2);
  EXPECT_EQ(model_config_to_json(again), written);
}

}  // namespace moelora::io::hf_config_test
