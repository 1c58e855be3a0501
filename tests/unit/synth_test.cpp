// `moelora synth`, `moelora synth-adapter` and `moelora inspect`, run as the built binary:
//   - the tiny presets in bf16, fp8 and nvfp4 load back through load_checkpoint with the preset's
//     shapes, dtypes and formats; FP8 scales are positive and finite and every block reaches
//     +-448 (scale_inv = amax / 448); NVFP4 codes decode to finite values and the largest one is
//     6 * 448 * scale_2 (scale_2 = amax / (6 * 448)); values are seeded and scaled like a real
//     init;
//   - --layers, --max-shard-size (sharded == single file, tensor for tensor), --tokenizer;
//   - synth-adapter in each layout: the exact PEFT keys and shapes, adapter_config.json fields,
//     random non-zero B, and the adapter loader (io/peft.h) reading it back in the same layout;
//   - inspect on models and adapters (table and --json), and its exit code on a broken model;
//   - bad arguments: non-zero exit and one error line that names the argument;
//   - optional, when python3 has torch + transformers + peft: transformers loads a synthesized
//     checkpoint and PEFT loads synthesized adapters onto it without missing or unexpected keys.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "io/checkpoint.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

std::string quoted(const fs::path& p) {
  return "'" + p.string() + "'";
}

// Runs `moelora <args>`; fails the test (with the binary's output) when the exit code differs.
std::string moelora(const std::string& args, int expected_exit = 0) {
  const fs::path binary = test::binary_dir() / "moelora";
  if (!fs::exists(binary)) {
    ADD_FAILURE() << "the moelora binary is missing at " << binary.string()
                  << ": build the `moelora` target of this build directory first";
    return "";
  }
  const test::CommandResult r = test::run_moelora(args);
  EXPECT_EQ(r.exit_code, expected_exit) << "moelora " << args << "\n" << r.output;
  return r.output;
}

// The error output of a failing command: exit code != 0 and one line naming `parts`.
void expect_cli_error(const std::string& args, const std::vector<std::string>& parts) {
  const test::CommandResult r = test::run_moelora(args);
  EXPECT_NE(r.exit_code, 0) << "moelora " << args << "\n" << r.output;
  std::string first_line = r.output.substr(0, r.output.find('\n'));
  for (const std::string& part : parts)
    EXPECT_THAT(first_line, HasSubstr(part)) << "moelora " << args;
  // main prints library errors as one line; CLI11's own parse errors add a "Run with --help" hint
  size_t lines = 0;
  for (char ch : r.output) lines += ch == '\n';
  EXPECT_LE(lines, 2u) << r.output;
}

LoadOptions quiet() {
  LoadOptions o;
  o.show_progress = false;
  return o;
}

class SynthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(test::binary_dir() / "moelora"))
        << "the moelora binary is missing at " << (test::binary_dir() / "moelora").string()
        << ": build the `moelora` target of this build directory (it is part of `all`)";
  }
  // synth into tmp_/name; returns the directory
  fs::path synth(const std::string& name, const std::string& args) {
    const fs::path dir = tmp_ / name;
    moelora("synth " + args + " --out " + quoted(dir));
    return dir;
  }
  test::TempDir tmp_;
};

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

std::string file_bytes(const fs::path& p) {
  return test::read_text_file(p);
}

// ---------------------------------------------------------------------------------------------
// synth: dense

