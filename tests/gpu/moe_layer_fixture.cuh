// The MoE layer GPU tests' fixture (moe_layer_test.cu, moe_layer_model_test.cu): random FP8
// layers with their CPU reference weights, strong random adapters, the per-token check against
// moe_forward_ref (a token must be far closer to its own slot's reference than to any other
// slot's), and the test class with its two streams, an eager run and a graph capture.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "gpu/moe_adapter_case.cuh"
#include "ops/moe/moe.h"
#include "ops/moe/moe_layer_cuda.cuh"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora::moe_layer_test {

using test::download_vector;
using test::upload_vector;

using moe_adapter_case::bf16_round;
using moe_adapter_case::HostAdapter;
using moe_adapter_case::random_factors;

inline const char* decode_lora_name(ops::cuda::DecodeLoraPath path) {
  switch (path) {
    case ops::cuda::DecodeLoraPath::kFused: return "fused decode LoRA";
    case ops::cuda::DecodeLoraPath::kEpilogue: return "GEMM-epilogue decode LoRA";
    default: return "side-stream decode LoRA";
  }
}
inline constexpr ops::cuda::DecodeLoraPath kDecodeLoraPaths[] = {
    ops::cuda::DecodeLoraPath::kSideStream, ops::cuda::DecodeLoraPath::kFused,
    ops::cuda::DecodeLoraPath::kEpilogue};

struct LayerFixture {
  ops::cuda::MoeLayerConfig config;
  ops::cuda::MoeLayerHostWeights host;
  ops::MoeWeightsRef ref;
  ops::MoeParams params;
};

// Random FP8 experts (quantized per expert), bf16 router and shared expert; with
// shared_in_experts (Is = I) the shared expert is FP8 too and runs among the routed experts
// (MoeLayerConfig::shared_in_experts), the reference emulating its FP8 activations.
inline LayerFixture make_layer(int H, int I, int E, int k, int Is, bool gate, RouterKind router,
                               int max_tokens, int slots, int max_rank, std::mt19937_64& rng,
                               bool shared_in_experts = false) {
  LayerFixture f;
  auto& c = f.config;
  c.hidden = H;
  c.inter = I;
  c.num_experts = E;
  c.top_k = k;
  c.route.kind = router;
  c.route.num_experts = E;
  c.route.top_k = k;
  c.route.renormalize = true;
  if (router == RouterKind::kSigmoidNoauxTc) {
    c.route.n_group = 4;
    c.route.topk_group = 2;
    c.route.routed_scaling_factor = 2.5f;
  }
  c.shared_inter = Is;
  c.shared_gate = gate;
  c.max_tokens = max_tokens;
  c.num_slots = slots;
  c.max_rank = max_rank;

  auto quantize_stack = [&](int rows, int cols, Tensor& q, Tensor& scale, Tensor& deq) {
    q = Tensor::empty(DType::kF8E4M3, {E, rows, cols});
    const int nb = (rows + 127) / 128, kb = (cols + 127) / 128;
    scale = Tensor::empty(DType::kF32, {E, nb, kb});
    deq = Tensor::empty(DType::kF32, {E, rows, cols});
    for (int e = 0; e < E; ++e) {
      Tensor w = test::random_normal({rows, cols}, rng, 1.0f / std::sqrt(static_cast<float>(cols)));
      auto qb = ops::quantize_fp8_block_ref(w);
      std::memcpy(q.data<uint8_t>() + static_cast<size_t>(e) * rows * cols, qb.q.raw_data(),
                  qb.q.nbytes());
      std::memcpy(scale.data<float>() + static_cast<size_t>(e) * nb * kb, qb.scale_inv.raw_data(),
                  qb.scale_inv.nbytes());
      Tensor d = ops::dequant_fp8_block_ref(qb.q, qb.scale_inv);
      std::memcpy(deq.data<float>() + static_cast<size_t>(e) * rows * cols, d.raw_data(),
                  d.nbytes());
    }
  };
  quantize_stack(2 * I, H, f.host.w13, f.host.w13_scale, f.ref.w13);
  quantize_stack(H, I, f.host.w2, f.host.w2_scale, f.ref.w2);
  // softmax routers get sharp logits; sigmoid scores must not saturate (near-ties at 1.0)
  const float router_scale = router == RouterKind::kSoftmaxTopK ? 4.0f : 1.0f;
  f.ref.router =
      bf16_round(test::random_normal({E, H}, rng, router_scale / std::sqrt(static_cast<float>(H))));
  f.host.router = f.ref.router;
  if (router == RouterKind::kSigmoidNoauxTc) {
    f.ref.correction_bias = test::random_uniform({E}, rng, -0.05f, 0.05f);
    f.host.correction_bias = f.ref.correction_bias;
  }
  if (Is > 0 && shared_in_experts) {  // FP8 blocks, the reference gets the dequantized values
    c.shared_in_experts = true;
    f.params.shared_fp8_activations = true;
    auto quantize = [&](int rows, int cols, Tensor& q, Tensor& scale, Tensor& deq) {
      auto qb = ops::quantize_fp8_block_ref(
          test::random_normal({rows, cols}, rng, 1.0f / std::sqrt(static_cast<float>(cols))));
      q = qb.q;
      scale = qb.scale_inv;
      deq = ops::dequant_fp8_block_ref(qb.q, qb.scale_inv);
    };
    quantize(2 * Is, H, f.host.shared_w13, f.host.shared_w13_scale, f.ref.shared_w13);
    quantize(H, Is, f.host.shared_w2, f.host.shared_w2_scale, f.ref.shared_w2);
  } else if (Is > 0) {
    f.ref.shared_w13 =
        bf16_round(test::random_normal({2 * Is, H}, rng, 1.0f / std::sqrt(static_cast<float>(H))));
    f.ref.shared_w2 =
        bf16_round(test::random_normal({H, Is}, rng, 1.0f / std::sqrt(static_cast<float>(Is))));
    f.host.shared_w13 = f.ref.shared_w13;
    f.host.shared_w2 = f.ref.shared_w2;
  }
  if (Is > 0) {
    if (gate) {
      f.ref.shared_gate =
          bf16_round(test::random_normal({1, H}, rng, 1.0f / std::sqrt(static_cast<float>(H))));
      f.host.shared_gate = f.ref.shared_gate;
    }
  }
  f.params.hidden = H;
  f.params.intermediate = I;
  f.params.route = c.route;
  f.params.fp8_activations = true;
  return f;
}

