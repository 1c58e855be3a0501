// Sm90 MLA in absorbed form (ops/mla/mla_cuda.cuh) against the CPU references of ops/mla/mla.h on
// random bf16-representable inputs: the paged latent-cache append (bit exact, untouched rows stay
// NaN), query absorption and output projection (cuBLAS over heads), the latent attention for
// decode, prefill, chunked prefill over cached context and mixed batches with padding sequences,
// padding rows and gaps (page sizes 16 / 64, shuffled page tables, split and unsplit KV, a
// CUDA-graph replay), the whole pipeline, and the factored kv_b LoRA (base tokens, two adapters
// of different ranks, a rank-0 slot, tokens past the device token count). Tiny shapes (n 4, nope
// 16, rope 8, dv 16, r 32) and Kimi-K2.5 shapes (n 64, 128 / 64 / 128, r 512, 2048-token context).
//
// Unused cache rows, padding query rows and stride gaps hold NaN or junk, so a kernel that reads
// outside what it owns produces NaN or a mismatch instead of passing by luck.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "gpu/gpu_test_util.cuh"
#include "ops/mla/mla.h"
#include "ops/mla/mla_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

constexpr uint16_t kNanBits = 0x7fc0;       // bf16 quiet NaN
constexpr uint16_t kSentinelBits = 0x4049;  // bf16 3.140625: "never written"

struct Dims {
  int heads, nope, rope, dv, rank;
  int dim() const { return rank + rope; }
};
constexpr Dims kTiny{4, 16, 8, 16, 32};
constexpr Dims kKimi{64, 128, 64, 128, 512};

ops::cuda::MlaShape gpu_shape(const Dims& d) {
  ops::cuda::MlaShape s;
  s.num_heads = d.heads;
  s.nope = d.nope;
  s.rope = d.rope;
  s.v_dim = d.dv;
  s.rank = d.rank;
  return s;
}

ops::MlaDims ref_dims(const Dims& d) {
  ops::MlaDims r;
  r.num_heads = d.heads;
  r.qk_nope_head_dim = d.nope;
  r.qk_rope_head_dim = d.rope;
  r.v_head_dim = d.dv;
  r.kv_lora_rank = d.rank;
  return r;
}

// Random normal values already rounded to bf16 (what the GPU sees is exactly what the CPU sees).
Tensor random_bf16(const Shape& shape, std::mt19937_64& rng, float stddev) {
  return test::random_normal(shape, rng, stddev).to(DType::kBF16).to_f32();
}

std::vector<uint16_t> to_bits(const Tensor& t) {
  std::vector<uint16_t> bits(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) bits[i] = f32_to_bf16_bits(t.item_f32(i));
  return bits;
}

Tensor from_bits(const std::vector<uint16_t>& bits, size_t offset, const Shape& shape) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = bf16_bits_to_f32(bits[offset + i]);
  return t;
}

// ---- batch layout ----

struct SeqSpec {
  int context;  // positions already cached
  int q_len;    // new tokens this step (0 = padding sequence)
  int kv_len() const { return context + q_len; }
};

struct HostBatch {
  std::vector<SeqSpec> seqs;
  int page_size = 0;
  int max_pages_per_seq = 0;
  int num_pages = 0;
  std::vector<int32_t> page_table, q_start, q_len, kv_len, token_seq, token_pos;
  int max_tokens = 0, max_q_len = 0, max_kv_len = 0;
};

// Tokens of consecutive sequences, optionally one padding row after each, `trailing` padding rows
// at the end; pages handed out in a shuffled order, unused page table entries -1.
HostBatch make_batch(const std::vector<SeqSpec>& seqs, int page_size, bool gaps, int trailing,
                     std::mt19937_64& rng) {
  HostBatch b;
  b.seqs = seqs;
  b.page_size = page_size;
  int total_pages = 0;
  for (const SeqSpec& s : seqs) {
    const int pages = (s.kv_len() + page_size - 1) / page_size;
    b.max_pages_per_seq = std::max(b.max_pages_per_seq, pages + 1);
    total_pages += pages;
  }
  b.num_pages = total_pages + 3;  // spare pages stay NaN
  std::vector<int32_t> ids(b.num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  b.page_table.assign(static_cast<size_t>(seqs.size()) * b.max_pages_per_seq, -1);
  int next = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int pages = (seqs[i].kv_len() + page_size - 1) / page_size;
    for (int p = 0; p < pages; ++p) b.page_table[i * b.max_pages_per_seq + p] = ids[next++];
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    b.q_start.push_back(static_cast<int32_t>(b.token_seq.size()));
    b.q_len.push_back(seqs[i].q_len);
    b.kv_len.push_back(seqs[i].kv_len());
    for (int t = 0; t < seqs[i].q_len; ++t) {
      b.token_seq.push_back(static_cast<int32_t>(i));
      b.token_pos.push_back(seqs[i].context + t);
    }
    if (gaps) {
      b.token_seq.push_back(-1);
      b.token_pos.push_back(0);
    }
    b.max_q_len = std::max(b.max_q_len, seqs[i].q_len);
    b.max_kv_len = std::max(b.max_kv_len, seqs[i].kv_len());
  }
  for (int i = 0; i < trailing; ++i) {
    b.token_seq.push_back(-1);
    b.token_pos.push_back(0);
  }
  b.max_tokens = static_cast<int>(b.token_seq.size());
  b.max_kv_len += 7;  // a host bound, not the exact maximum
  return b;
}

