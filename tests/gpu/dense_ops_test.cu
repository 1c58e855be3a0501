// GPU kernels of the dense parts of the models against their CPU references, on random inputs
// (seed printed), odd sizes and the real models' shapes:
//   - embedding vs embedding_ref (bit-exact; an out-of-range id gives a zero row; rows past the
//     device count are untouched; one vocabulary shard of a group: its ids only);
//   - rms_norm vs rms_norm_ref: hidden rows with and without the fused residual add (residual
//     written back bit-exactly), Qwen3's per-head q/k norm on a [T, heads, 128] view with
//     rows_per_token, MLA's kv_a_layernorm on the first 512 of 576 columns, both NormStyles,
//     scalar (unaligned) rows, in place;
//   - rope vs apply_rope_inplace_ref: Qwen3 rotate-half D = 128, Kimi-K2.5 MLA interleaved rope 64
//     at dim_offset 128 with a YaRN table, Qwen3.5 partial rotary 64 of 256, an odd unaligned case
//     with attention_factor != 1;
//   - silu_mul vs silu_mul_fused_ref, add_rows (bit-exact, base-only rows untouched);
//   - the sampler: sample_test.cu;
//   - cuBLAS handles made by CublasHandle on two streams at once (set_cublas_stream keeps each
//     handle's own workspace): bitwise the result of one handle alone, close to the CPU.
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "gpu/gpu_test_util.cuh"
#include "model/gpu_model_kernels_cuda.cuh"
#include "ops/embedding/embedding.h"
#include "ops/embedding/embedding_cuda.cuh"
#include "ops/linear/linear.h"
#include "ops/linear/linear_cuda.cuh"
#include "ops/norm/norm.h"
#include "ops/norm/norm_cuda.cuh"
#include "ops/rope/rope.h"
#include "ops/rope/rope_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

// Random bf16 values (as raw bits) and their exact fp32 values.
std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t n, float stddev, float mean = 0.0f) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = f32_to_bf16_bits(dist(rng));
  return out;
}
std::vector<float> to_f32(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_bits_to_f32(bits[i]);
  return out;
}
Tensor f32_tensor(const std::vector<float>& v, Shape shape) {
  return Tensor::from_f32(v, std::move(shape));
}

// ---------------------------------------------------------------- cuBLAS handles

// cublasSetStream drops a handle's workspace for cuBLAS's default pool; set_cublas_stream binds
// the CublasHandle's own again, so handles on concurrent streams never share one (cuBLAS's
// condition for bitwise reproducible results with several streams). The shape is Kimi-K2.5's
// q_a projection at decode (4 rows, K = 7168), where cuBLAS splits K through its workspace.
TEST(Sm90_DenseOps, CublasHandlesOnTwoStreamsKeepTheirWorkspaces) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(701));
  const int rows = 4, n = 1536, k = 7168;
  const std::vector<uint16_t> x = random_bf16(rng, static_cast<size_t>(rows) * k, 1.f);
  const std::vector<uint16_t> w = random_bf16(rng, static_cast<size_t>(n) * k, 0.02f);
  auto x_d = upload_vector(x);
  auto w_d = upload_vector(w);
  const size_t out_bytes = static_cast<size_t>(rows) * n * 2;
  cuda::DeviceBuffer y_one(out_bytes), y_a(out_bytes), y_b(out_bytes);
  cuda::CublasHandle one, a, b;
  cuda::Stream s1, s2;
  auto gemm = [&](const cuda::CublasHandle& h, const cuda::Stream& s, cuda::DeviceBuffer& y) {
    cuda::set_cublas_stream(h.get(), s.get());
    const float alpha = 1.f, beta = 0.f;
    ASSERT_EQ(cublasGemmEx(static_cast<cublasHandle_t>(h.get()), CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k,
                           &alpha, w_d.get(), CUDA_R_16BF, k, x_d.get(), CUDA_R_16BF, k, &beta,
                           y.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
  };
  gemm(one, s1, y_one);
  s1.synchronize();
  const std::vector<uint16_t> want = download_vector<uint16_t>(y_one, static_cast<size_t>(rows) * n);
  // The fp32 dot of a few outputs: the GEMM itself is right.
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < n; c += 97) {
      double dot = 0;
      for (int i = 0; i < k; ++i)
        dot += static_cast<double>(bf16_bits_to_f32(x[static_cast<size_t>(r) * k + i])) *
               bf16_bits_to_f32(w[static_cast<size_t>(c) * k + i]);
      EXPECT_NEAR(bf16_bits_to_f32(want[static_cast<size_t>(r) * n + c]), dot, 0.01 + 0.01 * std::fabs(dot))
          << "row " << r << " column " << c;
    }
  for (int rep = 0; rep < 16; ++rep) {
    MOELORA_CUDA_CHECK(cudaMemsetAsync(y_a.get(), 0xff, out_bytes, s1.get()));
    MOELORA_CUDA_CHECK(cudaMemsetAsync(y_b.get(), 0xff, out_bytes, s2.get()));
    for (int i = 0; i < 4; ++i) {  // both streams busy at once
      gemm(a, s1, y_a);
      gemm(b, s2, y_b);
    }
    s1.synchronize();
    s2.synchronize();
    ASSERT_EQ(download_vector<uint16_t>(y_a, want.size()), want) << "stream 1, repetition " << rep;
    ASSERT_EQ(download_vector<uint16_t>(y_b, want.size()), want) << "stream 2, repetition " << rep;
  }
}

