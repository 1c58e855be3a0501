// CPU reference of the FP8 block / per-token and NVFP4 formats (see quant.h). The dequantizers are
// the oracle of every quantized GPU kernel; the quantizers follow the public recipes (DeepSeek
// block FP8, vLLM/SGLang per-token-group FP8, NVIDIA ModelOpt NVFP4, FORMATS.md §4 and §6.6) and
// write synthetic checkpoints. Scalar conversions are the exact ones of core/dtype.h.
#include "ops/quant/quant.h"

#include <algorithm>
#include <cmath>

#include "core/threads.h"

namespace moelora::ops {

namespace {

constexpr int64_t kNvfp4Group = 16;
constexpr float kFp8ActivationScaleFloor = 1e-10f;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

void check_block(int block, const char* what) {
  MOELORA_CHECK(block > 0, ErrorCode::kInvalidArgument, what, " must be positive, got ", block);
}

void check_2d(const Tensor& t, const char* what) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, what, " is undefined");
  MOELORA_CHECK(t.ndim() == 2, ErrorCode::kInvalidArgument, what, " must be 2-D, got shape ",
                shape_str(t.shape()));
}

// The quantizers take any float tensor; fp32 input is used in place.
Tensor as_f32(const Tensor& t, const char* what) {
  check_2d(t, what);
  MOELORA_CHECK(dtype_is_float(t.dtype()) && t.dtype() != DType::kE2M1x2, ErrorCode::kInvalidArgument, what,
                " must be a float tensor, got ", dtype_name(t.dtype()));
  return t.dtype() == DType::kF32 ? t : t.to_f32();
}

void check_finite(const float* v, int64_t n, int64_t row_length, const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    MOELORA_CHECK(std::isfinite(v[i]), ErrorCode::kInvalidArgument, what, "[", i / row_length, ", ",
                  i % row_length, "] is not finite (", v[i], "); cannot quantize");
  }
}

// Scale of one activation group: max(amax / 448, 1e-10).
float fp8_group_scale(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return std::max(amax / kE4M3Max, kFp8ActivationScaleFloor);
}

uint8_t fp8_activation_code(float x, float scale) {
  return f32_to_e4m3(x / scale, Fp8Overflow::kSaturate);
}

}  // namespace

Tensor dequant_fp8_block_ref(const Tensor& q, const Tensor& scale_inv, int block_n, int block_k) {
  check_2d(q, "fp8 weight");
  check_dtype(q, DType::kF8E4M3, "fp8 weight");
  check_2d(scale_inv, "fp8 weight_scale_inv");
  check_dtype(scale_inv, DType::kF32, "fp8 weight_scale_inv");
  check_block(block_n, "fp8 block_n");
  check_block(block_k, "fp8 block_k");
  const int64_t rows = q.dim(0), cols = q.dim(1);
  const int64_t scale_cols = ceil_div(cols, block_k);
  check_shape(scale_inv, {ceil_div(rows, block_n), scale_cols},
              "fp8 weight_scale_inv of a weight " + shape_str(q.shape()));
  Tensor out = Tensor::empty(DType::kF32, {rows, cols});
  const uint8_t* qp = q.data<uint8_t>();
  const float* sp = scale_inv.data<float>();
  float* op = out.data<float>();
  parallel_for(
      rows,
      [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          const float* scale_row = sp + (n / block_n) * scale_cols;
          for (int64_t k = 0; k < cols; ++k)
            op[n * cols + k] = e4m3_to_f32(qp[n * cols + k]) * scale_row[k / block_k];
        }
      },
      /*min_chunk=*/std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols)));
  return out;
}

