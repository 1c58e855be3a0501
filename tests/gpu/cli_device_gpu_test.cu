// `moelora generate --device cuda` and `moelora logits --device cuda` against --device cpu, run as
// a user runs them (the built moelora binary; build the `moelora` target first), on a small
// model written by `moelora synth` (tiny-qwen3-moe) with a `moelora synth-adapter` adapter:
//   - generate: the same greedy tokens on both devices (--json and the plain token-id output),
//     up to the first step where bf16 may legitimately pick another token: that step must be a
//     near-tie of the CPU reference (its top-1 minus top-2 logit margin below 2 % of the logit
//     range, the GPU's token within that of the best; the rule of tests/gpu/engine_gpu_test.cu);
//   - logits: the same safetensors layout (`logits` [tokens, vocab], `logits.i` for a mixed
//     adapter batch), every position within the whole-model bf16 bound of the GPU parity tests
//     (tests/gpu/model_gpu_test.cu: cosine >= 0.998, max |diff| <= 3 % of the logit range).
//   - the same model with NVFP4 experts (`synth --quant nvfp4`): packed on the GPU, dequantized on
//     the CPU, logits within the same bound.
// The synthesized config routes every token to all of its experts (num_experts_per_tok =
// num_experts, as in engine_gpu_test's FlashInfer test), so bf16 differences cannot flip an expert
// choice and move the two runs apart beyond the bf16 bound.
// Skips without a CUDA device (sm_90 required by the kernels).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "io/safetensors.h"
#include "model/sampler.h"
#include "support/test_support.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;

constexpr int kNewTokens = 16;
constexpr double kNearTieFraction = 0.02;  // engine_gpu_test.cu / model_gpu_test.cu
constexpr double kMinLogitCosine = 0.998;  // model_gpu_test.cu's whole-model bf16 bound
constexpr double kMaxDiffFraction = 0.03;  // of the logit range (max - min) at that position

// Shell-quoted path (appended piecewise: GCC 12's -Wrestrict misfires on "'" + string + "'").
std::string quote(const fs::path& p) {
  std::string q = "'";
  q += p.string();
  q += '\'';
  return q;
}

// Runs `moelora args`; stdout only (stderr, progress and timing, dropped).
std::string moelora_stdout(const std::string& args) {
  const fs::path binary = test::binary_dir() / "moelora";
  EXPECT_TRUE(fs::exists(binary)) << binary << " is missing: build the moelora target";
  const test::CommandResult r = test::run_command("{ MOELORA_NO_PROGRESS=1 " + quote(binary) + " " +
                                                  args + " 2>/dev/null; }");
  EXPECT_EQ(r.exit_code, 0) << "moelora " << args << "\n" << r.output;
  return r.output;
}

class CliDeviceGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    MOELORA_REQUIRE_SM90();
    model_ = tmp_ / "model";
    adapter_ = tmp_ / "adapter";
    moelora_stdout("synth --preset tiny-qwen3-moe --seed 7 --out " + quote(model_));
    ASSERT_TRUE(fs::exists(model_ / "config.json")) << "moelora synth failed";
    // Every token through all experts: no routing flips (see the top of the file).
    nlohmann::json config = nlohmann::json::parse(std::ifstream(model_ / "config.json"));
    config["num_experts_per_tok"] = config["num_experts"];
    std::ofstream(model_ / "config.json") << config.dump(2);
    moelora_stdout("synth-adapter --model " + quote(model_) +
                   " --targets all --rank 8 --seed 3 --out " + quote(adapter_));
  }

  std::string model_args() const {
    return "--model " + quote(model_) + " --adapter a=" + quote(adapter_);
  }

  test::TempDir tmp_;
  fs::path model_, adapter_;
};

std::vector<int32_t> json_tokens(const std::string& out) {
  return nlohmann::json::parse(out)["tokens"].get<std::vector<int32_t>>();
}

std::string ids_list(const std::vector<int32_t>& ids, const char* sep) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : sep) + std::to_string(id);
  return s;
}

std::vector<float> row(const Tensor& logits, int64_t r) {
  const float* p = logits.data<float>() + r * logits.dim(1);
  return std::vector<float>(p, p + logits.dim(1));
}