// ---------------------------------------------------------------- embedding

TEST(Sm90_DenseOps, EmbeddingGathersRowsExactly) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(301));
  for (const auto& [V, H] : std::vector<std::pair<int, int>>{{1001, 2048}, {163, 7168}, {57, 24}}) {
    const int T = 37, valid = 29;
    const std::vector<uint16_t> table = random_bf16(rng, static_cast<size_t>(V) * H, 1.0f);
    std::vector<int32_t> ids(T);
    std::uniform_int_distribution<int32_t> id_dist(0, V - 1);
    for (auto& id : ids) id = id_dist(rng);
    ids[5] = V;  // out of range: zero row
    ids[6] = -3;
    std::vector<int32_t> ref_ids = ids;
    ref_ids[5] = ref_ids[6] = 0;
    Tensor table_t = Tensor::empty(DType::kBF16, {V, H});
    std::memcpy(table_t.raw_data(), table.data(), table.size() * 2);
    const Tensor ref = ops::embedding_ref(table_t, std::span<const int32_t>(ref_ids));

    auto table_d = upload_vector(table);
    auto ids_d = upload_vector(ids);
    auto count_d = upload_vector(std::vector<int32_t>{valid});
    std::vector<uint16_t> sentinel(static_cast<size_t>(T) * H, 0x7f7f);
    auto out_d = upload_vector(sentinel);
    ops::cuda::EmbeddingArgs a;
    a.table = table_d.as<__nv_bfloat16>();
    a.ids = ids_d.as<int32_t>();
    a.out = out_d.as<__nv_bfloat16>();
    a.tokens = T;
    a.num_tokens = count_d.as<int32_t>();
    a.hidden = H;
    a.vocab = V;
    ops::cuda::launch_embedding(a, nullptr);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> out = download_vector<uint16_t>(out_d, sentinel.size());
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < H; ++h) {
        const uint16_t got = out[static_cast<size_t>(t) * H + h];
        if (t >= valid) {
          ASSERT_EQ(got, 0x7f7f) << "row " << t << " past num_tokens was written";
        } else if (t == 5 || t == 6) {
          ASSERT_EQ(got, 0) << "row " << t << " with a bad id must be zero";
        } else {
          ASSERT_EQ(bf16_bits_to_f32(got), ref.data<float>()[static_cast<size_t>(t) * H + h])
              << "V " << V << " H " << H << " row " << t << " col " << h;
        }
      }
    }
  }
}

