// The flat split-KV decode attention (ops/attention/gqa_decode_cuda.cuh) against ops::attention_ref
// on random bf16 inputs: Qwen3-30B-A3B (32 / 4 heads of 128) and Qwen3.5 (16 / 2 heads of 256)
// shapes, GQA groups 1 / 8 / 16, head dims 64 / 128 / 256, pages of 16 and 64 in shuffled order,
// padding sequences and padding rows (left untouched), odd context lengths; grids of 3 and 7 CTAs
// (every (sequence, KV head) cut across CTAs, CTAs spanning many of them, merges of many
// partials), of more CTAs than tiles (the kernel uses fewer) and the device default.
// Also: the tickets are back at zero after every launch, repeated launches and a CUDA-graph
// replay give the same bits as an eager launch, a replay on other lengths matches the reference,
// and the launcher's refusals.
#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <vector>

#include "core/error.h"
#include "gpu/gpu_test_util.cuh"
#include "gpu/paged_attention_case.cuh"
#include "ops/attention/gqa_decode_cuda.cuh"

namespace moelora {
namespace {

using namespace attention_case;

// A case ready to launch: the batch, its device copy and a decode workspace for `num_ctas`.
struct DecodeRun {
  Batch b;
  DeviceBatch dev;
  cuda::DeviceBuffer workspace;
  int num_ctas = 0;
};

void prepare(const Case& c, int num_ctas, DecodeRun& r) {
  std::mt19937_64 rng(test::test_seed(c.seed));
  r.b = make_batch(c, rng);
  make_device(c, r.b, 1, batch_max_kv_len(c), r.dev);
  const int seqs = static_cast<int>(c.seqs.size());
  r.num_ctas = num_ctas;
  r.workspace =
      cuda::DeviceBuffer(ops::cuda::gqa_decode_workspace_bytes(seqs, c.hq, c.hkv, c.d, num_ctas));
  ops::cuda::reset_gqa_decode_workspace(r.workspace.get(), seqs, c.hkv, nullptr);
  r.dev.attend.workspace = r.workspace.get();
}

void expect_tickets_zero(const Case& c, const DecodeRun& r) {
  const auto tickets =
      download_vector<int32_t>(r.workspace, c.seqs.size() * static_cast<size_t>(c.hkv));
  for (size_t i = 0; i < tickets.size(); ++i)
    EXPECT_EQ(tickets[i], 0) << "ticket of sequence " << i / c.hkv << ", KV head " << i % c.hkv;
}

// Append, attend, compare with the reference; returns out's bits.
std::vector<uint16_t> run_decode(const Case& c, int num_ctas) {
  DecodeRun r;
  prepare(c, num_ctas, r);
  ops::cuda::launch_paged_kv_append(r.dev.append, nullptr);
  ops::cuda::launch_gqa_decode_attention(r.dev.attend, nullptr, r.num_ctas);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  check_results(c, r.b, r.dev);
  expect_tickets_zero(c, r);
  return download_vector<uint16_t>(r.dev.out, static_cast<size_t>(r.b.rows) * c.hq * c.dv);
}

Case qwen3_case() {
  Case c;
  c.hq = 32, c.hkv = 4, c.d = c.dv = 128, c.page_size = 64;  // G 8
  c.seqs = {{1, 2048}, {1, 1}, {0, 40}, {1, 65}, {1, 64}, {1, 1000}, {1, 129}};
  c.pad_rows = 3;
  c.seed = 301;
  return c;
}

TEST(Sm90_GqaDecode, Qwen3ShapesOnTheDefaultGrid) {
  MOELORA_REQUIRE_SM90();
  run_decode(qwen3_case(), 0);
}

TEST(Sm90_GqaDecode, FewCtasCutEveryPairAndMergeManyPartials) {
  MOELORA_REQUIRE_SM90();
  Case c = qwen3_case();
  c.hq = 16, c.hkv = 2, c.page_size = 16;  // G 8, pages smaller than a tile
  c.seqs = {{1, 1000}, {1, 7}, {1, 129}, {0, 3}, {1, 513}, {1, 1}};
  for (const int ctas : {1, 3, 7, 64}) {
    SCOPED_TRACE(::testing::Message() << ctas << " CTAs");
    run_decode(c, ctas);
  }
}

TEST(Sm90_GqaDecode, MoreCtasThanTilesUseFewer) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 8, c.hkv = 2, c.d = c.dv = 128, c.page_size = 16;  // G 4
  c.seqs = {{1, 200}, {1, 3}, {1, 64}};                     // 4 + 1 + 1 tiles per KV head: 12 tiles
  c.seed = 302;
  run_decode(c, 500);
  run_decode(c, 29);
}

TEST(Sm90_GqaDecode, Qwen35HeadDim256Group8) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 16, c.hkv = 2, c.d = c.dv = 256, c.page_size = 64;
  c.seqs = {{1, 3000}, {1, 77}, {1, 1}, {1, 640}};
  c.pad_rows = 1;
  c.seed = 303;
  run_decode(c, 0);
  run_decode(c, 5);
}

TEST(Sm90_GqaDecode, HeadDim64Group16AndGroup1) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 16, c.hkv = 1, c.d = c.dv = 64, c.page_size = 16;  // G 16: every m16 row a head
  c.seqs = {{1, 300}, {1, 17}};
  c.scale = 0.3f;
  c.seed = 304;
  run_decode(c, 0);
  run_decode(c, 4);
  c.hq = 4, c.hkv = 4, c.d = c.dv = 128;  // G 1
  c.seed = 305;
  run_decode(c, 0);
  run_decode(c, 9);
}

