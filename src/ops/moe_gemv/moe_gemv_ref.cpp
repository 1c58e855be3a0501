#include "ops/moe_gemv/moe_gemv.h"

#include <string>

#include "core/dtype.h"
#include "ops/linear/linear.h"
#include "ops/quant/quant.h"

namespace moelora::ops {
namespace {

constexpr int64_t kBlock = 128;

// Checks the codes / scales of one expert stack against [E, rows, cols]; returns E.
int64_t check_stack(const Tensor& q, const Tensor& scale, int64_t rows, int64_t cols,
                    const char* what) {
  check_dtype(q, DType::kF8E4M3, what);
  MOELORA_CHECK(q.ndim() == 3 && q.dim(1) == rows && q.dim(2) == cols, ErrorCode::kInvalidArgument,
                what, ": expected [E, ", rows, ", ", cols, "], got ", shape_str(q.shape()));
  const std::string scale_what = std::string(what) + "_scale";
  check_dtype(scale, DType::kF32, scale_what.c_str());
  check_shape(scale, {q.dim(0), rows / kBlock, cols / kBlock}, scale_what.c_str());
  return q.dim(0);
}

// Rows [row0, row0 + n) of expert e, dequantized: out [n, cols].
void dequant_rows(const Tensor& q, const Tensor& scale, int64_t e, int64_t row0, int64_t n,
                  float* out) {
  const int64_t rows = q.dim(1), cols = q.dim(2);
  const uint8_t* codes = q.data<uint8_t>() + (e * rows + row0) * cols;
  const float* s = scale.data<float>() + e * (rows / kBlock) * (cols / kBlock);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = e4m3_to_f32(codes[r * cols + c]) *
                          s[((row0 + r) / kBlock) * (cols / kBlock) + c / kBlock];
}

// Block-wise dot product: sum over 128-column blocks, each an ops::dot_f32, added in order.
float blocked_dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t c = 0; c < n; c += kBlock) sum += dot_f32(a + c, b + c, kBlock);
  return sum;
}

void check_ids(const std::vector<int32_t>& ids, int64_t pairs, int64_t experts, const char* what) {
  MOELORA_CHECK(static_cast<int64_t>(ids.size()) == pairs, ErrorCode::kInvalidArgument, what,
                ": ids has ", ids.size(), " entries, expected T * k = ", pairs);
  for (size_t p = 0; p < ids.size(); ++p)
    MOELORA_CHECK(ids[p] >= -1 && ids[p] < experts, ErrorCode::kOutOfRange, what, ": ids[", p,
                  "] = ", ids[p], " outside [-1, E = ", experts, ")");
}

}  // namespace

Tensor moe_gemv_up_ref(const Tensor& x, const std::vector<int32_t>& ids, int top_k,
                       const MoeGemvWeightsRef& w) {
  detail::check_f32(x, 2, "moe_gemv_up_ref: x");
  const int64_t T = x.dim(0), H = x.dim(1);
  MOELORA_CHECK(top_k > 0, ErrorCode::kInvalidArgument, "moe_gemv_up_ref: top_k = ", top_k,
                " must be positive");
  MOELORA_CHECK(H % kBlock == 0, ErrorCode::kInvalidArgument, "moe_gemv_up_ref: H = ", H,
                " must be a multiple of 128");
  MOELORA_CHECK(w.w13.defined() && w.w13.ndim() == 3 && w.w13.dim(1) % (2 * kBlock) == 0,
                ErrorCode::kInvalidArgument,
                "moe_gemv_up_ref: w13 must be [E, 2I, H] with I a multiple of 128, got ",
                w.w13.defined() ? shape_str(w.w13.shape()) : std::string("undefined"));
  const int64_t I = w.w13.dim(1) / 2;
  const int64_t E = check_stack(w.w13, w.w13_scale, 2 * I, H, "moe_gemv_up_ref: w13");
  check_ids(ids, T * top_k, E, "moe_gemv_up_ref");

  Tensor a = Tensor::zeros(DType::kF32, {T * top_k, I});
  std::vector<float> xq(static_cast<size_t>(H)), rows(static_cast<size_t>(2 * I * H));
  for (int64_t t = 0; t < T; ++t) {
    fp8_round_trip_row_ref(x.data<float>() + t * H, H, kBlock, xq.data());
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = ids[t * top_k + j];
      if (e < 0) continue;
      dequant_rows(w.w13, w.w13_scale, e, 0, 2 * I, rows.data());
      float* out = a.data<float>() + (t * top_k + j) * I;
      for (int64_t i = 0; i < I; ++i) {
        const float g = blocked_dot(xq.data(), rows.data() + i * H, H);
        const float u = blocked_dot(xq.data(), rows.data() + (I + i) * H, H);
        out[i] = silu_f32(g) * u;
      }
    }
  }
  return a;
}

Tensor moe_gemv_down_ref(const Tensor& a, const std::vector<int32_t>& ids, const Tensor& weights,
                         const MoeGemvWeightsRef& w) {
  detail::check_f32(a, 2, "moe_gemv_down_ref: a");
  detail::check_f32(weights, 2, "moe_gemv_down_ref: weights");
  const int64_t T = weights.dim(0), k = weights.dim(1), I = a.dim(1);
  MOELORA_CHECK(a.dim(0) == T * k, ErrorCode::kInvalidArgument, "moe_gemv_down_ref: a has ",
                a.dim(0), " rows, expected T * k = ", T * k);
  MOELORA_CHECK(I % kBlock == 0, ErrorCode::kInvalidArgument, "moe_gemv_down_ref: I = ", I,
                " must be a multiple of 128");
  MOELORA_CHECK(w.w2.defined() && w.w2.ndim() == 3 && w.w2.dim(1) % kBlock == 0,
                ErrorCode::kInvalidArgument,
                "moe_gemv_down_ref: w2 must be [E, H, I] with H a multiple of 128, got ",
                w.w2.defined() ? shape_str(w.w2.shape()) : std::string("undefined"));
  const int64_t H = w.w2.dim(1);
  const int64_t E = check_stack(w.w2, w.w2_scale, H, I, "moe_gemv_down_ref: w2");
  check_ids(ids, T * k, E, "moe_gemv_down_ref");

  Tensor out = Tensor::zeros(DType::kF32, {T, H});
  std::vector<float> aq(static_cast<size_t>(I)), rows(static_cast<size_t>(H * I));
  for (int64_t t = 0; t < T; ++t) {
    float* o = out.data<float>() + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      if (e < 0) continue;
      fp8_round_trip_row_ref(a.data<float>() + (t * k + j) * I, I, kBlock, aq.data());
      dequant_rows(w.w2, w.w2_scale, e, 0, H, rows.data());
      const float route_w = weights.data<float>()[t * k + j];
      for (int64_t h = 0; h < H; ++h)
        o[h] += route_w * blocked_dot(aq.data(), rows.data() + h * I, I);
    }
  }
  return out;
}

}  // namespace moelora::ops
