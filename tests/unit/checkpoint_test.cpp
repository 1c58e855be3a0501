// Checkpoint loader (src/io/checkpoint.h) on the real Hugging Face fixtures of tests/data/parity:
//   - every base model loads with the shapes, dtypes and layer kinds its config describes, and
//     its values are the stored ones (embedding rows against the reference's hidden.base.0);
//   - the per-expert, fused and sharded Qwen3-MoE checkpoints give byte-identical tensors, the
//     fused ones as zero-copy views;
//   - FP8 block and NVFP4 (ModelOpt) weights dequantize bit-exactly to the `dequant.*` oracles
//     written by scripts/make_reference.py (partial FP8 blocks, NVFP4 scalars of shape [] and [1],
//     different gate and up global scales);
//   - fused FP8 experts split into per-expert views when 2I/128 splits cleanly, else kUnsupported;
//   - max_layers, tied embeddings, tensors transformers ignores (MTP layer, inv_freq);
//   - bad input (modified copies in a TempDir): a shape that contradicts config.json, a missing
//     tensor, a wrong dtype, missing or malformed config.json, a quantized tensor without its
//     scales or without a quantization config, an excluded module stored quantized, a bad NVFP4
//     scalar, an unused tensor. Each is one error line naming the file / tensor / field, with the
//     expected and the actual value.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "core/dtype.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

fs::path parity(const std::string& rel) {
  return test::data_dir() / "parity" / rel;
}

LoadOptions quiet(int64_t max_layers = 0) {
  LoadOptions o;
  o.show_progress = false;
  o.max_layers = max_layers;
  return o;
}

::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return ::testing::AssertionFailure() << "undefined tensor";
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return ::testing::AssertionFailure() << dtype_name(a.dtype()) << shape_str(a.shape()) << " vs "
                                         << dtype_name(b.dtype()) << shape_str(b.shape());
  }
  if (std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) != 0) {
    return ::testing::AssertionFailure() << "bytes differ";
  }
  return ::testing::AssertionSuccess();
}

// Bit-exact fp32 comparison with the first mismatch in the failure message.
::testing::AssertionResult same_f32(const Tensor& actual, const Tensor& expected) {
  if (actual.shape() != expected.shape()) {
    return ::testing::AssertionFailure()
           << "shape " << shape_str(actual.shape()) << " vs " << shape_str(expected.shape());
  }
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const float a = actual.item_f32(i), e = expected.item_f32(i);
    if (std::memcmp(&a, &e, sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "element " << i << ": " << a << " vs " << e;
    }
  }
  return ::testing::AssertionSuccess();
}

Tensor dequant(const LinearWeight& w) {
  switch (w.format) {
    case WeightFormat::kFp8Block:
      return ops::dequant_fp8_block_ref(w.weight, w.scale, w.block_n, w.block_k);
    case WeightFormat::kNvfp4: return ops::dequant_nvfp4_ref(w.weight, w.scale, w.scale_2);
    case WeightFormat::kDense: return w.weight.to_f32();
  }
  return {};
}

// Runs fn, expects a moelora::Error with `code` whose one-line message contains every part.
void expect_error(const std::function<void()>& fn, ErrorCode code,
                  const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected one containing '" << parts.front() << "'";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.code(), code) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    for (const std::string& part : parts) EXPECT_THAT(message, HasSubstr(part));
  }
}

// A writable copy of a fixture directory.
void copy_dir(const fs::path& from, const fs::path& to) {
  fs::create_directories(to);
  fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
}

// Rewrites dir/model.safetensors after `edit` changed the name -> tensor map.
void rewrite_weights(const fs::path& dir,
                     const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  const SafetensorsStore store = SafetensorsStore::open_dir(dir);
  std::map<std::string, Tensor> tensors;
  for (const std::string& name : store.names()) tensors[name] = store.tensor(name);
  edit(tensors);
  SafetensorsWriter writer;
  for (const auto& [name, t] : tensors) writer.add(name, t);
  writer.write(dir / "model.safetensors");
}

json read_json(const fs::path& path) {
  return json::parse(test::read_text_file(path));
}
void write_json(const fs::path& path, const json& j) {
  test::write_text_file(path, j.dump(2));
}

// ---------------------------------------------------------------------------------------------
// real fixtures