Tensor dequant_nvfp4_ref(const Tensor& packed, const Tensor& scale, float scale_2) {
  check_2d(packed, "nvfp4 weight");
  MOELORA_CHECK(packed.dtype() == DType::kU8 || packed.dtype() == DType::kE2M1x2, ErrorCode::kInvalidArgument,
                "nvfp4 weight must be U8 [N, K/2] (or F4 [N, K]), got ", dtype_name(packed.dtype()));
  check_2d(scale, "nvfp4 weight_scale");
  check_dtype(scale, DType::kF8E4M3, "nvfp4 weight_scale");
  const int64_t rows = packed.dim(0);
  const int64_t cols = packed.dtype() == DType::kU8 ? 2 * packed.dim(1) : packed.dim(1);
  MOELORA_CHECK(cols % kNvfp4Group == 0, ErrorCode::kInvalidArgument, "nvfp4 weight ",
                shape_str(packed.shape()), ": K = ", cols,
                " input features is not a multiple of the group size ", kNvfp4Group);
  check_shape(scale, {rows, cols / kNvfp4Group},
              "nvfp4 weight_scale of a weight with K = " + std::to_string(cols));
  Tensor out = Tensor::empty(DType::kF32, {rows, cols});
  const uint8_t* pp = packed.data<uint8_t>();
  const uint8_t* sp = scale.data<uint8_t>();
  float* op = out.data<float>();
  parallel_for(
      rows,
      [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          const uint8_t* prow = pp + n * (cols / 2);
          for (int64_t k = 0; k < cols; ++k) {
            const uint8_t byte = prow[k / 2];
            const uint8_t code = (k % 2 == 0) ? (byte & 0x0f) : (byte >> 4);  // low nibble = even k
            const float block_scale = e4m3_to_f32(sp[n * (cols / kNvfp4Group) + k / kNvfp4Group]);
            op[n * cols + k] = e2m1_to_f32(code) * block_scale * scale_2;
          }
        }
      },
      /*min_chunk=*/std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols)));
  return out;
}

Fp8Block quantize_fp8_block_ref(const Tensor& w_in, int block_n, int block_k) {
  const Tensor w = as_f32(w_in, "weight to quantize to fp8");
  check_block(block_n, "fp8 block_n");
  check_block(block_k, "fp8 block_k");
  const int64_t rows = w.dim(0), cols = w.dim(1);
  const float* wp = w.data<float>();
  check_finite(wp, w.numel(), std::max<int64_t>(1, cols), "weight to quantize to fp8");
  const int64_t row_blocks = ceil_div(rows, block_n), col_blocks = ceil_div(cols, block_k);
  Fp8Block result{Tensor::empty(DType::kF8E4M3, {rows, cols}),
                  Tensor::empty(DType::kF32, {row_blocks, col_blocks})};
  uint8_t* qp = result.q.data<uint8_t>();
  float* sp = result.scale_inv.data<float>();
  parallel_for(row_blocks * col_blocks, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = (b / col_blocks) * block_n, k0 = (b % col_blocks) * block_k;
      const int64_t n1 = std::min(rows, n0 + block_n), k1 = std::min(cols, k0 + block_k);
      float amax = 0.0f;
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(wp[n * cols + k]));
      const float scale_inv = amax > 0.0f ? amax / kE4M3Max : 1.0f;
      sp[b] = scale_inv;
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t k = k0; k < k1; ++k)
          qp[n * cols + k] = f32_to_e4m3(wp[n * cols + k] / scale_inv, Fp8Overflow::kSaturate);
    }
  });
  return result;
}

