// The CPU backend of the runtime (see cpu_executor.h).
#include "runtime/cpu_executor.h"

#include <set>
#include <string>

namespace moelora::runtime {

std::unique_ptr<CpuExecutor> CpuExecutor::load(const std::filesystem::path& dir,
                                               const ExecutorLimits& limits, bool show_progress,
                                               int64_t max_layers) {
  model::ModelOptions options;
  options.show_progress = show_progress;
  options.max_layers = max_layers;
  return std::make_unique<CpuExecutor>(model::Model::load(dir, options), limits);
}

CpuExecutor::CpuExecutor(model::Model model, const ExecutorLimits& limits)
    : model_(std::move(model)), limits_(limits) {
  MOELORA_CHECK(limits.max_batch_tokens > 0 && limits.max_sequences > 0 && limits.num_slots >= 0 &&
                    limits.max_lora_rank > 0,
                ErrorCode::kInvalidArgument, "executor limits must be positive: max_batch_tokens ",
                limits.max_batch_tokens, ", max_sequences ", limits.max_sequences, ", num_slots ",
                limits.num_slots, ", max_lora_rank ", limits.max_lora_rank);
  MOELORA_CHECK(
      model_.adapters().names().empty(), ErrorCode::kInvalidArgument,
      "the CPU executor manages the adapter slots itself; the model already has adapters loaded");
  model_.adapters().resize(limits.num_slots);
}

void CpuExecutor::check_adapter(const io::LoraAdapter& adapter) const {
  MOELORA_CHECK(adapter.max_rank <= limits_.max_lora_rank, ErrorCode::kUnsupported, "adapter '",
                adapter.name, "' has rank ", adapter.max_rank,
                ", above the engine's max_lora_rank ", limits_.max_lora_rank);
  model_.adapters().check(adapter);
}

void CpuExecutor::write_slot(int32_t slot, const io::LoraAdapter& adapter) {
  check_adapter(adapter);
  model_.adapters().set(slot, adapter);  // shares the factor storage
}

void CpuExecutor::clear_slot(int32_t slot) {
  model_.adapters().clear(slot);
}

SequenceHandle CpuExecutor::new_sequence() {
  const SequenceHandle handle = next_handle_++;
  sequences_.emplace(handle, std::make_unique<Entry>());
  return handle;
}

CpuExecutor::Entry& CpuExecutor::entry(SequenceHandle sequence) {
  auto it = sequences_.find(sequence);
  MOELORA_CHECK(it != sequences_.end(), ErrorCode::kInternal, "sequence handle ", sequence,
                " is not live");
  return *it->second;
}

const CpuExecutor::Entry& CpuExecutor::entry(SequenceHandle sequence) const {
  auto it = sequences_.find(sequence);
  MOELORA_CHECK(it != sequences_.end(), ErrorCode::kInternal, "sequence handle ", sequence,
                " is not live");
  return *it->second;
}

void CpuExecutor::free_sequence(SequenceHandle sequence) {
  MOELORA_CHECK(sequences_.erase(sequence) == 1, ErrorCode::kInternal, "freeing sequence handle ",
                sequence, ", which is not live");
}

int64_t CpuExecutor::sequence_length(SequenceHandle sequence) const {
  const Entry& e = entry(sequence);
  return e.sequence ? e.sequence->length() : 0;
}

uint64_t CpuExecutor::cache_bytes() const {
  uint64_t bytes = 0;
  for (const auto& [handle, e] : sequences_) {
    if (e->sequence) bytes += e->sequence->kv_bytes();
  }
  return bytes;
}

uint64_t CpuExecutor::state_bytes() const {
  uint64_t bytes = 0;
  for (const auto& [handle, e] : sequences_) {
    if (e->sequence) bytes += e->sequence->state_bytes();
  }
  return bytes;
}

std::vector<Tensor> CpuExecutor::forward(std::span<const BatchEntry> batch) {
  MOELORA_CHECK(!batch.empty(), ErrorCode::kInternal, "forward of an empty batch");
  MOELORA_CHECK(static_cast<int64_t>(batch.size()) <= limits_.max_sequences, ErrorCode::kInternal,
                "forward of ", batch.size(), " sequences; the limit is ", limits_.max_sequences);
  int64_t tokens = 0;
  std::set<SequenceHandle> seen;
  for (const BatchEntry& b : batch) {
    tokens += static_cast<int64_t>(b.tokens.size());
    MOELORA_CHECK(seen.insert(b.sequence).second, ErrorCode::kInternal, "sequence handle ",
                  b.sequence, " appears twice in one forward");
    MOELORA_CHECK(b.slot == -1 || model_.adapters().occupied(b.slot), ErrorCode::kInternal,
                  "sequence handle ", b.sequence, " runs on adapter slot ", b.slot,
                  ", which is empty");
  }
  MOELORA_CHECK(tokens <= limits_.max_batch_tokens, ErrorCode::kInternal, "forward of ", tokens,
                " tokens; the limit is ", limits_.max_batch_tokens);

  std::vector<model::SequenceInput> inputs;
  inputs.reserve(batch.size());
  for (const BatchEntry& b : batch) {
    Entry& e = entry(b.sequence);
    if (!e.sequence) {
      e.sequence = model_.new_sequence(b.slot);
      e.slot = b.slot;
    }
    MOELORA_CHECK(e.slot == b.slot, ErrorCode::kInternal, "sequence handle ", b.sequence,
                  " was made for slot ", e.slot, " but runs on slot ", b.slot);
    inputs.push_back({&*e.sequence, b.tokens});
  }
  model::ForwardOptions options;
  options.all_logits = false;  // generation needs each sequence's last position only
  std::vector<Tensor> logits = model_.forward(inputs, options);
  ++counters_.eager_forwards;
  return logits;
}

}  // namespace moelora::runtime
