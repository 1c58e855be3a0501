// Sm90 multi-LoRA on the token rows of dense projections (attention q/k/v/o, dense MLP) against
// the CPU reference on random inputs: one adapter over a decode batch on every grid (row-major and
// segment-major, bit-identical to each other), mixed ranks around base rows, and multi-target
// launches shaped like Qwen3's qkv and Kimi's q_a / kv_a in write and add mode, with their
// host-side refusals. (The expert segments' LoRA kernels are in moe_ops_test.cu.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "ops/lora/lora.h"
#include "ops/lora/lora_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

// The token rows of a dense projection (attention q/k/v/o, dense MLP): segments are the maximal
// runs of rows with one slot >= 0, as the model's step metadata builds them, expert 0, no gather.

constexpr uint16_t kSentinel = 0xffff;  // bf16 NaN: rows outside every segment must keep it

// {slot, 0, begin, end} for every maximal run of rows whose slot is >= 0, in row order.
std::vector<int4> slot_runs(const std::vector<int32_t>& slots) {
  std::vector<int4> segs;
  const int T = static_cast<int>(slots.size());
  for (int r = 0; r < T;) {
    int end = r + 1;
    while (end < T && slots[end] == slots[r]) ++end;
    if (slots[r] >= 0) segs.push_back(make_int4(slots[r], 0, r, end));
    r = end;
  }
  return segs;
}

// Row slots from (slot, rows) runs.
std::vector<int32_t> slot_pattern(const std::vector<std::pair<int32_t, int>>& runs) {
  std::vector<int32_t> slots;
  for (const auto& [slot, rows] : runs) slots.insert(slots.end(), rows, slot);
  return slots;
}

// A dense (Ea = Eb = 1) pool target of S slots on the device, with the bf16-rounded factors of
// every slot of rank > 0 kept as fp32 for the CPU reference. Every target gets its own random
// factors, so a delta that lands in another target's columns fails the comparison.
struct DensePoolTarget {
  int in = 0, out = 0, R = 0;
  std::vector<int32_t> ranks;
  std::vector<float> scaling;
  std::vector<LoraFactors> factors;  // [S]; undefined where the rank is 0
  cuda::DeviceBuffer a, b, sc, rk;

  ops::cuda::LoraPoolTarget view() const {
    ops::cuda::LoraPoolTarget v;
    v.a = a.as<__nv_bfloat16>();
    v.b = b.as<__nv_bfloat16>();
    v.scaling = sc.as<float>();
    v.rank = rk.as<int32_t>();
    v.num_slots = static_cast<int>(ranks.size());
    v.max_rank = R;
    v.in_features = in;
    v.out_features = out;
    return v;
  }
  std::vector<const LoraFactors*> adapters() const {
    std::vector<const LoraFactors*> v;
    for (const LoraFactors& f : factors) v.push_back(f.defined() ? &f : nullptr);
    return v;
  }
};

DensePoolTarget make_dense_target(int in, int out, int R, const std::vector<int32_t>& ranks,
                                  std::mt19937_64& rng) {
  DensePoolTarget t;
  t.in = in;
  t.out = out;
  t.R = R;
  t.ranks = ranks;
  const size_t S = ranks.size();
  t.factors.resize(S);
  std::vector<uint16_t> a_pool(S * R * in, 0), b_pool(S * out * R, 0);  // rank tails stay zero
  for (size_t s = 0; s < S; ++s) {
    t.scaling.push_back(0.5f + 0.375f * static_cast<float>(s));
    const int r = ranks[s];
    if (r == 0) continue;
    Tensor a = test::random_normal({1, r, in}, rng, 0.05f).to(DType::kBF16).to_f32();
    Tensor b = test::random_normal({1, out, r}, rng, 0.05f).to(DType::kBF16).to_f32();
    for (int i = 0; i < r; ++i)
      for (int c = 0; c < in; ++c)
        a_pool[(s * R + i) * in + c] = f32_to_bf16_bits(a.data<float>()[i * in + c]);
    for (int n = 0; n < out; ++n)
      for (int i = 0; i < r; ++i)
        b_pool[(s * out + n) * R + i] = f32_to_bf16_bits(b.data<float>()[n * r + i]);
    t.factors[s] = {a, b, t.scaling[s]};
  }
  t.a = upload_vector(a_pool);
  t.b = upload_vector(b_pool);
  t.sc = upload_vector(t.scaling);
  t.rk = upload_vector(ranks);
  return t;
}

