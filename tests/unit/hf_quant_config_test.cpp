// Quantization configs (src/io/hf_quant_config.cpp): FP8 block-wise and ModelOpt NVFP4 in
// config.json's quantization_config and in the legacy hf_quant_config.json, the methods and
// variants that are refused, and the module exclusion rules.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/hf_config.h"
#include "support/test_support.h"
#include "unit/hf_config_fixtures.h"

namespace moelora::io {
namespace {

using namespace hf_config_test;  // json, the gmock matchers, error_message

TEST(HfConfigQuant, Fp8Variants) {
  json j = parse(kQwen3_30B_A3B);
  j["quantization_config"] = {{"quant_method", "fp8"},
                              {"activation_scheme", "dynamic"},
                              {"weight_block_size", {128, 128}},
                              {"modules_to_not_convert", {"lm_head", "model.layers.0.mlp.gate"}},
                              {"ignored_layers", {"model.embed_tokens"}},
                              {"scale_fmt", "ue8m0"}};
  const ModelConfig c = parse_config(j);
  EXPECT_EQ(c.quant.method, QuantMethod::kFp8Block);
  EXPECT_EQ(c.quant.scale_fmt, "ue8m0");
  EXPECT_EQ(c.quant.modules_to_not_convert,
            (std::vector<std::string>{"lm_head", "model.layers.0.mlp.gate", "model.embed_tokens"}));
  EXPECT_TRUE(c.quant.is_excluded("model.layers.0.mlp.gate"));
  EXPECT_FALSE(c.quant.is_excluded("model.layers.1.mlp.gate"));
  EXPECT_FALSE(c.quant.is_excluded("model.layers.0.mlp.gate_proj"));
  expect_round_trip(c);

  j["quantization_config"]["scale_fmt"] =
      "float";  // FineGrainedFP8Config's default = plain fp32 scales
  EXPECT_EQ(parse_config(j).quant.scale_fmt, "");

  auto with = [&](const char* key, const json& value) {
    json k = j;
    k["quantization_config"][key] = value;
    return k;
  };
  expect_config_error(with("weight_block_size", {64, 64}), ErrorCode::kUnsupported,
                      {"quantization_config.weight_block_size", "[64,64]", "[128, 128]"});
  expect_config_error(with("weight_block_size", nullptr), ErrorCode::kUnsupported,
                      {"weight_block_size", "per-tensor FP8"});
  expect_config_error(with("fmt", "e5m2"), ErrorCode::kUnsupported,
                      {"quantization_config.fmt", "e5m2"});
  expect_config_error(with("activation_scheme", "static"), ErrorCode::kUnsupported, {"static"});
  expect_config_error(with("scale_fmt", "e4m3"), ErrorCode::kUnsupported, {"scale_fmt", "ue8m0"});
  expect_config_error(with("modules_to_not_convert", "lm_head"), ErrorCode::kInvalidFile,
                      {"modules_to_not_convert", "list of strings"});
}

TEST(HfConfigQuant, OtherMethodsAreUnsupported) {
  for (const char* method : {"awq", "gptq", "compressed-tensors", "bitsandbytes", "mxfp4"}) {
    json j = parse(kQwen3_30B_A3B);
    j["quantization_config"] = {{"quant_method", method}, {"bits", 4}};
    expect_config_error(j, ErrorCode::kUnsupported, {std::string("\"") + method + "\""});
  }
  json j = parse(kQwen3_30B_A3B);
  j["quantization_config"] = parse(kModeloptQuantizationConfig);
  j["quantization_config"]["quant_algo"] = "MIXED_PRECISION";
  expect_config_error(j, ErrorCode::kUnsupported,
                      {"quantization_config.quant_algo", "MIXED_PRECISION", "NVFP4"});
  j["quantization_config"]["quant_algo"] = "NVFP4";
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32;
  expect_config_error(j, ErrorCode::kUnsupported, {"group size is 32", "16"});
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16;
  j["quantization_config"]["kv_cache_scheme"]["num_bits"] = 4;
  expect_config_error(j, ErrorCode::kUnsupported, {"kv_cache_scheme", "4-bit"});
  j["quantization_config"].erase("quant_method");
  expect_config_error(j, ErrorCode::kInvalidFile,
                      {"missing field 'quantization_config.quant_method'"});
}

// fuzz/fuzz_hf_config's first finding, verbatim: a number too large for a double made nlohmann
// throw out_of_range (406), which is not a parse_error and escaped load_model_config. Any JSON
// exception is kInvalidFile naming the file.

TEST(HfConfigQuant, ModeloptLegacyHfQuantConfigFile) {
  test::TempDir dir;
  test::write_text_file(dir / "config.json", kQwen3_30B_A3B);
  test::write_text_file(dir / "hf_quant_config.json", kHfQuantConfig);
  const ModelConfig c = load_model_config(dir.path());
  EXPECT_EQ(c.quant.method, QuantMethod::kNvfp4);
  EXPECT_EQ(c.quant.group_size, 16);
  EXPECT_EQ(c.quant.kv_cache_quant_algo, "");
  EXPECT_EQ(c.quant.source, "hf_quant_config.json");
  EXPECT_TRUE(c.quant.is_excluded("lm_head"));
  EXPECT_TRUE(c.quant.is_excluded("model.layers.17.mlp.gate"));
  EXPECT_TRUE(c.quant.is_excluded("model.layers.17.self_attn.q_proj"));
  EXPECT_FALSE(c.quant.is_excluded("model.layers.17.mlp.experts.0.gate_proj"));

  // Writing it back as hf_quant_config.json and reading gives the same QuantConfig.
  const QuantConfig again = parse_hf_quant_config(hf_quant_config_to_json(c.quant), "written");
  EXPECT_TRUE(again == c.quant);
  // The same quantization inside config.json compares equal too (source is not compared).
  const ModelConfig in_config = parse_config(model_config_to_json(c));
  EXPECT_EQ(in_config.quant.source, "config.json");
  EXPECT_TRUE(in_config == c);

  // kv_cache_quant_algo FP8; a conflicting method in config.json
  json hq = parse(kHfQuantConfig);
  hq["quantization"]["kv_cache_quant_algo"] = "FP8";
  test::write_text_file(dir / "hf_quant_config.json", hq.dump());
  EXPECT_EQ(load_model_config(dir.path()).quant.kv_cache_quant_algo, "FP8");
  EXPECT_EQ(hf_quant_config_to_json(
                load_model_config(dir.path()).quant)["quantization"]["kv_cache_quant_algo"],
            "FP8");
  test::write_text_file(dir / "config.json", kDeepseekV3);  // FP8 block in config.json
  EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kInvalidFile),
              AllOf(StartsWith((dir / "config.json").string()), HasSubstr("fp8-block"),
                    HasSubstr("nvfp4"), HasSubstr("hf_quant_config.json")));

