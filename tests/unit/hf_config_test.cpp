// config.json parsing (src/io/hf_config.h) for every supported family, from hand-written copies
// of the published configs (hf_config_fixtures.h): Qwen3-30B-A3B, Qwen3.5-35B-A3B (VLM with
// text_config), DeepSeek-V3 (legacy rope_scaling, FP8), Kimi-K2 and Kimi-K2.5; the errors
// (missing field, wrong type, unsupported values, router constraints, malformed JSON); and
// parse(model_config_to_json(c)) == c for each family. The quantization configs:
// hf_quant_config_test.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>

#include "io/hf_config.h"
#include "support/test_support.h"
#include "unit/hf_config_fixtures.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using test::error_message;
using ::testing::StartsWith;
using namespace hf_config_test;

// ---------------------------------------------------------------------------------------------
// families

TEST(HfConfigQwen3Moe, Qwen3_30B_A3B) {
  const ModelConfig c = parse_config(parse(kQwen3_30B_A3B));
  EXPECT_EQ(c.arch, Architecture::kQwen3Moe);
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.text_model_type, "qwen3_moe");
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_EQ(c.lm_head_name, "lm_head");
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.norm_style, NormStyle::kWeight);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  EXPECT_EQ(c.bos_token_id, 151643);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.qk_head_dim(), 128);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.attention_output_gate);
  EXPECT_FALSE(c.use_mla);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.partial_rotary_factor, 1.0);
  EXPECT_EQ(c.rope.yarn_attention_factor(), 1.0);
  EXPECT_EQ(c.rotary_dim(), 128);
  EXPECT_EQ(c.rope_style, RopeStyle::kRotateHalf);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);  // Qwen3-MoE has no shared expert
  EXPECT_FALSE(c.shared_expert_gate);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.router, RouterKind::kSoftmaxTopK);
  EXPECT_EQ(c.quant.method, QuantMethod::kNone);
  for (int64_t layer = 0; layer < 48; ++layer) EXPECT_TRUE(c.is_moe_layer(layer)) << layer;
  EXPECT_THROW(c.is_moe_layer(48), Error);
  EXPECT_THROW(c.is_moe_layer(-1), Error);
  expect_round_trip(c);
}

TEST(HfConfigQwen3Moe, DefaultsWhenFieldsAreAbsent) {
  json j = parse(kQwen3_30B_A3B);
  for (const char* key : {"head_dim", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                          "rms_norm_eps", "tie_word_embeddings", "rope_theta", "max_position_embeddings",
                          "bos_token_id", "eos_token_id", "torch_dtype"}) {
    j.erase(key);
  }
  j["num_local_experts"] = j["num_experts"];  // the alias
  j.erase("num_experts");
  const ModelConfig c = parse_config(j);
  EXPECT_EQ(c.head_dim, 2048 / 32);  // hidden / heads
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope.theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.dtype, "");
  EXPECT_EQ(c.num_experts, 128);
  expect_round_trip(c);
}

TEST(HfConfigQwen3Moe, SparseStepAndDenseLayers) {
  json j = parse(kQwen3_30B_A3B);
  j["num_hidden_layers"] = 7;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  j["eos_token_id"] = {151645, 151643};
  const ModelConfig c = parse_config(j);
  // MoE when (i + 1) % 2 == 0 and i not in [3]
  const std::vector<bool> expected = {false, true, false, false, false, true, false};
  for (int64_t layer = 0; layer < 7; ++layer) EXPECT_EQ(c.is_moe_layer(layer), expected[layer]) << layer;
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  expect_round_trip(c);
  // dense layers need intermediate_size
  j.erase("intermediate_size");
  expect_config_error(j, ErrorCode::kInvalidFile, {"intermediate_size must be positive", "dense MLP"});
}

