// PEFT adapter loading (src/io/peft.h):
//   - every adapter fixture of tests/data/parity against its base model's config: the expert
//     layout, the canonical shapes and ranks, the scalings (computed here from adapter_config.json,
//     including the rank_pattern / alpha_pattern entries and the rsLoRA one), and the canonical
//     factors reproducing the dense delta s * B_e A_e that the raw file tensors give when read
//     with the documented layout (tests/data/README.md §7; written independently here);
//   - the shared-outer fixture equals the per-expert adapter it stands for;
//   - synthetic adapters: gate/up and per-expert scalings that differ (folded into B), ranks padded
//     per expert, BF16 factors, keys without "base_model.model." / ".weight", stacked 3-D;
//   - adapter_config.json parsing: list / regex / all-linear targets, patterns in dict order,
//     exclude_modules, layers_to_transform (+ layers_pattern), target_parameters;
//   - bad input: each case gets one error that names the file, tensor or field and the numbers.
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

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using test::error_message;
using ::testing::Not;

fs::path parity_dir() {
  return test::data_dir() / "parity";
}

// ---------------------------------------------------------------------------------------------
// Dense deltas, computed in double

struct Dense {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Dense(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<size_t>(r * c), 0.0) {}
  double& at(int64_t r, int64_t c) { return v[static_cast<size_t>(r * cols + c)]; }
  double at(int64_t r, int64_t c) const { return v[static_cast<size_t>(r * cols + c)]; }
};

using Accessor = std::function<double(int64_t, int64_t)>;

// s * B A for B(o, k) [out, rank] and A(k, i) [rank, in].
Dense low_rank(int64_t out, int64_t rank, int64_t in, double s, const Accessor& b, const Accessor& a) {
  Dense d(out, in);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      double sum = 0;
      for (int64_t k = 0; k < rank; ++k) sum += b(o, k) * a(k, i);
      d.at(o, i) = s * sum;
    }
  }
  return d;
}

Dense vstack(const Dense& top, const Dense& bottom) {
  EXPECT_EQ(top.cols, bottom.cols);
  Dense d(top.rows + bottom.rows, top.cols);
  std::copy(top.v.begin(), top.v.end(), d.v.begin());
  std::copy(bottom.v.begin(), bottom.v.end(), d.v.begin() + static_cast<std::ptrdiff_t>(top.v.size()));
  return d;
}

// The delta of expert e as the canonical form describes it (core/lora.h).
Dense canonical_delta(const LoraWeights& w, int64_t e) {
  const int64_t rank = w.rank(), in = w.in_features(), out = w.out_features();
  const float* a = w.a.data<float>() + (w.a.dim(0) == 1 ? 0 : e) * rank * in;
  const float* b = w.b.data<float>() + (w.b.dim(0) == 1 ? 0 : e) * out * rank;
  return low_rank(
      out, rank, in, w.scaling, [&](int64_t o, int64_t k) { return b[o * rank + k]; },
      [&](int64_t k, int64_t i) { return a[k * in + i]; });
}

