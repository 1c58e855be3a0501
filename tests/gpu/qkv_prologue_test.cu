// The fused GQA attention input stage (ops/attention/qkv_prologue_cuda.cuh) against
// ops::qkv_prologue_ref with bf16 rounding between the stages, on random bf16 rows:
//   - Qwen3-MoE: 32 / 4 heads of 128, q/k norms (w * n), rotate-half RoPE over all 128 dims;
//   - Qwen3.5 gated attention: 16 / 2 heads of 256, the gate block between q and k, (1 + w) norms,
//     RoPE on 64 of 256 dims;
//   - no norms, interleaved RoPE, 8 / 8 heads of 64.
// Each case has padding rows (sequence -1: processed, not appended) and rows past the valid
// count (untouched); pages are shuffled. It checks q and k against the reference, the gate
// columns and rows past the count bit for bit unchanged, the cache rows of appended tokens equal
// to the kernel's k output and the input v bit for bit, and nothing else in the cache written.
// The LoRA-delta cases hand the kernel a delta and per-row slots (some rows -1): every output must
// be that of the same kernel on qkv with the delta added first (bf16(x + delta) on the rows with a
// slot, gate block and tail included), so the expectations are computed from that sum.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "gpu/gpu_test_util.cuh"
#include "ops/attention/qkv_prologue.h"
#include "ops/attention/qkv_prologue_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

constexpr uint16_t kCacheSentinel = 0x7fc0;  // bf16 NaN

struct PrologueCase {
  const char* name;
  int q_heads, kv_heads, head_dim, gate_width;  // gate_width: columns between q and k (Qwen3.5)
  int rotary_dim;
  bool norms;
  NormStyle norm_style;
  RopeStyle rope_style;
  int valid_rows, capacity, padding_rows;  // the last padding_rows of the valid rows have seq -1
  bool delta = false;  // a LoRA delta on every third row but one (the others slot -1)
};

std::vector<uint16_t> random_bits(std::mt19937_64& rng, size_t n, float mean, float stddev) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = f32_to_bf16_bits(dist(rng));
  return out;
}

