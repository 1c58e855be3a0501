// Adapter slots of the GPU model: the checks an adapter must pass (every target the model has, in
// shape and rank), uploading one into a slot (dense targets into their pools, experts into the MoE
// layers' pools), clearing a slot and seeded random adapters for benchmarks.
#include "model/gpu_model_impl_cuda.cuh"

namespace moelora::model::gpu_impl {

TargetDims GpuModelImpl::target_dims(int64_t l, int target) const {
  const Layer& layer = layers_[static_cast<size_t>(l)];
  const int H = hidden_;
  const int n = static_cast<int>(config_.num_attention_heads);
  if (layer.linear) {
    const ops::GdnShape g = gdn_shape();
    const int conv_dim = static_cast<int>(g.conv_dim()), vd = static_cast<int>(g.value_dim()),
              nv = static_cast<int>(g.num_v_heads);
    switch (target) {
      case kInQkv: return {H, conv_dim};
      case kInZ: return {H, vd};
      case kInB:
      case kInA: return {H, nv};
      case kOutProj: return {vd, H};
      default: break;
    }
  } else if (config_.use_mla) {
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
      case kQ: return {H, layer.gated ? 2 * n * D : n * D};
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

void GpuModelImpl::write_dense_pool(const DenseLoraPool& pool, int32_t slot, const LoraFactors* f,
                                    bool gated_q) {
  const size_t R = std::max(limits_.max_rank, 8);
  // Gated q_proj: B's rows follow the weight's regrouping (per-head [q | gate] -> [q | gate]
  // blocks).
  const int64_t D = config_.head_dim, heads = config_.num_attention_heads;
  auto out_row = [&](int64_t o) {
    if (!gated_q) return o;
    const int64_t h = o / (2 * D), half = (o / D) % 2, i = o % D;
    return (half * heads + h) * D + i;
  };
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
      for (int64_t i = 0; i < rank; ++i) b[out_row(o) * R + i] = f32_to_bf16_bits(bp[o * rank + i]);
  }
  copy_to_device(pool.a + slot * R * pool.in, a.data(), a.size() * 2);
  copy_to_device(pool.b + slot * pool.out * R, b.data(), b.size() * 2);
  copy_to_device(pool.scaling + slot, &scaling, 4);
  copy_to_device(pool.rank + slot, &rank, 4);
}

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
                    layer.linear      ? "Gated DeltaNet linear"
                    : config_.use_mla ? "MLA"
                                      : "GQA",
                    " attention): the adapter was made for another architecture");
      check_factors(f, 1, dims.in, dims.out, limits_.max_rank, where + kDenseTargets[t].name);
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
      write_dense_pool(layer.lora[t], slot, f.defined() ? &f : nullptr, t == kQ && layer.gated);
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
      if (layer.lora[t].present()) write_dense_pool(layer.lora[t], slot, nullptr, false);
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

}  // namespace moelora::model::gpu_impl