// A split vocabulary (vocab_shard): each of n ranks looks up the ids of its rows
// [first_id, first_id + V / n) in its share of the table and writes zero rows for the others, so
// the ranks' outputs summed are the whole table's lookup, row by row exactly.
TEST(Sm90_DenseOps, EmbeddingOfOneVocabularyShardSumsToTheWholeLookup) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(302));
  const int V = 96, H = 64, T = 41, ranks = 4, shard = V / ranks;
  const std::vector<uint16_t> table = random_bf16(rng, static_cast<size_t>(V) * H, 1.0f);
  std::vector<int32_t> ids(T);
  std::uniform_int_distribution<int32_t> id_dist(0, V - 1);
  for (auto& id : ids) id = id_dist(rng);
  ids[0] = 0, ids[1] = V - 1, ids[2] = shard - 1, ids[3] = shard;  // the shards' edges
  Tensor table_t = Tensor::empty(DType::kBF16, {V, H});
  std::memcpy(table_t.raw_data(), table.data(), table.size() * 2);
  const Tensor ref = ops::embedding_ref(table_t, std::span<const int32_t>(ids));
  auto ids_d = upload_vector(ids);
  std::vector<int> owners(T, 0);  // how many ranks wrote a nonzero-able row for each token
  for (int r = 0; r < ranks; ++r) {
    const std::vector<uint16_t> rows(table.begin() + static_cast<size_t>(r) * shard * H,
                                     table.begin() + static_cast<size_t>(r + 1) * shard * H);
    auto table_d = upload_vector(rows);
    auto out_d = upload_vector(std::vector<uint16_t>(static_cast<size_t>(T) * H, 0x7f7f));
    ops::cuda::EmbeddingArgs a;
    a.table = table_d.as<__nv_bfloat16>();
    a.ids = ids_d.as<int32_t>();
    a.out = out_d.as<__nv_bfloat16>();
    a.tokens = T;
    a.hidden = H;
    a.vocab = shard;
    a.first_id = r * shard;
    ops::cuda::launch_embedding(a, nullptr);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> out = download_vector<uint16_t>(out_d, static_cast<size_t>(T) * H);
    for (int t = 0; t < T; ++t) {
      const bool mine = ids[t] >= r * shard && ids[t] < (r + 1) * shard;
      owners[t] += mine;
      for (int h = 0; h < H; ++h) {
        const uint16_t got = out[static_cast<size_t>(t) * H + h];
        if (mine) {
          ASSERT_EQ(bf16_bits_to_f32(got), ref.data<float>()[static_cast<size_t>(t) * H + h])
              << "rank " << r << " row " << t << " col " << h;
        } else {
          ASSERT_EQ(got, 0) << "rank " << r << " row " << t << " (id " << ids[t]
                            << ") belongs to another rank";
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) EXPECT_EQ(owners[t], 1) << "row " << t;
  // A negative first id is refused, naming it.
  ops::cuda::EmbeddingArgs bad;
  bad.table = reinterpret_cast<const __nv_bfloat16*>(ids_d.get());
  bad.ids = ids_d.as<int32_t>();
  bad.out = reinterpret_cast<__nv_bfloat16*>(ids_d.get());
  bad.tokens = 1;
  bad.hidden = H;
  bad.vocab = shard;
  bad.first_id = -1;
  EXPECT_TRUE(test::contains(test::error_of([&] { ops::cuda::launch_embedding(bad, nullptr); }),
                             "first_id >= 0"));
}

// ---------------------------------------------------------------- rms_norm

struct NormCase {
  const char* name;
  int tokens, rows_per_token, dim;
  int64_t x_stride, y_stride;  // 0 = dim
  bool residual, in_place;
  NormStyle style;
  float eps;
};

void check_norm(const NormCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(test::test_seed(seed));
  const int capacity_tokens = c.tokens + 3, valid_tokens = c.tokens;
  const int rows = capacity_tokens * c.rows_per_token, valid_rows = valid_tokens * c.rows_per_token;
  const int64_t xs = c.x_stride ? c.x_stride : c.dim, ys = c.y_stride ? c.y_stride : c.dim;
  const std::vector<uint16_t> x = random_bf16(rng, static_cast<size_t>(rows) * xs, 1.3f, 0.2f);
  const std::vector<uint16_t> res = random_bf16(rng, static_cast<size_t>(rows) * c.dim, 0.8f);
  const std::vector<uint16_t> w = random_bf16(rng, static_cast<size_t>(c.dim), 0.2f,
                                              c.style == NormStyle::kWeight ? 1.0f : 0.0f);

  // Reference: r = bf16(x + residual) (or x), y = rms_norm_ref(r).
  std::vector<float> r(static_cast<size_t>(valid_rows) * c.dim);
  std::vector<uint16_t> r_bits(r.size());
  for (int i = 0; i < valid_rows; ++i) {
    for (int d = 0; d < c.dim; ++d) {
      float v = bf16_bits_to_f32(x[static_cast<size_t>(i) * xs + d]);
      if (c.residual)
        v = round_to_bf16(v + bf16_bits_to_f32(res[static_cast<size_t>(i) * c.dim + d]));
      r[static_cast<size_t>(i) * c.dim + d] = v;
      r_bits[static_cast<size_t>(i) * c.dim + d] = f32_to_bf16_bits(v);
    }
  }
  ops::RmsNormParams params;
  params.eps = c.eps;
  params.style = c.style;
  const Tensor ref =
      ops::rms_norm_ref(f32_tensor(r, {valid_rows, c.dim}), f32_tensor(to_f32(w), {c.dim}), params);

  auto x_d = upload_vector(x);
  auto res_d = upload_vector(res);
  auto w_d = upload_vector(w);
  std::vector<uint16_t> y_init(static_cast<size_t>(rows) * ys, 0x7f7f);
  auto y_d = upload_vector(y_init);
  auto count_d = upload_vector(std::vector<int32_t>{valid_tokens});
  ops::cuda::RmsNormArgs a;
  a.x = x_d.as<__nv_bfloat16>();
  a.residual = c.residual ? res_d.as<__nv_bfloat16>() : nullptr;
  a.weight = w_d.as<__nv_bfloat16>();
  a.y = c.in_place ? x_d.as<__nv_bfloat16>() : y_d.as<__nv_bfloat16>();
  a.rows = rows;
  a.num_rows = count_d.as<int32_t>();
  a.rows_per_token = c.rows_per_token;
  a.dim = c.dim;
  a.x_stride = c.x_stride;
  a.y_stride = c.in_place ? c.x_stride : c.y_stride;
  a.eps = c.eps;
  a.style = c.style;
  ops::cuda::launch_rms_norm(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());

  const int64_t out_stride = c.in_place ? xs : ys;
  const std::vector<uint16_t> y = c.in_place ? download_vector<uint16_t>(x_d, x.size())
                                             : download_vector<uint16_t>(y_d, y_init.size());
  std::vector<float> got(static_cast<size_t>(valid_rows) * c.dim);
  for (int i = 0; i < valid_rows; ++i)
    for (int d = 0; d < c.dim; ++d)
      got[static_cast<size_t>(i) * c.dim + d] =
          bf16_bits_to_f32(y[static_cast<size_t>(i) * out_stride + d]);
  EXPECT_TRUE(test::close_bf16(f32_tensor(got, {valid_rows, c.dim}), ref));
  // Rows past the device count and columns past dim are untouched.
  for (int i = 0; i < rows; ++i) {
    for (int64_t d = 0; d < out_stride; ++d) {
      if (i < valid_rows && d < c.dim) continue;
      const size_t at = static_cast<size_t>(i) * out_stride + d;
      ASSERT_EQ(y[at], c.in_place ? x[at] : uint16_t{0x7f7f}) << "row " << i << " col " << d;
    }
  }
  if (c.residual) {
    const std::vector<uint16_t> res_out = download_vector<uint16_t>(res_d, res.size());
    for (size_t i = 0; i < res.size(); ++i) {
      const uint16_t expected = i < r_bits.size() ? r_bits[i] : res[i];
      ASSERT_EQ(res_out[i], expected) << "residual element " << i;
    }
  }
}

TEST(Sm90_DenseOps, RmsNormMatchesReference) {
  MOELORA_REQUIRE_SM90();
  const std::vector<NormCase> cases = {
      {"qwen3 hidden 2048 + residual", 37, 1, 2048, 0, 0, true, false, NormStyle::kWeight, 1e-6f},
      {"kimi hidden 7168", 5, 1, 7168, 0, 0, false, false, NormStyle::kWeight, 1e-5f},
      {"kimi hidden 7168 + residual", 9, 1, 7168, 0, 0, true, false, NormStyle::kWeight, 1e-5f},
      {"qwen3 q_norm [T, 32, 128] in place", 13, 32, 128, 128, 0, false, true, NormStyle::kWeight,
       1e-6f},
      {"qwen3.5 k_norm (1 + w) [T, 2, 256]", 11, 2, 256, 256, 0, false, false,
       NormStyle::kOnePlusWeight, 1e-6f},
      {"qwen3.5 hidden (1 + w) + residual", 7, 1, 2048, 0, 0, true, false,
       NormStyle::kOnePlusWeight, 1e-6f},
      {"kimi kv_a_layernorm 512 of 576", 17, 1, 512, 576, 520, false, false, NormStyle::kWeight,
       1e-6f},
      {"kimi q_a_layernorm 1536", 6, 1, 1536, 0, 0, false, false, NormStyle::kWeight, 1e-6f},
      {"odd unaligned D 6 stride 10", 23, 3, 6, 10, 14, true, false, NormStyle::kWeight, 1e-6f},
      {"odd unaligned D 1030", 4, 1, 1030, 1034, 0, true, false, NormStyle::kOnePlusWeight, 1e-6f},
  };
  uint64_t seed = 311;
  for (const NormCase& c : cases) check_norm(c, seed++);
}

// The LoRA delta of the projection that wrote x, added by the residual RMSNorm as it reads x
// (x_delta): bit for bit add_rows (x += delta on rows with slot >= 0) followed by the plain norm,
// for the block kernel (hidden 2048, vector and scalar rows) and the warp kernel (512).
TEST(Sm90_DenseOps, RmsNormAddsTheLoraDeltaLikeAddRows) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(341));
  for (const int dim : {2048, 1030, 512}) {
    SCOPED_TRACE(dim);
    const int T = 19, valid = 17;
    const size_t n = static_cast<size_t>(T) * dim;
    const std::vector<uint16_t> x = random_bf16(rng, n, 1.0f);
    const std::vector<uint16_t> delta = random_bf16(rng, n, 0.2f);
    const std::vector<uint16_t> resid = random_bf16(rng, n, 1.0f);
    const std::vector<uint16_t> w = random_bf16(rng, dim, 0.5f, 1.0f);
    std::vector<int32_t> slot(T);
    std::uniform_int_distribution<int32_t> slot_dist(-1, 2);
    for (auto& v : slot) v = slot_dist(rng);
    slot[0] = -1;
    slot[1] = 0;
    auto slot_d = upload_vector(slot);
    auto count_d = upload_vector(std::vector<int32_t>{valid});
    auto w_d = upload_vector(w);
    auto delta_d = upload_vector(delta);
    // kPlain: the norm alone; kAddRows: add_rows then the norm; kFold: the norm with x_delta.
    enum Mode { kPlain, kAddRows, kFold };
    auto run = [&](Mode mode) {
      auto x_d = upload_vector(x);
      auto r_d = upload_vector(resid);
      auto y_d = upload_vector(std::vector<uint16_t>(n, 0));
      if (mode == kAddRows) {
        ops::cuda::AddRowsArgs add;
        add.y = x_d.as<__nv_bfloat16>();
        add.delta = delta_d.as<__nv_bfloat16>();
        add.row_slot = slot_d.as<int32_t>();
        add.tokens = T;
        add.num_tokens = count_d.as<int32_t>();
        add.cols = dim;
        ops::cuda::launch_add_rows(add, nullptr);
      }
      ops::cuda::RmsNormArgs a;
      a.x = x_d.as<__nv_bfloat16>();
      a.residual = r_d.as<__nv_bfloat16>();
      a.weight = w_d.as<__nv_bfloat16>();
      a.y = y_d.as<__nv_bfloat16>();
      a.rows = T;
      a.num_rows = count_d.as<int32_t>();
      a.dim = dim;
      if (mode == kFold) {
        a.x_delta = delta_d.as<__nv_bfloat16>();
        a.delta_slot = slot_d.as<int32_t>();
      }
      ops::cuda::launch_rms_norm(a, nullptr);
      MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
      return std::make_pair(download_vector<uint16_t>(y_d, n), download_vector<uint16_t>(r_d, n));
    };
    const auto [y_ref, r_ref] = run(kAddRows);
    const auto [y_got, r_got] = run(kFold);
    EXPECT_EQ(y_got, y_ref);
    EXPECT_EQ(r_got, r_ref);
    // The delta really moved the rows it belongs to (slot 1 is a LoRA row): not a no-op test.
    const std::vector<uint16_t> y_plain = run(kPlain).first;
    EXPECT_NE(std::vector<uint16_t>(y_got.begin() + dim, y_got.begin() + 2 * dim),
              std::vector<uint16_t>(y_plain.begin() + dim, y_plain.begin() + 2 * dim));
    EXPECT_EQ(std::vector<uint16_t>(y_got.begin(), y_got.begin() + dim),
              std::vector<uint16_t>(y_plain.begin(), y_plain.begin() + dim));
  }
}

