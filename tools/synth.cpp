// `moelora synth`: real Hugging Face checkpoints with random weights, for tests, demos and
// benchmarks of models nobody wants to download.
//
// synth writes what transformers' save_pretrained writes (config.json with "architectures",
// model.safetensors or model-0000k-of-0000n.safetensors + index, per-expert keys), optionally
// FP8 block-quantized (weight + weight_scale_inv, quantization_config) or NVFP4 the way ModelOpt
// exports it (U8 codes + E4M3 block scales + F32 scale_2 / input_scale, hf_quant_config.json).
// Tensors are produced one at a time inside SafetensorsWriter's Fill callbacks, so a preset of
// hundreds of GB never sits in memory: the largest buffer is one tensor.
//
// Values come from the counter-based generator of synth_plan.cpp (element i of tensor T depends on
// (seed, T's name, i) only). That makes every value independent of the thread count and lets the
// FP8 / NVFP4 passes for a weight and for its scales (written at different points of the file,
// because safetensors orders tensors by dtype) regenerate exactly the same matrix instead of
// keeping it. The presets are in synth_presets.cpp, the list of tensors and their scales in
// synth_plan.cpp.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "cli.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/progress.h"
#include "core/threads.h"
#include "format.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "synth.h"

namespace moelora::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using io::ModelConfig;
using io::QuantMethod;
using namespace synth;

// NVFP4 input_scale = amax(activation) / (6 * 448). A synthetic model has no calibration data;
// 8 stands in for the amax of RMS-normalized hidden states.
constexpr float kSynthInputScale = 8.0f / (kE2M1Max * kE4M3Max);

// ============================================================================================
// quantizers

// FP8 block quantization of the [rows, cols] matrix `src` with the arithmetic of
// ops::quantize_fp8_block_ref: scale_inv = amax(block) / 448 (1 for an all-zero block),
// q = e4m3(w / scale_inv) saturating. Writes scale_inv [ceil(rows/128), ceil(cols/128)] and/or
// the codes [rows, cols] (either may be null).
void fp8_block_quantize(const Source& src, int64_t rows, int64_t cols, float* scale_inv,
                        uint8_t* codes) {
  const int64_t row_blocks = ceil_div(rows, kFp8Block), col_blocks = ceil_div(cols, kFp8Block);
  parallel_for(row_blocks, [&](int64_t rb_begin, int64_t rb_end) {
    std::vector<float> block_rows;
    for (int64_t rb = rb_begin; rb < rb_end; ++rb) {
      const int64_t n0 = rb * kFp8Block, n1 = std::min(rows, n0 + kFp8Block);
      block_rows.resize(static_cast<size_t>((n1 - n0) * cols));
      for (int64_t n = n0; n < n1; ++n) src.row(n, cols, block_rows.data() + (n - n0) * cols);
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t k0 = cb * kFp8Block, k1 = std::min(cols, k0 + kFp8Block);
        float amax = 0.0f;
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t k = k0; k < k1; ++k)
            amax = std::max(amax, std::fabs(block_rows[(n - n0) * cols + k]));
        const float s = amax > 0.0f ? amax / kE4M3Max : 1.0f;
        if (scale_inv) scale_inv[rb * col_blocks + cb] = s;
        if (!codes) continue;
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t k = k0; k < k1; ++k)
            codes[n * cols + k] =
                f32_to_e4m3(block_rows[(n - n0) * cols + k] / s, Fp8Overflow::kSaturate);
      }
    }
  });
}

float amax_of(const Source& src, int64_t numel) {
  std::mutex mutex;
  float amax = 0.0f;
  parallel_for(
      numel,
      [&](int64_t begin, int64_t end) {
        float local = 0.0f;
        for (int64_t i = begin; i < end; ++i)
          local = std::max(local, std::fabs(src.at(static_cast<uint64_t>(i))));
        std::lock_guard<std::mutex> lock(mutex);
        amax = std::max(amax, local);
      },
      1 << 15);
  return amax;
}

