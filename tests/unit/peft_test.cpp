// PEFT adapter loading (src/io/peft.h):
//   - every adapter fixture of tests/data/parity against its base model's config: the expert
//     layout, the canonical shapes and ranks, the scalings (computed here from adapter_config.json,
//     including the rank_pattern / alpha_pattern entries and the rsLoRA one), and the canonical
//     factors reproducing the dense delta s * B_e A_e that the raw file tensors give when read
//     with the documented layout (tests/data/README.md §7; written independently here);
//   - the shared-outer fixture equals the per-expert adapter it stands for;
//   - synthetic adapters: gate/up and per-expert scalings that differ (folded into B), ranks padded
//     per expert, BF16 factors, keys without "base_model.model." / ".weight", stacked 3-D;
// adapter_config.json parsing: peft_config_test.cpp; bad input: peft_bad_adapter_test.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "io/peft.h"
#include "io/safetensors.h"
#include "support/test_support.h"
#include "unit/peft_test_support.h"

namespace moelora::io {
namespace {

using namespace peft_test;  // fs, json, the gmock matchers, error_message

// ---------------------------------------------------------------------------------------------
// Raw adapter files, read without the loader

class RawAdapter {
 public:
  explicit RawAdapter(const fs::path& dir)
      : file_(SafetensorsFile::open(dir / "adapter_model.safetensors")),
        config_(json::parse(test::read_text_file(dir / "adapter_config.json"))) {}

  const json& config() const { return config_; }
  double r() const { return config_.at("r").get<double>(); }
  double alpha() const { return config_.at("lora_alpha").get<double>(); }
  // F32 copy of the tensor named `name` after the "base_model.model." prefix.
  Tensor get(const std::string& name) const { return file_.tensor("base_model.model." + name).to_f32(); }

