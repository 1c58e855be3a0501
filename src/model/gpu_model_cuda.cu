// GpuModel: the whole decoder on one GPU (gpu_model_cuda.cuh). This file holds the weights
// (uploaded layer by layer from a checkpoint, or drawn on the device), the paged KV cache, the
// dense LoRA pools, the per-step metadata block, the workspace and the forward pass. The MoE
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
// multi-target expand on the main stream that adds the deltas into the output columns.
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
#include "ops/embedding/embedding_cuda.cuh"
#include "ops/linear/linear_cuda.cuh"
#include "ops/lora/lora_cuda.cuh"
#include "ops/mla/mla.h"
#include "ops/mla/mla_cuda.cuh"
#include "ops/moe/moe_layer_cuda.cuh"
#include "ops/norm/norm_cuda.cuh"
#include "ops/rope/rope.h"
#include "ops/rope/rope_cuda.cuh"
#include "ops/sample/sample_cuda.cuh"

namespace moelora::model {

namespace {

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
  // GQA: q/k/v concatenated into one [q_out + 2 kv_out, H] weight
  Linear qkv;
  int q_out = 0, kv_out = 0;
  bf16* q_norm = nullptr;
  bf16* k_norm = nullptr;
  // MLA
  Linear q_a, q_b, q_proj, kv_a, kv_b;
  bf16* q_a_norm = nullptr;
  bf16* kv_a_norm = nullptr;
  Linear o;
  // dense MLP: gate and up concatenated [2 Id, H]
  Linear gate_up, down;
  int inter = 0;
  // MoE
  std::unique_ptr<ops::cuda::MoeLayerCuda> moe;
  int experts = 0, moe_inter = 0, shared_inter = 0;
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
void copy_to_device(void* dst, const void* src, size_t bytes) {
  MOELORA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

// Any float tensor as bf16 bits (bf16 tensors copied as they are).
std::vector<uint16_t> tensor_bf16_bits(const Tensor& t) {
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
void linear_bf16_bits(const io::LinearWeight& w, uint16_t* dst) {
  if (w.format == io::WeightFormat::kDense && w.weight.dtype() == DType::kBF16) {
    check_shape(w.weight, {w.out_features, w.in_features}, "weight '" + w.name + "'");
    std::memcpy(dst, w.weight.raw_data(), static_cast<size_t>(w.out_features * w.in_features) * 2);
    return;
  }
  const Tensor f = dequantize_linear(w);
  const float* p = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) dst[i] = f32_to_bf16_bits(p[i]);
}

bool is_fp8_block_128(const io::LinearWeight& w) {
  return w.format == io::WeightFormat::kFp8Block && w.block_n == 128 && w.block_k == 128 &&
         w.scale.defined() && w.scale.dtype() == DType::kF32;
}

class GpuModelImpl final : public GpuModel {
 public:
  GpuModelImpl(const io::ModelConfig& config, const GpuModelLimits& limits,
               const GpuModelOptions& options)
      : config_(config), limits_(limits), options_(options), fork_(false), join_(false) {
    // Qwen3.5's hybrid layers: name the first Gated DeltaNet layer, the part that is missing,
    // before the architecture check below refuses the model as a whole.
    const auto linear = std::count(config_.layer_types.begin(), config_.layer_types.end(),
                                   std::string("linear_attention"));
    for (size_t l = 0; l < config_.layer_types.size(); ++l) {
      MOELORA_CHECK(config_.layer_types[l] != "linear_attention", ErrorCode::kUnsupported,
                    "GpuModel: layer ", l, " of the ", config_.model_type,
                    " model is a linear_attention layer (", linear, " of its ",
                    config_.layer_types.size(),
                    " layers are); Gated DeltaNet layers are not implemented on the GPU yet");
    }
    MOELORA_CHECK(config_.arch == io::Architecture::kQwen3Moe ||
                      (config_.arch == io::Architecture::kDeepseekV3 && config_.use_mla),
                  ErrorCode::kUnsupported, "GpuModel: ", io::architecture_name(config_.arch),
                  " (model_type '", config_.model_type,
                  "') is not supported; supported: qwen3_moe, deepseek_v3 / kimi_k2 with MLA");
    MOELORA_CHECK(!config_.attention_output_gate, ErrorCode::kUnsupported,
                  "GpuModel: gated attention is not implemented");
    MOELORA_CHECK(limits_.max_tokens > 0 && limits_.max_seqs > 0, ErrorCode::kInvalidArgument,
                  "GpuModel: limits max_tokens = ", limits_.max_tokens,
                  " and max_seqs = ", limits_.max_seqs, " must be positive");
    MOELORA_CHECK(limits_.num_slots >= 0, ErrorCode::kInvalidArgument,
                  "GpuModel: num_slots = ", limits_.num_slots, " must be >= 0");
    MOELORA_CHECK(limits_.num_slots == 0 || (limits_.max_rank > 0 && limits_.max_rank % 8 == 0),
                  ErrorCode::kInvalidArgument, "GpuModel: max_rank = ", limits_.max_rank,
                  " must be a positive multiple of 8 when adapter slots exist");
    MOELORA_CHECK(limits_.page_size >= 16 && (limits_.page_size & (limits_.page_size - 1)) == 0,
                  ErrorCode::kInvalidArgument, "GpuModel: page_size = ", limits_.page_size,
                  " must be a power of two >= 16");
    if (limits_.max_pages_per_seq <= 0) {
      limits_.max_pages_per_seq = static_cast<int>(
          (config_.max_position_embeddings + limits_.page_size - 1) / limits_.page_size);
    }
    MOELORA_CHECK(
        limits_.max_pages_per_seq > 0, ErrorCode::kInvalidArgument,
        "GpuModel: max_pages_per_seq must be positive (or derivable from max_position_embeddings)");
    MOELORA_CUDA_CHECK(cudaSetDevice(options_.device));
    size_t total = 0;
    MOELORA_CUDA_CHECK(cudaMemGetInfo(&free_at_start_, &total));
    cublas_.emplace(32u << 20);
    hidden_ = static_cast<int>(config_.hidden_size);
    vocab_ = static_cast<int>(config_.vocab_size);
    layers_.resize(static_cast<size_t>(config_.num_hidden_layers));
  }

  ~GpuModelImpl() override {
    // Nothing may still run on the streams when the buffers go.
    cudaStreamSynchronize(main_.get());
    cudaStreamSynchronize(side_.get());
  }

  // ---------------------------------------------------------------- construction

  void upload(const io::ModelWeights& weights) {
    const int64_t L = config_.num_hidden_layers;
    MOELORA_CHECK(static_cast<int64_t>(weights.layers.size()) == L, ErrorCode::kInvalidArgument,
                  "GpuModel: the checkpoint holds ", weights.layers.size(),
                  " layers but the config has ", L);
    std::optional<ProgressBar> bar;
    if (options_.show_progress)
      bar.emplace("Uploading weights to the GPU", static_cast<uint64_t>(L + 1), "layers");
    embed_ = upload_plain(weights.embed_tokens, {config_.vocab_size, config_.hidden_size},
                          "embed_tokens");
    final_norm_ = upload_plain(weights.final_norm, {config_.hidden_size}, "norm");
    lm_head_ = weights.tied_embeddings ? embed_ : upload_linear(weights.lm_head).w;
    if (bar) bar->advance();
    for (int64_t l = 0; l < L; ++l) {
      upload_layer(weights.layers[static_cast<size_t>(l)], l);
      if (bar) bar->advance();
    }
    if (bar) bar->finish();
    finish_construction();
  }

  void randomize(uint64_t seed, bool fp8_experts) {
    const int64_t H = config_.hidden_size, L = config_.num_hidden_layers;
    const float norm_lo = config_.norm_style == NormStyle::kOnePlusWeight ? -0.1f : 0.9f;
    const float norm_hi = config_.norm_style == NormStyle::kOnePlusWeight ? 0.1f : 1.1f;
    uint64_t stream_id = 0;
    auto next_seed = [&] {
      return seed * 0x9e3779b97f4a7c15ull + (++stream_id) * 0xd1b54a32d192ed03ull;
    };
    auto norm = [&](int64_t n) {
      bf16* p = alloc_weight<bf16>(static_cast<size_t>(n));
      gd::launch_fill_bf16(p, n, {gd::FillKind::kUniform, norm_lo, norm_hi, next_seed()},
                           main_.get());
      return p;
    };
    auto linear = [&](int64_t out, int64_t in) {
      Linear lin{alloc_weight<bf16>(static_cast<size_t>(out * in)), static_cast<int>(out),
                 static_cast<int>(in)};
      gd::launch_fill_bf16(
          lin.w, out * in,
          {gd::FillKind::kNormal, 0.0f, 1.0f / std::sqrt(static_cast<float>(in)), next_seed()},
          main_.get());
      return lin;
    };
    std::optional<ProgressBar> bar;
    if (options_.show_progress)
      bar.emplace("Drawing random weights on the GPU", static_cast<uint64_t>(L + 1), "layers");
    embed_ = alloc_weight<bf16>(static_cast<size_t>(config_.vocab_size * H));
    gd::launch_fill_bf16(embed_, config_.vocab_size * H,
                         {gd::FillKind::kNormal, 0.0f, 1.0f, next_seed()}, main_.get());
    final_norm_ = norm(H);
    lm_head_ = config_.tie_word_embeddings ? embed_ : linear(config_.vocab_size, H).w;
    if (bar) bar->advance();
    for (int64_t l = 0; l < L; ++l) {
      Layer& layer = layers_[static_cast<size_t>(l)];
      layer.input_norm = norm(H);
      layer.post_norm = norm(H);
      if (config_.use_mla) {
        const int64_t n = config_.num_attention_heads, qk = config_.qk_head_dim();
        if (config_.q_lora_rank > 0) {
          layer.q_a = linear(config_.q_lora_rank, H);
          layer.q_a_norm = norm(config_.q_lora_rank);
          layer.q_b = linear(n * qk, config_.q_lora_rank);
        } else {
          layer.q_proj = linear(n * qk, H);
        }
        layer.kv_a = linear(config_.kv_lora_rank + config_.qk_rope_head_dim, H);
        layer.kv_a_norm = norm(config_.kv_lora_rank);
        layer.kv_b =
            linear(n * (config_.qk_nope_head_dim + config_.v_head_dim), config_.kv_lora_rank);
        layer.o = linear(H, n * config_.v_head_dim);
      } else {
        const int64_t q = config_.num_attention_heads * config_.head_dim,
                      kv = config_.num_key_value_heads * config_.head_dim;
        layer.qkv = linear(q + 2 * kv, H);
        layer.q_out = static_cast<int>(q);
        layer.kv_out = static_cast<int>(kv);
        layer.o = linear(H, q);
        if (config_.qk_norm) {
          layer.q_norm = norm(config_.head_dim);
          layer.k_norm = norm(config_.head_dim);
        }
      }
      layer.is_moe = config_.is_moe_layer(l);
      if (!layer.is_moe) {
        layer.inter = static_cast<int>(config_.intermediate_size);
        layer.gate_up = linear(2 * config_.intermediate_size, H);
        layer.down = linear(H, config_.intermediate_size);
      } else {
        layer.experts = static_cast<int>(config_.num_experts);
        layer.moe_inter = static_cast<int>(config_.moe_intermediate_size);
        layer.shared_inter = static_cast<int>(config_.shared_expert_intermediate_size);
        ops::cuda::MoeLayerConfig mc = moe_config(layer, config_.shared_expert_gate);
        const bool fp8 = fp8_experts && layer.moe_inter % 128 == 0;
        mc.bf16_experts = !fp8;
        MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_.get()));
        layer.moe = std::make_unique<ops::cuda::MoeLayerCuda>(mc, ops::cuda::MoeLayerHostWeights{},
                                                              main_.get(), side_.get());
        layer.moe->randomize_weights(next_seed());
      }
      if (bar) bar->advance();
    }
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_.get()));
    if (bar) bar->finish();
    finish_construction();
  }

  // ---------------------------------------------------------------- GpuModel interface

  const io::ModelConfig& config() const override { return config_; }
  const GpuModelLimits& limits() const override { return limits_; }

  void check_adapter(const io::LoraAdapter& adapter) const override;
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override;
  void clear_slot(int32_t slot) override;
  void randomize_slot(int32_t slot, int rank, bool shared_outer, uint64_t seed) override;

  StepMetadata& host_step() override { return host_step_; }
  const StepMetadata& device_step() const override { return device_step_; }
  void upload_step(const ForwardShape& shape, cudaStream_t stream) override {
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

  const char* attention_kernel() const override {
    return config_.use_mla ? "moelora-mla" : flashinfer_ ? "flashinfer" : "moelora";
  }

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

  bf16* upload_plain(const Tensor& t, const Shape& shape, const std::string& what) {
    MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, "GpuModel: ", what, " is missing");
    check_shape(t, shape, "GpuModel: " + what);
    const std::vector<uint16_t> bits = tensor_bf16_bits(t);
    bf16* p = alloc_weight<bf16>(bits.size());
    copy_to_device(p, bits.data(), bits.size() * 2);
    return p;
  }

  // Uploads several linears with the same input width stacked along the output rows.
  Linear upload_stacked(std::initializer_list<const io::LinearWeight*> parts) {
    int64_t rows = 0, in = -1;
    for (const io::LinearWeight* w : parts) {
      MOELORA_CHECK(w->defined(), ErrorCode::kInvalidArgument, "GpuModel: weight '", w->name,
                    "' is missing");
      MOELORA_CHECK(in < 0 || w->in_features == in, ErrorCode::kInvalidArgument,
                    "GpuModel: weight '", w->name, "' has ", w->in_features, " inputs, expected ",
                    in);
      in = w->in_features;
      rows += w->out_features;
    }
    std::vector<uint16_t> bits(static_cast<size_t>(rows * in));
    int64_t row = 0;
    for (const io::LinearWeight* w : parts) {
      linear_bf16_bits(*w, bits.data() + row * in);
      row += w->out_features;
    }
    Linear lin{alloc_weight<bf16>(bits.size()), static_cast<int>(rows), static_cast<int>(in)};
    copy_to_device(lin.w, bits.data(), bits.size() * 2);
    return lin;
  }
  Linear upload_linear(const io::LinearWeight& w) { return upload_stacked({&w}); }

  ops::cuda::MoeLayerConfig moe_config(const Layer& layer, bool shared_gate) const {
    ops::cuda::MoeLayerConfig mc;
    mc.hidden = hidden_;
    mc.inter = layer.moe_inter;
    mc.num_experts = layer.experts;
    mc.top_k = static_cast<int>(config_.num_experts_per_tok);
    mc.route.kind = config_.router;
    mc.route.num_experts = layer.experts;
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

  void upload_layer(const io::LayerWeights& src, int64_t l) {
    Layer& layer = layers_[static_cast<size_t>(l)];
    const int64_t H = config_.hidden_size;
    const std::string where = "layer " + std::to_string(l) + " ";
    layer.input_norm = upload_plain(src.input_layernorm, {H}, where + "input_layernorm");
    layer.post_norm =
        upload_plain(src.post_attention_layernorm, {H}, where + "post_attention_layernorm");
    if (config_.use_mla) {
      if (config_.q_lora_rank > 0) {
        layer.q_a = upload_linear(src.q_a_proj);
        layer.q_a_norm =
            upload_plain(src.q_a_layernorm, {config_.q_lora_rank}, where + "q_a_layernorm");
        layer.q_b = upload_linear(src.q_b_proj);
      } else {
        layer.q_proj = upload_linear(src.q_proj);
      }
      layer.kv_a = upload_linear(src.kv_a_proj_with_mqa);
      layer.kv_a_norm =
          upload_plain(src.kv_a_layernorm, {config_.kv_lora_rank}, where + "kv_a_layernorm");
      layer.kv_b = upload_linear(src.kv_b_proj);
      layer.o = upload_linear(src.o_proj);
    } else {
      layer.qkv = upload_stacked({&src.q_proj, &src.k_proj, &src.v_proj});
      layer.q_out = static_cast<int>(src.q_proj.out_features);
      layer.kv_out = static_cast<int>(src.k_proj.out_features);
      MOELORA_CHECK(
          layer.q_out == config_.num_attention_heads * config_.head_dim &&
              layer.kv_out == config_.num_key_value_heads * config_.head_dim &&
              src.v_proj.out_features == layer.kv_out,
          ErrorCode::kInvalidArgument, "GpuModel: ", where, "q/k/v_proj have ", layer.q_out, " / ",
          layer.kv_out, " / ", src.v_proj.out_features,
          " outputs; expected heads * head_dim = ", config_.num_attention_heads * config_.head_dim,
          " and kv_heads * head_dim = ", config_.num_key_value_heads * config_.head_dim);
      layer.o = upload_linear(src.o_proj);
      if (src.q_norm.defined()) {
        layer.q_norm = upload_plain(src.q_norm, {config_.head_dim}, where + "q_norm");
        layer.k_norm = upload_plain(src.k_norm, {config_.head_dim}, where + "k_norm");
      }
    }
    layer.is_moe = src.is_moe;
    if (!src.is_moe) {
      layer.gate_up = upload_stacked({&src.mlp.gate, &src.mlp.up});
      layer.inter = static_cast<int>(src.mlp.gate.out_features);
      layer.down = upload_linear(src.mlp.down);
      return;
    }
    const io::ExpertWeights& ex = src.experts;
    const int64_t E = ex.num_experts;
    MOELORA_CHECK(E > 0 && static_cast<int64_t>(ex.gate.size()) == E &&
                      static_cast<int64_t>(ex.up.size()) == E &&
                      static_cast<int64_t>(ex.down.size()) == E,
                  ErrorCode::kInvalidArgument, "GpuModel: ", where,
                  "expert weight lists do not hold ", E, " experts");
    const int64_t I = ex.gate[0].out_features;
    layer.experts = static_cast<int>(E);
    layer.moe_inter = static_cast<int>(I);
    layer.shared_inter =
        src.shared_expert.defined() ? static_cast<int>(src.shared_expert.gate.out_features) : 0;

    bool fp8 = I % 128 == 0;
    for (int64_t e = 0; e < E && fp8; ++e)
      fp8 = is_fp8_block_128(ex.gate[e]) && is_fp8_block_128(ex.up[e]) &&
            is_fp8_block_128(ex.down[e]);

    ops::cuda::MoeLayerHostWeights hw;
    hw.router = src.router;
    hw.correction_bias = src.e_score_correction_bias;
    if (fp8) {
      const int64_t hb = (H + 127) / 128, ib = I / 128;
      hw.w13 = Tensor::empty(DType::kF8E4M3, {E, 2 * I, H});
      hw.w13_scale = Tensor::empty(DType::kF32, {E, 2 * ib, hb});
      hw.w2 = Tensor::empty(DType::kF8E4M3, {E, H, I});
      hw.w2_scale = Tensor::empty(DType::kF32, {E, hb, ib});
      uint8_t* w13 = hw.w13.data<uint8_t>();
      float* s13 = hw.w13_scale.data<float>();
      uint8_t* w2 = hw.w2.data<uint8_t>();
      float* s2 = hw.w2_scale.data<float>();
      for (int64_t e = 0; e < E; ++e) {
        check_shape(ex.gate[e].weight, {I, H}, "GpuModel: " + ex.gate[e].name);
        check_shape(ex.up[e].weight, {I, H}, "GpuModel: " + ex.up[e].name);
        check_shape(ex.down[e].weight, {H, I}, "GpuModel: " + ex.down[e].name);
        check_shape(ex.gate[e].scale, {ib, hb}, "GpuModel: scale of " + ex.gate[e].name);
        check_shape(ex.up[e].scale, {ib, hb}, "GpuModel: scale of " + ex.up[e].name);
        check_shape(ex.down[e].scale, {hb, ib}, "GpuModel: scale of " + ex.down[e].name);
        std::memcpy(w13 + e * 2 * I * H, ex.gate[e].weight.raw_data(), static_cast<size_t>(I * H));
        std::memcpy(w13 + e * 2 * I * H + I * H, ex.up[e].weight.raw_data(),
                    static_cast<size_t>(I * H));
        std::memcpy(s13 + e * 2 * ib * hb, ex.gate[e].scale.raw_data(),
                    static_cast<size_t>(ib * hb) * 4);
        std::memcpy(s13 + e * 2 * ib * hb + ib * hb, ex.up[e].scale.raw_data(),
                    static_cast<size_t>(ib * hb) * 4);
        std::memcpy(w2 + e * H * I, ex.down[e].weight.raw_data(), static_cast<size_t>(H * I));
        std::memcpy(s2 + e * hb * ib, ex.down[e].scale.raw_data(),
                    static_cast<size_t>(hb * ib) * 4);
      }
    } else {
      hw.w13 = Tensor::empty(DType::kBF16, {E, 2 * I, H});
      hw.w2 = Tensor::empty(DType::kBF16, {E, H, I});
      uint16_t* w13 = hw.w13.data<uint16_t>();
      uint16_t* w2 = hw.w2.data<uint16_t>();
      for (int64_t e = 0; e < E; ++e) {
        MOELORA_CHECK(ex.gate[e].out_features == I && ex.gate[e].in_features == H &&
                          ex.up[e].out_features == I && ex.up[e].in_features == H &&
                          ex.down[e].out_features == H && ex.down[e].in_features == I,
                      ErrorCode::kInvalidArgument, "GpuModel: ", where, "expert ", e,
                      " does not have gate/up [", I, ", ", H, "] and down [", H, ", ", I, "]");
        linear_bf16_bits(ex.gate[e], w13 + e * 2 * I * H);
        linear_bf16_bits(ex.up[e], w13 + e * 2 * I * H + I * H);
        linear_bf16_bits(ex.down[e], w2 + e * H * I);
      }
    }
    if (layer.shared_inter > 0) {
      const io::MlpWeights& sh = src.shared_expert;
      const int64_t Is = layer.shared_inter;
      hw.shared_w13 = Tensor::empty(DType::kBF16, {2 * Is, H});
      hw.shared_w2 = Tensor::empty(DType::kBF16, {H, Is});
      MOELORA_CHECK(
          sh.up.out_features == Is && sh.gate.in_features == H && sh.up.in_features == H &&
              sh.down.out_features == H && sh.down.in_features == Is,
          ErrorCode::kInvalidArgument, "GpuModel: ", where, "shared expert shapes do not match");
      linear_bf16_bits(sh.gate, hw.shared_w13.data<uint16_t>());
      linear_bf16_bits(sh.up, hw.shared_w13.data<uint16_t>() + Is * H);
      linear_bf16_bits(sh.down, hw.shared_w2.data<uint16_t>());
      hw.shared_gate = src.shared_expert_gate;
    }
    ops::cuda::MoeLayerConfig mc = moe_config(layer, src.shared_expert_gate.defined());
    mc.bf16_experts = !fp8;
    layer.moe = std::make_unique<ops::cuda::MoeLayerCuda>(mc, hw, main_.get(), side_.get());
  }

  // (in, out) of a dense LoRA target in layer l, from the config and the layer's kind; in = 0
  // when the layer has no such module.
  TargetDims target_dims(int64_t l, int target) const {
    const Layer& layer = layers_[static_cast<size_t>(l)];
    const int H = hidden_;
    const int n = static_cast<int>(config_.num_attention_heads);
    if (config_.use_mla) {
      const int qk = static_cast<int>(config_.qk_head_dim()),
                r = static_cast<int>(config_.kv_lora_rank);
      const int ql = static_cast<int>(config_.q_lora_rank),
                rope = static_cast<int>(config_.qk_rope_head_dim);
      switch (target) {
        case kQ: return ql > 0 ? TargetDims{} : TargetDims{H, n * qk};
        case kQa: return ql > 0 ? TargetDims{H, ql} : TargetDims{};
        case kQb: return ql > 0 ? TargetDims{ql, n * qk} : TargetDims{};
        case kKva: return {H, r + rope};
        case kKvb: return {r, n * static_cast<int>(config_.qk_nope_head_dim + config_.v_head_dim)};
        case kO: return {n * static_cast<int>(config_.v_head_dim), H};
        default: break;
      }
    } else {
      const int D = static_cast<int>(config_.head_dim),
                kvh = static_cast<int>(config_.num_key_value_heads);
      switch (target) {
        case kQ: return {H, n * D};
        case kK:
        case kV: return {H, kvh * D};
        case kO: return {n * D, H};
        default: break;
      }
    }
    if (!layer.is_moe) {
      switch (target) {
        case kMlpGate:
        case kMlpUp: return {H, layer.inter};
        case kMlpDown: return {layer.inter, H};
        default: break;
      }
    }
    return {};
  }

  void finish_construction() {
    const int T = limits_.max_tokens, B = limits_.max_seqs, S = limits_.num_slots;
    const int R = std::max(limits_.max_rank, 8);
    const int64_t L = config_.num_hidden_layers;
    const int H = hidden_;

    // ---- rope ----
    const ops::RopeParams rope = rope_params(config_);
    const ops::RopeTable table = ops::make_rope_table(rope);
    rotary_dim_ = static_cast<int>(table.rotary_dim);
    attention_factor_ = table.attention_factor;
    inv_freq_ = alloc<float>(table.inv_freq.size());
    copy_to_device(inv_freq_, table.inv_freq.data(), table.inv_freq.size() * 4);
    attention_scale_ =
        config_.use_mla
            ? static_cast<float>(ops::mla_softmax_scale(config_.qk_head_dim(), rope))
            : static_cast<float>(1.0 / std::sqrt(static_cast<double>(config_.head_dim)));

    // ---- LoRA pools of the dense targets ----
    // One projection's targets run in one multi-target shrink, each into its own partials: the
    // partials of all of a layer's dense targets side by side bound any projection's needs.
    size_t partial_bytes = 0;
    if (S > 0) {
      for (int64_t l = 0; l < L; ++l) {
        Layer& layer = layers_[static_cast<size_t>(l)];
        size_t layer_partial_bytes = 0;
        for (int t = 0; t < kNumDenseTargets; ++t) {
          const TargetDims dims = target_dims(l, t);
          if (!dims.exists()) continue;
          MOELORA_CHECK(dims.in % 8 == 0, ErrorCode::kUnsupported, "GpuModel: LoRA on ",
                        kDenseTargets[t].name, " needs in_features % 8 == 0, got ", dims.in);
          DenseLoraPool& pool = layer.lora[t];
          pool.in = dims.in;
          pool.out = dims.out;
          pool.a = alloc<bf16>(static_cast<size_t>(S) * R * dims.in);
          pool.b = alloc<bf16>(static_cast<size_t>(S) * dims.out * R);
          pool.scaling = alloc<float>(S);
          pool.rank = alloc<int32_t>(S);
          layer_partial_bytes += ops::cuda::lora_partial_bytes(dims.in, T, R);
        }
        partial_bytes = std::max(partial_bytes, layer_partial_bytes);
      }
      lora_partial_ = alloc<float>(partial_bytes / 4 + 1);
    }

    // ---- paged KV cache ----
    if (config_.use_mla) {
      latent_width_ = static_cast<int>(config_.kv_lora_rank + config_.qk_rope_head_dim);
      kv_bytes_per_token_ = static_cast<uint64_t>(L) * latent_width_ * 2;
    } else {
      kv_bytes_per_token_ =
          static_cast<uint64_t>(L) * 2 * config_.num_key_value_heads * config_.head_dim * 2;
    }
    if (limits_.num_pages <= 0) {
      limits_.num_pages =
          static_cast<int64_t>(limits_.kv_cache_bytes /
                               (kv_bytes_per_token_ * static_cast<uint64_t>(limits_.page_size)));
    }
    MOELORA_CHECK(limits_.num_pages > 0, ErrorCode::kInvalidArgument,
                  "GpuModel: the KV cache has no pages (num_pages = 0, kv_cache_bytes = ",
                  limits_.kv_cache_bytes, " < one page of ",
                  kv_bytes_per_token_ * limits_.page_size, " bytes)");
    const size_t slots_per_layer = static_cast<size_t>(limits_.num_pages) * limits_.page_size;
    if (config_.use_mla) {
      kv_layer_elems_ = slots_per_layer * latent_width_;
      latent_cache_ = alloc<bf16>(kv_layer_elems_ * L);
    } else {
      kv_layer_elems_ = slots_per_layer * config_.num_key_value_heads * config_.head_dim;
      k_cache_ = alloc<bf16>(kv_layer_elems_ * L);
      v_cache_ = alloc<bf16>(kv_layer_elems_ * L);
    }

    // ---- activations ----
    const size_t t = T;
    resid_ = alloc<bf16>(t * H);
    hnorm_ = alloc<bf16>(t * H);
    branch_ = alloc<bf16>(t * H);
    const int n = static_cast<int>(config_.num_attention_heads);
    if (config_.use_mla) {
      mla_shape_.num_heads = n;
      mla_shape_.nope = static_cast<int>(config_.qk_nope_head_dim);
      mla_shape_.rope = static_cast<int>(config_.qk_rope_head_dim);
      mla_shape_.v_dim = static_cast<int>(config_.v_head_dim);
      mla_shape_.rank = static_cast<int>(config_.kv_lora_rank);
      const size_t qk = config_.qk_head_dim();
      if (config_.q_lora_rank > 0) q_lat_ = alloc<bf16>(t * config_.q_lora_rank);
      q_ = alloc<bf16>(t * n * qk);
      kv_ = alloc<bf16>(t * latent_width_);
      q_full_ = alloc<bf16>(t * n * latent_width_);
      o_lat_ = alloc<bf16>(t * n * config_.kv_lora_rank);
      attn_ = alloc<bf16>(t * n * config_.v_head_dim);
      // A forward may run with fewer sequences than B; size for the largest need of any count.
      size_t ws = 0;
      for (int seqs = 1; seqs <= B; ++seqs)
        ws = std::max(ws, ops::cuda::mla_attention_workspace_bytes(mla_shape_, T, seqs));
      attn_ws_ = alloc<uint8_t>(ws);
    } else {
      const size_t width =
          static_cast<size_t>(n + 2 * config_.num_key_value_heads) * config_.head_dim;
      qkv_ = alloc<bf16>(t * width);
      attn_ = alloc<bf16>(t * n * config_.head_dim);
      const int Hkv = static_cast<int>(config_.num_key_value_heads), D = static_cast<int>(config_.head_dim);
      const bool fi_served = ops::cuda::FlashInferAttention::supports(n, Hkv, D);
      MOELORA_CHECK(options_.attention != AttentionKernel::kFlashInfer || fi_served,
                    ErrorCode::kUnsupported, "GpuModel: FlashInfer attention was asked for, but ",
                    ops::cuda::FlashInferAttention::compiled()
                        ? detail::concat("it does not serve ", n, " / ", Hkv, " heads of head_dim ", D,
                                         " (head_dim 64, 128 or 256)")
                        : std::string("this build has no FlashInfer kernels"));
      if (fi_served && options_.attention != AttentionKernel::kMoelora) {
        ops::cuda::FlashInferAttentionShape fs;
        fs.num_q_heads = n;
        fs.num_kv_heads = Hkv;
        fs.head_dim = D;
        fs.page_size = limits_.page_size;
        fs.max_seqs = B;
        fs.max_tokens = T;
        fs.max_pages_per_seq = limits_.max_pages_per_seq;
        flashinfer_ = std::make_unique<ops::cuda::FlashInferAttention>(fs);
      } else {
        size_t ws = 0;
        for (int seqs = 1; seqs <= B; ++seqs)
          ws = std::max(ws, ops::cuda::paged_attention_workspace_bytes(T, n, D, seqs));
        attn_ws_ = alloc<uint8_t>(ws);
      }
    }
    int max_inter = 0;
    for (const Layer& layer : layers_)
      max_inter = std::max(max_inter, layer.is_moe ? 0 : layer.inter);
    if (max_inter > 0) {
      gate_up_ = alloc<bf16>(t * 2 * max_inter);
      act_ = alloc<bf16>(t * max_inter);
    }
    last_branch_ = alloc<bf16>(static_cast<size_t>(B) * H);
    last_resid_ = alloc<bf16>(static_cast<size_t>(B) * H);
    last_norm_ = alloc<bf16>(static_cast<size_t>(B) * H);
    logits_ = alloc<float>(static_cast<size_t>(B) * vocab_);
    sampled_ = alloc<int32_t>(B);

    // ---- step metadata: one block, host mirror pinned ----
    size_t offset = 0;
    auto reserve = [&](size_t bytes) {
      const size_t at = (offset + 15) / 16 * 16;
      offset = at + bytes;
      return at;
    };
    const size_t o_num_tokens = reserve(4), o_num_seqs = reserve(4), o_ids = reserve(t * 4),
                 o_slot = reserve(t * 4), o_seq = reserve(t * 4), o_pos = reserve(t * 4),
                 o_q_start = reserve(B * 4), o_q_len = reserve(B * 4), o_kv_len = reserve(B * 4),
                 o_last = reserve(B * 4),
                 o_pages = reserve(static_cast<size_t>(B) * limits_.max_pages_per_seq * 4),
                 o_num_seg = reserve(4), o_seg = reserve(static_cast<size_t>(std::max(S, 1)) * 16),
                 o_sample = reserve(B * sizeof(ops::SampleRowParams)), o_uniform = reserve(B * 4);
    step_bytes_ = (offset + 15) / 16 * 16;
    step_host_ = std::make_unique<PinnedBuffer>(step_bytes_);
    step_device_ = cuda::DeviceBuffer(step_bytes_);
    step_device_.zero();
    auto bind = [&](StepMetadata& m, char* base) {
      m.num_tokens = reinterpret_cast<int32_t*>(base + o_num_tokens);
      m.num_seqs = reinterpret_cast<int32_t*>(base + o_num_seqs);
      m.token_ids = reinterpret_cast<int32_t*>(base + o_ids);
      m.token_slot = reinterpret_cast<int32_t*>(base + o_slot);
      m.token_seq = reinterpret_cast<int32_t*>(base + o_seq);
      m.token_pos = reinterpret_cast<int32_t*>(base + o_pos);
      m.q_start = reinterpret_cast<int32_t*>(base + o_q_start);
      m.q_len = reinterpret_cast<int32_t*>(base + o_q_len);
      m.kv_len = reinterpret_cast<int32_t*>(base + o_kv_len);
      m.last_row = reinterpret_cast<int32_t*>(base + o_last);
      m.page_table = reinterpret_cast<int32_t*>(base + o_pages);
      m.num_lora_segments = reinterpret_cast<int32_t*>(base + o_num_seg);
      m.lora_segments = reinterpret_cast<int32_t*>(base + o_seg);
      m.sample_params = reinterpret_cast<ops::SampleRowParams*>(base + o_sample);
      m.uniform = reinterpret_cast<float*>(base + o_uniform);
    };
    bind(host_step_, static_cast<char*>(step_host_->get()));
    bind(device_step_, static_cast<char*>(step_device_.get()));
    // A harmless default: no rows, no sequences, padding slots -1, greedy sampling.
    std::fill_n(host_step_.token_slot, T, -1);
    std::fill_n(host_step_.token_seq, T, -1);
    for (int b = 0; b < B; ++b) host_step_.sample_params[b] = ops::SampleRowParams{};

    for (int s = 0; s < S; ++s) clear_slot(s);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    size_t free_now = 0, total = 0;
    MOELORA_CUDA_CHECK(cudaMemGetInfo(&free_now, &total));
    device_bytes_ = free_at_start_ > free_now ? free_at_start_ - free_now : 0;
    for (const Layer& layer : layers_) {
      if (layer.moe)
        weight_bytes_ +=
            layer.moe->expert_bytes() + layer.moe->router_bytes() + layer.moe->shared_bytes();
    }
  }

  // ---- forward pieces ----
  ops::cuda::AttentionBatch batch(const ForwardShape& shape) const {
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
                const int32_t* num_rows, int dim, int64_t x_stride = 0,
                int64_t y_stride = 0) const {
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

  void rope(bf16* x, const ForwardShape& shape, int heads, int64_t token_stride,
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
  // on the rows of the LoRA segments.
  void project(const ForwardShape& shape, const Layer& layer, const bf16* x, const Linear& w,
               bf16* y, std::initializer_list<std::pair<int, int>> loras) {
    std::array<ProjectLora, ops::cuda::kLoraMaxTargets> targets{};
    MOELORA_ASSERT(loras.size() <= targets.size(), "a projection has ", loras.size(),
                   " LoRA targets");
    size_t n = 0;
    for (const auto& [target, column] : loras) targets[n++] = {target, y, column, w.out};
    const ProjectGemm gemm{&w, y};
    project_group(shape, layer, x, std::span(&gemm, 1), std::span(targets.data(), n));
  }

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
  // reads the fp32 partials ([splits, T, R], ~100 KB) instead of a bf16 delta [T, out]. The add
  // cannot move into the consumers (q/k norms, rope, the next residual RMSNorm) without putting
  // LoRA into every one of them, and it cannot run on the side stream: no cross-stream in-place
  // add on a buffer the main stream writes. Rounding is that of expand + add_rows: the delta is
  // rounded to bf16, then added to the bf16 output in fp32 and rounded once.
  void project_group(const ForwardShape& shape, const Layer& layer, const bf16* x,
                     std::span<const ProjectGemm> gemms, std::span<const ProjectLora> loras) {
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
        expand.targets[i].out = l.y + l.column;
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
      expand.mode = ops::cuda::LoraExpandMode::kAdd;
      fork_.record(main);
      MOELORA_CUDA_CHECK(cudaStreamWaitEvent(side, fork_.get(), 0));
      ops::cuda::launch_lora_shrink_multi(shrink, side);
      join_.record(side);
    }
    for (const ProjectGemm& g : gemms) {
      gd::gemm_bf16(static_cast<cublasHandle_t>(cublas_->get()), main, x, g.w->in, g.w->w, g.y,
                    CUDA_R_16BF, g.w->out, shape.tokens, g.w->out, g.w->in);
    }
    if (!use_lora) return;
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(main, join_.get(), 0));
    ops::cuda::launch_lora_expand_multi(expand, main);
  }

  void gqa_attention(const ForwardShape& shape, const Layer& layer, int64_t l) {
    const StepMetadata& d = device_step_;
    const int Hq = static_cast<int>(config_.num_attention_heads),
              Hkv = static_cast<int>(config_.num_key_value_heads);
    const int D = static_cast<int>(config_.head_dim);
    const int width = layer.qkv.out;
    project(shape, layer, hnorm_, layer.qkv, qkv_,
            {{kQ, 0}, {kK, layer.q_out}, {kV, layer.q_out + layer.kv_out}});
    if (layer.q_norm) {
      for (const auto& [ptr, heads, weight] : {std::tuple{qkv_, Hq, layer.q_norm},
                                               std::tuple{qkv_ + layer.q_out, Hkv, layer.k_norm}}) {
        gd::HeadNormArgs a;
        a.x = ptr;
        a.tokens = shape.tokens;
        a.num_tokens = d.num_tokens;
        a.heads = heads;
        a.head_dim = D;
        a.token_stride = width;
        a.weight = weight;
        a.eps = static_cast<float>(config_.rms_norm_eps);
        a.style = config_.norm_style;
        gd::launch_head_rms_norm(a, main_.get());
      }
    }
    rope(qkv_, shape, Hq, width, D, 0);
    rope(qkv_ + layer.q_out, shape, Hkv, width, D, 0);

    ops::cuda::PagedKv cache;
    cache.k = k_cache_ + static_cast<size_t>(l) * kv_layer_elems_;
    cache.v = v_cache_ + static_cast<size_t>(l) * kv_layer_elems_;
    cache.page_size = limits_.page_size;
    cache.num_kv_heads = Hkv;
    cache.head_dim = D;
    cache.v_head_dim = D;
    ops::cuda::PagedKvAppendArgs append;
    append.cache = cache;
    append.batch = batch(shape);
    append.k = qkv_ + layer.q_out;
    append.k_stride = width;
    append.v = qkv_ + layer.q_out + layer.kv_out;
    append.v_stride = width;
    ops::cuda::launch_paged_kv_append(append, main_.get());
    ops::cuda::PagedAttentionArgs attn;
    attn.cache = cache;
    attn.batch = append.batch;
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
    project(shape, layer, attn_, layer.o, branch_, {{kO, 0}});
  }

  void mla_attention(const ForwardShape& shape, const Layer& layer, int64_t l) {
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
    cache.kv = latent_cache_ + static_cast<size_t>(l) * kv_layer_elems_;
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
    project(shape, layer, attn_, layer.o, branch_, {{kO, 0}});
  }

  void ffn(const ForwardShape& shape, const Layer& layer) {
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
    project(shape, layer, act_, layer.down, branch_, {{kMlpDown, 0}});
  }

  // Writes one adapter factor pair into `slot` of a dense pool (rank tail zero); null = rank 0.
  void write_dense_pool(const DenseLoraPool& pool, int32_t slot, const LoraFactors* f) {
    const size_t R = std::max(limits_.max_rank, 8);
    std::vector<uint16_t> a(R * pool.in, 0), b(static_cast<size_t>(pool.out) * R, 0);
    int32_t rank = 0;
    float scaling = 0.0f;
    if (f && f->defined()) {
      rank = static_cast<int32_t>(f->rank());
      scaling = f->scaling;
      const float* ap = f->a.data<float>();
      const float* bp = f->b.data<float>();
      for (int64_t i = 0; i < rank * static_cast<int64_t>(pool.in); ++i)
        a[i] = f32_to_bf16_bits(ap[i]);
      for (int64_t o = 0; o < pool.out; ++o)
        for (int64_t i = 0; i < rank; ++i) b[o * R + i] = f32_to_bf16_bits(bp[o * rank + i]);
    }
    copy_to_device(pool.a + slot * R * pool.in, a.data(), a.size() * 2);
    copy_to_device(pool.b + slot * pool.out * R, b.data(), b.size() * 2);
    copy_to_device(pool.scaling + slot, &scaling, 4);
    copy_to_device(pool.rank + slot, &rank, 4);
  }

  void check_slot_index(int32_t slot) const {
    MOELORA_CHECK(slot >= 0 && slot < limits_.num_slots, ErrorCode::kOutOfRange,
                  "GpuModel: adapter slot ", slot, " is not in [0, ", limits_.num_slots, ")");
  }

  io::ModelConfig config_;
  GpuModelLimits limits_;
  GpuModelOptions options_;
  size_t free_at_start_ = 0;
  int hidden_ = 0, vocab_ = 0;

  cuda::Stream main_, side_;
  cuda::Event fork_, join_;
  std::optional<cuda::CublasHandle> cublas_;
  std::vector<cuda::DeviceBuffer> buffers_;
  uint64_t weight_bytes_ = 0, device_bytes_ = 0, kv_bytes_per_token_ = 0;

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
  bf16 *qkv_ = nullptr, *attn_ = nullptr;
  bf16 *q_lat_ = nullptr, *q_ = nullptr, *kv_ = nullptr, *q_full_ = nullptr, *o_lat_ = nullptr;
  bf16 *gate_up_ = nullptr, *act_ = nullptr;
  uint8_t* attn_ws_ = nullptr;
  // GQA attention through FlashInfer's kernel (planned in upload_step); null: moelora's kernel.
  std::unique_ptr<ops::cuda::FlashInferAttention> flashinfer_;
  float* lora_partial_ = nullptr;
  bf16 *last_branch_ = nullptr, *last_resid_ = nullptr, *last_norm_ = nullptr;
  float* logits_ = nullptr;
  int32_t* sampled_ = nullptr;

  std::unique_ptr<PinnedBuffer> step_host_;
  cuda::DeviceBuffer step_device_;
  size_t step_bytes_ = 0;
  StepMetadata host_step_{}, device_step_{};
};

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
  embed.vocab = vocab_;
  ops::cuda::launch_embedding(embed, main);

  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    // resid += branch (the previous half-layer's output); hnorm = norm(resid)
    if (l == 0) {
      rms_norm(resid_, nullptr, layer.input_norm, hnorm_, shape.tokens, d.num_tokens, H);
    } else {
      rms_norm(branch_, resid_, layer.input_norm, hnorm_, shape.tokens, d.num_tokens, H);
    }
    if (config_.use_mla) {
      mla_attention(shape, layer, static_cast<int64_t>(l));
    } else {
      gqa_attention(shape, layer, static_cast<int64_t>(l));
    }
    rms_norm(branch_, resid_, layer.post_norm, hnorm_, shape.tokens, d.num_tokens, H);
    ffn(shape, layer);
  }

  // Output head on each sequence's last row only: gather, final (residual-fused) norm, lm_head.
  gd::launch_gather_rows(branch_, shape.tokens, d.last_row, shape.seqs, H, last_branch_, main);
  gd::launch_gather_rows(resid_, shape.tokens, d.last_row, shape.seqs, H, last_resid_, main);
  rms_norm(last_branch_, last_resid_, final_norm_, last_norm_, shape.seqs, d.num_seqs, H);
  gd::gemm_bf16(static_cast<cublasHandle_t>(cublas_->get()), main, last_norm_, H, lm_head_, logits_,
                CUDA_R_32F, vocab_, shape.seqs, vocab_, H);
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