struct DeviceBatch {
  cuda::DeviceBuffer page_table, q_start, q_len, kv_len, token_seq, token_pos;
  ops::cuda::AttentionBatch view;
  explicit DeviceBatch(const HostBatch& b)
      : page_table(upload_vector(b.page_table)),
        q_start(upload_vector(b.q_start)),
        q_len(upload_vector(b.q_len)),
        kv_len(upload_vector(b.kv_len)),
        token_seq(upload_vector(b.token_seq)),
        token_pos(upload_vector(b.token_pos)) {
    view.page_table = page_table.as<int32_t>();
    view.max_pages_per_seq = b.max_pages_per_seq;
    view.q_start = q_start.as<int32_t>();
    view.q_len = q_len.as<int32_t>();
    view.kv_len = kv_len.as<int32_t>();
    view.token_seq = token_seq.as<int32_t>();
    view.token_pos = token_pos.as<int32_t>();
    view.max_seqs = static_cast<int>(b.seqs.size());
    view.max_tokens = b.max_tokens;
    view.max_q_len = b.max_q_len;
    view.max_kv_len = b.max_kv_len;
  }
};

// Latents of every sequence (c_kv [kv_len, r], k_rope [kv_len, rope]) and the paged cache holding
// the context rows; the new rows come through launch_mla_cache_append, which is checked
// bit-exactly.
struct CacheFixture {
  std::vector<Tensor> c_kv, k_rope;
  cuda::DeviceBuffer cache;
};

CacheFixture fill_cache(const Dims& d, const HostBatch& b, const DeviceBatch& db,
                        std::mt19937_64& rng) {
  CacheFixture f;
  const int dim = d.dim();
  std::vector<uint16_t> host(static_cast<size_t>(b.num_pages) * b.page_size * dim, kNanBits);
  std::vector<uint16_t> expected = host;
  const int row_stride = dim + 8;  // kv_a_proj-like fused rows with a junk gap
  std::vector<uint16_t> rows(static_cast<size_t>(b.max_tokens) * row_stride, kNanBits);
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    const SeqSpec& s = b.seqs[i];
    f.c_kv.push_back(random_bf16({s.kv_len(), d.rank}, rng, 1.0f));
    f.k_rope.push_back(random_bf16({s.kv_len(), d.rope}, rng, 1.0f));
    const std::vector<uint16_t> ckv = to_bits(f.c_kv.back()), kr = to_bits(f.k_rope.back());
    for (int pos = 0; pos < s.kv_len(); ++pos) {
      const int page = b.page_table[i * b.max_pages_per_seq + pos / b.page_size];
      const size_t at = (static_cast<size_t>(page) * b.page_size + pos % b.page_size) * dim;
      for (int c = 0; c < d.rank; ++c)
        expected[at + c] = ckv[static_cast<size_t>(pos) * d.rank + c];
      for (int c = 0; c < d.rope; ++c)
        expected[at + d.rank + c] = kr[static_cast<size_t>(pos) * d.rope + c];
      if (pos < s.context) {
        std::copy_n(expected.begin() + at, dim, host.begin() + at);
      } else {
        const size_t row = static_cast<size_t>(b.q_start[i] + pos - s.context) * row_stride;
        std::copy_n(expected.begin() + at, dim, rows.begin() + row);
      }
    }
  }
  f.cache = upload_vector(host);
  cuda::DeviceBuffer rows_d = upload_vector(rows);
  ops::cuda::MlaAppendArgs a;
  a.cache.kv = f.cache.as<__nv_bfloat16>();
  a.cache.page_size = b.page_size;
  a.shape = gpu_shape(d);
  a.batch = db.view;
  a.c_kv = rows_d.as<__nv_bfloat16>();
  a.c_kv_stride = row_stride;
  a.k_rope = rows_d.as<__nv_bfloat16>() + d.rank;
  a.k_rope_stride = row_stride;
  ops::cuda::launch_mla_cache_append(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = download_vector<uint16_t>(f.cache, host.size());
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != expected[i] && mismatches++ == 0) first = i;
  EXPECT_EQ(mismatches, 0u) << "latent cache after append: first mismatch at element " << first
                            << " (page " << first / (static_cast<size_t>(b.page_size) * dim)
                            << "): got 0x" << std::hex << got[first] << ", expected 0x"
                            << expected[first];
  return f;
}

