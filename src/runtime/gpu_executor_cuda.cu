// GpuExecutor (gpu_executor.h): the runtime's backend over model::GpuModel.
//
// One step: plan_gpu_step() (host: order by slot, pages, padding) -> copy the plan into the
// model's pinned metadata mirror -> upload_step() -> forward eagerly, or replay the decode
// bucket's CUDA graph -> one async copy of the sampled tokens (or the logits) into pinned host
// memory -> one stream synchronize. Nothing is allocated per step: the plan's vectors keep their
// capacity, the pinned buffers are made at construction.
//
// Graphs: keyed by (bucket, LoRA on/off). At a bucket's first decode step the forward runs
// eagerly (which also loads every kernel it uses, so no lazy module loading happens under
// capture), its outputs are copied back, and only then is the same forward captured, with
// single_slot = -1 (a graph serves any mix of slots) and max_kv_len = the page table's capacity.
// A capture that fails leaves that key eager for good (counted in capture_failures).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "core/cuda_utils.h"
#include "io/checkpoint.h"
#include "model/gpu_model_cuda.cuh"
#include "runtime/gpu_executor.h"

namespace moelora::runtime {

bool cuda_device_available() {
  return cuda::device_count() > 0;
}

GpuDeviceReport gpu_device_report(int device) {
  const cuda::DeviceInfo info = cuda::device_info(device);
  GpuDeviceReport r;
  r.name = info.name;
  r.sm_major = info.sm_major;
  r.sm_minor = info.sm_minor;
  r.num_sms = info.num_sms;
  r.total_bytes = info.total_memory;
  r.driver_version = info.driver_version;
  r.runtime_version = info.runtime_version;
  r.memory_clock_khz = info.memory_clock_khz;
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&r.sm_clock_khz, cudaDevAttrClockRate, device));
  return r;
}

uint64_t gpu_memory_in_use(int device) {
  MOELORA_CUDA_CHECK(cudaSetDevice(device));
  size_t free_bytes = 0, total_bytes = 0;
  MOELORA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<uint64_t>(total_bytes - free_bytes);
}

double measure_copy_bandwidth(uint64_t bytes, int repetitions, int device) {
  MOELORA_CHECK(bytes >= 1024 && repetitions >= 1, ErrorCode::kInvalidArgument,
                "measure_copy_bandwidth: bytes ", bytes, " (>= 1024) and repetitions ", repetitions,
                " (>= 1)");
  MOELORA_CUDA_CHECK(cudaSetDevice(device));
  cuda::DeviceBuffer src(bytes), dst(bytes);
  MOELORA_CUDA_CHECK(cudaMemset(src.get(), 1, bytes));
  cuda::Stream stream;
  cuda::Event start(true), stop(true);
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice,
                                     stream.get()));  // warm-up
  std::vector<float> ms;
  for (int i = 0; i < repetitions; ++i) {
    start.record(stream.get());
    MOELORA_CUDA_CHECK(
        cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream.get()));
    stop.record(stream.get());
    ms.push_back(cuda::Event::elapsed_ms(start, stop));
  }
  std::sort(ms.begin(), ms.end());
  const double median_s = static_cast<double>(ms[ms.size() / 2]) * 1e-3;
  return median_s > 0 ? 2.0 * static_cast<double>(bytes) / median_s : 0.0;
}

namespace {

// Page-locked host memory (cudaMallocHost): the targets of the per-step async copies.
template <typename T>
class PinnedArray {
 public:
  explicit PinnedArray(size_t count) : count_(count) {
    if (count)
      MOELORA_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ptr_), count * sizeof(T)));
  }
  ~PinnedArray() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  T* get() const { return ptr_; }
  size_t size() const { return count_; }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// An instantiated graph, destroyed with its owner.
