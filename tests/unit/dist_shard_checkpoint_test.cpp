// The GPU ranks' shares of a checkpoint and of an adapter (dist/shard_checkpoint.h) on the parity
// fixtures: the rank's config counts its share; every split projection's rows / columns are the
// ones its heads or channels own, found here by index arithmetic written out per layer kind (GQA
// heads with Qwen3.5's [q | gate] rows, KV heads held by two ranks at 4 ranks, MLA heads, Gated
// DeltaNet's [q | k | v] channels, MLP channels); routed experts are the rank's block, as stored;
// adapters are cut like their base weights; uneven splits are refused naming what does not divide.
// Whether the shares compute the whole model is the GPU test's (tests/gpu/model_tp_gpu_test.cu).
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "core/device_collectives.h"
#include "dist/shard_checkpoint.h"
#include "io/checkpoint.h"
#include "io/peft.h"
#include "model/weights.h"
#include "support/dist_helpers.h"
#include "support/test_support.h"

namespace moelora::dist {
namespace {

using namespace test_helpers;

io::ModelWeights load(const std::string& fixture, const std::string& checkpoint = "base") {
  io::LoadOptions options;
  options.show_progress = false;
  return io::load_checkpoint(test::fixture(fixture) / checkpoint, options);
}

Tensor as_f32(const io::LinearWeight& w) {
  return w.format == io::WeightFormat::kDense ? w.weight.to_f32() : model::dequantize_linear(w);
}

// share [rows.size() * ..., C] of a 2-D (or leading-dimension) tensor: its row i equals whole's
// row rows[i], element for element.
void expect_rows(const Tensor& share, const Tensor& whole, const std::vector<int64_t>& rows,
                 const std::string& what) {
  const Tensor s = share.to_f32(), w = whole.to_f32();
  ASSERT_EQ(s.dim(0), static_cast<int64_t>(rows.size())) << what << " " << shape_str(s.shape());
  const int64_t cols = s.numel() / s.dim(0);
  ASSERT_EQ(cols, w.numel() / w.dim(0)) << what;
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(s.data<float>()[static_cast<int64_t>(i) * cols + c],
                w.data<float>()[rows[i] * cols + c])
          << what << ": row " << i << " (whole row " << rows[i] << "), column " << c;
}

// share [R, columns.size()] of whole [R, C]: column j equals whole's column columns[j].
void expect_columns(const Tensor& share, const Tensor& whole, const std::vector<int64_t>& columns,
                    const std::string& what) {
  const Tensor s = share.to_f32(), w = whole.to_f32();
  ASSERT_EQ(s.ndim(), 2) << what;
  ASSERT_EQ(s.dim(0), w.dim(0)) << what;
  ASSERT_EQ(s.dim(1), static_cast<int64_t>(columns.size())) << what;
  for (int64_t r = 0; r < s.dim(0); ++r)
    for (size_t j = 0; j < columns.size(); ++j)
      ASSERT_EQ(s.data<float>()[r * s.dim(1) + static_cast<int64_t>(j)],
                w.data<float>()[r * w.dim(1) + columns[j]])
          << what << ": row " << r << ", column " << j << " (whole column " << columns[j] << ")";
}

// The items [b * per, (b + 1) * per) of each block b in `blocks`, in order.
std::vector<int64_t> items_of(const std::vector<int64_t>& blocks, int64_t per) {
  std::vector<int64_t> out;
  for (int64_t b : blocks)
    for (int64_t i = 0; i < per; ++i) out.push_back(b * per + i);
  return out;
}
std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> out;
  for (int64_t i = begin; i < end; ++i) out.push_back(i);
  return out;
}

// B of a column-split target [E, out, R]: its rows (dimension 1) are `rows` of the whole's.
void expect_lora_b_rows(const LoraFactors& share, const LoraFactors& whole,
                        const std::vector<int64_t>& rows, const std::string& what) {
  ASSERT_TRUE(share.defined() && whole.defined()) << what;
  ASSERT_EQ(share.b.dim(0), 1) << what;
  const int64_t R = whole.b.dim(2);
  expect_rows(share.b.reshape({share.b.dim(1), R}), whole.b.reshape({whole.b.dim(1), R}), rows,
              what + " lora B");
  expect_rows(share.a.reshape({share.a.dim(1), share.a.dim(2)}),
              whole.a.reshape({whole.a.dim(1), whole.a.dim(2)}), range(0, whole.a.dim(1)),
              what + " lora A (whole)");
  EXPECT_EQ(share.scaling, whole.scaling) << what;
}

// A of a row-split target [1, R, in]: its columns are `columns` of the whole's.
void expect_lora_a_columns(const LoraFactors& share, const LoraFactors& whole,
                           const std::vector<int64_t>& columns, const std::string& what) {
  ASSERT_TRUE(share.defined() && whole.defined()) << what;
  expect_columns(share.a.reshape({share.a.dim(1), share.a.dim(2)}),
                 whole.a.reshape({whole.a.dim(1), whole.a.dim(2)}), columns, what + " lora A");
  expect_rows(share.b.reshape({share.b.dim(1), share.b.dim(2)}),
              whole.b.reshape({whole.b.dim(1), whole.b.dim(2)}), range(0, whole.b.dim(1)),
              what + " lora B (whole)");
}

TEST(DistShardCheckpoint, Qwen3MoeGqaHeadsChannelsAndExperts) {
  const io::ModelWeights w = load("qwen3_moe");
  const io::ModelConfig& c = w.config;  // 4 query heads of 16, 2 KV heads, 8 experts, dense I 96
  for (int n : {2, 4}) {
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(n));
      const io::ModelWeights s = shard_checkpoint(w, {r, n});
      EXPECT_EQ(s.config.num_attention_heads, 4 / n);
      EXPECT_EQ(s.config.num_key_value_heads, 1);  // 2 / 2, or the one KV head of its query heads
      EXPECT_EQ(s.config.num_experts, 8);          // the router scores every expert
      EXPECT_EQ(s.config.intermediate_size, 96 / n);
      const int64_t d = c.head_dim, per = 4 / n;
      // The vocabulary (512) divides: the rank's rows of the embedding and of lm_head.
      const int64_t v = c.vocab_size / n;
      EXPECT_EQ(s.config.vocab_size, c.vocab_size);  // the model's vocabulary, not the share
      expect_rows(s.embed_tokens.to_f32(), w.embed_tokens.to_f32(), range(r * v, (r + 1) * v),
                  "embed_tokens");
      ASSERT_EQ(s.lm_head.out_features, v);
      expect_rows(as_f32(s.lm_head), as_f32(w.lm_head), range(r * v, (r + 1) * v), "lm_head");
      // At 4 ranks the query heads r read KV head r / 2: ranks 0, 1 hold head 0, ranks 2, 3 head 1.
      const int64_t kv = n == 2 ? r : r / 2;
      for (size_t l = 0; l < w.layers.size(); ++l) {
        const io::LayerWeights &src = w.layers[l], &dst = s.layers[l];
        const std::string where = "layer " + std::to_string(l);
        expect_rows(as_f32(dst.q_proj), as_f32(src.q_proj),
                    items_of(range(r * per, (r + 1) * per), d), where + " q_proj");
        expect_rows(as_f32(dst.k_proj), as_f32(src.k_proj), items_of({kv}, d), where + " k_proj");
        expect_rows(as_f32(dst.v_proj), as_f32(src.v_proj), items_of({kv}, d), where + " v_proj");
        expect_columns(as_f32(dst.o_proj), as_f32(src.o_proj),
                       items_of(range(r * per, (r + 1) * per), d), where + " o_proj");
        EXPECT_EQ(dst.q_norm.raw_data(), src.q_norm.raw_data()) << where << ": q_norm is whole";
        if (!src.is_moe) {
          const int64_t ch = 96 / n;
          expect_rows(as_f32(dst.mlp.gate), as_f32(src.mlp.gate), range(r * ch, (r + 1) * ch),
                      where + " mlp gate");
          expect_rows(as_f32(dst.mlp.up), as_f32(src.mlp.up), range(r * ch, (r + 1) * ch),
                      where + " mlp up");
          expect_columns(as_f32(dst.mlp.down), as_f32(src.mlp.down), range(r * ch, (r + 1) * ch),
                         where + " mlp down");
          continue;
        }
        ASSERT_TRUE(dst.is_moe);
        EXPECT_EQ(dst.router.raw_data(), src.router.raw_data()) << where << ": router is whole";
        const int64_t e0 = r * (8 / n);
        ASSERT_EQ(dst.experts.num_experts, 8 / n);
        ASSERT_EQ(dst.experts.gate.size(), static_cast<size_t>(8 / n));
        for (int64_t e = 0; e < 8 / n; ++e) {
          // The rank's experts as stored: the same tensors, not copies.
          EXPECT_EQ(dst.experts.gate[e].weight.raw_data(),
                    src.experts.gate[e0 + e].weight.raw_data());
          EXPECT_EQ(dst.experts.down[e].name, src.experts.down[e0 + e].name);
        }
      }
    }
  }
  EXPECT_EQ(expert_range(c, {3, 4}).begin, 6);
  EXPECT_EQ(expert_range(c, {3, 4}).end, 8);
}