// moe_adapter_case.cuh's adapter for the fixture's layer.
inline HostAdapter make_adapter(const LayerFixture& lf, int rank, bool shared_outer,
                                std::mt19937_64& rng) {
  return moe_adapter_case::make_adapter(lf.config, rank, shared_outer, rng);
}

struct DeviceBatch {
  cuda::DeviceBuffer x, slot, out, logits;
  int tokens;
};

inline double row_rel_error(const Tensor& got, const Tensor& want, int row) {
  const int64_t H = got.dim(1);
  double num = 0, den = 0;
  for (int64_t c = 0; c < H; ++c) {
    const double d = double(got.item_f32(row * H + c)) - want.item_f32(row * H + c);
    num += d * d;
    den += double(want.item_f32(row * H + c)) * want.item_f32(row * H + c);
  }
  return std::sqrt(num / (den + 1e-30));
}

// Checks every row of `got` against the reference with its own slot, and that the reference of
// every other slot assignment (other adapter or none) is clearly farther away. max_row_error: the
// relative error a row may have (0.04 below; PERF.md's FP8 bound, cosine >= 0.999, is a relative
// error of sqrt(2 * 0.001) = 0.0447).
inline void check_rows(const Tensor& got, const Tensor& x, const std::vector<int32_t>& slots,
                       const LayerFixture& lf, const std::vector<ops::MoeLoraRef>& adapters,
                       const Tensor& logits, double max_row_error = 0.04) {
  Tensor want = ops::moe_forward_ref(x, slots, lf.ref, adapters, lf.params, nullptr, logits);
  const int T = static_cast<int>(slots.size());
  for (int t = 0; t < T; ++t) {
    const double err = row_rel_error(got, want, t);
    // 0.04: the reference quantizes its fp32 activations to FP8, the GPU its bf16-rounded ones,
    // and the codes that flip between the two put single rows, base tokens included, up to 3.7 %
    // off (the same on every decode LoRA path, on identical inputs); a wrong slot is >= 15 % off.
    EXPECT_LT(err, max_row_error) << "token " << t << " (slot " << slots[t]
                                  << ") differs from its reference";
    for (int other = -1; other < static_cast<int>(adapters.size()); ++other) {
      if (other == slots[t]) continue;
      if (other >= 0 && adapters[other].gate_up == nullptr) continue;  // empty slot: same as base
      std::vector<int32_t> alt(slots);
      alt[t] = other;
      Tensor wrong =
          ops::moe_forward_ref(x.slice0(t, t + 1), {other}, lf.ref, adapters, lf.params, nullptr,
                               logits.defined() ? logits.slice0(t, t + 1) : Tensor());
      const double gap = row_rel_error(wrong, want.slice0(t, t + 1), 0);
      // the test is only meaningful when slots are distinguishable
      ASSERT_GT(gap, 0.15) << "test inputs do not separate slot " << slots[t] << " from " << other;
      EXPECT_LT(err, gap / 4) << "token " << t << " is closer to slot " << other
                              << "'s result than expected";
    }
  }
  double dot = 0, na = 0, nb = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    dot += double(got.item_f32(i)) * want.item_f32(i);
    na += double(got.item_f32(i)) * got.item_f32(i);
    nb += double(want.item_f32(i)) * want.item_f32(i);
  }
  EXPECT_GE(dot / std::sqrt(na * nb), 0.999);
}

