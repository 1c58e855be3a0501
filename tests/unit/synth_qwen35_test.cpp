// `moelora synth`, `synth-adapter` and `inspect` on the Qwen3.5-MoE presets, whose decoders
// interleave Gated DeltaNet ("linear_attention") layers with gated full-attention layers:
//   - tiny-qwen3.5-moe in bf16, fp8 and nvfp4 loads back through load_checkpoint with the preset's
//     layer kinds, shapes, formats and init scales; FP8 keeps bf16 exactly the modules its
//     modules_to_not_convert names (the list of the Qwen FP8 releases); NVFP4 quantizes the
//     routed experts only, stored per expert;
//   - the presets' configurations without weights (this test links the preset table of
//     tools/): qwen3.5-35b-a3b has 40 layers = 10 x (3 linear + 1 full) and the real sizes,
//     --layers keeps (and continues) the pattern;
//   - synth-adapter: linear_attn targets on linear-attention layers only, self_attn (q_proj of
//     the doubled gated width) on full-attention layers only, "all" per layer; the adapter loader
//     reads them back in every expert layout;
//   - the CPU model runs the tiny preset in every format and with an adapter on every target;
//   - inspect: the layer pattern, and a note on the tensors the loader skips (vision tower, MTP).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "io/checkpoint.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "ops/quant/quant.h"
#include "support/test_support.h"
#include "synth.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kLinear = "linear_attention";
const std::string kFull = "full_attention";

std::string quoted(const fs::path& p) {
  return "'" + p.string() + "'";
}

// Runs `moelora <args>`; fails the test (with the binary's output) when the exit code differs.
std::string moelora(const std::string& args, int expected_exit = 0) {
  const test::CommandResult r = test::run_moelora(args);
  EXPECT_EQ(r.exit_code, expected_exit) << "moelora " << args << "\n" << r.output;
  return r.output;
}

LoadOptions quiet() {
  LoadOptions o;
  o.show_progress = false;
  return o;
}

double stddev(const Tensor& t) {
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = t.item_f32(i);
    sum += v;
    sq += v * v;
  }
  const double mean = sum / static_cast<double>(t.numel());
  return std::sqrt(sq / static_cast<double>(t.numel()) - mean * mean);
}

// Every element of `t` in [lo, hi].
void expect_within(const Tensor& t, float lo, float hi, const std::string& what) {
  const Tensor f = t.to_f32();
  for (int64_t i = 0; i < f.numel(); ++i) {
    ASSERT_GE(f.item_f32(i), lo) << what << " element " << i;
    ASSERT_LE(f.item_f32(i), hi) << what << " element " << i;
  }
}

class SynthQwen35Test : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(test::binary_dir() / "moelora"))
        << "the moelora binary is missing at " << (test::binary_dir() / "moelora").string()
        << ": build the `moelora` target of this build directory (it is part of `all`)";
  }
  fs::path synth(const std::string& name, const std::string& args) {
    const fs::path dir = tmp_ / name;
    moelora("synth " + args + " --out " + quoted(dir));
    return dir;
  }
  fs::path adapter(const std::string& name, const std::string& args) {
    const fs::path dir = tmp_ / name;
    moelora("synth-adapter " + args + " --out " + quoted(dir));
    return dir;
  }
  test::TempDir tmp_;
};

// ---------------------------------------------------------------------------------------------
// bf16

