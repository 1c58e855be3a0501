// Internal to the GPU model (not a public header): the GpuModelImpl class that implements GpuModel
// (gpu_model_cuda.cuh) and the device-side types it keeps per layer. Its member functions are
// defined by block kind, each file with its own buffers and kernels:
//   gpu_model_cuda.cu           the step: metadata upload, RMSNorm / projection (+ LoRA) helpers,
//                               forward(), the public factories
//   gpu_model_weights_cuda.cu   construction: checks, weight upload or random weights, KV cache,
//                               workspaces, LoRA pools
//   gpu_model_gqa_cuda.cu       GQA attention (Qwen3-MoE; Qwen3.5's gated full attention): qkv
//                               projection, q/k norms, RoPE, paged attention (FlashInfer's or
//                               moelora's), the output gate, o_proj
//   gpu_model_mla_cuda.cu       MLA attention (DeepSeek-V3 / Kimi) in its absorbed form
//   gpu_model_gdn_cuda.cu       Gated DeltaNet linear attention (Qwen3.5) and its state slots
//   gpu_model_ffn_cuda.cu       the FFN half: dense SwiGLU MLP or ops::cuda::MoeLayerCuda
//   gpu_model_adapters_cuda.cu  adapter slots: checks, uploads, random adapters
#pragma once

#include "model/gpu_model_cuda.cuh"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/cuda_utils.h"
#include "core/dtype.h"
#include "core/progress.h"
#include "model/gpu_model_kernels_cuda.cuh"
#include "model/model.h"
#include "model/weights.h"
#include "ops/attention/attention_cuda.cuh"
#include "ops/attention/attention_flashinfer.cuh"
#include "ops/attention/qkv_prologue_cuda.cuh"
#include "ops/embedding/embedding_cuda.cuh"
#include "ops/gdn/gdn_cuda.cuh"
#include "ops/linear/linear_cuda.cuh"
#include "ops/lora/lora_cuda.cuh"
#include "ops/mla/mla.h"
#include "ops/mla/mla_cuda.cuh"
#include "ops/moe/moe_layer_cuda.cuh"
#include "ops/norm/norm_cuda.cuh"
#include "ops/rope/rope.h"
#include "ops/rope/rope_cuda.cuh"
#include "ops/sample/sample_cuda.cuh"