TEST(DenseOps, RmsNormRefusesADeltaWithoutTheResidual) {
  ops::cuda::RmsNormArgs a;
  alignas(16) static uint16_t buf[64];
  a.y = reinterpret_cast<__nv_bfloat16*>(buf);
  a.x = a.weight = a.y;
  a.x_delta = reinterpret_cast<const __nv_bfloat16*>(buf);
  a.delta_slot = reinterpret_cast<const int32_t*>(buf);
  a.rows = 1;
  a.dim = 8;
  const std::string message = test::error_message([&] { ops::cuda::launch_rms_norm(a, nullptr); },
                                                  ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("x_delta needs"), std::string::npos) << message;
}

// ---------------------------------------------------------------- rope

struct RopeCase {
  const char* name;
  int tokens, heads, head_dim, dim_offset;
  RopeStyle style;
  ops::RopeParams params;
  int max_position;
};

void check_rope(const RopeCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(test::test_seed(seed));
  const ops::RopeTable table = ops::make_rope_table(c.params);
  const int capacity = c.tokens + 2;
  const size_t n = static_cast<size_t>(capacity) * c.heads * c.head_dim;
  const std::vector<uint16_t> x = random_bf16(rng, n, 1.0f);
  std::vector<int32_t> pos(capacity);
  std::uniform_int_distribution<int32_t> pos_dist(0, c.max_position);
  for (auto& p : pos) p = pos_dist(rng);
  pos[0] = 0;

  std::vector<float> x_f = to_f32(x);
  x_f.resize(static_cast<size_t>(c.tokens) * c.heads * c.head_dim);
  Tensor ref = f32_tensor(x_f, {c.tokens, c.heads, c.head_dim});
  std::vector<int64_t> pos64(pos.begin(), pos.begin() + c.tokens);
  ops::RopeApplyParams ap;
  ap.style = c.style;
  ap.dim_offset = c.dim_offset;
  ops::apply_rope_inplace_ref(ref, pos64, table, ap);

  auto x_d = upload_vector(x);
  auto pos_d = upload_vector(pos);
  auto freq_d = upload_vector(table.inv_freq);
  auto count_d = upload_vector(std::vector<int32_t>{c.tokens});
  ops::cuda::RopeCudaArgs a;
  a.x = x_d.as<__nv_bfloat16>();
  a.tokens = capacity;
  a.num_tokens = count_d.as<int32_t>();
  a.positions = pos_d.as<int32_t>();
  a.heads = c.heads;
  a.token_stride = static_cast<int64_t>(c.heads) * c.head_dim;
  a.head_stride = c.head_dim;
  a.dim_offset = c.dim_offset;
  a.rotary_dim = static_cast<int>(table.rotary_dim);
  a.inv_freq = freq_d.as<float>();
  a.attention_factor = table.attention_factor;
  a.style = c.style;
  ops::cuda::launch_rope(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> y = download_vector<uint16_t>(x_d, n);
  const size_t valid = static_cast<size_t>(c.tokens) * c.heads * c.head_dim;
  std::vector<float> got(valid);
  for (size_t i = 0; i < valid; ++i) got[i] = bf16_bits_to_f32(y[i]);
  EXPECT_TRUE(test::close_bf16(f32_tensor(got, {c.tokens, c.heads, c.head_dim}), ref));
  // Dims outside the rotated range and tokens past the count are untouched.
  for (size_t i = 0; i < n; ++i) {
    const int d = static_cast<int>(i % c.head_dim);
    if (i < valid && d >= c.dim_offset && d < c.dim_offset + table.rotary_dim) continue;
    ASSERT_EQ(y[i], x[i]) << "element " << i << " (dim " << d << ") changed";
  }
}

TEST(Sm90_DenseOps, RopeMatchesReference) {
  MOELORA_REQUIRE_SM90();
  ops::RopeParams qwen3;
  qwen3.theta = 1e6;
  qwen3.rotary_dim = 128;
  ops::RopeParams kimi;  // DeepSeek-V3 / Kimi-K2.5 YaRN
  kimi.type = ops::RopeType::kYarn;
  kimi.theta = 50000;
  kimi.rotary_dim = 64;
  kimi.factor = 64;
  kimi.original_max_position_embeddings = 4096;
  kimi.beta_fast = 32;
  kimi.beta_slow = 1;
  kimi.mscale = 1;
  kimi.mscale_all_dim = 1;
  ops::RopeParams qwen35;
  qwen35.theta = 1e7;
  qwen35.rotary_dim = 64;
  ops::RopeParams scaled;  // YaRN without mscale keys: attention_factor 1 + 0.1 ln 4
  scaled.type = ops::RopeType::kYarn;
  scaled.rotary_dim = 6;
  scaled.factor = 4;
  scaled.original_max_position_embeddings = 256;
  const std::vector<RopeCase> cases = {
      {"qwen3 q [T, 32, 128] rotate-half", 19, 32, 128, 0, RopeStyle::kRotateHalf, qwen3, 40000},
      {"qwen3 k [T, 4, 128] rotate-half", 7, 4, 128, 0, RopeStyle::kRotateHalf, qwen3, 40000},
      {"kimi q [T, 64, 192] interleaved rope 64 at 128, YaRN", 9, 64, 192, 128,
       RopeStyle::kInterleaved, kimi, 200000},
      {"kimi k_rope [T, 1, 64] interleaved, YaRN", 21, 1, 64, 0, RopeStyle::kInterleaved, kimi,
       200000},
      {"qwen3.5 partial rotary 64 of 256", 11, 16, 256, 0, RopeStyle::kRotateHalf, qwen35, 250000},
      {"odd: rotary 6 at 3 of 11, rotate-half, factor 1.1386", 5, 3, 11, 3, RopeStyle::kRotateHalf,
       scaled, 999},
      {"odd: rotary 6 at 1 of 9, interleaved", 6, 5, 9, 1, RopeStyle::kInterleaved, scaled, 999},
  };
  uint64_t seed = 331;
  for (const RopeCase& c : cases) check_rope(c, seed++);
}

// ---------------------------------------------------------------- silu_mul, add_rows

TEST(Sm90_DenseOps, SiluMulMatchesReference) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(351));
  for (int inter : {768, 2048, 13}) {
    SCOPED_TRACE(inter);
    const int T = 23, valid = 19;
    const std::vector<uint16_t> gu = random_bf16(rng, static_cast<size_t>(T) * 2 * inter, 2.0f);
    const std::vector<float> gu_f = to_f32(gu);
    const Tensor ref = ops::silu_mul_fused_ref(f32_tensor(
        std::vector<float>(gu_f.begin(), gu_f.begin() + static_cast<int64_t>(valid) * 2 * inter),
        {valid, 2 * inter}));
    auto gu_d = upload_vector(gu);
    std::vector<uint16_t> init(static_cast<size_t>(T) * inter, 0x7f7f);
    auto out_d = upload_vector(init);
    auto count_d = upload_vector(std::vector<int32_t>{valid});
    ops::cuda::SiluMulArgs a;
    a.gate_up = gu_d.as<__nv_bfloat16>();
    a.out = out_d.as<__nv_bfloat16>();
    a.tokens = T;
    a.num_tokens = count_d.as<int32_t>();
    a.inter = inter;
    ops::cuda::launch_silu_mul(a, nullptr);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> out = download_vector<uint16_t>(out_d, init.size());
    std::vector<float> got(static_cast<size_t>(valid) * inter);
    for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_bits_to_f32(out[i]);
    EXPECT_TRUE(test::close_bf16(f32_tensor(got, {valid, inter}), ref));
    for (size_t i = got.size(); i < out.size(); ++i) ASSERT_EQ(out[i], 0x7f7f) << i;
  }
}

