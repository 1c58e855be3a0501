// Sm90 NVFP4 expert GEMM (launch_moe_gemm_nvfp4_stream) and its f16 activation rows
// (launch_rows_to_f16_pow2) against the CPU references of ops/gemm/moe_gemm_nvfp4.h on random
// inputs: ModelOpt-quantized experts with a different scale_2 per gate / up half, all-zero and
// tiny groups (zero and subnormal e4m3 scales), idle experts, experts with 1..70 tokens (every
// pass width, several passes), prefill passes of 1..300 tokens (every width up to 128, tails),
// rows past the sorted positions holding NaN, programmatic launch, the three instances (64- and
// 128-row decode items, 256-row prefill pass items) and claimed work items bit-equal to
// round-robin, graph replays bit-equal to eager launches, refusals. The W4A8 decode GEMM
// (launch_moe_gemm_nvfp4_w4a8) and its e4m3 rows (launch_rows_to_e4m3_pow2) the same way: the rows
// bit-exact, the GEMM against moe_gemm_nvfp4_ref on the dequantized e4m3 rows, every token count
// up to 8 and experts of several 8-token passes, claimed items bit-equal to round-robin, graph
// replays, refusals.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/gemm/moe_gemm_nvfp4.h"
#include "ops/quant/quant.h"
#include "ops/quant/quant_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

struct Problem {
  int E, N, K;
  std::vector<int> tokens_per_expert;
};

struct Case {
  ops::MoeGemmNvfp4Ref ref;  // act: bf16 rows in sorted order
  std::vector<int32_t> active;
};

Case make_case(const Problem& pb, std::mt19937_64& rng) {
  Case c;
  const int E = pb.E, N = pb.N, K = pb.K;
  c.ref.packed = Tensor::empty(DType::kU8, {E, N, K / 2});
  c.ref.scale = Tensor::empty(DType::kF8E4M3, {E, N, K / 16});
  c.ref.row_scale = Tensor::empty(DType::kF32, {E, N});
  for (int e = 0; e < E; ++e)
    for (int half = 0; half < 2; ++half) {
      Tensor w =
          test::random_normal({N / 2, K}, rng, 0.03f * static_cast<float>(1 + 2 * half + e % 3));
      // an all-zero group (scale 0) and a tiny one (subnormal e4m3 scale) in every half
      for (int k = 0; k < 16; ++k) w.data<float>()[(1 % (N / 2)) * K + 16 + k] = 0.0f;
      for (int k = 0; k < 16; ++k) w.data<float>()[(2 % (N / 2)) * K + 32 + k] *= 1e-5f;
      const ops::Nvfp4Weight q = ops::quantize_nvfp4_ref(w);
      const int64_t row0 = static_cast<int64_t>(e) * N + half * (N / 2);
      std::memcpy(c.ref.packed.data<uint8_t>() + row0 * (K / 2), q.packed.raw_data(),
                  q.packed.nbytes());
      std::memcpy(c.ref.scale.data<uint8_t>() + row0 * (K / 16), q.scale.raw_data(),
                  q.scale.nbytes());
      for (int n = 0; n < N / 2; ++n) c.ref.row_scale.data<float>()[row0 + n] = q.scale_2;
    }
  c.ref.expert_offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    c.ref.expert_offsets[e + 1] = c.ref.expert_offsets[e] + pb.tokens_per_expert[e];
    if (pb.tokens_per_expert[e] > 0) c.active.push_back(e);
  }
  const int P = c.ref.expert_offsets.back();
  Tensor x = test::random_normal({std::max(P, 1), K}, rng, 1.0f);
  // rows of very different magnitudes: each gets its own power-of-two scale
  for (int q = 0; q < P; ++q) {
    const float m = std::ldexp(1.0f, (q * 7) % 23 - 11);
    for (int k = 0; k < K; ++k) x.data<float>()[static_cast<int64_t>(q) * K + k] *= m;
  }
  c.ref.act = x.to(DType::kBF16);
  return c;
}

