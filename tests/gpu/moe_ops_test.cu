// Sm90 MoE building blocks against their CPU references on random inputs (the routers are in
// route_test.cu, the dense projections' LoRA in lora_dense_test.cu): pair alignment (expert and
// (slot, expert) grouping, tokens by slot, padding tokens), FP8 activation quantization (bit
// exact, permuted), segmented multi-LoRA shrink/expand over (slot, expert) segments (mixed ranks
// incl. non powers of two, shared-outer slots, rank-0 slots, the expand as a programmatic
// dependent of the shrink), and the LoRA shrink fused into the quant and activation kernels
// (per-expert, shared-outer and rank-0 slots, base rows, padded columns).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "ops/lora/lora.h"
#include "ops/lora/lora_cuda.cuh"
#include "ops/moe/moe_cuda.cuh"
#include "ops/moe_align/moe_align.h"
#include "ops/moe_align/moe_align_cuda.cuh"
#include "ops/quant/quant.h"
#include "ops/quant/quant_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

// E local experts; with routed_experts > E the ids range over all routed_experts experts and the
// launch aligns experts [expert_begin, expert_begin + E) (expert parallelism): the reference is
// the plain alignment of the ids mapped to local ones (-1 for another rank's expert). shared: the
// shared expert as local expert E, pair k of every valid token (MoeAlignDeviceArgs::
// shared_expert): the reference aligns k + 1 ids per token with that expert's pairs in its base
// bin.
void check_align(int T, int valid, int E, int k, int S, uint64_t seed, int routed_experts = 0,
                 int expert_begin = 0, bool shared = false) {
  std::mt19937_64 rng(test::test_seed(seed));
  const int Er = routed_experts > 0 ? routed_experts : E;
  std::vector<int32_t> ids(static_cast<size_t>(T) * k, -1), slot(T);
  std::uniform_int_distribution<int> pick_slot(-1, S - 1);
  for (int t = 0; t < T; ++t) {
    slot[t] = S > 0 ? pick_slot(rng) : -1;
    if (t >= valid) continue;
    std::vector<int> experts(Er);
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    // skew: half of the tokens prefer the first few experts, leaving others idle
    if (t % 2 == 0) std::sort(experts.begin(), experts.begin() + std::min(Er, 2 * k));
    for (int j = 0; j < k; ++j) ids[t * k + j] = experts[j];
  }
  auto local = [&](int32_t id) {
    return id >= expert_begin && id < expert_begin + E ? id - expert_begin : -1;
  };
  const int kp = k + (shared ? 1 : 0),
            Ex = E + (shared ? 1 : 0);  // pairs per token, experts aligned
  std::vector<int32_t> ref_slot(slot.begin(), slot.begin() + valid);
  std::vector<int32_t> ref_ids(static_cast<size_t>(valid) * kp);
  for (int t = 0; t < valid; ++t)
    for (int j = 0; j < kp; ++j) ref_ids[t * kp + j] = j < k ? local(ids[t * k + j]) : E;
  auto ref = ops::moe_align_ref(ref_ids, ref_slot, kp, Ex, S, shared ? E : -1);

  const int P = T * kp, max_seg = std::max(1, std::min(T * k, S * E));
  auto ids_d = upload_vector(ids);
  auto slot_d = upload_vector(slot);
  auto num_d = upload_vector(std::vector<int32_t>{valid});
  cuda::DeviceBuffer off(4 * (Ex + 1)), sp(4 * P), st(4 * P), pp(4 * P), act(4 * Ex), nact(4),
      seg(16 * max_seg), nseg(4), ts(4 * T), tp(4 * T), tseg(16 * std::max(S, 1)), ntseg(4),
      sse(8 * P), tsr(4 * T);
  ops::cuda::MoeAlignDeviceArgs a;
  a.topk_ids = ids_d.as<int32_t>();
  a.slot = slot_d.as<int32_t>();
  a.max_tokens = T;
  a.top_k = k;
  a.num_experts = Ex;
  a.shared_expert = shared ? E : -1;
  a.expert_begin = expert_begin;
  a.num_slots = S;
  a.expert_offsets = off.as<int32_t>();
  a.sorted_pair = sp.as<int32_t>();
  a.sorted_token = st.as<int32_t>();
  a.pair_pos = pp.as<int32_t>();
  a.sorted_slot_expert = sse.as<int2>();
  a.active_experts = act.as<int32_t>();
  a.num_active = nact.as<int32_t>();
  a.lora_segments = seg.as<int4>();
  a.num_lora_segments = nseg.as<int32_t>();
  a.max_lora_segments = std::min(T * k, S * E);
  a.num_tokens = num_d.as<int32_t>();
  a.token_sorted = ts.as<int32_t>();
  a.token_pos = tp.as<int32_t>();
  a.token_segments = tseg.as<int4>();
  a.num_token_segments = ntseg.as<int32_t>();
  a.token_shared_row = shared && S > 0 ? tsr.as<int32_t>() : nullptr;
  ops::cuda::launch_moe_align(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());

  EXPECT_EQ(download_vector<int32_t>(off, Ex + 1), ref.expert_offsets);
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
  auto slot_expert = download_vector<int2>(sse, n_pairs);
  for (int q = 0; q < n_pairs; ++q) {
    ASSERT_EQ(pair_pos[sorted_pair[q]], q);
    const int t = sorted_pair[q] / kp, j = sorted_pair[q] % kp;
    ASSERT_EQ(sorted_token[q], t);
    const int e = j < k ? local(ids[t * k + j]) : E;
    ASSERT_GE(e, 0) << "row " << q << " holds another rank's pair";
    // the shared expert's pairs sit in its base bin whatever the token's slot
    ASSERT_EQ(slot_expert[q].x, j < k ? slot[t] : -1) << "sorted_slot_expert slot, row " << q;
    ASSERT_EQ(slot_expert[q].y, e) << "sorted_slot_expert expert, row " << q;
    ASSERT_TRUE(q >= ref.expert_offsets[e] && q < ref.expert_offsets[e + 1]);
  }
  for (int p = valid * kp; p < P; ++p) EXPECT_EQ(pair_pos[p], -1);
  for (int p = 0; p < valid * kp; ++p)
    if (p % kp < k && local(ids[p / kp * k + p % kp]) < 0)
      EXPECT_EQ(pair_pos[p], -1) << "pair " << p << " of another rank's expert";
  const int n_active = download_vector<int32_t>(nact, 1)[0];
  auto active = download_vector<int32_t>(act, Ex);
  ASSERT_EQ(n_active, static_cast<int>(ref.active_experts.size()));
  EXPECT_EQ(std::vector<int32_t>(active.begin(), active.begin() + n_active), ref.active_experts);
  for (int i = n_active; i < Ex; ++i) EXPECT_EQ(active[i], -1);
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
    if (shared) {  // the shared pair's row of each token, in token_sorted order
      auto rows = download_vector<int32_t>(tsr, valid);
      for (int i = 0; i < valid; ++i)
        EXPECT_EQ(rows[i], pair_pos[ref.token_sorted[i] * kp + k]) << "token_shared_row " << i;
    }
  }
}