::testing::AssertionResult dense_close(const Dense& actual, const Dense& expected, const std::string& what) {
  if (actual.rows != expected.rows || actual.cols != expected.cols) {
    return ::testing::AssertionFailure()
           << what << ": shape [" << actual.rows << ", " << actual.cols << "] vs expected [" << expected.rows
           << ", " << expected.cols << "]";
  }
  double max_ref = 0, max_err = 0;
  size_t worst = 0;
  for (size_t i = 0; i < expected.v.size(); ++i) {
    max_ref = std::max(max_ref, std::abs(expected.v[i]));
    const double err = std::abs(actual.v[i] - expected.v[i]);
    if (!(err <= max_err)) {
      max_err = err;
      worst = i;
    }
  }
  if (max_ref == 0) return ::testing::AssertionFailure() << what << ": the expected delta is all zeros";
  if (max_err <= 1e-6 * std::max(1.0, max_ref)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": max abs error " << max_err << " at (" << worst / expected.cols << ", "
         << worst % expected.cols << "): got " << actual.v[worst] << ", expected " << expected.v[worst]
         << " (max |expected| " << max_ref << ")";
}

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

Accessor element(const Tensor& t, int64_t row_stride, int64_t col_stride, int64_t offset = 0) {
  return [t, row_stride, col_stride, offset](int64_t r, int64_t c) {
    return static_cast<double>(t.item_f32(offset + r * row_stride + c * col_stride));
  };
}

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

// ---------------------------------------------------------------------------------------------
// Synthetic adapters against the tiny Qwen3-MoE config (H 64, q 64, k/v 32, 8 experts, I 32,
// layer 1 dense with intermediate 96)

class AdapterDir {
 public:
  AdapterDir() {
    config_ = {{"peft_type", "LORA"},
               {"r", 4},
               {"lora_alpha", 8},
               {"target_modules",
                json::array({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})}};
  }
  json& config() { return config_; }
  const fs::path& path() const { return dir_.path(); }
  // name: the tensor name after "base_model.model."
  void add(const std::string& name, const Tensor& t) { tensors_[name] = t; }
  void add_lora(const std::string& module, const Tensor& a, const Tensor& b) {
    add(module + ".lora_A.weight", a);
    add(module + ".lora_B.weight", b);
  }
  void remove(const std::string& name) { tensors_.erase(name); }
  const Tensor& tensor(const std::string& name) const { return tensors_.at(name); }
  fs::path write(const std::string& prefix = "base_model.model.") const {
    test::write_text_file(dir_ / "adapter_config.json", config_.dump(2));
    SafetensorsWriter writer;
    for (const auto& [name, t] : tensors_) writer.add(prefix + name, t);
    writer.write(dir_ / "adapter_model.safetensors");
    return dir_.path();
  }

 private:
  test::TempDir dir_;
  json config_;
  std::map<std::string, Tensor> tensors_;
};

class PeftSynthetic : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = load_model_config(parity_dir() / "qwen3_moe" / "base");
    rng_.seed(test::test_seed(20260811));
  }
  Tensor random(const Shape& shape) { return test::random_normal(shape, rng_, 0.25f); }
  // Per-expert LoRAs for every expert of `layer`, rank `rank` (rank_of(e, proj) overrides it).
  void add_per_expert(AdapterDir& d, int64_t layer, int64_t rank,
                      const std::function<int64_t(int64_t, const std::string&)>& rank_of = nullptr) {
    const int64_t H = base_.hidden_size, I = base_.moe_intermediate_size;
    for (int64_t e = 0; e < base_.num_experts; ++e) {
      const std::string expert =
          "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e) + ".";
      for (const std::string proj : {"gate_proj", "up_proj", "down_proj"}) {
        const int64_t r = rank_of ? rank_of(e, proj) : rank;
        const bool down = proj == "down_proj";
        d.add_lora(expert + proj, random({r, down ? I : H}), random({down ? H : I, r}));
      }
    }
  }
  // s * B A of a LoRA held by `d` (module path without "base_model.model.").
  static Dense delta_of(const AdapterDir& d, const std::string& module, double s) {
    const Tensor a = d.tensor(module + ".lora_A.weight").to_f32(),
                 b = d.tensor(module + ".lora_B.weight").to_f32();
    return low_rank(b.dim(0), a.dim(0), a.dim(1), s, element(b, a.dim(0), 1), element(a, a.dim(1), 1));
  }

  ModelConfig base_;
  std::mt19937_64 rng_;
};

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
  EXPECT_EQ(c.target_modules,
            (std::vector<std::string>{"kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"}));
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
      dir, R"({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "model.layers.1.mlp.gate_proj"]})");
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
  AdapterConfig c = parse_text(dir, R"({"r": 8, "lora_alpha": 16, "target_modules": ["o_proj", "q_proj"],
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
      dir, R"({"r": 16, "lora_alpha": 8, "use_rslora": true, "rank_pattern": {"experts.3.up_proj": 4}})");
  EXPECT_TRUE(c.use_rslora);
  EXPECT_EQ(c.scaling_for("model.layers.0.self_attn.q_proj"), 2.0);        // 8 / sqrt(16)
  EXPECT_EQ(c.scaling_for("model.layers.0.mlp.experts.3.up_proj"), 4.0);   // 8 / sqrt(4)
  EXPECT_EQ(c.scaling_for("model.layers.0.mlp.experts.13.up_proj"), 2.0);  // not expert 3
}

TEST(PeftConfig, ExcludeModules) {
  test::TempDir dir;
  AdapterConfig c = parse_text(
      dir, R"({"target_modules": ["q_proj", "o_proj"], "exclude_modules": ["layers.1.self_attn.q_proj"]})");
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.q_proj"));
  EXPECT_TRUE(c.targets_module("model.layers.11.self_attn.q_proj"));  // suffix match starts at a dot
  EXPECT_TRUE(c.targets_module("model.layers.1.self_attn.o_proj"));

  c = parse_text(
      dir, R"({"target_modules": ["q_proj", "o_proj"], "exclude_modules": "model\\.layers\\.[01]\\..*"})");
  ASSERT_TRUE(c.exclude_modules_regex);
  EXPECT_FALSE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.o_proj"));
  EXPECT_TRUE(c.targets_module("model.layers.2.self_attn.o_proj"));
}

