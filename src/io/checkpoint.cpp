// Checkpoint loader: config.json + safetensors -> ModelWeights (see checkpoint.h for the names,
// layouts and rules).
//
// The loader is the one place where a Hugging Face checkpoint is checked against its
// config.json, so the model code can index weights without re-checking anything. It walks the
// model the config describes (layer by layer, module by module), asks the store for exactly the
// tensors that module needs, and checks each one's dtype and shape on the spot; the expected
// shapes carry the config fields they come from, so a message says why a shape was expected.
// Afterwards every tensor of the checkpoint must have been used, or be one of the few that
// transformers ignores too: an unused tensor almost always means config.json and the weights
// disagree (more experts or layers on disk than the config says), and loading only the part the
// config names would compute something else without a word.
#include "io/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/progress.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;

// One dimension expected by config.json and the fields it comes from, for messages:
// {4096, "num_attention_heads 32 x head_dim 128"}.
struct Dim {
  int64_t value;
  std::string why;
};

Dim product(const Dim& a, const Dim& b) {
  return {a.value * b.value, a.why + " x " + b.why};
}
Dim field(const char* name, int64_t value) {
  return {value, std::string(name) + " " + std::to_string(value)};
}

Shape shape_of(const std::vector<Dim>& dims) {
  Shape s;
  for (const Dim& d : dims) s.push_back(d.value);
  return s;
}

// "[4096 (num_attention_heads 32 x head_dim 128), 2048 (hidden_size 2048)]"
std::string explain(const std::vector<Dim>& dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) os << ", ";
    os << dims[i].value;
    if (!dims[i].why.empty() && dims[i].why != std::to_string(dims[i].value))
      os << " (" << dims[i].why << ")";
  }
  os << "]";
  return os.str();
}

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::string out;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i) out += i + 1 == dtypes.size() ? " or " : ", ";
    out += dtype_name(dtypes[i]);
  }
  return out;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

const std::vector<DType> kFloatTypes = {DType::kBF16, DType::kF16, DType::kF32};

// First `num_hidden_layers` layers only (LoadOptions::max_layers).
void truncate_layers(ModelConfig& c, int64_t layers) {
  c.num_hidden_layers = layers;
  if (static_cast<int64_t>(c.layer_types.size()) > layers)
    c.layer_types.resize(static_cast<size_t>(layers));
  c.mlp_only_layers.erase(std::remove_if(c.mlp_only_layers.begin(), c.mlp_only_layers.end(),
                                         [&](int64_t l) { return l >= layers; }),
                          c.mlp_only_layers.end());
  c.first_k_dense_replace = std::min(c.first_k_dense_replace, layers);
}

// The decoder prefix the checkpoint actually uses: the config's, else the first other known one
// that holds embed_tokens (text configs reading VLM-saved weights and the reverse).
std::string resolve_prefix(const ModelConfig& config, const SafetensorsStore& store) {
  for (const std::string& candidate :
       {config.weight_prefix, std::string("model."), std::string("model.language_model."),
        std::string("language_model.model.")}) {
    if (store.contains(candidate + "embed_tokens.weight")) return candidate;
  }
  return config.weight_prefix;  // the missing-tensor error will name the expected key
}

std::string resolve_lm_head(const ModelConfig& config, const SafetensorsStore& store) {
  for (const std::string& candidate :
       {config.lm_head_name, std::string("lm_head"), std::string("language_model.lm_head")}) {
    if (store.contains(candidate + ".weight")) return candidate;
  }
  return config.lm_head_name;
}

class Loader {
 public:
  Loader(const ModelConfig& config, const SafetensorsStore& store, fs::path dir, std::string prefix)
      : config_(config), store_(store), dir_(std::move(dir)), prefix_(std::move(prefix)) {}

  const std::set<std::string>& used() const { return used_; }
  bool has(const std::string& name) const { return store_.contains(name); }

