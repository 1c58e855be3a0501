// Sm90 grouped FP8 expert GEMMs against the CPU reference (ops/gemm/moe_gemm.h) on random
// inputs: odd N, idle experts, experts with 1..70 tokens (several passes of the decode kernel),
// gathered activation rows, every decode instance (token subtiles x CTA shapes); the
// weight-streaming kernel with every pass width (8 / 16 / 32 / 64 tokens and several passes),
// NaN rows past the sorted positions (loaded into columns that are never stored), programmatic
// dependent launch, graph replays bit-equal to eager launches, and the LoRA epilogue (each row's
// slot delta added before the store) against the reference GEMM plus the delta.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

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
  // Without gather, act row q is sorted position q: as many rows as tokens in all.
  const int rows = pb.gather ? pb.rows
                             : std::accumulate(pb.tokens_per_expert.begin(), pb.tokens_per_expert.end(), 0);
  Tensor x = test::random_normal({rows, pb.K}, rng, 1.0f);
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

// The stream kernel reads sorted rows and k-major scales: materialize both from the reference
// inputs (gathered rows copied into sorted order). The act buffer holds `slack_rows` rows past the
// P sorted positions filled with NaN codes and NaN scales: a pass loads them into columns whose
// results are never stored, so they must not show up anywhere. With slack_rows = 0 the rows past
// P lie outside the TMA view and read as zeros.
struct StreamInputs {
  cuda::DeviceBuffer act, act_scale, weight, weight_scale, offsets, active, num_active, out;
  ops::cuda::MoeGemmFp8Args args;
};

StreamInputs make_stream_inputs(const HostInputs& in, const Problem& pb, int slack_rows) {
  using test::upload_vector;
  const int P = in.ref.expert_offsets.back();
  const int rows = P + slack_rows, kb = pb.K / 128;
  const int ld = (rows + 3) / 4 * 4 + 4;  // leading dimension > rows: the kernel must use ld, not rows
  std::vector<uint8_t> act(static_cast<size_t>(rows) * pb.K, 0x7f);  // 0x7f: e4m3 NaN
  std::vector<float> sx(static_cast<size_t>(kb) * ld, std::numeric_limits<float>::quiet_NaN());
  const uint8_t* src = in.ref.act.data<uint8_t>();
  const float* src_scale = in.ref.act_scale.data<float>();
  for (int q = 0; q < P; ++q) {
    const int row = in.ref.gather.empty() ? q : in.ref.gather[q];
    std::memcpy(&act[static_cast<size_t>(q) * pb.K], src + static_cast<size_t>(row) * pb.K, pb.K);
    for (int b = 0; b < kb; ++b) sx[static_cast<size_t>(b) * ld + q] = src_scale[static_cast<size_t>(row) * kb + b];
  }
  StreamInputs s;
  s.act = upload_vector(act);
  s.act_scale = upload_vector(sx);
  s.weight = cuda::to_device(in.ref.weight);
  s.weight_scale = cuda::to_device(in.ref.weight_scale);
  s.offsets = upload_vector(in.ref.expert_offsets);
  std::vector<int32_t> active(pb.E, -1);
  std::copy(in.active.begin(), in.active.end(), active.begin());
  s.active = upload_vector(active);
  s.num_active = upload_vector(std::vector<int32_t>{static_cast<int32_t>(in.active.size())});
  s.out = cuda::DeviceBuffer(static_cast<size_t>(std::max(P, 1)) * pb.N * 2);
  ops::cuda::MoeGemmFp8Args& a = s.args;
  a.act = s.act.as<uint8_t>();
  a.act_scale = s.act_scale.as<float>();
  a.act_rows = std::max(rows, 1);
  a.act_scale_ld = ld;
  a.weight = s.weight.as<uint8_t>();
  a.weight_scale = s.weight_scale.as<float>();
  a.expert_offsets = s.offsets.as<int32_t>();
  a.active_experts = s.active.as<int32_t>();
  a.num_active = s.num_active.as<int32_t>();
  a.out = s.out.as<__nv_bfloat16>();
  a.num_experts = pb.E;
  a.n = pb.N;
  a.k = pb.K;
  a.max_active_experts = pb.E;
  a.max_tokens_per_expert = 8;
  return s;
}

