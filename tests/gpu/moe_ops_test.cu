// Sm90 MoE building blocks against their CPU references on random inputs: fused routers
// (softmax top-k with/without renormalization, noaux_tc with groups), pair alignment (expert and
// (slot, expert) grouping, tokens by slot, padding tokens), FP8 activation quantization (bit
// exact, permuted), and segmented multi-LoRA shrink/expand (mixed ranks incl. non powers of two,
// shared-outer slots, rank-0 slots).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "gpu/gpu_test_util.cuh"
#include "ops/lora/lora.h"
#include "ops/lora/lora_cuda.cuh"
#include "ops/moe_align/moe_align.h"
#include "ops/moe_align/moe_align_cuda.cuh"
#include "ops/quant/quant.h"
#include "ops/quant/quant_cuda.cuh"
#include "ops/route/route.h"
#include "ops/route/route_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

std::vector<float> to_vec(const Tensor& t) {
  Tensor f = t.to_f32();
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

// Logits with a clear gap between every pair of consecutive sorted values, so that fp32
// rounding differences between CPU and GPU cannot reorder the top-k.
Tensor separated_logits(int T, int E, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(DType::kF32, {T, E});
  std::vector<int> perm(E);
  for (int r = 0; r < T; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < E; ++e) t.data<float>()[r * E + perm[e]] = -3.0f + 6.0f * e / E;
  }
  return t;
}

void check_route(const ops::RouteParams& params, int T, uint64_t seed, bool with_bias, int valid_tokens = -1) {
  std::mt19937_64 rng(test::test_seed(seed));
  const int E = static_cast<int>(params.num_experts), k = static_cast<int>(params.top_k);
  Tensor logits = separated_logits(T, E, rng);
  Tensor bias;
  if (with_bias) bias = test::random_uniform({E}, rng, -0.02f, 0.02f);
  auto ref = ops::route_ref(logits, bias, params);
  auto logits_d = cuda::to_device(logits);
  cuda::DeviceBuffer bias_d;
  if (with_bias) bias_d = cuda::to_device(bias);
  cuda::DeviceBuffer ids_d(static_cast<size_t>(T) * k * 4), w_d(static_cast<size_t>(T) * k * 4);
  cuda::DeviceBuffer num_d = upload_vector(std::vector<int32_t>{valid_tokens < 0 ? T : valid_tokens});
  ops::cuda::RouteDeviceArgs a;
  a.logits = logits_d.as<float>();
  a.correction_bias = with_bias ? bias_d.as<float>() : nullptr;
  a.num_tokens = valid_tokens < 0 ? nullptr : num_d.as<int32_t>();
  a.topk_ids = ids_d.as<int32_t>();
  a.topk_weights = w_d.as<float>();
  a.max_tokens = T;
  ops::cuda::launch_route(params, a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  auto ids = download_vector<int32_t>(ids_d, T * k);
  auto w = download_vector<float>(w_d, T * k);
  const int valid = valid_tokens < 0 ? T : valid_tokens;
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      if (t >= valid) {
        ASSERT_EQ(ids[t * k + j], -1) << "padding token " << t;
        continue;
      }
      ASSERT_EQ(ids[t * k + j], ref.ids.data<int32_t>()[t * k + j]) << "token " << t << " pick " << j;
      ASSERT_NEAR(w[t * k + j], ref.weights.data<float>()[t * k + j], 2e-6f * (1 + std::fabs(w[t * k + j])))
          << "token " << t << " pick " << j;
    }
}

TEST(Sm90_Route, SoftmaxTopKRenormalizeAndNot) {
  MOELORA_REQUIRE_SM90();
  ops::RouteParams p;
  p.kind = RouterKind::kSoftmaxTopK;
  p.num_experts = 256;
  p.top_k = 8;
  p.renormalize = true;
  check_route(p, 37, 101, false);
  p.renormalize = false;
  p.num_experts = 60;  // not a multiple of 32
  p.top_k = 4;
  check_route(p, 5, 102, false);
}

