// `moelora synth` and `moelora synth-adapter`: real Hugging Face checkpoints and PEFT adapters
// with random weights, for tests, demos and benchmarks of models nobody wants to download.
//
// synth writes what transformers' save_pretrained writes (config.json with "architectures",
// model.safetensors or model-0000k-of-0000n.safetensors + index, per-expert keys), optionally
// FP8 block-quantized (weight + weight_scale_inv, quantization_config) or NVFP4 the way ModelOpt
// exports it (U8 codes + E4M3 block scales + F32 scale_2 / input_scale, hf_quant_config.json).
// Tensors are produced one at a time inside SafetensorsWriter's Fill callbacks, so a preset of
// hundreds of GB never sits in memory: the largest buffer is one tensor.
//
// Random values come from a counter-based generator: element i of tensor T is a function of
// (seed, T's name, i) only. That makes every value independent of the thread count and lets the
// FP8 / NVFP4 passes for a weight and for its scales (written at different points of the file,
// because safetensors orders tensors by dtype) regenerate exactly the same matrix instead of
// keeping it. The scale of every tensor follows a real initialization: linears ~ N(0, 1/in),
// embeddings ~ N(0, 1), norms near 1 (near 0 for Qwen3.5's (1+w) norms), routers sharper
// (N(0, 9/H): logits of std ~3, so routing is decided, not a near-tie of uniform scores).
//
// synth-adapter writes adapter_config.json + adapter_model.safetensors exactly as PEFT lays them
// out (FORMATS.md §3, tests/data/README.md §7): per-expert 2-D keys, PEFT's target_parameters 3-D
// layout, or the shared-outer 3-D layout SGLang serves, plus plain 2-D LoRA on attention, dense
// MLP and shared-expert modules. B is random (not PEFT's zero init), so the adapter changes the
// model's outputs.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

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
using io::Architecture;
using io::ModelConfig;
using io::QuantConfig;
using io::QuantMethod;

constexpr int kFp8Block = 128;
constexpr int kNvfp4Group = 16;
// NVFP4 input_scale = amax(activation) / (6 * 448). A synthetic model has no calibration data;
// 8 stands in for the amax of RMS-normalized hidden states.
constexpr float kSynthInputScale = 8.0f / (kE2M1Max * kE4M3Max);

// ============================================================================================
// counter-based random numbers

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t stream_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name, then mixed with the seed
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return mix64(h ^ mix64(seed + 0x9e3779b97f4a7c15ull));
}

struct Distribution {
  enum class Kind { kNormal, kUniform } kind = Kind::kNormal;
  float a = 0.0f;  // normal: mean; uniform: low
  float b = 1.0f;  // normal: std; uniform: high

  static Distribution normal(float mean, float stddev) { return {Kind::kNormal, mean, stddev}; }
  static Distribution uniform(float low, float high) { return {Kind::kUniform, low, high}; }

  // Element i of the stream `key`. Normal: the sum of four 16-bit uniforms (Irwin-Hall, within
  // a few percent of a Gaussian and bounded at +-3.5 std, which real weights are too), one hash
  // per element.
  float sample(uint64_t key, uint64_t i) const {
    const uint64_t h = mix64(key + i * 0x9e3779b97f4a7c15ull);
    if (kind == Kind::kUniform)
      return a + (b - a) * static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    const float sum =
        static_cast<float>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
    constexpr float kMean = 4 * 32767.5f;
    constexpr float kInvStd = 1.0f / 37837.23f;  // sqrt(4 * (65536^2 - 1) / 12)
    return a + b * (sum - kMean) * kInvStd;
  }
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

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

void fill_float(void* dst, DType dtype, const Source& src, int64_t numel) {
  parallel_for(
      numel,
      [&](int64_t begin, int64_t end) {
        if (dtype == DType::kBF16) {
          auto* out = static_cast<uint16_t*>(dst);
          for (int64_t i = begin; i < end; ++i)
            out[i] = f32_to_bf16_bits(src.at(static_cast<uint64_t>(i)));
        } else {
          auto* out = static_cast<float*>(dst);
          for (int64_t i = begin; i < end; ++i) out[i] = src.at(static_cast<uint64_t>(i));
        }
      },
      1 << 15);
}

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

void write_json_file(const fs::path& path, const json& value) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MOELORA_CHECK(out.good(), ErrorCode::kInvalidArgument, path.string(), ": cannot write");
  out << value.dump(2) << "\n";
  out.close();
  MOELORA_CHECK(out.good(), ErrorCode::kInvalidArgument, path.string(), ": write failed");
}

void prepare_output_dir(const fs::path& out) {
  std::error_code ec;
  MOELORA_CHECK(!fs::exists(out, ec) || fs::is_directory(out, ec), ErrorCode::kInvalidArgument,
                "--out ", out.string(), " exists and is not a directory");
  fs::create_directories(out, ec);
  MOELORA_CHECK(fs::is_directory(out, ec), ErrorCode::kInvalidArgument, "--out ", out.string(),
                ": cannot create the directory", ec ? ": " + ec.message() : std::string());
}

// ============================================================================================
// presets

