// GpuModel: the whole decoder on one GPU (gpu_model_cuda.cuh). This file holds the step: the
// per-step metadata upload, the RMSNorm and projection (+ LoRA) helpers every block uses, the
// forward pass over the layers and the public factories; the blocks and the construction live
// beside it (gpu_model_impl_cuda.cuh lists them). The MoE
// halves of the layers are ops::cuda::MoeLayerCuda objects; everything else is cuBLAS GEMMs and
// the ops launchers.
//
// Buffers (T = limits.max_tokens, B = limits.max_seqs, bf16 unless noted):
//   resid [T, H] residual stream, hnorm [T, H] normalized input of a half-layer, branch [T, H]
//   output of attention / FFN (added into resid by the next fused RMSNorm);
//   GQA: qkv [T, (Hq + 2 Hkv) D], attn [T, Hq D];
//   MLA: q_lat [T, q_lora_rank], q [T, n (nope + rope)], kv [T, r + rope], q_full [T, n, r + rope],
//        o_lat [T, n, r], attn [T, n dv];
//   dense MLP: gate_up [T, 2 Id], act [T, Id];
//   LoRA: partial fp32, the [splits, T, R] blocks of one projection group's targets side by side;
//   head: last_branch / last_resid / last_norm [B, H], logits fp32 [B, V], sampled int32 [B].
// Dense LoRA: fork after the projection's input is ready, one multi-target shrink for all targets
// that read it on the side stream while the main stream runs the base GEMM(s), join, one
// multi-target expand on the main stream that adds the deltas into the output columns. The
// projections that write branch_ run the expand on the side stream too, into branch_delta_, and
// the next residual RMSNorm adds the delta rows (project_branch, branch_norm).
#include "model/gpu_model_impl_cuda.cuh"

namespace moelora::model::gpu_impl {

void GpuModelImpl::upload_step(const ForwardShape& shape, cudaStream_t stream) {
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(step_device_.get(), step_host_->get(), step_bytes_,
                                     cudaMemcpyHostToDevice, stream));
  if (flashinfer_) {
    // One schedule for every attention layer of the forward. Decode-only forwards (the ones
    // captured as graphs) take FlashInfer's graph-stable plan: the same launch configuration
    // for every plan of one bucket size.
    ops::cuda::FlashInferHostBatch b;
    b.q_start = host_step_.q_start;
    b.q_len = host_step_.q_len;
    b.kv_len = host_step_.kv_len;
    b.page_table = host_step_.page_table;
    b.seqs = shape.seqs;
    flashinfer_->plan(b, /*decode=*/shape.max_q_len <= 1, stream);
  }
}

void GpuModelImpl::rms_norm(const bf16* x, bf16* residual, const bf16* weight, bf16* y, int rows,
                            const int32_t* num_rows, int dim, int64_t x_stride,
                            int64_t y_stride) const {
  ops::cuda::RmsNormArgs a;
  a.x = x;
  a.residual = residual;
  a.weight = weight;
  a.y = y;
  a.rows = rows;
  a.num_rows = num_rows;
  a.dim = dim;
  a.x_stride = x_stride;
  a.y_stride = y_stride;
  a.eps = static_cast<float>(config_.rms_norm_eps);
  a.style = config_.norm_style;
  ops::cuda::launch_rms_norm(a, main_.get());
}

void GpuModelImpl::branch_norm(const ForwardShape& shape, const bf16* weight) {
  ops::cuda::RmsNormArgs a;
  a.x = branch_;
  a.residual = resid_;
  a.weight = weight;
  a.y = hnorm_;
  a.rows = shape.tokens;
  a.num_rows = device_step_.num_tokens;
  a.dim = hidden_;
  a.eps = static_cast<float>(config_.rms_norm_eps);
  a.style = config_.norm_style;
  if (branch_delta_pending_) {
    a.x_delta = branch_delta_;
    a.delta_slot = device_step_.token_slot;
    branch_delta_pending_ = false;
  }
  ops::cuda::launch_rms_norm(a, main_.get());
}

void GpuModelImpl::project_branch(const ForwardShape& shape, const Layer& layer, const bf16* x,
                                  const Linear& w, int target) {
  MOELORA_ASSERT(w.out == hidden_ && !branch_delta_pending_, "project_branch: out ", w.out,
                 ", pending ", branch_delta_pending_);
  branch_delta_pending_ = project(shape, layer, x, w, branch_, {{target, 0}}, branch_delta_);
}

void GpuModelImpl::add_pending_branch_delta(const ForwardShape& shape) {
  if (!branch_delta_pending_) return;
  ops::cuda::AddRowsArgs add;
  add.y = branch_;
  add.delta = branch_delta_;
  add.row_slot = device_step_.token_slot;
  add.tokens = shape.tokens;
  add.num_tokens = device_step_.num_tokens;
  add.cols = hidden_;
  ops::cuda::launch_add_rows(add, main_.get());
  branch_delta_pending_ = false;
}