TEST(Sm90_Route, NoauxTcGroupsBiasScaling) {
  MOELORA_REQUIRE_SM90();
  ops::RouteParams p;
  p.kind = RouterKind::kSigmoidNoauxTc;
  p.num_experts = 256;
  p.top_k = 8;
  p.renormalize = true;
  p.n_group = 8;
  p.topk_group = 4;
  p.routed_scaling_factor = 2.5f;
  check_route(p, 33, 103, true);
  p.num_experts = 384;  // Kimi: one group
  p.n_group = 1;
  p.topk_group = 1;
  p.routed_scaling_factor = 2.827f;
  check_route(p, 17, 104, true);
}

TEST(Sm90_Route, PaddingTokensGetNoExperts) {
  MOELORA_REQUIRE_SM90();
  ops::RouteParams p;
  p.num_experts = 64;
  p.top_k = 6;
  p.renormalize = true;
  check_route(p, 16, 105, false, /*valid_tokens=*/11);
}

void check_align(int T, int valid, int E, int k, int S, uint64_t seed) {
  std::mt19937_64 rng(test::test_seed(seed));
  std::vector<int32_t> ids(static_cast<size_t>(T) * k, -1), slot(T);
  std::uniform_int_distribution<int> pick_slot(-1, S - 1);
  for (int t = 0; t < T; ++t) {
    slot[t] = S > 0 ? pick_slot(rng) : -1;
    if (t >= valid) continue;
    std::vector<int> experts(E);
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    // skew: half of the tokens prefer the first few experts, leaving others idle
    if (t % 2 == 0) std::sort(experts.begin(), experts.begin() + std::min(E, 2 * k));
    for (int j = 0; j < k; ++j) ids[t * k + j] = experts[j];
  }
  std::vector<int32_t> ref_slot(slot.begin(), slot.begin() + valid);
  std::vector<int32_t> ref_ids(ids.begin(), ids.begin() + static_cast<size_t>(valid) * k);
  auto ref = ops::moe_align_ref(ref_ids, ref_slot, k, E, S);

  const int P = T * k, max_seg = std::max(1, std::min(P, S * E));
  auto ids_d = upload_vector(ids);
  auto slot_d = upload_vector(slot);
  auto num_d = upload_vector(std::vector<int32_t>{valid});
  cuda::DeviceBuffer off(4 * (E + 1)), sp(4 * P), st(4 * P), pp(4 * P), act(4 * E), nact(4), seg(16 * max_seg),
      nseg(4), ts(4 * T), tp(4 * T), tseg(16 * std::max(S, 1)), ntseg(4);
  ops::cuda::MoeAlignDeviceArgs a;
  a.topk_ids = ids_d.as<int32_t>();
  a.slot = slot_d.as<int32_t>();
  a.max_tokens = T;
  a.top_k = k;
  a.num_experts = E;
  a.num_slots = S;
  a.expert_offsets = off.as<int32_t>();
  a.sorted_pair = sp.as<int32_t>();
  a.sorted_token = st.as<int32_t>();
  a.pair_pos = pp.as<int32_t>();
  a.active_experts = act.as<int32_t>();
  a.num_active = nact.as<int32_t>();
  a.lora_segments = seg.as<int4>();
  a.num_lora_segments = nseg.as<int32_t>();
  a.max_lora_segments = std::min(P, S * E);
  a.num_tokens = num_d.as<int32_t>();
  a.token_sorted = ts.as<int32_t>();
  a.token_pos = tp.as<int32_t>();
  a.token_segments = tseg.as<int4>();
  a.num_token_segments = ntseg.as<int32_t>();
  ops::cuda::launch_moe_align(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());

  EXPECT_EQ(download_vector<int32_t>(off, E + 1), ref.expert_offsets);
  const int n_pairs = ref.expert_offsets.back();
  auto sorted_pair = download_vector<int32_t>(sp, n_pairs);
  auto sorted_token = download_vector<int32_t>(st, n_pairs);
  auto pair_pos = download_vector<int32_t>(pp, P);
  // Same multiset per (expert, slot) bin; positions consistent.
  for (const auto& s : ref.lora_segments) {
    std::multiset<int> got(sorted_pair.begin() + s.begin, sorted_pair.begin() + s.end);
    std::multiset<int> want(ref.sorted_pair.begin() + s.begin, ref.sorted_pair.begin() + s.end);
    EXPECT_EQ(got, want) << "segment slot " << s.slot << " expert " << s.expert;
  }
  for (int q = 0; q < n_pairs; ++q) {
    ASSERT_EQ(pair_pos[sorted_pair[q]], q);
    ASSERT_EQ(sorted_token[q], sorted_pair[q] / k);
    const int e = ids[sorted_pair[q]];
    ASSERT_TRUE(q >= ref.expert_offsets[e] && q < ref.expert_offsets[e + 1]);
  }
  for (int p = valid * k; p < P; ++p) EXPECT_EQ(pair_pos[p], -1);
  const int n_active = download_vector<int32_t>(nact, 1)[0];
  auto active = download_vector<int32_t>(act, E);
  ASSERT_EQ(n_active, static_cast<int>(ref.active_experts.size()));
  EXPECT_EQ(std::vector<int32_t>(active.begin(), active.begin() + n_active), ref.active_experts);
  for (int i = n_active; i < E; ++i) EXPECT_EQ(active[i], -1);
  if (S > 0) {
    const int n_seg = download_vector<int32_t>(nseg, 1)[0];
    ASSERT_EQ(n_seg, static_cast<int>(ref.lora_segments.size()));
    auto segs = download_vector<int4>(seg, std::max(n_seg, 1));
    for (int i = 0; i < n_seg; ++i) {
      EXPECT_EQ(segs[i].x, ref.lora_segments[i].slot);
      EXPECT_EQ(segs[i].y, ref.lora_segments[i].expert);
      EXPECT_EQ(segs[i].z, ref.lora_segments[i].begin);
      EXPECT_EQ(segs[i].w, ref.lora_segments[i].end);
    }
    // tokens by slot: stable, so exactly the reference order
    EXPECT_EQ(download_vector<int32_t>(ts, valid), ref.token_sorted);
    auto tpos = download_vector<int32_t>(tp, T);
    for (int t = 0; t < T; ++t) EXPECT_EQ(tpos[t], t < valid ? ref.token_pos[t] : -1);
    const int n_tseg = download_vector<int32_t>(ntseg, 1)[0];
    ASSERT_EQ(n_tseg, static_cast<int>(ref.token_segments.size()));
    auto tsegs = download_vector<int4>(tseg, std::max(n_tseg, 1));
    for (int i = 0; i < n_tseg; ++i) {
      EXPECT_EQ(tsegs[i].x, ref.token_segments[i].slot);
      EXPECT_EQ(tsegs[i].z, ref.token_segments[i].begin);
      EXPECT_EQ(tsegs[i].w, ref.token_segments[i].end);
    }
  }
}

