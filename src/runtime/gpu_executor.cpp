// The CUDA-free half of the GPU executor (gpu_executor.h): decode buckets, the host page
// allocator, the per-step metadata plan and the memory estimates, compiled in every build; and
// the stubs that a build without CUDA links instead of gpu_executor_cuda.cu.
#include "runtime/gpu_executor.h"

#include <algorithm>
#include <set>

#include "model/model.h"
#include "moelora/engine.h"

namespace moelora::runtime {

// ============================================================================ decode buckets

std::vector<int> decode_buckets(int max_sequences) {
  std::vector<int> out;
  // 1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, ...: at most 50 % padding above 8, few graphs.
  for (int b = 1; b <= 8 && b < max_sequences; b *= 2) out.push_back(b);
  for (int64_t p = 16; p < max_sequences; p *= 2) {
    out.push_back(static_cast<int>(p));
    if (p + p / 2 < max_sequences) out.push_back(static_cast<int>(p + p / 2));
  }
  if (max_sequences >= 1) out.push_back(max_sequences);
  return out;
}

int decode_bucket(int batch, std::span<const int> buckets) {
  for (int b : buckets) {
    if (b >= batch) return b;
  }
  return -1;
}

// ============================================================================ PageAllocator

PageAllocator::PageAllocator(int64_t num_pages, int page_size, int max_pages_per_seq)
    : num_pages_(num_pages), page_size_(page_size), max_pages_per_seq_(max_pages_per_seq) {
  MOELORA_CHECK(
      num_pages >= 1 && page_size >= 1 && max_pages_per_seq >= 1 && num_pages <= INT32_MAX,
      ErrorCode::kInvalidArgument, "KV page allocator: num_pages ", num_pages, ", page_size ",
      page_size, " and max_pages_per_seq ", max_pages_per_seq,
      " must all be >= 1 (and num_pages < 2^31)");
  free_.resize(static_cast<size_t>(num_pages));
  // Stack with page 0 on top.
  for (int64_t i = 0; i < num_pages; ++i)
    free_[static_cast<size_t>(i)] = static_cast<int32_t>(num_pages - 1 - i);
}

SequenceHandle PageAllocator::new_sequence() {
  const SequenceHandle handle = next_handle_++;
  sequences_.emplace(handle, Sequence{});
  return handle;
}

PageAllocator::Sequence& PageAllocator::get(SequenceHandle sequence) {
  auto it = sequences_.find(sequence);
  MOELORA_CHECK(it != sequences_.end(), ErrorCode::kInternal, "sequence handle ", sequence,
                " is not live");
  return it->second;
}

const PageAllocator::Sequence& PageAllocator::get(SequenceHandle sequence) const {
  auto it = sequences_.find(sequence);
  MOELORA_CHECK(it != sequences_.end(), ErrorCode::kInternal, "sequence handle ", sequence,
                " is not live");
  return it->second;
}

void PageAllocator::free_sequence(SequenceHandle sequence) {
  auto it = sequences_.find(sequence);
  MOELORA_CHECK(it != sequences_.end(), ErrorCode::kInternal, "freeing sequence handle ", sequence,
                ", which is not live");
  // Back in reverse so that the sequence's first page is handed out first again.
  for (auto p = it->second.pages.rbegin(); p != it->second.pages.rend(); ++p) free_.push_back(*p);
  sequences_.erase(it);
}

int64_t PageAllocator::length(SequenceHandle sequence) const {
  return get(sequence).length;
}

const std::vector<int32_t>& PageAllocator::pages(SequenceHandle sequence) const {
  return get(sequence).pages;
}

void PageAllocator::reserve(SequenceHandle sequence, int64_t new_length) {
  Sequence& s = get(sequence);
  MOELORA_CHECK(new_length >= s.length, ErrorCode::kInternal, "sequence handle ", sequence,
                " would shrink from ", s.length, " to ", new_length, " tokens");
  MOELORA_CHECK(new_length <= max_length(), ErrorCode::kOutOfRange, "sequence handle ", sequence,
                " would reach ", new_length, " tokens; the KV page table holds ", max_length(),
                " (max_pages_per_seq ", max_pages_per_seq_, " x page_size ", page_size_,
                "; raise max_seq_len)");
  const int64_t need = pages_for(new_length) - static_cast<int64_t>(s.pages.size());
  if (need <= 0) return;
  MOELORA_CHECK(need <= free_pages(), ErrorCode::kOutOfRange,
                "the KV cache is full: sequence handle ", sequence, " needs ", need, " more page",
                need == 1 ? "" : "s", " of ", page_size_, " tokens and ", free_pages(), " of ",
                num_pages_,
                " are free (raise kv_cache_bytes or gpu_memory_fraction, or run fewer requests)");
  for (int64_t i = 0; i < need; ++i) {
    s.pages.push_back(free_.back());
    free_.pop_back();
  }
}

void PageAllocator::commit(SequenceHandle sequence, int64_t new_length) {
  Sequence& s = get(sequence);
  MOELORA_CHECK(
      new_length >= s.length && pages_for(new_length) <= static_cast<int64_t>(s.pages.size()),
      ErrorCode::kInternal, "sequence handle ", sequence, ": commit of ", new_length,
      " tokens with ", s.pages.size(), " pages reserved (length ", s.length, ")");
  s.length = new_length;
}

void PageAllocator::rollback(SequenceHandle sequence) {
  Sequence& s = get(sequence);
  const size_t keep = static_cast<size_t>(pages_for(s.length));
  while (s.pages.size() > keep) {
    free_.push_back(s.pages.back());
    s.pages.pop_back();
  }
}

// ============================================================================ step plan

void plan_gpu_step(std::span<const BatchEntry> batch, std::span<const ops::SampleRowParams> params,
                   std::span<const float> uniforms, const StepCapacity& cap,
                   std::span<const int> buckets, const std::vector<bool>& occupied,
                   PageAllocator& pages, GpuStepPlan& plan) {
  const auto internal = ErrorCode::kInternal;
  const size_t n = batch.size();
  MOELORA_CHECK(n > 0, internal, "forward of an empty batch");
  MOELORA_CHECK(static_cast<int64_t>(n) <= cap.max_seqs, internal, "forward of ", n,
                " sequences; the limit is ", cap.max_seqs);
  MOELORA_CHECK(
      (params.empty() && uniforms.empty()) || (params.size() == n && uniforms.size() == n),
      internal, "forward of ", n, " entries with ", params.size(), " sampling params and ",
      uniforms.size(), " uniforms");
  int64_t tokens = 0;
  int max_q_len = 0;
  std::set<SequenceHandle> seen;
  for (const BatchEntry& b : batch) {
    MOELORA_CHECK(!b.tokens.empty(), internal, "sequence handle ", b.sequence,
                  " has no tokens in this forward");
    MOELORA_CHECK(seen.insert(b.sequence).second, internal, "sequence handle ", b.sequence,
                  " appears twice in one forward");
    MOELORA_CHECK(b.slot >= -1 && b.slot < cap.num_slots, internal, "sequence handle ", b.sequence,
                  " runs on adapter slot ", b.slot, ", outside [-1, ", cap.num_slots, ")");
    MOELORA_CHECK(b.slot < 0 || occupied[static_cast<size_t>(b.slot)], internal, "sequence handle ",
                  b.sequence, " runs on adapter slot ", b.slot, ", which is empty");
    for (int32_t id : b.tokens) {
      MOELORA_CHECK(id >= 0 && id < cap.vocab_size, internal, "sequence handle ", b.sequence,
                    ": token id ", id, " is outside the vocabulary [0, ", cap.vocab_size, ")");
    }
    tokens += static_cast<int64_t>(b.tokens.size());
    max_q_len = std::max(max_q_len, static_cast<int>(b.tokens.size()));
  }
  MOELORA_CHECK(tokens <= cap.max_tokens, internal, "forward of ", tokens, " tokens; the limit is ",
                cap.max_tokens);

  // Order: adapter slots ascending (each slot's rows one range), base-only rows last; batch
  // order within a group.
  plan.order.resize(n);
  for (size_t i = 0; i < n; ++i) plan.order[i] = static_cast<int>(i);
  auto group = [&](int i) {
    const int32_t slot = batch[static_cast<size_t>(i)].slot;
    return slot < 0 ? INT32_MAX : slot;
  };
  std::stable_sort(plan.order.begin(), plan.order.end(),
                   [&](int a, int b) { return group(a) < group(b); });

  // Shape: a decode-only batch that fits a bucket replays that bucket's graph.
  const int bucket = max_q_len == 1 ? decode_bucket(static_cast<int>(n), buckets) : -1;
  plan.graph = bucket > 0 && bucket <= cap.max_tokens;
  plan.rows = plan.graph ? bucket : static_cast<int>(tokens);
  plan.seqs = plan.graph ? bucket : static_cast<int>(n);
  plan.num_tokens = static_cast<int32_t>(tokens);
  plan.num_seqs = static_cast<int32_t>(n);
  plan.max_q_len = max_q_len;

  // Everything to capacity, padding values first.
  const size_t mt = static_cast<size_t>(cap.max_tokens), ms = static_cast<size_t>(cap.max_seqs);
  const size_t mp = static_cast<size_t>(cap.max_pages_per_seq);
  plan.token_ids.assign(mt, 0);
  plan.token_slot.assign(mt, -1);
  plan.token_seq.assign(mt, -1);
  plan.token_pos.assign(mt, 0);
  plan.q_start.assign(ms, 0);
  plan.q_len.assign(ms, 0);
  plan.kv_len.assign(ms, 0);
  plan.last_row.assign(ms, 0);
  plan.page_table.assign(ms * mp, 0);  // padding entries name page 0: in bounds, never read
  plan.cu_seqlens.assign(ms + 1, static_cast<int32_t>(tokens));
  plan.state_slot.assign(ms, -1);
  plan.lora_segments.assign(static_cast<size_t>(std::max(cap.num_slots, 0)) * 4, 0);
  plan.sample_params.assign(ms, ops::SampleRowParams{});
  plan.uniform.assign(ms, 0.0f);
  plan.num_lora_segments = 0;

  // Pages first (the only state this function changes), undone if any reservation fails.
  size_t reserved = 0;
  try {
    for (; reserved < n; ++reserved) {
      const BatchEntry& b = batch[reserved];
      pages.reserve(b.sequence, pages.length(b.sequence) + static_cast<int64_t>(b.tokens.size()));
    }
  } catch (...) {
    for (size_t i = 0; i < reserved; ++i) pages.rollback(batch[i].sequence);
    throw;
  }

  int32_t row = 0;
  int max_kv_len = 0;
  std::set<int32_t> slots;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = static_cast<size_t>(plan.order[k]);
    const BatchEntry& b = batch[i];
    const int32_t length = static_cast<int32_t>(pages.length(b.sequence));
    const int32_t q = static_cast<int32_t>(b.tokens.size());
    plan.q_start[k] = row;
    plan.q_len[k] = q;
    plan.cu_seqlens[k] = row;
    plan.kv_len[k] = length + q;
    plan.last_row[k] = row + q - 1;
    max_kv_len = std::max(max_kv_len, length + q);
    const std::vector<int32_t>& held = pages.pages(b.sequence);
    std::copy(held.begin(), held.end(), plan.page_table.begin() + static_cast<ptrdiff_t>(k * mp));
    for (int32_t j = 0; j < q; ++j) {
      plan.token_ids[static_cast<size_t>(row + j)] = b.tokens[static_cast<size_t>(j)];
      plan.token_slot[static_cast<size_t>(row + j)] = b.slot;
      plan.token_seq[static_cast<size_t>(row + j)] = static_cast<int32_t>(k);
      plan.token_pos[static_cast<size_t>(row + j)] = length + j;
    }
    if (b.slot >= 0) {
      slots.insert(b.slot);
      int32_t* seg = plan.lora_segments.data();
      const int32_t s = plan.num_lora_segments;
      if (s > 0 && seg[4 * (s - 1)] == b.slot) {
        seg[4 * (s - 1) + 3] = row + q;  // extends the slot's range (rows are grouped by slot)
      } else {
        seg[4 * s + 0] = b.slot;
        seg[4 * s + 1] = 0;
        seg[4 * s + 2] = row;
        seg[4 * s + 3] = row + q;
        ++plan.num_lora_segments;
      }
    }
    if (!params.empty()) {
      plan.sample_params[k] = params[i];
      plan.uniform[k] = uniforms[i];
    }
    row += q;
  }
  plan.lora = !slots.empty();
  plan.single_slot = !plan.graph && slots.size() == 1 ? *slots.begin() : -1;
  // A graph serves any sequence length up to the page table's capacity.
  plan.max_kv_len = plan.graph ? cap.max_pages_per_seq * pages.page_size() : max_kv_len;
}