TEST(Sm90_MoeAlign, DecodeBatchesWithSlots) {
  MOELORA_REQUIRE_SM90();
  check_align(1, 1, 256, 8, 8, 201);
  check_align(64, 64, 256, 8, 8, 202);
  check_align(128, 100, 384, 8, 4, 203);  // padding tokens
  check_align(33, 33, 48, 8, 0, 204);     // no LoRA at all
  // 4084 bins: 49,040 bytes of dynamic shared memory for the counted form (132 pairs), under 48 KB
  // alone but past it with the kernel's static part (the launch must opt in to more).
  check_align(33, 33, 1021, 4, 3, 206);
}

// Expert parallelism: 384 routed experts, this rank's 48 of them (the first, a middle and the
// last rank of EP8), at decode and prefill sizes, with and without slots.
TEST(Sm90_MoeAlign, OneRanksExpertsOfAllRouted) {
  MOELORA_REQUIRE_SM90();
  for (const int begin : {0, 144, 336}) {
    SCOPED_TRACE("expert_begin " + std::to_string(begin));
    check_align(64, 60, 48, 8, 4, 207, 384, begin);
    check_align(2048, 2048, 48, 8, 0, 208, 384, begin);
  }
}

// The shared expert among the routed ones (expert E, pair k of every valid token, base bin): with
// slots (its rows for the shared down LoRA's gather), with padding tokens, without LoRA, prefill.
TEST(Sm90_MoeAlign, SharedExpertAsOneMorePairPerToken) {
  MOELORA_REQUIRE_SM90();
  check_align(16, 16, 256, 8, 4, 209, 0, 0, /*shared=*/true);
  check_align(64, 50, 256, 8, 8, 210, 0, 0, /*shared=*/true);
  check_align(33, 33, 48, 8, 0, 211, 0, 0, /*shared=*/true);
  check_align(2048, 2048, 128, 8, 2, 212, 0, 0, /*shared=*/true);
}

