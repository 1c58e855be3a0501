// ops::qkv_prologue_ref, the CPU oracle of the fused GQA attention input stage: hand-computed
// values on a small row (norms, a quarter turn of RoPE, the columns it must leave alone), the
// bf16 rounding between the stages, and errors that name the field.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "ops/attention/qkv_prologue.h"
#include "support/test_support.h"

namespace moelora {
namespace {

// One q head and one kv head of 4 dims, a 2-column gate between q and k: row = q(4) gate(2) k(4)
// v(4).
ops::QkvPrologueParams small_params() {
  ops::QkvPrologueParams p;
  p.q_heads = 1;
  p.kv_heads = 1;
  p.head_dim = 4;
  p.k_offset = 6;
  p.v_offset = 10;
  return p;
}

ops::RopeTable table_of(int64_t rotary_dim) {
  ops::RopeParams params;
  params.theta = 10000.0;
  params.rotary_dim = rotary_dim;
  return ops::make_rope_table(params);
}

TEST(OpsQkvPrologue, NormsThenRotatesAndLeavesTheRestAlone) {
  // q = (1, 2, 3, 4), gate (7, 8), k = (2, 0, 0, 0), v = (5, 6, 7, 8); norms weight 1 and 2.
  Tensor qkv = Tensor::from_f32({1, 2, 3, 4, 7, 8, 2, 0, 0, 0, 5, 6, 7, 8}, {1, 14});
  const Tensor q_norm = Tensor::from_f32({1, 1, 1, 1}, {4});
  const Tensor k_norm = Tensor::from_f32({2, 2, 2, 2}, {4});
  const ops::RopeTable rope = table_of(2);  // rotate (x0, x1) only: inv_freq[0] = 1
  const std::vector<int64_t> positions = {0};
  ops::qkv_prologue_ref(qkv, &q_norm, &k_norm, positions, rope, small_params());
  const float* x = qkv.data<float>();
  const float q_rms = std::sqrt((1.0f + 4 + 9 + 16) / 4 + 1e-6f);
  for (int i = 0; i < 4; ++i)
    EXPECT_FLOAT_EQ(x[i], static_cast<float>(i + 1) / q_rms) << i;  // angle 0
  EXPECT_EQ(x[4], 7.0f);
  EXPECT_EQ(x[5], 8.0f);
  const float k_rms = std::sqrt(4.0f / 4 + 1e-6f);
  EXPECT_FLOAT_EQ(x[6], 2.0f * 2.0f / k_rms);
  for (int i = 7; i < 10; ++i) EXPECT_EQ(x[i], 0.0f) << i;
  for (int i = 10; i < 14; ++i) EXPECT_EQ(x[i], static_cast<float>(i - 5)) << i;  // v untouched
}

TEST(OpsQkvPrologue, RotatesAtThePositionWithoutNorms) {
  // Position 1 with inv_freq 1: (a, b) -> (a cos 1 - b sin 1, b cos 1 + a sin 1) on dims 0 and 1
  // (rotate-half over a rotary_dim of 2); dims 2 and 3 pass through.
  Tensor qkv = Tensor::from_f32({1, 0, 3, 4, 0, 0, 0, 1, 5, 5, 9, 9, 9, 9}, {1, 14});
  const ops::RopeTable rope = table_of(2);
  const std::vector<int64_t> positions = {1};
  ops::qkv_prologue_ref(qkv, nullptr, nullptr, positions, rope, small_params());
  const float* x = qkv.data<float>();
  EXPECT_FLOAT_EQ(x[0], std::cos(1.0f));
  EXPECT_FLOAT_EQ(x[1], std::sin(1.0f));
  EXPECT_EQ(x[2], 3.0f);
  EXPECT_EQ(x[3], 4.0f);
  EXPECT_FLOAT_EQ(x[6], -std::sin(1.0f));
  EXPECT_FLOAT_EQ(x[7], std::cos(1.0f));
}

TEST(OpsQkvPrologue, RoundsToBf16BetweenTheStagesWhenAsked) {
  Tensor exact = Tensor::from_f32({1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0}, {1, 14});
  Tensor rounded = exact.clone();
  const Tensor w = Tensor::from_f32({1.1f, 0.9f, 1.3f, 0.7f}, {4});
  const ops::RopeTable rope = table_of(4);
  const std::vector<int64_t> positions = {3};
  ops::QkvPrologueParams p = small_params();
  ops::qkv_prologue_ref(exact, &w, &w, positions, rope, p);
  p.round_bf16 = true;
  ops::qkv_prologue_ref(rounded, &w, &w, positions, rope, p);
  bool differs = false;
  for (int i = 0; i < 10; ++i) {
    const float r = rounded.data<float>()[i];
    EXPECT_EQ(r, round_to_bf16(r)) << "element " << i << " is not a bf16 value";
    EXPECT_NEAR(r, exact.data<float>()[i], 0.02f) << i;
    differs = differs || r != exact.data<float>()[i];
  }
  EXPECT_TRUE(differs);
}

TEST(OpsQkvPrologue, ErrorsNameTheField) {
  Tensor qkv = Tensor::from_f32(std::vector<float>(14, 0.0f), {1, 14});
  const ops::RopeTable rope = table_of(4);
  const std::vector<int64_t> two = {0, 1};
  std::string m = test::error_message(
      [&] { ops::qkv_prologue_ref(qkv, nullptr, nullptr, two, rope, small_params()); });
  EXPECT_NE(m.find("positions has 2 entries, expected T = 1"), std::string::npos) << m;
  const std::vector<int64_t> one = {0};
  ops::QkvPrologueParams p = small_params();
  p.v_offset = 11;
  m = test::error_message([&] { ops::qkv_prologue_ref(qkv, nullptr, nullptr, one, rope, p); });
  EXPECT_NE(m.find("run past the row width 14"), std::string::npos) << m;
  const Tensor w3 = Tensor::from_f32({1, 1, 1}, {3});
  m = test::error_message([&] { ops::qkv_prologue_ref(qkv, &w3, &w3, one, rope, small_params()); });
  EXPECT_NE(m.find("has 3 elements, expected head_dim = 4"), std::string::npos) << m;
  m = test::error_message(
      [&] { ops::qkv_prologue_ref(qkv, &w3, nullptr, one, rope, small_params()); });
  EXPECT_NE(m.find("given together or not at all"), std::string::npos) << m;
}

}  // namespace
}  // namespace moelora