// Device buffers of one problem: the weight image, the f16 rows (written by the conversion kernel
// from the bf16 rows, checked bit-exact against its reference), `slack` rows past P holding NaN.
struct DeviceCase {
  cuda::DeviceBuffer x, act, act_scale, weight, row_scale, offsets, active, num_active, out;
  ops::cuda::MoeGemmNvfp4Args args;
  int P = 0;
};

DeviceCase upload_case(const Case& c, const Problem& pb, int slack, cudaStream_t stream) {
  using test::upload_vector;
  DeviceCase d;
  d.P = c.ref.expert_offsets.back();
  const int rows = d.P + slack;
  d.x = cuda::to_device(c.ref.act);
  std::vector<uint16_t> nan_rows(static_cast<size_t>(std::max(rows, 1)) * pb.K, 0x7e00);  // f16 NaN
  d.act = upload_vector(nan_rows);
  d.act_scale =
      upload_vector(std::vector<float>(std::max(rows, 1), std::numeric_limits<float>::quiet_NaN()));
  ops::cuda::RowsToF16Args conv;
  conv.x = d.x.as<__nv_bfloat16>();
  conv.max_rows = d.P;
  conv.cols = pb.K;
  conv.out = d.act.as<__half>();
  conv.scale = d.act_scale.as<float>();
  ops::cuda::launch_rows_to_f16_pow2(conv, stream);
  d.weight = cuda::to_device(ops::pack_nvfp4_for_stream(c.ref.packed, c.ref.scale));
  d.row_scale = cuda::to_device(c.ref.row_scale);
  d.offsets = upload_vector(c.ref.expert_offsets);
  std::vector<int32_t> active(pb.E, -1);
  std::copy(c.active.begin(), c.active.end(), active.begin());
  d.active = upload_vector(active);
  d.num_active = upload_vector(std::vector<int32_t>{static_cast<int32_t>(c.active.size())});
  d.out = cuda::DeviceBuffer(static_cast<size_t>(std::max(d.P, 1)) * pb.N * 2);
  ops::cuda::MoeGemmNvfp4Args& a = d.args;
  a.act = d.act.as<__half>();
  a.act_scale = d.act_scale.as<float>();
  a.weight = d.weight.as<uint8_t>();
  a.row_scale = d.row_scale.as<float>();
  a.expert_offsets = d.offsets.as<int32_t>();
  a.active_experts = d.active.as<int32_t>();
  a.num_active = d.num_active.as<int32_t>();
  a.out = d.out.as<__nv_bfloat16>();
  a.num_experts = pb.E;
  a.n = pb.N;
  a.k = pb.K;
  a.max_active_experts = pb.E;
  a.act_rows = std::max(rows, 1);
  return d;
}

