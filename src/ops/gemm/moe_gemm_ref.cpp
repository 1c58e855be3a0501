#include "ops/gemm/moe_gemm.h"

#include "core/threads.h"

namespace moelora::ops {

Tensor moe_gemm_fp8_ref(const MoeGemmFp8Ref& a) {
  check_dtype(a.act, DType::kF8E4M3, "moe_gemm_fp8_ref: act");
  check_dtype(a.weight, DType::kF8E4M3, "moe_gemm_fp8_ref: weight");
  MOELORA_CHECK(a.weight.ndim() == 3, ErrorCode::kInvalidArgument, "moe_gemm_fp8_ref: weight must be [E, N, K], got ",
                shape_str(a.weight.shape()));
  const int64_t E = a.weight.dim(0), N = a.weight.dim(1), K = a.weight.dim(2);
  MOELORA_CHECK(K % 128 == 0, ErrorCode::kInvalidArgument, "moe_gemm_fp8_ref: K = ", K, " is not a multiple of 128");
  const int64_t kb = K / 128, nb = (N + 127) / 128;
  check_shape(a.weight_scale, {E, nb, kb}, "moe_gemm_fp8_ref: weight_scale");
  MOELORA_CHECK(a.act.ndim() == 2 && a.act.dim(1) == K, ErrorCode::kInvalidArgument,
                "moe_gemm_fp8_ref: act must be [rows, ", K, "], got ", shape_str(a.act.shape()));
  const int64_t rows = a.act.dim(0);
  check_shape(a.act_scale, {rows, kb}, "moe_gemm_fp8_ref: act_scale");
  MOELORA_CHECK(static_cast<int64_t>(a.expert_offsets.size()) == E + 1 && a.expert_offsets[0] == 0,
                ErrorCode::kInvalidArgument, "moe_gemm_fp8_ref: expert_offsets must have E + 1 = ", E + 1,
                " entries starting at 0");
  const int64_t P = a.expert_offsets.back();
  MOELORA_CHECK(a.gather.empty() || static_cast<int64_t>(a.gather.size()) == P, ErrorCode::kInvalidArgument,
                "moe_gemm_fp8_ref: gather has ", a.gather.size(), " entries, expected ", P);

  // Dequantize both operands once (exact: e4m3 * f32 scale in fp32), then plain dot products.
  Tensor act = Tensor::empty(DType::kF32, {rows, K});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      act.data<float>()[r * K + k] = a.act.item_f32(r * K + k) * a.act_scale.data<float>()[r * kb + k / 128];

  Tensor out = Tensor::zeros(DType::kF32, {P, N});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = a.expert_offsets[e], end = a.expert_offsets[e + 1];
    MOELORA_CHECK(begin <= end, ErrorCode::kInvalidArgument, "moe_gemm_fp8_ref: expert_offsets decrease at ", e);
    if (begin == end) continue;
    std::vector<float> w(static_cast<size_t>(N * K));
    const uint8_t* wq = a.weight.data<uint8_t>() + e * N * K;
    const float* ws = a.weight_scale.data<float>() + e * nb * kb;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) w[n * K + k] = e4m3_to_f32(wq[n * K + k]) * ws[(n / 128) * kb + k / 128];
    parallel_for(end - begin, [&](int64_t lo, int64_t hi) {
      for (int64_t q = begin + lo; q < begin + hi; ++q) {
        const int64_t row = a.gather.empty() ? q : a.gather[q];
        MOELORA_CHECK(row >= 0 && row < rows, ErrorCode::kOutOfRange, "moe_gemm_fp8_ref: gather[", q, "] = ", row,
                      " outside [0, ", rows, ")");
        const float* x = act.data<float>() + row * K;
        float* o = out.data<float>() + q * N;
        for (int64_t n = 0; n < N; ++n) {
          const float* wr = w.data() + n * K;
          double acc = 0;  // the reference accumulates in double: it is the oracle
          for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[k]) * wr[k];
          o[n] = static_cast<float>(acc);
        }
      }
    });
  }
  return out;
}

}  // namespace moelora::ops