 private:
  SafetensorsFile file_;
  json config_;
};

// s * B A of a plain 2-D LoRA: lora_A [r, in], lora_B [out, r].
Dense raw_plain_delta(const RawAdapter& raw, const std::string& module, double s) {
  const Tensor a = raw.get(module + ".lora_A.weight"), b = raw.get(module + ".lora_B.weight");
  const int64_t rank = a.dim(0), in = a.dim(1), out = b.dim(0);
  return low_rank(out, rank, in, s, element(b, rank, 1), element(a, in, 1));
}

// PEFT target_parameters layout (README §7.3): A_e[k, :] = lora_A[e*R + k, :],
// B_e[:, k] = lora_B[:, k*E + e].
Dense raw_peft3d_delta(const RawAdapter& raw, const std::string& module, int64_t num_experts, int64_t e,
                       double s) {
  const Tensor a = raw.get(module + ".lora_A.weight"), b = raw.get(module + ".lora_B.weight");
  const int64_t rank = a.dim(0) / num_experts, in = a.dim(1), out = b.dim(0);
  return low_rank(out, rank, in, s, element(b, b.dim(1), num_experts, e), element(a, in, 1, e * rank * in));
}

// Stacked / shared-outer layout (README §7.4): expert e uses index 0 of a leading dim 1, else e.
Dense raw_stacked_delta(const RawAdapter& raw, const std::string& module, int64_t e, double s) {
  const Tensor a = raw.get(module + ".lora_A.weight"), b = raw.get(module + ".lora_B.weight");
  const int64_t rank = a.dim(1), in = a.dim(2), out = b.dim(1);
  const int64_t ea = a.dim(0) == 1 ? 0 : e, eb = b.dim(0) == 1 ? 0 : e;
  return low_rank(out, rank, in, s, element(b, rank, 1, eb * out * rank), element(a, in, 1, ea * rank * in));
}

// ---------------------------------------------------------------------------------------------
// Fixture checks

struct Fixture {
  ModelConfig base;
  RawAdapter raw;
  LoraAdapter adapter;
  Fixture(const std::string& model, const std::string& base_dir, const std::string& adapter_dir)
      : base(load_model_config(parity_dir() / model / base_dir)),
        raw(parity_dir() / model / adapter_dir),
        adapter(load_adapter(parity_dir() / model / adapter_dir, base, adapter_dir)) {}
};

// "L:target" for every adapted target, to compare against the expected set.
std::set<std::string> adapted_targets(const LoraAdapter& adapter) {
  std::set<std::string> out;
  for (size_t layer = 0; layer < adapter.layers.size(); ++layer) {
    for (const auto& [name, w] : adapter.layers[layer].named()) {
      if (w->defined()) out.insert(std::to_string(layer) + ":" + name);
    }
  }
  return out;
}

std::set<std::string> targets_in(const std::vector<int64_t>& layers, const std::vector<std::string>& names) {
  std::set<std::string> out;
  for (int64_t layer : layers) {
    for (const std::string& name : names) out.insert(std::to_string(layer) + ":" + name);
  }
  return out;
}

std::set<std::string> merged(std::set<std::string> a, const std::set<std::string>& b) {
  a.insert(b.begin(), b.end());
  return a;
}

// Every plain (non-expert) target: scaling as expected, shapes [1, r, in] / [1, out, r], delta
// equal to the raw file's.
void check_plain_targets(const Fixture& f,
                         const std::function<double(int64_t, const std::string&)>& expected_scaling,
                         const std::function<int64_t(int64_t, const std::string&)>& expected_rank) {
  for (size_t layer = 0; layer < f.adapter.layers.size(); ++layer) {
    for (const auto& [name, w] : f.adapter.layers[layer].named()) {
      if (!w->defined() || name.rfind("mlp.experts.", 0) == 0) continue;
      const std::string module = "model.layers." + std::to_string(layer) + "." + name;
      const double s = expected_scaling(static_cast<int64_t>(layer), name);
      const int64_t rank = expected_rank(static_cast<int64_t>(layer), name);
      SCOPED_TRACE(module);
      EXPECT_EQ(w->scaling, static_cast<float>(s));
      EXPECT_EQ(w->a.dim(0), 1);
      EXPECT_EQ(w->b.dim(0), 1);
      EXPECT_EQ(w->rank(), rank);
      EXPECT_TRUE(dense_close(canonical_delta(*w, 0), raw_plain_delta(f.raw, module, s), module));
    }
  }
}

TEST(PeftFixtures, Qwen3MoePeft3d) {
  Fixture f("qwen3_moe", "base", "lora_peft3d");
  const int64_t E = f.base.num_experts, H = f.base.hidden_size, I = f.base.moe_intermediate_size;
  const double r = f.raw.r(), alpha = f.raw.alpha();
  // rank_pattern / alpha_pattern {"layers.2.self_attn.o_proj": 6 / 3}: o_proj of layer 2 only.
  const json& cfg = f.raw.config();
  const double o2_rank = cfg.at("rank_pattern").at("layers.2.self_attn.o_proj").get<double>();
  const double o2_alpha = cfg.at("alpha_pattern").at("layers.2.self_attn.o_proj").get<double>();
  ASSERT_EQ(o2_rank, 6);

  EXPECT_EQ(f.adapter.expert_layout, ExpertLoraLayout::kPeft3d);
  EXPECT_EQ(f.adapter.num_tensors, 32);
  EXPECT_EQ(f.adapter.max_rank, 6);
  EXPECT_EQ(adapted_targets(f.adapter),
            merged(targets_in({0, 1, 2}, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj"}),
                   targets_in({0, 2}, {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})));
  check_plain_targets(
      f,
      [&](int64_t layer, const std::string& name) {
        return layer == 2 && name == "self_attn.o_proj" ? o2_alpha / o2_rank : alpha / r;
      },
      [&](int64_t layer, const std::string& name) {
        return layer == 2 && name == "self_attn.o_proj" ? static_cast<int64_t>(o2_rank)
                                                        : static_cast<int64_t>(r);
      });
  EXPECT_EQ(f.adapter.layers[2].o_proj.scaling, 0.5f);

  for (int64_t layer : {0, 2}) {
    const LayerLora& l = f.adapter.layers[static_cast<size_t>(layer)];
    const std::string experts = "model.layers." + std::to_string(layer) + ".mlp.experts";
    EXPECT_EQ(l.experts_gate_up.a.shape(), Shape({E, 4, H}));
    EXPECT_EQ(l.experts_gate_up.b.shape(), Shape({E, 2 * I, 4}));
    EXPECT_EQ(l.experts_down.a.shape(), Shape({E, 4, I}));
    EXPECT_EQ(l.experts_down.b.shape(), Shape({E, H, 4}));
    EXPECT_EQ(l.experts_gate_up.scaling, static_cast<float>(alpha / r));
    EXPECT_EQ(l.experts_down.scaling, static_cast<float>(alpha / r));
    for (int64_t e = 0; e < E; ++e) {
      SCOPED_TRACE("layer " + std::to_string(layer) + " expert " + std::to_string(e));
      // both parameters targeted: gate_up_proj is the inner wrapper (base_layer), down_proj the outer
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_gate_up, e),
                              raw_peft3d_delta(f.raw, experts + ".base_layer", E, e, alpha / r), "gate_up"));
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_down, e),
                              raw_peft3d_delta(f.raw, experts, E, e, alpha / r), "down"));
    }
  }
  EXPECT_FALSE(f.adapter.layers[1].experts_gate_up.defined());
  EXPECT_THAT(f.adapter.targets, ::testing::Contains("self_attn.o_proj (layer 2): rank 6, scaling 0.5"));
  EXPECT_THAT(f.adapter.targets,
              ::testing::Contains("mlp.experts.gate_up_proj (layers 0, 2): rank 4, scaling 2, 8 experts"));
}