void check_stream_problem(const Problem& pb, uint64_t seed_fallback) {
  std::mt19937_64 rng(test::test_seed(seed_fallback));
  HostInputs in = make_inputs(pb, rng);
  Tensor expected = ops::moe_gemm_fp8_ref(in.ref);
  const int P = in.ref.expert_offsets.back();
  const int sms = cuda::device_info(0).num_sms;
  // claimed: work items from the atomic counters, two launches in a row (the first must leave
  // the counters zeroed for the second); each result bit-equal to the round-robin one (every
  // output element has one owner that adds its K blocks in order, whoever that is)
  cuda::DeviceBuffer counters(2 * sizeof(int32_t));
  MOELORA_CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
  for (int slack : {0, 70}) {
    for (bool pdl : {false, true}) {
      StreamInputs s = make_stream_inputs(in, pb, slack);
      cuda::Stream stream;
      std::vector<uint16_t> round_robin;
      for (int launch = 0; launch < 3; ++launch) {
        const bool claimed = launch > 0;
        ops::cuda::MoeGemmFp8Args args = s.args;
        if (claimed) args.work_counters = counters.as<int32_t>();
        // poison the output: every stored element must be written by the kernel
        MOELORA_CUDA_CHECK(cudaMemsetAsync(s.out.get(), 0xff, s.out.bytes(), stream.get()));
        ops::cuda::launch_moe_gemm_fp8_stream(args, sms, pdl, stream.get());
        stream.synchronize();
        const std::string what = "E=" + std::to_string(pb.E) + " N=" + std::to_string(pb.N) +
                                 " K=" + std::to_string(pb.K) + " slack rows=" + std::to_string(slack) +
                                 " pdl=" + std::to_string(pdl) + (claimed ? " claimed items, launch " : " round-robin") +
                                 (claimed ? std::to_string(launch) : "");
        Tensor got = cuda::to_host(s.out, DType::kBF16, {P, pb.N}).to_f32();
        EXPECT_TRUE(test::close_bf16(got, expected)) << what;
        const auto bits = test::download_vector<uint16_t>(s.out, static_cast<size_t>(P) * pb.N);
        if (!claimed) round_robin = bits;
        else EXPECT_EQ(bits, round_robin) << what;
        if (claimed)
          EXPECT_EQ(test::download_vector<int32_t>(counters, 2), (std::vector<int32_t>{0, 0}))
              << what << ": the work counters must be left zeroed";
      }
    }
  }
}

TEST(Sm90_MoeGemmFp8Stream, EveryPassWidthOddN) {
  MOELORA_REQUIRE_SM90();
  // 1, 8 -> N 8; 9, 16 -> 16; 17, 32 -> 32; 33, 64 -> 64; 65 -> 64 + 8; 130 -> 64 + 64 + 8
  check_stream_problem({11, 200, 512, 0, {1, 8, 9, 0, 16, 17, 32, 33, 64, 65, 130}, false}, 21);
}

TEST(Sm90_MoeGemmFp8Stream, GatheredRowsSingleTokens) {
  MOELORA_REQUIRE_SM90();
  check_stream_problem({8, 200, 512, 3, {1, 0, 1, 0, 0, 1, 1, 0}, true}, 22);
}

TEST(Sm90_MoeGemmFp8Stream, WideKNarrowN) {
  MOELORA_REQUIRE_SM90();
  check_stream_problem({3, 48, 2048, 5, {5, 2, 0}, true}, 23);
}

TEST(Sm90_MoeGemmFp8Stream, DecodeShapesManyExperts) {
  MOELORA_REQUIRE_SM90();
  // qwen3.5 GEMM1-like: 2I = 1024 rows, K = 2048, 40 experts with 0..5 tokens (more work items
  // than the persistent grid has CTAs: each CTA runs several items through one ring)
  std::mt19937_64 rng(test::test_seed(24));
  std::vector<int> tokens(40);
  for (auto& t : tokens) t = static_cast<int>(rng() % 6);
  check_stream_problem({40, 1024, 2048, 0, tokens, false}, 25);
}

