// GpuModelImpl construction (gpu_model_impl_cuda.cuh): the checks of the config and limits, the
// weights uploaded layer by layer from a checkpoint (dense as bf16, FP8-block experts kept) or
// drawn on the device, then the KV cache, the workspaces, the dense LoRA pools and the step
// metadata.
#include "model/gpu_model_impl_cuda.cuh"

namespace moelora::model::gpu_impl {

GpuModelImpl::GpuModelImpl(const io::ModelConfig& config, const GpuModelLimits& limits,
                           const GpuModelOptions& options)
    : config_(config), limits_(limits), options_(options), fork_(false), join_(false) {
  MOELORA_CHECK(config_.arch == io::Architecture::kQwen3Moe ||
                    config_.arch == io::Architecture::kQwen35Moe ||
                    (config_.arch == io::Architecture::kDeepseekV3 && config_.use_mla),
                ErrorCode::kUnsupported, "GpuModel: ", io::architecture_name(config_.arch),
                " (model_type '", config_.model_type,
                "') is not supported; supported: qwen3_moe, qwen3_5_moe, deepseek_v3 / kimi_k2 "
                "with MLA");
  for (size_t l = 0; l < config_.layer_types.size(); ++l)
    has_linear_ = has_linear_ || config_.layer_types[l] == "linear_attention";
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
  num_sms_ = cuda::device_info(options_.device).num_sms;
  hidden_ = static_cast<int>(config_.hidden_size);
  vocab_ = static_cast<int>(config_.vocab_size);
  const VocabShard vocab = options_.collectives
                               ? vocab_shard(config_.vocab_size, options_.collectives->rank(),
                                             options_.collectives->size())
                               : vocab_shard(config_.vocab_size, 0, 1);
  vocab_begin_ = static_cast<int>(vocab.begin);
  vocab_rows_ = static_cast<int>(vocab.count);
  vocab_split_ = vocab.split;
  layers_.resize(static_cast<size_t>(config_.num_hidden_layers));
}

void GpuModelImpl::upload(const io::ModelWeights& weights) {
  const int64_t L = config_.num_hidden_layers;
  MOELORA_CHECK(static_cast<int64_t>(weights.layers.size()) == L, ErrorCode::kInvalidArgument,
                "GpuModel: the checkpoint holds ", weights.layers.size(),
                " layers but the config has ", L);
  std::optional<ProgressBar> bar;
  if (options_.show_progress)
    bar.emplace("Uploading weights to the GPU", static_cast<uint64_t>(L + 1), "layers");
  // A rank of a split vocabulary uploads its rows (dist::shard_checkpoint cut them).
  embed_ =
      upload_plain(weights.embed_tokens, {vocab_rows_, config_.hidden_size},
                   vocab_split_ ? "embed_tokens (this rank's vocabulary rows)" : "embed_tokens");
  final_norm_ = upload_plain(weights.final_norm, {config_.hidden_size}, "norm");
  if (weights.tied_embeddings) {
    lm_head_ = embed_;
  } else {
    MOELORA_CHECK(weights.lm_head.out_features == vocab_rows_ &&
                      weights.lm_head.in_features == config_.hidden_size,
                  ErrorCode::kInvalidArgument, "GpuModel: lm_head is [",
                  weights.lm_head.out_features, ", ", weights.lm_head.in_features, "], expected [",
                  vocab_rows_, ", ", config_.hidden_size, "]",
                  vocab_split_ ? " (this rank's vocabulary rows: cut the checkpoint with "
                                 "dist::shard_checkpoint)"
                               : "");
    lm_head_ = upload_linear(weights.lm_head).w;
  }
  if (bar) bar->advance();
  for (int64_t l = 0; l < L; ++l) {
    upload_layer(weights.layers[static_cast<size_t>(l)], l);
    if (bar) bar->advance();
  }
  if (bar) bar->finish();
  finish_construction();
}

void GpuModelImpl::randomize(uint64_t seed, bool fp8_experts) {
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
  embed_ = alloc_weight<bf16>(static_cast<size_t>(vocab_rows_) * H);
  gd::launch_fill_bf16(embed_, vocab_rows_ * H, {gd::FillKind::kNormal, 0.0f, 1.0f, next_seed()},
                       main_.get());
  final_norm_ = norm(H);
  lm_head_ = config_.tie_word_embeddings ? embed_ : linear(vocab_rows_, H).w;
  if (bar) bar->advance();
  for (int64_t l = 0; l < L; ++l) {
    Layer& layer = layers_[static_cast<size_t>(l)];
    layer.input_norm = norm(H);
    layer.post_norm = norm(H);
    if (static_cast<size_t>(l) < config_.layer_types.size() &&
        config_.layer_types[static_cast<size_t>(l)] == "linear_attention") {
      // transformers-like scales: A = exp(A_log) in [1, 16], small dt_bias, conv U(+-1/sqrt(K)),
      // the gated norm's plain weight near 1
      const ops::GdnShape g = gdn_shape();
      layer.linear = true;
      layer.gdn_in = linear(g.conv_dim() + g.value_dim() + 2 * g.num_v_heads, H);
      layer.gdn_out = linear(H, g.value_dim());
      const float conv_bound = 1.0f / std::sqrt(static_cast<float>(g.conv_kernel));
      layer.conv_weight = alloc_weight<bf16>(static_cast<size_t>(g.conv_dim() * g.conv_kernel));
      gd::launch_fill_bf16(layer.conv_weight, g.conv_dim() * g.conv_kernel,
                           {gd::FillKind::kUniform, -conv_bound, conv_bound, next_seed()},
                           main_.get());
      auto fill_f32 = [&](int64_t n, float lo, float hi) {
        float* p = alloc_weight<float>(static_cast<size_t>(n));
        gd::launch_fill_f32(p, n, {gd::FillKind::kUniform, lo, hi, next_seed()}, main_.get());
        return p;
      };
      layer.a_log = fill_f32(g.num_v_heads, 0.0f, std::log(16.0f));
      layer.dt_bias = fill_f32(g.num_v_heads, -0.1f, 0.1f);
      layer.gdn_norm = fill_f32(g.head_v_dim, 0.9f, 1.1f);
    } else if (config_.use_mla) {
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
      layer.gated = config_.attention_output_gate;
      const int64_t q_rows = layer.gated ? 2 * q : q;
      layer.qkv = linear(q_rows + 2 * kv, H);
      layer.q_out = static_cast<int>(q_rows);
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
      const int ranks = options_.collectives ? options_.collectives->size() : 1;
      set_local_experts(layer, config_.num_experts / std::max(ranks, 1));
      layer.moe_inter = static_cast<int>(config_.moe_intermediate_size);
      layer.shared_inter = static_cast<int>(config_.shared_expert_intermediate_size);
      ops::cuda::MoeLayerConfig mc = moe_config(layer, config_.shared_expert_gate);
      const bool fp8 = fp8_experts && layer.moe_inter % 128 == 0;
      // NVFP4 configurations keep their experts packed (the NVFP4 stream GEMM), where the shapes allow
      const bool nvfp4 = config_.quant.method == io::QuantMethod::kNvfp4 && H % 128 == 0 && layer.moe_inter % 128 == 0;
      mc.nvfp4_experts = nvfp4;
      mc.bf16_experts = !fp8 && !nvfp4;
      mc.shared_in_experts =
          shared_expert_in_experts(layer, fp8 && !nvfp4);  // random FP8 like the experts
      MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_.get()));
      layer.moe = std::make_unique<ops::cuda::MoeLayerCuda>(
          mc, ops::cuda::MoeLayerHostWeights{}, main_.get(), side_.get(), &moe_workspace_);
      configure_moe(*layer.moe);
      layer.moe->randomize_weights(next_seed());
    }
    if (bar) bar->advance();
  }
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_.get()));
  if (bar) bar->finish();
  finish_construction();
}