// NVFP4 with the arithmetic of ops::quantize_nvfp4_ref (ModelOpt's recipe), given the tensor's
// scale_2 = amax / (6 * 448): scale[n, g] = e4m3(amax16 / (6 * scale_2)),
// code = e2m1(w / (scale * scale_2)); a block whose scale rounds to 0 stores scale 0 and codes 0.
// Writes the scales [rows, cols/16] and/or the packed codes [rows, cols/2] (either may be null).
void nvfp4_quantize(const Source& src, int64_t rows, int64_t cols, float scale_2, uint8_t* scales,
                    uint8_t* packed) {
  const int64_t groups = cols / kNvfp4Group;
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t n = begin; n < end; ++n) {
      src.row(n, cols, row.data());
      for (int64_t g = 0; g < groups; ++g) {
        const float* v = row.data() + g * kNvfp4Group;
        float block_amax = 0.0f;
        for (int i = 0; i < kNvfp4Group; ++i) block_amax = std::max(block_amax, std::fabs(v[i]));
        const uint8_t code =
            scale_2 > 0.0f ? f32_to_e4m3(block_amax / (kE2M1Max * scale_2), Fp8Overflow::kSaturate)
                           : uint8_t{0};
        const float denominator = e4m3_to_f32(code) * scale_2;
        const bool zero_block = !(denominator > 0.0f) || !std::isfinite(denominator);
        if (scales) scales[n * groups + g] = zero_block ? 0 : code;
        if (!packed) continue;
        uint8_t* out = packed + n * (cols / 2) + g * (kNvfp4Group / 2);
        for (int i = 0; i < kNvfp4Group; i += 2) {
          out[i / 2] = zero_block
                           ? 0
                           : static_cast<uint8_t>(f32_to_e2m1(v[i] / denominator) |
                                                  (f32_to_e2m1(v[i + 1] / denominator) << 4));
        }
      }
    }
  });
}

// ============================================================================================
// --help

std::string wrap(const std::string& text, size_t indent, size_t width) {
  std::string out, line;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += std::string(indent, ' ') + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) out += std::string(indent, ' ') + line + "\n";
  return out;
}

std::string presets_help() {
  std::string text = "\nPresets (checkpoint size for --quant bf16 / fp8 / nvfp4, all layers):\n";
  for (const Preset& p : presets()) {
    ModelConfig c = p.make();
    std::string sizes;
    for (QuantMethod m : {QuantMethod::kNone, QuantMethod::kFp8Block, QuantMethod::kNvfp4}) {
      c.quant = make_quant(c, m);
      sizes += (sizes.empty() ? "" : " / ") + format_bytes(model_totals(c).bytes);
    }
    c.quant = {};
    text += "  " + std::string(p.name) + "   " + sizes + ", " +
            format_count(model_totals(c).parameters) + " parameters\n";
    text += wrap(p.description, 6, 96);
  }
  text +=
      "\nWeights are random (seeded; independent of the thread count): linears N(0, 1/in),\n"
      "embeddings N(0, 1), norms near 1 (Qwen3.5's (1+w) norms near 0), routers N(0, 9/H) so\n"
      "routing is decisive; Gated DeltaNet A_log = log U(1, 16), dt_bias and the conv small.\n"
      "--quant fp8 writes 128x128 block scales (weight_scale_inv) for every attention / MLP /\n"
      "expert linear and keeps lm_head, routers, norms, embeddings, e_score_correction_bias and\n"
      "shared_expert_gate in bf16 (Qwen3.5: also Gated DeltaNet's in_proj_a / in_proj_b, conv1d,\n"
      "A_log, dt_bias and norm, listed in modules_to_not_convert as its FP8 releases do).\n"
      "--quant nvfp4 writes ModelOpt tensors (weight, weight_scale, weight_scale_2, input_scale)\n"
      "with the same exclusions (Qwen3.5: routed experts only), and hf_quant_config.json.\n"
      "Checkpoints over --max-shard-size (4 GB) are sharded with model.safetensors.index.json.\n";
  return text;
}

// ============================================================================================
// moelora synth

struct SynthOptions {
  std::string preset;
  int64_t layers = 0;
  std::string quant = "bf16";
  uint64_t seed = 0;
  std::string out;
  std::string tokenizer;
  std::string max_shard_size = "4GB";
};

// "4GB", "500MB", "150KB", "1000" (bytes); decimal units like transformers' max_shard_size.
uint64_t parse_size(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string unit = text.substr(digits);
  uint64_t scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  if (unit == "KB" || unit == "kB") scale = 1'000;
  if (unit == "MB") scale = 1'000'000;
  if (unit == "GB") scale = 1'000'000'000;
  MOELORA_CHECK(digits > 0 && digits <= 12 && scale != 0, ErrorCode::kInvalidArgument,
                "--max-shard-size: '", text,
                "' is not a size such as 4GB, 500MB, 150KB or a byte count");
  const uint64_t value = std::stoull(text.substr(0, digits)) * scale;
  MOELORA_CHECK(value > 0, ErrorCode::kInvalidArgument, "--max-shard-size must be positive, got '",
                text, "'");
  return value;
}

