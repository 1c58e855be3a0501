// Sm90 tensor-core LoRA shrink / expand (ops/lora/lora_mma_cuda.cuh) against a double-precision
// loop over the segments (the math of lora_cuda.cuh) and against the CUDA-core kernels:
//   - segments of 1, 17, 64, 300 and 1000 rows (partial, whole and many 64-row tiles), adjacent
//     ones and ones separated by rows of slot -1 (in no segment: their partial and delta rows
//     must keep a sentinel), with gathered x rows;
//   - slot ranks 8, 12, 16, 24, 40, 64, 72, 128, 136, 256 (not all multiples of 16 or of 8) and a
//     rank-0 slot (zero deltas, no partial writes); pool max ranks 16, 40, 64, 128 and 256 (every
//     kernel instance);
//   - per-expert factors and shared ones (Ea = 1 / Eb = 1 pools, per-slot a_shared / b_shared);
//   - in / out not multiples of 128 (multiples of 8) and the Qwen3-30B-A3B expert seams
//     (H 2048 -> 2I 1536 and I 768 -> H 2048);
//   - every pairing of the two families (mma shrink + mma expand, mma shrink + CUDA-core expand
//     with splits = 1, CUDA-core shrink + mma expand over its K splits), the dense-u form of the
//     expand (u_row, splits = 1) and CUDA-graph replays with other segments under one capture.
// Pool entries past a slot's rank hold large garbage and the partial buffer starts as NaN, so a
// kernel that reads either fails. Each segment's error must be far below its distance to the
// result computed with a neighbouring expert's or another slot's factors, so a segment that
// reads another slot's or expert's factors fails.
//
// Tolerances: partial (fp32) |p - u| <= 2e-4 sum_k |x a| + 1e-6; delta (bf16) per segment
// relative Frobenius error <= 5e-3 and PERF.md's elementwise bound (|x - ref| <= 2e-2 |ref| +
// 2e-2 rms(ref)) with cosine >= 0.9999 over all segment rows.
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