  // The named tensor with one of `dtypes` and the shape `dims`; marks it used.
  Tensor tensor(const std::string& name, const std::vector<Dim>& dims,
                const std::vector<DType>& dtypes, const char* what) {
    require(name, dims, dtypes, what);
    const TensorInfo& info = store_.info(name);
    check_dtype(name, info.dtype, dtypes, what);
    check_shape(name, info.shape, dims);
    used_.insert(name);
    return store_.tensor(name);
  }

  Tensor float_tensor(const std::string& name, const std::vector<Dim>& dims, const char* what) {
    return tensor(name, dims, kFloatTypes, what);
  }

  // An F32 scalar stored as shape [] or [1] (ModelOpt writes either).
  float scalar(const std::string& name, const char* what) {
    require(name, {}, {DType::kF32}, what);
    const TensorInfo& info = store_.info(name);
    check_dtype(name, info.dtype, {DType::kF32}, what);
    MOELORA_CHECK(info.shape.empty() || info.shape == Shape{1}, ErrorCode::kInvalidFile, file(name),
                  ": tensor '", name, "' (", what, ") has shape ", shape_str(info.shape),
                  ", expected a scalar: [] or [1]");
    used_.insert(name);
    const Tensor t = store_.tensor(name);
    const float value = load_as_f32(t.raw_data(), DType::kF32, 0);
    MOELORA_CHECK(std::isfinite(value) && value >= 0.0f, ErrorCode::kInvalidFile, file(name),
                  ": tensor '", name, "' (", what, ") is ", value,
                  ", expected a finite value >= 0");
    return value;
  }

  // One linear layer `module` ("model.layers.0.self_attn.q_proj"), W [out, in], in whichever
  // format its companion tensors say.
  LinearWeight linear(const std::string& module, const Dim& out, const Dim& in) {
    LinearWeight w;
    w.name = module + ".weight";
    w.out_features = out.value;
    w.in_features = in.value;
    const std::string fp8_scale = module + ".weight_scale_inv";
    const std::string nvfp4_scale = module + ".weight_scale";
    const bool fp8 = has(fp8_scale);
    const bool nvfp4 = has(nvfp4_scale);
    MOELORA_CHECK(!(fp8 && nvfp4), ErrorCode::kInvalidFile, file(w.name), ": linear '", module,
                  "' has both '", fp8_scale, "' (FP8 block) and '", nvfp4_scale,
                  "' (NVFP4) scales");
    if (fp8) {
      check_quantized_allowed(module, QuantMethod::kFp8Block, fp8_scale);
      w.format = WeightFormat::kFp8Block;
      w.block_n = config_.quant.block_n;
      w.block_k = config_.quant.block_k;
      w.weight = tensor(w.name, {out, in}, {DType::kF8E4M3}, "FP8 block weight");
      w.scale =
          tensor(fp8_scale,
                 {{ceil_div(out.value, w.block_n),
                   "ceil(" + std::to_string(out.value) + " / " + std::to_string(w.block_n) + ")"},
                  {ceil_div(in.value, w.block_k),
                   "ceil(" + std::to_string(in.value) + " / " + std::to_string(w.block_k) + ")"}},
                 {DType::kF32}, "FP8 block scales");
      return w;
    }
    if (nvfp4) {
      check_quantized_allowed(module, QuantMethod::kNvfp4, nvfp4_scale);
      MOELORA_CHECK(in.value % 16 == 0, ErrorCode::kInvalidFile, file(nvfp4_scale),
                    ": NVFP4 linear '", module, "' has in_features ", in.value, " (", in.why,
                    "), which is not a multiple of the group size 16");
      w.format = WeightFormat::kNvfp4;
      w.weight = tensor(w.name, {out, {in.value / 2, in.why + " / 2 (two e2m1 codes per byte)"}},
                        {DType::kU8}, "NVFP4 packed weight");
      w.scale = tensor(nvfp4_scale, {out, {in.value / 16, in.why + " / 16"}}, {DType::kF8E4M3},
                       "NVFP4 block scales");
      w.scale_2 = scalar(module + ".weight_scale_2", "NVFP4 weight_scale_2");
      MOELORA_CHECK(w.scale_2 > 0.0f, ErrorCode::kInvalidFile, file(module + ".weight_scale_2"),
                    ": tensor '", module,
                    ".weight_scale_2' is 0; a per-tensor NVFP4 scale must be positive");
      if (has(module + ".input_scale")) {
        w.input_scale = scalar(module + ".input_scale", "NVFP4 input_scale");
        w.has_input_scale = true;
      }
      return w;
    }
    // Dense. A quantized dtype here means the scale tensor is missing: say that, not "bad dtype".
    if (has(w.name)) {
      const DType dt = store_.info(w.name).dtype;
      MOELORA_CHECK(dt != DType::kF8E4M3, ErrorCode::kInvalidFile, file(w.name), ": tensor '",
                    w.name, "' is F8_E4M3 but the checkpoint has no '", fp8_scale,
                    "' (FP8 block scales)");
      MOELORA_CHECK(dt != DType::kU8, ErrorCode::kInvalidFile, file(w.name), ": tensor '", w.name,
                    "' is U8 (packed NVFP4?) but the checkpoint has no '", nvfp4_scale,
                    "' (NVFP4 block scales)");
    }
    w.weight = float_tensor(w.name, {out, in}, "linear weight");
    return w;
  }

