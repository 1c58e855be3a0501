// What the PEFT adapter tests share (peft_test.cpp, peft_bad_adapter_test.cpp): dense deltas in
// double, element accessors of tensors, and synthetic adapters written to a temporary directory
// against the tiny Qwen3-MoE parity config.
#pragma once

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

namespace moelora::io::peft_test {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::error_message;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

inline fs::path parity_dir() {
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
inline Dense low_rank(int64_t out, int64_t rank, int64_t in, double s, const Accessor& b,
                      const Accessor& a) {
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

inline Dense vstack(const Dense& top, const Dense& bottom) {
  EXPECT_EQ(top.cols, bottom.cols);
  Dense d(top.rows + bottom.rows, top.cols);
  std::copy(top.v.begin(), top.v.end(), d.v.begin());
  std::copy(bottom.v.begin(), bottom.v.end(),
            d.v.begin() + static_cast<std::ptrdiff_t>(top.v.size()));
  return d;
}

// The delta of expert e as the canonical form describes it (core/lora.h).
inline Dense canonical_delta(const LoraWeights& w, int64_t e) {
  const int64_t rank = w.rank(), in = w.in_features(), out = w.out_features();
  const float* a = w.a.data<float>() + (w.a.dim(0) == 1 ? 0 : e) * rank * in;
  const float* b = w.b.data<float>() + (w.b.dim(0) == 1 ? 0 : e) * out * rank;
  return low_rank(
      out, rank, in, w.scaling, [&](int64_t o, int64_t k) { return b[o * rank + k]; },
      [&](int64_t k, int64_t i) { return a[k * in + i]; });
}

::testing::AssertionResult dense_close(const Dense& actual, const Dense& expected,
                                       const std::string& what) {
  if (actual.rows != expected.rows || actual.cols != expected.cols) {
    return ::testing::AssertionFailure()
           << what << ": shape [" << actual.rows << ", " << actual.cols << "] vs expected ["
           << expected.rows << ", " << expected.cols << "]";
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
  if (max_ref == 0)
    return ::testing::AssertionFailure() << what << ": the expected delta is all zeros";
  if (max_err <= 1e-6 * std::max(1.0, max_ref)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": max abs error " << max_err << " at (" << worst / expected.cols << ", "
         << worst % expected.cols << "): got " << actual.v[worst] << ", expected "
         << expected.v[worst] << " (max |expected| " << max_ref << ")";
}

inline Accessor element(const Tensor& t, int64_t row_stride, int64_t col_stride,
                        int64_t offset = 0) {
  return [t, row_stride, col_stride, offset](int64_t r, int64_t c) {
    return static_cast<double>(t.item_f32(offset + r * row_stride + c * col_stride));
  };
}

// ---------------------------------------------------------------------------------------------
// Synthetic adapters against the tiny Qwen3-MoE config (H 64, q 64, k/v 32, 8 experts, I 32,
// layer 1 dense with intermediate 96)

// adapter_config.json (r 4, alpha 8, `targets`) + adapter_model.safetensors in a temporary
// directory; also peft_linear_attention_test.cpp's, with the linear-attention targets.
class AdapterDir {
 public:
  explicit AdapterDir(json targets = json::array({"q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"})) {
    config_ = {
        {"peft_type", "LORA"}, {"r", 4}, {"lora_alpha", 8}, {"target_modules", std::move(targets)}};
  }
  json& config() { return config_; }
  const fs::path& path() const { return dir_.path(); }
  std::string file() const { return (dir_ / "adapter_model.safetensors").string(); }
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
  void add_per_expert(
      AdapterDir& d, int64_t layer, int64_t rank,
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
    return low_rank(b.dim(0), a.dim(0), a.dim(1), s, element(b, a.dim(0), 1),
                    element(a, a.dim(1), 1));
  }

  ModelConfig base_;
  std::mt19937_64 rng_;
};

}  // namespace moelora::io::peft_test
