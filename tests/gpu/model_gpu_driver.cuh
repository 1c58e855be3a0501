// The GPU model tests' driver (model_gpu_test.cu, model_shapes_gpu_test.cu): the step metadata a
// scheduler would fill, row order by slot, LoRA segments and KV pages handed out by the test; the
// logits bounds of the whole model; the graph-replay check (a decode step captured once, replayed
// with other sequences, slot maps and adapters, bitwise equal to the eager forward).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "model/gpu_model_cuda.cuh"
#include "model/sampler.h"

namespace moelora::model::gpu_model_test {

constexpr int kPromptTokens = 12;
constexpr int kGreedyTokens = 16;

// Limits for batches of up to `max_batch` sequences of at most `prompt_tokens` new tokens each
// (prefill of every prompt in one forward) and prompt_tokens + kGreedyTokens positions.
inline GpuModelLimits small_limits(int max_batch = 6, int prompt_tokens = kPromptTokens) {
  GpuModelLimits limits;
  limits.max_tokens = std::max(64, max_batch * prompt_tokens);
  limits.max_seqs = max_batch;
  limits.num_slots = 4;
  limits.max_rank = 16;
  limits.page_size = 16;
  // e.g. 64 positions >= prompt 12 + 16 generated
  limits.max_pages_per_seq = std::max(4, (prompt_tokens + kGreedyTokens + 15) / 16);
  // Every sequence of a batch at full length, plus the graph test's replacement sequences.
  limits.num_pages = static_cast<int64_t>(max_batch + 2) * limits.max_pages_per_seq;
  return limits;
}

// Routing of one forward's rows of one sequence: MoE layer -> expert ids [rows * k] (each row in
// descending selection score).
using RouteMap = std::map<int64_t, std::vector<int32_t>>;

// One sequence as the test's scheduler sees it.
struct GpuSequence {
  int32_t slot = -1;
  int kv_len = 0;
  std::vector<int32_t> pages;
  int32_t state = -1;  // linear-attention state slot (models with Gated DeltaNet layers)
};

// Fills the step metadata of GpuModel for a batch of (sequence, new tokens), runs forwards and
// reads the results back. Sequences are ordered by slot (adapter rows grouped, base rows last),
// as the executor does; results come back in the caller's order.
class Driver {
 public:
  explicit Driver(GpuModel& model) : model_(model) {
    const GpuModelLimits& l = model.limits();
    for (int64_t p = l.num_pages - 1; p >= 0; --p) free_pages_.push_back(static_cast<int32_t>(p));
    for (int32_t s = model.num_state_slots() - 1; s >= 0; --s) free_states_.push_back(s);
  }

  // Linear-attention models: a new sequence takes a free state slot, zeroed here, as the executor
  // does at admission.
  int add_sequence(int32_t slot) {
    const int id = static_cast<int>(seqs_.size());
    seqs_.push_back({slot, 0, {}});
    if (model_.num_state_slots() > 0) {
      if (free_states_.empty()) throw std::logic_error("the test ran out of state slots");
      seqs_[id].state = free_states_.back();
      free_states_.pop_back();
      model_.reset_state(seqs_[id].state, model_.main_stream());
    }
    return id;
  }
  // A state slot for the test's own use (taken from the free ones).
  int32_t take_state_slot() {
    if (free_states_.empty()) throw std::logic_error("the test ran out of state slots");
    const int32_t s = free_states_.back();
    free_states_.pop_back();
    return s;
  }
  void drop_sequence(int id) {
    for (int32_t p : seqs_[id].pages) free_pages_.push_back(p);
    seqs_[id].pages.clear();
    seqs_[id].kv_len = 0;
    if (seqs_[id].state >= 0) free_states_.push_back(seqs_[id].state);
    seqs_[id].state = -1;
  }
  GpuSequence& sequence(int id) { return seqs_[id]; }
  // Batch row of the last prepare()'s item i (rows are ordered by adapter slot).
  int position(size_t item) const { return position_[item]; }

  struct Item {
    int seq;
    std::vector<int32_t> tokens;
  };

