// What the tensor-core LoRA tests share (lora_mma_test.cu: the kernels against the reference and
// the CUDA-core kernels; lora_mma_graph_test.cu: graph replays and the tile capacity): host pools
// and sorted-row batches, the double-precision reference of the segmented LoRA math, the checks
// with their tolerances (lora_mma_test.cu's header lists them) and the Sm90_LoraMma fixture that
// runs both kernel families.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/threads.h"
#include "gpu/gpu_test_util.cuh"
#include "ops/lora/lora_cuda.cuh"
#include "ops/lora/lora_mma_cuda.cuh"
#include "support/test_support.h"

namespace moelora::lora_mma_test {

using ops::cuda::LoraExpandArgs;
using ops::cuda::LoraPoolTarget;
using ops::cuda::LoraSegmentsView;
using ops::cuda::LoraShrinkArgs;

constexpr uint16_t kDeltaSentinel = 0x4B2A;         // bf16 ~1.1e7: rows no kernel may write
constexpr uint32_t kPartialSentinel = 0xFFFFFFFFu;  // fp32 NaN: no kernel may write or read it
constexpr float kGarbage = 1024.0f;                 // pool entries past a slot's rank

// ---- host pool --------------------------------------------------------------------------------

struct PoolSpec {
  int in = 0, out = 0, experts = 1;
  int ea = 1, eb = 1;  // expert extents of A and B in the pool (1 or experts)
  int max_rank = 8;
  std::vector<int> ranks;                   // per slot
  std::vector<float> scaling;               // per slot
  std::vector<uint8_t> a_shared, b_shared;  // per slot, empty = none
};

// One pool target on the host (bf16-representable floats) and its device image.
struct Pool {
  PoolSpec spec;
  std::vector<float> a, b;  // [S, Ea, R, in], [S, Eb, out, R]
  cuda::DeviceBuffer a_d, b_d, scaling_d, rank_d, a_shared_d, b_shared_d;

  int slots() const { return static_cast<int>(spec.ranks.size()); }
  int ea_of(int slot, int expert) const {
    return (spec.ea == 1 || (!spec.a_shared.empty() && spec.a_shared[slot])) ? 0 : expert;
  }
  int eb_of(int slot, int expert) const {
    return (spec.eb == 1 || (!spec.b_shared.empty() && spec.b_shared[slot])) ? 0 : expert;
  }
  size_t a_offset(int slot, int e, int r) const {  // A[slot, e, r, :]
    return ((static_cast<size_t>(slot) * spec.ea + e) * spec.max_rank + r) * spec.in;
  }
  size_t b_offset(int slot, int e, int n) const {  // B[slot, e, n, :]
    return ((static_cast<size_t>(slot) * spec.eb + e) * spec.out + n) * spec.max_rank;
  }
  const float* a_row(int slot, int e, int r) const { return &a[a_offset(slot, e, r)]; }
  const float* b_row(int slot, int e, int n) const { return &b[b_offset(slot, e, n)]; }
  LoraPoolTarget view() const {
    LoraPoolTarget v;
    v.a = a_d.as<__nv_bfloat16>();
    v.b = b_d.as<__nv_bfloat16>();
    v.scaling = scaling_d.as<float>();
    v.rank = rank_d.as<int32_t>();
    v.a_shared = spec.a_shared.empty() ? nullptr : a_shared_d.as<uint8_t>();
    v.b_shared = spec.b_shared.empty() ? nullptr : b_shared_d.as<uint8_t>();
    v.num_slots = slots();
    v.ea = spec.ea;
    v.eb = spec.eb;
    v.max_rank = spec.max_rank;
    v.in_features = spec.in;
    v.out_features = spec.out;
    return v;
  }
};

inline cuda::DeviceBuffer upload_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16_bits(v[i]);
  return test::upload_vector(bits);
}