TEST(HfConfigQwen35Moe, Qwen35_35B_A3B_Vlm) {
  const ModelConfig c = parse_config(parse(kQwen35_35B_A3B));
  EXPECT_EQ(c.arch, Architecture::kQwen35Moe);
  EXPECT_EQ(c.model_type, "qwen3_5_moe");
  EXPECT_EQ(c.text_model_type, "qwen3_5_moe_text");
  EXPECT_EQ(c.weight_prefix, "model.language_model.");
  EXPECT_EQ(c.lm_head_name, "lm_head");
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 40);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.attention_output_gate);
  EXPECT_EQ(c.norm_style, NormStyle::kOnePlusWeight);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{248044});
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_EQ(c.rope.theta, 1e7);
  EXPECT_EQ(c.rope.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rope.mrope_section, (std::vector<int>{11, 11, 10}));
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c.shared_expert_gate);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_TRUE(c.norm_topk_prob);  // the router always renormalizes
  EXPECT_EQ(c.router, RouterKind::kSoftmaxTopK);
  ASSERT_EQ(c.layer_types.size(), 40u);
  for (int64_t i = 0; i < 40; ++i) {
    EXPECT_EQ(c.layer_types[i], (i + 1) % 4 == 0 ? "full_attention" : "linear_attention") << i;
    EXPECT_TRUE(c.is_moe_layer(i));
  }
  EXPECT_EQ(c.linear_attention.conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_attention.key_head_dim, 128);
  EXPECT_EQ(c.linear_attention.value_head_dim, 128);
  EXPECT_EQ(c.linear_attention.num_key_heads, 16);
  EXPECT_EQ(c.linear_attention.num_value_heads, 32);
  expect_round_trip(c);
}

TEST(HfConfigQwen35Moe, TextOnlyConfigDerivesLayerTypesAndPartialRotaryDefault) {
  json j = parse(kQwen35_35B_A3B)["text_config"];
  j.erase("layer_types");
  j["full_attention_interval"] = 3;
  j["num_hidden_layers"] = 7;
  j["rope_parameters"].erase("partial_rotary_factor");  // Qwen3.5 defaults to 0.25
  j["norm_topk_prob"] = false;                          // not a Qwen3.5 field: ignored
  const ModelConfig c = parse_config(j);
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{"linear_attention", "linear_attention", "full_attention",
                                                     "linear_attention", "linear_attention", "full_attention",
                                                     "linear_attention"}));
  EXPECT_EQ(c.rope.partial_rotary_factor, 0.25);
  EXPECT_TRUE(c.norm_topk_prob);
  expect_round_trip(c);
  j.erase("full_attention_interval");  // default 4
  EXPECT_EQ(parse_config(j).layer_types[3], "full_attention");
  EXPECT_EQ(parse_config(j).layer_types[2], "linear_attention");
}

TEST(HfConfigDeepseekV3, DeepseekV3WithLegacyYarnAndFp8) {
  const ModelConfig c = parse_config(parse(kDeepseekV3));
  EXPECT_EQ(c.arch, Architecture::kDeepseekV3);
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.num_key_value_heads, 128);
  EXPECT_TRUE(c.use_mla);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.head_dim, 64);  // = qk_rope_head_dim, the RoPE width
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.rope_style, RopeStyle::kInterleaved);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.shared_expert_intermediate_size, 2048);  // 1 shared expert x 2048
  EXPECT_FALSE(c.shared_expert_gate);
  EXPECT_EQ(c.router, RouterKind::kSigmoidNoauxTc);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
  for (int64_t layer = 0; layer < 61; ++layer) EXPECT_EQ(c.is_moe_layer(layer), layer >= 3) << layer;
  // RoPE: legacy rope_theta + rope_scaling {type: yarn}
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_EQ(c.rope.theta, 10000.0);
  EXPECT_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.rope.beta_fast, 32.0);
  EXPECT_EQ(c.rope.beta_slow, 1.0);
  EXPECT_EQ(c.rope.mscale, 1.0);
  EXPECT_EQ(c.rope.mscale_all_dim, 1.0);
  EXPECT_FALSE(c.rope.attention_factor.has_value());
  EXPECT_TRUE(c.rope.truncate);
  EXPECT_DOUBLE_EQ(c.rope.yarn_attention_factor(), 1.0);  // mscale == mscale_all_dim
  // FP8 block quantization
  EXPECT_EQ(c.quant.method, QuantMethod::kFp8Block);
  EXPECT_EQ(c.quant.block_n, 128);
  EXPECT_EQ(c.quant.block_k, 128);
  EXPECT_EQ(c.quant.activation_scheme, "dynamic");
  EXPECT_EQ(c.quant.scale_fmt, "");
  EXPECT_EQ(c.quant.source, "config.json");
  EXPECT_TRUE(c.quant.modules_to_not_convert.empty());
  expect_round_trip(c);
}

