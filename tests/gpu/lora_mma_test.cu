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
//     expand (u_row, splits = 1); CUDA-graph replays with other segments under one capture and the
//     grid's tile capacity are in lora_mma_graph_test.cu.
// Pool entries past a slot's rank hold large garbage and the partial buffer starts as NaN, so a
// kernel that reads either fails. Each segment's error must be far below its distance to the
// result computed with a neighbouring expert's or another slot's factors, so a segment that
// reads another slot's or expert's factors fails.
//
// Tolerances: partial (fp32) |p - u| <= 2e-4 sum_k |x a| + 1e-6; delta (bf16) per segment
// relative Frobenius error <= 5e-3 and PERF.md's elementwise bound (|x - ref| <= 2e-2 |ref| +
// 2e-2 rms(ref)) with cosine >= 0.9999 over all segment rows.
#include <gtest/gtest.h>

#include "gpu/lora_mma_test_support.cuh"

namespace moelora {
namespace {

using namespace lora_mma_test;

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
}  // namespace
}  // namespace moelora
