// Scheduler: continuous batching with chunked prefill and adapter-aware admission. Decides, step
// by step, which requests run and how many of their tokens; knows nothing of tokens' values,
// the model or sampling (the Engine does those), so it is tested on its own.
//
// A request is waiting (FIFO queue) until admitted; then running until the Engine calls finish()
// or remove(). A running request is in prefill while part of its prompt is not in the cache yet,
// then in decode (one token per step: the token sampled at the previous step).
//
// schedule() builds one step within max_batch_tokens tokens:
//   1. one decode token for every running request in decode;
//   2. prompt chunks of running requests still in prefill, oldest first: at most prefill_chunk
//      tokens each (0 = no per-request cap), while budget remains;
//   3. admission from the queue, in arrival order, while fewer than max_running requests run
//      and budget remains; each admitted request gets its first chunk in this same step.
// Decode first: max_running <= max_batch_tokens (checked), so every running request decodes at
// every step, and a request in prefill always gets at least one token.
//
// Adapter admission: a request naming an adapter needs the adapter's slot. It is admitted when
// the adapter is in use by a running request already (shared slot, no new distinct adapter), or
// when fewer than max_loras_per_batch distinct adapters are in use and the AdapterPool can give
// it a slot (possibly evicting an idle adapter). Otherwise it is blocked: it stays at its place
// in the queue, and every later adapter request waits behind it (adapter requests keep FIFO
// order, so requests of busy adapters cannot keep overtaking it and starve it); later base-only
// requests, which need no slot, are admitted past it. The blocked request is first in line for
// the next adapter slot or running place that frees up, so it waits at most until the running
// requests of the adapters in use finish.
//
// A request whose adapter cannot run is dropped from the queue and reported in StepPlan::failed:
// its files failed to load at admission (they went missing after the adapter left the host
// cache), every slot is pinned to other adapters, or LoRA is off (max_loras_per_batch 0).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "runtime/adapter_pool.h"

namespace moelora::runtime {

using RequestId = uint64_t;

struct SchedulerOptions {
  int64_t max_batch_tokens = 2048;
  int32_t max_running = 64;
  int32_t max_loras_per_batch = 8;
  int64_t prefill_chunk = 512;  // 0 = no per-request cap
};

// kInvalidArgument naming the option for limits that cannot work together.
void check_scheduler_options(const SchedulerOptions& options, int32_t adapter_slots);

// The work of one request in a step.
struct StepItem {
  RequestId id = 0;
  int32_t slot = -1;      // adapter slot, -1 = base
  bool decode = false;    // one token: the last sampled one
  int64_t begin = 0;      // prefill: first prompt position of the chunk
  int64_t count = 0;      // tokens (1 for decode)
  bool samples = false;   // the logits of this item's last token give the request's next token
  bool admitted = false;  // the request joined in this step (needs a fresh sequence)
};

struct StepPlan {
  std::vector<StepItem> items;  // decode items, then prefill chunks (oldest request first)
  int64_t decode_tokens = 0;
  int64_t prefill_tokens = 0;
  std::vector<std::pair<RequestId, std::string>> failed;  // dropped at admission, with the reason
  int64_t tokens() const { return decode_tokens + prefill_tokens; }
  bool empty() const { return items.empty(); }
};

class Scheduler {
 public:
  // `pool` provides and refcounts the adapter slots; it must outlive the scheduler.
  Scheduler(const SchedulerOptions& options, AdapterPool& pool);

  const SchedulerOptions& options() const { return options_; }

  // Queues a request (adapter "" = base). kInvalidArgument for a duplicate id or prompt_len < 1.
  void enqueue(RequestId id, const std::string& adapter, int64_t prompt_len);
  // Plans the next step and commits it: admitted requests hold their slots, and the planned
  // chunks count as prefilled (if the step fails, the Engine finishes its requests).
  StepPlan schedule();
  // A running request is done: it leaves and releases its adapter slot. kNotFound if not running.
  void finish(RequestId id);
  // Drops a waiting or running request (cancel); false when the id is unknown.
  bool remove(RequestId id);

  bool is_waiting(RequestId id) const;
  bool is_running(RequestId id) const;
  // Prompt tokens of a running request in the cache after the steps planned so far.
  int64_t prefilled(RequestId id) const;
  int32_t running() const { return static_cast<int32_t>(running_.size()); }
  int32_t waiting() const { return static_cast<int32_t>(waiting_.size()); }
  // Waiting and running requests that name `adapter`.
  int32_t waiting_with(const std::string& adapter) const;
  int32_t running_with(const std::string& adapter) const;
  std::vector<RequestId> waiting_ids() const;

 private:
  struct Entry {
    RequestId id = 0;
    std::string adapter;
    int64_t prompt_len = 0;
    int64_t prefilled = 0;
    int32_t slot = -1;
  };
  int64_t chunk(const Entry& e, int64_t budget) const;

  SchedulerOptions options_;
  AdapterPool& pool_;
  std::deque<Entry> waiting_;
  std::vector<Entry> running_;  // admission order
};

}  // namespace moelora::runtime
