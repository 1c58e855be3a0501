// CPU reference of the grouped NVFP4 expert GEMM and the stream kernel's weight image
// (ops/gemm/moe_gemm_nvfp4.h).
#include <cmath>
#include <cstring>

#include "core/threads.h"
#include "ops/gemm/moe_gemm_nvfp4.h"

namespace moelora::ops {

namespace {

constexpr int64_t kGroup = 16;

// Where code (row, k) of a (tile, block) lives in the image's code bytes: its 32-bit word, the A
// register it expands into (a0 .. a3) and the half of that register (k odd: the high half). The
// bits of the code inside the word: the sign at 15 - reg, the 3 magnitude bits at 9 - 3 reg ..
// 11 - 3 reg, plus 16 for the high half (moe_gemm_nvfp4.h).
struct CodeSlot {
  int64_t word;
  int reg, half;
  int sign_bit() const { return 16 * half + 15 - reg; }
  int magnitude_bit() const { return 16 * half + 9 - 3 * reg; }
};
CodeSlot code_slot(int64_t row, int64_t k) {
  const int64_t warp = row / 16, r = row % 8, upper = (row % 16) / 8;  // upper: row + 8 of the pair
  const int64_t step = k / 16, kk = k % 16;
  const int64_t c = (kk % 8) / 2, high_half = kk % 2, second = kk / 8;  // second: columns 8..15
  const int64_t thread = warp * 32 + r * 4 + c;
  const int64_t word = ((step / 4) * 128 + thread) * 4 + step % 4;
  return {word, static_cast<int>(2 * second + upper), static_cast<int>(high_half)};
}
uint32_t place_code(uint32_t code, const CodeSlot& slot) {
  return ((code >> 3) << slot.sign_bit()) | ((code & 7u) << slot.magnitude_bit());
}
uint32_t take_code(uint32_t word, const CodeSlot& slot) {
  return (((word >> slot.sign_bit()) & 1u) << 3) | ((word >> slot.magnitude_bit()) & 7u);
}

// Byte of the scale of (row, step) inside a block's 512 scale bytes.
int64_t scale_slot(int64_t row, int64_t step) {
  const int64_t pair = (row / 16) * 8 + row % 8, upper = (row % 16) / 8;
  return pair * 16 + 2 * step + upper;
}

void check_stream_shapes(int64_t n, int64_t k, const char* what) {
  MOELORA_CHECK(n % kNvfp4StreamRows == 0 && k % kNvfp4StreamK == 0, ErrorCode::kUnsupported, what,
                ": the NVFP4 stream layout needs N % ", kNvfp4StreamRows, " == 0 and K % ", kNvfp4StreamK,
                " == 0, got N = ", n, ", K = ", k);
}

}  // namespace

Tensor pack_nvfp4_for_stream(const Tensor& packed, const Tensor& scale) {
  MOELORA_CHECK(packed.defined() && packed.ndim() == 3, ErrorCode::kInvalidArgument,
                "pack_nvfp4_for_stream: packed must be U8 [E, N, K/2]");
  check_dtype(packed, DType::kU8, "pack_nvfp4_for_stream: packed");
  const int64_t E = packed.dim(0), N = packed.dim(1), K = packed.dim(2) * 2;
  check_stream_shapes(N, K, "pack_nvfp4_for_stream");
  check_dtype(scale, DType::kF8E4M3, "pack_nvfp4_for_stream: scale");
  check_shape(scale, {E, N, K / kGroup}, "pack_nvfp4_for_stream: scale");
  const int64_t tiles = N / kNvfp4StreamRows, blocks = K / kNvfp4StreamK;
  const uint8_t* codes = packed.data<uint8_t>();
  const uint8_t* scales = scale.data<uint8_t>();
  for (int64_t i = 0; i < E * N * (K / kGroup); ++i) {
    const uint8_t s = scales[i];
    MOELORA_CHECK((s & 0x80) == 0 && (s & 0x7f) != 0x7f, ErrorCode::kInvalidArgument,
                  "pack_nvfp4_for_stream: scale [", i / (N * (K / kGroup)), ", ", (i / (K / kGroup)) % N, ", ",
                  i % (K / kGroup), "] = e4m3 0x", std::hex, static_cast<int>(s), std::dec,
                  " is negative or NaN; NVFP4 group scales must be non-negative numbers");
  }
  Tensor image = Tensor::zeros(DType::kU8, {E, tiles, blocks, kNvfp4StreamBlockBytes});
  uint8_t* out = image.data<uint8_t>();
  parallel_for(E * tiles, [&](int64_t lo, int64_t hi) {
    for (int64_t et = lo; et < hi; ++et) {
      const int64_t e = et / tiles, tile = et % tiles;
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* block = out + ((et * blocks) + b) * kNvfp4StreamBlockBytes;
        uint32_t* words = reinterpret_cast<uint32_t*>(block);
        for (int64_t row = 0; row < kNvfp4StreamRows; ++row) {
          const int64_t n = tile * kNvfp4StreamRows + row;
          const uint8_t* src = codes + (e * N + n) * (K / 2) + b * (kNvfp4StreamK / 2);
          for (int64_t k = 0; k < kNvfp4StreamK; ++k) {
            const uint32_t code = (src[k / 2] >> (4 * (k % 2))) & 0xfu;
            const CodeSlot slot = code_slot(row, k);
            words[slot.word] |= place_code(code, slot);
          }
          const uint8_t* srow = scales + (e * N + n) * (K / kGroup) + b * (kNvfp4StreamK / kGroup);
          for (int64_t step = 0; step < kNvfp4StreamK / kGroup; ++step)
            block[kNvfp4StreamCodeBytes + scale_slot(row, step)] = srow[step];
        }
      }
    }
  });
  return image;
}

