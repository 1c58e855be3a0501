// Quantization references (ops/quant): FP8 128x128 block dequantization with partial blocks,
// the block and per-token quantizers' scales and error bounds, NVFP4 nibble order, exact codes
// and error bounds, and the errors for bad shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora {
namespace {

using ops::dequant_fp8_block_ref;
using ops::dequant_fp8_per_token_ref;
using ops::dequant_nvfp4_ref;
using ops::quantize_fp8_block_ref;
using ops::quantize_fp8_per_token_ref;
using ops::quantize_nvfp4_ref;

Tensor u8_tensor(DType dtype, const std::vector<uint8_t>& bytes, Shape shape) {
  Tensor t = Tensor::empty(dtype, std::move(shape));
  EXPECT_EQ(t.nbytes(), bytes.size());
  std::memcpy(t.raw_data(), bytes.data(), bytes.size());
  return t;
}

// e4m3 codes used below, decoded by hand from the format (bias 7, 3 mantissa bits).
constexpr uint8_t kE4M3One = 0x38;           // 1.0
constexpr uint8_t kE4M3MinusOneHalf = 0xbc;  // -1.5
constexpr uint8_t kE4M3Two = 0x40;           // 2.0
constexpr uint8_t kE4M3Max448 = 0x7e;        // 448

// ---------------------------------------------------------------- FP8 block dequantization

TEST(QuantFp8Block, DequantPartialBlocksUseTheirBlockScale) {
  // N = 130, K = 200 with 128x128 blocks: scales [2, 2]; the last row block has 2 rows and the
  // last column block 72 columns.
  const int64_t rows = 130, cols = 200;
  std::vector<uint8_t> codes(rows * cols, kE4M3One);
  codes[0 * cols + 0] = kE4M3MinusOneHalf;
  codes[129 * cols + 199] = kE4M3Two;
  codes[127 * cols + 128] = kE4M3Max448;
  const Tensor q = u8_tensor(DType::kF8E4M3, codes, {rows, cols});
  const Tensor scale = Tensor::from_f32({0.5f, 2.0f, 3.0f, 0.25f}, {2, 2});
  const Tensor w = dequant_fp8_block_ref(q, scale);
  ASSERT_EQ(w.shape(), (Shape{rows, cols}));
  const float* wp = w.data<float>();
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t k = 0; k < cols; ++k) {
      float block_scale;
      if (n < 128)
        block_scale = k < 128 ? 0.5f : 2.0f;
      else
        block_scale = k < 128 ? 3.0f : 0.25f;
      float value = 1.0f;
      if (n == 0 && k == 0) value = -1.5f;
      if (n == 129 && k == 199) value = 2.0f;
      if (n == 127 && k == 128) value = 448.0f;
      ASSERT_EQ(wp[n * cols + k], value * block_scale) << "at [" << n << ", " << k << "]";
    }
  }
}

TEST(QuantFp8Block, DequantSmallBlocksAndSizesNotMultiples) {
  // 5 x 7 weight with 2 x 3 blocks: scales [3, 3].
  std::vector<uint8_t> codes(35, kE4M3Two);
  const Tensor q = u8_tensor(DType::kF8E4M3, codes, {5, 7});
  std::vector<float> s(9);
  for (int i = 0; i < 9; ++i) s[i] = static_cast<float>(i + 1);
  const Tensor w = dequant_fp8_block_ref(q, Tensor::from_f32(s, {3, 3}), 2, 3);
  for (int64_t n = 0; n < 5; ++n)
    for (int64_t k = 0; k < 7; ++k) EXPECT_EQ(w.data<float>()[n * 7 + k], 2.0f * s[(n / 2) * 3 + k / 3]);
}

