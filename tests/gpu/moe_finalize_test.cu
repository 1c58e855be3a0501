// Sm90 MoE finalize (ops/moe/moe_cuda.cuh) with the seam-2 LoRA expand folded in
// (MoeFinalizeArgs::lora_expand) against the path it replaces, on random inputs: the segment
// expand (launch_lora_expand, kWrite) followed by the plain finalize, bit for bit, and both
// against a double-precision reference of the formula. The batch mixes what the layer can hand
// the kernel: base tokens (slot -1), a rank-0 slot, a shared-B slot, ranks that end inside an
// 8-rank chunk (B's tail values there are finite and multiplied by zero in both paths), pairs
// without a local expert (pair_pos -1, as under expert parallelism), padding tokens past the
// device token count (left untouched) and a hidden size that is not a multiple of the kernel's
// 128 columns; and with the shared expert among the pairs (MoeLayerConfig::shared_in_experts:
// pair k of each token, gated by sigmoid(x . wsg), plus its own LoRA delta rows), which both
// kernels add after the routed pairs. Refusals name what is wrong (a separate shared expert output
// among them: the layer folds only where the finalize follows GEMM2 directly).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "gpu/gpu_test_util.cuh"
#include "ops/lora/lora_cuda.cuh"
#include "ops/moe/moe_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16_bits(d(rng));
  return v;
}

std::vector<float> bf16_to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_bits_to_f32(v[i]);
  return f;
}

struct FoldCase {
  int max_rank;  // R of the pool (the kernel's 2- or 4-chunk instance)
  int top_k;
  bool shared_pairs = false;  // the shared expert as pair k of every token (expert E, base bin)
};

