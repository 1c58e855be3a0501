// GpuExecutor: the runtime's backend on the GPU model (model::GpuModel, gpu_model_cuda.cuh), seen
// from CPU code. This header has no CUDA in it: the Engine, the tools and the CPU tests include
// it in every build; a build without CUDA gets stubs (cuda_device_available() is false and
// make_gpu_executor() throws kUnsupported).
//
// What the executor adds to the model (gpu_executor_cuda.cu):
//   - a paged KV cache managed on the host (PageAllocator below): a free list of page ids, each
//     sequence holding the pages its length needs, growing as it grows; free_sequence returns
//     them at once; cache_bytes() counts the pages held; kv_capacity() reports the pool
//     (PageAllocator::capacity()), against which the Scheduler reserves each request's pages
//     at admission, so a forward never finds the pool empty;
//   - per step, the batch metadata (GpuStepPlan below): entries sorted by adapter slot (adapter
//     rows grouped, base rows last) so that the dense LoRA targets see one row range per slot,
//     page-table rows, positions, sampling parameters and uniforms, padded to the forward's
//     capacity; copied into the model's pinned mirror and uploaded with one async copy;
//   - CUDA graphs for decode-only steps (every entry one token): one graph per (bucket, LoRA on
//     or off) with buckets 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ... up to max_sequences,
//     captured at the bucket's first use (that step runs eagerly, then the graph is recorded) and
//     replayed afterwards with padding rows (token_seq -1) and padding sequences (q_len 0). The
//     graph reads everything that varies (tokens, slots, positions, page tables, adapters'
//     segments) from the metadata block, so admitting, evicting or reloading adapters never
//     recaptures; single-adapter fast paths are used only by eager steps (graphs pass -1).
//     Steps with a prefill chunk run eagerly at their exact size;
//   - sampling on the device (ops/sample/sample_cuda.cuh); only the tokens come back (one async
//     copy + one stream synchronize per step), or the logits for forward().
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/device_collectives.h"
#include "io/checkpoint.h"
#include "runtime/executor.h"

