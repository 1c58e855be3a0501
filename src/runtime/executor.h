// The backend interface of the runtime: what the Engine needs from a device to run one step.
//
// The Engine (scheduling, sampling, adapter bookkeeping) is the same for every backend; an
// Executor owns the model weights, the per-sequence KV caches and the adapter slot pool, and runs
// one batched forward per step. CpuExecutor (cpu_executor.h) runs the fp32 reference model;
// GpuExecutor (gpu_executor.h, CUDA builds) runs model::GpuModel with a paged KV cache and one
// CUDA graph per decode batch bucket.
//
// Two entry points run a step: forward() returns each entry's logits (tests, tools), and
// forward_sample() also picks each entry's next token from per-entry sampling parameters and one
// uniform number per entry (ops/sample/sample.h). The randomness stays with the caller (each
// request's own seeded model::Sampler draws u), so every backend consumes the same random stream
// and a GPU backend can sample on the device without copying the logits back. The default
// forward_sample() runs forward() and ops::sample_row_ref per entry.
//
// Contract, written so that a GPU executor can honour it without allocating or synchronizing in
// the steady state (DESIGN.md §4):
//   - Sizes are fixed at creation by ExecutorLimits: tokens per forward, sequences per forward,
//     adapter slots and their maximum rank. A GPU executor sizes its Workspace, slot buffers
//     (A [S, Ea, Rmax, in], B [S, Eb, out, Rmax] per layer and target) and static batch-metadata
//     buffers from them, and captures one decode graph per batch-size bucket up to max_sequences.
//   - forward() gets each sequence's slot with its tokens (-1 = base only); the slot map is batch
//     metadata, refreshed before the replay, so changing which adapters run never recaptures.
//   - write_slot() / clear_slot() only rewrite slot buffers. A GPU executor may upload on a copy
//     stream and make the next forward wait on the upload's event; the runtime guarantees that a
//     slot is never rewritten while a sequence that uses it is live, so no in-flight forward can
//     read a slot being written.
//   - Executors throw moelora::Error (the Engine catches it at its boundary). A forward that
//     throws leaves every sequence of the batch as it was before the call.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "ops/sample/sample.h"

namespace moelora {
struct EngineOptions;
}

namespace moelora::runtime {

// Opaque handle of one sequence's state (KV cache) inside an executor.
using SequenceHandle = int64_t;

struct ExecutorLimits {
  int64_t max_batch_tokens = 0;  // tokens in one forward (decode + prefill chunks)
  int32_t max_sequences = 0;     // sequences in one forward
  int32_t num_slots = 0;         // adapter slots
  int64_t max_lora_rank = 0;     // largest adapter rank a slot holds
};
// The limits EngineOptions set (max_batch_tokens, max_running, adapter_slots, max_lora_rank): what
// the engine and every rank of a parallel job build their executors with. Defined in engine.cpp.
ExecutorLimits executor_limits(const EngineOptions& options);

// A paged KV cache's fixed size, for admission control. A sequence of n tokens holds
// pages_for(n) pages; live sequences together hold at most `pages`. pages == 0: no fixed pool
// (the cache of each sequence grows on demand, as on the CPU), nothing to budget.
struct KvCapacity {
  int64_t pages = 0;      // pages in the pool; 0 = unlimited
  int64_t page_size = 1;  // tokens per page
  bool limited() const { return pages > 0; }
  int64_t pages_for(int64_t tokens) const { return (tokens + page_size - 1) / page_size; }
  int64_t tokens() const { return pages * page_size; }
};

// The new tokens of one sequence in a forward.
struct BatchEntry {
  SequenceHandle sequence = -1;
  std::span<const int32_t> tokens;  // at least one
  int32_t slot = -1;                // adapter slot, -1 = base only; fixed for a sequence's lifetime
};

// How a backend ran its forwards so far (a GPU backend: eager launches, CUDA-graph captures and
// replays; the CPU backend counts every forward as eager).
struct ExecutorCounters {
  int64_t eager_forwards = 0;
  int64_t graph_captures = 0;
  int64_t graph_replays = 0;
  int64_t capture_failures = 0;  // buckets that could not be captured and run eagerly instead
};

class Executor {
 public:
  virtual ~Executor() = default;

  virtual const io::ModelConfig& config() const = 0;
  int64_t vocab_size() const { return config().vocab_size; }
  virtual const ExecutorLimits& limits() const = 0;