ModelConfig qwen3_moe_base() {
  ModelConfig c;
  c.arch = Architecture::kQwen3Moe;
  c.model_type = c.text_model_type = "qwen3_moe";
  c.dtype = "bfloat16";
  c.qk_norm = true;
  c.norm_topk_prob = true;
  c.router = RouterKind::kSoftmaxTopK;
  c.rope.type = "default";
  c.rope.theta = 1e6;
  c.rms_norm_eps = 1e-6;
  return c;
}

ModelConfig preset_tiny_qwen3_moe() {
  ModelConfig c = qwen3_moe_base();
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.intermediate_size = 384;
  c.moe_intermediate_size = 128;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.mlp_only_layers = {1};
  c.bos_token_id = 0;
  c.eos_token_ids = {2};
  return c;
}

ModelConfig preset_small_qwen3_moe() {
  ModelConfig c = qwen3_moe_base();
  // 512 ids: the 500-token tokenizer of tests/data/tokenizer (what the demo passes with
  // --tokenizer) covers almost all of them, so generated text decodes.
  c.vocab_size = 512;
  c.hidden_size = 512;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.moe_intermediate_size = 256;
  c.num_experts = 32;
  c.num_experts_per_tok = 4;
  c.bos_token_id = 0;
  c.eos_token_ids = {2};
  return c;
}

ModelConfig preset_qwen3_30b_a3b() {
  ModelConfig c = qwen3_moe_base();
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.num_hidden_layers = 48;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.max_position_embeddings = 40960;
  c.intermediate_size = 6144;  // only used by mlp_only_layers, which this model has none of
  c.moe_intermediate_size = 768;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.bos_token_id = 151643;
  c.eos_token_ids = {151645};
  return c;
}

ModelConfig preset_qwen35_35b_a3b() {
  ModelConfig c;
  c.arch = Architecture::kQwen35Moe;
  c.model_type = c.text_model_type = "qwen3_5_moe_text";
  c.dtype = "bfloat16";
  c.vocab_size = 248320;
  c.hidden_size = 2048;
  c.num_hidden_layers = 40;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 2;
  c.head_dim = 256;
  c.qk_norm = true;
  c.attention_output_gate = true;
  c.norm_style = NormStyle::kOnePlusWeight;
  c.max_position_embeddings = 262144;
  c.rms_norm_eps = 1e-6;
  c.rope.type = "default";
  c.rope.theta = 1e7;
  c.rope.partial_rotary_factor = 0.25;
  c.rope.mrope_section = {11, 11, 10};
  c.moe_intermediate_size = 512;
  c.shared_expert_intermediate_size = 512;
  c.shared_expert_gate = true;
  c.num_experts = 256;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.router = RouterKind::kSoftmaxTopK;
  // The real model interleaves 3 Gated DeltaNet layers with 1 gated full-attention layer; the
  // engine does not build Gated DeltaNet yet, so every layer is full attention (see --help).
  c.layer_types.assign(40, "full_attention");
  c.linear_attention = {4, 128, 128, 16, 32};
  c.eos_token_ids = {248044};
  return c;
}

ModelConfig deepseek_base() {
  ModelConfig c;
  c.arch = Architecture::kDeepseekV3;
  c.model_type = c.text_model_type = "deepseek_v3";
  c.dtype = "bfloat16";
  c.use_mla = true;
  c.rope_style = RopeStyle::kInterleaved;
  c.router = RouterKind::kSigmoidNoauxTc;
  c.norm_topk_prob = true;
  c.rope.type = "yarn";
  c.rope.beta_fast = 32;
  c.rope.beta_slow = 1;
  c.rope.mscale = 1.0;
  c.rope.mscale_all_dim = 1.0;
  return c;
}

ModelConfig preset_tiny_deepseek_v3() {
  ModelConfig c = deepseek_base();
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.q_lora_rank = 128;
  c.kv_lora_rank = 128;
  c.qk_nope_head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.head_dim = 16;
  c.v_head_dim = 32;
  c.max_position_embeddings = 512;
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 10000;
  c.rope.factor = 4;
  c.rope.original_max_position_embeddings = 128;
  c.intermediate_size = 384;
  c.moe_intermediate_size = 128;
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  c.first_k_dense_replace = 1;
  c.shared_expert_intermediate_size = 128;  // n_shared_experts 1
  c.bos_token_id = 0;
  c.eos_token_ids = {2};
  return c;
}

ModelConfig preset_kimi_k25() {
  ModelConfig c = deepseek_base();
  c.vocab_size = 163840;
  c.hidden_size = 7168;
  c.num_hidden_layers = 61;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 64;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.head_dim = 64;
  c.v_head_dim = 128;
  c.max_position_embeddings = 262144;
  c.rms_norm_eps = 1e-5;
  c.rope.theta = 50000;
  c.rope.factor = 64;
  c.rope.original_max_position_embeddings = 4096;
  c.intermediate_size = 18432;
  c.moe_intermediate_size = 2048;
  c.num_experts = 384;
  c.num_experts_per_tok = 8;
  c.n_group = 1;
  c.topk_group = 1;
  c.routed_scaling_factor = 2.827;
  c.first_k_dense_replace = 1;
  c.shared_expert_intermediate_size = 2048;  // n_shared_experts 1
  c.bos_token_id = 163584;
  c.eos_token_ids = {163585};
  return c;
}

