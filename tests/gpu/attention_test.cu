// Paged causal GQA attention on the GPU against ops::attention_ref on random bf16-representable
// inputs: decode (single and split KV), prefill, chunked prefill over cached context, mixed
// batches with padding sequences and padding rows, GQA groups 1 / 2 / 8, head dims 8, 16, 64,
// 128 and a generic size pair, odd lengths, pages of 16 and 64 in shuffled order, a
// Qwen3-30B-A3B shaped batch with a 4096-token context, and a CUDA-graph replay with other
// lengths than at capture. Every case also checks the KV append bit for bit (and that nothing
// else in the cache changed) and that padding rows of `out` are left untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "gpu/gpu_test_util.cuh"
#include "gpu/paged_attention_case.cuh"
#include "ops/attention/attention.h"
#include "ops/attention/attention_cuda.cuh"
#include "ops/attention/attention_flashinfer.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using namespace attention_case;

void run_case(const Case& c) {
  std::mt19937_64 rng(test::test_seed(c.seed));
  Batch b = make_batch(c, rng);
  DeviceBatch dev;
  make_device(c, b, batch_max_q_len(c), batch_max_kv_len(c), dev);
  ops::cuda::launch_paged_kv_append(dev.append, nullptr);
  ops::cuda::launch_paged_attention(dev.attend, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  check_results(c, b, dev);
}

TEST(GpuPagedAttention, DecodeShortContextsOneSplit) {
  MOELORA_REQUIRE_SM90();
  Case c;  // G 2, D 128, page 16; longest context 129 keeps one split (direct bf16 store)
  c.seqs = {{1, 1}, {1, 7}, {1, 129}, {1, 100}};
  c.seed = 101;
  run_case(c);
}

TEST(GpuPagedAttention, DecodeSplitKvGroup8) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 16, c.hkv = 2, c.page_size = 64;  // G 8
  c.seqs = {{1, 1000}, {1, 7}, {1, 129}, {1, 513}, {1, 1}};
  c.seed = 102;
  run_case(c);
}

TEST(GpuPagedAttention, DecodeGroup1HeadDim64) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 5, c.hkv = 5, c.d = c.dv = 64;
  c.seqs = {{1, 1000}, {1, 33}, {1, 1}};
  c.scale = 0.3f;
  c.seed = 103;
  run_case(c);
}

TEST(GpuPagedAttention, PrefillGroup1HeadDim64Page64) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 3, c.hkv = 3, c.d = c.dv = 64, c.page_size = 64;
  c.seqs = {{7, 7}, {129, 129}, {1000, 1000}};
  c.seed = 104;
  run_case(c);
}

TEST(GpuPagedAttention, PrefillGroup2HeadDim128) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.seqs = {{1000, 1000}, {2, 2}, {65, 65}};
  c.seed = 105;
  run_case(c);
}

TEST(GpuPagedAttention, ChunkedPrefillOverCachedContextGroup8) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 16, c.hkv = 2;  // G 8: a 64-row tile holds 8 tokens x 8 heads
  c.seqs = {{129, 1000}, {7, 71}, {64, 128}, {3, 1000}};
  c.seed = 106;
  run_case(c);
}

TEST(GpuPagedAttention, ChunkedPrefillHeadDim64Group8Page64) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 16, c.hkv = 2, c.d = c.dv = 64, c.page_size = 64;
  c.seqs = {{1, 129}, {129, 1000}, {33, 40}};
  c.seed = 107;
  run_case(c);
}

TEST(GpuPagedAttention, MixedBatchWithPaddingAndLargeKvBound) {
  MOELORA_REQUIRE_SM90();
  Case c;  // decode + prefill + chunk + padding sequences and rows; bound far above the contexts
  c.seqs = {{1, 1000}, {0, 0}, {129, 129}, {1, 7}, {0, 0}, {7, 300}, {1, 1}};
  c.pad_rows = 4;
  c.kv_len_bound = 4096;
  c.seed = 108;
  run_case(c);
}