class GraphExec {
 public:
  GraphExec() = default;
  explicit GraphExec(cudaGraphExec_t exec) : exec_(exec) {}
  ~GraphExec() {
    if (exec_) cudaGraphExecDestroy(exec_);
  }
  GraphExec(GraphExec&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)) {}
  GraphExec& operator=(GraphExec&&) = delete;
  cudaGraphExec_t get() const { return exec_; }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

template <typename T>
void copy_into(T* dst, const std::vector<T>& src) {
  std::memcpy(dst, src.data(), src.size() * sizeof(T));
}

class GpuExecutor final : public Executor {
 public:
  GpuExecutor(std::unique_ptr<model::GpuModel> model, const ExecutorLimits& limits,
              const GpuExecutorOptions& options)
      : model_(std::move(model)),
        limits_(limits),
        pages_(model_->limits().num_pages, model_->limits().page_size,
               model_->limits().max_pages_per_seq),
        occupied_(static_cast<size_t>(std::max(limits.num_slots, 0)), false),
        tokens_host_(static_cast<size_t>(model_->limits().max_seqs)),
        logits_host_(static_cast<size_t>(model_->limits().max_seqs) *
                     static_cast<size_t>(model_->config().vocab_size)) {
    const model::GpuModelLimits& m = model_->limits();
    capacity_ = {m.max_tokens, m.max_seqs, m.num_slots, m.max_pages_per_seq,
                 model_->config().vocab_size};
    if (options.cuda_graphs) buckets_ = decode_buckets(m.max_seqs);
    for (int32_t s = model_->num_state_slots() - 1; s >= 0; --s) free_state_slots_.push_back(s);
    // Buckets above the token capacity cannot be graphs (plan_gpu_step runs them eagerly).
    buckets_.erase(
        std::remove_if(buckets_.begin(), buckets_.end(), [&](int b) { return b > m.max_tokens; }),
        buckets_.end());
  }

  const io::ModelConfig& config() const override { return model_->config(); }
  const ExecutorLimits& limits() const override { return limits_; }
  int64_t max_sequence_length() const override { return pages_.max_length(); }
  KvCapacity kv_capacity() const override { return pages_.capacity(); }

  void check_adapter(const io::LoraAdapter& adapter) const override {
    MOELORA_CHECK(adapter.max_rank <= limits_.max_lora_rank, ErrorCode::kUnsupported, "adapter '",
                  adapter.name, "' has rank ", adapter.max_rank,
                  ", above the engine's max_lora_rank ", limits_.max_lora_rank);
    model_->check_adapter(adapter);
  }
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override {
    check_slot(slot);
    check_adapter(adapter);
    occupied_[static_cast<size_t>(slot)] = false;  // a failed upload leaves the slot unusable
    model_->write_slot(slot, adapter);
    occupied_[static_cast<size_t>(slot)] = true;
  }
  void clear_slot(int32_t slot) override {
    check_slot(slot);
    occupied_[static_cast<size_t>(slot)] = false;
    model_->clear_slot(slot);
  }
  bool supports_random_adapters() const override { return true; }
  void randomize_slot(int32_t slot, int64_t rank, bool shared_outer, uint64_t seed) override {
    check_slot(slot);
    MOELORA_CHECK(rank >= 1 && rank <= limits_.max_lora_rank, ErrorCode::kUnsupported,
                  "random adapter of rank ", rank, ": the engine's max_lora_rank is ",
                  limits_.max_lora_rank);
    occupied_[static_cast<size_t>(slot)] = false;
    model_->randomize_slot(slot, static_cast<int>(rank), shared_outer, seed);
    occupied_[static_cast<size_t>(slot)] = true;
  }