TEST(QuantFp8Block, DequantRejectsWrongScaleShapeAndDtype) {
  const Tensor q = Tensor::zeros(DType::kF8E4M3, {130, 200});
  const std::string msg = test::error_message([&] { dequant_fp8_block_ref(q, Tensor::zeros(DType::kF32, {1, 2})); });
  EXPECT_NE(msg.find("weight_scale_inv"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[1, 2]"), std::string::npos) << msg;
  const std::string dtype_msg = test::error_message([&] {
    dequant_fp8_block_ref(Tensor::zeros(DType::kF32, {130, 200}), Tensor::zeros(DType::kF32, {2, 2}));
  });
  EXPECT_NE(dtype_msg.find("F8_E4M3"), std::string::npos) << dtype_msg;
  EXPECT_THROW(dequant_fp8_block_ref(q, Tensor::zeros(DType::kF32, {2, 2}), 0, 128), Error);
}

// ---------------------------------------------------------------- FP8 block quantization

TEST(QuantFp8Block, QuantizeScaleIsBlockAmaxOver448AndErrorIsBounded) {
  std::mt19937_64 rng(test::test_seed(11));
  const int64_t rows = 131, cols = 259;  // partial blocks in both dimensions
  Tensor w = test::random_normal({rows, cols}, rng, 0.7f);
  float* wp = w.data<float>();
  // Make one block much smaller than the others so per-block scales matter.
  for (int64_t n = 128; n < rows; ++n)
    for (int64_t k = 0; k < 128; ++k) wp[n * cols + k] *= 1e-3f;
  const ops::Fp8Block block = quantize_fp8_block_ref(w);
  ASSERT_EQ(block.q.dtype(), DType::kF8E4M3);
  ASSERT_EQ(block.scale_inv.shape(), (Shape{2, 3}));
  const float* scale = block.scale_inv.data<float>();
  for (int64_t bn = 0; bn < 2; ++bn) {
    for (int64_t bk = 0; bk < 3; ++bk) {
      float amax = 0;
      for (int64_t n = bn * 128; n < std::min<int64_t>(rows, bn * 128 + 128); ++n)
        for (int64_t k = bk * 128; k < std::min<int64_t>(cols, bk * 128 + 128); ++k)
          amax = std::max(amax, std::fabs(wp[n * cols + k]));
      EXPECT_EQ(scale[bn * 3 + bk], amax / 448.0f) << "block " << bn << ", " << bk;
    }
  }
  const Tensor deq = dequant_fp8_block_ref(block.q, block.scale_inv);
  const uint8_t* q = block.q.data<uint8_t>();
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t k = 0; k < cols; ++k) {
      const float s = scale[(n / 128) * 3 + k / 128];
      const float x = wp[n * cols + k], d = deq.data<float>()[n * cols + k];
      // e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative for normals; below the smallest
      // normal (2^-6 in scaled units) the spacing is 2^-9, so half of it is 2^-10 absolute.
      const double bound = std::max<double>(std::ldexp(std::fabs(x), -4), std::ldexp(1.0, -10) * s);
      ASSERT_LE(std::fabs(double(d) - x), bound * (1 + 1e-6)) << "at [" << n << ", " << k << "]";
      ASSERT_NE(q[n * cols + k] & 0x7f, 0x7f) << "NaN code at [" << n << ", " << k << "]";
    }
  }
}

TEST(QuantFp8Block, AmaxElementMapsTo448AndZeroBlockGetsScaleOne) {
  std::vector<float> v(4 * 6, 0.0f);
  // 2 x 3 blocks: block (0, 0) holds -3.5 as its amax, block (0, 1) stays all zero.
  v[0 * 6 + 1] = 1.0f;
  v[1 * 6 + 2] = -3.5f;
  v[2 * 6 + 4] = 0.25f;
  const ops::Fp8Block block = quantize_fp8_block_ref(Tensor::from_f32(v, {4, 6}), 2, 3);
  ASSERT_EQ(block.scale_inv.shape(), (Shape{2, 2}));
  EXPECT_EQ(block.scale_inv.data<float>()[0], 3.5f / 448.0f);
  EXPECT_EQ(block.scale_inv.data<float>()[1], 1.0f);  // all-zero block
  EXPECT_EQ(block.scale_inv.data<float>()[3], 0.25f / 448.0f);
  const uint8_t* q = block.q.data<uint8_t>();
  EXPECT_EQ(q[1 * 6 + 2], 0x80 | kE4M3Max448);  // -448
  EXPECT_EQ(q[2 * 6 + 4], kE4M3Max448);
  EXPECT_EQ(q[0 * 6 + 4], 0x00);
  // 1.0 / (3.5 / 448) = 128 = 2^7: exactly representable (code 0x70).
  EXPECT_EQ(q[0 * 6 + 1], 0x70);
  const Tensor deq = dequant_fp8_block_ref(block.q, block.scale_inv, 2, 3);
  EXPECT_EQ(deq.data<float>()[1 * 6 + 2], -3.5f);
  EXPECT_EQ(deq.data<float>()[0 * 6 + 3], 0.0f);
}

