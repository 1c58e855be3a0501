// CPU reference of MLA attention, un-absorbed and absorbed (see mla.h). Like ops/attention, work is
// split over (token, head) pairs and every pair is one serial loop in a fixed order, so results
// are deterministic and independent of the thread count.
#include "ops/mla/mla.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/threads.h"
#include "ops/attention/attention.h"
#include "ops/linear/linear.h"

namespace moelora::ops {

namespace {

std::string describe(const Tensor& t) {
  return t.defined() ? std::string(dtype_name(t.dtype())) + " " + shape_str(t.shape())
                     : "an undefined tensor";
}

void check_tensor(const Tensor& t, const Shape& expected, const char* what) {
  MOELORA_CHECK(t.defined() && t.dtype() == DType::kF32 && t.shape() == expected, ErrorCode::kInvalidArgument,
                "MLA ", what, ": expected F32 ", shape_str(expected), ", got ", describe(t));
}

void check_dims(const MlaDims& d, bool needs_rank) {
  MOELORA_CHECK(d.num_heads > 0 && d.qk_nope_head_dim >= 0 && d.qk_rope_head_dim >= 0 && d.v_head_dim > 0 &&
                    d.qk_head_dim() > 0 && (!needs_rank || d.kv_lora_rank > 0),
                ErrorCode::kInvalidArgument, "MLA dims: num_heads ", d.num_heads, ", qk_nope_head_dim ",
                d.qk_nope_head_dim, ", qk_rope_head_dim ", d.qk_rope_head_dim, ", v_head_dim ", d.v_head_dim,
                ", kv_lora_rank ", d.kv_lora_rank, " (all must be > 0 except one of nope/rope)");
}

// Checks q [T, n, nope + rope]; returns T.
int64_t check_query(const Tensor& q, const MlaDims& d) {
  MOELORA_CHECK(q.defined() && q.dtype() == DType::kF32 && q.ndim() == 3, ErrorCode::kInvalidArgument,
                "MLA query: expected F32 [tokens, heads, qk_head_dim], got ", describe(q));
  const int64_t tokens = q.dim(0);
  check_tensor(q, {tokens, d.num_heads, d.qk_head_dim()}, "query");
  return tokens;
}

// The T queries are the last T of the S cached positions, so the cache must hold them.
void check_causal(int64_t tokens, int64_t positions) {
  MOELORA_CHECK(tokens <= positions, ErrorCode::kInvalidArgument, "MLA: ", tokens,
                " query tokens but the cache holds only ", positions,
                " positions; append the new tokens' K/V (or latents) before attending");
}

float resolve_scale(const MlaAttentionParams& params) {
  MOELORA_CHECK(
      params.softmax_scale >= 0.0f && std::isfinite(params.softmax_scale), ErrorCode::kInvalidArgument,
      "MLA: softmax_scale must be finite and >= 0 (0 = qk_head_dim^-0.5), got ", params.softmax_scale);
  if (params.softmax_scale > 0.0f) return params.softmax_scale;
  return static_cast<float>(std::pow(static_cast<double>(params.dims.qk_head_dim()), -0.5));
}

// Balances thread start-up against the work of one (token, head) item.
int64_t min_items(int64_t work_per_item) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, work_per_item));
}

// out[0 .. dim) = sum_i probs[i] * rows[i * stride .. + dim), accumulated in double, i ascending.
void weighted_row_sum(const float* probs, int64_t n, const float* rows, int64_t stride, int64_t dim,
                      std::vector<double>& acc, float* out) {
  std::fill(acc.begin(), acc.begin() + dim, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const double p = probs[i];
    const float* row = rows + i * stride;
    for (int64_t d = 0; d < dim; ++d) acc[d] += p * row[d];
  }
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(acc[d]);
}

}  // namespace

double mla_softmax_scale(int64_t qk_head_dim, const RopeParams& rope) {
  MOELORA_CHECK(qk_head_dim > 0, ErrorCode::kInvalidArgument,
                "MLA softmax scale: qk_head_dim must be > 0, got ", qk_head_dim);
  double scale = std::pow(static_cast<double>(qk_head_dim), -0.5);
  if (rope.type != RopeType::kDefault && rope.mscale_all_dim != 0.0) {
    MOELORA_CHECK(rope.factor > 0.0, ErrorCode::kInvalidArgument, "MLA softmax scale: rope type '",
                  rope_type_name(rope.type), "' with mscale_all_dim ", rope.mscale_all_dim,
                  " needs the rope factor, got ", rope.factor);
    const double mscale = yarn_get_mscale(rope.factor, rope.mscale_all_dim);
    scale = scale * mscale * mscale;
  }
  return scale;
}

