// Sm90 MoeLayerCuda with bf16 routed experts (MoeLayerConfig::bf16_experts: the tiny parity
// models and non-quantized checkpoints) against the CPU reference moe_forward_ref in fp32:
//   - tiny shapes of the parity models (H 64, I 32, E 16, k 4, shared expert 96 with and without
//     Qwen's sigmoid gate; DeepSeek-style noaux_tc routing with groups, correction bias and routed
//     scaling), through the GPU router GEMM, T in {1, 5, 64, 300};
//   - the Qwen3-30B-A3B routed shape (H 2048, I 768, E 128, k 8) with device-randomized weights;
//   - tokens of slot -1 mixed with 1-3 adapters of different ranks (per-expert and shared-outer)
//     and an empty slot; the single-adapter path; both tiles of the bf16 grouped GEMM; skewed
//     routing (one expert takes every token); CUDA-graph capture and replay;
//   - a 600-token prefill with 1 and 3 adapters of ranks 16 and 40 (pool rank 40): the
//     tensor-core LoRA kernels that kAuto picks at this size against the reference and against
//     the CUDA-core LoRA kernels, and the tensor-core kernels forced on a decode-sized batch.
//
// Tolerance: PERF.md's bf16 elementwise bound (|x - ref| <= 2e-2 |ref| + 2e-2 rms(ref)) with the
// layer's looser cosine >= 0.999 (h, a, y, the LoRA deltas and out are each rounded to bf16).
// Every token is also checked on its own: its error against the reference with its own slot must
// be far below the distance to the reference with any other slot (or none), so a token that gets
// another slot's weights, or no LoRA, fails.
//
// Routing: the GPU router GEMM (bf16 x, fp32 accumulation) and the reference's fp32 logits round
// differently; inputs are drawn so that no token has a near-tie at the top-k boundary (margin
// >= 1e-4, the logits agree to ~1e-6), and the GPU's expert ids must equal the reference's.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/moe_layer_case.cuh"
#include "ops/lora/lora_mma_cuda.cuh"

namespace moelora {
namespace {

using namespace moe_layer_case;
using test::upload_vector;

class Sm90_MoeLayerBf16 : public MoeLayerCaseTest {};

TEST_F(Sm90_MoeLayerBf16, TinyQwenGatedSharedExpert) {
  run_tiny_suite(tiny_qwen_spec(true), 701);
}

TEST_F(Sm90_MoeLayerBf16, TinySharedExpertWithoutGate) {
  run_tiny_suite(tiny_qwen_spec(false), 702);
}

// DeepSeek-style: sigmoid + correction bias, 4 groups keep 2, routed scaling 2.5, ungated shared
// expert of I 32 (I not a multiple of 128 anywhere).
TEST_F(Sm90_MoeLayerBf16, TinyDeepSeekNoauxTcGroups) {
  LayerSpec s = tiny_qwen_spec(false);
  s.shared_inter = 32;
  s.router = RouterKind::kSigmoidNoauxTc;
  s.n_group = 4;
  s.topk_group = 2;
  s.routed_scaling = 2.5f;
  run_tiny_suite(s, 703);
}

// E = 12 (the other tiny router), no shared expert, and skewed routing through given logits:
// expert 5 takes (nearly) every token, far more rows than the grid's expected maximum per expert,
// so the GEMM CTAs must loop over their token tiles.
TEST_F(Sm90_MoeLayerBf16, TwelveExpertsSkewedRouting) {
  std::mt19937_64 rng(test::test_seed(704));
  LayerSpec s = tiny_qwen_spec(false);
  s.experts = 12;
  s.shared_inter = 0;
  LayerFixture lf = make_host_layer(s, rng);
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  auto a0 = make_adapter(lf.config, 16, false, rng), a1 = make_adapter(lf.config, 7, true, rng);
  layer.set_adapter(0, a0.gpu());
  layer.set_adapter(3, a1.gpu());
  std::vector<ops::MoeLoraRef> refs(4);
  refs[0] = a0.ref();
  refs[3] = a1.ref();
  for (int T : {5, 300}) {
    Tensor x = bf16_round(test::random_normal({T, 64}, rng));
    Tensor logits = test::random_normal({T, 12}, rng, 1.0f);
    for (int t = 0; t < T; ++t) logits.data<float>()[t * 12 + 5] += 3.0f;  // nearly always picked
    std::vector<int32_t> slots(T);
    for (int t = 0; t < T; ++t) slots[t] = t % 3 == 0 ? -1 : (t % 3 == 1 ? 0 : 3);
    for (auto path : {ops::cuda::GemmPath::kDecode, ops::cuda::GemmPath::kPrefill}) {
      layer.set_gemm_path(path);
      Tensor got = run(layer, x, slots, logits);
      check_against_reference(got, x, slots, lf, refs, logits,
                              "T = " + std::to_string(T) +
                                  (path == ops::cuda::GemmPath::kDecode ? " decode" : " prefill"));
    }
  }
}

// The Qwen3-30B-A3B routed shape (no shared expert): weights randomized on the device (also
// covers randomize_weights for bf16 experts) and read back for the reference.
TEST_F(Sm90_MoeLayerBf16, Qwen3MoeShape) {
  std::mt19937_64 rng(test::test_seed(705));
  LayerSpec s;
  s.hidden = 2048;
  s.inter = 768;
  s.experts = 128;
  s.top_k = 8;
  s.router = RouterKind::kSoftmaxTopK;
  s.max_tokens = 300;
  s.slots = 4;
  s.max_rank = 24;
  LayerFixture lf = make_config(s);
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());  // allocate only
  layer.randomize_weights(701);
  const auto view = layer.device_view();
  ASSERT_NE(view.w13_bf16, nullptr);
  ASSERT_EQ(view.w13, nullptr);
  const int E = s.experts, H = s.hidden, I = s.inter;
  lf.ref.w13 = download_bf16(view.w13_bf16, {E, 2 * I, H});
  lf.ref.w2 = download_bf16(view.w2_bf16, {E, H, I});
  lf.ref.router = download_bf16(view.router, {E, H});
  ASSERT_EQ(layer.expert_bytes(), 3ull * H * I * 2);