TEST(PeftFixtures, Qwen3MoePerExpertRsLora) {
  Fixture f("qwen3_moe", "base", "lora_per_expert");
  const int64_t E = f.base.num_experts, H = f.base.hidden_size, I = f.base.moe_intermediate_size;
  ASSERT_TRUE(f.raw.config().at("use_rslora").get<bool>());
  // rsLoRA with the per-expert meaning: every expert projection is its own rank-r LoRA scaled by
  // alpha / sqrt(r) (not PEFT 0.21's 2*alpha / sqrt(2r) for gate and up).
  const double s = f.raw.alpha() / std::sqrt(f.raw.r());
  ASSERT_EQ(s, 4.0);

  EXPECT_EQ(f.adapter.expert_layout, ExpertLoraLayout::kPerExpert);
  EXPECT_EQ(f.adapter.max_rank, 8);
  EXPECT_EQ(adapted_targets(f.adapter),
            merged(targets_in({0, 1, 2}, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj"}),
                   targets_in({0, 2}, {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})));
  check_plain_targets(
      f, [&](int64_t, const std::string&) { return s; }, [&](int64_t, const std::string&) { return 4; });
  for (int64_t layer : {0, 2}) {
    const LayerLora& l = f.adapter.layers[static_cast<size_t>(layer)];
    // separate gate and up A: R = 4 + 4, block-diagonal B
    EXPECT_EQ(l.experts_gate_up.a.shape(), Shape({E, 8, H}));
    EXPECT_EQ(l.experts_gate_up.b.shape(), Shape({E, 2 * I, 8}));
    EXPECT_EQ(l.experts_down.a.shape(), Shape({E, 4, I}));
    EXPECT_EQ(l.experts_down.b.shape(), Shape({E, H, 4}));
    EXPECT_EQ(l.experts_gate_up.scaling, static_cast<float>(s));
    EXPECT_EQ(l.experts_down.scaling, static_cast<float>(s));
    for (int64_t e = 0; e < E; ++e) {
      SCOPED_TRACE("layer " + std::to_string(layer) + " expert " + std::to_string(e));
      const std::string expert =
          "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e);
      const Dense gate_up = vstack(raw_plain_delta(f.raw, expert + ".gate_proj", s),
                                   raw_plain_delta(f.raw, expert + ".up_proj", s));
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_gate_up, e), gate_up, "gate_up"));
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_down, e),
                              raw_plain_delta(f.raw, expert + ".down_proj", s), "down"));
    }
    // the off-diagonal blocks of B are zero: gate rows use only the first 4 rank columns
    const float* b = l.experts_gate_up.b.data<float>();
    for (int64_t o = 0; o < I; ++o) {
      for (int64_t k = 4; k < 8; ++k) ASSERT_EQ(b[o * 8 + k], 0.0f);
    }
  }
}