  // Writes the host metadata for `items`; tokens / seqs > 0 pad to that capacity. Returns the
  // forward shape; `order` receives the batch position of each item.
  ForwardShape prepare(const std::vector<Item>& items, int tokens_capacity = 0,
                       int seqs_capacity = 0, bool graph_kv_bound = false) {
    const GpuModelLimits& l = model_.limits();
    StepMetadata& h = model_.host_step();
    // The host mirror is one pinned block (token_ids, then token_slot, ...): a batch above the
    // limits would overwrite the next array, so refuse it before writing anything.
    int total_rows = 0;
    for (const Item& item : items) total_rows += static_cast<int>(item.tokens.size());
    if (total_rows > l.max_tokens || static_cast<int>(items.size()) > l.max_seqs ||
        tokens_capacity > l.max_tokens || seqs_capacity > l.max_seqs) {
      throw std::logic_error(
          "test batch of " + std::to_string(total_rows) + " rows / " +
          std::to_string(items.size()) + " sequences exceeds the model limits (" +
          std::to_string(l.max_tokens) + " / " + std::to_string(l.max_seqs) + ")");
    }
    std::vector<int> order(items.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const int32_t sa = seqs_[items[a].seq].slot, sb = seqs_[items[b].seq].slot;
      return (sa < 0 ? INT32_MAX : sa) < (sb < 0 ? INT32_MAX : sb);
    });
    position_.assign(items.size(), 0);
    item_rows_.assign(items.size(), {0, 0});
    ForwardShape shape;
    int row = 0, max_q = 0, max_kv = 0;
    std::vector<int32_t> slots_seen;
    for (int b = 0; b < static_cast<int>(order.size()); ++b) {
      const Item& item = items[order[b]];
      position_[order[b]] = b;
      GpuSequence& s = seqs_[item.seq];
      const int len = static_cast<int>(item.tokens.size());
      const int kv = s.kv_len + len;
      while (static_cast<int>(s.pages.size()) * l.page_size < kv) {
        EXPECT_FALSE(free_pages_.empty()) << "the test ran out of KV pages";
        s.pages.push_back(free_pages_.back());
        free_pages_.pop_back();
      }
      EXPECT_LE(static_cast<int>(s.pages.size()), l.max_pages_per_seq);
      item_rows_[order[b]] = {row, len};
      h.cu_seqlens[b] = row;
      h.state_slot[b] = s.state;
      h.q_start[b] = row;
      h.q_len[b] = len;
      h.kv_len[b] = kv;
      for (int i = 0; i < l.max_pages_per_seq; ++i)
        h.page_table[b * l.max_pages_per_seq + i] =
            i < static_cast<int>(s.pages.size()) ? s.pages[i] : 0;
      for (int t = 0; t < len; ++t, ++row) {
        h.token_ids[row] = item.tokens[t];
        h.token_slot[row] = s.slot;
        h.token_seq[row] = b;
        h.token_pos[row] = s.kv_len + t;
      }
      h.last_row[b] = row - 1;
      h.sample_params[b] = ops::SampleRowParams{};  // greedy
      h.uniform[b] = 0.5f;
      max_q = std::max(max_q, len);
      max_kv = std::max(max_kv, kv);
      if (s.slot >= 0 &&
          std::find(slots_seen.begin(), slots_seen.end(), s.slot) == slots_seen.end())
        slots_seen.push_back(s.slot);
    }
    shape.tokens = tokens_capacity > 0 ? tokens_capacity : row;
    shape.seqs = seqs_capacity > 0 ? seqs_capacity : static_cast<int>(items.size());
    for (int r = row; r < shape.tokens; ++r) {
      h.token_ids[r] = 0;
      h.token_slot[r] = -1;
      h.token_seq[r] = -1;
      h.token_pos[r] = 0;
    }
    for (int b = static_cast<int>(items.size()); b <= l.max_seqs; ++b) h.cu_seqlens[b] = row;
    for (int b = static_cast<int>(items.size()); b < l.max_seqs; ++b) h.state_slot[b] = -1;
    for (int b = static_cast<int>(items.size()); b < shape.seqs; ++b) {
      h.q_start[b] = 0;
      h.q_len[b] = 0;
      h.kv_len[b] = 0;
      h.last_row[b] = 0;
      h.sample_params[b] = ops::SampleRowParams{};
      h.uniform[b] = 0.5f;
      for (int i = 0; i < l.max_pages_per_seq; ++i) h.page_table[b * l.max_pages_per_seq + i] = 0;
    }
    h.num_tokens[0] = row;
    h.num_seqs[0] = static_cast<int>(items.size());
    // LoRA segments: maximal runs of rows with one slot >= 0.
    int segments = 0;
    for (int r = 0; r < row;) {
      int end = r;
      while (end < row && h.token_slot[end] == h.token_slot[r]) ++end;
      if (h.token_slot[r] >= 0) {
        if (segments == l.num_slots)
          throw std::logic_error("more LoRA segments than adapter slots");
        int32_t* seg = h.lora_segments + 4 * segments++;
        seg[0] = h.token_slot[r];
        seg[1] = 0;
        seg[2] = r;
        seg[3] = end;
      }
      r = end;
    }
    // Rows are ordered by slot, so every slot of the batch forms exactly one run.
    EXPECT_EQ(segments, static_cast<int>(slots_seen.size()));
    h.num_lora_segments[0] = segments;
    shape.max_q_len = max_q;
    shape.max_kv_len = graph_kv_bound ? l.max_pages_per_seq * l.page_size : max_kv;
    shape.lora = !slots_seen.empty();
    shape.single_slot = slots_seen.size() == 1 ? slots_seen[0] : -1;
    shape.sample = true;
    return shape;
  }