void check_prologue(const PrologueCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(test::test_seed(seed));
  const int D = c.head_dim, T = c.capacity;
  const int64_t k_offset = static_cast<int64_t>(c.q_heads) * D + c.gate_width;
  const int64_t v_offset = k_offset + static_cast<int64_t>(c.kv_heads) * D;
  const int64_t width = v_offset + static_cast<int64_t>(c.kv_heads) * D + 8;  // a spare tail
  const std::vector<uint16_t> qkv_in = random_bits(rng, static_cast<size_t>(T) * width, 0.0f, 1.5f);
  // What the kernel must behave as if it were given: qkv_in with the delta added on the valid
  // rows that have a slot (add_rows' rounding); without a delta, qkv_in itself.
  std::vector<uint16_t> qkv = qkv_in;
  std::vector<uint16_t> delta;
  std::vector<int32_t> delta_slot(static_cast<size_t>(T), -1);
  if (c.delta) {
    delta = random_bits(rng, qkv_in.size(), 0.0f, 0.5f);
    for (int t = 0; t < T; ++t) {
      delta_slot[static_cast<size_t>(t)] = t % 3 == 1 ? -1 : t % 4;
      if (t >= c.valid_rows || delta_slot[static_cast<size_t>(t)] < 0) continue;
      for (int64_t col = 0; col < width; ++col) {
        const size_t i = static_cast<size_t>(t) * width + col;
        qkv[i] = f32_to_bf16_bits(bf16_bits_to_f32(qkv_in[i]) + bf16_bits_to_f32(delta[i]));
      }
    }
  }
  const std::vector<uint16_t> q_norm =
      random_bits(rng, D, c.norm_style == NormStyle::kWeight ? 1.0f : 0.0f, 0.2f);
  const std::vector<uint16_t> k_norm =
      random_bits(rng, D, c.norm_style == NormStyle::kWeight ? 1.0f : 0.0f, 0.2f);

  // Sequences: one row each (decode); row r belongs to sequence r, padding rows to -1.
  const int page_size = 16, pages_per_seq = 8, seqs = T;
  std::vector<int32_t> token_seq(T), token_pos(T);
  std::vector<int32_t> table(static_cast<size_t>(seqs) * pages_per_seq);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::uniform_int_distribution<int32_t> pos_dist(0, page_size * pages_per_seq - 1);
  for (int r = 0; r < T; ++r) {
    token_seq[r] = r < c.valid_rows - c.padding_rows ? r : -1;
    token_pos[r] = pos_dist(rng);
  }
  token_pos[0] = 0;
  const int num_pages = seqs * pages_per_seq;
  const size_t cache_elems = static_cast<size_t>(num_pages) * page_size * c.kv_heads * D;

  ops::RopeParams rope_params;
  rope_params.theta = 1e6;
  rope_params.rotary_dim = c.rotary_dim;
  const ops::RopeTable rope = ops::make_rope_table(rope_params);

  auto qkv_d = upload_vector(qkv_in);
  auto delta_d = upload_vector(c.delta ? delta : std::vector<uint16_t>(8));
  auto delta_slot_d = upload_vector(delta_slot);
  auto q_norm_d = upload_vector(q_norm);
  auto k_norm_d = upload_vector(k_norm);
  auto seq_d = upload_vector(token_seq);
  auto pos_d = upload_vector(token_pos);
  auto table_d = upload_vector(table);
  auto freq_d = upload_vector(rope.inv_freq);
  auto count_d = upload_vector(std::vector<int32_t>{c.valid_rows});
  auto k_cache_d = upload_vector(std::vector<uint16_t>(cache_elems, kCacheSentinel));
  auto v_cache_d = upload_vector(std::vector<uint16_t>(cache_elems, kCacheSentinel));

  ops::cuda::QkvPrologueArgs a;
  a.qkv = qkv_d.as<__nv_bfloat16>();
  a.row_stride = width;
  a.num_tokens = count_d.as<int32_t>();
  a.q_heads = c.q_heads;
  a.k_offset = k_offset;
  a.v_offset = v_offset;
  if (c.norms) {
    a.q_norm = q_norm_d.as<__nv_bfloat16>();
    a.k_norm = k_norm_d.as<__nv_bfloat16>();
  }
  a.eps = 1e-6f;
  a.norm_style = c.norm_style;
  a.rotary_dim = c.rotary_dim;
  a.inv_freq = freq_d.as<float>();
  a.attention_factor = rope.attention_factor;
  a.rope_style = c.rope_style;
  a.cache.k = k_cache_d.as<__nv_bfloat16>();
  a.cache.v = v_cache_d.as<__nv_bfloat16>();
  a.cache.page_size = page_size;
  a.cache.num_kv_heads = c.kv_heads;
  a.cache.head_dim = D;
  a.cache.v_head_dim = D;
  a.batch.page_table = table_d.as<int32_t>();
  a.batch.max_pages_per_seq = pages_per_seq;
  a.batch.token_seq = seq_d.as<int32_t>();
  a.batch.token_pos = pos_d.as<int32_t>();
  a.batch.max_seqs = seqs;
  a.batch.max_tokens = T;
  if (c.delta) {
    a.delta = delta_d.as<__nv_bfloat16>();
    a.delta_slot = delta_slot_d.as<int32_t>();
  }
  ops::cuda::launch_qkv_prologue(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const auto out = download_vector<uint16_t>(qkv_d, qkv.size());
  const auto k_cache = download_vector<uint16_t>(k_cache_d, cache_elems);
  const auto v_cache = download_vector<uint16_t>(v_cache_d, cache_elems);

  // Reference on the valid rows.
  // bf16 bits [n] as an F32 tensor of their exact values, shaped `shape`.
  auto f32_of = [](const std::vector<uint16_t>& bits, size_t n, Shape shape) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = bf16_bits_to_f32(bits[i]);
    return Tensor::from_f32(v, std::move(shape));
  };
  Tensor ref = f32_of(qkv, static_cast<size_t>(c.valid_rows) * width, {c.valid_rows, width});
  const Tensor qn = f32_of(q_norm, D, {D});
  const Tensor kn = f32_of(k_norm, D, {D});
  std::vector<int64_t> positions(token_pos.begin(), token_pos.begin() + c.valid_rows);
  ops::QkvPrologueParams p;
  p.q_heads = c.q_heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = D;
  p.k_offset = k_offset;
  p.v_offset = v_offset;
  p.norm.eps = 1e-6;
  p.norm.style = c.norm_style;
  p.rope_style = c.rope_style;
  p.round_bf16 = true;
  ops::qkv_prologue_ref(ref, c.norms ? &qn : nullptr, c.norms ? &kn : nullptr, positions, rope, p);

  // q and k heads against the reference (within bf16 rounding: the GPU sums squares in another
  // order); every other element bit for bit as it was.
  const float* r = ref.data<float>();
  std::vector<float> got_qk, want_qk;
  for (int t = 0; t < T; ++t) {
    for (int64_t col = 0; col < width; ++col) {
      const size_t i = static_cast<size_t>(t) * width + col;
      const bool q_or_k =
          col < static_cast<int64_t>(c.q_heads) * D || (col >= k_offset && col < v_offset);
      if (t < c.valid_rows && q_or_k) {
        got_qk.push_back(bf16_bits_to_f32(out[i]));
        want_qk.push_back(r[i]);
      } else {
        ASSERT_EQ(out[i], qkv[i]) << "row " << t << " column " << col << " changed";
      }
    }
  }
  const Tensor got_t = Tensor::from_f32(got_qk, {static_cast<int64_t>(got_qk.size())});
  const Tensor want_t = Tensor::from_f32(want_qk, {static_cast<int64_t>(want_qk.size())});
  EXPECT_TRUE(test::close_bf16(got_t, want_t));
  size_t off_by_more_than_two_ulps = 0;
  for (size_t i = 0; i < got_qk.size(); ++i) {
    const float ulp = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(want_qk[i]), 1e-30f)) - 7);
    if (std::fabs(got_qk[i] - want_qk[i]) > 2.0f * ulp + 1e-6f) ++off_by_more_than_two_ulps;
  }
  EXPECT_LE(off_by_more_than_two_ulps, got_qk.size() / 1000)
      << "of " << got_qk.size() << " q/k values";

  // The cache: appended rows hold the kernel's k and the input v; nothing else was written.
  const int64_t kv_width = static_cast<int64_t>(c.kv_heads) * D;
  std::vector<bool> written(static_cast<size_t>(num_pages) * page_size, false);
  int appended = 0;
  for (int t = 0; t < c.valid_rows; ++t) {
    if (token_seq[t] < 0) continue;
    const int page =
        table[static_cast<size_t>(token_seq[t]) * pages_per_seq + token_pos[t] / page_size];
    const int64_t slot = static_cast<int64_t>(page) * page_size + token_pos[t] % page_size;
    written[static_cast<size_t>(slot)] = true;
    ++appended;
    for (int64_t e = 0; e < kv_width; ++e) {
      ASSERT_EQ(k_cache[slot * kv_width + e], out[static_cast<size_t>(t) * width + k_offset + e])
          << "K of row " << t << " element " << e;
      ASSERT_EQ(v_cache[slot * kv_width + e], qkv[static_cast<size_t>(t) * width + v_offset + e])
          << "V of row " << t << " element " << e;
    }
  }
  EXPECT_EQ(appended, c.valid_rows - c.padding_rows);
  for (size_t slot = 0; slot < written.size(); ++slot) {
    if (written[slot]) continue;
    for (int64_t e = 0; e < kv_width; ++e) {
      ASSERT_EQ(k_cache[slot * kv_width + e], kCacheSentinel) << "K slot " << slot << " written";
      ASSERT_EQ(v_cache[slot * kv_width + e], kCacheSentinel) << "V slot " << slot << " written";
    }
  }
}