struct Preset {
  const char* name;
  const char* description;
  ModelConfig (*make)();
};

const std::vector<Preset>& presets() {
  static const std::vector<Preset> list = {
      {"tiny-qwen3-moe",
       "Qwen3-MoE for tests: 3 layers (layer 1 a dense MLP), hidden 256, 8 experts top-2, "
       "expert I 128, 4 query / 2 KV heads of 64, vocab 512; H and I are multiples of 128 so "
       "every quantization applies.",
       preset_tiny_qwen3_moe},
      {"tiny-deepseek-v3",
       "DeepSeek-V3 for tests: MLA (q_lora_rank 128, kv_lora_rank 128, nope 32 / rope 16 / v "
       "32, 4 heads), 3 layers with first_k_dense_replace 1, 16 experts top-4 + 1 shared, "
       "noaux_tc routing with 4 groups (top 2), YaRN factor 4, vocab 512. kv_a_proj_with_mqa "
       "has 144 rows: a partial FP8 block.",
       preset_tiny_deepseek_v3},
      {"small-qwen3-moe",
       "Qwen3-MoE for the CPU demo: 8 layers, hidden 512, 32 experts top-4, expert I 256, 8 "
       "query / 2 KV heads of 64, vocab 512 (the 500-token tokenizer of tests/data/tokenizer "
       "covers it); about 106 M parameters, 18 M active per token, so the CPU backend "
       "generates on the order of a hundred tokens/s.",
       preset_small_qwen3_moe},
      {"qwen3-30b-a3b",
       "Qwen3-30B-A3B shapes: 48 layers, hidden 2048, 128 experts top-8, expert I 768, 32 "
       "query / 4 KV heads of 128, vocab 151936, RoPE theta 1e6.",
       preset_qwen3_30b_a3b},
      {"qwen3.5-35b-a3b",
       "Qwen3.5-35B-A3B MoE shapes: 40 layers, hidden 2048, 256 experts top-8, expert I 512 "
       "+ a gated shared expert of 512, gated attention with 16 query / 2 KV heads of 256 "
       "(partial RoPE 0.25), vocab 248320. NOT the real attention mix: the real model has "
       "Gated DeltaNet in 30 of its 40 layers, which the engine does not build yet, so this "
       "config (qwen3_5_moe_text) declares every layer \"full_attention\". MoE cost and weight "
       "layout are the real ones; attention cost and KV-cache size are not.",
       preset_qwen35_35b_a3b},
      {"kimi-k2.5",
       "Kimi-K2.5 language model shapes (DeepSeek-V3 architecture): MLA with 64 heads, "
       "q_lora_rank 1536, kv_lora_rank 512, nope 128 / rope 64 / v 128; 61 layers with "
       "first_k_dense_replace 1, hidden 7168, 384 experts top-8 (I 2048) + 1 shared, n_group "
       "1, routed_scaling_factor 2.827, YaRN factor 64 (original 4096, theta 50000), vocab "
       "163840. Written as a text-only DeepseekV3ForCausalLM (model_type deepseek_v3); the "
       "vision tower is not synthesized.",
       preset_kimi_k25},
  };
  return list;
}

std::string preset_names() {
  std::string names;
  for (const Preset& p : presets()) names += (names.empty() ? "" : ", ") + std::string(p.name);
  return names;
}

const Preset& find_preset(const std::string& name) {
  for (const Preset& p : presets()) {
    if (name == p.name) return p;
  }
  MOELORA_THROW(ErrorCode::kInvalidArgument, "--preset: unknown preset '", name,
                "'; presets: ", preset_names());
}

// First `layers` decoder layers of a preset (--layers).
void set_layers(ModelConfig& c, int64_t layers) {
  c.num_hidden_layers = layers;
  if (!c.layer_types.empty()) c.layer_types.assign(static_cast<size_t>(layers), "full_attention");
  c.mlp_only_layers.erase(std::remove_if(c.mlp_only_layers.begin(), c.mlp_only_layers.end(),
                                         [&](int64_t l) { return l >= layers; }),
                          c.mlp_only_layers.end());
  c.first_k_dense_replace = std::min(c.first_k_dense_replace, layers);
}

// ============================================================================================
// the tensors of a model

struct Planned {
  std::string
      module;   // linear: module name (the tensor is module + ".weight"); else the tensor name
  Shape shape;  // linear: [out, in]
  bool linear = false;
  DType dtype = DType::kBF16;  // plain tensors (F32 for the DeepSeek correction bias)
  Distribution init;
  std::string tensor_name() const { return linear ? module + ".weight" : module; }
};

enum class Format { kDense, kFp8, kNvfp4 };