// The vocabulary's rows: an equal share when the ranks divide it, else (and for one rank) all of
// them; tied embeddings share the embedding's rows with lm_head.
TEST(DistShardCheckpoint, VocabularyRowsFollowVocabShard) {
  EXPECT_EQ(vocab_shard(512, 3, 4).begin, 384);
  EXPECT_EQ(vocab_shard(512, 3, 4).count, 128);
  EXPECT_TRUE(vocab_shard(512, 3, 4).split);
  for (const auto& [vocab, size] :
       std::vector<std::pair<int64_t, int>>{{511, 2}, {512, 1}, {100, 3}}) {
    const VocabShard whole = vocab_shard(vocab, 0, size);
    EXPECT_EQ(whole.begin, 0);
    EXPECT_EQ(whole.count, vocab);
    EXPECT_FALSE(whole.split);
  }
  io::ModelWeights w = load("qwen3_moe");
  w.tied_embeddings = true;
  w.lm_head.weight = w.embed_tokens;
  const io::ModelWeights s = shard_checkpoint(w, {1, 2});
  const int64_t v = w.config.vocab_size / 2;
  ASSERT_EQ(s.embed_tokens.dim(0), v);
  EXPECT_TRUE(s.tied_embeddings);
  EXPECT_EQ(s.lm_head.out_features, v);
  EXPECT_EQ(s.lm_head.weight.raw_data(), s.embed_tokens.raw_data());
  expect_rows(s.embed_tokens.to_f32(), w.embed_tokens.to_f32(), range(v, 2 * v), "embed_tokens");
}

