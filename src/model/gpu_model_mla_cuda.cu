// MLA attention of the GPU model (DeepSeek-V3 / Kimi) in its absorbed form: q (through q_a / q_b
// or a plain q_proj) and the latent kv_a projection with their LoRA, the latent cache, attention
// over the 576-wide latent, the kv_b up-projection of the output and o_proj.
#include "model/gpu_model_impl_cuda.cuh"

namespace moelora::model::gpu_impl {

void GpuModelImpl::mla_attention(const ForwardShape& shape, const Layer& layer, int64_t) {
  const StepMetadata& d = device_step_;
  const int n = mla_shape_.num_heads, qk = mla_shape_.nope + mla_shape_.rope, r = mla_shape_.rank;
  cublasHandle_t handle = static_cast<cublasHandle_t>(cublas_->get());
  // q_a (or q_proj without a q LoRA rank) and kv_a both read hnorm: one projection group, so
  // their LoRA is one shrink and one expand launch.
  const bool q_latent = config_.q_lora_rank > 0;
  const Linear& q_first = q_latent ? layer.q_a : layer.q_proj;
  bf16* q_first_out = q_latent ? q_lat_ : q_;
  const ProjectGemm first_gemms[] = {{&q_first, q_first_out}, {&layer.kv_a, kv_}};
  const ProjectLora first_loras[] = {{q_latent ? kQa : kQ, q_first_out, 0, q_first.out},
                                     {kKva, kv_, 0, layer.kv_a.out}};
  project_group(shape, layer, hnorm_, first_gemms, first_loras);
  if (q_latent) {
    rms_norm(q_lat_, nullptr, layer.q_a_norm, q_lat_, shape.tokens, d.num_tokens, layer.q_a.out);
    project(shape, layer, q_lat_, layer.q_b, q_, {{kQb, 0}});
  }
  rms_norm(kv_, nullptr, layer.kv_a_norm, kv_, shape.tokens, d.num_tokens, r, latent_width_,
           latent_width_);
  rope(q_, shape, n, static_cast<int64_t>(n) * qk, qk, mla_shape_.nope);
  rope(kv_, shape, 1, latent_width_, latent_width_, r);

  ops::cuda::MlaLatentCache cache;
  cache.kv = latent_cache_ + static_cast<size_t>(layer.kv_index) * kv_layer_elems_;
  cache.page_size = limits_.page_size;
  ops::cuda::MlaAppendArgs append;
  append.cache = cache;
  append.shape = mla_shape_;
  append.batch = batch(shape);
  append.c_kv = kv_;
  append.c_kv_stride = latent_width_;
  append.k_rope = kv_ + r;
  append.k_rope_stride = latent_width_;
  ops::cuda::launch_mla_cache_append(append, main_.get());

  ops::cuda::MlaAbsorbArgs absorb;
  absorb.shape = mla_shape_;
  absorb.q = q_;
  absorb.q_stride = static_cast<int64_t>(n) * qk;
  absorb.kv_b = layer.kv_b.w;
  absorb.q_full = q_full_;
  absorb.tokens = shape.tokens;
  ops::cuda::launch_mla_absorb_query(handle, absorb, main_.get());
  const bool kvb_lora = shape.lora && limits_.num_slots > 0 && layer.lora[kKvb].present();
  ops::cuda::MlaKvbLoraArgs kvb;
  if (kvb_lora) {
    // Both sides add into buffers the main stream writes, so they stay on the main stream.
    kvb.shape = mla_shape_;
    kvb.pool = pool_view(layer.lora[kKvb]);
    kvb.token_slot = d.token_slot;
    kvb.tokens = shape.tokens;
    kvb.num_tokens = d.num_tokens;
    kvb.q = q_;
    kvb.q_stride = absorb.q_stride;
    kvb.q_full = q_full_;
    kvb.o_lat = o_lat_;
    kvb.out = attn_;
    ops::cuda::launch_mla_kvb_lora_query(kvb, main_.get());
  }
  ops::cuda::MlaAttentionArgs attn;
  attn.cache = cache;
  attn.shape = mla_shape_;
  attn.batch = append.batch;
  attn.q_full = q_full_;
  attn.scale = attention_scale_;
  attn.o_lat = o_lat_;
  attn.workspace = attn_ws_;
  ops::cuda::launch_mla_attention(attn, main_.get());
  ops::cuda::MlaProjectArgs proj;
  proj.shape = mla_shape_;
  proj.o_lat = o_lat_;
  proj.kv_b = layer.kv_b.w;
  proj.out = attn_;
  proj.tokens = shape.tokens;
  ops::cuda::launch_mla_project_output(handle, proj, main_.get());
  if (kvb_lora) ops::cuda::launch_mla_kvb_lora_output(kvb, main_.get());
  project_branch(shape, layer, attn_, layer.o, kO);
}

}  // namespace moelora::model::gpu_impl