bool GpuModelImpl::project(const ForwardShape& shape, const Layer& layer, const bf16* x,
                           const Linear& w, bf16* y,
                           std::initializer_list<std::pair<int, int>> loras, bf16* lora_delta) {
  std::array<ProjectLora, ops::cuda::kLoraMaxTargets> targets{};
  MOELORA_ASSERT(loras.size() <= targets.size(), "a projection has ", loras.size(),
                 " LoRA targets");
  size_t n = 0;
  for (const auto& [target, column] : loras) targets[n++] = {target, y, column, w.out};
  const ProjectGemm gemm{&w, y};
  return project_group(shape, layer, x, std::span(&gemm, 1), std::span(targets.data(), n),
                       lora_delta);
}

bool GpuModelImpl::project_group(const ForwardShape& shape, const Layer& layer, const bf16* x,
                                 std::span<const ProjectGemm> gemms,
                                 std::span<const ProjectLora> loras, bf16* lora_delta) {
  cudaStream_t main = main_.get(), side = side_.get();
  const int T = limits_.max_tokens;
  ops::cuda::LoraMultiShrinkArgs shrink;
  ops::cuda::LoraMultiExpandArgs expand;
  if (shape.lora && limits_.num_slots > 0) {
    size_t partial_offset = 0;  // floats; the targets' partials side by side (see allocation)
    for (const ProjectLora& l : loras) {
      const DenseLoraPool& pool = layer.lora[l.target];
      if (!pool.present()) continue;
      const int i = shrink.num_targets++;
      const ops::cuda::LoraPoolTarget view = pool_view(pool);
      float* partial = lora_partial_ + partial_offset;
      partial_offset += ops::cuda::lora_partial_bytes(pool.in, T, view.max_rank) / sizeof(float);
      shrink.targets[i] = {view, partial};
      expand.targets[i].pool = view;
      expand.targets[i].partial = partial;
      expand.targets[i].out = (lora_delta ? lora_delta : l.y) + l.column;
      expand.targets[i].out_stride = l.y_stride;
    }
  }
  const bool use_lora = shrink.num_targets > 0;
  if (use_lora) {
    const StepMetadata& d = device_step_;
    ops::cuda::LoraSegmentsView seg;
    seg.segments = reinterpret_cast<const int4*>(d.lora_segments);
    seg.num_segments = d.num_lora_segments;
    seg.max_segments = limits_.num_slots;
    // Segments are disjoint runs of the forward's token rows: row-major grids, so a single
    // adapter's rows spread over as many CTAs as many adapters' (see LoraSegmentsView).
    seg.max_rows = shape.tokens;
    shrink.seg = seg;
    shrink.x = x;
    shrink.gather = nullptr;
    shrink.row_capacity = T;
    expand.num_targets = shrink.num_targets;
    expand.seg = seg;
    expand.row_capacity = T;
    expand.mode = lora_delta ? ops::cuda::LoraExpandMode::kWrite : ops::cuda::LoraExpandMode::kAdd;
    fork_.record(main);
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(side, fork_.get(), 0));
    ops::cuda::launch_lora_shrink_multi(shrink, side);
    if (lora_delta) ops::cuda::launch_lora_expand_multi(expand, side);
    join_.record(side);
  }
  for (const ProjectGemm& g : gemms) {
    gd::gemm_bf16(static_cast<cublasHandle_t>(cublas_->get()), main, x, g.w->in, g.w->w, g.y,
                  CUDA_R_16BF, g.w->out, shape.tokens, g.w->out, g.w->in);
  }
  if (!use_lora) return false;
  MOELORA_CUDA_CHECK(cudaStreamWaitEvent(main, join_.get(), 0));
  if (lora_delta) return true;
  ops::cuda::launch_lora_expand_multi(expand, main);
  return false;
}