TEST(DistShardCheckpoint, Qwen35GatedAttentionAndGatedDeltaNetChannels) {
  const io::ModelWeights w = load("qwen3_5_moe");
  const io::ModelConfig& c = w.config;
  const io::LinearAttentionConfig& la = c.linear_attention;  // 2 key heads, 4 value heads
  const int64_t dk = la.key_head_dim, dv = la.value_head_dim, key_dim = la.num_key_heads * dk;
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of 2");
    const io::ModelWeights s = shard_checkpoint(w, {r, 2});
    EXPECT_EQ(s.config.linear_attention.num_key_heads, 1);
    EXPECT_EQ(s.config.linear_attention.num_value_heads, 2);
    EXPECT_EQ(s.config.shared_expert_intermediate_size, c.shared_expert_intermediate_size / 2);
    int linear = 0, full = 0;
    for (size_t l = 0; l < w.layers.size(); ++l) {
      const io::LayerWeights &src = w.layers[l], &dst = s.layers[l];
      const std::string where = "layer " + std::to_string(l);
      if (src.is_linear_attention) {
        ++linear;
        // [q | k | v] channels: the rank's key head in q and in k, its two value heads in v.
        std::vector<int64_t> channels = range(r * dk, (r + 1) * dk);
        for (int64_t i : range(key_dim + r * dk, key_dim + (r + 1) * dk)) channels.push_back(i);
        for (int64_t i : range(2 * key_dim + 2 * r * dv, 2 * key_dim + (2 * r + 2) * dv))
          channels.push_back(i);
        const io::LinearAttentionWeights &a = src.linear_attn, &b = dst.linear_attn;
        expect_rows(as_f32(b.in_proj_qkv), as_f32(a.in_proj_qkv), channels, where + " in_proj_qkv");
        expect_rows(b.conv1d, a.conv1d, channels, where + " conv1d");
        expect_rows(as_f32(b.in_proj_z), as_f32(a.in_proj_z), range(2 * r * dv, (2 * r + 2) * dv),
                    where + " in_proj_z");
        expect_rows(as_f32(b.in_proj_b), as_f32(a.in_proj_b), range(2 * r, 2 * r + 2),
                    where + " in_proj_b");
        expect_rows(b.a_log, a.a_log, range(2 * r, 2 * r + 2), where + " A_log");
        expect_rows(b.dt_bias, a.dt_bias, range(2 * r, 2 * r + 2), where + " dt_bias");
        expect_columns(as_f32(b.out_proj), as_f32(a.out_proj), range(2 * r * dv, (2 * r + 2) * dv),
                       where + " out_proj");
        EXPECT_EQ(b.norm.raw_data(), a.norm.raw_data()) << where << ": the gated norm is whole";
      } else {
        ++full;
        // q_proj rows per head are [q | gate]: heads 2r, 2r + 1 bring 2 * head_dim rows each.
        expect_rows(as_f32(dst.q_proj), as_f32(src.q_proj),
                    items_of({2 * r, 2 * r + 1}, 2 * c.head_dim), where + " q_proj");
        expect_rows(as_f32(dst.k_proj), as_f32(src.k_proj), items_of({r}, c.head_dim),
                    where + " k_proj");
      }
      const int64_t ch = c.shared_expert_intermediate_size / 2;
      expect_rows(as_f32(dst.shared_expert.gate), as_f32(src.shared_expert.gate),
                  range(r * ch, (r + 1) * ch), where + " shared expert gate");
      expect_columns(as_f32(dst.shared_expert.down), as_f32(src.shared_expert.down),
                     range(r * ch, (r + 1) * ch), where + " shared expert down");
      EXPECT_EQ(dst.shared_expert_gate.raw_data(), src.shared_expert_gate.raw_data());
    }
    EXPECT_GT(linear, 0);
    EXPECT_GT(full, 0);
  }
}