TEST_F(SynthQwen35Test, TinyBf16HasTheHybridLayersWithTheirShapesAndScales) {
  const fs::path dir = synth("q35", "--preset tiny-qwen3.5-moe --seed 3");
  const json raw = json::parse(test::read_text_file(dir / "config.json"));
  EXPECT_EQ(raw["model_type"], "qwen3_5_moe_text");
  EXPECT_EQ(raw["architectures"], json({"Qwen3_5MoeForCausalLM"}));
  EXPECT_EQ(raw["layer_types"], json({kLinear, kLinear, kLinear, kFull}));
  EXPECT_EQ(raw["rope_parameters"]["partial_rotary_factor"], 0.25);

  const ModelWeights w = load_checkpoint(dir, quiet());
  const ModelConfig& c = w.config;
  EXPECT_EQ(w.weight_prefix, "model.");
  EXPECT_EQ(c.arch, Architecture::kQwen35Moe);
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{kLinear, kLinear, kLinear, kFull}));
  EXPECT_EQ(c.rotary_dim(), 16);
  EXPECT_TRUE(c.attention_output_gate);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_TRUE(c.shared_expert_gate);
  EXPECT_EQ(c.norm_style, NormStyle::kOnePlusWeight);
  const LinearAttentionConfig& la = c.linear_attention;
  EXPECT_EQ(la, (LinearAttentionConfig{4, 32, 32, 2, 4}));
  EXPECT_GT(la.num_value_heads, la.num_key_heads);
  EXPECT_EQ(la.num_value_heads % la.num_key_heads, 0);

  ASSERT_EQ(w.layers.size(), 4u);
  for (size_t l = 0; l < 4; ++l) {
    const LayerWeights& lw = w.layers[l];
    EXPECT_EQ(lw.is_linear_attention, l != 3) << "layer " << l;
    EXPECT_TRUE(lw.is_moe) << "layer " << l;
    EXPECT_EQ(lw.linear_attn.defined(), l != 3) << "layer " << l;
    EXPECT_EQ(lw.q_proj.defined(), l == 3) << "layer " << l;
    EXPECT_EQ(lw.shared_expert_gate.shape(), (Shape{1, 256}));
    EXPECT_EQ(lw.shared_expert.down.weight.shape(), (Shape{256, 128}));
    EXPECT_EQ(lw.experts.gate[7].weight.shape(), (Shape{128, 256}));
    EXPECT_FALSE(lw.experts.fused_on_disk);
  }
  // Gated DeltaNet: key_dim 2 x 32 = 64, value_dim 4 x 32 = 128, conv over [q | k | v] = 256
  const LinearAttentionWeights& g = w.layers[1].linear_attn;
  EXPECT_EQ(g.in_proj_qkv.weight.shape(), (Shape{256, 256}));
  EXPECT_EQ(g.in_proj_z.weight.shape(), (Shape{128, 256}));
  EXPECT_EQ(g.in_proj_b.weight.shape(), (Shape{4, 256}));
  EXPECT_EQ(g.in_proj_a.weight.shape(), (Shape{4, 256}));
  EXPECT_EQ(g.conv1d.shape(), (Shape{256, 1, 4}));
  EXPECT_EQ(g.a_log.shape(), (Shape{4}));
  EXPECT_EQ(g.dt_bias.shape(), (Shape{4}));
  EXPECT_EQ(g.norm.shape(), (Shape{32}));
  EXPECT_EQ(g.out_proj.weight.shape(), (Shape{256, 128}));
  // gated full attention: q_proj holds the query and the output gate
  const LayerWeights& full = w.layers[3];
  EXPECT_EQ(full.q_proj.weight.shape(), (Shape{2 * 4 * 64, 256}));
  EXPECT_EQ(full.k_proj.weight.shape(), (Shape{2 * 64, 256}));
  EXPECT_EQ(full.o_proj.weight.shape(), (Shape{256, 4 * 64}));
  EXPECT_EQ(full.q_norm.shape(), (Shape{64}));

  // scales: linears ~ 1/sqrt(in); (1+w) norms near 0, the gated norm (a plain weight) near 1;
  // A = exp(A_log) in [1, 16] and spread; dt_bias and the conv small
  EXPECT_NEAR(stddev(g.in_proj_qkv.weight.to_f32()), 1.0 / 16, 0.005);
  EXPECT_NEAR(stddev(g.out_proj.weight.to_f32()), 1.0 / std::sqrt(128.0), 0.008);
  expect_within(w.layers[0].input_layernorm, -0.101f, 0.101f, "input_layernorm");
  expect_within(full.q_norm, -0.101f, 0.101f, "q_norm");
  expect_within(w.final_norm, -0.101f, 0.101f, "norm");
  expect_within(g.norm, 0.899f, 1.101f, "linear_attn.norm");
  expect_within(g.dt_bias, -0.101f, 0.101f, "dt_bias");
  expect_within(g.conv1d, -0.502f, 0.502f, "conv1d");
  EXPECT_GT(stddev(g.conv1d.to_f32()), 0.2);  // U(+-0.5): std 0.29
  float a_min = 100, a_max = 0;
  for (const LayerWeights& lw : w.layers) {
    if (!lw.is_linear_attention) continue;
    const Tensor a_log = lw.linear_attn.a_log.to_f32();
    for (int64_t i = 0; i < a_log.numel(); ++i) {
      const float a = std::exp(a_log.item_f32(i));
      a_min = std::min(a_min, a);
      a_max = std::max(a_max, a);
    }
  }
  EXPECT_GE(a_min, 0.99f);
  EXPECT_LE(a_max, 16.3f);
  EXPECT_GT(a_max - a_min, 3.0f);  // 12 draws of U(1, 16)
}

// --layers keeps the preset's pattern (and continues it past the preset's own count).
TEST_F(SynthQwen35Test, LayersKeepThePattern) {
  const ModelWeights three =
      load_checkpoint(synth("l3", "--preset tiny-qwen3.5-moe --layers 3"), quiet());
  EXPECT_EQ(three.config.layer_types, (std::vector<std::string>{kLinear, kLinear, kLinear}));
  EXPECT_TRUE(three.layers[2].is_linear_attention);
  const ModelWeights nine =
      load_checkpoint(synth("l9", "--preset tiny-qwen3.5-moe --layers 9"), quiet());
  ASSERT_EQ(nine.layers.size(), 9u);
  for (size_t l = 0; l < 9; ++l)
    EXPECT_EQ(nine.layers[l].is_linear_attention, (l + 1) % 4 != 0) << "layer " << l;
}