// delta [T, out] of the CPU reference (zero on rows of slot -1 and of rank-0 slots).
Tensor reference_delta(const Tensor& x, const std::vector<int32_t>& slots,
                       const DensePoolTarget& t) {
  Tensor y = Tensor::zeros(DType::kF32, {static_cast<int64_t>(slots.size()), t.out});
  ops::lora_add_slots_ref(x, slots, t.adapters(), y);
  return y;
}

// Columns [col, col + n) of bf16 bits [rows, ld] against `want` [rows, n]: rows of slot -1 must
// still hold the sentinel, the others must be within the bf16 tolerance of the reference.
::testing::AssertionResult check_block(const std::vector<uint16_t>& bits, int ld, int col, int n,
                                       const std::vector<int32_t>& slots, const Tensor& want,
                                       const std::string& what) {
  const int T = static_cast<int>(slots.size());
  Tensor got = Tensor::zeros(DType::kF32, {T, n});
  for (int r = 0; r < T; ++r) {
    for (int c = 0; c < n; ++c) {
      const uint16_t v = bits[static_cast<size_t>(r) * ld + col + c];
      if (slots[r] < 0) {
        if (v != kSentinel)
          return ::testing::AssertionFailure()
                 << what << ": row " << r << " (slot -1) column " << c << " was written";
      } else {
        got.data<float>()[static_cast<size_t>(r) * n + c] = bf16_bits_to_f32(v);
      }
    }
  }
  ::testing::AssertionResult close = test::close_bf16(got, want);
  if (!close) close << " (" << what << ")";
  return close;
}

// Segments and their count on the device; the buffer holds `capacity` entries.
struct DeviceSegments {
  cuda::DeviceBuffer segs, count;
  DeviceSegments(std::vector<int4> runs, int capacity) {
    const int n = static_cast<int>(runs.size());
    runs.resize(std::max(capacity, 1), make_int4(0, 0, 0, 0));
    segs = upload_vector(runs);
    count = upload_vector(std::vector<int32_t>{n});
  }
  // Row-major grids when max_rows > 0, else segment-major with `row_chunks` CTAs per segment.
  ops::cuda::LoraSegmentsView view(int capacity, int max_rows, int row_chunks = 1) const {
    ops::cuda::LoraSegmentsView v{segs.as<int4>(), count.as<int32_t>(), capacity, row_chunks};
    v.max_rows = max_rows;
    return v;
  }
};

// Single-target shrink + expand (write mode) into delta [T, out], sentinel-filled first.
std::vector<uint16_t> run_single_target(const DensePoolTarget& t,
                                        const ops::cuda::LoraSegmentsView& view,
                                        const cuda::DeviceBuffer& x, int T) {
  cuda::DeviceBuffer part(ops::cuda::lora_partial_bytes(t.in, T, t.R));
  // NaN partials: the expand reads every rank below R and must drop those past a slot's rank,
  // which no shrink writes
  MOELORA_CUDA_CHECK(cudaMemset(part.get(), 0xff, part.bytes()));
  cuda::DeviceBuffer delta(static_cast<size_t>(T) * t.out * 2);
  MOELORA_CUDA_CHECK(cudaMemset(delta.get(), 0xff, delta.bytes()));
  ops::cuda::LoraShrinkArgs sa{t.view(), view, x.as<__nv_bfloat16>(), nullptr, part.as<float>(), T};
  ops::cuda::launch_lora_shrink(sa, nullptr);
  ops::cuda::LoraExpandArgs ea;
  ea.pool = t.view();
  ea.seg = view;
  ea.partial = part.as<float>();
  ea.row_capacity = T;
  ea.delta = delta.as<__nv_bfloat16>();
  ops::cuda::launch_lora_expand(ea, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  return download_vector<uint16_t>(delta, static_cast<size_t>(T) * t.out);
}

// One adapter over a decode batch (the case that spread 64 rows over 2 CTAs per K split): 64 and
// 128 rows plus padding rows of slot -1, Qwen3's k/v width, on every grid (row-major and
// segment-major with 1 and ceil(T / 32) chunks), each bit-identical to the others.
TEST(Sm90_Lora, DenseDecodeOneSegmentOnEveryGrid) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(411));
  const int S = 4, R = 16, in = 2048, out = 512;
  const DensePoolTarget t = make_dense_target(in, out, R, {16, 16, 16, 16}, rng);
  for (const int rows : {64, 128}) {
    SCOPED_TRACE("rows = " + std::to_string(rows));
    const std::vector<int32_t> slots = slot_pattern({{2, rows}, {-1, 3}});
    const int T = static_cast<int>(slots.size());
    Tensor x = test::random_normal({T, in}, rng).to(DType::kBF16).to_f32();
    auto x_d = cuda::to_device(x.to(DType::kBF16));
    const Tensor want = reference_delta(x, slots, t);
    const DeviceSegments segs(slot_runs(slots), S);
    const std::vector<std::pair<std::string, ops::cuda::LoraSegmentsView>> grids = {
        {"row-major", segs.view(S, T)},
        {"segment-major x1", segs.view(S, 0, 1)},
        {"segment-major x" + std::to_string((T + 31) / 32), segs.view(S, 0, (T + 31) / 32)}};
    std::vector<uint16_t> first;
    for (const auto& [name, view] : grids) {
      const std::vector<uint16_t> bits = run_single_target(t, view, x_d, T);
      EXPECT_TRUE(check_block(bits, out, 0, out, slots, want, name));
      if (first.empty()) {
        first = bits;
      } else {
        EXPECT_TRUE(bits == first) << name << " differs from " << grids[0].first;
      }
    }
  }
}