// Both forms of the kernel at their bound: up to 128 pairs (T x kp) the ranked form, past it the
// counted one; slots, padding tokens and the shared expert's pairs in the ranked form, slots and
// the shared expert's pairs in the counted one; the ranked form without slots.
TEST(Sm90_MoeAlign, RankedAndCountedFormsAtTheirBound) {
  MOELORA_REQUIRE_SM90();
  // The ranked form takes up to kMoeAlignRankedMaxPairs pairs, the counted one past it; the cases
  // follow the bound (128 today: 16 / 17 tokens at k = 8, 14 / 15 with the shared expert).
  constexpr int bound = ops::cuda::kMoeAlignRankedMaxPairs;
  check_align(bound / 8, bound / 8 - 3, 256, 8, 8, 213);      // ranked, padding tokens
  check_align(bound / 8 + 1, bound / 8 + 1, 256, 8, 8, 214);  // counted
  check_align(bound / 8 - 4, bound / 8 - 6, 256, 8, 8, 221);  // ranked, the last warp idle
  check_align(bound / 9, bound / 9 - 2, 256, 8, 4, 215, 0, 0, /*shared=*/true);      // ranked
  check_align(bound / 9 + 1, bound / 9 + 1, 256, 8, 4, 216, 0, 0, /*shared=*/true);  // counted
  check_align(16, 16, 256, 8, 8, 222, 0, 0, /*shared=*/true);  // Qwen3.5 at 16 sequences
  check_align(2, 1, 384, 8, 8, 217, 0, 0, /*shared=*/true);    // one valid token of two
  check_align(16, 16, 48, 8, 8, 218, 384, 336);                // the last EP8 rank's experts
  check_align(bound / 8 + 1, bound / 8 + 1, 48, 8, 8, 223, 384, 336);  // ... one past the bound
  check_align(bound, bound, 8, 1, 8, 219);                     // one pair per token
  check_align(bound + 1, bound + 1, 8, 1, 8, 224);             // ... one past the bound
  check_align(16, 11, 256, 8, 0, 220);                         // no LoRA: S = 0
}

TEST(Sm90_MoeAlign, PrefillSizedBatch) {
  MOELORA_REQUIRE_SM90();
  check_align(4096, 4096, 256, 8, 8, 205);
}