TEST(HfConfigDeepseekV3, RopeParametersFormEqualsTheLegacyForm) {
  json legacy = parse(kDeepseekV3);
  json v5 = legacy;
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0},
                           {"factor", 40.0},      {"original_max_position_embeddings", 4096},
                           {"beta_fast", 32.0},   {"beta_slow", 1.0},
                           {"mscale", 1.0},       {"mscale_all_dim", 1.0}};
  EXPECT_TRUE(parse_config(legacy) == parse_config(v5));
  // "rope_type" instead of "type" in the legacy dict
  legacy["rope_scaling"].erase("type");
  legacy["rope_scaling"]["rope_type"] = "yarn";
  EXPECT_TRUE(parse_config(legacy) == parse_config(v5));
}

TEST(HfConfigDeepseekV3, YarnDefaultsAndAttentionFactor) {
  json j = parse(kDeepseekV3);
  j["rope_scaling"] = {{"type", "yarn"},
                       {"factor", 40},
                       {"mscale", 0.707},
                       {"mscale_all_dim", 1.0},
                       {"original_max_position_embeddings", 4096}};
  ModelConfig c = parse_config(j);
  const double m = 0.1 * std::log(40.0);
  EXPECT_DOUBLE_EQ(c.rope.yarn_attention_factor(), (0.707 * m + 1) / (m + 1));
  // only mscale_all_dim: transformers falls back to get_mscale(factor)
  j["rope_scaling"].erase("mscale");
  c = parse_config(j);
  EXPECT_DOUBLE_EQ(c.rope.yarn_attention_factor(), m + 1);
  // explicit attention_factor wins
  j["rope_scaling"]["attention_factor"] = 0.5;
  EXPECT_EQ(parse_config(j).rope.yarn_attention_factor(), 0.5);
  // no factor: max_position_embeddings / original; no original: max_position_embeddings
  j["rope_scaling"] = {{"type", "yarn"}, {"original_max_position_embeddings", 4096}};
  EXPECT_EQ(parse_config(j).rope.factor, 40.0);
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.0}};
  EXPECT_EQ(parse_config(j).rope.original_max_position_embeddings, 163840);
  EXPECT_EQ(parse_config(j).rope.beta_fast, 32.0);
  EXPECT_EQ(RopeConfig::yarn_get_mscale(1.0, 5.0), 1.0);
}

TEST(HfConfigDeepseekV3, NullsAndDefaults) {
  json j = parse(kDeepseekV3);
  j["q_lora_rank"] = nullptr;
  j["n_group"] = nullptr;
  j["topk_group"] = nullptr;
  j["rope_interleave"] = false;
  j["moe_layer_freq"] = 2;
  j["first_k_dense_replace"] = 1;
  j.erase("num_key_value_heads");
  j.erase("bos_token_id");
  j.erase("eos_token_id");
  j.erase("scoring_func");
  j.erase("topk_method");
  j.erase("quantization_config");
  const ModelConfig c = parse_config(j);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.rope_style, RopeStyle::kRotateHalf);
  EXPECT_EQ(c.num_key_value_heads, 128);
  EXPECT_EQ(c.bos_token_id, 0);  // DeepseekV3Config's defaults
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
  EXPECT_EQ(c.quant.method, QuantMethod::kNone);
  // layers >= 1 and even
  for (int64_t layer = 0; layer < 8; ++layer) {
    EXPECT_EQ(c.is_moe_layer(layer), layer >= 1 && layer % 2 == 0) << layer;
  }
  expect_round_trip(c);
  // class defaults for absent router fields
  j.erase("n_group");
  j.erase("topk_group");
  j.erase("routed_scaling_factor");
  j.erase("first_k_dense_replace");
  j.erase("norm_topk_prob");
  const ModelConfig d = parse_config(j);
  EXPECT_EQ(d.n_group, 8);
  EXPECT_EQ(d.topk_group, 4);
  EXPECT_EQ(d.routed_scaling_factor, 2.5);
  EXPECT_EQ(d.first_k_dense_replace, 3);
  EXPECT_TRUE(d.norm_topk_prob);
  // shared experts: n_shared_experts 0 / null = none, and the field must be there
  j["n_shared_experts"] = 2;
  EXPECT_EQ(parse_config(j).shared_expert_intermediate_size, 4096);
  j["n_shared_experts"] = nullptr;
  EXPECT_EQ(parse_config(j).shared_expert_intermediate_size, 0);
  j.erase("n_shared_experts");
  expect_config_error(j, ErrorCode::kInvalidFile, {"missing field 'n_shared_experts'"});
  j = parse(kDeepseekV3);
  j.erase("q_lora_rank");
  expect_config_error(j, ErrorCode::kInvalidFile, {"missing field 'q_lora_rank'"});
}

