// LoRA on Qwen3.5's Gated DeltaNet (linear-attention) projections, io/peft.h and
// model/lora_binding.h, against a tiny Qwen3.5 config built here (layer 0 "linear_attention",
// layer 1 "full_attention" with gated q_proj):
//   - the five targets linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj
//     load with the base model's in/out features, their scaling and the file's factors, under
//     both decoder prefixes ("model.layers." and the VLM's "model.language_model.layers.");
//   - rank_pattern / alpha_pattern keys naming a linear_attn module;
//   - the module on the wrong kind of layer (linear_attn on full attention, self_attn on linear
//     attention, linear_attn on a model without linear attention), the non-linear sub-modules
//     (conv1d, A_log, dt_bias, norm), Qwen3-Next's fused names and wrong shapes are rejected with
//     one error naming the tensor and the layer;
//   - AdapterSet checks the factors against the fp32 base weights of each kind of layer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>

#include "io/peft.h"
#include "io/safetensors.h"
#include "model/lora_binding.h"
#include "model/weights.h"
#include "support/test_support.h"
#include "unit/peft_test_support.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;
using io::LayerLora;
using io::LoraAdapter;
using io::LoraWeights;
using json = nlohmann::json;
using test::error_message;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Sizes of the tiny config: H 32; gated attention 2 heads x head_dim 8 (q_proj 2 * 16 = 32
// outputs), 1 KV head; Gated DeltaNet nk 2, dk 4, nv 4, dv 3: key_dim 8, value_dim 12,
// in_proj_qkv 2 * 8 + 12 = 28 outputs.
constexpr int64_t kH = 32, kKeyDim = 8, kValueDim = 12, kNv = 4;

io::ModelConfig tiny_qwen35() {
  io::ModelConfig c;
  c.arch = io::Architecture::kQwen35Moe;
  c.model_type = c.text_model_type = "qwen3_5_moe_text";
  c.vocab_size = 64;
  c.hidden_size = kH;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 128;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 8;
  c.qk_norm = true;
  c.attention_output_gate = true;
  c.moe_intermediate_size = 8;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.shared_expert_intermediate_size = 8;
  c.shared_expert_gate = true;
  c.layer_types = {"linear_attention", "full_attention"};
  c.linear_attention = {/*conv_kernel_dim=*/4, /*key_head_dim=*/4, /*value_head_dim=*/3,
                        /*num_key_heads=*/2, /*num_value_heads=*/4};
  return c;
}

struct Projection {
  const char* name;  // below "linear_attn."
  io::LoraWeights LayerLora::*member;
  int64_t in, out;
};
const Projection kProjections[] = {
    {"in_proj_qkv", &LayerLora::in_proj_qkv, kH, 2 * kKeyDim + kValueDim},
    {"in_proj_z", &LayerLora::in_proj_z, kH, kValueDim},
    {"in_proj_b", &LayerLora::in_proj_b, kH, kNv},
    {"in_proj_a", &LayerLora::in_proj_a, kH, kNv},
    {"out_proj", &LayerLora::out_proj, kValueDim, kH},
};

// The shared synthetic adapter directory with the linear-attention targets (and the attention
// and fused-projection names the rejection tests use).
struct AdapterDir : io::peft_test::AdapterDir {
  AdapterDir()
      : io::peft_test::AdapterDir(
            json::array({"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d",
                         "in_proj_qkvz", "q_proj", "k_proj", "v_proj", "o_proj"})) {}
};

class PeftLinearAttention : public ::testing::Test {
 protected:
  void SetUp() override { rng_.seed(test::test_seed(20260904)); }
  Tensor random(const Shape& shape) { return test::random_normal(shape, rng_, 0.25f); }
  // LoRAs of rank `rank` on all five projections of `layer_prefix` ("model.layers.0.").
  void add_all(AdapterDir& d, const std::string& layer_prefix, int64_t rank = 4) {
    for (const Projection& p : kProjections) {
      d.add_lora(layer_prefix + "linear_attn." + p.name, random({rank, p.in}),
                 random({p.out, rank}));
    }
  }
  std::string load_error(const AdapterDir& d, const io::ModelConfig& base) {
    const fs::path dir = d.write();
    return error_message([&] { io::load_adapter(dir, base, "bad"); }, ErrorCode::kUnsupported);
  }

  io::ModelConfig base_ = tiny_qwen35();
  std::mt19937_64 rng_;
};

// The canonical factors are the file's, bit for bit (fp32 in, fp32 out, one scaling).
void expect_factors(const LoraWeights& w, const Tensor& a, const Tensor& b, int64_t rank,
                    int64_t in, int64_t out, float scaling, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_TRUE(w.defined());
  EXPECT_EQ(w.a.shape(), (Shape{1, rank, in}));
  EXPECT_EQ(w.b.shape(), (Shape{1, out, rank}));
  EXPECT_EQ(w.scaling, scaling);
  ASSERT_EQ(w.a.numel(), a.numel());
  ASSERT_EQ(w.b.numel(), b.numel());
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(w.a.data<float>()[i], a.item_f32(i)) << i;
  for (int64_t i = 0; i < b.numel(); ++i) ASSERT_EQ(w.b.data<float>()[i], b.item_f32(i)) << i;
}

TEST(PeftLinearAttentionTargets, NamedListsThemAfterTheMlaEntries) {
  std::vector<std::string> names;
  for (const auto& [name, w] : LayerLora().named()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "self_attn.q_proj",
                       "self_attn.k_proj",
                       "self_attn.v_proj",
                       "self_attn.o_proj",
                       "self_attn.q_a_proj",
                       "self_attn.q_b_proj",
                       "self_attn.kv_a_proj_with_mqa",
                       "self_attn.kv_b_proj",
                       "linear_attn.in_proj_qkv",
                       "linear_attn.in_proj_z",
                       "linear_attn.in_proj_b",
                       "linear_attn.in_proj_a",
                       "linear_attn.out_proj",
                       "mlp.gate_proj",
                       "mlp.up_proj",
                       "mlp.down_proj",
                       "mlp.shared_expert.gate_proj",
                       "mlp.shared_expert.up_proj",
                       "mlp.shared_expert.down_proj",
                       "mlp.experts.gate_up_proj",
                       "mlp.experts.down_proj",
                   }));
  LayerLora l;
  for (const Projection& p : kProjections) {
    const auto& named = l.named();
    const auto it = std::find_if(named.begin(), named.end(), [&](const auto& entry) {
      return entry.first == std::string("linear_attn.") + p.name;
    });
    ASSERT_NE(it, named.end()) << p.name;
    EXPECT_EQ(it->second, &(l.*p.member)) << p.name;
  }
}

