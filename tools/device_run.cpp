// --device of `moelora generate` / `moelora logits` (device_run.h): the device check, generation
// through the public Engine API and every position's logits through the GPU executor.
#include "device_run.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <span>

#include "core/error.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "moelora/engine.h"
#include "runtime/gpu_executor.h"

namespace moelora::tools {

void require_cli_device(const std::string& device) {
  MOELORA_CHECK(device == "cpu" || device == "cuda", ErrorCode::kInvalidArgument, "--device '",
                device, "' is unknown; expected cpu or cuda");
  const Status status = check_device(device);
  if (!status) throw Error(status.code(), status.message() + "; rerun with --device cpu");
}

int64_t adapter_rank_bound(const std::vector<model::AdapterSpec>& specs) {
  int64_t rank = 8;
  for (const model::AdapterSpec& spec : specs) {
    const io::AdapterConfig config = io::parse_adapter_config(spec.dir / "adapter_config.json");
    int64_t r = config.r;
    for (const auto& [key, value] : config.rank_pattern) r = std::max(r, value);
    rank = std::max(rank, 2 * r);
  }
  return rank;
}

DeviceGenerateResult generate_on_device(const std::string& device,
                                        const DeviceGenerateRequest& request) {
  DeviceGenerateResult result;
  result.prompt_tokens = static_cast<int64_t>(request.prompt.size());
  EngineOptions options;
  options.model_dir = request.model_dir;
  options.device = device;
  // One request whose prompt runs in one forward (as model::generate's prefill does): no chunks,
  // a budget that holds the whole prompt, and KV pages for exactly its length.
  options.max_running = 1;
  options.max_loras_per_batch = 1;
  options.adapter_slots = 1;
  options.max_lora_rank = adapter_rank_bound(request.adapters);
  options.prefill_chunk = 0;
  options.max_batch_tokens = std::max<int64_t>(256, result.prompt_tokens);
  options.max_seq_len = result.prompt_tokens + std::max<int64_t>(request.max_new_tokens, 1);
  options.max_layers = request.max_layers;
  options.show_progress = request.show_progress;
  Result<std::unique_ptr<Engine>> created = Engine::create(options);
  if (!created.is_ok()) throw Error(created.status().code(), created.status().message());
  std::unique_ptr<Engine> engine = std::move(created.value());
  for (const model::AdapterSpec& spec : request.adapters) {
    const Status status = engine->register_adapter(spec.name, spec.dir);
    if (!status) throw Error(status.code(), status.message());
  }
  if (request.max_new_tokens == 0) return result;  // the Engine needs max_new_tokens >= 1

  Request r;
  r.prompt = request.prompt;
  r.adapter = request.adapter;
  r.sampling.temperature = request.temperature;
  r.sampling.top_p = request.top_p;
  r.sampling.top_k = request.top_k;
  r.sampling.seed = request.seed;
  r.sampling.max_new_tokens = request.max_new_tokens;
  r.sampling.ignore_eos = request.ignore_eos;
  if (!request.ignore_eos) r.sampling.stop_token_ids = request.extra_stop_tokens;
  std::string error;
  FinishReason reason = FinishReason::kNone;
  auto on_event = [&](const TokenEvent& e) {
    if (e.token >= 0) result.tokens.push_back(e.token);
    if (e.finished) {
      reason = e.finish_reason;
      error = e.error;
    }
  };
  const Result<RequestId> id = engine->submit(std::move(r), on_event);
  if (!id.is_ok()) throw Error(id.status().code(), id.status().message());
  const Status run = engine->run_until_idle();
  if (!run) throw Error(run.code(), run.message());
  MOELORA_CHECK(reason != FinishReason::kError, ErrorCode::kInternal, "generation on ", device,
                " failed: ", error);
  MOELORA_CHECK(reason == FinishReason::kStop || reason == FinishReason::kLength,
                ErrorCode::kInternal, "generation on ", device, " ended with ",
                finish_reason_name(reason));
  result.stopped = reason == FinishReason::kStop;
  const EngineStats stats = engine->stats();
  result.seconds = stats.prefill_seconds + stats.decode_seconds;
  return result;
}

std::vector<Tensor> logits_on_gpu(const std::filesystem::path& model_dir,
                                  const std::vector<model::AdapterSpec>& adapters,
                                  const std::vector<BatchEntry>& entries, int64_t max_layers,
                                  bool show_progress) {
  require_cli_device("cuda");
  MOELORA_CHECK(!entries.empty(), ErrorCode::kInvalidArgument, "no sequences to run");
  // The adapters, read against the config the executor will run (its first max_layers layers).
  const io::ModelConfig config =
      runtime::first_layers(io::load_model_config(model_dir), max_layers);
  std::vector<io::LoraAdapter> loaded;
  int64_t max_rank = 8;
  for (const model::AdapterSpec& spec : adapters) {
    loaded.push_back(io::load_adapter(spec.dir, config, spec.name, io::AdapterLoadOptions{}));
    max_rank = std::max(max_rank, loaded.back().max_rank);
  }
  size_t longest = 0;
  for (const BatchEntry& e : entries) longest = std::max(longest, e.tokens.size());

  runtime::GpuExecutorOptions g;
  g.model_dir = model_dir;
  // One token of every entry per forward (see device_run.h).
  g.limits.max_batch_tokens = static_cast<int64_t>(entries.size());
  g.limits.max_sequences = static_cast<int32_t>(entries.size());
  g.limits.num_slots = static_cast<int32_t>(loaded.size());
  g.limits.max_lora_rank = max_rank;
  g.max_layers = max_layers;
  g.max_seq_len = static_cast<int64_t>(longest);
  g.cuda_graphs = false;
  g.show_progress = show_progress;
  std::unique_ptr<runtime::Executor> executor = runtime::make_gpu_executor(g);
  for (size_t i = 0; i < loaded.size(); ++i) {
    executor->check_adapter(loaded[i]);
    executor->write_slot(static_cast<int32_t>(i), loaded[i]);
  }
  auto slot_of = [&](const std::string& name) -> int32_t {
    if (name.empty()) return -1;
    for (size_t i = 0; i < adapters.size(); ++i) {
      if (adapters[i].name == name) return static_cast<int32_t>(i);
    }
    MOELORA_THROW(ErrorCode::kNotFound, "unknown adapter '", name, "'");
  };

  const int64_t vocab = executor->vocab_size();
  std::vector<Tensor> out;
  std::vector<runtime::SequenceHandle> sequences;
  std::vector<int32_t> slots;
  for (const BatchEntry& e : entries) {
    out.push_back(Tensor::empty(DType::kF32, {static_cast<int64_t>(e.tokens.size()), vocab}));
    sequences.push_back(executor->new_sequence());
    slots.push_back(slot_of(e.adapter));
  }
  for (size_t pos = 0; pos < longest; ++pos) {
    std::vector<runtime::BatchEntry> batch;
    std::vector<size_t> owner;  // entry of each batch row
    for (size_t i = 0; i < entries.size(); ++i) {
      if (pos >= entries[i].tokens.size()) continue;
      batch.push_back(
          {sequences[i], std::span<const int32_t>(&entries[i].tokens[pos], 1), slots[i]});
      owner.push_back(i);
    }
    const std::vector<Tensor> logits = executor->forward(batch);
    MOELORA_CHECK(logits.size() == batch.size(), ErrorCode::kInternal, "the GPU executor returned ",
                  logits.size(), " logits rows for ", batch.size(), " sequences");
    for (size_t b = 0; b < batch.size(); ++b) {
      MOELORA_CHECK(logits[b].numel() == vocab, ErrorCode::kInternal,
                    "the GPU executor returned logits of ", logits[b].numel(), " values, expected ",
                    vocab);
      std::memcpy(out[owner[b]].data<float>() + pos * vocab, logits[b].data<float>(),
                  static_cast<size_t>(vocab) * sizeof(float));
    }
  }
  for (runtime::SequenceHandle s : sequences) executor->free_sequence(s);
  return out;
}

}  // namespace moelora::tools