  SequenceHandle new_sequence() override {
    const bool stateful = model_->num_state_slots() > 0;
    // Linear-attention layers: the sequence's recurrent state, zeroed before its first forward.
    MOELORA_CHECK(!stateful || !free_state_slots_.empty(), ErrorCode::kInternal,
                  "no free linear-attention state slot: ", model_->num_state_slots(),
                  " sequences are live (the limit is max_sequences)");
    const SequenceHandle s = pages_.new_sequence();
    slot_of_[s] = kUnbound;
    if (stateful) {
      const int32_t state = free_state_slots_.back();
      model_->reset_state(state, model_->main_stream());
      free_state_slots_.pop_back();
      state_slot_of_[s] = state;
    }
    return s;
  }
  void free_sequence(SequenceHandle sequence) override {
    pages_.free_sequence(sequence);
    slot_of_.erase(sequence);
    auto it = state_slot_of_.find(sequence);
    if (it != state_slot_of_.end()) {
      free_state_slots_.push_back(it->second);
      state_slot_of_.erase(it);
    }
  }
  int64_t sequence_length(SequenceHandle sequence) const override {
    return pages_.length(sequence);
  }
  int64_t live_sequences() const override { return pages_.live_sequences(); }
  uint64_t cache_bytes() const override {
    return static_cast<uint64_t>(pages_.pages_in_use()) *
           static_cast<uint64_t>(pages_.page_size()) * model_->kv_bytes_per_token();
  }
  uint64_t state_bytes() const override {
    return static_cast<uint64_t>(state_slot_of_.size()) * linear_attention_state_bytes(config());
  }
  int64_t state_slots() const override { return model_->num_state_slots(); }

  std::vector<Tensor> forward(std::span<const BatchEntry> batch) override {
    run(batch, {}, {}, /*sample=*/false);
    const int64_t vocab = config().vocab_size;
    std::vector<Tensor> out(batch.size());
    for (size_t k = 0; k < plan_.order.size(); ++k) {
      Tensor row = Tensor::empty(DType::kF32, {1, vocab});
      std::memcpy(row.data<float>(), logits_host_.get() + k * static_cast<size_t>(vocab),
                  static_cast<size_t>(vocab) * sizeof(float));
      out[static_cast<size_t>(plan_.order[k])] = std::move(row);
    }
    return out;
  }

  std::vector<int32_t> forward_sample(std::span<const BatchEntry> batch,
                                      std::span<const ops::SampleRowParams> params,
                                      std::span<const float> uniforms) override {
    MOELORA_CHECK(params.size() == batch.size() && uniforms.size() == batch.size(),
                  ErrorCode::kInternal, "forward_sample of ", batch.size(), " entries with ",
                  params.size(), " sampling params and ", uniforms.size(), " uniforms");
    run(batch, params, uniforms, /*sample=*/true);
    std::vector<int32_t> tokens(batch.size(), -1);
    const int64_t vocab = config().vocab_size;
    for (size_t k = 0; k < plan_.order.size(); ++k) {
      const int32_t t = tokens_host_.get()[k];
      tokens[static_cast<size_t>(plan_.order[k])] = t >= 0 && t < vocab ? t : -1;
    }
    return tokens;
  }