TEST_F(SynthTest, TinyQwenBf16LoadsBackWithThePresetShapes) {
  const fs::path dir = synth("q", "--preset tiny-qwen3-moe --seed 7");
  const ModelWeights w = load_checkpoint(dir, quiet());
  const ModelConfig& c = w.config;
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.moe_intermediate_size, 128);
  EXPECT_EQ(c.quant.method, QuantMethod::kNone);
  ASSERT_EQ(w.layers.size(), 3u);
  EXPECT_FALSE(w.layers[1].is_moe);  // mlp_only_layers [1]
  EXPECT_EQ(w.layers[1].mlp.gate.weight.shape(), (Shape{384, 256}));
  const LayerWeights& l0 = w.layers[0];
  EXPECT_EQ(l0.q_proj.weight.shape(), (Shape{256, 256}));
  EXPECT_EQ(l0.k_proj.weight.shape(), (Shape{128, 256}));
  EXPECT_EQ(l0.q_norm.shape(), (Shape{64}));
  EXPECT_EQ(l0.router.shape(), (Shape{8, 256}));
  EXPECT_EQ(l0.experts.gate[7].weight.shape(), (Shape{128, 256}));
  EXPECT_EQ(l0.experts.down[7].weight.shape(), (Shape{256, 128}));
  EXPECT_FALSE(l0.experts.fused_on_disk);
  EXPECT_EQ(l0.experts.up[3].weight.dtype(), DType::kBF16);
  EXPECT_FALSE(fs::exists(dir / "tokenizer.json"));
  EXPECT_FALSE(fs::exists(dir / "hf_quant_config.json"));

  // scaled like a real init: linears ~ 1/sqrt(in), embeddings ~ 1, routers ~ 3/sqrt(H), norms near
  // 1
  EXPECT_NEAR(stddev(w.embed_tokens.to_f32()), 1.0, 0.05);
  EXPECT_NEAR(stddev(l0.q_proj.weight.to_f32()), 1.0 / 16, 0.005);
  EXPECT_NEAR(stddev(l0.experts.down[2].weight.to_f32()), 1.0 / std::sqrt(128.0), 0.006);
  EXPECT_NEAR(stddev(l0.router.to_f32()), 3.0 / 16, 0.02);
  const Tensor norm = l0.input_layernorm.to_f32();
  for (int64_t i = 0; i < norm.numel(); ++i) {
    ASSERT_GE(norm.item_f32(i), 0.89f);
    ASSERT_LE(norm.item_f32(i), 1.11f);
  }
  // distinct tensors get distinct values
  EXPECT_NE(
      std::memcmp(l0.experts.gate[0].weight.raw_data(), l0.experts.gate[1].weight.raw_data(), 64),
      0);

  // seeded: the same seed gives the same bytes, another seed other bytes
  const fs::path again = synth("q_again", "--preset tiny-qwen3-moe --seed 7");
  const fs::path other = synth("q_other", "--preset tiny-qwen3-moe --seed 8");
  EXPECT_EQ(file_bytes(dir / "model.safetensors"), file_bytes(again / "model.safetensors"));
  EXPECT_NE(file_bytes(dir / "model.safetensors"), file_bytes(other / "model.safetensors"));
}

TEST_F(SynthTest, TinyDeepseekBf16HasMlaDenseFirstLayerAndF32Bias) {
  const fs::path dir = synth("d", "--preset tiny-deepseek-v3");
  const ModelWeights w = load_checkpoint(dir, quiet());
  EXPECT_EQ(w.config.router, RouterKind::kSigmoidNoauxTc);
  EXPECT_EQ(w.config.n_group, 4);
  EXPECT_EQ(w.config.rope.type, "yarn");
  ASSERT_EQ(w.layers.size(), 3u);
  EXPECT_FALSE(w.layers[0].is_moe);
  const LayerWeights& l = w.layers[2];
  EXPECT_TRUE(l.is_moe);
  EXPECT_EQ(l.q_a_proj.weight.shape(), (Shape{128, 256}));
  EXPECT_EQ(l.q_b_proj.weight.shape(), (Shape{4 * 48, 128}));
  EXPECT_EQ(l.kv_a_proj_with_mqa.weight.shape(), (Shape{144, 256}));
  EXPECT_EQ(l.kv_b_proj.weight.shape(), (Shape{4 * 64, 128}));
  EXPECT_EQ(l.o_proj.weight.shape(), (Shape{256, 128}));
  EXPECT_EQ(l.e_score_correction_bias.dtype(), DType::kF32);
  EXPECT_EQ(l.e_score_correction_bias.shape(), (Shape{16}));
  EXPECT_EQ(l.shared_expert.gate.weight.shape(), (Shape{128, 256}));
  EXPECT_EQ(l.experts.num_experts, 16);
}