// Adds every tensor of the model to `writer`, each produced by a Fill callback when written.
// `scale_2_cache` (per module) must outlive the write.
void add_tensors(const ModelConfig& c, uint64_t seed, io::SafetensorsWriter& writer,
                 std::map<std::string, float>& scale_2_cache, std::mutex& cache_mutex) {
  plan_model(c, [&](Planned t) {
    const Source src{stream_key(seed, t.tensor_name()), t.init};
    const Format format = format_of(t, c.quant);
    const int64_t rows = t.shape[0];
    const int64_t cols = t.shape.size() > 1 ? t.shape[1] : 1;
    const int64_t numel = shape_numel(t.shape);
    switch (format) {
      case Format::kDense: {
        const DType dtype = t.dtype;
        writer.add(t.tensor_name(), dtype, t.shape,
                   [src, dtype, numel](void* dst) { fill_float(dst, dtype, src, numel); });
        return;
      }
      case Format::kFp8: {
        writer.add(t.module + ".weight", DType::kF8E4M3, t.shape, [src, rows, cols](void* dst) {
          fp8_block_quantize(src, rows, cols, nullptr, static_cast<uint8_t*>(dst));
        });
        writer.add(t.module + ".weight_scale_inv", DType::kF32,
                   {ceil_div(rows, kFp8Block), ceil_div(cols, kFp8Block)},
                   [src, rows, cols](void* dst) {
                     fp8_block_quantize(src, rows, cols, static_cast<float*>(dst), nullptr);
                   });
        return;
      }
      case Format::kNvfp4: {
        const std::string module = t.module;
        // scale_2 = amax / (6 * 448), computed once per tensor whichever entry is written first
        auto scale_2 = [src, numel, module, &scale_2_cache, &cache_mutex]() {
          {
            std::lock_guard<std::mutex> lock(cache_mutex);
            auto it = scale_2_cache.find(module);
            if (it != scale_2_cache.end()) return it->second;
          }
          const float value = amax_of(src, numel) / (kE2M1Max * kE4M3Max);
          std::lock_guard<std::mutex> lock(cache_mutex);
          scale_2_cache[module] = value;
          return value;
        };
        writer.add(module + ".weight", DType::kU8, {rows, cols / 2}, [=](void* dst) {
          nvfp4_quantize(src, rows, cols, scale_2(), nullptr, static_cast<uint8_t*>(dst));
        });
        writer.add(
            module + ".weight_scale", DType::kF8E4M3, {rows, cols / kNvfp4Group}, [=](void* dst) {
              nvfp4_quantize(src, rows, cols, scale_2(), static_cast<uint8_t*>(dst), nullptr);
            });
        writer.add(module + ".weight_scale_2", DType::kF32, {}, [=](void* dst) {
          const float value = scale_2();
          std::memcpy(dst, &value, sizeof value);
        });
        writer.add(module + ".input_scale", DType::kF32, {}, [](void* dst) {
          const float value = kSynthInputScale;
          std::memcpy(dst, &value, sizeof value);
        });
        return;
      }
    }
  });
}

void copy_tokenizer(const fs::path& from, const fs::path& out) {
  std::error_code ec;
  MOELORA_CHECK(fs::is_regular_file(from / "tokenizer.json", ec), ErrorCode::kNotFound,
                "--tokenizer ", from.string(), ": no tokenizer.json there");
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                           "special_tokens_map.json"}) {
    if (!fs::is_regular_file(from / name, ec)) continue;
    fs::copy_file(from / name, out / name, fs::copy_options::overwrite_existing, ec);
    MOELORA_CHECK(!ec, ErrorCode::kInvalidArgument, "--tokenizer: cannot copy ",
                  (from / name).string(), " to ", out.string(), ": ", ec.message());
  }
}

