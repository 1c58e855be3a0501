// Tensor-parallel Gated DeltaNet on the CPU reference operators (parallel_gdn.h).
#include "dist/parallel_gdn.h"

#include <string>
#include <tuple>

#include "core/error.h"
#include "dist/lora_projection.h"

namespace moelora::dist {

namespace {

// Every weight of `layer` against its shape (the whole layer or a rank's share), F32.
void check_gdn_layer(const GdnLayer& layer, const char* which) {
  const ops::GdnShape& s = layer.shape;
  const ops::GdnWeights& w = layer.weights;
  MOELORA_CHECK(s.hidden > 0 && s.num_k_heads > 0 && s.num_v_heads > 0 && s.head_k_dim > 0 &&
                    s.head_v_dim > 0 && s.conv_kernel >= 1 && s.num_v_heads % s.num_k_heads == 0,
                ErrorCode::kInvalidArgument, "Gated DeltaNet (", which, "): hidden ", s.hidden,
                ", ", s.num_k_heads, " key heads of ", s.head_k_dim, ", ", s.num_v_heads,
                " value heads of ", s.head_v_dim, " (a multiple of the key heads), conv kernel ",
                s.conv_kernel, ": every size must be positive");
  const int64_t h = s.hidden, nv = s.num_v_heads, vd = s.value_dim();
  for (const auto& [t, shape, name] :
       {std::tuple{&w.in_proj_qkv, Shape{s.conv_dim(), h}, "in_proj_qkv"},
        std::tuple{&w.in_proj_z, Shape{vd, h}, "in_proj_z"},
        std::tuple{&w.in_proj_b, Shape{nv, h}, "in_proj_b"},
        std::tuple{&w.in_proj_a, Shape{nv, h}, "in_proj_a"},
        std::tuple{&w.conv1d, Shape{s.conv_dim(), s.conv_kernel}, "conv1d"},
        std::tuple{&w.a_log, Shape{nv}, "A_log"}, std::tuple{&w.dt_bias, Shape{nv}, "dt_bias"},
        std::tuple{&w.norm, Shape{s.head_v_dim}, "norm"},
        std::tuple{&w.out_proj, Shape{h, vd}, "out_proj"}}) {
    MOELORA_CHECK(t->defined() && t->dtype() == DType::kF32 && t->shape() == shape,
                  ErrorCode::kInvalidArgument, "Gated DeltaNet (", which, ") ", name,
                  ": expected F32 ", shape_str(shape), ", got ",
                  t->defined() ? std::string(dtype_name(t->dtype())) + " " + shape_str(t->shape())
                               : std::string("undefined"));
  }
}

// The rank's key and value heads.
struct HeadRanges {
  ShardRange key, value;
};

HeadRanges head_ranges(const ops::GdnShape& shape, ShardSpec tp) {
  return {shard_range(shape.num_k_heads, tp, "Gated DeltaNet key heads"),
          shard_range(shape.num_v_heads, tp, "Gated DeltaNet value heads")};
}

// The rank's [q | k | v] channels of the conv_dim ones, in the same block order.
std::vector<ShardRange> qkv_channels(const ops::GdnShape& shape, const HeadRanges& h) {
  const int64_t dk = shape.head_k_dim, dv = shape.head_v_dim, key_dim = shape.key_dim();
  return {{h.key.begin * dk, h.key.end * dk},
          {key_dim + h.key.begin * dk, key_dim + h.key.end * dk},
          {2 * key_dim + h.value.begin * dv, 2 * key_dim + h.value.end * dv}};
}


}  // namespace

GdnLayer shard_gdn(const GdnLayer& layer, ShardSpec tp) {
  check_gdn_layer(layer, "the whole layer");
  const ops::GdnShape& shape = layer.shape;
  const ops::GdnWeights& w = layer.weights;
  const HeadRanges h = head_ranges(shape, tp);
  const int64_t dv = shape.head_v_dim;
  const std::vector<ShardRange> channels = qkv_channels(shape, h);
  GdnLayer s;
  s.shape = shape;
  s.shape.num_k_heads = h.key.size();
  s.shape.num_v_heads = h.value.size();
  s.weights.in_proj_qkv = slice_ranges(w.in_proj_qkv, 0, channels, "in_proj_qkv");
  s.weights.conv1d = slice_ranges(w.conv1d, 0, channels, "conv1d");
  s.weights.in_proj_z = slice_dim(w.in_proj_z, 0, h.value.begin * dv, h.value.end * dv, "in_proj_z");
  s.weights.in_proj_b = slice_dim(w.in_proj_b, 0, h.value.begin, h.value.end, "in_proj_b");
  s.weights.in_proj_a = slice_dim(w.in_proj_a, 0, h.value.begin, h.value.end, "in_proj_a");
  s.weights.a_log = slice_dim(w.a_log, 0, h.value.begin, h.value.end, "A_log");
  s.weights.dt_bias = slice_dim(w.dt_bias, 0, h.value.begin, h.value.end, "dt_bias");
  s.weights.norm = w.norm.clone();
  s.weights.out_proj = slice_dim(w.out_proj, 1, h.value.begin * dv, h.value.end * dv, "out_proj");
  return s;
}

GdnLora shard_gdn_lora(const GdnLora& lora, const GdnLayer& layer, ShardSpec tp) {
  const HeadRanges h = head_ranges(layer.shape, tp);
  GdnLora s;
  // in_proj_qkv's rows are three blocks: B gets the rank's rows of each (A whole).
  if (lora.in_proj_qkv.defined()) {
    s.in_proj_qkv = {lora.in_proj_qkv.a.clone(),
                     slice_ranges(lora.in_proj_qkv.b, 1, qkv_channels(layer.shape, h),
                                  "in_proj_qkv lora B"),
                     lora.in_proj_qkv.scaling};
  }
  // z / b / a rows and out_proj's columns go by value heads in head order: even splits.
  s.in_proj_z = shard_lora_column(lora.in_proj_z, tp, "in_proj_z");
  s.in_proj_b = shard_lora_column(lora.in_proj_b, tp, "in_proj_b");
  s.in_proj_a = shard_lora_column(lora.in_proj_a, tp, "in_proj_a");
  s.out_proj = shard_lora_row(lora.out_proj, tp, "out_proj");
  return s;
}

Tensor gdn_prefill_tp(const Tensor& x, const std::vector<int32_t>& slot, const GdnLayer& shard,
                      const std::vector<GdnLora>& lora, Communicator& comm) {
  GdnCache cache;
  return gdn_forward_tp(x, slot, shard, lora, cache, comm);
}

Tensor gdn_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const GdnLayer& shard,
                      const std::vector<GdnLora>& lora, GdnCache& cache, Communicator& comm) {
  ops::detail::check_f32(x, 2, "Gated DeltaNet input x");
  check_gdn_layer(shard, "the rank's share");
  MOELORA_CHECK(x.dim(1) == shard.shape.hidden, ErrorCode::kInvalidArgument,
                "Gated DeltaNet input x: expected ", shard.shape.hidden, " columns, got ",
                shape_str(x.shape()));
  const ops::GdnShape& shape = shard.shape;
  const ops::GdnWeights& w = shard.weights;
  // Column-parallel projections of the local heads, then the rule on them from a zero state.
  const Tensor qkv = project_with_lora(x, w.in_proj_qkv, slot, lora, &GdnLora::in_proj_qkv);
  const Tensor z = project_with_lora(x, w.in_proj_z, slot, lora, &GdnLora::in_proj_z);
  const Tensor b = project_with_lora(x, w.in_proj_b, slot, lora, &GdnLora::in_proj_b);
  const Tensor a = project_with_lora(x, w.in_proj_a, slot, lora, &GdnLora::in_proj_a);
  if (!cache.state) cache.state = ops::GdnState::zeros(shape);
  MOELORA_CHECK(cache.state->recurrent.dim(0) == shape.num_v_heads, ErrorCode::kInvalidArgument,
                "Gated DeltaNet cache: holds ", cache.state->recurrent.dim(0),
                " value heads' state, the share has ", shape.num_v_heads);
  const Tensor mixed =
      ops::gdn_mix_ref(qkv, z, b, a, w, shape, *cache.state, /*chunked=*/x.dim(0) > 1);
  // Row-parallel out_proj: this rank's partial sum of the base and its LoRA, reduced once.
  Tensor out = project_with_lora(mixed, w.out_proj, slot, lora, &GdnLora::out_proj);
  comm.all_reduce_sum({out.data<float>(), static_cast<size_t>(out.numel())});
  return out;
}

}  // namespace moelora::dist