// ---------------------------------------------------------------------------------------------
// FP8 and NVFP4

// Every FP8 block's scale is positive and finite and its largest code is +-448; the dequantized
// weight keeps the init's scale.
void check_fp8(const LinearWeight& lw) {
  ASSERT_STREQ(weight_format_name(lw.format), "fp8-block") << lw.name;
  ASSERT_EQ(lw.weight.dtype(), DType::kF8E4M3) << lw.name;
  const int64_t rows = lw.out_features, cols = lw.in_features;
  ASSERT_EQ(lw.scale.shape(), (Shape{(rows + 127) / 128, (cols + 127) / 128})) << lw.name;
  const auto* q = static_cast<const uint8_t*>(lw.weight.raw_data());
  for (int64_t rb = 0; rb < lw.scale.dim(0); ++rb) {
    for (int64_t cb = 0; cb < lw.scale.dim(1); ++cb) {
      const float s = lw.scale.item_f32(rb * lw.scale.dim(1) + cb);
      ASSERT_TRUE(std::isfinite(s) && s > 0.0f) << lw.name << " block " << rb << "," << cb;
      float amax = 0.0f;
      for (int64_t n = rb * 128; n < std::min(rows, rb * 128 + 128); ++n)
        for (int64_t k = cb * 128; k < std::min(cols, cb * 128 + 128); ++k)
          amax = std::max(amax, std::fabs(e4m3_to_f32(q[n * cols + k])));
      ASSERT_EQ(amax, 448.0f) << lw.name << " block " << rb << "," << cb;
    }
  }
  EXPECT_NEAR(stddev(ops::dequant_fp8_block_ref(lw.weight, lw.scale)),
              1.0 / std::sqrt(double(cols)), 0.12 / std::sqrt(double(cols)))
      << lw.name;
}

void expect_dense_bf16(const LinearWeight& lw) {
  EXPECT_STREQ(weight_format_name(lw.format), "dense") << lw.name;
  EXPECT_EQ(dtype_name(lw.weight.dtype()), dtype_name(DType::kBF16)) << lw.name;
}

// modules_to_not_convert of a Qwen3.5 FP8 release for the 4 tiny layers, written out.
std::vector<std::string> tiny_fp8_not_converted() {
  std::vector<std::string> list = {"lm_head", "model.embed_tokens"};
  for (int l = 0; l < 4; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    list.push_back(p + "input_layernorm");
    if (l < 3) {
      for (const char* m : {"A_log", "conv1d", "dt_bias", "in_proj_a", "in_proj_b", "norm"})
        list.push_back(p + "linear_attn." + m);
    } else {
      list.push_back(p + "self_attn.q_norm");
      list.push_back(p + "self_attn.k_norm");
    }
    list.push_back(p + "mlp.gate");
    list.push_back(p + "mlp.shared_expert_gate");
    list.push_back(p + "post_attention_layernorm");
  }
  return list;
}

TEST_F(SynthQwen35Test, Fp8KeepsExactlyTheReleasesUnconvertedModulesInBf16) {
  const fs::path dir = synth("f8", "--preset tiny-qwen3.5-moe --quant fp8 --seed 4");
  const json q = json::parse(test::read_text_file(dir / "config.json"))["quantization_config"];
  EXPECT_EQ(q["quant_method"], "fp8");
  EXPECT_EQ(q["weight_block_size"], json({128, 128}));
  EXPECT_EQ(q["modules_to_not_convert"], json(tiny_fp8_not_converted()));

  const ModelWeights w = load_checkpoint(dir, quiet());
  EXPECT_EQ(w.config.quant.method, QuantMethod::kFp8Block);
  for (const LayerWeights& l : w.layers) {
    if (l.is_linear_attention) {
      check_fp8(l.linear_attn.in_proj_qkv);
      check_fp8(l.linear_attn.in_proj_z);
      check_fp8(l.linear_attn.out_proj);
      expect_dense_bf16(l.linear_attn.in_proj_a);
      expect_dense_bf16(l.linear_attn.in_proj_b);
      EXPECT_EQ(l.linear_attn.conv1d.dtype(), DType::kBF16);
      EXPECT_EQ(l.linear_attn.a_log.dtype(), DType::kBF16);
    } else {
      for (const LinearWeight* lw : {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj}) check_fp8(*lw);
      EXPECT_EQ(l.q_norm.dtype(), DType::kBF16);
    }
    check_fp8(l.shared_expert.gate);
    check_fp8(l.shared_expert.down);
    for (int e = 0; e < 8; e += 3) {
      check_fp8(l.experts.gate[e]);
      check_fp8(l.experts.up[e]);
      check_fp8(l.experts.down[e]);
    }
    EXPECT_EQ(l.router.dtype(), DType::kBF16);
    EXPECT_EQ(l.shared_expert_gate.dtype(), DType::kBF16);
  }
  EXPECT_EQ(w.lm_head.format, WeightFormat::kDense);
  EXPECT_EQ(w.embed_tokens.dtype(), DType::kBF16);
  // and nothing else is FP8: every scale belongs to a module the list does not name
  size_t scales = 0;
  for (const std::string& name : w.store.names()) {
    if (name.size() < 17 || name.compare(name.size() - 17, 17, ".weight_scale_inv") != 0) continue;
    ++scales;
    EXPECT_FALSE(w.config.quant.is_excluded(name.substr(0, name.size() - 17))) << name;
  }
  // per layer: 3 GDN or 4 attention projections, the shared expert's 3, the experts' 8 x 3
  EXPECT_EQ(scales, 3u * (3 + 3 + 24) + (4 + 3 + 24));
}