TEST(Sm90_MoeGemmFp8Stream, GraphReplayBitEqualToEager) {
  MOELORA_REQUIRE_SM90();
  const Problem pb{6, 256, 1024, 0, {3, 0, 40, 1, 12, 70}, false};
  std::mt19937_64 rng(test::test_seed(26));
  HostInputs in = make_inputs(pb, rng);
  const int P = in.ref.expert_offsets.back();
  const int sms = cuda::device_info(0).num_sms;
  StreamInputs s = make_stream_inputs(in, pb, 16);
  cuda::Stream stream;
  ops::cuda::launch_moe_gemm_fp8_stream(s.args, sms, false, stream.get());
  stream.synchronize();
  const auto eager = test::download_vector<uint16_t>(s.out, static_cast<size_t>(P) * pb.N);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  // replays claim their items from counters that every launch leaves zeroed for the next
  cuda::DeviceBuffer counters(2 * sizeof(int32_t));
  MOELORA_CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
  ops::cuda::MoeGemmFp8Args claimed = s.args;
  claimed.work_counters = counters.as<int32_t>();
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  MOELORA_CUDA_CHECK(cudaMemsetAsync(s.out.get(), 0xff, s.out.bytes(), stream.get()));
  ops::cuda::launch_moe_gemm_fp8_stream(claimed, sms, true, stream.get());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.synchronize();
    EXPECT_EQ(test::download_vector<uint16_t>(s.out, static_cast<size_t>(P) * pb.N), eager) << "replay " << replay;
  }
  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
}

// The LoRA epilogue (MoeGemmLoraEpilogue) against the reference GEMM plus each row's delta
//   scaling[s] * sum_{r < rank[s]} (sum_split partial[split, q, r]) * B[s, eb, n, r]
// with three slots of ranks 5 / 16 / 24 (an odd rank, two rank blocks of the mma), NaN in every
// rank tail of B and of the partials and in the B of experts a shared-B slot does not use (none
// may be read), partials over 3 K splits, base rows (slot -1) mixed into every expert, odd N and
// pass widths 8..64 with several passes. Base rows must be bit-equal to the launch without LoRA.
// A second case makes the last expert base-only (every row slot -1, B without its region), as the
// shared expert stored among the routed experts is (MoeGemmLoraEpilogue::base_only_experts).
struct LoraEpilogueCase {
  std::vector<int32_t> rank{5, 16, 24};
  std::vector<float> scaling{0.5f, 2.0f, 1.0f};
  std::vector<uint8_t> b_shared{0, 1, 0};
  int max_rank = 24, splits = 3;
  int b_experts = 0;                  // Eb: E, or E - 1 with a base-only last expert
  std::vector<int2> row_slot_expert;  // [row_capacity]
  std::vector<uint16_t> b;            // [S, Eb, N, R] bf16 bits
  std::vector<float> partial;         // [splits, row_capacity, R]
};

LoraEpilogueCase make_lora_epilogue_case(const HostInputs& in, const Problem& pb, int row_capacity,
                                         std::mt19937_64& rng, bool base_only_last_expert) {
  LoraEpilogueCase lc;
  lc.b_experts = pb.E - (base_only_last_expert ? 1 : 0);
  const int S = static_cast<int>(lc.rank.size()), R = lc.max_rank;
  const uint16_t nan_bits = 0x7fc0;
  lc.row_slot_expert.assign(row_capacity, int2{-1, 0});
  std::uniform_int_distribution<int> pick_slot(-1, S - 1);
  for (int e = 0; e < pb.E; ++e) {
    std::vector<int> slots;
    for (int q = in.ref.expert_offsets[e]; q < in.ref.expert_offsets[e + 1]; ++q)
      slots.push_back(e < lc.b_experts ? pick_slot(rng) : -1);
    std::sort(slots.begin(), slots.end());  // rows of one expert sorted by slot, as moe_align leaves them
    for (size_t i = 0; i < slots.size(); ++i)
      lc.row_slot_expert[in.ref.expert_offsets[e] + i] = int2{slots[i], e};
  }
  std::normal_distribution<float> normal(0.f, 1.f);
  lc.b.assign(static_cast<size_t>(S) * lc.b_experts * pb.N * R, nan_bits);
  for (int s = 0; s < S; ++s)
    for (int e = 0; e < (lc.b_shared[s] ? 1 : lc.b_experts); ++e)
      for (int n = 0; n < pb.N; ++n)
        for (int r = 0; r < lc.rank[s]; ++r)
          lc.b[((static_cast<size_t>(s) * lc.b_experts + e) * pb.N + n) * R + r] =
              f32_to_bf16_bits(0.3f * normal(rng));
  lc.partial.assign(static_cast<size_t>(lc.splits) * row_capacity * R, std::numeric_limits<float>::quiet_NaN());
  for (int sp = 0; sp < lc.splits; ++sp)
    for (int q = 0; q < row_capacity; ++q) {
      const int s = lc.row_slot_expert[q].x;
      for (int r = 0; r < (s >= 0 ? lc.rank[s] : 0); ++r)
        lc.partial[(static_cast<size_t>(sp) * row_capacity + q) * R + r] = 0.5f * normal(rng);
    }
  return lc;
}

