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
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "gpu/gpu_test_util.cuh"
#include "ops/attention/attention.h"
#include "ops/attention/attention_cuda.cuh"
#include "ops/attention/attention_flashinfer.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

constexpr uint16_t kCacheSentinel = 0x7fc0;  // bf16 NaN: reading an unwritten cache row poisons out
constexpr uint16_t kOutSentinel = 0x4321;    // padding rows of out must keep this

struct SeqSpec {
  int q_len;   // new tokens this step (0 = padding sequence)
  int kv_len;  // context length after the append
};

struct Case {
  int hq = 8, hkv = 4, d = 128, dv = 128, page_size = 16;
  std::vector<SeqSpec> seqs;
  int pad_rows = 0;  // rows with token_seq -1, one before each sequence then the rest at the end
  int kv_len_bound = 0;  // max_kv_len passed to the kernel (0 = the batch's longest)
  float scale = 0.0f;
  bool odd_strides = false;  // K/V rows not 16-byte aligned: the append's scalar path
  uint64_t seed = 1;
};

std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16_bits(dist(rng));
  return v;
}

// Host image of one batch: the inputs, the expected cache after the append and the reference.
struct Batch {
  int rows = 0, max_pages_per_seq = 0, num_pages = 0;
  std::vector<int32_t> page_table, q_start, q_len, kv_len, token_seq, token_pos;
  std::vector<uint16_t> q, k_new, v_new;  // [rows, Hq*D], [rows, k_stride], [rows, v_stride]
  int64_t k_stride = 0, v_stride = 0;
  std::vector<uint16_t> cache_k, cache_v;        // before the append
  std::vector<uint16_t> expect_k, expect_v;      // after the append
  std::vector<std::vector<float>> seq_k, seq_v;  // per sequence: K [S, Hkv, D], V [S, Hkv, Dv]
};

