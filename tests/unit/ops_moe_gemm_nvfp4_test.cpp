// The NVFP4 expert GEMM's CPU side (ops/gemm/moe_gemm_nvfp4.h): the reference against the
// dequantized weights, the stream kernel's weight image (where each code and scale lands, the
// round trip, refusals) and the f16 activation rows with power-of-two row scales; the W4A8 decode
// image (every code expands to its e4m3 fragment byte with the kernel's five ops) and the e4m3
// activation rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/dtype.h"
#include "ops/gemm/moe_gemm_nvfp4.h"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora {
namespace {

// Random NVFP4 experts: codes uniform over all 16, scales uniform over the positive e4m3 numbers
// (subnormals and zero included).
ops::Nvfp4Experts random_experts(int64_t E, int64_t N, int64_t K, std::mt19937_64& rng) {
  ops::Nvfp4Experts w{Tensor::empty(DType::kU8, {E, N, K / 2}), Tensor::empty(DType::kF8E4M3, {E, N, K / 16})};
  std::uniform_int_distribution<int> byte(0, 255), scale(0, 0x7e);
  for (int64_t i = 0; i < w.packed.numel(); ++i) w.packed.data<uint8_t>()[i] = static_cast<uint8_t>(byte(rng));
  for (int64_t i = 0; i < w.scale.numel(); ++i) w.scale.data<uint8_t>()[i] = static_cast<uint8_t>(scale(rng));
  return w;
}

TEST(MoeGemmNvfp4Layout, CodesAndScalesLandWhereTheConsumerThreadsReadThem) {
  // One nonzero code / scale at a time: (row, k) -> thread 32 (row / 16) + 4 (row % 8) + (k % 8) / 2,
  // step k / 16, register a_i (i = 2 (k % 16 >= 8) + (row % 16 >= 8)), half k % 2. Code 0x9 (-0.5:
  // sign and magnitude 1) sets the sign bit 15 - i and the magnitude bit 9 - 3 i of that half.
  const int64_t E = 2, N = 128, K = 256;
  struct Case {
    int64_t e, n, k;
    int64_t word;   // 32-bit word index inside the block
    uint32_t bits;  // the word's value
  };
  auto block_of = [&](int64_t e, int64_t n, int64_t k) { return (e * (N / 64) + n / 64) * (K / 128) + k / 128; };
  const Case cases[] = {
      {0, 0, 0, 0, 0x8200u},                                   // thread 0, step 0, a0 low
      {0, 0, 1, 0, 0x82000000u},                               // a0 high
      {0, 8, 0, 0, 0x4040u},                                   // row + 8: a1
      {0, 0, 8, 0, 0x2008u},                                   // k + 8: a2
      {0, 8, 9, 0, 0x10010000u},                               // row + 8, k + 9: a3 high
      {0, 3, 6, (3 * 4 + 3) * 4, 0x8200u},                     // thread 15, step 0
      {0, 16, 16, (32) * 4 + 1, 0x8200u},                      // warp 1, step 1
      {1, 64 + 63, 128 + 127, (128 + 127) * 4 + 3, 0x10010000u},  // last row, last column: thread 127, step 7
  };
  for (const Case& c : cases) {
    ops::Nvfp4Experts w{Tensor::zeros(DType::kU8, {E, N, K / 2}), Tensor::zeros(DType::kF8E4M3, {E, N, K / 16})};
    w.packed.data<uint8_t>()[(c.e * N + c.n) * (K / 2) + c.k / 2] = static_cast<uint8_t>(0x9 << (4 * (c.k % 2)));
    w.scale.data<uint8_t>()[(c.e * N + c.n) * (K / 16) + c.k / 16] = 0x38;
    const Tensor image = ops::pack_nvfp4_for_stream(w.packed, w.scale);
    const uint8_t* block = image.data<uint8_t>() + block_of(c.e, c.n, c.k) * ops::kNvfp4StreamBlockBytes;
    uint32_t word = 0;
    std::memcpy(&word, block + 4 * c.word, 4);
    EXPECT_EQ(word, c.bits) << "code (" << c.e << ", " << c.n << ", " << c.k << ")";
    int bits_set = 0;
    for (int64_t i = 0; i < image.numel(); ++i) bits_set += __builtin_popcount(image.data<uint8_t>()[i]);
    EXPECT_EQ(bits_set, 2 + 3) << "the code's two bits and the scale 0x38, nothing else";
    const int64_t row = c.n % 64, step = (c.k % 128) / 16;
    const int64_t scale_byte = ((row / 16) * 8 + row % 8) * 16 + 2 * step + (row % 16) / 8;
    EXPECT_EQ(block[ops::kNvfp4StreamCodeBytes + scale_byte], 0x38) << "scale of (" << c.n << ", " << c.k << ")";
  }
}

TEST(MoeGemmNvfp4Layout, PackThenUnpackIsTheIdentity) {
  std::mt19937_64 rng(test::test_seed(71));
  const ops::Nvfp4Experts w = random_experts(3, 192, 384, rng);
  const Tensor image = ops::pack_nvfp4_for_stream(w.packed, w.scale);
  EXPECT_EQ(image.shape(), (Shape{3, 3, 3, ops::kNvfp4StreamBlockBytes}));
  const ops::Nvfp4Experts back = ops::unpack_nvfp4_from_stream(image, 192, 384);
  EXPECT_EQ(std::memcmp(back.packed.raw_data(), w.packed.raw_data(), w.packed.nbytes()), 0);
  EXPECT_EQ(std::memcmp(back.scale.raw_data(), w.scale.raw_data(), w.scale.nbytes()), 0);
}

TEST(MoeGemmNvfp4Layout, RefusesShapesAndScalesTheKernelCannotTake) {
  std::mt19937_64 rng(test::test_seed(72));
  const ops::Nvfp4Experts odd_n = random_experts(1, 96, 128, rng);
  EXPECT_THROW(
      {
        try {
          ops::pack_nvfp4_for_stream(odd_n.packed, odd_n.scale);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("N = 96"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  const ops::Nvfp4Experts odd_k = random_experts(1, 64, 144, rng);
  EXPECT_THROW(ops::pack_nvfp4_for_stream(odd_k.packed, odd_k.scale), Error);
  ops::Nvfp4Experts negative = random_experts(1, 64, 128, rng);
  negative.scale.data<uint8_t>()[5] = 0xb8;  // -1.0
  EXPECT_THROW(
      {
        try {
          ops::pack_nvfp4_for_stream(negative.packed, negative.scale);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("[0, 0, 5]"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  ops::Nvfp4Experts wrong_scale = random_experts(1, 64, 128, rng);
  EXPECT_THROW(ops::pack_nvfp4_for_stream(wrong_scale.packed, wrong_scale.scale.slice0(0, 1).to(DType::kU8)), Error);
}

TEST(MoeGemmNvfp4Ref, MatchesTheDequantizedWeightsTimesTheRowScale) {
  std::mt19937_64 rng(test::test_seed(73));
  const int64_t E = 3, N = 64, K = 128;
  // ModelOpt-quantized experts: gate and up halves with their own scale_2, as a fused gate_up has.
  ops::MoeGemmNvfp4Ref ref;
  ref.packed = Tensor::empty(DType::kU8, {E, N, K / 2});
  ref.scale = Tensor::empty(DType::kF8E4M3, {E, N, K / 16});
  ref.row_scale = Tensor::empty(DType::kF32, {E, N});
  std::vector<Tensor> dense;
  for (int64_t e = 0; e < E; ++e) {
    Tensor w = Tensor::empty(DType::kF32, {N, K});
    for (int64_t half = 0; half < 2; ++half) {
      const Tensor part = test::random_normal({N / 2, K}, rng, 0.02f * static_cast<float>(1 + 3 * half));
      const ops::Nvfp4Weight q = ops::quantize_nvfp4_ref(part);
      const int64_t row0 = e * N + half * (N / 2);
      std::memcpy(ref.packed.data<uint8_t>() + row0 * (K / 2), q.packed.raw_data(), q.packed.nbytes());
      std::memcpy(ref.scale.data<uint8_t>() + row0 * (K / 16), q.scale.raw_data(), q.scale.nbytes());
      for (int64_t n = 0; n < N / 2; ++n) ref.row_scale.data<float>()[row0 + n] = q.scale_2;
      const Tensor d = ops::dequant_nvfp4_ref(q.packed, q.scale, q.scale_2);
      std::memcpy(w.data<float>() + half * (N / 2) * K, d.raw_data(), d.nbytes());
    }
    dense.push_back(w);
  }
  ref.act = test::random_normal({5, K}, rng).to(DType::kBF16);
  ref.expert_offsets = {0, 2, 2, 5};
  ref.gather = {4, 0, 1, 1, 3};
  const Tensor got = ops::moe_gemm_nvfp4_ref(ref);
  ASSERT_EQ(got.shape(), (Shape{5, N}));
  const Tensor x = ref.act.to_f32();
  for (int64_t q = 0; q < 5; ++q) {
    const int64_t e = q < 2 ? 0 : 2;
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += static_cast<double>(x.data<float>()[ref.gather[q] * K + k]) * dense[e].data<float>()[n * K + k];
      EXPECT_NEAR(got.data<float>()[q * N + n], acc, 1e-6 * (1 + std::fabs(acc))) << q << ", " << n;
    }
  }
}

TEST(MoeGemmNvfp4Ref, F16RowsArePowerOfTwoScaledAndExactForBf16) {
  std::mt19937_64 rng(test::test_seed(74));
  Tensor x = test::random_normal({4, 64}, rng, 3.0f);
  for (int64_t k = 0; k < 64; ++k) x.data<float>()[1 * 64 + k] = 0.0f;           // a zero row
  x.data<float>()[2 * 64 + 7] = 70000.0f;                                         // past f16's range
  x.data<float>()[3 * 64 + 9] = 1e-20f;                                           // tiny next to O(1)
  x = x.to(DType::kBF16);
  const std::vector<int32_t> gather = {2, 1, 0, 3, 2};
  const ops::F16Rows rows = ops::rows_to_f16_pow2_ref(x, gather, 5);
  const Tensor xf = x.to_f32();
  for (int64_t q = 0; q < 5; ++q) {
    const float s = rows.scale.data<float>()[q];
    int exponent = 0;
    EXPECT_EQ(std::frexp(s, &exponent), 0.5f) << "row " << q << ": scale " << s << " is not a power of two";
    float amax = 0.0f;
    for (int64_t k = 0; k < 64; ++k) {
      const float v = f16_bits_to_f32(rows.rows.data<uint16_t>()[q * 64 + k]);
      amax = std::fmax(amax, std::fabs(v));
      const float want = xf.data<float>()[gather[q] * 64 + k];
      if (std::fabs(want) > 1e-6f) {
        EXPECT_EQ(v * s, want) << "row " << q << " col " << k;
      }
    }
    if (gather[q] == 1) {
      EXPECT_EQ(s, 1.0f);
      EXPECT_EQ(amax, 0.0f);
    } else {
      EXPECT_GE(amax, 8192.0f) << "row " << q;
      EXPECT_LT(amax, 16384.0f) << "row " << q;
    }
  }
  EXPECT_EQ(ops::f16_row_scale_for(1.0f), std::ldexp(1.0f, -13));
  EXPECT_EQ(ops::f16_row_scale_for(0.0f), 1.0f);
}

// The kernel's expansion of one W4A8 code word (moe_gemm_nvfp4.h): row r's and row r + 8's e4m3
// bytes.
std::pair<uint32_t, uint32_t> expand_w4a8_word(uint32_t q) {
  const uint32_t rotl6 = (q << 6) | (q >> 26);
  return {q & 0x9C9C9C9Cu, (rotl6 & 0x98989898u) | ((q << 2) & 0x04040404u)};
}

TEST(MoeGemmNvfp4W4a8Layout, EveryCodeExpandsToItsE4m3FragmentByte) {
  // Random experts; for every (row, column) of every block, the consumer thread's word of the
  // code's group, expanded as the kernel does, must hold the code's e4m3 byte at the position of
  // the wgmma m64nNk32 A fragment: thread 32 (row / 16) + 4 (row % 8) + (k % 16) / 4, register R0
  // (row % 16 < 8) or R1, byte k % 4; that byte reads as e2m1 * 2^-6.
  std::mt19937_64 rng(test::test_seed(75));
  const int64_t E = 2, N = 128, K = 256;
  const ops::Nvfp4Experts w = random_experts(E, N, K, rng);
  const Tensor image = ops::pack_nvfp4_for_w4a8(w.packed, w.scale);
  const Tensor stream = ops::pack_nvfp4_for_stream(w.packed, w.scale);
  int64_t checked = 0, wrong = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t block = (e * (N / 64) + n / 64) * (K / 128) + k / 128;
        const int64_t row = n % 64, col = k % 128, group = col / 16;
        const int64_t thread = 32 * (row / 16) + 4 * (row % 8) + (col % 16) / 4;
        uint32_t q = 0;
        std::memcpy(&q,
                    image.data<uint8_t>() + block * ops::kNvfp4StreamBlockBytes +
                        4 * ((group / 4) * 512 + thread * 4 + group % 4),
                    4);
        const auto [r0, r1] = expand_w4a8_word(q);
        const uint8_t byte = static_cast<uint8_t>(((row % 16) < 8 ? r0 : r1) >> (8 * (col % 4)));
        const uint32_t code =
            (w.packed.data<uint8_t>()[(e * N + n) * (K / 2) + k / 2] >> (4 * (k % 2))) & 0xfu;
        const bool ok =
            e4m3_to_f32(byte) == e2m1_to_f32(static_cast<uint8_t>(code)) * std::ldexp(1.0f, -6) &&
            byte == (((code >> 3) << 7) | ((code & 7u) << 2));
        wrong += !ok;
        ++checked;
      }
  EXPECT_EQ(wrong, 0) << "of " << checked << " codes";
  // the scales sit where the stream image has them
  for (int64_t b = 0; b < image.dim(0) * image.dim(1) * image.dim(2); ++b)
    ASSERT_EQ(
        std::memcmp(
            image.data<uint8_t>() + b * ops::kNvfp4StreamBlockBytes + ops::kNvfp4StreamCodeBytes,
            stream.data<uint8_t>() + b * ops::kNvfp4StreamBlockBytes + ops::kNvfp4StreamCodeBytes,
            ops::kNvfp4StreamScaleBytes),
        0)
        << "block " << b;
  const ops::Nvfp4Experts back = ops::unpack_nvfp4_from_w4a8(image, N, K);
  EXPECT_EQ(std::memcmp(back.packed.raw_data(), w.packed.raw_data(), w.packed.nbytes()), 0);
  EXPECT_EQ(std::memcmp(back.scale.raw_data(), w.scale.raw_data(), w.scale.nbytes()), 0);
  EXPECT_THROW(ops::pack_nvfp4_for_w4a8(w.packed.slice0(0, 1), w.scale), Error)
      << "scale of another shape";
  EXPECT_THROW(ops::unpack_nvfp4_from_w4a8(image, N, K + 128), Error);
}

TEST(MoeGemmNvfp4W4a8Ref, E4m3RowsArePowerOfTwoScaledAndRoundedToNearest) {
  std::mt19937_64 rng(test::test_seed(76));
  Tensor x = test::random_normal({5, 128}, rng, 3.0f);
  for (int64_t k = 0; k < 128; ++k) x.data<float>()[1 * 128 + k] = 0.0f;     // a zero row
  x.data<float>()[2 * 128 + 7] = 1e30f;                                      // huge beside O(1)
  for (int64_t k = 0; k < 128; ++k) x.data<float>()[3 * 128 + k] *= 1e-20f;  // tiny row
  x.data<float>()[4 * 128 + 5] = 448.0f;                                     // amax exactly 448
  x = x.to(DType::kBF16);
  const std::vector<int32_t> gather = {2, 1, 0, 3, 4, 0};
  const ops::E4m3Rows rows = ops::rows_to_e4m3_pow2_ref(x, gather, 6);
  ASSERT_EQ(rows.rows.shape(), (Shape{6, 128}));
  const Tensor xf = x.to_f32();
  const Tensor dequantized = ops::e4m3_rows_dequantized(rows);
  for (int64_t q = 0; q < 6; ++q) {
    const float s = rows.scale.data<float>()[q];
    int exponent = 0;
    EXPECT_EQ(std::frexp(s, &exponent), 0.5f)
        << "row " << q << ": scale " << s << " is not a power of two";
    float amax = 0.0f;
    for (int64_t k = 0; k < 128; ++k) {
      const float want = xf.data<float>()[gather[q] * 128 + k];
      const uint8_t byte = rows.rows.data<uint8_t>()[q * 128 + k];
      EXPECT_EQ(byte, f32_to_e4m3(want / s)) << "row " << q << " col " << k;
      amax = std::fmax(amax, std::fabs(e4m3_to_f32(byte)));
      EXPECT_EQ(dequantized.data<float>()[q * 128 + k], e4m3_to_f32(byte) * s);
      // nearest e4m3: within half a unit of the last place (2^-4 of the value) or, below e4m3's
      // normal range, half its subnormal step 2^-10
      const float scaled = want / s;
      EXPECT_LE(std::fabs(e4m3_to_f32(byte) - scaled),
                std::fmax(std::fabs(scaled) / 16, std::ldexp(1.0f, -10)))
          << "row " << q << " col " << k;
    }
    if (gather[q] == 1) {
      EXPECT_EQ(s, 1.0f);
      EXPECT_EQ(amax, 0.0f);
    } else {
      EXPECT_GT(amax, 224.0f) << "row " << q;
      EXPECT_LE(amax, 448.0f) << "row " << q;
    }
  }
  EXPECT_EQ(ops::e4m3_row_scale_for(448.0f), 1.0f);
  EXPECT_EQ(ops::e4m3_row_scale_for(449.0f), 2.0f);
  EXPECT_EQ(ops::e4m3_row_scale_for(1.0f), std::ldexp(1.0f, -8));
  EXPECT_EQ(ops::e4m3_row_scale_for(0.0f), 1.0f);
  EXPECT_THROW(ops::rows_to_e4m3_pow2_ref(x, {0, 9}, 2), Error) << "gather past the rows";
}

TEST(MoeGemmNvfp4W4a8Ref, E4m3ActivationsStayCloseToTheW4a16Product) {
  // The W4A8 GEMM's reference (the dequantized e4m3 rows through moe_gemm_nvfp4_ref) against the
  // W4A16 one: e4m3 keeps 3 mantissa bits, so each product moves by at most 2^-4 of itself and the
  // sums, of random signs, much less.
  std::mt19937_64 rng(test::test_seed(77));
  const int64_t E = 2, N = 64, K = 256;
  ops::MoeGemmNvfp4Ref ref;
  ref.packed = Tensor::empty(DType::kU8, {E, N, K / 2});
  ref.scale = Tensor::empty(DType::kF8E4M3, {E, N, K / 16});
  ref.row_scale = Tensor::from_f32(std::vector<float>(E * N, 0.01f), {E, N});
  for (int64_t e = 0; e < E; ++e) {
    const ops::Nvfp4Weight q = ops::quantize_nvfp4_ref(test::random_normal({N, K}, rng, 0.05f));
    std::memcpy(ref.packed.data<uint8_t>() + e * N * (K / 2), q.packed.raw_data(),
                q.packed.nbytes());
    std::memcpy(ref.scale.data<uint8_t>() + e * N * (K / 16), q.scale.raw_data(), q.scale.nbytes());
  }
  ref.act = test::random_normal({6, K}, rng, 2.0f).to(DType::kBF16);
  ref.expert_offsets = {0, 4, 6};
  const Tensor w4a16 = ops::moe_gemm_nvfp4_ref(ref);
  ops::MoeGemmNvfp4Ref w4a8 = ref;
  w4a8.act = ops::e4m3_rows_dequantized(ops::rows_to_e4m3_pow2_ref(ref.act, {}, 6));
  const Tensor got = ops::moe_gemm_nvfp4_ref(w4a8);
  EXPECT_GT(test::cosine_similarity(got, w4a16), 0.999);
  EXPECT_LT(test::max_abs_diff(got, w4a16),
            0.1 * test::max_abs_diff(w4a16, Tensor::zeros(DType::kF32, {6, N})));
}

}  // namespace
}  // namespace moelora
