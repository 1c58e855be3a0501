// The FFN half of a GPU model layer: the dense SwiGLU MLP (gate_up GEMM, SiLU * up, down, LoRA
// on each) or the fused MoE layer (ops::cuda::MoeLayerCuda: router, experts, shared expert, both
// LoRA seams).
#include "model/gpu_model_impl_cuda.cuh"

namespace moelora::model::gpu_impl {

ops::cuda::MoeLayerConfig GpuModelImpl::moe_config(const Layer& layer, bool shared_gate) const {
  ops::cuda::MoeLayerConfig mc;
  mc.hidden = hidden_;
  mc.inter = layer.moe_inter;
  mc.num_experts = layer.experts;
  mc.expert_begin = layer.expert_begin;
  mc.top_k = static_cast<int>(config_.num_experts_per_tok);
  mc.route.kind = config_.router;
  mc.route.num_experts = static_cast<int>(config_.num_experts);
  mc.route.top_k = config_.num_experts_per_tok;
  mc.route.renormalize = config_.norm_topk_prob;
  mc.route.n_group = config_.n_group;
  mc.route.topk_group = config_.topk_group;
  mc.route.routed_scaling_factor = static_cast<float>(config_.routed_scaling_factor);
  mc.shared_inter = layer.shared_inter;
  mc.shared_gate = layer.shared_inter > 0 && shared_gate;
  mc.max_tokens = limits_.max_tokens;
  mc.num_slots = limits_.num_slots;
  mc.max_rank = limits_.num_slots > 0 ? limits_.max_rank : 0;
  mc.per_expert_pool = true;
  return mc;
}

bool GpuModelImpl::shared_expert_in_experts(const Layer& layer, bool fp8_experts) const {
  return options_.moe_shared_expert_in_experts && fp8_experts && layer.shared_inter > 0 &&
         layer.shared_inter == layer.moe_inter && layer.experts == config_.num_experts &&
         layer.experts + 1 <= ops::cuda::kMoeLayerStreamMaxExperts;
}

void GpuModelImpl::set_local_experts(Layer& layer, int64_t held) const {
  const int ranks = options_.collectives ? options_.collectives->size() : 1;
  const int rank = options_.collectives ? options_.collectives->rank() : 0;
  const int64_t E = config_.num_experts;
  MOELORA_CHECK(E > 0 && E % ranks == 0 && held == E / ranks, ErrorCode::kInvalidArgument,
                "GpuModel: rank ", rank, " of ", ranks, " holds ", held, " routed experts of ", E,
                "; expected ", ranks > 0 ? E / ranks : 0,
                " (cut the checkpoint with dist::shard_checkpoint for this group)");
  layer.experts = static_cast<int>(held);
  layer.expert_begin = static_cast<int>(held * rank);
}

void GpuModelImpl::reduce_branch(const ForwardShape& shape) {
  if (options_.collectives == nullptr || options_.collectives->size() == 1) return;
  add_pending_branch_delta(shape);  // the projection's LoRA delta is a partial sum too
  options_.collectives->all_reduce_sum(branch_, static_cast<size_t>(shape.tokens) * hidden_,
                                       DType::kBF16, main_.get());
}

void GpuModelImpl::ffn(const ForwardShape& shape, const Layer& layer) {
  const StepMetadata& d = device_step_;
  if (layer.is_moe) {
    ops::cuda::MoeForwardArgs a;
    a.x = hnorm_;
    a.slot = d.token_slot;
    a.num_tokens = d.num_tokens;
    a.tokens = shape.tokens;
    a.lora = shape.lora && limits_.num_slots > 0;
    a.single_slot = shape.single_slot;
    a.out = branch_;
    layer.moe->forward(a);
    return;
  }
  project(shape, layer, hnorm_, layer.gate_up, gate_up_, {{kMlpGate, 0}, {kMlpUp, layer.inter}});
  ops::cuda::SiluMulArgs s;
  s.gate_up = gate_up_;
  s.out = act_;
  s.tokens = shape.tokens;
  s.num_tokens = d.num_tokens;
  s.inter = layer.inter;
  ops::cuda::launch_silu_mul(s, main_.get());
  project_branch(shape, layer, act_, layer.down, kMlpDown);
}

}  // namespace moelora::model::gpu_impl
