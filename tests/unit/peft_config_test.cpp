// adapter_config.json parsing (src/io/peft.h): the fixtures' fields, list / regex / all-linear
// targets, patterns in dict order, rsLoRA scaling, exclude_modules, layers_to_transform (+
// layers_pattern), target_parameters, and the configs that are refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "io/peft.h"
#include "support/test_support.h"
#include "unit/peft_test_support.h"

namespace moelora::io {
namespace {

using namespace peft_test;  // fs, json, the gmock matchers, error_message

// ---------------------------------------------------------------------------------------------
// adapter_config.json parsing

AdapterConfig parse_text(const test::TempDir& dir, const std::string& text) {
  test::write_text_file(dir / "adapter_config.json", text);
  return parse_adapter_config(dir / "adapter_config.json");
}

TEST(PeftConfig, FixtureFields) {
  const AdapterConfig c =
      parse_adapter_config(parity_dir() / "deepseek_v3" / "lora_peft3d" / "adapter_config.json");
  EXPECT_EQ(c.r, 4);
  EXPECT_EQ(c.lora_alpha, 8);
  EXPECT_FALSE(c.use_rslora);
  EXPECT_EQ(c.target_modules, (std::vector<std::string>{"kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                                        "q_a_proj", "q_b_proj"}));
  EXPECT_EQ(c.target_parameters,
            (std::vector<std::string>{"mlp.experts.down_proj", "mlp.experts.gate_up_proj"}));
  EXPECT_EQ(c.base_model_name_or_path, "../base");
  EXPECT_EQ(c.rank_for("model.layers.1.mlp.experts.down_proj"), 2);
  EXPECT_EQ(c.rank_for("model.layers.1.mlp.experts.gate_up_proj"), 4);
  EXPECT_EQ(c.scaling_for("model.layers.1.mlp.experts.down_proj"), 3.0);
  EXPECT_EQ(c.scaling_for("model.layers.1.mlp.experts.gate_up_proj"), 2.0);
  EXPECT_EQ(c.source, parity_dir() / "deepseek_v3" / "lora_peft3d" / "adapter_config.json");
}

TEST(PeftConfig, ListTargets) {
  test::TempDir dir;
  const AdapterConfig c = parse_text(
      dir,
      R"({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "model.layers.1.mlp.gate_proj"]})");
  EXPECT_FALSE(c.target_modules_regex);
  EXPECT_FALSE(c.target_all_linear);
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(c.targets_module("q_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.k_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.xq_proj"));  // suffixes start at a dot
  EXPECT_TRUE(c.targets_module("model.layers.1.mlp.gate_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.2.mlp.gate_proj"));
  EXPECT_EQ(c.scaling_for("model.layers.0.self_attn.q_proj"), 2.0);
}

TEST(PeftConfig, RegexTargetsMatchTheWholePath) {
  test::TempDir dir;
  const AdapterConfig c =
      parse_text(dir, R"({"target_modules": "model\\.layers\\.[02]\\.self_attn\\.(q|v)_proj"})");
  ASSERT_TRUE(c.target_modules_regex);
  EXPECT_TRUE(c.target_modules.empty());
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(c.targets_module("model.layers.2.self_attn.v_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.q_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.k_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.q_proj.base_layer"));
  EXPECT_FALSE(c.targets_module("xmodel.layers.0.self_attn.q_proj"));
  // PEFT's defaults for absent fields
  EXPECT_EQ(c.r, 8);
  EXPECT_EQ(c.lora_alpha, 8);
}

TEST(PeftConfig, AllLinear) {
  test::TempDir dir;
  const AdapterConfig c = parse_text(dir, R"({"target_modules": "ALL-LINEAR"})");
  EXPECT_TRUE(c.target_all_linear);
  EXPECT_FALSE(c.target_modules_regex);
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(c.targets_module("model.layers.3.mlp.experts.7.down_proj"));
  EXPECT_FALSE(c.targets_module("lm_head"));
}

TEST(PeftConfig, PatternsApplyInDictOrder) {
  test::TempDir dir;
  const std::string o2 = "model.layers.2.self_attn.o_proj";
  AdapterConfig c =
      parse_text(dir, R"({"r": 8, "lora_alpha": 16, "target_modules": ["o_proj", "q_proj"],
      "rank_pattern": {"o_proj": 6, "layers.2.self_attn.o_proj": 2, "layers\\.[13]\\.self_attn\\.q_proj": 3},
      "alpha_pattern": {"layers.0.self_attn.q_proj": 2, "q_proj": 32}})");
  ASSERT_EQ(c.rank_pattern.size(), 3u);
  EXPECT_EQ(c.rank_pattern[0].first, "o_proj");  // file order, not sorted
  EXPECT_EQ(c.rank_pattern[1].first, "layers.2.self_attn.o_proj");
  EXPECT_EQ(c.rank_for(o2), 6);  // the first matching key wins
  EXPECT_EQ(c.rank_pattern_key(o2), std::optional<std::string>("o_proj"));
  EXPECT_EQ(c.rank_for("model.layers.1.self_attn.q_proj"), 3);
  EXPECT_EQ(c.rank_for("model.layers.2.self_attn.q_proj"), 8);
  EXPECT_EQ(c.rank_pattern_key("model.layers.2.self_attn.q_proj"), std::nullopt);
  // rank and alpha keys are looked up independently
  EXPECT_EQ(c.scaling_for("model.layers.0.self_attn.q_proj"), 2.0 / 8);
  EXPECT_EQ(c.scaling_for("model.layers.1.self_attn.q_proj"), 32.0 / 3);
  EXPECT_EQ(c.alpha_pattern_key("model.layers.0.self_attn.q_proj"),
            std::optional<std::string>("layers.0.self_attn.q_proj"));
  EXPECT_EQ(c.scaling_for(o2), 16.0 / 6);

  c = parse_text(dir, R"({"r": 8, "rank_pattern": {"layers.2.self_attn.o_proj": 2, "o_proj": 6}})");
  EXPECT_EQ(c.rank_for(o2), 2);
  EXPECT_EQ(c.rank_for("model.layers.0.self_attn.o_proj"), 6);

  // a key matches whole dotted components at the end only: "proj" is not "o_proj"
  c = parse_text(dir, R"({"r": 8, "rank_pattern": {"proj": 3, "self_attn": 5}})");
  EXPECT_EQ(c.rank_for(o2), 8);
}

TEST(PeftConfig, RsLoraScaling) {
  test::TempDir dir;
  const AdapterConfig c = parse_text(
      dir,
      R"({"r": 16, "lora_alpha": 8, "use_rslora": true, "rank_pattern": {"experts.3.up_proj": 4}})");
  EXPECT_TRUE(c.use_rslora);
  EXPECT_EQ(c.scaling_for("model.layers.0.self_attn.q_proj"), 2.0);        // 8 / sqrt(16)
  EXPECT_EQ(c.scaling_for("model.layers.0.mlp.experts.3.up_proj"), 4.0);   // 8 / sqrt(4)
  EXPECT_EQ(c.scaling_for("model.layers.0.mlp.experts.13.up_proj"), 2.0);  // not expert 3
}

TEST(PeftConfig, ExcludeModules) {
  test::TempDir dir;
  AdapterConfig c = parse_text(
      dir,
      R"({"target_modules": ["q_proj", "o_proj"], "exclude_modules": ["layers.1.self_attn.q_proj"]})");
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.q_proj"));
  EXPECT_TRUE(
      c.targets_module("model.layers.11.self_attn.q_proj"));  // suffix match starts at a dot
  EXPECT_TRUE(c.targets_module("model.layers.1.self_attn.o_proj"));

  c = parse_text(
      dir,
      R"({"target_modules": ["q_proj", "o_proj"], "exclude_modules": "model\\.layers\\.[01]\\..*"})");
  ASSERT_TRUE(c.exclude_modules_regex);
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.o_proj"));
  EXPECT_TRUE(c.targets_module("model.layers.2.self_attn.o_proj"));
}

TEST(PeftConfig, LayersToTransform) {
  test::TempDir dir;
  AdapterConfig c = parse_text(
      dir, R"({"target_modules": ["q_proj", "gate_proj"], "layers_to_transform": [0, 2]})");
  EXPECT_EQ(c.layers_to_transform, (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.q_proj"));
  EXPECT_TRUE(c.targets_module("model.layers.2.self_attn.q_proj"));
  // Without layers_pattern PEFT takes the number after the last ".<name>." component, which for a
  // per-expert module is the expert index; mirrored as is.
  EXPECT_TRUE(c.targets_module("model.layers.1.mlp.experts.2.gate_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.2.mlp.experts.1.gate_proj"));

  c = parse_text(
      dir,
      R"({"target_modules": ["gate_proj"], "layers_to_transform": 1, "layers_pattern": "layers"})");
  EXPECT_EQ(c.layers_pattern, std::vector<std::string>{"layers"});
  EXPECT_TRUE(c.targets_module("model.layers.1.mlp.experts.2.gate_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.2.mlp.experts.1.gate_proj"));
  EXPECT_TRUE(c.targets_module("gate_proj"));  // an exact entry skips the layer filter, as in PEFT
  EXPECT_TRUE(c.targets_module("model.layers.1.mlp.gate_proj"));
}

TEST(PeftConfig, TargetParameters) {
  test::TempDir dir;
  const AdapterConfig c = parse_text(
      dir, R"({"target_modules": null, "target_parameters": ["mlp.experts.down_proj"]})");
  EXPECT_TRUE(c.targets_parameter("model.layers.1.mlp.experts.down_proj"));
  EXPECT_FALSE(c.targets_parameter("model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_FALSE(c.targets_parameter("model.layers.1.mlp.xexperts.down_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.q_proj"));  // no target_modules
}

// One clear error for each bad adapter_config.json: it names the file and the field with its value.
TEST(PeftConfig, Rejections) {
  test::TempDir dir;
  const std::string file = (dir / "adapter_config.json").string();
  const auto message = [&](const std::string& text, ErrorCode code) {
    return error_message([&] { parse_text(dir, text); }, code);
  };
  EXPECT_THAT(message(R"({"r": 8, "use_dora": true})", ErrorCode::kUnsupported),
              AllOf(HasSubstr(file), HasSubstr("'use_dora' is true"), HasSubstr("DoRA")));
  EXPECT_THAT(message(R"({"modules_to_save": ["lm_head", "score"]})", ErrorCode::kUnsupported),
              AllOf(HasSubstr(file), HasSubstr("'modules_to_save' is [\"lm_head\",\"score\"]")));
  EXPECT_THAT(message(R"({"lora_bias": true})", ErrorCode::kUnsupported),
              AllOf(HasSubstr(file), HasSubstr("'lora_bias' is true")));
  EXPECT_THAT(message(R"({"bias": "lora_only"})", ErrorCode::kUnsupported),
              AllOf(HasSubstr(file), HasSubstr("'bias' is \"lora_only\""), HasSubstr("\"none\"")));
  EXPECT_THAT(message(R"({"fan_in_fan_out": true})", ErrorCode::kUnsupported),
              HasSubstr("'fan_in_fan_out' is true"));
  EXPECT_THAT(message(R"({"peft_type": "IA3"})", ErrorCode::kUnsupported),
              AllOf(HasSubstr("'peft_type' is \"IA3\""), HasSubstr("LORA")));
  EXPECT_THAT(message(R"({"alora_invocation_tokens": [1, 2]})", ErrorCode::kUnsupported),
              HasSubstr("'alora_invocation_tokens' is [1,2]"));
  EXPECT_THAT(message(R"({"r": "8"})", ErrorCode::kInvalidFile),
              AllOf(HasSubstr(file), HasSubstr("'r' must be a positive integer, got \"8\"")));
  EXPECT_THAT(message(R"({"r": 0})", ErrorCode::kInvalidFile),
              HasSubstr("'r' must be a positive integer, got 0"));
  EXPECT_THAT(
      message(R"({"target_modules": "q_proj(", "r": 4})", ErrorCode::kInvalidFile),
      AllOf(HasSubstr("'target_modules'"), HasSubstr("'q_proj('"), HasSubstr("not a valid regex")));
  EXPECT_THAT(message(R"({"target_modules": ["q_proj", 3]})", ErrorCode::kInvalidFile),
              AllOf(HasSubstr("'target_modules'"), HasSubstr("[\"q_proj\",3]")));
  EXPECT_THAT(message(R"({"rank_pattern": {"o_proj": 2.5}})", ErrorCode::kInvalidFile),
              AllOf(HasSubstr("'rank_pattern'"), HasSubstr("'o_proj'"), HasSubstr("2.5")));
  EXPECT_THAT(message(R"({"target_modules": ".*q_proj", "layers_to_transform": [1]})",
                      ErrorCode::kInvalidFile),
              HasSubstr("'layers_to_transform' cannot be used when 'target_modules' is a regex"));
  EXPECT_THAT(message(R"({"r": 8, "lora_alpha": 16,)", ErrorCode::kInvalidFile),
              AllOf(HasSubstr(file), HasSubstr("malformed JSON")));
  EXPECT_THAT(message(R"([1, 2])", ErrorCode::kInvalidFile), HasSubstr("expected a JSON object"));
  // A number too large for a double (nlohmann's out_of_range 406, not a parse_error; the shape of
  // a fuzz finding in config.json) is malformed JSON too, not an escaping exception.
  EXPECT_THAT(message(R"({"r": 8, "lora_alpha": 3333333333333333333333333E366666666666660.0})",
                      ErrorCode::kInvalidFile),
              AllOf(HasSubstr(file), HasSubstr("malformed JSON"), HasSubstr("number overflow")));
  EXPECT_THAT(
      error_message([&] { parse_adapter_config(dir / "missing.json"); }, ErrorCode::kNotFound),
      HasSubstr("missing.json"));
}

// Layer lists in messages (peft.cpp's errors, `moelora inspect`): sorted, de-duplicated ranges.
TEST(PeftFormat, RangesAreSortedAndDeduplicated) {
  EXPECT_EQ(format_ranges({}), "");
  EXPECT_EQ(format_ranges({4}), "4");
  EXPECT_EQ(format_ranges({8, 0, 1, 2, 5, 7, 1}), "0-2, 5, 7-8");
  EXPECT_EQ(format_ranges({3, 2, 1, 0}), "0-3");
}

}  // namespace
}  // namespace moelora::io
