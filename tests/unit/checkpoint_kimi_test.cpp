// Kimi-K2.5-NVFP4 as published, through the checkpoint loader (src/io/checkpoint.h): the tiny
// DeepSeek-V3 fixture of tests/data/parity rewritten the way the NVFP4 export of the multimodal
// model stores it:
//   - config.json is the KimiK25ForConditionalGeneration wrapper (model_type kimi_k25, the text
//     model under text_config with model_type kimi_k2, a vision_config) with ModelOpt's NVFP4
//     quantization_config, whose ignore list keeps attention, the shared experts, layer 0's dense
//     MLP, the routers, lm_head and the vision tower in bf16;
//   - every text tensor sits under language_model. (language_model.model.layers...,
//     language_model.lm_head.weight), the routed experts as NVFP4 (codes, e4m3 group scales, a
//     scalar weight_scale_2 and input_scale per tensor), and the vision tower and projector beside
//     them.
// The loader must find the prefix, load the routed experts as NVFP4 that dequantize bit-exactly to
// what was quantized, keep every excluded module bf16 and byte-equal to the fixture, and list the
// vision tensors as ignored, which `moelora inspect` reports.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "core/dtype.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

Tensor f32_scalar(float v, Shape shape) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  t.data<float>()[0] = v;
  return t;
}

// The ModelOpt block of the NVFP4 export (module names as the multimodal model has them).
json modelopt_nvfp4_config() {
  return json::parse(R"({
    "config_groups": {"group_0": {
      "input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
      "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
      "targets": ["Linear"]}},
    "ignore": ["language_model.lm_head", "language_model.model.layers.*.self_attn*",
               "language_model.model.layers.*.mlp.shared_experts*",
               "language_model.model.layers.0.mlp*", "*.mlp.gate", "vision_tower*", "mm_projector*"],
    "kv_cache_scheme": {"dynamic": false, "num_bits": 8, "type": "float"},
    "producer": {"name": "modelopt", "version": "0.39.0"},
    "quant_algo": "NVFP4",
    "quant_method": "modelopt"})");
}

struct PublishedKimi {
  // per routed-expert weight name (language_model.model.layers.L.mlp.experts.e.P_proj.weight):
  // what the loader must dequantize it to
  std::map<std::string, Tensor> expert_dequant;
  std::vector<std::string> vision_names;
};

// Rewrites the bf16 DeepSeek-V3 fixture in `dir` into the published Kimi-K2.5-NVFP4 layout.
PublishedKimi write_published_kimi(const fs::path& dir) {
  const fs::path fixture = test::data_dir() / "parity" / "deepseek_v3" / "base";
  fs::create_directories(dir);
  for (const auto& entry : fs::directory_iterator(fixture))
    if (entry.path().filename() != "model.safetensors" && entry.path().filename() != "config.json")
      fs::copy(entry.path(), dir / entry.path().filename(), fs::copy_options::recursive);

  json text = json::parse(test::read_text_file(fixture / "config.json"));
  text["model_type"] = "kimi_k2";
  text.erase("architectures");
  json config = {{"architectures", {"KimiK25ForConditionalGeneration"}},
                 {"model_type", "kimi_k25"},
                 {"tie_word_embeddings", false},
                 {"text_config", text},
                 {"vision_config", {{"mm_hidden_size", 16}, {"model_type", "kimi_k25_vision"}}},
                 {"quantization_config", modelopt_nvfp4_config()}};
  test::write_text_file(dir / "config.json", config.dump(2));

  PublishedKimi out;
  const SafetensorsStore store = SafetensorsStore::open_dir(fixture);
  SafetensorsWriter writer;
  bool scalar_shape = false;  // alternate [] and [1], as exports disagree
  for (const std::string& name : store.names()) {
    const Tensor t = store.tensor(name);
    const std::string published = "language_model." + name;
    if (name.find(".mlp.experts.") != std::string::npos && name.ends_with("_proj.weight")) {
      const ops::Nvfp4Weight q = ops::quantize_nvfp4_ref(t.to_f32());
      const std::string base = published.substr(0, published.size() - std::string("weight").size());
      writer.add(base + "weight", q.packed);
      writer.add(base + "weight_scale", q.scale);
      writer.add(base + "weight_scale_2", f32_scalar(q.scale_2, scalar_shape ? Shape{} : Shape{1}));
      writer.add(base + "input_scale",
                 f32_scalar(1.0f / 448.0f, scalar_shape ? Shape{1} : Shape{}));
      scalar_shape = !scalar_shape;
      out.expert_dequant[published] = ops::dequant_nvfp4_ref(q.packed, q.scale, q.scale_2);
    } else {
      writer.add(published, t);
    }
  }
  Tensor patch = Tensor::empty(DType::kBF16, {16, 12});
  std::memset(patch.raw_data(), 0, patch.nbytes());
  for (const std::string name :
       {"vision_tower.patch_embed.proj.weight", "vision_tower.encoder.blocks.0.wqkv.weight",
        "mm_projector.proj.0.weight"}) {
    writer.add(name, patch);
    out.vision_names.push_back(name);
  }
  writer.write(dir / "model.safetensors");
  return out;
}

