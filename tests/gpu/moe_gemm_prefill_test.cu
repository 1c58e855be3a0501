// Sm90 prefill grouped FP8 expert GEMM (CUTLASS, per-expert row counts on the device) against the
// CPU reference ops::moe_gemm_fp8_ref on random inputs: idle experts, a 1-row expert, experts
// spanning several 128-row tiles with partial last tiles, an odd number of 128-column N tiles (the
// 1x2 cluster's second CTA then has no columns), up to 64 experts, no rows at all; a CUDA graph
// replayed after expert_offsets changed on the device; argument checks.
//
// The output buffer is pre-filled with NaN and has one guard row past the last sorted position:
// a row the kernel skips fails the comparison, a row written out of range trips the guard check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "gpu/gpu_test_util.cuh"
#include "ops/gemm/moe_gemm.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora {
namespace {

constexpr uint16_t kBf16NaN = 0xFFFF;

struct Problem {
  int E, N, K;
  std::vector<int> tokens_per_expert;
};

std::vector<int32_t> offsets_of(const std::vector<int>& tokens_per_expert) {
  std::vector<int32_t> offsets(tokens_per_expert.size() + 1, 0);
  for (size_t e = 0; e < tokens_per_expert.size(); ++e) offsets[e + 1] = offsets[e] + tokens_per_expert[e];
  return offsets;
}

// Random weights quantized per expert (each expert has its own 128x128 blocks) and `rows`
// activation rows quantized per token; expert_offsets from the problem's row counts.
ops::MoeGemmFp8Ref make_inputs(const Problem& pb, int rows, std::mt19937_64& rng) {
  ops::MoeGemmFp8Ref ref;
  Tensor w = test::random_normal({pb.E * pb.N, pb.K}, rng, 0.05f);
  Tensor weight = Tensor::empty(DType::kF8E4M3, {pb.E, pb.N, pb.K});
  const int nb = (pb.N + 127) / 128, kb = pb.K / 128;
  Tensor wscale = Tensor::empty(DType::kF32, {pb.E, nb, kb});
  for (int e = 0; e < pb.E; ++e) {
    // A different magnitude per expert makes a wrong weight-scale pointer visible.
    Tensor we = w.slice0(e * pb.N, (e + 1) * pb.N);
    const float gain = 1.0f + 0.25f * static_cast<float>(e % 5);
    Tensor scaled = Tensor::empty(DType::kF32, {pb.N, pb.K});
    for (int64_t i = 0; i < scaled.numel(); ++i) scaled.data<float>()[i] = we.data<float>()[i] * gain;
    auto q = ops::quantize_fp8_block_ref(scaled);
    std::memcpy(weight.data<uint8_t>() + static_cast<size_t>(e) * pb.N * pb.K, q.q.raw_data(), q.q.nbytes());
    std::memcpy(wscale.data<float>() + static_cast<size_t>(e) * nb * kb, q.scale_inv.raw_data(),
                q.scale_inv.nbytes());
  }
  // Rows of very different magnitude make a wrong activation-scale row visible.
  Tensor x = test::random_normal({std::max(rows, 1), pb.K}, rng, 1.0f);
  std::uniform_real_distribution<float> row_gain(0.1f, 4.0f);
  for (int r = 0; r < x.dim(0); ++r) {
    const float g = row_gain(rng);
    for (int c = 0; c < pb.K; ++c) x.data<float>()[static_cast<size_t>(r) * pb.K + c] *= g;
  }
  auto xq = ops::quantize_fp8_per_token_ref(x);
  ref.act = xq.q;
  ref.act_scale = xq.scale;
  ref.weight = weight;
  ref.weight_scale = wscale;
  ref.expert_offsets = offsets_of(pb.tokens_per_expert);
  return ref;
}

// Device copies of one problem, an output of `capacity + 1` rows (the last one a guard row) and
// a workspace for E experts on every SM.
struct DeviceProblem {
  cuda::DeviceBuffer act, act_scale, weight, weight_scale, offsets, out, workspace;
  ops::cuda::MoeGemmFp8Args args;
  ops::cuda::MoeGemmPrefillWorkspace ws;
  int capacity = 0, n = 0;