// Several adapters of mixed ranks (5, 16, 64) and a rank-0 slot in one R = 64 pool, base rows
// (slot -1) between and around the segments, segments not in slot order, in and out not
// multiples of a K split or a column tile; row-major with the tightest row bound (the rows of the
// segments only) and with T, and segment-major.
TEST(Sm90_Lora, DenseMixedRanksSegmentsAndBaseRows) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(412));
  const int S = 6, R = 64, in = 1032, out = 300;
  const DensePoolTarget t = make_dense_target(in, out, R, {5, 16, 64, 0, 16, 16}, rng);
  const std::vector<int32_t> slots =
      slot_pattern({{-1, 3}, {2, 20}, {0, 7}, {-1, 2}, {1, 17}, {3, 5}, {4, 1}, {-1, 6}});
  const int T = static_cast<int>(slots.size());
  const int adapter_rows =
      static_cast<int>(std::count_if(slots.begin(), slots.end(), [](int32_t s) { return s >= 0; }));
  Tensor x = test::random_normal({T, in}, rng).to(DType::kBF16).to_f32();
  auto x_d = cuda::to_device(x.to(DType::kBF16));
  const Tensor want = reference_delta(x, slots, t);
  const DeviceSegments segs(slot_runs(slots), S);
  const std::vector<std::pair<std::string, ops::cuda::LoraSegmentsView>> grids = {
      {"row-major, max_rows = adapter rows", segs.view(S, adapter_rows)},
      {"row-major, max_rows = T", segs.view(S, T)},
      {"segment-major x1", segs.view(S, 0, 1)},
      {"segment-major x3", segs.view(S, 0, 3)}};
  std::vector<uint16_t> first;
  for (const auto& [name, view] : grids) {
    const std::vector<uint16_t> bits = run_single_target(t, view, x_d, T);
    EXPECT_TRUE(check_block(bits, out, 0, out, slots, want, name));
    // rank-0 rows (slot 3) are written with exact zeros
    for (int r = 0; r < T; ++r)
      if (slots[r] == 3)
        for (int c = 0; c < out; ++c)
          ASSERT_EQ(bits[static_cast<size_t>(r) * out + c], 0) << name << " row " << r;
    if (first.empty()) {
      first = bits;
    } else {
      EXPECT_TRUE(bits == first) << name << " differs from " << grids[0].first;
    }
  }
}

// Targets that read the same x in one shrink and one expand launch: write mode into one delta
// [T, sum of outs] at each target's column offset, checked per target against its own reference
// and bit for bit against single-target launches; then add mode into a base output y [T, sum of
// outs], which must equal bf16(y + delta) on adapter rows (y on base rows and where the slot's
// rank for that target is 0).
struct MultiTargetCase {
  int in = 0;
  std::vector<int> outs;                      // per target
  std::vector<std::vector<int32_t>> ranks;    // [target][slot]
  std::vector<std::pair<int32_t, int>> runs;  // (slot, rows)
};

