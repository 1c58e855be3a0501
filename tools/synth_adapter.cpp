// `moelora synth-adapter`: PEFT LoRA adapters with random weights for a model directory, for tests,
// demos and benchmarks.
//
// It writes adapter_config.json + adapter_model.safetensors exactly as PEFT lays them out
// (FORMATS.md §3, tests/data/README.md §7): per-expert 2-D keys, PEFT's target_parameters 3-D
// layout, or the shared-outer 3-D layout SGLang serves, plus plain 2-D LoRA on attention (GQA,
// MLA, Qwen3.5's Gated DeltaNet projections), dense MLP and shared-expert modules. Each target
// exists only on the layers that have the module: self_attn projections on full-attention layers,
// linear_attn projections on Qwen3.5's linear-attention layers, experts and shared_experts on MoE
// layers, mlp on dense layers. B is random (not PEFT's zero init), so the adapter changes the
// model's outputs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

#include "cli.h"
#include "core/error.h"
#include "core/progress.h"
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
using synth::Distribution;
using synth::Source;

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

// Qwen3.5 Gated DeltaNet projections (module linear_attn.<name>), in the order "all" lists them.
const std::vector<std::string>& linear_attention_targets() {
  static const std::vector<std::string> names =
      split_list("in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj");
  return names;
}

bool is_linear_attention_target(const std::string& name) {
  const auto& names = linear_attention_targets();
  return std::find(names.begin(), names.end(), name) != names.end();
}

// Target names synth-adapter knows, in the order "all" lists them.
const std::vector<std::string>& known_targets() {
  static const std::vector<std::string> names = split_list(
      "q_proj,k_proj,v_proj,o_proj,q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,in_proj_qkv,"
      "in_proj_z,in_proj_b,in_proj_a,out_proj,experts,shared_experts,mlp");
  return names;
}

bool is_linear_attention_layer(const ModelConfig& c, int64_t layer) {
  return !c.layer_types.empty() && c.layer_types[static_cast<size_t>(layer)] == "linear_attention";
}

// The targets the model has (on at least one layer).
std::vector<std::string> valid_targets(const ModelConfig& c) {
  std::vector<std::string> out;
  bool any_full = false, any_linear = false, any_moe = false, any_dense = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    (is_linear_attention_layer(c, l) ? any_linear : any_full) = true;
    (c.is_moe_layer(l) ? any_moe : any_dense) = true;
  }
  if (any_full && c.use_mla) {
    if (c.q_lora_rank > 0) {
      out.insert(out.end(), {"q_a_proj", "q_b_proj"});
    } else {
      out.push_back("q_proj");
    }
    out.insert(out.end(), {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"});
  } else if (any_full) {
    out.insert(out.end(), {"q_proj", "k_proj", "v_proj", "o_proj"});
  }
  if (any_linear) {
    const auto& linear = linear_attention_targets();
    out.insert(out.end(), linear.begin(), linear.end());
  }
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
    const std::string a = p + "self_attn.";
    if (is_linear_attention_layer(c, layer)) {
      const io::LinearAttentionConfig& la = c.linear_attention;
      const int64_t key_dim = la.num_key_heads * la.key_head_dim;
      const int64_t value_dim = la.num_value_heads * la.value_head_dim;
      const std::string g = p + "linear_attn.";
      if (has("in_proj_qkv")) pair(g + "in_proj_qkv", 2 * key_dim + value_dim, H);
      if (has("in_proj_z")) pair(g + "in_proj_z", value_dim, H);
      if (has("in_proj_b")) pair(g + "in_proj_b", la.num_value_heads, H);
      if (has("in_proj_a")) pair(g + "in_proj_a", la.num_value_heads, H);
      if (has("out_proj")) pair(g + "out_proj", H, value_dim);
    } else if (c.use_mla) {
      const int64_t heads = c.num_attention_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (has("q_proj")) pair(a + "q_proj", heads * qk, H);
      if (has("q_a_proj")) pair(a + "q_a_proj", c.q_lora_rank, H);
      if (has("q_b_proj")) pair(a + "q_b_proj", heads * qk, c.q_lora_rank);
      if (has("kv_a_proj_with_mqa"))
        pair(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H);
      if (has("kv_b_proj"))
        pair(a + "kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
      if (has("o_proj")) pair(a + "o_proj", H, heads * c.v_head_dim);
    } else {
      // Qwen3.5's gated attention: q_proj also produces the output gate (2 x the query width)
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
  std::vector<std::string> attention, linear_attention;  // self_attn.* / linear_attn.* leaves
  for (const std::string& t : targets) {
    if (t == "experts" || t == "shared_experts" || t == "mlp") continue;
    (is_linear_attention_target(t) ? linear_attention : attention).push_back(t);
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
    names.insert(names.end(), linear_attention.begin(), linear_attention.end());
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
    if (!linear_attention.empty())
      alternatives.push_back("linear_attn\\.(" + join(linear_attention, "|") + ")");
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
  synth::prepare_output_dir(out);

  synth::write_json_file(out / "adapter_config.json",
                         adapter_config_json(c, targets, layout, o, model_dir));
  io::SafetensorsWriter writer;
  uint64_t parameters = 0;
  plan_adapter(c, targets, layout, o.rank, [&](Factor f) {
    const Source src{synth::stream_key(o.seed, f.name), f.init};
    const int64_t numel = shape_numel(f.shape);
    parameters += static_cast<uint64_t>(numel);
    // fill_float splits each tensor over the thread pool; bf16 rounds each value once.
    writer.add(f.name, factor_dtype, f.shape, [src, numel, factor_dtype](void* dst) {
      synth::fill_float(dst, factor_dtype, src, numel);
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
                 "kv_a_proj_with_mqa, kv_b_proj, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, "
                 "out_proj (Qwen3.5 Gated DeltaNet), experts, shared_experts, mlp (dense "
                 "layers), or all (everything the model has)")
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
      "targets (self_attn) exist on every full-attention layer, the Gated DeltaNet ones\n"
      "(linear_attn) on Qwen3.5's linear-attention layers, experts and shared_experts on MoE\n"
      "layers, mlp on dense layers.");
  return [o] { return run_synth_adapter(*o); };
}

MOELORA_SUBCOMMAND("synth-adapter",
                   "Write a PEFT LoRA adapter with random weights for a model directory", 61,
                   setup_synth_adapter);

}  // namespace
}  // namespace moelora::cli