namespace moelora::model::gpu_impl {

using bf16 = __nv_bfloat16;
namespace gd = gpu_detail;

// The dense (non-expert) LoRA targets a layer may have; each has its own pool.
enum DenseTarget {
  kQ,
  kK,
  kV,
  kO,
  kQa,
  kQb,
  kKva,
  kKvb,
  kMlpGate,
  kMlpUp,
  kMlpDown,
  kInQkv,  // Gated DeltaNet linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj
  kInZ,
  kInB,
  kInA,
  kOutProj,
  kNumDenseTargets
};

struct DenseTargetInfo {
  const char* name;
  LoraTargetMember member;
};
constexpr DenseTargetInfo kDenseTargets[kNumDenseTargets] = {
    {"q_proj", &io::LayerLora::q_proj},
    {"k_proj", &io::LayerLora::k_proj},
    {"v_proj", &io::LayerLora::v_proj},
    {"o_proj", &io::LayerLora::o_proj},
    {"q_a_proj", &io::LayerLora::q_a_proj},
    {"q_b_proj", &io::LayerLora::q_b_proj},
    {"kv_a_proj_with_mqa", &io::LayerLora::kv_a_proj_with_mqa},
    {"kv_b_proj", &io::LayerLora::kv_b_proj},
    {"mlp.gate_proj", &io::LayerLora::mlp_gate},
    {"mlp.up_proj", &io::LayerLora::mlp_up},
    {"mlp.down_proj", &io::LayerLora::mlp_down},
    {"linear_attn.in_proj_qkv", &io::LayerLora::in_proj_qkv},
    {"linear_attn.in_proj_z", &io::LayerLora::in_proj_z},
    {"linear_attn.in_proj_b", &io::LayerLora::in_proj_b},
    {"linear_attn.in_proj_a", &io::LayerLora::in_proj_a},
    {"linear_attn.out_proj", &io::LayerLora::out_proj},
};

struct Linear {  // y = x W^T, W bf16 [out, in] on the device
  bf16* w = nullptr;
  int out = 0, in = 0;
};

struct DenseLoraPool {  // A [S, 1, R, in], B [S, 1, out, R], scaling [S], rank [S]
  bf16* a = nullptr;
  bf16* b = nullptr;
  float* scaling = nullptr;
  int32_t* rank = nullptr;
  int in = 0, out = 0;
  bool present() const { return a != nullptr; }
};

struct Layer {
  bool is_moe = false;
  bf16* input_norm = nullptr;
  bf16* post_norm = nullptr;
  // GQA: q/k/v concatenated into one [q_out + 2 kv_out, H] weight. Qwen3.5's gated attention
  // (gated): q_out = 2 Hq D, its rows regrouped at upload from per-head [q | gate] to
  // [q of every head | gate of every head], so q is a plain [Hq, D] block and the gate follows it.
  Linear qkv;
  int q_out = 0, kv_out = 0;
  bool gated = false;
  int kv_index = -1;  // attention layers: this layer's place in the KV cache (linear layers: -1)
  bf16* q_norm = nullptr;
  bf16* k_norm = nullptr;
  // MLA
  Linear q_a, q_b, q_proj, kv_a, kv_b;
  bf16* q_a_norm = nullptr;
  bf16* kv_a_norm = nullptr;
  Linear o;
  // Gated DeltaNet (Qwen3.5 "linear_attention" layers): in_proj_qkv / z / b / a stacked into one
  // [conv_dim + value_dim + 2 nv, H] weight, out_proj [H, value_dim], the conv weight [conv_dim,
  // K], A_log / dt_bias [nv] and the gated norm [dv] in fp32; states per state slot.
  bool linear = false;
  Linear gdn_in, gdn_out;
  bf16* conv_weight = nullptr;
  float *a_log = nullptr, *dt_bias = nullptr, *gdn_norm = nullptr;
  bf16* conv_state = nullptr;  // [max_seqs, conv_dim, K - 1]
  float* rec_state = nullptr;  // [max_seqs, nv, dk, dv]
  // dense MLP: gate and up concatenated [2 Id, H]
  Linear gate_up, down;
  int inter = 0;
  // MoE
  std::unique_ptr<ops::cuda::MoeLayerCuda> moe;
  // experts: the routed experts this model holds, [expert_begin, expert_begin + experts) of the
  // config's num_experts (all of them unless expert parallel)
  int experts = 0, expert_begin = 0, moe_inter = 0, shared_inter = 0;
  // LoRA pools of the dense targets (present() only for targets this layer has, slots > 0)
  std::array<DenseLoraPool, kNumDenseTargets> lora;
};

struct TargetDims {
  int in = 0, out = 0;
  bool exists() const { return in > 0; }
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    MOELORA_CUDA_CHECK(cudaMallocHost(&ptr_, bytes));
    std::memset(ptr_, 0, bytes);
  }
  ~PinnedBuffer() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The source may be freed on return; the bytes may still be in flight to the device: the public
// upload APIs end with a wait (finish_construction's device sync, write_slot / clear_slot's
// cuda::wait_for_host_copies) before any device work reads them.
inline void copy_to_device(void* dst, const void* src, size_t bytes) {
  MOELORA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

// Any float tensor as bf16 bits (bf16 tensors copied as they are).
inline std::vector<uint16_t> tensor_bf16_bits(const Tensor& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::kBF16) {
    std::memcpy(out.data(), t.raw_data(), out.size() * 2);
    return out;
  }
  const Tensor f = t.to_f32();
  const float* p = f.data<float>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = f32_to_bf16_bits(p[i]);
  return out;
}

// One linear weight as bf16 [out, in] into dst (dense bf16 copied, everything else dequantized).
inline void linear_bf16_bits(const io::LinearWeight& w, uint16_t* dst) {
  if (w.format == io::WeightFormat::kDense && w.weight.dtype() == DType::kBF16) {
    check_shape(w.weight, {w.out_features, w.in_features}, "weight '" + w.name + "'");
    std::memcpy(dst, w.weight.raw_data(), static_cast<size_t>(w.out_features * w.in_features) * 2);
    return;
  }
  const Tensor f = dequantize_linear(w);
  const float* p = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) dst[i] = f32_to_bf16_bits(p[i]);
}