// Factors ~ N(0, 1/in) for A and N(0, 1/rank) for B below each slot's rank, kGarbage past it.
inline Pool make_pool(const PoolSpec& spec, std::mt19937_64& rng) {
  Pool p;
  p.spec = spec;
  const int S = p.slots(), R = spec.max_rank;
  p.a.resize(static_cast<size_t>(S) * spec.ea * R * spec.in);
  p.b.resize(static_cast<size_t>(S) * spec.eb * spec.out * R);
  for (int s = 0; s < S; ++s) {
    const int rank = spec.ranks[s];
    std::normal_distribution<float> da(0.f, 1.f / std::sqrt(static_cast<float>(spec.in)));
    std::normal_distribution<float> db(0.f, 1.f / std::sqrt(static_cast<float>(std::max(rank, 1))));
    for (int e = 0; e < spec.ea; ++e)
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < spec.in; ++k)
          p.a[p.a_offset(s, e, r) + k] = r < rank ? round_to_bf16(da(rng)) : kGarbage;
    for (int e = 0; e < spec.eb; ++e)
      for (int n = 0; n < spec.out; ++n)
        for (int r = 0; r < R; ++r)
          p.b[p.b_offset(s, e, n) + r] = r < rank ? round_to_bf16(db(rng)) : kGarbage;
  }
  p.a_d = upload_bf16(p.a);
  p.b_d = upload_bf16(p.b);
  p.scaling_d = test::upload_vector(spec.scaling);
  p.rank_d = test::upload_vector(std::vector<int32_t>(spec.ranks.begin(), spec.ranks.end()));
  if (!spec.a_shared.empty()) p.a_shared_d = test::upload_vector(spec.a_shared);
  if (!spec.b_shared.empty()) p.b_shared_d = test::upload_vector(spec.b_shared);
  return p;
}

// ---- batch of sorted rows ---------------------------------------------------------------------

struct SegSpec {
  int slot, expert, rows;
  int gap;  // rows of slot -1 (in no segment) before this segment
};

struct Batch {
  int x_rows = 0, rows = 0;         // rows of x; sorted rows (segments and gaps)
  std::vector<float> x;             // [x_rows, in], bf16-representable
  std::vector<int32_t> gather;      // [rows] x row of each sorted row
  std::vector<int4> segments;       // {slot, expert, begin, end}
  std::vector<uint8_t> in_segment;  // [rows]
};

inline Batch make_batch(const std::vector<SegSpec>& specs, int trailing_gap, int in, int x_rows,
                        std::mt19937_64& rng) {
  Batch b;
  b.x_rows = x_rows;
  int q = 0;
  for (const SegSpec& s : specs) {
    q += s.gap;
    b.segments.push_back(make_int4(s.slot, s.expert, q, q + s.rows));
    q += s.rows;
  }
  b.rows = q + trailing_gap;
  b.in_segment.assign(b.rows, 0);
  for (const int4& s : b.segments)
    for (int r = s.z; r < s.w; ++r) b.in_segment[r] = 1;
  std::normal_distribution<float> dx(0.f, 1.f);
  b.x.resize(static_cast<size_t>(x_rows) * in);
  for (float& v : b.x) v = round_to_bf16(dx(rng));
  std::uniform_int_distribution<int> pick(0, x_rows - 1);
  b.gather.resize(b.rows);
  for (int32_t& g : b.gather) g = pick(rng);  // gap rows too: valid, but must not be used
  return b;
}

inline int rows_in_segments(const Batch& b) {
  int n = 0;
  for (const int4& s : b.segments) n += s.w - s.z;
  return n;
}

// ---- double-precision reference ---------------------------------------------------------------

struct Reference {
  std::vector<double> u, u_abs;  // [rows, R]: sum_k x a and sum_k |x a| (r < rank)
  std::vector<double> delta;     // [rows, out]
};