TEST(PeftFixtures, Qwen3MoeSharedOuter) {
  Fixture f("qwen3_moe", "base", "lora_shared_outer");
  const int64_t E = f.base.num_experts, H = f.base.hidden_size, I = f.base.moe_intermediate_size;
  const double s = f.raw.alpha() / f.raw.r();

  EXPECT_EQ(f.adapter.expert_layout, ExpertLoraLayout::kSharedOuter);
  check_plain_targets(
      f, [&](int64_t, const std::string&) { return s; }, [&](int64_t, const std::string&) { return 4; });
  for (int64_t layer : {0, 2}) {
    const LayerLora& l = f.adapter.layers[static_cast<size_t>(layer)];
    // the shared factors stay shared: Ea == 1 for gate_up A, Eb == 1 for down B
    EXPECT_EQ(l.experts_gate_up.a.shape(), Shape({1, 8, H}));
    EXPECT_EQ(l.experts_gate_up.b.shape(), Shape({E, 2 * I, 8}));
    EXPECT_EQ(l.experts_down.a.shape(), Shape({E, 4, I}));
    EXPECT_EQ(l.experts_down.b.shape(), Shape({1, H, 4}));
    EXPECT_TRUE(l.experts_gate_up.shared_a());
    EXPECT_TRUE(l.experts_down.shared_b());
    for (int64_t e = 0; e < E; ++e) {
      SCOPED_TRACE("layer " + std::to_string(layer) + " expert " + std::to_string(e));
      const std::string experts = "model.layers." + std::to_string(layer) + ".mlp.experts";
      const Dense gate_up = vstack(raw_stacked_delta(f.raw, experts + ".gate_proj", e, s),
                                   raw_stacked_delta(f.raw, experts + ".up_proj", e, s));
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_gate_up, e), gate_up, "gate_up"));
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_down, e),
                              raw_stacked_delta(f.raw, experts + ".down_proj", e, s), "down"));
    }
  }
}