// quantize_fp8_rows against quantize_fp8_per_token_ref, bit for bit, in its three forms: identity
// rows, gathered rows with a device row count (rows past it untouched), and the scatter (each
// input row quantized once, stored to the output rows it lists; unlisted rows untouched); scales
// row-major or k-major (scale_ld).
void check_quant_fp8_rows(int cols, uint64_t seed_tag) {
  SCOPED_TRACE(::testing::Message() << "cols " << cols);
  std::mt19937_64 rng(test::test_seed(seed_tag));
  const int rows = 19, padded = (cols + 127) / 128 * 128, groups = padded / 128;
  Tensor x = test::random_normal({rows, cols}, rng, 3.0f).to(DType::kBF16);  // bf16 values
  x.data<uint16_t>()[5 * cols + 7] = 0;  // zeros and an all-zero group must work
  for (int c = 128; c < std::min(256, cols); ++c) x.data<uint16_t>()[2 * cols + c] = 0;
  Tensor xf = x.to_f32();
  auto ref = ops::quantize_fp8_per_token_ref(xf);
  auto x_d = cuda::to_device(x);
  const std::vector<int32_t> gather = {3, 3, 0, 18, 7, 11};
  const std::vector<int32_t> device_rows = {static_cast<int32_t>(gather.size()) - 1};
  // scatter: 3 output rows per input row at most, rows of a random permutation, some dropped
  const int width = 3, scatter_out = rows * width;
  std::vector<int32_t> perm(scatter_out);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> scatter(perm),
      source(scatter_out, -1);  // source: input row of each output row
  for (int i = 0; i < scatter_out; ++i) {
    if (i % 7 == 3) scatter[i] = -1;  // a pair on another rank's expert
    if (scatter[i] >= 0) source[scatter[i]] = i / width;
  }
  auto g_d = upload_vector(gather);
  auto n_d = upload_vector(device_rows);
  auto sc_d = upload_vector(scatter);
  for (const char* form : {"identity", "gather", "scatter"}) {
    for (bool k_major : {false, true}) {
      SCOPED_TRACE(::testing::Message() << form << ", k-major scales " << k_major);
      const bool gathered = std::string(form) == "gather",
                 scattered = std::string(form) == "scatter";
      const int out_rows = gathered    ? static_cast<int>(gather.size())
                           : scattered ? scatter_out
                                       : rows;
      const int scale_ld = k_major ? out_rows + 3 : 0;
      const size_t scale_count =
          k_major ? static_cast<size_t>(groups) * scale_ld : static_cast<size_t>(out_rows) * groups;
      // poisoned outputs: padding codes must be written as zeros, rows not produced not at all
      const std::vector<uint8_t> q_poison(static_cast<size_t>(out_rows) * padded, 0xAB);
      const std::vector<float> s_poison(scale_count, -1.f);
      auto q_d = upload_vector(q_poison);
      auto s_d = upload_vector(s_poison);
      ops::cuda::QuantFp8DeviceArgs a;
      a.x = x_d.as<__nv_bfloat16>();
      a.gather = gathered ? g_d.as<int32_t>() : nullptr;
      a.num_rows = gathered ? n_d.as<int32_t>() : nullptr;
      a.max_rows = out_rows;
      a.cols = cols;
      a.cols_padded = padded;
      a.q = q_d.as<uint8_t>();
      a.scale = s_d.as<float>();
      a.scale_ld = scale_ld;
      if (scattered) {
        a.scatter = sc_d.as<int32_t>();
        a.scatter_rows = rows;
        a.scatter_width = width;
      }
      ops::cuda::launch_quantize_fp8_rows(a, nullptr);
      MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
      auto q = download_vector<uint8_t>(q_d, q_poison.size());
      auto sc = download_vector<float>(s_d, scale_count);
      for (int r = 0; r < out_rows; ++r) {
        const int src = gathered ? gather[r] : scattered ? source[r] : r;
        const bool written = gathered ? r < device_rows[0] : src >= 0;
        for (int g = 0; g < groups; ++g) {
          const float got = sc[k_major ? static_cast<size_t>(g) * scale_ld + r
                                       : static_cast<size_t>(r) * groups + g];
          const float want =
              written ? ref.scale.data<float>()[static_cast<size_t>(src) * groups + g] : -1.f;
          ASSERT_EQ(got, want) << "row " << r << " group " << g;
        }
        for (int c = 0; c < padded; ++c) {
          const uint8_t want = !written ? 0xAB
                               : c < cols
                                   ? ref.q.data<uint8_t>()[static_cast<size_t>(src) * cols + c]
                                   : 0;
          ASSERT_EQ(q[static_cast<size_t>(r) * padded + c], want) << "row " << r << " col " << c;
        }
      }
    }
  }
}

TEST(Sm90_QuantFp8, BitExactIdentityGatherScatter) {
  MOELORA_REQUIRE_SM90();
  check_quant_fp8_rows(300, 301);   // a partial last group
  check_quant_fp8_rows(262, 302);   // cols % 4 != 0: the scatter's scalar loads
  check_quant_fp8_rows(2048, 304);  // Qwen3 / Qwen3.5 hidden
  check_quant_fp8_rows(7168, 305);  // DeepSeek-V3 / Kimi hidden: 7 CTAs of 8 groups per row
}