  DeviceProblem(const ops::MoeGemmFp8Ref& ref, const Problem& pb)
      : act(cuda::to_device(ref.act)),
        act_scale(cuda::to_device(ref.act_scale)),
        weight(cuda::to_device(ref.weight)),
        weight_scale(cuda::to_device(ref.weight_scale)),
        offsets(test::upload_vector(ref.expert_offsets)),
        capacity(static_cast<int>(ref.act.dim(0))),
        n(pb.N) {
    out = cuda::DeviceBuffer(static_cast<size_t>(capacity + 1) * n * sizeof(uint16_t));
    fill_out_with_nan();
    const int sms = cuda::device_info(0).num_sms;
    workspace = cuda::DeviceBuffer(ops::cuda::moe_gemm_prefill_workspace_bytes(pb.E, sms));
    ws.data = workspace.get();
    ws.bytes = workspace.bytes();
    ws.num_sms = sms;
    args.act = act.as<uint8_t>();
    args.act_scale = act_scale.as<float>();
    args.gather = nullptr;
    args.weight = weight.as<uint8_t>();
    args.weight_scale = weight_scale.as<float>();
    args.expert_offsets = offsets.as<int32_t>();
    args.out = out.as<__nv_bfloat16>();
    args.num_experts = pb.E;
    args.n = pb.N;
    args.k = pb.K;
    args.max_active_experts = pb.E;
    args.max_tokens_per_expert = capacity;
  }

  void fill_out_with_nan() {
    std::vector<uint16_t> nan(static_cast<size_t>(capacity + 1) * n, kBf16NaN);
    out.upload(nan.data(), nan.size() * sizeof(uint16_t));
  }

  // The first `rows` output rows as f32; checks that no row at or past `rows` was written.
  Tensor result(int rows) const {
    std::vector<uint16_t> all(static_cast<size_t>(capacity + 1) * n);
    out.download(all.data(), all.size() * sizeof(uint16_t));
    const size_t written = static_cast<size_t>(rows) * n;
    const auto stray =
        std::find_if(all.begin() + written, all.end(), [](uint16_t v) { return v != kBf16NaN; });
    EXPECT_TRUE(stray == all.end()) << "output element " << (stray - all.begin()) << " past row " << rows
                                    << " was written";
    Tensor t = Tensor::empty(DType::kBF16, {rows, n});
    if (written) std::memcpy(t.raw_data(), all.data(), written * sizeof(uint16_t));
    return t.to_f32();
  }
};

void check_problem(const Problem& pb, uint64_t seed_fallback) {
  std::mt19937_64 rng(test::test_seed(seed_fallback));
  const int P = offsets_of(pb.tokens_per_expert).back();
  const ops::MoeGemmFp8Ref ref = make_inputs(pb, P, rng);
  const Tensor expected = ops::moe_gemm_fp8_ref(ref);
  DeviceProblem dev(ref, pb);
  ops::cuda::launch_moe_gemm_fp8_prefill(dev.args, dev.ws, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const Tensor got = dev.result(P);
  EXPECT_TRUE(test::close_bf16(got, expected))
      << "E=" << pb.E << " N=" << pb.N << " K=" << pb.K << " P=" << P;
  // Launching again with the same workspace gives the same bits (deterministic, no state kept).
  dev.fill_out_with_nan();
  ops::cuda::launch_moe_gemm_fp8_prefill(dev.args, dev.ws, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const Tensor again = dev.result(P);
  EXPECT_EQ(0, std::memcmp(again.raw_data(), got.raw_data(), got.nbytes())) << "second launch differs";
}

TEST(Sm90_MoeGemmFp8Prefill, IdleExpertsSingleRowAndPartialTiles) {
  MOELORA_REQUIRE_SM90();
  // 1 row, idle experts, 130 and 300 rows (2 and 3 row tiles, partial last ones), exactly 64 rows
  check_problem({8, 256, 512, {1, 0, 130, 0, 300, 64, 0, 17}}, 21);
}

TEST(Sm90_MoeGemmFp8Prefill, OddNTileCountMinimalK) {
  MOELORA_REQUIRE_SM90();
  // N = 384: three N tiles, so one CTA of the last 1x2 cluster per row tile has no columns; K = 128
  // is one K block (the mainloop's single-iteration path).
  check_problem({5, 384, 128, {129, 0, 3, 256, 40}}, 22);
}

TEST(Sm90_MoeGemmFp8Prefill, LeadingAndTrailingIdleExperts) {
  MOELORA_REQUIRE_SM90();
  check_problem({6, 640, 768, {0, 0, 2, 500, 0, 0}}, 23);
}

TEST(Sm90_MoeGemmFp8Prefill, SixtyFourExperts) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(24));
  std::uniform_int_distribution<int> count(0, 200);
  std::bernoulli_distribution idle(0.25);
  Problem pb{64, 768, 1024, {}};
  for (int e = 0; e < pb.E; ++e) pb.tokens_per_expert.push_back(idle(rng) ? 0 : count(rng));
  pb.tokens_per_expert[7] = 1;
  pb.tokens_per_expert[8] = 128;
  pb.tokens_per_expert[9] = 129;
  check_problem(pb, 25);
}

TEST(Sm90_MoeGemmFp8Prefill, NoRowsAtAll) {
  MOELORA_REQUIRE_SM90();
  check_problem({4, 256, 256, {0, 0, 0, 0}}, 26);
}

// The row counts reach the kernel only through device memory: a graph captured for one routing
// must give the right answer after expert_offsets is rewritten for another one.
TEST(Sm90_MoeGemmFp8Prefill, GraphReplayAfterRoutingChange) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(27));
  const Problem first{16, 512, 512, {40, 0, 200, 1, 0, 0, 77, 130, 0, 12, 0, 0, 90, 0, 30, 0}};
  const Problem second{16, 512, 512, {0, 150, 0, 0, 256, 1, 0, 3, 0, 0, 0, 64, 0, 0, 0, 0}};
  const int capacity = offsets_of(first.tokens_per_expert).back();  // 600 rows
  ASSERT_LE(offsets_of(second.tokens_per_expert).back(), capacity);
  ops::MoeGemmFp8Ref ref = make_inputs(first, capacity, rng);
  DeviceProblem dev(ref, first);

  cuda::Stream stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  ops::cuda::launch_moe_gemm_fp8_prefill(dev.args, dev.ws, stream.get());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (const Problem* pb : {&first, &second, &first}) {
    ref.expert_offsets = offsets_of(pb->tokens_per_expert);
    const int P = ref.expert_offsets.back();
    dev.offsets.upload(ref.expert_offsets.data(), ref.expert_offsets.size() * sizeof(int32_t));
    dev.fill_out_with_nan();
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.synchronize();
    // The reference reads act rows [0, P) only; the device buffer keeps all `capacity` rows.
    // result() also checks that rows [P, capacity] were left alone.
    const Tensor expected = ops::moe_gemm_fp8_ref(ref);
    const Tensor got = dev.result(P);
    EXPECT_TRUE(test::close_bf16(got, expected)) << "replay with P = " << P;
  }
  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
}