namespace moelora::runtime {

struct GpuExecutorOptions {
  std::filesystem::path model_dir;  // checkpoint, or (random_weights) a directory with config.json
  ExecutorLimits limits;
  // Benchmarks: read only config.json and draw seeded random weights on the device (FP8-block
  // experts when config.json asks for FP8, else bf16).
  bool random_weights = false;
  uint64_t random_seed = 0;
  int64_t max_layers = 0;  // first N decoder layers only (0 = all)
  // Longest sequence a page table holds: 0 = min(max_position_embeddings, kDefaultMaxSeqLen).
  int64_t max_seq_len = 0;
  // KV cache budget: kv_cache_bytes when > 0, else gpu_memory_fraction of the device memory that
  // is free before loading, minus an estimate of the weights, the adapter pool and the
  // workspaces. Never more than max_sequences full-length sequences need.
  uint64_t kv_cache_bytes = 0;
  double gpu_memory_fraction = 0.9;
  int page_size = 64;       // KV tokens per page
  bool cuda_graphs = true;  // false: every step runs eagerly (debugging)
  // GQA attention kernels: "auto", "flashinfer" or "moelora" (model::AttentionKernel).
  std::string attention = "auto";
  bool attention_pdl = true;    // model::GpuModelOptions::attention_pdl
  bool router_in_route = true;  // model::GpuModelOptions::router_in_route
  // model::GpuModelOptions::moe_seam1_after_quant, moe_pdl_after_side_join,
  // moe_seam2_in_finalize_max_tokens, moe_seam2_shrink_in_activation, moe_shared_lora_stream,
  // moe_activation_pdl_with_shared_pairs, moe_lora_side_ctas
  int moe_seam1_after_quant = -1;
  bool moe_pdl_after_side_join = true;
  int moe_seam2_in_finalize_max_tokens = -1;
  int moe_seam2_shrink_in_activation = -1;
  int moe_shared_lora_stream = -1;
  int moe_activation_pdl_with_shared_pairs = -1;
  int moe_lora_side_ctas = 0;
  int moe_stream_schedule = -1;  // model::GpuModelOptions::moe_stream_schedule
  // model::GpuModelOptions::moe_shared_expert_in_experts, gdn_lora_delta_in_mix
  bool moe_shared_expert_in_experts = true;
  bool gdn_lora_delta_in_mix = false;
  bool show_progress = false;
  int device = 0;
  // One rank of a tensor / expert parallel group (one process per GPU): the group that sums each
  // half-layer's output (model::GpuModelOptions::collectives), and the cuts that turn the loaded
  // checkpoint, or with random weights its config, into this rank's share (dist::shard_checkpoint
  // and dist::rank_config; the runtime does not depend on dist). Every rank gets the same options
  // but for these, and the ranks agree on the KV pool through the group (the fewest pages any of
  // them can hold), so that the same steps fit on all of them. nullptr: the whole model.
  DeviceCollectives* collectives = nullptr;
  std::function<io::ModelWeights(const io::ModelWeights&)> shard_checkpoint;
  std::function<io::ModelConfig(const io::ModelConfig&)> shard_config;
};

inline constexpr int64_t kDefaultMaxSeqLen = 8192;

// The GPU executor's options of an engine's (model, limits, KV budget, graphs, kernels).
GpuExecutorOptions gpu_executor_options(const EngineOptions& options);

// GpuExecutorOptions::moe_stream_schedule from its command-line name: "auto" -1 (the layers'
// rule), "round-robin" 0, "claimed" 1; another name is an Error that lists the three.
int moe_stream_schedule_from_name(std::string_view name);

// What make_gpu_executor plans for the device memory of `config` (already cut to
// options.max_layers and to the rank's share), from the shapes alone: the model
// (estimate_gpu_model_bytes), KV pages over all layers (one page, the pages of one full-length
// sequence, every sequence at full length) and the slack it keeps free for the CUDA context,
// cuBLAS, graphs and the estimate's error (1 GiB + 2 % of the device).
struct GpuMemoryPlan {
  uint64_t model_bytes = 0;
  uint64_t page_bytes = 0;
  int64_t max_seq_len = 0;  // options.max_seq_len, or the default, capped by the config's positions
  int64_t max_pages_per_seq = 0;
  uint64_t full_kv_bytes = 0;  // limits.max_sequences sequences of max_seq_len tokens
  uint64_t slack_bytes = 0;
};
GpuMemoryPlan plan_gpu_memory(const io::ModelConfig& config, const GpuExecutorOptions& options,
                              uint64_t device_total_bytes, int expert_ranks = 1);

// The most leading decoder layers of `config` (1 .. config.num_hidden_layers) whose plan, with
// every sequence's KV cache at full length, fits options.gpu_memory_fraction of `free_bytes` (the
// device's free memory before the model is made); 0 when not even one layer does. Benchmarks
// of models larger than one device run that many layers (`moelora bench --max-layers fit`).
int64_t gpu_layers_that_fit(const io::ModelConfig& config, const GpuExecutorOptions& options,
                            uint64_t free_bytes, uint64_t device_total_bytes, int expert_ranks = 1);

// Whether this build has CUDA and a device is visible (never throws).
bool cuda_device_available();

// Loads (or draws) the model onto the device and sizes everything from the options. Throws
// moelora::Error: kUnsupported without CUDA, kInvalidArgument for bad options, kOutOfRange when the
// device memory cannot hold the model with a useful KV cache.
std::unique_ptr<Executor> make_gpu_executor(const GpuExecutorOptions& options);

// Device facts and measurements for `moelora bench` (kUnsupported without CUDA).
struct GpuDeviceReport {
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int num_sms = 0;
  uint64_t total_bytes = 0;
  int driver_version = 0;   // e.g. 13000
  int runtime_version = 0;  // CUDA runtime, e.g. 13000
  int memory_clock_khz = 0;
  int sm_clock_khz = 0;
};
GpuDeviceReport gpu_device_report(int device = 0);
// Device bytes in use now (cudaMemGetInfo: total - free; other processes included).
uint64_t gpu_memory_in_use(int device = 0);
// Device-to-device copy bandwidth in bytes/s, read + write counted (2 * bytes / time), median of
// `repetitions` timed cudaMemcpyAsync of `bytes` bytes after a warm-up.
double measure_copy_bandwidth(uint64_t bytes = 1ull << 30, int repetitions = 20, int device = 0);

// ============================================================================================
// Host-side pieces of the executor, CUDA-free so that the CPU tests cover them.

// Decode batch buckets: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, ... (powers of two and
// 1.5x powers of two from 16 on) below max_sequences, then max_sequences itself.
std::vector<int> decode_buckets(int max_sequences);
// The smallest bucket >= batch; -1 when batch exceeds the largest.
int decode_bucket(int batch, std::span<const int> buckets);

// Pages of the paged KV cache: ids [0, num_pages), handed out from a free list (lowest id first,
// so runs are reproducible). A sequence holds ceil(length / page_size) pages.
class PageAllocator {
 public:
  // kInvalidArgument unless num_pages >= 1, page_size >= 1 and max_pages_per_seq >= 1.
  PageAllocator(int64_t num_pages, int page_size, int max_pages_per_seq);