Tensor mla_attention_ref(const Tensor& q, const Tensor& k_nope, const Tensor& k_rope, const Tensor& v,
                         const MlaAttentionParams& params) {
  const MlaDims& d = params.dims;
  check_dims(d, /*needs_rank=*/false);
  MOELORA_CHECK(k_rope.defined() && k_rope.ndim() == 2, ErrorCode::kInvalidArgument,
                "MLA k_rope: expected F32 [positions, qk_rope_head_dim], got ", describe(k_rope));
  const int64_t positions = k_rope.dim(0);
  check_tensor(k_rope, {positions, d.qk_rope_head_dim}, "k_rope");
  check_tensor(k_nope, {positions, d.num_heads, d.qk_nope_head_dim}, "k_nope");
  check_tensor(v, {positions, d.num_heads, d.v_head_dim}, "v");
  const int64_t tokens = check_query(q, d);
  check_causal(tokens, positions);
  const float scale = resolve_scale(params);
  const int64_t nope = d.qk_nope_head_dim, rope = d.qk_rope_head_dim, heads = d.num_heads;
  const int64_t first_position = positions - tokens;

  Tensor out = Tensor::empty(DType::kF32, {tokens, heads, d.v_head_dim});
  const float* q_data = q.data<float>();
  const float* kn = k_nope.data<float>();
  const float* kr = k_rope.data<float>();
  const float* v_data = v.data<float>();
  float* out_data = out.data<float>();
  parallel_for(
      tokens * heads,
      [&](int64_t begin, int64_t end) {
        std::vector<float> scores(static_cast<size_t>(positions));
        std::vector<double> acc(static_cast<size_t>(d.v_head_dim));
        for (int64_t item = begin; item < end; ++item) {
          const int64_t t = item / heads, h = item % heads;
          const int64_t visible = first_position + t + 1;
          const float* q_nope = q_data + item * (nope + rope);
          const float* q_rope = q_nope + nope;
          for (int64_t s = 0; s < visible; ++s) {
            const float nope_part = dot_f32(q_nope, kn + (s * heads + h) * nope, nope);
            const float rope_part = dot_f32(q_rope, kr + s * rope, rope);
            scores[s] = (nope_part + rope_part) * scale;
          }
          detail::softmax_inplace_f32(scores.data(), visible);
          weighted_row_sum(scores.data(), visible, v_data + h * d.v_head_dim, heads * d.v_head_dim,
                           d.v_head_dim, acc, out_data + item * d.v_head_dim);
        }
      },
      min_items(positions * (d.qk_head_dim() + d.v_head_dim)));
  return out;
}

MlaKeyValue mla_expand_kv_ref(const Tensor& c_kv, const Tensor& kv_b_weight, const MlaDims& dims) {
  check_dims(dims, /*needs_rank=*/true);
  MOELORA_CHECK(c_kv.defined() && c_kv.ndim() == 2, ErrorCode::kInvalidArgument,
                "MLA c_kv: expected F32 [positions, kv_lora_rank], got ", describe(c_kv));
  const int64_t positions = c_kv.dim(0);
  const int64_t nope = dims.qk_nope_head_dim, dv = dims.v_head_dim, heads = dims.num_heads;
  check_tensor(c_kv, {positions, dims.kv_lora_rank}, "c_kv");
  check_tensor(kv_b_weight, {heads * (nope + dv), dims.kv_lora_rank}, "kv_b_proj weight");
  const Tensor kv = linear_ref(c_kv, kv_b_weight);  // [S, n * (nope + dv)]
  MlaKeyValue result{Tensor::empty(DType::kF32, {positions, heads, nope}),
                     Tensor::empty(DType::kF32, {positions, heads, dv})};
  const float* src = kv.data<float>();
  float* k_dst = result.k_nope.data<float>();
  float* v_dst = result.v.data<float>();
  for (int64_t row = 0; row < positions * heads; ++row) {
    std::copy_n(src + row * (nope + dv), nope, k_dst + row * nope);
    std::copy_n(src + row * (nope + dv) + nope, dv, v_dst + row * dv);
  }
  return result;
}