// The segmented LoRA math of lora_cuda.cuh, in double, for the given segments (which may name
// other slots / experts than the batch's own: the "wrong factors" references).
inline Reference reference(const Pool& pool, const Batch& batch,
                           const std::vector<int4>& segments) {
  const PoolSpec& sp = pool.spec;
  const int R = sp.max_rank, K = sp.in, N = sp.out;
  Reference ref;
  ref.u.assign(static_cast<size_t>(batch.rows) * R, 0.0);
  ref.u_abs.assign(static_cast<size_t>(batch.rows) * R, 0.0);
  ref.delta.assign(static_cast<size_t>(batch.rows) * N, 0.0);
  std::vector<int> seg_of(batch.rows, -1);
  for (size_t i = 0; i < segments.size(); ++i)
    for (int q = segments[i].z; q < segments[i].w; ++q) seg_of[q] = static_cast<int>(i);
  parallel_for(batch.rows, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      if (seg_of[q] < 0) continue;
      const int4 s = segments[seg_of[q]];
      const int slot = s.x, rank = sp.ranks[slot];
      const int ea = pool.ea_of(slot, s.y), eb = pool.eb_of(slot, s.y);
      const float* x = &batch.x[static_cast<size_t>(batch.gather[q]) * K];
      double* u = &ref.u[q * R];
      double* u_abs = &ref.u_abs[q * R];
      for (int r = 0; r < rank; ++r) {
        const float* a = pool.a_row(slot, ea, r);
        double acc = 0, acc_abs = 0;
        for (int k = 0; k < K; ++k) {
          const double t = double(x[k]) * a[k];
          acc += t;
          acc_abs += std::fabs(t);
        }
        u[r] = acc;
        u_abs[r] = acc_abs;
      }
      for (int n = 0; n < N; ++n) {
        const float* b = pool.b_row(slot, eb, n);
        double acc = 0;
        for (int r = 0; r < rank; ++r) acc += u[r] * b[r];
        ref.delta[q * N + n] = sp.scaling[slot] * acc;
      }
    }
  });
  return ref;
}

inline double rel_frobenius(const double* got, const double* want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / (den + 1e-300));
}

// Per segment of rank > 0: the smallest relative distance from its reference to the result with
// a neighbouring expert's factors (where the factors depend on the expert) or with another
// slot's. The inputs must separate them clearly for the per-segment checks to mean anything.
inline std::vector<double> factor_gaps(const Pool& pool, const Batch& batch, const Reference& ref) {
  const int E = pool.spec.experts, S = pool.slots(), N = pool.spec.out;
  std::vector<int4> other_expert = batch.segments, other_slot = batch.segments;
  for (int4& s : other_expert) s.y = (s.y + 1) % E;
  for (int4& s : other_slot) {
    int o = s.x;
    for (int step = 1; step < S; ++step) {
      const int cand = (s.x + step) % S;
      if (pool.spec.ranks[cand] > 0) {
        o = cand;
        break;
      }
    }
    s.x = o;
  }
  const Reference by_expert = reference(pool, batch, other_expert);
  const Reference by_slot = reference(pool, batch, other_slot);
  std::vector<double> gaps(batch.segments.size(), 1e30);
  for (size_t i = 0; i < batch.segments.size(); ++i) {
    const int4 s = batch.segments[i];
    if (pool.spec.ranks[s.x] == 0) continue;
    const size_t off = static_cast<size_t>(s.z) * N, n = static_cast<size_t>(s.w - s.z) * N;
    const bool expert_matters = E > 1 && (pool.ea_of(s.x, s.y) != pool.ea_of(s.x, (s.y + 1) % E) ||
                                          pool.eb_of(s.x, s.y) != pool.eb_of(s.x, (s.y + 1) % E));
    if (expert_matters)
      gaps[i] = std::min(gaps[i], rel_frobenius(&by_expert.delta[off], &ref.delta[off], n));
    if (other_slot[i].x != s.x)
      gaps[i] = std::min(gaps[i], rel_frobenius(&by_slot.delta[off], &ref.delta[off], n));
  }
  return gaps;
}

// ---- checks -----------------------------------------------------------------------------------