TEST_F(PeftLinearAttention, AllFiveTargetsLoadWithTheirShapesAndScaling) {
  AdapterDir d;
  add_all(d, "model.layers.0.");
  d.add_lora("model.layers.1.self_attn.q_proj", random({4, kH}), random({2 * 2 * 8, 4}));
  const LoraAdapter adapter = io::load_adapter(d.write(), base_, "gdn");
  ASSERT_EQ(adapter.layers.size(), 2u);
  EXPECT_EQ(adapter.num_tensors, 12);
  EXPECT_EQ(adapter.max_rank, 4);
  EXPECT_EQ(adapter.expert_layout, io::ExpertLoraLayout::kNone);
  const LayerLora& l0 = adapter.layers[0];
  for (const Projection& p : kProjections) {
    const std::string module = std::string("model.layers.0.linear_attn.") + p.name;
    expect_factors(l0.*p.member, d.tensor(module + ".lora_A.weight"),
                   d.tensor(module + ".lora_B.weight"), 4, p.in, p.out, 2.0f, module);
    EXPECT_FALSE((adapter.layers[1].*p.member).defined()) << p.name;
  }
  EXPECT_FALSE(l0.q_proj.defined());
  expect_factors(
      adapter.layers[1].q_proj, d.tensor("model.layers.1.self_attn.q_proj.lora_A.weight"),
      d.tensor("model.layers.1.self_attn.q_proj.lora_B.weight"), 4, kH, 32, 2.0f, "gated q_proj");
  // moelora inspect's list, in LayerLora::named() order
  EXPECT_EQ(adapter.targets, (std::vector<std::string>{
                                 "self_attn.q_proj (layer 1): rank 4, scaling 2",
                                 "linear_attn.in_proj_qkv (layer 0): rank 4, scaling 2",
                                 "linear_attn.in_proj_z (layer 0): rank 4, scaling 2",
                                 "linear_attn.in_proj_b (layer 0): rank 4, scaling 2",
                                 "linear_attn.in_proj_a (layer 0): rank 4, scaling 2",
                                 "linear_attn.out_proj (layer 0): rank 4, scaling 2",
                             }));
}