// NVFP4 values decode to finite numbers with the tensor's global scale; the init scale survives.
void check_nvfp4(const LinearWeight& lw) {
  ASSERT_STREQ(weight_format_name(lw.format), "nvfp4") << lw.name;
  ASSERT_EQ(lw.weight.shape(), (Shape{lw.out_features, lw.in_features / 2})) << lw.name;
  ASSERT_EQ(lw.scale.shape(), (Shape{lw.out_features, lw.in_features / 16})) << lw.name;
  ASSERT_TRUE(std::isfinite(lw.scale_2) && lw.scale_2 > 0.0f) << lw.name;
  EXPECT_TRUE(lw.has_input_scale) << lw.name;
  const Tensor d = ops::dequant_nvfp4_ref(lw.weight, lw.scale, lw.scale_2);
  float amax = 0.0f;
  for (int64_t i = 0; i < d.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(d.item_f32(i))) << lw.name << " element " << i;
    amax = std::max(amax, std::fabs(d.item_f32(i)));
  }
  EXPECT_NEAR(amax, 6.0f * 448.0f * lw.scale_2, 1e-6f * amax) << lw.name;
  EXPECT_NEAR(stddev(d), 1.0 / std::sqrt(double(lw.in_features)),
              0.15 / std::sqrt(double(lw.in_features)))
      << lw.name;
}

TEST_F(SynthQwen35Test, Nvfp4QuantizesTheRoutedExpertsOnlyPerExpert) {
  const fs::path dir = synth("n4", "--preset tiny-qwen3.5-moe --quant nvfp4");
  const json hf = json::parse(test::read_text_file(dir / "hf_quant_config.json"));
  EXPECT_THAT(
      hf["quantization"]["exclude_modules"].get<std::vector<std::string>>(),
      ::testing::IsSupersetOf({"lm_head", "model.layers.*.mlp.gate",
                               "model.layers.*.mlp.shared_expert_gate", "model.layers.*.self_attn",
                               "model.layers.*.linear_attn", "model.layers.*.mlp.shared_expert"}));
  const ModelWeights w = load_checkpoint(dir, quiet());
  EXPECT_EQ(w.config.quant.method, QuantMethod::kNvfp4);
  for (const LayerWeights& l : w.layers) {
    EXPECT_FALSE(l.experts.fused_on_disk);
    for (int e = 0; e < 8; e += 2) {
      check_nvfp4(l.experts.gate[e]);
      check_nvfp4(l.experts.down[e]);
      EXPECT_NE(l.experts.gate[e].scale_2, l.experts.up[e].scale_2);  // separate global scales
    }
    if (l.is_linear_attention) {
      for (const LinearWeight* lw :
           {&l.linear_attn.in_proj_qkv, &l.linear_attn.in_proj_z, &l.linear_attn.in_proj_b,
            &l.linear_attn.in_proj_a, &l.linear_attn.out_proj}) {
        expect_dense_bf16(*lw);
      }
    } else {
      for (const LinearWeight* lw : {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj})
        expect_dense_bf16(*lw);
    }
    for (const LinearWeight* lw :
         {&l.shared_expert.gate, &l.shared_expert.up, &l.shared_expert.down})
      expect_dense_bf16(*lw);
  }
  EXPECT_EQ(w.lm_head.format, WeightFormat::kDense);
}

// ---------------------------------------------------------------------------------------------
// the presets' configurations (no weights)