// Split 0 of an mma shrink's partial [row_capacity, R]: the reference below each segment slot's
// rank, the sentinel everywhere else (gap rows, rank-0 slots, columns past the rank).
inline void check_mma_partial(const std::vector<float>& partial, const Pool& pool,
                              const Batch& batch, const Reference& ref, const std::string& what) {
  const int R = pool.spec.max_rank;
  std::vector<int> rank_of(batch.rows, 0);
  for (const int4& s : batch.segments)
    for (int q = s.z; q < s.w; ++q) rank_of[q] = pool.spec.ranks[s.x];
  int bad = 0;
  for (int q = 0; q < batch.rows && bad < 10; ++q) {
    for (int r = 0; r < R && bad < 10; ++r) {
      const float v = partial[static_cast<size_t>(q) * R + r];
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      if (r >= rank_of[q]) {
        if (bits != kPartialSentinel) {
          ADD_FAILURE() << what << ": partial (" << q << ", " << r << ") was written ("
                        << (batch.in_segment[q] ? "past the slot's rank" : "row in no segment")
                        << "): " << v;
          ++bad;
        }
        continue;
      }
      const double want = ref.u[q * R + r];
      const double tol = 2e-4 * ref.u_abs[q * R + r] + 1e-6;
      if (!(std::fabs(v - want) <= tol)) {
        ADD_FAILURE() << what << ": partial (" << q << ", " << r << ") = " << v << ", want " << want
                      << " (tolerance " << tol << ")";
        ++bad;
      }
    }
  }
}

// Sum over `splits` of a CUDA-core shrink's partial [splits, row_capacity, R] on segment rows.
inline void check_split_partial(const std::vector<float>& partial, int splits, int row_capacity,
                                const Pool& pool, const Batch& batch, const Reference& ref,
                                const std::string& what) {
  const int R = pool.spec.max_rank;
  int bad = 0;
  for (const int4& s : batch.segments) {
    const int rank = pool.spec.ranks[s.x];
    for (int q = s.z; q < s.w && bad < 10; ++q) {
      for (int r = 0; r < rank && bad < 10; ++r) {
        double v = 0;
        for (int sp = 0; sp < splits; ++sp)
          v += partial[(static_cast<size_t>(sp) * row_capacity + q) * R + r];
        const double want = ref.u[q * R + r];
        const double tol = 2e-4 * ref.u_abs[q * R + r] + 1e-6;
        if (!(std::fabs(v - want) <= tol)) {
          ADD_FAILURE() << what << ": summed partial (" << q << ", " << r << ") = " << v
                        << ", want " << want;
          ++bad;
        }
      }
    }
  }
}

// Delta [rows, out] bf16 bits: sentinel on gap rows, zeros for rank-0 slots, per segment the
// reference within 5e-3 (relative Frobenius) and far closer than any wrong factors, PERF.md's
// bf16 bound and cosine over all segment rows.
inline void check_delta(const std::vector<uint16_t>& delta, const Pool& pool, const Batch& batch,
                        const Reference& ref, const std::vector<double>& gaps,
                        const std::string& what) {
  const int N = pool.spec.out;
  for (int q = 0; q < batch.rows; ++q) {
    if (batch.in_segment[q]) continue;
    for (int n = 0; n < N; ++n) {
      ASSERT_EQ(delta[static_cast<size_t>(q) * N + n], kDeltaSentinel)
          << what << ": delta row " << q << " (in no segment) was written at column " << n;
    }
  }
  const int seg_rows = rows_in_segments(batch);
  Tensor got_all = Tensor::empty(DType::kF32, {seg_rows, N});
  Tensor want_all = Tensor::empty(DType::kF32, {seg_rows, N});
  int64_t out_row = 0;
  for (size_t i = 0; i < batch.segments.size(); ++i) {
    const int4 s = batch.segments[i];
    const size_t off = static_cast<size_t>(s.z) * N, n = static_cast<size_t>(s.w - s.z) * N;
    std::vector<double> got(n);
    for (size_t j = 0; j < n; ++j) {
      got[j] = bf16_bits_to_f32(delta[off + j]);
      ASSERT_TRUE(std::isfinite(got[j]))
          << what << ": delta element " << off + j << " is " << got[j];
    }
    const std::string seg_what = what + ", segment " + std::to_string(i) + " {slot " +
                                 std::to_string(s.x) + ", expert " + std::to_string(s.y) + ", " +
                                 std::to_string(s.w - s.z) + " rows}";
    if (pool.spec.ranks[s.x] == 0) {
      for (size_t j = 0; j < n; ++j)
        ASSERT_EQ(got[j], 0.0) << seg_what << ": rank-0 slot must write zeros (element " << j
                               << ")";
    } else {
      const double err = rel_frobenius(got.data(), &ref.delta[off], n);
      EXPECT_LT(err, 5e-3) << seg_what;
      EXPECT_GT(gaps[i], 0.3) << seg_what << ": inputs do not separate the factors";
      EXPECT_LT(err, gaps[i] / 20) << seg_what << ": closer to wrong factors than expected";
    }
    for (size_t j = 0; j < n; ++j) {
      got_all.data<float>()[out_row * N + j] = static_cast<float>(got[j]);
      want_all.data<float>()[out_row * N + j] = static_cast<float>(ref.delta[off + j]);
    }
    out_row += s.w - s.z;
  }
  EXPECT_TRUE(test::close_bf16(got_all, want_all)) << what;
}