TEST(PeftConfig, LayersToTransform) {
  test::TempDir dir;
  AdapterConfig c =
      parse_text(dir, R"({"target_modules": ["q_proj", "gate_proj"], "layers_to_transform": [0, 2]})");
  EXPECT_EQ(c.layers_to_transform, (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(c.targets_module("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.1.self_attn.q_proj"));
  EXPECT_TRUE(c.targets_module("model.layers.2.self_attn.q_proj"));
  // Without layers_pattern PEFT takes the number after the last ".<name>." component, which for a
  // per-expert module is the expert index; mirrored as is.
  EXPECT_TRUE(c.targets_module("model.layers.1.mlp.experts.2.gate_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.2.mlp.experts.1.gate_proj"));

  c = parse_text(
      dir, R"({"target_modules": ["gate_proj"], "layers_to_transform": 1, "layers_pattern": "layers"})");
  EXPECT_EQ(c.layers_pattern, std::vector<std::string>{"layers"});
  EXPECT_TRUE(c.targets_module("model.layers.1.mlp.experts.2.gate_proj"));
  EXPECT_FALSE(c.targets_module("model.layers.2.mlp.experts.1.gate_proj"));
  EXPECT_TRUE(c.targets_module("gate_proj"));  // an exact entry skips the layer filter, as in PEFT
  EXPECT_TRUE(c.targets_module("model.layers.1.mlp.gate_proj"));
}

TEST(PeftConfig, TargetParameters) {
  test::TempDir dir;
  const AdapterConfig c =
      parse_text(dir, R"({"target_modules": null, "target_parameters": ["mlp.experts.down_proj"]})");
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
  EXPECT_THAT(message(R"({"target_modules": "q_proj(", "r": 4})", ErrorCode::kInvalidFile),
              AllOf(HasSubstr("'target_modules'"), HasSubstr("'q_proj('"), HasSubstr("not a valid regex")));
  EXPECT_THAT(message(R"({"target_modules": ["q_proj", 3]})", ErrorCode::kInvalidFile),
              AllOf(HasSubstr("'target_modules'"), HasSubstr("[\"q_proj\",3]")));
  EXPECT_THAT(message(R"({"rank_pattern": {"o_proj": 2.5}})", ErrorCode::kInvalidFile),
              AllOf(HasSubstr("'rank_pattern'"), HasSubstr("'o_proj'"), HasSubstr("2.5")));
  EXPECT_THAT(
      message(R"({"target_modules": ".*q_proj", "layers_to_transform": [1]})", ErrorCode::kInvalidFile),
      HasSubstr("'layers_to_transform' cannot be used when 'target_modules' is a regex"));
  EXPECT_THAT(message(R"({"r": 8, "lora_alpha": 16,)", ErrorCode::kInvalidFile),
              AllOf(HasSubstr(file), HasSubstr("malformed JSON")));
  EXPECT_THAT(message(R"([1, 2])", ErrorCode::kInvalidFile), HasSubstr("expected a JSON object"));
  // A number too large for a double (nlohmann's out_of_range 406, not a parse_error; the shape of
  // a fuzz finding in config.json) is malformed JSON too, not an escaping exception.
  EXPECT_THAT(message(R"({"r": 8, "lora_alpha": 3333333333333333333333333E366666666666660.0})",
                      ErrorCode::kInvalidFile),
              AllOf(HasSubstr(file), HasSubstr("malformed JSON"), HasSubstr("number overflow")));
  EXPECT_THAT(error_message([&] { parse_adapter_config(dir / "missing.json"); }, ErrorCode::kNotFound),
              HasSubstr("missing.json"));
}

// ---------------------------------------------------------------------------------------------
// Bad adapters: one clear error each

class PeftBadAdapter : public PeftSynthetic {
 protected:
  std::string load_error(const AdapterDir& d, ErrorCode code, const AdapterLoadOptions& options = {},
                         const std::string& prefix = "base_model.model.") {
    const fs::path dir = d.write(prefix);
    return error_message([&] { load_adapter(dir, base_, "bad", options); }, code);
  }
  std::string file_of(const AdapterDir& d) const { return (d.path() / "adapter_model.safetensors").string(); }
};

TEST_F(PeftBadAdapter, DoraInConfigAndInFile) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 64}), random({64, 4}));
  d.config()["use_dora"] = true;
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
              AllOf(HasSubstr("adapter_config.json"), HasSubstr("use_dora")));
  d.config()["use_dora"] = false;
  d.add("model.layers.0.self_attn.q_proj.lora_magnitude_vector", random({64}));
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
              AllOf(HasSubstr(file_of(d)), HasSubstr("model.layers.0.self_attn.q_proj.lora_magnitude_vector"),
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
  EXPECT_THAT(
      load_error(d, ErrorCode::kUnsupported),
      AllOf(HasSubstr("'base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias'"), HasSubstr("bias")));
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
                AllOf(HasSubstr(file_of(d)), HasSubstr("model.layers.0.mlp.gate.lora_A.weight"),
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
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
                AllOf(HasSubstr("model.layers.0.self_attn.q_proj.weight"), HasSubstr("not a LoRA factor")));
  }
}