  MlpWeights mlp(const std::string& module, const Dim& intermediate) {
    const Dim hidden = field("hidden_size", config_.hidden_size);
    MlpWeights m;
    m.gate = linear(module + ".gate_proj", intermediate, hidden);
    m.up = linear(module + ".up_proj", intermediate, hidden);
    m.down = linear(module + ".down_proj", hidden, intermediate);
    return m;
  }

  ExpertWeights experts(const std::string& mlp_prefix) {
    const int64_t num_experts = config_.num_experts;
    ExpertWeights out;
    out.num_experts = num_experts;
    out.gate.resize(static_cast<size_t>(num_experts));
    out.up.resize(static_cast<size_t>(num_experts));
    out.down.resize(static_cast<size_t>(num_experts));

    const std::string fused_gate_up = mlp_prefix + "experts.gate_up_proj";
    const std::string fused_down = mlp_prefix + "experts.down_proj";
    const bool fused = has(fused_gate_up) || has(fused_down);
    const bool per_expert = has(mlp_prefix + "experts.0.gate_proj.weight") ||
                            has(mlp_prefix + "experts.0.up_proj.weight") ||
                            has(mlp_prefix + "experts.0.down_proj.weight");
    MOELORA_CHECK(!(fused && per_expert), ErrorCode::kInvalidFile, store_.source().string(),
                  ": layer '", mlp_prefix, "experts' has both fused ('",
                  has(fused_gate_up) ? fused_gate_up : fused_down, "') and per-expert ('",
                  mlp_prefix, "experts.0.*') tensors");
    if (fused) {
      load_fused_experts(mlp_prefix, out);
      return out;
    }
    MOELORA_CHECK(per_expert || num_experts == 0, ErrorCode::kNotFound, dir_.string(),
                  ": the checkpoint has no routed experts for '", mlp_prefix,
                  "experts': expected per-expert tensors '", mlp_prefix,
                  "experts.{e}.{gate,up,down}_proj.weight' or fused '", fused_gate_up, "' + '",
                  fused_down, "' (tensors are read from ", store_.source().string(), ")");
    const Dim intermediate = field("moe_intermediate_size", config_.moe_intermediate_size);
    const Dim hidden = field("hidden_size", config_.hidden_size);
    for (int64_t e = 0; e < num_experts; ++e) {
      const std::string expert = mlp_prefix + "experts." + std::to_string(e);
      const size_t i = static_cast<size_t>(e);
      out.gate[i] = linear(expert + ".gate_proj", intermediate, hidden);
      out.up[i] = linear(expert + ".up_proj", intermediate, hidden);
      out.down[i] = linear(expert + ".down_proj", hidden, intermediate);
    }
    return out;
  }