inline bool is_fp8_block_128(const io::LinearWeight& w) {
  return w.format == io::WeightFormat::kFp8Block && w.block_n == 128 && w.block_k == 128 &&
         w.scale.defined() && w.scale.dtype() == DType::kF32;
}

class GpuModelImpl final : public GpuModel {
 public:
  GpuModelImpl(const io::ModelConfig& config, const GpuModelLimits& limits,
               const GpuModelOptions& options);

  ~GpuModelImpl() override {
    // Nothing may still run on the streams when the buffers go.
    cudaStreamSynchronize(main_.get());
    cudaStreamSynchronize(side_.get());
  }

  // ---------------------------------------------------------------- construction

  void upload(const io::ModelWeights& weights);

  void randomize(uint64_t seed, bool fp8_experts);

  // ---------------------------------------------------------------- GpuModel interface

  const io::ModelConfig& config() const override { return config_; }
  const GpuModelLimits& limits() const override { return limits_; }

  void check_adapter(const io::LoraAdapter& adapter) const override;
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override;
  void clear_slot(int32_t slot) override;
  void randomize_slot(int32_t slot, int rank, bool shared_outer, uint64_t seed) override;

  StepMetadata& host_step() override { return host_step_; }
  const StepMetadata& device_step() const override { return device_step_; }
  void upload_step(const ForwardShape& shape, cudaStream_t stream) override;

  const char* attention_kernel() const override {
    return config_.use_mla ? "moelora-mla" : flashinfer_ ? "flashinfer" : "moelora";
  }
  int shared_experts_in_experts() const override {
    int n = 0;
    for (const Layer& layer : layers_) n += layer.moe && layer.moe->config().shared_in_experts;
    return n;
  }
  int gdn_delta_rows() const override { return gdn_delta_ ? gdn_delta_rows_ : 0; }

  void forward(const ForwardShape& shape) override;
  const float* logits() const override { return logits_; }
  const int32_t* sampled() const override { return sampled_; }
  const int32_t* moe_topk_ids(int64_t layer) const override {
    if (layer < 0 || layer >= static_cast<int64_t>(layers_.size()) || !layers_[layer].moe)
      return nullptr;
    return layers_[layer].moe->topk_ids();
  }
  cudaStream_t main_stream() const override { return main_.get(); }
  uint64_t weight_bytes() const override { return weight_bytes_; }
  uint64_t kv_bytes_per_token() const override { return kv_bytes_per_token_; }
  uint64_t device_bytes() const override { return device_bytes_; }
  int num_state_slots() const override { return has_linear_ ? limits_.max_seqs : 0; }
  void reset_state(int32_t state_slot, cudaStream_t stream) override;
  void copy_state(int32_t src, int32_t dst, cudaStream_t stream) override;

 private:
  // ---- allocation ----
  template <typename T>
  T* alloc_weight(size_t count) {
    buffers_.emplace_back(std::max<size_t>(count * sizeof(T), 16));
    weight_bytes_ += count * sizeof(T);
    return buffers_.back().as<T>();
  }
  template <typename T>
  T* alloc(size_t count) {
    buffers_.emplace_back(std::max<size_t>(count * sizeof(T), 16));
    buffers_.back().zero();
    return buffers_.back().as<T>();
  }

  bf16* upload_plain(const Tensor& t, const Shape& shape, const std::string& what);

