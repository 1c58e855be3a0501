// The serving runtime's backend over a model sharded across processes (`moelora serve --tp N` on
// the CPU reference backend): rank 0 runs the Engine with a ShardedExecutor, every other rank
// runs run_sharded_worker, and each step is one command from rank 0 that all ranks execute on
// their share (dist::ShardedModel) with the collectives of their SocketGroup.
//
// Each command (messages.h, ShardCommand) is one of: write an adapter slot (each rank
// loads the adapter from its folder and cuts its share), clear a slot, run a forward (the batch's
// sequence handles, slots and tokens), stop. Sequences freed on rank 0 are dropped on the
// workers with the next command. After a command every worker replies; rank 0 throws the failures
// naming the ranks, and a failure inside a forward breaks the group (the ranks' caches no longer
// agree), which stops the engine (/health turns 503) and the launcher stops the job.
//
// Sequence i (handle h) is attended on rank h % n under data-parallel attention.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "dist/messages.h"
#include "dist/rank_model.h"
#include "dist/sharded_model.h"
#include "dist/socket_group.h"
#include "model/model.h"
#include "runtime/executor.h"

namespace moelora::dist {

// The CPU reference's rank: the model, its share, and its sequences (rank_model.h).
class RankShard final : public RankModel {
 public:
  // `model` must have no adapters; its AdapterSet is sized to limits.num_slots.
  RankShard(std::unique_ptr<model::Model> model, const runtime::ExecutorLimits& limits,
            ShardSpec shard, const ShardedModelOptions& options);

  const model::Model& model() const { return *model_; }
  const io::ModelConfig& config() const override { return model_->config(); }
  void check_adapter(const io::LoraAdapter& adapter) const override {
    model_->adapters().check(adapter);
  }
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override;
  void clear_slot(int32_t slot) override;
  void free_sequence(runtime::SequenceHandle handle) override;
  // Logits F32 [1, V] of each entry's last token (the sequences are made at their first
  // forward, bound to that entry's slot).
  std::vector<Tensor> forward(std::span<const runtime::BatchEntry> batch,
                              Communicator& comm) override;
  int64_t sequence_length(runtime::SequenceHandle handle) const override;
  bool occupied(int32_t slot) const override { return model_->adapters().occupied(slot); }
  // The live sequences' attention caches and linear-attention states over every rank of the job:
  // each sequence as each rank that attends it holds it (ShardedModel::ranks_per_sequence), from
  // the lengths every rank tracks.
  uint64_t job_kv_bytes() const override;
  uint64_t job_state_bytes() const override;
  std::string attention_kernel() const override;

 private:
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<ShardedModel> sharded_;
  ShardedModelOptions options_;
  std::map<runtime::SequenceHandle, ShardedSequence> sequences_;
};

class ShardedExecutor final : public runtime::Executor {
 public:
  // Rank 0's side. `group` has joined (rank 0); waits up to `ready_timeout` for every worker to
  // report its share built (run_sharded_worker), and throws their failures naming the ranks.
  ShardedExecutor(std::unique_ptr<model::Model> model, std::unique_ptr<SocketGroup> group,
                  const runtime::ExecutorLimits& limits, const ShardedModelOptions& options,
                  std::chrono::milliseconds ready_timeout);
  // The same over any rank model (a GPU rank: gpu_rank_model.h), built by the caller.
  ShardedExecutor(std::unique_ptr<RankModel> shard, std::unique_ptr<SocketGroup> group,
                  const runtime::ExecutorLimits& limits, std::chrono::milliseconds ready_timeout);
  // Tells the workers to stop (they return from run_sharded_worker).
  ~ShardedExecutor() override;

  const io::ModelConfig& config() const override { return shard_->config(); }
  const runtime::ExecutorLimits& limits() const override { return limits_; }

  void check_adapter(const io::LoraAdapter& adapter) const override;
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override;
  void clear_slot(int32_t slot) override;

  runtime::SequenceHandle new_sequence() override;
  void free_sequence(runtime::SequenceHandle sequence) override;
  int64_t sequence_length(runtime::SequenceHandle sequence) const override;
  int64_t live_sequences() const override { return static_cast<int64_t>(live_.size()); }
  // The job's caches and states over all ranks (what /metrics reports): rank 0 computes them from
  // the sequences' lengths, which every rank tracks, without asking the workers.
  uint64_t cache_bytes() const override { return shard_->job_kv_bytes(); }
  uint64_t state_bytes() const override { return shard_->job_state_bytes(); }
  runtime::KvCapacity kv_capacity() const override { return shard_->kv_capacity(); }
  int64_t max_sequence_length() const override { return shard_->max_sequence_length(); }

  std::vector<Tensor> forward(std::span<const runtime::BatchEntry> batch) override;
  // GPU ranks: the tokens sampled on rank 0's device (RankModel::samples_on_device); the CPU
  // shares: Executor's host sampling of forward()'s logits.
  std::vector<int32_t> forward_sample(std::span<const runtime::BatchEntry> batch,
                                      std::span<const ops::SampleRowParams> params,
                                      std::span<const float> uniforms) override;
  std::vector<Tensor> last_logits(std::span<const size_t> rows) override;
  runtime::ExecutorCounters counters() const override;
  // The group's first failure once a rank was lost or a forward failed part-way.
  std::string broken_reason() const override;
  // Between steps: a worker that went away breaks the group now (SocketGroup::check_peers).
  void check_health() override { group_->check_peers(); }
  std::string attention_kernel() const override;

 private:
  // Sends `command` (with the frees pending since the last one), runs `local` on rank 0, then
  // collects the workers' replies.
  // `what` names the command in errors.
  template <typename Local>
  auto run_command(ShardCommand command, const std::string& what, Local&& local);
  // Checks a forward's batch (everything a rank could refuse, before the command goes out) and
  // makes its command; records each sequence's slot.
  ShardCommand forward_command(std::span<const runtime::BatchEntry> batch);
  // The constructors' common part: checks, then waits for every worker's ready reply.
  void start(std::chrono::milliseconds ready_timeout);

  runtime::ExecutorLimits limits_;
  std::chrono::milliseconds slow_timeout_;  // for the ready reply and adapter loads
  std::unique_ptr<SocketGroup> group_;
  std::unique_ptr<RankModel> shard_;
  // Live sequences and the slot of their first forward (nullopt before it).
  std::map<runtime::SequenceHandle, std::optional<int32_t>> live_;
  std::vector<runtime::SequenceHandle> pending_frees_;  // freed since the last command
  runtime::SequenceHandle next_handle_ = 1;
  runtime::ExecutorCounters counters_;
};

// A worker rank's loop: builds its share, reports ready, then executes rank 0's commands until
// the stop command (returns) or until the group breaks (throws the cause).
void run_sharded_worker(std::unique_ptr<model::Model> model, SocketGroup& group,
                        const runtime::ExecutorLimits& limits, const ShardedModelOptions& options);
// The same over any rank model: `make` builds this rank's (its failure is reported to rank 0 as
// the rank's ready reply).
void run_sharded_worker(const std::function<std::unique_ptr<RankModel>()>& make,
                        SocketGroup& group);

}  // namespace moelora::dist