Tensor mla_absorb_query_ref(const Tensor& q, const Tensor& kv_b_weight, const MlaDims& dims) {
  check_dims(dims, /*needs_rank=*/true);
  const int64_t tokens = check_query(q, dims);
  const int64_t nope = dims.qk_nope_head_dim, dv = dims.v_head_dim, heads = dims.num_heads;
  const int64_t rank = dims.kv_lora_rank, qk = dims.qk_head_dim();
  check_tensor(kv_b_weight, {heads * (nope + dv), rank}, "kv_b_proj weight");
  Tensor q_lat = Tensor::empty(DType::kF32, {tokens, heads, rank});
  const float* q_data = q.data<float>();
  const float* w = kv_b_weight.data<float>();
  float* dst = q_lat.data<float>();
  parallel_for(
      tokens * heads,
      [&](int64_t begin, int64_t end) {
        std::vector<double> acc(static_cast<size_t>(rank));
        for (int64_t item = begin; item < end; ++item) {
          const int64_t h = item % heads;
          const float* q_nope = q_data + item * qk;
          const float* w_uk = w + h * (nope + dv) * rank;  // [nope, rank]
          // q_lat[r] = sum_i q_nope[i] * W_UK[i, r], i ascending.
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t i = 0; i < nope; ++i) {
            const double qi = q_nope[i];
            const float* w_row = w_uk + i * rank;
            for (int64_t r = 0; r < rank; ++r) acc[r] += qi * w_row[r];
          }
          for (int64_t r = 0; r < rank; ++r) dst[item * rank + r] = static_cast<float>(acc[r]);
        }
      },
      min_items(nope * rank));
  return q_lat;
}

Tensor mla_latent_attention_ref(const Tensor& q_lat, const Tensor& q, const Tensor& c_kv,
                                const Tensor& k_rope, const MlaAttentionParams& params) {
  const MlaDims& d = params.dims;
  check_dims(d, /*needs_rank=*/true);
  MOELORA_CHECK(c_kv.defined() && c_kv.ndim() == 2, ErrorCode::kInvalidArgument,
                "MLA c_kv: expected F32 [positions, kv_lora_rank], got ", describe(c_kv));
  const int64_t positions = c_kv.dim(0);
  const int64_t rank = d.kv_lora_rank, rope = d.qk_rope_head_dim, heads = d.num_heads, qk = d.qk_head_dim();
  check_tensor(c_kv, {positions, rank}, "c_kv");
  check_tensor(k_rope, {positions, rope}, "k_rope");
  const int64_t tokens = check_query(q, d);
  check_causal(tokens, positions);
  check_tensor(q_lat, {tokens, heads, rank}, "absorbed query");
  const float scale = resolve_scale(params);
  const int64_t first_position = positions - tokens;

  Tensor o_lat = Tensor::empty(DType::kF32, {tokens, heads, rank});
  const float* ql = q_lat.data<float>();
  const float* q_data = q.data<float>();
  const float* latent = c_kv.data<float>();
  const float* kr = k_rope.data<float>();
  float* dst = o_lat.data<float>();
  parallel_for(
      tokens * heads,
      [&](int64_t begin, int64_t end) {
        std::vector<float> scores(static_cast<size_t>(positions));
        std::vector<double> acc(static_cast<size_t>(rank));
        for (int64_t item = begin; item < end; ++item) {
          const int64_t t = item / heads;
          const int64_t visible = first_position + t + 1;
          const float* q_latent = ql + item * rank;
          const float* q_rope = q_data + item * qk + d.qk_nope_head_dim;
          for (int64_t s = 0; s < visible; ++s) {
            const float nope_part = dot_f32(q_latent, latent + s * rank, rank);
            const float rope_part = dot_f32(q_rope, kr + s * rope, rope);
            scores[s] = (nope_part + rope_part) * scale;
          }
          detail::softmax_inplace_f32(scores.data(), visible);
          weighted_row_sum(scores.data(), visible, latent, rank, rank, acc, dst + item * rank);
        }
      },
      min_items(positions * (2 * rank + rope)));
  return o_lat;
}