TEST(HfConfigKimi, KimiK2) {
  const ModelConfig c = parse_config(parse(kKimiK2));
  EXPECT_EQ(c.arch, Architecture::kDeepseekV3);
  EXPECT_EQ(c.model_type, "kimi_k2");
  EXPECT_EQ(c.text_model_type, "kimi_k2");
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_experts, 384);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.routed_scaling_factor, 2.827);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.router, RouterKind::kSigmoidNoauxTc);
  EXPECT_EQ(c.rope.theta, 50000.0);
  EXPECT_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.rope.beta_fast, 1.0);
  EXPECT_EQ(c.rope.beta_slow, 1.0);
  EXPECT_EQ(c.bos_token_id, 163584);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{163585});
  EXPECT_EQ(c.quant.method, QuantMethod::kFp8Block);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  expect_round_trip(c);
}

TEST(HfConfigKimi, KimiK25WithTextConfigAndModeloptNvfp4) {
  json j = parse(kKimiK25);
  j["quantization_config"] = parse(kModeloptQuantizationConfig);
  const ModelConfig c = parse_config(j);
  EXPECT_EQ(c.arch, Architecture::kDeepseekV3);
  EXPECT_EQ(c.model_type, "kimi_k25");
  EXPECT_EQ(c.text_model_type, "kimi_k2");
  EXPECT_EQ(c.weight_prefix, "language_model.model.");
  EXPECT_EQ(c.lm_head_name, "language_model.lm_head");
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope.factor, 64.0);
  EXPECT_EQ(c.num_experts, 384);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.quant.method, QuantMethod::kNvfp4);
  EXPECT_EQ(c.quant.group_size, 16);
  EXPECT_EQ(c.quant.kv_cache_quant_algo, "FP8");
  EXPECT_EQ(c.quant.source, "config.json");
  EXPECT_EQ(c.quant.modules_to_not_convert.size(), 6u);
  EXPECT_TRUE(c.quant.is_excluded("language_model.lm_head"));
  EXPECT_TRUE(c.quant.is_excluded("language_model.model.layers.5.self_attn.kv_b_proj"));
  EXPECT_TRUE(c.quant.is_excluded("language_model.model.layers.0.mlp.down_proj"));
  EXPECT_TRUE(c.quant.is_excluded("language_model.model.layers.7.mlp.gate"));
  EXPECT_FALSE(c.quant.is_excluded("language_model.model.layers.7.mlp.experts.3.down_proj"));
  EXPECT_FALSE(c.quant.is_excluded("language_model.model.layers.10.mlp.down_proj"));
  expect_round_trip(c);

  // text model_type deepseek_v3 (or absent, Kimi_K25Config's default) works the same way
  j["text_config"]["model_type"] = "deepseek_v3";
  EXPECT_EQ(parse_config(j).text_model_type, "deepseek_v3");
  j["text_config"].erase("model_type");
  EXPECT_EQ(parse_config(j).text_model_type, "deepseek_v3");
  j["text_config"]["model_type"] = "qwen3_moe";
  expect_config_error(j, ErrorCode::kUnsupported, {"text_config.model_type", "qwen3_moe", "kimi_k2"});
  j.erase("text_config");
  expect_config_error(j, ErrorCode::kInvalidFile, {"missing field 'text_config'"});
}

TEST(HfConfigKimi, KimiK25OriginalInt4IsUnsupported) {
  json j = parse(kKimiK25);
  j["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"format", "pack-quantized"}};
  expect_config_error(j, ErrorCode::kUnsupported,
                      {"quantization_config.quant_method", "compressed-tensors", "fp8", "modelopt"});
}

TEST(HfConfigFile, NumberOverflowIsInvalidJson) {
  test::TempDir dir;
  test::write_text_file(dir / "config.json", R"FUZZ({
  "architectures": [ 
   "Qwen3MoeForCausalLM"
  ],
  "attention_bias": false,
  "att#ntio`_dropout": 333333333333333333333333333333333333333E36666666666666660.0,
  "bos_token_id": 0,
  "de+cid_experts": 8
}
)FUZZ");
  EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kInvalidFile),
              AllOf(StartsWith((dir / "config.json").string()), HasSubstr("not valid JSON"),
                    HasSubstr("number overflow")));
}