Nvfp4Weight quantize_nvfp4_ref(const Tensor& w_in) {
  const Tensor w = as_f32(w_in, "weight to quantize to nvfp4");
  const int64_t rows = w.dim(0), cols = w.dim(1);
  MOELORA_CHECK(cols % kNvfp4Group == 0, ErrorCode::kInvalidArgument, "weight to quantize to nvfp4 ",
                shape_str(w.shape()), ": K = ", cols, " input features is not a multiple of the group size ",
                kNvfp4Group);
  const float* wp = w.data<float>();
  check_finite(wp, w.numel(), std::max<int64_t>(1, cols), "weight to quantize to nvfp4");
  float amax = 0.0f;
  for (int64_t i = 0; i < w.numel(); ++i) amax = std::max(amax, std::fabs(wp[i]));
  const int64_t groups = cols / kNvfp4Group;
  Nvfp4Weight result{Tensor::zeros(DType::kU8, {rows, cols / 2}),
                     Tensor::empty(DType::kF8E4M3, {rows, groups}), amax / (kE2M1Max * kE4M3Max)};
  const float scale_2 = result.scale_2;
  uint8_t* pp = result.packed.data<uint8_t>();
  uint8_t* sp = result.scale.data<uint8_t>();
  parallel_for(rows * groups, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* v = wp + (g / groups) * cols + (g % groups) * kNvfp4Group;
      uint8_t* out = pp + (g / groups) * (cols / 2) + (g % groups) * (kNvfp4Group / 2);
      float block_amax = 0.0f;
      for (int64_t i = 0; i < kNvfp4Group; ++i) block_amax = std::max(block_amax, std::fabs(v[i]));
      // scale_2 == 0 only for an all-zero tensor; then every block is a zero block.
      const uint8_t scale_code = scale_2 > 0.0f
                                     ? f32_to_e4m3(block_amax / (kE2M1Max * scale_2), Fp8Overflow::kSaturate)
                                     : uint8_t{0};
      const float denominator = e4m3_to_f32(scale_code) * scale_2;
      if (!(denominator > 0.0f) || !std::isfinite(denominator)) {
        sp[g] = 0;  // zero block (or one too small for an e4m3 scale): scale 0, all codes 0
        continue;   // packed bytes are already zero
      }
      sp[g] = scale_code;
      for (int64_t i = 0; i < kNvfp4Group; i += 2) {
        const uint8_t even = f32_to_e2m1(v[i] / denominator);
        const uint8_t odd = f32_to_e2m1(v[i + 1] / denominator);
        out[i / 2] = static_cast<uint8_t>(even | (odd << 4));
      }
    }
  });
  return result;
}

Fp8Activations quantize_fp8_per_token_ref(const Tensor& x_in, int group) {
  const Tensor x = as_f32(x_in, "activations to quantize to fp8");
  check_block(group, "fp8 activation group");
  const int64_t tokens = x.dim(0), cols = x.dim(1), groups = ceil_div(cols, group);
  const float* xp = x.data<float>();
  check_finite(xp, x.numel(), std::max<int64_t>(1, cols), "activations to quantize to fp8");
  Fp8Activations result{Tensor::empty(DType::kF8E4M3, {tokens, cols}),
                        Tensor::empty(DType::kF32, {tokens, groups})};
  uint8_t* qp = result.q.data<uint8_t>();
  float* sp = result.scale.data<float>();
  parallel_for(
      tokens,
      [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t k0 = g * group, n = std::min<int64_t>(group, cols - k0);
            const float* xg = xp + t * cols + k0;
            const float scale = fp8_group_scale(xg, n);
            sp[t * groups + g] = scale;
            for (int64_t i = 0; i < n; ++i) qp[t * cols + k0 + i] = fp8_activation_code(xg[i], scale);
          }
        }
      },
      /*min_chunk=*/std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols)));
  return result;
}

Tensor dequant_fp8_per_token_ref(const Fp8Activations& a, int group) {
  check_2d(a.q, "fp8 activations");
  check_dtype(a.q, DType::kF8E4M3, "fp8 activations");
  check_2d(a.scale, "fp8 activation scales");
  check_dtype(a.scale, DType::kF32, "fp8 activation scales");
  check_block(group, "fp8 activation group");
  const int64_t tokens = a.q.dim(0), cols = a.q.dim(1), groups = ceil_div(cols, group);
  check_shape(a.scale, {tokens, groups}, "fp8 activation scales of activations " + shape_str(a.q.shape()));
  Tensor out = Tensor::empty(DType::kF32, {tokens, cols});
  const uint8_t* qp = a.q.data<uint8_t>();
  const float* sp = a.scale.data<float>();
  float* op = out.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < cols; ++k)
      op[t * cols + k] = e4m3_to_f32(qp[t * cols + k]) * sp[t * groups + k / group];
  }
  return out;
}

void fp8_round_trip_row_ref(const float* x, int64_t n, int group, float* out) {
  check_block(group, "fp8 activation group");
  check_finite(x, n, std::max<int64_t>(1, n), "activations to quantize to fp8");
  for (int64_t k0 = 0; k0 < n; k0 += group) {
    const int64_t len = std::min<int64_t>(group, n - k0);
    const float scale = fp8_group_scale(x + k0, len);
    for (int64_t i = 0; i < len; ++i)
      out[k0 + i] = e4m3_to_f32(fp8_activation_code(x[k0 + i], scale)) * scale;
  }
}

}  // namespace moelora::ops
