// Exactness of the scalar conversions in core/dtype.h: every e4m3 and e2m1 code, bf16 and fp16
// round-to-nearest-even, NaN and Inf handling, safetensors dtype names.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "core/dtype.h"
#include "core/tensor.h"

namespace moelora {
namespace {

// Independent e4m3fn decoder written from the format definition (OCP FP8, e4m3fn variant).
double e4m3_reference(int code) {
  const int s = (code >> 7) & 1, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  double mag = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -mag : mag;
}

TEST(DTypeE4M3, AllCodesDecodeExactly) {
  int nan_count = 0;
  for (int code = 0; code < 256; ++code) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(code));
    const double ref = e4m3_reference(code);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(v)) << "code " << code;
      ++nan_count;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), ref) << "code " << code;
    EXPECT_EQ(std::signbit(v), (code & 0x80) != 0) << "code " << code;
  }
  EXPECT_EQ(nan_count, 2);  // 0x7f and 0xff
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
}

TEST(DTypeE4M3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const float v = e4m3_to_f32(static_cast<uint8_t>(code));
    EXPECT_EQ(f32_to_e4m3(v), code) << "value " << v;
  }
}

TEST(DTypeE4M3, RoundsToNearestEvenBetweenEveryPairOfCodes) {
  // Midpoint between consecutive positive codes c and c+1 ties to the even code; just above
  // goes up, just below goes down.
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = e4m3_to_f32(static_cast<uint8_t>(code));
    const float hi = e4m3_to_f32(static_cast<uint8_t>(code + 1));
    const float mid = (lo + hi) / 2;  // exact in fp32
    const int even = (code % 2 == 0) ? code : code + 1;
    EXPECT_EQ(f32_to_e4m3(mid), even) << "midpoint " << mid;
    EXPECT_EQ(f32_to_e4m3(std::nextafter(mid, 1e9f)), code + 1) << "above " << mid;
    EXPECT_EQ(f32_to_e4m3(std::nextafter(mid, -1e9f)), code) << "below " << mid;
    EXPECT_EQ(f32_to_e4m3(-mid), even | 0x80) << "negative midpoint " << -mid;
  }
}

TEST(DTypeE4M3, OverflowNanAndInf) {
  EXPECT_EQ(f32_to_e4m3(1e6f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-1e6f), 0xfe);
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(f32_to_e4m3(464.0f, Fp8Overflow::kNanOnOverflow), 0x7e);  // tie to even -> 448
  EXPECT_EQ(f32_to_e4m3(465.0f, Fp8Overflow::kNanOnOverflow), 0x7f);
  EXPECT_EQ(f32_to_e4m3(-std::numeric_limits<float>::infinity(), Fp8Overflow::kNanOnOverflow), 0xff);
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest subnormal
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
}

TEST(DTypeE2M1, AllSixteenCodes) {
  const float expected[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int code = 0; code < 16; ++code) {
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(code)), expected[code]) << code;
    EXPECT_EQ(std::signbit(e2m1_to_f32(static_cast<uint8_t>(code))), code >= 8) << code;
    EXPECT_EQ(f32_to_e2m1(expected[code]), code) << code;
  }
}

TEST(DTypeE2M1, RoundsToNearestEvenAndSaturates) {
  // midpoints: 0.25 -> 0 (code 0 even), 0.75 -> 1.0 (code 2), 1.25 -> 1.0 (code 2),
  // 1.75 -> 2.0 (code 4), 2.5 -> 2.0 (code 4), 3.5 -> 4.0 (code 6), 5.0 -> 4.0 (code 6)
  EXPECT_EQ(f32_to_e2m1(0.25f), 0);
  EXPECT_EQ(f32_to_e2m1(0.75f), 2);
  EXPECT_EQ(f32_to_e2m1(1.25f), 2);
  EXPECT_EQ(f32_to_e2m1(1.75f), 4);
  EXPECT_EQ(f32_to_e2m1(2.5f), 4);
  EXPECT_EQ(f32_to_e2m1(3.5f), 6);
  EXPECT_EQ(f32_to_e2m1(5.0f), 6);
  EXPECT_EQ(f32_to_e2m1(5.01f), 7);
  EXPECT_EQ(f32_to_e2m1(0.26f), 1);
  EXPECT_EQ(f32_to_e2m1(100.0f), 7);
  EXPECT_EQ(f32_to_e2m1(-100.0f), 15);
  EXPECT_EQ(f32_to_e2m1(-2.5f), 12);
}

