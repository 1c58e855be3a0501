// Rank 0's executor and the workers' loop of a model sharded across processes
// (sharded_executor.h).
#include "dist/sharded_executor.h"

#include <set>

#include "core/error.h"
#include "dist/messages.h"
#include "io/peft.h"

namespace moelora::dist {

namespace {

using ::moelora::detail::concat;
using runtime::BatchEntry;
using runtime::SequenceHandle;

using Kind = ShardCommand::Kind;

}  // namespace

// ---- RankShard ----

RankShard::RankShard(std::unique_ptr<model::Model> model, const runtime::ExecutorLimits& limits,
                     ShardSpec shard, const ShardedModelOptions& options)
    : model_(std::move(model)), options_(options) {
  MOELORA_CHECK(model_ != nullptr, ErrorCode::kInvalidArgument, "sharded executor: no model");
  MOELORA_CHECK(model_->adapters().names().empty(), ErrorCode::kInvalidArgument,
                "the sharded executor manages the adapter slots itself; the model already has "
                "adapters loaded");
  model_->adapters().resize(limits.num_slots);
  sharded_ = std::make_unique<ShardedModel>(*model_, shard, options);
}

void RankShard::write_slot(int32_t slot, const io::LoraAdapter& adapter) {
  model_->adapters().set(slot, adapter);
  sharded_->refresh_slot(slot);
}

void RankShard::clear_slot(int32_t slot) {
  model_->adapters().clear(slot);
  sharded_->refresh_slot(slot);
}

void RankShard::free_sequence(SequenceHandle handle) {
  sequences_.erase(handle);  // a sequence freed before its first forward was never made here
}

int64_t RankShard::sequence_length(SequenceHandle handle) const {
  auto it = sequences_.find(handle);
  return it == sequences_.end() ? 0 : it->second.length();
}

uint64_t RankShard::job_kv_bytes() const {
  uint64_t positions = 0;
  for (const auto& [handle, seq] : sequences_) positions += static_cast<uint64_t>(seq.length());
  return positions * sharded_->cache_bytes_per_position() *
         static_cast<uint64_t>(sharded_->ranks_per_sequence());
}

uint64_t RankShard::job_state_bytes() const {
  uint64_t started = 0;  // a sequence's states exist once it has run
  for (const auto& [handle, seq] : sequences_) started += seq.length() > 0 ? 1 : 0;
  return started * sharded_->state_bytes_per_sequence() *
         static_cast<uint64_t>(sharded_->ranks_per_sequence());
}

std::vector<Tensor> RankShard::forward(std::span<const BatchEntry> batch, Communicator& comm) {
  std::vector<ShardedSequence*> sequences;
  std::vector<std::vector<int32_t>> tokens;
  for (const BatchEntry& b : batch) {
    auto it = sequences_.find(b.sequence);
    if (it == sequences_.end()) {
      const int owner = static_cast<int>(b.sequence % sharded_->shard().size);
      it = sequences_.emplace(b.sequence, sharded_->new_sequence(b.slot, owner)).first;
    }
    MOELORA_CHECK(it->second.slot() == b.slot, ErrorCode::kInternal, "sequence handle ", b.sequence,
                  " was made for slot ", it->second.slot(), " but runs on slot ", b.slot);
    sequences.push_back(&it->second);
    tokens.emplace_back(b.tokens.begin(), b.tokens.end());
  }
  std::vector<Tensor> all = sharded_->forward(sequences, tokens, comm);
  std::vector<Tensor> last;
  last.reserve(all.size());
  for (const Tensor& logits : all)
    last.push_back(logits.slice0(logits.dim(0) - 1, logits.dim(0)).clone());
  return last;
}

std::string RankShard::attention_kernel() const {
  return concat("reference, ", sharded_->shard().size, " ranks (",
                options_.attention == AttentionSplit::kDataParallel ? "data" : "tensor",
                "-parallel attention)");
}

std::vector<int32_t> RankModel::forward_sample(std::span<const BatchEntry> batch,
                                               std::span<const ops::SampleRowParams> params,
                                               std::span<const float> uniforms,
                                               Communicator& control) {
  (void)batch, (void)params, (void)uniforms, (void)control;
  MOELORA_THROW(ErrorCode::kInternal,
                "this rank model returns logits (samples_on_device() is false)");
}

std::vector<Tensor> RankModel::last_logits(std::span<const size_t> rows) {
  (void)rows;
  MOELORA_THROW(ErrorCode::kInternal,
                "this rank model returns logits (samples_on_device() is false)");
}

// ---- ShardedExecutor (rank 0) ----

ShardedExecutor::ShardedExecutor(std::unique_ptr<model::Model> model,
                                 std::unique_ptr<SocketGroup> group,
                                 const runtime::ExecutorLimits& limits,
                                 const ShardedModelOptions& options,
                                 std::chrono::milliseconds ready_timeout)
    : limits_(limits),
      slow_timeout_(ready_timeout),
      group_(std::move(group)),
      shard_(std::make_unique<RankShard>(std::move(model), limits, ShardSpec{0, group_->size()},
                                         options)) {
  start(ready_timeout);
}

ShardedExecutor::ShardedExecutor(std::unique_ptr<RankModel> shard,
                                 std::unique_ptr<SocketGroup> group,
                                 const runtime::ExecutorLimits& limits,
                                 std::chrono::milliseconds ready_timeout)
    : limits_(limits),
      slow_timeout_(ready_timeout),
      group_(std::move(group)),
      shard_(std::move(shard)) {
  MOELORA_CHECK(shard_ != nullptr, ErrorCode::kInvalidArgument, "sharded executor: no rank model");
  start(ready_timeout);
}

void ShardedExecutor::start(std::chrono::milliseconds ready_timeout) {
  MOELORA_CHECK(group_->rank() == 0, ErrorCode::kInvalidArgument,
                "the sharded executor runs on rank 0; rank ", group_->rank(),
                " runs run_sharded_worker");
  MOELORA_CHECK(limits_.max_batch_tokens > 0 && limits_.max_sequences > 0 &&
                    limits_.num_slots >= 0 && limits_.max_lora_rank > 0,
                ErrorCode::kInvalidArgument, "executor limits must be positive: max_batch_tokens ",
                limits_.max_batch_tokens, ", max_sequences ", limits_.max_sequences, ", num_slots ",
                limits_.num_slots, ", max_lora_rank ", limits_.max_lora_rank);
  group_->collect_replies("cutting its share of the model", ready_timeout);
}

ShardedExecutor::~ShardedExecutor() {
  if (group_->broken()) return;
  try {
    ShardCommand stop;
    stop.kind = Kind::kStop;
    group_->send_command(encode_command(stop));
    group_->collect_replies("stop");
  } catch (...) {  // a worker already gone: the launcher reports it
  }
}

template <typename Local>
auto ShardedExecutor::run_command(ShardCommand command, const std::string& what, Local&& local) {
  command.frees = std::exchange(pending_frees_, {});
  try {
    group_->send_command(encode_command(command));
    if constexpr (std::is_void_v<decltype(local())>) {
      local();
      group_->collect_replies(what);
    } else {
      auto result = local();
      group_->collect_replies(what);
      return result;
    }
  } catch (const std::exception& e) {
    // The ranks no longer agree (a forward stopped part-way on some of them): tell them why and
    // stop them all. The caller's arguments were checked before the command went out.
    group_->break_group(concat(what, " failed: ", e.what()));
    throw;
  } catch (...) {
    group_->break_group(what + " failed");
    throw;
  }
}

void ShardedExecutor::check_adapter(const io::LoraAdapter& adapter) const {
  MOELORA_CHECK(adapter.max_rank <= limits_.max_lora_rank, ErrorCode::kUnsupported, "adapter '",
                adapter.name, "' has rank ", adapter.max_rank,
                ", above the engine's max_lora_rank ", limits_.max_lora_rank);
  MOELORA_CHECK(!adapter.dir.empty(), ErrorCode::kUnsupported, "adapter '", adapter.name,
                "' has no folder: with several ranks every rank loads the adapter from its "
                "folder, which all of them must be able to read");
  shard_->check_adapter(adapter);
}

void ShardedExecutor::write_slot(int32_t slot, const io::LoraAdapter& adapter) {
  check_adapter(adapter);
  ShardCommand write;
  write.kind = Kind::kWriteSlot;
  write.frees = std::exchange(pending_frees_, {});
  write.slot = slot;
  write.adapter_name = adapter.name;
  write.adapter_dir = adapter.dir.string();
  write.max_lora_rank = limits_.max_lora_rank;
  const std::string what = concat("loading adapter '", adapter.name, "' into slot ", slot);
  group_->send_command(encode_command(write));
  try {
    // Reading an adapter from a network folder can take longer than a collective.
    group_->collect_replies(what, slow_timeout_);
  } catch (const Error& e) {
    if (group_->broken()) throw;
    // Some worker could not load it (the folder is not visible on its node): empty the slot on
    // every rank, this one included, so the ranks agree, and report which ranks failed.
    ShardCommand clear;
    clear.kind = Kind::kClearSlot;
    clear.slot = slot;
    run_command(std::move(clear), concat("clearing slot ", slot),
                [&] { shard_->clear_slot(slot); });
    MOELORA_THROW(e.code(), "adapter '", adapter.name,
                  "' could not be loaded on every rank: ", e.what());
  }
  try {
    shard_->write_slot(slot, adapter);
  } catch (const std::exception& e) {  // the workers hold it and this rank does not
    group_->break_group(concat(what, " failed on rank 0: ", e.what()));
    throw;
  }
}

void ShardedExecutor::clear_slot(int32_t slot) {
  ShardCommand clear;
  clear.kind = Kind::kClearSlot;
  clear.slot = slot;
  run_command(std::move(clear), concat("clearing slot ", slot), [&] { shard_->clear_slot(slot); });
}

SequenceHandle ShardedExecutor::new_sequence() {
  const SequenceHandle handle = next_handle_++;
  live_.emplace(handle, std::nullopt);
  return handle;
}

void ShardedExecutor::free_sequence(SequenceHandle sequence) {
  MOELORA_CHECK(live_.erase(sequence) == 1, ErrorCode::kInternal, "freeing sequence handle ",
                sequence, ", which is not live");
  shard_->free_sequence(sequence);
  pending_frees_.push_back(sequence);
}

int64_t ShardedExecutor::sequence_length(SequenceHandle sequence) const {
  MOELORA_CHECK(live_.count(sequence) == 1, ErrorCode::kInternal, "sequence handle ", sequence,
                " is not live");
  return shard_->sequence_length(sequence);
}

ShardCommand ShardedExecutor::forward_command(std::span<const BatchEntry> batch) {
  MOELORA_CHECK(!batch.empty(), ErrorCode::kInternal, "forward of an empty batch");
  MOELORA_CHECK(static_cast<int64_t>(batch.size()) <= limits_.max_sequences, ErrorCode::kInternal,
                "forward of ", batch.size(), " sequences; the limit is ", limits_.max_sequences);
  // Everything a rank could refuse is checked here, before the command goes out: a refusal after
  // it would break the whole group.
  int64_t tokens = 0;
  std::set<SequenceHandle> seen;
  const int64_t vocab = config().vocab_size;
  for (const BatchEntry& b : batch) {
    tokens += static_cast<int64_t>(b.tokens.size());
    auto live = live_.find(b.sequence);
    MOELORA_CHECK(live != live_.end(), ErrorCode::kInternal, "sequence handle ", b.sequence,
                  " is not live");
    MOELORA_CHECK(seen.insert(b.sequence).second, ErrorCode::kInternal, "sequence handle ",
                  b.sequence, " appears twice in one forward");
    MOELORA_CHECK(!b.tokens.empty(), ErrorCode::kInternal, "sequence handle ", b.sequence,
                  " has no tokens in this forward");
    MOELORA_CHECK(b.slot >= -1 && b.slot < limits_.num_slots, ErrorCode::kInternal,
                  "sequence handle ", b.sequence, " runs on adapter slot ", b.slot,
                  ", not -1 (base) or one of the ", limits_.num_slots, " slots");
    MOELORA_CHECK(b.slot == -1 || shard_->occupied(b.slot), ErrorCode::kInternal,
                  "sequence handle ", b.sequence, " runs on adapter slot ", b.slot,
                  ", which is empty");
    MOELORA_CHECK(!live->second || *live->second == b.slot, ErrorCode::kInternal,
                  "sequence handle ", b.sequence, " was made for slot ", live->second.value_or(-1),
                  " but runs on slot ", b.slot);
    for (int32_t t : b.tokens)
      MOELORA_CHECK(t >= 0 && t < vocab, ErrorCode::kInvalidArgument, "sequence handle ",
                    b.sequence, ": token id ", t, " is out of range for the vocabulary of ", vocab);
  }
  MOELORA_CHECK(tokens <= limits_.max_batch_tokens, ErrorCode::kInternal, "forward of ", tokens,
                " tokens; the limit is ", limits_.max_batch_tokens);
  for (const BatchEntry& b : batch) live_[b.sequence] = b.slot;
  ShardCommand step;
  step.kind = Kind::kForward;
  for (const BatchEntry& b : batch)
    step.entries.push_back({b.sequence, b.slot, {b.tokens.begin(), b.tokens.end()}});
  return step;
}

std::vector<Tensor> ShardedExecutor::forward(std::span<const BatchEntry> batch) {
  std::vector<Tensor> logits = run_command(forward_command(batch), "a forward",
                                           [&] { return shard_->forward(batch, *group_); });
  ++counters_.eager_forwards;
  return logits;
}

std::vector<int32_t> ShardedExecutor::forward_sample(std::span<const BatchEntry> batch,
                                                     std::span<const ops::SampleRowParams> params,
                                                     std::span<const float> uniforms) {
  if (!shard_->samples_on_device()) return Executor::forward_sample(batch, params, uniforms);
  MOELORA_CHECK(params.size() == batch.size() && uniforms.size() == batch.size(),
                ErrorCode::kInternal, "forward_sample of ", batch.size(), " entries with ",
                params.size(), " sampling params and ", uniforms.size(), " uniforms");
  std::vector<int32_t> tokens = run_command(forward_command(batch), "a forward", [&] {
    return shard_->forward_sample(batch, params, uniforms, *group_);
  });
  ++counters_.eager_forwards;
  return tokens;
}

std::vector<Tensor> ShardedExecutor::last_logits(std::span<const size_t> rows) {
  if (!shard_->samples_on_device()) return Executor::last_logits(rows);
  return shard_->last_logits(rows);
}

std::string ShardedExecutor::broken_reason() const {
  return group_->broken() ? group_->failure() : std::string();
}

std::string ShardedExecutor::attention_kernel() const {
  return shard_->attention_kernel();
}

runtime::ExecutorCounters ShardedExecutor::counters() const {
  // A GPU rank counts its own eager forwards, captures and replays; the CPU shares count none.
  const runtime::ExecutorCounters rank = shard_->counters();
  if (rank.eager_forwards + rank.graph_replays + rank.graph_captures > 0) return rank;
  return counters_;
}

// ---- the workers ----

void run_sharded_worker(std::unique_ptr<model::Model> model, SocketGroup& group,
                        const runtime::ExecutorLimits& limits, const ShardedModelOptions& options) {
  run_sharded_worker(
      [&]() -> std::unique_ptr<RankModel> {
        return std::make_unique<RankShard>(std::move(model), limits,
                                           ShardSpec{group.rank(), group.size()}, options);
      },
      group);
}

void run_sharded_worker(const std::function<std::unique_ptr<RankModel>()>& make,
                        SocketGroup& group) {
  std::unique_ptr<RankModel> shard;
  std::string error;
  try {
    shard = make();
  } catch (const std::exception& e) {
    error = e.what();
  }
  group.send_reply(error);
  MOELORA_CHECK(shard != nullptr, ErrorCode::kInternal, "rank ", group.rank(),
                " could not cut its share: ", error);
  const io::ModelConfig& config = shard->config();
  for (;;) {
    ShardCommand command;
    try {
      command = decode_command(group.receive_command());
    } catch (const Error& e) {
      if (group.broken()) throw;
      // A command this rank cannot read: say so to rank 0 (which then breaks the group), stop.
      group.send_reply(concat("rank ", group.rank(), ": ", e.what()));
      throw;
    }
    for (SequenceHandle freed : command.frees) shard->free_sequence(freed);
    std::string failure;
    try {
      switch (command.kind) {
        case Kind::kWriteSlot: {
          io::AdapterLoadOptions load;
          load.max_rank = command.max_lora_rank;
          shard->write_slot(command.slot, io::load_adapter(command.adapter_dir, config,
                                                           command.adapter_name, load));
          break;
        }
        case Kind::kClearSlot: shard->clear_slot(command.slot); break;
        case Kind::kForward: {
          std::vector<BatchEntry> batch;
          for (const ShardCommand::Entry& e : command.entries)
            batch.push_back({e.sequence, e.tokens, e.slot});
          shard->step(batch, group);  // the results are rank 0's
          break;
        }
        case Kind::kStop: break;
      }
    } catch (const std::exception& e) {
      failure = concat("rank ", group.rank(), ": ", e.what());
    }
    group.send_reply(failure);
    if (command.kind == Kind::kStop) return;
  }
}

}  // namespace moelora::dist