TEST(QuantFp8Block, RejectsNonFiniteInput) {
  std::vector<float> v(16, 1.0f);
  v[5] = std::nanf("");
  const std::string msg = test::error_message([&] { quantize_fp8_block_ref(Tensor::from_f32(v, {2, 8})); });
  EXPECT_NE(msg.find("[0, 5]"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- FP8 per-token activations

TEST(QuantFp8PerToken, ScalesPerTokenAndGroupWithPartialLastGroup) {
  std::mt19937_64 rng(test::test_seed(12));
  const int64_t tokens = 5, cols = 300;  // groups of 128: 128, 128, 44
  Tensor x = test::random_normal({tokens, cols}, rng, 2.0f);
  float* xp = x.data<float>();
  for (int64_t k = 128; k < 256; ++k) xp[3 * cols + k] = 0.0f;  // an all-zero group
  const ops::Fp8Activations a = quantize_fp8_per_token_ref(x);
  ASSERT_EQ(a.q.shape(), (Shape{tokens, cols}));
  ASSERT_EQ(a.scale.shape(), (Shape{tokens, 3}));
  const Tensor deq = dequant_fp8_per_token_ref(a);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t g = 0; g < 3; ++g) {
      float amax = 0;
      for (int64_t k = g * 128; k < std::min<int64_t>(cols, g * 128 + 128); ++k)
        amax = std::max(amax, std::fabs(xp[t * cols + k]));
      const float expected = std::max(amax / 448.0f, 1e-10f);
      ASSERT_EQ(a.scale.data<float>()[t * 3 + g], expected) << "token " << t << " group " << g;
      for (int64_t k = g * 128; k < std::min<int64_t>(cols, g * 128 + 128); ++k) {
        const float v = xp[t * cols + k], d = deq.data<float>()[t * cols + k];
        const double bound = std::max<double>(std::ldexp(std::fabs(v), -4), std::ldexp(1.0, -10) * expected);
        ASSERT_LE(std::fabs(double(d) - v), bound * (1 + 1e-6)) << "at [" << t << ", " << k << "]";
      }
    }
  }
  EXPECT_EQ(a.scale.data<float>()[3 * 3 + 1], 1e-10f);  // floor on the zero group
  EXPECT_EQ(deq.data<float>()[3 * cols + 200], 0.0f);

  // The row helper used by the MoE reference is the same round trip, also in place.
  std::vector<float> row(xp + 2 * cols, xp + 3 * cols);
  ops::fp8_round_trip_row_ref(row.data(), cols, 128, row.data());
  for (int64_t k = 0; k < cols; ++k) ASSERT_EQ(row[k], deq.data<float>()[2 * cols + k]) << "column " << k;
}

TEST(QuantFp8PerToken, SmallGroupExactValues) {
  // Group of 4: amax 8 -> scale 8/448; 8 -> 448, 4 -> 224, -1 -> -56, 0.5 -> 28 (all exact e4m3).
  const Tensor x = Tensor::from_f32({8.0f, 4.0f, -1.0f, 0.5f, 0.0f, 0.0f}, {1, 6});
  const ops::Fp8Activations a = quantize_fp8_per_token_ref(x, 4);
  ASSERT_EQ(a.scale.shape(), (Shape{1, 2}));
  EXPECT_EQ(a.scale.data<float>()[0], 8.0f / 448.0f);
  const Tensor deq = dequant_fp8_per_token_ref(a, 4);
  const std::vector<float> expect = {448.0f, 224.0f, -56.0f, 28.0f};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(e4m3_to_f32(a.q.data<uint8_t>()[i]), expect[i]) << i;
    EXPECT_FLOAT_EQ(deq.data<float>()[i], expect[i] * (8.0f / 448.0f)) << i;
  }
  EXPECT_THROW(dequant_fp8_per_token_ref(a, 2), Error);  // scale shape does not match group 2
}

// ---------------------------------------------------------------- NVFP4

