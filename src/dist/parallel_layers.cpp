// Tensor-parallel MLP and expert-parallel MoE on the CPU reference operators (parallel_layers.h).
#include "dist/parallel_layers.h"

#include <string>

#include "core/error.h"
#include "ops/linear/linear.h"
#include "ops/route/route.h"

namespace moelora::dist {

namespace {

LoraFactors copy_or_empty(const LoraFactors* f) {
  return f != nullptr && f->defined() ? *f : LoraFactors{};
}

// Multiplies row t of `shared` [T, H] by sigmoid(x[t] . gate): the Qwen shared-expert gate.
void apply_shared_gate(const Tensor& x, const Tensor& gate, Tensor& shared) {
  const int64_t tokens = x.dim(0), hidden = x.dim(1);
  const float* xp = x.data<float>();
  const float* gp = gate.data<float>();
  float* sp = shared.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float g = ops::sigmoid_f32(ops::dot_f32(xp + t * hidden, gp, hidden));
    for (int64_t c = 0; c < hidden; ++c) sp[t * hidden + c] = g * sp[t * hidden + c];
  }
}

std::vector<ops::MlpLoraRef> mlp_refs(const std::vector<MlpLora>& lora) {
  std::vector<ops::MlpLoraRef> refs;
  refs.reserve(lora.size());
  for (const MlpLora& l : lora) refs.push_back(l.ref());
  return refs;
}

}  // namespace

// ---------------------------------------------------------------------------- dense MLP, TP

ops::MlpLoraRef MlpLora::ref() const {
  return {factors_or_null(gate), factors_or_null(up), factors_or_null(down)};
}

MlpShard shard_mlp(const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down, ShardSpec tp) {
  return {shard_dim(w_gate, 0, tp, "mlp gate weight"), shard_dim(w_up, 0, tp, "mlp up weight"),
          shard_dim(w_down, 1, tp, "mlp down weight")};
}

MlpLora shard_mlp_lora(const ops::MlpLoraRef& lora, ShardSpec tp) {
  return {shard_lora_column(copy_or_empty(lora.gate), tp, "mlp gate"),
          shard_lora_column(copy_or_empty(lora.up), tp, "mlp up"),
          shard_lora_row(copy_or_empty(lora.down), tp, "mlp down")};
}

Tensor mlp_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const MlpShard& shard,
                      const std::vector<MlpLora>& lora, Communicator& comm) {
  // Rank r's channels give its partial sum of the output (see the header).
  Tensor partial = ops::mlp_forward_ref(x, slot, shard.w_gate, shard.w_up, shard.w_down, mlp_refs(lora));
  comm.all_reduce_sum({partial.data<float>(), static_cast<size_t>(partial.numel())});
  return partial;
}

// ---------------------------------------------------------------------------- MoE, EP

ops::MoeLoraRef MoeLora::ref() const {
  ops::MoeLoraRef r;
  r.gate_up = factors_or_null(gate_up);
  r.down = factors_or_null(down);
  r.shared_gate = factors_or_null(shared.gate);
  r.shared_up = factors_or_null(shared.up);
  r.shared_down = factors_or_null(shared.down);
  return r;
}

MoeShard shard_moe(const ops::MoeWeightsRef& layer, const ops::MoeParams& params, ShardSpec ep,
                   SharedExpertSplit shared_split) {
  const int64_t experts = params.route.num_experts;
  MoeShard s;
  s.params = params;
  s.shared_split = shared_split;
  s.expert_offset = shard_range(experts, ep, "moe experts").begin;
  s.router = layer.router.clone();
  if (layer.correction_bias.defined()) s.correction_bias = layer.correction_bias.clone();
  MOELORA_CHECK(layer.w13.defined() && layer.w13.ndim() == 3 && layer.w13.dim(0) == experts,
                ErrorCode::kInvalidArgument, "moe w13: expected [", experts, ", 2I, H], got ",
                layer.w13.defined() ? shape_str(layer.w13.shape()) : "undefined");
  s.w13 = shard_dim(layer.w13, 0, ep, "moe w13");
  s.w2 = shard_dim(layer.w2, 0, ep, "moe w2");
  if (layer.shared_w13.defined()) {
    const int64_t shared_inter = layer.shared_w13.dim(0) / 2;
    const Tensor gate = layer.shared_w13.slice0(0, shared_inter);
    const Tensor up = layer.shared_w13.slice0(shared_inter, 2 * shared_inter);
    s.shared = shared_split == SharedExpertSplit::kTensorParallel
                   ? shard_mlp(gate, up, layer.shared_w2, ep)
                   : MlpShard{gate.clone(), up.clone(), layer.shared_w2.clone()};
    if (layer.shared_gate.defined()) s.shared_gate = layer.shared_gate.clone();
  }
  return s;
}

