// Which module of the base model a PEFT tensor name adapts: the decoder prefixes transformers
// writes, the layer index, the attention kind of that layer (GQA, gated GQA, MLA, Gated DeltaNet),
// dense MLP or routed experts (per-expert, PEFT 3-D, stacked), and the expected features of each
// factor. Everything the base model does not have is rejected here, naming the tensor.
#include "io/peft_internal.h"
#include "io/peft_loader.h"

#include <string>

#include "core/error.h"

namespace moelora::io::peft_detail {

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

[[noreturn]] void another_architecture(const Where& w, const std::string& why) {
  MOELORA_THROW(ErrorCode::kUnsupported, w.file, ": tensor '", w.key,
                "': adapter was made for another architecture: ", why);
}
[[noreturn]] void unsupported_target(const Where& w, const std::string& what) {
  MOELORA_THROW(ErrorCode::kUnsupported, w.file, ": tensor '", w.key, "': ", what,
                " is not supported");
}

namespace {

bool is_linear_attention_layer(const ModelConfig& base, int64_t layer) {
  return static_cast<size_t>(layer) < base.layer_types.size() &&
         base.layer_types[static_cast<size_t>(layer)] == "linear_attention";
}

bool has_linear_attention(const ModelConfig& base) {
  return std::find(base.layer_types.begin(), base.layer_types.end(), "linear_attention") !=
         base.layer_types.end();
}

}  // namespace

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

}  // namespace moelora::io::peft_detail