TEST(QuantNvfp4, NibbleOrderLowNibbleIsEvenElement) {
  // Row of 16: byte 0 = 0x21 -> element 0 code 1 (0.5), element 1 code 2 (1.0); byte 1 = 0xF7 ->
  // element 2 code 7 (6), element 3 code F (-6); the rest zero. Scale e4m3 2.0, scale_2 0.25.
  std::vector<uint8_t> packed(8, 0);
  packed[0] = 0x21;
  packed[1] = 0xF7;
  packed[7] = 0x9A;  // element 14 code A (-1), element 15 code 9 (-0.5)
  const Tensor p = u8_tensor(DType::kU8, packed, {1, 8});
  const Tensor s = u8_tensor(DType::kF8E4M3, {kE4M3Two}, {1, 1});
  const Tensor w = dequant_nvfp4_ref(p, s, 0.25f);
  ASSERT_EQ(w.shape(), (Shape{1, 16}));
  const float* wp = w.data<float>();
  EXPECT_EQ(wp[0], 0.25f);
  EXPECT_EQ(wp[1], 0.5f);
  EXPECT_EQ(wp[2], 3.0f);
  EXPECT_EQ(wp[3], -3.0f);
  EXPECT_EQ(wp[14], -0.5f);
  EXPECT_EQ(wp[15], -0.25f);
  for (int k = 4; k < 14; ++k) EXPECT_EQ(wp[k], 0.0f) << k;
  // The same bytes typed as packed e2m1 (F4 [N, K]) decode identically.
  const Tensor f4 = u8_tensor(DType::kE2M1x2, packed, {1, 16});
  const Tensor w2 = dequant_nvfp4_ref(f4, s, 0.25f);
  for (int k = 0; k < 16; ++k) EXPECT_EQ(w2.data<float>()[k], wp[k]) << k;
}

TEST(QuantNvfp4, DequantUsesOneScalePer16Inputs) {
  // 2 rows x 32: all codes 2 (1.0); scales row 0 = {1, 2}, row 1 = {4, 0.5}; scale_2 = 3.
  std::vector<uint8_t> packed(2 * 16, 0x22);
  const Tensor p = u8_tensor(DType::kU8, packed, {2, 16});
  const Tensor s = u8_tensor(DType::kF8E4M3, {kE4M3One, kE4M3Two, 0x48 /*4*/, 0x30 /*0.5*/}, {2, 2});
  const Tensor w = dequant_nvfp4_ref(p, s, 3.0f);
  const float expected_scale[2][2] = {{1.0f, 2.0f}, {4.0f, 0.5f}};
  for (int n = 0; n < 2; ++n)
    for (int k = 0; k < 32; ++k) EXPECT_EQ(w.data<float>()[n * 32 + k], 3.0f * expected_scale[n][k / 16]);
}

TEST(QuantNvfp4, DequantRequiresKMultipleOf16) {
  const Tensor p = Tensor::zeros(DType::kU8, {2, 4});  // K = 8
  const Tensor s = Tensor::zeros(DType::kF8E4M3, {2, 1});
  const std::string msg = test::error_message([&] { dequant_nvfp4_ref(p, s, 1.0f); });
  EXPECT_NE(msg.find("K = 8"), std::string::npos) << msg;
  const std::string shape_msg = test::error_message([&] {
    dequant_nvfp4_ref(Tensor::zeros(DType::kU8, {2, 16}), Tensor::zeros(DType::kF8E4M3, {2, 1}), 1.0f);
  });
  EXPECT_NE(shape_msg.find("[2, 2]"), std::string::npos) << shape_msg;
  const std::string q_msg = test::error_message([&] { quantize_nvfp4_ref(Tensor::zeros(DType::kF32, {3, 24})); });
  EXPECT_NE(q_msg.find("K = 24"), std::string::npos) << q_msg;
}

// With amax = 2.625 = 6 * 448 * 2^-10, scale_2 is exactly 2^-10 and a block holding the amax gets
// the e4m3 scale 448, so one e2m1 unit is 448 * 2^-10 = 0.4375 and all arithmetic is exact.
constexpr float kNvfp4Unit = 0.4375f;

TEST(QuantNvfp4, QuantizeExactKnownCodes) {
  const std::vector<float> grid = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f, 0.0f};
  std::vector<float> v;
  for (float g : grid) v.push_back(g * kNvfp4Unit);
  const ops::Nvfp4Weight q = quantize_nvfp4_ref(Tensor::from_f32(v, {1, 16}));
  EXPECT_EQ(q.scale_2, std::ldexp(1.0f, -10));
  EXPECT_EQ(q.scale.data<uint8_t>()[0], kE4M3Max448);
  const std::vector<uint8_t> expected = {0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x0F};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(q.packed.data<uint8_t>()[i], expected[i]) << "byte " << i;
  const Tensor deq = dequant_nvfp4_ref(q.packed, q.scale, q.scale_2);
  for (int k = 0; k < 16; ++k) EXPECT_EQ(deq.data<float>()[k], v[k]) << k;
}