// Every tensor of the model in the order transformers saves them (the order shards are filled).
void plan_model(const ModelConfig& c, const std::function<void(Planned)>& add) {
  const std::string P = c.weight_prefix;
  const int64_t H = c.hidden_size;
  const Distribution norm_init = c.norm_style == NormStyle::kOnePlusWeight
                                     ? Distribution::uniform(-0.1f, 0.1f)
                                     : Distribution::uniform(0.9f, 1.1f);
  auto plain = [&](std::string name, Shape shape, Distribution init, DType dtype = DType::kBF16) {
    add(Planned{std::move(name), std::move(shape), false, dtype, init});
  };
  auto norm = [&](std::string name, int64_t size) { plain(std::move(name), {size}, norm_init); };
  auto linear = [&](std::string module, int64_t out, int64_t in) {
    add(Planned{std::move(module),
                {out, in},
                true,
                DType::kBF16,
                Distribution::normal(0.0f, 1.0f / std::sqrt(static_cast<float>(in)))});
  };
  auto mlp = [&](const std::string& module, int64_t inter) {
    linear(module + ".gate_proj", inter, H);
    linear(module + ".up_proj", inter, H);
    linear(module + ".down_proj", H, inter);
  };

  plain(P + "embed_tokens.weight", {c.vocab_size, H}, Distribution::normal(0.0f, 1.0f));
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = P + "layers." + std::to_string(layer) + ".";
    norm(p + "input_layernorm.weight", H);
    MOELORA_CHECK(
        c.layer_types.empty() || c.layer_types[static_cast<size_t>(layer)] == "full_attention",
        ErrorCode::kUnsupported, "synth: layer ", layer, " is ",
        c.layer_types[static_cast<size_t>(layer)],
        "; synthetic Gated DeltaNet layers are not supported");
    const std::string a = p + "self_attn.";
    if (c.use_mla) {
      const int64_t heads = c.num_attention_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (c.q_lora_rank > 0) {
        linear(a + "q_a_proj", c.q_lora_rank, H);
        norm(a + "q_a_layernorm.weight", c.q_lora_rank);
        linear(a + "q_b_proj", heads * qk, c.q_lora_rank);
      } else {
        linear(a + "q_proj", heads * qk, H);
      }
      linear(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H);
      norm(a + "kv_a_layernorm.weight", c.kv_lora_rank);
      linear(a + "kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
      linear(a + "o_proj", H, heads * c.v_head_dim);
    } else {
      const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
      linear(a + "q_proj", c.attention_output_gate ? 2 * q : q, H);
      linear(a + "k_proj", kv, H);
      linear(a + "v_proj", kv, H);
      linear(a + "o_proj", H, q);
      if (c.qk_norm) {
        norm(a + "q_norm.weight", c.head_dim);
        norm(a + "k_norm.weight", c.head_dim);
      }
    }
    norm(p + "post_attention_layernorm.weight", H);
    if (!c.is_moe_layer(layer)) {
      mlp(p + "mlp", c.intermediate_size);
      continue;
    }
    plain(p + "mlp.gate.weight", {c.num_experts, H},
          Distribution::normal(0.0f, 3.0f / std::sqrt(static_cast<float>(H))));
    if (c.router == RouterKind::kSigmoidNoauxTc) {
      plain(p + "mlp.gate.e_score_correction_bias", {c.num_experts},
            Distribution::normal(0.0f, 0.05f), DType::kF32);
    }
    for (int64_t e = 0; e < c.num_experts; ++e)
      mlp(p + "mlp.experts." + std::to_string(e), c.moe_intermediate_size);
    if (c.shared_expert_intermediate_size > 0) {
      mlp(p + (c.arch == Architecture::kDeepseekV3 ? "mlp.shared_experts" : "mlp.shared_expert"),
          c.shared_expert_intermediate_size);
      if (c.shared_expert_gate) {
        plain(p + "mlp.shared_expert_gate.weight", {1, H},
              Distribution::normal(0.0f, 1.0f / std::sqrt(static_cast<float>(H))));
      }
    }
  }
  norm(P + "norm.weight", H);
  if (!c.tie_word_embeddings) linear(c.lm_head_name, c.vocab_size, H);
}

Format format_of(const Planned& t, const QuantConfig& quant) {
  if (!t.linear || quant.method == QuantMethod::kNone || quant.is_excluded(t.module))
    return Format::kDense;
  if (quant.method == QuantMethod::kNvfp4)
    return t.shape[1] % kNvfp4Group == 0 ? Format::kNvfp4 : Format::kDense;
  return Format::kFp8;
}

uint64_t planned_bytes(const Planned& t, Format format) {
  const uint64_t numel = static_cast<uint64_t>(shape_numel(t.shape));
  switch (format) {
    case Format::kDense: return dtype_bytes(t.dtype, numel);
    case Format::kFp8:
      return numel + 4ull * static_cast<uint64_t>(ceil_div(t.shape[0], kFp8Block) *
                                                  ceil_div(t.shape[1], kFp8Block));
    case Format::kNvfp4: return numel / 2 + numel / kNvfp4Group + 8;
  }
  return 0;
}