  LayerWeights layer(int64_t index) {
    const ModelConfig& c = config_;
    const std::string p = prefix_ + "layers." + std::to_string(index) + ".";
    const Dim hidden = field("hidden_size", c.hidden_size);
    LayerWeights lw;
    lw.input_layernorm = float_tensor(p + "input_layernorm.weight", {hidden}, "RMSNorm weight");
    lw.post_attention_layernorm =
        float_tensor(p + "post_attention_layernorm.weight", {hidden}, "RMSNorm weight");

    lw.is_linear_attention =
        !c.layer_types.empty() && c.layer_types[static_cast<size_t>(index)] == "linear_attention";
    if (lw.is_linear_attention) {
      load_linear_attention(p + "linear_attn.", lw.linear_attn);
    } else if (c.use_mla) {
      load_mla(p + "self_attn.", lw);
    } else {
      load_gqa(p + "self_attn.", lw);
    }

    lw.is_moe = c.is_moe_layer(index);
    if (!lw.is_moe) {
      lw.mlp = mlp(p + "mlp", field("intermediate_size", c.intermediate_size));
      return lw;
    }
    const Dim experts = experts_dim();
    lw.router = float_tensor(p + "mlp.gate.weight", {experts, hidden}, "router");
    if (c.router == RouterKind::kSigmoidNoauxTc) {
      lw.e_score_correction_bias =
          float_tensor(p + "mlp.gate.e_score_correction_bias", {experts}, "router correction bias");
    }
    lw.experts = this->experts(p + "mlp.");
    if (c.shared_expert_intermediate_size > 0) {
      const Dim shared =
          field("shared_expert_intermediate_size", c.shared_expert_intermediate_size);
      if (c.arch == Architecture::kDeepseekV3) {
        lw.shared_expert = mlp(p + "mlp.shared_experts", shared);
      } else {
        lw.shared_expert = mlp(p + "mlp.shared_expert", shared);
      }
      if (c.shared_expert_gate) {
        lw.shared_expert_gate = float_tensor(p + "mlp.shared_expert_gate.weight",
                                             {{1, "one gate"}, hidden}, "shared expert gate");
      }
    }
    return lw;
  }

  std::string file(const std::string& name) const {
    return has(name) ? store_.file_of(name).string() : store_.source().string();
  }

 private:
  Dim experts_dim() const {
    return field(config_.arch == Architecture::kDeepseekV3 ? "n_routed_experts" : "num_experts",
                 config_.num_experts);
  }

  void require(const std::string& name, const std::vector<Dim>& dims,
               const std::vector<DType>& dtypes, const char* what) const {
    if (has(name)) return;
    MOELORA_THROW(
        ErrorCode::kNotFound, dir_.string(), ": the checkpoint has no tensor '", name, "' (", what,
        ", ", dtype_list(dtypes), " ", dims.empty() ? std::string("scalar") : explain(dims),
        ", required by config.json; tensors are read from ", store_.source().string(), ")");
  }

  void check_dtype(const std::string& name, DType actual, const std::vector<DType>& allowed,
                   const char* what) const {
    MOELORA_CHECK(std::find(allowed.begin(), allowed.end(), actual) != allowed.end(),
                  ErrorCode::kInvalidFile, file(name), ": tensor '", name, "' (", what,
                  ") has dtype ", dtype_name(actual), ", expected ", dtype_list(allowed));
  }

  void check_shape(const std::string& name, const Shape& actual,
                   const std::vector<Dim>& dims) const {
    MOELORA_CHECK(actual == shape_of(dims), ErrorCode::kInvalidFile, file(name), ": tensor '", name,
                  "' has shape ", shape_str(actual), ", expected ", explain(dims),
                  " from config.json");
  }

  // A quantized tensor needs the matching quantization config, and a module the config leaves
  // unquantized must be stored dense.
  void check_quantized_allowed(const std::string& module, QuantMethod method,
                               const std::string& evidence) const {
    const QuantConfig& q = config_.quant;
    MOELORA_CHECK(q.method == method, ErrorCode::kInvalidFile, file(evidence), ": tensor '",
                  evidence, "' holds ", quant_method_name(method),
                  " scales but the quantization config (config.json",
                  method == QuantMethod::kNvfp4 ? " or hf_quant_config.json" : "", ") says ",
                  quant_method_name(q.method));
    MOELORA_CHECK(!q.is_excluded(module), ErrorCode::kInvalidFile, file(evidence), ": module '",
                  module, "' is stored quantized ('", evidence, "') but ",
                  q.source.empty() ? "config.json" : q.source,
                  " lists it among the modules left unquantized");
  }