  SequenceHandle new_sequence();
  void free_sequence(SequenceHandle sequence);  // kInternal for a handle that is not live
  bool live(SequenceHandle sequence) const { return sequences_.count(sequence) > 0; }
  int64_t live_sequences() const { return static_cast<int64_t>(sequences_.size()); }

  int64_t length(SequenceHandle sequence) const;  // tokens committed
  const std::vector<int32_t>& pages(SequenceHandle sequence) const;
  // Makes `sequence` hold pages for `new_length` tokens (>= its length). kOutOfRange naming the
  // sequence when new_length exceeds the page table (max_pages_per_seq * page_size) or the pool
  // has too few free pages; nothing changes then.
  void reserve(SequenceHandle sequence, int64_t new_length);
  // The forward that used the reserved pages succeeded: the length becomes new_length.
  void commit(SequenceHandle sequence, int64_t new_length);
  // The forward failed: pages beyond what the committed length needs go back to the pool.
  void rollback(SequenceHandle sequence);

  int64_t num_pages() const { return num_pages_; }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t pages_in_use() const { return num_pages_ - free_pages(); }
  int page_size() const { return page_size_; }
  int max_pages_per_seq() const { return max_pages_per_seq_; }
  int64_t max_length() const { return static_cast<int64_t>(max_pages_per_seq_) * page_size_; }
  // The pool as Executor::kv_capacity() reports it.
  KvCapacity capacity() const { return {num_pages_, page_size_}; }

 private:
  struct Sequence {
    int64_t length = 0;
    std::vector<int32_t> pages;
  };
  Sequence& get(SequenceHandle sequence);
  const Sequence& get(SequenceHandle sequence) const;
  int64_t pages_for(int64_t length) const { return (length + page_size_ - 1) / page_size_; }

  int64_t num_pages_;
  int page_size_;
  int max_pages_per_seq_;
  std::vector<int32_t> free_;  // a stack: back() is the next page handed out
  std::map<SequenceHandle, Sequence> sequences_;
  SequenceHandle next_handle_ = 1;
};

// Capacities the step metadata is laid out for (GpuModelLimits).
struct StepCapacity {
  int max_tokens = 0;
  int max_seqs = 0;
  int num_slots = 0;
  int max_pages_per_seq = 0;
  int64_t vocab_size = 0;
};

// One step's metadata on the host, every array filled to its full capacity (padding included),
// with the forward's shape. Internal sequence k is batch entry order[k]; its rows are
// [q_start[k], q_start[k] + q_len[k]).
struct GpuStepPlan {
  int32_t num_tokens = 0;  // valid rows
  int32_t num_seqs = 0;    // valid sequences
  int32_t num_lora_segments = 0;
  std::vector<int32_t> token_ids, token_slot, token_seq, token_pos;  // [max_tokens]
  std::vector<int32_t> q_start, q_len, kv_len, last_row;             // [max_seqs]
  std::vector<int32_t> page_table;                                   // [max_seqs * max_pages]
  // Linear-attention layers: row offsets (sequence k's rows are [cu_seqlens[k], cu_seqlens[k +
  // 1]); padding sequences empty at num_tokens) and state slots (-1 here; the executor fills the
  // valid sequences' slots).
  std::vector<int32_t> cu_seqlens;     // [max_seqs + 1]
  std::vector<int32_t> state_slot;     // [max_seqs]
  std::vector<int32_t> lora_segments;  // [num_slots * 4] {slot, 0, begin, end}, then zeros
  std::vector<ops::SampleRowParams> sample_params;  // [max_seqs] (padding: greedy)
  std::vector<float> uniform;                       // [max_seqs]
  std::vector<int> order;                           // [num_seqs] batch index of sequence k

