// Bad PEFT adapters (src/io/peft.h): each case gets one error that names the file, tensor or field
// and the numbers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "io/peft.h"
#include "support/test_support.h"
#include "unit/peft_test_support.h"

namespace moelora::io {
namespace {

using namespace peft_test;  // fs, json, the gmock matchers, error_message

// ---------------------------------------------------------------------------------------------
// Bad adapters: one clear error each

class PeftBadAdapter : public PeftSynthetic {
 protected:
  std::string load_error(const AdapterDir& d, ErrorCode code,
                         const AdapterLoadOptions& options = {},
                         const std::string& prefix = "base_model.model.") {
    const fs::path dir = d.write(prefix);
    return error_message([&] { load_adapter(dir, base_, "bad", options); }, code);
  }
};

TEST_F(PeftBadAdapter, DoraInConfigAndInFile) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 64}), random({64, 4}));
  d.config()["use_dora"] = true;
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
              AllOf(HasSubstr("adapter_config.json"), HasSubstr("use_dora")));
  d.config()["use_dora"] = false;
  d.add("model.layers.0.self_attn.q_proj.lora_magnitude_vector", random({64}));
  EXPECT_THAT(
      load_error(d, ErrorCode::kUnsupported),
      AllOf(HasSubstr(d.file()), HasSubstr("model.layers.0.self_attn.q_proj.lora_magnitude_vector"),
            HasSubstr("DoRA")));
}

TEST_F(PeftBadAdapter, ModulesToSaveAndLoraBias) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 64}), random({64, 4}));
  d.config()["modules_to_save"] = json::array({"lm_head"});
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
              AllOf(HasSubstr("modules_to_save"), HasSubstr("lm_head")));
  d.config().erase("modules_to_save");
  d.add("model.layers.0.self_attn.q_proj.lora_B.bias", random({64}));
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
              AllOf(HasSubstr("'base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias'"),
                    HasSubstr("bias")));
  d.remove("model.layers.0.self_attn.q_proj.lora_B.bias");
  d.add("model.lm_head.modules_to_save.default.weight", random({8, 64}));
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported), HasSubstr("modules_to_save"));
}

TEST_F(PeftBadAdapter, UnsupportedTargets) {
  {
    AdapterDir d;
    d.config()["target_modules"] = json::array({"gate"});
    d.add_lora("model.layers.0.mlp.gate", random({4, 64}), random({8, 4}));
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr(d.file()), HasSubstr("model.layers.0.mlp.gate.lora_A.weight"),
                      HasSubstr("router")));
  }
  {
    AdapterDir d;
    d.add("model.embed_tokens.lora_embedding_A", random({4, 512}));
    d.add("model.embed_tokens.lora_embedding_B", random({64, 4}));
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr("model.embed_tokens.lora_embedding_A"), HasSubstr("embedding")));
  }
  {
    AdapterDir d;
    d.add_lora("lm_head", random({4, 64}), random({512, 4}));
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr("'base_model.model.lm_head.lora_A.weight'"), HasSubstr("lm_head")));
  }
  {
    AdapterDir d;
    d.add("model.layers.0.self_attn.q_proj.weight", random({64, 64}));
    EXPECT_THAT(
        load_error(d, ErrorCode::kUnsupported),
        AllOf(HasSubstr("model.layers.0.self_attn.q_proj.weight"), HasSubstr("not a LoRA factor")));
  }
}

TEST_F(PeftBadAdapter, WrongShape) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 48}), random({64, 4}));
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
              AllOf(HasSubstr(d.file()), HasSubstr("lora_A of 'model.layers.0.self_attn.q_proj'"),
                    HasSubstr("shape [4, 48], expected [4, 64]"), HasSubstr("in_features")));
  AdapterDir e;
  e.add_lora("model.layers.0.self_attn.k_proj", random({4, 64}),
             random({64, 4}));  // k_proj has 32 outputs
  EXPECT_THAT(load_error(e, ErrorCode::kUnsupported),
              AllOf(HasSubstr("lora_B of 'model.layers.0.self_attn.k_proj'"),
                    HasSubstr("[64, 4], expected [32, 4]"), HasSubstr("out_features")));
  AdapterDir f;
  f.add_lora("model.layers.0.self_attn.k_proj", random({4, 64}), random({32, 3}));
  EXPECT_THAT(load_error(f, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("lora_B of 'model.layers.0.self_attn.k_proj' has shape [32, 3]"),
                    HasSubstr("lora_A has rank 4")));
  AdapterDir g;
  g.add_lora("model.layers.0.self_attn.k_proj", random({1, 4, 64}), random({32, 4}));
  EXPECT_THAT(load_error(g, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("[1, 4, 64]"), HasSubstr("2-D")));
}