TEST(DistShardCheckpoint, MlaHeadsAndFp8DenseWeightsDequantized) {
  for (const auto& [fixture, checkpoint] : std::vector<std::pair<std::string, std::string>>{
           {"deepseek_v3", "base"}, {"fp8", "deepseek_v3_fp8"}}) {
    const io::ModelWeights w = load(fixture, checkpoint);
    const io::ModelConfig& c = w.config;
    const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim,
                  kv = c.qk_nope_head_dim + c.v_head_dim, n = 2, per = c.num_attention_heads / n;
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(fixture + " rank " + std::to_string(r));
      const io::ModelWeights s = shard_checkpoint(w, {r, static_cast<int>(n)});
      for (size_t l = 0; l < w.layers.size(); ++l) {
        const io::LayerWeights &src = w.layers[l], &dst = s.layers[l];
        const std::string where = "layer " + std::to_string(l);
        const std::vector<int64_t> heads = range(r * per, (r + 1) * per);
        // The latents feed every head: whole, in their own format.
        EXPECT_EQ(dst.kv_a_proj_with_mqa.weight.raw_data(),
                  src.kv_a_proj_with_mqa.weight.raw_data());
        EXPECT_EQ(dst.kv_a_proj_with_mqa.format, src.kv_a_proj_with_mqa.format);
        if (c.q_lora_rank > 0)
          expect_rows(as_f32(dst.q_b_proj), as_f32(src.q_b_proj), items_of(heads, qk),
                      where + " q_b_proj");
        else
          expect_rows(as_f32(dst.q_proj), as_f32(src.q_proj), items_of(heads, qk),
                      where + " q_proj");
        EXPECT_EQ(dst.kv_b_proj.format, io::WeightFormat::kDense) << where;
        expect_rows(as_f32(dst.kv_b_proj), as_f32(src.kv_b_proj), items_of(heads, kv),
                    where + " kv_b_proj");
        expect_columns(as_f32(dst.o_proj), as_f32(src.o_proj), items_of(heads, c.v_head_dim),
                       where + " o_proj");
        if (src.is_moe) {
          // FP8 experts stay FP8.
          EXPECT_EQ(dst.experts.gate[0].format, src.experts.gate[0].format);
        }
      }
    }
  }
}

