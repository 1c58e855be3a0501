// moelora::Engine (include/moelora/engine.h): request state, validation, the step loop and event
// delivery, over a Scheduler, an AdapterPool and an Executor.
//
// Sampling: each request's own model::Sampler draws its uniform number (only when its temperature
// is > 0, exactly when Sampler::sample would), and the executor picks the token from the logits
// with it (Executor::forward_sample: on the host for the CPU backend, on the device for the GPU
// backend), so every backend consumes the same random stream.
//
// Random adapters (register_random_adapter, benchmarks): registered in the pool like any other,
// under a placeholder io::LoraAdapter that carries only the name and rank; the slot writer sees
// the name and asks the executor to draw the adapter into the slot instead of uploading factors.
//
// Locking: `state_mutex` guards everything but the callbacks; step() holds it while it plans,
// runs the forward and samples, then releases it and delivers the step's events while holding
// only `step_mutex` (which keeps steps, and so each request's events, in order). A callback may
// therefore call submit() / cancel() (they take state_mutex only), but not step(). state_mutex is
// a FairMutex: with std::mutex the stepping thread, relocking microseconds after each step, could
// keep a submitting thread out until the running requests finished.
#include "moelora/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <set>

#include "core/fair_mutex.h"
#include "model/sampler.h"
#include "runtime/adapter_pool.h"
#include "runtime/cpu_executor.h"
#include "runtime/executor.h"
#include "runtime/gpu_executor.h"
#include "runtime/scheduler.h"

namespace moelora {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;

// A registered random adapter (register_random_adapter).
struct RandomAdapter {
  int64_t rank = 0;
  bool shared_outer = false;
  uint64_t seed = 0;
};

// The pool writes slots through the executor; random adapters are drawn by it.
class ExecutorSlotWriter final : public runtime::SlotWriter {
 public:
  ExecutorSlotWriter(runtime::Executor& executor,
                     const std::map<std::string, RandomAdapter>& random)
      : executor_(executor), random_(random) {}
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override {
    auto it = random_.find(adapter.name);
    if (it != random_.end() && adapter.layers.empty()) {
      executor_.randomize_slot(slot, it->second.rank, it->second.shared_outer, it->second.seed);
      return;
    }
    executor_.write_slot(slot, adapter);
  }
  void clear_slot(int32_t slot) override { executor_.clear_slot(slot); }

