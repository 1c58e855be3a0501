// Sm90 tensor-core LoRA shrink / expand (ops/lora/lora_mma_cuda.cuh) in CUDA graphs: one capture
// replayed with other segments written into its buffers, each replay against the reference of its
// own segments (pools, checks and tolerances of lora_mma_test_support.cuh); and the grid's tile
// capacity (host only: exact worst case, the launchers' checks, the token threshold).
#include <gtest/gtest.h>

#include "gpu/lora_mma_test_support.cuh"

namespace moelora {
namespace {

using namespace lora_mma_test;

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
