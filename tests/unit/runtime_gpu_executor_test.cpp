// Unit tests of the CUDA-free half of the GPU executor (src/runtime/gpu_executor.h): decode
// buckets, the KV page allocator, the step metadata plan (slot grouping, LoRA segments, positions,
// page tables, padding, graphs).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "io/hf_config.h"
#include "runtime/gpu_executor.h"
#include "support/test_support.h"

namespace moelora::runtime {
namespace {

using test::contains;
using test::error_of;
using test::fixture;

TEST(GpuExecutorHost, DecodeBuckets) {
  EXPECT_EQ(decode_buckets(128), (std::vector<int>{1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128}));
  EXPECT_EQ(decode_buckets(5), (std::vector<int>{1, 2, 4, 5}));
  EXPECT_EQ(decode_buckets(1), (std::vector<int>{1}));
  EXPECT_EQ(decode_buckets(100), (std::vector<int>{1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100}));
  EXPECT_EQ(decode_buckets(200).back(), 200);
  EXPECT_EQ(decode_buckets(200)[decode_buckets(200).size() - 2], 192);
  const std::vector<int> b = decode_buckets(100);
  EXPECT_EQ(decode_bucket(1, b), 1);
  EXPECT_EQ(decode_bucket(3, b), 4);
  EXPECT_EQ(decode_bucket(17, b), 24);
  EXPECT_EQ(decode_bucket(97, b), 100);
  EXPECT_EQ(decode_bucket(101, b), -1);
  EXPECT_EQ(decode_bucket(1, std::vector<int>{}), -1);
}

TEST(GpuExecutorHost, MoeStreamScheduleNames) {
  EXPECT_EQ(moe_stream_schedule_from_name("auto"), -1);
  EXPECT_EQ(moe_stream_schedule_from_name("round-robin"), 0);
  EXPECT_EQ(moe_stream_schedule_from_name("claimed"), 1);
  const std::string message = error_of([] { moe_stream_schedule_from_name("roundrobin"); });
  EXPECT_TRUE(contains(message, "'roundrobin'")) << message;
  EXPECT_TRUE(contains(message, "auto, claimed or round-robin")) << message;
}

TEST(GpuExecutorHost, PageAllocator) {
  PageAllocator pages(5, 4, 3);  // 5 pages of 4 tokens; a sequence holds at most 12 tokens
  EXPECT_EQ(pages.max_length(), 12);
  const SequenceHandle a = pages.new_sequence(), b = pages.new_sequence();
  pages.reserve(a, 5);  // 2 pages
  EXPECT_EQ(pages.pages(a), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(pages.length(a), 0);  // not committed yet
  pages.commit(a, 5);
  EXPECT_EQ(pages.length(a), 5);
  pages.reserve(b, 4);
  pages.commit(b, 4);
  EXPECT_EQ(pages.pages(b), (std::vector<int32_t>{2}));
  pages.reserve(a, 8);  // still 2 pages
  EXPECT_EQ(pages.pages(a).size(), 2u);
  pages.reserve(a, 9);  // a third
  EXPECT_EQ(pages.pages(a), (std::vector<int32_t>{0, 1, 3}));
  pages.rollback(a);  // the forward failed: back to 5 tokens, 2 pages
  EXPECT_EQ(pages.pages(a), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(pages.free_pages(), 2);
  // Beyond the page table, and beyond the pool: kOutOfRange, nothing changes.
  EXPECT_TRUE(contains(error_of([&] { pages.reserve(a, 13); }), "the KV page table holds 12"));
  pages.reserve(b, 12);  // 2 more pages: the pool is empty now
  EXPECT_EQ(pages.free_pages(), 0);
  EXPECT_TRUE(contains(error_of([&] { pages.reserve(a, 9); }), "the KV cache is full"));
  EXPECT_EQ(pages.pages(a).size(), 2u);
  pages.free_sequence(b);
  EXPECT_EQ(pages.free_pages(), 3);
  EXPECT_FALSE(pages.live(b));
  EXPECT_TRUE(contains(error_of([&] { pages.free_sequence(b); }), "not live"));
  const SequenceHandle c = pages.new_sequence();
  pages.reserve(c, 1);
  EXPECT_EQ(pages.pages(c), (std::vector<int32_t>{2}));  // b's first page comes back first
  EXPECT_EQ(pages.live_sequences(), 2);
  EXPECT_TRUE(contains(error_of([] { PageAllocator(0, 4, 1); }), "num_pages 0"));
}

struct PlanFixture {
  StepCapacity cap{16, 6, 3, 4, 100};  // 16 rows, 6 sequences, 3 slots, 4 pages of 8, vocab 100
  PageAllocator pages{20, 8, 4};
  std::vector<bool> occupied{true, true, false};
  std::vector<int> buckets = decode_buckets(6);
  GpuStepPlan plan;
};

// A mixed batch: prefill chunks and decodes, two adapters and base rows, known lengths.
TEST(GpuExecutorHost, PlanGroupsRowsBySlotWithSegmentsPositionsAndPages) {
  PlanFixture f;
  const SequenceHandle s0 = f.pages.new_sequence(), s1 = f.pages.new_sequence(),
                       s2 = f.pages.new_sequence(), s3 = f.pages.new_sequence();
  f.pages.reserve(s1, 9);  // s1 has 9 tokens cached (2 pages), s3 has 3
  f.pages.commit(s1, 9);
  f.pages.reserve(s3, 3);
  f.pages.commit(s3, 3);
  const std::vector<int32_t> t0 = {5, 6, 7}, t1 = {8}, t2 = {9, 10}, t3 = {11};
  // batch order: base, slot 1, slot 0, slot 1
  const std::vector<BatchEntry> batch = {{s0, t0, -1}, {s1, t1, 1}, {s2, t2, 0}, {s3, t3, 1}};
  std::vector<ops::SampleRowParams> params(4);
  params[1].temperature = 0.5f;
  const std::vector<float> uniforms = {0.0f, 0.25f, 0.0f, 0.0f};
  plan_gpu_step(batch, params, uniforms, f.cap, f.buckets, f.occupied, f.pages, f.plan);
  const GpuStepPlan& p = f.plan;
  // Slot 0 first, then slot 1 (batch order kept), base last.
  EXPECT_EQ(p.order, (std::vector<int>{2, 1, 3, 0}));
  EXPECT_EQ(p.num_tokens, 7);
  EXPECT_EQ(p.num_seqs, 4);
  EXPECT_FALSE(p.graph);  // prefill chunks: eager at the exact size
  EXPECT_EQ(p.rows, 7);
  EXPECT_EQ(p.seqs, 4);
  EXPECT_EQ(p.max_q_len, 3);
  EXPECT_EQ(p.max_kv_len, 10);  // s1: 9 + 1
  EXPECT_TRUE(p.lora);
  EXPECT_EQ(p.single_slot, -1);  // two slots
  const std::vector<int32_t> ids = {9, 10, 8, 11, 5, 6, 7};
  const std::vector<int32_t> slot = {0, 0, 1, 1, -1, -1, -1};
  const std::vector<int32_t> seq = {0, 0, 1, 2, 3, 3, 3};
  const std::vector<int32_t> pos = {0, 1, 9, 3, 0, 1, 2};
  for (int r = 0; r < 16; ++r) {
    const bool valid = r < 7;
    EXPECT_EQ(p.token_ids[r], valid ? ids[r] : 0) << r;
    EXPECT_EQ(p.token_slot[r], valid ? slot[r] : -1) << r;
    EXPECT_EQ(p.token_seq[r], valid ? seq[r] : -1) << r;
    EXPECT_EQ(p.token_pos[r], valid ? pos[r] : 0) << r;
  }
  EXPECT_EQ(p.q_start, (std::vector<int32_t>{0, 2, 3, 4, 0, 0}));
  EXPECT_EQ(p.q_len, (std::vector<int32_t>{2, 1, 1, 3, 0, 0}));
  EXPECT_EQ(p.kv_len, (std::vector<int32_t>{2, 10, 4, 3, 0, 0}));
  EXPECT_EQ(p.last_row, (std::vector<int32_t>{1, 2, 3, 6, 0, 0}));
  EXPECT_EQ(p.num_lora_segments, 2);
  EXPECT_EQ(p.lora_segments, (std::vector<int32_t>{0, 0, 0, 2, 1, 0, 2, 4, 0, 0, 0, 0}));
  // Page tables: each sequence's pages (reserved now for the new tokens), zeros elsewhere.
  for (int k = 0; k < 6; ++k) {
    std::vector<int32_t> row(p.page_table.begin() + k * 4, p.page_table.begin() + k * 4 + 4);
    std::vector<int32_t> expected(4, 0);
    if (k < 4) {
      const std::vector<int32_t>& held = f.pages.pages(batch[p.order[k]].sequence);
      std::copy(held.begin(), held.end(), expected.begin());
      const int64_t kv = p.kv_len[k];
      EXPECT_EQ(static_cast<int64_t>(held.size()), (kv + 7) / 8) << k;
    }
    EXPECT_EQ(row, expected) << "sequence " << k;
  }
  // Linear-attention rows: sequence k's rows [cu_seqlens[k], cu_seqlens[k + 1]), padding
  // sequences empty at num_tokens; state slots left for the executor (-1).
  EXPECT_EQ(p.cu_seqlens, (std::vector<int32_t>{0, 2, 3, 4, 7, 7, 7}));
  EXPECT_EQ(p.state_slot, (std::vector<int32_t>(6, -1)));
  EXPECT_FLOAT_EQ(p.sample_params[1].temperature, 0.5f);  // batch entry 1 is sequence 1
  EXPECT_FLOAT_EQ(p.uniform[1], 0.25f);
  EXPECT_EQ(p.sample_params[0].temperature, 0.0f);
  // Nothing committed: lengths are the caller's to commit.
  EXPECT_EQ(f.pages.length(s1), 9);
}

TEST(GpuExecutorHost, DecodeOnlyBatchesBecomeGraphBuckets) {
  PlanFixture f;
  std::vector<SequenceHandle> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back(f.pages.new_sequence());
  f.pages.reserve(seqs[2], 17);
  f.pages.commit(seqs[2], 17);
  const std::vector<int32_t> tok = {42};
  const std::vector<BatchEntry> batch = {{seqs[0], tok, 1}, {seqs[1], tok, -1}, {seqs[2], tok, 1}};
  plan_gpu_step(batch, {}, {}, f.cap, f.buckets, f.occupied, f.pages, f.plan);
  const GpuStepPlan& p = f.plan;
  EXPECT_TRUE(p.graph);
  EXPECT_EQ(p.rows, 4);  // bucket of 3
  EXPECT_EQ(p.seqs, 4);
  EXPECT_EQ(p.num_seqs, 3);
  EXPECT_EQ(p.max_q_len, 1);
  EXPECT_EQ(p.max_kv_len, 32);   // page-table capacity: any length fits the graph
  EXPECT_EQ(p.single_slot, -1);  // never baked into a graph
  EXPECT_EQ(p.order, (std::vector<int>{0, 2, 1}));
  EXPECT_EQ(p.num_lora_segments, 1);
  EXPECT_EQ(std::vector<int32_t>(p.lora_segments.begin(), p.lora_segments.begin() + 4),
            (std::vector<int32_t>{1, 0, 0, 2}));
  EXPECT_EQ(p.token_seq[3], -1);  // padding row of the bucket
  EXPECT_EQ(p.q_len[3], 0);       // padding sequence
  EXPECT_EQ(p.token_pos[1], 17);

  // Without buckets (graphs off) the same batch runs eagerly at its size; one slot -> fast path.
  f.pages.rollback(seqs[0]);
  f.pages.rollback(seqs[1]);
  f.pages.rollback(seqs[2]);
  const std::vector<BatchEntry> one_slot = {{seqs[0], tok, 1}, {seqs[2], tok, 1}};
  plan_gpu_step(one_slot, {}, {}, f.cap, {}, f.occupied, f.pages, f.plan);
  EXPECT_FALSE(f.plan.graph);
  EXPECT_EQ(f.plan.rows, 2);
  EXPECT_EQ(f.plan.single_slot, 1);
  EXPECT_EQ(f.plan.max_kv_len, 18);
}

TEST(GpuExecutorHost, BadBatchesThrowAndReserveNothing) {
  PlanFixture f;
  const SequenceHandle a = f.pages.new_sequence(), b = f.pages.new_sequence();
  const std::vector<int32_t> tok = {1, 2}, bad = {100}, none = {};
  auto plan = [&](std::vector<BatchEntry> batch) {
    return error_of(
        [&] { plan_gpu_step(batch, {}, {}, f.cap, f.buckets, f.occupied, f.pages, f.plan); });
  };
  EXPECT_TRUE(contains(plan({{a, tok, 2}}), "slot 2, which is empty"));
  EXPECT_TRUE(contains(plan({{a, tok, 3}}), "outside [-1, 3)"));
  EXPECT_TRUE(contains(plan({{a, tok, -1}, {a, tok, -1}}), "appears twice"));
  EXPECT_TRUE(contains(plan({{a, bad, -1}}), "token id 100 is outside the vocabulary"));
  EXPECT_TRUE(contains(plan({{a, none, -1}}), "has no tokens"));
  EXPECT_TRUE(contains(plan({}), "empty batch"));
  const std::vector<int32_t> many(17, 1);
  EXPECT_TRUE(contains(plan({{a, many, -1}}), "forward of 17 tokens; the limit is 16"));
  // b fits, a does not (30 + 3 tokens, beyond its page table): b's reservation is undone.
  const std::vector<int32_t> three = {1, 2, 3};
  f.pages.reserve(a, 30);
  f.pages.commit(a, 30);
  EXPECT_TRUE(contains(plan({{b, tok, -1}, {a, three, -1}}), "the KV page table holds 32"));
  EXPECT_TRUE(f.pages.pages(b).empty());
  EXPECT_EQ(f.pages.pages(a).size(), 4u);
  const std::vector<ops::SampleRowParams> params(1);
  EXPECT_TRUE(contains(error_of([&] {
                         const std::vector<BatchEntry> batch = {{b, tok, -1}};
                         plan_gpu_step(batch, params, {}, f.cap, f.buckets, f.occupied, f.pages,
                                       f.plan);
                       }),
                       "sampling params"));
}

TEST(GpuExecutorHost, EstimatesScaleWithTheShapes) {
  const io::ModelConfig qwen = io::load_model_config(fixture("qwen3_moe") / "base");
  const io::ModelConfig deepseek = io::load_model_config(fixture("deepseek_v3") / "base");
  // GQA: layers x 2 (K, V) x KV heads x head_dim x 2 bytes; MLA: layers x (latent + rope) x 2.
  EXPECT_EQ(estimate_kv_bytes_per_token(qwen),
            static_cast<uint64_t>(qwen.num_hidden_layers * 2 * qwen.num_key_value_heads *
                                  qwen.head_dim * 2));
  EXPECT_EQ(estimate_kv_bytes_per_token(deepseek),
            static_cast<uint64_t>(deepseek.num_hidden_layers *
                                  (deepseek.kv_lora_rank + deepseek.qk_rope_head_dim) * 2));
  const ExecutorLimits none{64, 4, 0, 8}, slots{64, 4, 4, 8};
  const uint64_t bf16 = estimate_gpu_model_bytes(qwen, false, none);
  EXPECT_LT(estimate_gpu_model_bytes(qwen, true, none), bf16);    // FP8 experts are smaller
  EXPECT_GT(estimate_gpu_model_bytes(qwen, false, slots), bf16);  // adapter pool
  const io::ModelConfig one = first_layers(qwen, 1);
  EXPECT_EQ(one.num_hidden_layers, 1);
  EXPECT_LT(estimate_gpu_model_bytes(one, false, none), bf16);
  EXPECT_EQ(first_layers(qwen, 0), qwen);
  EXPECT_EQ(first_layers(qwen, 99), qwen);
  // Two ranks: a vocabulary they divide (512) is split, its embedding and lm_head halved, and the
  // logits workspace grows by the gathered blocks and the rank's columns; one they do not (511)
  // stays whole. The experts' halving is the same in both, so it drops out of the difference.
  io::ModelConfig odd = qwen;
  odd.vocab_size = 511;
  const auto rank_saving = [&](const io::ModelConfig& c) {
    return static_cast<int64_t>(estimate_gpu_model_bytes(c, false, none, 1)) -
           static_cast<int64_t>(estimate_gpu_model_bytes(c, false, none, 2));
  };
  EXPECT_EQ(rank_saving(qwen) - rank_saving(odd),
            256 * qwen.hidden_size * 2 * 2 - int64_t{4} * (512 + 256) * 4);

  // NVFP4 experts stay packed when H and I are multiples of 128: 9/16 of a byte per weight
  // (codes + e4m3 group scales) and an fp32 scale_2 per row, against FP8's byte and 128 x 128
  // scales; smaller shapes fall back to bf16 experts.
  io::ModelConfig wide = qwen;
  wide.hidden_size = 256;
  wide.moe_intermediate_size = 128;
  io::ModelConfig wide_nvfp4 = wide;
  wide_nvfp4.quant.method = io::QuantMethod::kNvfp4;
  uint64_t moe_layers = 0;
  for (int64_t l = 0; l < wide.num_hidden_layers; ++l) moe_layers += wide.is_moe_layer(l) ? 1 : 0;
  ASSERT_GT(moe_layers, 0u);
  const uint64_t we = wide.num_experts, wh = 256, wi = 128;
  const uint64_t fp8_experts = we * 3 * wh * wi + we * 3 * wh * wi / (128 * 128) * 4;
  const uint64_t nvfp4_experts = we * 3 * wh * wi * 9 / 16 + we * (2 * wi + wh) * 4;
  EXPECT_EQ(estimate_gpu_model_bytes(wide, true, none) - estimate_gpu_model_bytes(wide_nvfp4, false, none),
            moe_layers * (fp8_experts - nvfp4_experts));
  // The workspace's width: the top_k factor multiplies the expert width, not a dense MLP's (a
  // wide dense layer must not count as k times wider).
  io::ModelConfig wide_dense = qwen;
  wide_dense.intermediate_size = 64 * qwen.moe_intermediate_size * qwen.num_experts_per_tok;
  const uint64_t T = static_cast<uint64_t>(none.max_batch_tokens);
  uint64_t dense_layers = 0;  // the fixture's mlp_only_layers: their gate / up / down grow too
  for (int64_t l = 0; l < qwen.num_hidden_layers; ++l) dense_layers += qwen.is_moe_layer(l) ? 0 : 1;
  const uint64_t dense_growth = dense_layers * 3 * static_cast<uint64_t>(qwen.hidden_size) *
                                static_cast<uint64_t>(wide_dense.intermediate_size - qwen.intermediate_size) * 2;
  EXPECT_EQ(estimate_gpu_model_bytes(wide_dense, false, none) - bf16,
            dense_growth + 8 * T * 4 *
                (2 * static_cast<uint64_t>(wide_dense.intermediate_size) -
                 std::max<uint64_t>({static_cast<uint64_t>(qwen.hidden_size),
                                     2 * static_cast<uint64_t>(qwen.num_experts_per_tok * qwen.moe_intermediate_size),
                                     2 * static_cast<uint64_t>(qwen.intermediate_size)})));
  io::ModelConfig narrow_nvfp4 = qwen;  // the fixture's H and I are not multiples of 128
  narrow_nvfp4.quant.method = io::QuantMethod::kNvfp4;
  EXPECT_EQ(estimate_gpu_model_bytes(narrow_nvfp4, false, none), bf16);

  // Qwen3.5: only the full-attention layers hold KV rows; each Gated DeltaNet layer holds a bf16
  // conv state [conv_dim, K - 1] and an fp32 recurrent state [nv, dk, dv] per sequence.
  const io::ModelConfig q35 = io::load_model_config(fixture("qwen3_5_moe") / "base");
  const io::LinearAttentionConfig& la = q35.linear_attention;
  int64_t linear = 0;
  for (int64_t l = 0; l < q35.num_hidden_layers; ++l) linear += is_linear_attention_layer(q35, l);
  EXPECT_EQ(linear, 4);
  EXPECT_EQ(estimate_kv_bytes_per_token(q35),
            static_cast<uint64_t>(1 * 2 * q35.num_key_value_heads * q35.head_dim * 2));
  const int64_t conv_dim =
      2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim;
  EXPECT_EQ(linear_attention_state_bytes(q35),
            static_cast<uint64_t>(linear *
                                  (conv_dim * (la.conv_kernel_dim - 1) * 2 +
                                   la.num_value_heads * la.key_head_dim * la.value_head_dim * 4)));
  EXPECT_EQ(linear_attention_state_bytes(qwen), 0u);
  // The linear layers' projections are what for_each_dense_linear lists for them.
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for_each_dense_linear(q35, 0, [&](int64_t out, int64_t in) { shapes.emplace_back(out, in); });
  const int64_t H = q35.hidden_size, vd = la.num_value_heads * la.value_head_dim;
  const std::vector<std::pair<int64_t, int64_t>> expected = {
      {conv_dim, H},
      {vd, H},
      {la.num_value_heads, H},
      {la.num_value_heads, H},
      {H, vd},
      {q35.shared_expert_intermediate_size, H},
      {q35.shared_expert_intermediate_size, H},
      {H, q35.shared_expert_intermediate_size}};
  EXPECT_EQ(shapes, expected);
}

// The executor's memory plan and the layer count `moelora bench --max-layers fit` runs: the plan
// is the executor's arithmetic (model estimate, KV pages of full-length sequences, 1 GiB + 2 % of
// the device kept free), and the fit is the largest leading layer count whose plan fits
// gpu_memory_fraction of the free memory.
TEST(GpuExecutorHost, MemoryPlanAndTheLayersThatFit) {
  io::ModelConfig qwen = io::load_model_config(fixture("qwen3_moe") / "base");
  qwen.num_hidden_layers = 12;  // more layers to choose from (the per-layer lists are cut below)
  qwen.mlp_only_layers.clear();
  GpuExecutorOptions o;
  o.limits = {256, 8, 2, 16};
  o.page_size = 64;
  o.max_seq_len = 300;
  o.gpu_memory_fraction = 0.5;
  const uint64_t total = 80ull << 30;

  const GpuMemoryPlan plan = plan_gpu_memory(qwen, o, total);
  EXPECT_EQ(plan.model_bytes, estimate_gpu_model_bytes(qwen, false, o.limits));
  EXPECT_EQ(plan.max_seq_len, 300);
  EXPECT_EQ(plan.max_pages_per_seq, 5);  // ceil(300 / 64)
  EXPECT_EQ(plan.page_bytes, estimate_kv_bytes_per_token(qwen) * 64);
  EXPECT_EQ(plan.full_kv_bytes, plan.page_bytes * 5 * 8);
  EXPECT_EQ(plan.slack_bytes, (1ull << 30) + total / 50);
  // The default length, capped by the model's positions.
  o.max_seq_len = 0;
  EXPECT_EQ(plan_gpu_memory(qwen, o, total).max_seq_len,
            std::min(kDefaultMaxSeqLen, qwen.max_position_embeddings));
  o.max_seq_len = 300;
  // An expert-parallel rank holds a share of the experts.
  EXPECT_LT(plan_gpu_memory(qwen, o, total, 4).model_bytes, plan.model_bytes);

  // What k leading layers need; the free memory that holds exactly k of them.
  auto need = [&](int64_t k) {
    const GpuMemoryPlan p = plan_gpu_memory(first_layers(qwen, k), o, total);
    return p.model_bytes + p.full_kv_bytes + p.slack_bytes;
  };
  for (int64_t k = 2; k <= qwen.num_hidden_layers; ++k) EXPECT_GT(need(k), need(k - 1));
  for (const int64_t k : {1, 5, 11}) {
    const uint64_t free_exact = static_cast<uint64_t>(static_cast<double>(need(k)) / 0.5) + 2;
    EXPECT_EQ(gpu_layers_that_fit(qwen, o, free_exact, total), k) << k;
    EXPECT_EQ(gpu_layers_that_fit(qwen, o, free_exact - 4, total), k - 1) << k;
  }
  EXPECT_EQ(gpu_layers_that_fit(qwen, o, 1ull << 50, total), qwen.num_hidden_layers);
  EXPECT_EQ(gpu_layers_that_fit(qwen, o, 1ull << 30, total), 0);  // below the slack alone
  // A longer sequence or more of them leave room for fewer layers.
  const uint64_t free_eleven = static_cast<uint64_t>(static_cast<double>(need(11)) / 0.5) + 2;
  GpuExecutorOptions longer = o;
  longer.max_seq_len = 512;
  EXPECT_LT(gpu_layers_that_fit(qwen, longer, free_eleven, total), 11);
}

}  // namespace
}  // namespace moelora::runtime
