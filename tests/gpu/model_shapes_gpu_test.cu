// Random GpuModels of real shapes (Qwen3-30B-A3B, Qwen3.5-35B-A3B, Kimi-K2.5; two layers, fewer
// experts, a smaller vocabulary) through the driver of model_gpu_driver.cuh: an adapter changes
// the logits, the on-device sampler is the argmax, a replayed decode graph equals the eager
// forward bitwise; FlashInfer's attention against moelora's on the whole model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "gpu/model_gpu_driver.cuh"
#include "io/hf_config.h"
#include "model/gpu_model_cuda.cuh"
#include "ops/attention/attention_flashinfer.cuh"
#include "support/test_support.h"

namespace moelora::model {
namespace {

using namespace gpu_model_test;

// ---- random models of real shapes (two layers, fewer experts, smaller vocabulary) ----

io::ModelConfig qwen3_30b_a3b_shape() {
  nlohmann::json c = {{"model_type", "qwen3_moe"},
                      {"vocab_size", 8192},
                      {"hidden_size", 2048},
                      {"num_hidden_layers", 2},
                      {"num_attention_heads", 32},
                      {"num_key_value_heads", 4},
                      {"head_dim", 128},
                      {"intermediate_size", 6144},
                      {"moe_intermediate_size", 768},
                      {"num_experts", 128},
                      {"num_experts_per_tok", 8},
                      {"norm_topk_prob", true},
                      {"rms_norm_eps", 1e-6},
                      {"rope_theta", 1000000.0},
                      {"max_position_embeddings", 4096},
                      {"decoder_sparse_step", 1},
                      {"mlp_only_layers", nlohmann::json::array()},
                      {"tie_word_embeddings", false}};
  return io::parse_model_config(c, "qwen3-30b-a3b shape");
}

// Qwen3.5-35B-A3B's layer shapes, 4 layers (3 Gated DeltaNet + 1 gated full attention): 16 / 2
// heads of 256 with RoPE on 64 dims, linear attention 16 key / 32 value heads of 128, 256 experts
// top-8 of 512 with a gated shared expert.
io::ModelConfig qwen35_35b_a3b_shape() {
  nlohmann::json c = {
      {"model_type", "qwen3_5_moe_text"},
      {"vocab_size", 8192},
      {"hidden_size", 2048},
      {"num_hidden_layers", 4},
      {"layer_types",
       {"linear_attention", "linear_attention", "linear_attention", "full_attention"}},
      {"num_attention_heads", 16},
      {"num_key_value_heads", 2},
      {"head_dim", 256},
      {"linear_conv_kernel_dim", 4},
      {"linear_key_head_dim", 128},
      {"linear_value_head_dim", 128},
      {"linear_num_key_heads", 16},
      {"linear_num_value_heads", 32},
      {"moe_intermediate_size", 512},
      {"shared_expert_intermediate_size", 512},
      {"num_experts", 256},
      {"num_experts_per_tok", 8},
      {"rms_norm_eps", 1e-6},
      {"rope_parameters",
       {{"rope_type", "default"}, {"rope_theta", 10000000.0}, {"partial_rotary_factor", 0.25}}},
      {"max_position_embeddings", 4096},
      {"tie_word_embeddings", false}};
  return io::parse_model_config(c, "qwen3.5-35b-a3b shape");
}

io::ModelConfig kimi_k25_shape() {
  nlohmann::json c = {{"model_type", "kimi_k2"},
                      {"vocab_size", 8192},
                      {"hidden_size", 7168},
                      {"num_hidden_layers", 2},
                      {"num_attention_heads", 64},
                      {"num_key_value_heads", 64},
                      {"q_lora_rank", 1536},
                      {"kv_lora_rank", 512},
                      {"qk_nope_head_dim", 128},
                      {"qk_rope_head_dim", 64},
                      {"v_head_dim", 128},
                      {"intermediate_size", 18432},
                      {"moe_intermediate_size", 2048},
                      {"n_routed_experts", 32},
                      {"num_experts_per_tok", 8},
                      {"n_shared_experts", 1},
                      {"first_k_dense_replace", 1},
                      {"n_group", 1},
                      {"topk_group", 1},
                      {"routed_scaling_factor", 2.827},
                      {"scoring_func", "sigmoid"},
                      {"topk_method", "noaux_tc"},
                      {"norm_topk_prob", true},
                      {"rms_norm_eps", 1e-5},
                      {"rope_theta", 50000.0},
                      {"max_position_embeddings", 262144},
                      {"rope_interleave", true},
                      {"rope_scaling",
                       {{"type", "yarn"},
                        {"factor", 64.0},
                        {"original_max_position_embeddings", 4096},
                        {"beta_fast", 32.0},
                        {"beta_slow", 1.0},
                        {"mscale", 1.0},
                        {"mscale_all_dim", 1.0}}},
                      {"tie_word_embeddings", false}};
  return io::parse_model_config(c, "kimi-k2.5 shape");
}

void check_random_model(const io::ModelConfig& config, const std::string& label,
                        bool attention_pdl = true) {
  const uint64_t seed = test::test_seed(20240611);
  // 10 sequences: the graph test's 4 and their 4 shadow state slots (linear-attention models)
  GpuModelLimits limits = small_limits(10);
  limits.max_tokens = 96;
  GpuModelOptions options;
  options.show_progress = false;
  options.attention_pdl = attention_pdl;
  std::unique_ptr<GpuModel> gpu =
      GpuModel::random(config, seed, /*fp8_experts=*/true, limits, options);
  EXPECT_GT(gpu->weight_bytes(), 0u);
  EXPECT_GT(gpu->kv_bytes_per_token(), 0u);
  gpu->randomize_slot(0, 16, false, seed + 1);
  gpu->randomize_slot(1, 8, true, seed + 2);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts(3);
  for (int i = 0; i < 3; ++i) prompts[i] = test::random_tokens(rng, 17 + 9 * i, config.vocab_size);
  // The same prompt with and without an adapter must give different logits (LoRA is live), and
  // the replayed decode graph must equal the eager forward bitwise.
  Driver driver(*gpu);
  const int base = driver.add_sequence(-1), lora = driver.add_sequence(0);
  const Driver::Output out = driver.step({{base, prompts[0]}, {lora, prompts[0]}});
  double diff = 0;
  for (size_t v = 0; v < out.logits[0].size(); ++v) {
    ASSERT_TRUE(std::isfinite(out.logits[0][v]) && std::isfinite(out.logits[1][v])) << label;
    diff = std::max(diff, static_cast<double>(std::fabs(out.logits[0][v] - out.logits[1][v])));
  }
  EXPECT_GT(diff, 1e-3) << label << ": the adapter in slot 0 changed nothing";
  expect_sampler_is_argmax(out, label);
  check_graph_replay(
      *gpu, prompts, {0, -1, 1, 0}, [](int) {},
      [](int step, int i) {
        const int32_t table[4][4] = {{0, -1, 1, 0}, {1, -1, 1, 0}, {-1, 0, 0, 1}, {1, 1, -1, -1}};
        return table[step][i];
      },
      label + " graph");
}

TEST(Sm90_GpuModel, RandomQwen3_30bA3bShape) {
  MOELORA_REQUIRE_SM90();
  check_random_model(qwen3_30b_a3b_shape(), "qwen3-30b-a3b shape");
}

// The tests above run FlashInfer's attention and merge as programmatic dependents of the qkv
// prologue (GpuModelOptions::attention_pdl, the default), so their decode graphs hold programmatic
// edges into them; these run the plain launches (the A/B runs' other side) on both GQA shapes.
TEST(Sm90_GpuModel, RandomQwen3_30bA3bShapePlainAttentionLaunch) {
  MOELORA_REQUIRE_SM90();
  check_random_model(qwen3_30b_a3b_shape(), "qwen3-30b-a3b shape, plain attention launch", false);
}

TEST(Sm90_GpuModel, RandomQwen35_35bA3bShapePlainAttentionLaunch) {
  MOELORA_REQUIRE_SM90();
  check_random_model(qwen35_35b_a3b_shape(), "qwen3.5-35b-a3b shape, plain attention launch",
                     false);
}

TEST(Sm90_GpuModel, RandomQwen35_35bA3bShape) {
  MOELORA_REQUIRE_SM90();
  check_random_model(qwen35_35b_a3b_shape(), "qwen3.5-35b-a3b shape");
}

TEST(Sm90_GpuModel, RandomKimiK25Shape) {
  MOELORA_REQUIRE_SM90();
  check_random_model(kimi_k25_shape(), "kimi-k2.5 shape");
}

// The same random model with Qwen3-30B-A3B's attention (32 / 4 heads of 128) run with
// FlashInfer's attention kernel and with moelora's: a prefill of two prompts (one on an adapter),
// decode steps (FlashInfer's decode plan) and a step mixing a chunk over cached context with a
// decode (its general plan) give logits within the whole-model bf16 bound, step after step. The
// MoE layers route every token to all 8 of their 8 experts, so bf16 differences between the two
// attention kernels cannot flip a near-tied expert choice (which would move the two runs apart
// by more than rounding); both runs are fed the same tokens.
TEST(Sm90_GpuModel, FlashInferAttentionMatchesMoeloraAttention) {
  MOELORA_REQUIRE_SM90();
  if (!ops::cuda::FlashInferAttention::compiled())
    GTEST_SKIP() << "this build has no FlashInfer kernels (scripts/setup)";
  io::ModelConfig config = qwen3_30b_a3b_shape();
  config.num_experts = 8;
  config.num_experts_per_tok = 8;
  const uint64_t seed = test::test_seed(20261130);
  GpuModelLimits limits = small_limits();
  limits.max_tokens = 96;
  GpuModelOptions with_flashinfer, with_moelora;
  with_flashinfer.show_progress = with_moelora.show_progress = false;
  with_flashinfer.attention = AttentionKernel::kFlashInfer;
  with_moelora.attention = AttentionKernel::kMoelora;
  auto fi = GpuModel::random(config, seed, /*fp8_experts=*/true, limits, with_flashinfer);
  auto own = GpuModel::random(config, seed, /*fp8_experts=*/true, limits, with_moelora);
  EXPECT_STREQ(fi->attention_kernel(), "flashinfer");
  EXPECT_STREQ(own->attention_kernel(), "moelora");
  fi->randomize_slot(0, 16, false, seed + 1);
  own->randomize_slot(0, 16, false, seed + 1);

  Driver df(*fi), dm(*own);
  std::mt19937_64 rng(seed);
  auto random_tokens = [&](int n) { return test::random_tokens(rng, n, config.vocab_size); };
  const int a = df.add_sequence(-1), b = df.add_sequence(0);
  ASSERT_EQ(a, dm.add_sequence(-1));
  ASSERT_EQ(b, dm.add_sequence(0));
  std::vector<std::vector<Driver::Item>> steps;
  steps.push_back({{a, random_tokens(17)}, {b, random_tokens(26)}});
  for (int i = 0; i < 6; ++i) steps.push_back({{a, {}}, {b, {}}});  // decode: tokens set below
  steps.push_back({{a, random_tokens(9)}, {b, {}}});                // chunk + decode
  steps.push_back({{a, {}}, {b, {}}});
  std::vector<int32_t> next(2, 0);
  double worst_cosine = 1;
  for (size_t k = 0; k < steps.size(); ++k) {
    std::vector<Driver::Item>& items = steps[k];
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].tokens.empty()) items[i].tokens = {next[i]};
    const Driver::Output of = df.step(items);
    const Driver::Output om = dm.step(items);
    for (size_t i = 0; i < items.size(); ++i) {
      next[i] = om.sampled[i];  // both runs continue with the same token
      const LogitsDiff d =
          expect_logits_close(of.logits[i], om.logits[i],
                              "step " + std::to_string(k) + " sequence " + std::to_string(i));
      worst_cosine = std::min(worst_cosine, d.cosine);
    }
  }
  std::printf("FlashInfer vs moelora attention, whole model: worst logit cosine %.6f\n",
              worst_cosine);
}