namespace moelora {
namespace {

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

cuda::DeviceBuffer upload_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16_bits(v[i]);
  return test::upload_vector(bits);
}

// Factors ~ N(0, 1/in) for A and N(0, 1/rank) for B below each slot's rank, kGarbage past it.
Pool make_pool(const PoolSpec& spec, std::mt19937_64& rng) {
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

Batch make_batch(const std::vector<SegSpec>& specs, int trailing_gap, int in, int x_rows,
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

int rows_in_segments(const Batch& b) {
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
Reference reference(const Pool& pool, const Batch& batch, const std::vector<int4>& segments) {
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

double rel_frobenius(const double* got, const double* want, size_t n) {
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
std::vector<double> factor_gaps(const Pool& pool, const Batch& batch, const Reference& ref) {
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
void check_mma_partial(const std::vector<float>& partial, const Pool& pool, const Batch& batch,
                       const Reference& ref, const std::string& what) {
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
void check_split_partial(const std::vector<float>& partial, int splits, int row_capacity,
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
void check_delta(const std::vector<uint16_t>& delta, const Pool& pool, const Batch& batch,
                 const Reference& ref, const std::vector<double>& gaps, const std::string& what) {
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
DeviceBatch upload_batch(const Batch& b) {
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
std::vector<SegSpec> standard_segments(const PoolSpec& sp, int rank0_slot) {
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

TEST_F(Sm90_LoraMma, PerExpertOddSizesRanksUpTo128) {
  std::mt19937_64 rng(test::test_seed(901));
  PoolSpec sp;
  sp.in = 1000;  // multiple of 8, not of 64 or 128
  sp.out = 712;
  sp.experts = sp.ea = sp.eb = 5;
  sp.max_rank = 128;
  sp.ranks = {16, 40, 0, 128, 64, 8};
  sp.scaling = {0.5f, 2.0f, 1.0f, 0.75f, 1.25f, 3.0f};
  Pool pool = make_pool(sp, rng);
  Batch batch = make_batch(standard_segments(sp, 2), 6, sp.in, 997, rng);
  run_all_paths(pool, batch, "per-expert R 128");
}

TEST_F(Sm90_LoraMma, SmallPoolRank16WithRank12Slot) {
  std::mt19937_64 rng(test::test_seed(902));
  PoolSpec sp;
  sp.in = 264;
  sp.out = 136;
  sp.experts = sp.ea = sp.eb = 3;
  sp.max_rank = 16;
  sp.ranks = {16, 8, 0, 12};  // 12: a 16-byte chunk of B straddles the rank
  sp.scaling = {1.5f, 0.5f, 1.0f, 2.0f};
  Pool pool = make_pool(sp, rng);
  Batch batch = make_batch(standard_segments(sp, 2), 0, sp.in, 311, rng);
  run_all_paths(pool, batch, "per-expert R 16");
}

// Shared-outer pools (Ea = 1 for A, or Eb = 1 for B) and per-slot shared flags on per-expert pools.
TEST_F(Sm90_LoraMma, SharedFactorsRank40) {
  std::mt19937_64 rng(test::test_seed(903));
  {
    PoolSpec sp;
    sp.in = 520;
    sp.out = 1032;
    sp.experts = 4;
    sp.ea = 1;  // gate_up A of a shared-outer pool
    sp.eb = 4;
    sp.max_rank = 40;
    sp.ranks = {40, 16, 0, 24};
    sp.scaling = {1.0f, 0.5f, 1.0f, 2.0f};
    sp.b_shared = {0, 1, 0, 0};  // slot 1 also shares its B
    Pool pool = make_pool(sp, rng);
    Batch batch = make_batch(standard_segments(sp, 2), 3, sp.in, 401, rng);
    run_all_paths(pool, batch, "Ea = 1, R 40");
  }
  {
    PoolSpec sp;
    sp.in = 136;
    sp.out = 264;
    sp.experts = 4;
    sp.ea = 4;
    sp.eb = 1;  // down B of a shared-outer pool
    sp.max_rank = 40;
    sp.ranks = {8, 40, 0, 16};
    sp.scaling = {2.0f, 1.0f, 1.0f, 0.25f};
    sp.a_shared = {0, 0, 0, 1};  // slot 3 also shares its A
    Pool pool = make_pool(sp, rng);
    Batch batch = make_batch(standard_segments(sp, 2), 3, sp.in, 257, rng);
    run_all_paths(pool, batch, "Eb = 1, R 40");
  }
}

// The Qwen3-30B-A3B expert seams: gate_up (H 2048 -> 2I 1536) per-expert, down (I 768 -> H 2048)
// with a shared-outer B.
TEST_F(Sm90_LoraMma, Qwen3MoeSeams) {
  std::mt19937_64 rng(test::test_seed(904));
  {
    PoolSpec sp;
    sp.in = 2048;
    sp.out = 1536;
    sp.experts = sp.ea = sp.eb = 8;
    sp.max_rank = 64;
    sp.ranks = {64, 16, 0, 40};
    sp.scaling = {0.5f, 2.0f, 1.0f, 1.0f};
    Pool pool = make_pool(sp, rng);
    Batch batch = make_batch(standard_segments(sp, 2), 2, sp.in, 600, rng);
    run_all_paths(pool, batch, "Qwen3 gate_up");
  }
  {
    PoolSpec sp;
    sp.in = 768;
    sp.out = 2048;
    sp.experts = sp.ea = 8;
    sp.eb = 1;
    sp.max_rank = 64;
    sp.ranks = {16, 64, 0, 40};
    sp.scaling = {1.0f, 0.5f, 1.0f, 2.0f};
    Pool pool = make_pool(sp, rng);
    Batch batch = make_batch(standard_segments(sp, 2), 2, sp.in, 600, rng);
    run_all_paths(pool, batch, "Qwen3 down");
  }
}

// The largest bucket: pool rank 256 (4 shrink rank chunks, the 256-column expand instance).
TEST_F(Sm90_LoraMma, Rank256Pool) {
  std::mt19937_64 rng(test::test_seed(905));
  PoolSpec sp;
  sp.in = 136;
  sp.out = 264;
  sp.experts = sp.ea = sp.eb = 2;
  sp.max_rank = 256;
  sp.ranks = {256, 72, 0, 136};
  sp.scaling = {0.25f, 1.0f, 1.0f, 0.5f};
  Pool pool = make_pool(sp, rng);
  Batch batch = make_batch(standard_segments(sp, 2), 1, sp.in, 300, rng);
  run_all_paths(pool, batch, "R 256");
}

// The expand of the layers' single-adapter path: u comes from a dense GEMM over all x rows
// (partial [x_rows, R], one split) and sorted row q reads u row u_row[q] = gather[q].
TEST_F(Sm90_LoraMma, DenseUWithRowMap) {
  std::mt19937_64 rng(test::test_seed(906));
  PoolSpec sp;
  sp.in = 328;
  sp.out = 776;
  sp.experts = 6;
  sp.ea = 1;
  sp.eb = 6;
  sp.max_rank = 24;
  sp.ranks = {0, 24, 0};
  sp.scaling = {1.0f, 1.5f, 1.0f};
  Pool pool = make_pool(sp, rng);
  std::vector<SegSpec> specs = {
      {1, 0, 1, 2}, {1, 3, 17, 0}, {1, 5, 300, 4}, {1, 1, 1000, 1}, {1, 2, 64, 0}};
  Batch batch = make_batch(specs, 5, sp.in, 733, rng);
  const Reference ref = reference(pool, batch, batch.segments);
  // one adapter only: each segment must be far closer to its own expert's B than to the next's
  std::vector<double> gaps(batch.segments.size(), 1.0);
  {
    std::vector<int4> other = batch.segments;
    for (int4& s : other) s.y = (s.y + 1) % sp.experts;
    const Reference wrong = reference(pool, batch, other);
    for (size_t i = 0; i < other.size(); ++i) {
      const size_t off = static_cast<size_t>(batch.segments[i].z) * sp.out;
      const size_t n = static_cast<size_t>(batch.segments[i].w - batch.segments[i].z) * sp.out;
      gaps[i] = rel_frobenius(&wrong.delta[off], &ref.delta[off], n);
    }
  }
  // u for every x row with slot 1's (expert-shared) A, fp32 as a GEMM would write it
  const int R = sp.max_rank;
  std::vector<float> u_dense(static_cast<size_t>(batch.x_rows) * R, 0.f);
  for (int xr = 0; xr < batch.x_rows; ++xr)
    for (int r = 0; r < sp.ranks[1]; ++r) {
      double acc = 0;
      const float* a = pool.a_row(1, 0, r);
      for (int k = 0; k < sp.in; ++k)
        acc += double(batch.x[static_cast<size_t>(xr) * sp.in + k]) * a[k];
      u_dense[static_cast<size_t>(xr) * R + r] = static_cast<float>(acc);
    }
  DeviceBatch d = upload_batch(batch);
  auto partial = test::upload_vector(u_dense);
  const size_t delta_elems = static_cast<size_t>(batch.rows) * sp.out;
  cuda::DeviceBuffer delta(delta_elems * 2);
  LoraExpandArgs ex;
  ex.pool = pool.view();
  ex.seg = d.view();
  ex.partial = partial.as<float>();
  ex.row_capacity = batch.x_rows;
  ex.splits = 1;
  ex.u_row = d.gather.as<int32_t>();
  ex.delta = delta.as<__nv_bfloat16>();
  fresh_delta(delta, delta_elems);
  ops::cuda::launch_lora_expand_mma(ex, d.max_rows, stream_->get());
  stream_->synchronize();
  const auto mma = test::download_vector<uint16_t>(delta, delta_elems);
  check_delta(mma, pool, batch, ref, gaps, "dense u, mma expand");
  fresh_delta(delta, delta_elems);
  ops::cuda::launch_lora_expand(ex, stream_->get());
  stream_->synchronize();
  check_delta(test::download_vector<uint16_t>(delta, delta_elems), pool, batch, ref, gaps,
              "dense u, CUDA-core expand");
}

// One capture of shrink + expand at fixed capacity, replayed with other segments (other counts,
// lengths, slots and experts) written into the same device buffers: each replay matches the
// reference of its own segments.
TEST_F(Sm90_LoraMma, GraphReplaysWithOtherSegments) {
  std::mt19937_64 rng(test::test_seed(907));
  PoolSpec sp;
  sp.in = 392;
  sp.out = 520;
  sp.experts = sp.ea = sp.eb = 4;
  sp.max_rank = 32;
  sp.ranks = {32, 0, 24, 8};
  sp.scaling = {1.0f, 1.0f, 0.5f, 2.0f};
  Pool pool = make_pool(sp, rng);
  const int max_rows = 1500, max_segments = 12, x_rows = 500;
  const int R = sp.max_rank, N = sp.out;
  cuda::DeviceBuffer x_d(static_cast<size_t>(x_rows) * sp.in * 2), gather_d(max_rows * 4),
      segments_d(max_segments * 16), count_d(4), partial_d(static_cast<size_t>(max_rows) * R * 4),
      delta_d(static_cast<size_t>(max_rows) * N * 2);
  LoraSegmentsView seg;
  seg.segments = segments_d.as<int4>();
  seg.num_segments = count_d.as<int32_t>();
  seg.max_segments = max_segments;
  LoraShrinkArgs sh;
  sh.pool = pool.view();
  sh.seg = seg;
  sh.x = x_d.as<__nv_bfloat16>();
  sh.gather = gather_d.as<int32_t>();
  sh.partial = partial_d.as<float>();
  sh.row_capacity = max_rows;
  LoraExpandArgs ex;
  ex.pool = pool.view();
  ex.seg = seg;
  ex.partial = partial_d.as<float>();
  ex.row_capacity = max_rows;
  ex.splits = 1;
  ex.delta = delta_d.as<__nv_bfloat16>();
  MOELORA_CUDA_CHECK(cudaMemset(count_d.get(), 0, 4));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream_->get(), cudaStreamCaptureModeGlobal));
  ops::cuda::launch_lora_shrink_mma(sh, max_rows, stream_->get());
  ops::cuda::launch_lora_expand_mma(ex, max_rows, stream_->get());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream_->get(), &graph));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  const std::vector<std::vector<SegSpec>> replays = {
      {{0, 1, 1000, 2}, {2, 3, 300, 0}, {3, 0, 17, 1}},
      {{3, 2, 64, 0},
       {1, 2, 33, 0},
       {0, 0, 1, 5},
       {2, 1, 129, 0},
       {0, 3, 700, 3},
       {3, 3, 63, 0},
       {2, 0, 65, 0}},
  };
  for (size_t rep = 0; rep < replays.size(); ++rep) {
    Batch batch = make_batch(replays[rep], 4, sp.in, x_rows, rng);
    ASSERT_LE(batch.rows, max_rows);
    ASSERT_LE(static_cast<int>(batch.segments.size()), max_segments);
    const Reference ref = reference(pool, batch, batch.segments);
    const std::vector<double> gaps = factor_gaps(pool, batch, ref);
    std::vector<uint16_t> xb(batch.x.size());
    for (size_t i = 0; i < xb.size(); ++i) xb[i] = f32_to_bf16_bits(batch.x[i]);
    x_d.upload(xb.data(), xb.size() * 2);
    gather_d.upload(batch.gather.data(), batch.gather.size() * 4);
    segments_d.upload(batch.segments.data(), batch.segments.size() * 16);
    const int32_t count = static_cast<int32_t>(batch.segments.size());
    count_d.upload(&count, 4);
    MOELORA_CUDA_CHECK(cudaMemset(partial_d.get(), 0xFF, partial_d.bytes()));
    const size_t delta_elems = static_cast<size_t>(batch.rows) * N;
    fresh_delta(delta_d, delta_elems);
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream_->get()));
    stream_->synchronize();
    const std::string what = "replay " + std::to_string(rep);
    check_mma_partial(test::download_vector<float>(partial_d, static_cast<size_t>(batch.rows) * R),
                      pool, batch, ref, what);
    check_delta(test::download_vector<uint16_t>(delta_d, delta_elems), pool, batch, ref, gaps,
                what);
  }
  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
}

// The grid's tile capacity is an upper bound of sum_s ceil(len_s / 64) over every way to put at
// most max_rows rows into at most max_segments segments, and a tight one (host only: exhaustive
// maximum by dynamic programming over small sizes).
TEST(LoraMmaTiles, CapacityIsTheExactWorstCase) {
  const int kMaxRows = 300, kMaxSegs = 7;
  // best[m][s]: max tiles of at most s segments holding at most m rows
  std::vector<std::vector<int>> best(kMaxRows + 1, std::vector<int>(kMaxSegs + 1, 0));
  for (int s = 1; s <= kMaxSegs; ++s)
    for (int m = 0; m <= kMaxRows; ++m) {
      int v = best[m][s - 1];
      for (int len = 1; len <= m; ++len)
        v = std::max(v, (len + ops::cuda::kLoraMmaTileRows - 1) / ops::cuda::kLoraMmaTileRows +
                            best[m - len][s - 1]);
      best[m][s] = v;
    }
  for (int m = 0; m <= kMaxRows; ++m)
    for (int s = 0; s <= kMaxSegs; ++s)
      ASSERT_EQ(ops::cuda::lora_mma_tile_capacity(m, s), best[m][s])
          << "max_rows " << m << ", max_segments " << s;
  // the real sizes: a 4096-token prefill of a top-8, 256-expert layer with 8 slots
  EXPECT_EQ(ops::cuda::lora_mma_tile_capacity(4096 * 8, 2048), 512 + 2016);
}

// Launch-time checks name the argument and the value (host only: nothing is launched).
TEST(LoraMmaTiles, LauncherChecks) {
  alignas(16) static char dummy[64];
  LoraExpandArgs ex;
  ex.pool.a = reinterpret_cast<const __nv_bfloat16*>(dummy);
  ex.pool.b = reinterpret_cast<const __nv_bfloat16*>(dummy);
  ex.pool.scaling = reinterpret_cast<const float*>(dummy);
  ex.pool.rank = reinterpret_cast<const int32_t*>(dummy);
  ex.pool.max_rank = 16;
  ex.pool.in_features = 64;
  ex.pool.out_features = 100;  // not a multiple of 8
  ex.seg.segments = reinterpret_cast<const int4*>(dummy);
  ex.seg.num_segments = reinterpret_cast<const int32_t*>(dummy);
  ex.seg.max_segments = 1;
  ex.partial = reinterpret_cast<const float*>(dummy);
  ex.row_capacity = 8;
  ex.delta = reinterpret_cast<__nv_bfloat16*>(dummy);
  std::string msg = test::error_message([&] { ops::cuda::launch_lora_expand_mma(ex, 8, nullptr); },
                                        ErrorCode::kUnsupported);
  EXPECT_NE(msg.find("out_features = 100"), std::string::npos) << msg;
  LoraShrinkArgs sh;
  sh.pool = ex.pool;
  sh.pool.max_rank = 264;
  sh.seg = ex.seg;
  sh.x = reinterpret_cast<const __nv_bfloat16*>(dummy);
  sh.partial = reinterpret_cast<float*>(dummy);
  sh.row_capacity = 8;
  msg = test::error_message([&] { ops::cuda::launch_lora_shrink_mma(sh, 8, nullptr); },
                            ErrorCode::kUnsupported);
  EXPECT_NE(msg.find("rank 264"), std::string::npos) << msg;
  // prefill-sized forwards only
  EXPECT_FALSE(ops::cuda::should_use_lora_mma(ops::cuda::kLoraMmaMinTokens - 1));
  EXPECT_TRUE(ops::cuda::should_use_lora_mma(ops::cuda::kLoraMmaMinTokens));
}

}  // namespace
}  // namespace moelora