  // Uploads several linears with the same input width stacked along the output rows.
  Linear upload_stacked(std::initializer_list<const io::LinearWeight*> parts);
  Linear upload_linear(const io::LinearWeight& w) { return upload_stacked({&w}); }

  ops::cuda::MoeLayerConfig moe_config(const Layer& layer, bool shared_gate) const;
  // Whether the layer's shared expert runs as one more expert of its FP8 routed GEMMs
  // (MoeLayerConfig::shared_in_experts): the option on, FP8 experts, a shared expert of the routed
  // experts' size, every routed expert on this GPU and E + 1 within the decode GEMMs' bound
  // (kMoeLayerStreamMaxExperts). A loaded checkpoint must also hold the shared expert in FP8
  // 128x128 blocks (the caller checks).
  bool shared_expert_in_experts(const Layer& layer, bool fp8_experts) const;
  // The options' MoE knobs (router GEMM path, side-stream scheduling) on a new layer.
  void configure_moe(ops::cuda::MoeLayerCuda& moe) const;

  void upload_layer(const io::LayerWeights& src, int64_t l);

  // (in, out) of a dense LoRA target in layer l, from the config and the layer's kind; in = 0
  // when the layer has no such module.
  TargetDims target_dims(int64_t l, int target) const;

  void finish_construction();

  // ---- forward pieces ----
  ops::cuda::AttentionBatch batch(const ForwardShape& shape) const;

  ops::cuda::LoraPoolTarget pool_view(const DenseLoraPool& pool) const {
    ops::cuda::LoraPoolTarget v;
    v.a = pool.a;
    v.b = pool.b;
    v.scaling = pool.scaling;
    v.rank = pool.rank;
    v.num_slots = limits_.num_slots;
    v.ea = v.eb = 1;
    v.max_rank = std::max(limits_.max_rank, 8);
    v.in_features = pool.in;
    v.out_features = pool.out;
    return v;
  }

  void rms_norm(const bf16* x, bf16* residual, const bf16* weight, bf16* y, int rows,
                const int32_t* num_rows, int dim, int64_t x_stride = 0, int64_t y_stride = 0) const;

  void rope(bf16* x, const ForwardShape& shape, int heads, int64_t token_stride,
            int64_t head_stride, int dim_offset) const;

  // One base GEMM of a projection: y [T, w.out] = x [T, w.in] W^T.
  struct ProjectGemm {
    const Linear* w;
    bf16* y;
  };
  // One dense LoRA target of a projection: its delta [T, out] is added into the columns
  // [column, column + out) of y (row stride y_stride elements).
  struct ProjectLora {
    int target;
    bf16* y;
    int column;
    int y_stride;
  };

  // y [T, w.out] = x [T, w.in] W^T, plus the LoRA delta of each (target, first column) of `loras`
  // on the rows of the LoRA segments. With `lora_delta` ([T, w.out], laid out like y) the deltas
  // are written there instead, on the side stream (see project_group); returns whether they were.
  bool project(const ForwardShape& shape, const Layer& layer, const bf16* x, const Linear& w,
               bf16* y, std::initializer_list<std::pair<int, int>> loras,
               bf16* lora_delta = nullptr);

  // The projections that write branch_ (o_proj, out_proj, a dense MLP's down_proj): the LoRA delta
  // goes to branch_delta_ and the residual RMSNorm that reads branch_ next adds it
  // (branch_norm); base-only steps and models without slots project as usual.
  void project_branch(const ForwardShape& shape, const Layer& layer, const bf16* x, const Linear& w,
                      int target);
  // resid += branch_ (+ its pending LoRA delta); hnorm = norm(resid).
  void branch_norm(const ForwardShape& shape, const bf16* weight);
  // branch_ += its pending LoRA delta (add_rows), where no RMSNorm will add it.
  void add_pending_branch_delta(const ForwardShape& shape);