void check_problem(const Problem& pb, uint64_t seed_fallback) {
  std::mt19937_64 rng(test::test_seed(seed_fallback));
  const Case c = make_case(pb, rng);
  const Tensor expected = ops::moe_gemm_nvfp4_ref(c.ref);
  const int P = c.ref.expert_offsets.back();
  const int sms = cuda::device_info(0).num_sms;
  cuda::DeviceBuffer counters(2 * sizeof(int32_t));
  MOELORA_CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
  for (int slack : {0, 40}) {
    for (bool pdl : {false, true}) {
      cuda::Stream stream;
      DeviceCase d = upload_case(c, pb, slack, stream.get());
      stream.synchronize();
      // the conversion kernel against its reference, bit for bit
      const ops::F16Rows want_rows = ops::rows_to_f16_pow2_ref(c.ref.act, {}, P);
      EXPECT_EQ(test::download_vector<uint16_t>(d.act, static_cast<size_t>(P) * pb.K),
                std::vector<uint16_t>(want_rows.rows.data<uint16_t>(),
                                      want_rows.rows.data<uint16_t>() + P * pb.K));
      EXPECT_EQ(
          test::download_vector<float>(d.act_scale, P),
          std::vector<float>(want_rows.scale.data<float>(), want_rows.scale.data<float>() + P));
      // launches 0-2: 64-row items (one warpgroup per CTA), 3-5: 128-row items (two), 6-8 where N
      // allows: the prefill instance (256-row x 128-token pass items); every pair of instances and
      // schedules must give the same bits (the same k16 steps in the same order per output)
      std::vector<uint16_t> round_robin;
      const int launches = pb.N % 256 == 0 ? 9 : 6;
      for (int launch = 0; launch < launches; ++launch) {
        const bool claimed = launch % 3 > 0;
        ops::cuda::MoeGemmNvfp4Args args = d.args;
        args.max_tokens_per_expert = launch < 3   ? 8
                                     : launch < 6 ? 32
                                                  : ops::cuda::kNvfp4PrefillMinTokens + 1;
        if (claimed) args.work_counters = counters.as<int32_t>();
        MOELORA_CUDA_CHECK(cudaMemsetAsync(d.out.get(), 0xff, d.out.bytes(), stream.get()));
        ops::cuda::launch_moe_gemm_nvfp4_stream(args, sms, pdl, stream.get());
        stream.synchronize();
        const std::string what = "E=" + std::to_string(pb.E) + " N=" + std::to_string(pb.N) +
                                 " K=" + std::to_string(pb.K) + " slack=" + std::to_string(slack) +
                                 " pdl=" + std::to_string(pdl) + " launch " +
                                 std::to_string(launch);
        const Tensor got = cuda::to_host(d.out, DType::kBF16, {P, pb.N}).to_f32();
        EXPECT_TRUE(test::close_bf16(got, expected, 0.99999)) << what;
        const auto bits = test::download_vector<uint16_t>(d.out, static_cast<size_t>(P) * pb.N);
        if (launch == 0)
          round_robin = bits;
        else
          EXPECT_EQ(bits, round_robin)
              << what << ": every instance and schedule must give the same bits";
        if (claimed)
          EXPECT_EQ(test::download_vector<int32_t>(counters, 2), (std::vector<int32_t>{0, 0}))
              << what << ": the work counters must be left zeroed";
      }
    }
  }
}

TEST(Sm90_MoeGemmNvfp4Stream, EveryPassWidthAndSeveralPasses) {
  MOELORA_REQUIRE_SM90();
  check_problem({6, 128, 256, {1, 0, 9, 17, 33, 70}}, 81);
}

TEST(Sm90_MoeGemmNvfp4Stream, PrefillPassesEveryWidthAndTails) {
  MOELORA_REQUIRE_SM90();
  // 300 tokens: passes of 128, 128 and 44 (N = 64); 129: 128 + 1 (N = 8); 65: one pass of N = 96,
  // 97: one of N = 128
  check_problem({7, 512, 384, {300, 0, 129, 65, 5, 17, 97}}, 85);
}

TEST(Sm90_MoeGemmNvfp4Stream, PrefillGemm2ShapeManyItems) {
  MOELORA_REQUIRE_SM90();
  // GEMM2 of a small MoE (N = H = 1024, K = I = 256) at prefill: 8 experts of 90-250 tokens, more
  // pass items than CTAs
  check_problem({8, 1024, 256, {90, 250, 131, 0, 200, 128, 97, 160}}, 86);
}

TEST(Sm90_MoeGemmNvfp4Stream, DecodeShapesManyExperts) {
  MOELORA_REQUIRE_SM90();
  // Qwen3.5-35B-A3B's GEMM1 (N = 2 x 512, K = 2048) over 64 experts, 1..4 tokens each
  std::vector<int> tokens(64);
  for (int e = 0; e < 64; ++e) tokens[e] = e % 5;
  check_problem({64, 1024, 2048, tokens}, 82);
}

