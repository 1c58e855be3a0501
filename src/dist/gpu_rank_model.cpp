// A GPU rank of the sharded executor (gpu_rank_model.h).
#include "dist/gpu_rank_model.h"

#include "core/error.h"
#include "dist/shard_checkpoint.h"
#include "io/hf_config.h"

namespace moelora::dist {

using ::moelora::detail::concat;

GpuRankModel::GpuRankModel(runtime::GpuExecutorOptions options, DeviceCollectives& collectives,
                           ShardSpec shard)
    : shard_(shard),
      whole_config_(
          runtime::first_layers(io::load_model_config(options.model_dir), options.max_layers)),
      occupied_(static_cast<size_t>(std::max(options.limits.num_slots, 0)), false) {
  MOELORA_CHECK(collectives.rank() == shard.rank && collectives.size() == shard.size,
                ErrorCode::kInvalidArgument, "GPU rank ", shard.rank, " of ", shard.size,
                " was given the collectives of rank ", collectives.rank(), " of ",
                collectives.size());
  rank_config(whole_config_, shard);  // the heads, channels and experts divide evenly
  options.collectives = &collectives;
  options.shard_checkpoint = [shard](const io::ModelWeights& w) {
    return shard_checkpoint(w, shard);
  };
  options.shard_config = [shard](const io::ModelConfig& c) { return rank_config(c, shard); };
  executor_ = runtime::make_gpu_executor(options);
}

GpuRankModel::GpuRankModel(runtime::GpuExecutorOptions options,
                           std::unique_ptr<DeviceCollectives> collectives, ShardSpec shard)
    : GpuRankModel(std::move(options), *collectives, shard) {
  owned_ = std::move(collectives);
}

void GpuRankModel::check_adapter(const io::LoraAdapter& adapter) const {
  executor_->check_adapter(shard_adapter(adapter, whole_config_, shard_));
}

void GpuRankModel::write_slot(int32_t slot, const io::LoraAdapter& adapter) {
  executor_->write_slot(slot, shard_adapter(adapter, whole_config_, shard_));
  occupied_.at(static_cast<size_t>(slot)) = true;
}

void GpuRankModel::clear_slot(int32_t slot) {
  executor_->clear_slot(slot);
  occupied_.at(static_cast<size_t>(slot)) = false;
}

bool GpuRankModel::occupied(int32_t slot) const {
  return slot >= 0 && static_cast<size_t>(slot) < occupied_.size() &&
         occupied_[static_cast<size_t>(slot)];
}

void GpuRankModel::free_sequence(runtime::SequenceHandle handle) {
  auto it = local_.find(handle);
  if (it == local_.end()) return;  // freed before its first forward: never made here
  executor_->free_sequence(it->second);
  local_.erase(it);
}

int64_t GpuRankModel::sequence_length(runtime::SequenceHandle handle) const {
  auto it = local_.find(handle);
  return it == local_.end() ? 0 : executor_->sequence_length(it->second);
}

std::vector<runtime::BatchEntry> GpuRankModel::local_batch(
    std::span<const runtime::BatchEntry> batch) {
  std::vector<runtime::BatchEntry> local;
  local.reserve(batch.size());
  for (const runtime::BatchEntry& b : batch) {
    auto it = local_.find(b.sequence);
    if (it == local_.end()) it = local_.emplace(b.sequence, executor_->new_sequence()).first;
    local.push_back({it->second, b.tokens, b.slot});
  }
  return local;
}

std::vector<Tensor> GpuRankModel::forward(std::span<const runtime::BatchEntry> batch,
                                          Communicator& /*control*/) {
  return executor_->forward(local_batch(batch));
}

std::vector<int32_t> GpuRankModel::forward_sample(std::span<const runtime::BatchEntry> batch,
                                                  std::span<const ops::SampleRowParams> params,
                                                  std::span<const float> uniforms,
                                                  Communicator& /*control*/) {
  return executor_->forward_sample(local_batch(batch), params, uniforms);
}

void GpuRankModel::step(std::span<const runtime::BatchEntry> batch, Communicator& /*control*/) {
  const std::vector<ops::SampleRowParams> greedy(batch.size());
  const std::vector<float> uniforms(batch.size(), 0.5f);
  executor_->forward_sample(local_batch(batch), greedy, uniforms);
}

uint64_t GpuRankModel::job_kv_bytes() const {
  return executor_->cache_bytes() * static_cast<uint64_t>(shard_.size);
}

uint64_t GpuRankModel::job_state_bytes() const {
  return executor_->state_bytes() * static_cast<uint64_t>(shard_.size);
}

std::string GpuRankModel::attention_kernel() const {
  return concat(executor_->attention_kernel(), ", ", shard_.size, " GPU ranks (tensor-parallel)");
}

}  // namespace moelora::dist