void GpuModelImpl::forward(const ForwardShape& shape) {
  MOELORA_CHECK(shape.tokens > 0 && shape.tokens <= limits_.max_tokens && shape.seqs > 0 &&
                    shape.seqs <= limits_.max_seqs && shape.max_q_len >= 0 && shape.max_kv_len >= 0,
                ErrorCode::kInvalidArgument, "GpuModel::forward: tokens = ", shape.tokens, " (max ",
                limits_.max_tokens, "), seqs = ", shape.seqs, " (max ", limits_.max_seqs,
                "), max_q_len = ", shape.max_q_len, ", max_kv_len = ", shape.max_kv_len);
  MOELORA_CHECK(shape.single_slot < limits_.num_slots, ErrorCode::kInvalidArgument,
                "GpuModel::forward: single_slot ", shape.single_slot, " is not a slot (",
                limits_.num_slots, " slots)");
  const StepMetadata& d = device_step_;
  cudaStream_t main = main_.get();
  const int H = hidden_;

  ops::cuda::EmbeddingArgs embed;
  embed.table = embed_;
  embed.ids = d.token_ids;
  embed.out = resid_;
  embed.tokens = shape.tokens;
  embed.num_tokens = d.num_tokens;
  embed.hidden = H;
  embed.vocab = vocab_rows_;
  embed.first_id = vocab_begin_;
  ops::cuda::launch_embedding(embed, main);
  // A split vocabulary: each rank wrote its ids' rows and zeros elsewhere; the sum is the lookup
  // (one nonzero term per row, exact in bf16).
  if (vocab_split_)
    options_.collectives->all_reduce_sum(resid_, static_cast<size_t>(shape.tokens) * H,
                                         DType::kBF16, main);

  branch_delta_pending_ = false;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    // resid += branch (the previous half-layer's output); hnorm = norm(resid)
    if (l == 0) {
      rms_norm(resid_, nullptr, layer.input_norm, hnorm_, shape.tokens, d.num_tokens, H);
    } else {
      branch_norm(shape, layer.input_norm);
    }
    if (layer.linear) {
      linear_attention(shape, layer);
    } else if (config_.use_mla) {
      mla_attention(shape, layer, static_cast<int64_t>(l));
    } else {
      gqa_attention(shape, layer, static_cast<int64_t>(l));
    }
    reduce_branch(shape);
    branch_norm(shape, layer.post_norm);
    ffn(shape, layer);
    reduce_branch(shape);
  }
  add_pending_branch_delta(shape);  // a dense last layer's down_proj: its delta before the head

  // Output head on each sequence's last row only: gather, final (residual-fused) norm, lm_head.
  gd::launch_gather_rows(branch_, shape.tokens, d.last_row, shape.seqs, H, last_branch_, main);
  gd::launch_gather_rows(resid_, shape.tokens, d.last_row, shape.seqs, H, last_resid_, main);
  rms_norm(last_branch_, last_resid_, final_norm_, last_norm_, shape.seqs, d.num_seqs, H);
  if (!vocab_split_) {
    gd::gemm_bf16(static_cast<cublasHandle_t>(cublas_->get()), main, last_norm_, H, lm_head_,
                  logits_, CUDA_R_32F, vocab_, shape.seqs, vocab_, H);
  } else {
    // This rank's vocabulary columns, gathered from every rank ([ranks, seqs, V / ranks]) and
    // laid out as the rows of logits_ [seqs, V].
    gd::gemm_bf16(static_cast<cublasHandle_t>(cublas_->get()), main, last_norm_, H, lm_head_,
                  local_logits_, CUDA_R_32F, vocab_rows_, shape.seqs, vocab_rows_, H);
    const size_t block = static_cast<size_t>(shape.seqs) * vocab_rows_;
    options_.collectives->all_gather(local_logits_, gathered_logits_, block, DType::kF32, main);
    for (int r = 0; r < options_.collectives->size(); ++r) {
      MOELORA_CUDA_CHECK(
          cudaMemcpy2DAsync(logits_ + static_cast<size_t>(r) * vocab_rows_, sizeof(float) * vocab_,
                            gathered_logits_ + static_cast<size_t>(r) * block,
                            sizeof(float) * vocab_rows_, sizeof(float) * vocab_rows_,
                            static_cast<size_t>(shape.seqs), cudaMemcpyDeviceToDevice, main));
    }
  }
  if (shape.sample) {
    ops::cuda::SampleArgs s;
    s.logits = logits_;
    s.stride = vocab_;
    s.params = d.sample_params;
    s.uniform = d.uniform;
    s.tokens = sampled_;
    s.rows = shape.seqs;
    s.num_rows = d.num_seqs;
    s.vocab = vocab_;
    ops::cuda::launch_sample(s, main);
  }
}

}  // namespace moelora::model::gpu_impl

namespace moelora::model {

AttentionKernel parse_attention_kernel(const std::string& name) {
  if (name == "auto") return AttentionKernel::kAuto;
  if (name == "flashinfer") return AttentionKernel::kFlashInfer;
  if (name == "moelora") return AttentionKernel::kMoelora;
  MOELORA_THROW(ErrorCode::kInvalidArgument, "attention kernel '", name,
                "': expected auto, flashinfer or moelora");
}

std::unique_ptr<GpuModel> GpuModel::load(const io::ModelWeights& weights,
                                         const GpuModelLimits& limits,
                                         const GpuModelOptions& options) {
  auto model = std::make_unique<gpu_impl::GpuModelImpl>(weights.config, limits, options);
  model->upload(weights);
  return model;
}

std::unique_ptr<GpuModel> GpuModel::random(const io::ModelConfig& config, uint64_t seed,
                                           bool fp8_experts, const GpuModelLimits& limits,
                                           const GpuModelOptions& options) {
  config.validate("GpuModel::random config");
  auto model = std::make_unique<gpu_impl::GpuModelImpl>(config, limits, options);
  model->randomize(seed, fp8_experts);
  return model;
}

}  // namespace moelora::model