// ---------------------------------------------------------------------------------------------
// errors

TEST(HfConfigErrors, MissingFieldNamesTheFieldAndTheFile) {
  json j = parse(kQwen3_30B_A3B);
  j.erase("hidden_size");
  expect_config_error(j, ErrorCode::kInvalidFile, {"missing field 'hidden_size'"});
  j = parse(kQwen35_35B_A3B);
  j["text_config"].erase("num_experts");
  expect_config_error(j, ErrorCode::kInvalidFile, {"missing field 'text_config.num_experts'"});
  j = parse(kQwen35_35B_A3B);
  j["text_config"].erase("linear_num_value_heads");
  expect_config_error(j, ErrorCode::kInvalidFile, {"'text_config.linear_num_value_heads'"});
  j = parse(kDeepseekV3);
  j.erase("kv_lora_rank");
  expect_config_error(j, ErrorCode::kInvalidFile, {"missing field 'kv_lora_rank'"});
  j = parse(kQwen3_30B_A3B);
  j.erase("model_type");
  expect_config_error(j, ErrorCode::kInvalidFile, {"missing field 'model_type'"});
  j = parse(kQwen3_30B_A3B);
  j["vocab_size"] = nullptr;  // null counts as missing
  expect_config_error(j, ErrorCode::kInvalidFile, {"missing field 'vocab_size'"});
}

TEST(HfConfigErrors, WrongTypes) {
  auto with = [](const char* base, const char* key, const json& value) {
    json j = parse(base);
    j[key] = value;
    return j;
  };
  expect_config_error(with(kQwen3_30B_A3B, "hidden_size", "2048"), ErrorCode::kInvalidFile,
                      {"field 'hidden_size' must be an integer", "\"2048\""});
  expect_config_error(with(kQwen3_30B_A3B, "hidden_size", 2048.5), ErrorCode::kInvalidFile,
                      {"'hidden_size' must be an integer", "2048.5"});
  expect_config_error(with(kQwen3_30B_A3B, "norm_topk_prob", 1), ErrorCode::kInvalidFile,
                      {"'norm_topk_prob' must be true or false"});
  expect_config_error(with(kQwen3_30B_A3B, "rms_norm_eps", "1e-6"), ErrorCode::kInvalidFile,
                      {"'rms_norm_eps' must be a number"});
  expect_config_error(with(kQwen3_30B_A3B, "mlp_only_layers", {1, "2"}), ErrorCode::kInvalidFile,
                      {"'mlp_only_layers' must be a list of integers"});
  expect_config_error(with(kQwen3_30B_A3B, "eos_token_id", "</s>"), ErrorCode::kInvalidFile,
                      {"'eos_token_id' must be a list of integers"});
  expect_config_error(with(kQwen3_30B_A3B, "model_type", 3), ErrorCode::kInvalidFile,
                      {"'model_type' must be a string"});
  expect_config_error(with(kQwen3_30B_A3B, "rope_scaling", "yarn"), ErrorCode::kInvalidFile,
                      {"'rope_scaling' must be an object"});
  expect_config_error(with(kQwen3_30B_A3B, "hidden_size", 18446744073709551615ull), ErrorCode::kInvalidFile,
                      {"within int64"});
  expect_config_error(with(kQwen35_35B_A3B, "text_config", {1, 2}), ErrorCode::kInvalidFile,
                      {"'text_config' must be an object"});
  json j = parse(kQwen3_30B_A3B);
  j["num_local_experts"] = 64;  // alias disagreeing with num_experts
  expect_config_error(j, ErrorCode::kInvalidFile,
                      {"'num_experts' (128)", "'num_local_experts' (64)", "disagree"});
  expect_config_error(json::array({1}), ErrorCode::kInvalidFile, {"expected a JSON object"});
}

