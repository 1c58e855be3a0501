// What `moelora synth` writes, tensor by tensor: the counter-based random numbers every value
// comes from, and the list of a model's tensors with the scale each one is drawn at.
//
// Scales follow a real initialization: linears ~ N(0, 1/in), embeddings ~ N(0, 1), norms near 1
// (near 0 for Qwen3.5's (1+w) norms), routers sharper (N(0, 9/H): logits of std ~3, so routing is
// decided, not a near-tie of uniform scores). Gated DeltaNet layers: A_log = log(U(1, 16)) as
// transformers initialises it, dt_bias U(-0.1, 0.1), the depthwise conv U(+-1/sqrt(K)) (PyTorch's
// Conv1d init for fan_in K: SiLU then sees O(1) inputs), the gated norm near 1 (a plain weight).
#include <algorithm>
#include <cmath>
#include <fstream>

#include "core/error.h"
#include "core/threads.h"
#include "synth.h"

namespace moelora::cli::synth {

namespace fs = std::filesystem;
using json = nlohmann::json;
using io::Architecture;
using io::ModelConfig;
using io::QuantConfig;
using io::QuantMethod;

namespace {

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

// ============================================================================================
// counter-based random numbers

uint64_t stream_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name, then mixed with the seed
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return mix64(h ^ mix64(seed + 0x9e3779b97f4a7c15ull));
}

float Distribution::sample(uint64_t key, uint64_t i) const {
  const uint64_t h = mix64(key + i * 0x9e3779b97f4a7c15ull);
  if (kind != Kind::kNormal) {
    const float u = a + (b - a) * static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    return kind == Kind::kUniform ? u : std::log(u);
  }
  const float sum =
      static_cast<float>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
  constexpr float kMean = 4 * 32767.5f;
  constexpr float kInvStd = 1.0f / 37837.23f;  // sqrt(4 * (65536^2 - 1) / 12)
  return a + b * (sum - kMean) * kInvStd;
}

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

// ============================================================================================
// the tensors of a model

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
  // Qwen3.5 Gated DeltaNet; key_dim = nk * dk, value_dim = nv * dv, conv over [q | k | v].
  auto linear_attention = [&](const std::string& g) {
    const io::LinearAttentionConfig& la = c.linear_attention;
    const int64_t key_dim = la.num_key_heads * la.key_head_dim;
    const int64_t value_dim = la.num_value_heads * la.value_head_dim;
    const int64_t conv_dim = 2 * key_dim + value_dim;
    const float conv_bound = 1.0f / std::sqrt(static_cast<float>(la.conv_kernel_dim));
    linear(g + "in_proj_qkv", conv_dim, H);
    linear(g + "in_proj_z", value_dim, H);
    linear(g + "in_proj_b", la.num_value_heads, H);
    linear(g + "in_proj_a", la.num_value_heads, H);
    plain(g + "conv1d.weight", {conv_dim, 1, la.conv_kernel_dim},
          Distribution::uniform(-conv_bound, conv_bound));
    plain(g + "dt_bias", {la.num_value_heads}, Distribution::uniform(-0.1f, 0.1f));
    plain(g + "A_log", {la.num_value_heads}, Distribution::log_uniform(1.0f, 16.0f));
    plain(g + "norm.weight", {la.value_head_dim}, Distribution::uniform(0.9f, 1.1f));
    linear(g + "out_proj", H, value_dim);
  };

  plain(P + "embed_tokens.weight", {c.vocab_size, H}, Distribution::normal(0.0f, 1.0f));
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = P + "layers." + std::to_string(layer) + ".";
    norm(p + "input_layernorm.weight", H);
    const std::string a = p + "self_attn.";
    if (!c.layer_types.empty() && c.layer_types[static_cast<size_t>(layer)] == "linear_attention") {
      linear_attention(p + "linear_attn.");
    } else if (c.use_mla) {
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

// ============================================================================================
// files

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

}  // namespace moelora::cli::synth