TEST_F(PeftBadAdapter, RankMismatchWithConfig) {
  AdapterDir d;
  d.config()["r"] = 8;
  add_per_expert(d, 0, 8, [](int64_t e, const std::string& proj) -> int64_t {
    return e == 7 && proj == "up_proj" ? 16 : 8;
  });
  EXPECT_THAT(load_error(d, ErrorCode::kInvalidFile),
              AllOf(HasSubstr(d.file()),
                    HasSubstr("lora_A of 'model.layers.0.mlp.experts.7.up_proj' has rank 16"),
                    HasSubstr("adapter_config.json says r=8")));
  AdapterDir e;
  e.config()["rank_pattern"] = {{"k_proj", 2}};
  e.add_lora("model.layers.0.self_attn.k_proj", random({4, 64}), random({32, 4}));
  EXPECT_THAT(load_error(e, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("has rank 4"), HasSubstr("says r=2 (rank_pattern key 'k_proj')")));
}

TEST_F(PeftBadAdapter, RankAboveTheConfiguredMaximum) {
  AdapterDir d;
  d.config()["r"] = 8;
  d.add_lora("model.layers.1.self_attn.q_proj", random({8, 64}), random({64, 8}));
  AdapterLoadOptions options;
  options.max_rank = 4;
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported, options),
              AllOf(HasSubstr("adapter 'bad'"), HasSubstr("self_attn.q_proj of layer 1 has rank 8"),
                    HasSubstr("maximum LoRA rank 4")));
  // per-expert gate and up of rank 4 each need R = 8 in the canonical form
  AdapterDir e;
  add_per_expert(e, 2, 4);
  options.max_rank = 6;
  EXPECT_THAT(load_error(e, ErrorCode::kUnsupported, options),
              AllOf(HasSubstr("mlp.experts.gate_up_proj of layer 2 has rank 8"),
                    HasSubstr("gate_proj 4 + up_proj 4"), HasSubstr("maximum LoRA rank 6")));
}

TEST_F(PeftBadAdapter, AdapterForAnotherArchitecture) {
  // a DeepSeek (MLA) adapter on the Qwen3-MoE config
  const std::string deepseek = error_message(
      [&] { load_adapter(parity_dir() / "deepseek_v3" / "lora_peft3d", base_, "deepseek"); },
      ErrorCode::kUnsupported);
  EXPECT_THAT(
      deepseek,
      AllOf(HasSubstr("adapter was made for another architecture"), HasSubstr("qwen3_moe"),
            HasSubstr(
                "'base_model.model.model.layers.0.self_attn.kv_a_proj_with_mqa.lora_A.weight'")));
  // a Qwen adapter on the DeepSeek config: its q/k/v names do not exist in MLA attention, and its
  // layer 0 is dense there
  const ModelConfig deepseek_base = load_model_config(parity_dir() / "deepseek_v3" / "base");
  EXPECT_THAT(
      error_message(
          [&] { load_adapter(parity_dir() / "qwen3_moe" / "lora_per_expert", deepseek_base, "q"); },
          ErrorCode::kUnsupported),
      HasSubstr("adapter was made for another architecture"));
  {
    AdapterDir d;
    d.add_lora("model.layers.47.self_attn.q_proj", random({4, 64}), random({64, 4}));
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr("model.layers.47.self_attn.q_proj.lora_A.weight"),
                      HasSubstr("layer 47 but the base model has 3 layers")));
  }
  {
    AdapterDir d;
    d.add_lora("model.layers.0.self_attn.q_a_proj", random({4, 64}), random({32, 4}));
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr("another architecture"), HasSubstr("self_attn.q_a_proj")));
  }
  {
    AdapterDir d;
    d.add_lora("model.layers.0.mlp.experts.9.down_proj", random({4, 32}), random({64, 4}));
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr("expert 9"), HasSubstr("8 routed experts")));
  }
  {
    AdapterDir d;
    d.add_lora("model.layers.0.mlp.gate_proj", random({4, 64}), random({96, 4}));
    EXPECT_THAT(
        load_error(d, ErrorCode::kUnsupported),
        AllOf(HasSubstr("layer 0 of the base model is a MoE layer"), HasSubstr("mlp.gate_proj")));
  }
  {
    AdapterDir d;
    d.add_lora("model.layers.0.mlp.shared_experts.gate_proj", random({4, 64}), random({32, 4}));
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr("another architecture"), HasSubstr("no shared expert")));
  }
  {
    // PEFT 3-D with a different expert count: 30 rows are not E*R for 8 experts
    AdapterDir d;
    d.config()["target_parameters"] = json::array({"mlp.experts.gate_up_proj"});
    d.add_lora("model.layers.0.mlp.experts", random({30, 64}), random({64, 30}));
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr("lora_A of 'model.layers.0.mlp.experts.gate_up_proj' has 30 rows"),
                      HasSubstr("8 experts")));
  }
}

