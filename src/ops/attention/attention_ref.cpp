// CPU reference of causal GQA attention (see attention.h). Work is split over (token, query head)
// pairs; each pair's output is computed by one serial loop in a fixed order (q.k with dot_f32,
// softmax sum and the probability-weighted sum of V accumulated in double), so results are
// deterministic and independent of the thread count and of how many tokens share the call.
#include "ops/attention/attention.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/threads.h"
#include "ops/linear/linear.h"

namespace moelora::ops {

namespace detail {

void softmax_inplace_f32(float* x, int64_t n) {
  float max_value = x[0];
  for (int64_t i = 1; i < n; ++i) max_value = std::max(max_value, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max_value);
    sum += x[i];
  }
  // torch's CPU softmax multiplies by the reciprocal of the sum.
  const float inv_sum = 1.0f / static_cast<float>(sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv_sum;
}

}  // namespace detail

namespace {

std::string describe(const Tensor& t) {
  return t.defined() ? std::string(dtype_name(t.dtype())) + " " + shape_str(t.shape())
                     : "an undefined tensor";
}

void check_f32_3d(const Tensor& t, const char* what, const char* layout) {
  MOELORA_CHECK(t.defined() && t.dtype() == DType::kF32 && t.ndim() == 3, ErrorCode::kInvalidArgument,
                "attention ", what, ": expected F32 ", layout, ", got ", describe(t));
}

// Where the K/V rows of one sequence live: position-major, KV heads inside.
struct KvView {
  const float* keys;    // [S, Hkv, D]
  const float* values;  // [S, Hkv, Dv]
  int64_t size, num_kv_heads, head_dim, v_head_dim;
};

Tensor attend(const Tensor& q, const KvView& kv, const AttentionParams& params) {
  check_f32_3d(q, "query", "[tokens, q_heads, head_dim]");
  const int64_t tokens = q.dim(0), q_heads = q.dim(1), head_dim = q.dim(2);
  MOELORA_CHECK(head_dim == kv.head_dim, ErrorCode::kInvalidArgument, "attention: query head_dim ", head_dim,
                " differs from the key head_dim ", kv.head_dim);
  MOELORA_CHECK(kv.num_kv_heads > 0 && q_heads % kv.num_kv_heads == 0, ErrorCode::kInvalidArgument,
                "attention: ", q_heads, " query heads are not a multiple of ", kv.num_kv_heads, " KV heads");
  MOELORA_CHECK(tokens <= kv.size, ErrorCode::kInvalidArgument, "attention: ", tokens,
                " query tokens but the KV cache holds only ", kv.size,
                " positions; append the new tokens' K/V before attending");
  MOELORA_CHECK(params.scale >= 0.0f && std::isfinite(params.scale), ErrorCode::kInvalidArgument,
                "attention: scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got ", params.scale);
  const float scale = params.scale > 0.0f ? params.scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t group = q_heads / kv.num_kv_heads;  // query heads per KV head (repeat_kv's n_rep)
  const int64_t first_position = kv.size - tokens;

  Tensor out = Tensor::empty(DType::kF32, {tokens, q_heads, kv.v_head_dim});
  const float* q_data = q.data<float>();
  float* out_data = out.data<float>();
  const int64_t kv_stride = kv.num_kv_heads * head_dim;
  const int64_t v_stride = kv.num_kv_heads * kv.v_head_dim;
  parallel_for(
      tokens * q_heads,
      [&](int64_t begin, int64_t end) {
        std::vector<float> scores(static_cast<size_t>(kv.size));
        std::vector<double> acc(static_cast<size_t>(kv.v_head_dim));
        for (int64_t item = begin; item < end; ++item) {
          const int64_t t = item / q_heads, h = item % q_heads;
          const int64_t kv_head = h / group;
          const int64_t visible = first_position + t + 1;  // positions 0 .. first_position + t
          const float* q_row = q_data + item * head_dim;
          for (int64_t i = 0; i < visible; ++i) {
            scores[i] = dot_f32(q_row, kv.keys + i * kv_stride + kv_head * head_dim, head_dim) * scale;
          }
          detail::softmax_inplace_f32(scores.data(), visible);
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t i = 0; i < visible; ++i) {
            const float* v_row = kv.values + i * v_stride + kv_head * kv.v_head_dim;
            const double p = scores[i];
            for (int64_t d = 0; d < kv.v_head_dim; ++d) acc[d] += p * v_row[d];
          }
          float* o = out_data + item * kv.v_head_dim;
          for (int64_t d = 0; d < kv.v_head_dim; ++d) o[d] = static_cast<float>(acc[d]);
        }
      },
      /*min_chunk=*/std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kv.size * (head_dim + kv.v_head_dim))));
  return out;
}

}  // namespace

KvCacheRef::KvCacheRef(int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim)
    : num_kv_heads_(num_kv_heads), head_dim_(head_dim), v_head_dim_(v_head_dim) {
  MOELORA_CHECK(num_kv_heads > 0 && head_dim > 0 && v_head_dim > 0, ErrorCode::kInvalidArgument,
                "KV cache: num_kv_heads, head_dim and v_head_dim must be > 0, got ", num_kv_heads, ", ",
                head_dim, ", ", v_head_dim);
}

