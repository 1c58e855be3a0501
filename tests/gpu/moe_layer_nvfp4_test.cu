// Sm90 MoeLayerCuda with NVFP4 routed experts (MoeLayerConfig::nvfp4_experts: codes and e4m3 group
// scales packed on the device, the NVFP4 stream GEMM for GEMM1 and GEMM2 on f16 rows) against the
// CPU reference moe_forward_ref on the exactly dequantized weights:
//   - Qwen-style softmax routing with a gated shared expert and DeepSeek-style noaux_tc routing
//     with groups and routed scaling, H 256, I 128, E 16, k 4, T in {1, 5, 64, 300} (64 takes the
//     128-row decode GEMM instance, 300 the prefill one), gate and up rows with different scale_2
//     values;
//   - tokens of slot -1 mixed with adapters of ranks 5-16 (per-expert and shared-outer) and an
//     empty slot, the single-adapter path, the no-LoRA pipeline, every GEMM path bit-equal;
//   - CUDA-graph capture and replays with other inputs, bit-equal to eager forwards;
//   - each NVFP4 GEMM instance forced, bit-equal to the automatic pick;
//   - the configuration and weight checks.
// Tolerance as moe_layer_bf16_test.cu (moe_layer_case.cuh): the activation rows are exact in f16,
// the weights exact, so the layer rounds where the bf16-expert layer does.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gpu/moe_layer_case.cuh"

namespace moelora {
namespace {

using namespace moe_layer_case;
using test::upload_vector;

class Sm90_MoeLayerNvfp4 : public MoeLayerCaseTest {};

LayerSpec nvfp4_spec(bool gate) {
  LayerSpec s = tiny_qwen_spec(gate);
  s.hidden = 256;
  s.inter = 128;
  s.shared_inter = 128;
  s.nvfp4 = true;
  return s;
}

TEST_F(Sm90_MoeLayerNvfp4, QwenStyleGatedSharedExpert) {
  run_tiny_suite(nvfp4_spec(true), 801);
}

TEST_F(Sm90_MoeLayerNvfp4, DeepSeekNoauxTcGroups) {
  LayerSpec s = nvfp4_spec(false);
  s.router = RouterKind::kSigmoidNoauxTc;
  s.n_group = 4;
  s.topk_group = 2;
  s.routed_scaling = 2.5f;
  run_tiny_suite(s, 802);
}

// A decode bucket captured once and replayed with other tokens, slots and adapters: each replay
// equals an eager forward of the same inputs bit for bit.
TEST_F(Sm90_MoeLayerNvfp4, GraphReplaysMatchEager) {
  std::mt19937_64 rng(test::test_seed(803));
  LayerSpec s = nvfp4_spec(true);
  s.max_tokens = 32;
  LayerFixture lf = make_host_layer(s, rng);
  const int H = s.hidden, bucket = 32;
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  HostAdapter a0 = make_adapter(lf.config, 16, false, rng), a1 = make_adapter(lf.config, 8, true, rng);
  layer.set_adapter(0, a0.gpu());
  layer.set_adapter(2, a1.gpu());
  cuda::DeviceBuffer x_d(static_cast<size_t>(bucket) * H * 2), s_d(bucket * 4), out_d(static_cast<size_t>(bucket) * H * 2);
  ops::cuda::MoeForwardArgs f;
  f.x = x_d.as<__nv_bfloat16>();
  f.slot = s_d.as<int32_t>();
  f.tokens = bucket;
  f.out = out_d.as<__nv_bfloat16>();
  x_d.zero();
  s_d.zero();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(main_->get(), cudaStreamCaptureModeGlobal));
  layer.forward(f);
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(main_->get(), &graph));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    const Tensor x = draw_x(bucket, lf, rng);
    std::vector<int32_t> slots(bucket);
    for (int t = 0; t < bucket; ++t) slots[t] = (t + replay) % 4 - 1;  // -1, 0, 1 (empty), 2
    x_d.upload(x.to(DType::kBF16).raw_data(), static_cast<size_t>(bucket) * H * 2);
    s_d.upload(slots.data(), slots.size() * 4);
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_->get()));
    main_->synchronize();
    const Tensor replayed = cuda::to_host(out_d, DType::kBF16, {bucket, H}).to_f32();
    const Tensor eager = run(layer, x, slots);
    EXPECT_EQ(test::max_abs_diff(replayed, eager), 0.0) << "replay " << replay;
    check_against_reference(eager, x, slots, lf, {a0.ref(), {}, a1.ref(), {}}, Tensor(),
                            "replay " + std::to_string(replay));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// The NVFP4 GEMMs' instance forced (MoeLayerCuda::set_nvfp4_instance, the benches' A/B switch):