  // The base GEMMs of `gemms` and the LoRA of every target of `loras`, all reading x [T, in]
  // (q/k/v of one fused GEMM; MLA's q_a and kv_a; gate and up): one shrink launch for all targets
  // on the side stream (forked once x is ready) while the main stream runs the base GEMMs, then,
  // after the join, one expand launch on the main stream that adds every target's delta straight
  // into its output columns (LoraExpandMode::kAdd).
  //
  // Why the expand runs on the main stream: the shrink reads a few hundred KB and fits under the
  // base GEMM (at decode ~2-4 us against 5-7 us for the qkv or o GEMM of Qwen3-30B-A3B), so the
  // join is free and the main stream pays for one small kernel, the same count as the add_rows
  // that used to follow it, but no longer waits for a side chain of shrink + expand; it also
  // reads the fp32 partials ([splits, T, R], ~100 KB) instead of a bf16 delta [T, out]. Folding
  // the add into the consumers (the qkv prologue, the next residual RMSNorm) was measured on the
  // H200 and gained nothing: each consumer row re-reads B, which the expand reads once per CTA
  // (docs/gpu_engine.md §3a). The in-place add cannot run on the side stream: no cross-stream
  // in-place add on a buffer the main stream writes. Rounding is that of expand + add_rows: the
  // delta is rounded to bf16, then added to the bf16 output in fp32 and rounded once.
  //
  // With `lora_delta` (a buffer laid out like the outputs) the expand writes the deltas there
  // (LoraExpandMode::kWrite) on the side stream right after the shrink, beside the base GEMM, and
  // the main stream only waits for the join: the consumer adds the delta rows as it reads its
  // input (the residual RMSNorm after o_proj: rms_norm's x_delta, same rounding; unlike the
  // consumer fold above it reads a finished delta row, it does not recompute it from B). On the
  // H200 this took 1.5-2 % off a LoRA decode step (docs/gpu_engine.md §3a); the q/k/v targets
  // still use the main-stream expand. Returns whether deltas were written (false: no LoRA work
  // this step, nothing to add).
  bool project_group(const ForwardShape& shape, const Layer& layer, const bf16* x,
                     std::span<const ProjectGemm> gemms, std::span<const ProjectLora> loras,
                     bf16* lora_delta = nullptr);

  void gqa_attention(const ForwardShape& shape, const Layer& layer, int64_t l);
  void linear_attention(const ForwardShape& shape, const Layer& layer);
  ops::GdnShape gdn_shape() const;
  float* upload_f32(const Tensor& t, const Shape& shape, const std::string& what);

  void mla_attention(const ForwardShape& shape, const Layer& layer, int64_t l);

  void ffn(const ForwardShape& shape, const Layer& layer);

  // Tensor / expert parallel models: branch_ (the half-layer's partial output, its pending LoRA
  // delta added first) summed over the group; a no-op on one GPU.
  void reduce_branch(const ForwardShape& shape);
  // The routed experts this rank holds of a layer's num_routed (GpuModelOptions::collectives):
  // sets layer.experts and layer.expert_begin; kInvalidArgument when the ranks do not divide them
  // or a checkpoint's share holds another count.
  void set_local_experts(Layer& layer, int64_t held) const;

  // Writes one adapter factor pair into `slot` of a dense pool (rank tail zero); null = rank 0.
  void write_dense_pool(const DenseLoraPool& pool, int32_t slot, const LoraFactors* f,
                        bool gated_q);

  void check_slot_index(int32_t slot) const {
    MOELORA_CHECK(slot >= 0 && slot < limits_.num_slots, ErrorCode::kOutOfRange,
                  "GpuModel: adapter slot ", slot, " is not in [0, ", limits_.num_slots, ")");
  }

  io::ModelConfig config_;
  GpuModelLimits limits_;
  GpuModelOptions options_;
  size_t free_at_start_ = 0;
  int hidden_ = 0, vocab_ = 0;
  // The vocabulary rows this model holds of its embedding and lm_head (vocab_shard: a rank of a
  // group whose size divides V holds [vocab_begin_, + vocab_rows_), looks up only those ids and
  // sums the embedding over the group, and gathers the logits); else all V.
  int vocab_begin_ = 0, vocab_rows_ = 0;
  bool vocab_split_ = false;

