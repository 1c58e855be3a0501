// Continuous batching with chunked prefill and adapter-aware admission (see scheduler.h).
#include "runtime/scheduler.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace moelora::runtime {

void check_scheduler_options(const SchedulerOptions& o, int32_t adapter_slots) {
  const auto bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(o.max_running >= 1, bad, "max_running must be >= 1, got ", o.max_running);
  MOELORA_CHECK(o.max_batch_tokens >= o.max_running, bad, "max_batch_tokens (", o.max_batch_tokens,
                ") must be >= max_running (", o.max_running,
                "): every running request decodes one token per step");
  MOELORA_CHECK(o.prefill_chunk >= 0, bad, "prefill_chunk must be >= 0 (0 = no limit), got ",
                o.prefill_chunk);
  MOELORA_CHECK(o.max_loras_per_batch >= 0, bad, "max_loras_per_batch must be >= 0, got ",
                o.max_loras_per_batch);
  MOELORA_CHECK(o.kv_pages >= 0 && o.kv_page_size >= 1, bad, "the KV page pool (", o.kv_pages,
                " pages of ", o.kv_page_size,
                " tokens) needs kv_pages >= 0 (0 = unlimited) and kv_page_size >= 1");
  MOELORA_CHECK(o.max_loras_per_batch <= adapter_slots, bad, "max_loras_per_batch (",
                o.max_loras_per_batch, ") exceeds adapter_slots (", adapter_slots,
                "): every adapter in a batch needs its own slot");
}

Scheduler::Scheduler(const SchedulerOptions& options, AdapterPool& pool)
    : options_(options), pool_(pool) {
  check_scheduler_options(options, pool.num_slots());
}

void Scheduler::enqueue(RequestId id, const std::string& adapter, int64_t prompt_len,
                        int64_t max_new_tokens) {
  MOELORA_CHECK(prompt_len >= 1, ErrorCode::kInvalidArgument, "request ", id,
                ": the prompt is empty");
  MOELORA_CHECK(max_new_tokens >= 1, ErrorCode::kInvalidArgument, "request ", id,
                ": max_new_tokens must be >= 1, got ", max_new_tokens);
  MOELORA_CHECK(!is_waiting(id) && !is_running(id), ErrorCode::kInvalidArgument, "request id ", id,
                " is queued twice");
  const int64_t tokens = prompt_len + max_new_tokens;
  const int64_t pages = kv_pages_for(tokens);
  MOELORA_CHECK(pages <= options_.kv_pages || !kv_limited(), ErrorCode::kOutOfRange, "request ", id,
                ": prompt (", prompt_len, " tokens) + max_new_tokens (", max_new_tokens,
                ") = ", tokens, " tokens need ", pages, " KV pages of ", options_.kv_page_size,
                " tokens; the whole KV cache has ", options_.kv_pages, " pages (",
                options_.kv_pages * options_.kv_page_size, " tokens)");
  waiting_.push_back({id, adapter, prompt_len, 0, -1, pages});
}

int64_t Scheduler::kv_pages_for(int64_t tokens) const {
  if (!kv_limited()) return 0;
  return (tokens + options_.kv_page_size - 1) / options_.kv_page_size;
}

bool Scheduler::kv_fits(const Entry& e) const {
  return !kv_limited() || kv_pages_reserved_ + e.kv_pages <= options_.kv_pages;
}