TEST(Sm90_QuantFp8, ScatterRefusesGatherOrNoWidth) {
  MOELORA_REQUIRE_SM90();
  cuda::DeviceBuffer x_d(64 * 2), q_d(128), s_d(16), idx_d(16);
  ops::cuda::QuantFp8DeviceArgs a;
  a.x = x_d.as<__nv_bfloat16>();
  a.max_rows = 1;
  a.cols = 64;
  a.cols_padded = 128;
  a.q = q_d.as<uint8_t>();
  a.scale = s_d.as<float>();
  a.scatter = idx_d.as<int32_t>();
  a.scatter_rows = 1;
  a.scatter_width = 0;
  EXPECT_THROW(ops::cuda::launch_quantize_fp8_rows(a, nullptr), Error);
  a.scatter_width = 1;
  a.gather = idx_d.as<int32_t>();
  EXPECT_THROW(ops::cuda::launch_quantize_fp8_rows(a, nullptr), Error);
}

// A per-expert adapter pool on the device: the factors (bf16 A [S, E, R, in] and B [S, E, out, R],
// uploaded by the caller) and the per-slot arrays uploaded here; `target` is the kernels' view.
struct DevicePool {
  cuda::DeviceBuffer scaling, rank, a_shared, b_shared;
  ops::cuda::LoraPoolTarget target;
};
DevicePool make_device_pool(const void* a, const void* b, const std::vector<float>& scaling,
                            const std::vector<int32_t>& rank, const std::vector<uint8_t>& a_shared,
                            const std::vector<uint8_t>& b_shared, int E, int R, int in, int out) {
  DevicePool p{upload_vector(scaling), upload_vector(rank), upload_vector(a_shared), upload_vector(b_shared), {}};
  ops::cuda::LoraPoolTarget& t = p.target;
  t.a = static_cast<const __nv_bfloat16*>(a);
  t.b = static_cast<const __nv_bfloat16*>(b);
  t.scaling = p.scaling.as<float>();
  t.rank = p.rank.as<int32_t>();
  t.a_shared = p.a_shared.as<uint8_t>();
  t.b_shared = p.b_shared.as<uint8_t>();
  t.num_slots = static_cast<int>(scaling.size());
  t.ea = E;
  t.eb = E;
  t.max_rank = R;
  t.in_features = in;
  t.out_features = out;
  return p;
}