  std::vector<HostAdapter> adapters(4);
  std::vector<ops::MoeLoraRef> refs(4);
  const int ranks[4] = {16, 8, 0, 24};
  for (int slot : {0, 1, 3}) {
    adapters[slot] = make_adapter(lf.config, ranks[slot], /*shared_outer=*/slot == 1, rng);
    layer.set_adapter(slot, adapters[slot].gpu());
    refs[slot] = adapters[slot].ref();
  }
  const int pattern[4] = {0, -1, 3, 1};
  for (int T : {1, 5, 64, 300}) {
    Tensor x = draw_x(T, lf, rng);
    std::vector<int32_t> slots(T);
    for (int t = 0; t < T; ++t) slots[t] = pattern[(t + T) % 4];
    const std::string what = "T = " + std::to_string(T);
    layer.set_gemm_path(ops::cuda::GemmPath::kAuto);
    Tensor got = run(layer, x, slots);
    expect_reference_routing(layer, x, lf, what);
    check_against_reference(got, x, slots, lf, refs, Tensor(), what);
    if (T == 64 || T == 300) {  // the tile kAuto did not pick
      layer.set_gemm_path(T == 64 ? ops::cuda::GemmPath::kPrefill : ops::cuda::GemmPath::kDecode);
      Tensor other = run(layer, x, slots);
      EXPECT_EQ(test::max_abs_diff(other, got), 0.0) << what << ": the two GEMM tiles differ";
    }
  }
}

// CUDA graphs in bf16 mode: capture per batch bucket once; replay with new inputs, slot maps and
// adapters written into the pool between replays (and padding tokens past the device count);
// each replay equals an eager run bitwise and the reference.
TEST_F(Sm90_MoeLayerBf16, GraphReplaysMatchEager) {
  std::mt19937_64 rng(test::test_seed(706));
  LayerSpec s = tiny_qwen_spec(true);
  s.max_tokens = 64;
  s.slots = 4;
  LayerFixture lf = make_host_layer(s, rng);
  const int H = s.hidden;
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  const int ranks[4] = {16, 8, 5, 12};
  std::vector<HostAdapter> adapters;
  for (int i = 0; i < 4; ++i) adapters.push_back(make_adapter(lf.config, ranks[i], i == 2, rng));

  for (int bucket : {8, 64}) {
    cuda::DeviceBuffer x_d(static_cast<size_t>(bucket) * H * 2), s_d(bucket * 4),
        out_d(static_cast<size_t>(bucket) * H * 2), n_d(4);
    ops::cuda::MoeForwardArgs f;
    f.x = x_d.as<__nv_bfloat16>();
    f.slot = s_d.as<int32_t>();
    f.num_tokens = n_d.as<int32_t>();
    f.tokens = bucket;
    f.out = out_d.as<__nv_bfloat16>();
    for (int slot = 0; slot < 4; ++slot) layer.clear_adapter(slot);
    MOELORA_CUDA_CHECK(cudaMemset(n_d.get(), 0, 4));
    x_d.zero();
    s_d.zero();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(main_->get(), cudaStreamCaptureModeGlobal));
    layer.forward(f);
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(main_->get(), &graph));
    MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    for (int num_adapters : {1, 2, 4}) {
      std::vector<int> slot_of(4);
      std::iota(slot_of.begin(), slot_of.end(), 0);
      std::shuffle(slot_of.begin(), slot_of.end(), rng);
      std::vector<ops::MoeLoraRef> refs(4);
      for (int slot = 0; slot < 4; ++slot) layer.clear_adapter(slot);
      for (int i = 0; i < num_adapters; ++i) {
        layer.set_adapter(slot_of[i], adapters[i].gpu());
        refs[slot_of[i]] = adapters[i].ref();
      }
      const int T = bucket - (num_adapters % 3);  // some padding tokens in the bucket
      Tensor x_real = draw_x(T, lf, rng);
      Tensor x = Tensor::zeros(DType::kF32, {bucket, H});
      std::memcpy(x.data<float>(), x_real.data<float>(),
                  static_cast<size_t>(T) * H * sizeof(float));
      std::vector<int32_t> slots(bucket, -1);
      for (int t = 0; t < T; ++t)
        slots[t] = t % (num_adapters + 1) == num_adapters ? -1 : slot_of[t % (num_adapters + 1)];
      Tensor xb = x.to(DType::kBF16);
      x_d.upload(xb.raw_data(), xb.nbytes());
      s_d.upload(slots.data(), slots.size() * 4);
      const int32_t n = T;
      n_d.upload(&n, 4);
      MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_->get()));
      main_->synchronize();
      Tensor replay = cuda::to_host(out_d, DType::kBF16, {bucket, H}).to_f32().slice0(0, T).clone();
      layer.forward(f);  // eager on the same buffers
      main_->synchronize();
      side_->synchronize();
      Tensor eager = cuda::to_host(out_d, DType::kBF16, {bucket, H}).to_f32().slice0(0, T).clone();
      const std::string what =
          "bucket " + std::to_string(bucket) + ", " + std::to_string(num_adapters) + " adapters";
      EXPECT_EQ(test::max_abs_diff(replay, eager), 0.0) << what;
      std::vector<int32_t> real_slots(slots.begin(), slots.begin() + T);
      check_against_reference(replay, x_real, real_slots, lf, refs, Tensor(), what);
    }
    MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