// ============================================================================ estimates

io::ModelConfig first_layers(io::ModelConfig c, int64_t layers) {
  if (layers <= 0 || layers >= c.num_hidden_layers) return c;
  c.num_hidden_layers = layers;
  if (!c.layer_types.empty()) c.layer_types.resize(static_cast<size_t>(layers));
  c.mlp_only_layers.erase(std::remove_if(c.mlp_only_layers.begin(), c.mlp_only_layers.end(),
                                         [&](int64_t l) { return l >= layers; }),
                          c.mlp_only_layers.end());
  c.first_k_dense_replace = std::min(c.first_k_dense_replace, layers);
  return c;
}

uint64_t estimate_kv_bytes_per_token(const io::ModelConfig& c) {
  const uint64_t per_layer =
      c.use_mla ? static_cast<uint64_t>(c.kv_lora_rank + c.qk_rope_head_dim) * 2
                : static_cast<uint64_t>(c.num_key_value_heads * (c.head_dim + c.head_dim)) * 2;
  int64_t attention_layers = 0;  // Gated DeltaNet layers keep a fixed-size state, no KV rows
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    attention_layers += is_linear_attention_layer(c, l) ? 0 : 1;
  return per_layer * static_cast<uint64_t>(attention_layers);
}

bool is_linear_attention_layer(const io::ModelConfig& c, int64_t layer) {
  return layer >= 0 && static_cast<size_t>(layer) < c.layer_types.size() &&
         c.layer_types[static_cast<size_t>(layer)] == "linear_attention";
}