TEST(Sm90_MoeGemmFp8Prefill, RejectsUnsupportedArguments) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(28));
  const Problem pb{2, 256, 256, {3, 4}};
  const ops::MoeGemmFp8Ref ref = make_inputs(pb, 7, rng);
  DeviceProblem dev(ref, pb);

  ops::cuda::MoeGemmFp8Args a = dev.args;
  a.n = 200;  // not a multiple of 128
  EXPECT_THROW(ops::cuda::launch_moe_gemm_fp8_prefill(a, dev.ws, nullptr), Error);

  a = dev.args;
  a.gather = dev.offsets.as<int32_t>();  // prefill rows must be pre-permuted
  EXPECT_THROW(ops::cuda::launch_moe_gemm_fp8_prefill(a, dev.ws, nullptr), Error);

  a = dev.args;
  a.k = 200;  // not a multiple of 128
  EXPECT_THROW(ops::cuda::launch_moe_gemm_fp8_prefill(a, dev.ws, nullptr), Error);

  ops::cuda::MoeGemmPrefillWorkspace small = dev.ws;
  small.bytes = ops::cuda::moe_gemm_prefill_workspace_bytes(pb.E, dev.ws.num_sms) - 1;
  EXPECT_THROW(ops::cuda::launch_moe_gemm_fp8_prefill(dev.args, small, nullptr), Error);

  ops::cuda::MoeGemmPrefillWorkspace more_sms = dev.ws;  // sized for fewer SMs than it claims
  more_sms.num_sms = dev.ws.num_sms * 4;
  EXPECT_THROW(ops::cuda::launch_moe_gemm_fp8_prefill(dev.args, more_sms, nullptr), Error);

  EXPECT_THROW(ops::cuda::moe_gemm_prefill_workspace_bytes(0, dev.ws.num_sms), Error);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());  // nothing was launched
}

}  // namespace
}  // namespace moelora