// Prefill-sized forwards (T = 600 >= kLoraMmaMinTokens) take the tensor-core (mma) LoRA kernels:
// ~150 pair rows per expert, the shared expert's token segments of up to 600 rows. Pool rank 40
// (not a multiple of 16; the shared expert's fused gate/up target has rank 80 and slot ranks
// r + r / 2 = 24 and 60). Phases: one per-expert r16 adapter; one shared-outer r40 adapter through
// the single-adapter path (dense cuBLAS shrinks, mma expands reading u through the row map) and
// the segmented path; three adapters (per-expert r40 and r16, shared-outer r40) with base tokens
// and an empty slot. Each must match the reference per token and the CUDA-core LoRA kernels.
TEST_F(Sm90_MoeLayerBf16, PrefillLoraTensorCorePath) {
  std::mt19937_64 rng(test::test_seed(708));
  LayerSpec s;
  s.hidden = 200;
  s.inter = 72;
  s.experts = 8;
  s.top_k = 2;
  s.shared_inter = 96;
  s.shared_gate = true;
  s.router = RouterKind::kSoftmaxTopK;
  s.max_tokens = 600;
  s.slots = 4;
  s.max_rank = 40;
  LayerFixture lf = make_host_layer(s, rng);
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  std::vector<HostAdapter> adapters(4);
  adapters[0] = make_adapter(lf.config, 40, /*shared_outer=*/false, rng);
  adapters[1] = make_adapter(lf.config, 16, /*shared_outer=*/false, rng);
  adapters[3] = make_adapter(lf.config, 40, /*shared_outer=*/true, rng);
  struct Phase {
    std::vector<int> slots;  // filled pool slots; tokens cycle through them and -1
    int single_slot;
    std::string what;
  };
  const std::vector<Phase> phases = {
      {{1}, -1, "1 adapter (per-expert r16)"},
      {{3}, 3, "1 adapter (shared-outer r40), single-adapter path"},
      {{3}, -1, "1 adapter (shared-outer r40), segmented path"},
      {{0, 1, 3}, -1, "3 adapters"},
  };
  for (const Phase& ph : phases) {
    std::vector<ops::MoeLoraRef> refs(4);
    for (int slot = 0; slot < 4; ++slot) layer.clear_adapter(slot);
    for (int slot : ph.slots) {
      layer.set_adapter(slot, adapters[slot].gpu());
      refs[slot] = adapters[slot].ref();
    }
    for (int T : {600, 37}) {
      Tensor x = bf16_round(test::random_normal({T, s.hidden}, rng));
      Tensor logits = test::random_normal({T, s.experts}, rng, 3.0f);
      std::vector<int32_t> slots(T);
      const int cycle = static_cast<int>(ph.slots.size()) + (ph.slots.size() > 1 ? 2 : 1);
      for (int t = 0; t < T; ++t) {
        const int i = (t * 7 + 3) % cycle;  // base tokens (and the empty slot 2 with 3 adapters)
        slots[t] = i < static_cast<int>(ph.slots.size())
                       ? ph.slots[i]
                       : (i == static_cast<int>(ph.slots.size()) ? -1 : 2);
      }
      const std::string what = ph.what + ", T = " + std::to_string(T);
      // T = 600: kAuto takes the mma kernels; T = 37: they are forced on a decode-sized batch
      layer.set_lora_path(T >= ops::cuda::kLoraMmaMinTokens ? ops::cuda::LoraPath::kAuto
                                                            : ops::cuda::LoraPath::kTensorCore);
      Tensor mma = run(layer, x, slots, logits, true, ph.single_slot);
      check_against_reference(mma, x, slots, lf, refs, logits, what + ", tensor-core LoRA");
      layer.set_lora_path(ops::cuda::LoraPath::kCudaCore);
      Tensor core = run(layer, x, slots, logits, true, ph.single_slot);
      layer.set_lora_path(ops::cuda::LoraPath::kAuto);
      EXPECT_TRUE(test::close_bf16(mma, core)) << what << ": tensor-core vs CUDA-core LoRA";
      for (int t = 0; t < T; ++t)
        EXPECT_LT(row_rel_error(mma, core, t), 0.02) << what << ": token " << t;
    }
  }
}