TEST(QuantNvfp4, QuantizeRoundsHalfwayToEvenCode) {
  // Midpoints: 0.25 (codes 0 | 1) -> 0; 0.75 (1 | 2) -> 2; 1.25 (2 | 3) -> 2; 1.75 (3 | 4) -> 4;
  // 2.5 (4 | 5) -> 4; 3.5 (5 | 6) -> 6; 5 (6 | 7) -> 6; negative midpoints mirror with the sign
  // bit; just above a midpoint rounds up.
  const std::vector<std::pair<float, int>> cases = {{0.25f, 0}, {0.75f, 2},    {1.25f, 2},
                                                    {1.75f, 4}, {2.5f, 4},     {3.5f, 6},
                                                    {5.0f, 6},  {-1.25f, 0xA}, {-5.0f, 0xE}};
  std::vector<float> v(16, 0.0f);
  v[0] = 6.0f * kNvfp4Unit;  // the amax
  for (size_t i = 0; i < cases.size(); ++i) v[1 + i] = cases[i].first * kNvfp4Unit;
  v[15] = std::nextafter(0.25f * kNvfp4Unit, 1.0f);
  const ops::Nvfp4Weight q = quantize_nvfp4_ref(Tensor::from_f32(v, {1, 16}));
  ASSERT_EQ(q.scale_2, std::ldexp(1.0f, -10));
  ASSERT_EQ(q.scale.data<uint8_t>()[0], kE4M3Max448);
  auto code = [&](int k) {
    const uint8_t b = q.packed.data<uint8_t>()[k / 2];
    return (k % 2 == 0) ? (b & 0xf) : (b >> 4);
  };
  EXPECT_EQ(code(0), 7);
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(code(1 + i), cases[i].second) << cases[i].first;
  EXPECT_EQ(code(15), 1);
}

TEST(QuantNvfp4, QuantizeErrorWithinHalfAStep) {
  std::mt19937_64 rng(test::test_seed(13));
  const int64_t rows = 9, cols = 80;
  Tensor w = test::random_normal({rows, cols}, rng, 1.0f);
  float* wp = w.data<float>();
  for (int64_t k = 16; k < 32; ++k) wp[2 * cols + k] = 0.0f;    // a zero block
  for (int64_t k = 32; k < 48; ++k) wp[4 * cols + k] *= 1e-2f;  // a small block
  const ops::Nvfp4Weight q = quantize_nvfp4_ref(w);
  float amax = 0;
  for (int64_t i = 0; i < w.numel(); ++i) amax = std::max(amax, std::fabs(wp[i]));
  EXPECT_EQ(q.scale_2, amax / 2688.0f);
  ASSERT_EQ(q.scale.shape(), (Shape{rows, cols / 16}));
  EXPECT_EQ(q.scale.data<uint8_t>()[2 * 5 + 1], 0);  // zero block: scale 0
  const Tensor deq = dequant_nvfp4_ref(q.packed, q.scale, q.scale_2);
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t g = 0; g < cols / 16; ++g) {
      const float block_scale = e4m3_to_f32(q.scale.data<uint8_t>()[n * 5 + g]);
      float block_amax = 0;
      for (int64_t k = g * 16; k < g * 16 + 16; ++k)
        block_amax = std::max(block_amax, std::fabs(wp[n * cols + k]));
      // The block scale is the e4m3 rounding of amax16 / (6 scale_2): within 2^-4 relative.
      EXPECT_NEAR(block_scale, block_amax / (6.0f * q.scale_2), block_amax / (6.0f * q.scale_2) / 16 + 1e-6)
          << "row " << n << " block " << g;
      const double unit = double(block_scale) * q.scale_2;
      for (int64_t k = g * 16; k < g * 16 + 16; ++k) {
        const double x = wp[n * cols + k], d = deq.data<float>()[n * cols + k];
        if (unit == 0) {
          ASSERT_EQ(d, 0.0) << "zero block at [" << n << ", " << k << "]";
          continue;
        }
        // e2m1 grid spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; saturation beyond 6 (the
        // block scale may round down) adds the overshoot.
        const double scaled = std::fabs(x) / unit;
        const double half_step = scaled < 2 ? 0.25 : scaled < 4 ? 0.5 : 1.0;
        const double bound = (half_step + std::max(0.0, scaled - 6.0)) * unit;
        ASSERT_LE(std::fabs(d - x), bound * (1 + 1e-5)) << "at [" << n << ", " << k << "]";
      }
    }
  }
}

TEST(QuantNvfp4, AllZeroTensor) {
  const ops::Nvfp4Weight q = quantize_nvfp4_ref(Tensor::zeros(DType::kF32, {2, 32}));
  EXPECT_EQ(q.scale_2, 0.0f);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(q.scale.data<uint8_t>()[i], 0);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(q.packed.data<uint8_t>()[i], 0);
}

}  // namespace
}  // namespace moelora