  void load_gqa(const std::string& p, LayerWeights& lw) {
    const ModelConfig& c = config_;
    const Dim hidden = field("hidden_size", c.hidden_size);
    const Dim head_dim = field("head_dim", c.head_dim);
    const Dim q_width = product(field("num_attention_heads", c.num_attention_heads), head_dim);
    const Dim kv_width = product(field("num_key_value_heads", c.num_key_value_heads), head_dim);
    Dim q_out = q_width;
    if (c.attention_output_gate)
      q_out = {q_width.value * 2, q_width.why + " x 2 (query and output gate)"};
    lw.q_proj = linear(p + "q_proj", q_out, hidden);
    lw.k_proj = linear(p + "k_proj", kv_width, hidden);
    lw.v_proj = linear(p + "v_proj", kv_width, hidden);
    lw.o_proj = linear(p + "o_proj", hidden, q_width);
    if (c.qk_norm) {
      lw.q_norm = float_tensor(p + "q_norm.weight", {head_dim}, "per-head RMSNorm weight");
      lw.k_norm = float_tensor(p + "k_norm.weight", {head_dim}, "per-head RMSNorm weight");
    }
  }

  void load_mla(const std::string& p, LayerWeights& lw) {
    const ModelConfig& c = config_;
    const Dim hidden = field("hidden_size", c.hidden_size);
    const Dim heads = field("num_attention_heads", c.num_attention_heads);
    const Dim qk_head{c.qk_nope_head_dim + c.qk_rope_head_dim,
                      "qk_nope_head_dim " + std::to_string(c.qk_nope_head_dim) +
                          " + qk_rope_head_dim " + std::to_string(c.qk_rope_head_dim)};
    const Dim q_out{heads.value * qk_head.value, heads.why + " x (" + qk_head.why + ")"};
    if (c.q_lora_rank > 0) {
      const Dim q_rank = field("q_lora_rank", c.q_lora_rank);
      lw.q_a_proj = linear(p + "q_a_proj", q_rank, hidden);
      lw.q_a_layernorm = float_tensor(p + "q_a_layernorm.weight", {q_rank}, "RMSNorm weight");
      lw.q_b_proj = linear(p + "q_b_proj", q_out, q_rank);
    } else {
      lw.q_proj = linear(p + "q_proj", q_out, hidden);
    }
    const Dim kv_rank = field("kv_lora_rank", c.kv_lora_rank);
    lw.kv_a_proj_with_mqa =
        linear(p + "kv_a_proj_with_mqa",
               {c.kv_lora_rank + c.qk_rope_head_dim,
                kv_rank.why + " + qk_rope_head_dim " + std::to_string(c.qk_rope_head_dim)},
               hidden);
    lw.kv_a_layernorm = float_tensor(p + "kv_a_layernorm.weight", {kv_rank}, "RMSNorm weight");
    const Dim kv_b_out{heads.value * (c.qk_nope_head_dim + c.v_head_dim),
                       heads.why + " x (qk_nope_head_dim " + std::to_string(c.qk_nope_head_dim) +
                           " + v_head_dim " + std::to_string(c.v_head_dim) + ")"};
    lw.kv_b_proj = linear(p + "kv_b_proj", kv_b_out, kv_rank);
    lw.o_proj = linear(p + "o_proj", hidden, product(heads, field("v_head_dim", c.v_head_dim)));
  }