uint64_t linear_attention_state_bytes(const io::ModelConfig& c) {
  // Per layer: the bf16 conv state [conv_dim, K - 1] and the fp32 recurrent state [nv, dk, dv].
  const ops::GdnShape s = model::linear_attention_shape(c);
  const uint64_t per_layer = static_cast<uint64_t>(s.conv_dim()) *
                                 static_cast<uint64_t>(std::max<int64_t>(s.conv_kernel - 1, 0)) *
                                 2 +
                             static_cast<uint64_t>(s.num_v_heads * s.head_k_dim * s.head_v_dim) * 4;
  uint64_t layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    layers += is_linear_attention_layer(c, l) ? 1 : 0;
  return per_layer * layers;
}

void for_each_dense_linear(const io::ModelConfig& c, int64_t layer,
                           const std::function<void(int64_t out, int64_t in)>& fn) {
  const int64_t H = c.hidden_size, Hq = c.num_attention_heads;
  if (c.use_mla) {
    const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    if (c.q_lora_rank > 0) {
      fn(c.q_lora_rank, H);
      fn(Hq * qk, c.q_lora_rank);
    } else {
      fn(Hq * qk, H);
    }
    fn(c.kv_lora_rank + c.qk_rope_head_dim, H);
    fn(Hq * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
    fn(H, Hq * c.v_head_dim);
  } else if (is_linear_attention_layer(c, layer)) {
    const io::LinearAttentionConfig& la = c.linear_attention;
    const int64_t kd = la.num_key_heads * la.key_head_dim,
                  vd = la.num_value_heads * la.value_head_dim;
    fn(2 * kd + vd, H);         // in_proj_qkv
    fn(vd, H);                  // in_proj_z
    fn(la.num_value_heads, H);  // in_proj_b
    fn(la.num_value_heads, H);  // in_proj_a
    fn(H, vd);                  // out_proj
  } else {
    const int64_t D = c.head_dim, Hkv = c.num_key_value_heads;
    fn(Hq * D * (c.attention_output_gate ? 2 : 1), H);
    fn(Hkv * D, H);
    fn(Hkv * D, H);
    fn(H, Hq * D);
  }
  const int64_t I = c.is_moe_layer(layer) ? c.shared_expert_intermediate_size : c.intermediate_size;
  if (I > 0) {
    fn(I, H);  // gate
    fn(I, H);  // up
    fn(H, I);  // down
  }
}

GpuExecutorOptions gpu_executor_options(const EngineOptions& options) {
  GpuExecutorOptions g;
  g.model_dir = options.model_dir;
  g.limits = executor_limits(options);
  g.random_weights = options.random_weights;
  g.random_seed = options.random_seed;
  g.max_layers = options.max_layers;
  g.max_seq_len = options.max_seq_len;
  g.kv_cache_bytes = options.kv_cache_bytes;
  g.gpu_memory_fraction = options.gpu_memory_fraction;
  g.cuda_graphs = options.cuda_graphs;
  g.attention = options.attention;
  g.attention_pdl = options.attention_pdl;
  g.router_in_route = options.router_in_route;
  g.moe_seam1_after_quant = options.moe_seam1_after_quant;
  g.moe_pdl_after_side_join = options.moe_pdl_after_side_join;
  g.moe_seam2_in_finalize_max_tokens = options.moe_seam2_in_finalize_max_tokens;
  g.moe_seam2_shrink_in_activation = options.moe_seam2_shrink_in_activation;
  g.moe_shared_lora_stream = options.moe_shared_lora_stream;
  g.moe_activation_pdl_with_shared_pairs = options.moe_activation_pdl_with_shared_pairs;
  g.moe_lora_side_ctas = options.moe_lora_side_ctas;
  g.moe_stream_schedule = options.moe_stream_schedule;
  g.moe_shared_expert_in_experts = options.moe_shared_expert_in_experts;
  g.gdn_lora_delta_in_mix = options.gdn_lora_delta_in_mix;
  g.show_progress = options.show_progress;
  return g;
}

uint64_t estimate_gpu_model_bytes(const io::ModelConfig& c, bool fp8_experts,
                                  const ExecutorLimits& limits, int expert_ranks) {
  // Counts elements (bf16 = 2 bytes) of weights and of the LoRA pool's (in + out) x rank per
  // target; shapes as in hf_config.h.
  const uint64_t H = static_cast<uint64_t>(c.hidden_size), V = static_cast<uint64_t>(c.vocab_size);
  const uint64_t R =
      static_cast<uint64_t>((std::max<int64_t>(limits.max_lora_rank, 1) + 7) / 8 * 8);
  const uint64_t S = static_cast<uint64_t>(std::max(limits.num_slots, 0));
  // embedding + lm_head: a rank holds its vocabulary rows when the ranks divide V (vocab_shard)
  const uint64_t vocab_rows =
      static_cast<uint64_t>(vocab_shard(c.vocab_size, 0, std::max(expert_ranks, 1)).count);
  uint64_t weights = vocab_rows * H * (c.tie_word_embeddings ? 1 : 2) * 2;
  uint64_t lora_elems = 0;                                         // per slot
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for_each_dense_linear(c, l, [&](int64_t out, int64_t in) {
      weights += static_cast<uint64_t>(out * in) * 2;
      lora_elems += static_cast<uint64_t>(out + in) * R;
    });
    if (c.is_moe_layer(l)) {
      const uint64_t E =
          static_cast<uint64_t>(c.num_experts) / static_cast<uint64_t>(std::max(expert_ranks, 1));
      const uint64_t I = static_cast<uint64_t>(c.moe_intermediate_size);
      weights += static_cast<uint64_t>(c.num_experts) * H * 4;  // router (fp32 at most), whole
      if (c.quant.method == io::QuantMethod::kNvfp4 && H % 128 == 0 && I % 128 == 0)
        weights += E * 3 * H * I * 9 / 16 + E * (2 * I + H) * 4;  // codes, group scales, row scale_2
      else
        weights += E * 3 * H * I * (fp8_experts ? 1 : 2) + E * 3 * H * I / (128 * 128) * 4;
      lora_elems += E * (H + 2 * I) * R + E * (I + H) * R;  // gate_up and down
    }
  }
  // Workspaces: a few [max_tokens, max(H, 2 * top_k * I)] activations and the fp32 logits, once
  // (the MoE layers share one allocation: ops::cuda::MoeSharedWorkspace).
  const uint64_t T = static_cast<uint64_t>(std::max<int64_t>(limits.max_batch_tokens, 1));
  // The routed experts' rows are token x top_k pairs ([T k, 2 I_moe]); a dense MLP's are tokens
  // ([T, 2 I]): the top_k factor applies to the expert width only (Kimi-K2.5's dense I of 18432
  // times top_k 8 had sized 77 GB of workspace at 8192 tokens).
  const uint64_t width = std::max<uint64_t>(
      {H,
       2 * static_cast<uint64_t>(std::max<int64_t>(c.num_experts_per_tok, 1)) *
           static_cast<uint64_t>(std::max<int64_t>(c.moe_intermediate_size, 0)),
       2 * static_cast<uint64_t>(std::max<int64_t>(c.intermediate_size, 0))});
  // ... and the logits [max_seqs, V] fp32 (a split vocabulary: also the rank's columns and the
  // gathered blocks).
  const uint64_t logits_per_seq = V + (vocab_rows < V ? V + vocab_rows : 0);
  const uint64_t workspace =
      8 * T * width * 4 +
      static_cast<uint64_t>(std::max(limits.max_sequences, 1)) * logits_per_seq * 4;
  // Linear-attention states: one per sequence of a step.
  const uint64_t states =
      linear_attention_state_bytes(c) * static_cast<uint64_t>(std::max(limits.max_sequences, 1));
  return weights + S * lora_elems * 2 + workspace + states;
}