  // Advances the sequences of `items` by their tokens (after the forward ran).
  void commit(const std::vector<Item>& items) {
    for (const Item& item : items) seqs_[item.seq].kv_len += static_cast<int>(item.tokens.size());
  }

  struct Output {
    std::vector<std::vector<float>> logits;  // per item, [V]
    std::vector<int32_t> sampled;            // per item
    std::vector<RouteMap> routes;            // per item, when capture_routes(true)
  };
  // read() also copies every MoE layer's routing of the items' rows back.
  void capture_routes(bool on) { capture_routes_ = on; }
  // Copies the outputs of the last forward back (synchronizes the main stream).
  Output read(size_t count) {
    const int V = static_cast<int>(model_.config().vocab_size);
    const int B = model_.limits().max_seqs;
    std::vector<float> logits(static_cast<size_t>(B) * V);
    std::vector<int32_t> sampled(B);
    cudaStream_t s = model_.main_stream();
    EXPECT_EQ(cudaMemcpyAsync(logits.data(), model_.logits(), logits.size() * 4,
                              cudaMemcpyDeviceToHost, s),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(sampled.data(), model_.sampled(), sampled.size() * 4,
                              cudaMemcpyDeviceToHost, s),
              cudaSuccess);
    std::map<int64_t, std::vector<int32_t>> layer_ids;  // MoE layer -> ids [rows, k]
    const int k = static_cast<int>(model_.config().num_experts_per_tok);
    const int rows = model_.host_step().num_tokens[0];
    if (capture_routes_) {
      for (int64_t l = 0; l < model_.config().num_hidden_layers; ++l) {
        const int32_t* ids = model_.moe_topk_ids(l);
        if (ids == nullptr) continue;
        std::vector<int32_t>& host = layer_ids[l];
        host.resize(static_cast<size_t>(rows) * k);
        EXPECT_EQ(cudaMemcpyAsync(host.data(), ids, host.size() * 4, cudaMemcpyDeviceToHost, s),
                  cudaSuccess);
      }
    }
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    Output out;
    for (size_t i = 0; i < count; ++i) {
      const int b = position_[i];
      out.logits.emplace_back(logits.begin() + static_cast<int64_t>(b) * V,
                              logits.begin() + static_cast<int64_t>(b + 1) * V);
      out.sampled.push_back(sampled[b]);
      if (capture_routes_) {
        RouteMap routes;
        const auto [begin, len] = item_rows_[i];
        for (const auto& [l, ids] : layer_ids)
          routes[l].assign(ids.begin() + static_cast<int64_t>(begin) * k,
                           ids.begin() + static_cast<int64_t>(begin + len) * k);
        out.routes.push_back(std::move(routes));
      }
    }
    return out;
  }