void check_fold(const FoldCase& c, uint64_t seed) {
  std::mt19937_64 rng(test::test_seed(seed));
  const int T = 13, valid = 11, k = c.top_k, E = 6, routed = 9, H = 200, in = 768, S = 4;
  const int kp = k + (c.shared_pairs ? 1 : 0);  // pair_pos entries per token
  const int R = c.max_rank, P = T * kp;
  const int splits = ops::cuda::lora_shrink_splits(in);
  const std::vector<int32_t> ranks =
      R > 16 ? std::vector<int32_t>{R, 21, 0, 9} : std::vector<int32_t>{R, 5, 0, 13};
  const std::vector<float> scaling = {0.5f, 1.25f, 2.0f, 0.75f};
  const std::vector<uint8_t> b_shared = {0, 0, 0, 1};
  std::vector<int32_t> slot(T);
  for (int t = 0; t < T; ++t) slot[t] = t % 5 - 1;  // -1, 0, 1, 2, 3, -1, ...

  // routing: k distinct experts of `routed`, the local ones [0, E) get sorted positions by
  // (expert, slot) as the align kernel orders them; the others keep pair_pos -1
  std::vector<int32_t> pair_pos(P, -1);
  std::vector<float> weights(static_cast<size_t>(T) * k);
  std::uniform_real_distribution<float> w01(0.05f, 1.f);
  std::vector<std::tuple<int, int, int>> keyed;  // (expert, slot + 1, pair)
  for (int t = 0; t < T; ++t) {
    std::vector<int> experts(routed);
    for (int e = 0; e < routed; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int j = 0; j < k; ++j) {
      weights[t * k + j] = w01(rng);
      if (experts[j] < E) keyed.emplace_back(experts[j], slot[t] + 1, t * kp + j);
    }
    // the shared expert's pair: expert E, base bin, valid tokens only (as the align writes it)
    if (c.shared_pairs && t < valid) keyed.emplace_back(E, 0, t * kp + k);
  }
  std::sort(keyed.begin(), keyed.end());
  std::vector<int2> slot_expert(P, make_int2(-1, 0));
  std::vector<int4> segments;  // {slot, expert, begin, end} of the rows with a slot
  for (size_t q = 0; q < keyed.size(); ++q) {
    const auto [e, s1, pair] = keyed[q];
    pair_pos[pair] = static_cast<int32_t>(q);
    slot_expert[q] = make_int2(s1 - 1, e);
    if (s1 == 0) continue;
    if (!segments.empty() && segments.back().x == s1 - 1 && segments.back().y == e)
      ++segments.back().w;
    else
      segments.push_back(make_int4(s1 - 1, e, static_cast<int>(q), static_cast<int>(q) + 1));
  }

  // the pool's B [S, E, H, R]: every value finite, also past each slot's rank
  const std::vector<uint16_t> b_pool = random_bf16(static_cast<size_t>(S) * E * H * R, rng, 0.05f);
  const std::vector<uint16_t> a_pool(static_cast<size_t>(S) * E * R * in, 0);  // unread
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> partial(static_cast<size_t>(splits) * P * R);
  for (auto& v : partial) v = nd(rng);
  const std::vector<uint16_t> y = random_bf16(static_cast<size_t>(P) * H, rng, 1.f);
  // the shared expert's gate input, gate weight and LoRA delta rows (row of token t: a permutation)
  const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(T) * H, rng, 1.f);
  const std::vector<uint16_t> gate_w = random_bf16(H, rng, 0.1f);
  const std::vector<uint16_t> shared_delta = random_bf16(static_cast<size_t>(T) * H, rng, 0.3f);
  std::vector<int32_t> shared_delta_row(T);
  for (int t = 0; t < T; ++t) shared_delta_row[t] = t;
  std::shuffle(shared_delta_row.begin(), shared_delta_row.end(), rng);
  auto x_d = upload_vector(x);
  auto gate_d = upload_vector(gate_w);
  auto sd_d = upload_vector(shared_delta);
  auto sdr_d = upload_vector(shared_delta_row);

  auto b_d = upload_vector(b_pool);
  auto a_d = upload_vector(a_pool);
  auto scaling_d = upload_vector(scaling);
  auto rank_d = upload_vector(ranks);
  auto bsh_d = upload_vector(b_shared);
  auto partial_d = upload_vector(partial);
  auto y_d = upload_vector(y);
  auto w_d = upload_vector(weights);
  auto pos_d = upload_vector(pair_pos);
  auto se_d = upload_vector(slot_expert);
  auto slot_d = upload_vector(slot);
  auto valid_d = upload_vector(std::vector<int32_t>{valid});
  auto seg_d = upload_vector(segments);
  auto nseg_d = upload_vector(std::vector<int32_t>{static_cast<int32_t>(segments.size())});

  ops::cuda::LoraPoolTarget pool;
  pool.a = a_d.as<__nv_bfloat16>();
  pool.b = b_d.as<__nv_bfloat16>();
  pool.scaling = scaling_d.as<float>();
  pool.rank = rank_d.as<int32_t>();
  pool.b_shared = bsh_d.as<uint8_t>();
  pool.num_slots = S;
  pool.ea = pool.eb = E;
  pool.max_rank = R;
  pool.in_features = in;
  pool.out_features = H;

  ops::cuda::MoeFinalizeArgs f;
  f.y = y_d.as<__nv_bfloat16>();
  f.topk_weights = w_d.as<float>();
  f.pair_pos = pos_d.as<int32_t>();
  f.slot = slot_d.as<int32_t>();
  f.num_tokens = valid_d.as<int32_t>();
  f.max_tokens = T;
  f.top_k = k;
  f.hidden = H;
  if (c.shared_pairs) {
    f.shared_in_pairs = true;
    f.x = x_d.as<__nv_bfloat16>();
    f.shared_gate = gate_d.as<__nv_bfloat16>();
    f.shared_delta = sd_d.as<__nv_bfloat16>();
    f.shared_delta_row = sdr_d.as<int32_t>();
  }

  // the path the fold replaces: the segment expand into d2 (rows of base tokens left NaN), then
  // the plain finalize
  cuda::DeviceBuffer d2(static_cast<size_t>(P) * H * 2);
  MOELORA_CUDA_CHECK(cudaMemset(d2.get(), 0xff, d2.bytes()));
  ops::cuda::LoraExpandArgs ea;
  ea.pool = pool;
  ea.seg = ops::cuda::LoraSegmentsView{seg_d.as<int4>(), nseg_d.as<int32_t>(), P};
  ea.partial = partial_d.as<float>();
  ea.row_capacity = P;
  ea.delta = d2.as<__nv_bfloat16>();
  ops::cuda::launch_lora_expand(ea, nullptr);
  const uint16_t untouched = 0x7fc1;  // a NaN no kernel writes
  cuda::DeviceBuffer out_plain(static_cast<size_t>(T) * H * 2), out_fold(out_plain.bytes());
  const std::vector<uint16_t> fill(static_cast<size_t>(T) * H, untouched);
  out_plain.upload(fill.data(), out_plain.bytes());
  out_fold.upload(fill.data(), out_fold.bytes());
  ops::cuda::MoeFinalizeArgs plain = f;
  plain.delta = d2.as<__nv_bfloat16>();
  plain.out = out_plain.as<__nv_bfloat16>();
  ops::cuda::launch_moe_finalize(plain, nullptr);
  ops::cuda::MoeFinalizeArgs fold = f;
  fold.lora_expand.pool = pool;
  fold.lora_expand.partial = partial_d.as<float>();
  fold.lora_expand.splits = splits;
  fold.lora_expand.row_capacity = P;
  fold.lora_expand.row_slot_expert = se_d.as<int2>();
  fold.out = out_fold.as<__nv_bfloat16>();
  ops::cuda::launch_moe_finalize(fold, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got_plain = download_vector<uint16_t>(out_plain, fill.size());
  const std::vector<uint16_t> got_fold = download_vector<uint16_t>(out_fold, fill.size());

  // double-precision reference of the formula
  const std::vector<float> bf = bf16_to_f32(b_pool), yf = bf16_to_f32(y);
  int mismatches = 0;
  double worst = 0.0;
  for (int t = 0; t < T; ++t) {
    for (int n = 0; n < H; ++n) {
      const size_t o = static_cast<size_t>(t) * H + n;
      if (t >= valid) {  // padding tokens: neither kernel writes them
        EXPECT_EQ(got_plain[o], untouched) << "padding token " << t;
        EXPECT_EQ(got_fold[o], untouched) << "padding token " << t;
        continue;
      }
      mismatches += got_plain[o] != got_fold[o];
      double want = 0.0;
      for (int j = 0; j < k; ++j) {
        const int pos = pair_pos[t * kp + j];
        if (pos < 0) continue;
        double v = yf[static_cast<size_t>(pos) * H + n];
        const int s = slot[t];
        if (s >= 0) {
          const int e = slot_expert[pos].y;
          const int eb = b_shared[s] ? 0 : e;
          double d = 0.0;
          for (int r = 0; r < ranks[s]; ++r) {
            double u = 0.0;
            for (int sp = 0; sp < splits; ++sp)
              u += partial[(static_cast<size_t>(sp) * P + pos) * R + r];
            d += u * scaling[s] * bf[((static_cast<size_t>(s) * E + eb) * H + n) * R + r];
          }
          v += round_to_bf16(static_cast<float>(d));
        }
        want += weights[t * k + j] * v;
      }
      if (c.shared_pairs) {  // + sigmoid(x . wsg) (y_shared + the token's shared delta)
        double dot = 0.0;
        for (int h = 0; h < H; ++h)
          dot += double(bf16_bits_to_f32(x[static_cast<size_t>(t) * H + h])) *
                 bf16_bits_to_f32(gate_w[h]);
        const double gate = 1.0 / (1.0 + std::exp(-dot));
        double v = yf[static_cast<size_t>(pair_pos[t * kp + k]) * H + n];
        if (slot[t] >= 0)
          v += bf16_bits_to_f32(shared_delta[static_cast<size_t>(shared_delta_row[t]) * H + n]);
        want += gate * v;
      }
      const double err = std::abs(bf16_bits_to_f32(got_fold[o]) - want);
      worst = std::max(worst, err / (std::abs(want) + 1.0));
    }
  }
  EXPECT_EQ(mismatches, 0) << "the fold's output differs from expand + finalize";
  // bf16 output, and d rounded to bf16 from a float sum: well below 1 % of |want| + 1
  EXPECT_LT(worst, 1e-2) << "against the double-precision reference";
}

