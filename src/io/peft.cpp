// PEFT LoRA adapter loading: adapter_model.safetensors normalized to the canonical
// A [Ea, R, in] / B [Eb, out, R] form of DESIGN.md §2 for the base model's architecture (see
// io/peft.h for the accepted layouts). adapter_config.json and PEFT's matching and scaling rules
// are in peft_config.cpp.
//
// Loading works in three passes over the tensor names, so that adapters with tens of thousands of
// tensors (48 layers x 128 experts x 6) cost O(n log n):
//   1. every key is split into a module path and a factor (lora_A / lora_B) and the module is
//      classified against the base model (which layer, which target, which expert layout);
//      anything the base model does not have is rejected here, naming the key;
//   2. the pairs are checked (every A has its B) and grouped per layer and target;
//   3. each target's factors are validated (shapes, ranks vs adapter_config.json) and written
//      once, straight from the mmap'ed file, into freshly allocated fp32 canonical tensors.
#include "io/peft.h"
#include "io/peft_internal.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>
#include <string_view>

#include "core/error.h"
#include "io/safetensors.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using peft_detail::ends_with;
using peft_detail::last_component;
using peft_detail::parse_index;
using peft_detail::starts_with;

constexpr std::string_view kPeftPrefix = "base_model.model.";

std::string format_number(double value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

// "0-2, 5, 7-9"
std::string format_ranges(const std::vector<int64_t>& sorted) {
  std::string out;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(sorted[i]);
    if (j > i) out += "-" + std::to_string(sorted[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ExpertLoraLayout

const char* expert_lora_layout_name(ExpertLoraLayout l) {
  switch (l) {
    case ExpertLoraLayout::kNone: return "none";
    case ExpertLoraLayout::kPerExpert: return "per-expert";
    case ExpertLoraLayout::kPeft3d: return "peft-3d";
    case ExpertLoraLayout::kStacked: return "stacked";
    case ExpertLoraLayout::kSharedOuter: return "shared-outer";
  }
  return "?";
}
// ---------------------------------------------------------------------------------------------
// LayerLora

std::vector<std::pair<std::string, const LoraWeights*>> LayerLora::named() const {
  const std::string shared = "mlp." + shared_expert_module + ".";
  return {{"self_attn.q_proj", &q_proj},
          {"self_attn.k_proj", &k_proj},
          {"self_attn.v_proj", &v_proj},
          {"self_attn.o_proj", &o_proj},
          {"self_attn.q_a_proj", &q_a_proj},
          {"self_attn.q_b_proj", &q_b_proj},
          {"self_attn.kv_a_proj_with_mqa", &kv_a_proj_with_mqa},
          {"self_attn.kv_b_proj", &kv_b_proj},
          {"linear_attn.in_proj_qkv", &in_proj_qkv},
          {"linear_attn.in_proj_z", &in_proj_z},
          {"linear_attn.in_proj_b", &in_proj_b},
          {"linear_attn.in_proj_a", &in_proj_a},
          {"linear_attn.out_proj", &out_proj},
          {"mlp.gate_proj", &mlp_gate},
          {"mlp.up_proj", &mlp_up},
          {"mlp.down_proj", &mlp_down},
          {shared + "gate_proj", &shared_gate},
          {shared + "up_proj", &shared_up},
          {shared + "down_proj", &shared_down},
          {"mlp.experts.gate_up_proj", &experts_gate_up},
          {"mlp.experts.down_proj", &experts_down}};
}

bool LayerLora::any() const {
  for (const auto& [name, weights] : named()) {
    if (weights->defined()) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// load_adapter

namespace {

// 2-D targets, in the order of LayerLora's fields (and of LayerLora::named(), whose first
// kNumPlain entries they are).
enum class Plain {
  kQ,
  kK,
  kV,
  kO,
  kQA,
  kQB,
  kKVA,
  kKVB,
  kInProjQkv,
  kInProjZ,
  kInProjB,
  kInProjA,
  kOutProj,
  kMlpGate,
  kMlpUp,
  kMlpDown,
  kSharedGate,
  kSharedUp,
  kSharedDown
};
constexpr size_t kNumPlain = 19;

LoraWeights& plain_slot(LayerLora& layer, Plain p) {
  switch (p) {
    case Plain::kQ: return layer.q_proj;
    case Plain::kK: return layer.k_proj;
    case Plain::kV: return layer.v_proj;
    case Plain::kO: return layer.o_proj;
    case Plain::kQA: return layer.q_a_proj;
    case Plain::kQB: return layer.q_b_proj;
    case Plain::kKVA: return layer.kv_a_proj_with_mqa;
    case Plain::kKVB: return layer.kv_b_proj;
    case Plain::kInProjQkv: return layer.in_proj_qkv;
    case Plain::kInProjZ: return layer.in_proj_z;
    case Plain::kInProjB: return layer.in_proj_b;
    case Plain::kInProjA: return layer.in_proj_a;
    case Plain::kOutProj: return layer.out_proj;
    case Plain::kMlpGate: return layer.mlp_gate;
    case Plain::kMlpUp: return layer.mlp_up;
    case Plain::kMlpDown: return layer.mlp_down;
    case Plain::kSharedGate: return layer.shared_gate;
    case Plain::kSharedUp: return layer.shared_up;
    case Plain::kSharedDown: return layer.shared_down;
  }
  MOELORA_ASSERT(false);
  return layer.q_proj;
}

// How a routed-expert tensor is keyed.
enum class ExpertForm { kNone, kPerExpert, kPeft3dOuter, kPeft3dInner, kStacked };
// Projections of the per-expert and stacked layouts (gate_up: a fused stacked LoRA).
enum class ExpertProj { kGate = 0, kUp = 1, kDown = 2, kGateUp = 3 };
constexpr std::array<const char*, 4> kExpertProjNames = {"gate_proj", "up_proj", "down_proj",
                                                         "gate_up_proj"};

struct ModuleRef {
  int64_t layer = -1;
  std::string layer_prefix;  // module path up to and including "layers.<L>."
  ExpertForm form = ExpertForm::kNone;
  Plain plain = Plain::kQ;              // when form == kNone
  int64_t expert = -1;                  // kPerExpert
  ExpertProj proj = ExpertProj::kGate;  // kPerExpert, kStacked
  int64_t in = 0, out = 0;  // expected features (all but PEFT 3-D, which is resolved by shape)
};

struct ModuleEntry {
  ModuleRef ref;
  std::string module;        // path without "base_model.model."
  std::string key_a, key_b;  // tensor names in the file ("" when absent)
};

// Everything a classification error needs to say where it is.
struct Where {
  const std::string& file;
  const std::string& key;
};

[[noreturn]] void another_architecture(const Where& w, const std::string& why) {
  MOELORA_THROW(ErrorCode::kUnsupported, w.file, ": tensor '", w.key,
                "': adapter was made for another architecture: ", why);
}
[[noreturn]] void unsupported_target(const Where& w, const std::string& what) {
  MOELORA_THROW(ErrorCode::kUnsupported, w.file, ": tensor '", w.key, "': ", what,
                " is not supported");
}

bool is_linear_attention_layer(const ModelConfig& base, int64_t layer) {
  return static_cast<size_t>(layer) < base.layer_types.size() &&
         base.layer_types[static_cast<size_t>(layer)] == "linear_attention";
}

bool has_linear_attention(const ModelConfig& base) {
  return std::find(base.layer_types.begin(), base.layer_types.end(), "linear_attention") !=
         base.layer_types.end();
}

std::string describe_base(const ModelConfig& base) {
  std::string out = architecture_name(base.arch);
  if (base.use_mla) {
    out += base.q_lora_rank > 0 ? " (MLA, q_lora_rank " + std::to_string(base.q_lora_rank) + ")"
                                : " (MLA, plain q_proj)";
  } else {
    out += base.attention_output_gate ? " (gated GQA attention" : " (GQA attention";
    if (has_linear_attention(base)) out += " and Gated DeltaNet linear attention";
    out += ")";
  }
  return out;
}

// Which part of `base` the module path names (module = key without "base_model.model." and without
// the lora_A/lora_B suffix). Throws for modules the base model does not have or that are not
// supported as LoRA targets.
ModuleRef classify_module(const std::string& module, const ModelConfig& base, const Where& w) {
  ModuleRef ref;
  // The decoder's prefix: the base checkpoint's, or any of the spellings transformers uses.
  std::string rest;
  for (const std::string& prefix :
       {base.weight_prefix, std::string("model."), std::string("model.language_model."),
        std::string("language_model.model.")}) {
    if (starts_with(module, prefix + "layers.")) {
      rest = module.substr(prefix.size() + 7);
      ref.layer_prefix = prefix + "layers.";
      break;
    }
  }
  if (ref.layer_prefix.empty()) {
    const std::string leaf = last_component(module);
    if (leaf == "embed_tokens") unsupported_target(w, "LoRA on the token embedding (embed_tokens)");
    if (leaf == "lm_head") unsupported_target(w, "LoRA on the output projection (lm_head)");
    another_architecture(
        w, "the base model " + describe_base(base) + " has no module '" + module + "'");
  }

  const size_t dot = rest.find('.');
  const auto layer = parse_index(rest.substr(0, dot));
  if (!layer || dot == std::string::npos) {
    another_architecture(
        w, "'" + module + "' does not name a decoder layer of " + describe_base(base));
  }
  if (*layer >= base.num_hidden_layers) {
    another_architecture(w, "it adapts layer " + std::to_string(*layer) +
                                " but the base model has " +
                                std::to_string(base.num_hidden_layers) + " layers");
  }
  ref.layer = *layer;
  ref.layer_prefix += std::to_string(*layer) + ".";
  const std::string sub = rest.substr(dot + 1);
  const std::string where_in_layer = "layer " + std::to_string(ref.layer) + " of the base model";

  const int64_t H = base.hidden_size;
  auto plain = [&](Plain p, int64_t in, int64_t out) {
    ref.plain = p;
    ref.in = in;
    ref.out = out;
    return ref;
  };

  if (starts_with(sub, "self_attn.")) {
    const std::string name = sub.substr(10);
    if (is_linear_attention_layer(base, ref.layer)) {
      another_architecture(
          w, where_in_layer + " is a Gated DeltaNet (linear attention) layer; it has no " + sub);
    }
    const int64_t heads = base.num_attention_heads;
    if (base.use_mla) {
      const int64_t qk = base.qk_head_dim();
      if (name == "q_proj") {
        if (base.q_lora_rank > 0) {
          another_architecture(w, describe_base(base) +
                                      " has no self_attn.q_proj: queries go through q_a_proj and "
                                      "q_b_proj");
        }
        return plain(Plain::kQ, H, heads * qk);
      }
      if (name == "q_a_proj" || name == "q_b_proj") {
        if (base.q_lora_rank == 0) {
          another_architecture(w, describe_base(base) + " has no self_attn." + name +
                                      " (q_lora_rank is null: it "
                                      "has a plain q_proj)");
        }
        return name == "q_a_proj" ? plain(Plain::kQA, H, base.q_lora_rank)
                                  : plain(Plain::kQB, base.q_lora_rank, heads * qk);
      }
      if (name == "kv_a_proj_with_mqa")
        return plain(Plain::kKVA, H, base.kv_lora_rank + base.qk_rope_head_dim);
      if (name == "kv_b_proj") {
        return plain(Plain::kKVB, base.kv_lora_rank,
                     heads * (base.qk_nope_head_dim + base.v_head_dim));
      }
      if (name == "o_proj") return plain(Plain::kO, heads * base.v_head_dim, H);
    } else {
      const int64_t q_out = heads * base.head_dim * (base.attention_output_gate ? 2 : 1);
      const int64_t kv_out = base.num_key_value_heads * base.head_dim;
      if (name == "q_proj") return plain(Plain::kQ, H, q_out);
      if (name == "k_proj") return plain(Plain::kK, H, kv_out);
      if (name == "v_proj") return plain(Plain::kV, H, kv_out);
      if (name == "o_proj") return plain(Plain::kO, heads * base.head_dim, H);
    }
    another_architecture(w, describe_base(base) + " has no LoRA target self_attn." + name);
  }
  if (starts_with(sub, "linear_attn.")) {
    // Qwen3.5's Gated DeltaNet (FORMATS.md §1.4-1.5), key_dim = nk dk, value_dim = nv dv:
    // in_proj_qkv [2 key_dim + value_dim, H], in_proj_z [value_dim, H], in_proj_b / in_proj_a
    // [nv, H], out_proj [H, value_dim].
    const std::string name = sub.substr(12);
    if (!is_linear_attention_layer(base, ref.layer)) {
      if (!has_linear_attention(base)) {
        another_architecture(w, "the base model " + describe_base(base) +
                                    " has no Gated DeltaNet (linear attention) layers; layer " +
                                    std::to_string(ref.layer) + " has no " + sub);
      }
      another_architecture(w, where_in_layer + " is a full-attention layer of " +
                                  describe_base(base) + "; it has no " + sub +
                                  " (only its linear_attention layers have linear_attn)");
    }
    const LinearAttentionConfig& la = base.linear_attention;
    const int64_t key_dim = la.num_key_heads * la.key_head_dim;
    const int64_t value_dim = la.num_value_heads * la.value_head_dim;
    if (name == "in_proj_qkv") return plain(Plain::kInProjQkv, H, 2 * key_dim + value_dim);
    if (name == "in_proj_z") return plain(Plain::kInProjZ, H, value_dim);
    if (name == "in_proj_b") return plain(Plain::kInProjB, H, la.num_value_heads);
    if (name == "in_proj_a") return plain(Plain::kInProjA, H, la.num_value_heads);
    if (name == "out_proj") return plain(Plain::kOutProj, value_dim, H);
    if (name == "conv1d" || name == "A_log" || name == "dt_bias" || name == "norm") {
      unsupported_target(w, "LoRA on " + sub +
                                " (LoRA targets of the Gated DeltaNet are its linear projections "
                                "in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj)");
    }
    another_architecture(w, describe_base(base) + " has no LoRA target " + sub +
                                " (its Gated DeltaNet projections are in_proj_qkv, in_proj_z, "
                                "in_proj_b, in_proj_a and out_proj)");
  }
  if (sub == "mlp.gate") unsupported_target(w, "LoRA on the router (mlp.gate)");
  if (sub == "mlp.shared_expert_gate")
    unsupported_target(w, "LoRA on the shared-expert gate (mlp.shared_expert_gate)");
  if (!starts_with(sub, "mlp."))
    another_architecture(w, describe_base(base) + " has no LoRA target " + sub);

  const bool moe = base.is_moe_layer(ref.layer);
  const std::string mlp = sub.substr(4);
  auto mlp_proj = [&](const std::string& name, Plain gate, Plain up, Plain down, int64_t inter) {
    if (name == "gate_proj") return plain(gate, H, inter);
    if (name == "up_proj") return plain(up, H, inter);
    if (name == "down_proj") return plain(down, inter, H);
    another_architecture(w, describe_base(base) + " has no LoRA target " + sub);
  };
  if (mlp == "gate_proj" || mlp == "up_proj" || mlp == "down_proj") {
    if (moe) another_architecture(w, where_in_layer + " is a MoE layer; it has no dense " + sub);
    return mlp_proj(mlp, Plain::kMlpGate, Plain::kMlpUp, Plain::kMlpDown, base.intermediate_size);
  }
  if (starts_with(mlp, "shared_expert.") || starts_with(mlp, "shared_experts.")) {
    const std::string name = mlp.substr(mlp.find('.') + 1);
    const std::string module_name = mlp.substr(0, mlp.find('.'));
    const std::string expected =
        base.arch == Architecture::kDeepseekV3 ? "shared_experts" : "shared_expert";
    if (module_name != expected || base.shared_expert_intermediate_size == 0 || !moe) {
      another_architecture(w, where_in_layer + " has no mlp." + module_name +
                                  (base.shared_expert_intermediate_size > 0 && moe
                                       ? " (its shared expert is mlp." + expected + ")"
                                       : std::string(" (no shared expert)")));
    }
    return mlp_proj(name, Plain::kSharedGate, Plain::kSharedUp, Plain::kSharedDown,
                    base.shared_expert_intermediate_size);
  }
  if (mlp == "experts" || starts_with(mlp, "experts.")) {
    if (!moe)
      another_architecture(w, where_in_layer + " has a dense MLP; it has no routed experts");
    const std::string after = mlp.substr(7);  // "", ".base_layer", ".<e>.<proj>" or ".<proj>"
    if (after.empty()) {
      ref.form = ExpertForm::kPeft3dOuter;
      return ref;
    }
    if (after == ".base_layer") {
      ref.form = ExpertForm::kPeft3dInner;
      return ref;
    }
    std::string proj_name = after.substr(1);
    const size_t next = proj_name.find('.');
    if (next != std::string::npos) {
      const auto expert = parse_index(proj_name.substr(0, next));
      if (!expert) another_architecture(w, describe_base(base) + " has no LoRA target " + sub);
      if (*expert >= base.num_experts) {
        another_architecture(w, "it adapts expert " + std::to_string(*expert) +
                                    " but the base model has " + std::to_string(base.num_experts) +
                                    " routed experts per layer");
      }
      ref.form = ExpertForm::kPerExpert;
      ref.expert = *expert;
      proj_name = proj_name.substr(next + 1);
    } else {
      ref.form = ExpertForm::kStacked;
    }
    const int64_t I = base.moe_intermediate_size;
    if (proj_name == "gate_proj" || proj_name == "up_proj") {
      ref.proj = proj_name == "gate_proj" ? ExpertProj::kGate : ExpertProj::kUp;
      ref.in = H;
      ref.out = I;
    } else if (proj_name == "down_proj") {
      ref.proj = ExpertProj::kDown;
      ref.in = I;
      ref.out = H;
    } else if (proj_name == "gate_up_proj" && ref.form == ExpertForm::kStacked) {
      ref.proj = ExpertProj::kGateUp;
      ref.in = H;
      ref.out = 2 * I;
    } else {
      another_architecture(w, describe_base(base) + " has no LoRA target " + sub);
    }
    return ref;
  }
  another_architecture(w, describe_base(base) + " has no LoRA target " + sub);
}

// One LoRA factor as stored: element (i, j) of the logical [rows, cols] matrix is element
// offset + i * row_stride + j * col_stride of `t` (any float dtype, read through load_as_f32 so
// unaligned mmap'ed data is fine).
struct FactorView {
  Tensor t;
  int64_t offset = 0, row_stride = 0, col_stride = 1;
  int64_t rows = 0, cols = 0;

  // dst[0, cols) = row i * ratio (ratio 1: the stored value converted to fp32, exactly).
  void copy_row(int64_t i, float* dst, double ratio) const {
    const int64_t start = offset + i * row_stride;
    if (t.dtype() == DType::kF32 && col_stride == 1 && ratio == 1.0) {
      std::memcpy(dst, static_cast<const char*>(t.raw_data()) + 4 * start,
                  static_cast<size_t>(cols) * 4);
      return;
    }
    for (int64_t j = 0; j < cols; ++j) {
      const float v =
          load_as_f32(t.raw_data(), t.dtype(), static_cast<uint64_t>(start + j * col_stride));
      dst[j] = ratio == 1.0 ? v : static_cast<float>(static_cast<double>(v) * ratio);
    }
  }
};

FactorView matrix_view(const Tensor& t, int64_t index, int64_t rows, int64_t cols) {
  return FactorView{t, index * rows * cols, cols, 1, rows, cols};
}

// A block of one canonical target: its rows [out_offset, out_offset + out_rows) of the fused
// output and `rank` columns of R, for every expert.
struct Part {
  std::string label;  // "gate_proj", "up_proj", ... for messages
  int64_t out_offset = 0, out_rows = 0;
  std::vector<FactorView> a, b;  // one (shared by all experts) or one per expert
  std::vector<double> scaling;   // per expert (one entry for plain targets)
  int64_t rank = 0;              // the largest rank of any expert

  bool uniform_scaling() const {
    return std::all_of(scaling.begin(), scaling.end(), [&](double s) { return s == scaling[0]; });
  }
};

// Writes the canonical A [Ea, R, in], B [Eb, out, R] of a target made of `parts` (blocks on the
// diagonal: part p takes rows [out_offset, +out_rows) and its own columns of R).
LoraWeights assemble(const std::vector<Part>& parts, int64_t num_experts, int64_t out_total,
                     int64_t in) {
  int64_t total_rank = 0;
  bool share_a = true, share_b = true;
  std::vector<double> all_scalings;
  for (const Part& p : parts) {
    total_rank += p.rank;
    share_a = share_a && p.a.size() == 1;
    share_b = share_b && p.b.size() == 1 && p.uniform_scaling();
    all_scalings.insert(all_scalings.end(), p.scaling.begin(), p.scaling.end());
  }
  // One scaling for the target: the common one, else the largest in magnitude with the ratios of
  // the others folded into their B rows.
  double s = all_scalings.at(0);
  for (double value : all_scalings) {
    if (std::abs(value) > std::abs(s)) s = value;
  }

  const int64_t ea = share_a ? 1 : num_experts;
  const int64_t eb = share_b ? 1 : num_experts;
  LoraWeights w;
  w.a = Tensor::zeros(DType::kF32, {ea, total_rank, in});
  w.b = Tensor::zeros(DType::kF32, {eb, out_total, total_rank});
  w.scaling = static_cast<float>(s);
  float* a = w.a.data<float>();
  float* b = w.b.data<float>();
  for (int64_t e = 0; e < ea; ++e) {
    int64_t column = 0;
    for (const Part& p : parts) {
      const FactorView& view = p.a[p.a.size() == 1 ? 0 : e];
      for (int64_t k = 0; k < view.rows; ++k)
        view.copy_row(k, a + (e * total_rank + column + k) * in, 1.0);
      column += p.rank;
    }
  }
  for (int64_t e = 0; e < eb; ++e) {
    int64_t column = 0;
    for (const Part& p : parts) {
      const FactorView& view = p.b[p.b.size() == 1 ? 0 : e];
      const double part_scaling = p.scaling[p.scaling.size() == 1 ? 0 : e];
      const double ratio = part_scaling == s ? 1.0 : part_scaling / s;
      for (int64_t o = 0; o < view.rows; ++o) {
        view.copy_row(o, b + (e * out_total + p.out_offset + o) * total_rank + column, ratio);
      }
      column += p.rank;
    }
  }
  return w;
}

// Per-layer collection of the routed-expert tensors.
struct LayerExperts {
  std::set<ExpertForm> forms;
  const ModuleEntry* peft3d_outer = nullptr;
  const ModuleEntry* peft3d_inner = nullptr;
  std::array<std::vector<const ModuleEntry*>, 3> per_expert;  // gate, up, down; one slot per expert
  std::array<const ModuleEntry*, 4> stacked{};                // gate, up, down, gate_up
  std::string layer_prefix;
};

const char* form_name(ExpertForm form) {
  switch (form) {
    case ExpertForm::kPerExpert: return "per-expert 2-D (mlp.experts.{e}.<proj>)";
    case ExpertForm::kPeft3dOuter:
    case ExpertForm::kPeft3dInner: return "PEFT 3-D (mlp.experts[.base_layer].lora_*)";
    case ExpertForm::kStacked:
      return "stacked 3-D (mlp.experts.<proj>.lora_* with an expert dimension)";
    case ExpertForm::kNone: break;
  }
  return "none";
}

class AdapterLoader {
 public:
  AdapterLoader(const fs::path& dir, const ModelConfig& base, const std::string& name,
                const AdapterLoadOptions& options)
      : dir_(dir), base_(base), name_(name), options_(options) {}

  LoraAdapter load();

 private:
  void collect();
  void check_pairs_and_dtypes();
  void check_targeted(const ModuleEntry& entry) const;
  LoraWeights load_plain(const ModuleEntry& entry);
  void load_experts(int64_t layer, LayerExperts& experts, LayerLora& out);
  std::vector<Part> per_expert_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  std::vector<Part> peft3d_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  std::vector<Part> stacked_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  void check_max_rank(const LoraWeights& w, int64_t layer, const std::string& target,
                      const std::string& detail) const;

  // Validations shared by the layouts; `module` is the module path for messages.
  void check_ndim(const Tensor& t, int ndim, const std::string& factor, const std::string& module,
                  const char* layout) const;
  void check_rank_vs_config(int64_t rank, const std::string& path, const std::string& module,
                            const std::string& how) const;
  void check_feature(const Tensor& t, int dim, int64_t expected, const std::string& factor,
                     const std::string& module, const char* feature) const;

  const fs::path dir_;
  const ModelConfig& base_;
  const std::string name_;
  const AdapterLoadOptions options_;
  AdapterConfig config_;
  SafetensorsStore store_;
  std::string file_;  // the safetensors file (or index), for messages
  std::string config_file_;
  std::map<std::string, ModuleEntry> modules_;  // by module path
  int64_t num_tensors_ = 0;
  std::vector<std::array<const ModuleEntry*, kNumPlain>> plain_;  // per layer
  std::vector<LayerExperts> experts_;                             // per layer
};

void AdapterLoader::collect() {
  for (const std::string& key : store_.names()) {
    ++num_tensors_;
    std::string_view name = key;
    if (starts_with(name, kPeftPrefix)) name.remove_prefix(kPeftPrefix.size());
    const Where where{file_, key};
    bool is_b = false;
    std::string module;
    for (const auto& [suffix, b] : {std::pair<std::string_view, bool>{".lora_A.weight", false},
                                    {".lora_B.weight", true},
                                    {".lora_A", false},
                                    {".lora_B", true}}) {
      if (ends_with(name, suffix)) {
        module = std::string(name.substr(0, name.size() - suffix.size()));
        is_b = b;
        break;
      }
    }
    if (module.empty()) {
      if (ends_with(name, ".lora_A.bias") || ends_with(name, ".lora_B.bias")) {
        unsupported_target(where, "a LoRA bias (lora_bias)");
      }
      if (name.find("lora_embedding_") != std::string_view::npos) {
        unsupported_target(where, "LoRA on an embedding (lora_embedding_A/B)");
      }
      if (name.find("lora_magnitude_vector") != std::string_view::npos) {
        unsupported_target(where, "DoRA (lora_magnitude_vector)");
      }
      if (name.find("modules_to_save") != std::string_view::npos) {
        unsupported_target(where, "a full module copy (modules_to_save)");
      }
      MOELORA_THROW(
          ErrorCode::kUnsupported, file_, ": tensor '", key,
          "' is not a LoRA factor (expected a name ending in lora_A.weight or lora_B.weight); full "
          "weights and other PEFT methods are not supported");
    }
    auto [it, inserted] = modules_.try_emplace(module);
    ModuleEntry& entry = it->second;
    if (inserted) {
      entry.module = module;
      entry.ref = classify_module(module, base_, where);
    }
    std::string& slot = is_b ? entry.key_b : entry.key_a;
    MOELORA_CHECK(slot.empty(), ErrorCode::kInvalidFile, file_, ": '", slot, "' and '", key,
                  "' are both the ", is_b ? "lora_B" : "lora_A", " of '", module, "'");
    slot = key;
  }
  MOELORA_CHECK(num_tensors_ > 0, ErrorCode::kInvalidFile, file_, ": holds no tensors");
}

void AdapterLoader::check_pairs_and_dtypes() {
  for (const auto& [module, entry] : modules_) {
    const bool has_a = !entry.key_a.empty(), has_b = !entry.key_b.empty();
    if (!has_a || !has_b) {
      const std::string& present = has_a ? entry.key_a : entry.key_b;
      std::string missing = present;
      const size_t at = missing.rfind(has_a ? "lora_A" : "lora_B");
      missing.replace(at, 6, has_a ? "lora_B" : "lora_A");
      MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": '", present, "' has no matching ",
                    has_a ? "lora_B" : "lora_A", " ('", missing, "' is missing)");
    }
    for (const std::string* key : {&entry.key_a, &entry.key_b}) {
      const DType dtype = store_.info(*key).dtype;
      MOELORA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 ||
                        dtype == DType::kF64,
                    ErrorCode::kUnsupported, file_, ": tensor '", *key, "' has dtype ",
                    dtype_name(dtype), "; LoRA factors must be F32, BF16, F16 or F64");
    }
  }
}

void AdapterLoader::check_targeted(const ModuleEntry& entry) const {
  MOELORA_CHECK(config_.targets_module(entry.module), ErrorCode::kInvalidFile, file_, ": tensor '",
                entry.key_a, "' adapts '", entry.module, "', which ", config_file_,
                " does not target (see target_modules, exclude_modules and layers_to_transform)");
}

void AdapterLoader::check_ndim(const Tensor& t, int ndim, const std::string& factor,
                               const std::string& module, const char* layout) const {
  MOELORA_CHECK(t.ndim() == ndim, ErrorCode::kInvalidFile, file_, ": ", factor, " of '", module,
                "' has shape ", shape_str(t.shape()), "; the ", layout, " layout needs a ", ndim,
                "-D tensor");
}

void AdapterLoader::check_rank_vs_config(int64_t rank, const std::string& path,
                                         const std::string& module, const std::string& how) const {
  const int64_t expected = config_.rank_for(path);
  if (rank == expected) return;
  const auto key = config_.rank_pattern_key(path);
  MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": lora_A of '", module, "' has rank ", rank, how,
                " but ", config_file_, " says r=", expected,
                key ? " (rank_pattern key '" + *key + "')" : std::string(" (field 'r')"));
}

void AdapterLoader::check_feature(const Tensor& t, int dim, int64_t expected,
                                  const std::string& factor, const std::string& module,
                                  const char* feature) const {
  if (t.dim(dim) == expected) return;
  Shape want = t.shape();
  want[static_cast<size_t>(dim < 0 ? t.ndim() + dim : dim)] = expected;
  MOELORA_THROW(ErrorCode::kUnsupported, file_, ": ", factor, " of '", module, "' has shape ",
                shape_str(t.shape()), ", expected ", shape_str(want), ": ", feature,
                " of this module in the base model ", describe_base(base_), " is ", expected,
                " (the adapter was made for another model)");
}

LoraWeights AdapterLoader::load_plain(const ModuleEntry& entry) {
  check_targeted(entry);
  const Tensor a = store_.tensor(entry.key_a), b = store_.tensor(entry.key_b);
  check_ndim(a, 2, "lora_A", entry.module, "2-D module");
  check_ndim(b, 2, "lora_B", entry.module, "2-D module");
  const int64_t rank = a.dim(0);
  MOELORA_CHECK(b.dim(1) == rank, ErrorCode::kInvalidFile, file_, ": lora_B of '", entry.module,
                "' has shape ", shape_str(b.shape()), " but lora_A has rank ", rank, " (shape ",
                shape_str(a.shape()), ")");
  check_rank_vs_config(rank, entry.module, entry.module, "");
  check_feature(a, 1, entry.ref.in, "lora_A", entry.module, "in_features");
  check_feature(b, 0, entry.ref.out, "lora_B", entry.module, "out_features");

  Part part;
  part.label = last_component(entry.module);
  part.out_rows = entry.ref.out;
  part.a = {matrix_view(a, 0, rank, entry.ref.in)};
  part.b = {matrix_view(b, 0, entry.ref.out, rank)};
  part.scaling = {config_.scaling_for(entry.module)};
  part.rank = rank;
  return assemble({part}, 1, entry.ref.out, entry.ref.in);
}

std::vector<Part> AdapterLoader::per_expert_parts(int64_t layer, LayerExperts& experts,
                                                  bool gate_up) {
  const int64_t E = base_.num_experts, I = base_.moe_intermediate_size, H = base_.hidden_size;
  std::vector<Part> parts;
  for (ExpertProj proj : gate_up ? std::vector<ExpertProj>{ExpertProj::kGate, ExpertProj::kUp}
                                 : std::vector<ExpertProj>{ExpertProj::kDown}) {
    const auto& entries = experts.per_expert[static_cast<size_t>(proj)];
    const int64_t present =
        std::count_if(entries.begin(), entries.end(), [](const ModuleEntry* e) { return e; });
    if (present == 0) continue;
    const char* proj_name = kExpertProjNames[static_cast<size_t>(proj)];
    const int64_t in = proj == ExpertProj::kDown ? I : H, out = proj == ExpertProj::kDown ? H : I;
    Part part;
    part.label = proj_name;
    part.out_offset = proj == ExpertProj::kUp ? I : 0;
    part.out_rows = out;
    part.a.resize(static_cast<size_t>(E));
    part.b.resize(static_cast<size_t>(E));
    part.scaling.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const std::string path =
          experts.layer_prefix + "mlp.experts." + std::to_string(e) + "." + proj_name;
      part.scaling[static_cast<size_t>(e)] = config_.scaling_for(path);
      const ModuleEntry* entry = entries[static_cast<size_t>(e)];
      if (entry == nullptr) {
        // Absent experts are fine only where the config does not target them (the adapter then
        // declares them unadapted); otherwise the file is incomplete.
        MOELORA_CHECK(!config_.targets_module(path), ErrorCode::kInvalidFile, file_,
                      ": per-expert LoRA of layer ", layer, " has mlp.experts.{e}.", proj_name,
                      " for ", present, " of ", E, " experts; missing: '", path,
                      "' (its lora_A and lora_B), which ", config_file_, " targets");
        continue;
      }
      check_targeted(*entry);
      const Tensor a = store_.tensor(entry->key_a), b = store_.tensor(entry->key_b);
      check_ndim(a, 2, "lora_A", path, "per-expert");
      check_ndim(b, 2, "lora_B", path, "per-expert");
      const int64_t rank = a.dim(0);
      MOELORA_CHECK(b.dim(1) == rank, ErrorCode::kInvalidFile, file_, ": lora_B of '", path,
                    "' has shape ", shape_str(b.shape()), " but lora_A has rank ", rank, " (shape ",
                    shape_str(a.shape()), ")");
      check_rank_vs_config(rank, path, path, "");
      check_feature(a, 1, in, "lora_A", path, "in_features");
      check_feature(b, 0, out, "lora_B", path, "out_features");
      part.a[static_cast<size_t>(e)] = matrix_view(a, 0, rank, in);
      part.b[static_cast<size_t>(e)] = matrix_view(b, 0, out, rank);
      part.rank = std::max(part.rank, rank);
    }
    parts.push_back(std::move(part));
  }
  return parts;
}

std::vector<Part> AdapterLoader::peft3d_parts(int64_t layer, LayerExperts& experts, bool gate_up) {
  const int64_t E = base_.num_experts, I = base_.moe_intermediate_size, H = base_.hidden_size;
  std::vector<Part> parts;
  const ModuleEntry* found = nullptr;
  for (const ModuleEntry* entry : {experts.peft3d_inner, experts.peft3d_outer}) {
    if (entry == nullptr) continue;
    const Tensor a = store_.tensor(entry->key_a), b = store_.tensor(entry->key_b);
    check_ndim(a, 2, "lora_A", entry->module, "PEFT 3-D (target_parameters)");
    check_ndim(b, 2, "lora_B", entry->module, "PEFT 3-D (target_parameters)");
    // The parameter a wrapper adapts follows from its shapes: gate_up_proj [E, 2I, H] takes
    // lora_A [E*R, H] / lora_B [2I, E*R], down_proj [E, H, I] takes [E*R, I] / [H, E*R].
    const bool is_gate_up = a.dim(1) == H && b.dim(0) == 2 * I;
    const bool is_down = a.dim(1) == I && b.dim(0) == H;
    MOELORA_CHECK(is_gate_up || is_down, ErrorCode::kUnsupported, file_, ": 3-D expert LoRA '",
                  entry->module, "' (lora_A ", shape_str(a.shape()), ", lora_B ",
                  shape_str(b.shape()), ") fits neither gate_up_proj (lora_A [E*R, ", H,
                  "], lora_B [", 2 * I, ", E*R]) nor down_proj (lora_A [E*R, ", I, "], lora_B [", H,
                  ", E*R]) of the base model ", describe_base(base_),
                  " (the adapter was made for another model)");
    if (is_gate_up != gate_up) continue;
    const char* param = gate_up ? "gate_up_proj" : "down_proj";
    MOELORA_CHECK(found == nullptr, ErrorCode::kInvalidFile, file_, ": '",
                  found ? found->key_a : "", "' and '", entry->key_a,
                  "' are both LoRAs of mlp.experts.", param, " of layer ", layer);
    found = entry;
    const std::string param_path = experts.layer_prefix + "mlp.experts." + param;
    MOELORA_CHECK(config_.target_parameters.empty() || config_.targets_parameter(param_path),
                  ErrorCode::kInvalidFile, file_, ": tensor '", entry->key_a, "' adapts '",
                  param_path, "', which ", config_file_,
                  " does not target (see target_parameters)");
    const int64_t rows = a.dim(0);
    MOELORA_CHECK(rows % E == 0 && rows > 0, ErrorCode::kUnsupported, file_, ": lora_A of '",
                  param_path, "' has ", rows, " rows, not a positive multiple of the base model's ",
                  E, " experts (E*R rows expected; the adapter was made for another model)");
    MOELORA_CHECK(b.dim(1) == rows, ErrorCode::kInvalidFile, file_, ": lora_B of '", param_path,
                  "' has shape ", shape_str(b.shape()), " but lora_A has ", rows, " rows (shape ",
                  shape_str(a.shape()), "): both must hold E*R = ", rows, " rank components");
    const int64_t rank = rows / E;
    check_rank_vs_config(
        rank, param_path, param_path,
        " (" + std::to_string(rows) + " rows / " + std::to_string(E) + " experts)");

    Part part;
    part.label = param;
    part.out_rows = gate_up ? 2 * I : H;
    const int64_t in = gate_up ? H : I;
    part.scaling.assign(static_cast<size_t>(E), config_.scaling_for(param_path));
    part.rank = rank;
    for (int64_t e = 0; e < E; ++e) {
      // A_e[k, :] = lora_A[e*R + k, :] (expert-major rows); B_e[:, k] = lora_B[:, k*E + e]
      // (rank-major columns).
      part.a.push_back(FactorView{a, e * rank * in, in, 1, rank, in});
      part.b.push_back(FactorView{b, e, E * rank, E, part.out_rows, rank});
    }
    parts.push_back(std::move(part));
  }
  return parts;
}

std::vector<Part> AdapterLoader::stacked_parts(int64_t layer, LayerExperts& experts, bool gate_up) {
  const int64_t E = base_.num_experts, I = base_.moe_intermediate_size;
  const auto& stacked = experts.stacked;
  if (gate_up && stacked[3] != nullptr && (stacked[0] != nullptr || stacked[1] != nullptr)) {
    MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": layer ", layer, " has both a fused '",
                  stacked[3]->module, "' LoRA and separate ", stacked[0] ? "gate_proj" : "up_proj",
                  " LoRAs");
  }
  std::vector<Part> parts;
  for (ExpertProj proj :
       gate_up ? std::vector<ExpertProj>{ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kGateUp}
               : std::vector<ExpertProj>{ExpertProj::kDown}) {
    const ModuleEntry* entry = stacked[static_cast<size_t>(proj)];
    if (entry == nullptr) continue;
    const std::string& path = entry->module;
    const std::string param_path =
        experts.layer_prefix +
        (proj == ExpertProj::kDown ? "mlp.experts.down_proj" : "mlp.experts.gate_up_proj");
    MOELORA_CHECK(config_.targets_module(path) || config_.targets_parameter(param_path),
                  ErrorCode::kInvalidFile, file_, ": tensor '", entry->key_a, "' adapts '", path,
                  "', which ", config_file_,
                  " does not target (see target_modules and target_parameters)");
    const Tensor a = store_.tensor(entry->key_a), b = store_.tensor(entry->key_b);
    check_ndim(a, 3, "lora_A", path, "stacked 3-D");
    check_ndim(b, 3, "lora_B", path, "stacked 3-D");
    for (const Tensor* t : {&a, &b}) {
      MOELORA_CHECK(t->dim(0) == 1 || t->dim(0) == E, ErrorCode::kUnsupported, file_, ": ",
                    t == &a ? "lora_A" : "lora_B", " of '", path, "' has shape ",
                    shape_str(t->shape()),
                    ": its leading (expert) dimension must be 1 "
                    "(shared by all experts) or the base model's ",
                    E,
                    " experts (the adapter was made for another "
                    "model)");
    }
    const int64_t rank = a.dim(1);
    MOELORA_CHECK(b.dim(2) == rank, ErrorCode::kInvalidFile, file_, ": lora_B of '", path,
                  "' has shape ", shape_str(b.shape()), " but lora_A has rank ", rank, " (shape ",
                  shape_str(a.shape()), ")");
    check_rank_vs_config(rank, path, path, "");
    const ModuleRef& ref = entry->ref;
    check_feature(a, 2, ref.in, "lora_A", path, "in_features");
    check_feature(b, 1, ref.out, "lora_B", path, "out_features");

    Part part;
    part.label = kExpertProjNames[static_cast<size_t>(proj)];
    part.out_offset = proj == ExpertProj::kUp ? I : 0;
    part.out_rows = ref.out;
    part.scaling.assign(static_cast<size_t>(E), config_.scaling_for(path));
    part.rank = rank;
    for (int64_t e = 0; e < a.dim(0); ++e) part.a.push_back(matrix_view(a, e, rank, ref.in));
    for (int64_t e = 0; e < b.dim(0); ++e) part.b.push_back(matrix_view(b, e, ref.out, rank));
    parts.push_back(std::move(part));
  }
  return parts;
}

void AdapterLoader::check_max_rank(const LoraWeights& w, int64_t layer, const std::string& target,
                                   const std::string& detail) const {
  MOELORA_CHECK(w.rank() <= options_.max_rank, ErrorCode::kUnsupported, "adapter '", name_, "' (",
                dir_.string(), "): ", target, " of layer ", layer, " has rank ", w.rank(), detail,
                ", above the configured maximum LoRA rank ", options_.max_rank);
}

void AdapterLoader::load_experts(int64_t layer, LayerExperts& experts, LayerLora& out) {
  const int64_t E = base_.num_experts, I = base_.moe_intermediate_size, H = base_.hidden_size;
  if (experts.forms.size() > 1) {
    MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": layer ", layer,
                  " mixes routed-expert LoRA layouts: ", form_name(*experts.forms.begin()), " and ",
                  form_name(*std::next(experts.forms.begin())));
  }
  const ExpertForm form = *experts.forms.begin();
  for (const bool gate_up : {true, false}) {
    std::vector<Part> parts;
    if (form == ExpertForm::kPerExpert) {
      parts = per_expert_parts(layer, experts, gate_up);
    } else if (form == ExpertForm::kStacked) {
      parts = stacked_parts(layer, experts, gate_up);
    } else {
      parts = peft3d_parts(layer, experts, gate_up);
    }
    if (parts.empty()) continue;
    LoraWeights w = assemble(parts, E, gate_up ? 2 * I : H, gate_up ? H : I);
    std::string detail;
    if (parts.size() > 1) {
      detail = " (";
      for (size_t i = 0; i < parts.size(); ++i) {
        detail += (i ? " + " : "") + parts[i].label + " " + std::to_string(parts[i].rank);
      }
      detail += ": separate gate and up LoRAs are stacked into one A)";
    }
    check_max_rank(w, layer, gate_up ? "mlp.experts.gate_up_proj" : "mlp.experts.down_proj",
                   detail);
    (gate_up ? out.experts_gate_up : out.experts_down) = std::move(w);
  }
}

LoraAdapter AdapterLoader::load() {
  std::error_code ec;
  MOELORA_CHECK(fs::is_directory(dir_, ec), ErrorCode::kNotFound, dir_.string(),
                ": adapter directory not found (expected adapter_config.json and "
                "adapter_model.safetensors in it)");
  const fs::path config_path = dir_ / "adapter_config.json";
  config_file_ = config_path.string();
  config_ = parse_adapter_config(config_path);

  if (!fs::exists(dir_ / "adapter_model.safetensors", ec) &&
      !fs::exists(dir_ / "adapter_model.safetensors.index.json", ec) &&
      fs::exists(dir_ / "adapter_model.bin", ec)) {
    MOELORA_THROW(ErrorCode::kUnsupported, (dir_ / "adapter_model.bin").string(),
                  ": pickle .bin adapters are not supported; convert to safetensors (e.g. load the "
                  "adapter with "
                  "PEFT and save it again with safe_serialization=True)");
  }
  store_ = SafetensorsStore::open_dir(dir_, "adapter_model");
  file_ = store_.source().string();

  collect();
  check_pairs_and_dtypes();

  const int64_t num_layers = base_.num_hidden_layers;
  plain_.assign(static_cast<size_t>(num_layers), {});
  experts_.assign(static_cast<size_t>(num_layers), {});
  for (const auto& [module, entry] : modules_) {
    const ModuleRef& ref = entry.ref;
    const size_t layer = static_cast<size_t>(ref.layer);
    LayerExperts& experts = experts_[layer];
    if (ref.form != ExpertForm::kNone) {
      experts.layer_prefix = ref.layer_prefix;
      experts.forms.insert(ref.form == ExpertForm::kPeft3dInner ? ExpertForm::kPeft3dOuter
                                                                : ref.form);
    }
    switch (ref.form) {
      case ExpertForm::kNone: {
        const ModuleEntry*& slot = plain_[layer][static_cast<size_t>(ref.plain)];
        // Two spellings of the decoder prefix can name the same module.
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_, ": '",
                      slot ? slot->key_a : "", "' and '", entry.key_a,
                      "' adapt the same module of layer ", ref.layer);
        slot = &entry;
        break;
      }
      case ExpertForm::kPerExpert: {
        auto& list = experts.per_expert[static_cast<size_t>(ref.proj)];
        if (list.empty()) list.assign(static_cast<size_t>(base_.num_experts), nullptr);
        MOELORA_CHECK(list[static_cast<size_t>(ref.expert)] == nullptr, ErrorCode::kInvalidFile,
                      file_, ": two tensors adapt expert ", ref.expert, " ",
                      kExpertProjNames[static_cast<size_t>(ref.proj)], " of layer ", ref.layer,
                      " ('", entry.key_a, "')");
        list[static_cast<size_t>(ref.expert)] = &entry;
        break;
      }
      case ExpertForm::kStacked: {
        const ModuleEntry*& slot = experts.stacked[static_cast<size_t>(ref.proj)];
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_,
                      ": two tensors adapt mlp.experts.",
                      kExpertProjNames[static_cast<size_t>(ref.proj)], " of layer ", ref.layer,
                      " ('", entry.key_a, "')");
        slot = &entry;
        break;
      }
      case ExpertForm::kPeft3dOuter:
      case ExpertForm::kPeft3dInner: {
        const ModuleEntry*& slot =
            ref.form == ExpertForm::kPeft3dOuter ? experts.peft3d_outer : experts.peft3d_inner;
        MOELORA_CHECK(slot == nullptr, ErrorCode::kInvalidFile, file_,
                      ": two tensors adapt mlp.experts of layer ", ref.layer, " ('", entry.key_a,
                      "')");
        slot = &entry;
        break;
      }
    }
  }

  LoraAdapter adapter;
  adapter.name = name_;
  adapter.dir = dir_;
  adapter.num_tensors = num_tensors_;
  adapter.layers.resize(static_cast<size_t>(num_layers));
  std::optional<std::pair<ExpertForm, int64_t>> first_form;  // layout and the layer that set it
  bool shared_outer = false;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    LayerLora& out = adapter.layers[static_cast<size_t>(layer)];
    out.shared_expert_module =
        base_.arch == Architecture::kDeepseekV3 ? "shared_experts" : "shared_expert";
    for (size_t p = 0; p < kNumPlain; ++p) {
      const ModuleEntry* entry = plain_[static_cast<size_t>(layer)][p];
      if (entry == nullptr) continue;
      LoraWeights w = load_plain(*entry);
      check_max_rank(w, layer, entry->module.substr(entry->ref.layer_prefix.size()), "");
      plain_slot(out, static_cast<Plain>(p)) = std::move(w);
    }
    LayerExperts& experts = experts_[static_cast<size_t>(layer)];
    if (experts.forms.empty()) continue;
    load_experts(layer, experts, out);
    const ExpertForm form = *experts.forms.begin();
    if (!first_form) {
      first_form = {form, layer};
    } else if (first_form->first != form) {
      MOELORA_THROW(ErrorCode::kInvalidFile, file_, ": routed-expert LoRAs of layer ",
                    first_form->second, " use the ", form_name(first_form->first),
                    " layout but those of layer ", layer, " use the ", form_name(form),
                    " layout; one adapter must use one layout");
    }
    for (const LoraWeights* w : {&out.experts_gate_up, &out.experts_down}) {
      if (w->defined() && base_.num_experts > 1 && (w->shared_a() || w->shared_b()))
        shared_outer = true;
    }
  }
  if (first_form) {
    switch (first_form->first) {
      case ExpertForm::kPerExpert: adapter.expert_layout = ExpertLoraLayout::kPerExpert; break;
      case ExpertForm::kStacked:
        adapter.expert_layout =
            shared_outer ? ExpertLoraLayout::kSharedOuter : ExpertLoraLayout::kStacked;
        break;
      default: adapter.expert_layout = ExpertLoraLayout::kPeft3d; break;
    }
  }

  // max_rank and the human-readable target list: one line per target and (rank, scaling, sharing),
  // with the layers it covers.
  struct Group {
    std::string target, detail;
    std::vector<int64_t> layers;
  };
  std::vector<Group> groups;
  MOELORA_ASSERT(LayerLora().named().size() == kNumPlain + 2,
                 "LayerLora::named() lists the plain targets, then the two expert targets");
  for (size_t t = 0; t < kNumPlain + 2; ++t) {
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      const auto named = adapter.layers[static_cast<size_t>(layer)].named();
      // Plain references, not a structured binding: the lambda below captures the name, which
      // clang before 16 does not allow for bindings.
      const auto& target = named[t].first;
      const auto& w = named[t].second;
      if (!w->defined()) continue;
      adapter.max_rank = std::max(adapter.max_rank, w->rank());
      std::string detail =
          "rank " + std::to_string(w->rank()) + ", scaling " + format_number(w->scaling);
      if (t >= kNumPlain) {
        detail += ", " + std::to_string(base_.num_experts) + " experts";
        if (base_.num_experts > 1 && w->shared_a()) detail += ", A shared by all experts";
        if (base_.num_experts > 1 && w->shared_b()) detail += ", B shared by all experts";
      }
      auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
        return g.target == target && g.detail == detail;
      });
      if (it == groups.end()) {
        groups.push_back({target, detail, {}});
        it = std::prev(groups.end());
      }
      it->layers.push_back(layer);
    }
  }
  for (const Group& g : groups) {
    adapter.targets.push_back(g.target + " (layer" + (g.layers.size() > 1 ? "s " : " ") +
                              format_ranges(g.layers) + "): " + g.detail);
  }
  MOELORA_ASSERT(adapter.max_rank > 0, "an adapter with tensors adapts at least one target");
  adapter.config = std::move(config_);
  return adapter;
}

}  // namespace

LoraAdapter load_adapter(const fs::path& dir, const ModelConfig& base, const std::string& name,
                         const AdapterLoadOptions& options) {
  MOELORA_CHECK(options.max_rank > 0, ErrorCode::kInvalidArgument,
                "AdapterLoadOptions::max_rank must be positive, got ", options.max_rank);
  return AdapterLoader(dir, base, name, options).load();
}

}  // namespace moelora::io