TEST(GpuPagedAttention, GenericHeadDim16) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 4, c.hkv = 2, c.d = c.dv = 16;
  c.seqs = {{1, 50}, {7, 7}, {0, 0}, {33, 100}, {1, 1}};
  c.pad_rows = 2;
  c.odd_strides = true;
  c.seed = 109;
  run_case(c);
}

TEST(GpuPagedAttention, GenericHeadDim8Page64) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 8, c.hkv = 1, c.d = c.dv = 8, c.page_size = 64;  // G 8
  c.seqs = {{1, 129}, {129, 129}, {7, 1000}};
  c.pad_rows = 1;
  c.seed = 110;
  run_case(c);
}

TEST(GpuPagedAttention, GenericUnequalHeadDims) {
  MOELORA_REQUIRE_SM90();
  Case c;
  c.hq = 6, c.hkv = 3, c.d = 200, c.dv = 40;
  c.seqs = {{1, 77}, {17, 17}, {5, 300}};
  c.seed = 111;
  run_case(c);
}

TEST(GpuPagedAttention, Qwen3_30B_A3B_Context4096) {
  MOELORA_REQUIRE_SM90();
  Case c;  // 32 q heads, 4 kv heads, head_dim 128
  c.hq = 32, c.hkv = 4, c.d = c.dv = 128, c.page_size = 16;
  c.seqs = {{1, 4096}, {1, 4095}, {64, 4096}, {1, 1}, {0, 0}};
  c.pad_rows = 2;
  c.seed = 112;
  run_case(c);
}

// Captured once with a kv bound, replayed after the lengths, positions and inputs changed.
TEST(GpuPagedAttention, GraphReplayWithOtherLengths) {
  MOELORA_REQUIRE_SM90();
  Case first;
  first.hq = 16, first.hkv = 2;
  first.seqs = {{1, 700}, {1, 9}, {1, 1}};
  first.kv_len_bound = 2048;
  first.seed = 113;
  Case second = first;
  second.seqs = {{1, 3}, {1, 2048}, {1, 130}};
  second.seed = 114;

  std::mt19937_64 rng(test::test_seed(first.seed));
  Batch b1 = make_batch(first, rng);
  Batch b2 = make_batch(second, rng);
  ASSERT_EQ(b1.rows, b2.rows);
  // One set of device buffers sized for both (the second needs more pages and a wider table).
  DeviceBatch dev;
  const int mpps = std::max(b1.max_pages_per_seq, b2.max_pages_per_seq);
  const int pages = std::max(b1.num_pages, b2.num_pages);
  widen_batch(first, mpps, pages, b1);
  widen_batch(first, mpps, pages, b2);
  make_device(first, b1, 1, first.kv_len_bound, dev);

  cuda::Stream stream;
  test::CapturedGraph graph(stream.get(), [&](cudaStream_t s) {
    ops::cuda::launch_paged_kv_append(dev.append, s);
    ops::cuda::launch_paged_attention(dev.attend, s);
  });
  graph.launch();
  check_results(first, b1, dev);
  upload_contents(b2, dev);  // same buffers, new contents
  graph.launch();
  check_results(second, b2, dev);
}

// ---- FlashInfer's paged-prefill kernel behind ops::cuda::FlashInferAttention ----

// The engine's layout for FlashInfer: rows back to back; for a decode plan, padding sequences
// (q_len 0) at the end with one padding row each (row b for sequence b, as in a graph bucket).
void add_trailing_padding_rows(const Case& c, Batch& b, int rows, std::mt19937_64& rng) {
  for (int r = 0; r < rows; ++r) {
    b.token_seq.push_back(-1);
    b.token_pos.push_back(0);
  }
  b.rows += rows;
  const auto q_pad = random_bf16(static_cast<size_t>(rows) * c.hq * c.d, rng);
  b.q.insert(b.q.end(), q_pad.begin(), q_pad.end());
  b.k_new.resize(static_cast<size_t>(b.rows) * b.k_stride, 0);
  b.v_new.resize(static_cast<size_t>(b.rows) * b.v_stride, 0);
}

