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
//   3. admission from the queue, in arrival order, while fewer than max_running requests run,
//      budget remains and the next request's KV pages fit (see "KV admission"); each admitted
//      request gets its first chunk in this same step.
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
// KV admission (a backend with a fixed page pool, Executor::kv_capacity): a request reserves
// the pages of its whole length, ceil((prompt_len + max_new_tokens) / kv_page_size), when it is
// admitted, and gives them back when it leaves. It is admitted only when they are not reserved
// by running requests, so a running request always finds the pages it grows into (decode can
// never fail for lack of pages, and nothing is ever preempted). This is predictable at the cost
// of holding pages a request that stops early never uses. A request that does not fit stops
// admission for the step: later requests (even small ones, even base-only ones) wait behind it,
// so a stream of small requests cannot starve a large one; it fits once enough running requests
// finish, because enqueue() refuses a request larger than the whole pool.
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
  // The KV page pool (Executor::kv_capacity): kv_pages pages of kv_page_size tokens; 0 pages =
  // unlimited (no reservation).
  int64_t kv_pages = 0;
  int64_t kv_page_size = 1;
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
  bool kv_blocked = false;  // a waiting request did not fit the free KV pages (admission stopped)
  int64_t tokens() const { return decode_tokens + prefill_tokens; }
  bool empty() const { return items.empty(); }
};

class Scheduler {
 public:
  // `pool` provides and refcounts the adapter slots; it must outlive the scheduler.
  Scheduler(const SchedulerOptions& options, AdapterPool& pool);

  const SchedulerOptions& options() const { return options_; }

  // Queues a request (adapter "" = base) that will run prompt_len prompt tokens and generate up
  // to max_new_tokens. kInvalidArgument for a duplicate id, prompt_len < 1 or
  // max_new_tokens < 1; kOutOfRange when its KV pages exceed the whole pool (it could never run).
  void enqueue(RequestId id, const std::string& adapter, int64_t prompt_len,
               int64_t max_new_tokens);
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

  // KV pages: what a request of `tokens` tokens (prompt + max_new_tokens) reserves (0 when the
  // pool is unlimited), and what the running requests hold reserved now.
  int64_t kv_pages_for(int64_t tokens) const;
  int64_t kv_pages_reserved() const { return kv_pages_reserved_; }
  bool kv_limited() const { return options_.kv_pages > 0; }

 private:
  struct Entry {
    RequestId id = 0;
    std::string adapter;
    int64_t prompt_len = 0;
    int64_t prefilled = 0;
    int32_t slot = -1;
    int64_t kv_pages = 0;  // reserved while running: pages of prompt_len + max_new_tokens
  };
  int64_t chunk(const Entry& e, int64_t budget) const;
  bool kv_fits(const Entry& e) const;

  SchedulerOptions options_;
  AdapterPool& pool_;
  std::deque<Entry> waiting_;
  std::vector<Entry> running_;     // admission order
  int64_t kv_pages_reserved_ = 0;  // sum of running_[i].kv_pages
};

}  // namespace moelora::runtime