  // The forward's shape (model::ForwardShape).
  int rows = 0;  // T the forward runs: num_tokens, or the bucket for a graph
  int seqs = 0;  // B the forward runs
  int max_q_len = 0;
  int max_kv_len = 0;
  bool lora = false;
  int single_slot = -1;
  bool graph = false;  // a decode-only step run as the replay of bucket `rows`
};

// Fills `plan` for `batch` (see GpuStepPlan), reserving the KV pages the new tokens need in
// `pages` (the caller commits or rolls them back). params / uniforms: per entry, or empty (greedy
// params, u = 0). buckets: decode buckets, empty = no graphs. `occupied`: which slots hold an
// adapter. Checks the batch like CpuExecutor::forward (kInternal: limits, duplicate sequences,
// empty entries, empty or out-of-range slots, token ids outside the vocabulary); when it throws,
// no pages stay reserved.
void plan_gpu_step(std::span<const BatchEntry> batch, std::span<const ops::SampleRowParams> params,
                   std::span<const float> uniforms, const StepCapacity& capacity,
                   std::span<const int> buckets, const std::vector<bool>& occupied,
                   PageAllocator& pages, GpuStepPlan& plan);

// Every dense (non-expert) linear of decoder layer `layer` as fn(out_features, in_features):
// the attention projections (GQA q/k/v/o, or MLA q_a/q_b or q_proj, kv_a, kv_b, o, or Gated
// DeltaNet in_proj_qkv / z / b / a and out_proj) and the SwiGLU
// gate/up/down of the dense MLP or of the MoE layer's shared expert. The memory estimate below
// and `moelora bench`'s byte model both walk the model through it.
void for_each_dense_linear(const io::ModelConfig& config, int64_t layer,
                           const std::function<void(int64_t out, int64_t in)>& fn);

// Device bytes the GPU model will need for `config` besides the KV cache, estimated from the
// shapes (weights as the GPU model stores them, the adapter pool of num_slots x max_rank, and
// the per-token workspaces). Used to size the KV cache before the model exists. expert_ranks: the
// routed experts (and their LoRA pools) are split over that many ranks (config.num_experts is
// all of them; an expert-parallel rank holds 1 / expert_ranks), and so are the embedding and
// lm_head rows when the ranks divide the vocabulary (vocab_shard).
uint64_t estimate_gpu_model_bytes(const io::ModelConfig& config, bool fp8_experts,
                                  const ExecutorLimits& limits, int expert_ranks = 1);
// KV bytes per token over all layers as the paged cache stores them (bf16; GQA: K and V of every
// KV head; MLA: the latent kv_lora_rank + rope part); Gated DeltaNet layers hold none.
uint64_t estimate_kv_bytes_per_token(const io::ModelConfig& config);
// Whether decoder layer `layer` is a Qwen3.5 Gated DeltaNet ("linear_attention") layer.
bool is_linear_attention_layer(const io::ModelConfig& config, int64_t layer);
// Bytes of one sequence's linear-attention states over all such layers: the conv state (bf16
// [conv_dim, K - 1]) and the recurrent state (fp32 [nv, dk, dv]); 0 without such layers.
uint64_t linear_attention_state_bytes(const io::ModelConfig& config);
// The first `layers` decoder layers of `config` (per-layer lists cut to match); 0 = unchanged.
io::ModelConfig first_layers(io::ModelConfig config, int64_t layers);

}  // namespace moelora::runtime