// Configuration errors name the field and the value; bf16 experts accept I % 128 != 0.
TEST_F(Sm90_MoeLayerBf16, ConfigurationChecks) {
  std::mt19937_64 rng(test::test_seed(707));
  LayerSpec s = tiny_qwen_spec(false);
  s.shared_inter = 0;
  s.max_tokens = 4;
  LayerFixture lf = make_host_layer(s, rng);
  {
    auto c = lf.config;
    c.inter = 36;  // not a multiple of 8
    const std::string msg = test::error_message([&] {
      ops::cuda::MoeLayerCuda bad(c, ops::cuda::MoeLayerHostWeights{}, main_->get(), side_->get());
    });
    EXPECT_NE(msg.find("I = 36"), std::string::npos) << msg;
  }
  {
    auto c = lf.config;
    c.bf16_experts = false;  // FP8 experts still need I % 128 == 0
    const std::string msg = test::error_message([&] {
      ops::cuda::MoeLayerCuda bad(c, ops::cuda::MoeLayerHostWeights{}, main_->get(), side_->get());
    });
    EXPECT_NE(msg.find("I % 128"), std::string::npos) << msg;
  }
  {
    auto host = lf.host;
    host.w2 = Tensor::zeros(DType::kF32, {16, 64, 24});  // [E, H, I] with the wrong I
    const std::string msg = test::error_message(
        [&] { ops::cuda::MoeLayerCuda bad(lf.config, host, main_->get(), side_->get()); });
    EXPECT_NE(msg.find("w2"), std::string::npos) << msg;
  }
  {
    auto host = lf.host;
    host.w13 = Tensor::zeros(DType::kF8E4M3, {16, 64, 64});  // FP8 codes without scales
    const std::string msg = test::error_message(
        [&] { ops::cuda::MoeLayerCuda bad(lf.config, host, main_->get(), side_->get()); });
    EXPECT_NE(msg.find("F8_E4M3"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace moelora