  cuda::Stream main_, side_;
  cuda::Event fork_, join_;
  std::optional<cuda::CublasHandle> cublas_;
  std::vector<cuda::DeviceBuffer> buffers_;
  uint64_t weight_bytes_ = 0, device_bytes_ = 0, kv_bytes_per_token_ = 0;
  // The MoE layers' transient buffers, one allocation for all of them (they run one after another
  // on main_ / side_); declared before layers_ so that it outlives them.
  ops::cuda::MoeSharedWorkspace moe_workspace_;

  std::vector<Layer> layers_;
  bf16* embed_ = nullptr;
  bf16* final_norm_ = nullptr;
  bf16* lm_head_ = nullptr;

  float* inv_freq_ = nullptr;
  int rotary_dim_ = 0;
  float attention_factor_ = 1.0f;
  float attention_scale_ = 0.0f;
  ops::cuda::MlaShape mla_shape_;
  int latent_width_ = 0;

  size_t kv_layer_elems_ = 0;
  bf16* k_cache_ = nullptr;
  bf16* v_cache_ = nullptr;
  bf16* latent_cache_ = nullptr;

  bf16 *resid_ = nullptr, *hnorm_ = nullptr, *branch_ = nullptr;
  // [T, H]: the LoRA delta of the projection that last wrote branch_ (project_branch), added by
  // the next branch_norm while branch_delta_pending_; nullptr without adapter slots.
  bf16* branch_delta_ = nullptr;
  bool branch_delta_pending_ = false;
  bf16 *qkv_ = nullptr, *attn_ = nullptr;
  // [qkv_delta_rows_, qkv width]: the qkv projection's LoRA delta of forwards of at most that
  // many rows (decode), written on the side stream beside the base GEMM and added by the qkv
  // prologue; nullptr without adapter slots.
  bf16* qkv_delta_ = nullptr;
  int qkv_delta_rows_ = 0;
  bf16 *q_lat_ = nullptr, *q_ = nullptr, *kv_ = nullptr, *q_full_ = nullptr, *o_lat_ = nullptr;
  bf16 *gate_up_ = nullptr, *act_ = nullptr;
  // Gated DeltaNet: projections [T, conv_dim + value_dim + 2 nv], mix output [T, value_dim]
  bool has_linear_ = false;
  int num_sms_ = 0;
  bf16 *gdn_proj_ = nullptr, *gdn_mix_ = nullptr;
  // [gdn_delta_rows_, gdn_proj_ width]: the in-projection's LoRA delta of forwards of at most that
  // many rows that take no chunked rule, written on the side stream beside the base GEMM and added
  // by the mix kernels as they read their inputs (ops::cuda::GdnInputDelta); nullptr without
  // adapter slots or without GpuModelOptions::gdn_lora_delta_in_mix.
  bf16* gdn_delta_ = nullptr;
  int gdn_delta_rows_ = 0;
  uint8_t* gdn_ws_ = nullptr;
  size_t gdn_ws_bytes_ = 0;
  uint8_t* attn_ws_ = nullptr;
  // GQA attention through FlashInfer's kernel (planned in upload_step); null: moelora's kernel.
  std::unique_ptr<ops::cuda::FlashInferAttention> flashinfer_;
  float* lora_partial_ = nullptr;
  bf16 *last_branch_ = nullptr, *last_resid_ = nullptr, *last_norm_ = nullptr;
  float* logits_ = nullptr;
  // Split vocabulary: this rank's logits [max_seqs, vocab_rows_] and every rank's, gathered
  // [ranks, max_seqs, vocab_rows_] (rank-major, as the all-gather delivers them).
  float *local_logits_ = nullptr, *gathered_logits_ = nullptr;
  int32_t* sampled_ = nullptr;

  std::unique_ptr<PinnedBuffer> step_host_;
  cuda::DeviceBuffer step_device_;
  size_t step_bytes_ = 0;
  StepMetadata host_step_{}, device_step_{};
};

}  // namespace moelora::model::gpu_impl
