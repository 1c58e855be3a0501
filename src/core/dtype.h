// Element types and exact scalar conversions.
//
// Storage dtypes follow the safetensors names. Compute in the CPU reference is fp32; the
// conversions below are bit-exact with PyTorch / ml_dtypes:
//   bf16, fp16 <- fp32: round to nearest even, NaN stays NaN (quiet), overflow -> Inf.
//   f8e4m3 (OCP e4m3fn: bias 7, max 448, NaN = S.1111.111, no Inf) <- fp32: round to nearest
//     even; |x| > 448 either saturates to +-448 (kSaturate, what quantizers want) or becomes NaN
//     (kNanOnOverflow, what torch's .to(float8_e4m3fn) does).
//   e2m1 (4-bit: sign, 2 exponent bits with bias 1, 1 mantissa bit; values 0, .5, 1, 1.5, 2, 3,
//     4, 6) <- fp32: round to nearest even, saturating at 6. Packed two per byte, the low nibble
//     holding the even element.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

namespace moelora {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kI32,
  kU32,
  kI64,
  kU64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,  // OCP e4m3fn
  kF8E5M2,
  kF8E8M0,  // power-of-two scales (ue8m0)
  kE2M1x2,  // two packed e2m1 values per byte (safetensors "F4")
};

// Size in bits of one element (4 for the packed e2m1 type).
int dtype_bits(DType t);
// Bytes needed for `numel` elements (rounded up for sub-byte types). Throws on overflow.
uint64_t dtype_bytes(DType t, uint64_t numel);
// The safetensors dtype string ("BF16", "F8_E4M3", "F4", ...).
std::string_view dtype_name(DType t);
// Parses a safetensors dtype string; nullopt for names moelora does not know.
std::optional<DType> dtype_from_name(std::string_view name);
// Comma-separated list of every accepted name, for error messages.
std::string dtype_all_names();
bool dtype_is_float(DType t);

// ---- scalar conversions (inline: they sit in hot CPU loops) ----

inline float bf16_bits_to_f32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

inline uint16_t f32_to_bf16_bits(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// fp32 value rounded to the nearest bf16 (returned as fp32).
inline float round_to_bf16(float value) { return bf16_bits_to_f32(f32_to_bf16_bits(value)); }

float f16_bits_to_f32(uint16_t bits);
uint16_t f32_to_f16_bits(float value);

// All 256 e4m3 codes decode exactly; 0x7f / 0xff are NaN.
float e4m3_to_f32(uint8_t code);
enum class Fp8Overflow { kSaturate, kNanOnOverflow };
uint8_t f32_to_e4m3(float value, Fp8Overflow overflow = Fp8Overflow::kSaturate);

float e5m2_to_f32(uint8_t code);
// e8m0: 2^(code - 127); 0xff is NaN.
float e8m0_to_f32(uint8_t code);

inline constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
inline float e2m1_to_f32(uint8_t code) { return kE2M1Values[code & 0xf]; }
// Round to nearest e2m1 (ties to the even code), saturating at +-6. NaN maps to +0... never
// produced by the quantizers, which check for finite input first.
uint8_t f32_to_e2m1(float value);

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE2M1Max = 6.0f;

// Reads element i of a buffer of dtype t as fp32 (every float and integer dtype; e2m1x2 unpacks).
float load_as_f32(const void* data, DType t, uint64_t i);
// Writes fp32 value v as element i of a buffer of dtype t (float dtypes, I32, U8 for small ints).
void store_from_f32(void* data, DType t, uint64_t i, float v);

}  // namespace moelora