// The quantization config synth writes for `method`, with the modules left unquantized: the
// output projection, the routers and Qwen's shared_expert_gate (and, for NVFP4, any linear whose
// in_features is not a multiple of 16).
QuantConfig make_quant(const ModelConfig& c, QuantMethod method) {
  QuantConfig q;
  q.method = method;
  if (method == QuantMethod::kNone) return q;
  if (method == QuantMethod::kFp8Block) {
    // Explicit module names, like the Qwen FP8 releases: every matcher (transformers' prefix and
    // suffix rules, vLLM's, ours) reads them the same way.
    q.source = "config.json";
    q.activation_scheme = "dynamic";
    q.modules_to_not_convert.push_back(c.lm_head_name);
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
      if (!c.is_moe_layer(layer)) continue;
      const std::string p = c.weight_prefix + "layers." + std::to_string(layer) + ".mlp.";
      q.modules_to_not_convert.push_back(p + "gate");
      if (c.shared_expert_gate) q.modules_to_not_convert.push_back(p + "shared_expert_gate");
    }
    return q;
  }
  // ModelOpt style wildcards
  q.source = "hf_quant_config.json";
  q.modules_to_not_convert = {c.lm_head_name, c.weight_prefix + "layers.*.mlp.gate"};
  if (c.shared_expert_gate)
    q.modules_to_not_convert.push_back(c.weight_prefix + "layers.*.mlp.shared_expert_gate");
  plan_model(c, [&](Planned t) {
    if (t.linear && t.shape[1] % kNvfp4Group != 0 && !q.is_excluded(t.module))
      q.modules_to_not_convert.push_back(t.module);
  });
  return q;
}

QuantMethod parse_quant(const std::string& name) {
  if (name == "bf16") return QuantMethod::kNone;
  if (name == "fp8") return QuantMethod::kFp8Block;
  if (name == "nvfp4") return QuantMethod::kNvfp4;
  MOELORA_THROW(ErrorCode::kInvalidArgument, "--quant: unknown value '", name,
                "'; expected bf16, fp8 or nvfp4");
}

struct ModelTotals {
  uint64_t bytes = 0, parameters = 0, tensors = 0;
};

ModelTotals model_totals(const ModelConfig& c) {
  ModelTotals totals;
  plan_model(c, [&](Planned t) {
    const Format f = format_of(t, c.quant);
    totals.bytes += planned_bytes(t, f);
    totals.parameters += static_cast<uint64_t>(shape_numel(t.shape));
    totals.tensors += f == Format::kDense ? 1 : f == Format::kFp8 ? 2 : 4;
  });
  return totals;
}

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
      "embeddings N(0, 1), norms near 1, routers N(0, 9/H) so routing is decisive.\n"
      "--quant fp8 writes 128x128 block scales (weight_scale_inv) for every attention / MLP /\n"
      "expert linear and keeps lm_head, routers, norms, embeddings, e_score_correction_bias and\n"
      "shared_expert_gate in bf16. --quant nvfp4 writes ModelOpt tensors (weight, weight_scale,\n"
      "weight_scale_2, input_scale) with the same exclusions, and hf_quant_config.json.\n"
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

// ============================================================================================
// moelora synth-adapter

enum class AdapterLayout { kPerExpert, kPeft3d, kSharedOuter };

AdapterLayout parse_layout(const std::string& name) {
  if (name == "per-expert") return AdapterLayout::kPerExpert;
  if (name == "peft-3d") return AdapterLayout::kPeft3d;
  if (name == "shared-outer") return AdapterLayout::kSharedOuter;
  MOELORA_THROW(ErrorCode::kInvalidArgument, "--layout: unknown value '", name,
                "'; expected per-expert, peft-3d or shared-outer");
}

// "a, b,c" -> {"a", "b", "c"} (spaces around items dropped, empty items skipped)
std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// Target names synth-adapter knows, in the order "all" lists them.
const std::vector<std::string>& known_targets() {
  static const std::vector<std::string> names = split_list(
      "q_proj,k_proj,v_proj,o_proj,q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,experts,"
      "shared_experts,mlp");
  return names;
}