TEST(CheckpointQwen3Moe, ShapesLayerKindsAndValues) {
  const ModelWeights w = load_checkpoint(parity("qwen3_moe/base"), quiet());
  EXPECT_EQ(w.config.arch, Architecture::kQwen3Moe);
  EXPECT_EQ(w.weight_prefix, "model.");
  ASSERT_EQ(w.layers.size(), 3u);
  EXPECT_EQ(w.embed_tokens.shape(), (Shape{512, 64}));
  EXPECT_EQ(w.embed_tokens.dtype(), DType::kBF16);
  EXPECT_FALSE(w.tied_embeddings);
  EXPECT_EQ(w.lm_head.weight.shape(), (Shape{512, 64}));
  EXPECT_EQ(w.final_norm.shape(), (Shape{64}));
  EXPECT_TRUE(w.ignored_tensors.empty());

  // mlp_only_layers [1]: layer 1 dense, layers 0 and 2 MoE
  EXPECT_TRUE(w.layers[0].is_moe);
  EXPECT_FALSE(w.layers[1].is_moe);
  EXPECT_TRUE(w.layers[2].is_moe);
  EXPECT_EQ(w.layers[1].mlp.gate.weight.shape(), (Shape{96, 64}));
  EXPECT_EQ(w.layers[1].mlp.down.weight.shape(), (Shape{64, 96}));
  EXPECT_FALSE(w.layers[1].router.defined());
  for (int layer : {0, 2}) {
    const LayerWeights& l = w.layers[layer];
    EXPECT_EQ(l.router.shape(), (Shape{8, 64}));
    EXPECT_FALSE(l.e_score_correction_bias.defined());
    EXPECT_FALSE(l.shared_expert.defined());
    ASSERT_EQ(l.experts.num_experts, 8);
    ASSERT_EQ(l.experts.gate.size(), 8u);
    EXPECT_FALSE(l.experts.fused_on_disk);
    for (int e = 0; e < 8; ++e) {
      EXPECT_EQ(l.experts.gate[e].weight.shape(), (Shape{32, 64}));
      EXPECT_EQ(l.experts.up[e].weight.shape(), (Shape{32, 64}));
      EXPECT_EQ(l.experts.down[e].weight.shape(), (Shape{64, 32}));
      EXPECT_EQ(l.experts.down[e].format, WeightFormat::kDense);
    }
    EXPECT_EQ(l.experts.up[5].name,
              "model.layers." + std::to_string(layer) + ".mlp.experts.5.up_proj.weight");
  }
  const LayerWeights& l0 = w.layers[0];
  EXPECT_EQ(l0.q_proj.weight.shape(), (Shape{64, 64}));
  EXPECT_EQ(l0.k_proj.weight.shape(), (Shape{32, 64}));
  EXPECT_EQ(l0.v_proj.weight.shape(), (Shape{32, 64}));
  EXPECT_EQ(l0.o_proj.weight.shape(), (Shape{64, 64}));
  EXPECT_EQ(l0.q_norm.shape(), (Shape{16}));
  EXPECT_EQ(l0.k_norm.shape(), (Shape{16}));
  EXPECT_EQ(l0.q_proj.out_features, 64);
  EXPECT_EQ(l0.k_proj.in_features, 64);
  EXPECT_FALSE(l0.q_a_proj.defined());

  // Values: the reference's embedding output is embed_tokens[input_ids] in fp32.
  const SafetensorsStore ref =
      SafetensorsStore::open_file(parity("qwen3_moe/reference.safetensors"));
  const Tensor ids = ref.tensor("input_ids");
  const Tensor hidden0 = ref.tensor("hidden.base.0");
  for (int64_t t = 0; t < ids.numel(); ++t) {
    const int32_t id = ids.data<int32_t>()[t];
    for (int64_t h = 0; h < 64; ++h) {
      ASSERT_EQ(w.embed_tokens.item_f32(id * 64 + h), hidden0.item_f32(t * 64 + h))
          << "token " << t << " dim " << h;
    }
  }
}

TEST(CheckpointQwen3Moe, PerExpertFusedAndShardedAreIdentical) {
  const ModelWeights base = load_checkpoint(parity("qwen3_moe/base"), quiet());
  const ModelWeights fused = load_checkpoint(parity("qwen3_moe/base_fused"), quiet());
  const ModelWeights sharded = load_checkpoint(parity("qwen3_moe/base_sharded"), quiet());
  EXPECT_FALSE(base.layers[0].experts.fused_on_disk);
  EXPECT_TRUE(fused.layers[0].experts.fused_on_disk);
  EXPECT_FALSE(sharded.layers[0].experts.fused_on_disk);
  EXPECT_GT(sharded.store.names().size(), 0u);
  EXPECT_THAT(sharded.store.source().string(), HasSubstr("model.safetensors.index.json"));

  int64_t compared = 0;
  auto same = [&](const Tensor& a, const Tensor& b, const std::string& what) {
    EXPECT_TRUE(same_bytes(a, b)) << what;
    ++compared;
  };
  for (const ModelWeights* other : {&fused, &sharded}) {
    same(base.embed_tokens, other->embed_tokens, "embed_tokens");
    same(base.final_norm, other->final_norm, "norm");
    same(base.lm_head.weight, other->lm_head.weight, "lm_head");
    ASSERT_EQ(base.layers.size(), other->layers.size());
    for (size_t l = 0; l < base.layers.size(); ++l) {
      const LayerWeights& a = base.layers[l];
      const LayerWeights& b = other->layers[l];
      const std::string at = "layer " + std::to_string(l);
      same(a.input_layernorm, b.input_layernorm, at + " input_layernorm");
      same(a.post_attention_layernorm, b.post_attention_layernorm,
           at + " post_attention_layernorm");
      for (auto [x, y, name] :
           {std::tuple{&a.q_proj, &b.q_proj, "q"}, std::tuple{&a.k_proj, &b.k_proj, "k"},
            std::tuple{&a.v_proj, &b.v_proj, "v"}, std::tuple{&a.o_proj, &b.o_proj, "o"}}) {
        same(x->weight, y->weight, at + " " + name);
      }
      same(a.q_norm, b.q_norm, at + " q_norm");
      same(a.k_norm, b.k_norm, at + " k_norm");
      ASSERT_EQ(a.is_moe, b.is_moe);
      if (!a.is_moe) {
        same(a.mlp.gate.weight, b.mlp.gate.weight, at + " mlp.gate");
        same(a.mlp.up.weight, b.mlp.up.weight, at + " mlp.up");
        same(a.mlp.down.weight, b.mlp.down.weight, at + " mlp.down");
        continue;
      }
      same(a.router, b.router, at + " router");
      for (int e = 0; e < 8; ++e) {
        same(a.experts.gate[e].weight, b.experts.gate[e].weight, at + " gate " + std::to_string(e));
        same(a.experts.up[e].weight, b.experts.up[e].weight, at + " up " + std::to_string(e));
        same(a.experts.down[e].weight, b.experts.down[e].weight, at + " down " + std::to_string(e));
      }
    }
  }
  EXPECT_GT(compared, 150);

  // The fused views point into the mapped gate_up_proj [8, 64, 64]: expert e's gate rows start
  // at e * 2I * H elements, its up rows I * H elements later.
  const Tensor gate_up = fused.store.tensor("model.layers.2.mlp.experts.gate_up_proj");
  const auto* base_ptr = static_cast<const uint8_t*>(gate_up.raw_data());
  const ExpertWeights& ex = fused.layers[2].experts;
  EXPECT_EQ(ex.gate[3].weight.raw_data(), base_ptr + (3 * 64 * 64) * 2);
  EXPECT_EQ(ex.up[3].weight.raw_data(), base_ptr + (3 * 64 * 64 + 32 * 64) * 2);
  EXPECT_EQ(ex.up[3].name, "model.layers.2.mlp.experts.gate_up_proj[3][32:64]");
}

