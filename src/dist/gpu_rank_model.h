// A GPU rank behind the sharded executor (rank_model.h): a GPU executor (runtime/gpu_executor.h)
// of this rank's share of the model (shard_checkpoint.h), its half-layers summed over the
// group's device collectives (NCCL across the GPUs of a job), while the ranks' SocketGroup carries
// rank 0's commands. Every rank runs the same commands in the same order, so their executors
// make the same steps (pages, graph buckets, adapter slots) and call the same collectives.
//
// Compiled in every build (it calls the runtime's GPU factory, which a build without CUDA answers
// with kUnsupported).
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "core/device_collectives.h"
#include "dist/rank_model.h"
#include "dist/shard.h"
#include "runtime/gpu_executor.h"

namespace moelora::dist {

class GpuRankModel final : public RankModel {
 public:
  // `options` as for the whole model on one GPU (device: this rank's); the rank's cuts and
  // `collectives` (rank shard.rank of shard.size; it outlives the model) are filled in here.
  GpuRankModel(runtime::GpuExecutorOptions options, DeviceCollectives& collectives,
               ShardSpec shard);
  // The same, owning the collectives (a rank process's NCCL communicator).
  GpuRankModel(runtime::GpuExecutorOptions options, std::unique_ptr<DeviceCollectives> collectives,
               ShardSpec shard);

  const io::ModelConfig& config() const override { return whole_config_; }
  void check_adapter(const io::LoraAdapter& adapter) const override;
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override;
  void clear_slot(int32_t slot) override;
  bool occupied(int32_t slot) const override;

  void free_sequence(runtime::SequenceHandle handle) override;
  int64_t sequence_length(runtime::SequenceHandle handle) const override;
  std::vector<Tensor> forward(std::span<const runtime::BatchEntry> batch,
                              Communicator& control) override;
  bool samples_on_device() const override { return true; }
  std::vector<int32_t> forward_sample(std::span<const runtime::BatchEntry> batch,
                                      std::span<const ops::SampleRowParams> params,
                                      std::span<const float> uniforms,
                                      Communicator& control) override;
  std::vector<Tensor> last_logits(std::span<const size_t> rows) override {
    return executor_->last_logits(rows);
  }
  // Greedy device sampling, tokens dropped: the same kernels (and decode graphs) as rank 0's.
  void step(std::span<const runtime::BatchEntry> batch, Communicator& control) override;

  // Every rank holds its heads' share of each sequence's cache (replicated KV heads and MLA's
  // latent counted on each rank that holds them).
  uint64_t job_kv_bytes() const override;
  uint64_t job_state_bytes() const override;
  runtime::KvCapacity kv_capacity() const override { return executor_->kv_capacity(); }
  int64_t max_sequence_length() const override { return executor_->max_sequence_length(); }
  runtime::ExecutorCounters counters() const override { return executor_->counters(); }
  std::string attention_kernel() const override;

 private:
  std::unique_ptr<DeviceCollectives> owned_;  // destroyed after the executor that uses it
  ShardSpec shard_;
  io::ModelConfig whole_config_;
  std::unique_ptr<runtime::Executor> executor_;
  std::vector<bool> occupied_;
  // rank 0's handle -> this rank's executor's sequence, made at the handle's first forward
  std::map<runtime::SequenceHandle, runtime::SequenceHandle> local_;

  // The batch with this rank's sequence handles (made at a handle's first forward).
  std::vector<runtime::BatchEntry> local_batch(std::span<const runtime::BatchEntry> batch);
};

}  // namespace moelora::dist