ops::cuda::FlashInferAttentionShape flashinfer_shape(const Case& c, const Batch& b,
                                                     bool programmatic_launch = false) {
  ops::cuda::FlashInferAttentionShape s;
  s.programmatic_launch = programmatic_launch;
  s.num_q_heads = c.hq;
  s.num_kv_heads = c.hkv;
  s.head_dim = c.d;
  s.page_size = c.page_size;
  s.max_seqs = static_cast<int>(c.seqs.size());
  s.max_tokens = b.rows;
  s.max_pages_per_seq = b.max_pages_per_seq;
  return s;
}

ops::cuda::FlashInferHostBatch host_batch(const Case& c, const Batch& b) {
  ops::cuda::FlashInferHostBatch h;
  h.q_start = b.q_start.data();
  h.q_len = b.q_len.data();
  h.kv_len = b.kv_len.data();
  h.page_table = b.page_table.data();
  h.seqs = static_cast<int>(c.seqs.size());
  return h;
}

// moelora's append, then FlashInfer's attention, against attention_ref. trailing_rows: padding
// rows after the sequences' rows; a decode plan gives them to the padding sequences at the end of
// c.seqs ({0, 0}, one each) and writes them, a general plan must leave them untouched. Returns out
// (bf16 bits). programmatic_launch: FlashInferAttentionShape::programmatic_launch.
std::vector<uint16_t> run_flashinfer_case(const Case& c, bool decode, int trailing_rows = 0,
                                          bool programmatic_launch = false) {
  std::mt19937_64 rng(test::test_seed(c.seed));
  Batch b = make_batch(c, rng);
  add_trailing_padding_rows(c, b, trailing_rows, rng);
  DeviceBatch dev;
  make_device(c, b, batch_max_q_len(c), batch_max_kv_len(c), dev);
  ops::cuda::FlashInferAttention attention(flashinfer_shape(c, b, programmatic_launch));
  cuda::Stream stream;
  attention.plan(host_batch(c, b), decode, stream.get());
  ops::cuda::launch_paged_kv_append(dev.append, stream.get());
  attention.launch(dev.attend, stream.get());
  stream.synchronize();
  check_results(c, b, dev, /*padding_rows_written=*/decode && trailing_rows > 0);
  return download_vector<uint16_t>(dev.out, static_cast<size_t>(b.rows) * c.hq * c.dv);
}

#define MOELORA_REQUIRE_FLASHINFER()                                          \
  do {                                                                        \
    MOELORA_REQUIRE_SM90();                                                   \
    if (!ops::cuda::FlashInferAttention::compiled())                          \
      GTEST_SKIP() << "this build has no FlashInfer kernels (scripts/setup)"; \
  } while (0)

TEST(GpuFlashInferAttention, DecodeGroup8HeadDim128WithPaddingSequences) {
  MOELORA_REQUIRE_FLASHINFER();
  Case c;  // Qwen3-30B-A3B heads; a bucket of 7 with two padding sequences at the end
  c.hq = 32, c.hkv = 4, c.page_size = 64;
  c.seqs = {{1, 4096}, {1, 7}, {1, 129}, {1, 1}, {1, 1000}, {0, 0}, {0, 0}};
  c.seed = 201;
  run_flashinfer_case(c, /*decode=*/true, /*padding_seqs=*/2);
}

TEST(GpuFlashInferAttention, DecodeGroup4HeadDim64Page16) {
  MOELORA_REQUIRE_FLASHINFER();
  Case c;
  c.hq = 8, c.hkv = 2, c.d = c.dv = 64, c.page_size = 16;
  c.seqs = {{1, 33}, {1, 2048}, {1, 16}, {1, 17}};
  c.scale = 0.2f;
  c.seed = 202;
  run_flashinfer_case(c, /*decode=*/true);
}