TEST(Sm90_MoeAlign, DecodeBatchesWithSlots) {
  MOELORA_REQUIRE_SM90();
  check_align(1, 1, 256, 8, 8, 201);
  check_align(64, 64, 256, 8, 8, 202);
  check_align(128, 100, 384, 8, 4, 203);  // padding tokens
  check_align(33, 33, 48, 8, 0, 204);     // no LoRA at all
}

TEST(Sm90_MoeAlign, PrefillSizedBatch) {
  MOELORA_REQUIRE_SM90();
  check_align(4096, 4096, 256, 8, 8, 205);
}

TEST(Sm90_QuantFp8, BitExactPerTokenAndPermuted) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(301));
  const int rows = 19, cols = 300, padded = 384;
  Tensor x = test::random_normal({rows, cols}, rng, 3.0f).to(DType::kBF16);  // bf16 values
  x.data<uint16_t>()[5 * cols + 7] = 0;  // zeros and an all-zero group must work
  for (int c = 128; c < 256; ++c) x.data<uint16_t>()[2 * cols + c] = 0;
  std::vector<int32_t> gather = {3, 3, 0, 18, 7};
  Tensor xf = x.to_f32();
  auto ref = ops::quantize_fp8_per_token_ref(xf);
  auto x_d = cuda::to_device(x);
  auto g_d = upload_vector(gather);
  for (bool permuted : {false, true}) {
    const int out_rows = permuted ? static_cast<int>(gather.size()) : rows;
    cuda::DeviceBuffer q_d(static_cast<size_t>(out_rows) * padded), s_d(static_cast<size_t>(out_rows) * 3 * 4);
    ops::cuda::QuantFp8DeviceArgs a;
    a.x = x_d.as<__nv_bfloat16>();
    a.gather = permuted ? g_d.as<int32_t>() : nullptr;
    a.max_rows = out_rows;
    a.cols = cols;
    a.cols_padded = padded;
    a.q = q_d.as<uint8_t>();
    a.scale = s_d.as<float>();
    ops::cuda::launch_quantize_fp8_rows(a, nullptr);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    auto q = download_vector<uint8_t>(q_d, static_cast<size_t>(out_rows) * padded);
    auto s = download_vector<float>(s_d, static_cast<size_t>(out_rows) * 3);
    for (int r = 0; r < out_rows; ++r) {
      const int src = permuted ? gather[r] : r;
      for (int g = 0; g < 3; ++g)
        ASSERT_EQ(s[r * 3 + g], ref.scale.data<float>()[src * 3 + g]) << "row " << r << " group " << g;
      for (int c = 0; c < padded; ++c) {
        const uint8_t want = c < cols ? ref.q.data<uint8_t>()[src * cols + c] : 0;
        ASSERT_EQ(q[static_cast<size_t>(r) * padded + c], want) << "row " << r << " col " << c;
      }
    }
  }
}

