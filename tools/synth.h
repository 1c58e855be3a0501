// `moelora synth` / `moelora synth-adapter`: what other subcommands use (preset_config) and what
// the synth sources share among themselves (namespace synth).
//
//   synth_presets.cpp  the preset table: model configurations, --layers, quantization configs
//   synth_plan.cpp     counter-based random numbers and the list of tensors a model has
//   synth.cpp          `moelora synth`: quantizers, the checkpoint writer, --help
//   synth_adapter.cpp  `moelora synth-adapter`: PEFT adapters for a model directory
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/tensor.h"
#include "io/hf_config.h"

namespace moelora::cli {

// The configuration `moelora synth --preset preset --layers layers --quant quant` writes to
// config.json (layers 0 = the preset's own count; quant bf16, fp8 or nvfp4), without writing any
// weights (e.g. `moelora bench --preset NAME --random-weights`, where the GPU draws the weights
// itself). kInvalidArgument naming the option for an unknown preset or quantization.
io::ModelConfig preset_config(const std::string& preset, int64_t layers, const std::string& quant);

namespace synth {

// ---- presets (synth_presets.cpp) ----

struct Preset {
  const char* name;
  const char* description;
  io::ModelConfig (*make)();
};

const std::vector<Preset>& presets();
std::string preset_names();  // "tiny-qwen3-moe, tiny-deepseek-v3, ..."
// kInvalidArgument naming --preset and the known presets.
const Preset& find_preset(const std::string& name);
// The preset with `layers` decoder layers (--layers): the first ones of the preset, with
// layer_types, mlp_only_layers and first_k_dense_replace cut to match; more layers than the
// preset has continue its layer_types pattern (Qwen3.5: a full-attention layer every 4th).
void set_layers(io::ModelConfig& c, int64_t layers);
// "bf16" / "fp8" / "nvfp4"; kInvalidArgument naming --quant otherwise.
io::QuantMethod parse_quant(const std::string& name);
// The quantization config synth writes for `method`, with the modules it leaves unquantized
// (see the definition for the lists and where they come from).
io::QuantConfig make_quant(const io::ModelConfig& c, io::QuantMethod method);

// ---- random numbers (synth_plan.cpp) ----
//
// Counter-based: element i of tensor T is a function of (seed, T's name, i) only, so values do not
// depend on the thread count and a weight can be regenerated for its scales instead of kept.

uint64_t stream_key(uint64_t seed, const std::string& name);

struct Distribution {
  enum class Kind { kNormal, kUniform, kLogUniform } kind = Kind::kNormal;
  float a = 0.0f;  // normal: mean; uniform / log-uniform: low
  float b = 1.0f;  // normal: std; uniform / log-uniform: high

  static Distribution normal(float mean, float stddev) { return {Kind::kNormal, mean, stddev}; }
  static Distribution uniform(float low, float high) { return {Kind::kUniform, low, high}; }
  // log(u), u ~ U(low, high): Gated DeltaNet's A_log (transformers draws A ~ U(., 16), stores log
  // A)
  static Distribution log_uniform(float low, float high) { return {Kind::kLogUniform, low, high}; }

  // Element i of the stream `key`. Normal: the sum of four 16-bit uniforms (Irwin-Hall, within
  // a few percent of a Gaussian and bounded at +-3.5 std, which real weights are too), one hash
  // per element.
  float sample(uint64_t key, uint64_t i) const;
};

// The values of one planned tensor.
struct Source {
  uint64_t key;
  Distribution init;
  float at(uint64_t i) const { return init.sample(key, i); }
  void row(int64_t row_index, int64_t cols, float* out) const {
    const uint64_t base = static_cast<uint64_t>(row_index) * static_cast<uint64_t>(cols);
    for (int64_t k = 0; k < cols; ++k) out[k] = at(base + static_cast<uint64_t>(k));
  }
};

// numel values of `src` as BF16 or F32 into dst, split over the thread pool.
void fill_float(void* dst, DType dtype, const Source& src, int64_t numel);

int64_t ceil_div(int64_t a, int64_t b);

// ---- the tensors of a model (synth_plan.cpp) ----

constexpr int kFp8Block = 128;
constexpr int kNvfp4Group = 16;

struct Planned {
  // linear: module name (the tensor is module + ".weight"); else the tensor name
  std::string module;
  Shape shape;  // linear: [out, in]
  bool linear = false;
  DType dtype = DType::kBF16;  // plain tensors (F32 for the DeepSeek correction bias)
  Distribution init;
  std::string tensor_name() const { return linear ? module + ".weight" : module; }
};

enum class Format { kDense, kFp8, kNvfp4 };

// Every tensor of the model in the order transformers saves them (the order shards are filled).
void plan_model(const io::ModelConfig& c, const std::function<void(Planned)>& add);
// How a planned tensor is stored under `quant`.
Format format_of(const Planned& t, const io::QuantConfig& quant);
uint64_t planned_bytes(const Planned& t, Format format);

struct ModelTotals {
  uint64_t bytes = 0, parameters = 0, tensors = 0;
};
ModelTotals model_totals(const io::ModelConfig& c);  // under c.quant

// ---- files (synth_plan.cpp) ----

void write_json_file(const std::filesystem::path& path, const nlohmann::json& value);
// Creates --out (kInvalidArgument when it exists and is not a directory or cannot be created).
void prepare_output_dir(const std::filesystem::path& out);

}  // namespace synth
}  // namespace moelora::cli