Batch make_batch(const Case& c, std::mt19937_64& rng) {
  Batch b;
  const int n = static_cast<int>(c.seqs.size());
  int max_kv = 1;
  for (const auto& s : c.seqs) max_kv = std::max(max_kv, s.kv_len);
  b.max_pages_per_seq = (max_kv + c.page_size - 1) / c.page_size + 1;
  // Rows: [pad] seq0 [pad] seq1 ... then the remaining pads.
  int pads_left = c.pad_rows;
  for (int s = 0; s < n; ++s) {
    if (pads_left > 0) {
      b.token_seq.push_back(-1);
      b.token_pos.push_back(0);
      --pads_left;
    }
    b.q_start.push_back(static_cast<int32_t>(b.token_seq.size()));
    b.q_len.push_back(c.seqs[s].q_len);
    b.kv_len.push_back(c.seqs[s].kv_len);
    for (int t = 0; t < c.seqs[s].q_len; ++t) {
      b.token_seq.push_back(s);
      b.token_pos.push_back(c.seqs[s].kv_len - c.seqs[s].q_len + t);
    }
  }
  for (; pads_left > 0; --pads_left) {
    b.token_seq.push_back(-1);
    b.token_pos.push_back(0);
  }
  b.rows = static_cast<int>(b.token_seq.size());

  // Pages in shuffled order, plus a few never used (they keep the NaN sentinel).
  int pages_needed = 0;
  for (const auto& s : c.seqs) pages_needed += (s.kv_len + c.page_size - 1) / c.page_size;
  b.num_pages = pages_needed + 3;
  std::vector<int32_t> order(b.num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  b.page_table.assign(static_cast<size_t>(n) * b.max_pages_per_seq, -1);
  int next = 0;
  for (int s = 0; s < n; ++s)
    for (int i = 0; i < (c.seqs[s].kv_len + c.page_size - 1) / c.page_size; ++i)
      b.page_table[static_cast<size_t>(s) * b.max_pages_per_seq + i] = order[next++];

  const int64_t k_row = static_cast<int64_t>(c.hkv) * c.d,
                v_row = static_cast<int64_t>(c.hkv) * c.dv;
  b.k_stride = k_row + (c.odd_strides ? 3 : 8);  // strided rows, as slices of a fused projection
  b.v_stride = v_row + (c.odd_strides ? 5 : 16);
  b.q = random_bf16(static_cast<size_t>(b.rows) * c.hq * c.d, rng);
  b.k_new.assign(static_cast<size_t>(b.rows) * b.k_stride, 0);
  b.v_new.assign(static_cast<size_t>(b.rows) * b.v_stride, 0);
  const size_t slots = static_cast<size_t>(b.num_pages) * c.page_size;
  b.cache_k.assign(slots * k_row, kCacheSentinel);
  b.cache_v.assign(slots * v_row, kCacheSentinel);
  b.expect_k = b.cache_k;
  b.expect_v = b.cache_v;
  for (int s = 0; s < n; ++s) {
    const int S = c.seqs[s].kv_len, T = c.seqs[s].q_len;
    auto k_bits = random_bf16(static_cast<size_t>(S) * k_row, rng);
    auto v_bits = random_bf16(static_cast<size_t>(S) * v_row, rng);
    b.seq_k.emplace_back(k_bits.size());
    b.seq_v.emplace_back(v_bits.size());
    for (size_t i = 0; i < k_bits.size(); ++i) b.seq_k.back()[i] = bf16_bits_to_f32(k_bits[i]);
    for (size_t i = 0; i < v_bits.size(); ++i) b.seq_v.back()[i] = bf16_bits_to_f32(v_bits[i]);
    for (int pos = 0; pos < S; ++pos) {
      const int page =
          b.page_table[static_cast<size_t>(s) * b.max_pages_per_seq + pos / c.page_size];
      const size_t slot = static_cast<size_t>(page) * c.page_size + pos % c.page_size;
      std::copy_n(k_bits.begin() + pos * k_row, k_row, b.expect_k.begin() + slot * k_row);
      std::copy_n(v_bits.begin() + pos * v_row, v_row, b.expect_v.begin() + slot * v_row);
      if (pos < S - T) {  // cached context: already in the pages
        std::copy_n(k_bits.begin() + pos * k_row, k_row, b.cache_k.begin() + slot * k_row);
        std::copy_n(v_bits.begin() + pos * v_row, v_row, b.cache_v.begin() + slot * v_row);
      } else {  // this step's rows: appended by the kernel
        const int row = b.q_start[s] + pos - (S - T);
        std::copy_n(k_bits.begin() + pos * k_row, k_row, b.k_new.begin() + row * b.k_stride);
        std::copy_n(v_bits.begin() + pos * v_row, v_row, b.v_new.begin() + row * b.v_stride);
      }
    }
  }
  return b;
}

// Device copies of a batch plus the argument structs that point at them.
struct DeviceBatch {
  cuda::DeviceBuffer page_table, q_start, q_len, kv_len, token_seq, token_pos;
  cuda::DeviceBuffer q, k_new, v_new, cache_k, cache_v, out, workspace;
  ops::cuda::PagedKvAppendArgs append;
  ops::cuda::PagedAttentionArgs attend;
};

void make_device(const Case& c, const Batch& b, int max_q_len, int max_kv_len, DeviceBatch& dev) {
  dev.page_table = upload_vector(b.page_table);
  dev.q_start = upload_vector(b.q_start);
  dev.q_len = upload_vector(b.q_len);
  dev.kv_len = upload_vector(b.kv_len);
  dev.token_seq = upload_vector(b.token_seq);
  dev.token_pos = upload_vector(b.token_pos);
  dev.q = upload_vector(b.q);
  dev.k_new = upload_vector(b.k_new);
  dev.v_new = upload_vector(b.v_new);
  dev.cache_k = upload_vector(b.cache_k);
  dev.cache_v = upload_vector(b.cache_v);
  dev.out =
      upload_vector(std::vector<uint16_t>(static_cast<size_t>(b.rows) * c.hq * c.dv, kOutSentinel));
  const int max_seqs = static_cast<int>(c.seqs.size());
  dev.workspace = cuda::DeviceBuffer(std::max<size_t>(
      16, ops::cuda::paged_attention_workspace_bytes(b.rows, c.hq, c.dv, max_seqs)));

  ops::cuda::PagedKv cache;
  cache.k = dev.cache_k.as<__nv_bfloat16>();
  cache.v = dev.cache_v.as<__nv_bfloat16>();
  cache.page_size = c.page_size;
  cache.num_kv_heads = c.hkv;
  cache.head_dim = c.d;
  cache.v_head_dim = c.dv;
  ops::cuda::AttentionBatch batch;
  batch.page_table = dev.page_table.as<int32_t>();
  batch.max_pages_per_seq = b.max_pages_per_seq;
  batch.q_start = dev.q_start.as<int32_t>();
  batch.q_len = dev.q_len.as<int32_t>();
  batch.kv_len = dev.kv_len.as<int32_t>();
  batch.token_seq = dev.token_seq.as<int32_t>();
  batch.token_pos = dev.token_pos.as<int32_t>();
  batch.max_seqs = max_seqs;
  batch.max_tokens = b.rows;
  batch.max_q_len = max_q_len;
  batch.max_kv_len = max_kv_len;

  dev.append = {};
  dev.append.cache = cache;
  dev.append.batch = batch;
  dev.append.k = dev.k_new.as<__nv_bfloat16>();
  dev.append.k_stride = b.k_stride;
  dev.append.v = dev.v_new.as<__nv_bfloat16>();
  dev.append.v_stride = b.v_stride;
  dev.attend = {};
  dev.attend.cache = cache;
  dev.attend.batch = batch;
  dev.attend.q = dev.q.as<__nv_bfloat16>();
  dev.attend.q_stride = static_cast<int64_t>(c.hq) * c.d;
  dev.attend.num_q_heads = c.hq;
  dev.attend.scale = c.scale;
  dev.attend.out = dev.out.as<__nv_bfloat16>();
  dev.attend.workspace = dev.workspace.get();
}

int batch_max_q_len(const Case& c) {
  int m = 0;
  for (const auto& s : c.seqs) m = std::max(m, s.q_len);
  return m;
}
int batch_max_kv_len(const Case& c) {
  int m = 0;
  for (const auto& s : c.seqs) m = std::max(m, s.kv_len);
  return c.kv_len_bound > 0 ? c.kv_len_bound : m;
}

// Compares out (bf16 bits, [rows, Hq, Dv]) of the sequences' rows with attention_ref.
void check_output(const Case& c, const Batch& b, const std::vector<uint16_t>& out) {
  const int64_t out_row = static_cast<int64_t>(c.hq) * c.dv;
  std::vector<float> actual, expected;
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const int T = c.seqs[s].q_len, S = c.seqs[s].kv_len;
    if (T == 0) continue;
    std::vector<float> q(static_cast<size_t>(T) * c.hq * c.d);
    for (size_t i = 0; i < q.size(); ++i)
      q[i] = bf16_bits_to_f32(b.q[b.q_start[s] * c.hq * c.d + i]);
    ops::AttentionParams params;
    params.scale = c.scale;
    Tensor ref = ops::attention_ref(Tensor::from_f32(q, {T, c.hq, c.d}),
                                    Tensor::from_f32(b.seq_k[s], {S, c.hkv, c.d}),
                                    Tensor::from_f32(b.seq_v[s], {S, c.hkv, c.dv}), params);
    expected.insert(expected.end(), ref.data<float>(), ref.data<float>() + ref.numel());
    for (int64_t i = 0; i < T * out_row; ++i)
      actual.push_back(bf16_bits_to_f32(out[b.q_start[s] * out_row + i]));
  }
  const int64_t n = static_cast<int64_t>(expected.size()) / out_row;
  EXPECT_TRUE(test::close_bf16(Tensor::from_f32(actual, {n, c.hq, c.dv}),
                               Tensor::from_f32(expected, {n, c.hq, c.dv})));
}