// ---------------------------------------------------------------- adapters

void GpuModelImpl::check_adapter(const io::LoraAdapter& adapter) const {
  std::string label = "adapter '" + adapter.name + "'";
  if (!adapter.dir.empty()) label += " (" + adapter.dir.string() + ")";
  MOELORA_CHECK(!adapter.name.empty(), ErrorCode::kInvalidArgument,
                "an adapter needs a non-empty name");
  const int64_t L = config_.num_hidden_layers;
  MOELORA_CHECK(static_cast<int64_t>(adapter.layers.size()) == L, ErrorCode::kInvalidArgument,
                label, " has LoRA weights for ", adapter.layers.size(),
                " layers but the model has ", L, " layers: it was made for another model");
  MOELORA_CHECK(limits_.num_slots > 0, ErrorCode::kUnsupported, label,
                ": the GPU model was created without adapter slots (num_slots = 0)");
  const char* arch = io::architecture_name(config_.arch);
  auto check_factors = [&](const LoraFactors& f, int64_t experts, int64_t in, int64_t out,
                           int64_t max_rank, const std::string& what) {
    const auto bad = ErrorCode::kInvalidArgument;
    MOELORA_CHECK(f.b.defined(), bad, what, ": lora A is set but lora B is missing");
    check_dtype(f.a, DType::kF32, what + " lora A");
    check_dtype(f.b, DType::kF32, what + " lora B");
    MOELORA_CHECK(f.a.ndim() == 3 && f.b.ndim() == 3, bad, what,
                  ": lora factors must be 3-D, got A ", shape_str(f.a.shape()), " and B ",
                  shape_str(f.b.shape()));
    const int64_t ea = f.a.dim(0), rank = f.a.dim(1), eb = f.b.dim(0);
    const std::string lead = experts == 1 ? "1" : "1 or " + std::to_string(experts);
    MOELORA_CHECK(rank > 0, bad, what, ": lora rank is 0");
    MOELORA_CHECK((ea == 1 || ea == experts) && f.a.dim(2) == in, bad, what, ": lora A has shape ",
                  shape_str(f.a.shape()), ", expected [", lead, ", R, ", in, "]");
    MOELORA_CHECK((eb == 1 || eb == experts) && f.b.dim(1) == out && f.b.dim(2) == rank, bad, what,
                  ": lora B has shape ", shape_str(f.b.shape()), ", expected [", lead, ", ", out,
                  ", ", rank, "]");
    MOELORA_CHECK(rank <= max_rank, ErrorCode::kUnsupported, what, ": lora rank ", rank,
                  " exceeds the GPU pool's maximum rank ", max_rank);
  };
  for (int64_t l = 0; l < L; ++l) {
    const io::LayerLora& lora = adapter.layers[static_cast<size_t>(l)];
    const Layer& layer = layers_[static_cast<size_t>(l)];
    const std::string where = label + " layer " + std::to_string(l) + " ";
    for (int t = 0; t < kNumDenseTargets; ++t) {
      const LoraFactors& f = lora.*kDenseTargets[t].member;
      if (!f.defined()) continue;
      const TargetDims dims = target_dims(l, t);
      MOELORA_CHECK(dims.exists(), ErrorCode::kUnsupported, label, " adapts ",
                    kDenseTargets[t].name, " of layer ", l, ", which this ", arch,
                    " model does not have (", layer.is_moe ? "MoE" : "dense", " layer, ",
                    config_.use_mla ? "MLA" : "GQA",
                    " attention): the adapter was made for another architecture");
      check_factors(f, 1, dims.in, dims.out, limits_.max_rank, where + kDenseTargets[t].name);
    }
    // The GPU model serves no Qwen3.5 (the constructor refuses it), so it has no Gated DeltaNet
    // layer a linear_attn LoRA could adapt.
    const std::pair<const char*, const LoraFactors*> linear_attn[] = {
        {"linear_attn.in_proj_qkv", &lora.in_proj_qkv},
        {"linear_attn.in_proj_z", &lora.in_proj_z},
        {"linear_attn.in_proj_b", &lora.in_proj_b},
        {"linear_attn.in_proj_a", &lora.in_proj_a},
        {"linear_attn.out_proj", &lora.out_proj}};
    for (const auto& [name, f] : linear_attn) {
      const std::string why = ": the GPU model has no Gated DeltaNet (linear attention) layers";
      MOELORA_CHECK(!f->defined(), ErrorCode::kUnsupported, label, " adapts ", name, " of layer ",
                    l, why, ", so LoRA on them is not supported there");
    }
    const std::pair<const char*, const LoraFactors*> shared[] = {
        {"shared_expert.gate_proj", &lora.shared_gate},
        {"shared_expert.up_proj", &lora.shared_up},
        {"shared_expert.down_proj", &lora.shared_down}};
    for (const auto& [name, f] : shared) {
      if (!f->defined()) continue;
      MOELORA_CHECK(layer.is_moe && layer.shared_inter > 0, ErrorCode::kUnsupported, label,
                    " adapts ", name, " of layer ", l, ", which this ", arch,
                    " model does not have: the adapter was made for another architecture");
      const bool down = f == &lora.shared_down;
      check_factors(*f, 1, down ? layer.shared_inter : hidden_, down ? hidden_ : layer.shared_inter,
                    limits_.max_rank, where + name);
    }
    const std::pair<const char*, const LoraFactors*> experts[] = {
        {"experts.gate_up_proj", &lora.experts_gate_up}, {"experts.down_proj", &lora.experts_down}};
    for (const auto& [name, f] : experts) {
      if (!f->defined()) continue;
      MOELORA_CHECK(layer.is_moe, ErrorCode::kUnsupported, label, " adapts ", name, " of layer ", l,
                    ", which is a dense layer of this ", arch,
                    " model: the adapter was made for another architecture");
      const bool down = f == &lora.experts_down;
      check_factors(*f, layer.experts, down ? layer.moe_inter : hidden_,
                    down ? hidden_ : 2 * layer.moe_inter, limits_.max_rank, where + name);
    }
  }
}