// ---- device runs ------------------------------------------------------------------------------

struct DeviceBatch {
  cuda::DeviceBuffer x, gather, segments, num_segments;
  int max_segments = 0, max_rows = 0, row_capacity = 0;
  LoraSegmentsView view(int row_chunks = 1) const {
    LoraSegmentsView v;
    v.segments = segments.as<int4>();
    v.num_segments = num_segments.as<int32_t>();
    v.max_segments = max_segments;
    v.row_chunks = row_chunks;
    return v;
  }
};

// Segments with capacity slack (more segment slots and rows than used: the grid bound must not
// rely on the exact counts).
inline DeviceBatch upload_batch(const Batch& b) {
  DeviceBatch d;
  d.x = upload_bf16(b.x);
  d.gather = test::upload_vector(b.gather);
  d.max_segments = static_cast<int>(b.segments.size()) + 3;
  std::vector<int4> segs = b.segments;
  segs.resize(d.max_segments, make_int4(0, 0, 0, 0));
  d.segments = test::upload_vector(segs);
  d.num_segments =
      test::upload_vector(std::vector<int32_t>{static_cast<int32_t>(b.segments.size())});
  d.max_rows = b.rows + 7;
  d.row_capacity = b.rows + 5;
  return d;
}

class Sm90_LoraMma : public ::testing::Test {
 protected:
  void SetUp() override {
    MOELORA_REQUIRE_SM90();
    stream_ = std::make_unique<cuda::Stream>();
  }

  std::vector<uint16_t> fresh_delta(cuda::DeviceBuffer& delta, size_t n) {
    std::vector<uint16_t> sentinel(n, kDeltaSentinel);
    delta.upload(sentinel.data(), n * 2);
    return sentinel;
  }