  void load_linear_attention(const std::string& p, LinearAttentionWeights& la) {
    const ModelConfig& c = config_;
    const LinearAttentionConfig& cfg = c.linear_attention;
    const Dim hidden = field("hidden_size", c.hidden_size);
    const Dim key_dim = product(field("linear_num_key_heads", cfg.num_key_heads),
                                field("linear_key_head_dim", cfg.key_head_dim));
    const Dim value_dim = product(field("linear_num_value_heads", cfg.num_value_heads),
                                  field("linear_value_head_dim", cfg.value_head_dim));
    const Dim conv_dim{2 * key_dim.value + value_dim.value,
                       "2 x " + key_dim.why + " + " + value_dim.why};
    const Dim value_heads = field("linear_num_value_heads", cfg.num_value_heads);
    la.in_proj_qkv = linear(p + "in_proj_qkv", conv_dim, hidden);
    la.in_proj_z = linear(p + "in_proj_z", value_dim, hidden);
    la.in_proj_b = linear(p + "in_proj_b", value_heads, hidden);
    la.in_proj_a = linear(p + "in_proj_a", value_heads, hidden);
    la.conv1d = float_tensor(
        p + "conv1d.weight",
        {conv_dim, {1, "depthwise"}, field("linear_conv_kernel_dim", cfg.conv_kernel_dim)},
        "depthwise causal conv");
    la.a_log = float_tensor(p + "A_log", {value_heads}, "decay parameter");
    la.dt_bias = float_tensor(p + "dt_bias", {value_heads}, "time-step bias");
    la.norm = float_tensor(p + "norm.weight", {field("linear_value_head_dim", cfg.value_head_dim)},
                           "gated RMSNorm weight");
    la.out_proj = linear(p + "out_proj", hidden, value_dim);
  }

  // Fused experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] (dense or FP8) as
  // per-expert views.
  void load_fused_experts(const std::string& mlp_prefix, ExpertWeights& out) {
    const ModelConfig& c = config_;
    const int64_t num_experts = c.num_experts, inter = c.moe_intermediate_size,
                  hidden_size = c.hidden_size;
    const Dim experts = experts_dim();
    const Dim hidden = field("hidden_size", hidden_size);
    const Dim intermediate = field("moe_intermediate_size", inter);
    const Dim two_i{2 * inter, "2 x moe_intermediate_size " + std::to_string(inter)};
    const std::string module = mlp_prefix + "experts";
    const std::string gate_up = module + ".gate_up_proj";
    const std::string down = module + ".down_proj";
    out.fused_on_disk = true;

    for (const std::string& name : {gate_up, down}) {
      const bool nvfp4 = has(name + "_weight_scale") || has(name + "_scale") ||
                         has(name + "_weight_scale_2") ||
                         (has(name) && store_.info(name).dtype == DType::kU8);
      MOELORA_CHECK(!nvfp4, ErrorCode::kUnsupported, file(name), ": fused NVFP4 experts ('", name,
                    "') are not supported; store NVFP4 experts per expert "
                    "(mlp.experts.{e}.{gate,up,down}_proj)");
    }
    const bool fp8 = has(gate_up + "_scale_inv") || has(down + "_scale_inv") ||
                     (has(gate_up) && store_.info(gate_up).dtype == DType::kF8E4M3) ||
                     (has(down) && store_.info(down).dtype == DType::kF8E4M3);

    Tensor gu, gu_scale, dn, dn_scale;
    int bn = 128, bk = 128;
    if (fp8) {
      check_quantized_allowed(
          module, QuantMethod::kFp8Block,
          has(gate_up + "_scale_inv") ? gate_up + "_scale_inv" : down + "_scale_inv");
      bn = c.quant.block_n;
      bk = c.quant.block_k;
      MOELORA_CHECK(inter % bn == 0, ErrorCode::kUnsupported, file(gate_up),
                    ": fused FP8 experts '", gate_up, "' have moe_intermediate_size ", inter,
                    ", not a multiple of the ", bn,
                    "-row scale block: one block of gate_up_proj_scale_inv would cover both "
                    "gate and up rows, which the per-expert gate/up layout cannot express");
      auto grid = [](int64_t n, int block) {
        return Dim{ceil_div(n, block),
                   "ceil(" + std::to_string(n) + " / " + std::to_string(block) + ")"};
      };
      gu = tensor(gate_up, {experts, two_i, hidden}, {DType::kF8E4M3}, "fused FP8 gate/up experts");
      gu_scale =
          tensor(gate_up + "_scale_inv", {experts, grid(2 * inter, bn), grid(hidden_size, bk)},
                 {DType::kF32}, "fused FP8 gate/up block scales");
      dn =
          tensor(down, {experts, hidden, intermediate}, {DType::kF8E4M3}, "fused FP8 down experts");
      dn_scale = tensor(down + "_scale_inv", {experts, grid(hidden_size, bn), grid(inter, bk)},
                        {DType::kF32}, "fused FP8 down block scales");
    } else {
      gu = float_tensor(gate_up, {experts, two_i, hidden}, "fused gate/up experts");
      dn = float_tensor(down, {experts, hidden, intermediate}, "fused down experts");
    }

    for (int64_t e = 0; e < num_experts; ++e) {
      const size_t i = static_cast<size_t>(e);
      const std::string tag = "[" + std::to_string(e) + "]";
      LinearWeight base;
      base.format = fp8 ? WeightFormat::kFp8Block : WeightFormat::kDense;
      base.block_n = bn;
      base.block_k = bk;

      LinearWeight& g = out.gate[i] = base;
      g.out_features = inter;
      g.in_features = hidden_size;
      g.weight = gu.select0(e).slice0(0, inter);
      g.name = gate_up + tag + "[0:" + std::to_string(inter) + "]";

      LinearWeight& u = out.up[i] = base;
      u.out_features = inter;
      u.in_features = hidden_size;
      u.weight = gu.select0(e).slice0(inter, 2 * inter);
      u.name = gate_up + tag + "[" + std::to_string(inter) + ":" + std::to_string(2 * inter) + "]";

      LinearWeight& d = out.down[i] = base;
      d.out_features = hidden_size;
      d.in_features = inter;
      d.weight = dn.select0(e);
      d.name = down + tag;

      if (fp8) {
        const int64_t gate_blocks = inter / bn;
        g.scale = gu_scale.select0(e).slice0(0, gate_blocks);
        u.scale = gu_scale.select0(e).slice0(gate_blocks, 2 * gate_blocks);
        d.scale = dn_scale.select0(e);
      }
    }
  }