TEST(Sm90_DenseOps, AddRowsAddsOnlyLoraRows) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(361));
  for (const auto& [cols, stride] :
       std::vector<std::pair<int, int>>{{2048, 2056}, {7168, 0}, {45, 51}}) {
    SCOPED_TRACE(cols);
    const int T = 29, valid = 26;
    const int64_t ys = stride ? stride : cols;
    const std::vector<uint16_t> y = random_bf16(rng, static_cast<size_t>(T) * ys, 1.0f);
    const std::vector<uint16_t> delta = random_bf16(rng, static_cast<size_t>(T) * cols, 0.1f);
    std::vector<int32_t> slot(T);
    std::uniform_int_distribution<int32_t> slot_dist(-1, 3);
    for (auto& s : slot) s = slot_dist(rng);
    slot[0] = -1;
    slot[1] = 0;
    auto y_d = upload_vector(y);
    auto d_d = upload_vector(delta);
    auto slot_d = upload_vector(slot);
    auto count_d = upload_vector(std::vector<int32_t>{valid});
    ops::cuda::AddRowsArgs a;
    a.y = y_d.as<__nv_bfloat16>();
    a.delta = d_d.as<__nv_bfloat16>();
    a.row_slot = slot_d.as<int32_t>();
    a.tokens = T;
    a.num_tokens = count_d.as<int32_t>();
    a.cols = cols;
    a.y_stride = stride;
    ops::cuda::launch_add_rows(a, nullptr);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> out = download_vector<uint16_t>(y_d, y.size());
    for (int t = 0; t < T; ++t) {
      for (int64_t c = 0; c < ys; ++c) {
        const size_t at = static_cast<size_t>(t) * ys + c;
        uint16_t expected = y[at];
        if (t < valid && slot[t] >= 0 && c < cols)
          expected = f32_to_bf16_bits(bf16_bits_to_f32(y[at]) +
                                      bf16_bits_to_f32(delta[static_cast<size_t>(t) * cols + c]));
        ASSERT_EQ(out[at], expected) << "row " << t << " (slot " << slot[t] << ") col " << c;
      }
    }
  }
}