Nvfp4Experts unpack_nvfp4_from_stream(const Tensor& image, int64_t n, int64_t k) {
  check_stream_shapes(n, k, "unpack_nvfp4_from_stream");
  check_dtype(image, DType::kU8, "unpack_nvfp4_from_stream: image");
  MOELORA_CHECK(image.ndim() == 4, ErrorCode::kInvalidArgument, "unpack_nvfp4_from_stream: image must be 4-D");
  const int64_t E = image.dim(0), tiles = n / kNvfp4StreamRows, blocks = k / kNvfp4StreamK;
  check_shape(image, {E, tiles, blocks, kNvfp4StreamBlockBytes}, "unpack_nvfp4_from_stream: image");
  Nvfp4Experts w{Tensor::zeros(DType::kU8, {E, n, k / 2}), Tensor::zeros(DType::kF8E4M3, {E, n, k / kGroup})};
  const uint8_t* in = image.data<uint8_t>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = in + ((e * tiles + t) * blocks + b) * kNvfp4StreamBlockBytes;
        const uint32_t* words = reinterpret_cast<const uint32_t*>(block);
        for (int64_t row = 0; row < kNvfp4StreamRows; ++row) {
          const int64_t nn = t * kNvfp4StreamRows + row;
          uint8_t* dst = w.packed.data<uint8_t>() + (e * n + nn) * (k / 2) + b * (kNvfp4StreamK / 2);
          for (int64_t kk = 0; kk < kNvfp4StreamK; ++kk) {
            const CodeSlot slot = code_slot(row, kk);
            dst[kk / 2] |= static_cast<uint8_t>(take_code(words[slot.word], slot) << (4 * (kk % 2)));
          }
          uint8_t* srow = w.scale.data<uint8_t>() + (e * n + nn) * (k / kGroup) + b * (kNvfp4StreamK / kGroup);
          for (int64_t step = 0; step < kNvfp4StreamK / kGroup; ++step)
            srow[step] = block[kNvfp4StreamCodeBytes + scale_slot(row, step)];
        }
      }
  return w;
}