// Reference o_lat of sequence i: q_full rows [q_len, n, dim] split into q_lat and the rope part.
Tensor reference_o_lat(const Dims& d, const Tensor& q_full_seq, const CacheFixture& f, size_t i,
                       float scale) {
  const int64_t q_len = q_full_seq.dim(0);
  Tensor q_lat = Tensor::empty(DType::kF32, {q_len, d.heads, d.rank});
  Tensor q = Tensor::zeros(DType::kF32, {q_len, d.heads, d.nope + d.rope});
  for (int64_t row = 0; row < q_len * d.heads; ++row) {
    const float* src = q_full_seq.data<float>() + row * d.dim();
    std::copy_n(src, d.rank, q_lat.data<float>() + row * d.rank);
    std::copy_n(src + d.rank, d.rope, q.data<float>() + row * (d.nope + d.rope) + d.nope);
  }
  ops::MlaAttentionParams params;
  params.dims = ref_dims(d);
  params.softmax_scale = scale;
  return ops::mla_latent_attention_ref(q_lat, q, f.c_kv[i], f.k_rope[i], params);
}

size_t attention_workspace(const Dims& d, const HostBatch& b) {
  return std::max<size_t>(256, ops::cuda::mla_attention_workspace_bytes(
                                   gpu_shape(d), b.max_tokens, static_cast<int>(b.seqs.size())));
}

// Appends, attends over the latent cache, compares o_lat with mla_latent_attention_ref per
// sequence; padding rows of o_lat must keep their sentinel.
// With `graph`, the launch is captured into a CUDA graph and replayed (launchers must neither
// allocate nor synchronize, and the split count must not read device values).
void check_attention(const Dims& d, const std::vector<SeqSpec>& seqs, int page_size, bool gaps,
                     int trailing, float scale, uint64_t seed, bool graph = false) {
  std::mt19937_64 rng(test::test_seed(seed));
  const HostBatch b = make_batch(seqs, page_size, gaps, trailing, rng);
  const DeviceBatch db(b);
  const CacheFixture f = fill_cache(d, b, db, rng);
  if (::testing::Test::HasFailure()) return;

  const int64_t row_elems = static_cast<int64_t>(d.heads) * d.dim();
  Tensor q_full = random_bf16({b.max_tokens, d.heads, d.dim()}, rng, 1.5f);
  std::vector<uint16_t> q_bits = to_bits(q_full);
  for (int t = 0; t < b.max_tokens; ++t)
    if (b.token_seq[t] < 0) std::fill_n(q_bits.begin() + t * row_elems, row_elems, kNanBits);
  cuda::DeviceBuffer q_d = upload_vector(q_bits);
  const size_t out_elems = static_cast<size_t>(b.max_tokens) * d.heads * d.rank;
  cuda::DeviceBuffer o_d = upload_vector(std::vector<uint16_t>(out_elems, kSentinelBits));
  cuda::DeviceBuffer ws(attention_workspace(d, b));

  ops::cuda::MlaAttentionArgs a;
  a.cache.kv = f.cache.as<__nv_bfloat16>();
  a.cache.page_size = page_size;
  a.shape = gpu_shape(d);
  a.batch = db.view;
  a.q_full = q_d.as<__nv_bfloat16>();
  a.scale = scale;
  a.o_lat = o_d.as<__nv_bfloat16>();
  a.workspace = ws.get();
  if (graph) {
    cuda::Stream stream;
    cudaGraph_t captured = nullptr;
    cudaGraphExec_t exec = nullptr;
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
    ops::cuda::launch_mla_attention(a, stream.get());
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &captured));
    MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec, captured, 0));
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));  // a replay gives the same result
    stream.synchronize();
    MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOELORA_CUDA_CHECK(cudaGraphDestroy(captured));
  } else {
    ops::cuda::launch_mla_attention(a, nullptr);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const std::vector<uint16_t> got = download_vector<uint16_t>(o_d, out_elems);

  const int64_t out_row = static_cast<int64_t>(d.heads) * d.rank;
  for (int t = 0; t < b.max_tokens; ++t) {
    if (b.token_seq[t] >= 0) continue;
    for (int64_t c = 0; c < out_row; ++c)
      ASSERT_EQ(got[t * out_row + c], kSentinelBits)
          << "padding row " << t << " of o_lat was written";
  }
  int total_rows = 0;
  for (const SeqSpec& s : seqs) total_rows += s.q_len;
  Tensor actual = Tensor::empty(DType::kF32, {total_rows, d.heads, d.rank});
  Tensor expected = Tensor::empty(DType::kF32, {total_rows, d.heads, d.rank});
  int at = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i].q_len == 0) continue;
    const Tensor q_seq = q_full.slice0(b.q_start[i], b.q_start[i] + seqs[i].q_len);
    const Tensor ref = reference_o_lat(d, q_seq.clone(), f, i, scale);
    std::copy_n(ref.data<float>(), ref.numel(), expected.data<float>() + at * out_row);
    const Tensor mine = from_bits(got, static_cast<size_t>(b.q_start[i]) * out_row,
                                  {seqs[i].q_len, d.heads, d.rank});
    std::copy_n(mine.data<float>(), mine.numel(), actual.data<float>() + at * out_row);
    at += seqs[i].q_len;
  }
  EXPECT_TRUE(test::close_bf16(actual, expected))
      << "o_lat of " << seqs.size() << " sequences, page size " << page_size << ", max_tokens "
      << b.max_tokens;
}