// The shared-outer fixture and the per-expert adapter it stands for (the shared factor copied to
// every expert, as its oracle was made) give the same delta for every expert.
TEST(PeftFixtures, SharedOuterEqualsItsPerExpertForm) {
  const fs::path shared_dir = parity_dir() / "qwen3_moe" / "lora_shared_outer";
  const ModelConfig base = load_model_config(parity_dir() / "qwen3_moe" / "base");
  const SafetensorsFile file = SafetensorsFile::open(shared_dir / "adapter_model.safetensors");
  test::TempDir tmp;
  const fs::path per_expert_dir = tmp / "per_expert";
  fs::create_directories(per_expert_dir);
  fs::copy_file(shared_dir / "adapter_config.json", per_expert_dir / "adapter_config.json");
  SafetensorsWriter writer;
  const std::string stacked_marker = ".mlp.experts.";
  for (const TensorInfo& info : file.tensors()) {
    const Tensor t = file.tensor(info.name).to_f32();
    const size_t at = info.name.find(stacked_marker);
    if (at == std::string::npos) {
      writer.add(info.name, t);
      continue;
    }
    // "...mlp.experts.<proj>.lora_X.weight" [1 or E, ., .] -> "...mlp.experts.<e>.<proj>.lora_X.weight"
    const std::string head = info.name.substr(0, at + stacked_marker.size());
    const std::string tail = info.name.substr(at + stacked_marker.size());
    for (int64_t e = 0; e < base.num_experts; ++e) {
      writer.add(head + std::to_string(e) + "." + tail, t.select0(t.dim(0) == 1 ? 0 : e).clone());
    }
  }
  writer.write(per_expert_dir / "adapter_model.safetensors");

  const LoraAdapter shared = load_adapter(shared_dir, base, "shared");
  const LoraAdapter per_expert = load_adapter(per_expert_dir, base, "per_expert");
  EXPECT_EQ(per_expert.expert_layout, ExpertLoraLayout::kPerExpert);
  for (int64_t layer : {0, 2}) {
    const LayerLora& a = shared.layers[static_cast<size_t>(layer)];
    const LayerLora& b = per_expert.layers[static_cast<size_t>(layer)];
    EXPECT_EQ(b.experts_gate_up.a.dim(0), base.num_experts);
    for (int64_t e = 0; e < base.num_experts; ++e) {
      SCOPED_TRACE("layer " + std::to_string(layer) + " expert " + std::to_string(e));
      EXPECT_TRUE(dense_close(canonical_delta(a.experts_gate_up, e), canonical_delta(b.experts_gate_up, e),
                              "gate_up"));
      EXPECT_TRUE(
          dense_close(canonical_delta(a.experts_down, e), canonical_delta(b.experts_down, e), "down"));
    }
  }
}

TEST(PeftFixtures, DeepseekV3Peft3dWithPatterns) {
  Fixture f("deepseek_v3", "base", "lora_peft3d");
  const int64_t E = f.base.num_experts, H = f.base.hidden_size, I = f.base.moe_intermediate_size;
  const double r = f.raw.r(), alpha = f.raw.alpha();
  const json& cfg = f.raw.config();
  const double down_rank = cfg.at("rank_pattern").at("mlp.experts.down_proj").get<double>();
  const double down_alpha = cfg.at("alpha_pattern").at("mlp.experts.down_proj").get<double>();
  ASSERT_EQ(down_rank, 2);
  ASSERT_EQ(down_alpha / down_rank, 3.0);

  EXPECT_EQ(f.adapter.expert_layout, ExpertLoraLayout::kPeft3d);
  EXPECT_EQ(f.adapter.max_rank, 4);
  const std::vector<std::string> mla = {"self_attn.q_a_proj", "self_attn.q_b_proj",
                                        "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                                        "self_attn.o_proj"};
  EXPECT_EQ(adapted_targets(f.adapter),
            merged(targets_in({0, 1, 2}, mla),
                   targets_in({1, 2}, {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})));
  check_plain_targets(
      f, [&](int64_t, const std::string&) { return alpha / r; },
      [&](int64_t, const std::string&) { return static_cast<int64_t>(r); });
  for (int64_t layer : {1, 2}) {
    const LayerLora& l = f.adapter.layers[static_cast<size_t>(layer)];
    const std::string experts = "model.layers." + std::to_string(layer) + ".mlp.experts";
    EXPECT_EQ(l.experts_gate_up.a.shape(), Shape({E, 4, H}));
    EXPECT_EQ(l.experts_gate_up.b.shape(), Shape({E, 2 * I, 4}));
    EXPECT_EQ(l.experts_down.a.shape(), Shape({E, 2, I}));
    EXPECT_EQ(l.experts_down.b.shape(), Shape({E, H, 2}));
    EXPECT_EQ(l.experts_gate_up.scaling, static_cast<float>(alpha / r));
    EXPECT_EQ(l.experts_down.scaling, static_cast<float>(down_alpha / down_rank));
    for (int64_t e : {0, 5, 15}) {
      SCOPED_TRACE("layer " + std::to_string(layer) + " expert " + std::to_string(e));
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_gate_up, e),
                              raw_peft3d_delta(f.raw, experts + ".base_layer", E, e, alpha / r), "gate_up"));
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_down, e),
                              raw_peft3d_delta(f.raw, experts, E, e, down_alpha / down_rank), "down"));
    }
  }
}