  // Rows of the last forward's device logits (the model computes them for every sequence, also
  // when it samples), copied back only for the requests that asked for log-probabilities.
  std::vector<Tensor> last_logits(std::span<const size_t> rows) override {
    const int64_t vocab = config().vocab_size;
    std::vector<Tensor> out;
    out.reserve(rows.size());
    for (size_t row : rows) {
      int64_t k = -1;
      for (size_t j = 0; j < plan_.order.size(); ++j)
        if (static_cast<size_t>(plan_.order[j]) == row) k = static_cast<int64_t>(j);
      MOELORA_CHECK(k >= 0, ErrorCode::kInternal, "last_logits: row ", row,
                    " is not in the last batch");
      Tensor t = Tensor::empty(DType::kF32, {vocab});
      MOELORA_CUDA_CHECK(cudaMemcpyAsync(t.raw_data(), model_->logits() + k * vocab,
                                         static_cast<size_t>(vocab) * sizeof(float),
                                         cudaMemcpyDeviceToHost, model_->main_stream()));
      out.push_back(std::move(t));
    }
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(model_->main_stream()));
    return out;
  }

  ExecutorCounters counters() const override { return counters_; }
  std::string attention_kernel() const override { return model_->attention_kernel(); }
  int64_t moe_shared_experts_in_experts() const override {
    return model_->shared_experts_in_experts();
  }

 private:
  static constexpr int32_t kUnbound = -2;  // a sequence's slot before its first forward

  void check_slot(int32_t slot) const {
    MOELORA_CHECK(slot >= 0 && slot < limits_.num_slots, ErrorCode::kInternal, "adapter slot ",
                  slot, " is not in [0, ", limits_.num_slots, ")");
  }

  // The step: plan, upload, forward or replay, copy back, synchronize. On failure every
  // sequence of the batch keeps its length and pages.
  void run(std::span<const BatchEntry> batch, std::span<const ops::SampleRowParams> params,
           std::span<const float> uniforms, bool sample) {
    for (const BatchEntry& b : batch) {  // the runtime never moves a live sequence to another slot
      auto it = slot_of_.find(b.sequence);
      MOELORA_CHECK(it != slot_of_.end(), ErrorCode::kInternal, "sequence handle ", b.sequence,
                    " is not live");
      MOELORA_CHECK(it->second == kUnbound || it->second == b.slot, ErrorCode::kInternal,
                    "sequence handle ", b.sequence, " was made for slot ", it->second,
                    " but runs on slot ", b.slot);
    }
    plan_gpu_step(batch, params, uniforms, capacity_, buckets_, occupied_, pages_, plan_);
    if (!state_slot_of_.empty()) {
      for (int32_t k = 0; k < plan_.num_seqs; ++k)
        plan_.state_slot[static_cast<size_t>(k)] = state_slot_of_.at(
            batch[static_cast<size_t>(plan_.order[static_cast<size_t>(k)])].sequence);
    }
    try {
      launch(sample);
    } catch (...) {
      // Pages go back; the batch's linear-attention states may already have advanced on the
      // device, which is fine because the engine ends every request of a failed forward.
      for (const BatchEntry& b : batch) pages_.rollback(b.sequence);
      throw;
    }
    for (const BatchEntry& b : batch) {
      pages_.commit(b.sequence, pages_.length(b.sequence) + static_cast<int64_t>(b.tokens.size()));
      slot_of_[b.sequence] = b.slot;
    }
  }

  void write_mirror() {
    model::StepMetadata& h = model_->host_step();
    *h.num_tokens = plan_.num_tokens;
    *h.num_seqs = plan_.num_seqs;
    copy_into(h.token_ids, plan_.token_ids);
    copy_into(h.token_slot, plan_.token_slot);
    copy_into(h.token_seq, plan_.token_seq);
    copy_into(h.token_pos, plan_.token_pos);
    copy_into(h.q_start, plan_.q_start);
    copy_into(h.q_len, plan_.q_len);
    copy_into(h.kv_len, plan_.kv_len);
    copy_into(h.last_row, plan_.last_row);
    copy_into(h.page_table, plan_.page_table);
    *h.num_lora_segments = plan_.num_lora_segments;
    if (!plan_.lora_segments.empty()) copy_into(h.lora_segments, plan_.lora_segments);
    copy_into(h.sample_params, plan_.sample_params);
    copy_into(h.uniform, plan_.uniform);
    copy_into(h.cu_seqlens, plan_.cu_seqlens);
    copy_into(h.state_slot, plan_.state_slot);
  }

  model::ForwardShape shape_of(bool sample) const {
    model::ForwardShape shape;
    shape.tokens = plan_.rows;
    shape.seqs = plan_.seqs;
    shape.max_q_len = plan_.max_q_len;
    shape.max_kv_len = plan_.max_kv_len;
    shape.lora = plan_.lora;
    shape.single_slot = plan_.single_slot;
    shape.sample = sample;
    return shape;
  }

  void launch(bool sample) {
    const cudaStream_t stream = model_->main_stream();
    write_mirror();  // the previous step synchronized: the mirror is not being read
    model_->upload_step(shape_of(sample), stream);
    const std::pair<int, bool> key{plan_.rows, plan_.lora};
    bool captured_now = false;
    if (plan_.graph) {
      auto it = graphs_.find(key);
      if (it != graphs_.end() && it->second.get() != nullptr) {
        MOELORA_CUDA_CHECK(cudaGraphLaunch(it->second.get(), stream));
        ++counters_.graph_replays;
      } else {
        // Graphs always sample (the logits are computed either way), so one graph serves both
        // forward() and forward_sample().
        model_->forward(shape_of(/*sample=*/true));
        ++counters_.eager_forwards;
        captured_now = it == graphs_.end();
      }
    } else {
      model_->forward(shape_of(sample));
      ++counters_.eager_forwards;
    }
    copy_back(sample, stream);
    if (captured_now) capture(key);
  }

  void copy_back(bool sample, cudaStream_t stream) {
    const size_t seqs = static_cast<size_t>(plan_.num_seqs);
    if (sample) {
      MOELORA_CUDA_CHECK(cudaMemcpyAsync(tokens_host_.get(), model_->sampled(),
                                         seqs * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    } else {
      const size_t vocab = static_cast<size_t>(config().vocab_size);
      MOELORA_CUDA_CHECK(cudaMemcpyAsync(logits_host_.get(), model_->logits(),
                                         seqs * vocab * sizeof(float), cudaMemcpyDeviceToHost,
                                         stream));
    }
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  // Records the decode forward of `key` (bucket, lora) into a graph. Runs nothing.
  void capture(const std::pair<int, bool>& key) {
    const cudaStream_t stream = model_->main_stream();
    model::ForwardShape shape = shape_of(/*sample=*/true);
    shape.single_slot = -1;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    bool ok = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (ok) {
      try {
        model_->forward(shape);
      } catch (const Error&) {
        ok = false;
      }
      // Ends the capture whatever happened, so that the stream is usable again.
      const cudaError_t end = cudaStreamEndCapture(stream, &graph);
      ok = ok && end == cudaSuccess && graph != nullptr;
    }
    // Node priorities: kernels captured from a stream of greater priority (the MoE layers' shared
    // expert LoRA stream) keep it in replays, instead of all taking the launch stream's.
    if (ok)
      ok = cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority) ==
           cudaSuccess;
    if (graph) cudaGraphDestroy(graph);
    if (!ok) {
      cudaGetLastError();  // clear the capture error; this key runs eagerly from now on
      graphs_.emplace(key, GraphExec());
      ++counters_.capture_failures;
      return;
    }
    graphs_.emplace(key, GraphExec(exec));
    ++counters_.graph_captures;
  }

  std::unique_ptr<model::GpuModel> model_;
  ExecutorLimits limits_;
  PageAllocator pages_;
  StepCapacity capacity_;
  std::vector<int> buckets_;
  std::vector<bool> occupied_;
  std::map<SequenceHandle, int32_t> slot_of_;
  GpuStepPlan plan_;
  // Linear-attention state slots (GpuModel::num_state_slots): free ones (a stack) and each live
  // sequence's.
  std::vector<int32_t> free_state_slots_;
  std::map<SequenceHandle, int32_t> state_slot_of_;
  PinnedArray<int32_t> tokens_host_;                  // [max_seqs]
  PinnedArray<float> logits_host_;                    // [max_seqs, V]
  std::map<std::pair<int, bool>, GraphExec> graphs_;  // empty GraphExec: capture failed
  ExecutorCounters counters_;
};

int round_up(int64_t value, int64_t multiple) {
  return static_cast<int>((value + multiple - 1) / multiple * multiple);
}

// The smallest page count any rank of the group can hold: every rank runs the same steps, so
// they all size their pools alike. An all-gather through the group's sum (each rank's count in
// its own element, zeros elsewhere; counts below 2^24 are exact in fp32).
int64_t fewest_pages_of_the_group(int64_t pages, DeviceCollectives& group) {
  const int n = group.size();
  std::vector<float> counts(static_cast<size_t>(n), 0.0f);
  counts[static_cast<size_t>(group.rank())] = static_cast<float>(std::min<int64_t>(pages, 1 << 24));
  cuda::DeviceBuffer device(counts.size() * sizeof(float));
  cuda::Stream stream;
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(device.get(), counts.data(), counts.size() * sizeof(float),
                                     cudaMemcpyHostToDevice, stream.get()));
  group.all_reduce_sum(device.get(), counts.size(), DType::kF32, stream.get());
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(counts.data(), device.get(), counts.size() * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream.get()));
  stream.synchronize();
  int64_t fewest = pages;
  for (int r = 0; r < n; ++r) {
    MOELORA_CHECK(counts[static_cast<size_t>(r)] >= 1.0f, ErrorCode::kInternal, "rank ", r,
                  " of the group reported ", counts[static_cast<size_t>(r)],
                  " KV pages; the ranks disagree on the group");
    fewest = std::min(fewest, static_cast<int64_t>(counts[static_cast<size_t>(r)]));
  }
  return fewest;
}

}  // namespace