TEST(Sm90_MoeGemmNvfp4Stream, DecodeManyExpertsSomeWithTwoPasses) {
  MOELORA_REQUIRE_SM90();
  // Kimi-K2.5's EP8 rank at 128 tokens in miniature: 48 experts of 14..45 tokens, so a third have
  // a second 32-token pass, more items than CTAs
  std::vector<int> tokens(48);
  for (int e = 0; e < 48; ++e) tokens[e] = 14 + (e * 7) % 32;
  check_problem({48, 512, 512, tokens}, 87);
}

TEST(Sm90_MoeGemmNvfp4Stream, NarrowKWideN) {
  MOELORA_REQUIRE_SM90();
  // GEMM2's shape: K = one stage, N wide
  check_problem({3, 2048, 128, {2, 8, 31}}, 83);
}

TEST(Sm90_MoeGemmNvfp4Stream, GraphReplayBitEqualToEager) {
  MOELORA_REQUIRE_SM90();
  const Problem pb{5, 256, 512, {3, 0, 12, 1, 140}};
  std::mt19937_64 rng(test::test_seed(84));
  const Case c = make_case(pb, rng);
  const int sms = cuda::device_info(0).num_sms;
  cuda::Stream stream;
  DeviceCase d = upload_case(c, pb, 8, stream.get());
  for (int max_tokens :
       {8, ops::cuda::kNvfp4PrefillMinTokens + 1}) {  // a decode and the prefill instance
    ops::cuda::MoeGemmNvfp4Args args = d.args;
    args.max_tokens_per_expert = max_tokens;
    ops::cuda::launch_moe_gemm_nvfp4_stream(args, sms, true, stream.get());
    stream.synchronize();
    const auto eager = test::download_vector<uint16_t>(d.out, static_cast<size_t>(d.P) * pb.N);
    MOELORA_CUDA_CHECK(cudaMemset(d.out.get(), 0, d.out.bytes()));
    cudaGraph_t graph = nullptr;
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
    ops::cuda::launch_moe_gemm_nvfp4_stream(args, sms, true, stream.get());
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
    cudaGraphExec_t exec = nullptr;
    MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
      stream.synchronize();
      EXPECT_EQ(test::download_vector<uint16_t>(d.out, static_cast<size_t>(d.P) * pb.N), eager)
          << "max_tokens_per_expert " << max_tokens << ", replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// The activation-row kernels of both NVFP4 GEMMs against their references, bit for bit: gathered
// rows (one repeated), a zero row, a row with one huge value, rows past the device row count left
// untouched; then a refusal. Bits: the stored element type (uint16_t for f16, uint8_t for e4m3).
// cols picks the kernel's form (rows held in registers, 1 / 2 / 4 / 8 vectors per thread, or read
// twice past 8192 columns); the huge value sits in the row's last vector, which only the widest
// thread of the form holds.
template <class Bits, class Args, class Rows>
void check_rows_kernel(void (*launch)(const Args&, cudaStream_t),
                       Rows (*reference)(const Tensor&, const std::vector<int32_t>&, int64_t),
                       uint64_t seed_fallback, int cols = 520) {
  SCOPED_TRACE("cols " + std::to_string(cols));
  std::mt19937_64 rng(test::test_seed(seed_fallback));
  Tensor x = test::random_normal({6, cols}, rng, 50.0f);
  for (int k = 0; k < cols; ++k) x.data<float>()[2 * cols + k] = 0.0f;
  x.data<float>()[4 * cols + cols - 3] = 3.0e5f;
  x.data<float>()[1 * cols + 7] = 448.0f;
  x = x.to(DType::kBF16);
  const std::vector<int32_t> gather = {5, 2, 4, 4, 0, 1, 3};
  const int valid = 5;  // rows 5 and 6 must stay untouched
  auto xd = cuda::to_device(x);
  auto gd = test::upload_vector(gather);
  auto nd = test::upload_vector(std::vector<int32_t>{valid});
  cuda::DeviceBuffer out(7 * cols * sizeof(Bits)), scale(7 * 4);
  MOELORA_CUDA_CHECK(cudaMemset(out.get(), 0x11, out.bytes()));
  MOELORA_CUDA_CHECK(cudaMemset(scale.get(), 0x22, scale.bytes()));
  Args a;
  a.x = xd.as<__nv_bfloat16>();
  a.gather = gd.as<int32_t>();
  a.num_rows = nd.as<int32_t>();
  a.max_rows = 7;
  a.cols = cols;
  a.out = reinterpret_cast<decltype(a.out)>(out.get());
  a.scale = scale.as<float>();
  launch(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const Rows want = reference(x, {gather.begin(), gather.begin() + valid}, valid);
  const auto got = test::download_vector<Bits>(out, 7 * cols);
  const auto got_scale = test::download_vector<float>(scale, 7);
  EXPECT_EQ(std::vector<Bits>(got.begin(), got.begin() + valid * cols),
            std::vector<Bits>(want.rows.template data<Bits>(),
                              want.rows.template data<Bits>() + valid * cols));
  EXPECT_EQ(std::vector<float>(got_scale.begin(), got_scale.begin() + valid),
            std::vector<float>(want.scale.template data<float>(),
                               want.scale.template data<float>() + valid));
  Bits untouched;
  std::memset(&untouched, 0x11, sizeof untouched);
  for (size_t i = valid * cols; i < got.size(); ++i)
    ASSERT_EQ(got[i], untouched) << "row past the count written";
  a.cols = 12;
  EXPECT_THROW(launch(a, nullptr), Error);
}

TEST(Sm90_RowsToF16Pow2, GatheredRowsAndDeviceRowCount) {
  MOELORA_REQUIRE_SM90();
  check_rows_kernel<uint16_t>(ops::cuda::launch_rows_to_f16_pow2, ops::rows_to_f16_pow2_ref, 85);
}

// Each register form of the kernel and the two-read form past 8192 columns (the widths that
// cross a form's bound, and the models' 2048 / 7168 hidden sizes).
TEST(Sm90_RowsToF16Pow2, EveryRowLengthForm) {
  MOELORA_REQUIRE_SM90();
  for (int cols : {8, 1024, 1032, 2048, 3000, 4096, 4104, 7168, 8192, 8200, 10240})
    check_rows_kernel<uint16_t>(ops::cuda::launch_rows_to_f16_pow2, ops::rows_to_f16_pow2_ref, 87,
                                cols);
}

TEST(Sm90_MoeGemmNvfp4Stream, RefusesBadArguments) {
  MOELORA_REQUIRE_SM90();
  const Problem pb{2, 128, 128, {1, 1}};
  std::mt19937_64 rng(test::test_seed(86));
  const Case c = make_case(pb, rng);
  DeviceCase d = upload_case(c, pb, 0, nullptr);
  const int sms = cuda::device_info(0).num_sms;
  auto expect_refusal = [&](ops::cuda::MoeGemmNvfp4Args a, const std::string& needle) {
    try {
      ops::cuda::launch_moe_gemm_nvfp4_stream(a, sms, false, nullptr);
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ops::cuda::MoeGemmNvfp4Args a = d.args;
  a.n = 64;
  expect_refusal(a, "N = 64");
  a = d.args;
  a.k = 192;
  expect_refusal(a, "K = 192");
  a = d.args;
  a.row_scale = nullptr;
  expect_refusal(a, "row_scale");
  a = d.args;
  a.num_experts = 600;
  a.max_active_experts = 600;
  expect_refusal(a, "E = 600");
  a = d.args;
  a.max_active_experts = 3;
  expect_refusal(a, "max_active_experts = 3");
  a = d.args;  // N = 128
  a.instance = ops::cuda::Nvfp4StreamInstance::kPrefill;
  expect_refusal(a, "the prefill instance needs N a multiple of 256; N = 128");
}

// The instance rule (host only): the expected tokens of the busiest expert pick narrow (<= 16),
// wide (17..64, or more where N is not a multiple of 256) or prefill; a forced instance is kept.
TEST(Sm90_MoeGemmNvfp4Stream, InstanceRuleAndForcedInstances) {
  using ops::cuda::Nvfp4StreamInstance;
  ops::cuda::MoeGemmNvfp4Args a;
  a.n = 512;
  const std::vector<std::pair<int, Nvfp4StreamInstance>> rule = {
      {1, Nvfp4StreamInstance::kNarrow},
      {16, Nvfp4StreamInstance::kNarrow},
      {17, Nvfp4StreamInstance::kWide},
      {ops::cuda::kNvfp4PrefillMinTokens, Nvfp4StreamInstance::kWide},
      {ops::cuda::kNvfp4PrefillMinTokens + 1, Nvfp4StreamInstance::kPrefill}};
  for (const auto& [tokens, want] : rule) {
    a.max_tokens_per_expert = tokens;
    EXPECT_EQ(ops::cuda::nvfp4_stream_instance(a), want) << tokens << " tokens";
  }
  a.n = 384;  // no 256-row tiles: wide above 16 tokens
  EXPECT_EQ(ops::cuda::nvfp4_stream_instance(a), Nvfp4StreamInstance::kWide);
  a.max_tokens_per_expert = 1;
  for (Nvfp4StreamInstance forced : {Nvfp4StreamInstance::kNarrow, Nvfp4StreamInstance::kWide}) {
    a.instance = forced;
    EXPECT_EQ(ops::cuda::nvfp4_stream_instance(a), forced);
  }
  a.n = 512;
  a.instance = Nvfp4StreamInstance::kPrefill;
  EXPECT_EQ(ops::cuda::nvfp4_stream_instance(a), Nvfp4StreamInstance::kPrefill);
}

// ---- W4A8 ----

// The problem's e4m3 rows by the conversion kernel (bit for bit against rows_to_e4m3_pow2_ref),
// rows past P holding e4m3 NaN, the W4A8 image, and the GEMM against moe_gemm_nvfp4_ref on the
// dequantized rows (the same e4m3 values times the same codes and scales; only the order of the
// fp32 sums differs), eagerly and programmatically, round-robin and claimed (the same bits).
struct DeviceW4a8Case {
  DeviceCase base;  // the routing, row scales and output buffers (its f16 rows go unused)
  cuda::DeviceBuffer act, act_scale, weight;
  ops::cuda::MoeGemmNvfp4W4a8Args args;
};

DeviceW4a8Case upload_w4a8_case(const Case& c, const Problem& pb, int slack, cudaStream_t stream) {
  DeviceW4a8Case d{upload_case(c, pb, slack, stream), {}, {}, {}, {}};
  const int rows = d.base.P + slack;
  d.act = test::upload_vector(
      std::vector<uint8_t>(static_cast<size_t>(std::max(rows, 1)) * pb.K, 0x7f));
  d.act_scale = test::upload_vector(
      std::vector<float>(std::max(rows, 1), std::numeric_limits<float>::quiet_NaN()));
  ops::cuda::RowsToE4m3Args conv;
  conv.x = d.base.x.as<__nv_bfloat16>();
  conv.max_rows = d.base.P;
  conv.cols = pb.K;
  conv.out = d.act.as<uint8_t>();
  conv.scale = d.act_scale.as<float>();
  ops::cuda::launch_rows_to_e4m3_pow2(conv, stream);
  d.weight = cuda::to_device(ops::pack_nvfp4_for_w4a8(c.ref.packed, c.ref.scale));
  const ops::cuda::MoeGemmNvfp4Args& f = d.base.args;
  ops::cuda::MoeGemmNvfp4W4a8Args& a = d.args;
  a.act = d.act.as<uint8_t>();
  a.act_scale = d.act_scale.as<float>();
  a.weight = d.weight.as<uint8_t>();
  a.row_scale = f.row_scale;
  a.expert_offsets = f.expert_offsets;
  a.active_experts = f.active_experts;
  a.num_active = f.num_active;
  a.out = f.out;
  a.num_experts = f.num_experts;
  a.n = f.n;
  a.k = f.k;
  a.max_active_experts = f.max_active_experts;
  a.act_rows = f.act_rows;
  return d;
}

void check_w4a8_problem(const Problem& pb, uint64_t seed_fallback) {
  std::mt19937_64 rng(test::test_seed(seed_fallback));
  const Case c = make_case(pb, rng);
  const int P = c.ref.expert_offsets.back();
  const ops::E4m3Rows want_rows = ops::rows_to_e4m3_pow2_ref(c.ref.act, {}, P);
  ops::MoeGemmNvfp4Ref ref = c.ref;
  ref.act = ops::e4m3_rows_dequantized(want_rows);
  const Tensor expected = ops::moe_gemm_nvfp4_ref(ref);
  const int sms = cuda::device_info(0).num_sms;
  cuda::DeviceBuffer counters(2 * sizeof(int32_t));
  MOELORA_CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
  for (int slack : {0, 24}) {
    for (bool pdl : {false, true}) {
      cuda::Stream stream;
      DeviceW4a8Case d = upload_w4a8_case(c, pb, slack, stream.get());
      stream.synchronize();
      EXPECT_EQ(test::download_vector<uint8_t>(d.act, static_cast<size_t>(P) * pb.K),
                std::vector<uint8_t>(want_rows.rows.data<uint8_t>(),
                                     want_rows.rows.data<uint8_t>() + P * pb.K));
      EXPECT_EQ(
          test::download_vector<float>(d.act_scale, P),
          std::vector<float>(want_rows.scale.data<float>(), want_rows.scale.data<float>() + P));
      std::vector<uint16_t> round_robin;
      for (int launch = 0; launch < 3; ++launch) {
        const bool claimed = launch > 0;
        ops::cuda::MoeGemmNvfp4W4a8Args args = d.args;
        if (claimed) args.work_counters = counters.as<int32_t>();
        MOELORA_CUDA_CHECK(
            cudaMemsetAsync(d.base.out.get(), 0xff, d.base.out.bytes(), stream.get()));
        ops::cuda::launch_moe_gemm_nvfp4_w4a8(args, sms, pdl, stream.get());
        stream.synchronize();
        const std::string what = "W4A8 E=" + std::to_string(pb.E) + " N=" + std::to_string(pb.N) +
                                 " K=" + std::to_string(pb.K) + " slack=" + std::to_string(slack) +
                                 " pdl=" + std::to_string(pdl) + " launch " +
                                 std::to_string(launch);
        const Tensor got = cuda::to_host(d.base.out, DType::kBF16, {P, pb.N}).to_f32();
        EXPECT_TRUE(test::close_bf16(got, expected, 0.99999)) << what;
        const auto bits =
            test::download_vector<uint16_t>(d.base.out, static_cast<size_t>(P) * pb.N);
        if (launch == 0)
          round_robin = bits;
        else
          EXPECT_EQ(bits, round_robin) << what << ": claimed items must give the round-robin bits";
        if (claimed)
          EXPECT_EQ(test::download_vector<int32_t>(counters, 2), (std::vector<int32_t>{0, 0}))
              << what << ": the work counters must be left zeroed";
      }
    }
  }
}

TEST(Sm90_MoeGemmNvfp4W4a8, EveryTokenCountAndSeveralPasses) {
  MOELORA_REQUIRE_SM90();
  // 1..8 tokens: one pass; 9, 17, 40: two, three and five passes of 8
  check_w4a8_problem({7, 128, 256, {1, 0, 8, 9, 17, 3, 40}}, 91);
}

TEST(Sm90_MoeGemmNvfp4W4a8, DecodeShapesManyExperts) {
  MOELORA_REQUIRE_SM90();
  // Qwen3.5-35B-A3B's GEMM1 (N = 2 x 512, K = 2048) over 64 experts, 0..4 tokens each
  std::vector<int> tokens(64);
  for (int e = 0; e < 64; ++e) tokens[e] = e % 5;
  check_w4a8_problem({64, 1024, 2048, tokens}, 92);
}

TEST(Sm90_MoeGemmNvfp4W4a8, NarrowKWideN) {
  MOELORA_REQUIRE_SM90();
  check_w4a8_problem({3, 2048, 128, {2, 8, 5}}, 93);  // GEMM2's shape: K = one stage
}

TEST(Sm90_MoeGemmNvfp4W4a8, GraphReplayBitEqualToEager) {
  MOELORA_REQUIRE_SM90();
  const Problem pb{5, 256, 512, {3, 0, 12, 1, 7}};
  std::mt19937_64 rng(test::test_seed(94));
  const Case c = make_case(pb, rng);
  const int sms = cuda::device_info(0).num_sms;
  cuda::Stream stream;
  DeviceW4a8Case d = upload_w4a8_case(c, pb, 8, stream.get());
  const size_t values = static_cast<size_t>(d.base.P) * pb.N;
  ops::cuda::launch_moe_gemm_nvfp4_w4a8(d.args, sms, true, stream.get());
  stream.synchronize();
  const auto eager = test::download_vector<uint16_t>(d.base.out, values);
  MOELORA_CUDA_CHECK(cudaMemset(d.base.out.get(), 0, d.base.out.bytes()));
  cudaGraph_t graph = nullptr;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  ops::cuda::launch_moe_gemm_nvfp4_w4a8(d.args, sms, true, stream.get());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.synchronize();
    EXPECT_EQ(test::download_vector<uint16_t>(d.base.out, values), eager) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(Sm90_RowsToE4m3Pow2, GatheredRowsAndDeviceRowCount) {
  MOELORA_REQUIRE_SM90();
  check_rows_kernel<uint8_t>(ops::cuda::launch_rows_to_e4m3_pow2, ops::rows_to_e4m3_pow2_ref, 95);
}

TEST(Sm90_RowsToE4m3Pow2, EveryRowLengthForm) {
  MOELORA_REQUIRE_SM90();
  for (int cols : {8, 1032, 2048, 3000, 7168, 8200, 10240})
    check_rows_kernel<uint8_t>(ops::cuda::launch_rows_to_e4m3_pow2, ops::rows_to_e4m3_pow2_ref, 97,
                               cols);
}

TEST(Sm90_MoeGemmNvfp4W4a8, RefusesBadArguments) {
  MOELORA_REQUIRE_SM90();
  const Problem pb{2, 128, 128, {1, 1}};
  std::mt19937_64 rng(test::test_seed(96));
  const Case c = make_case(pb, rng);
  DeviceW4a8Case d = upload_w4a8_case(c, pb, 0, nullptr);
  const int sms = cuda::device_info(0).num_sms;
  auto expect_refusal = [&](ops::cuda::MoeGemmNvfp4W4a8Args a, const std::string& needle) {
    const std::string message =
        test::error_of([&] { ops::cuda::launch_moe_gemm_nvfp4_w4a8(a, sms, false, nullptr); });
    EXPECT_TRUE(test::contains(message, needle))
        << "expected an error naming " << needle << ", got: " << message;
  };
  ops::cuda::MoeGemmNvfp4W4a8Args a = d.args;
  a.n = 96;
  expect_refusal(a, "N = 96");
  a = d.args;
  a.k = 192;
  expect_refusal(a, "K = 192");
  a = d.args;
  a.act = nullptr;
  expect_refusal(a, "are required");
  a = d.args;
  a.num_experts = 600;
  a.max_active_experts = 600;
  expect_refusal(a, "E = 600");
  a = d.args;
  a.max_active_experts = 3;
  expect_refusal(a, "max_active_experts = 3");
}

}  // namespace
}  // namespace moelora