TEST(CheckpointDeepseekV3, MlaDenseFirstLayerSharedExpertAndBias) {
  const ModelWeights w = load_checkpoint(parity("deepseek_v3/base"), quiet());
  EXPECT_EQ(w.config.arch, Architecture::kDeepseekV3);
  ASSERT_EQ(w.layers.size(), 3u);
  EXPECT_FALSE(w.layers[0].is_moe);
  EXPECT_EQ(w.layers[0].mlp.gate.weight.shape(), (Shape{96, 64}));
  for (int layer = 0; layer < 3; ++layer) {
    const LayerWeights& l = w.layers[layer];
    EXPECT_FALSE(l.q_proj.defined());
    EXPECT_EQ(l.q_a_proj.weight.shape(), (Shape{32, 64}));
    EXPECT_EQ(l.q_a_layernorm.shape(), (Shape{32}));
    EXPECT_EQ(l.q_b_proj.weight.shape(), (Shape{96, 32}));
    EXPECT_EQ(l.kv_a_proj_with_mqa.weight.shape(), (Shape{40, 64}));
    EXPECT_EQ(l.kv_a_layernorm.shape(), (Shape{32}));
    EXPECT_EQ(l.kv_b_proj.weight.shape(), (Shape{128, 32}));
    EXPECT_EQ(l.o_proj.weight.shape(), (Shape{64, 64}));
    EXPECT_FALSE(l.q_norm.defined());
  }
  for (int layer : {1, 2}) {
    const LayerWeights& l = w.layers[layer];
    EXPECT_TRUE(l.is_moe);
    EXPECT_EQ(l.router.shape(), (Shape{16, 64}));
    EXPECT_EQ(l.router.dtype(), DType::kBF16);
    EXPECT_EQ(l.e_score_correction_bias.shape(), (Shape{16}));
    EXPECT_EQ(l.e_score_correction_bias.dtype(), DType::kF32);
    EXPECT_EQ(l.experts.num_experts, 16);
    EXPECT_EQ(l.experts.gate[15].weight.shape(), (Shape{32, 64}));
    EXPECT_EQ(l.shared_expert.gate.weight.shape(), (Shape{32, 64}));
    EXPECT_EQ(l.shared_expert.down.weight.shape(), (Shape{64, 32}));
    EXPECT_EQ(l.shared_expert.down.name,
              "model.layers." + std::to_string(layer) + ".mlp.shared_experts.down_proj.weight");
    EXPECT_FALSE(l.shared_expert_gate.defined());
  }
  // The bias is the stored F32 value: non-zero, small (N(0, 0.05^2) in make_reference.py).
  float max_abs = 0;
  for (int64_t i = 0; i < 16; ++i)
    max_abs = std::max(max_abs, std::fabs(w.layers[1].e_score_correction_bias.item_f32(i)));
  EXPECT_GT(max_abs, 0.0f);
  EXPECT_LT(max_abs, 0.5f);
}

