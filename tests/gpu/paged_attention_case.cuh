// Paged-attention test cases shared by the attention kernel tests (attention_test.cu: moelora's
// kernels and FlashInfer's; gqa_decode_test.cu: the flat split-KV decode kernel): a batch of
// sequences with random bf16 queries and K/V in shuffled pages (unused slots hold a NaN sentinel,
// padding rows of out another), its device copy with the argument structs, and the checks of the
// appended cache and of out against ops::attention_ref.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "gpu/gpu_test_util.cuh"
#include "ops/attention/attention.h"
#include "ops/attention/attention_cuda.cuh"
#include "support/test_support.h"

namespace moelora::attention_case {

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

inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng) {
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

inline Batch make_batch(const Case& c, std::mt19937_64& rng) {
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

inline void make_device(const Case& c, const Batch& b, int max_q_len, int max_kv_len,
                        DeviceBatch& dev) {
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

inline int batch_max_q_len(const Case& c) {
  int m = 0;
  for (const auto& s : c.seqs) m = std::max(m, s.q_len);
  return m;
}
inline int batch_max_kv_len(const Case& c) {
  int m = 0;
  for (const auto& s : c.seqs) m = std::max(m, s.kv_len);
  return c.kv_len_bound > 0 ? c.kv_len_bound : m;
}

// Compares out (bf16 bits, [rows, Hq, Dv]) of the sequences' rows with attention_ref.
inline void check_output(const Case& c, const Batch& b, const std::vector<uint16_t>& out) {
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
inline void check_results(const Case& c, const Batch& b, const DeviceBatch& dev,
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

// Gives batch b a page table of `mpps` columns and a cache of `pages` pages (sentinel-filled), so
// that two batches of one case can share one set of device buffers (a graph replayed on new data).
inline void widen_batch(const Case& c, int mpps, int pages, Batch& b) {
  std::vector<int32_t> table(c.seqs.size() * mpps, -1);
  for (size_t s = 0; s < c.seqs.size(); ++s)
    std::copy_n(b.page_table.begin() + s * b.max_pages_per_seq, b.max_pages_per_seq,
                table.begin() + s * mpps);
  b.page_table = table;
  b.max_pages_per_seq = mpps;
  const size_t k_slot = static_cast<size_t>(c.hkv) * c.d,
               v_slot = static_cast<size_t>(c.hkv) * c.dv;
  const size_t slots = static_cast<size_t>(pages) * c.page_size;
  b.cache_k.resize(slots * k_slot, kCacheSentinel);
  b.cache_v.resize(slots * v_slot, kCacheSentinel);
  b.expect_k.resize(slots * k_slot, kCacheSentinel);
  b.expect_v.resize(slots * v_slot, kCacheSentinel);
  b.num_pages = pages;
}

// New contents for the device buffers of `dev` (made for a batch of the same shape, widened to
// b's page table and cache): what a graph captured on the old contents replays on.
inline void upload_contents(const Batch& b, DeviceBatch& dev) {
  dev.page_table.upload(b.page_table.data(), b.page_table.size() * 4);
  dev.kv_len.upload(b.kv_len.data(), b.kv_len.size() * 4);
  dev.token_pos.upload(b.token_pos.data(), b.token_pos.size() * 4);
  dev.q.upload(b.q.data(), b.q.size() * 2);
  dev.k_new.upload(b.k_new.data(), b.k_new.size() * 2);
  dev.v_new.upload(b.v_new.data(), b.v_new.size() * 2);
  dev.cache_k.upload(b.cache_k.data(), b.cache_k.size() * 2);
  dev.cache_v.upload(b.cache_v.data(), b.cache_v.size() * 2);
}

}  // namespace moelora::attention_case