void check_multi_target(const MultiTargetCase& c, uint64_t seed) {
  std::mt19937_64 rng(test::test_seed(seed));
  const int R = 16, nt = static_cast<int>(c.outs.size());
  const int S = static_cast<int>(c.ranks[0].size());
  std::vector<DensePoolTarget> targets;
  std::vector<int> col(nt + 1, 0);
  for (int i = 0; i < nt; ++i) {
    targets.push_back(make_dense_target(c.in, c.outs[i], R, c.ranks[i], rng));
    col[i + 1] = col[i] + c.outs[i];
  }
  const int ld = col[nt];
  const std::vector<int32_t> slots = slot_pattern(c.runs);
  const int T = static_cast<int>(slots.size());
  Tensor x = test::random_normal({T, c.in}, rng).to(DType::kBF16).to_f32();
  auto x_d = cuda::to_device(x.to(DType::kBF16));
  const DeviceSegments segs(slot_runs(slots), S);
  const ops::cuda::LoraSegmentsView view = segs.view(S, T);

  std::vector<cuda::DeviceBuffer> parts;
  ops::cuda::LoraMultiShrinkArgs sa;
  ops::cuda::LoraMultiExpandArgs ea;
  cuda::DeviceBuffer delta(static_cast<size_t>(T) * ld * 2);
  MOELORA_CUDA_CHECK(cudaMemset(delta.get(), 0xff, delta.bytes()));
  for (int i = 0; i < nt; ++i) {
    parts.emplace_back(ops::cuda::lora_partial_bytes(c.in, T, R));
    MOELORA_CUDA_CHECK(cudaMemset(parts.back().get(), 0xff, parts.back().bytes()));  // NaN
    sa.targets[i] = {targets[i].view(), parts[i].as<float>()};
    ea.targets[i].pool = targets[i].view();
    ea.targets[i].partial = parts[i].as<float>();
    ea.targets[i].out = delta.as<__nv_bfloat16>() + col[i];
    ea.targets[i].out_stride = ld;
  }
  sa.num_targets = ea.num_targets = nt;
  sa.seg = ea.seg = view;
  sa.x = x_d.as<__nv_bfloat16>();
  sa.row_capacity = ea.row_capacity = T;
  ops::cuda::launch_lora_shrink_multi(sa, nullptr);
  ops::cuda::launch_lora_expand_multi(ea, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> bits = download_vector<uint16_t>(delta, static_cast<size_t>(T) * ld);
  for (int i = 0; i < nt; ++i) {
    const std::string name =
        "target " + std::to_string(i) + " (out " + std::to_string(c.outs[i]) + ")";
    EXPECT_TRUE(check_block(bits, ld, col[i], c.outs[i], slots,
                            reference_delta(x, slots, targets[i]), name));
    const std::vector<uint16_t> single = run_single_target(targets[i], view, x_d, T);
    int64_t differ = 0;
    for (int r = 0; r < T; ++r)
      for (int n = 0; n < c.outs[i]; ++n)
        differ += single[static_cast<size_t>(r) * c.outs[i] + n] !=
                  bits[static_cast<size_t>(r) * ld + col[i] + n];
    EXPECT_EQ(differ, 0) << name << ": the multi-target launch differs from a single-target one";
  }

  // add mode, reading the partials the multi shrink left
  Tensor y0 = test::random_normal({T, ld}, rng).to(DType::kBF16);
  const uint16_t* y0_bits = static_cast<const uint16_t*>(y0.raw_data());
  auto y_d = cuda::to_device(y0);
  for (int i = 0; i < nt; ++i) ea.targets[i].out = y_d.as<__nv_bfloat16>() + col[i];
  ea.mode = ops::cuda::LoraExpandMode::kAdd;
  ops::cuda::launch_lora_expand_multi(ea, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> y = download_vector<uint16_t>(y_d, static_cast<size_t>(T) * ld);
  int64_t wrong = 0;
  std::string first_wrong;
  for (int r = 0; r < T; ++r) {
    for (int i = 0; i < nt; ++i) {
      const bool adapted = slots[r] >= 0 && c.ranks[i][slots[r]] > 0;
      for (int n = col[i]; n < col[i + 1]; ++n) {
        const size_t e = static_cast<size_t>(r) * ld + n;
        const uint16_t want =
            adapted ? f32_to_bf16_bits(bf16_bits_to_f32(y0_bits[e]) + bf16_bits_to_f32(bits[e]))
                    : y0_bits[e];
        if (y[e] != want && wrong++ == 0)
          first_wrong = "row " + std::to_string(r) + " column " + std::to_string(n) + ": got " +
                        std::to_string(bf16_bits_to_f32(y[e])) + ", want " +
                        std::to_string(bf16_bits_to_f32(want));
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "add mode: first mismatch at " << first_wrong;
}

// Qwen3-30B-A3B's fused qkv at H 2048: q 32 x 128, k and v 4 x 128, r16. One adapter over a
// 64-row decode batch (slot capacity 2), then three adapters with per-target ranks (a slot may
// skip k or q) around base rows.
TEST(Sm90_Lora, MultiTargetQwenQkvWriteAndAdd) {
  MOELORA_REQUIRE_SM90();
  {
    SCOPED_TRACE("one adapter, 64 decode rows");
    check_multi_target({2048, {4096, 512, 512}, {{16, 16}, {16, 16}, {16, 16}}, {{1, 64}}}, 421);
  }
  {
    SCOPED_TRACE("three adapters, mixed ranks, base rows");
    check_multi_target({2048,
                        {4096, 512, 512},
                        {{16, 8, 0}, {16, 0, 12}, {16, 5, 16}},
                        {{1, 9}, {-1, 4}, {0, 40}, {2, 10}, {-1, 4}}},
                       422);
  }
}

// Kimi-K2.5's q_a (1536) and kv_a (512 + 64) at H 7168: four 16-byte vectors per lane and K
// split (7 splits of 1024 columns), a partial column tile, two adapters of different ranks.
TEST(Sm90_Lora, MultiTargetKimiQaKvaWriteAndAdd) {
  MOELORA_REQUIRE_SM90();
  check_multi_target({7168, {1536, 576}, {{16, 16}, {16, 8}}, {{0, 3}, {1, 61}, {-1, 2}}}, 423);
}

// Host-side validation happens before any launch (no device needed).
TEST(Sm90_Lora, MultiTargetRejectsInconsistentTargets) {
  auto fake = [](uintptr_t v) { return reinterpret_cast<void*>(v * 256); };
  ops::cuda::LoraPoolTarget pool;
  pool.a = static_cast<const __nv_bfloat16*>(fake(1));
  pool.b = static_cast<const __nv_bfloat16*>(fake(2));
  pool.scaling = static_cast<const float*>(fake(3));
  pool.rank = static_cast<const int32_t*>(fake(4));
  pool.num_slots = 2;
  pool.max_rank = 16;
  pool.in_features = 2048;
  pool.out_features = 512;
  ops::cuda::LoraSegmentsView view{static_cast<const int4*>(fake(5)),
                                   static_cast<const int32_t*>(fake(6)), 2};
  view.max_rows = 64;
  ops::cuda::LoraMultiShrinkArgs sa;
  sa.targets[0] = {pool, static_cast<float*>(fake(7))};
  sa.targets[1] = sa.targets[0];
  sa.targets[1].pool.in_features = 4096;  // another x
  sa.num_targets = 2;
  sa.seg = view;
  sa.x = static_cast<const __nv_bfloat16*>(fake(8));
  sa.row_capacity = 64;
  EXPECT_NE(test::error_message([&] { ops::cuda::launch_lora_shrink_multi(sa, nullptr); },
                                ErrorCode::kInvalidArgument)
                .find("in_features"),
            std::string::npos);
  sa.num_targets = ops::cuda::kLoraMaxTargets + 1;
  test::error_message([&] { ops::cuda::launch_lora_shrink_multi(sa, nullptr); },
                      ErrorCode::kInvalidArgument);
  // A segment-major view belongs to the single-target (short-segment) launchers.
  sa.num_targets = 1;
  sa.seg.max_rows = 0;
  EXPECT_NE(test::error_message([&] { ops::cuda::launch_lora_shrink_multi(sa, nullptr); },
                                ErrorCode::kInvalidArgument)
                .find("row-major"),
            std::string::npos);
  sa.seg.max_rows = view.max_rows;
  ops::cuda::LoraMultiExpandArgs ea;
  ea.targets[0].pool = pool;
  ea.targets[0].partial = static_cast<const float*>(fake(7));
  ea.targets[0].out = static_cast<__nv_bfloat16*>(fake(9));
  ea.targets[0].out_stride = 500;  // narrower than out_features
  ea.num_targets = 1;
  ea.seg = view;
  ea.row_capacity = 64;
  ea.mode = ops::cuda::LoraExpandMode::kAdd;
  EXPECT_NE(test::error_message([&] { ops::cuda::launch_lora_expand_multi(ea, nullptr); },
                                ErrorCode::kInvalidArgument)
                .find("out_stride"),
            std::string::npos);
}

}  // namespace
}  // namespace moelora