TEST(CheckpointDeepseekV3, KimiLikePlainQProj) {
  const ModelWeights w = load_checkpoint(parity("kimi_like/base"), quiet());
  ASSERT_EQ(w.layers.size(), 2u);
  EXPECT_EQ(w.config.q_lora_rank, 0);
  for (const LayerWeights& l : w.layers) {
    EXPECT_EQ(l.q_proj.weight.shape(), (Shape{96, 64}));
    EXPECT_FALSE(l.q_a_proj.defined());
    EXPECT_FALSE(l.q_b_proj.defined());
    EXPECT_FALSE(l.q_a_layernorm.defined());
  }
  EXPECT_EQ(w.layers[1].experts.num_experts, 12);
  EXPECT_EQ(w.layers[1].e_score_correction_bias.shape(), (Shape{12}));
}

TEST(CheckpointFp8, BlockFormatsAndDequantMatchesTheOracle) {
  const ModelWeights w = load_checkpoint(parity("fp8/deepseek_v3_fp8"), quiet());
  EXPECT_EQ(w.config.quant.method, QuantMethod::kFp8Block);
  ASSERT_EQ(w.layers.size(), 2u);

  int quantized = 0;
  auto expect_fp8 = [&](const LinearWeight& lw, Shape weight, Shape grid) {
    EXPECT_EQ(lw.format, WeightFormat::kFp8Block) << lw.name;
    EXPECT_EQ(lw.weight.dtype(), DType::kF8E4M3) << lw.name;
    EXPECT_EQ(lw.weight.shape(), weight) << lw.name;
    EXPECT_EQ(lw.scale.dtype(), DType::kF32) << lw.name;
    EXPECT_EQ(lw.scale.shape(), grid) << lw.name;
    EXPECT_EQ(lw.block_n, 128);
    EXPECT_EQ(lw.block_k, 128);
    ++quantized;
  };
  for (const LayerWeights& l : w.layers) {
    expect_fp8(l.q_a_proj, {64, 256}, {1, 2});
    expect_fp8(l.q_b_proj, {96, 64}, {1, 1});
    expect_fp8(l.kv_a_proj_with_mqa, {48, 256}, {1, 2});  // partial row block: 48 of 128
    expect_fp8(l.kv_b_proj, {128, 32}, {1, 1});
    expect_fp8(l.o_proj, {256, 64}, {2, 1});
    EXPECT_EQ(l.q_a_layernorm.dtype(), DType::kBF16);
  }
  expect_fp8(w.layers[0].mlp.gate, {256, 256}, {2, 2});
  expect_fp8(w.layers[0].mlp.up, {256, 256}, {2, 2});
  expect_fp8(w.layers[0].mlp.down, {256, 256}, {2, 2});
  const LayerWeights& moe = w.layers[1];
  for (int e = 0; e < 4; ++e) {
    expect_fp8(moe.experts.gate[e], {128, 256}, {1, 2});
    expect_fp8(moe.experts.up[e], {128, 256}, {1, 2});
    expect_fp8(moe.experts.down[e], {256, 128}, {2, 1});
  }
  expect_fp8(moe.shared_expert.gate, {128, 256}, {1, 2});
  expect_fp8(moe.shared_expert.up, {128, 256}, {1, 2});
  expect_fp8(moe.shared_expert.down, {256, 128}, {2, 1});
  EXPECT_EQ(quantized, 28);  // README: 28 quantized tensors
  // Unquantized: embeddings, lm_head, router (BF16), correction bias (F32).
  EXPECT_EQ(w.embed_tokens.dtype(), DType::kBF16);
  EXPECT_EQ(w.lm_head.format, WeightFormat::kDense);
  EXPECT_EQ(moe.router.dtype(), DType::kBF16);
  EXPECT_EQ(moe.e_score_correction_bias.dtype(), DType::kF32);

  const SafetensorsStore ref = SafetensorsStore::open_file(parity("fp8/reference.safetensors"));
  const std::map<std::string, const LinearWeight*> oracles = {
      {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight", &moe.kv_a_proj_with_mqa},
      {"model.layers.1.self_attn.kv_b_proj.weight", &moe.kv_b_proj},
      {"model.layers.1.self_attn.q_b_proj.weight", &moe.q_b_proj},
      {"model.layers.1.mlp.experts.3.up_proj.weight", &moe.experts.up[3]},
  };
  for (const auto& [name, lw] : oracles) {
    EXPECT_EQ(lw->name, name);
    EXPECT_TRUE(same_f32(dequant(*lw), ref.tensor("dequant." + name))) << name;
  }
}

TEST(CheckpointNvfp4, ModeloptFormatsScalarsAndDequantMatchesTheOracle) {
  const fs::path dir = parity("nvfp4/qwen3_moe_nvfp4");
  const ModelWeights w = load_checkpoint(dir, quiet());
  EXPECT_EQ(w.config.quant.method, QuantMethod::kNvfp4);
  ASSERT_EQ(w.layers.size(), 2u);
  // The fixture stores weight_scale_2 as [] in layer 0 and [1] in layer 1 (input_scale the other
  // way).
  EXPECT_EQ(w.store.info("model.layers.0.self_attn.q_proj.weight_scale_2").shape, Shape{});
  EXPECT_EQ(w.store.info("model.layers.1.self_attn.q_proj.weight_scale_2").shape, Shape{1});
  EXPECT_EQ(w.store.info("model.layers.0.self_attn.q_proj.input_scale").shape, Shape{1});
  EXPECT_EQ(w.store.info("model.layers.1.self_attn.q_proj.input_scale").shape, Shape{});

  for (const LayerWeights& l : w.layers) {
    for (const LinearWeight* lw : {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj}) {
      EXPECT_EQ(lw->format, WeightFormat::kNvfp4) << lw->name;
      EXPECT_TRUE(lw->has_input_scale) << lw->name;
      EXPECT_GT(lw->scale_2, 0.0f) << lw->name;
      EXPECT_GT(lw->input_scale, 0.0f) << lw->name;
    }
    EXPECT_EQ(l.q_proj.weight.shape(), (Shape{128, 64}));
    EXPECT_EQ(l.q_proj.scale.shape(), (Shape{128, 8}));
    EXPECT_EQ(l.k_proj.weight.shape(), (Shape{64, 64}));
    EXPECT_EQ(l.k_proj.scale.dtype(), DType::kF8E4M3);
    EXPECT_EQ(l.q_proj.in_features, 128);
    EXPECT_EQ(l.q_norm.dtype(), DType::kBF16);
    EXPECT_EQ(l.router.dtype(), DType::kBF16);
    for (int e = 0; e < 4; ++e) {
      EXPECT_EQ(l.experts.gate[e].weight.shape(), (Shape{64, 64}));
      EXPECT_EQ(l.experts.gate[e].scale.shape(), (Shape{64, 8}));
      EXPECT_EQ(l.experts.down[e].weight.shape(), (Shape{128, 32}));
      EXPECT_EQ(l.experts.down[e].scale.shape(), (Shape{128, 4}));
      // gate and up keep their own global scales
      EXPECT_NE(l.experts.gate[e].scale_2, l.experts.up[e].scale_2) << "expert " << e;
    }
  }
  EXPECT_EQ(w.lm_head.format, WeightFormat::kDense);
  EXPECT_EQ(w.embed_tokens.dtype(), DType::kBF16);

  const SafetensorsStore ref = SafetensorsStore::open_file(parity("nvfp4/reference.safetensors"));
  const std::map<std::string, const LinearWeight*> oracles = {
      {"model.layers.0.mlp.experts.0.gate_proj.weight", &w.layers[0].experts.gate[0]},
      {"model.layers.0.self_attn.k_proj.weight", &w.layers[0].k_proj},
      {"model.layers.1.mlp.experts.2.down_proj.weight", &w.layers[1].experts.down[2]},
  };
  for (const auto& [name, lw] : oracles) {
    EXPECT_EQ(lw->name, name);
    EXPECT_TRUE(same_f32(dequant(*lw), ref.tensor("dequant." + name))) << name;
  }
}

TEST(CheckpointOptions, MaxLayersCutsTheModelAndTheConfig) {
  const ModelWeights w = load_checkpoint(parity("qwen3_moe/base"), quiet(2));
  ASSERT_EQ(w.layers.size(), 2u);
  EXPECT_EQ(w.config.num_hidden_layers, 2);
  EXPECT_EQ(w.config.mlp_only_layers, (std::vector<int64_t>{1}));
  EXPECT_FALSE(w.layers[1].is_moe);
  // Layer 2's tensors are skipped, not an error.
  EXPECT_THAT(w.ignored_tensors,
              ::testing::Contains("model.layers.2.mlp.experts.7.down_proj.weight"));

  const ModelWeights d = load_checkpoint(parity("deepseek_v3/base"), quiet(1));
  ASSERT_EQ(d.layers.size(), 1u);
  EXPECT_EQ(d.config.first_k_dense_replace, 1);
  EXPECT_FALSE(d.layers[0].is_moe);

  const ModelWeights all =
      load_checkpoint(parity("kimi_like/base"), quiet(10));  // more than there are
  EXPECT_EQ(all.layers.size(), 2u);

  expect_error([] { load_checkpoint(parity("kimi_like/base"), quiet(-1)); },
               ErrorCode::kInvalidArgument, {"max_layers", "-1"});
}

// ---------------------------------------------------------------------------------------------
// fused FP8 experts (written here: no fixture has them)

// A one-layer Qwen3-MoE checkpoint (H 128, 2 experts, moe_intermediate_size `inter`) with fused
// FP8 experts and dense attention; returns the per-expert fp32 weights it quantized.
struct FusedFp8Model {
  std::vector<Tensor> gate_up, down;  // per expert, fp32 [2I, H] / [H, I]
};

FusedFp8Model write_fused_fp8_model(const fs::path& dir, int64_t inter, std::mt19937_64& rng) {
  const int64_t hidden = 128, experts = 2, vocab = 64, heads = 2, head_dim = 64;
  json config = {{"architectures", {"Qwen3MoeForCausalLM"}},
                 {"model_type", "qwen3_moe"},
                 {"vocab_size", vocab},
                 {"hidden_size", hidden},
                 {"num_hidden_layers", 1},
                 {"num_attention_heads", heads},
                 {"num_key_value_heads", 1},
                 {"head_dim", head_dim},
                 {"moe_intermediate_size", inter},
                 {"num_experts", experts},
                 {"num_experts_per_tok", 1},
                 {"tie_word_embeddings", true},
                 {"quantization_config",
                  {{"quant_method", "fp8"},
                   {"activation_scheme", "dynamic"},
                   {"weight_block_size", {128, 128}}}}};
  fs::create_directories(dir);
  write_json(dir / "config.json", config);

  SafetensorsWriter writer;
  auto bf16 = [&](const std::string& name, Shape shape) {
    writer.add(name, test::random_normal(shape, rng, 0.5f).to(DType::kBF16));
  };
  bf16("model.embed_tokens.weight", {vocab, hidden});
  bf16("model.norm.weight", {hidden});
  bf16("model.layers.0.input_layernorm.weight", {hidden});
  bf16("model.layers.0.post_attention_layernorm.weight", {hidden});
  bf16("model.layers.0.self_attn.q_proj.weight", {heads * head_dim, hidden});
  bf16("model.layers.0.self_attn.k_proj.weight", {head_dim, hidden});
  bf16("model.layers.0.self_attn.v_proj.weight", {head_dim, hidden});
  bf16("model.layers.0.self_attn.o_proj.weight", {hidden, heads * head_dim});
  bf16("model.layers.0.self_attn.q_norm.weight", {head_dim});
  bf16("model.layers.0.self_attn.k_norm.weight", {head_dim});
  bf16("model.layers.0.mlp.gate.weight", {experts, hidden});

  FusedFp8Model model;
  auto stack = [&](const std::string& name, int64_t rows, int64_t cols, std::vector<Tensor>& keep) {
    std::vector<ops::Fp8Block> blocks;
    for (int64_t e = 0; e < experts; ++e) {
      keep.push_back(test::random_normal({rows, cols}, rng, 0.1f));
      blocks.push_back(ops::quantize_fp8_block_ref(keep.back()));
    }
    const Shape grid = blocks[0].scale_inv.shape();
    Tensor q = Tensor::empty(DType::kF8E4M3, {experts, rows, cols});
    Tensor s = Tensor::empty(DType::kF32, {experts, grid[0], grid[1]});
    for (int64_t e = 0; e < experts; ++e) {
      std::memcpy(static_cast<uint8_t*>(q.raw_data()) + e * blocks[e].q.nbytes(),
                  blocks[e].q.raw_data(), blocks[e].q.nbytes());
      std::memcpy(static_cast<uint8_t*>(s.raw_data()) + e * blocks[e].scale_inv.nbytes(),
                  blocks[e].scale_inv.raw_data(), blocks[e].scale_inv.nbytes());
    }
    writer.add(name, q);
    writer.add(name + "_scale_inv", s);
  };
  stack("model.layers.0.mlp.experts.gate_up_proj", 2 * inter, hidden, model.gate_up);
  stack("model.layers.0.mlp.experts.down_proj", hidden, inter, model.down);
  writer.write(dir / "model.safetensors");
  return model;
}

TEST(CheckpointFusedFp8, SplitsIntoPerExpertViewsWhenBlocksAlign) {
  std::mt19937_64 rng(test::test_seed(601));
  test::TempDir tmp;
  const int64_t inter = 256;  // 2I = 512 rows = 4 scale blocks, gate = blocks 0-1, up = 2-3
  const FusedFp8Model model = write_fused_fp8_model(tmp.path(), inter, rng);
  const ModelWeights w = load_checkpoint(tmp.path(), quiet());
  const ExpertWeights& ex = w.layers[0].experts;
  EXPECT_TRUE(ex.fused_on_disk);
  EXPECT_TRUE(w.tied_embeddings);
  EXPECT_EQ(w.lm_head.weight.raw_data(), w.embed_tokens.raw_data());
  EXPECT_EQ(w.layers[0].q_proj.format,
            WeightFormat::kDense);  // dense linears are fine in an FP8 checkpoint
  for (int e = 0; e < 2; ++e) {
    EXPECT_EQ(ex.gate[e].format, WeightFormat::kFp8Block);
    EXPECT_EQ(ex.gate[e].weight.shape(), (Shape{inter, 128}));
    EXPECT_EQ(ex.gate[e].scale.shape(), (Shape{2, 1}));
    EXPECT_EQ(ex.up[e].scale.shape(), (Shape{2, 1}));
    EXPECT_EQ(ex.down[e].weight.shape(), (Shape{128, inter}));
    EXPECT_EQ(ex.down[e].scale.shape(), (Shape{1, 2}));
    // The views dequantize to the halves of the whole expert's dequantized matrix.
    const Tensor gu = ops::dequant_fp8_block_ref(
        w.store.tensor("model.layers.0.mlp.experts.gate_up_proj").select0(e),
        w.store.tensor("model.layers.0.mlp.experts.gate_up_proj_scale_inv").select0(e));
    EXPECT_TRUE(same_f32(dequant(ex.gate[e]), gu.slice0(0, inter))) << "gate " << e;
    EXPECT_TRUE(same_f32(dequant(ex.up[e]), gu.slice0(inter, 2 * inter))) << "up " << e;
    // ... and stay close to the weights that were quantized (e4m3: 3 mantissa bits).
    EXPECT_TRUE(test::all_close(dequant(ex.up[e]), model.gate_up[e].slice0(inter, 2 * inter), 1e-3f,
                                0.07f));
    EXPECT_TRUE(test::all_close(dequant(ex.down[e]), model.down[e], 1e-3f, 0.07f));
  }
}

TEST(CheckpointFusedFp8, UnalignedGateUpSplitIsUnsupported) {
  std::mt19937_64 rng(test::test_seed(602));
  test::TempDir tmp;
  write_fused_fp8_model(tmp.path(), 96,
                        rng);  // 2I = 192: scale block 0 covers gate rows 0-95 and up rows 0-31
  expect_error([&] { load_checkpoint(tmp.path(), quiet()); }, ErrorCode::kUnsupported,
               {"model.layers.0.mlp.experts.gate_up_proj", "moe_intermediate_size 96", "128"});
}

// ---------------------------------------------------------------------------------------------
// tied embeddings and tensors transformers ignores

TEST(CheckpointTied, TiedEmbeddingsAliasAndAMissingUntiedHeadIsAnError) {
  test::TempDir tmp;
  const fs::path dir = tmp / "tied";
  copy_dir(parity("qwen3_moe/base"), dir);
  json config = read_json(dir / "config.json");
  config["tie_word_embeddings"] = true;
  write_json(dir / "config.json", config);
  {
    const ModelWeights w = load_checkpoint(dir, quiet());  // lm_head.weight is in the file: ignored
    EXPECT_TRUE(w.tied_embeddings);
    EXPECT_EQ(w.lm_head.weight.raw_data(), w.embed_tokens.raw_data());
    EXPECT_EQ(w.ignored_tensors, (std::vector<std::string>{"lm_head.weight"}));
  }
  rewrite_weights(dir, [](auto& t) { t.erase("lm_head.weight"); });
  EXPECT_TRUE(load_checkpoint(dir, quiet()).ignored_tensors.empty());

  config["tie_word_embeddings"] = false;
  write_json(dir / "config.json", config);
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kNotFound,
               {"'lm_head.weight'", dir.string(), "[512 (vocab_size 512), 64 (hidden_size 64)]"});
}