TEST_F(PeftLinearAttention, VlmPrefixAndKeysWithoutThePeftPrefix) {
  AdapterDir d;
  add_all(d, "model.language_model.layers.0.");
  // the text config ("model.") and the VLM config ("model.language_model.") both accept it
  io::ModelConfig vlm = base_;
  vlm.weight_prefix = "model.language_model.";
  for (const io::ModelConfig* base : {&base_, &vlm}) {
    for (const std::string prefix : {"base_model.model.", ""}) {
      SCOPED_TRACE(base->weight_prefix + " / '" + prefix + "'");
      const LoraAdapter adapter = io::load_adapter(d.write(prefix), *base, "vlm");
      for (const Projection& p : kProjections) {
        const std::string module =
            std::string("model.language_model.layers.0.linear_attn.") + p.name;
        expect_factors(adapter.layers[0].*p.member, d.tensor(module + ".lora_A.weight"),
                       d.tensor(module + ".lora_B.weight"), 4, p.in, p.out, 2.0f, module);
      }
    }
  }
}

TEST_F(PeftLinearAttention, RankAndAlphaPatterns) {
  AdapterDir d;
  d.config()["rank_pattern"] = {{"linear_attn.in_proj_qkv", 2}};
  d.config()["alpha_pattern"] = {{"layers.0.linear_attn.out_proj", 3}};
  for (const Projection& p : kProjections) {
    const int64_t rank = std::string(p.name) == "in_proj_qkv" ? 2 : 4;
    d.add_lora(std::string("model.layers.0.linear_attn.") + p.name, random({rank, p.in}),
               random({p.out, rank}));
  }
  const LoraAdapter adapter = io::load_adapter(d.write(), base_, "patterns");
  const LayerLora& l = adapter.layers[0];
  EXPECT_EQ(l.in_proj_qkv.rank(), 2);
  EXPECT_EQ(l.in_proj_qkv.scaling, 4.0f);  // 8 / 2
  EXPECT_EQ(l.out_proj.rank(), 4);
  EXPECT_EQ(l.out_proj.scaling, 0.75f);  // 3 / 4
  for (const LoraWeights* w : {&l.in_proj_z, &l.in_proj_b, &l.in_proj_a}) {
    EXPECT_EQ(w->rank(), 4);
    EXPECT_EQ(w->scaling, 2.0f);
  }
  EXPECT_EQ(adapter.max_rank, 4);

  // a factor whose rank disagrees with the pattern's
  AdapterDir e;
  e.config()["rank_pattern"] = {{"linear_attn.in_proj_z", 2}};
  e.add_lora("model.layers.0.linear_attn.in_proj_z", random({4, kH}), random({kValueDim, 4}));
  const fs::path dir = e.write();
  EXPECT_THAT(error_message([&] { io::load_adapter(dir, base_, "bad"); }, ErrorCode::kInvalidFile),
              AllOf(HasSubstr("lora_A of 'model.layers.0.linear_attn.in_proj_z' has rank 4"),
                    HasSubstr("says r=2 (rank_pattern key 'linear_attn.in_proj_z')")));
}