  const ModelConfig& config_;
  const SafetensorsStore& store_;
  fs::path dir_;
  std::string prefix_;
  std::set<std::string> used_;
};

// Tensors transformers ignores as well (see checkpoint.h).
bool ignorable(const std::string& name, const ModelConfig& config, const std::string& prefix,
               const std::string& lm_head, int64_t declared_layers, int64_t loaded_layers,
               bool tied) {
  if (ends_with(name, ".rotary_emb.inv_freq")) return true;
  if (starts_with(name, "mtp.")) return true;
  if ((ends_with(name, ".k_scale") || ends_with(name, ".v_scale")) &&
      name.find(".self_attn.") != std::string::npos) {
    return true;
  }
  if (tied && name == lm_head + ".weight") return true;
  const std::string layers = prefix + "layers.";
  if (starts_with(name, layers)) {
    const size_t dot = name.find('.', layers.size());
    const std::string index = name.substr(
        layers.size(), dot == std::string::npos ? std::string::npos : dot - layers.size());
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos ||
        index.size() > 9)
      return false;
    const int64_t layer = std::stoll(index);
    if (layer >= loaded_layers && layer < declared_layers) return true;  // cut by max_layers
    return layer >= declared_layers && config.arch == Architecture::kDeepseekV3;  // MTP layer(s)
  }
  // Qwen3_5MoeForCausalLM also drops the vision tower of a checkpoint saved from the VLM.
  if (config.arch == Architecture::kQwen35Moe && starts_with(name, "model.visual.")) return true;
  const bool vlm = config.model_type == "qwen3_5_moe" || config.model_type == "kimi_k25";
  return vlm && !starts_with(name, prefix) && !starts_with(name, lm_head + ".");
}

}  // namespace

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kDense: return "dense";
    case WeightFormat::kFp8Block: return "fp8-block";
    case WeightFormat::kNvfp4: return "nvfp4";
  }
  return "unknown";
}