 private:
  runtime::Executor& executor_;
  const std::map<std::string, RandomAdapter>& random_;
};

// The placeholder the pool holds for a random adapter: its name and rank, no factors.
io::LoraAdapter random_placeholder(const std::string& name, const RandomAdapter& r) {
  io::LoraAdapter a;
  a.name = name;
  a.max_rank = r.rank;
  a.targets = {std::string("random ") + (r.shared_outer ? "shared-outer" : "per-expert") +
               " adapter, seed " + std::to_string(r.seed)};
  return a;
}

std::filesystem::path random_dir(const RandomAdapter& r) {
  return "random:rank=" + std::to_string(r.rank) +
         (r.shared_outer ? ",shared-outer" : ",per-expert") + ",seed=" + std::to_string(r.seed);
}

// u in [0, 1) as the float the executors take (a double just below 1 would round to 1.0f).
float uniform_as_float(double u) {
  const float f = static_cast<float>(u);
  return f < 1.0f ? f : std::nextafter(1.0f, 0.0f);
}

// The scheduler's limits: the engine options and the backend's KV page pool.
runtime::SchedulerOptions scheduler_options(const EngineOptions& o, const runtime::KvCapacity& kv) {
  runtime::SchedulerOptions s;
  s.max_batch_tokens = o.max_batch_tokens;
  s.max_running = o.max_running;
  s.max_loras_per_batch = o.max_loras_per_batch;
  s.prefill_chunk = o.prefill_chunk;
  s.kv_pages = kv.pages;
  s.kv_page_size = kv.page_size;
  return s;
}

void check_options(const EngineOptions& o) {
  const auto bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(o.adapter_slots >= 0, bad, "adapter_slots must be >= 0, got ", o.adapter_slots);
  MOELORA_CHECK(o.max_lora_rank >= 1, bad, "max_lora_rank must be >= 1, got ", o.max_lora_rank);
  MOELORA_CHECK(o.host_adapter_cache >= 0, bad, "host_adapter_cache must be >= 0, got ",
                o.host_adapter_cache);
  MOELORA_CHECK(o.max_layers >= 0, bad, "max_layers must be >= 0 (0 = all), got ", o.max_layers);
  MOELORA_CHECK(o.max_seq_len >= 0, bad, "max_seq_len must be >= 0 (0 = automatic), got ",
                o.max_seq_len);
  MOELORA_CHECK(o.gpu_memory_fraction > 0.0 && o.gpu_memory_fraction <= 1.0, bad,
                "gpu_memory_fraction must be in (0, 1], got ", o.gpu_memory_fraction);
  MOELORA_CHECK(o.attention == "auto" || o.attention == "flashinfer" || o.attention == "moelora",
                bad, "attention must be auto, flashinfer or moelora, got '", o.attention, "'");
  runtime::check_scheduler_options(scheduler_options(o, {}), o.adapter_slots);
}

bool is_cuda(const std::string& device) {
  return device == "cuda" || device == "gpu";
}

void require_device(const std::string& device) {
  if (device == "cpu") return;
  if (is_cuda(device)) {
#if MOELORA_WITH_CUDA
    MOELORA_CHECK(runtime::cuda_device_available(), ErrorCode::kUnsupported, "device '", device,
                  "': no CUDA device is visible (no driver, no GPU, or CUDA_VISIBLE_DEVICES "
                  "hides them); use device 'cpu'");
    return;
#else
    MOELORA_THROW(ErrorCode::kUnsupported, "device '", device,
                  "': this build has no CUDA support (configured with MOELORA_ENABLE_CUDA=OFF or "
                  "without nvcc); use device 'cpu'");
#endif
  }
  MOELORA_THROW(ErrorCode::kInvalidArgument, "device '", device,
                "' is unknown; expected cpu or cuda");
}

// The log-softmax of `logits` at `token`, and its `top` largest entries (most likely first, ties
// by lower id), in double precision for the normalizer.
TokenEvent::Logprobs token_logprobs(std::span<const float> logits, int32_t token, int32_t top) {
  float max = -std::numeric_limits<float>::infinity();
  for (float v : logits) max = std::max(max, v);
  double sum = 0.0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - max);
  const double lse = static_cast<double>(max) + std::log(sum);
  TokenEvent::Logprobs out;
  out.logprob = static_cast<float>(static_cast<double>(logits[static_cast<size_t>(token)]) - lse);
  if (top <= 0) return out;
  // A min-heap of the best `top` (value, -id): O(V log top).
  auto worse = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<std::pair<float, int32_t>> heap;
  heap.reserve(static_cast<size_t>(top) + 1);
  for (size_t i = 0; i < logits.size(); ++i) {
    const std::pair<float, int32_t> item{logits[i], static_cast<int32_t>(i)};
    if (heap.size() < static_cast<size_t>(top)) {
      heap.push_back(item);
      std::push_heap(heap.begin(), heap.end(), worse);
    } else if (worse(item, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      heap.back() = item;
      std::push_heap(heap.begin(), heap.end(), worse);
    }
  }
  std::sort(heap.begin(), heap.end(), worse);
  for (const auto& [value, id] : heap)
    out.top.push_back({id, static_cast<float>(static_cast<double>(value) - lse)});
  return out;
}

}  // namespace

runtime::ExecutorLimits runtime::executor_limits(const EngineOptions& o) {
  return {o.max_batch_tokens, o.max_running, o.adapter_slots, o.max_lora_rank};
}

Status check_device(const std::string& device) {
  return capture([&] { require_device(device); });
}

std::string default_device() {
  return check_device("cuda").is_ok() ? "cuda" : "cpu";
}

struct Engine::Impl {
  struct RequestState {
    RequestId id = 0;
    Request request;
    std::shared_ptr<TokenCallback> callback;
    model::Sampler sampler;
    std::vector<int32_t> stop_tokens;
    runtime::SequenceHandle sequence = -1;  // -1 until admitted
    int64_t generated = 0;
    int32_t last_token = -1;
  };
  struct PendingEvent {
    std::shared_ptr<TokenCallback> callback;
    TokenEvent event;
  };