void KvCacheRef::append(const Tensor& k, const Tensor& v) {
  check_f32_3d(k, "keys to append", "[tokens, kv_heads, head_dim]");
  check_f32_3d(v, "values to append", "[tokens, kv_heads, v_head_dim]");
  const int64_t tokens = k.dim(0);
  check_shape(k, {tokens, num_kv_heads_, head_dim_}, "KV cache append: keys");
  check_shape(v, {tokens, num_kv_heads_, v_head_dim_}, "KV cache append: values");
  keys_.insert(keys_.end(), k.data<float>(), k.data<float>() + k.numel());
  values_.insert(values_.end(), v.data<float>(), v.data<float>() + v.numel());
  size_ += tokens;
}

void KvCacheRef::truncate(int64_t new_size) {
  MOELORA_CHECK(new_size >= 0 && new_size <= size_, ErrorCode::kOutOfRange, "KV cache truncate to ", new_size,
                " positions: the cache holds ", size_);
  size_ = new_size;
  keys_.resize(static_cast<size_t>(size_ * num_kv_heads_ * head_dim_));
  values_.resize(static_cast<size_t>(size_ * num_kv_heads_ * v_head_dim_));
}

Tensor KvCacheRef::keys() const {
  return size_ == 0 ? Tensor::zeros(DType::kF32, {0, num_kv_heads_, head_dim_})
                    : Tensor::from_f32(keys_, {size_, num_kv_heads_, head_dim_});
}

Tensor KvCacheRef::values() const {
  return size_ == 0 ? Tensor::zeros(DType::kF32, {0, num_kv_heads_, v_head_dim_})
                    : Tensor::from_f32(values_, {size_, num_kv_heads_, v_head_dim_});
}

Tensor attention_ref(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params) {
  check_f32_3d(k, "keys", "[positions, kv_heads, head_dim]");
  check_f32_3d(v, "values", "[positions, kv_heads, v_head_dim]");
  MOELORA_CHECK(v.dim(0) == k.dim(0) && v.dim(1) == k.dim(1), ErrorCode::kInvalidArgument,
                "attention: values ", shape_str(v.shape()), " do not match keys ", shape_str(k.shape()),
                " in positions and KV heads");
  const KvView view{k.data<float>(), v.data<float>(), k.dim(0), k.dim(1), k.dim(2), v.dim(2)};
  return attend(q, view, params);
}

Tensor attention_ref(const Tensor& q, const KvCacheRef& cache, const AttentionParams& params) {
  const KvView view{cache.key(0, 0),      cache.value(0, 0), cache.size(),
                    cache.num_kv_heads(), cache.head_dim(),  cache.v_head_dim()};
  return attend(q, view, params);
}

GatedQuery split_gated_query_ref(const Tensor& q_proj_out, int64_t num_heads, int64_t head_dim) {
  MOELORA_CHECK(q_proj_out.defined() && q_proj_out.dtype() == DType::kF32 && q_proj_out.ndim() == 2,
                ErrorCode::kInvalidArgument, "gated query: expected F32 [tokens, heads * 2 * head_dim], got ",
                describe(q_proj_out));
  MOELORA_CHECK(num_heads > 0 && head_dim > 0 && q_proj_out.dim(1) == num_heads * 2 * head_dim,
                ErrorCode::kInvalidArgument, "gated query: q_proj output has ", q_proj_out.dim(1),
                " columns; ", num_heads, " heads of [q | gate] with head_dim ", head_dim, " need ",
                num_heads * 2 * head_dim);
  const int64_t tokens = q_proj_out.dim(0);
  GatedQuery result{Tensor::empty(DType::kF32, {tokens, num_heads, head_dim}),
                    Tensor::empty(DType::kF32, {tokens, num_heads, head_dim})};
  const float* src = q_proj_out.data<float>();
  float* query = result.query.data<float>();
  float* gate = result.gate.data<float>();
  for (int64_t row = 0; row < tokens * num_heads; ++row) {
    std::copy_n(src + row * 2 * head_dim, head_dim, query + row * head_dim);
    std::copy_n(src + row * 2 * head_dim + head_dim, head_dim, gate + row * head_dim);
  }
  return result;
}

void apply_output_gate_inplace_ref(Tensor& out, const Tensor& gate) {
  MOELORA_CHECK(out.defined() && out.dtype() == DType::kF32, ErrorCode::kInvalidArgument,
                "attention output gate: expected an F32 output, got ", describe(out));
  MOELORA_CHECK(gate.defined() && gate.dtype() == DType::kF32 && gate.numel() == out.numel(),
                ErrorCode::kInvalidArgument, "attention output gate: expected an F32 gate with ", out.numel(),
                " elements (output ", shape_str(out.shape()), "), got ", describe(gate));
  float* o = out.data<float>();
  const float* g = gate.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i) o[i] *= sigmoid_f32(g[i]);
}

}  // namespace moelora::ops