Tensor mla_project_output_ref(const Tensor& o_lat, const Tensor& kv_b_weight, const MlaDims& dims) {
  check_dims(dims, /*needs_rank=*/true);
  const int64_t nope = dims.qk_nope_head_dim, dv = dims.v_head_dim, heads = dims.num_heads;
  const int64_t rank = dims.kv_lora_rank;
  MOELORA_CHECK(o_lat.defined() && o_lat.ndim() == 3, ErrorCode::kInvalidArgument,
                "MLA latent output: expected F32 [tokens, heads, kv_lora_rank], got ", describe(o_lat));
  const int64_t tokens = o_lat.dim(0);
  check_tensor(o_lat, {tokens, heads, rank}, "latent output");
  check_tensor(kv_b_weight, {heads * (nope + dv), rank}, "kv_b_proj weight");
  Tensor out = Tensor::empty(DType::kF32, {tokens, heads, dv});
  const float* src = o_lat.data<float>();
  const float* w = kv_b_weight.data<float>();
  float* dst = out.data<float>();
  parallel_for(
      tokens * heads,
      [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t h = item % heads;
          const float* w_uv = w + (h * (nope + dv) + nope) * rank;  // [dv, rank]
          for (int64_t j = 0; j < dv; ++j)
            dst[item * dv + j] = dot_f32(w_uv + j * rank, src + item * rank, rank);
        }
      },
      min_items(dv * rank));
  return out;
}

Tensor mla_attention_absorbed_ref(const Tensor& q, const Tensor& c_kv, const Tensor& k_rope,
                                  const Tensor& kv_b_weight, const MlaAttentionParams& params) {
  const Tensor q_lat = mla_absorb_query_ref(q, kv_b_weight, params.dims);
  const Tensor o_lat = mla_latent_attention_ref(q_lat, q, c_kv, k_rope, params);
  return mla_project_output_ref(o_lat, kv_b_weight, params.dims);
}

MlaLatentCacheRef::MlaLatentCacheRef(int64_t kv_lora_rank, int64_t qk_rope_head_dim)
    : rank_(kv_lora_rank), rope_dim_(qk_rope_head_dim) {
  MOELORA_CHECK(kv_lora_rank > 0 && qk_rope_head_dim > 0, ErrorCode::kInvalidArgument,
                "MLA latent cache: kv_lora_rank and qk_rope_head_dim must be > 0, got ", kv_lora_rank, ", ",
                qk_rope_head_dim);
}

void MlaLatentCacheRef::append(const Tensor& c_kv, const Tensor& k_rope) {
  MOELORA_CHECK(c_kv.defined() && c_kv.ndim() == 2, ErrorCode::kInvalidArgument,
                "MLA latent cache append: expected c_kv F32 [tokens, kv_lora_rank], got ", describe(c_kv));
  const int64_t tokens = c_kv.dim(0);
  check_tensor(c_kv, {tokens, rank_}, "latent cache append: c_kv");
  check_tensor(k_rope, {tokens, rope_dim_}, "latent cache append: k_rope");
  latent_.insert(latent_.end(), c_kv.data<float>(), c_kv.data<float>() + c_kv.numel());
  k_rope_.insert(k_rope_.end(), k_rope.data<float>(), k_rope.data<float>() + k_rope.numel());
  size_ += tokens;
}

void MlaLatentCacheRef::truncate(int64_t new_size) {
  MOELORA_CHECK(new_size >= 0 && new_size <= size_, ErrorCode::kOutOfRange, "MLA latent cache truncate to ",
                new_size, " positions: the cache holds ", size_);
  size_ = new_size;
  latent_.resize(static_cast<size_t>(size_ * rank_));
  k_rope_.resize(static_cast<size_t>(size_ * rope_dim_));
}

Tensor MlaLatentCacheRef::latent() const {
  return size_ == 0 ? Tensor::zeros(DType::kF32, {0, rank_}) : Tensor::from_f32(latent_, {size_, rank_});
}

Tensor MlaLatentCacheRef::k_rope() const {
  return size_ == 0 ? Tensor::zeros(DType::kF32, {0, rope_dim_})
                    : Tensor::from_f32(k_rope_, {size_, rope_dim_});
}

}  // namespace moelora::ops