ModelWeights load_checkpoint(const fs::path& dir, const LoadOptions& options) {
  std::error_code ec;
  MOELORA_CHECK(
      fs::is_directory(dir, ec), ErrorCode::kNotFound, dir.string(),
      ": not a directory (expected a checkpoint directory with config.json and model.safetensors)");
  MOELORA_CHECK(options.max_layers >= 0, ErrorCode::kInvalidArgument, "load_checkpoint(",
                dir.string(), "): max_layers must be >= 0 (0 = all layers), got ",
                options.max_layers);

  ModelWeights weights;
  weights.dir = dir;
  weights.config = load_model_config(dir);
  ModelConfig& config = weights.config;
  const int64_t declared_layers = config.num_hidden_layers;
  if (options.max_layers > 0 && options.max_layers < declared_layers)
    truncate_layers(config, options.max_layers);

  weights.store = SafetensorsStore::open_dir(dir, "model");
  const SafetensorsStore& store = weights.store;
  weights.weight_prefix = resolve_prefix(config, store);
  const std::string lm_head = resolve_lm_head(config, store);
  Loader loader(config, store, dir, weights.weight_prefix);

  const Dim vocab = field("vocab_size", config.vocab_size);
  const Dim hidden = field("hidden_size", config.hidden_size);
  weights.embed_tokens = loader.float_tensor(weights.weight_prefix + "embed_tokens.weight",
                                             {vocab, hidden}, "token embeddings");

  std::optional<ProgressBar> progress;
  if (options.show_progress) {
    progress.emplace("loading " + dir.filename().string(),
                     static_cast<uint64_t>(config.num_hidden_layers), "layers");
  }
  weights.layers.reserve(static_cast<size_t>(config.num_hidden_layers));
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    weights.layers.push_back(loader.layer(layer));
    if (progress) progress->advance();
  }
  if (progress) progress->finish();

  weights.final_norm =
      loader.float_tensor(weights.weight_prefix + "norm.weight", {hidden}, "final RMSNorm weight");
  weights.tied_embeddings = config.tie_word_embeddings;
  if (config.tie_word_embeddings) {
    LinearWeight& head = weights.lm_head;
    head.format = WeightFormat::kDense;
    head.out_features = config.vocab_size;
    head.in_features = config.hidden_size;
    head.weight = weights.embed_tokens;
    head.name = weights.weight_prefix + "embed_tokens.weight";
  } else {
    weights.lm_head = loader.linear(lm_head, vocab, hidden);
  }

  // Every tensor must be accounted for.
  std::vector<std::string> unexplained;
  for (const std::string& name : store.names()) {
    if (loader.used().count(name) != 0) continue;
    if (ignorable(name, config, weights.weight_prefix, lm_head, declared_layers,
                  config.num_hidden_layers, config.tie_word_embeddings)) {
      weights.ignored_tensors.push_back(name);
    } else if (options.allow_unused_tensors) {
      weights.ignored_tensors.push_back(name);
      unexplained.push_back(name);
    } else {
      unexplained.push_back(name);
    }
  }
  if (!unexplained.empty() && !options.allow_unused_tensors) {
    std::string list;
    const size_t shown = std::min<size_t>(unexplained.size(), 5);
    for (size_t i = 0; i < shown; ++i) list += (i ? ", '" : "'") + unexplained[i] + "'";
    if (unexplained.size() > shown) list += ", ...";
    MOELORA_THROW(
        ErrorCode::kInvalidFile, store.source().string(), ": ", unexplained.size(),
        unexplained.size() == 1 ? " tensor is" : " tensors are", " not used by a ",
        config.model_type, " model with ", dir.string(), "/config.json (", config.num_hidden_layers,
        " layers, ", config.num_experts, " experts): ", list,
        "; config.json and the weights disagree (LoadOptions::allow_unused_tensors skips them)");
  }
  return weights;
}

}  // namespace moelora::io