Tensor lora_epilogue_expected(const HostInputs& in, const Problem& pb, const LoraEpilogueCase& lc, int row_capacity) {
  Tensor expected = ops::moe_gemm_fp8_ref(in.ref);
  const int P = in.ref.expert_offsets.back(), R = lc.max_rank;
  float* out = expected.data<float>();
  for (int q = 0; q < P; ++q) {
    const auto [s, e] = lc.row_slot_expert[q];
    if (s < 0) continue;
    const int eb = lc.b_shared[s] ? 0 : e;
    std::vector<double> u(lc.rank[s], 0.0);
    for (int r = 0; r < lc.rank[s]; ++r) {
      for (int sp = 0; sp < lc.splits; ++sp) u[r] += lc.partial[(static_cast<size_t>(sp) * row_capacity + q) * R + r];
      u[r] *= lc.scaling[s];
    }
    for (int n = 0; n < pb.N; ++n) {
      double d = 0;
      for (int r = 0; r < lc.rank[s]; ++r)
        d += u[r] * bf16_bits_to_f32(
                        lc.b[((static_cast<size_t>(s) * lc.b_experts + eb) * pb.N + n) * R + r]);
      out[static_cast<size_t>(q) * pb.N + n] += static_cast<float>(d);
    }
  }
  return expected;
}

TEST(Sm90_MoeGemmFp8Stream, LoraEpilogueMatchesReference) {
  MOELORA_REQUIRE_SM90();
  using test::upload_vector;
  const Problem pb{5, 200, 512, 0, {1, 9, 0, 20, 70}, false};
  std::mt19937_64 rng(test::test_seed(28));
  HostInputs in = make_inputs(pb, rng);
  const int P = in.ref.expert_offsets.back();
  const int sms = cuda::device_info(0).num_sms;
  StreamInputs s = make_stream_inputs(in, pb, 16);
  const int row_capacity = s.args.act_rows;
  cuda::Stream stream;
  ops::cuda::launch_moe_gemm_fp8_stream(s.args, sms, false, stream.get());
  stream.synchronize();
  const auto base = test::download_vector<uint16_t>(s.out, static_cast<size_t>(P) * pb.N);
  cuda::DeviceBuffer counters(2 * sizeof(int32_t));
  for (bool base_only_last_expert : {false, true}) {
    SCOPED_TRACE(base_only_last_expert ? "base-only last expert" : "LoRA on every expert");
    const LoraEpilogueCase lc =
        make_lora_epilogue_case(in, pb, row_capacity, rng, base_only_last_expert);
    const Tensor expected = lora_epilogue_expected(in, pb, lc, row_capacity);
    auto b = upload_vector(lc.b);
    auto partial = upload_vector(lc.partial);
    auto rse = upload_vector(lc.row_slot_expert);
    auto rank = upload_vector(lc.rank);
    auto scaling = upload_vector(lc.scaling);
    auto b_shared = upload_vector(lc.b_shared);
    ops::cuda::MoeGemmLoraEpilogue l;
    l.b = b.as<__nv_bfloat16>();
    l.scaling = scaling.as<float>();
    l.rank = rank.as<int32_t>();
    l.b_shared = b_shared.as<uint8_t>();
    l.partial = partial.as<float>();
    l.row_slot_expert = rse.as<int2>();
    l.num_slots = static_cast<int>(lc.rank.size());
    l.b_experts = lc.b_experts;
    l.base_only_experts = pb.E - lc.b_experts;
    l.max_rank = lc.max_rank;
    l.splits = lc.splits;
    l.row_capacity = row_capacity;

    MOELORA_CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
    std::vector<uint16_t> first;
    for (bool claimed : {false, true})
      for (bool pdl : {false, true}) {
        const std::string what =
            std::string(claimed ? "claimed" : "round-robin") + (pdl ? ", pdl" : "");
        ops::cuda::MoeGemmFp8Args args = s.args;
        args.lora = l;
        if (claimed) args.work_counters = counters.as<int32_t>();
        MOELORA_CUDA_CHECK(cudaMemsetAsync(s.out.get(), 0xff, s.out.bytes(), stream.get()));
        ops::cuda::launch_moe_gemm_fp8_stream(args, sms, pdl, stream.get());
        stream.synchronize();
        Tensor got = cuda::to_host(s.out, DType::kBF16, {P, pb.N}).to_f32();
        EXPECT_TRUE(test::close_bf16(got, expected)) << what;
        const auto bits = test::download_vector<uint16_t>(s.out, static_cast<size_t>(P) * pb.N);
        int adapter_rows_changed = 0;
        for (int q = 0; q < P; ++q) {
          const bool base_row = lc.row_slot_expert[q].x < 0;
          const bool same = std::equal(bits.begin() + static_cast<size_t>(q) * pb.N,
                                       bits.begin() + static_cast<size_t>(q + 1) * pb.N,
                                       base.begin() + static_cast<size_t>(q) * pb.N);
          if (base_row)
            EXPECT_TRUE(same) << what << ": base row " << q << " changed by the LoRA epilogue";
          adapter_rows_changed += !base_row && !same;
        }
        EXPECT_GT(adapter_rows_changed, 0) << what;
        if (first.empty())
          first = bits;
        else
          EXPECT_EQ(bits, first) << what << ": results depend on the schedule";
      }
  }
}