TEST(CheckpointIgnored, MtpLayerAndRotaryBuffersAreSkipped) {
  test::TempDir tmp;
  const fs::path dir = tmp / "ds";
  copy_dir(parity("deepseek_v3/base"), dir);
  rewrite_weights(dir, [](auto& t) {
    t["model.layers.3.self_attn.kv_a_layernorm.weight"] =
        Tensor::zeros(DType::kBF16, {32});  // MTP layer
    t["model.layers.3.enorm.weight"] = Tensor::zeros(DType::kBF16, {64});
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = Tensor::zeros(DType::kF32, {4});
  });
  const ModelWeights w = load_checkpoint(dir, quiet());
  EXPECT_EQ(w.layers.size(), 3u);
  EXPECT_EQ(w.ignored_tensors.size(), 3u);
}

// ---------------------------------------------------------------------------------------------
// bad input

TEST(CheckpointErrors, ShapeThatContradictsConfig) {
  test::TempDir tmp;
  const fs::path dir = tmp / "m";
  copy_dir(parity("qwen3_moe/base"), dir);
  json config = read_json(dir / "config.json");
  config["moe_intermediate_size"] = 16;
  write_json(dir / "config.json", config);
  expect_error(
      [&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
      {(dir / "model.safetensors").string(), "'model.layers.0.mlp.experts.0.gate_proj.weight'",
       "has shape [32, 64]", "expected [16 (moe_intermediate_size 16), 64 (hidden_size 64)]"});

  config["moe_intermediate_size"] = 32;
  config["num_key_value_heads"] = 4;  // k_proj would be [64, 64]
  write_json(dir / "config.json", config);
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"'model.layers.0.self_attn.k_proj.weight'", "has shape [32, 64]",
                "64 (num_key_value_heads 4 x head_dim 16)"});
}