// The targets the model has.
std::vector<std::string> valid_targets(const ModelConfig& c) {
  std::vector<std::string> out;
  if (c.use_mla) {
    if (c.q_lora_rank > 0) {
      out.insert(out.end(), {"q_a_proj", "q_b_proj"});
    } else {
      out.push_back("q_proj");
    }
    out.insert(out.end(), {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"});
  } else {
    out.insert(out.end(), {"q_proj", "k_proj", "v_proj", "o_proj"});
  }
  bool any_moe = false, any_dense = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    (c.is_moe_layer(l) ? any_moe : any_dense) = true;
  if (any_moe) out.push_back("experts");
  if (any_moe && c.shared_expert_intermediate_size > 0) out.push_back("shared_experts");
  if (any_dense) out.push_back("mlp");
  return out;
}

std::string join(const std::vector<std::string>& items, const std::string& sep = ", ") {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::set<std::string> parse_targets(const std::string& list, const ModelConfig& c,
                                    const std::string& model) {
  const std::vector<std::string> valid = valid_targets(c);
  std::set<std::string> targets;
  for (std::string item : split_list(list)) {
    if (item == "all") {
      targets.insert(valid.begin(), valid.end());
      continue;
    }
    if (item == "shared_expert") item = "shared_experts";
    const auto& known = known_targets();
    MOELORA_CHECK(std::find(known.begin(), known.end(), item) != known.end(),
                  ErrorCode::kInvalidArgument, "--targets: unknown target '", item,
                  "'; known targets: ", join(known), ", all");
    MOELORA_CHECK(std::find(valid.begin(), valid.end(), item) != valid.end(),
                  ErrorCode::kInvalidArgument, "--targets: the ", c.model_type, " model ", model,
                  " has no '", item, "' module; valid targets: ", join(valid), ", all");
    targets.insert(item);
  }
  MOELORA_CHECK(!targets.empty(), ErrorCode::kInvalidArgument,
                "--targets is empty; valid targets for ", model, ": ", join(valid), ", all");
  return targets;
}

struct AdapterOptions {
  std::string model;
  int64_t rank = 8;
  double alpha = 16;
  std::string layout = "per-expert";
  std::string targets;
  uint64_t seed = 0;
  bool rslora = false;
  std::string dtype = "f32";  // of the LoRA factors: f32 or bf16
  std::string out;
};

// One LoRA factor to write: values ~ U(+-1/sqrt(fan_in)) for A (PEFT's kaiming-uniform with
// init_lora_weights=False) and N(0, (0.25/sqrt(r))^2) for B, so the delta s*B*A*x has about
// 0.15*s of the base output's scale.
struct Factor {
  std::string name;
  Shape shape;
  Distribution init;
};

void plan_adapter(const ModelConfig& c, const std::set<std::string>& targets, AdapterLayout layout,
                  int64_t r, const std::function<void(Factor)>& add) {
  const std::string P = "base_model.model." + c.weight_prefix;
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const Distribution b_init = Distribution::normal(0.0f, 0.25f / std::sqrt(static_cast<float>(r)));
  auto a_init = [](int64_t fan_in) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    return Distribution::uniform(-bound, bound);
  };
  auto pair = [&](const std::string& module, int64_t out, int64_t in) {  // plain 2-D LoRA
    add({module + ".lora_A.weight", {r, in}, a_init(in)});
    add({module + ".lora_B.weight", {out, r}, b_init});
  };
  auto has = [&](const char* t) { return targets.count(t) != 0; };

  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = P + "layers." + std::to_string(layer) + ".";
    const bool full_attention =
        c.layer_types.empty() || c.layer_types[static_cast<size_t>(layer)] == "full_attention";
    const std::string a = p + "self_attn.";
    if (full_attention && c.use_mla) {
      const int64_t heads = c.num_attention_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (has("q_proj")) pair(a + "q_proj", heads * qk, H);
      if (has("q_a_proj")) pair(a + "q_a_proj", c.q_lora_rank, H);
      if (has("q_b_proj")) pair(a + "q_b_proj", heads * qk, c.q_lora_rank);
      if (has("kv_a_proj_with_mqa"))
        pair(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H);
      if (has("kv_b_proj"))
        pair(a + "kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
      if (has("o_proj")) pair(a + "o_proj", H, heads * c.v_head_dim);
    } else if (full_attention) {
      const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
      if (has("q_proj")) pair(a + "q_proj", c.attention_output_gate ? 2 * q : q, H);
      if (has("k_proj")) pair(a + "k_proj", kv, H);
      if (has("v_proj")) pair(a + "v_proj", kv, H);
      if (has("o_proj")) pair(a + "o_proj", H, q);
    }
    if (!c.is_moe_layer(layer)) {
      if (has("mlp")) {
        pair(p + "mlp.gate_proj", c.intermediate_size, H);
        pair(p + "mlp.up_proj", c.intermediate_size, H);
        pair(p + "mlp.down_proj", H, c.intermediate_size);
      }
      continue;
    }
    if (has("experts")) {
      const std::string x = p + "mlp.experts.";
      switch (layout) {
        case AdapterLayout::kPerExpert:
          for (int64_t e = 0; e < E; ++e) {
            const std::string m = x + std::to_string(e) + ".";
            pair(m + "gate_proj", I, H);
            pair(m + "up_proj", I, H);
            pair(m + "down_proj", H, I);
          }
          break;
        case AdapterLayout::kPeft3d:
          // gate_up_proj is the inner ParamWrapper (base_layer), down_proj the outer one:
          // A rows e*r + k (expert-major), B columns k*E + e (rank-major).
          add({x + "base_layer.lora_A.weight", {E * r, H}, a_init(H)});
          add({x + "base_layer.lora_B.weight", {2 * I, E * r}, b_init});
          add({x + "lora_A.weight", {E * r, I}, a_init(I)});
          add({x + "lora_B.weight", {H, E * r}, b_init});
          break;
        case AdapterLayout::kSharedOuter:
          // the outer factor (gate/up A, down B) is shared by all experts: leading dim 1
          add({x + "gate_proj.lora_A.weight", {1, r, H}, a_init(H)});
          add({x + "gate_proj.lora_B.weight", {E, I, r}, b_init});
          add({x + "up_proj.lora_A.weight", {1, r, H}, a_init(H)});
          add({x + "up_proj.lora_B.weight", {E, I, r}, b_init});
          add({x + "down_proj.lora_A.weight", {E, r, I}, a_init(I)});
          add({x + "down_proj.lora_B.weight", {1, H, r}, b_init});
          break;
      }
    }
    if (has("shared_experts") && c.shared_expert_intermediate_size > 0) {
      const std::string s =
          p + (c.arch == Architecture::kDeepseekV3 ? "mlp.shared_experts." : "mlp.shared_expert.");
      pair(s + "gate_proj", c.shared_expert_intermediate_size, H);
      pair(s + "up_proj", c.shared_expert_intermediate_size, H);
      pair(s + "down_proj", H, c.shared_expert_intermediate_size);
    }
  }
}

// adapter_config.json as PEFT writes it. Attention-only and expert adapters list leaf names in
// target_modules (PEFT's usual form); when the dense MLP or the shared expert is a target, a
// regex that full-matches exactly the adapted module paths is written instead, because the leaf
// names gate_proj/up_proj/down_proj cannot tell the dense, shared and routed MLPs apart.
json adapter_config_json(const ModelConfig& c, const std::set<std::string>& targets,
                         AdapterLayout layout, const AdapterOptions& o, const fs::path& model_dir) {
  std::vector<std::string> attention;
  for (const std::string& t : targets) {
    if (t != "experts" && t != "shared_experts" && t != "mlp") attention.push_back(t);
  }
  const bool experts = targets.count("experts") != 0;
  const bool mlp_like = targets.count("mlp") != 0 || targets.count("shared_experts") != 0;
  json target_modules;
  json target_parameters = nullptr;
  if (experts && layout == AdapterLayout::kPeft3d) {
    target_parameters = {"mlp.experts.down_proj", "mlp.experts.gate_up_proj"};
  }
  if (!mlp_like) {
    std::vector<std::string> names = attention;
    if (experts && layout != AdapterLayout::kPeft3d)
      names.insert(names.end(), {"down_proj", "gate_proj", "up_proj"});
    std::sort(names.begin(), names.end());
    target_modules = names;
  } else {
    std::string prefix = c.weight_prefix;
    std::string escaped;
    for (char ch : prefix) escaped += ch == '.' ? std::string("\\.") : std::string(1, ch);
    std::vector<std::string> alternatives;
    if (!attention.empty()) alternatives.push_back("self_attn\\.(" + join(attention, "|") + ")");
    const std::string projections = "(gate_proj|up_proj|down_proj)";
    if (targets.count("mlp")) alternatives.push_back("mlp\\." + projections);
    if (targets.count("shared_experts")) {
      alternatives.push_back(std::string(c.arch == Architecture::kDeepseekV3
                                             ? "mlp\\.shared_experts\\."
                                             : "mlp\\.shared_expert\\.") +
                             projections);
    }
    if (experts && layout == AdapterLayout::kPerExpert)
      alternatives.push_back("mlp\\.experts\\.\\d+\\." + projections);
    if (experts && layout == AdapterLayout::kSharedOuter)
      alternatives.push_back("mlp\\.experts\\." + projections);
    target_modules = escaped + "layers\\.\\d+\\.(" + join(alternatives, "|") + ")";
  }
  json alpha = o.alpha == std::floor(o.alpha) && std::fabs(o.alpha) < 1e15
                   ? json(static_cast<int64_t>(o.alpha))
                   : json(o.alpha);
  std::error_code ec;
  const fs::path absolute = fs::absolute(model_dir, ec);
  return {{"alpha_pattern", json::object()},
          {"auto_mapping", nullptr},
          {"base_model_name_or_path", (ec ? model_dir : absolute).lexically_normal().string()},
          {"bias", "none"},
          {"exclude_modules", nullptr},
          {"fan_in_fan_out", false},
          {"inference_mode", true},
          {"init_lora_weights", true},
          {"layer_replication", nullptr},
          {"layers_pattern", nullptr},
          {"layers_to_transform", nullptr},
          {"lora_alpha", alpha},
          {"lora_bias", false},
          {"lora_dropout", 0.0},
          {"modules_to_save", nullptr},
          {"peft_type", "LORA"},
          {"r", o.rank},
          {"rank_pattern", json::object()},
          {"revision", nullptr},
          {"target_modules", target_modules},
          {"target_parameters", target_parameters},
          {"task_type", "CAUSAL_LM"},
          {"trainable_token_indices", nullptr},
          {"use_dora", false},
          {"use_rslora", o.rslora}};
}

int run_synth_adapter(const AdapterOptions& o) {
  const fs::path model_dir(o.model);
  const ModelConfig c = io::load_model_config(model_dir);
  MOELORA_CHECK(o.rank >= 1, ErrorCode::kInvalidArgument, "--rank must be >= 1, got ", o.rank);
  MOELORA_CHECK(std::isfinite(o.alpha) && o.alpha > 0, ErrorCode::kInvalidArgument,
                "--alpha must be positive, got ", o.alpha);
  const AdapterLayout layout = parse_layout(o.layout);
  MOELORA_CHECK(o.dtype == "f32" || o.dtype == "bf16", ErrorCode::kInvalidArgument, "--dtype '",
                o.dtype, "' is not supported; supported: f32, bf16");
  const DType factor_dtype = o.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  const std::set<std::string> targets = parse_targets(o.targets, c, model_dir.string());
  const fs::path out(o.out);
  prepare_output_dir(out);

  write_json_file(out / "adapter_config.json",
                  adapter_config_json(c, targets, layout, o, model_dir));
  io::SafetensorsWriter writer;
  uint64_t parameters = 0;
  plan_adapter(c, targets, layout, o.rank, [&](Factor f) {
    const Source src{stream_key(o.seed, f.name), f.init};
    const int64_t numel = shape_numel(f.shape);
    parameters += static_cast<uint64_t>(numel);
    // fill_float splits each tensor over the thread pool; bf16 rounds each value once.
    writer.add(f.name, factor_dtype, f.shape, [src, numel, factor_dtype](void* dst) {
      fill_float(dst, factor_dtype, src, numel);
    });
  });
  MOELORA_CHECK(writer.size() > 0, ErrorCode::kInvalidArgument, "--targets ", o.targets,
                ": no module of ", model_dir.string(), " matches");
  const uint64_t total = writer.data_bytes();
  ProgressBar progress("synth-adapter", total, "bytes");
  writer.write(out / "adapter_model.safetensors", [&](uint64_t bytes) { progress.advance(bytes); });
  progress.finish();
  const double scaling = o.rslora ? o.alpha / std::sqrt(static_cast<double>(o.rank))
                                  : o.alpha / static_cast<double>(o.rank);
  std::printf(
      "wrote %s: %s adapter, r %lld, alpha %g, scaling %g%s, targets %s, %llu tensors, %s "
      "parameters, %s\n",
      out.string().c_str(), o.layout.c_str(), static_cast<long long>(o.rank), o.alpha, scaling,
      o.rslora ? " (rsLoRA)" : "",
      join(std::vector<std::string>(targets.begin(), targets.end()), ",").c_str(),
      static_cast<unsigned long long>(writer.size()), format_count(parameters).c_str(),
      format_bytes(total).c_str());
  return 0;
}

std::function<int()> setup_synth_adapter(CLI::App& app) {
  auto o = std::make_shared<AdapterOptions>();
  app.add_option("--model", o->model, "Base model directory (its config.json decides the shapes)")
      ->required();
  app.add_option("--rank", o->rank, "LoRA rank r (default 8)");
  app.add_option("--alpha", o->alpha,
                 "lora_alpha (default 16); scaling = alpha / r, or alpha / sqrt(r) with --rslora");
  app.add_option("--layout", o->layout,
                 "Routed-expert layout: per-expert (experts.{e}.{gate,up,down}_proj, 2-D; "
                 "the default), peft-3d (PEFT target_parameters: experts.base_layer.lora_A "
                 "[E*r, H], ...), shared-outer (experts.<proj>, 3-D, gate/up lora_A and down "
                 "lora_B shared by all experts: leading dim 1)");
  app.add_option("--targets", o->targets,
                 "Comma list of q_proj, k_proj, v_proj, o_proj, q_a_proj, q_b_proj, "
                 "kv_a_proj_with_mqa, kv_b_proj, experts, shared_experts, mlp (dense layers), "
                 "or all (everything the model has)")
      ->required();
  app.add_option("--seed", o->seed, "Random seed (default 0)");
  app.add_flag("--rslora", o->rslora, "use_rslora: scaling alpha / sqrt(r)");
  app.add_option("--dtype", o->dtype,
                 "dtype of the LoRA factors: f32 (the default) or bf16 (half the file size)");
  app.add_option("--out", o->out, "Output directory")->required();
  app.footer(
      "\nWrites adapter_config.json (peft_type LORA, bias none, base_model_name_or_path =\n"
      "--model) and adapter_model.safetensors (F32 or --dtype bf16, keys "
      "base_model.model.<module>.lora_{A,B}\n"
      ".weight). B is random, not zero, so the adapter changes the model's outputs. Attention\n"
      "targets exist on every attention layer, experts and shared_experts on MoE layers, mlp on\n"
      "dense layers.");
  return [o] { return run_synth_adapter(*o); };
}

MOELORA_SUBCOMMAND(
    "synth", "Write a Hugging Face checkpoint with random weights from a preset (bf16, FP8, NVFP4)",
    60, setup_synth);
MOELORA_SUBCOMMAND("synth-adapter",
                   "Write a PEFT LoRA adapter with random weights for a model directory", 61,
                   setup_synth_adapter);

}  // namespace
}  // namespace moelora::cli

namespace moelora::cli {

io::ModelConfig preset_config(const std::string& preset, int64_t layers, const std::string& quant) {
  io::ModelConfig c = find_preset(preset).make();
  MOELORA_CHECK(layers >= 0, ErrorCode::kInvalidArgument, "layers must be >= 0 (0 = all), got ",
                layers);
  if (layers > 0 && layers < c.num_hidden_layers) set_layers(c, layers);
  c.quant = make_quant(c, parse_quant(quant));
  c.validate("preset " + preset);
  return c;
}

}  // namespace moelora::cli