int run_synth(const SynthOptions& o) {
  const Preset& preset = find_preset(o.preset);
  ModelConfig c = preset.make();
  MOELORA_CHECK(o.layers >= 0, ErrorCode::kInvalidArgument, "--layers must be >= 1, got ",
                o.layers);
  if (o.layers > 0) set_layers(c, o.layers);
  c.quant = make_quant(c, parse_quant(o.quant));
  c.validate("preset " + o.preset);
  const uint64_t max_shard_bytes = parse_size(o.max_shard_size);
  const fs::path out(o.out);
  prepare_output_dir(out);
  if (!o.tokenizer.empty()) copy_tokenizer(o.tokenizer, out);

  // config.json (+ hf_quant_config.json), checked by reading them back
  json config = io::model_config_to_json(c);
  config["initializer_range"] = 0.02;
  config["use_cache"] = true;
  config["moelora_synth"] = {{"preset", o.preset}, {"seed", o.seed}, {"quant", o.quant}};
  write_json_file(out / "config.json", config);
  std::error_code ec;
  fs::remove(out / "hf_quant_config.json", ec);
  if (c.quant.method == QuantMethod::kNvfp4)
    write_json_file(out / "hf_quant_config.json", io::hf_quant_config_to_json(c.quant));
  json generation = {{"_from_model_config", true},
                     {"eos_token_id", c.eos_token_ids.size() == 1 ? json(c.eos_token_ids[0])
                                                                  : json(c.eos_token_ids)}};
  if (c.bos_token_id) generation["bos_token_id"] = *c.bos_token_id;
  write_json_file(out / "generation_config.json", generation);
  const ModelConfig reread = io::load_model_config(out);
  MOELORA_CHECK(
      reread == c, ErrorCode::kInternal, "synth: ", (out / "config.json").string(),
      " does not read back as the preset's configuration (a config writer/parser mismatch)");

  // weights
  io::SafetensorsWriter writer;
  std::map<std::string, float> scale_2_cache;
  std::mutex cache_mutex;
  add_tensors(c, o.seed, writer, scale_2_cache, cache_mutex);
  const uint64_t total = writer.data_bytes();
  constexpr uint64_t kMiB = 1ull << 20;
  ProgressBar progress("synth " + o.preset, (total + kMiB - 1) / kMiB, "MiB");
  uint64_t written = 0;
  writer.write_sharded(out, max_shard_bytes, "model", [&](uint64_t bytes) {
    written += bytes;
    progress.set(written / kMiB);
  });
  progress.set((total + kMiB - 1) / kMiB);
  progress.finish();

  const ModelTotals totals = model_totals(c);
  std::printf("wrote %s: %s, %s, %llu layers, %s parameters, %s in %llu tensors%s%s\n",
              out.string().c_str(), o.preset.c_str(), o.quant.c_str(),
              static_cast<unsigned long long>(c.num_hidden_layers),
              format_count(totals.parameters).c_str(), format_bytes(total).c_str(),
              static_cast<unsigned long long>(writer.size()),
              total > max_shard_bytes ? " (sharded)" : "",
              o.tokenizer.empty() ? ", no tokenizer" : ", tokenizer copied");
  return 0;
}

std::function<int()> setup_synth(CLI::App& app) {
  auto o = std::make_shared<SynthOptions>();
  app.add_option("--preset", o->preset, "Model preset (see below)")->required();
  app.add_option("--layers", o->layers, "Write only the first N decoder layers (default: all)");
  app.add_option("--quant", o->quant,
                 "Weight format: bf16 (default), fp8 (128x128 blocks) or nvfp4 (ModelOpt)");
  app.add_option("--seed", o->seed, "Random seed (default 0)");
  app.add_option("--out", o->out, "Output directory (created; existing model files are replaced)")
      ->required();
  app.add_option(
      "--tokenizer", o->tokenizer,
      "Copy tokenizer.json, tokenizer_config.json and chat_template.jinja from this directory "
      "(default: write no tokenizer)");
  app.add_option(
      "--max-shard-size", o->max_shard_size,
      "Largest shard (tensor bytes, decimal units: 4GB default, 500MB, 150KB); a larger checkpoint "
      "is written as model-0000k-of-0000n.safetensors + model.safetensors.index.json");
  app.footer([] { return presets_help(); });
  return [o] { return run_synth(*o); };
}

MOELORA_SUBCOMMAND(
    "synth", "Write a Hugging Face checkpoint with random weights from a preset (bf16, FP8, NVFP4)",
    60, setup_synth);

}  // namespace
}  // namespace moelora::cli
