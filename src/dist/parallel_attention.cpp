// Tensor-parallel GQA attention on the CPU reference operators (parallel_attention.h).
#include "dist/parallel_attention.h"

#include <numeric>
#include <string>

#include "core/error.h"
#include "dist/lora_projection.h"
#include "ops/attention/attention.h"

namespace moelora::dist {

namespace {

// The query heads and the KV heads rank tp.rank holds (see the header).
struct HeadRange {
  ShardRange query, kv;
};

HeadRange head_range(const GqaWeights& w, ShardSpec tp) {
  MOELORA_CHECK(w.num_heads > 0 && w.num_kv_heads > 0 && w.num_heads % w.num_kv_heads == 0,
                ErrorCode::kInvalidArgument, "attention: ", w.num_heads, " query heads and ",
                w.num_kv_heads, " KV heads (query heads must be a multiple of KV heads)");
  HeadRange r;
  r.query = shard_range(w.num_heads, tp, "attention query heads");
  if (w.num_kv_heads % tp.size == 0) {
    r.kv = shard_range(w.num_kv_heads, tp, "attention KV heads");
  } else {
    MOELORA_CHECK(tp.size % w.num_kv_heads == 0, ErrorCode::kInvalidArgument, "attention: ",
                  w.num_kv_heads, " KV heads over ", tp.size,
                  " ranks; the ranks must divide the KV heads or be a multiple of them");
    const int64_t kv = tp.rank / (tp.size / w.num_kv_heads);
    r.kv = {kv, kv + 1};
  }
  return r;
}


}  // namespace

GqaWeights shard_gqa(const GqaWeights& w, ShardSpec tp) {
  const HeadRange heads = head_range(w, tp);
  const int64_t d = w.head_dim;
  const int64_t q_rows = d * (w.output_gate ? 2 : 1);  // q_proj rows per query head
  GqaWeights s = w;
  s.num_heads = heads.query.size();
  s.num_kv_heads = heads.kv.size();
  s.q_proj = slice_dim(w.q_proj, 0, heads.query.begin * q_rows, heads.query.end * q_rows, "q_proj");
  s.k_proj = slice_dim(w.k_proj, 0, heads.kv.begin * d, heads.kv.end * d, "k_proj");
  s.v_proj = slice_dim(w.v_proj, 0, heads.kv.begin * d, heads.kv.end * d, "v_proj");
  s.o_proj = slice_dim(w.o_proj, 1, heads.query.begin * d, heads.query.end * d, "o_proj");
  return s;
}

GqaLora shard_gqa_lora(const GqaLora& lora, const GqaWeights& w, ShardSpec tp) {
  const HeadRange heads = head_range(w, tp);
  const int64_t d = w.head_dim;
  auto column = [&](const LoraFactors& f, ShardRange h, int64_t rows, const char* what) {
    if (!f.defined()) return f;
    return LoraFactors{f.a.clone(),
                       slice_dim(f.b, 1, h.begin * rows, h.end * rows, std::string(what) + " lora B"),
                       f.scaling};
  };
  GqaLora s;
  s.q = column(lora.q, heads.query, d * (w.output_gate ? 2 : 1), "q_proj");
  s.k = column(lora.k, heads.kv, d, "k_proj");
  s.v = column(lora.v, heads.kv, d, "v_proj");
  if (lora.o.defined()) {
    s.o = {slice_dim(lora.o.a, 2, heads.query.begin * d, heads.query.end * d, "o_proj lora A"),
           lora.o.b.clone(), lora.o.scaling};
  }
  return s;
}

Tensor gqa_prefill_tp(const Tensor& x, const std::vector<int32_t>& slot, const GqaWeights& shard,
                      const std::vector<GqaLora>& lora, Communicator& comm) {
  GqaCache cache;
  return gqa_forward_tp(x, slot, shard, lora, cache, comm);
}

Tensor gqa_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const GqaWeights& shard,
                      const std::vector<GqaLora>& lora, GqaCache& cache, Communicator& comm) {
  ops::detail::check_f32(x, 2, "attention input x");
  const int64_t tokens = x.dim(0), d = shard.head_dim;
  const int64_t q_rows = d * (shard.output_gate ? 2 : 1);
  MOELORA_CHECK(shard.q_proj.defined() && shard.q_proj.dim(0) == shard.num_heads * q_rows,
                ErrorCode::kInvalidArgument, "attention q_proj: expected ", shard.num_heads * q_rows,
                " rows for ", shard.num_heads, " local heads of ", q_rows, ", got ",
                shard.q_proj.defined() ? shape_str(shard.q_proj.shape()) : "undefined");
  // Column-parallel projections of the local heads: [T, h, D] (and the gate [T, h D]).
  const Tensor q_out = project_with_lora(x, shard.q_proj, slot, lora, &GqaLora::q);
  Tensor q, gate;
  if (shard.output_gate) {  // per head [q | gate]: the two halves of [T h, 2D]
    const Tensor per_head = q_out.reshape({tokens * shard.num_heads, 2 * d});
    q = slice_dim(per_head, 1, 0, d, "attention q").reshape({tokens, shard.num_heads, d});
    gate = slice_dim(per_head, 1, d, 2 * d, "attention gate").reshape({tokens, shard.num_heads * d});
  } else {
    q = q_out.reshape({tokens, shard.num_heads, d});
  }
  Tensor k = project_with_lora(x, shard.k_proj, slot, lora, &GqaLora::k)
                 .reshape({tokens, shard.num_kv_heads, d});
  const Tensor v = project_with_lora(x, shard.v_proj, slot, lora, &GqaLora::v)
                       .reshape({tokens, shard.num_kv_heads, d});
  // Per-head norms and RoPE: each head on its own.
  if (shard.q_norm.defined()) ops::rms_norm_inplace_ref(q, shard.q_norm, shard.norm);
  if (shard.k_norm.defined()) ops::rms_norm_inplace_ref(k, shard.k_norm, shard.norm);
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  std::iota(positions.begin(), positions.end(), cache.size());
  ops::apply_rope_inplace_ref(q, positions, shard.rope, shard.rope_apply);
  ops::apply_rope_inplace_ref(k, positions, shard.rope, shard.rope_apply);
  if (!cache.kv) cache.kv.emplace(shard.num_kv_heads, d, d);
  MOELORA_CHECK(cache.kv->num_kv_heads() == shard.num_kv_heads, ErrorCode::kInvalidArgument,
                "attention cache: holds ", cache.kv->num_kv_heads(), " KV heads, the shard ",
                shard.num_kv_heads);
  cache.kv->append(k, v);
  Tensor attended =
      ops::attention_ref(q, *cache.kv, {shard.scale}).reshape({tokens, shard.num_heads * d});
  if (gate.defined()) {
    float* o = attended.data<float>();
    const float* g = gate.data<float>();
    for (int64_t i = 0; i < attended.numel(); ++i) o[i] *= ops::sigmoid_f32(g[i]);
  }
  // Row-parallel o_proj: this rank's partial sum of the base and its LoRA, reduced once.
  Tensor out = project_with_lora(attended, shard.o_proj, slot, lora, &GqaLora::o);
  comm.all_reduce_sum({out.data<float>(), static_cast<size_t>(out.numel())});
  return out;
}

}  // namespace moelora::dist
