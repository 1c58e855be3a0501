// Sm90 grouped FP8 expert GEMMs against the CPU reference (ops/gemm/moe_gemm.h) on random
// inputs: odd N, idle experts, experts with 1..70 tokens (several passes of the decode kernel),
// gathered activation rows, every decode instance (token subtiles x CTA shapes).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "gpu/gpu_test_util.cuh"
#include "ops/gemm/moe_gemm.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/quant/quant.h"
#include "support/test_support.h"

namespace moelora {
namespace {

struct Problem {
  int E, N, K, rows;
  std::vector<int> tokens_per_expert;
  bool gather;
};

struct HostInputs {
  ops::MoeGemmFp8Ref ref;
  std::vector<int32_t> active;
};

HostInputs make_inputs(const Problem& pb, std::mt19937_64& rng) {
  HostInputs in;
  Tensor w = test::random_normal({pb.E * pb.N, pb.K}, rng, 0.05f);
  // quantize per expert so every expert has its own 128-row blocks
  Tensor weight = Tensor::empty(DType::kF8E4M3, {pb.E, pb.N, pb.K});
  const int nb = (pb.N + 127) / 128, kb = pb.K / 128;
  Tensor wscale = Tensor::empty(DType::kF32, {pb.E, nb, kb});
  for (int e = 0; e < pb.E; ++e) {
    auto q = ops::quantize_fp8_block_ref(w.slice0(e * pb.N, (e + 1) * pb.N));
    std::memcpy(weight.data<uint8_t>() + static_cast<size_t>(e) * pb.N * pb.K, q.q.raw_data(), q.q.nbytes());
    std::memcpy(wscale.data<float>() + static_cast<size_t>(e) * nb * kb, q.scale_inv.raw_data(), q.scale_inv.nbytes());
  }
  Tensor x = test::random_normal({pb.rows, pb.K}, rng, 1.0f);
  auto xq = ops::quantize_fp8_per_token_ref(x);
  in.ref.act = xq.q;
  in.ref.act_scale = xq.scale;
  in.ref.weight = weight;
  in.ref.weight_scale = wscale;
  in.ref.expert_offsets.assign(pb.E + 1, 0);
  for (int e = 0; e < pb.E; ++e) {
    in.ref.expert_offsets[e + 1] = in.ref.expert_offsets[e] + pb.tokens_per_expert[e];
    if (pb.tokens_per_expert[e] > 0) in.active.push_back(e);
  }
  const int P = in.ref.expert_offsets.back();
  if (pb.gather) {
    std::uniform_int_distribution<int> pick(0, pb.rows - 1);
    for (int q = 0; q < P; ++q) in.ref.gather.push_back(pick(rng));
  }
  return in;
}

Tensor run_decode(const HostInputs& in, const Problem& pb, int max_tokens_per_expert) {
  using test::upload_vector;
  auto act = cuda::to_device(in.ref.act);
  auto act_scale = cuda::to_device(in.ref.act_scale);
  auto weight = cuda::to_device(in.ref.weight);
  auto weight_scale = cuda::to_device(in.ref.weight_scale);
  auto offsets = upload_vector(in.ref.expert_offsets);
  std::vector<int32_t> active(pb.E, -1);
  std::copy(in.active.begin(), in.active.end(), active.begin());
  auto active_d = upload_vector(active);
  auto num_active = upload_vector(std::vector<int32_t>{static_cast<int32_t>(in.active.size())});
  cuda::DeviceBuffer gather;
  if (!in.ref.gather.empty()) gather = upload_vector(in.ref.gather);
  const int P = in.ref.expert_offsets.back();
  cuda::DeviceBuffer out(static_cast<size_t>(std::max(P, 1)) * pb.N * 2);
  ops::cuda::MoeGemmFp8Args a;
  a.act = act.as<uint8_t>();
  a.act_scale = act_scale.as<float>();
  a.gather = in.ref.gather.empty() ? nullptr : gather.as<int32_t>();
  a.weight = weight.as<uint8_t>();
  a.weight_scale = weight_scale.as<float>();
  a.expert_offsets = offsets.as<int32_t>();
  a.active_experts = active_d.as<int32_t>();
  a.num_active = num_active.as<int32_t>();
  a.out = out.as<__nv_bfloat16>();
  a.num_experts = pb.E;
  a.n = pb.N;
  a.k = pb.K;
  a.max_active_experts = pb.E;
  a.max_tokens_per_expert = max_tokens_per_expert;
  const int sms = cuda::device_info(0).num_sms;
  ops::cuda::launch_moe_gemm_fp8_decode(a, sms, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  return cuda::to_host(out, DType::kBF16, {P, pb.N}).to_f32();
}

void check_problem(const Problem& pb, uint64_t seed_fallback) {
  std::mt19937_64 rng(test::test_seed(seed_fallback));
  HostInputs in = make_inputs(pb, rng);
  Tensor expected = ops::moe_gemm_fp8_ref(in.ref);
  const int max_tokens = *std::max_element(pb.tokens_per_expert.begin(), pb.tokens_per_expert.end());
  // Every token-subtile instance must give the same answer (capacity 8, 16 and 64 tokens).
  for (int capacity : {8, 16, 64}) {
    if (capacity < max_tokens && capacity != 64) continue;
    Tensor got = run_decode(in, pb, capacity);
    EXPECT_TRUE(test::close_bf16(got, expected)) << "E=" << pb.E << " N=" << pb.N << " K=" << pb.K
                                                 << " capacity=" << capacity;
  }
}

TEST(Sm90_MoeGemmFp8Decode, SingleTokenPerExpertOddN) {
  MOELORA_REQUIRE_SM90();
  check_problem({8, 200, 512, 3, {1, 0, 1, 0, 0, 1, 1, 0}, true}, 11);
}

TEST(Sm90_MoeGemmFp8Decode, ManyTokensSeveralPasses) {
  MOELORA_REQUIRE_SM90();
  check_problem({4, 256, 1024, 112, {70, 0, 9, 33}, false}, 12);  // rows = P: no gather
}

TEST(Sm90_MoeGemmFp8Decode, WideKNarrowN) {
  MOELORA_REQUIRE_SM90();
  check_problem({3, 48, 2048, 5, {5, 2, 0}, true}, 13);
}

TEST(Sm90_MoeGemmFp8Decode, EveryCtaShape) {
  MOELORA_REQUIRE_SM90();
  // N and K chosen so that choose_decode_gemm_config visits 1, 2, 4 and 8 warps per row tile
  for (auto [n, k] : {std::pair{2048, 1024}, std::pair{256, 512}, std::pair{1024, 256}, std::pair{96, 128}}) {
    check_problem({6, n, k, 12, {2, 0, 3, 1, 0, 6}, true}, 14 + n);
  }
}

}  // namespace
}  // namespace moelora