std::unique_ptr<Executor> make_gpu_executor(const GpuExecutorOptions& o) {
  const auto bad = ErrorCode::kInvalidArgument;
  const ExecutorLimits& l = o.limits;
  MOELORA_CHECK(l.max_batch_tokens > 0 && l.max_sequences > 0 && l.num_slots >= 0 &&
                    l.max_lora_rank > 0 && l.max_batch_tokens <= INT32_MAX,
                bad, "executor limits must be positive: max_batch_tokens ", l.max_batch_tokens,
                ", max_sequences ", l.max_sequences, ", num_slots ", l.num_slots,
                ", max_lora_rank ", l.max_lora_rank);
  MOELORA_CHECK(o.page_size >= 16 && (o.page_size & (o.page_size - 1)) == 0, bad,
                "page_size must be a power of two >= 16, got ", o.page_size);
  MOELORA_CHECK(o.max_seq_len >= 0 && o.max_layers >= 0, bad,
                "max_seq_len and max_layers must be >= 0, got ", o.max_seq_len, " and ",
                o.max_layers);
  MOELORA_CHECK(o.gpu_memory_fraction > 0.0 && o.gpu_memory_fraction <= 1.0, bad,
                "gpu_memory_fraction must be in (0, 1], got ", o.gpu_memory_fraction);
  MOELORA_CHECK(cuda::device_count() > o.device && o.device >= 0, ErrorCode::kUnsupported,
                "CUDA device ", o.device, " is not available (", cuda::device_count(), " visible)");
  MOELORA_CUDA_CHECK(cudaSetDevice(o.device));
  size_t free_before = 0, total = 0;
  MOELORA_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));

  // The model's shapes first: they size the KV cache before anything is allocated.
  io::ModelConfig config;
  std::unique_ptr<io::ModelWeights> weights;
  if (o.random_weights) {
    config = first_layers(io::load_model_config(o.model_dir), o.max_layers);
  } else {
    io::LoadOptions load;
    load.show_progress = o.show_progress;
    load.max_layers = o.max_layers;
    weights = std::make_unique<io::ModelWeights>(io::load_checkpoint(o.model_dir, load));
    config = weights->config;
  }
  // A rank of a tensor / expert parallel group: its share of the checkpoint (whose unsplit
  // tensors stay in `whole` until the upload) or of the config.
  const int ranks = o.collectives ? o.collectives->size() : 1;
  std::unique_ptr<io::ModelWeights> whole;
  if (o.collectives) {
    MOELORA_CHECK(o.shard_checkpoint && o.shard_config, bad,
                  "a GPU executor of a parallel group needs shard_checkpoint and shard_config");
    if (weights) {
      whole = std::move(weights);
      weights = std::make_unique<io::ModelWeights>(o.shard_checkpoint(*whole));
      config = weights->config;
    } else {
      config = o.shard_config(config);
    }
  }
  const bool fp8_experts = config.quant.method == io::QuantMethod::kFp8Block;

  model::GpuModelLimits m;
  m.max_tokens = static_cast<int>(l.max_batch_tokens);
  m.max_seqs = l.max_sequences;
  m.num_slots = l.num_slots;
  m.max_rank = round_up(l.max_lora_rank, 8);
  m.page_size = o.page_size;
  const GpuMemoryPlan plan = plan_gpu_memory(config, o, total, ranks);
  const int64_t max_seq_len = plan.max_seq_len;
  m.max_pages_per_seq = static_cast<int>(plan.max_pages_per_seq);
  const uint64_t page_bytes = plan.page_bytes;
  // Never more than every sequence at full length needs.
  const uint64_t need = plan.full_kv_bytes;
  uint64_t budget = o.kv_cache_bytes;
  if (budget == 0) {
    const uint64_t model_bytes = plan.model_bytes, slack = plan.slack_bytes;
    const double usable = o.gpu_memory_fraction * static_cast<double>(free_before);
    MOELORA_CHECK(usable > static_cast<double>(model_bytes + slack) +
                               static_cast<double>(page_bytes) * m.max_pages_per_seq,
                  ErrorCode::kOutOfRange, "device ", o.device, " has ", free_before >> 20,
                  " MiB free; ", o.gpu_memory_fraction, " of it cannot hold the model (about ",
                  model_bytes >> 20, " MiB with the adapter pool and workspaces) plus one ",
                  max_seq_len,
                  "-token sequence's KV cache; use fewer layers (max_layers), fewer "
                  "adapter slots or tokens per step");
    budget = static_cast<uint64_t>(usable) - model_bytes - slack;
  }
  budget = std::min(budget, need);
  m.num_pages = std::max<int64_t>(1, static_cast<int64_t>(budget / page_bytes));
  if (ranks > 1) m.num_pages = fewest_pages_of_the_group(m.num_pages, *o.collectives);
  m.kv_cache_bytes = static_cast<uint64_t>(m.num_pages) * page_bytes;

  model::GpuModelOptions mo;
  mo.show_progress = o.show_progress;
  mo.device = o.device;
  mo.attention = model::parse_attention_kernel(o.attention);
  mo.attention_pdl = o.attention_pdl;
  mo.router_in_route = o.router_in_route;
  mo.moe_seam1_after_quant = o.moe_seam1_after_quant;
  mo.moe_pdl_after_side_join = o.moe_pdl_after_side_join;
  mo.moe_seam2_in_finalize_max_tokens = o.moe_seam2_in_finalize_max_tokens;
  mo.moe_seam2_shrink_in_activation = o.moe_seam2_shrink_in_activation;
  mo.moe_shared_lora_stream = o.moe_shared_lora_stream;
  mo.moe_activation_pdl_with_shared_pairs = o.moe_activation_pdl_with_shared_pairs;
  mo.moe_lora_side_ctas = o.moe_lora_side_ctas;
  mo.moe_stream_schedule = o.moe_stream_schedule;
  mo.moe_shared_expert_in_experts = o.moe_shared_expert_in_experts;
  mo.gdn_lora_delta_in_mix = o.gdn_lora_delta_in_mix;
  mo.collectives = o.collectives;
  std::unique_ptr<model::GpuModel> model =
      o.random_weights ? model::GpuModel::random(config, o.random_seed, fp8_experts, m, mo)
                       : model::GpuModel::load(*weights, m, mo);
  weights.reset();  // the host copy (mmap) is not needed any more
  whole.reset();
  return std::make_unique<GpuExecutor>(std::move(model), l, o);
}

}  // namespace moelora::runtime