TEST_F(PeftBadAdapter, Peft3dRankMismatch) {
  AdapterDir d;
  d.config()["target_parameters"] =
      json::array({"mlp.experts.down_proj", "mlp.experts.gate_up_proj"});
  d.add_lora("model.layers.2.mlp.experts.base_layer", random({64, 64}), random({64, 64}));  // R = 8
  d.add_lora("model.layers.2.mlp.experts", random({32, 32}), random({64, 32}));
  EXPECT_THAT(load_error(d, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("lora_A of 'model.layers.2.mlp.experts.gate_up_proj' has rank 8 (64 "
                              "rows / 8 experts)"),
                    HasSubstr("says r=4")));
}

TEST_F(PeftBadAdapter, MissingLoraB) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 64}), random({64, 4}));
  d.remove("model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_THAT(
      load_error(d, ErrorCode::kInvalidFile),
      AllOf(HasSubstr(d.file()),
            HasSubstr("'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' "
                      "has no matching lora_B"),
            HasSubstr(
                "'base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight' is missing")));
}

TEST_F(PeftBadAdapter, MissingExpert) {
  AdapterDir d;
  add_per_expert(d, 2, 4);
  d.remove("model.layers.2.mlp.experts.5.up_proj.lora_A.weight");
  d.remove("model.layers.2.mlp.experts.5.up_proj.lora_B.weight");
  EXPECT_THAT(load_error(d, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("layer 2"), HasSubstr("7 of 8 experts"),
                    HasSubstr("'model.layers.2.mlp.experts.5.up_proj'")));
}

TEST_F(PeftBadAdapter, TensorOfAnUntargetedModule) {
  AdapterDir d;
  d.config()["target_modules"] = json::array({"q_proj"});
  d.add_lora("model.layers.0.self_attn.k_proj", random({4, 64}), random({32, 4}));
  EXPECT_THAT(load_error(d, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("'model.layers.0.self_attn.k_proj'"), HasSubstr("does not target")));
}

TEST_F(PeftBadAdapter, MixedExpertLayouts) {
  AdapterDir d;
  add_per_expert(d, 0, 4);
  d.add_lora("model.layers.2.mlp.experts.down_proj", random({8, 4, 32}), random({8, 64, 4}));
  EXPECT_THAT(load_error(d, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("layer 0"), HasSubstr("layer 2"), HasSubstr("one layout")));
}

TEST_F(PeftBadAdapter, MissingFiles) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 64}), random({64, 4}));
  const fs::path dir = d.write();
  fs::rename(dir / "adapter_model.safetensors", dir / "adapter_model.bin");
  EXPECT_THAT(error_message([&] { load_adapter(dir, base_, "bin"); }, ErrorCode::kUnsupported),
              AllOf(HasSubstr("adapter_model.bin"),
                    HasSubstr("pickle .bin adapters are not supported; convert to safetensors")));
  fs::remove(dir / "adapter_model.bin");
  EXPECT_THAT(error_message([&] { load_adapter(dir, base_, "none"); }, ErrorCode::kNotFound),
              HasSubstr("adapter_model.safetensors"));
  fs::remove(dir / "adapter_config.json");
  EXPECT_THAT(error_message([&] { load_adapter(dir, base_, "none"); }, ErrorCode::kNotFound),
              HasSubstr("adapter_config.json"));
  EXPECT_THAT(
      error_message([&] { load_adapter(dir / "nope", base_, "none"); }, ErrorCode::kNotFound),
      HasSubstr("nope"));
}

TEST_F(PeftBadAdapter, MalformedConfigJson) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 64}), random({64, 4}));
  const fs::path dir = d.write();
  test::write_text_file(dir / "adapter_config.json", "{\"r\": 4, \"target_modules\": [\"q_proj\"");
  EXPECT_THAT(
      error_message([&] { load_adapter(dir, base_, "json"); }, ErrorCode::kInvalidFile),
      AllOf(HasSubstr((dir / "adapter_config.json").string()), HasSubstr("malformed JSON")));
}

}  // namespace
}  // namespace moelora::io