TEST(HfConfigErrors, UnsupportedModelTypeAndFeatures) {
  json j = parse(kQwen3_30B_A3B);
  j["model_type"] = "llama";
  expect_config_error(
      j, ErrorCode::kUnsupported,
      {"model_type \"llama\"", "qwen3_moe", "qwen3_5_moe", "deepseek_v3", "kimi_k2", "kimi_k25"});
  j = parse(kQwen3_30B_A3B);
  j["use_sliding_window"] = true;
  expect_config_error(j, ErrorCode::kUnsupported, {"use_sliding_window"});
  j = parse(kQwen3_30B_A3B);
  j["attention_bias"] = true;
  expect_config_error(j, ErrorCode::kUnsupported, {"attention_bias"});
  j = parse(kQwen3_30B_A3B);
  j["hidden_act"] = "gelu";
  expect_config_error(j, ErrorCode::kUnsupported, {"hidden_act", "gelu"});
  j = parse(kDeepseekV3);
  j["scoring_func"] = "softmax";
  expect_config_error(j, ErrorCode::kUnsupported, {"scoring_func", "softmax", "sigmoid"});
  j = parse(kDeepseekV3);
  j["topk_method"] = "group_limited_greedy";
  expect_config_error(j, ErrorCode::kUnsupported, {"topk_method", "group_limited_greedy", "noaux_tc"});
  j = parse(kQwen35_35B_A3B);
  j["text_config"]["attn_output_gate"] = false;
  expect_config_error(j, ErrorCode::kUnsupported, {"text_config.attn_output_gate"});
  j = parse(kQwen35_35B_A3B);
  j["text_config"]["model_type"] = "qwen3_next";
  expect_config_error(j, ErrorCode::kUnsupported, {"text_config.model_type", "qwen3_next"});
  j = parse(kQwen35_35B_A3B);
  j["text_config"]["layer_types"][5] = "sliding_attention";
  expect_config_error(j, ErrorCode::kUnsupported, {"layer_types[5]", "sliding_attention"});
}