TEST(PeftFixtures, DeepseekV3DenseAndSharedExperts) {
  Fixture f("deepseek_v3", "base", "lora_dense_shared");
  const double s = f.raw.alpha() / f.raw.r();
  ASSERT_TRUE(f.raw.config().at("target_modules").is_string());  // the regex form
  EXPECT_EQ(f.adapter.expert_layout, ExpertLoraLayout::kNone);
  EXPECT_EQ(adapted_targets(f.adapter),
            merged(merged(targets_in({0}, {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}),
                          targets_in({1, 2}, {"mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                              "mlp.shared_experts.down_proj"})),
                   targets_in({0, 1, 2}, {"self_attn.o_proj"})));
  check_plain_targets(
      f, [&](int64_t, const std::string&) { return s; }, [&](int64_t, const std::string&) { return 4; });
  EXPECT_EQ(f.adapter.layers[0].mlp_down.a.shape(), Shape({1, 4, f.base.intermediate_size}));
  EXPECT_EQ(f.adapter.layers[1].shared_down.a.shape(), Shape({1, 4, f.base.shared_expert_intermediate_size}));
}

TEST(PeftFixtures, DeepseekV3PerExpert) {
  Fixture f("deepseek_v3", "base", "lora_per_expert");
  const int64_t E = f.base.num_experts, H = f.base.hidden_size;
  const double s = f.raw.alpha() / f.raw.r();
  EXPECT_EQ(f.adapter.expert_layout, ExpertLoraLayout::kPerExpert);
  // target_modules names gate/up/down_proj, which the dense MLP and the shared experts also
  // match; they have no tensors and are not adapted.
  EXPECT_EQ(adapted_targets(f.adapter),
            merged(targets_in({0, 1, 2}, {"self_attn.q_a_proj", "self_attn.kv_b_proj"}),
                   targets_in({1, 2}, {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})));
  check_plain_targets(
      f, [&](int64_t, const std::string&) { return s; }, [&](int64_t, const std::string&) { return 4; });
  for (int64_t layer : {1, 2}) {
    const LayerLora& l = f.adapter.layers[static_cast<size_t>(layer)];
    EXPECT_EQ(l.experts_gate_up.a.shape(), Shape({E, 8, H}));
    EXPECT_EQ(l.experts_down.b.shape(), Shape({E, H, 4}));
    for (int64_t e : {0, 7, 15}) {
      SCOPED_TRACE("layer " + std::to_string(layer) + " expert " + std::to_string(e));
      const std::string expert =
          "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e);
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_gate_up, e),
                              vstack(raw_plain_delta(f.raw, expert + ".gate_proj", s),
                                     raw_plain_delta(f.raw, expert + ".up_proj", s)),
                              "gate_up"));
      EXPECT_TRUE(dense_close(canonical_delta(l.experts_down, e),
                              raw_plain_delta(f.raw, expert + ".down_proj", s), "down"));
    }
  }
}