TEST_F(PeftLinearAttention, ModuleOnTheWrongKindOfLayerIsAnotherArchitecture) {
  {
    AdapterDir d;
    d.add_lora("model.layers.1.linear_attn.in_proj_qkv", random({4, kH}),
               random({2 * kKeyDim + kValueDim, 4}));
    EXPECT_THAT(load_error(d, base_),
                AllOf(HasSubstr(d.file()),
                      HasSubstr("'base_model.model.model.layers.1.linear_attn.in_proj_qkv.lora_A."
                                "weight'"),
                      HasSubstr("adapter was made for another architecture"),
                      HasSubstr("layer 1 of the base model is a full-attention layer"),
                      HasSubstr("qwen3_5_moe (gated GQA attention and Gated DeltaNet linear "
                                "attention)"),
                      HasSubstr("it has no linear_attn.in_proj_qkv")));
  }
  {
    AdapterDir d;
    d.add_lora("model.layers.0.self_attn.q_proj", random({4, kH}), random({32, 4}));
    EXPECT_THAT(load_error(d, base_),
                AllOf(HasSubstr("model.layers.0.self_attn.q_proj.lora_A.weight"),
                      HasSubstr("adapter was made for another architecture"),
                      HasSubstr("layer 0 of the base model is a Gated DeltaNet (linear attention) "
                                "layer; it has no self_attn.q_proj")));
  }
  {
    // a Qwen3.5 adapter on a model without linear attention
    AdapterDir d;
    d.add_lora("model.layers.0.linear_attn.out_proj", random({4, kValueDim}), random({kH, 4}));
    const io::ModelConfig qwen3 =
        io::load_model_config(test::data_dir() / "parity" / "qwen3_moe" / "base");
    EXPECT_THAT(load_error(d, qwen3),
                AllOf(HasSubstr("model.layers.0.linear_attn.out_proj.lora_A.weight"),
                      HasSubstr("adapter was made for another architecture"),
                      HasSubstr("qwen3_moe (GQA attention) has no Gated DeltaNet (linear "
                                "attention) layers; layer 0 has no linear_attn.out_proj")));
  }
  {
    // Qwen3-Next's fused projection does not exist in Qwen3.5
    AdapterDir d;
    d.add_lora("model.layers.0.linear_attn.in_proj_qkvz", random({4, kH}), random({40, 4}));
    EXPECT_THAT(load_error(d, base_),
                AllOf(HasSubstr("model.layers.0.linear_attn.in_proj_qkvz.lora_A.weight"),
                      HasSubstr("another architecture"),
                      HasSubstr("has no LoRA target linear_attn.in_proj_qkvz")));
  }
}

TEST_F(PeftLinearAttention, NonLinearSubModulesAreUnsupportedTargets) {
  for (const std::string name : {"conv1d", "A_log", "dt_bias", "norm"}) {
    SCOPED_TRACE(name);
    AdapterDir d;
    d.config()["target_modules"] = json::array({name});
    d.add_lora("model.layers.0.linear_attn." + name, random({4, 4}), random({4, 4}));
    EXPECT_THAT(
        load_error(d, base_),
        AllOf(HasSubstr(d.file()),
              HasSubstr("'base_model.model.model.layers.0.linear_attn." + name + ".lora_A.weight'"),
              HasSubstr("LoRA on linear_attn." + name), HasSubstr("is not supported"),
              ::testing::Not(HasSubstr("another architecture"))));
  }
}

TEST_F(PeftLinearAttention, WrongShapesNameTheFeature) {
  {
    AdapterDir d;
    d.add_lora("model.layers.0.linear_attn.in_proj_b", random({4, kH}), random({5, 4}));
    EXPECT_THAT(load_error(d, base_),
                AllOf(HasSubstr("lora_B of 'model.layers.0.linear_attn.in_proj_b'"),
                      HasSubstr("shape [5, 4], expected [4, 4]"), HasSubstr("out_features")));
  }
  {
    AdapterDir d;
    d.add_lora("model.layers.0.linear_attn.out_proj", random({4, kH}), random({kH, 4}));
    EXPECT_THAT(load_error(d, base_),
                AllOf(HasSubstr("lora_A of 'model.layers.0.linear_attn.out_proj'"),
                      HasSubstr("shape [4, 32], expected [4, 12]"), HasSubstr("in_features")));
  }
}

// ---------------------------------------------------------------------------------------------
// AdapterSet against fp32 base weights: layer 0 Gated DeltaNet, layer 1 gated full attention.