// narrow, wide and prefill sum every output in the same order, so a mixed-adapter forward gives
// the auto instance's bits with each, and so does the seam-1 LoRA released after the align or
// after the f16 rows kernel; the layer refuses the prefill instance where a GEMM's N (here
// GEMM2's, H = 384) is not a multiple of 256, before any forward.
TEST_F(Sm90_MoeLayerNvfp4, EveryForcedGemmInstanceGivesTheSameBits) {
  std::mt19937_64 rng(test::test_seed(805));
  LayerSpec s = nvfp4_spec(true);
  s.max_tokens = 40;
  LayerFixture lf = make_host_layer(s, rng);
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  HostAdapter a0 = make_adapter(lf.config, 16, false, rng),
              a1 = make_adapter(lf.config, 8, true, rng);
  layer.set_adapter(0, a0.gpu());
  layer.set_adapter(1, a1.gpu());
  const int T = 40;
  const Tensor x = draw_x(T, lf, rng);
  std::vector<int32_t> slots(T);
  for (int t = 0; t < T; ++t) slots[t] = t % 3 - 1;  // base-only, adapter 0, adapter 1
  const Tensor automatic = run(layer, x, slots);
  check_against_reference(automatic, x, slots, lf, {a0.ref(), a1.ref()}, Tensor(), "auto instance");
  for (auto [instance, name] : {std::pair{ops::cuda::Nvfp4StreamInstance::kNarrow, "narrow"},
                                {ops::cuda::Nvfp4StreamInstance::kWide, "wide"},
                                {ops::cuda::Nvfp4StreamInstance::kPrefill, "prefill"}}) {
    layer.set_nvfp4_instance(instance);
    EXPECT_EQ(test::max_abs_diff(run(layer, x, slots), automatic), 0.0) << name;
  }
  layer.set_nvfp4_instance(ops::cuda::Nvfp4StreamInstance::kAuto);
  // the seam-1 side work released after the align or after the f16 rows kernel (the rule picks
  // the latter up to 32 tokens): only the order of launches differs
  for (int after_rows : {0, 1}) {
    ops::cuda::SideStreamScheduling side;
    side.seam1_after_quant = after_rows;
    layer.set_side_stream_scheduling(side);
    EXPECT_EQ(test::max_abs_diff(run(layer, x, slots), automatic), 0.0)
        << "seam1_after_quant " << after_rows;
  }
  layer.set_side_stream_scheduling(ops::cuda::SideStreamScheduling{});

  LayerSpec odd = nvfp4_spec(false);
  odd.hidden = 384;
  odd.shared_inter = 0;
  odd.max_tokens = 4;
  LayerFixture lo = make_host_layer(odd, rng);
  ops::cuda::MoeLayerCuda narrow_h(lo.config, lo.host, main_->get(), side_->get());
  const std::string msg = test::error_message(
      [&] { narrow_h.set_nvfp4_instance(ops::cuda::Nvfp4StreamInstance::kPrefill); });
  EXPECT_NE(msg.find("prefill instance needs H and 2I multiples of 256; H = 384, 2I = 256"),
            std::string::npos)
      << msg;
  narrow_h.set_nvfp4_instance(ops::cuda::Nvfp4StreamInstance::kWide);  // accepted
}

TEST_F(Sm90_MoeLayerNvfp4, ConfigurationChecks) {
  std::mt19937_64 rng(test::test_seed(804));
  LayerSpec s = nvfp4_spec(false);
  s.shared_inter = 0;
  s.max_tokens = 4;
  LayerFixture lf = make_host_layer(s, rng);
  auto refused = [&](const ops::cuda::MoeLayerConfig& c, const ops::cuda::MoeLayerHostWeights& w) {
    return test::error_message([&] { ops::cuda::MoeLayerCuda bad(c, w, main_->get(), side_->get()); });
  };
  {
    auto c = lf.config;
    c.inter = 192;  // a multiple of 64 but not of 128
    const std::string msg = refused(c, ops::cuda::MoeLayerHostWeights{});
    EXPECT_NE(msg.find("I % 128"), std::string::npos) << msg;
  }
  {
    auto c = lf.config;
    c.bf16_experts = true;
    const std::string msg = refused(c, ops::cuda::MoeLayerHostWeights{});
    EXPECT_NE(msg.find("exclusive"), std::string::npos) << msg;
  }
  {
    auto host = lf.host;
    host.w13 = Tensor::zeros(DType::kF32, {16, 256, 256});  // dense weights where codes belong
    const std::string msg = refused(lf.config, host);
    EXPECT_NE(msg.find("w13"), std::string::npos) << msg;
  }
  {
    auto host = lf.host;
    host.w2_scale_2 = Tensor();
    const std::string msg = refused(lf.config, host);
    EXPECT_NE(msg.find("w2_scale_2"), std::string::npos) << msg;
  }
  {
    auto host = lf.host;
    host.w13_scale = Tensor::empty(DType::kF8E4M3, lf.host.w13_scale.shape());
    std::memcpy(host.w13_scale.raw_data(), lf.host.w13_scale.raw_data(), host.w13_scale.nbytes());
    host.w13_scale.data<uint8_t>()[3] = 0xb8;  // -1.0
    const std::string msg = refused(lf.config, host);
    EXPECT_NE(msg.find("negative"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace moelora