Tensor moe_gemm_nvfp4_ref(const MoeGemmNvfp4Ref& a) {
  check_dtype(a.packed, DType::kU8, "moe_gemm_nvfp4_ref: packed");
  MOELORA_CHECK(a.packed.ndim() == 3, ErrorCode::kInvalidArgument, "moe_gemm_nvfp4_ref: packed must be [E, N, K/2], got ",
                shape_str(a.packed.shape()));
  const int64_t E = a.packed.dim(0), N = a.packed.dim(1), K = a.packed.dim(2) * 2;
  MOELORA_CHECK(K % kGroup == 0, ErrorCode::kInvalidArgument, "moe_gemm_nvfp4_ref: K = ", K,
                " is not a multiple of 16");
  check_dtype(a.scale, DType::kF8E4M3, "moe_gemm_nvfp4_ref: scale");
  check_shape(a.scale, {E, N, K / kGroup}, "moe_gemm_nvfp4_ref: scale");
  check_dtype(a.row_scale, DType::kF32, "moe_gemm_nvfp4_ref: row_scale");
  check_shape(a.row_scale, {E, N}, "moe_gemm_nvfp4_ref: row_scale");
  MOELORA_CHECK(a.act.defined() && a.act.ndim() == 2 && a.act.dim(1) == K, ErrorCode::kInvalidArgument,
                "moe_gemm_nvfp4_ref: act must be [rows, ", K, "]");
  const Tensor act = a.act.dtype() == DType::kF32 ? a.act : a.act.to_f32();
  const int64_t rows = act.dim(0);
  MOELORA_CHECK(static_cast<int64_t>(a.expert_offsets.size()) == E + 1 && a.expert_offsets[0] == 0,
                ErrorCode::kInvalidArgument, "moe_gemm_nvfp4_ref: expert_offsets must have E + 1 = ", E + 1,
                " entries starting at 0");
  const int64_t P = a.expert_offsets.back();
  MOELORA_CHECK(a.gather.empty() || static_cast<int64_t>(a.gather.size()) == P, ErrorCode::kInvalidArgument,
                "moe_gemm_nvfp4_ref: gather has ", a.gather.size(), " entries, expected ", P);
  Tensor out = Tensor::zeros(DType::kF32, {P, N});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = a.expert_offsets[e], end = a.expert_offsets[e + 1];
    MOELORA_CHECK(begin <= end, ErrorCode::kInvalidArgument, "moe_gemm_nvfp4_ref: expert_offsets decrease at ", e);
    if (begin == end) continue;
    // The expert's weights dequantized exactly (e2m1 * e4m3 has at most 5 significant bits; the
    // row scale is applied to the dot product, as the kernel does).
    std::vector<float> w(static_cast<size_t>(N * K));
    const uint8_t* codes = a.packed.data<uint8_t>() + e * N * (K / 2);
    const uint8_t* scales = a.scale.data<uint8_t>() + e * N * (K / kGroup);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        w[n * K + k] = e2m1_to_f32(codes[n * (K / 2) + k / 2] >> (4 * (k % 2))) * e4m3_to_f32(scales[n * (K / kGroup) + k / kGroup]);
    const float* rs = a.row_scale.data<float>() + e * N;
    parallel_for(end - begin, [&](int64_t lo, int64_t hi) {
      for (int64_t q = begin + lo; q < begin + hi; ++q) {
        const int64_t row = a.gather.empty() ? q : a.gather[q];
        MOELORA_CHECK(row >= 0 && row < rows, ErrorCode::kOutOfRange, "moe_gemm_nvfp4_ref: gather[", q, "] = ", row,
                      " outside [0, ", rows, ")");
        const float* x = act.data<float>() + row * K;
        float* o = out.data<float>() + q * N;
        for (int64_t n = 0; n < N; ++n) {
          const float* wr = w.data() + n * K;
          double acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[k]) * wr[k];
          o[n] = static_cast<float>(acc * rs[n]);
        }
      }
    });
  }
  return out;
}

float f16_row_scale_for(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  int exponent = 0;
  std::frexp(amax, &exponent);  // amax = m * 2^exponent, m in [0.5, 1)
  // amax / 2^(exponent - 14) = m * 2^14 in [2^13, 2^14)
  return std::ldexp(1.0f, exponent - 14);
}