TEST_F(SynthTest, LayersShardsAndTokenizer) {
  const fs::path one = synth("one", "--preset tiny-deepseek-v3 --layers 2 --seed 3");
  const ModelWeights w1 = load_checkpoint(one, quiet());
  EXPECT_EQ(w1.layers.size(), 2u);
  EXPECT_EQ(w1.config.num_hidden_layers, 2);

  // sharded: several files + index, the same tensors as the single file
  const fs::path sharded =
      synth("sharded", "--preset tiny-deepseek-v3 --layers 2 --seed 3 --max-shard-size 1MB");
  EXPECT_TRUE(fs::exists(sharded / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(sharded / "model.safetensors"));
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(sharded)) {
    shards += entry.path().filename().string().rfind("model-0", 0) == 0;
  }
  EXPECT_GE(shards, 3);
  const ModelWeights w2 = load_checkpoint(sharded, quiet());
  const std::vector<std::string> names = w1.store.names();
  ASSERT_EQ(names, w2.store.names());
  for (const std::string& name : names) {
    const Tensor a = w1.store.tensor(name), b = w2.store.tensor(name);
    ASSERT_EQ(a.shape(), b.shape()) << name;
    ASSERT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0) << name;
  }
  const json index = json::parse(test::read_text_file(sharded / "model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"].size(), names.size());

  const fs::path tok = synth("tok", "--preset tiny-qwen3-moe --layers 1 --tokenizer " +
                                        quoted(test::data_dir() / "tokenizer"));
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
    EXPECT_EQ(file_bytes(tok / f), file_bytes(test::data_dir() / "tokenizer" / f)) << f;
  }
  EXPECT_EQ(load_checkpoint(tok, quiet()).layers.size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// synth: quantized

// Every FP8 block's scale is positive and finite and its largest code is +-448.
void check_fp8(const LinearWeight& lw) {
  ASSERT_EQ(lw.format, WeightFormat::kFp8Block) << lw.name;
  ASSERT_EQ(lw.weight.dtype(), DType::kF8E4M3) << lw.name;
  const int64_t rows = lw.out_features, cols = lw.in_features;
  ASSERT_EQ(lw.scale.shape(), (Shape{(rows + 127) / 128, (cols + 127) / 128})) << lw.name;
  const auto* q = static_cast<const uint8_t*>(lw.weight.raw_data());
  for (int64_t rb = 0; rb < lw.scale.dim(0); ++rb) {
    for (int64_t cb = 0; cb < lw.scale.dim(1); ++cb) {
      const float s = lw.scale.item_f32(rb * lw.scale.dim(1) + cb);
      ASSERT_TRUE(std::isfinite(s) && s > 0.0f)
          << lw.name << " block " << rb << "," << cb << ": " << s;
      float amax = 0.0f;
      for (int64_t n = rb * 128; n < std::min(rows, rb * 128 + 128); ++n)
        for (int64_t k = cb * 128; k < std::min(cols, cb * 128 + 128); ++k) {
          const float v = e4m3_to_f32(q[n * cols + k]);
          ASSERT_TRUE(std::isfinite(v)) << lw.name;
          amax = std::max(amax, std::fabs(v));
        }
      ASSERT_EQ(amax, 448.0f) << lw.name << " block " << rb << "," << cb;
    }
  }
  // the dequantized weight keeps the init's scale
  EXPECT_NEAR(stddev(ops::dequant_fp8_block_ref(lw.weight, lw.scale)),
              1.0 / std::sqrt(double(cols)), 0.12 / std::sqrt(double(cols)))
      << lw.name;
}

// NVFP4 codes decode to finite values; the largest |value| is 6 * 448 * scale_2.
void check_nvfp4(const LinearWeight& lw) {
  ASSERT_EQ(lw.format, WeightFormat::kNvfp4) << lw.name;
  ASSERT_EQ(lw.weight.dtype(), DType::kU8);
  ASSERT_EQ(lw.weight.shape(), (Shape{lw.out_features, lw.in_features / 2})) << lw.name;
  ASSERT_EQ(lw.scale.shape(), (Shape{lw.out_features, lw.in_features / 16})) << lw.name;
  ASSERT_TRUE(std::isfinite(lw.scale_2) && lw.scale_2 > 0.0f) << lw.name;
  ASSERT_TRUE(lw.has_input_scale);
  EXPECT_GT(lw.input_scale, 0.0f);
  const Tensor w = ops::dequant_nvfp4_ref(lw.weight, lw.scale, lw.scale_2);
  float amax = 0.0f;
  for (int64_t i = 0; i < w.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(w.item_f32(i))) << lw.name << " element " << i;
    amax = std::max(amax, std::fabs(w.item_f32(i)));
  }
  EXPECT_NEAR(amax, 6.0f * 448.0f * lw.scale_2, 1e-6f * amax) << lw.name;
  EXPECT_NEAR(stddev(w), 1.0 / std::sqrt(double(lw.in_features)),
              0.15 / std::sqrt(double(lw.in_features)))
      << lw.name;
}