std::shared_ptr<const model::ModelWeightsF32> tiny_weights() {
  auto w = std::make_shared<model::ModelWeightsF32>();
  w->layers.resize(2);
  model::LayerWeightsF32& linear = w->layers[0];
  linear.is_linear_attention = true;
  model::LinearAttentionWeightsF32& g = linear.linear_attn;
  g.in_proj_qkv = Tensor::zeros(DType::kF32, {2 * kKeyDim + kValueDim, kH});
  g.in_proj_z = Tensor::zeros(DType::kF32, {kValueDim, kH});
  g.in_proj_b = Tensor::zeros(DType::kF32, {kNv, kH});
  g.in_proj_a = Tensor::zeros(DType::kF32, {kNv, kH});
  g.out_proj = Tensor::zeros(DType::kF32, {kH, kValueDim});
  model::AttentionWeightsF32& a = w->layers[1].attention;
  a.q_proj = Tensor::zeros(DType::kF32, {32, kH});
  a.k_proj = Tensor::zeros(DType::kF32, {8, kH});
  a.v_proj = Tensor::zeros(DType::kF32, {8, kH});
  a.o_proj = Tensor::zeros(DType::kF32, {kH, 16});
  return w;
}

LoraAdapter in_memory(const std::string& name, int64_t layer, LoraWeights LayerLora::*member,
                      int64_t in, int64_t out) {
  LoraAdapter adapter;
  adapter.name = name;
  adapter.layers.resize(2);
  LoraWeights& f = adapter.layers[static_cast<size_t>(layer)].*member;
  f.a = Tensor::zeros(DType::kF32, {1, 4, in});
  f.b = Tensor::zeros(DType::kF32, {1, out, 4});
  f.scaling = 1.0f;
  return adapter;
}

TEST_F(PeftLinearAttention, AdapterSetChecksFactorsAgainstTheBaseWeights) {
  model::AdapterSet set(tiny_weights(), base_);
  AdapterDir d;
  add_all(d, "model.layers.0.");
  d.add_lora("model.layers.1.self_attn.o_proj", random({4, 16}), random({kH, 4}));
  ASSERT_EQ(set.load("gdn", d.write()), 0);
  for (const Projection& p : kProjections) {
    const auto slots = set.target(0, p.member);
    ASSERT_EQ(slots.size(), 1u);
    EXPECT_EQ(slots[0], &(set.adapter(0).layers[0].*p.member)) << p.name;
    EXPECT_TRUE(set.any(0, p.member)) << p.name;
    EXPECT_FALSE(set.any(1, p.member)) << p.name;
  }
  EXPECT_TRUE(set.any(1, &LayerLora::o_proj));

  // linear_attn on the full-attention layer, self_attn on the Gated DeltaNet layer
  EXPECT_THAT(
      error_message([&] { set.check(in_memory("x", 1, &LayerLora::in_proj_z, kH, kValueDim)); },
                    ErrorCode::kUnsupported),
      AllOf(HasSubstr("adapter 'x' adapts linear_attn.in_proj_z of layer 1"),
            HasSubstr("gated GQA attention"), HasSubstr("made for another architecture")));
  EXPECT_THAT(error_message([&] { set.check(in_memory("y", 0, &LayerLora::q_proj, kH, 32)); },
                            ErrorCode::kUnsupported),
              AllOf(HasSubstr("adapter 'y' adapts q_proj of layer 0"),
                    HasSubstr("Gated DeltaNet linear attention"),
                    HasSubstr("made for another architecture")));
  // right layer, wrong shapes
  EXPECT_THAT(
      error_message([&] { set.check(in_memory("z", 0, &LayerLora::in_proj_z, kH - 1, kValueDim)); },
                    ErrorCode::kInvalidArgument),
      HasSubstr("layer 0 linear_attn.in_proj_z: lora A has shape [1, 4, 31], expected [1, R, 32]"));
  EXPECT_THAT(
      error_message(
          [&] {
            set.check(in_memory("w", 0, &LayerLora::in_proj_qkv, kH, 2 * kKeyDim + kValueDim + 1));
          },
          ErrorCode::kInvalidArgument),
      HasSubstr("layer 0 linear_attn.in_proj_qkv: lora B has shape [1, 29, 4], expected [1, 28, "
                "4]"));
  set.check(in_memory("ok", 0, &LayerLora::out_proj, kValueDim, kH));
  EXPECT_EQ(set.size(), 1);
}

}  // namespace
}  // namespace moelora