TEST(CheckpointErrors, FewerExpertsInConfigThanOnDiskIsAnError) {
  test::TempDir tmp;
  const fs::path dir = tmp / "m";
  copy_dir(parity("qwen3_moe/base_fused"), dir);
  rewrite_weights(dir, [](auto& t) {
    // one extra module the model does not have
    t["model.layers.0.mlp.extra_proj.weight"] = Tensor::zeros(DType::kBF16, {4, 64});
  });
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"1 tensor is not used", "'model.layers.0.mlp.extra_proj.weight'", "config.json"});
  LoadOptions lenient = quiet();
  lenient.allow_unused_tensors = true;
  const ModelWeights w = load_checkpoint(dir, lenient);
  EXPECT_EQ(w.ignored_tensors, (std::vector<std::string>{"model.layers.0.mlp.extra_proj.weight"}));
}

TEST(CheckpointErrors, MissingTensorNamesItAndTheDirectory) {
  test::TempDir tmp;
  const fs::path dir = tmp / "m";
  copy_dir(parity("qwen3_moe/base"), dir);
  rewrite_weights(dir, [](auto& t) { t.erase("model.layers.2.self_attn.k_norm.weight"); });
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kNotFound,
               {dir.string(), "'model.layers.2.self_attn.k_norm.weight'", "[16 (head_dim 16)]"});

  rewrite_weights(dir, [](auto& t) {
    t["model.layers.2.self_attn.k_norm.weight"] = Tensor::zeros(DType::kBF16, {16});
    for (int e = 0; e < 8; ++e) {
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        t.erase("model.layers.2.mlp.experts." + std::to_string(e) + "." + proj + ".weight");
      }
    }
  });
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kNotFound,
               {"model.layers.2.mlp.experts", "per-expert", "fused"});
}