TEST(Sm90_QkvPrologue, MatchesTheReferenceAndAppendsExactly) {
  MOELORA_REQUIRE_SM90();
  const std::vector<PrologueCase> cases = {
      {"qwen3: 32 / 4 heads of 128, norms, rotate-half", 32, 4, 128, 0, 128, true,
       NormStyle::kWeight, RopeStyle::kRotateHalf, 19, 24, 3},
      {"qwen3.5 gated: 16 / 2 heads of 256, gate block, (1 + w) norms, RoPE on 64", 16, 2, 256,
       16 * 256, 64, true, NormStyle::kOnePlusWeight, RopeStyle::kRotateHalf, 7, 9, 1},
      {"no norms, interleaved, 8 / 8 heads of 64", 8, 8, 64, 0, 64, false, NormStyle::kWeight,
       RopeStyle::kInterleaved, 33, 40, 0},
      {"qwen3 with a LoRA delta", 32, 4, 128, 0, 128, true, NormStyle::kWeight,
       RopeStyle::kRotateHalf, 19, 24, 3, true},
      {"qwen3.5 gated with a LoRA delta (gate block and tail in place)", 16, 2, 256, 16 * 256, 64,
       true, NormStyle::kOnePlusWeight, RopeStyle::kRotateHalf, 7, 9, 1, true},
      {"no norms with a LoRA delta", 8, 8, 64, 0, 64, false, NormStyle::kWeight,
       RopeStyle::kInterleaved, 33, 40, 0, true},
  };
  uint64_t seed = 1;
  for (const PrologueCase& c : cases) check_prologue(c, seed++);
}