TEST(Sm90_Mla, DecodeTinyPage16) {
  MOELORA_REQUIRE_SM90();
  // Split KV (few rows), a one-token context, a padding sequence, padding rows at the end.
  check_attention(kTiny, {{0, 1}, {16, 1}, {299, 1}, {40, 1}, {0, 0}, {127, 1}}, 16, false, 2, 0.f,
                  101);
}

TEST(Sm90_Mla, DecodeTinyGraphReplay) {
  MOELORA_REQUIRE_SM90();
  check_attention(kTiny, {{90, 1}, {0, 0}, {257, 1}}, 16, true, 1, 0.f, 108, /*graph=*/true);
}

TEST(Sm90_Mla, PrefillTinyPage64SingleSplit) {
  MOELORA_REQUIRE_SM90();
  // More than 256 token rows: one KV split, causal mask across many 32-row groups.
  check_attention(kTiny, {{0, 150}, {0, 121}}, 64, true, 0, 0.31f, 102);
}

TEST(Sm90_Mla, ChunkedPrefillWithContextTinyPage16) {
  MOELORA_REQUIRE_SM90();
  // Prefill chunks over cached context with split KV: some rows see nothing in late splits.
  check_attention(kTiny, {{100, 37}, {0, 20}, {333, 3}}, 16, false, 1, 0.f, 103);
}

TEST(Sm90_Mla, MixedBatchWithPaddingTinyPage64) {
  MOELORA_REQUIRE_SM90();
  check_attention(kTiny, {{50, 1}, {0, 0}, {200, 17}, {0, 5}, {77, 1}, {0, 0}}, 64, true, 3, 0.25f,
                  104);
}

TEST(Sm90_Mla, DecodeKimi2048ContextPage64) {
  MOELORA_REQUIRE_SM90();
  // 2048-token context; the one-token sequence leaves most of its 32 splits empty.
  check_attention(kKimi, {{2047, 1}, {699, 1}, {0, 1}, {0, 0}}, 64, false, 1, 0.f, 105);
}

TEST(Sm90_Mla, MixedKimiPage16) {
  MOELORA_REQUIRE_SM90();
  check_attention(kKimi, {{1000, 24}, {2047, 1}, {0, 0}, {5, 1}}, 16, true, 2, 0.f, 106);
}

TEST(Sm90_Mla, PrefillKimiSingleSplitPage64) {
  MOELORA_REQUIRE_SM90();
  check_attention(kKimi, {{0, 200}, {300, 60}}, 64, false, 0, 0.f, 107);
}