TEST(HfConfigErrors, UnsupportedRopeTypes) {
  for (const char* type : {"dynamic", "longrope", "llama3", "linear"}) {
    json j = parse(kQwen3_30B_A3B);
    j["rope_scaling"] = {{"type", type}, {"factor", 2.0}};
    expect_config_error(j, ErrorCode::kUnsupported, {"'rope_scaling.type'", type, "default, yarn"});
    j.erase("rope_scaling");
    j["rope_parameters"] = {{"rope_type", type}, {"rope_theta", 1e6}, {"factor", 2.0}};
    expect_config_error(j, ErrorCode::kUnsupported, {"'rope_parameters.rope_type'", type});
  }
  json j = parse(kQwen3_30B_A3B);
  j["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}}}};
  expect_config_error(j, ErrorCode::kUnsupported, {"rope_parameters.full_attention", "per-layer-type"});
  j = parse(kQwen3_30B_A3B);
  j["partial_rotary_factor"] = 1.5;
  expect_config_error(j, ErrorCode::kInvalidFile, {"partial_rotary_factor must be in (0, 1]", "1.5"});
  j["partial_rotary_factor"] = 0.3;  // 128 * 0.3 = 38.4 -> 38, even: fine
  EXPECT_EQ(parse_config(j).rotary_dim(), 38);
  j["partial_rotary_factor"] = 0.29;  // 37: odd
  expect_config_error(j, ErrorCode::kInvalidFile, {"rotary width", "37", "even"});
  j = parse(kQwen35_35B_A3B);
  j["text_config"]["rope_parameters"]["mrope_section"] = {11, 11, 11};
  expect_config_error(j, ErrorCode::kInvalidFile, {"mrope_section sums to 33", "64"});
}

TEST(HfConfigErrors, RouterAndHeadConstraints) {
  auto deepseek_with = [](std::initializer_list<std::pair<const char*, json>> changes) {
    json j = parse(kDeepseekV3);
    for (const auto& [key, value] : changes) j[key] = value;
    return j;
  };
  expect_config_error(deepseek_with({{"n_group", 7}}), ErrorCode::kInvalidFile,
                      {"n_routed_experts 256 is not divisible by n_group 7"});
  expect_config_error(deepseek_with({{"n_group", 256}, {"topk_group", 8}}), ErrorCode::kInvalidFile,
                      {"256 / n_group 256 = 1 experts per group", "at least 2"});
  expect_config_error(deepseek_with({{"n_group", 64}, {"topk_group", 1}}), ErrorCode::kInvalidFile,
                      {"topk_group 1 groups of 4 experts hold fewer than num_experts_per_tok 8"});
  expect_config_error(deepseek_with({{"topk_group", 9}}), ErrorCode::kInvalidFile,
                      {"topk_group 9", "n_group 8"});
  expect_config_error(deepseek_with({{"n_routed_experts", 4}, {"n_group", 1}, {"topk_group", 1}}),
                      ErrorCode::kInvalidFile, {"num_experts_per_tok 8 exceeds the number of experts 4"});
  expect_config_error(deepseek_with({{"routed_scaling_factor", 0}}), ErrorCode::kInvalidFile,
                      {"routed_scaling_factor must be positive"});
  expect_config_error(deepseek_with({{"first_k_dense_replace", 62}}), ErrorCode::kInvalidFile,
                      {"first_k_dense_replace 62"});
  expect_config_error(deepseek_with({{"qk_rope_head_dim", 0}}), ErrorCode::kInvalidFile,
                      {"qk_rope_head_dim must be positive, got 0"});
  expect_config_error(deepseek_with({{"moe_layer_freq", 0}}), ErrorCode::kInvalidFile, {"moe_layer_freq"});
  // Exactly at the limits is fine: 8 groups of 32, top-1 group holds 32 >= 8.
  EXPECT_NO_THROW(parse_config(deepseek_with({{"topk_group", 1}})));

  json j = parse(kQwen3_30B_A3B);
  j["num_key_value_heads"] = 5;
  expect_config_error(j, ErrorCode::kInvalidFile,
                      {"num_attention_heads 32 is not divisible by num_key_value_heads 5"});
  j = parse(kQwen3_30B_A3B);
  j["num_experts_per_tok"] = 129;
  expect_config_error(j, ErrorCode::kInvalidFile,
                      {"num_experts_per_tok 129 exceeds the number of experts 128"});
  j = parse(kQwen3_30B_A3B);
  j["hidden_size"] = -2048;
  expect_config_error(j, ErrorCode::kInvalidFile, {"hidden_size must be positive, got -2048"});
  j = parse(kQwen3_30B_A3B);
  j.erase("head_dim");
  j["hidden_size"] = 2050;
  expect_config_error(j, ErrorCode::kInvalidFile, {"'head_dim' is absent", "2050", "32"});
  j = parse(kQwen3_30B_A3B);
  j["mlp_only_layers"] = {48};
  expect_config_error(j, ErrorCode::kInvalidFile, {"mlp_only_layers entry 48"});
  j = parse(kQwen3_30B_A3B);
  j["decoder_sparse_step"] = 0;
  expect_config_error(j, ErrorCode::kInvalidFile, {"decoder_sparse_step must be >= 1, got 0"});
  j = parse(kQwen3_30B_A3B);
  j["eos_token_id"] = 151936;
  expect_config_error(j, ErrorCode::kInvalidFile, {"eos_token_id 151936", "vocabulary"});
  j = parse(kQwen35_35B_A3B);
  j["text_config"]["layer_types"].erase(0);
  expect_config_error(j, ErrorCode::kInvalidFile, {"layer_types has 39 entries", "num_hidden_layers is 40"});
  j = parse(kQwen35_35B_A3B);
  j["text_config"]["linear_num_value_heads"] = 24;
  expect_config_error(j, ErrorCode::kInvalidFile, {"linear_num_value_heads 24", "linear_num_key_heads 16"});
}

TEST(HfConfigErrors, FilesOnDisk) {
  test::TempDir dir;
  EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kNotFound),
              AllOf(StartsWith((dir / "config.json").string()), HasSubstr("config.json")));
  test::write_text_file(dir / "config.json",
                        "{\n  \"model_type\": \"qwen3_moe\",\n  \"hidden_size\": 2048,,\n}");
  EXPECT_THAT(
      error_message([&] { load_model_config(dir.path()); }, ErrorCode::kInvalidFile),
      AllOf(StartsWith((dir / "config.json").string()), HasSubstr("not valid JSON"), HasSubstr("line 3")));
  // a missing field is reported against the file path
  json j = parse(kQwen3_30B_A3B);
  j.erase("num_hidden_layers");
  test::write_text_file(dir / "config.json", j.dump(2));
  EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kInvalidFile),
              AllOf(StartsWith((dir / "config.json").string()), HasSubstr("'num_hidden_layers'")));
  // the path of config.json itself is accepted too
  test::write_text_file(dir / "config.json", kQwen3_30B_A3B);
  EXPECT_EQ(load_model_config(dir / "config.json").hidden_size, 2048);
  test::write_text_file(dir / "hf_quant_config.json", "{ not json");
  EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kInvalidFile),
              AllOf(StartsWith((dir / "hf_quant_config.json").string()), HasSubstr("line 1")));
}