// Compares the downloaded cache and out with the host image and attention_ref; padding rows of
// out must keep their sentinel unless padding_rows_written (FlashInfer's decode plan computes
// them).
void check_results(const Case& c, const Batch& b, const DeviceBatch& dev,
                   bool padding_rows_written = false) {
  const auto cache_k = download_vector<uint16_t>(dev.cache_k, b.expect_k.size());
  const auto cache_v = download_vector<uint16_t>(dev.cache_v, b.expect_v.size());
  for (size_t i = 0; i < cache_k.size(); ++i)
    ASSERT_EQ(cache_k[i], b.expect_k[i])
        << "K cache element " << i << " (slot " << i / (c.hkv * c.d) << ")";
  for (size_t i = 0; i < cache_v.size(); ++i)
    ASSERT_EQ(cache_v[i], b.expect_v[i])
        << "V cache element " << i << " (slot " << i / (c.hkv * c.dv) << ")";

  const auto out = download_vector<uint16_t>(dev.out, static_cast<size_t>(b.rows) * c.hq * c.dv);
  const int64_t out_row = static_cast<int64_t>(c.hq) * c.dv;
  for (int r = 0; r < b.rows && !padding_rows_written; ++r) {
    if (b.token_seq[r] >= 0) continue;
    for (int64_t i = 0; i < out_row; ++i)
      ASSERT_EQ(out[r * out_row + i], kOutSentinel)
          << "padding row " << r << " of out was written at " << i;
  }
  check_output(c, b, out);
}

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
  auto widen = [&](Batch& b) {
    std::vector<int32_t> table(first.seqs.size() * mpps, -1);
    for (size_t s = 0; s < first.seqs.size(); ++s)
      std::copy_n(b.page_table.begin() + s * b.max_pages_per_seq, b.max_pages_per_seq,
                  table.begin() + s * mpps);
    b.page_table = table;
    b.max_pages_per_seq = mpps;
    const size_t k_slot = static_cast<size_t>(first.hkv) * first.d,
                 v_slot = static_cast<size_t>(first.hkv) * first.dv;
    const size_t slots = static_cast<size_t>(pages) * first.page_size;
    b.cache_k.resize(slots * k_slot, kCacheSentinel);
    b.cache_v.resize(slots * v_slot, kCacheSentinel);
    b.expect_k.resize(slots * k_slot, kCacheSentinel);
    b.expect_v.resize(slots * v_slot, kCacheSentinel);
    b.num_pages = pages;
  };
  widen(b1);
  widen(b2);
  make_device(first, b1, 1, first.kv_len_bound, dev);

  cuda::Stream stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  ops::cuda::launch_paged_kv_append(dev.append, stream.get());
  ops::cuda::launch_paged_attention(dev.attend, stream.get());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.synchronize();
  check_results(first, b1, dev);

  // Same buffers, new contents.
  dev.page_table.upload(b2.page_table.data(), b2.page_table.size() * 4);
  dev.kv_len.upload(b2.kv_len.data(), b2.kv_len.size() * 4);
  dev.token_pos.upload(b2.token_pos.data(), b2.token_pos.size() * 4);
  dev.q.upload(b2.q.data(), b2.q.size() * 2);
  dev.k_new.upload(b2.k_new.data(), b2.k_new.size() * 2);
  dev.v_new.upload(b2.v_new.data(), b2.v_new.size() * 2);
  dev.cache_k.upload(b2.cache_k.data(), b2.cache_k.size() * 2);
  dev.cache_v.upload(b2.cache_v.data(), b2.cache_v.size() * 2);
  MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.synchronize();
  check_results(second, b2, dev);

  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
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