TEST(PeftFixtures, KimiLikePeft3dPlainQProj) {
  Fixture f("kimi_like", "base", "lora_peft3d");
  const int64_t E = f.base.num_experts, H = f.base.hidden_size, I = f.base.moe_intermediate_size;
  const double s = f.raw.alpha() / f.raw.r();
  ASSERT_EQ(f.base.q_lora_rank, 0);
  EXPECT_EQ(f.adapter.expert_layout, ExpertLoraLayout::kPeft3d);
  EXPECT_EQ(adapted_targets(f.adapter),
            merged(targets_in({0, 1}, {"self_attn.q_proj", "self_attn.kv_a_proj_with_mqa",
                                       "self_attn.kv_b_proj", "self_attn.o_proj"}),
                   targets_in({1}, {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})));
  check_plain_targets(
      f, [&](int64_t, const std::string&) { return s; }, [&](int64_t, const std::string&) { return 4; });
  const LayerLora& l = f.adapter.layers[1];
  EXPECT_EQ(l.experts_gate_up.a.shape(), Shape({E, 4, H}));
  EXPECT_EQ(l.experts_down.a.shape(), Shape({E, 4, I}));
  for (int64_t e = 0; e < E; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    EXPECT_TRUE(dense_close(canonical_delta(l.experts_gate_up, e),
                            raw_peft3d_delta(f.raw, "model.layers.1.mlp.experts.base_layer", E, e, s),
                            "gate_up"));
    EXPECT_TRUE(dense_close(canonical_delta(l.experts_down, e),
                            raw_peft3d_delta(f.raw, "model.layers.1.mlp.experts", E, e, s), "down"));
  }
}

// alpha_pattern gives up_proj another alpha and rank_pattern gives expert 3 another rank: the
// scaling ratios are folded into B, expert 3's smaller rank is zero-padded, and every expert's
// delta is still s_module * B A of its own modules.
TEST_F(PeftSynthetic, DifferentScalingsAreFoldedIntoB) {
  AdapterDir d;
  d.config()["rank_pattern"] = {{"experts.3.gate_proj", 2}, {"experts.3.up_proj", 3}};
  d.config()["alpha_pattern"] = {{"up_proj", 24}};
  const auto rank_of = [](int64_t e, const std::string& proj) -> int64_t {
    if (e == 3 && proj == "gate_proj") return 2;
    if (e == 3 && proj == "up_proj") return 3;
    return 4;
  };
  add_per_expert(d, 0, 4, rank_of);
  const LoraAdapter adapter = load_adapter(d.write(), base_, "folded");
  const LoraWeights& gate_up = adapter.layers[0].experts_gate_up;
  EXPECT_EQ(gate_up.a.shape(), Shape({8, 8, 64}));  // max gate rank 4 + max up rank 4
  // the largest scaling (up_proj of expert 3: 24 / 3) becomes the target's
  EXPECT_EQ(gate_up.scaling, 8.0f);
  for (int64_t e = 0; e < base_.num_experts; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    const std::string expert = "model.layers.0.mlp.experts." + std::to_string(e);
    const double gate_s = 8.0 / static_cast<double>(rank_of(e, "gate_proj"));
    const double up_s = 24.0 / static_cast<double>(rank_of(e, "up_proj"));
    EXPECT_TRUE(dense_close(
        canonical_delta(gate_up, e),
        vstack(delta_of(d, expert + ".gate_proj", gate_s), delta_of(d, expert + ".up_proj", up_s)),
        "gate_up"));
    EXPECT_TRUE(dense_close(canonical_delta(adapter.layers[0].experts_down, e),
                            delta_of(d, expert + ".down_proj", 2.0), "down"));
  }
  // expert 3's gate block uses rank columns [0, 2) only
  const float* a = gate_up.a.data<float>() + 3 * 8 * 64;
  for (int64_t k = 2; k < 4; ++k) {
    for (int64_t i = 0; i < 64; ++i) ASSERT_EQ(a[k * 64 + i], 0.0f);
  }
}