TEST(CheckpointErrors, WrongDtype) {
  test::TempDir tmp;
  const fs::path dir = tmp / "m";
  copy_dir(parity("qwen3_moe/base"), dir);
  rewrite_weights(dir, [](auto& t) {
    t["model.layers.1.self_attn.q_proj.weight"] = Tensor::zeros(DType::kI32, {64, 64});
  });
  expect_error(
      [&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
      {"'model.layers.1.self_attn.q_proj.weight'", "has dtype I32", "expected BF16, F16 or F32"});

  rewrite_weights(dir, [](auto& t) {
    t["model.layers.1.self_attn.q_proj.weight"] = Tensor::zeros(DType::kBF16, {64, 64});
    t["model.layers.0.mlp.gate.weight"] = Tensor::zeros(DType::kF8E4M3, {8, 64});
  });
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"'model.layers.0.mlp.gate.weight' (router)", "has dtype F8_E4M3"});
}

TEST(CheckpointErrors, MissingOrMalformedConfigJson) {
  test::TempDir tmp;
  const fs::path dir = tmp / "m";
  copy_dir(parity("kimi_like/base"), dir);
  fs::remove(dir / "config.json");
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kNotFound,
               {(dir / "config.json").string()});

  test::write_text_file(dir / "config.json",
                        "{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64,,}");
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {(dir / "config.json").string(), "JSON"});

  json config = read_json(parity("kimi_like/base/config.json"));
  config.erase("kv_lora_rank");
  write_json(dir / "config.json", config);
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {(dir / "config.json").string(), "kv_lora_rank"});

  expect_error([&] { load_checkpoint(tmp / "nowhere", quiet()); }, ErrorCode::kNotFound,
               {"nowhere", "not a directory"});
  fs::remove(dir / "model.safetensors");
  write_json(dir / "config.json", read_json(parity("kimi_like/base/config.json")));
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kNotFound, {"model.safetensors"});
}

