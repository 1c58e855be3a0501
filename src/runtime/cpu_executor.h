// CpuExecutor: the runtime's backend on the fp32 CPU reference model (src/model).
//
// Each step's batch becomes ONE model::Model::forward over all sequences (every layer sees the
// whole [T, H] activation with a per-token slot vector; only the attention core runs per
// sequence), with logits for each sequence's last token only. The adapter pool is the model's
// AdapterSet with a fixed slot count (AdapterSet::resize / set / clear): writing a slot swaps
// the factors in place, nothing is copied (io::LoraAdapter tensors share storage).
//
// A sequence's model::Sequence is made at its first forward, with the slot of that entry: the
// CPU model binds a sequence to its slot, and the runtime never changes a live sequence's slot.
// The executor also checks what a GPU executor would rely on (batch within the limits, distinct
// sequences, occupied slots), so scheduler bugs surface on the CPU too.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "model/model.h"
#include "runtime/executor.h"

namespace moelora::runtime {

class CpuExecutor final : public Executor {
 public:
  // Model::load(dir) (its first max_layers decoder layers when > 0) then
  // CpuExecutor(model, limits).
  static std::unique_ptr<CpuExecutor> load(const std::filesystem::path& dir,
                                           const ExecutorLimits& limits, bool show_progress = false,
                                           int64_t max_layers = 0);
  // `model` must have no adapters loaded (the executor owns its slots); kInvalidArgument for
  // limits that are not all positive.
  CpuExecutor(model::Model model, const ExecutorLimits& limits);

  const io::ModelConfig& config() const override { return model_.config(); }
  const ExecutorLimits& limits() const override { return limits_; }
  model::Model& model() { return model_; }

  void check_adapter(const io::LoraAdapter& adapter) const override;
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override;
  void clear_slot(int32_t slot) override;

  SequenceHandle new_sequence() override;
  void free_sequence(SequenceHandle sequence) override;
  int64_t sequence_length(SequenceHandle sequence) const override;
  int64_t live_sequences() const override { return static_cast<int64_t>(sequences_.size()); }
  uint64_t cache_bytes() const override;
  uint64_t state_bytes() const override;

  std::vector<Tensor> forward(std::span<const BatchEntry> batch) override;
  // Each sequence's cache grows in host memory as it grows: no fixed pool, nothing to reserve.
  KvCapacity kv_capacity() const override { return {}; }
  ExecutorCounters counters() const override { return counters_; }

 private:
  struct Entry {
    std::optional<model::Sequence> sequence;  // made at the first forward, bound to `slot`
    int32_t slot = -1;
  };
  Entry& entry(SequenceHandle sequence);
  const Entry& entry(SequenceHandle sequence) const;

  model::Model model_;
  ExecutorLimits limits_;
  std::map<SequenceHandle, std::unique_ptr<Entry>> sequences_;  // unique_ptr: stable addresses
  SequenceHandle next_handle_ = 1;
  ExecutorCounters counters_;  // every forward is eager
};

}  // namespace moelora::runtime