TEST(SynthQwen35Presets, RealModelHasTheHybridPatternAndSizes) {
  const ModelConfig c = cli::preset_config("qwen3.5-35b-a3b", 0, "bf16");
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  ASSERT_EQ(c.num_hidden_layers, 40);
  ASSERT_EQ(c.layer_types.size(), 40u);
  for (size_t l = 0; l < 40; ++l)
    EXPECT_EQ(c.layer_types[l], (l + 1) % 4 == 0 ? kFull : kLinear) << "layer " << l;
  EXPECT_EQ(c.linear_attention, (LinearAttentionConfig{4, 128, 128, 16, 32}));
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c.attention_output_gate && c.shared_expert_gate && c.norm_topk_prob);
  EXPECT_EQ(parse_model_config(model_config_to_json(c), "round trip"), c);
  // embeddings + lm_head 1.02 B, 40 MoE layers 32.4 B, 30 GDN layers 1.01 B, 10 attention 0.27 B
  const uint64_t parameters = cli::synth::model_totals(c).parameters;
  EXPECT_GT(parameters, 34'600'000'000ull);
  EXPECT_LT(parameters, 34'700'000'000ull);

  // --layers: the first layers, pattern kept
  EXPECT_EQ(cli::preset_config("qwen3.5-35b-a3b", 6, "bf16").layer_types,
            (std::vector<std::string>{kLinear, kLinear, kLinear, kFull, kLinear, kLinear}));
}

TEST(SynthQwen35Presets, RealModelFp8AndNvfp4Exclusions) {
  const QuantConfig fp8 = cli::preset_config("qwen3.5-35b-a3b", 0, "fp8").quant;
  // lm_head + embeddings; per layer 2 norms, router, shared_expert_gate; 30 x 6 GDN parameters;
  // 10 x q_norm / k_norm
  EXPECT_EQ(fp8.modules_to_not_convert.size(), 2u + 40 * 4 + 30 * 6 + 10 * 2);
  for (const char* m :
       {"model.layers.0.linear_attn.in_proj_a", "model.layers.38.linear_attn.in_proj_b",
        "model.layers.5.mlp.shared_expert_gate", "model.layers.39.mlp.gate", "lm_head",
        "model.embed_tokens"}) {
    EXPECT_TRUE(fp8.is_excluded(m)) << m;
  }
  for (const char* m :
       {"model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.out_proj",
        "model.layers.3.self_attn.q_proj", "model.layers.5.mlp.shared_expert.up_proj",
        "model.layers.5.mlp.experts.7.gate_proj"}) {
    EXPECT_FALSE(fp8.is_excluded(m)) << m;
  }
  for (const std::string& m : fp8.modules_to_not_convert)
    EXPECT_EQ(m.find('*'), std::string::npos) << m;  // explicit names, like the releases

  const QuantConfig nvfp4 = cli::preset_config("qwen3.5-35b-a3b", 0, "nvfp4").quant;
  for (const char* m :
       {"model.layers.3.self_attn.q_proj", "model.layers.0.linear_attn.in_proj_qkv",
        "model.layers.2.mlp.shared_expert.down_proj", "model.layers.2.mlp.gate", "lm_head"}) {
    EXPECT_TRUE(nvfp4.is_excluded(m)) << m;
  }
  EXPECT_FALSE(nvfp4.is_excluded("model.layers.2.mlp.experts.255.down_proj"));
}

TEST(SynthQwen35Presets, SmallPreset) {
  const ModelConfig c = cli::preset_config("small-qwen3.5-moe", 0, "bf16");
  EXPECT_EQ(c.num_hidden_layers, 8);
  EXPECT_EQ(std::count(c.layer_types.begin(), c.layer_types.end(), kFull), 2);
  EXPECT_EQ(c.layer_types[3], kFull);
  EXPECT_EQ(c.layer_types[7], kFull);
  EXPECT_EQ(c.rotary_dim(), 32);
  EXPECT_GT(c.linear_attention.num_value_heads, c.linear_attention.num_key_heads);
  const uint64_t parameters = cli::synth::model_totals(c).parameters;
  EXPECT_GT(parameters, 90'000'000ull);
  EXPECT_LT(parameters, 130'000'000ull);
}

// ---------------------------------------------------------------------------------------------
// synth-adapter

void expect_shape(const SafetensorsStore& s, const std::string& key, const Shape& shape) {
  const std::string full = "base_model.model." + key;
  ASSERT_TRUE(s.contains(full)) << full;
  EXPECT_EQ(s.info(full).shape, shape) << full;
}

TEST_F(SynthQwen35Test, AdapterTargetsFollowTheLayerKinds) {
  const fs::path model = synth("base", "--preset tiny-qwen3.5-moe --seed 1");
  const fs::path all =
      adapter("all", "--model " + quoted(model) + " --rank 2 --alpha 4 --targets all");
  const SafetensorsStore s = SafetensorsStore::open_dir(all, "adapter_model");
  // linear-attention layers 0-2: the five Gated DeltaNet projections
  expect_shape(s, "model.layers.0.linear_attn.in_proj_qkv.lora_A.weight", {2, 256});
  expect_shape(s, "model.layers.0.linear_attn.in_proj_qkv.lora_B.weight", {256, 2});
  expect_shape(s, "model.layers.1.linear_attn.in_proj_z.lora_B.weight", {128, 2});
  expect_shape(s, "model.layers.2.linear_attn.in_proj_b.lora_B.weight", {4, 2});
  expect_shape(s, "model.layers.2.linear_attn.in_proj_a.lora_A.weight", {2, 256});
  expect_shape(s, "model.layers.1.linear_attn.out_proj.lora_A.weight", {2, 128});
  expect_shape(s, "model.layers.1.linear_attn.out_proj.lora_B.weight", {256, 2});
  // full-attention layer 3: q_proj of the doubled (query + gate) width
  expect_shape(s, "model.layers.3.self_attn.q_proj.lora_B.weight", {512, 2});
  expect_shape(s, "model.layers.3.self_attn.k_proj.lora_B.weight", {128, 2});
  expect_shape(s, "model.layers.3.self_attn.o_proj.lora_A.weight", {2, 256});
  expect_shape(s, "model.layers.3.mlp.experts.7.up_proj.lora_B.weight", {128, 2});
  expect_shape(s, "model.layers.0.mlp.shared_expert.down_proj.lora_A.weight", {2, 128});
  EXPECT_FALSE(s.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_FALSE(s.contains("base_model.model.model.layers.3.linear_attn.in_proj_qkv.lora_A.weight"));
  // 3 layers x 5 GDN + 1 x 4 attention, 4 MoE layers x (8 experts x 3 + the shared expert's 3)
  EXPECT_EQ(s.size(), 2u * (3 * 5 + 4 + 4 * (8 * 3 + 3)));
  const AdapterConfig cfg = parse_adapter_config(all / "adapter_config.json");
  ASSERT_TRUE(cfg.target_modules_regex.has_value());
  for (const char* m :
       {"model.layers.0.linear_attn.in_proj_qkv", "model.layers.2.linear_attn.out_proj",
        "model.layers.3.self_attn.q_proj", "model.layers.1.mlp.experts.3.down_proj",
        "model.layers.1.mlp.shared_expert.gate_proj"}) {
    EXPECT_TRUE(cfg.targets_module(m)) << m;
  }
  for (const char* m : {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
                        "model.layers.0.linear_attn.conv1d", "lm_head"}) {
    EXPECT_FALSE(cfg.targets_module(m)) << m;
  }

  // leaf names when no MLP target needs a regex
  const fs::path leaves = adapter(
      "leaves", "--model " + quoted(model) + " --targets q_proj,in_proj_qkv,out_proj,experts");
  EXPECT_EQ(json::parse(test::read_text_file(leaves / "adapter_config.json"))["target_modules"],
            json({"down_proj", "gate_proj", "in_proj_qkv", "out_proj", "q_proj", "up_proj"}));

  // targets a model lacks: no full-attention layer in the first 3, no GDN in Qwen3-MoE
  const fs::path linear_only = synth("l3", "--preset tiny-qwen3.5-moe --layers 3");
  const test::CommandResult no_q =
      test::run_moelora("synth-adapter --targets q_proj --model " + quoted(linear_only) +
                        " --out " + quoted(tmp_ / "bad"));
  EXPECT_NE(no_q.exit_code, 0);
  EXPECT_THAT(no_q.output,
              HasSubstr("has no 'q_proj' module; valid targets: in_proj_qkv, in_proj_z, in_proj_b, "
                        "in_proj_a, out_proj, experts, shared_experts, all"));
  const fs::path qwen3 = synth("q3", "--preset tiny-qwen3-moe --layers 1");
  const test::CommandResult no_gdn =
      test::run_moelora("synth-adapter --targets in_proj_z --model " + quoted(qwen3) + " --out " +
                        quoted(tmp_ / "bad"));
  EXPECT_NE(no_gdn.exit_code, 0);
  EXPECT_THAT(no_gdn.output, HasSubstr("has no 'in_proj_z' module"));
}

// --targets all in every expert layout round-trips through the adapter loader: the Gated
// DeltaNet projections on the linear-attention layers, gated attention on the full one.
TEST_F(SynthQwen35Test, AllTargetsAdapterLoadsInEveryLayout) {
  const fs::path model = synth("base", "--preset tiny-qwen3.5-moe --seed 1");
  const ModelConfig base = load_model_config(model);
  for (const char* layout : {"per-expert", "peft-3d", "shared-outer"}) {
    SCOPED_TRACE(layout);
    const fs::path dir = adapter(std::string("all-") + layout,
                                 "--model " + quoted(model) + " --rank 4 --alpha 8 --layout " +
                                     layout + " --targets all --dtype bf16");
    const LoraAdapter a = load_adapter(dir, base, layout);
    ASSERT_EQ(a.layers.size(), 4u);
    for (size_t l = 0; l < 3; ++l) {
      const LayerLora& ll = a.layers[l];
      ASSERT_TRUE(ll.in_proj_qkv.defined() && ll.in_proj_z.defined() && ll.in_proj_b.defined() &&
                  ll.in_proj_a.defined() && ll.out_proj.defined())
          << "layer " << l;
      EXPECT_EQ(ll.in_proj_qkv.out_features(), 256);
      EXPECT_EQ(ll.in_proj_z.out_features(), 128);
      EXPECT_EQ(ll.in_proj_b.out_features(), 4);
      EXPECT_EQ(ll.in_proj_a.out_features(), 4);
      EXPECT_EQ(ll.out_proj.in_features(), 128);
      EXPECT_FLOAT_EQ(ll.out_proj.scaling, 2.0f);
      EXPECT_FALSE(ll.q_proj.defined()) << "layer " << l;
    }
    const LayerLora& full = a.layers[3];
    EXPECT_FALSE(full.in_proj_qkv.defined());
    ASSERT_TRUE(full.q_proj.defined());
    EXPECT_EQ(full.q_proj.out_features(), 512);
    EXPECT_TRUE(full.v_proj.defined() && full.o_proj.defined());
    for (const LayerLora& ll : a.layers) {
      EXPECT_TRUE(ll.experts_gate_up.defined());
      EXPECT_TRUE(ll.experts_down.defined());
      EXPECT_TRUE(ll.shared_gate.defined() && ll.shared_down.defined());
    }
  }
}

// Attention and expert targets alone, in the per-expert and PEFT 3-D layouts.
TEST_F(SynthQwen35Test, AttentionAndExpertAdapterLoads) {
  const fs::path model = synth("base", "--preset tiny-qwen3.5-moe --seed 1");
  const fs::path dir = adapter("ae", "--model " + quoted(model) +
                                         " --rank 4 --alpha 8 --layout per-expert --targets "
                                         "q_proj,k_proj,v_proj,o_proj,experts,shared_experts");
  const LoraAdapter a = load_adapter(dir, load_model_config(model), "ae");
  ASSERT_EQ(a.layers.size(), 4u);
  EXPECT_EQ(a.expert_layout, ExpertLoraLayout::kPerExpert);
  EXPECT_FALSE(a.layers[0].q_proj.defined());
  ASSERT_TRUE(a.layers[3].q_proj.defined());
  EXPECT_EQ(a.layers[3].q_proj.out_features(), 512);
  EXPECT_EQ(a.layers[3].o_proj.in_features(), 256);
  EXPECT_FLOAT_EQ(a.layers[3].q_proj.scaling, 2.0f);
  for (size_t l = 0; l < 4; ++l) {
    EXPECT_TRUE(a.layers[l].experts_gate_up.defined()) << "layer " << l;
    EXPECT_TRUE(a.layers[l].shared_down.defined()) << "layer " << l;
  }
  const fs::path peft3d = adapter(
      "p3", "--model " + quoted(model) + " --rank 4 --layout peft-3d --targets q_proj,experts");
  EXPECT_EQ(load_adapter(peft3d, load_model_config(model), "p3").expert_layout,
            ExpertLoraLayout::kPeft3d);
}

// ---------------------------------------------------------------------------------------------
// the CPU model on synthesized checkpoints

bool all_finite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(t.item_f32(i))) return false;
  }
  return true;
}