TEST(CheckpointErrors, Fp8ScalesMissingMisshapenOrWithoutConfig) {
  test::TempDir tmp;
  const fs::path dir = tmp / "fp8";
  copy_dir(parity("fp8/deepseek_v3_fp8"), dir);
  const std::string q_a = "model.layers.0.self_attn.q_a_proj";

  rewrite_weights(dir, [&](auto& t) {
    t[q_a + ".weight_scale_inv"] = Tensor::zeros(DType::kF32, {1, 1});
  });
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"'" + q_a + ".weight_scale_inv'", "has shape [1, 1]",
                "[1 (ceil(64 / 128)), 2 (ceil(256 / 128))]"});

  rewrite_weights(dir, [&](auto& t) { t.erase(q_a + ".weight_scale_inv"); });
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"'" + q_a + ".weight'", "F8_E4M3", "no '" + q_a + ".weight_scale_inv'"});

  copy_dir(parity("fp8/deepseek_v3_fp8"), dir);  // restore
  json config = read_json(dir / "config.json");
  config["quantization_config"]["modules_to_not_convert"] = {"lm_head", "kv_b_proj"};
  write_json(dir / "config.json", config);
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"'model.layers.0.self_attn.kv_b_proj'", "stored quantized", "unquantized"});

  config.erase("quantization_config");
  write_json(dir / "config.json", config);
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"weight_scale_inv'", "fp8-block", "says none"});
}

TEST(CheckpointErrors, Nvfp4BadScalarAndOddGroup) {
  test::TempDir tmp;
  const fs::path dir = tmp / "nvfp4";
  copy_dir(parity("nvfp4/qwen3_moe_nvfp4"), dir);
  const std::string k = "model.layers.1.self_attn.k_proj";
  rewrite_weights(dir,
                  [&](auto& t) { t[k + ".weight_scale_2"] = Tensor::zeros(DType::kF32, {2}); });
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"'" + k + ".weight_scale_2'", "has shape [2]", "[] or [1]"});

  rewrite_weights(dir, [&](auto& t) {
    t[k + ".weight_scale_2"] = Tensor::from_f32({0.01f}, {});
    t[k + ".weight_scale"] = Tensor::zeros(DType::kF8E4M3, {64, 4});
  });
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"'" + k + ".weight_scale'", "has shape [64, 4]", "8 (hidden_size 128 / 16)"});

  // Without hf_quant_config.json the quantized tensors have no config.
  copy_dir(parity("nvfp4/qwen3_moe_nvfp4"), dir);
  fs::remove(dir / "hf_quant_config.json");
  expect_error([&] { load_checkpoint(dir, quiet()); }, ErrorCode::kInvalidFile,
               {"nvfp4", "says none"});
}

}  // namespace
}  // namespace moelora::io