// The same random model with the attention launched programmatically (attention_pdl) and plainly:
// a prefill (one sequence on an adapter), decode steps and a chunk beside a decode give the same
// logits bitwise (the qkv prologue's early trigger lets the attention start before it ends, and
// griddepcontrol.wait must still order every read of q and the cache after it).
TEST(Sm90_GpuModel, AttentionPdlGivesThePlainLaunchLogits) {
  MOELORA_REQUIRE_SM90();
  if (!ops::cuda::FlashInferAttention::compiled())
    GTEST_SKIP() << "this build has no FlashInfer kernels (scripts/setup)";
  io::ModelConfig config = qwen3_30b_a3b_shape();
  const uint64_t seed = test::test_seed(20261206);
  GpuModelLimits limits = small_limits();
  limits.max_tokens = 96;
  GpuModelOptions plain, pdl;
  plain.show_progress = pdl.show_progress = false;
  plain.attention = pdl.attention = AttentionKernel::kFlashInfer;
  plain.attention_pdl = false;
  pdl.attention_pdl = true;
  auto a_model = GpuModel::random(config, seed, /*fp8_experts=*/true, limits, plain);
  auto b_model = GpuModel::random(config, seed, /*fp8_experts=*/true, limits, pdl);
  a_model->randomize_slot(0, 16, false, seed + 1);
  b_model->randomize_slot(0, 16, false, seed + 1);
  Driver da(*a_model), db(*b_model);
  std::mt19937_64 rng(seed);
  auto random_tokens = [&](int n) { return test::random_tokens(rng, n, config.vocab_size); };
  const int s0 = da.add_sequence(-1), s1 = da.add_sequence(0), s2 = da.add_sequence(0);
  ASSERT_EQ(s0, db.add_sequence(-1));
  ASSERT_EQ(s1, db.add_sequence(0));
  ASSERT_EQ(s2, db.add_sequence(0));
  std::vector<std::vector<Driver::Item>> steps;
  steps.push_back({{s0, random_tokens(40)}, {s1, random_tokens(23)}, {s2, random_tokens(5)}});
  for (int i = 0; i < 5; ++i) steps.push_back({{s0, {}}, {s1, {}}, {s2, {}}});
  steps.push_back({{s0, random_tokens(11)}, {s1, {}}, {s2, {}}});  // chunk + decodes
  steps.push_back({{s0, {}}, {s1, {}}, {s2, {}}});
  std::vector<int32_t> next(3, 0);
  for (size_t k = 0; k < steps.size(); ++k) {
    std::vector<Driver::Item>& items = steps[k];
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].tokens.empty()) items[i].tokens = {next[i]};
    const Driver::Output oa = da.step(items);
    const Driver::Output ob = db.step(items);
    for (size_t i = 0; i < items.size(); ++i) {
      next[i] = oa.sampled[i];
      EXPECT_EQ(ob.sampled[i], oa.sampled[i]) << "step " << k << " sequence " << i;
      ASSERT_EQ(ob.logits[i], oa.logits[i]) << "step " << k << " sequence " << i;
    }
  }
}

}  // namespace
}  // namespace moelora::model