  Impl(std::unique_ptr<runtime::Executor> exec, const EngineOptions& opts)
      : options(opts),
        executor(std::move(exec)),
        writer(*executor, random_adapters),
        pool(opts.adapter_slots, opts.host_adapter_cache, writer, pool_loader()),
        scheduler(scheduler_options(opts, executor->kv_capacity()), pool) {
    const io::ModelConfig& config = executor->config();
    info.model_type = config.model_type;
    info.vocab_size = config.vocab_size;
    info.num_layers = config.num_hidden_layers;
    info.max_position_embeddings = config.max_position_embeddings;
    info.max_sequence_length = executor->max_sequence_length();
    info.attention_kernel = executor->attention_kernel();
    info.moe_shared_experts_in_experts = executor->moe_shared_experts_in_experts();
    info.state_slots = executor->state_slots();
    if (scheduler.kv_limited()) {
      info.kv_cache_pages = scheduler.options().kv_pages;
      info.kv_page_size = scheduler.options().kv_page_size;
    }
    for (int64_t id : config.eos_token_ids) {
      if (id >= 0 && id < config.vocab_size) info.eos_token_ids.push_back(static_cast<int32_t>(id));
    }
  }

  // Reads an adapter for this model: the files (max_lora_rank applies), then the model's checks.
  runtime::AdapterLoader loader() {
    runtime::Executor* exec = executor.get();
    const int64_t max_rank = options.max_lora_rank;
    return [exec, max_rank](const std::string& name, const std::filesystem::path& dir) {
      io::AdapterLoadOptions load;
      load.max_rank = max_rank;
      io::LoraAdapter adapter = io::load_adapter(dir, exec->config(), name, load);
      exec->check_adapter(adapter);
      return adapter;
    };
  }

  // The pool's loader: random adapters come back as their placeholder (called under
  // state_mutex, which guards random_adapters).
  runtime::AdapterLoader pool_loader() {
    runtime::AdapterLoader files = loader();
    return [this, files](const std::string& name, const std::filesystem::path& dir) {
      auto it = random_adapters.find(name);
      if (it != random_adapters.end()) return random_placeholder(name, it->second);
      return files(name, dir);
    };
  }

  void emit(RequestState& r, TokenEvent event) {
    event.request_id = r.id;
    pending.push_back({r.callback, std::move(event)});
  }

  // Removes a request that was admitted or waiting: scheduler, slot, sequence, state.
  void drop(RequestId id) {
    auto it = requests.find(id);
    if (it == requests.end()) return;
    scheduler.remove(id);  // releases the adapter slot when running
    if (it->second->sequence >= 0) executor->free_sequence(it->second->sequence);
    requests.erase(it);
  }

  void fail(RequestState& r, const std::string& message) {
    TokenEvent event;
    event.finished = true;
    event.finish_reason = FinishReason::kError;
    event.error = message;
    emit(r, std::move(event));
    ++stats.requests_failed;
    drop(r.id);
  }

  Status validate(const Request& request) const;
  void run_step(const runtime::StepPlan& plan);
  void update_gauges();

  EngineOptions options;
  ModelInfo info;
  std::unique_ptr<runtime::Executor> executor;
  std::map<std::string, RandomAdapter> random_adapters;  // before writer and pool: they use it
  ExecutorSlotWriter writer;
  runtime::AdapterPool pool;
  runtime::Scheduler scheduler;

  // First come, first served: step() releases and retakes it back to back, and a submit(),
  // cancel() or stats() from an HTTP thread must get in between (core/fair_mutex.h).
  mutable FairMutex state_mutex;
  std::mutex step_mutex;
  std::map<RequestId, std::unique_ptr<RequestState>> requests;
  std::vector<PendingEvent> pending;
  RequestId next_id = 1;
  EngineStats stats;
};

