// CPU reference of RMSNorm (see norm.h). One row is normalized by one call of normalize_row, so the
// result does not depend on the thread split.
#include "ops/norm/norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/threads.h"

namespace moelora::ops {

namespace {

// y[d] = style(w, x[d] / rms(x)) for one row of D values; x and y may alias.
void normalize_row(const float* x, float* y, const std::vector<float>& weight, float eps, NormStyle style) {
  const int64_t dim = static_cast<int64_t>(weight.size());
  // Each square is rounded to fp32 (torch's x.pow(2) is an fp32 tensor); the sum is kept in double
  // and rounded once, which is at least as accurate as torch's cascaded fp32 sum, so the two agree
  // to within an ulp of the mean.
  double sum_sq = 0.0;
  for (int64_t d = 0; d < dim; ++d) {
    const float sq = x[d] * x[d];
    sum_sq += sq;
  }
  const float variance = static_cast<float>(sum_sq) / static_cast<float>(dim);
  const float inv_rms = 1.0f / std::sqrt(variance + eps);
  if (style == NormStyle::kWeight) {
    for (int64_t d = 0; d < dim; ++d) y[d] = weight[d] * (x[d] * inv_rms);
  } else {
    for (int64_t d = 0; d < dim; ++d) y[d] = (x[d] * inv_rms) * (1.0f + weight[d]);
  }
}

}  // namespace

void rms_norm_inplace_ref(Tensor& x, const Tensor& weight, const RmsNormParams& params) {
  MOELORA_CHECK(x.defined() && x.ndim() >= 1 && x.dtype() == DType::kF32, ErrorCode::kInvalidArgument,
                "rms_norm input: expected an F32 tensor [..., D], got ",
                x.defined() ? std::string(dtype_name(x.dtype())) + " " + shape_str(x.shape())
                            : std::string("an undefined tensor"));
  const int64_t dim = x.dim(-1);
  MOELORA_CHECK(weight.defined() && dtype_is_float(weight.dtype()) && weight.shape() == Shape{dim},
                ErrorCode::kInvalidArgument, "rms_norm weight: expected a float tensor of shape [", dim,
                "] to match the last dimension of the input ", shape_str(x.shape()), ", got ",
                weight.defined() ? std::string(dtype_name(weight.dtype())) + " " + shape_str(weight.shape())
                                 : std::string("an undefined tensor"));
  MOELORA_CHECK(params.eps >= 0.0, ErrorCode::kInvalidArgument, "rms_norm eps must be >= 0, got ",
                params.eps);
  if (x.numel() == 0) return;
  std::vector<float> w(static_cast<size_t>(dim));
  for (int64_t d = 0; d < dim; ++d) w[d] = weight.item_f32(d);
  const float eps = static_cast<float>(params.eps);
  const int64_t rows = x.numel() / dim;
  float* data = x.data<float>();
  parallel_for(
      rows,
      [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          normalize_row(data + r * dim, data + r * dim, w, eps, params.style);
      },
      /*min_chunk=*/std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1)));
}

Tensor rms_norm_ref(const Tensor& x, const Tensor& weight, const RmsNormParams& params) {
  MOELORA_CHECK(x.defined(), ErrorCode::kInvalidArgument, "rms_norm input: undefined tensor");
  Tensor out = x.clone();
  rms_norm_inplace_ref(out, weight, params);
  return out;
}

}  // namespace moelora::ops
