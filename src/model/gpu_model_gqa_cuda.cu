// GQA attention of the GPU model (Qwen3-MoE, and Qwen3.5's gated full attention): one fused qkv
// projection with the LoRA of q/k/v, one kernel for the per-head q/k RMSNorm, rotate-half RoPE (on
// the first rotary_dim dims of each head: Qwen3.5 rotates 64 of 256) and the paged KV append, attention
// (FlashInfer's paged-prefill kernel or moelora's), Qwen3.5's sigmoid output gate, o_proj with its
// LoRA. Gated layers hold q_proj's rows as [q of every head | gate of every head] (regrouped at
// upload, see Layer), so q, k and v are read exactly as without the gate.
#include "model/gpu_model_impl_cuda.cuh"

namespace moelora::model::gpu_impl {

ops::cuda::AttentionBatch GpuModelImpl::batch(const ForwardShape& shape) const {
  const StepMetadata& d = device_step_;
  ops::cuda::AttentionBatch b;
  b.page_table = d.page_table;
  b.max_pages_per_seq = limits_.max_pages_per_seq;
  b.q_start = d.q_start;
  b.q_len = d.q_len;
  b.kv_len = d.kv_len;
  b.token_seq = d.token_seq;
  b.token_pos = d.token_pos;
  b.max_seqs = shape.seqs;
  b.max_tokens = shape.tokens;
  b.max_q_len = shape.max_q_len;
  b.max_kv_len = shape.max_kv_len;
  return b;
}

void GpuModelImpl::rope(bf16* x, const ForwardShape& shape, int heads, int64_t token_stride,
                        int64_t head_stride, int dim_offset) const {
  ops::cuda::RopeCudaArgs a;
  a.x = x;
  a.tokens = shape.tokens;
  a.num_tokens = device_step_.num_tokens;
  a.positions = device_step_.token_pos;
  a.heads = heads;
  a.token_stride = token_stride;
  a.head_stride = head_stride;
  a.dim_offset = dim_offset;
  a.rotary_dim = rotary_dim_;
  a.inv_freq = inv_freq_;
  a.attention_factor = attention_factor_;
  a.style = config_.rope_style;
  ops::cuda::launch_rope(a, main_.get());
}

void GpuModelImpl::gqa_attention(const ForwardShape& shape, const Layer& layer, int64_t) {
  const StepMetadata& d = device_step_;
  const int Hq = static_cast<int>(config_.num_attention_heads),
            Hkv = static_cast<int>(config_.num_key_value_heads);
  const int D = static_cast<int>(config_.head_dim);
  const int width = layer.qkv.out;
  // Decode: the q/k/v LoRA delta is expanded on the side stream into qkv_delta_ while the base
  // GEMM runs (the expand would otherwise wait for the GEMM and add in place, on the critical
  // path); the prologue adds it. Larger forwards add in place.
  bf16* const qkv_delta = shape.tokens <= qkv_delta_rows_ ? qkv_delta_ : nullptr;
  const bool delta =
      project(shape, layer, hnorm_, layer.qkv, qkv_,
              {{kQ, 0}, {kK, layer.q_out}, {kV, layer.q_out + layer.kv_out}}, qkv_delta);
  ops::cuda::PagedKv cache;
  cache.k = k_cache_ + static_cast<size_t>(layer.kv_index) * kv_layer_elems_;
  cache.v = v_cache_ + static_cast<size_t>(layer.kv_index) * kv_layer_elems_;
  cache.page_size = limits_.page_size;
  cache.num_kv_heads = Hkv;
  cache.head_dim = D;
  cache.v_head_dim = D;
  // q/k norms, RoPE and the KV append in one launch (ops/attention/qkv_prologue_cuda.cuh).
  ops::cuda::QkvPrologueArgs prologue;
  prologue.qkv = qkv_;
  prologue.row_stride = width;
  prologue.num_tokens = d.num_tokens;
  prologue.q_heads = Hq;
  prologue.k_offset = layer.q_out;
  prologue.v_offset = layer.q_out + layer.kv_out;
  prologue.q_norm = layer.q_norm;
  prologue.k_norm = layer.q_norm ? layer.k_norm : nullptr;
  prologue.eps = static_cast<float>(config_.rms_norm_eps);
  prologue.norm_style = config_.norm_style;
  prologue.rotary_dim = rotary_dim_;
  prologue.inv_freq = inv_freq_;
  prologue.attention_factor = attention_factor_;
  prologue.rope_style = config_.rope_style;
  prologue.cache = cache;
  prologue.batch = batch(shape);
  if (delta) {
    prologue.delta = qkv_delta_;
    prologue.delta_slot = d.token_slot;
  }
  ops::cuda::launch_qkv_prologue(prologue, main_.get());
  ops::cuda::PagedAttentionArgs attn;
  attn.cache = cache;
  attn.batch = prologue.batch;
  attn.q = qkv_;
  attn.q_stride = width;
  attn.num_q_heads = Hq;
  attn.scale = attention_scale_;
  attn.out = attn_;
  attn.workspace = attn_ws_;
  if (flashinfer_)
    flashinfer_->launch(attn, main_.get());
  else
    ops::cuda::launch_paged_attention(attn, main_.get());
  if (layer.gated) {
    // Qwen3.5: attn [T, Hq D] *= sigmoid(gate), the gate block right after q in the qkv rows
    gd::SigmoidGateArgs gate;
    gate.x = attn_;
    gate.gate = qkv_ + static_cast<int64_t>(Hq) * D;
    gate.gate_stride = width;
    gate.width = Hq * D;
    gate.tokens = shape.tokens;
    gate.num_tokens = d.num_tokens;
    gd::launch_sigmoid_gate(gate, main_.get());
  }
  project_branch(shape, layer, attn_, layer.o, kO);
}

}  // namespace moelora::model::gpu_impl