void GpuModelImpl::write_slot(int32_t slot, const io::LoraAdapter& adapter) {
  check_slot_index(slot);
  check_adapter(adapter);
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_.get()));
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(side_.get()));
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    const io::LayerLora& lora = adapter.layers[l];
    for (int t = 0; t < kNumDenseTargets; ++t) {
      if (!layer.lora[t].present()) continue;
      const LoraFactors& f = lora.*kDenseTargets[t].member;
      write_dense_pool(layer.lora[t], slot, f.defined() ? &f : nullptr);
    }
    if (layer.moe) {
      auto ptr = [](const LoraFactors& f) { return f.defined() ? &f : nullptr; };
      ops::cuda::MoeLayerAdapter a;
      a.gate_up = ptr(lora.experts_gate_up);
      a.down = ptr(lora.experts_down);
      a.shared_gate = ptr(lora.shared_gate);
      a.shared_up = ptr(lora.shared_up);
      a.shared_down = ptr(lora.shared_down);
      layer.moe->set_adapter(slot, a);
    }
  }
  cuda::wait_for_host_copies();  // the next forward / replay reads the slot on other streams
}

void GpuModelImpl::clear_slot(int32_t slot) {
  check_slot_index(slot);
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_.get()));
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(side_.get()));
  for (Layer& layer : layers_) {
    for (int t = 0; t < kNumDenseTargets; ++t) {
      if (layer.lora[t].present()) write_dense_pool(layer.lora[t], slot, nullptr);
    }
    if (layer.moe) layer.moe->clear_adapter(slot);
  }
  cuda::wait_for_host_copies();
}