  // Runs every pairing of shrink and expand families on one pool and batch and checks each.
  void run_all_paths(const Pool& pool, const Batch& batch, const std::string& what) {
    const PoolSpec& sp = pool.spec;
    const int R = sp.max_rank, N = sp.out;
    const Reference ref = reference(pool, batch, batch.segments);
    const std::vector<double> gaps = factor_gaps(pool, batch, ref);
    DeviceBatch d = upload_batch(batch);
    const size_t delta_elems = static_cast<size_t>(batch.rows) * N;
    const int splits = ops::cuda::lora_shrink_splits(sp.in);
    cuda::DeviceBuffer partial_mma(static_cast<size_t>(d.row_capacity) * R * 4);
    cuda::DeviceBuffer partial_core(ops::cuda::lora_partial_bytes(sp.in, d.row_capacity, R));
    cuda::DeviceBuffer delta(delta_elems * 2);
    MOELORA_CUDA_CHECK(cudaMemset(partial_mma.get(), 0xFF, partial_mma.bytes()));
    MOELORA_CUDA_CHECK(cudaMemset(partial_core.get(), 0xFF, partial_core.bytes()));

    LoraShrinkArgs sh;
    sh.pool = pool.view();
    sh.seg = d.view(/*row_chunks=*/3);
    sh.x = d.x.as<__nv_bfloat16>();
    sh.gather = d.gather.as<int32_t>();
    sh.row_capacity = d.row_capacity;
    LoraExpandArgs ex;
    ex.pool = pool.view();
    ex.seg = d.view(/*row_chunks=*/3);
    ex.row_capacity = d.row_capacity;
    ex.delta = delta.as<__nv_bfloat16>();

    // mma shrink, then both expands over its split 0
    sh.partial = partial_mma.as<float>();
    ops::cuda::launch_lora_shrink_mma(sh, d.max_rows, stream_->get());
    stream_->synchronize();
    check_mma_partial(
        test::download_vector<float>(partial_mma, static_cast<size_t>(d.row_capacity) * R), pool,
        batch, ref, what + ", mma shrink");
    ex.partial = partial_mma.as<float>();
    ex.splits = 1;
    fresh_delta(delta, delta_elems);
    ops::cuda::launch_lora_expand_mma(ex, d.max_rows, stream_->get());
    stream_->synchronize();
    const auto mma_mma = test::download_vector<uint16_t>(delta, delta_elems);
    check_delta(mma_mma, pool, batch, ref, gaps, what + ", mma shrink + mma expand");
    fresh_delta(delta, delta_elems);
    ops::cuda::launch_lora_expand(ex, stream_->get());
    stream_->synchronize();
    check_delta(test::download_vector<uint16_t>(delta, delta_elems), pool, batch, ref, gaps,
                what + ", mma shrink + CUDA-core expand");

    // CUDA-core shrink (K splits), then both expands over its splits
    sh.partial = partial_core.as<float>();
    ops::cuda::launch_lora_shrink(sh, stream_->get());
    stream_->synchronize();
    check_split_partial(test::download_vector<float>(partial_core, partial_core.bytes() / 4),
                        splits, d.row_capacity, pool, batch, ref, what + ", CUDA-core shrink");
    ex.partial = partial_core.as<float>();
    ex.splits = 0;  // the CUDA-core shrink's own splits
    fresh_delta(delta, delta_elems);
    ops::cuda::launch_lora_expand_mma(ex, d.max_rows, stream_->get());
    stream_->synchronize();
    check_delta(test::download_vector<uint16_t>(delta, delta_elems), pool, batch, ref, gaps,
                what + ", CUDA-core shrink + mma expand");
    fresh_delta(delta, delta_elems);
    ops::cuda::launch_lora_expand(ex, stream_->get());
    stream_->synchronize();
    const auto core_core = test::download_vector<uint16_t>(delta, delta_elems);
    check_delta(core_core, pool, batch, ref, gaps, what + ", CUDA-core shrink + CUDA-core expand");

    // The two families agree with each other on every segment (both are ~1e-3 from the reference).
    for (size_t i = 0; i < batch.segments.size(); ++i) {
      const int4 s = batch.segments[i];
      const size_t off = static_cast<size_t>(s.z) * N, n = static_cast<size_t>(s.w - s.z) * N;
      std::vector<double> a(n), b(n);
      for (size_t j = 0; j < n; ++j) {
        a[j] = bf16_bits_to_f32(mma_mma[off + j]);
        b[j] = bf16_bits_to_f32(core_core[off + j]);
      }
      if (sp.ranks[s.x] > 0)
        EXPECT_LT(rel_frobenius(a.data(), b.data(), n), 5e-3)
            << what << ": mma and CUDA-core paths differ on segment " << i;
    }
  }

  std::unique_ptr<cuda::Stream> stream_;
};

// Segment lengths 1, 17, 64, 300, 1000 plus 65 / 129 / 7-row ones over the slots of non-zero
// rank (cycled) and a 33-row segment of the rank-0 slot; gaps of slot -1 rows between some of
// them, adjacent segments of one slot and other experts, of one expert and other slots.
inline std::vector<SegSpec> standard_segments(const PoolSpec& sp, int rank0_slot) {
  std::vector<int> live;
  for (int s = 0; s < static_cast<int>(sp.ranks.size()); ++s)
    if (sp.ranks[s] > 0) live.push_back(s);
  auto slot = [&](int i) { return live[i % live.size()]; };
  auto expert = [&](int e) { return e % sp.experts; };
  return {
      {slot(0), expert(0), 1, 3},
      {slot(1), expert(1), 17, 0},
      {slot(1), expert(2), 64, 0},
      {slot(0), expert(2), 65, 2},
      {rank0_slot, expert(1), 33, 0},
      {slot(2), expert(0), 300, 5},
      {slot(3), expert(3), 1000, 1},
      {slot(4), expert(4), 129, 0},
      {slot(5), expert(sp.experts - 1), 7, 4},
  };
}

}  // namespace moelora::lora_mma_test