TEST(QkvPrologue, RejectsLayoutsThatDoNotFit) {
  ops::cuda::QkvPrologueArgs a;
  std::string message = test::error_message([&] { ops::cuda::launch_qkv_prologue(a, nullptr); });
  EXPECT_NE(message.find("qkv, num_tokens and inv_freq"), std::string::npos) << message;
  // Non-null stand-ins: the checks run before any launch.
  auto* fake = reinterpret_cast<__nv_bfloat16*>(uintptr_t{256});
  auto* fake_i = reinterpret_cast<int32_t*>(uintptr_t{256});
  a.qkv = fake;
  a.num_tokens = fake_i;
  a.inv_freq = reinterpret_cast<float*>(uintptr_t{256});
  a.cache.k = a.cache.v = fake;
  a.batch.token_seq = a.batch.token_pos = a.batch.page_table = fake_i;
  a.batch.max_pages_per_seq = 4;
  a.cache.page_size = 16;
  a.cache.num_kv_heads = 4;
  a.cache.head_dim = a.cache.v_head_dim = 512;
  a.q_heads = 32;
  a.rotary_dim = 128;
  message = test::error_message([&] { ops::cuda::launch_qkv_prologue(a, nullptr); });
  EXPECT_NE(message.find("head_dim 512"), std::string::npos) << message;
  a.cache.head_dim = a.cache.v_head_dim = 128;
  a.k_offset = 32 * 128;
  a.v_offset = a.k_offset + 4 * 128;
  a.row_stride = a.v_offset + 4 * 128 - 1;
  message = test::error_message([&] { ops::cuda::launch_qkv_prologue(a, nullptr); });
  EXPECT_NE(message.find("does not fit in order in row_stride 5119"), std::string::npos) << message;
  a.row_stride += 1;
  a.rotary_dim = 130;
  message = test::error_message([&] { ops::cuda::launch_qkv_prologue(a, nullptr); });
  EXPECT_NE(message.find("rotary_dim must be even and in [2, head_dim = 128], got 130"),
            std::string::npos)
      << message;
  a.rotary_dim = 128;
  a.delta = fake;  // a delta without the rows' slots
  message = test::error_message([&] { ops::cuda::launch_qkv_prologue(a, nullptr); });
  EXPECT_NE(message.find("delta and delta_slot are given together or not at all (got delta 1, "
                         "delta_slot 0)"),
            std::string::npos)
      << message;
  a.row_stride = 5121;  // with a delta the columns go 8 at a time
  message = test::error_message([&] { ops::cuda::launch_qkv_prologue(a, nullptr); });
  EXPECT_NE(message.find("with a delta, row_stride (5121)"), std::string::npos) << message;
}

}  // namespace
}  // namespace moelora
