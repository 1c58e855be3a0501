// The W4A8 decode image of NVFP4 experts, CPU side (ops/gemm/moe_gemm_nvfp4.h; the kernel is
// moe_gemm_nvfp4_w4a8_cuda.cu; its e4m3 activation rows are beside the f16 ones in
// moe_gemm_nvfp4_ref.cpp).
#include <algorithm>

#include "core/threads.h"
#include "ops/gemm/moe_gemm_nvfp4.h"

namespace moelora::ops {

namespace {

constexpr int64_t kGroup = 16;

// Where the code of (row, k) of a (tile, block) lives in the W4A8 image's code bytes: its 32-bit
// word and the bits of its sign, two exponent bits and mantissa bit inside the word.
struct W4a8Slot {
  int64_t word;
  int sign, exponent_high, exponent_low, mantissa;
};
W4a8Slot w4a8_slot(int64_t row, int64_t k) {
  const int64_t warp = row / 16, r = row % 8, upper = (row % 16) / 8;  // upper: row + 8 of the pair
  const int64_t group = k / kGroup, c = (k % kGroup) / 4, j = (k % kGroup) % 4;
  const int64_t thread = warp * 32 + r * 4 + c;
  const int64_t word = (group / 4) * 512 + thread * 4 + group % 4;
  const int byte = static_cast<int>(8 * j);
  if (upper == 0) return {word, byte + 7, byte + 4, byte + 3, byte + 2};
  const int before = static_cast<int>(8 * ((j + 3) % 4));  // byte j - 1, cyclically
  return {word, byte + 1, before + 6, before + 5, byte};
}
// e2m1 code: bit 3 sign, bits 2-1 exponent, bit 0 mantissa.
uint32_t place_w4a8(uint32_t code, const W4a8Slot& s) {
  return ((code >> 3 & 1u) << s.sign) | ((code >> 2 & 1u) << s.exponent_high) |
         ((code >> 1 & 1u) << s.exponent_low) | ((code & 1u) << s.mantissa);
}
uint32_t take_w4a8(uint32_t word, const W4a8Slot& s) {
  return ((word >> s.sign & 1u) << 3) | ((word >> s.exponent_high & 1u) << 2) |
         ((word >> s.exponent_low & 1u) << 1) | (word >> s.mantissa & 1u);
}

}  // namespace

Tensor pack_nvfp4_for_w4a8(const Tensor& packed, const Tensor& scale) {
  // The stream image checks every argument and lays out the scales as this image does; only the
  // code words move.
  Tensor image = pack_nvfp4_for_stream(packed, scale);
  const int64_t E = packed.dim(0), N = packed.dim(1), K = packed.dim(2) * 2;
  const int64_t tiles = N / kNvfp4StreamRows, blocks = K / kNvfp4StreamK;
  const uint8_t* codes = packed.data<uint8_t>();
  uint8_t* out = image.data<uint8_t>();
  parallel_for(E * tiles, [&](int64_t lo, int64_t hi) {
    for (int64_t et = lo; et < hi; ++et) {
      const int64_t e = et / tiles, tile = et % tiles;
      for (int64_t b = 0; b < blocks; ++b) {
        uint32_t* words =
            reinterpret_cast<uint32_t*>(out + (et * blocks + b) * kNvfp4StreamBlockBytes);
        std::fill(words, words + kNvfp4StreamCodeBytes / 4, 0u);
        for (int64_t row = 0; row < kNvfp4StreamRows; ++row) {
          const uint8_t* src =
              codes + (e * N + tile * kNvfp4StreamRows + row) * (K / 2) + b * (kNvfp4StreamK / 2);
          for (int64_t k = 0; k < kNvfp4StreamK; ++k) {
            const W4a8Slot slot = w4a8_slot(row, k);
            words[slot.word] |= place_w4a8((src[k / 2] >> (4 * (k % 2))) & 0xfu, slot);
          }
        }
      }
    }
  });
  return image;
}

Nvfp4Experts unpack_nvfp4_from_w4a8(const Tensor& image, int64_t n, int64_t k) {
  // The stream image's inverse checks the image and reads the scales (laid out alike); only the
  // codes are read again from this image's words.
  Nvfp4Experts w = unpack_nvfp4_from_stream(image, n, k);
  std::fill(w.packed.data<uint8_t>(), w.packed.data<uint8_t>() + w.packed.numel(), uint8_t{0});
  const int64_t E = image.dim(0), tiles = n / kNvfp4StreamRows, blocks = k / kNvfp4StreamK;
  const uint8_t* in = image.data<uint8_t>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(
            in + ((e * tiles + t) * blocks + b) * kNvfp4StreamBlockBytes);
        for (int64_t row = 0; row < kNvfp4StreamRows; ++row) {
          uint8_t* dst = w.packed.data<uint8_t>() + (e * n + t * kNvfp4StreamRows + row) * (k / 2) +
                         b * (kNvfp4StreamK / 2);
          for (int64_t kk = 0; kk < kNvfp4StreamK; ++kk) {
            const W4a8Slot slot = w4a8_slot(row, kk);
            dst[kk / 2] |=
                static_cast<uint8_t>(take_w4a8(words[slot.word], slot) << (4 * (kk % 2)));
          }
        }
      }
  return w;
}

}  // namespace moelora::ops
