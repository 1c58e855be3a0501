// Gated DeltaNet linear attention of the GPU model (Qwen3.5 "linear_attention" layers):
//
//   proj = hnorm . [in_proj_qkv ; in_proj_z ; in_proj_b ; in_proj_a]^T   one GEMM, [T, conv_dim +
//          value_dim + 2 nv], with the LoRA of the four targets into their column blocks (decode
//          with GpuModelOptions::gdn_lora_delta_in_mix: into gdn_delta_ on the side stream beside
//          the GEMM, added by the mix kernels)
//   mix  = ops::cuda::launch_gdn_mix: per sequence (rows [cu_seqlens[k], cu_seqlens[k + 1]), state
//          slot state_slot[k]) the causal conv with its rolling state, the gated delta rule on
//          the fp32 recurrent state and the gated RMSNorm -> [T, value_dim] bf16
//   out  = mix . out_proj^T (+ its LoRA) into branch
//
// The states of a layer live in [max_seqs] slots; the caller assigns one slot per live sequence
// and zeroes it (reset_state) before the sequence's first forward, so a graph replay never needs
// to know which sequences are new.
#include "model/gpu_model_impl_cuda.cuh"

namespace moelora::model::gpu_impl {

void GpuModelImpl::linear_attention(const ForwardShape& shape, const Layer& layer) {
  const StepMetadata& d = device_step_;
  const ops::GdnShape g = gdn_shape();
  const int conv_dim = static_cast<int>(g.conv_dim()), vd = static_cast<int>(g.value_dim()),
            nv = static_cast<int>(g.num_v_heads);
  const int width = layer.gdn_in.out;  // conv_dim + vd + 2 nv
  // Prefill chunks of long prompts take the chunked (tensor-core) rule; decode steps (max_q_len 1)
  // never launch it.
  const int chunked_min_tokens =
      shape.max_q_len >= ops::cuda::kGdnChunkedMinTokens ? ops::cuda::kGdnChunkedMinTokens : 0;
  // One GEMM for the four projections and one multi-target LoRA launch pair for their adapters:
  // the shrink beside the GEMM on the side stream, then the expand, adding into the four column
  // blocks after the GEMM; with gdn_lora_delta_in_mix (gdn_delta_ allocated) and a decode-sized
  // forward, the expand too on the side stream into gdn_delta_, which the mix adds as it reads.
  bf16* const delta_rows =
      shape.tokens <= gdn_delta_rows_ && chunked_min_tokens == 0 ? gdn_delta_ : nullptr;
  const bool delta =
      project(shape, layer, hnorm_, layer.gdn_in, gdn_proj_,
              {{kInQkv, 0}, {kInZ, conv_dim}, {kInB, conv_dim + vd}, {kInA, conv_dim + vd + nv}},
              delta_rows);

  ops::cuda::GdnMixArgs a;
  a.shape = g;
  a.cu_seqlens = d.cu_seqlens;
  a.slots = d.state_slot;
  a.max_seqs = shape.seqs;
  a.max_tokens = shape.tokens;
  a.qkv = gdn_proj_;
  a.qkv_stride = width;
  a.z = gdn_proj_ + conv_dim;
  a.z_stride = width;
  a.b = gdn_proj_ + conv_dim + vd;
  a.b_stride = width;
  a.a = gdn_proj_ + conv_dim + vd + nv;
  a.a_stride = width;
  if (delta) {
    a.delta.qkv = delta_rows;
    a.delta.z = delta_rows + conv_dim;
    a.delta.b = delta_rows + conv_dim + vd;
    a.delta.a = delta_rows + conv_dim + vd + nv;
    a.delta.stride = width;
    a.delta.row_slot = d.token_slot;
  }
  a.conv_weight = layer.conv_weight;
  a.a_log = layer.a_log;
  a.dt_bias = layer.dt_bias;
  a.norm_weight = layer.gdn_norm;
  a.conv_state = layer.conv_state;
  a.recurrent_state = layer.rec_state;
  a.num_slots = limits_.max_seqs;
  a.out = gdn_mix_;
  a.out_stride = vd;
  a.workspace = gdn_ws_;
  a.workspace_bytes = gdn_ws_bytes_;
  a.num_sms = num_sms_;  // the rule kernel's persistent grid (two CTAs per SM, state prefetch)
  a.pdl = true;          // the conv kernel's launch overlaps the projection's tail
  a.chunked_min_tokens = chunked_min_tokens;
  ops::cuda::launch_gdn_mix(a, main_.get());
  project_branch(shape, layer, gdn_mix_, layer.gdn_out, kOutProj);
}

void GpuModelImpl::reset_state(int32_t state_slot, cudaStream_t stream) {
  if (!has_linear_) return;
  MOELORA_CHECK(state_slot >= 0 && state_slot < limits_.max_seqs, ErrorCode::kOutOfRange,
                "GpuModel::reset_state: state slot ", state_slot, " is not in [0, ",
                limits_.max_seqs, ")");
  const ops::GdnShape g = gdn_shape();
  const size_t conv = static_cast<size_t>(g.conv_dim()) * (g.conv_kernel - 1);
  const size_t rec = static_cast<size_t>(g.num_v_heads) * g.head_k_dim * g.head_v_dim;
  for (const Layer& layer : layers_) {
    if (!layer.linear) continue;
    MOELORA_CUDA_CHECK(
        cudaMemsetAsync(layer.conv_state + state_slot * conv, 0, conv * sizeof(bf16), stream));
    MOELORA_CUDA_CHECK(
        cudaMemsetAsync(layer.rec_state + state_slot * rec, 0, rec * sizeof(float), stream));
  }
}

void GpuModelImpl::copy_state(int32_t src, int32_t dst, cudaStream_t stream) {
  if (!has_linear_) return;
  for (const int32_t slot : {src, dst}) {
    MOELORA_CHECK(slot >= 0 && slot < limits_.max_seqs, ErrorCode::kOutOfRange,
                  "GpuModel::copy_state: state slot ", slot, " is not in [0, ", limits_.max_seqs,
                  ")");
  }
  if (src == dst) return;
  const ops::GdnShape g = gdn_shape();
  const size_t conv = static_cast<size_t>(g.conv_dim()) * (g.conv_kernel - 1);
  const size_t rec = static_cast<size_t>(g.num_v_heads) * g.head_k_dim * g.head_v_dim;
  for (const Layer& layer : layers_) {
    if (!layer.linear) continue;
    MOELORA_CUDA_CHECK(cudaMemcpyAsync(layer.conv_state + dst * conv, layer.conv_state + src * conv,
                                       conv * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
    MOELORA_CUDA_CHECK(cudaMemcpyAsync(layer.rec_state + dst * rec, layer.rec_state + src * rec,
                                       rec * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
}

}  // namespace moelora::model::gpu_impl