  Output step(const std::vector<Item>& items) {
    const ForwardShape shape = prepare(items);
    model_.upload_step(shape, model_.main_stream());
    model_.forward(shape);
    Output out = read(items.size());
    commit(items);
    return out;
  }

 private:
  GpuModel& model_;
  std::vector<GpuSequence> seqs_;
  std::vector<int32_t> free_pages_;
  std::vector<int32_t> free_states_;  // a stack of free linear-attention state slots
  std::vector<int> position_;
  std::vector<std::pair<int, int>> item_rows_;  // per caller item: first row, rows
  bool capture_routes_ = false;
};

struct LogitsDiff {
  double cosine = 1, max_diff = 0, range = 0;
};

// GPU logits against the reference: cosine >= 0.998 and max abs diff <= 3 % of the logit
// range. The whole model carries bf16 rounding of the residual stream through every layer (and,
// for the FP8 checkpoint, the FP8 quantization of the expert inputs, which the HF-equivalent
// reference does not do); with the GPU's routing imposed the worst steps measured on the H200 were
// cosine 0.99882 (FP8 experts) and 0.99897 (bf16), max abs diff 2.7 % of the range, while a
// single routing flip moves a step to 0.81-0.99.
//
// Qwen3.5 (ScopedQwen35Bound): its Gated DeltaNet layers feed bf16 projections into an fp32
// recurrence over 72 prompt tokens and more, and its gates (beta = sigmoid(b), decay = exp(-A
// softplus(a + dt_bias))) pass the bf16 rounding of b and a on to every later token; with the
// GPU's routing imposed the worst steps measured on the H200 were cosine 0.9966 and max abs diff
// 4.0 % of the range (the Gated DeltaNet kernels alone match the reference on the same bf16
// inputs to 1e-4: tests/gpu/gdn_rig.cuh), so these fixtures get cosine 0.995 and 5 %.
inline double g_min_logit_cosine = 0.998, g_max_diff_fraction = 0.03;
struct ScopedQwen35Bound {
  ScopedQwen35Bound() {
    g_min_logit_cosine = 0.995;
    g_max_diff_fraction = 0.05;
  }
  ~ScopedQwen35Bound() {
    g_min_logit_cosine = 0.998;
    g_max_diff_fraction = 0.03;
  }
};
inline LogitsDiff expect_logits_close(const std::vector<float>& gpu, const std::vector<float>& cpu,
                                      const std::string& label, bool strict = true) {
  LogitsDiff d;
  EXPECT_EQ(gpu.size(), cpu.size()) << label;
  if (gpu.size() != cpu.size() || cpu.empty()) return d;
  double dot = 0, na = 0, nb = 0;
  float lo = cpu[0], hi = cpu[0];
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (!std::isfinite(gpu[i])) {
      ADD_FAILURE() << label << ": logit " << i << " is " << gpu[i];
      d.cosine = 0;
      return d;
    }
    dot += static_cast<double>(gpu[i]) * cpu[i];
    na += static_cast<double>(gpu[i]) * gpu[i];
    nb += static_cast<double>(cpu[i]) * cpu[i];
    d.max_diff = std::max(d.max_diff, std::fabs(static_cast<double>(gpu[i]) - cpu[i]));
    lo = std::min(lo, cpu[i]);
    hi = std::max(hi, cpu[i]);
  }
  d.cosine = dot / std::sqrt(na * nb + 1e-30);
  d.range = hi - lo;
  if (strict) {
    EXPECT_GE(d.cosine, g_min_logit_cosine)
        << label << " (max abs diff " << d.max_diff << ", logit range " << d.range << ")";
    EXPECT_LE(d.max_diff, g_max_diff_fraction * d.range) << label << " (cosine " << d.cosine << ")";
  }
  return d;
}

inline bool logits_within_bf16(const LogitsDiff& d) {
  return d.cosine >= g_min_logit_cosine && d.max_diff <= g_max_diff_fraction * d.range;
}