// ---- absorb / project ----

void check_absorb_project(const Dims& d, int tokens, uint64_t seed) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(seed));
  const int qk = d.nope + d.rope;
  const int q_stride = d.heads * qk + 24;  // q as a slice of a wider projection output
  Tensor q_wide = random_bf16({tokens, q_stride}, rng, 1.0f);
  Tensor q = Tensor::empty(DType::kF32, {tokens, d.heads, qk});
  for (int t = 0; t < tokens; ++t)
    std::copy_n(q_wide.data<float>() + static_cast<int64_t>(t) * q_stride, d.heads * qk,
                q.data<float>() + static_cast<int64_t>(t) * d.heads * qk);
  const float sigma =
      std::sqrt(static_cast<float>(d.dim()) / (static_cast<float>(d.nope) * d.rank));
  Tensor kv_b = random_bf16({d.heads * (d.nope + d.dv), d.rank}, rng, sigma);
  Tensor o_lat = random_bf16({tokens, d.heads, d.rank}, rng, 0.5f);

  cuda::DeviceBuffer q_d = upload_vector(to_bits(q_wide)), kv_b_d = upload_vector(to_bits(kv_b));
  cuda::DeviceBuffer o_lat_d = upload_vector(to_bits(o_lat));
  cuda::DeviceBuffer q_full_d(static_cast<size_t>(tokens) * d.heads * d.dim() * 2);
  cuda::DeviceBuffer out_d(static_cast<size_t>(tokens) * d.heads * d.dv * 2);
  cuda::CublasHandle handle;
  cuda::Stream stream;
  ops::cuda::MlaAbsorbArgs aa;
  aa.shape = gpu_shape(d);
  aa.q = q_d.as<__nv_bfloat16>();
  aa.q_stride = q_stride;
  aa.kv_b = kv_b_d.as<__nv_bfloat16>();
  aa.q_full = q_full_d.as<__nv_bfloat16>();
  aa.tokens = tokens;
  ops::cuda::launch_mla_absorb_query(static_cast<cublasHandle_t>(handle.get()), aa, stream.get());
  ops::cuda::MlaProjectArgs pa;
  pa.shape = gpu_shape(d);
  pa.o_lat = o_lat_d.as<__nv_bfloat16>();
  pa.kv_b = kv_b_d.as<__nv_bfloat16>();
  pa.out = out_d.as<__nv_bfloat16>();
  pa.tokens = tokens;
  ops::cuda::launch_mla_project_output(static_cast<cublasHandle_t>(handle.get()), pa, stream.get());
  stream.synchronize();

  const std::vector<uint16_t> q_full_bits =
      download_vector<uint16_t>(q_full_d, static_cast<size_t>(tokens) * d.heads * d.dim());
  const Tensor q_lat_ref = ops::mla_absorb_query_ref(q, kv_b, ref_dims(d));
  Tensor q_lat = Tensor::empty(DType::kF32, {tokens, d.heads, d.rank});
  for (int64_t row = 0; row < static_cast<int64_t>(tokens) * d.heads; ++row) {
    for (int c = 0; c < d.rank; ++c)
      q_lat.data<float>()[row * d.rank + c] = bf16_bits_to_f32(q_full_bits[row * d.dim() + c]);
    for (int c = 0; c < d.rope; ++c)  // the rope tail is a copy
      ASSERT_EQ(bf16_bits_to_f32(q_full_bits[row * d.dim() + d.rank + c]),
                q.data<float>()[row * qk + d.nope + c])
          << "q_full rope tail, row " << row << " column " << c;
  }
  EXPECT_TRUE(test::close_bf16(q_lat, q_lat_ref)) << "absorbed query";
  const Tensor out_ref = ops::mla_project_output_ref(o_lat, kv_b, ref_dims(d));
  const Tensor out =
      from_bits(download_vector<uint16_t>(out_d, static_cast<size_t>(tokens) * d.heads * d.dv), 0,
                {tokens, d.heads, d.dv});
  EXPECT_TRUE(test::close_bf16(out, out_ref)) << "projected output";
}

TEST(Sm90_Mla, AbsorbAndProjectTiny) {
  check_absorb_project(kTiny, 7, 201);
}
TEST(Sm90_Mla, AbsorbAndProjectKimi) {
  check_absorb_project(kKimi, 37, 202);
}

// ---- whole pipeline: append, absorb, attend, project vs mla_attention_absorbed_ref ----