class Sm90_MoeLayer : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0 || cuda::device_info(0).sm_major < 9)
      GTEST_SKIP() << "needs an sm_90 device";
    main_ = std::make_unique<cuda::Stream>();
    side_ = std::make_unique<cuda::Stream>();
  }
  Tensor run(ops::cuda::MoeLayerCuda& layer, const Tensor& x, const std::vector<int32_t>& slots,
             const Tensor& logits, bool lora = true, int single_slot = -1) {
    const int T = static_cast<int>(slots.size()), H = layer.config().hidden;
    auto x_d = cuda::to_device(x.to(DType::kBF16));
    auto s_d = upload_vector(slots);
    cuda::DeviceBuffer out(static_cast<size_t>(T) * H * 2);
    cuda::DeviceBuffer l_d;
    if (logits.defined()) l_d = cuda::to_device(logits);
    ops::cuda::MoeForwardArgs f;
    f.x = x_d.as<__nv_bfloat16>();
    f.slot = s_d.as<int32_t>();
    f.router_logits = logits.defined() ? l_d.as<float>() : nullptr;
    f.tokens = T;
    f.lora = lora;
    f.single_slot = single_slot;
    f.out = out.as<__nv_bfloat16>();
    layer.forward(f);
    main_->synchronize();
    side_->synchronize();
    return cuda::to_host(out, DType::kBF16, {T, H}).to_f32();
  }
  // Device copies of a LoRA forward's inputs (x [T, H], the slot map, router logits [T, E]), its
  // output buffer [T, H] bf16 and the forward's arguments over them.
  struct UploadedForward {
    cuda::DeviceBuffer x, slots, logits, out;
    ops::cuda::MoeForwardArgs args;
  };
  static UploadedForward upload_forward(const ops::cuda::MoeLayerCuda& layer, const Tensor& x,
                                        const std::vector<int32_t>& slots, const Tensor& logits) {
    const int T = static_cast<int>(slots.size()), H = layer.config().hidden;
    UploadedForward u{cuda::to_device(x.to(DType::kBF16)),
                      upload_vector(slots),
                      cuda::to_device(logits),
                      cuda::DeviceBuffer(static_cast<size_t>(T) * H * 2),
                      {}};
    u.args.x = u.x.as<__nv_bfloat16>();
    u.args.slot = u.slots.as<int32_t>();
    u.args.router_logits = u.logits.as<float>();
    u.args.tokens = T;
    u.args.lora = true;
    u.args.out = u.out.as<__nv_bfloat16>();
    return u;
  }
  // Captures one LoRA forward of `layer` on (x, slots, logits) into a graph and expects each of
  // `replays` replays to write `want` bit for bit.
  void expect_graph_replays_equal(ops::cuda::MoeLayerCuda& layer, const Tensor& x,
                                  const std::vector<int32_t>& slots, const Tensor& logits,
                                  const Tensor& want, int replays = 3) {
    const int T = static_cast<int>(slots.size()), H = layer.config().hidden;
    UploadedForward f = upload_forward(layer, x, slots, logits);
    cuda::DeviceBuffer& out = f.out;
    cudaGraphExec_t exec = capture([&] { layer.forward(f.args); });
    for (int replay = 0; replay < replays; ++replay) {
      out.zero();
      MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_->get()));
      main_->synchronize();
      EXPECT_EQ(test::max_abs_diff(cuda::to_host(out, DType::kBF16, {T, H}).to_f32(), want), 0.0)
          << "graph replay " << replay;
    }
    MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  // Captures the launches of fn on the main stream into an instantiated graph (the caller
  // destroys it with cudaGraphExecDestroy), with its nodes' priorities as the engine's graphs.
  cudaGraphExec_t capture(const std::function<void()>& fn) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(main_->get(), cudaStreamCaptureModeGlobal));
    fn();
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(main_->get(), &graph));
    MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority));
    MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
    return exec;
  }
  std::unique_ptr<cuda::Stream> main_, side_;
};

}  // namespace moelora::moe_layer_test