void GpuModelImpl::randomize_slot(int32_t slot, int rank, bool shared_outer, uint64_t seed) {
  check_slot_index(slot);
  MOELORA_CHECK(rank > 0 && rank <= limits_.max_rank, ErrorCode::kInvalidArgument,
                "GpuModel::randomize_slot: rank ", rank, " is not in [1, ", limits_.max_rank, "]");
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_.get()));
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(side_.get()));
  const int64_t R = std::max(limits_.max_rank, 8);
  const float scaling = 1.0f;
  uint64_t counter = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    for (int t = 0; t < kNumDenseTargets; ++t) {
      const DenseLoraPool& pool = layer.lora[t];
      if (!pool.present()) continue;
      // A ~ U(+-1/sqrt(in)) on rows < rank, B ~ N(0, (0.25/sqrt(rank))^2) on columns < rank.
      const float bound = 1.0f / std::sqrt(static_cast<float>(pool.in));
      gd::FillArgs fa{gd::FillKind::kUniform,
                      -bound,
                      bound,
                      seed * 0x9e3779b97f4a7c15ull + (++counter),
                      pool.in,
                      R,
                      rank};
      gd::launch_fill_bf16(pool.a + slot * R * pool.in, R * pool.in, fa, main_.get());
      gd::FillArgs fb{gd::FillKind::kNormal,
                      0.0f,
                      0.25f / std::sqrt(static_cast<float>(rank)),
                      seed * 0x9e3779b97f4a7c15ull + (++counter),
                      1,
                      R,
                      rank};
      gd::launch_fill_bf16(pool.b + slot * pool.out * R, pool.out * R, fb, main_.get());
      MOELORA_CUDA_CHECK(
          cudaMemcpyAsync(pool.scaling + slot, &scaling, 4, cudaMemcpyHostToDevice, main_.get()));
      MOELORA_CUDA_CHECK(
          cudaMemcpyAsync(pool.rank + slot, &rank, 4, cudaMemcpyHostToDevice, main_.get()));
      MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_.get()));
    }
    if (layer.moe)
      layer.moe->randomize_adapter(slot, rank, shared_outer,
                                   seed * 0x9e3779b97f4a7c15ull + (++counter));
  }
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace

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
  auto model = std::make_unique<GpuModelImpl>(weights.config, limits, options);
  model->upload(weights);
  return model;
}

std::unique_ptr<GpuModel> GpuModel::random(const io::ModelConfig& config, uint64_t seed,
                                           bool fp8_experts, const GpuModelLimits& limits,
                                           const GpuModelOptions& options) {
  config.validate("GpuModel::random config");
  auto model = std::make_unique<GpuModelImpl>(config, limits, options);
  model->randomize(seed, fp8_experts);
  return model;
}

}  // namespace moelora::model