// Every position of `gpu` within the bf16 bound of `cpu` (same shape).
void expect_logits_close(const Tensor& gpu, const Tensor& cpu, const std::string& label) {
  ASSERT_EQ(gpu.shape(), cpu.shape()) << label;
  double worst_cosine = 1, worst_fraction = 0;
  for (int64_t r = 0; r < cpu.dim(0); ++r) {
    const std::vector<float> g = row(gpu, r), c = row(cpu, r);
    double dot = 0, ng = 0, nc = 0, max_diff = 0;
    float lo = c[0], hi = c[0];
    bool finite = true;
    for (size_t v = 0; v < c.size(); ++v) {
      finite = finite && std::isfinite(g[v]);
      dot += static_cast<double>(g[v]) * c[v];
      ng += static_cast<double>(g[v]) * g[v];
      nc += static_cast<double>(c[v]) * c[v];
      max_diff = std::max(max_diff, std::abs(static_cast<double>(g[v]) - c[v]));
      lo = std::min(lo, c[v]);
      hi = std::max(hi, c[v]);
    }
    ASSERT_TRUE(finite) << label << " position " << r << ": non-finite GPU logits";
    const double cosine = dot / std::sqrt(ng * nc + 1e-30);
    const double range = static_cast<double>(hi) - lo;
    worst_cosine = std::min(worst_cosine, cosine);
    worst_fraction = std::max(worst_fraction, max_diff / range);
    EXPECT_GE(cosine, kMinLogitCosine) << label << " position " << r;
    EXPECT_LE(max_diff, kMaxDiffFraction * range)
        << label << " position " << r << " (cosine " << cosine << ")";
  }
  std::printf(
      "[cli-device-gpu] %-28s %lld positions: worst cosine %.6f, max diff %.2f%% of range\n",
      label.c_str(), static_cast<long long>(cpu.dim(0)), worst_cosine, 100 * worst_fraction);
}

TEST_F(CliDeviceGpu, GenerateGreedyMatchesCpu) {
  const std::vector<int32_t> prompt = {5, 17, 300, 42, 9, 128, 77, 2, 411, 63, 1, 250};
  for (const std::string use : {"", "a"}) {
    const std::string label = use.empty() ? "base model" : "adapter a";
    const std::string args = "generate " + model_args() + (use.empty() ? "" : " --use " + use) +
                             " --tokens " + ids_list(prompt, ",") + " --max-new-tokens " +
                             std::to_string(kNewTokens) + " --ignore-eos";
    const std::string cpu_out = moelora_stdout(args + " --json --device cpu");
    const std::string gpu_out = moelora_stdout(args + " --json --device cuda");
    const nlohmann::json gpu_json = nlohmann::json::parse(gpu_out);
    EXPECT_EQ(gpu_json["device"], "cuda");
    EXPECT_EQ(gpu_json["prompt_tokens"], prompt.size());
    EXPECT_EQ(gpu_json["stopped"], false);
    EXPECT_TRUE(gpu_json["text"].is_null());  // synth writes no tokenizer
    EXPECT_EQ(gpu_json["adapter"], use.empty() ? nlohmann::json(nullptr) : nlohmann::json(use));
    const std::vector<int32_t> cpu = json_tokens(cpu_out), gpu = json_tokens(gpu_out);
    ASSERT_EQ(cpu.size(), static_cast<size_t>(kNewTokens)) << cpu_out;
    ASSERT_EQ(gpu.size(), static_cast<size_t>(kNewTokens)) << gpu_out;

    // The plain output is the same token ids the JSON has.
    EXPECT_EQ(moelora_stdout(args + " --device cuda"), ids_list(gpu, " ") + "\n");

    size_t leading = 0;
    while (leading < cpu.size() && cpu[leading] == gpu[leading]) ++leading;
    std::printf("[cli-device-gpu] %-12s %zu of %d greedy tokens equal\n", label.c_str(), leading,
                kNewTokens);
    if (leading == cpu.size()) continue;
    // Both runs saw prompt + cpu[0, leading): the CPU reference's logits there decide whether
    // the GPU's other token is a legitimate near-tie.
    std::vector<int32_t> fed = prompt;
    fed.insert(fed.end(), cpu.begin(), cpu.begin() + static_cast<std::ptrdiff_t>(leading));
    const fs::path file = tmp_ / "near_tie.safetensors";
    moelora_stdout("logits " + model_args() + (use.empty() ? "" : " --use " + use) +
                   " --device cpu --tokens " + ids_list(fed, ",") + " --out " + quote(file));
    const Tensor ref = io::SafetensorsFile::open(file).tensor("logits").clone();
    const std::vector<float> last = row(ref, ref.dim(0) - 1);
    const int32_t best = model::argmax(std::span<const float>(last));
    EXPECT_EQ(best, cpu[leading]) << label;
    const auto [lo, hi] = std::minmax_element(last.begin(), last.end());
    const double tolerance = kNearTieFraction * (static_cast<double>(*hi) - *lo);
    const int32_t other = gpu[leading];
    ASSERT_TRUE(other >= 0 && other < static_cast<int32_t>(last.size())) << other;
    EXPECT_LT(static_cast<double>(last[best]) - last[other], tolerance)
        << label << ": GPU token " << other << " at step " << leading << " is "
        << last[best] - last[other] << " below the CPU's best " << best << " (near-tie tolerance "
        << tolerance << ")";
  }
}