ops::cuda::FlashInferAttentionShape flashinfer_shape(const Case& c, const Batch& b) {
  ops::cuda::FlashInferAttentionShape s;
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
// c.seqs ({0, 0}, one each) and writes them, a general plan must leave them untouched.
void run_flashinfer_case(const Case& c, bool decode, int trailing_rows = 0) {
  std::mt19937_64 rng(test::test_seed(c.seed));
  Batch b = make_batch(c, rng);
  add_trailing_padding_rows(c, b, trailing_rows, rng);
  DeviceBatch dev;
  make_device(c, b, batch_max_q_len(c), batch_max_kv_len(c), dev);
  ops::cuda::FlashInferAttention attention(flashinfer_shape(c, b));
  cuda::Stream stream;
  attention.plan(host_batch(c, b), decode, stream.get());
  ops::cuda::launch_paged_kv_append(dev.append, stream.get());
  attention.launch(dev.attend, stream.get());
  stream.synchronize();
  check_results(c, b, dev, /*padding_rows_written=*/decode && trailing_rows > 0);
}

#define MOELORA_REQUIRE_FLASHINFER()                                       \
  do {                                                                     \
    MOELORA_REQUIRE_SM90();                                                \
    if (!ops::cuda::FlashInferAttention::compiled())                       \
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

// A graph captured after one decode plan, replayed after plans of other batches of the same
// bucket size: other lengths, fewer live sequences, other pages.
void check_graph_replay_across_plans(int hq, int hkv) {
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
  cuda::DeviceBuffer k(cache_elems * 2), v(cache_elems * 2),
      q(b1.q.size() * 2), out(static_cast<size_t>(b1.rows) * first.hq * first.dv * 2);
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
  ops::cuda::FlashInferAttention attention(flashinfer_shape(first, b1));
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
  std::string message = test::error_message(
      [&] { attention.plan(host_batch(c, b), /*decode=*/true, stream.get()); },
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
  message = test::error_message([&] { attention.launch(a, stream.get()); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("before plan"), std::string::npos) << message;
  // Capacities: sequences, rows, the page table, unassigned pages.
  ops::cuda::FlashInferHostBatch many = host_batch(c, b);
  many.seqs = 3;
  message = test::error_message([&] { attention.plan(many, /*decode=*/false, stream.get()); },
                                ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("batch.seqs = 3, expected 0 .. max_seqs = 2"), std::string::npos) << message;
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
  message = test::error_message([&] { ops::cuda::FlashInferAttention bad(s); },
                                ErrorCode::kUnsupported);
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