TEST_F(SynthTest, Fp8QwenAndDeepseek) {
  const fs::path qdir = synth("qf", "--preset tiny-qwen3-moe --quant fp8");
  const ModelWeights q = load_checkpoint(qdir, quiet());
  EXPECT_EQ(q.config.quant.method, QuantMethod::kFp8Block);
  EXPECT_THAT(q.config.quant.modules_to_not_convert,
              ::testing::IsSupersetOf({"lm_head", "model.layers.0.mlp.gate"}));
  for (const LayerWeights& l : q.layers) {
    for (const LinearWeight* lw : {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj}) check_fp8(*lw);
    if (!l.is_moe) {
      check_fp8(l.mlp.gate);
      check_fp8(l.mlp.down);
      continue;
    }
    EXPECT_EQ(l.router.dtype(), DType::kBF16);
    for (int e = 0; e < 8; e += 3) {
      check_fp8(l.experts.gate[e]);
      check_fp8(l.experts.up[e]);
      check_fp8(l.experts.down[e]);
    }
  }
  EXPECT_EQ(q.lm_head.format, WeightFormat::kDense);
  EXPECT_EQ(q.embed_tokens.dtype(), DType::kBF16);

  const fs::path ddir = synth("df", "--preset tiny-deepseek-v3 --quant fp8 --seed 5");
  const ModelWeights d = load_checkpoint(ddir, quiet());
  for (const LayerWeights& l : d.layers) {
    for (const LinearWeight* lw :
         {&l.q_a_proj, &l.q_b_proj, &l.kv_a_proj_with_mqa, &l.kv_b_proj, &l.o_proj}) {
      check_fp8(*lw);
    }
    EXPECT_EQ(l.q_a_layernorm.dtype(), DType::kBF16);
  }
  EXPECT_EQ(d.layers[1].kv_a_proj_with_mqa.scale.shape(),
            (Shape{2, 2}));  // 144 rows: a partial block
  check_fp8(d.layers[0].mlp.up);
  check_fp8(d.layers[1].shared_expert.down);
  check_fp8(d.layers[2].experts.gate[15]);
  EXPECT_EQ(d.layers[1].e_score_correction_bias.dtype(), DType::kF32);
  EXPECT_EQ(d.layers[1].router.dtype(), DType::kBF16);
}

TEST_F(SynthTest, Nvfp4QwenAndDeepseek) {
  const fs::path qdir = synth("qn", "--preset tiny-qwen3-moe --quant nvfp4");
  EXPECT_TRUE(fs::exists(qdir / "hf_quant_config.json"));
  const json hf_quant = json::parse(test::read_text_file(qdir / "hf_quant_config.json"));
  EXPECT_EQ(hf_quant["quantization"]["quant_algo"], "NVFP4");
  EXPECT_EQ(hf_quant["quantization"]["group_size"], 16);
  const json config = json::parse(test::read_text_file(qdir / "config.json"));
  EXPECT_EQ(config["quantization_config"]["quant_method"], "modelopt");

  const ModelWeights q = load_checkpoint(qdir, quiet());
  EXPECT_EQ(q.config.quant.method, QuantMethod::kNvfp4);
  EXPECT_EQ(q.store.info("model.layers.0.self_attn.q_proj.weight_scale_2").shape, Shape{});
  EXPECT_EQ(q.store.info("model.layers.0.self_attn.q_proj.input_scale").shape, Shape{});
  for (const LayerWeights& l : q.layers) {
    for (const LinearWeight* lw : {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj}) check_nvfp4(*lw);
    if (!l.is_moe) {
      check_nvfp4(l.mlp.up);
      continue;
    }
    EXPECT_EQ(l.router.dtype(), DType::kBF16);
    for (int e = 0; e < 8; e += 2) {
      check_nvfp4(l.experts.gate[e]);
      check_nvfp4(l.experts.down[e]);
      EXPECT_NE(l.experts.gate[e].scale_2, l.experts.up[e].scale_2);  // separate global scales
    }
  }
  EXPECT_EQ(q.lm_head.format, WeightFormat::kDense);

  const ModelWeights d =
      load_checkpoint(synth("dn", "--preset tiny-deepseek-v3 --quant nvfp4"), quiet());
  for (const LayerWeights& l : d.layers) {
    for (const LinearWeight* lw :
         {&l.q_a_proj, &l.q_b_proj, &l.kv_a_proj_with_mqa, &l.kv_b_proj, &l.o_proj}) {
      check_nvfp4(*lw);
    }
  }
  check_nvfp4(d.layers[1].shared_expert.gate);
  check_nvfp4(d.layers[2].experts.up[9]);
  EXPECT_EQ(d.layers[2].e_score_correction_bias.dtype(), DType::kF32);
}

// ---------------------------------------------------------------------------------------------
// synth-adapter

class SynthAdapterTest : public SynthTest {
 protected:
  void SetUp() override {
    SynthTest::SetUp();
    qwen_ = synth("qwen", "--preset tiny-qwen3-moe --seed 1");
  }
  fs::path adapter(const std::string& name, const std::string& args) {
    const fs::path dir = tmp_ / name;
    moelora("synth-adapter " + args + " --out " + quoted(dir));
    return dir;
  }
  fs::path qwen_;
};

void expect_shape(const SafetensorsStore& s, const std::string& key, const Shape& shape) {
  const std::string full = "base_model.model." + key;
  ASSERT_TRUE(s.contains(full)) << full;
  EXPECT_EQ(s.info(full).shape, shape) << full;
  EXPECT_EQ(s.info(full).dtype, DType::kF32) << full;
}