TEST_F(PeftSynthetic, Bf16FactorsAndKeysWithoutPrefixOrWeightSuffix) {
  AdapterDir d;
  const Tensor a = random({4, 64}).to(DType::kBF16), b = random({32, 4}).to(DType::kBF16);
  d.add("model.layers.2.self_attn.k_proj.lora_A", a);  // no ".weight"
  d.add("model.layers.2.self_attn.k_proj.lora_B", b);
  const LoraAdapter adapter = load_adapter(d.write(/*prefix=*/""), base_, "bf16");
  const LoraWeights& k = adapter.layers[2].k_proj;
  ASSERT_TRUE(k.defined());
  EXPECT_EQ(k.a.dtype(), DType::kF32);
  // the conversion is exact: every canonical value is the bf16 value
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(k.a.data<float>()[i], a.item_f32(i));
  for (int64_t i = 0; i < b.numel(); ++i) ASSERT_EQ(k.b.data<float>()[i], b.item_f32(i));
  EXPECT_EQ(adapter.expert_layout, ExpertLoraLayout::kNone);
  EXPECT_EQ(adapter.targets, std::vector<std::string>{"self_attn.k_proj (layer 2): rank 4, scaling 2"});
}

TEST_F(PeftSynthetic, StackedLayout) {
  AdapterDir d;
  const int64_t E = 8, H = 64, I = 32;
  d.add_lora("model.layers.2.mlp.experts.gate_proj", random({E, 4, H}), random({E, I, 4}));
  d.add_lora("model.layers.2.mlp.experts.up_proj", random({E, 4, H}), random({E, I, 4}));
  d.add_lora("model.layers.2.mlp.experts.down_proj", random({E, 4, I}), random({E, H, 4}));
  const LoraAdapter adapter = load_adapter(d.write(), base_, "stacked");
  EXPECT_EQ(adapter.expert_layout, ExpertLoraLayout::kStacked);
  const LayerLora& l = adapter.layers[2];
  EXPECT_EQ(l.experts_gate_up.a.shape(), Shape({E, 8, H}));
  EXPECT_EQ(l.experts_down.b.shape(), Shape({E, H, 4}));
  const Tensor ga = d.tensor("model.layers.2.mlp.experts.gate_proj.lora_A.weight");
  const Tensor gb = d.tensor("model.layers.2.mlp.experts.gate_proj.lora_B.weight");
  const Tensor ua = d.tensor("model.layers.2.mlp.experts.up_proj.lora_A.weight");
  const Tensor ub = d.tensor("model.layers.2.mlp.experts.up_proj.lora_B.weight");
  for (int64_t e : {0, 6}) {
    const Dense gate = low_rank(I, 4, H, 2.0, element(gb, 4, 1, e * I * 4), element(ga, H, 1, e * 4 * H));
    const Dense up = low_rank(I, 4, H, 2.0, element(ub, 4, 1, e * I * 4), element(ua, H, 1, e * 4 * H));
    EXPECT_TRUE(dense_close(canonical_delta(l.experts_gate_up, e), vstack(gate, up), "gate_up"));
  }
}

TEST_F(PeftSynthetic, AbsentExpertsThatTheConfigExcludesAreUnadapted) {
  AdapterDir d;
  add_per_expert(d, 0, 4);
  d.remove("model.layers.0.mlp.experts.5.up_proj.lora_A.weight");
  d.remove("model.layers.0.mlp.experts.5.up_proj.lora_B.weight");
  d.config()["exclude_modules"] = "model\\.layers\\.0\\.mlp\\.experts\\.5\\.up_proj";
  const LoraAdapter adapter = load_adapter(d.write(), base_, "partial");
  const LoraWeights& gate_up = adapter.layers[0].experts_gate_up;
  const Dense delta = canonical_delta(gate_up, 5);
  const Dense gate = delta_of(d, "model.layers.0.mlp.experts.5.gate_proj", 2.0);
  for (int64_t o = 0; o < 32; ++o) {
    for (int64_t i = 0; i < 64; ++i) {
      ASSERT_EQ(delta.at(o, i), gate.at(o, i));
      ASSERT_EQ(delta.at(32 + o, i), 0.0);
    }
  }
}

}  // namespace
}  // namespace moelora::io
