// One rank's model behind the sharded executor (sharded_executor.h): what rank 0's executor and a
// worker both hold and run each command on. Two kinds:
//   RankShard (sharded_executor.h): the CPU reference's share (dist::ShardedModel), its
//     collectives over the ranks' SocketGroup;
//   GpuRankModel (gpu_rank_model.h): a GPU executor of the rank's share, its collectives over
//     NCCL (the SocketGroup then carries only the commands).
// Sequence handles are rank 0's: a rank makes its own sequence at a handle's first forward.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "ops/sample/sample.h"
#include "runtime/executor.h"

namespace moelora::dist {

class RankModel {
 public:
  virtual ~RankModel() = default;

  // The whole model's config (what the engine on rank 0 serves).
  virtual const io::ModelConfig& config() const = 0;
  // An adapter of the whole model (the rank cuts its share): check throws what loading would.
  virtual void check_adapter(const io::LoraAdapter& adapter) const = 0;
  virtual void write_slot(int32_t slot, const io::LoraAdapter& adapter) = 0;
  virtual void clear_slot(int32_t slot) = 0;
  virtual bool occupied(int32_t slot) const = 0;

  virtual void free_sequence(runtime::SequenceHandle handle) = 0;
  virtual int64_t sequence_length(runtime::SequenceHandle handle) const = 0;
  // Logits F32 [1, V] of each entry's last token; `control` is the ranks' SocketGroup (the CPU
  // shares reduce over it; GPU ranks have their own collectives).
  virtual std::vector<Tensor> forward(std::span<const runtime::BatchEntry> batch,
                                      Communicator& control) = 0;
  // GPU ranks sample on the device (runtime::Executor::forward_sample): rank 0 gets the tokens
  // (and last_logits the rows asked for) without copying every logit to the host, and the
  // workers, whose results nobody reads, run `step`. The CPU shares return logits.
  virtual bool samples_on_device() const { return false; }
  virtual std::vector<int32_t> forward_sample(std::span<const runtime::BatchEntry> batch,
                                              std::span<const ops::SampleRowParams> params,
                                              std::span<const float> uniforms,
                                              Communicator& control);
  virtual std::vector<Tensor> last_logits(std::span<const size_t> rows);
  // A worker's forward: the same model work, results dropped.
  virtual void step(std::span<const runtime::BatchEntry> batch, Communicator& control) {
    forward(batch, control);
  }

  // The job's attention caches and linear-attention states over every rank.
  virtual uint64_t job_kv_bytes() const = 0;
  virtual uint64_t job_state_bytes() const = 0;
  // The KV pool and the longest sequence a rank holds (every rank alike; {} / 0: unlimited).
  virtual runtime::KvCapacity kv_capacity() const { return {}; }
  virtual int64_t max_sequence_length() const { return 0; }
  virtual runtime::ExecutorCounters counters() const { return {}; }
  // The attention kernels, for /metrics and logs.
  virtual std::string attention_kernel() const = 0;
};

}  // namespace moelora::dist