TEST(DTypeE2M1, PackedLowNibbleIsEvenElement) {
  Tensor t = Tensor::zeros(DType::kE2M1x2, {1, 4});
  EXPECT_EQ(t.nbytes(), 2u);
  store_from_f32(t.raw_data(), DType::kE2M1x2, 0, 1.0f);   // code 2
  store_from_f32(t.raw_data(), DType::kE2M1x2, 1, -6.0f);  // code 15
  EXPECT_EQ(t.data<uint8_t>()[0], 0xF2);
  EXPECT_EQ(t.item_f32(0), 1.0f);
  EXPECT_EQ(t.item_f32(1), -6.0f);
}

TEST(DTypeBF16, RoundToNearestEven) {
  // 1 + 2^-8 is exactly between bf16 1.0 and 1 + 2^-7: ties to even (1.0)
  EXPECT_EQ(f32_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 is between 1+2^-7 (odd mantissa) and 1+2^-6: ties to even (1 + 2^-6)
  EXPECT_EQ(f32_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(f32_to_bf16_bits(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  EXPECT_EQ(f32_to_bf16_bits(-2.0f), 0xc000);
  EXPECT_EQ(bf16_bits_to_f32(0x3f80), 1.0f);
  // exhaustive: every finite bf16 round-trips
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float v = bf16_bits_to_f32(static_cast<uint16_t>(b));
    if (std::isnan(v)) continue;
    ASSERT_EQ(f32_to_bf16_bits(v), b);
  }
}

TEST(DTypeBF16, NanInfAndOverflow) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f32_to_bf16_bits(inf), 0x7f80);
  EXPECT_EQ(f32_to_bf16_bits(-inf), 0xff80);
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
  // a signalling-style NaN whose payload sits in the low bits must stay NaN, not become Inf
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(std::bit_cast<float>(0x7f800001u)))));
  // the largest finite float rounds up to Inf
  EXPECT_EQ(f32_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(DTypeF16, ExhaustiveRoundTripAndRounding) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float v = f16_bits_to_f32(static_cast<uint16_t>(b));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(f16_bits_to_f32(f32_to_f16_bits(v))));
      continue;
    }
    ASSERT_EQ(f32_to_f16_bits(v), b) << "bits " << b;
  }
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7c00);  // rounds to Inf
  EXPECT_EQ(f32_to_f16_bits(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);           // tie to even (0)
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(3.0f, -25)), 0x0002);           // tie to even (2)
}

TEST(DTypeNames, SafetensorsNamesRoundTrip) {
  for (const char* name : {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32",
                           "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}) {
    auto t = dtype_from_name(name);
    ASSERT_TRUE(t.has_value()) << name;
    EXPECT_EQ(dtype_name(*t), name);
  }
  EXPECT_FALSE(dtype_from_name("F8_E4M3FNUZ").has_value());
  EXPECT_FALSE(dtype_from_name("bf16").has_value());
  EXPECT_EQ(dtype_bytes(DType::kE2M1x2, 7), 4u);
  EXPECT_EQ(dtype_bytes(DType::kBF16, 7), 14u);
  EXPECT_THROW(dtype_bytes(DType::kF64, std::numeric_limits<uint64_t>::max() / 4), Error);
}

TEST(Tensor, ReshapeSliceAndConvert) {
  Tensor t = Tensor::from_f32({1, 2, 3, 4, 5, 6}, {3, 2});
  EXPECT_EQ(t.reshape({2, -1}).shape(), (Shape{2, 3}));
  EXPECT_THROW(t.reshape({4, 2}), Error);
  Tensor row = t.select0(1);
  EXPECT_EQ(row.shape(), (Shape{2}));
  EXPECT_EQ(row.item_f32(0), 3.0f);
  Tensor b = t.to(DType::kBF16);
  EXPECT_EQ(b.nbytes(), 12u);
  EXPECT_EQ(b.to_f32().item_f32(5), 6.0f);
  EXPECT_THROW(t.data<int32_t>(), Error);
  EXPECT_THROW(t.slice0(2, 4), Error);
}

}  // namespace
}  // namespace moelora