TEST(Sm90_MoeFinalize, FoldedSeam2ExpandEqualsTheSegmentExpandThenFinalize) {
  MOELORA_REQUIRE_SM90();
  for (const FoldCase& c : {FoldCase{16, 8}, FoldCase{16, 3}, FoldCase{32, 8}, FoldCase{24, 5},
                            FoldCase{16, 8, true}, FoldCase{32, 5, true}}) {
    SCOPED_TRACE("R " + std::to_string(c.max_rank) + ", k " + std::to_string(c.top_k) +
                 (c.shared_pairs ? ", the shared expert among the pairs" : ""));
    check_fold(c, 601 + c.max_rank + c.top_k + (c.shared_pairs ? 100 : 0));
  }
}

TEST(Sm90_MoeFinalize, FoldRefusesWhatItCannotHold) {
  MOELORA_REQUIRE_SM90();
  cuda::DeviceBuffer dummy(1 << 16);
  ops::cuda::MoeFinalizeArgs f;
  f.y = dummy.as<__nv_bfloat16>();
  f.topk_weights = dummy.as<float>();
  f.pair_pos = dummy.as<int32_t>();
  f.slot = dummy.as<int32_t>();
  f.out = dummy.as<__nv_bfloat16>();
  f.max_tokens = 4;
  f.top_k = 8;
  f.hidden = 64;
  f.lora_expand.pool.b = dummy.as<__nv_bfloat16>();
  f.lora_expand.pool.rank = dummy.as<int32_t>();
  f.lora_expand.pool.scaling = dummy.as<float>();
  f.lora_expand.pool.max_rank = 16;
  f.lora_expand.pool.out_features = 64;
  f.lora_expand.partial = dummy.as<float>();
  f.lora_expand.splits = 1;
  f.lora_expand.row_capacity = 32;
  f.lora_expand.row_slot_expert = dummy.as<int2>();
  auto refused = [&](const ops::cuda::MoeFinalizeArgs& a, const std::string& part) {
    const std::string msg =
        test::error_message([&] { ops::cuda::launch_moe_finalize(a, nullptr); });
    EXPECT_TRUE(test::contains(msg, part)) << msg;
  };
  ops::cuda::MoeFinalizeArgs a = f;
  a.top_k = 9;
  refused(a, "top_k <= 8 (got 9)");
  a = f;
  a.lora_expand.pool.max_rank = 40;
  refused(a, "R <= 32 (got 40)");
  a = f;
  a.lora_expand.row_capacity = 31;
  refused(a, "row_capacity >= the pair rows (31 vs 32)");
  a = f;
  a.shared_in_pairs = true;  // T (k + 1) = 36 rows
  a.lora_expand.row_capacity = 32;
  refused(a, "row_capacity >= the pair rows (32 vs 36)");
  a = f;
  a.lora_expand.pool.out_features = 72;
  refused(a, "out_features = H (72 vs 64)");
  a = f;
  a.delta = dummy.as<__nv_bfloat16>();
  refused(a, "no separate delta");
  a = f;
  a.shared = dummy.as<__nv_bfloat16>();
  refused(a, "no separate shared expert output");
  a = f;
  a.lora_expand = {};
  a.shared = dummy.as<__nv_bfloat16>();
  a.shared_in_pairs = true;
  refused(a, "not both");
  // the shared expert's folded seam-2 expand (MoeFinalizeArgs::shared_lora_expand)
  ops::cuda::MoeFinalizeArgs s = f;
  s.shared_in_pairs = true;
  s.lora_expand.row_capacity = 36;
  s.shared_lora_expand = f.lora_expand;
  s.shared_lora_expand.row_capacity = 4;
  a = s;
  a.shared_in_pairs = false;
  a.lora_expand.row_capacity = 32;
  refused(a, "needs shared_in_pairs");
  a = s;
  a.lora_expand = {};
  refused(a, "needs the routed one (lora_expand)");
  a = s;
  a.shared_lora_expand.row_capacity = 3;
  refused(a, "row_capacity >= T (3 vs 4)");
  a = s;
  a.shared_lora_expand.pool.max_rank = 24;  // the routed pool's R 16 takes the 16-rank instance
  refused(a, "R within the routed pool's instance (24 vs 16)");
  a = s;
  a.shared_delta = dummy.as<__nv_bfloat16>();
  a.shared_delta_row = dummy.as<int32_t>();
  refused(a, "no shared_delta");
}

}  // namespace
}  // namespace moelora