// B factors are random, not PEFT's zeros; A stays within kaiming-uniform bounds.
void expect_random_factors(const SafetensorsStore& s) {
  for (const std::string& name : s.names()) {
    const Tensor t = s.tensor(name);
    float amax = 0.0f;
    for (int64_t i = 0; i < t.numel(); ++i) amax = std::max(amax, std::fabs(t.item_f32(i)));
    EXPECT_GT(amax, 0.0f) << name;
    if (name.find("lora_A") != std::string::npos) {
      EXPECT_LE(amax, 1.0f / std::sqrt(static_cast<float>(t.dim(-1))) + 1e-6f) << name;
    }
  }
}

TEST_F(SynthAdapterTest, PerExpertLayout) {
  const fs::path dir = adapter("pe", "--model " + quoted(qwen_) +
                                         " --rank 4 --alpha 8 --layout per-expert "
                                         "--targets q_proj,k_proj,v_proj,o_proj,experts --seed 2");
  const json cfg = json::parse(test::read_text_file(dir / "adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["lora_alpha"], 8);
  EXPECT_EQ(cfg["use_rslora"], false);
  EXPECT_EQ(cfg["bias"], "none");
  EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
  EXPECT_EQ(fs::path(cfg["base_model_name_or_path"].get<std::string>()),
            fs::absolute(qwen_).lexically_normal());
  EXPECT_EQ(cfg["target_modules"],
            json({"down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"}));
  EXPECT_TRUE(cfg["target_parameters"].is_null());

  const SafetensorsStore s = SafetensorsStore::open_dir(dir, "adapter_model");
  EXPECT_EQ(s.size(),
            3u * 4 * 2 + 2u * 8 * 3 * 2);  // attention in 3 layers, experts in MoE layers 0 and 2
  expect_shape(s, "model.layers.1.self_attn.q_proj.lora_A.weight", {4, 256});
  expect_shape(s, "model.layers.1.self_attn.q_proj.lora_B.weight", {256, 4});
  expect_shape(s, "model.layers.2.self_attn.k_proj.lora_B.weight", {128, 4});
  expect_shape(s, "model.layers.0.self_attn.o_proj.lora_A.weight", {4, 256});
  expect_shape(s, "model.layers.0.mlp.experts.7.gate_proj.lora_A.weight", {4, 256});
  expect_shape(s, "model.layers.0.mlp.experts.7.gate_proj.lora_B.weight", {128, 4});
  expect_shape(s, "model.layers.2.mlp.experts.0.up_proj.lora_B.weight", {128, 4});
  expect_shape(s, "model.layers.2.mlp.experts.3.down_proj.lora_A.weight", {4, 128});
  expect_shape(s, "model.layers.2.mlp.experts.3.down_proj.lora_B.weight", {256, 4});
  EXPECT_FALSE(s.contains(
      "base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_A.weight"));  // dense layer
  expect_random_factors(s);

  const LoraAdapter a = load_adapter(dir, load_model_config(qwen_), "pe");
  EXPECT_EQ(a.expert_layout, ExpertLoraLayout::kPerExpert);
  EXPECT_FLOAT_EQ(a.layers[0].q_proj.scaling, 2.0f);
  EXPECT_TRUE(a.layers[2].experts_gate_up.defined());
  EXPECT_FALSE(a.layers[1].experts_gate_up.defined());
}

// --dtype bf16: the same values as the f32 adapter of the same seed, rounded to bf16 once, in files
// of half the size; the adapter loader reads them; an unknown dtype is one clear error.
TEST_F(SynthAdapterTest, Bf16FactorsAreTheRoundedF32Factors) {
  const std::string args =
      "--model " + quoted(qwen_) + " --rank 5 --targets q_proj,experts --seed 9";
  const fs::path f32_dir = adapter("f32", args);
  const fs::path bf16_dir = adapter("bf16", args + " --dtype bf16");
  const SafetensorsStore f32 = SafetensorsStore::open_dir(f32_dir, "adapter_model");
  const SafetensorsStore bf16 = SafetensorsStore::open_dir(bf16_dir, "adapter_model");
  ASSERT_EQ(bf16.names(), f32.names());
  size_t checked = 0;
  for (const std::string& name : f32.names()) {
    ASSERT_EQ(bf16.info(name).dtype, DType::kBF16) << name;
    ASSERT_EQ(bf16.info(name).shape, f32.info(name).shape) << name;
    const Tensor a = f32.tensor(name), b = bf16.tensor(name);
    for (int64_t i = 0; i < a.numel(); ++i) {
      ASSERT_EQ(b.data<uint16_t>()[i], f32_to_bf16_bits(a.data<float>()[i]))
          << name << " element " << i;
    }
    ++checked;
  }
  EXPECT_GT(checked, 0u);
  const auto f32_bytes = fs::file_size(f32_dir / "adapter_model.safetensors");
  const auto bf16_bytes = fs::file_size(bf16_dir / "adapter_model.safetensors");
  EXPECT_LT(bf16_bytes, f32_bytes * 6 / 10);

  const LoraAdapter a = load_adapter(bf16_dir, load_model_config(qwen_), "bf16");
  EXPECT_EQ(a.expert_layout, ExpertLoraLayout::kPerExpert);
  EXPECT_TRUE(a.layers[0].experts_gate_up.defined());
  expect_cli_error("synth-adapter " + args + " --dtype f16 --out " + quoted(tmp_ / "bad"),
                   {"--dtype", "f16", "f32, bf16"});
}

TEST_F(SynthAdapterTest, Peft3dLayout) {
  const fs::path dir =
      adapter("p3", "--model " + quoted(qwen_) +
                        " --rank 3 --alpha 6 --layout peft-3d --targets experts,o_proj");
  const json cfg = json::parse(test::read_text_file(dir / "adapter_config.json"));
  EXPECT_EQ(cfg["target_modules"], json({"o_proj"}));
  EXPECT_EQ(cfg["target_parameters"], json({"mlp.experts.down_proj", "mlp.experts.gate_up_proj"}));
  const SafetensorsStore s = SafetensorsStore::open_dir(dir, "adapter_model");
  EXPECT_EQ(s.size(), 3u * 2 + 2u * 4);
  expect_shape(s, "model.layers.0.mlp.experts.base_layer.lora_A.weight", {8 * 3, 256});  // [E*r, H]
  expect_shape(s, "model.layers.0.mlp.experts.base_layer.lora_B.weight",
               {256, 8 * 3});                                                 // [2I, E*r]
  expect_shape(s, "model.layers.2.mlp.experts.lora_A.weight", {8 * 3, 128});  // [E*r, I]
  expect_shape(s, "model.layers.2.mlp.experts.lora_B.weight", {256, 8 * 3});  // [H, E*r]
  expect_shape(s, "model.layers.2.self_attn.o_proj.lora_B.weight", {256, 3});
  expect_random_factors(s);

  const LoraAdapter a = load_adapter(dir, load_model_config(qwen_), "p3");
  EXPECT_EQ(a.expert_layout, ExpertLoraLayout::kPeft3d);
  EXPECT_EQ(a.layers[0].experts_gate_up.rank(), 3);
  EXPECT_FLOAT_EQ(a.layers[0].experts_down.scaling, 2.0f);
}

TEST_F(SynthAdapterTest, SharedOuterLayout) {
  const fs::path dir = adapter("so", "--model " + quoted(qwen_) +
                                         " --rank 5 --alpha 5 --layout shared-outer "
                                         "--targets experts --rslora");
  const json cfg = json::parse(test::read_text_file(dir / "adapter_config.json"));
  EXPECT_EQ(cfg["use_rslora"], true);
  EXPECT_EQ(cfg["target_modules"], json({"down_proj", "gate_proj", "up_proj"}));
  const SafetensorsStore s = SafetensorsStore::open_dir(dir, "adapter_model");
  EXPECT_EQ(s.size(), 2u * 6);
  expect_shape(s, "model.layers.0.mlp.experts.gate_proj.lora_A.weight", {1, 5, 256});
  expect_shape(s, "model.layers.0.mlp.experts.gate_proj.lora_B.weight", {8, 128, 5});
  expect_shape(s, "model.layers.0.mlp.experts.up_proj.lora_A.weight", {1, 5, 256});
  expect_shape(s, "model.layers.2.mlp.experts.down_proj.lora_A.weight", {8, 5, 128});
  expect_shape(s, "model.layers.2.mlp.experts.down_proj.lora_B.weight", {1, 256, 5});
  expect_random_factors(s);

  const LoraAdapter a = load_adapter(dir, load_model_config(qwen_), "so");
  EXPECT_EQ(a.expert_layout, ExpertLoraLayout::kSharedOuter);
  EXPECT_FLOAT_EQ(a.layers[2].experts_down.scaling, static_cast<float>(5.0 / std::sqrt(5.0)));
}

TEST_F(SynthAdapterTest, DeepseekAllTargetsIncludingDenseAndSharedMlps) {
  const fs::path ds = synth("ds", "--preset tiny-deepseek-v3");
  const fs::path dir = adapter(
      "all", "--model " + quoted(ds) + " --rank 2 --alpha 4 --layout per-expert --targets all");
  const json cfg = json::parse(test::read_text_file(dir / "adapter_config.json"));
  ASSERT_TRUE(cfg["target_modules"].is_string());  // a regex naming exactly the adapted modules
  const SafetensorsStore s = SafetensorsStore::open_dir(dir, "adapter_model");
  expect_shape(s, "model.layers.0.self_attn.q_a_proj.lora_A.weight", {2, 256});
  expect_shape(s, "model.layers.0.self_attn.q_b_proj.lora_B.weight", {192, 2});
  expect_shape(s, "model.layers.1.self_attn.kv_a_proj_with_mqa.lora_B.weight", {144, 2});
  expect_shape(s, "model.layers.2.self_attn.kv_b_proj.lora_A.weight", {2, 128});
  expect_shape(s, "model.layers.2.self_attn.o_proj.lora_A.weight", {2, 128});
  expect_shape(s, "model.layers.0.mlp.gate_proj.lora_B.weight", {384, 2});  // dense layer 0
  expect_shape(s, "model.layers.1.mlp.shared_experts.down_proj.lora_A.weight", {2, 128});
  expect_shape(s, "model.layers.2.mlp.experts.15.up_proj.lora_B.weight", {128, 2});
  EXPECT_FALSE(s.contains("base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_B.weight"));
  EXPECT_FALSE(s.contains("base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"));

  const LoraAdapter a = load_adapter(dir, load_model_config(ds), "all");
  EXPECT_TRUE(a.layers[0].mlp_gate.defined());
  EXPECT_TRUE(a.layers[1].shared_down.defined());
  EXPECT_TRUE(a.layers[2].kv_b_proj.defined());
  EXPECT_FALSE(a.layers[0].experts_gate_up.defined());
  EXPECT_FLOAT_EQ(a.layers[1].shared_down.scaling, 2.0f);
}

// ---------------------------------------------------------------------------------------------
// inspect

TEST_F(SynthAdapterTest, InspectModelsAndAdapters) {
  const std::string table = moelora("inspect " + quoted(qwen_));
  for (const char* fact :
       {"Qwen3MoeForCausalLM", "qwen3_moe", "3 (2 MoE, dense MLP in 1)",
        "GQA: 4 query heads, 2 KV heads", "8 routed, top-2, moe_intermediate_size 128",
        "softmax top-2, renormalized", "none", "BF16", "tied embeddings", "tokenizer        none",
        "check            ok"}) {
    EXPECT_THAT(table, HasSubstr(fact));
  }
  const fs::path fp8 = synth("ds8", "--preset tiny-deepseek-v3 --quant fp8");
  const json j = json::parse(moelora("inspect --json " + quoted(fp8)));
  EXPECT_EQ(j["kind"], "model");
  EXPECT_EQ(j["layers"], 3);
  EXPECT_EQ(j["attention"]["type"], "MLA");
  EXPECT_EQ(j["attention"]["kv_lora_rank"], 128);
  EXPECT_EQ(j["quantization"]["method"], "fp8-block");
  EXPECT_EQ(j["router"]["scoring"], "sigmoid_noaux_tc");
  EXPECT_EQ(j["check"], "ok");
  // parameters: every non-scale element once
  const SafetensorsStore store = SafetensorsStore::open_dir(fp8);
  uint64_t parameters = 0;
  for (const std::string& n : store.names()) {
    if (n.find("_scale") == std::string::npos)
      parameters += static_cast<uint64_t>(shape_numel(store.info(n).shape));
  }
  EXPECT_EQ(j["parameters"].get<uint64_t>(), parameters);
  EXPECT_EQ(j["bytes"].get<uint64_t>(), store.total_bytes());

  const fs::path dir =
      adapter("ins", "--model " + quoted(qwen_) +
                         " --rank 4 --alpha 8 --layout peft-3d --targets experts,q_proj");
  const std::string at = moelora("inspect " + quoted(dir));
  for (const char* fact : {"peft-3d", "mlp.experts.gate_up_proj", "r 4, scaling 2, layers 0, 2",
                           "self_attn.q_proj", "check", "ok against"}) {
    EXPECT_THAT(at, HasSubstr(fact));
  }
  const json aj = json::parse(moelora("inspect --json " + quoted(dir)));
  EXPECT_EQ(aj["kind"], "adapter");
  EXPECT_EQ(aj["expert_layout"], "peft-3d");
  EXPECT_EQ(aj["r"], 4);

  // a model whose config contradicts its weights: the check fails, exit code 1
  json config = json::parse(test::read_text_file(qwen_ / "config.json"));
  config["moe_intermediate_size"] = 64;
  test::write_text_file(qwen_ / "config.json", config.dump());
  const std::string broken = moelora("inspect " + quoted(qwen_), 1);
  EXPECT_THAT(broken, HasSubstr("FAILED"));
  EXPECT_THAT(broken, HasSubstr("moe_intermediate_size 64"));
}

// ---------------------------------------------------------------------------------------------
// bad arguments

TEST_F(SynthAdapterTest, BadArgumentsGiveOneClearErrorLine) {
  const std::string out = quoted(tmp_ / "bad");
  expect_cli_error("synth --preset nope --out " + out, {"unknown preset 'nope'", "tiny-qwen3-moe"});
  expect_cli_error("synth --preset tiny-qwen3-moe --quant int4 --out " + out,
                   {"--quant", "int4", "nvfp4"});
  expect_cli_error("synth --preset tiny-qwen3-moe --layers -2 --out " + out, {"--layers"});
  expect_cli_error("synth --preset tiny-qwen3-moe --max-shard-size 4XB --out " + out,
                   {"--max-shard-size", "4XB"});
  expect_cli_error("synth --preset tiny-qwen3-moe", {"--out"});
  expect_cli_error(
      "synth --preset tiny-qwen3-moe --tokenizer " + quoted(tmp_ / "none") + " --out " + out,
      {"--tokenizer", "tokenizer.json"});

  const std::string model = " --model " + quoted(qwen_) + " --out " + out;
  expect_cli_error(
      "synth-adapter --targets q_a_proj" + model,
      {"no 'q_a_proj' module", "valid targets: q_proj, k_proj, v_proj, o_proj, experts, mlp"});
  expect_cli_error("synth-adapter --targets gate_proj" + model, {"unknown target 'gate_proj'"});
  expect_cli_error("synth-adapter --targets experts --layout fused" + model,
                   {"--layout", "fused", "peft-3d"});
  expect_cli_error("synth-adapter --targets experts --rank 0" + model, {"--rank"});
  expect_cli_error(
      "synth-adapter --targets experts --model " + quoted(tmp_ / "absent") + " --out " + out,
      {"config.json"});
  expect_cli_error("inspect " + quoted(tmp_ / "absent"), {"absent", "not a directory"});
  expect_cli_error("inspect " + quoted(tmp_.path()), {"neither a model"});
}

// ---------------------------------------------------------------------------------------------
// optional: transformers and PEFT read what synth writes

TEST_F(SynthAdapterTest, TransformersAndPeftLoadTheOutput) {
  // find_spec only looks the packages up (importing torch + transformers takes seconds); the
  // script itself exits with 77 when an import fails after all.
  const char* probe =
      "python3 -c 'import importlib.util as u, sys; "
      "sys.exit(0 if all(u.find_spec(m) for m in (\"torch\", \"transformers\", \"peft\")) else 1)' "
      ">/dev/null 2>&1";
  if (test::run_command(probe).exit_code != 0) {
    GTEST_SKIP() << "python3 with torch + transformers + peft is not available";
  }
  const fs::path ds = synth("ds_py", "--preset tiny-deepseek-v3 --layers 2");
  const fs::path p3 = adapter("py_p3", "--model " + quoted(qwen_) +
                                           " --rank 4 --alpha 8 --layout peft-3d "
                                           "--targets q_proj,k_proj,v_proj,o_proj,experts");
  const fs::path pe = adapter("py_pe", "--model " + quoted(qwen_) +
                                           " --rank 4 --alpha 8 --layout per-expert "
                                           "--targets q_proj,o_proj,experts");
  const fs::path script = tmp_ / "check.py";
  test::write_text_file(script, R"PY(
import sys, warnings
try:
    import torch
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
except ImportError as e:
    print(f"SKIP: {e}")
    sys.exit(77)

def load(path):
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{path}: loading info {bad}"
    return model

qwen, ds, adapters = sys.argv[1], sys.argv[2], sys.argv[3:]
ids = torch.tensor([[3, 17, 99, 250, 400, 11, 7]])
load(ds)(ids)
for adapter in adapters:
    model = load(qwen)
    base = model(ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(model, adapter)
    messages = [str(w.message).lower() for w in caught]
    keys = [m for m in messages if "missing" in m or "unexpected" in m]
    assert not keys, f"{adapter}: {keys}"
    delta = (peft_model(ids).logits - base).abs().max().item()
    assert delta > 1e-2, f"{adapter}: the adapter does not change the logits ({delta})"
print("OK")
)PY");
  const test::CommandResult r =
      test::run_command("python3 " + quoted(script) + " " + quoted(qwen_) + " " + quoted(ds) + " " +
                        quoted(p3) + " " + quoted(pe) + " 2>&1");
  if (r.exit_code == 77) GTEST_SKIP() << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("OK"));
}

}  // namespace
}  // namespace moelora::io