TEST(GpuFlashInferAttention, PrefillHeadDim256Group8) {
  MOELORA_REQUIRE_FLASHINFER();
  Case c;  // Qwen3.5's full-attention heads
  c.hq = 16, c.hkv = 2, c.d = c.dv = 256, c.page_size = 64;
  c.seqs = {{300, 300}, {1, 1}, {65, 65}};
  c.seed = 203;
  run_flashinfer_case(c, /*decode=*/false);
}

TEST(GpuFlashInferAttention, ChunkedPrefillMixedWithDecodesGroup1) {
  MOELORA_REQUIRE_FLASHINFER();
  Case c;  // a chunked-prefill step: decodes, chunks over cached context, a whole prompt, an idle
           // sequence (q_len 0) and padding rows at the end that must stay untouched
  c.hq = 4, c.hkv = 4, c.d = c.dv = 128, c.page_size = 16;
  c.seqs = {{1, 1000}, {129, 1000}, {0, 0}, {7, 71}, {1, 2}, {64, 64}};
  c.seed = 204;
  run_flashinfer_case(c, /*decode=*/false, /*trailing_rows=*/3);
}

// Programmatic launches (the engine's attention_pdl) change when the kernels start, not what they
// compute: a split-KV decode (attention + merge, both programmatic), an unsplit one and a prefill
// give the plain launch's bits, and each matches attention_ref.
TEST(GpuFlashInferAttention, ProgrammaticLaunchGivesThePlainLaunchBits) {
  MOELORA_REQUIRE_FLASHINFER();
  Case split;  // Qwen3-30B-A3B heads, long contexts: KV split, merge kernel
  split.hq = 32, split.hkv = 4, split.page_size = 64;
  split.seqs = {{1, 4096}, {1, 7}, {1, 2000}, {1, 1}, {0, 0}};
  split.seed = 207;
  Case unsplit;  // 64 KV heads: no split
  unsplit.hq = 64, unsplit.hkv = 64, unsplit.page_size = 16;
  unsplit.seqs = {{1, 300}, {1, 17}, {1, 64}};
  unsplit.seed = 208;
  Case prefill;  // Qwen3.5's heads of 256, a general plan
  prefill.hq = 16, prefill.hkv = 2, prefill.d = prefill.dv = 256, prefill.page_size = 64;
  prefill.seqs = {{130, 130}, {1, 77}};
  prefill.seed = 209;
  // (case, decode plan, trailing padding rows: one per {0, 0} sequence of a decode case)
  for (const auto& [c, decode, trailing, name] :
       {std::tuple{split, true, 1, "split decode"}, std::tuple{unsplit, true, 0, "unsplit decode"},
        std::tuple{prefill, false, 0, "prefill"}}) {
    const std::vector<uint16_t> plain = run_flashinfer_case(c, decode, trailing, false);
    const std::vector<uint16_t> pdl = run_flashinfer_case(c, decode, trailing, true);
    ASSERT_EQ(pdl.size(), plain.size()) << name;
    for (size_t i = 0; i < pdl.size(); ++i)
      ASSERT_EQ(pdl[i], plain[i]) << name << ": out element " << i;
  }
}