TEST_F(PeftBadAdapter, WrongShape) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 48}), random({64, 4}));
  EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
              AllOf(HasSubstr(file_of(d)), HasSubstr("lora_A of 'model.layers.0.self_attn.q_proj'"),
                    HasSubstr("shape [4, 48], expected [4, 64]"), HasSubstr("in_features")));
  AdapterDir e;
  e.add_lora("model.layers.0.self_attn.k_proj", random({4, 64}), random({64, 4}));  // k_proj has 32 outputs
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
  EXPECT_THAT(load_error(g, ErrorCode::kInvalidFile), AllOf(HasSubstr("[1, 4, 64]"), HasSubstr("2-D")));
}

TEST_F(PeftBadAdapter, RankMismatchWithConfig) {
  AdapterDir d;
  d.config()["r"] = 8;
  add_per_expert(d, 0, 8, [](int64_t e, const std::string& proj) -> int64_t {
    return e == 7 && proj == "up_proj" ? 16 : 8;
  });
  EXPECT_THAT(
      load_error(d, ErrorCode::kInvalidFile),
      AllOf(HasSubstr(file_of(d)), HasSubstr("lora_A of 'model.layers.0.mlp.experts.7.up_proj' has rank 16"),
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
  const std::string deepseek =
      error_message([&] { load_adapter(parity_dir() / "deepseek_v3" / "lora_peft3d", base_, "deepseek"); },
                    ErrorCode::kUnsupported);
  EXPECT_THAT(
      deepseek,
      AllOf(HasSubstr("adapter was made for another architecture"), HasSubstr("qwen3_moe"),
            HasSubstr("'base_model.model.model.layers.0.self_attn.kv_a_proj_with_mqa.lora_A.weight'")));
  // a Qwen adapter on the DeepSeek config: its q/k/v names do not exist in MLA attention, and its
  // layer 0 is dense there
  const ModelConfig deepseek_base = load_model_config(parity_dir() / "deepseek_v3" / "base");
  EXPECT_THAT(
      error_message([&] { load_adapter(parity_dir() / "qwen3_moe" / "lora_per_expert", deepseek_base, "q"); },
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
    EXPECT_THAT(load_error(d, ErrorCode::kUnsupported),
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
  d.config()["target_parameters"] = json::array({"mlp.experts.down_proj", "mlp.experts.gate_up_proj"});
  d.add_lora("model.layers.2.mlp.experts.base_layer", random({64, 64}), random({64, 64}));  // R = 8
  d.add_lora("model.layers.2.mlp.experts", random({32, 32}), random({64, 32}));
  EXPECT_THAT(
      load_error(d, ErrorCode::kInvalidFile),
      AllOf(HasSubstr("lora_A of 'model.layers.2.mlp.experts.gate_up_proj' has rank 8 (64 rows / 8 experts)"),
            HasSubstr("says r=4")));
}

TEST_F(PeftBadAdapter, MissingLoraB) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 64}), random({64, 4}));
  d.remove("model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_THAT(
      load_error(d, ErrorCode::kInvalidFile),
      AllOf(HasSubstr(file_of(d)),
            HasSubstr("'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' "
                      "has no matching lora_B"),
            HasSubstr("'base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight' is missing")));
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
  EXPECT_THAT(error_message([&] { load_adapter(dir / "nope", base_, "none"); }, ErrorCode::kNotFound),
              HasSubstr("nope"));
}

TEST_F(PeftBadAdapter, MalformedConfigJson) {
  AdapterDir d;
  d.add_lora("model.layers.0.self_attn.q_proj", random({4, 64}), random({64, 4}));
  const fs::path dir = d.write();
  test::write_text_file(dir / "adapter_config.json", "{\"r\": 4, \"target_modules\": [\"q_proj\"");
  EXPECT_THAT(error_message([&] { load_adapter(dir, base_, "json"); }, ErrorCode::kInvalidFile),
              AllOf(HasSubstr((dir / "adapter_config.json").string()), HasSubstr("malformed JSON")));
}

}  // namespace
}  // namespace moelora::io
