#include "core/dtype.h"

#include <array>

#include "core/error.h"

namespace moelora {

namespace {
struct DTypeInfo {
  DType type;
  std::string_view name;
  int bits;
  bool is_float;
};
constexpr std::array<DTypeInfo, 17> kDTypes = {{
    {DType::kBool, "BOOL", 8, false},
    {DType::kU8, "U8", 8, false},
    {DType::kI8, "I8", 8, false},
    {DType::kI16, "I16", 16, false},
    {DType::kU16, "U16", 16, false},
    {DType::kI32, "I32", 32, false},
    {DType::kU32, "U32", 32, false},
    {DType::kI64, "I64", 64, false},
    {DType::kU64, "U64", 64, false},
    {DType::kF16, "F16", 16, true},
    {DType::kBF16, "BF16", 16, true},
    {DType::kF32, "F32", 32, true},
    {DType::kF64, "F64", 64, true},
    {DType::kF8E4M3, "F8_E4M3", 8, true},
    {DType::kF8E5M2, "F8_E5M2", 8, true},
    {DType::kF8E8M0, "F8_E8M0", 8, true},
    {DType::kE2M1x2, "F4", 4, true},
}};

const DTypeInfo& info(DType t) {
  for (const auto& i : kDTypes)
    if (i.type == t) return i;
  MOELORA_THROW(ErrorCode::kInternal, "unknown DType value ", static_cast<int>(t));
}
}  // namespace

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kInvalidFile: return "invalid file";
    case ErrorCode::kNotFound: return "not found";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kOutOfRange: return "out of range";
    case ErrorCode::kCuda: return "CUDA error";
    case ErrorCode::kInternal: return "internal error";
  }
  return "error";
}

int dtype_bits(DType t) { return info(t).bits; }
bool dtype_is_float(DType t) { return info(t).is_float; }
std::string_view dtype_name(DType t) { return info(t).name; }

uint64_t dtype_bytes(DType t, uint64_t numel) {
  const uint64_t bits = static_cast<uint64_t>(dtype_bits(t));
  MOELORA_CHECK(numel <= std::numeric_limits<uint64_t>::max() / bits, ErrorCode::kOutOfRange,
                "tensor byte size overflows: ", numel, " elements of ", dtype_name(t));
  return (numel * bits + 7) / 8;
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& i : kDTypes)
    if (i.name == name) return i.type;
  return std::nullopt;
}

std::string dtype_all_names() {
  std::string out;
  for (const auto& i : kDTypes) {
    if (!out.empty()) out += ", ";
    out += i.name;
  }
  return out;
}

float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // zero or subnormal: mantissa * 2^-24, exact in fp32
    float v = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -v : v;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t f32_to_f16_bits(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: Inf
  if (u < 0x38800000u) {
    // result is subnormal or zero: value * 2^24 rounded to an integer, nearest even
    float a = std::bit_cast<float>(u);
    float scaled = a * 16777216.0f;  // exact (power-of-two scaling of a small value)
    float r = std::nearbyint(scaled);  // default rounding mode: nearest even
    return sign | static_cast<uint16_t>(r);
  }
  // normal: keep 10 mantissa bits, round to nearest even on the 13 dropped bits
  uint32_t rounded = u + 0xfffu + ((u >> 13) & 1u);
  return sign | static_cast<uint16_t>(((rounded >> 13) - (112u << 10)) & 0x7fffu);
}

float e4m3_to_f32(uint8_t code) {
  const bool negative = code & 0x80u;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  float v;
  if (exponent == 0xf && mantissa == 0x7) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    v = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
  } else {
    v = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  }
  return negative ? -v : v;
}

uint8_t f32_to_e4m3(float value, Fp8Overflow overflow) {
  const uint8_t sign = std::signbit(value) ? 0x80u : 0x00u;
  if (std::isnan(value)) return 0x7fu | sign;
  float a = std::fabs(value);
  if (a > kE4M3Max) {
    // Values up to 464 round to 448 in both modes: 464 = 448 + half an ulp is the midpoint to
    // the next (NaN) code and ties to even (448 has mantissa 110). Above it torch gives NaN.
    if (overflow == Fp8Overflow::kNanOnOverflow && a > 464.0f) return 0x7fu | sign;
    return 0x7eu | sign;
  }
  // Smallest normal is 2^-6. Below it the spacing is 2^-9 (subnormals).
  int exponent;
  std::frexp(a, &exponent);  // a = f * 2^exponent, f in [0.5, 1)
  int e = exponent - 1;      // a = 1.x * 2^e
  if (e < -6) e = -6;
  // quantum at this binade: 2^(e-3)
  float quantum = std::ldexp(1.0f, e - 3);
  float q = std::nearbyint(a / quantum);  // exact division by a power of two; RNE
  float r = q * quantum;
  if (r == 0.0f) return sign;
  int re;
  std::frexp(r, &re);
  int biased = (re - 1) + 7;
  if (biased <= 0) {  // subnormal
    return sign | static_cast<uint8_t>(std::nearbyint(r / std::ldexp(1.0f, -9)));
  }
  float mant = r / std::ldexp(1.0f, re - 1) - 1.0f;  // in [0, 1)
  uint8_t m = static_cast<uint8_t>(std::nearbyint(mant * 8.0f));
  return sign | static_cast<uint8_t>(biased << 3) | m;
}

