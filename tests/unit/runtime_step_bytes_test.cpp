// The byte model of a decode step (src/runtime/step_bytes.h), the denominator of `moelora
// bench`'s E1-E3: every term written out by hand for the Qwen3-MoE parity fixture (3 layers, the
// middle one a dense MLP), bf16 / FP8 / NVFP4 experts, one and two adapters of both layouts, and
// the Gated DeltaNet states of the Qwen3.5 fixture.
#include <gtest/gtest.h>

#include <cmath>

#include "io/hf_config.h"
#include "runtime/gpu_executor.h"
#include "runtime/step_bytes.h"
#include "support/test_support.h"

namespace moelora::runtime {
namespace {

using test::fixture;

TEST(RuntimeStepBytes, DistinctExpertsOfUniformRouting) {
  EXPECT_DOUBLE_EQ(distinct_experts(128, 8, 1), 8.0);  // one token: its k experts
  EXPECT_DOUBLE_EQ(distinct_experts(128, 8, 0), 0.0);
  EXPECT_DOUBLE_EQ(distinct_experts(0, 8, 16), 0.0);
  EXPECT_DOUBLE_EQ(distinct_experts(128, 8, 16), 128 * (1 - std::pow(120.0 / 128, 16)));
  EXPECT_NEAR(distinct_experts(128, 8, 4096), 128.0, 1e-9);  // every expert
  EXPECT_DOUBLE_EQ(distinct_experts(4, 8, 3), 4.0);          // k above E: all of them
}

TEST(RuntimeStepBytes, EveryTermOfTheQwen3MoeFixture) {
  io::ModelConfig c = io::load_model_config(fixture("qwen3_moe") / "base");
  // H 64, 4 query / 2 KV heads of 16, 8 experts top-2 of I 32, dense I 96 in layer 1, V 512.
  const double H = 64, V = 512, E = 8, I = 32, d = 16, B = 16, context = 100;
  const double attention = (4 * d * H + 2 * 2 * d * H + H * 4 * d) * 2;  // q, k, v, o in bf16
  const double dense_mlp = 3 * H * 96 * 2;
  const double kv = B * context * 3 * 2 * 2 * d * 2;  // 3 layers, K and V of 2 heads, bf16
  const double D = distinct_experts(E, 2, B);
  auto base_with = [&](double expert_bytes) {
    return V * H * 2 + 3 * attention + dense_mlp + 2 * (E * H * 2 + D * expert_bytes) + kv;
  };
  EXPECT_DOUBLE_EQ(decode_step_bytes(c, 16, context, 0, 0, 16, false).base,
                   base_with(3 * H * I * 2));
  EXPECT_DOUBLE_EQ(decode_step_bytes(c, 16, context, 0, 0, 16, false).lora, 0.0);

  // FP8 experts (1 byte + a 128 x 128 block scale) count only where I is a multiple of 128, as
  // the GPU keeps them; NVFP4 ones where H and I are (0.5625 bytes + an fp32 scale_2 per row).
  io::ModelConfig fp8 = c;
  fp8.quant.method = io::QuantMethod::kFp8Block;
  EXPECT_DOUBLE_EQ(decode_step_bytes(fp8, 16, context, 0, 0, 16, false).base,
                   base_with(3 * H * I * 2));  // I = 32: bf16 on the GPU
  fp8.moe_intermediate_size = 128;
  io::ModelConfig nvfp4 = fp8;
  nvfp4.quant.method = io::QuantMethod::kNvfp4;
  nvfp4.hidden_size = 128;
  {
    const double I2 = 128;
    const double base = decode_step_bytes(fp8, 16, context, 0, 0, 16, false).base;
    EXPECT_DOUBLE_EQ(base, V * H * 2 + 3 * attention + dense_mlp +
                               2 * (E * H * 2 + D * 3 * H * I2 * (1.0 + 4.0 / (128 * 128))) + kv);
  }
  {
    // a shared expert counts in bf16 per MoE layer; run among the FP8 routed experts
    // (fp8_shared_expert) one of their size counts as one more FP8 expert, one of another size
    // stays bf16
    io::ModelConfig shared = fp8;
    shared.shared_expert_intermediate_size = 128;
    const double I2 = 128, fp8_expert = 3 * H * I2 * (1.0 + 4.0 / (128 * 128));
    const double plain = decode_step_bytes(fp8, 16, context, 0, 0, 16, false).base;
    EXPECT_DOUBLE_EQ(decode_step_bytes(shared, 16, context, 0, 0, 16, false).base,
                     plain + 2 * 3 * H * I2 * 2);
    EXPECT_DOUBLE_EQ(decode_step_bytes(shared, 16, context, 0, 0, 16, false, true).base,
                     plain + 2 * fp8_expert);
    shared.shared_expert_intermediate_size = 256;
    EXPECT_DOUBLE_EQ(decode_step_bytes(shared, 16, context, 0, 0, 16, false, true).base,
                     plain + 2 * 3 * H * 256 * 2);
  }
  {
    const double H2 = 128, I2 = 128;
    const double attention2 = (4 * d * H2 + 2 * 2 * d * H2 + H2 * 4 * d) * 2;
    const double base = decode_step_bytes(nvfp4, 16, context, 0, 0, 16, false).base;
    EXPECT_DOUBLE_EQ(base, V * H2 * 2 + 3 * attention2 + 3 * H2 * 96 * 2 +
                               2 * (E * H2 * 2 + D * (3 * H2 * I2 * 0.5625 + (2 * I2 + H2) * 4)) +
                               kv);
  }

  // LoRA: two adapters of rank 8 share 12 of the 16 rows: each touches D(6) experts of each MoE
  // layer (per-expert: A and B of gate_up and down) and every dense target whole.
  const double R = 8, touched = distinct_experts(E, 2, 6);
  const double dense_targets =
      3 * ((4 * d + H) + 2 * (2 * d + H) + (H + 4 * d)) * R * 2 + ((96 + H) * 2 + (H + 96)) * R * 2;
  const double per_expert = (R * H + 2 * I * R + R * I + H * R) * 2;
  EXPECT_DOUBLE_EQ(decode_step_bytes(c, 16, context, 2, 12, 8, false).lora,
                   2 * (2 * touched * per_expert + dense_targets));
  // Shared-outer: the experts' own factors (B of gate_up, A of down) per touched expert, the
  // shared A of gate_up and B of down once per layer.
  const double outer = (2 * I * R + R * I) * 2, shared = (R * H + H * R) * 2;
  EXPECT_DOUBLE_EQ(decode_step_bytes(c, 16, context, 2, 12, 8, true).lora,
                   2 * (2 * (touched * outer + shared) + dense_targets));
}

TEST(RuntimeStepBytes, LinearAttentionStatesAreReadAndWritten) {
  const io::ModelConfig q35 = io::load_model_config(fixture("qwen3_5_moe") / "base");
  const StepBytes one = decode_step_bytes(q35, 1, 10, 0, 0, 16, false);
  const StepBytes two = decode_step_bytes(q35, 2, 10, 0, 0, 16, false);
  // The second sequence adds its KV at the context, its states twice, and the experts its token
  // touches beyond the first's.
  const double E = static_cast<double>(q35.num_experts),
               k = static_cast<double>(q35.num_experts_per_tok);
  const double H = static_cast<double>(q35.hidden_size),
               I = static_cast<double>(q35.moe_intermediate_size);
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < q35.num_hidden_layers; ++l) moe_layers += q35.is_moe_layer(l);
  const double experts = static_cast<double>(moe_layers) *
                         (distinct_experts(E, k, 2) - distinct_experts(E, k, 1)) * 3 * H * I * 2;
  EXPECT_NEAR(two.base - one.base,
              10.0 * static_cast<double>(estimate_kv_bytes_per_token(q35)) +
                  2.0 * static_cast<double>(linear_attention_state_bytes(q35)) + experts,
              1e-6 * two.base);
  EXPECT_GT(linear_attention_state_bytes(q35), 0u);
}

}  // namespace
}  // namespace moelora::runtime