TEST(CheckpointKimiK25, PublishedNvfp4LayoutLoadsThroughTheLanguageModelPrefix) {
  test::TempDir tmp;
  const PublishedKimi published = write_published_kimi(tmp.path());
  LoadOptions options;
  options.show_progress = false;
  const ModelWeights w = load_checkpoint(tmp.path(), options);
  const ModelWeights bf16 =
      load_checkpoint(test::data_dir() / "parity" / "deepseek_v3" / "base", options);

  EXPECT_EQ(w.config.model_type, "kimi_k25");
  EXPECT_EQ(w.config.arch, Architecture::kDeepseekV3);
  EXPECT_EQ(w.config.quant.method, QuantMethod::kNvfp4);
  EXPECT_EQ(w.weight_prefix, "language_model.model.");
  ASSERT_EQ(w.layers.size(), 3u);

  // routed experts: NVFP4, bit-exactly what was quantized; gate / up / down each with its scale_2
  int experts_checked = 0;
  for (size_t layer = 1; layer < w.layers.size(); ++layer) {
    const ExpertWeights& ex = w.layers[layer].experts;
    ASSERT_EQ(ex.num_experts, 16);
    for (int e = 0; e < ex.num_experts; ++e)
      for (const LinearWeight* lw : {&ex.gate[e], &ex.up[e], &ex.down[e]}) {
        ASSERT_EQ(lw->format, WeightFormat::kNvfp4) << lw->name;
        EXPECT_TRUE(lw->has_input_scale) << lw->name;
        const auto it = published.expert_dequant.find(lw->name);
        ASSERT_NE(it, published.expert_dequant.end()) << lw->name;
        const Tensor got = ops::dequant_nvfp4_ref(lw->weight, lw->scale, lw->scale_2);
        ASSERT_EQ(got.shape(), it->second.shape()) << lw->name;
        EXPECT_EQ(std::memcmp(got.raw_data(), it->second.raw_data(), got.nbytes()), 0) << lw->name;
        ++experts_checked;
      }
  }
  EXPECT_EQ(experts_checked, 2 * 16 * 3);

  // every module the ignore list names stays bf16 and byte-equal to the bf16 fixture
  auto same = [](const LinearWeight& a, const LinearWeight& b) {
    return a.format == WeightFormat::kDense && a.weight.dtype() == DType::kBF16 &&
           a.weight.shape() == b.weight.shape() &&
           std::memcmp(a.weight.raw_data(), b.weight.raw_data(), a.weight.nbytes()) == 0;
  };
  for (size_t layer = 0; layer < w.layers.size(); ++layer) {
    const LayerWeights &l = w.layers[layer], &r = bf16.layers[layer];
    for (const auto& [got, want] : {std::pair{&l.q_a_proj, &r.q_a_proj},
                                    {&l.q_b_proj, &r.q_b_proj},
                                    {&l.kv_a_proj_with_mqa, &r.kv_a_proj_with_mqa},
                                    {&l.kv_b_proj, &r.kv_b_proj},
                                    {&l.o_proj, &r.o_proj}})
      EXPECT_TRUE(same(*got, *want)) << got->name;
    if (layer == 0) {
      EXPECT_TRUE(same(l.mlp.gate, r.mlp.gate)) << l.mlp.gate.name;
      EXPECT_TRUE(same(l.mlp.down, r.mlp.down)) << l.mlp.down.name;
    } else {
      EXPECT_TRUE(same(l.shared_expert.gate, r.shared_expert.gate)) << l.shared_expert.gate.name;
      EXPECT_TRUE(same(l.shared_expert.down, r.shared_expert.down)) << l.shared_expert.down.name;
      EXPECT_EQ(l.router.dtype(), DType::kBF16);
      EXPECT_EQ(std::memcmp(l.router.raw_data(), r.router.raw_data(), l.router.nbytes()), 0);
      EXPECT_TRUE(l.shared_expert.down.name.starts_with("language_model.model.layers."));
    }
  }
  EXPECT_TRUE(same(w.lm_head, bf16.lm_head)) << w.lm_head.name;
  EXPECT_EQ(w.lm_head.name, "language_model.lm_head.weight");

  // the vision tower and the projector are skipped and named (nothing else is)
  EXPECT_THAT(w.ignored_tensors, ::testing::UnorderedElementsAreArray(published.vision_names));
}

// What `moelora inspect` tells a user about the published export: the text model under its
// language_model. prefix, the routed experts as NVFP4, and the vision tensors counted as ignored
// with the reason (table and JSON).
TEST(CheckpointKimiK25, InspectNamesTheIgnoredVisionTensorsAndTheNvfp4Experts) {
  test::TempDir tmp;
  const PublishedKimi published = write_published_kimi(tmp.path());
  const std::string dir = "'" + tmp.path().string() + "'";
  const test::CommandResult table = test::run_moelora("inspect " + dir);
  ASSERT_EQ(table.exit_code, 0) << table.output;
  for (const char* fact :
       {"3 tensors not used by the kimi_k2 text model",
        "2 vision_tower.*: outside the text model (vision tower / projector)",
        "1 mm_projector.*: outside the text model (vision tower / projector)", "nvfp4",
        "check            ok"}) {
    EXPECT_THAT(table.output, ::testing::HasSubstr(fact)) << table.output;
  }
  const test::CommandResult as_json = test::run_moelora("inspect --json " + dir);
  ASSERT_EQ(as_json.exit_code, 0) << as_json.output;
  const json j = json::parse(as_json.output);
  EXPECT_EQ(j["ignored_tensors"]["count"], published.vision_names.size());
  ASSERT_EQ(j["ignored_tensors"]["groups"].size(), 2u);
  EXPECT_EQ(j["ignored_tensors"]["groups"][0]["tensors"], "mm_projector.*");  // in name order
  EXPECT_EQ(j["ignored_tensors"]["groups"][1]["tensors"], "vision_tower.*");
  EXPECT_EQ(j["ignored_tensors"]["groups"][1]["count"], 2);
  EXPECT_EQ(j["check"], "ok");
}

}  // namespace
}  // namespace moelora::io