void check_pipeline(const Dims& d, const std::vector<SeqSpec>& seqs, int page_size, uint64_t seed) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(seed));
  const HostBatch b = make_batch(seqs, page_size, true, 1, rng);
  const DeviceBatch db(b);
  const CacheFixture f = fill_cache(d, b, db, rng);
  if (::testing::Test::HasFailure()) return;
  const int qk = d.nope + d.rope, T = b.max_tokens;
  Tensor q = random_bf16({T, d.heads, qk}, rng, 1.0f);
  const float sigma =
      std::sqrt(static_cast<float>(d.dim()) / (static_cast<float>(d.nope) * d.rank));
  Tensor kv_b = random_bf16({d.heads * (d.nope + d.dv), d.rank}, rng, sigma);
  cuda::DeviceBuffer q_d = upload_vector(to_bits(q)), kv_b_d = upload_vector(to_bits(kv_b));
  cuda::DeviceBuffer q_full_d(static_cast<size_t>(T) * d.heads * d.dim() * 2);
  cuda::DeviceBuffer o_lat_d(static_cast<size_t>(T) * d.heads * d.rank * 2);
  cuda::DeviceBuffer out_d(static_cast<size_t>(T) * d.heads * d.dv * 2);
  cuda::DeviceBuffer ws(attention_workspace(d, b));
  cuda::CublasHandle handle;
  cuda::Stream stream;
  const auto h = static_cast<cublasHandle_t>(handle.get());

  ops::cuda::MlaAbsorbArgs aa;
  aa.shape = gpu_shape(d);
  aa.q = q_d.as<__nv_bfloat16>();
  aa.q_stride = static_cast<int64_t>(d.heads) * qk;
  aa.kv_b = kv_b_d.as<__nv_bfloat16>();
  aa.q_full = q_full_d.as<__nv_bfloat16>();
  aa.tokens = T;
  ops::cuda::launch_mla_absorb_query(h, aa, stream.get());
  ops::cuda::MlaAttentionArgs at;
  at.cache.kv = f.cache.as<__nv_bfloat16>();
  at.cache.page_size = page_size;
  at.shape = gpu_shape(d);
  at.batch = db.view;
  at.q_full = q_full_d.as<__nv_bfloat16>();
  at.o_lat = o_lat_d.as<__nv_bfloat16>();
  at.workspace = ws.get();
  ops::cuda::launch_mla_attention(at, stream.get());
  ops::cuda::MlaProjectArgs pa;
  pa.shape = gpu_shape(d);
  pa.o_lat = o_lat_d.as<__nv_bfloat16>();
  pa.kv_b = kv_b_d.as<__nv_bfloat16>();
  pa.out = out_d.as<__nv_bfloat16>();
  pa.tokens = T;
  ops::cuda::launch_mla_project_output(h, pa, stream.get());
  stream.synchronize();
  const std::vector<uint16_t> got =
      download_vector<uint16_t>(out_d, static_cast<size_t>(T) * d.heads * d.dv);

  ops::MlaAttentionParams params;
  params.dims = ref_dims(d);
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i].q_len == 0) continue;
    const Tensor q_seq = q.slice0(b.q_start[i], b.q_start[i] + seqs[i].q_len).clone();
    const Tensor ref = ops::mla_attention_absorbed_ref(q_seq, f.c_kv[i], f.k_rope[i], kv_b, params);
    const Tensor mine = from_bits(got, static_cast<size_t>(b.q_start[i]) * d.heads * d.dv,
                                  {seqs[i].q_len, d.heads, d.dv});
    EXPECT_TRUE(test::close_bf16(mine, ref)) << "sequence " << i << " (context " << seqs[i].context
                                             << ", q_len " << seqs[i].q_len << ")";
  }
}

TEST(Sm90_Mla, PipelineTinyMixed) {
  check_pipeline(kTiny, {{33, 9}, {0, 0}, {64, 1}, {0, 13}}, 16, 301);
}
TEST(Sm90_Mla, PipelineKimiDecode2048) {
  check_pipeline(kKimi, {{2047, 1}, {311, 1}, {0, 0}, {1500, 3}}, 64, 302);
}

// ---- factored kv_b LoRA ----