float e5m2_to_f32(uint8_t code) {
  return f16_bits_to_f32(static_cast<uint16_t>(code) << 8);
}

float e8m0_to_f32(uint8_t code) {
  if (code == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

uint8_t f32_to_e2m1(float value) {
  const uint8_t sign = std::signbit(value) ? 0x8u : 0x0u;
  float a = std::fabs(value);
  if (std::isnan(a)) return 0;
  // magnitude codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; midpoints with ties to the even code
  static constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint8_t code = 0;
  while (code < 7 && a > kMid[code]) ++code;
  // exactly on a midpoint: `a > mid` kept the lower code; move up if the upper code is even
  if (code < 7 && a == kMid[code] && ((code + 1) % 2 == 0)) ++code;
  return sign | code;
}

float load_as_f32(const void* data, DType t, uint64_t i) {
  const auto* b = static_cast<const uint8_t*>(data);
  switch (t) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, b + 4 * i, 4);
      return v;
    }
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, b + 2 * i, 2);
      return bf16_bits_to_f32(v);
    }
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, b + 2 * i, 2);
      return f16_bits_to_f32(v);
    }
    case DType::kF64: {
      double v;
      std::memcpy(&v, b + 8 * i, 8);
      return static_cast<float>(v);
    }
    case DType::kF8E4M3: return e4m3_to_f32(b[i]);
    case DType::kF8E5M2: return e5m2_to_f32(b[i]);
    case DType::kF8E8M0: return e8m0_to_f32(b[i]);
    case DType::kE2M1x2: return e2m1_to_f32((i & 1) ? (b[i / 2] >> 4) : (b[i / 2] & 0xf));
    case DType::kBool:
    case DType::kU8: return static_cast<float>(b[i]);
    case DType::kI8: return static_cast<float>(static_cast<int8_t>(b[i]));
    case DType::kI16: {
      int16_t v;
      std::memcpy(&v, b + 2 * i, 2);
      return static_cast<float>(v);
    }
    case DType::kU16: {
      uint16_t v;
      std::memcpy(&v, b + 2 * i, 2);
      return static_cast<float>(v);
    }
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, b + 4 * i, 4);
      return static_cast<float>(v);
    }
    case DType::kU32: {
      uint32_t v;
      std::memcpy(&v, b + 4 * i, 4);
      return static_cast<float>(v);
    }
    case DType::kI64: {
      int64_t v;
      std::memcpy(&v, b + 8 * i, 8);
      return static_cast<float>(v);
    }
    case DType::kU64: {
      uint64_t v;
      std::memcpy(&v, b + 8 * i, 8);
      return static_cast<float>(v);
    }
  }
  MOELORA_THROW(ErrorCode::kInternal, "load_as_f32: unhandled dtype");
}

void store_from_f32(void* data, DType t, uint64_t i, float v) {
  auto* b = static_cast<uint8_t*>(data);
  switch (t) {
    case DType::kF32: std::memcpy(b + 4 * i, &v, 4); return;
    case DType::kBF16: {
      uint16_t h = f32_to_bf16_bits(v);
      std::memcpy(b + 2 * i, &h, 2);
      return;
    }
    case DType::kF16: {
      uint16_t h = f32_to_f16_bits(v);
      std::memcpy(b + 2 * i, &h, 2);
      return;
    }
    case DType::kF64: {
      double d = v;
      std::memcpy(b + 8 * i, &d, 8);
      return;
    }
    case DType::kF8E4M3: b[i] = f32_to_e4m3(v); return;
    case DType::kE2M1x2: {
      uint8_t code = f32_to_e2m1(v);
      uint8_t& byte = b[i / 2];
      byte = (i & 1) ? static_cast<uint8_t>((byte & 0x0f) | (code << 4))
                     : static_cast<uint8_t>((byte & 0xf0) | code);
      return;
    }
    case DType::kU8: b[i] = static_cast<uint8_t>(v); return;
    case DType::kI32: {
      int32_t x = static_cast<int32_t>(v);
      std::memcpy(b + 4 * i, &x, 4);
      return;
    }
    case DType::kI64: {
      int64_t x = static_cast<int64_t>(v);
      std::memcpy(b + 8 * i, &x, 8);
      return;
    }
    default:
      MOELORA_THROW(ErrorCode::kUnsupported, "cannot store fp32 values as ", dtype_name(t));
  }
}

}  // namespace moelora