TEST_F(CliDeviceGpu, LogitsMatchCpuWithinBf16) {
  // One sequence through the adapter.
  const std::string tokens = " --use a --tokens 3,14,15,92,65,35,89,79,323,84,62,64,33,83,27,95";
  moelora_stdout("logits " + model_args() + tokens + " --device cpu --out " +
                 quote(tmp_ / "cpu.safetensors"));
  const std::string printed =
      moelora_stdout("logits " + model_args() + tokens + " --device cuda --out " +
                     quote(tmp_ / "gpu.safetensors"));
  EXPECT_NE(printed.find("logits: [16, 512] adapter a"), std::string::npos) << printed;
  const io::SafetensorsFile cpu = io::SafetensorsFile::open(tmp_ / "cpu.safetensors");
  const io::SafetensorsFile gpu = io::SafetensorsFile::open(tmp_ / "gpu.safetensors");
  ASSERT_EQ(gpu.tensors().size(), 1u);
  EXPECT_EQ(gpu.metadata().at("device"), "cuda");
  const Tensor g = gpu.tensor("logits").clone();
  EXPECT_EQ(g.dtype(), DType::kF32);
  expect_logits_close(g, cpu.tensor("logits").clone(), "logits (adapter a)");

  // A mixed batch: adapter, base-only and the adapter again on other lengths, one batch per
  // position on the GPU.
  test::write_text_file(tmp_ / "batch.json",
                        R"([{"tokens": [5, 6, 7, 8, 9, 10, 11], "adapter": "a"},
                            {"tokens": [9, 10], "adapter": null},
                            {"tokens": [11, 12, 13, 200], "adapter": "a"},
                            {"tokens": [5, 6, 7, 8, 9, 10, 11]}])");
  const std::string batch = " --batch " + quote(tmp_ / "batch.json");
  moelora_stdout("logits " + model_args() + batch + " --device cpu --out " +
                 quote(tmp_ / "cpu_b.safetensors"));
  moelora_stdout("logits " + model_args() + batch + " --device cuda --out " +
                 quote(tmp_ / "gpu_b.safetensors"));
  const io::SafetensorsFile cpu_b = io::SafetensorsFile::open(tmp_ / "cpu_b.safetensors");
  const io::SafetensorsFile gpu_b = io::SafetensorsFile::open(tmp_ / "gpu_b.safetensors");
  ASSERT_EQ(gpu_b.tensors().size(), 4u);
  for (int i = 0; i < 4; ++i) {
    const std::string name = "logits." + std::to_string(i);
    expect_logits_close(gpu_b.tensor(name).clone(), cpu_b.tensor(name).clone(), name);
  }
  // The adapter moves the GPU's logits too (entry 0 and entry 3 are the same tokens).
  EXPECT_GT(test::max_abs_diff(gpu_b.tensor("logits.0").clone(), gpu_b.tensor("logits.3").clone()),
            0.05);
}

// The same model written with NVFP4 experts (ModelOpt tensors; H 256 and I 128 are multiples of
// 128, so the GPU keeps the experts packed and runs the NVFP4 stream GEMM, while the CPU
// dequantizes them): the logits of both devices within the same bf16 bound, with and without the
// adapter.
TEST_F(CliDeviceGpu, Nvfp4ExpertsLogitsMatchCpu) {
  const fs::path model = tmp_ / "nvfp4", adapter = tmp_ / "nvfp4_adapter";
  moelora_stdout("synth --preset tiny-qwen3-moe --quant nvfp4 --seed 9 --out " + quote(model));
  ASSERT_TRUE(fs::exists(model / "config.json")) << "moelora synth --quant nvfp4 failed";
  nlohmann::json config = nlohmann::json::parse(std::ifstream(model / "config.json"));
  config["num_experts_per_tok"] = config["num_experts"];
  std::ofstream(model / "config.json") << config.dump(2);
  moelora_stdout("synth-adapter --model " + quote(model) + " --targets all --rank 8 --seed 4 --out " +
                 quote(adapter));
  const std::string args = "logits --model " + quote(model) + " --adapter a=" + quote(adapter) +
                           " --tokens 3,14,15,92,65,35,89,79,323,84,62,64";
  for (const std::string use : {"", " --use a"}) {
    moelora_stdout(args + use + " --device cpu --out " + quote(tmp_ / "nv_cpu.safetensors"));
    moelora_stdout(args + use + " --device cuda --out " + quote(tmp_ / "nv_gpu.safetensors"));
    const io::SafetensorsFile cpu = io::SafetensorsFile::open(tmp_ / "nv_cpu.safetensors");
    const io::SafetensorsFile gpu = io::SafetensorsFile::open(tmp_ / "nv_gpu.safetensors");
    expect_logits_close(gpu.tensor("logits").clone(), cpu.tensor("logits").clone(),
                        use.empty() ? "NVFP4 experts, base" : "NVFP4 experts, adapter a");
  }
}

}  // namespace
}  // namespace moelora