// 70 tokens: past the 64-token chunk of the Gated DeltaNet prefill (a 70-token prefill of this
// preset takes ~15 ms on 2 cores). FP8 / NVFP4 checkpoints of the same seed quantize the bf16
// weights, so their logits must track the bf16 ones; an adapter on every target (the GDN
// projections included) must change them.
TEST_F(SynthQwen35Test, CpuModelRunsEveryFormatAndAnAllTargetsAdapter) {
  std::vector<int32_t> tokens(70);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 37 + 5) % 512);
  model::ModelOptions options;
  options.show_progress = false;
  Tensor logits[3];
  const char* quants[3] = {"bf16", "fp8", "nvfp4"};
  for (int q = 0; q < 3; ++q) {
    SCOPED_TRACE(quants[q]);
    const fs::path dir =
        synth(std::string("m-") + quants[q],
              std::string("--preset tiny-qwen3.5-moe --seed 3 --quant ") + quants[q]);
    model::Model model = model::Model::load(dir, options);
    model::Sequence seq = model.new_sequence();
    const auto start = std::chrono::steady_clock::now();
    logits[q] = model.forward(seq, tokens);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("tiny-qwen3.5-moe %s: %zu-token prefill in %.1f ms\n", quants[q], tokens.size(),
                ms);
    ASSERT_TRUE(all_finite(logits[q]));
    if (q == 0) {
      const fs::path lora =
          adapter("all", "--model " + quoted(dir) + " --rank 4 --alpha 8 --targets all");
      model.load_adapter("all", lora);
      model::Sequence adapted = model.new_sequence("all");
      const Tensor with_lora = model.forward(adapted, tokens);
      ASSERT_TRUE(all_finite(with_lora));
      EXPECT_GT(test::max_abs_diff(with_lora, logits[0]), 1e-3);
    }
  }
  // Mostly above 0.99 per token; a few tokens whose top-2 of 8 experts flips in some layer drop
  // to ~0.9. A dequantization wired wrong (a divided scale, a swapped nibble) ends far below.
  EXPECT_GT(test::cosine_similarity(logits[1], logits[0]), 0.95);
  EXPECT_GT(test::cosine_similarity(logits[2], logits[0]), 0.9);
  EXPECT_GT(test::max_abs_diff(logits[1], logits[0]), 0.0);  // really quantized
  EXPECT_GT(test::max_abs_diff(logits[2], logits[0]), 0.0);
}