  // unsupported algorithms in the legacy file
  test::write_text_file(dir / "config.json", kQwen3_30B_A3B);
  for (const json& algo : {json("FP8"), json("W4A16_NVFP4"), json(nullptr)}) {
    hq["quantization"]["quant_algo"] = algo;
    test::write_text_file(dir / "hf_quant_config.json", hq.dump());
    EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kUnsupported),
                AllOf(StartsWith((dir / "hf_quant_config.json").string()),
                      HasSubstr("quantization.quant_algo")));
  }
  test::write_text_file(dir / "hf_quant_config.json", R"({"producer": {}})");
  EXPECT_THAT(error_message([&] { load_model_config(dir.path()); }, ErrorCode::kInvalidFile),
              HasSubstr("missing field 'quantization'"));
  EXPECT_THAT(
      error_message([&] { hf_quant_config_to_json(QuantConfig{}); }, ErrorCode::kInvalidArgument),
      HasSubstr("NVFP4"));
}

TEST(HfConfigQuant, ExclusionPatterns) {
  QuantConfig q;
  q.modules_to_not_convert = {"lm_head",         "mlp.gate",
                              "model.layers.3",  "model.layers.*.self_attn",
                              "*shared_expert*", "model.layers.11."};
  // exact, and as a trailing run of components
  EXPECT_TRUE(q.is_excluded("lm_head"));
  EXPECT_TRUE(q.is_excluded("language_model.lm_head"));
  EXPECT_FALSE(q.is_excluded("lm_head_extra"));
  EXPECT_TRUE(q.is_excluded("model.layers.0.mlp.gate"));
  EXPECT_FALSE(q.is_excluded("model.layers.0.mlp.gate_proj"));
  EXPECT_FALSE(q.is_excluded("model.layers.0.xmlp.gate"));
  // module prefix (an ancestor)
  EXPECT_TRUE(q.is_excluded("model.layers.3"));
  EXPECT_TRUE(q.is_excluded("model.layers.3.mlp.experts.7.up_proj"));
  EXPECT_FALSE(q.is_excluded("model.layers.30.mlp.experts.7.up_proj"));
  EXPECT_TRUE(q.is_excluded("model.layers.11.self_attn.o_proj"));  // trailing '.' ignored
  EXPECT_FALSE(q.is_excluded("model.layers.110.mlp.down_proj"));
  // wildcards, '*' crossing dots
  EXPECT_TRUE(q.is_excluded("model.layers.17.self_attn.q_proj"));
  EXPECT_TRUE(q.is_excluded("model.layers.17.mlp.shared_expert.down_proj"));
  EXPECT_TRUE(q.is_excluded("model.layers.17.mlp.shared_expert_gate"));
  EXPECT_FALSE(q.is_excluded("model.layers.17.mlp.experts.2.down_proj"));
  EXPECT_FALSE(QuantConfig{}.is_excluded("lm_head"));
  QuantConfig glob;
  glob.modules_to_not_convert = {"model.layers.*.mlp.gate", "*.q_a_proj"};
  EXPECT_TRUE(glob.is_excluded("model.layers.60.mlp.gate"));
  EXPECT_FALSE(glob.is_excluded("model.layers.60.mlp.gate_proj"));
  EXPECT_TRUE(glob.is_excluded("model.layers.2.self_attn.q_a_proj"));
  EXPECT_FALSE(glob.is_excluded("model.layers.2.self_attn.q_a_proj_x"));
}

}  // namespace
}  // namespace moelora::io