namespace {

// The activation rows of both NVFP4 kernels: per output row q, the input row (gather), its largest
// magnitude, the format's power-of-two scale for it (scale_for) and each value divided by the
// scale (exact) and converted (store(q, k, value)).
template <class ScaleFor, class Store>
Tensor rows_pow2(const Tensor& x, const std::vector<int32_t>& gather, int64_t p, const char* what,
                 ScaleFor&& scale_for, Store&& store) {
  MOELORA_CHECK(x.defined() && x.ndim() == 2, ErrorCode::kInvalidArgument, what, ": x must be 2-D");
  const Tensor xf = x.dtype() == DType::kF32 ? x : x.to_f32();
  const int64_t rows = xf.dim(0), K = xf.dim(1);
  MOELORA_CHECK(gather.empty() ? p <= rows : static_cast<int64_t>(gather.size()) == p,
                ErrorCode::kInvalidArgument, what, ": ", p, " output rows from ", rows,
                " rows and ", gather.size(), " gather entries");
  Tensor scales = Tensor::empty(DType::kF32, {p});
  for (int64_t q = 0; q < p; ++q) {
    const int64_t row = gather.empty() ? q : gather[q];
    MOELORA_CHECK(row >= 0 && row < rows, ErrorCode::kOutOfRange, what, ": gather[", q, "] = ", row,
                  " outside [0, ", rows, ")");
    const float* src = xf.data<float>() + row * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(src[k]));
    const float s = scale_for(amax);
    scales.data<float>()[q] = s;
    for (int64_t k = 0; k < K; ++k) store(q, k, src[k] / s);
  }
  return scales;
}

}  // namespace

F16Rows rows_to_f16_pow2_ref(const Tensor& x, const std::vector<int32_t>& gather, int64_t p) {
  const int64_t K = x.defined() && x.ndim() == 2 ? x.dim(1) : 0;
  F16Rows out{Tensor::empty(DType::kF16, {p, K}), {}};
  uint16_t* dst = out.rows.data<uint16_t>();
  out.scale =
      rows_pow2(x, gather, p, "rows_to_f16_pow2_ref", f16_row_scale_for,
                [&](int64_t q, int64_t k, float v) { dst[q * K + k] = f32_to_f16_bits(v); });
  return out;
}

float e4m3_row_scale_for(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  int exponent = 0;
  const float m = std::frexp(amax, &exponent);  // amax = m * 2^exponent, m in [0.5, 1)
  // amax / 2^(exponent - 9) = m * 512 in [256, 512): keep it when at most 448 (e4m3's largest
  // value), else halve it into (224, 256)
  return std::ldexp(1.0f, m <= 0.875f ? exponent - 9 : exponent - 8);
}

E4m3Rows rows_to_e4m3_pow2_ref(const Tensor& x, const std::vector<int32_t>& gather, int64_t p) {
  const int64_t K = x.defined() && x.ndim() == 2 ? x.dim(1) : 0;
  E4m3Rows out{Tensor::empty(DType::kF8E4M3, {p, K}), {}};
  uint8_t* dst = out.rows.data<uint8_t>();
  out.scale = rows_pow2(x, gather, p, "rows_to_e4m3_pow2_ref", e4m3_row_scale_for,
                        [&](int64_t q, int64_t k, float v) { dst[q * K + k] = f32_to_e4m3(v); });
  return out;
}

Tensor e4m3_rows_dequantized(const E4m3Rows& r) {
  check_dtype(r.rows, DType::kF8E4M3, "e4m3_rows_dequantized: rows");
  MOELORA_CHECK(r.rows.ndim() == 2, ErrorCode::kInvalidArgument,
                "e4m3_rows_dequantized: rows must be [P, K]");
  const int64_t P = r.rows.dim(0), K = r.rows.dim(1);
  check_dtype(r.scale, DType::kF32, "e4m3_rows_dequantized: scale");
  check_shape(r.scale, {P}, "e4m3_rows_dequantized: scale");
  Tensor out = Tensor::empty(DType::kF32, {P, K});
  for (int64_t q = 0; q < P; ++q)
    for (int64_t k = 0; k < K; ++k)
      out.data<float>()[q * K + k] =
          e4m3_to_f32(r.rows.data<uint8_t>()[q * K + k]) * r.scale.data<float>()[q];
  return out;
}

}  // namespace moelora::ops