bf16* GpuModelImpl::upload_plain(const Tensor& t, const Shape& shape, const std::string& what) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, "GpuModel: ", what, " is missing");
  check_shape(t, shape, "GpuModel: " + what);
  const std::vector<uint16_t> bits = tensor_bf16_bits(t);
  bf16* p = alloc_weight<bf16>(bits.size());
  copy_to_device(p, bits.data(), bits.size() * 2);
  return p;
}

float* GpuModelImpl::upload_f32(const Tensor& t, const Shape& shape, const std::string& what) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, "GpuModel: ", what, " is missing");
  check_shape(t, shape, "GpuModel: " + what);
  const Tensor f = t.to_f32();
  float* p = alloc_weight<float>(static_cast<size_t>(f.numel()));
  copy_to_device(p, f.data<float>(), static_cast<size_t>(f.numel()) * 4);
  return p;
}

ops::GdnShape GpuModelImpl::gdn_shape() const {
  return linear_attention_shape(config_);
}

Linear GpuModelImpl::upload_stacked(std::initializer_list<const io::LinearWeight*> parts) {
  int64_t rows = 0, in = -1;
  for (const io::LinearWeight* w : parts) {
    MOELORA_CHECK(w->defined(), ErrorCode::kInvalidArgument, "GpuModel: weight '", w->name,
                  "' is missing");
    MOELORA_CHECK(in < 0 || w->in_features == in, ErrorCode::kInvalidArgument, "GpuModel: weight '",
                  w->name, "' has ", w->in_features, " inputs, expected ", in);
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

void GpuModelImpl::upload_layer(const io::LayerWeights& src, int64_t l) {
  Layer& layer = layers_[static_cast<size_t>(l)];
  const int64_t H = config_.hidden_size;
  const std::string where = "layer " + std::to_string(l) + " ";
  layer.input_norm = upload_plain(src.input_layernorm, {H}, where + "input_layernorm");
  layer.post_norm =
      upload_plain(src.post_attention_layernorm, {H}, where + "post_attention_layernorm");
  if (src.is_linear_attention) {
    const ops::GdnShape g = gdn_shape();
    const io::LinearAttentionWeights& la = src.linear_attn;
    layer.linear = true;
    layer.gdn_in = upload_stacked({&la.in_proj_qkv, &la.in_proj_z, &la.in_proj_b, &la.in_proj_a});
    MOELORA_CHECK(la.in_proj_qkv.out_features == g.conv_dim() &&
                      la.in_proj_z.out_features == g.value_dim() &&
                      la.in_proj_b.out_features == g.num_v_heads &&
                      la.in_proj_a.out_features == g.num_v_heads,
                  ErrorCode::kInvalidArgument, "GpuModel: ", where,
                  "linear_attn in_proj_qkv / z / b / a have ", la.in_proj_qkv.out_features, " / ",
                  la.in_proj_z.out_features, " / ", la.in_proj_b.out_features, " / ",
                  la.in_proj_a.out_features, " outputs; expected ", g.conv_dim(), " / ",
                  g.value_dim(), " / ", g.num_v_heads, " / ", g.num_v_heads);
    layer.gdn_out = upload_linear(la.out_proj);
    layer.conv_weight =
        upload_plain(la.conv1d, {g.conv_dim(), 1, g.conv_kernel}, where + "linear_attn.conv1d");
    layer.a_log = upload_f32(la.a_log, {g.num_v_heads}, where + "linear_attn.A_log");
    layer.dt_bias = upload_f32(la.dt_bias, {g.num_v_heads}, where + "linear_attn.dt_bias");
    layer.gdn_norm = upload_f32(la.norm, {g.head_v_dim}, where + "linear_attn.norm");
  } else if (config_.use_mla) {
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
    layer.gated = config_.attention_output_gate;
    const int gate_factor = layer.gated ? 2 : 1;
    layer.q_out = static_cast<int>(src.q_proj.out_features);
    layer.kv_out = static_cast<int>(src.k_proj.out_features);
    MOELORA_CHECK(layer.q_out == gate_factor * config_.num_attention_heads * config_.head_dim &&
                      layer.kv_out == config_.num_key_value_heads * config_.head_dim &&
                      src.v_proj.out_features == layer.kv_out,
                  ErrorCode::kInvalidArgument, "GpuModel: ", where, "q/k/v_proj have ", layer.q_out,
                  " / ", layer.kv_out, " / ", src.v_proj.out_features,
                  " outputs; expected heads * head_dim", layer.gated ? " * 2 (gated)" : "", " = ",
                  gate_factor * config_.num_attention_heads * config_.head_dim,
                  " and kv_heads * head_dim = ", config_.num_key_value_heads * config_.head_dim);
    if (layer.gated) {
      // per-head [q (D) | gate (D)] rows -> [q of every head | gate of every head]
      const int64_t D = config_.head_dim, heads = config_.num_attention_heads, H = layer.qkv.in;
      std::vector<uint16_t> bits(static_cast<size_t>(2 * heads * D * H)), grouped(bits.size());
      MOELORA_CUDA_CHECK(
          cudaMemcpy(bits.data(), layer.qkv.w, bits.size() * 2, cudaMemcpyDeviceToHost));
      for (int64_t h = 0; h < heads; ++h) {
        for (int half = 0; half < 2; ++half) {
          std::memcpy(grouped.data() + ((half * heads + h) * D) * H,
                      bits.data() + ((2 * h + half) * D) * H, static_cast<size_t>(D * H) * 2);
        }
      }
      copy_to_device(layer.qkv.w, grouped.data(), grouped.size() * 2);
    }
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
  set_local_experts(layer, E);
  layer.moe_inter = static_cast<int>(I);
  layer.shared_inter =
      src.shared_expert.defined() ? static_cast<int>(src.shared_expert.gate.out_features) : 0;

  bool fp8 = I % 128 == 0;
  for (int64_t e = 0; e < E && fp8; ++e)
    fp8 =
        is_fp8_block_128(ex.gate[e]) && is_fp8_block_128(ex.up[e]) && is_fp8_block_128(ex.down[e]);

  // NVFP4 experts stay packed: codes, e4m3 group scales and each tensor's scale_2 per row.
  bool nvfp4 = !fp8 && H % 128 == 0 && I % 128 == 0;
  for (int64_t e = 0; e < E && nvfp4; ++e)
    nvfp4 = ex.gate[e].format == io::WeightFormat::kNvfp4 && ex.up[e].format == io::WeightFormat::kNvfp4 &&
            ex.down[e].format == io::WeightFormat::kNvfp4;

  ops::cuda::MoeLayerHostWeights hw;
  hw.router = src.router;
  hw.correction_bias = src.e_score_correction_bias;
  if (nvfp4) {
    hw.w13 = Tensor::empty(DType::kU8, {E, 2 * I, H / 2});
    hw.w13_scale = Tensor::empty(DType::kF8E4M3, {E, 2 * I, H / 16});
    hw.w13_scale_2 = Tensor::empty(DType::kF32, {E, 2 * I});
    hw.w2 = Tensor::empty(DType::kU8, {E, H, I / 2});
    hw.w2_scale = Tensor::empty(DType::kF8E4M3, {E, H, I / 16});
    hw.w2_scale_2 = Tensor::empty(DType::kF32, {E, H});
    // rows [row0, row0 + w.out_features) of an expert stack
    auto put = [](const io::LinearWeight& w, int64_t out, int64_t in, Tensor& codes, Tensor& scales, Tensor& scale_2,
                  int64_t row0) {
      MOELORA_CHECK(w.out_features == out && w.in_features == in && w.weight.nbytes() == static_cast<size_t>(out * in / 2) &&
                        w.scale.nbytes() == static_cast<size_t>(out * in / 16),
                    ErrorCode::kInvalidArgument, "GpuModel: NVFP4 expert ", w.name, " is not [", out, ", ", in,
                    "] with ", out * in / 2, " code bytes and ", out * in / 16, " scales");
      std::memcpy(codes.data<uint8_t>() + row0 * (in / 2), w.weight.raw_data(), w.weight.nbytes());
      std::memcpy(scales.data<uint8_t>() + row0 * (in / 16), w.scale.raw_data(), w.scale.nbytes());
      std::fill(scale_2.data<float>() + row0, scale_2.data<float>() + row0 + out, w.scale_2);
    };
    for (int64_t e = 0; e < E; ++e) {
      put(ex.gate[e], I, H, hw.w13, hw.w13_scale, hw.w13_scale_2, e * 2 * I);
      put(ex.up[e], I, H, hw.w13, hw.w13_scale, hw.w13_scale_2, e * 2 * I + I);
      put(ex.down[e], H, I, hw.w2, hw.w2_scale, hw.w2_scale_2, e * H);
    }
  } else if (fp8) {
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
      std::memcpy(s2 + e * hb * ib, ex.down[e].scale.raw_data(), static_cast<size_t>(hb * ib) * 4);
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
  bool shared_in_experts = false;
  if (layer.shared_inter > 0) {
    const io::MlpWeights& sh = src.shared_expert;
    const int64_t Is = layer.shared_inter;
    MOELORA_CHECK(sh.up.out_features == Is && sh.gate.in_features == H && sh.up.in_features == H &&
                      sh.down.out_features == H && sh.down.in_features == Is,
                  ErrorCode::kInvalidArgument, "GpuModel: ", where,
                  "shared expert shapes do not match");
    shared_in_experts = shared_expert_in_experts(layer, fp8) && is_fp8_block_128(sh.gate) &&
                        is_fp8_block_128(sh.up) && is_fp8_block_128(sh.down);
    if (shared_in_experts) {  // its FP8 codes and scales as expert E of the stacks
      const int64_t hb = (H + 127) / 128, ib = Is / 128;
      check_shape(sh.gate.scale, {ib, hb}, "GpuModel: scale of " + sh.gate.name);
      check_shape(sh.up.scale, {ib, hb}, "GpuModel: scale of " + sh.up.name);
      check_shape(sh.down.scale, {hb, ib}, "GpuModel: scale of " + sh.down.name);
      hw.shared_w13 = Tensor::empty(DType::kF8E4M3, {2 * Is, H});
      hw.shared_w13_scale = Tensor::empty(DType::kF32, {2 * ib, hb});
      std::memcpy(hw.shared_w13.data<uint8_t>(), sh.gate.weight.raw_data(),
                  static_cast<size_t>(Is * H));
      std::memcpy(hw.shared_w13.data<uint8_t>() + Is * H, sh.up.weight.raw_data(),
                  static_cast<size_t>(Is * H));
      std::memcpy(hw.shared_w13_scale.data<float>(), sh.gate.scale.raw_data(),
                  static_cast<size_t>(ib * hb) * 4);
      std::memcpy(hw.shared_w13_scale.data<float>() + ib * hb, sh.up.scale.raw_data(),
                  static_cast<size_t>(ib * hb) * 4);
      hw.shared_w2 = sh.down.weight;
      hw.shared_w2_scale = sh.down.scale;
    } else {
      hw.shared_w13 = Tensor::empty(DType::kBF16, {2 * Is, H});
      hw.shared_w2 = Tensor::empty(DType::kBF16, {H, Is});
      linear_bf16_bits(sh.gate, hw.shared_w13.data<uint16_t>());
      linear_bf16_bits(sh.up, hw.shared_w13.data<uint16_t>() + Is * H);
      linear_bf16_bits(sh.down, hw.shared_w2.data<uint16_t>());
    }
    hw.shared_gate = src.shared_expert_gate;
  }
  ops::cuda::MoeLayerConfig mc = moe_config(layer, src.shared_expert_gate.defined());
  mc.nvfp4_experts = nvfp4;
  mc.bf16_experts = !fp8 && !nvfp4;
  mc.shared_in_experts = shared_in_experts;
  layer.moe =
      std::make_unique<ops::cuda::MoeLayerCuda>(mc, hw, main_.get(), side_.get(), &moe_workspace_);
  configure_moe(*layer.moe);
}

void GpuModelImpl::configure_moe(ops::cuda::MoeLayerCuda& moe) const {
  if (!options_.router_in_route) moe.set_router_gemm_path(ops::cuda::RouterGemmPath::kCublas);
  if (options_.moe_stream_schedule >= 0)
    moe.set_stream_gemm_schedule(options_.moe_stream_schedule == 1
                                     ? ops::cuda::StreamGemmSchedule::kClaimed
                                     : ops::cuda::StreamGemmSchedule::kRoundRobin);
  ops::cuda::SideStreamScheduling side;
  side.seam1_after_quant = options_.moe_seam1_after_quant;
  side.pdl_after_side_join = options_.moe_pdl_after_side_join;
  side.seam2_expand_in_finalize_max_tokens = options_.moe_seam2_in_finalize_max_tokens;
  side.seam2_shrink_in_activation = options_.moe_seam2_shrink_in_activation;
  side.shared_lora_stream = options_.moe_shared_lora_stream;
  side.activation_pdl_with_shared_pairs = options_.moe_activation_pdl_with_shared_pairs;
  side.lora_max_ctas = options_.moe_lora_side_ctas;
  moe.set_side_stream_scheduling(side);
}

void GpuModelImpl::finish_construction() {
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
      config_.use_mla ? static_cast<float>(ops::mla_softmax_scale(config_.qk_head_dim(), rope))
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

  // ---- paged KV cache (attention layers only: Gated DeltaNet layers keep a state instead) ----
  int64_t kv_layers = 0;
  for (Layer& layer : layers_) {
    if (!layer.linear) layer.kv_index = static_cast<int>(kv_layers++);
  }
  if (config_.use_mla) {
    latent_width_ = static_cast<int>(config_.kv_lora_rank + config_.qk_rope_head_dim);
    kv_bytes_per_token_ = static_cast<uint64_t>(kv_layers) * latent_width_ * 2;
  } else {
    kv_bytes_per_token_ =
        static_cast<uint64_t>(kv_layers) * 2 * config_.num_key_value_heads * config_.head_dim * 2;
  }
  if (limits_.num_pages <= 0) {
    limits_.num_pages = static_cast<int64_t>(
        limits_.kv_cache_bytes / (kv_bytes_per_token_ * static_cast<uint64_t>(limits_.page_size)));
  }
  MOELORA_CHECK(limits_.num_pages > 0, ErrorCode::kInvalidArgument,
                "GpuModel: the KV cache has no pages (num_pages = 0, kv_cache_bytes = ",
                limits_.kv_cache_bytes, " < one page of ", kv_bytes_per_token_ * limits_.page_size,
                " bytes)");
  const size_t slots_per_layer = static_cast<size_t>(limits_.num_pages) * limits_.page_size;
  if (config_.use_mla) {
    kv_layer_elems_ = slots_per_layer * latent_width_;
    latent_cache_ = alloc<bf16>(kv_layer_elems_ * kv_layers);
  } else {
    kv_layer_elems_ = slots_per_layer * config_.num_key_value_heads * config_.head_dim;
    k_cache_ = alloc<bf16>(kv_layer_elems_ * kv_layers);
    v_cache_ = alloc<bf16>(kv_layer_elems_ * kv_layers);
  }

  // ---- Gated DeltaNet: per-state-slot states (one slot per sequence of a forward), buffers ----
  if (has_linear_) {
    const ops::GdnShape g = gdn_shape();
    for (Layer& layer : layers_) {
      if (!layer.linear) continue;
      layer.conv_state = alloc<bf16>(static_cast<size_t>(B) * g.conv_dim() * (g.conv_kernel - 1));
      layer.rec_state =
          alloc<float>(static_cast<size_t>(B) * g.num_v_heads * g.head_k_dim * g.head_v_dim);
    }
    const size_t gdn_width = g.conv_dim() + g.value_dim() + 2 * g.num_v_heads;
    gdn_proj_ = alloc<bf16>(static_cast<size_t>(T) * gdn_width);
    // Decode-sized forwards (as qkv_delta_ below): the in-projection's LoRA delta, read by the mix.
    gdn_delta_rows_ = options_.gdn_lora_delta_in_mix ? std::min(T, B) : 0;
    if (limits_.num_slots > 0 && gdn_delta_rows_ > 0)
      gdn_delta_ = alloc<bf16>(static_cast<size_t>(gdn_delta_rows_) * gdn_width);
    gdn_mix_ = alloc<bf16>(static_cast<size_t>(T) * g.value_dim());
    gdn_ws_bytes_ = ops::cuda::gdn_mix_workspace_bytes(g, T);
    gdn_ws_ = alloc<uint8_t>(gdn_ws_bytes_);
  }

  // ---- activations ----
  const size_t t = T;
  resid_ = alloc<bf16>(t * H);
  hnorm_ = alloc<bf16>(t * H);
  branch_ = alloc<bf16>(t * H);
  if (limits_.num_slots > 0) branch_delta_ = alloc<bf16>(t * H);
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
    const size_t width = static_cast<size_t>((config_.attention_output_gate ? 2 * n : n) +
                                             2 * config_.num_key_value_heads) *
                         config_.head_dim;
    qkv_ = alloc<bf16>(t * width);
    // Decode-sized forwards only (one row per sequence at most): prefill chunks add in place.
    qkv_delta_rows_ = std::min(T, B);
    if (limits_.num_slots > 0)
      qkv_delta_ = alloc<bf16>(static_cast<size_t>(qkv_delta_rows_) * width);
    attn_ = alloc<bf16>(t * n * config_.head_dim);
    const int Hkv = static_cast<int>(config_.num_key_value_heads),
              D = static_cast<int>(config_.head_dim);
    const bool fi_served = ops::cuda::FlashInferAttention::supports(n, Hkv, D);
    MOELORA_CHECK(options_.attention != AttentionKernel::kFlashInfer || fi_served,
                  ErrorCode::kUnsupported, "GpuModel: FlashInfer attention was asked for, but ",
                  ops::cuda::FlashInferAttention::compiled()
                      ? detail::concat("it does not serve ", n, " / ", Hkv, " heads of head_dim ",
                                       D, " (head_dim 64, 128 or 256)")
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
      fs.programmatic_launch = options_.attention_pdl;
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
  if (vocab_split_) {
    local_logits_ = alloc<float>(static_cast<size_t>(B) * vocab_rows_);
    gathered_logits_ = alloc<float>(static_cast<size_t>(B) * vocab_);
  }
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
               o_sample = reserve(B * sizeof(ops::SampleRowParams)), o_uniform = reserve(B * 4),
               o_cu = reserve((B + 1) * 4), o_state = reserve(B * 4);
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
    m.cu_seqlens = reinterpret_cast<int32_t*>(base + o_cu);
    m.state_slot = reinterpret_cast<int32_t*>(base + o_state);
  };
  bind(host_step_, static_cast<char*>(step_host_->get()));
  bind(device_step_, static_cast<char*>(step_device_.get()));
  // A harmless default: no rows, no sequences, padding slots -1, greedy sampling.
  std::fill_n(host_step_.token_slot, T, -1);
  std::fill_n(host_step_.token_seq, T, -1);
  for (int b = 0; b < B; ++b) host_step_.sample_params[b] = ops::SampleRowParams{};
  std::fill_n(host_step_.state_slot, B, -1);

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

}  // namespace moelora::model::gpu_impl