MoeLora shard_moe_lora(const ops::MoeLoraRef& lora, const ops::MoeParams& params, ShardSpec ep,
                       SharedExpertSplit shared_split) {
  const int64_t experts = params.route.num_experts;
  MoeLora s;
  s.gate_up = shard_lora_experts(copy_or_empty(lora.gate_up), experts, ep, "moe gate_up");
  s.down = shard_lora_experts(copy_or_empty(lora.down), experts, ep, "moe down");
  const ops::MlpLoraRef shared{lora.shared_gate, lora.shared_up, lora.shared_down};
  s.shared = shared_split == SharedExpertSplit::kTensorParallel
                 ? shard_mlp_lora(shared, ep)
                 : MlpLora{copy_or_empty(lora.shared_gate), copy_or_empty(lora.shared_up),
                           copy_or_empty(lora.shared_down)};
  return s;
}

Tensor moe_forward_ep(const Tensor& x, const std::vector<int32_t>& slot, const MoeShard& shard,
                      const std::vector<MoeLora>& lora, MoeCombine combine, Communicator& comm) {
  const int64_t experts = shard.params.route.num_experts;
  MOELORA_CHECK(shard.w13.defined() && shard.w13.dim(0) * comm.size() == experts &&
                    shard.expert_offset == shard.w13.dim(0) * comm.rank(),
                ErrorCode::kInvalidArgument, "moe: rank ", comm.rank(), " of ", comm.size(),
                " holds experts [", shard.expert_offset, ", ",
                shard.expert_offset + (shard.w13.defined() ? shard.w13.dim(0) : 0),
                ") of ", experts, "; expected [", experts / comm.size() * comm.rank(), ", ",
                experts / comm.size() * (comm.rank() + 1), ")");
  std::vector<ops::MoeLoraRef> refs;
  std::vector<MlpLora> shared_lora;
  for (const MoeLora& l : lora) {
    refs.push_back(l.ref());
    shared_lora.push_back(l.shared);
  }

  // 1. Route every token with the whole router: the same ids and weights on every rank.
  const ops::RouteResult route =
      ops::route_ref(ops::linear_ref(x, shard.router), shard.correction_bias, shard.params.route);
  // 2. The local experts' pair rows y [T * k, H] (zeros for the other ranks' pairs).
  Tensor pairs = ops::moe_expert_outputs_ref(x, slot, shard.w13, shard.w2, refs, shard.params, route,
                                             shard.expert_offset);
  // 3. The shared expert: all of it (replicated) or this rank's partial sum (tensor parallel).
  Tensor shared;
  if (shard.shared.w_gate.defined()) {
    shared = ops::mlp_forward_ref(x, slot, shard.shared.w_gate, shard.shared.w_up,
                                  shard.shared.w_down, mlp_refs(shared_lora));
    if (shard.shared_gate.defined()) apply_shared_gate(x, shard.shared_gate, shared);
  }
  const bool shared_partial =
      shared.defined() && shard.shared_split == SharedExpertSplit::kTensorParallel;
  auto all_reduce = [&](Tensor& t) {
    comm.all_reduce_sum({t.data<float>(), static_cast<size_t>(t.numel())});
  };

  // 4. Combine.
  if (combine == MoeCombine::kPairRows) {
    all_reduce(pairs);
    if (shared_partial) all_reduce(shared);
    return ops::moe_combine_ref(pairs, route.weights, shared);
  }
  // kPartialSums: a replicated shared expert is added by rank 0 only, so the sum has it once.
  const bool add_shared = shared.defined() && (shared_partial || comm.rank() == 0);
  Tensor out = ops::moe_combine_ref(pairs, route.weights, add_shared ? shared : Tensor());
  all_reduce(out);
  return out;
}

}  // namespace moelora::dist
