// Tensor-parallel MLA on the CPU reference operators (parallel_mla.h).
#include "dist/parallel_mla.h"

#include <numeric>

#include "core/error.h"
#include "dist/lora_projection.h"

namespace moelora::dist {

namespace {

void check_weight(const Tensor& t, const Shape& shape, const char* which, const char* name) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, "MLA (", which, ") ", name,
                " is missing");
  MOELORA_CHECK(t.dtype() == DType::kF32 && t.shape() == shape, ErrorCode::kInvalidArgument,
                "MLA (", which, ") ", name, ": expected F32 ", shape_str(shape), ", got ",
                dtype_name(t.dtype()), " ", shape_str(t.shape()));
}

// Every weight of `w` against its dims (the whole block or a rank's share of heads); the hidden
// size is o_proj's rows.
void check_mla_weights(const MlaWeights& w, const char* which) {
  const ops::MlaDims& d = w.dims;
  MOELORA_CHECK(d.num_heads > 0 && d.qk_nope_head_dim > 0 && d.qk_rope_head_dim > 0 &&
                    d.v_head_dim > 0 && d.kv_lora_rank > 0 && w.q_lora_rank >= 0,
                ErrorCode::kInvalidArgument, "MLA (", which, "): ", d.num_heads, " heads, nope ",
                d.qk_nope_head_dim, ", rope ", d.qk_rope_head_dim, ", dv ", d.v_head_dim,
                ", kv_lora_rank ", d.kv_lora_rank, ": every size must be positive");
  MOELORA_CHECK(w.o_proj.defined() && w.o_proj.ndim() == 2, ErrorCode::kInvalidArgument, "MLA (",
                which, ") o_proj: expected F32 [hidden, ", d.num_heads * d.v_head_dim, "], got ",
                w.o_proj.defined() ? shape_str(w.o_proj.shape()) : "undefined");
  const int64_t hidden = w.o_proj.dim(0), heads = d.num_heads, qk = d.qk_head_dim(),
                rank = d.kv_lora_rank;
  if (w.q_lora_rank > 0) {
    check_weight(w.q_a_proj, {w.q_lora_rank, hidden}, which, "q_a_proj");
    check_weight(w.q_a_layernorm, {w.q_lora_rank}, which, "q_a_layernorm");
    check_weight(w.q_b_proj, {heads * qk, w.q_lora_rank}, which, "q_b_proj");
  } else {
    check_weight(w.q_proj, {heads * qk, hidden}, which, "q_proj");
  }
  check_weight(w.kv_a_proj_with_mqa, {rank + d.qk_rope_head_dim, hidden}, which,
               "kv_a_proj_with_mqa");
  check_weight(w.kv_a_layernorm, {rank}, which, "kv_a_layernorm");
  check_weight(w.kv_b_proj, {heads * (d.qk_nope_head_dim + d.v_head_dim), rank}, which,
               "kv_b_proj");
  check_weight(w.o_proj, {hidden, heads * d.v_head_dim}, which, "o_proj");
}

}  // namespace

MlaWeights shard_mla(const MlaWeights& w, ShardSpec tp) {
  check_mla_weights(w, "the whole block");
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
  MlaCache cache;
  return mla_forward_tp(x, slot, shard, lora, cache, comm);
}

Tensor mla_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const MlaWeights& shard,
                      const std::vector<MlaLora>& lora, MlaCache& cache, Communicator& comm) {
  ops::detail::check_f32(x, 2, "MLA input x");
  const ops::MlaDims& dims = shard.dims;
  const int64_t tokens = x.dim(0), hidden = x.dim(1), heads = dims.num_heads,
                nope = dims.qk_nope_head_dim, rope = dims.qk_rope_head_dim, dv = dims.v_head_dim,
                rank = dims.kv_lora_rank, qk = dims.qk_head_dim();
  check_mla_weights(shard, "the rank's heads");
  MOELORA_CHECK(shard.o_proj.dim(0) == hidden, ErrorCode::kInvalidArgument,
                "MLA input x: expected ", shard.o_proj.dim(0), " columns, got ", shape_str(x.shape()));

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
  Tensor c_kv = slice_dim(kv_a, 1, 0, rank, "MLA c_kv");
  Tensor k_rope = slice_dim(kv_a, 1, rank, rank + rope, "MLA k_rope");
  ops::rms_norm_inplace_ref(c_kv, shard.kv_a_layernorm, shard.norm);
  const Tensor kv = project_with_lora(c_kv, shard.kv_b_proj, slot, lora, &MlaLora::kv_b_proj)
                        .reshape({tokens * heads, nope + dv});
  const Tensor k_nope = slice_dim(kv, 1, 0, nope, "MLA k_nope").reshape({tokens, heads, nope});
  const Tensor v = slice_dim(kv, 1, nope, nope + dv, "MLA v").reshape({tokens, heads, dv});
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  std::iota(positions.begin(), positions.end(), cache.size);
  ops::apply_rope_inplace_ref(q, positions, shard.rope, {shard.rope_style, nope});
  ops::apply_rope_inplace_ref(k_rope, positions, shard.rope, {shard.rope_style, 0});
  MOELORA_CHECK(static_cast<int64_t>(cache.k_nope.size()) == cache.size * heads * nope &&
                    static_cast<int64_t>(cache.v.size()) == cache.size * heads * dv,
                ErrorCode::kInvalidArgument, "MLA cache: ", cache.k_nope.size(),
                " k_nope values for ", cache.size, " positions of ", heads, " heads of ", nope,
                " (a cache filled with another share of heads?)");
  auto append = [](std::vector<float>& rows, const Tensor& t) {
    rows.insert(rows.end(), t.data<float>(), t.data<float>() + t.numel());
  };
  append(cache.k_nope, k_nope);
  append(cache.k_rope, k_rope);
  append(cache.v, v);
  cache.size += tokens;
  ops::MlaAttentionParams params;
  params.dims = dims;
  params.softmax_scale = shard.scale;
  const int64_t s = cache.size;
  const Tensor attended =
      ops::mla_attention_ref(q, Tensor::from_f32(cache.k_nope, {s, heads, nope}),
                             Tensor::from_f32(cache.k_rope, {s, rope}),
                             Tensor::from_f32(cache.v, {s, heads, dv}), params)
          .reshape({tokens, heads * dv});
  // Row-parallel o_proj: this rank's partial sum of the base and its LoRA, reduced once.
  Tensor out = project_with_lora(attended, shard.o_proj, slot, lora, &MlaLora::o_proj);
  comm.all_reduce_sum({out.data<float>(), static_cast<size_t>(out.numel())});
  return out;
}

}  // namespace moelora::dist