GpuMemoryPlan plan_gpu_memory(const io::ModelConfig& config, const GpuExecutorOptions& o,
                              uint64_t device_total_bytes, int expert_ranks) {
  GpuMemoryPlan plan;
  const bool fp8_experts = config.quant.method == io::QuantMethod::kFp8Block;
  plan.model_bytes = estimate_gpu_model_bytes(config, fp8_experts, o.limits, expert_ranks);
  const int64_t page = std::max(o.page_size, 1);
  plan.max_seq_len = o.max_seq_len > 0 ? o.max_seq_len : kDefaultMaxSeqLen;
  if (config.max_position_embeddings > 0)
    plan.max_seq_len = std::min(plan.max_seq_len, config.max_position_embeddings);
  plan.max_pages_per_seq = (plan.max_seq_len + page - 1) / page;
  plan.page_bytes =
      std::max<uint64_t>(estimate_kv_bytes_per_token(config), 1) * static_cast<uint64_t>(page);
  plan.full_kv_bytes = plan.page_bytes * static_cast<uint64_t>(plan.max_pages_per_seq) *
                       static_cast<uint64_t>(std::max(o.limits.max_sequences, 1));
  plan.slack_bytes = (1ull << 30) + device_total_bytes / 50;
  return plan;
}

int64_t gpu_layers_that_fit(const io::ModelConfig& config, const GpuExecutorOptions& o,
                            uint64_t free_bytes, uint64_t device_total_bytes, int expert_ranks) {
  const double usable = o.gpu_memory_fraction * static_cast<double>(free_bytes);
  auto fits = [&](int64_t layers) {
    const GpuMemoryPlan plan =
        plan_gpu_memory(first_layers(config, layers), o, device_total_bytes, expert_ranks);
    return static_cast<double>(plan.model_bytes) + static_cast<double>(plan.full_kv_bytes) +
               static_cast<double>(plan.slack_bytes) <=
           usable;
  };
  // Every term grows with the layers: the largest count that fits, by bisection.
  int64_t lo = 0, hi = config.num_hidden_layers;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (fits(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

int moe_stream_schedule_from_name(std::string_view name) {
  if (name == "auto") return -1;
  if (name == "round-robin") return 0;
  if (name == "claimed") return 1;
  MOELORA_THROW(ErrorCode::kInvalidArgument, "MoE stream schedule '", std::string(name),
                "': expected auto, claimed or round-robin");
}

// ============================================================================ stubs

#if !MOELORA_WITH_CUDA

bool cuda_device_available() {
  return false;
}

namespace {
[[noreturn]] void no_cuda(const char* what) {
  MOELORA_THROW(ErrorCode::kUnsupported, what,
                ": this build has no CUDA support (configured with MOELORA_ENABLE_CUDA=OFF or "
                "without nvcc); use device 'cpu'");
}
}  // namespace

std::unique_ptr<Executor> make_gpu_executor(const GpuExecutorOptions&) {
  no_cuda("the GPU executor");
}
GpuDeviceReport gpu_device_report(int) {
  no_cuda("gpu_device_report");
}
uint64_t gpu_memory_in_use(int) {
  no_cuda("gpu_memory_in_use");
}
double measure_copy_bandwidth(uint64_t, int, int) {
  no_cuda("measure_copy_bandwidth");
}

#endif

}  // namespace moelora::runtime