inline void expect_sampler_is_argmax(const Driver::Output& out, const std::string& label) {
  for (size_t i = 0; i < out.sampled.size(); ++i) {
    EXPECT_EQ(out.sampled[i], argmax(std::span<const float>(out.logits[i])))
        << label << " item " << i;
  }
}

// Decode steps of B = 4 captured once; replays see other sequences, slot maps and adapters.
inline void check_graph_replay(GpuModel& gpu, const std::vector<std::vector<int32_t>>& prompts,
                               const std::vector<int32_t>& slots,
                               const std::function<void(int)>& between_replays,
                               const std::function<int32_t(int, int)>& slot_at_step,
                               const std::string& label) {
  constexpr int kBatch = 4, kSteps = 4;
  Driver driver(gpu);
  std::vector<Driver::Item> batch;
  for (int i = 0; i < kBatch; ++i)
    batch.push_back({driver.add_sequence(slots[i]), prompts[i % prompts.size()]});
  // Linear-attention models: the eager forward advances the states it reads, so the replay of
  // the same step runs on shadow state slots holding copies of the states from before it.
  const bool stateful = gpu.num_state_slots() > 0;
  std::vector<int32_t> shadow;
  if (stateful) {
    for (int i = 0; i < kBatch; ++i) shadow.push_back(driver.take_state_slot());
  }
  Driver::Output out = driver.step(batch);  // eager prefill

  // Capture one decode forward (metadata uploaded outside the graph).
  for (int i = 0; i < kBatch; ++i) batch[i].tokens = {out.sampled[i]};
  ForwardShape shape = driver.prepare(batch, kBatch, kBatch, true);
  shape.lora = true;  // the graph serves any slot mix
  shape.single_slot = -1;
  cudaStream_t stream = gpu.main_stream();
  gpu.upload_step(shape, stream);  // the capture's launch configuration comes from this plan
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  gpu.forward(shape);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (int step = 0; step < kSteps; ++step) {
    between_replays(step);
    for (int i = 0; i < kBatch; ++i) driver.sequence(batch[i].seq).slot = slot_at_step(step, i);
    if (step == 2) {  // a new sequence takes the place of item 1: prefill it eagerly first
      driver.drop_sequence(batch[1].seq);
      batch[1].seq = driver.add_sequence(slot_at_step(step, 1));
      const Driver::Output pre =
          driver.step({{batch[1].seq, prompts[(1 + step) % prompts.size()]}});
      batch[1].tokens = {pre.sampled[0]};
    }
    ForwardShape eager = driver.prepare(batch, kBatch, kBatch, true);
    eager.lora = true;
    eager.single_slot = -1;
    if (stateful) {
      for (int i = 0; i < kBatch; ++i)
        gpu.copy_state(driver.sequence(batch[i].seq).state, shadow[i], stream);
    }
    gpu.upload_step(eager, stream);
    gpu.forward(eager);
    const Driver::Output want = driver.read(batch.size());
    if (stateful) {  // the same step again from the copies (item i is batch row position(i))
      StepMetadata& h = gpu.host_step();
      for (int i = 0; i < kBatch; ++i) h.state_slot[driver.position(i)] = shadow[i];
      gpu.upload_step(eager, stream);
    }
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);  // same metadata, same KV rows rewritten
    const Driver::Output got = driver.read(batch.size());
    for (int i = 0; i < kBatch; ++i) {
      for (float v : got.logits[i]) ASSERT_TRUE(std::isfinite(v)) << label << " step " << step;
      EXPECT_EQ(0,
                std::memcmp(got.logits[i].data(), want.logits[i].data(), want.logits[i].size() * 4))
          << label << " step " << step << " item " << i
          << ": graph replay differs from the eager forward";
      EXPECT_EQ(got.sampled[i], want.sampled[i]) << label << " step " << step << " item " << i;
    }
    expect_sampler_is_argmax(got, label);
    driver.commit(batch);
    for (int i = 0; i < kBatch; ++i) batch[i].tokens = {got.sampled[i]};
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace moelora::model::gpu_model_test