// LoRA fused into the decode MoE layer's quant and activation kernels (lora_row_fused.cuh): the
// quant kernel's seam-1 shrink partials (x rows gathered into sorted order), the activation
// kernel's seam-1 expand added to its gate / up values, and its seam-2 shrink partials of the bf16
// activation rows, each against double-precision sums; rows of base tokens and ranks past a
// slot's rank never written.
TEST(Sm90_LoraRowFused, QuantShrinkActivationExpandAndShrinkMatchReference) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(431));
  const int S = 3, E = 4, R = 16, K = 1160, Kp = 1280, T = 6, k = 2, P = T * k, chunks = 2;
  const int ranks[S] = {16, 5, 0};
  const uint8_t a_shared[S] = {0, 1, 0}, b_shared[S] = {1, 0, 0};
  const std::vector<int32_t> slot = {0, -1, 1, 2, 0, 1};
  std::vector<int32_t> topk_ids(P);
  for (int p = 0; p < P; ++p) topk_ids[p] = static_cast<int32_t>(rng() % E);
  // sorted rows: a permutation of the pairs
  std::vector<int32_t> row_pair(P), row_token(P);
  std::iota(row_pair.begin(), row_pair.end(), 0);
  std::shuffle(row_pair.begin(), row_pair.end(), rng);
  for (int q = 0; q < P; ++q) row_token[q] = row_pair[q] / k;
  // One pool for both seams' A (in = K) and the seam-1 B (out = 2K): the activation's I is K.
  Tensor a_pool = test::random_normal({S, E, R, K}, rng, 0.05f).to(DType::kBF16);
  Tensor b_pool = test::random_normal({S, E, 2 * K, R}, rng, 0.05f).to(DType::kBF16);
  Tensor x = test::random_normal({T, K}, rng).to(DType::kBF16);
  Tensor h = test::random_normal({P, 2 * K}, rng).to(DType::kBF16);
  std::vector<float> scaling = {1.f, 2.f, 3.f};
  auto a_d = cuda::to_device(a_pool);
  auto b_d = cuda::to_device(b_pool);
  auto x_d = cuda::to_device(x);
  auto h_d = cuda::to_device(h);
  auto token_d = upload_vector(row_token);
  std::vector<int2> slot_expert(P);
  for (int q = 0; q < P; ++q) slot_expert[q] = make_int2(slot[row_token[q]], topk_ids[row_pair[q]]);
  auto se_d = upload_vector(slot_expert);
  const DevicePool device_pool =
      make_device_pool(a_d.get(), b_d.get(), scaling, std::vector<int32_t>(ranks, ranks + S),
                       std::vector<uint8_t>(a_shared, a_shared + S), std::vector<uint8_t>(b_shared, b_shared + S),
                       E, R, K, 2 * K);
  const ops::cuda::LoraPoolTarget& pool = device_pool.target;
  const int capacity = P + 3;
  ops::cuda::LoraRowShrinkArgs lora;
  lora.pool = pool;
  lora.row_capacity = capacity;
  lora.row_slot_expert = se_d.as<int2>();
  const size_t partial_floats = static_cast<size_t>(chunks) * capacity * R;
  cuda::DeviceBuffer part1_d(partial_floats * 4), part2_d(partial_floats * 4);
  MOELORA_CUDA_CHECK(cudaMemset(part1_d.get(), 0xff, part1_d.bytes()));
  MOELORA_CUDA_CHECK(cudaMemset(part2_d.get(), 0xff, part2_d.bytes()));
  const Tensor a_f32 = a_pool.to_f32(), b_f32 = b_pool.to_f32();

  // values[q][c] of each sorted row -> the partials summed over the chunks against double sums;
  // returns u[q][r] (unscaled) as the GPU computed it.
  auto check = [&](const cuda::DeviceBuffer& part_d, const std::vector<std::vector<float>>& values, const char* what) {
    std::vector<float> part = download_vector<float>(part_d, partial_floats);
    std::vector<std::vector<double>> u(P, std::vector<double>(R, 0.0));
    for (int q = 0; q < P; ++q) {
      const int s = slot[row_token[q]];
      for (int r = 0; r < R; ++r) {
        const float got0 = part[(0 * static_cast<size_t>(capacity) + q) * R + r];
        const float got1 = part[(1 * static_cast<size_t>(capacity) + q) * R + r];
        if (s < 0 || r >= ranks[s]) {  // never written: still the 0xff poison (NaN)
          EXPECT_TRUE(std::isnan(got0) && std::isnan(got1)) << what << " row " << q << " rank " << r;
          continue;
        }
        const int ea = a_shared[s] ? 0 : topk_ids[row_pair[q]];
        double want = 0, mag = 0;
        for (int c = 0; c < K; ++c) {
          const double av = a_f32.data<float>()[((static_cast<size_t>(s) * E + ea) * R + r) * K + c];
          want += values[q][c] * av;
          mag += std::abs(values[q][c] * av);
        }
        EXPECT_NEAR(got0 + got1, want, 1e-5 * mag + 1e-6) << what << " row " << q << " rank " << r;
        u[q][r] = double(got0) + got1;
      }
    }
    return u;
  };

  // seam 1 shrink: the quant kernel over gathered x rows
  cuda::DeviceBuffer q_d(static_cast<size_t>(P) * Kp), s_d(static_cast<size_t>(P) * (Kp / 128) * 4);
  ops::cuda::QuantFp8DeviceArgs qa;
  qa.x = x_d.as<__nv_bfloat16>();
  qa.gather = token_d.as<int32_t>();
  qa.max_rows = P;
  qa.cols = K;
  qa.cols_padded = Kp;
  qa.q = q_d.as<uint8_t>();
  qa.scale = s_d.as<float>();
  qa.lora = lora;
  qa.lora.partial = part1_d.as<float>();
  ops::cuda::launch_quantize_fp8_rows(qa, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::vector<float>> xs(P, std::vector<float>(K));
  const Tensor xf = x.to_f32();
  for (int q = 0; q < P; ++q)
    for (int c = 0; c < K; ++c) xs[q][c] = xf.data<float>()[static_cast<size_t>(row_token[q]) * K + c];
  const auto u1 = check(part1_d, xs, "quant shrink");
  {  // the quantized rows are those of the plain kernel (the shrink only adds partials)
    auto ref = ops::quantize_fp8_per_token_ref(xf);
    auto qv = download_vector<uint8_t>(q_d, static_cast<size_t>(P) * Kp);
    for (int q = 0; q < P; ++q)
      for (int c = 0; c < K; ++c)
        ASSERT_EQ(qv[static_cast<size_t>(q) * Kp + c], ref.q.data<uint8_t>()[static_cast<size_t>(row_token[q]) * K + c]);
  }

  // the activation kernel: seam-1 expand of those partials into gate / up, then the seam-2 shrink
  // of the bf16 a16 values it wrote
  cuda::DeviceBuffer a16_d(static_cast<size_t>(P) * K * 2), aq_d(static_cast<size_t>(P) * Kp),
      sa_d(static_cast<size_t>(P) * (Kp / 128) * 4);
  ops::cuda::MoeActivationArgs act;
  act.h = h_d.as<__nv_bfloat16>();
  act.row_token = token_d.as<int32_t>();
  act.max_rows = P;
  act.inter = K;
  act.inter_padded = Kp;
  act.a16 = a16_d.as<__nv_bfloat16>();
  act.aq = aq_d.as<uint8_t>();
  act.sa = sa_d.as<float>();
  act.lora = lora;
  act.lora.partial = part2_d.as<float>();
  act.lora_expand.pool = pool;
  act.lora_expand.partial = part1_d.as<float>();
  act.lora_expand.splits = chunks;
  act.lora_expand.row_capacity = capacity;
  act.lora_expand.row_slot_expert = se_d.as<int2>();
  ops::cuda::launch_moe_activation(act, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const Tensor a16 = cuda::to_host(a16_d, DType::kBF16, {P, K}).to_f32();
  const Tensor hf = h.to_f32();
  std::vector<std::vector<float>> as(P, std::vector<float>(K));
  for (int q = 0; q < P; ++q) {
    const int s = slot[row_token[q]];
    const int eb = s >= 0 && b_shared[s] ? 0 : topk_ids[row_pair[q]];
    auto delta = [&](int n) {  // seam-1 delta of column n, from the partials the GPU wrote
      if (s < 0 || ranks[s] == 0) return 0.0;
      double d = 0;
      for (int r = 0; r < ranks[s]; ++r)
        d += u1[q][r] * b_f32.data<float>()[((static_cast<size_t>(s) * E + eb) * 2 * K + n) * R + r];
      return d * scaling[s];
    };
    for (int c = 0; c < K; ++c) {
      as[q][c] = a16.data<float>()[static_cast<size_t>(q) * K + c];
      const double g = hf.data<float>()[static_cast<size_t>(q) * 2 * K + c] + delta(c);
      const double u = hf.data<float>()[static_cast<size_t>(q) * 2 * K + K + c] + delta(K + c);
      const double want = g / (1.0 + std::exp(-g)) * u;
      ASSERT_NEAR(as[q][c], want, 8e-3 * std::abs(want) + 1e-4) << "a16 row " << q << " col " << c << " slot " << s;
    }
  }
  check(part2_d, as, "activation shrink");

  // fused arguments that do not match the rows are refused
  ops::cuda::QuantFp8DeviceArgs bad = qa;
  bad.lora.pool.in_features = K + 8;
  EXPECT_THROW(ops::cuda::launch_quantize_fp8_rows(bad, nullptr), Error);
  ops::cuda::MoeActivationArgs bad_act = act;
  bad_act.lora_expand.pool.out_features = K;
  EXPECT_THROW(ops::cuda::launch_moe_activation(bad_act, nullptr), Error);
}

// Multi-LoRA over (slot, expert) segments of pool rank R over `in` input features: per-expert and
// shared-outer slots, ranks R, 5, 0 and R - 4.
void check_segmented_shrink_expand(int in, int R, uint64_t seed_tag) {
  SCOPED_TRACE(::testing::Message() << "in " << in << ", R " << R);
  std::mt19937_64 rng(test::test_seed(seed_tag));
  const int S = 4, E = 6, out = 300, rows = 23;
  const int ranks[S] = {R, 5, 0, R - 4};
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
  auto seg_d = upload_vector(segs);
  auto nseg_d = upload_vector(std::vector<int32_t>{static_cast<int32_t>(segs.size())});
  auto x_d = cuda::to_device(x.to(DType::kBF16));
  auto g_d = upload_vector(gather);
  cuda::DeviceBuffer part(ops::cuda::lora_partial_bytes(in, rows, R));
  cuda::DeviceBuffer delta(static_cast<size_t>(rows) * out * 2);
  MOELORA_CUDA_CHECK(cudaMemset(delta.get(), 0xff, delta.bytes()));  // rank-0 rows must be overwritten

  const DevicePool device_pool = make_device_pool(a_d.get(), b_d.get(), scaling, std::vector<int32_t>(ranks, ranks + S),
                                                  a_sh, b_sh, E, R, in, out);
  const ops::cuda::LoraPoolTarget& pool = device_pool.target;
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

  // The expand as a programmatic dependent of the shrink (B rows loaded before its wait), on a
  // stream and in a captured graph, partials and delta poisoned first: bitwise the same delta.
  cuda::Stream stream;
  ea.pdl = true;
  auto poison = [&] {
    MOELORA_CUDA_CHECK(cudaMemsetAsync(part.get(), 0xff, part.bytes(), stream.get()));
    MOELORA_CUDA_CHECK(cudaMemsetAsync(delta.get(), 0xff, delta.bytes(), stream.get()));
  };
  poison();
  ops::cuda::launch_lora_shrink(sa, stream.get());
  ops::cuda::launch_lora_expand(ea, stream.get());
  stream.synchronize();
  EXPECT_EQ(test::max_abs_diff(cuda::to_host(delta, DType::kBF16, {rows, out}).to_f32(), got), 0.0)
      << "programmatic launch";
  poison();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  ops::cuda::launch_lora_shrink(sa, stream.get());
  ops::cuda::launch_lora_expand(ea, stream.get());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.synchronize();
  EXPECT_EQ(test::max_abs_diff(cuda::to_host(delta, DType::kBF16, {rows, out}).to_f32(), got), 0.0)
      << "graph replay";
  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));

  // Capped grids (few CTAs looping over the units, as the MoE layer launches them beside its
  // expert GEMMs), with one or two row chunks per segment: every partial and delta element is
  // still written by one thread in a fixed order, so the delta is bitwise the same.
  for (int max_ctas : {1, 3, 7, 1000})
    for (int row_chunks : {1, 2}) {
      ops::cuda::LoraShrinkArgs sc = sa;
      sc.seg.max_ctas = max_ctas;
      sc.seg.row_chunks = row_chunks;
      ops::cuda::LoraExpandArgs ec = ea;
      ec.seg = sc.seg;
      ec.beside_gemm = max_ctas % 2 == 1;  // both register budgets
      poison();
      ops::cuda::launch_lora_shrink(sc, stream.get());
      ops::cuda::launch_lora_expand(ec, stream.get());
      stream.synchronize();
      EXPECT_EQ(test::max_abs_diff(cuda::to_host(delta, DType::kBF16, {rows, out}).to_f32(), got), 0.0)
          << "max_ctas " << max_ctas << ", row_chunks " << row_chunks;
    }
  ops::cuda::LoraShrinkArgs bad = sa;
  bad.seg.max_ctas = -2;
  EXPECT_THROW(ops::cuda::launch_lora_shrink(bad, stream.get()), Error);
}

// The segment shrink's instances: 256 / 512 / 1024-column splits (in = 1000 / 2056 / 7176) and
// one, two or three 16-rank groups of A rows (R = 16, 24, 40).
TEST(Sm90_Lora, SegmentedShrinkExpandMatchesPerRowReference) {
  MOELORA_REQUIRE_SM90();
  check_segmented_shrink_expand(2056, 16, 401);
  check_segmented_shrink_expand(1000, 40, 402);
  check_segmented_shrink_expand(7176, 24, 403);
}

}  // namespace
}  // namespace moelora
