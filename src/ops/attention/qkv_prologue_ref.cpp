// CPU reference of the GQA attention input stage (qkv_prologue.h): the per-head norms and RoPE
// through the references they fuse, with the bf16 rounding between them when asked.
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/attention/qkv_prologue.h"

namespace moelora::ops {

namespace {

// Copies heads [heads, D] starting at column `offset` of every row of qkv [T, width] out of it
// (to a [T, heads, D] tensor) or back into it.
Tensor take_heads(const Tensor& qkv, int64_t offset, int64_t heads, int64_t D) {
  const int64_t T = qkv.dim(0), width = qkv.dim(1);
  Tensor out = Tensor::empty(DType::kF32, {T, heads, D});
  const float* src = qkv.data<float>();
  float* dst = out.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < heads * D; ++i) dst[t * heads * D + i] = src[t * width + offset + i];
  return out;
}

void put_heads(Tensor& qkv, int64_t offset, const Tensor& heads_tensor) {
  const int64_t T = qkv.dim(0), width = qkv.dim(1);
  const int64_t n = heads_tensor.dim(1) * heads_tensor.dim(2);
  const float* src = heads_tensor.data<float>();
  float* dst = qkv.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n; ++i) dst[t * width + offset + i] = src[t * n + i];
}

void round_all(Tensor& x) {
  float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = round_to_bf16(p[i]);
}

}  // namespace

void qkv_prologue_ref(Tensor& qkv, const Tensor* q_norm, const Tensor* k_norm,
                      std::span<const int64_t> positions, const RopeTable& table,
                      const QkvPrologueParams& p) {
  const auto bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(qkv.dtype() == DType::kF32 && qkv.ndim() == 2, bad,
                "qkv_prologue_ref: qkv must be F32 [T, width]");
  const int64_t T = qkv.dim(0), width = qkv.dim(1), D = p.head_dim;
  MOELORA_CHECK(p.q_heads > 0 && p.kv_heads > 0 && D > 0, bad,
                "qkv_prologue_ref: q_heads, kv_heads and head_dim must be > 0 (got ", p.q_heads,
                ", ", p.kv_heads, ", ", D, ")");
  MOELORA_CHECK(p.q_heads * D <= width && p.k_offset + p.kv_heads * D <= width &&
                    p.v_offset + p.kv_heads * D <= width,
                bad, "qkv_prologue_ref: q, k (at ", p.k_offset, ") or v (at ", p.v_offset,
                ") run past the row width ", width);
  MOELORA_CHECK(static_cast<int64_t>(positions.size()) == T, bad,
                "qkv_prologue_ref: positions has ", positions.size(), " entries, expected T = ", T);
  MOELORA_CHECK((q_norm == nullptr) == (k_norm == nullptr), bad,
                "qkv_prologue_ref: q_norm and k_norm are given together or not at all");
  MOELORA_CHECK(table.rotary_dim <= D, bad, "qkv_prologue_ref: rotary_dim ", table.rotary_dim,
                " exceeds head_dim ", D);
  RopeApplyParams rope;
  rope.style = p.rope_style;
  rope.dim_offset = 0;
  for (const auto& [offset, heads, weight] :
       {std::tuple{int64_t{0}, p.q_heads, q_norm}, std::tuple{p.k_offset, p.kv_heads, k_norm}}) {
    Tensor x = take_heads(qkv, offset, heads, D);
    if (weight != nullptr) {
      MOELORA_CHECK(weight->numel() == D, bad, "qkv_prologue_ref: the q/k norm weight has ",
                    weight->numel(), " elements, expected head_dim = ", D);
      rms_norm_inplace_ref(x, *weight, p.norm);
      if (p.round_bf16) round_all(x);
    }
    apply_rope_inplace_ref(x, positions, table, rope);
    if (p.round_bf16) round_all(x);
    put_heads(qkv, offset, x);
  }
}

}  // namespace moelora::ops