// s * B[:, :rank] A[:rank, :] [n (nope + dv), r]: the kv_b delta folded into a weight, so that
// mla_absorb_query_ref / mla_project_output_ref on it give the factored LoRA's contribution.
Tensor folded_delta(const Tensor& a, const Tensor& b, int rank, float scaling) {
  const int64_t R = a.dim(0), in = a.dim(1), out = b.dim(0);
  Tensor w = Tensor::empty(DType::kF32, {out, in});
  for (int64_t o = 0; o < out; ++o)
    for (int64_t c = 0; c < in; ++c) {
      double acc = 0.0;
      for (int j = 0; j < rank; ++j)
        acc += static_cast<double>(b.data<float>()[o * R + j]) * a.data<float>()[j * in + c];
      w.data<float>()[o * in + c] = static_cast<float>(scaling * acc);
    }
  return w;
}

void check_kvb_lora(const Dims& d, uint64_t seed) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(seed));
  const int T = 9, num_valid = 8, R = 16, S = 4, qk = d.nope + d.rope,
            out_features = d.heads * (d.nope + d.dv);
  const std::vector<int32_t> slot = {-1, 0, 1, 2, 0, -1, 1, 3, 0};  // token 8 is past num_tokens
  const std::vector<int32_t> ranks = {16, 6, 0, 8};                 // slot 2: not targeted
  const std::vector<float> scaling = {0.5f, 2.0f, 1.0f, 0.75f};
  const float sigma = 1.0f / std::sqrt(std::sqrt(static_cast<float>(d.nope) * R));
  // Pool factors; entries past a slot's rank are junk the kernels must not read.
  std::vector<Tensor> a(S), b(S);
  std::vector<uint16_t> a_bits, b_bits;
  for (int s = 0; s < S; ++s) {
    a[s] = random_bf16({R, d.rank}, rng, sigma);
    b[s] = random_bf16({out_features, R}, rng, sigma);
    std::vector<uint16_t> ab = to_bits(a[s]), bb = to_bits(b[s]);
    for (int j = ranks[s]; j < R; ++j)
      std::fill_n(ab.begin() + j * d.rank, d.rank, f32_to_bf16_bits(1000.f));
    for (int o = 0; o < out_features; ++o)
      for (int j = ranks[s]; j < R; ++j) bb[static_cast<size_t>(o) * R + j] = kNanBits;
    a_bits.insert(a_bits.end(), ab.begin(), ab.end());
    b_bits.insert(b_bits.end(), bb.begin(), bb.end());
  }
  const int q_stride = d.heads * qk + 8;
  Tensor q_wide = random_bf16({T, q_stride}, rng, 1.0f);
  Tensor q_full_in = random_bf16({T, d.heads, d.dim()}, rng, 1.0f);
  Tensor o_lat = random_bf16({T, d.heads, d.rank}, rng, 1.0f);
  Tensor out_in = random_bf16({T, d.heads * d.dv}, rng, 1.0f);

  cuda::DeviceBuffer a_d = upload_vector(a_bits), b_d = upload_vector(b_bits);
  cuda::DeviceBuffer scaling_d = upload_vector(scaling), rank_d = upload_vector(ranks),
                     slot_d = upload_vector(slot);
  cuda::DeviceBuffer count_d = upload_vector(std::vector<int32_t>{num_valid});
  cuda::DeviceBuffer q_d = upload_vector(to_bits(q_wide)),
                     q_full_d = upload_vector(to_bits(q_full_in));
  cuda::DeviceBuffer o_lat_d = upload_vector(to_bits(o_lat)),
                     out_d = upload_vector(to_bits(out_in));
  ops::cuda::MlaKvbLoraArgs p;
  p.shape = gpu_shape(d);
  p.pool.a = a_d.as<__nv_bfloat16>();
  p.pool.b = b_d.as<__nv_bfloat16>();
  p.pool.scaling = scaling_d.as<float>();
  p.pool.rank = rank_d.as<int32_t>();
  p.pool.num_slots = S;
  p.pool.max_rank = R;
  p.pool.in_features = d.rank;
  p.pool.out_features = out_features;
  p.token_slot = slot_d.as<int32_t>();
  p.tokens = T;
  p.num_tokens = count_d.as<int32_t>();
  p.q = q_d.as<__nv_bfloat16>();
  p.q_stride = q_stride;
  p.q_full = q_full_d.as<__nv_bfloat16>();
  p.o_lat = o_lat_d.as<__nv_bfloat16>();
  p.out = out_d.as<__nv_bfloat16>();
  ops::cuda::launch_mla_kvb_lora_query(p, nullptr);
  ops::cuda::launch_mla_kvb_lora_output(p, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> q_full_got =
      download_vector<uint16_t>(q_full_d, static_cast<size_t>(q_full_in.numel()));
  const std::vector<uint16_t> out_got =
      download_vector<uint16_t>(out_d, static_cast<size_t>(out_in.numel()));
  const std::vector<uint16_t> q_full_in_bits = to_bits(q_full_in), out_in_bits = to_bits(out_in);

  const int64_t q_row = static_cast<int64_t>(d.heads) * d.dim(),
                out_row = static_cast<int64_t>(d.heads) * d.dv;
  int adapted = 0;
  for (int t = 0; t < T; ++t) {
    const bool touched = t < num_valid && slot[t] >= 0 && ranks[slot[t]] > 0;
    if (!touched) {
      for (int64_t c = 0; c < q_row; ++c)
        ASSERT_EQ(q_full_got[t * q_row + c], q_full_in_bits[t * q_row + c])
            << "base token " << t << " q_full changed";
      for (int64_t c = 0; c < out_row; ++c)
        ASSERT_EQ(out_got[t * out_row + c], out_in_bits[t * out_row + c])
            << "base token " << t << " out changed";
      continue;
    }
    ++adapted;
    const int s = slot[t];
    const Tensor delta_w = folded_delta(a[s], b[s], ranks[s], scaling[s]);
    Tensor q_t = Tensor::empty(DType::kF32, {1, d.heads, qk});
    std::copy_n(q_wide.data<float>() + static_cast<int64_t>(t) * q_stride, d.heads * qk,
                q_t.data<float>());
    const Tensor dq = ops::mla_absorb_query_ref(q_t, delta_w, ref_dims(d));  // [1, n, r]
    Tensor q_expected = Tensor::empty(DType::kF32, {d.heads, d.rank});
    Tensor q_actual = Tensor::empty(DType::kF32, {d.heads, d.rank});
    for (int h = 0; h < d.heads; ++h) {
      for (int c = 0; c < d.rank; ++c) {
        const int64_t at = t * q_row + static_cast<int64_t>(h) * d.dim() + c;
        q_expected.data<float>()[h * d.rank + c] =
            q_full_in.data<float>()[at] + dq.data<float>()[h * d.rank + c];
        q_actual.data<float>()[h * d.rank + c] = bf16_bits_to_f32(q_full_got[at]);
      }
      for (int c = d.rank; c < d.dim(); ++c) {
        const int64_t at = t * q_row + static_cast<int64_t>(h) * d.dim() + c;
        ASSERT_EQ(q_full_got[at], q_full_in_bits[at])
            << "token " << t << " head " << h << ": rope tail changed";
      }
    }
    EXPECT_TRUE(test::close_bf16(q_actual, q_expected))
        << "query LoRA, token " << t << " slot " << s;
    const Tensor o_t = o_lat.slice0(t, t + 1).clone();
    const Tensor dout = ops::mla_project_output_ref(o_t, delta_w, ref_dims(d));  // [1, n, dv]
    Tensor out_expected = Tensor::empty(DType::kF32, {out_row});
    for (int64_t c = 0; c < out_row; ++c)
      out_expected.data<float>()[c] = out_in.data<float>()[t * out_row + c] + dout.data<float>()[c];
    const Tensor out_actual = from_bits(out_got, static_cast<size_t>(t) * out_row, {out_row});
    EXPECT_TRUE(test::close_bf16(out_actual, out_expected))
        << "output LoRA, token " << t << " slot " << s;
  }
  EXPECT_EQ(adapted, 5);
}

TEST(Sm90_Mla, KvbLoraTiny) {
  check_kvb_lora(kTiny, 401);
}
TEST(Sm90_Mla, KvbLoraKimi) {
  check_kvb_lora(kKimi, 402);
}

// Shape checks run before any launch, so they need no device.
TEST(Sm90_Mla, RejectsUnsupportedShapes) {
  Dims bad = kTiny;
  bad.rank = 36;  // not a multiple of 8
  EXPECT_THROW(ops::cuda::mla_attention_workspace_bytes(gpu_shape(bad), 4, 1), Error);
  ops::cuda::MlaAttentionArgs a;
  a.shape = gpu_shape(kTiny);
  a.shape.rope = 4;  // cache rows of 36 values are not 16-byte multiples
  EXPECT_THROW(ops::cuda::launch_mla_attention(a, nullptr), Error);
}

}  // namespace
}  // namespace moelora