// A graph captured after one decode plan, replayed after plans of other batches of the same
// bucket size: other lengths, fewer live sequences, other pages.
void check_graph_replay_across_plans(int hq, int hkv, bool programmatic_launch = false) {
  Case first;
  first.hq = hq, first.hkv = hkv, first.page_size = 64;
  first.seqs = {{1, 2000}, {1, 9}, {1, 64}, {1, 65}, {0, 0}, {0, 0}};
  first.seed = 205;
  Case second = first;
  second.seqs = {{1, 3}, {1, 2000}, {0, 0}, {0, 0}, {0, 0}, {0, 0}};
  second.seed = 206;
  std::mt19937_64 rng(test::test_seed(first.seed));
  Batch b1 = make_batch(first, rng), b2 = make_batch(second, rng);
  add_trailing_padding_rows(first, b1, 2, rng);
  add_trailing_padding_rows(second, b2, 4, rng);
  ASSERT_EQ(b1.rows, b2.rows);
  ASSERT_EQ(b1.max_pages_per_seq, b2.max_pages_per_seq);
  // The cache after the append is what attention reads: upload it whole.
  const size_t cache_elems = std::max(b1.expect_k.size(), b2.expect_k.size());
  cuda::DeviceBuffer k(cache_elems * 2), v(cache_elems * 2), q(b1.q.size() * 2),
      out(static_cast<size_t>(b1.rows) * first.hq * first.dv * 2);
  ops::cuda::PagedAttentionArgs a;
  a.cache.k = k.as<__nv_bfloat16>();
  a.cache.v = v.as<__nv_bfloat16>();
  a.cache.page_size = first.page_size;
  a.cache.num_kv_heads = first.hkv;
  a.cache.head_dim = a.cache.v_head_dim = first.d;
  a.q = q.as<__nv_bfloat16>();
  a.q_stride = static_cast<int64_t>(first.hq) * first.d;
  a.num_q_heads = first.hq;
  a.out = out.as<__nv_bfloat16>();
  ops::cuda::FlashInferAttention attention(flashinfer_shape(first, b1, programmatic_launch));
  cuda::Stream stream;
  auto load = [&](const Batch& b) {
    k.upload(b.expect_k.data(), b.expect_k.size() * 2);
    v.upload(b.expect_v.data(), b.expect_v.size() * 2);
    q.upload(b.q.data(), b.q.size() * 2);
  };

  load(b1);
  attention.plan(host_batch(first, b1), /*decode=*/true, stream.get());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  attention.launch(a, stream.get());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.synchronize();
  check_output(first, b1, download_vector<uint16_t>(out, out.bytes() / 2));

  load(b2);
  attention.plan(host_batch(second, b2), /*decode=*/true, stream.get());
  MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.synchronize();
  check_output(second, b2, download_vector<uint16_t>(out, out.bytes() / 2));

  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
}

TEST(GpuFlashInferAttention, GraphReplayAcrossPlans) {
  MOELORA_REQUIRE_FLASHINFER();
  check_graph_replay_across_plans(32, 4);  // 6 query tiles within the split budget: KV split
}

TEST(GpuFlashInferAttention, GraphReplayAcrossPlansProgrammaticLaunch) {
  MOELORA_REQUIRE_FLASHINFER();
  check_graph_replay_across_plans(32, 4, /*programmatic_launch=*/true);  // programmatic edges
}

TEST(GpuFlashInferAttention, GraphReplayAcrossPlansWithoutSplits) {
  MOELORA_REQUIRE_FLASHINFER();
  // 64 KV heads leave a split budget of 2 CTAs x SMs / 64 = 4 work items, below the bucket's 6
  // query tiles: the planner turns KV splitting off for this bucket (no merge kernel).
  check_graph_replay_across_plans(64, 64);
}