// Multi-LoRA over (slot, expert) segments: per-expert and shared-outer slots, ranks 16, 5 and 0.
TEST(Sm90_Lora, SegmentedShrinkExpandMatchesPerRowReference) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(401));
  const int S = 4, E = 6, R = 16, in = 2056, out = 300, rows = 23;
  const int ranks[S] = {16, 5, 0, 12};
  const bool shared_a[S] = {false, false, false, true};
  Tensor x = test::random_normal({rows, in}, rng).to(DType::kBF16).to_f32();
  // pool host arrays (bf16 values kept as fp32 for the reference)
  std::vector<std::vector<LoraFactors>> factors(S, std::vector<LoraFactors>(E));
  std::vector<uint16_t> a_pool(static_cast<size_t>(S) * E * R * in, 0), b_pool(static_cast<size_t>(S) * E * out * R, 0);
  std::vector<float> scaling(S);
  std::vector<uint8_t> a_sh(S), b_sh(S, 0);
  for (int s = 0; s < S; ++s) {
    scaling[s] = 0.5f + s;
    a_sh[s] = shared_a[s];
    const int r = ranks[s];
    Tensor a0 = test::random_normal({1, std::max(r, 1), in}, rng, 0.05f).to(DType::kBF16).to_f32();
    for (int e = 0; e < E; ++e) {
      Tensor a = shared_a[s] ? a0 : test::random_normal({1, std::max(r, 1), in}, rng, 0.05f).to(DType::kBF16).to_f32();
      Tensor b = test::random_normal({1, out, std::max(r, 1)}, rng, 0.05f).to(DType::kBF16).to_f32();
      factors[s][e] = {a.slice0(0, 1).reshape({1, std::max(r, 1), in}), b, scaling[s]};
      for (int i = 0; i < r; ++i)
        for (int c = 0; c < in; ++c)
          if (!shared_a[s] || e == 0)
            a_pool[((static_cast<size_t>(s) * E + e) * R + i) * in + c] = f32_to_bf16_bits(a.data<float>()[i * in + c]);
      for (int n = 0; n < out; ++n)
        for (int i = 0; i < r; ++i)
          b_pool[((static_cast<size_t>(s) * E + e) * out + n) * R + i] = f32_to_bf16_bits(b.data<float>()[n * std::max(r, 1) + i]);
    }
  }
  // segments over sorted rows: {slot, expert, begin, end}
  std::vector<int4> segs = {{0, 1, 0, 3}, {1, 1, 3, 4}, {2, 0, 4, 9}, {3, 5, 9, 15}, {0, 5, 15, 23}};
  std::vector<int32_t> gather(rows);
  for (int q = 0; q < rows; ++q) gather[q] = (q * 7) % rows;

  auto a_d = upload_vector(a_pool);
  auto b_d = upload_vector(b_pool);
  auto sc_d = upload_vector(scaling);
  auto rk_d = upload_vector(std::vector<int32_t>(ranks, ranks + S));
  auto ash_d = upload_vector(a_sh);
  auto bsh_d = upload_vector(b_sh);
  auto seg_d = upload_vector(segs);
  auto nseg_d = upload_vector(std::vector<int32_t>{static_cast<int32_t>(segs.size())});
  auto x_d = cuda::to_device(x.to(DType::kBF16));
  auto g_d = upload_vector(gather);
  cuda::DeviceBuffer part(ops::cuda::lora_partial_bytes(in, rows, R));
  cuda::DeviceBuffer delta(static_cast<size_t>(rows) * out * 2);
  MOELORA_CUDA_CHECK(cudaMemset(delta.get(), 0xff, delta.bytes()));  // rank-0 rows must be overwritten

  ops::cuda::LoraPoolTarget pool;
  pool.a = a_d.as<__nv_bfloat16>();
  pool.b = b_d.as<__nv_bfloat16>();
  pool.scaling = sc_d.as<float>();
  pool.rank = rk_d.as<int32_t>();
  pool.a_shared = ash_d.as<uint8_t>();
  pool.b_shared = bsh_d.as<uint8_t>();
  pool.num_slots = S;
  pool.ea = E;
  pool.eb = E;
  pool.max_rank = R;
  pool.in_features = in;
  pool.out_features = out;
  ops::cuda::LoraSegmentsView view{seg_d.as<int4>(), nseg_d.as<int32_t>(), 8};  // capacity > count
  ops::cuda::LoraShrinkArgs sa{pool, view, x_d.as<__nv_bfloat16>(), g_d.as<int32_t>(), part.as<float>(), rows};
  ops::cuda::launch_lora_shrink(sa, nullptr);
  ops::cuda::LoraExpandArgs ea;
  ea.pool = pool;
  ea.seg = view;
  ea.partial = part.as<float>();
  ea.row_capacity = rows;
  ea.delta = delta.as<__nv_bfloat16>();
  ops::cuda::launch_lora_expand(ea, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  Tensor got = cuda::to_host(delta, DType::kBF16, {rows, out}).to_f32();

  Tensor want = Tensor::zeros(DType::kF32, {rows, out});
  for (const auto& sg : segs) {
    const int r = ranks[sg.x];
    for (int q = sg.z; q < sg.w; ++q) {
      if (r == 0) continue;
      const LoraFactors& f = factors[sg.x][shared_a[sg.x] ? 0 : sg.y];
      const LoraFactors& fb = factors[sg.x][sg.y];
      Tensor xr = x.slice0(gather[q], gather[q] + 1);
      Tensor yr = Tensor::zeros(DType::kF32, {1, out});
      ops::lora_add_ref(xr, f.a.reshape({std::max(r, 1), in}).slice0(0, r), fb.b.reshape({out, std::max(r, 1)}),
                        scaling[sg.x], yr);
      std::memcpy(want.data<float>() + static_cast<size_t>(q) * out, yr.raw_data(), out * 4);
    }
  }
  EXPECT_TRUE(test::close_bf16(got, want));
}

}  // namespace
}  // namespace moelora