Status Engine::Impl::validate(const Request& request) const {
  return capture([&] {
    const auto bad = ErrorCode::kInvalidArgument;
    const SamplingParams& s = request.sampling;
    MOELORA_CHECK(!request.prompt.empty(), bad, "request: the prompt is empty");
    for (size_t i = 0; i < request.prompt.size(); ++i) {
      const int32_t id = request.prompt[i];
      MOELORA_CHECK(id >= 0 && id < info.vocab_size, ErrorCode::kOutOfRange, "request: token id ",
                    id, " at prompt position ", i, " is outside the vocabulary [0, ",
                    info.vocab_size, ")");
    }
    MOELORA_CHECK(s.max_new_tokens >= 1, bad, "request: max_new_tokens must be >= 1, got ",
                  s.max_new_tokens);
    const int64_t context = static_cast<int64_t>(request.prompt.size()) + s.max_new_tokens;
    MOELORA_CHECK(info.max_position_embeddings <= 0 || context <= info.max_position_embeddings,
                  ErrorCode::kOutOfRange, "request: prompt (", request.prompt.size(),
                  " tokens) + max_new_tokens (", s.max_new_tokens, ") = ", context,
                  " exceeds the model's context of ", info.max_position_embeddings, " tokens");
    MOELORA_CHECK(info.max_sequence_length <= 0 || context <= info.max_sequence_length,
                  ErrorCode::kOutOfRange, "request: prompt (", request.prompt.size(),
                  " tokens) + max_new_tokens (", s.max_new_tokens, ") = ", context,
                  " exceeds the engine's maximum sequence length of ", info.max_sequence_length,
                  " tokens (EngineOptions::max_seq_len)");
    // Admission reserves the KV pages of the whole request (engine.h): one that needs more than
    // the pool could only ever wait.
    MOELORA_CHECK(
        info.kv_cache_pages <= 0 || scheduler.kv_pages_for(context) <= info.kv_cache_pages,
        ErrorCode::kOutOfRange, "request: prompt (", request.prompt.size(),
        " tokens) + max_new_tokens (", s.max_new_tokens, ") = ", context, " tokens need ",
        scheduler.kv_pages_for(context), " KV cache pages of ", info.kv_page_size,
        " tokens, but the whole KV cache has ", info.kv_cache_pages, " pages (",
        info.kv_cache_pages * info.kv_page_size,
        " tokens); raise EngineOptions::kv_cache_bytes or gpu_memory_fraction, or ask "
        "for fewer tokens");
    for (int32_t id : s.stop_token_ids) {
      MOELORA_CHECK(id >= 0 && id < info.vocab_size, ErrorCode::kOutOfRange,
                    "request: stop token id ", id, " is outside the vocabulary [0, ",
                    info.vocab_size, ")");
    }
    MOELORA_CHECK(s.logprobs >= -1 && s.logprobs <= kMaxTopLogprobs, ErrorCode::kOutOfRange,
                  "request: logprobs must be -1 (none) or in [0, ", kMaxTopLogprobs, "], got ",
                  s.logprobs);
    try {
      model::check_sampling_params({s.temperature, s.top_p, s.top_k, s.seed});
    } catch (const Error& e) {
      MOELORA_THROW(e.code(), "request: ", e.what());
    }
    if (request.adapter.empty()) return;
    if (!pool.contains(request.adapter)) {
      try {
        pool.refcount(request.adapter);  // throws kNotFound listing the registered adapters
      } catch (const Error& e) {
        MOELORA_THROW(e.code(), "request: ", e.what());
      }
    }
    MOELORA_CHECK(options.max_loras_per_batch > 0, ErrorCode::kUnsupported, "request: adapter '",
                  request.adapter, "' cannot run: LoRA is off (max_loras_per_batch is 0)");
    MOELORA_CHECK(pool.can_ever_acquire(request.adapter), ErrorCode::kUnsupported,
                  "request: adapter '", request.adapter, "' cannot get a slot: all ",
                  pool.num_slots(), " adapter slots are pinned to other adapters");
  });
}