// ---------------------------------------------------------------- sigmoid output gate

// Qwen3.5's attention output gate x *= sigmoid(gate) against the formula in fp32 with one bf16
// rounding, on the vector path (Qwen3.5-35B-A3B's 16 heads of 256, gate rows inside wider qkv
// rows) and the scalar one (odd width and stride), with rows past the count untouched.
TEST(Sm90_DenseOps, SigmoidGateMatchesTheFormula) {
  MOELORA_REQUIRE_SM90();
  struct GateCase {
    int width, gate_stride, tokens, valid;
  };
  uint64_t seed = 40;
  for (const GateCase& c : {GateCase{4096, 4096 * 2 + 1024, 9, 7}, GateCase{1003, 1011, 5, 5}}) {
    SCOPED_TRACE(c.width);
    std::mt19937_64 rng(test::test_seed(seed++));
    const std::vector<uint16_t> x = random_bf16(rng, static_cast<size_t>(c.tokens) * c.width, 1.0f);
    const std::vector<uint16_t> gate = random_bf16(rng, static_cast<size_t>(c.tokens) * c.gate_stride, 2.0f);
    auto x_d = upload_vector(x);
    auto gate_d = upload_vector(gate);
    auto count_d = upload_vector(std::vector<int32_t>{c.valid});
    model::gpu_detail::SigmoidGateArgs a;
    a.x = x_d.as<__nv_bfloat16>();
    a.gate = gate_d.as<__nv_bfloat16>();
    a.gate_stride = c.gate_stride;
    a.width = c.width;
    a.tokens = c.tokens;
    a.num_tokens = count_d.as<int32_t>();
    model::gpu_detail::launch_sigmoid_gate(a, nullptr);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const auto y = download_vector<uint16_t>(x_d, x.size());
    size_t off = 0;
    for (int t = 0; t < c.tokens; ++t) {
      for (int i = 0; i < c.width; ++i) {
        const size_t at = static_cast<size_t>(t) * c.width + i;
        if (t >= c.valid) {
          ASSERT_EQ(y[at], x[at]) << "row " << t << " past the count changed";
          continue;
        }
        const float g = bf16_bits_to_f32(gate[static_cast<size_t>(t) * c.gate_stride + i]);
        const float want = round_to_bf16(bf16_bits_to_f32(x[at]) * (1.0f / (1.0f + std::exp(-g))));
        // expf on the device and std::exp here may differ in the last fp32 bit: one bf16 ulp.
        if (bf16_bits_to_f32(y[at]) != want) {
          ++off;
          ASSERT_NEAR(bf16_bits_to_f32(y[at]), want, std::fabs(want) / 128 + 1e-30f) << "row " << t << " col " << i;
        }
      }
    }
    EXPECT_LE(off, x.size() / 100);
  }
}

}  // namespace
}  // namespace moelora