TEST(Sm90_MoeGemmFp8Stream, RefusesBadLoraEpilogue) {
  MOELORA_REQUIRE_SM90();
  const Problem pb{2, 128, 256, 0, {1, 1}, false};
  std::mt19937_64 rng(29);
  HostInputs in = make_inputs(pb, rng);
  StreamInputs s = make_stream_inputs(in, pb, 0);
  cuda::DeviceBuffer dummy(4096);
  ops::cuda::MoeGemmFp8Args a = s.args;
  a.lora.b = dummy.as<__nv_bfloat16>();
  a.lora.scaling = dummy.as<float>();
  a.lora.rank = dummy.as<int32_t>();
  a.lora.partial = dummy.as<float>();
  a.lora.row_slot_expert = dummy.as<int2>();
  a.lora.num_slots = 1;
  a.lora.b_experts = 2;
  a.lora.max_rank = 16;
  a.lora.splits = 1;
  a.lora.row_capacity = a.act_rows;
  ops::cuda::MoeGemmFp8Args bad = a;
  bad.lora.max_rank = 12;
  EXPECT_NE(test::error_message([&] { ops::cuda::launch_moe_gemm_fp8_stream(bad, 132, false, nullptr); })
                .find("max_rank = 12"),
            std::string::npos);
  bad = a;
  bad.lora.row_capacity = a.act_rows - 1;
  EXPECT_NE(test::error_message([&] { ops::cuda::launch_moe_gemm_fp8_stream(bad, 132, false, nullptr); })
                .find("row_capacity"),
            std::string::npos);
  bad = a;
  bad.lora.partial = nullptr;
  EXPECT_THROW(ops::cuda::launch_moe_gemm_fp8_stream(bad, 132, false, nullptr), Error);
  bad = a;
  bad.lora.base_only_experts = 1;  // B still holds both experts
  EXPECT_NE(test::error_message([&] {
              ops::cuda::launch_moe_gemm_fp8_stream(bad, 132, false, nullptr);
            }).find("B expert extent 2 (must be 1 or the experts with LoRA, 1"),
            std::string::npos);
  bad.lora.base_only_experts = 2;
  EXPECT_NE(test::error_message([&] {
              ops::cuda::launch_moe_gemm_fp8_stream(bad, 132, false, nullptr);
            }).find("base_only_experts = 2"),
            std::string::npos);
}

TEST(Sm90_MoeGemmFp8Stream, RefusesGatherAndRowMajorScales) {
  MOELORA_REQUIRE_SM90();
  const Problem pb{2, 128, 256, 4, {1, 1}, true};
  std::mt19937_64 rng(27);
  HostInputs in = make_inputs(pb, rng);
  StreamInputs s = make_stream_inputs(in, pb, 0);
  ops::cuda::MoeGemmFp8Args a = s.args;
  a.gather = s.offsets.as<int32_t>();
  EXPECT_THROW(ops::cuda::launch_moe_gemm_fp8_stream(a, 132, false, nullptr), Error);
  a = s.args;
  a.act_scale_ld = 0;  // row-major scales
  EXPECT_THROW(ops::cuda::launch_moe_gemm_fp8_stream(a, 132, false, nullptr), Error);
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