// ---------------------------------------------------------------------------------------------
// serialization

TEST(HfConfigToJson, WritesTransformersFieldNames) {
  const json q3 = model_config_to_json(parse_config(parse(kQwen3_30B_A3B)));
  EXPECT_EQ(q3["architectures"], json::array({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(q3["model_type"], "qwen3_moe");
  EXPECT_EQ(q3["dtype"], "bfloat16");
  EXPECT_EQ(q3["rope_parameters"], json({{"rope_type", "default"}, {"rope_theta", 1e6}}));
  EXPECT_FALSE(q3.contains("rope_scaling"));
  EXPECT_EQ(q3["num_experts"], 128);
  EXPECT_EQ(q3["eos_token_id"], 151645);

  const json q35 = model_config_to_json(parse_config(parse(kQwen35_35B_A3B)));
  EXPECT_EQ(q35["architectures"], json::array({"Qwen3_5MoeForConditionalGeneration"}));
  EXPECT_EQ(q35["model_type"], "qwen3_5_moe");
  EXPECT_EQ(q35["text_config"]["model_type"], "qwen3_5_moe_text");
  EXPECT_EQ(q35["text_config"]["rope_parameters"]["partial_rotary_factor"], 0.25);
  EXPECT_EQ(q35["text_config"]["rope_parameters"]["mrope_section"], json({11, 11, 10}));
  EXPECT_FALSE(q35["text_config"].contains("tie_word_embeddings"));
  EXPECT_EQ(q35["tie_word_embeddings"], false);

  const json ds = model_config_to_json(parse_config(parse(kDeepseekV3)));
  EXPECT_EQ(ds["architectures"], json::array({"DeepseekV3ForCausalLM"}));
  EXPECT_EQ(ds["n_shared_experts"], 1);
  EXPECT_EQ(ds["q_lora_rank"], 1536);
  EXPECT_EQ(ds["rope_parameters"]["rope_type"], "yarn");
  EXPECT_EQ(ds["rope_parameters"]["factor"], 40.0);
  EXPECT_EQ(ds["quantization_config"]["weight_block_size"], json({128, 128}));

  const json k25 = model_config_to_json(parse_config(parse(kKimiK25)));
  EXPECT_EQ(k25["model_type"], "kimi_k25");
  EXPECT_EQ(k25["text_config"]["model_type"], "kimi_k2");
  EXPECT_EQ(k25["text_config"]["n_routed_experts"], 384);

  ModelConfig odd = parse_config(parse(kDeepseekV3));
  odd.shared_expert_intermediate_size = 3000;
  EXPECT_THAT(error_message([&] { model_config_to_json(odd); }, ErrorCode::kInvalidArgument),
              HasSubstr("n_shared_experts"));
}

TEST(HfConfigToJson, RoundTripThroughDiskForEveryFamily) {
  test::TempDir dir;
  for (const char* fixture : {kQwen3_30B_A3B, kQwen35_35B_A3B, kDeepseekV3, kKimiK2, kKimiK25}) {
    const ModelConfig c = parse_config(parse(fixture));
    SCOPED_TRACE(c.model_type);
    test::write_text_file(dir / "config.json", model_config_to_json(c).dump(2));
    const ModelConfig loaded = load_model_config(dir.path());
    EXPECT_TRUE(loaded == c);
    // a changed field is noticed (the comparison is not vacuous)
    ModelConfig changed = c;
    changed.rope.theta *= 2;
    EXPECT_FALSE(parse_model_config(model_config_to_json(changed), "x") == c);
  }
  // NVFP4 through hf_quant_config.json
  ModelConfig c = parse_config(parse(kQwen3_30B_A3B));
  c.quant = parse_hf_quant_config(parse(kHfQuantConfig), "hf_quant_config.json");
  ModelConfig without_quant = c;
  without_quant.quant = QuantConfig{};
  test::write_text_file(dir / "config.json", model_config_to_json(without_quant).dump(2));
  test::write_text_file(dir / "hf_quant_config.json", hf_quant_config_to_json(c.quant).dump(2));
  EXPECT_TRUE(load_model_config(dir.path()) == c);
}

}  // namespace
}  // namespace moelora::io