TEST(DistShardCheckpoint, AdaptersAreCutLikeTheirWeights) {
  const io::ModelWeights w = load("qwen3_moe");
  const io::ModelConfig& c = w.config;
  const int64_t d = c.head_dim;
  for (const std::string name : {"lora_per_expert", "lora_shared_outer", "lora_peft3d"}) {
    const io::LoraAdapter a = io::load_adapter(test::fixture("qwen3_moe") / name, c, name);
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE(name + " rank " + std::to_string(r));
      const io::LoraAdapter s = shard_adapter(a, c, {r, 2});
      EXPECT_EQ(s.name, a.name);
      EXPECT_EQ(s.max_rank, a.max_rank);
      for (size_t l = 0; l < a.layers.size(); ++l) {
        const io::LayerLora &src = a.layers[l], &dst = s.layers[l];
        const std::string where = "layer " + std::to_string(l);
        if (src.q_proj.defined())
          expect_lora_b_rows(dst.q_proj, src.q_proj, items_of({2 * r, 2 * r + 1}, d),
                             where + " q_proj");
        if (src.k_proj.defined())
          expect_lora_b_rows(dst.k_proj, src.k_proj, items_of({r}, d), where + " k_proj");
        if (src.o_proj.defined())
          expect_lora_a_columns(dst.o_proj, src.o_proj, items_of({2 * r, 2 * r + 1}, d),
                                where + " o_proj");
        for (LoraFactors io::LayerLora::*f :
             {&io::LayerLora::experts_gate_up, &io::LayerLora::experts_down}) {
          const LoraFactors &whole = src.*f, &share = dst.*f;
          if (!whole.defined()) continue;
          for (const auto& [part, cut] :
               {std::pair{&whole.a, &share.a}, std::pair{&whole.b, &share.b}}) {
            if (part->dim(0) == 1) {  // shared-outer: every rank keeps it whole
              EXPECT_EQ(cut->shape(), part->shape()) << where;
              expect_rows(*cut, *part, range(0, 1), where + " shared-outer factor");
            } else {
              expect_rows(*cut, *part, range(r * 4, r * 4 + 4), where + " per-expert factor");
            }
          }
        }
        if (src.mlp_down.defined())
          expect_lora_a_columns(dst.mlp_down, src.mlp_down, range(r * 48, r * 48 + 48),
                                where + " mlp down");
        if (src.mlp_gate.defined())
          expect_lora_b_rows(dst.mlp_gate, src.mlp_gate, range(r * 48, r * 48 + 48),
                             where + " mlp gate");
      }
    }
  }
}

TEST(DistShardCheckpoint, UnevenSplitsAreRefusedNamingWhatDoesNotDivide) {
  const io::ModelWeights qwen = load("qwen3_moe");
  expect_error_mentions(
      [&] {
        shard_checkpoint(qwen, {0, 3});
      },
      {"attention query heads", "4 is not divisible by 3"});
  expect_error_mentions(
      [&] {
        rank_config(qwen.config, {0, 8});
      },
      {"attention query heads", "4 is not divisible by 8"});
  const io::ModelWeights kimi = load("kimi_like");  // 4 heads, 12 experts
  expect_error_mentions([&] { rank_config(kimi.config, {1, 8}); }, {"not divisible by 8"});
  EXPECT_EQ(rank_config(kimi.config, {1, 4}).num_attention_heads, 1);
  expect_error_mentions(
      [&] {
        expert_range(kimi.config, {0, 8});
      },
      {"routed experts", "12 is not divisible by 8"});
  const io::ModelWeights q35 = load("qwen3_5_moe");  // 2 linear-attention key heads
  expect_error_mentions(
      [&] {
        shard_checkpoint(q35, {0, 4});
      },
      {"Gated DeltaNet key heads", "2 is not divisible by 4"});
}

}  // namespace
}  // namespace moelora::dist