  // Adapters. check_adapter: throws (kInvalidArgument / kUnsupported naming the adapter, layer
  // and target) when `adapter` cannot run on this model or exceeds max_lora_rank; stores nothing.
  virtual void check_adapter(const io::LoraAdapter& adapter) const = 0;
  // Puts `adapter` into `slot` (in [0, num_slots)), replacing what was there.
  virtual void write_slot(int32_t slot, const io::LoraAdapter& adapter) = 0;
  virtual void clear_slot(int32_t slot) = 0;

  // Sequences: a fresh, empty one; free releases its cache (the handle becomes invalid).
  virtual SequenceHandle new_sequence() = 0;
  virtual void free_sequence(SequenceHandle sequence) = 0;
  virtual int64_t sequence_length(SequenceHandle sequence) const = 0;
  virtual int64_t live_sequences() const = 0;
  virtual uint64_t cache_bytes() const = 0;  // KV cache bytes held by live sequences
  // Linear-attention (Gated DeltaNet) states: bytes held by live sequences, and the size of the
  // backend's fixed pool of per-sequence state slots (0: none, or allocated per sequence as the
  // CPU backend does). 0 for models without such layers.
  virtual uint64_t state_bytes() const { return 0; }
  virtual int64_t state_slots() const { return 0; }

  // Appends every entry's tokens to its sequence and returns the logits of each entry's last
  // token, F32 [1, V] per entry in batch order. Entries name distinct sequences; the batch
  // respects limits() (max_batch_tokens, max_sequences).
  virtual std::vector<Tensor> forward(std::span<const BatchEntry> batch) = 0;

  // forward() followed by sampling: returns one token per entry, in batch order. params[i] and
  // uniforms[i] (u in [0, 1), unused for greedy rows) belong to batch[i]; both spans have the
  // batch's size (kInternal otherwise). A row whose logits cannot be sampled (NaN) gets -1 and
  // the others are unaffected. Entries whose token the caller does not need (a prefill chunk
  // that is not the prompt's last) may pass greedy params; their token is computed and ignored.
  virtual std::vector<int32_t> forward_sample(std::span<const BatchEntry> batch,
                                              std::span<const ops::SampleRowParams> params,
                                              std::span<const float> uniforms);

  // The logits of entries `rows` (batch indices) of the last forward_sample(), F32 [V] each, for
  // requests that asked for log-probabilities. Valid until the next forward.
  virtual std::vector<Tensor> last_logits(std::span<const size_t> rows);

  // Longest sequence (prompt + generated tokens) a sequence may reach; 0 = only the model's
  // max_position_embeddings limits it. A paged GPU cache has a fixed page-table width.
  virtual int64_t max_sequence_length() const { return 0; }

  // The KV cache's fixed capacity, which the runtime budgets against: the Scheduler admits a
  // request only when the pages of its whole length (prompt + max_new_tokens) are not reserved
  // by running requests, so every forward finds the pages its sequences grow into. Reported
  // once, at Engine creation; the sequences the runtime makes are the only users of the pool.
  // The default {0, 1}: unlimited (the CPU backend).
  virtual KvCapacity kv_capacity() const { return {}; }

  // Benchmarks of models nobody has on disk: fills `slot` with a seeded random adapter of
  // `rank` on every target (shared_outer: the routed experts share gate_up A and down B).
  // Backends that cannot do it return false from supports_random_adapters() and throw
  // kUnsupported from randomize_slot().
  virtual bool supports_random_adapters() const { return false; }
  virtual void randomize_slot(int32_t slot, int64_t rank, bool shared_outer, uint64_t seed);

  virtual ExecutorCounters counters() const { return {}; }
  // Non-empty once the backend can run no more forwards (a rank of a multi-process job was lost,
  // so the ranks' caches no longer agree): the reason. The Engine then stops: step() returns it.
  virtual std::string broken_reason() const { return ""; }
  // Called between steps while the engine has no work (Engine::check_backend): a backend whose
  // peers can fail looks at them here without blocking and reports through broken_reason().
  virtual void check_health() {}
  // The attention kernels the backend runs (ModelInfo::attention_kernel).
  virtual std::string attention_kernel() const { return "reference"; }
  // ModelInfo::moe_shared_experts_in_experts.
  virtual int64_t moe_shared_experts_in_experts() const { return 0; }

 protected:
  // The default forward_sample() keeps its logits here for last_logits().
  std::vector<Tensor> last_forward_logits_;
};

}  // namespace moelora::runtime