TEST(GpuFlashInferAttention, RejectsBatchesItCannotServe) {
  MOELORA_REQUIRE_FLASHINFER();
  Case c;
  c.hq = 8, c.hkv = 2, c.d = c.dv = 64;
  c.seqs = {{3, 10}, {1, 5}};
  std::mt19937_64 rng(1);
  Batch b = make_batch(c, rng);
  ops::cuda::FlashInferAttention attention(flashinfer_shape(c, b));
  cuda::Stream stream;
  // A decode plan needs one row per sequence.
  std::string message =
      test::error_message([&] { attention.plan(host_batch(c, b), /*decode=*/true, stream.get()); },
                          ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("q_len 3"), std::string::npos) << message;
  // Rows must be back to back.
  std::vector<int32_t> q_start = b.q_start;
  q_start[1] += 1;
  ops::cuda::FlashInferHostBatch h = host_batch(c, b);
  h.q_start = q_start.data();
  message = test::error_message([&] { attention.plan(h, /*decode=*/false, stream.get()); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("starts at row 4, expected 3"), std::string::npos) << message;
  // launch before a successful plan.
  ops::cuda::PagedAttentionArgs a;
  message =
      test::error_message([&] { attention.launch(a, stream.get()); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("before plan"), std::string::npos) << message;
  // Capacities: sequences, rows, the page table, unassigned pages.
  ops::cuda::FlashInferHostBatch many = host_batch(c, b);
  many.seqs = 3;
  message = test::error_message([&] { attention.plan(many, /*decode=*/false, stream.get()); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("batch.seqs = 3, expected 0 .. max_seqs = 2"), std::string::npos)
      << message;
  std::vector<int32_t> q_len = b.q_len, kv_len = b.kv_len;
  q_len[1] = 2;  // 3 + 2 rows in a batch built for 4
  kv_len[1] = 6;
  h = host_batch(c, b);
  h.q_len = q_len.data();
  h.kv_len = kv_len.data();
  message = test::error_message([&] { attention.plan(h, /*decode=*/false, stream.get()); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("5 query rows"), std::string::npos) << message;
  kv_len = b.kv_len;
  kv_len[0] = b.max_pages_per_seq * c.page_size + 1;
  h = host_batch(c, b);
  h.kv_len = kv_len.data();
  message = test::error_message([&] { attention.plan(h, /*decode=*/false, stream.get()); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("the page table's capacity"), std::string::npos) << message;
  std::vector<int32_t> table = b.page_table;
  table[0] = -1;
  h = host_batch(c, b);
  h.page_table = table.data();
  message = test::error_message([&] { attention.plan(h, /*decode=*/false, stream.get()); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("page_table[0] = -1"), std::string::npos) << message;
  // A general plan's launch may not be captured into a graph.
  DeviceBatch dev;
  make_device(c, b, batch_max_q_len(c), batch_max_kv_len(c), dev);
  attention.plan(host_batch(c, b), /*decode=*/false, stream.get());
  stream.synchronize();
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  message = test::error_message([&] { attention.launch(dev.attend, stream.get()); },
                                ErrorCode::kInvalidArgument);
  cudaGraph_t graph = nullptr;
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  if (graph) MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
  EXPECT_NE(message.find("only decode plans"), std::string::npos) << message;
  // Misaligned q.
  ops::cuda::PagedAttentionArgs misaligned = dev.attend;
  misaligned.q = dev.attend.q + 1;
  message = test::error_message([&] { attention.launch(misaligned, stream.get()); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("16-byte aligned"), std::string::npos) << message;
  // Shapes FlashInfer's kernels are not built for.
  ops::cuda::FlashInferAttentionShape s = flashinfer_shape(c, b);
  s.head_dim = 96;
  message =
      test::error_message([&] { ops::cuda::FlashInferAttention bad(s); }, ErrorCode::kUnsupported);
  EXPECT_NE(message.find("head_dim 96"), std::string::npos) << message;
}

TEST(GpuPagedAttention, RejectsUnsupportedHeadDim) {
  // Host-side validation only: runs without a device.
  ops::cuda::PagedAttentionArgs a;
  std::vector<__nv_bfloat16> dummy(64);
  int32_t meta = 0;
  a.cache.k = a.cache.v =
      reinterpret_cast<__nv_bfloat16*>((reinterpret_cast<uintptr_t>(dummy.data()) + 15) / 16 * 16);
  a.cache.page_size = 16;
  a.cache.num_kv_heads = 1;
  a.cache.head_dim = 12;
  a.cache.v_head_dim = 16;
  a.batch.page_table = a.batch.q_start = a.batch.q_len = a.batch.kv_len = a.batch.token_seq =
      a.batch.token_pos = &meta;
  a.batch.max_pages_per_seq = 1;
  a.batch.max_seqs = a.batch.max_tokens = a.batch.max_q_len = a.batch.max_kv_len = 1;
  a.num_q_heads = 1;
  const std::string message = test::error_message(
      [&] { ops::cuda::launch_paged_attention(a, nullptr); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("head_dim"), std::string::npos) << message;
  EXPECT_NE(message.find("12"), std::string::npos) << message;
}

}  // namespace
}  // namespace moelora
