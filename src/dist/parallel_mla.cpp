// Tensor-parallel MLA on the CPU reference operators (parallel_mla.h).
#include "dist/parallel_mla.h"

#include <cstring>
#include <numeric>
#include <string>

#include "core/error.h"
#include "dist/lora_projection.h"

namespace moelora::dist {

namespace {

// Columns [begin, begin + width) of each row of a [T, row] tensor, as a new [T, width] tensor.
Tensor columns(const Tensor& t, int64_t begin, int64_t width) {
  const int64_t rows = t.dim(0), row = t.dim(1);
  Tensor out = Tensor::empty(DType::kF32, {rows, width});
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(out.data<float>() + i * width, t.data<float>() + i * row + begin,
                sizeof(float) * static_cast<size_t>(width));
  return out;
}

void check_weight(const Tensor& t, const Shape& shape, const char* name) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, "MLA ", name, " is missing");
  MOELORA_CHECK(t.shape() == shape, ErrorCode::kInvalidArgument, "MLA ", name, ": expected ",
                shape_str(shape), ", got ", shape_str(t.shape()));
}

}  // namespace

MlaWeights shard_mla(const MlaWeights& w, ShardSpec tp) {
  const ShardRange heads = shard_range(w.dims.num_heads, tp, "MLA heads");
  const int64_t qk = w.dims.qk_head_dim(), kv = w.dims.qk_nope_head_dim + w.dims.v_head_dim,
                dv = w.dims.v_head_dim;
  MlaWeights s = w;
  s.dims.num_heads = heads.size();
  if (w.q_lora_rank > 0)
    s.q_b_proj = slice_dim(w.q_b_proj, 0, heads.begin * qk, heads.end * qk, "q_b_proj");
  else
    s.q_proj = slice_dim(w.q_proj, 0, heads.begin * qk, heads.end * qk, "q_proj");
  s.kv_b_proj = slice_dim(w.kv_b_proj, 0, heads.begin * kv, heads.end * kv, "kv_b_proj");
  s.o_proj = slice_dim(w.o_proj, 1, heads.begin * dv, heads.end * dv, "o_proj");
  return s;
}

MlaLora shard_mla_lora(const MlaLora& lora, const MlaWeights& w, ShardSpec tp) {
  shard_range(w.dims.num_heads, tp, "MLA heads");  // the heads divide evenly
  // Every split projection's rows (q_b / q_proj / kv_b) and o_proj's columns are the heads' blocks
  // in head order, so an even split of them is the split by heads.
  auto whole = [](const LoraFactors& f) {
    return f.defined() ? LoraFactors{f.a.clone(), f.b.clone(), f.scaling} : f;
  };
  MlaLora s;
  s.q_a_proj = whole(lora.q_a_proj);
  s.kv_a_proj_with_mqa = whole(lora.kv_a_proj_with_mqa);
  s.q_proj = shard_lora_column(lora.q_proj, tp, "q_proj");
  s.q_b_proj = shard_lora_column(lora.q_b_proj, tp, "q_b_proj");
  s.kv_b_proj = shard_lora_column(lora.kv_b_proj, tp, "kv_b_proj");
  s.o_proj = shard_lora_row(lora.o_proj, tp, "o_proj");
  return s;
}

Tensor mla_prefill_tp(const Tensor& x, const std::vector<int32_t>& slot, const MlaWeights& shard,
                      const std::vector<MlaLora>& lora, Communicator& comm) {
  ops::detail::check_f32(x, 2, "MLA input x");
  const ops::MlaDims& dims = shard.dims;
  const int64_t tokens = x.dim(0), hidden = x.dim(1), heads = dims.num_heads,
                nope = dims.qk_nope_head_dim, rope = dims.qk_rope_head_dim, dv = dims.v_head_dim,
                rank = dims.kv_lora_rank, qk = dims.qk_head_dim();
  if (shard.q_lora_rank > 0) {
    check_weight(shard.q_a_proj, {shard.q_lora_rank, hidden}, "q_a_proj");
    check_weight(shard.q_a_layernorm, {shard.q_lora_rank}, "q_a_layernorm");
    check_weight(shard.q_b_proj, {heads * qk, shard.q_lora_rank}, "q_b_proj (the local heads)");
  } else {
    check_weight(shard.q_proj, {heads * qk, hidden}, "q_proj (the local heads)");
  }
  check_weight(shard.kv_a_proj_with_mqa, {rank + rope, hidden}, "kv_a_proj_with_mqa");
  check_weight(shard.kv_a_layernorm, {rank}, "kv_a_layernorm");
  check_weight(shard.kv_b_proj, {heads * (nope + dv), rank}, "kv_b_proj (the local heads)");
  check_weight(shard.o_proj, {hidden, heads * dv}, "o_proj (the local heads)");

  // Query of the local heads [T, h, nope + rope]; the latent (replicated) the same on every rank.
  Tensor q;
  if (shard.q_lora_rank > 0) {
    Tensor q_latent = project_with_lora(x, shard.q_a_proj, slot, lora, &MlaLora::q_a_proj);
    ops::rms_norm_inplace_ref(q_latent, shard.q_a_layernorm, shard.norm);
    q = project_with_lora(q_latent, shard.q_b_proj, slot, lora, &MlaLora::q_b_proj);
  } else {
    q = project_with_lora(x, shard.q_proj, slot, lora, &MlaLora::q_proj);
  }
  q = q.reshape({tokens, heads, qk});
  // Replicated [c_kv | k_rope] [T, r + rope]; the local heads' [k_nope | v] from kv_b_proj.
  const Tensor kv_a =
      project_with_lora(x, shard.kv_a_proj_with_mqa, slot, lora, &MlaLora::kv_a_proj_with_mqa);
  Tensor c_kv = columns(kv_a, 0, rank);
  Tensor k_rope = columns(kv_a, rank, rope);
  ops::rms_norm_inplace_ref(c_kv, shard.kv_a_layernorm, shard.norm);
  const Tensor kv = project_with_lora(c_kv, shard.kv_b_proj, slot, lora, &MlaLora::kv_b_proj)
                        .reshape({tokens * heads, nope + dv});
  const Tensor k_nope = columns(kv, 0, nope).reshape({tokens, heads, nope});
  const Tensor v = columns(kv, nope, dv).reshape({tokens, heads, dv});
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  std::iota(positions.begin(), positions.end(), int64_t{0});
  ops::apply_rope_inplace_ref(q, positions, shard.rope, {shard.rope_style, nope});
  ops::apply_rope_inplace_ref(k_rope, positions, shard.rope, {shard.rope_style, 0});
  ops::MlaAttentionParams params;
  params.dims = dims;
  params.softmax_scale = shard.scale;
  const Tensor attended =
      ops::mla_attention_ref(q, k_nope, k_rope, v, params).reshape({tokens, heads * dv});
  // Row-parallel o_proj: this rank's partial sum of the base and its LoRA, reduced once.
  Tensor out = project_with_lora(attended, shard.o_proj, slot, lora, &MlaLora::o_proj);
  comm.all_reduce_sum({out.data<float>(), static_cast<size_t>(out.numel())});
  return out;
}

}  // namespace moelora::dist