int64_t Scheduler::chunk(const Entry& e, int64_t budget) const {
  int64_t n = std::min(e.prompt_len - e.prefilled, budget);
  if (options_.prefill_chunk > 0) n = std::min(n, options_.prefill_chunk);
  return n;
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  int64_t budget = options_.max_batch_tokens;

  // 1. decode: one token for every request whose prompt is in the cache.
  for (const Entry& e : running_) {
    if (e.prefilled < e.prompt_len) continue;
    plan.items.push_back({e.id, e.slot, true, e.prompt_len, 1, true, false});
    ++plan.decode_tokens;
    --budget;
  }
  // 2. the next chunk of every request still in prefill, oldest first.
  for (Entry& e : running_) {
    if (e.prefilled >= e.prompt_len) continue;
    if (budget == 0) break;
    const int64_t n = chunk(e, budget);
    plan.items.push_back(
        {e.id, e.slot, false, e.prefilled, n, e.prefilled + n == e.prompt_len, false});
    e.prefilled += n;
    plan.prefill_tokens += n;
    budget -= n;
  }
  // 3. admission in arrival order.
  bool adapter_blocked = false;  // an earlier adapter request is waiting for a slot
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (static_cast<int32_t>(running_.size()) >= options_.max_running || budget == 0) break;
    Entry& e = *it;
    if (!e.adapter.empty()) {
      if (adapter_blocked) {  // keep FIFO order among adapter requests
        ++it;
        continue;
      }
      if (options_.max_loras_per_batch == 0 || !pool_.can_ever_acquire(e.adapter)) {
        plan.failed.emplace_back(
            e.id,
            options_.max_loras_per_batch == 0
                ? "adapter '" + e.adapter + "' cannot run: LoRA is off (max_loras_per_batch is 0)"
                : "adapter '" + e.adapter + "' cannot get a slot: all " +
                      std::to_string(pool_.num_slots()) +
                      " adapter slots are pinned to other adapters");
        it = waiting_.erase(it);
        continue;
      }
    }
    // KV before the slot, so that a request that has to wait holds no slot. Everything behind a
    // request that does not fit waits too (see scheduler.h).
    if (!kv_fits(e)) {
      plan.kv_blocked = true;
      break;
    }
    if (!e.adapter.empty()) {
      const bool shares_slot = pool_.in_use(e.adapter);
      if (!shares_slot && pool_.adapters_in_use() >= options_.max_loras_per_batch) {
        adapter_blocked = true;
        ++it;
        continue;
      }
      std::optional<int32_t> slot;
      try {
        slot = pool_.acquire(e.adapter);
      } catch (const std::exception& error) {
        plan.failed.emplace_back(e.id, error.what());
        it = waiting_.erase(it);
        continue;
      }
      if (!slot) {  // every slot is pinned or used by running requests
        adapter_blocked = true;
        ++it;
        continue;
      }
      e.slot = *slot;
    }
    const int64_t n = chunk(e, budget);
    plan.items.push_back({e.id, e.slot, false, 0, n, n == e.prompt_len, true});
    e.prefilled = n;
    plan.prefill_tokens += n;
    budget -= n;
    kv_pages_reserved_ += e.kv_pages;
    running_.push_back(e);
    it = waiting_.erase(it);
  }
  return plan;
}

void Scheduler::finish(RequestId id) {
  auto it =
      std::find_if(running_.begin(), running_.end(), [id](const Entry& e) { return e.id == id; });
  MOELORA_CHECK(it != running_.end(), ErrorCode::kNotFound, "request ", id, " is not running");
  if (!it->adapter.empty()) pool_.release(it->adapter);
  kv_pages_reserved_ -= it->kv_pages;
  running_.erase(it);
}

bool Scheduler::remove(RequestId id) {
  if (is_running(id)) {
    finish(id);
    return true;
  }
  auto it =
      std::find_if(waiting_.begin(), waiting_.end(), [id](const Entry& e) { return e.id == id; });
  if (it == waiting_.end()) return false;
  waiting_.erase(it);
  return true;
}

bool Scheduler::is_waiting(RequestId id) const {
  return std::any_of(waiting_.begin(), waiting_.end(), [id](const Entry& e) { return e.id == id; });
}

bool Scheduler::is_running(RequestId id) const {
  return std::any_of(running_.begin(), running_.end(), [id](const Entry& e) { return e.id == id; });
}

int64_t Scheduler::prefilled(RequestId id) const {
  for (const Entry& e : running_) {
    if (e.id == id) return e.prefilled;
  }
  MOELORA_THROW(ErrorCode::kNotFound, "request ", id, " is not running");
}

int32_t Scheduler::waiting_with(const std::string& adapter) const {
  return static_cast<int32_t>(std::count_if(waiting_.begin(), waiting_.end(),
                                            [&](const Entry& e) { return e.adapter == adapter; }));
}

int32_t Scheduler::running_with(const std::string& adapter) const {
  return static_cast<int32_t>(std::count_if(running_.begin(), running_.end(),
                                            [&](const Entry& e) { return e.adapter == adapter; }));
}

std::vector<RequestId> Scheduler::waiting_ids() const {
  std::vector<RequestId> out;
  for (const Entry& e : waiting_) out.push_back(e.id);
  return out;
}

}  // namespace moelora::runtime