void Engine::Impl::update_gauges() {
  stats.running = scheduler.running();
  stats.waiting = scheduler.waiting();
  stats.peak_running = std::max(stats.peak_running, stats.running);
  stats.kv_cache_bytes = executor->cache_bytes();
  stats.peak_kv_cache_bytes = std::max(stats.peak_kv_cache_bytes, stats.kv_cache_bytes);
  stats.state_cache_bytes = executor->state_bytes();
  stats.state_sequences = stats.state_cache_bytes > 0 ? executor->live_sequences() : 0;
  stats.kv_pages_reserved = scheduler.kv_pages_reserved();
  stats.peak_kv_pages_reserved = std::max(stats.peak_kv_pages_reserved, stats.kv_pages_reserved);
}

void Engine::Impl::run_step(const runtime::StepPlan& plan) {
  if (plan.kv_blocked) ++stats.kv_blocked_steps;
  // The peak as planned: finished requests give their pages back before the step ends.
  stats.peak_kv_pages_reserved =
      std::max(stats.peak_kv_pages_reserved, scheduler.kv_pages_reserved());
  for (const auto& [id, reason] : plan.failed) {
    auto it = requests.find(id);
    if (it != requests.end()) fail(*it->second, reason);
  }
  if (plan.empty()) return;

  // The batch, in plan order. Spans point into the requests' prompts and last tokens, which stay
  // put until the forward returns.
  std::vector<runtime::BatchEntry> batch;
  std::vector<RequestState*> owners;
  batch.reserve(plan.items.size());
  for (const runtime::StepItem& item : plan.items) {
    RequestState& r = *requests.at(item.id);
    if (item.admitted) r.sequence = executor->new_sequence();
    const std::span<const int32_t> tokens =
        item.decode
            ? std::span<const int32_t>(&r.last_token, 1)
            : std::span<const int32_t>(r.request.prompt)
                  .subspan(static_cast<size_t>(item.begin), static_cast<size_t>(item.count));
    batch.push_back({r.sequence, tokens, item.slot});
    owners.push_back(&r);
  }

  // Sampling parameters and uniforms; entries that do not sample run greedy and are ignored.
  std::vector<ops::SampleRowParams> params(batch.size());
  std::vector<float> uniforms(batch.size(), 0.0f);
  for (size_t i = 0; i < plan.items.size(); ++i) {
    if (!plan.items[i].samples) continue;
    RequestState& r = *owners[i];
    const SamplingParams& s = r.request.sampling;
    params[i].temperature = static_cast<float>(s.temperature);
    params[i].top_p = static_cast<float>(s.top_p);
    params[i].top_k = static_cast<int32_t>(std::min<int64_t>(s.top_k, info.vocab_size));
    if (s.temperature > 0) uniforms[i] = uniform_as_float(r.sampler.next_uniform());
  }

  const auto start = Clock::now();
  std::vector<int32_t> tokens;
  try {
    tokens = executor->forward_sample(batch, params, uniforms);
    MOELORA_CHECK(tokens.size() == batch.size(), ErrorCode::kInternal, "the backend returned ",
                  tokens.size(), " tokens for a batch of ", batch.size());
  } catch (const std::exception& e) {
    // The backend refused the batch (a bug or a device failure): end its requests, keep going.
    for (RequestState* r : owners) fail(*r, std::string("the forward pass failed: ") + e.what());
    return;
  }
  // Log-probabilities for the requests that asked (their logits rows, copied back only for them).
  std::vector<size_t> logprob_rows;
  for (size_t i = 0; i < plan.items.size(); ++i)
    if (plan.items[i].samples && owners[i]->request.sampling.logprobs >= 0 && tokens[i] >= 0 &&
        tokens[i] < info.vocab_size)
      logprob_rows.push_back(i);
  std::vector<std::optional<TokenEvent::Logprobs>> logprobs(plan.items.size());
  if (!logprob_rows.empty()) {
    try {
      const std::vector<Tensor> rows = executor->last_logits(logprob_rows);
      for (size_t j = 0; j < logprob_rows.size(); ++j) {
        const size_t i = logprob_rows[j];
        logprobs[i] = token_logprobs(
            std::span<const float>(rows[j].data<float>(), static_cast<size_t>(rows[j].numel())),
            tokens[i], owners[i]->request.sampling.logprobs);
      }
    } catch (const std::exception& e) {
      for (size_t i : logprob_rows) fail(*owners[i], std::string("log-probabilities: ") + e.what());
      for (size_t i : logprob_rows) tokens[i] = -2;  // failed above; skipped below
    }
  }
  int64_t sampled = 0;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const runtime::StepItem& item = plan.items[i];
    if (!item.samples) continue;
    RequestState& r = *owners[i];
    const int32_t token = tokens[i];
    if (token == -2) continue;  // already failed (log-probabilities)
    if (token < 0 || token >= info.vocab_size) {
      fail(r, "sampling failed: the backend produced no valid token (non-finite logits?)");
      continue;
    }
    ++sampled;
    r.last_token = token;
    TokenEvent event;
    event.token = token;
    event.index = r.generated++;
    event.logprobs = std::move(logprobs[i]);
    const bool stop =
        std::find(r.stop_tokens.begin(), r.stop_tokens.end(), token) != r.stop_tokens.end();
    if (stop || r.generated >= r.request.sampling.max_new_tokens) {
      event.finished = true;
      event.finish_reason = stop ? FinishReason::kStop : FinishReason::kLength;
    }
    const bool finished = event.finished;
    emit(r, std::move(event));
    if (finished) {
      ++stats.requests_finished;
      drop(r.id);
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  ++stats.steps;
  stats.prompt_tokens += plan.prefill_tokens;
  stats.decode_tokens += plan.decode_tokens;
  stats.generated_tokens += sampled;
  stats.peak_step_tokens = std::max(stats.peak_step_tokens, plan.tokens());
  if (plan.prefill_tokens > 0) {
    ++stats.prefill_steps;
    stats.prefill_seconds += seconds;
  } else {
    stats.decode_seconds += seconds;
    stats.decode_only_tokens += sampled;
  }
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options) {
  std::unique_ptr<runtime::Executor> executor;
  const Status status = capture([&] {
    require_device(options.device);
    check_options(options);
    MOELORA_CHECK(!options.model_dir.empty(), ErrorCode::kInvalidArgument, "model_dir is empty");
    if (is_cuda(options.device)) {
      const runtime::GpuExecutorOptions g = runtime::gpu_executor_options(options);
      executor = runtime::make_gpu_executor(g);
    } else {
      MOELORA_CHECK(!options.random_weights, ErrorCode::kUnsupported,
                    "random_weights needs device 'cuda' (the CPU backend loads checkpoints only; "
                    "`moelora synth` writes a random one)");
      executor = runtime::CpuExecutor::load(options.model_dir, runtime::executor_limits(options),
                                            options.show_progress, options.max_layers);
    }
  });
  if (!status) return status;
  return create(std::move(executor), options);
}

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<runtime::Executor> executor,
                                               const EngineOptions& options) {
  std::unique_ptr<Impl> impl;
  const Status status = capture([&] {
    MOELORA_CHECK(executor != nullptr, ErrorCode::kInvalidArgument,
                  "Engine::create: the executor is null");
    check_options(options);
    const runtime::ExecutorLimits& l = executor->limits();
    MOELORA_CHECK(
        l.max_batch_tokens >= options.max_batch_tokens && l.max_sequences >= options.max_running &&
            l.num_slots == options.adapter_slots && l.max_lora_rank >= options.max_lora_rank,
        ErrorCode::kInvalidArgument, "the executor's limits (max_batch_tokens ", l.max_batch_tokens,
        ", max_sequences ", l.max_sequences, ", num_slots ", l.num_slots, ", max_lora_rank ",
        l.max_lora_rank, ") do not cover the engine options (max_batch_tokens ",
        options.max_batch_tokens, ", max_running ", options.max_running, ", adapter_slots ",
        options.adapter_slots, ", max_lora_rank ", options.max_lora_rank, ")");
    impl = std::make_unique<Impl>(std::move(executor), options);
  });
  if (!status) return status;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

const ModelInfo& Engine::model_info() const {
  return impl_->info;
}

const EngineOptions& Engine::options() const {
  return impl_->options;
}

Status Engine::register_adapter(const std::string& name, const std::filesystem::path& dir,
                                bool pin) {
  Impl& im = *impl_;
  return capture([&] {
    MOELORA_CHECK(!name.empty(), ErrorCode::kInvalidArgument, "an adapter needs a non-empty name (",
                  dir.string(), ")");
    {
      std::lock_guard lock(im.state_mutex);
      MOELORA_CHECK(!im.pool.contains(name), ErrorCode::kInvalidArgument, "adapter '", name,
                    "' is already registered; unregister it first");
    }
    // Read the files without the lock: steps go on meanwhile.
    io::LoraAdapter adapter = im.loader()(name, dir);
    std::lock_guard lock(im.state_mutex);
    im.pool.add(name, dir, std::move(adapter), pin);
  });
}

Status Engine::register_random_adapter(const std::string& name, int64_t rank, bool shared_outer,
                                       uint64_t seed, bool pin) {
  Impl& im = *impl_;
  return capture([&] {
    MOELORA_CHECK(!name.empty(), ErrorCode::kInvalidArgument,
                  "a random adapter needs a non-empty name");
    MOELORA_CHECK(im.executor->supports_random_adapters(), ErrorCode::kUnsupported,
                  "random adapter '", name,
                  "': random adapters exist for GPU benchmarks and need device 'cuda' (with "
                  "random_weights); register adapter files with register_adapter()");
    MOELORA_CHECK(rank >= 1 && rank <= im.options.max_lora_rank, ErrorCode::kOutOfRange,
                  "random adapter '", name, "': rank ", rank, " is not in [1, max_lora_rank ",
                  im.options.max_lora_rank, "]");
    std::lock_guard lock(im.state_mutex);
    MOELORA_CHECK(!im.pool.contains(name), ErrorCode::kInvalidArgument, "adapter '", name,
                  "' is already registered; unregister it first");
    const RandomAdapter r{rank, shared_outer, seed};
    im.random_adapters[name] = r;
    try {
      im.pool.add(name, random_dir(r), random_placeholder(name, r), pin);
    } catch (...) {
      im.random_adapters.erase(name);
      throw;
    }
  });
}

Status Engine::unregister_adapter(const std::string& name) {
  Impl& im = *impl_;
  return capture([&] {
    std::lock_guard lock(im.state_mutex);
    const int32_t refs = im.pool.refcount(name);  // kNotFound for an unknown name
    const int32_t running = im.scheduler.running_with(name),
                  waiting = im.scheduler.waiting_with(name);
    MOELORA_ASSERT(refs == running, "pool refcount ", refs, " vs ", running, " running requests");
    MOELORA_CHECK(running + waiting == 0, ErrorCode::kInvalidArgument, "adapter '", name,
                  "' is in use by ", running + waiting, " request",
                  running + waiting == 1 ? "" : "s", " (", running, " running, ", waiting,
                  " waiting); cancel them or wait until they finish");
    im.pool.remove(name);
    im.random_adapters.erase(name);
  });
}

std::vector<AdapterInfo> Engine::adapters() const {
  std::lock_guard lock(impl_->state_mutex);
  std::vector<AdapterInfo> out;
  for (const runtime::AdapterPoolEntry& e : impl_->pool.list()) {
    out.push_back({e.name, e.dir, e.pinned, e.slot, e.refcount, e.in_host_cache});
  }
  return out;
}

Result<RequestId> Engine::submit(Request request, TokenCallback callback) {
  Impl& im = *impl_;
  std::lock_guard lock(im.state_mutex);
  const Status valid = im.validate(request);
  if (!valid) return valid;
  RequestId id = 0;
  const Status queued = capture([&] {
    auto r = std::make_unique<Impl::RequestState>();
    const SamplingParams& s = request.sampling;
    r->sampler = model::Sampler({s.temperature, s.top_p, s.top_k, s.seed});
    r->stop_tokens = s.stop_token_ids;
    if (!s.ignore_eos) {
      r->stop_tokens.insert(r->stop_tokens.end(), im.info.eos_token_ids.begin(),
                            im.info.eos_token_ids.end());
    }
    r->callback = std::make_shared<TokenCallback>(std::move(callback));
    r->id = im.next_id;
    im.scheduler.enqueue(r->id, request.adapter, static_cast<int64_t>(request.prompt.size()),
                         s.max_new_tokens);
    r->request = std::move(request);
    id = r->id;
    im.requests.emplace(id, std::move(r));
    ++im.next_id;
  });
  if (!queued) return queued;
  im.update_gauges();
  return id;
}

Status Engine::cancel(RequestId id) {
  Impl& im = *impl_;
  std::lock_guard lock(im.state_mutex);
  auto it = im.requests.find(id);
  if (it == im.requests.end()) {
    return Status(ErrorCode::kNotFound,
                  "request " + std::to_string(id) +
                      " is not waiting or running (unknown, finished or cancelled)");
  }
  return capture([&] {
    TokenEvent event;
    event.finished = true;
    event.finish_reason = FinishReason::kCancelled;
    im.emit(*it->second, std::move(event));
    ++im.stats.requests_cancelled;
    im.drop(id);
    im.update_gauges();
  });
}

Status Engine::step() {
  Impl& im = *impl_;
  std::lock_guard step_lock(im.step_mutex);
  std::vector<Impl::PendingEvent> events;
  Status status = capture([&] {
    std::lock_guard lock(im.state_mutex);
    im.run_step(im.scheduler.schedule());
    im.update_gauges();
    events.swap(im.pending);
  });
  // A backend that can run no more steps stops the engine (its requests have already failed).
  if (status.is_ok()) {
    const std::string broken = im.executor->broken_reason();
    if (!broken.empty())
      status = Status(ErrorCode::kInternal, "the backend cannot run any more steps: " + broken);
  }
  // Deliver outside the state lock. A callback that throws has its request cancelled quietly.
  std::set<RequestId> muted;
  for (Impl::PendingEvent& p : events) {
    const RequestId id = p.event.request_id;
    if (!p.callback || !*p.callback || muted.count(id)) continue;
    try {
      (*p.callback)(p.event);
    } catch (...) {
      muted.insert(id);
      std::lock_guard lock(im.state_mutex);
      if (im.requests.count(id)) {
        ++im.stats.requests_cancelled;
        capture([&] { im.drop(id); });
      }
    }
  }
  return status;
}

Status Engine::check_backend() {
  Impl& im = *impl_;
  std::lock_guard step_lock(im.step_mutex);
  std::lock_guard lock(im.state_mutex);
  Status status = capture([&] { im.executor->check_health(); });
  if (!status.is_ok()) return status;
  const std::string broken = im.executor->broken_reason();
  if (!broken.empty())
    return Status(ErrorCode::kInternal, "the backend cannot run any more steps: " + broken);
  return Status();
}

Status Engine::run_until_idle() {
  while (!idle()) {
    const EngineStats before = stats();
    const Status status = step();
    if (!status) return status;
    const EngineStats after = stats();
    // A step that ran nothing, finished nothing and delivered nothing while requests remain
    // would repeat forever: report it instead of spinning.
    const bool progress = after.steps != before.steps || after.waiting != before.waiting ||
                          after.running != before.running ||
                          after.requests_cancelled != before.requests_cancelled;
    if (!progress && !idle()) {
      return Status(ErrorCode::kInternal, "the engine made no progress with " +
                                              std::to_string(after.waiting) + " waiting and " +
                                              std::to_string(after.running) + " running requests");
    }
  }
  return Status::ok();
}

bool Engine::idle() const {
  std::lock_guard lock(impl_->state_mutex);
  return impl_->requests.empty() && impl_->pending.empty();
}

EngineStats Engine::stats() const {
  std::lock_guard lock(impl_->state_mutex);
  EngineStats s = impl_->stats;
  const runtime::AdapterPoolStats& p = impl_->pool.stats();
  s.pool_hits = p.hits;
  s.pool_misses = p.misses;
  s.pool_evictions = p.evictions;
  s.host_hits = p.host_hits;
  s.host_misses = p.host_misses;
  const runtime::ExecutorCounters c = impl_->executor->counters();
  s.eager_forwards = c.eager_forwards;
  s.graph_captures = c.graph_captures;
  s.graph_replays = c.graph_replays;
  s.graph_capture_failures = c.capture_failures;
  return s;
}

}  // namespace moelora