TEST(Sm90_GqaDecode, SameBitsEveryLaunchAndInAGraphReplay) {
  MOELORA_REQUIRE_SM90();
  const Case c = qwen3_case();
  DecodeRun r;
  prepare(c, 11, r);
  ops::cuda::launch_paged_kv_append(r.dev.append, nullptr);
  ops::cuda::launch_gqa_decode_attention(r.dev.attend, nullptr, r.num_ctas);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  check_results(c, r.b, r.dev);
  const size_t out_elems = static_cast<size_t>(r.b.rows) * c.hq * c.dv;
  const auto eager = download_vector<uint16_t>(r.dev.out, out_elems);
  for (int rep = 0; rep < 3; ++rep) {
    ops::cuda::launch_gqa_decode_attention(r.dev.attend, nullptr, r.num_ctas);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    ASSERT_EQ(download_vector<uint16_t>(r.dev.out, out_elems), eager) << "eager launch " << rep;
  }
  cuda::Stream stream;
  test::CapturedGraph graph(stream.get(), [&](cudaStream_t s) {
    ops::cuda::launch_gqa_decode_attention(r.dev.attend, s, r.num_ctas);
  });
  for (int rep = 0; rep < 2; ++rep) {
    graph.launch();
    ASSERT_EQ(download_vector<uint16_t>(r.dev.out, out_elems), eager) << "graph replay " << rep;
  }
  expect_tickets_zero(c, r);
}

TEST(Sm90_GqaDecode, GraphReplayOnOtherLengths) {
  MOELORA_REQUIRE_SM90();
  Case first;
  first.hq = 16, first.hkv = 2, first.page_size = 16;
  first.seqs = {{1, 700}, {1, 9}, {0, 5}, {1, 1}};
  first.seed = 306;
  Case second = first;
  second.seqs = {{1, 3}, {1, 2048}, {0, 5}, {1, 130}};
  second.seed = 307;
  std::mt19937_64 rng(test::test_seed(first.seed));
  Batch b1 = make_batch(first, rng);
  Batch b2 = make_batch(second, rng);
  ASSERT_EQ(b1.rows, b2.rows);
  const int mpps = std::max(b1.max_pages_per_seq, b2.max_pages_per_seq);
  const int pages = std::max(b1.num_pages, b2.num_pages);
  widen_batch(first, mpps, pages, b1);
  widen_batch(first, mpps, pages, b2);
  DeviceBatch dev;
  make_device(first, b1, 1, 2048, dev);
  const int seqs = static_cast<int>(first.seqs.size());
  cuda::DeviceBuffer workspace(
      ops::cuda::gqa_decode_workspace_bytes(seqs, first.hq, first.hkv, first.d, 0));
  ops::cuda::reset_gqa_decode_workspace(workspace.get(), seqs, first.hkv, nullptr);
  dev.attend.workspace = workspace.get();

  cuda::Stream stream;
  test::CapturedGraph graph(stream.get(), [&](cudaStream_t s) {
    ops::cuda::launch_paged_kv_append(dev.append, s);
    ops::cuda::launch_gqa_decode_attention(dev.attend, s);
  });
  graph.launch();
  check_results(first, b1, dev);
  upload_contents(b2, dev);  // same buffers, new contents
  graph.launch();
  check_results(second, b2, dev);
}

TEST(Sm90_GqaDecode, RefusesWhatItCannotServe) {
  EXPECT_TRUE(ops::cuda::gqa_decode_supports(32, 4, 128, 128));
  EXPECT_TRUE(ops::cuda::gqa_decode_supports(16, 2, 256, 256));
  EXPECT_FALSE(ops::cuda::gqa_decode_supports(32, 4, 96, 96));    // head dim
  EXPECT_FALSE(ops::cuda::gqa_decode_supports(64, 2, 128, 128));  // G 32 > 16
  EXPECT_FALSE(ops::cuda::gqa_decode_supports(12, 8, 128, 128));  // Hq % Hkv
  EXPECT_FALSE(ops::cuda::gqa_decode_supports(8, 2, 128, 64));    // D != Dv
  MOELORA_REQUIRE_SM90();
  Case c = qwen3_case();
  DecodeRun r;
  prepare(c, 0, r);
  // The error code a launch throws (nullopt: it did not throw).
  auto code_of = [](const ops::cuda::PagedAttentionArgs& a) -> std::optional<ErrorCode> {
    try {
      ops::cuda::launch_gqa_decode_attention(a, nullptr);
    } catch (const Error& e) {
      return e.code();
    }
    return std::nullopt;
  };
  ops::cuda::PagedAttentionArgs a = r.dev.attend;
  a.batch.max_q_len = 2;
  EXPECT_EQ(code_of(a), std::optional(ErrorCode::kInvalidArgument));
  a = r.dev.attend;
  a.workspace = nullptr;
  EXPECT_EQ(code_of(a), std::optional(ErrorCode::kInvalidArgument));
  a = r.dev.attend;
  a.num_q_heads = 4 * 17;  // G 17 over the case's 4 KV heads
  EXPECT_EQ(code_of(a), std::optional(ErrorCode::kUnsupported));
  a = r.dev.attend;
  a.batch.max_seqs = 2000;
  EXPECT_EQ(code_of(a), std::optional(ErrorCode::kInvalidArgument));
  a = r.dev.attend;
  a.q_stride = 100;
  EXPECT_EQ(code_of(a), std::optional(ErrorCode::kInvalidArgument));
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace moelora