// ---------------------------------------------------------------------------------------------
// inspect

// Copies the checkpoint in `from` to `to` with config.json replaced, every tensor renamed by
// `rename`, and `extra` zero tensors added.
void rewrite_checkpoint(const fs::path& from, const fs::path& to, const json& config,
                        const std::function<std::string(const std::string&)>& rename,
                        const std::vector<std::pair<std::string, Shape>>& extra) {
  fs::create_directories(to);
  test::write_text_file(to / "config.json", config.dump(2));
  const SafetensorsStore store = SafetensorsStore::open_dir(from);
  SafetensorsWriter writer;
  for (const std::string& name : store.names()) writer.add(rename(name), store.tensor(name));
  for (const auto& [name, shape] : extra) writer.add(name, Tensor::zeros(DType::kBF16, shape));
  writer.write(to / "model.safetensors");
}

TEST_F(SynthQwen35Test, InspectShowsTheLayerPatternAndIgnoredTensors) {
  const fs::path model = synth("base", "--preset tiny-qwen3.5-moe");
  const std::string table = moelora("inspect " + quoted(model));
  for (const char* fact :
       {"Qwen3_5MoeForCausalLM", "4 (4 MoE; 3 Gated DeltaNet + 1 full attention)",
        "full attention in 1 of 4 layers, Gated DeltaNet in 3: 3 linear + 1 full",
        "Gated DeltaNet: 2 key heads of 32, 4 value heads of 32, conv kernel 4", "output gate",
        "check            ok"}) {
    EXPECT_THAT(table, HasSubstr(fact));
  }
  EXPECT_THAT(table, Not(HasSubstr("ignored")));
  const json j = json::parse(moelora("inspect --json " + quoted(model)));
  EXPECT_EQ(j["attention"]["layer_pattern"], "3 linear + 1 full");
  EXPECT_EQ(j["linear_attention_layers"], json({0, 1, 2}));
  EXPECT_EQ(j["attention"]["linear_attention"]["num_value_heads"], 4);
  EXPECT_FALSE(j.contains("ignored_tensors"));

  const fs::path eight = synth("eight", "--preset tiny-qwen3.5-moe --layers 8");
  EXPECT_THAT(moelora("inspect " + quoted(eight)), HasSubstr("2 x (3 linear + 1 full)"));

  // The same weights as the VLM saves them (model.language_model.*), with a vision tower and an
  // MTP layer: loaded, and the skipped tensors explained.
  json vlm = json::parse(test::read_text_file(model / "config.json"));
  json text = vlm;
  text.erase("architectures");
  vlm = {{"model_type", "qwen3_5_moe"},
         {"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
         {"tie_word_embeddings", false},
         {"text_config", text}};
  const fs::path with_vision = tmp_ / "vlm";
  rewrite_checkpoint(
      model, with_vision, vlm,
      [](const std::string& name) {
        return name.rfind("model.", 0) == 0 ? "model.language_model." + name.substr(6) : name;
      },
      {{"model.visual.blocks.0.attn.qkv.weight", {48, 16}},
       {"model.visual.merger.linear_fc1.weight", {16, 16}},
       {"mtp.fc.weight", {256, 512}}});
  const std::string vt = moelora("inspect " + quoted(with_vision));
  for (const char* fact : {"3 tensors not used by the qwen3_5_moe_text text model",
                           "2 model.visual.*: outside the text model (vision tower / projector)",
                           "1 mtp.*: the multi-token prediction layer", "check            ok"}) {
    EXPECT_THAT(vt, HasSubstr(fact));
  }
  const json vj = json::parse(moelora("inspect --json " + quoted(with_vision)));
  EXPECT_EQ(vj["ignored_tensors"]["count"], 3);
  ASSERT_EQ(vj["ignored_tensors"]["groups"].size(), 2u);
  EXPECT_EQ(vj["ignored_tensors"]["groups"][0]["tensors"], "model.visual.*");
  EXPECT_EQ(vj["ignored_tensors"]["groups"][0]["count"], 2);
  EXPECT_EQ(vj["check"], "ok");

  // the text config ignores the MTP layer too
  const fs::path with_mtp = tmp_ / "mtp";
  rewrite_checkpoint(model, with_mtp, json::parse(test::read_text_file(model / "config.json")),
                     [](const std::string& name) { return name; },
                     {{"mtp.fc.weight", {256, 512}}, {"mtp.norm.weight", {256}}});
  EXPECT_THAT(moelora("inspect " + quoted(with_mtp)),
              HasSubstr("2 tensors not used by the qwen3_5_moe_text text model"));
}

}  // namespace
}  // namespace moelora::io
