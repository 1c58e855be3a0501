// Unit tests of the serving runtime (src/runtime, include/moelora/engine.h):
//   - AdapterPool bookkeeping without a model (LRU eviction, pinning, refcounts, never evicting
//     an adapter in use, host-cache hits, failing loads and slot writes);
//   - Scheduler decisions without a model (token budget, decode first, chunked prefill,
//     max_running, max_loras_per_batch, base requests going past a blocked adapter request, FIFO
//     among adapter requests, cancellation; KV page reservation: requests wait in arrival order
//     until their pages are free, a random load through a tiny real page pool never runs it dry,
//     a request larger than the pool is refused);
//   - the Engine end to end on the committed tiny fixtures (Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3):
//     greedy and sampled outputs equal
//     model::generate of each request alone while requests join and leave at different steps with
//     mixed adapters and chunked prompts; the per-step limits as the backend sees them;
//     cancellation frees the KV cache and the slot; adapter eviction and reloads; unregistering;
//     bad requests and options rejected with clear messages; a backend with a small KV page pool
//     makes requests wait, never fail, and too large ones are rejected at submit;
//   - the Executor contract the Engine relies on: sampling through forward_sample with one
//     uniform per sampling request drawn from the request's own generator, a row whose sampling
//     fails ends only its request, the backend's maximum sequence length, random adapters
//     (register_random_adapter) drawn into slots and drawn again after an eviction;
//   - the CUDA-free half of the GPU executor: decode buckets, the KV page allocator, the step
//     metadata plan (slot grouping, LoRA segments, positions, page tables, padding, graphs);
//   - `moelora bench` run as a user would (table, --json fields, errors, the adapter pool sized
//     from the run or from --adapter-slots / --max-lora-rank and printed in the header).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "model/generate.h"
#include "model/model.h"
#include "model/sampler.h"
#include "moelora/engine.h"
#include "runtime/adapter_pool.h"
#include "runtime/cpu_executor.h"
#include "runtime/gpu_executor.h"
#include "runtime/scheduler.h"
#include "support/test_support.h"

namespace moelora::runtime {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ================================================================ AdapterPool (no model)

// Records what the pool asks the backend to do.
class FakeWriter final : public SlotWriter {
 public:
  void write_slot(int32_t slot, const io::LoraAdapter& adapter) override {
    if (fail_next_write) {
      fail_next_write = false;
      MOELORA_THROW(ErrorCode::kInternal, "simulated upload failure");
    }
    content[slot] = adapter.name;
    ++writes;
  }
  void clear_slot(int32_t slot) override {
    content.erase(slot);
    ++clears;
  }
  std::map<int32_t, std::string> content;  // what each slot holds, as the backend sees it
  int writes = 0, clears = 0;
  bool fail_next_write = false;
};

// Counts disk reads; names listed in `broken` fail to load.
struct FakeDisk {
  std::map<std::string, int> reads;
  std::set<std::string> broken;
  AdapterLoader loader() {
    return [this](const std::string& name, const fs::path& dir) {
      ++reads[name];
      MOELORA_CHECK(!broken.count(name), ErrorCode::kNotFound, dir.string(),
                    ": adapter_config.json is missing");
      io::LoraAdapter a;
      a.name = name;
      a.dir = dir;
      return a;
    };
  }
};

TEST(AdapterPool, LoadsIntoFreeSlotsThenEvictsLeastRecentlyUsed) {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool(2, 8, writer, disk.loader());
  for (const char* name : {"a", "b", "c"}) pool.add(name, std::string("/adapters/") + name);
  EXPECT_EQ(writer.writes, 0);  // registration does not take a slot

  const auto use = [&](const std::string& name) {
    const std::optional<int32_t> slot = pool.acquire(name);
    EXPECT_TRUE(slot.has_value()) << name;
    pool.release(name);
    return slot.value_or(-1);
  };
  const int32_t slot_a = use("a");
  const int32_t slot_b = use("b");
  EXPECT_NE(slot_a, slot_b);
  EXPECT_EQ(use("a"), slot_a);  // hit: a is now more recent than b
  EXPECT_EQ(pool.stats().hits, 1);
  EXPECT_EQ(pool.stats().misses, 2);

  EXPECT_EQ(use("c"), slot_b);  // b was least recently used
  EXPECT_EQ(pool.stats().evictions, 1);
  EXPECT_FALSE(pool.slot_of("b").has_value());
  EXPECT_EQ(pool.slot_of("a"), slot_a);
  EXPECT_EQ(writer.content[slot_b], "c");
  EXPECT_EQ(writer.content[slot_a], "a");
}

TEST(AdapterPool, NeverEvictsAnAdapterInUse) {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool(2, 8, writer, disk.loader());
  for (const char* name : {"a", "b", "c"}) pool.add(name, name);
  const int32_t slot_a = pool.acquire("a").value();
  ASSERT_TRUE(pool.acquire("b").has_value());
  ASSERT_TRUE(pool.acquire("a").has_value());  // a second request on a
  EXPECT_EQ(pool.refcount("a"), 2);
  EXPECT_EQ(pool.adapters_in_use(), 2);

  EXPECT_FALSE(pool.can_acquire("c"));
  const int writes = writer.writes;
  EXPECT_FALSE(pool.acquire("c").has_value());  // both slots are held
  EXPECT_EQ(writer.writes, writes);
  EXPECT_EQ(pool.refcount("c"), 0);

  pool.release("a");
  EXPECT_FALSE(pool.acquire("c").has_value());  // a is still used once
  pool.release("a");
  EXPECT_TRUE(pool.can_acquire("c"));
  EXPECT_EQ(pool.acquire("c"), slot_a);  // now a's slot is free to take
  EXPECT_EQ(pool.refcount("b"), 1);
  EXPECT_EQ(writer.content[slot_a], "c");
  EXPECT_TRUE(contains(error_of([&] { pool.release("a"); }), "released more often than acquired"));
}

TEST(AdapterPool, PinnedAdaptersKeepTheirSlot) {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool(2, 8, writer, disk.loader());
  pool.add("p", "p", /*pin=*/true);
  const std::optional<int32_t> pinned_slot = pool.slot_of("p");
  ASSERT_TRUE(pinned_slot.has_value());
  EXPECT_EQ(writer.content[*pinned_slot], "p");  // written at registration
  EXPECT_TRUE(pool.pinned("p"));
  EXPECT_EQ(pool.refcount("p"), 0);

  pool.add("x", "x");
  pool.add("y", "y");
  const int32_t slot_x = pool.acquire("x").value();
  pool.release("x");
  EXPECT_EQ(pool.acquire("y"), slot_x);  // evicts idle x, not idle-but-pinned p
  pool.release("y");
  EXPECT_EQ(pool.slot_of("p"), pinned_slot);

  // A second pin takes the last slot; then nothing is left for unpinned adapters.
  EXPECT_EQ(error_of([&] { pool.add("q", "q", true); }), "<no error>");
  EXPECT_EQ(pool.pinned_count(), 2);
  EXPECT_FALSE(pool.can_ever_acquire("x"));
  EXPECT_TRUE(pool.can_ever_acquire("p"));
  EXPECT_FALSE(pool.acquire("x").has_value());
  const std::string msg = error_of([&] { pool.add("r", "r", true); });
  EXPECT_TRUE(contains(msg, "cannot pin adapter 'r'")) << msg;
  EXPECT_FALSE(pool.contains("r"));  // nothing registered on failure
}

TEST(AdapterPool, HostCacheServesReloadsWithoutReadingFiles) {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool(1, 2, writer, disk.loader());
  pool.add("a", "a");
  pool.add("b", "b");
  EXPECT_EQ(disk.reads["a"], 1);
  EXPECT_EQ(disk.reads["b"], 1);
  for (int round = 0; round < 3; ++round) {  // one slot: a and b evict each other every time
    for (const char* name : {"a", "b"}) {
      ASSERT_TRUE(pool.acquire(name).has_value());
      pool.release(name);
    }
  }
  EXPECT_EQ(disk.reads["a"], 1);  // every reload came from the host cache
  EXPECT_EQ(disk.reads["b"], 1);
  EXPECT_EQ(pool.stats().host_hits, 6);
  EXPECT_EQ(pool.stats().host_misses, 2);  // the registrations
  EXPECT_EQ(pool.stats().evictions, 5);

  // A third adapter pushes the least recently used one (a) out of the 2-entry host cache.
  pool.add("c", "c");
  EXPECT_FALSE(pool.in_host_cache("a"));
  EXPECT_TRUE(pool.in_host_cache("b"));
  ASSERT_TRUE(pool.acquire("a").has_value());
  EXPECT_EQ(disk.reads["a"], 2);  // read again
  pool.release("a");
}

TEST(AdapterPool, ZeroHostCacheReadsEveryTime) {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool(1, 0, writer, disk.loader());
  pool.add("a", "a");
  pool.add("b", "b");
  for (int i = 0; i < 2; ++i) {
    for (const char* name : {"a", "b"}) {
      ASSERT_TRUE(pool.acquire(name).has_value());
      pool.release(name);
    }
  }
  EXPECT_EQ(disk.reads["a"], 3);
  EXPECT_EQ(pool.stats().host_hits, 0);
}

TEST(AdapterPool, FailuresLeaveAConsistentState) {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool(1, 0, writer, disk.loader());
  disk.broken.insert("bad");
  EXPECT_TRUE(
      contains(error_of([&] { pool.add("bad", "/x/bad"); }), "adapter_config.json is missing"));
  EXPECT_FALSE(pool.contains("bad"));

  // Registered fine, files gone later (no host cache): acquire throws and changes nothing.
  pool.add("gone", "/x/gone");
  disk.broken.insert("gone");
  EXPECT_TRUE(contains(error_of([&] { pool.acquire("gone"); }), "adapter_config.json is missing"));
  EXPECT_EQ(pool.refcount("gone"), 0);
  EXPECT_FALSE(pool.slot_of("gone").has_value());

  // A slot write that fails leaves the slot empty (and cleared in the backend).
  pool.add("ok", "/x/ok");
  writer.fail_next_write = true;
  EXPECT_TRUE(contains(error_of([&] { pool.acquire("ok"); }), "simulated upload failure"));
  EXPECT_FALSE(pool.slot_of("ok").has_value());
  EXPECT_TRUE(writer.content.empty());
  EXPECT_EQ(pool.acquire("ok"), 0);  // and works next time

  EXPECT_TRUE(contains(error_of([&] { pool.acquire("nope"); }),
                       "unknown adapter 'nope'; registered: gone, ok"));
  EXPECT_TRUE(contains(error_of([&] { pool.add("ok", "/y"); }), "already registered"));
}

TEST(AdapterPool, RemoveRefusesWhileInUseAndClearsTheSlot) {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool(2, 4, writer, disk.loader());
  pool.add("a", "a");
  const int32_t slot = pool.acquire("a").value();
  const std::string msg = error_of([&] { pool.remove("a"); });
  EXPECT_TRUE(contains(msg, "'a' is used by 1 running request")) << msg;
  pool.release("a");
  pool.remove("a");
  EXPECT_FALSE(pool.contains("a"));
  EXPECT_FALSE(writer.content.count(slot));
  EXPECT_FALSE(pool.in_host_cache("a"));
  EXPECT_TRUE(contains(error_of([&] { pool.remove("a"); }), "unknown adapter 'a'"));
}

// ================================================================ Scheduler (no model)

struct SchedulerFixture {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool;
  Scheduler scheduler;
  SchedulerFixture(const SchedulerOptions& options, int32_t slots,
                   std::vector<std::string> adapters = {})
      : pool(slots, 8, writer, disk.loader()), scheduler(options, pool) {
    for (const std::string& a : adapters) pool.add(a, a);
  }
};

// (id, decode, begin, count, samples, admitted) of every item, for compact expectations.
std::vector<std::tuple<RequestId, bool, int64_t, int64_t, bool, bool>> summary(
    const StepPlan& plan) {
  std::vector<std::tuple<RequestId, bool, int64_t, int64_t, bool, bool>> out;
  for (const StepItem& i : plan.items)
    out.emplace_back(i.id, i.decode, i.decode ? 0 : i.begin, i.count, i.samples, i.admitted);
  return out;
}

TEST(Scheduler, TokenBudgetDecodeFirstAndChunkedPrefill) {
  SchedulerFixture f({/*max_batch_tokens=*/10, /*max_running=*/4, 1, /*prefill_chunk=*/0}, 1);
  f.scheduler.enqueue(1, "", 6, 1);
  f.scheduler.enqueue(2, "", 6, 1);
  f.scheduler.enqueue(3, "", 3, 1);
  using T = std::tuple<RequestId, bool, int64_t, int64_t, bool, bool>;
  // Step 1: 1 whole, 2 gets the 4 tokens left, 3 does not fit.
  StepPlan p = f.scheduler.schedule();
  EXPECT_EQ(summary(p),
            (std::vector<T>{{1, false, 0, 6, true, true}, {2, false, 0, 4, false, true}}));
  EXPECT_EQ(p.prefill_tokens, 10);
  EXPECT_EQ(f.scheduler.waiting(), 1);
  // Step 2: 1 decodes, 2 finishes its prompt, 3 joins.
  p = f.scheduler.schedule();
  EXPECT_EQ(summary(p), (std::vector<T>{{1, true, 0, 1, true, false},
                                        {2, false, 4, 2, true, false},
                                        {3, false, 0, 3, true, true}}));
  EXPECT_EQ(p.decode_tokens, 1);
  EXPECT_EQ(p.prefill_tokens, 5);
  // Request 1 finishes; the others decode.
  f.scheduler.finish(1);
  p = f.scheduler.schedule();
  EXPECT_EQ(summary(p),
            (std::vector<T>{{2, true, 0, 1, true, false}, {3, true, 0, 1, true, false}}));
  EXPECT_EQ(f.scheduler.running(), 2);
}

TEST(Scheduler, LongPromptIsChunkedAcrossSteps) {
  SchedulerFixture f({100, 4, 1, /*prefill_chunk=*/5}, 1);
  f.scheduler.enqueue(7, "", 23, 1);
  std::vector<int64_t> chunks;
  std::vector<bool> samples;
  for (int step = 0; step < 6; ++step) {
    const StepPlan p = f.scheduler.schedule();
    ASSERT_EQ(p.items.size(), 1u);
    EXPECT_EQ(p.items[0].admitted, step == 0);
    if (p.items[0].decode) break;
    EXPECT_EQ(p.items[0].begin, step * 5);
    chunks.push_back(p.items[0].count);
    samples.push_back(p.items[0].samples);
  }
  EXPECT_EQ(chunks, (std::vector<int64_t>{5, 5, 5, 5, 3}));
  EXPECT_EQ(samples, (std::vector<bool>{false, false, false, false, true}));
  EXPECT_EQ(f.scheduler.prefilled(7), 23);
}

TEST(Scheduler, MaxRunning) {
  SchedulerFixture f({100, 2, 1, 0}, 1);
  for (RequestId id = 1; id <= 3; ++id) f.scheduler.enqueue(id, "", 2, 1);
  StepPlan p = f.scheduler.schedule();
  EXPECT_EQ(p.items.size(), 2u);
  EXPECT_TRUE(f.scheduler.is_waiting(3));
  p = f.scheduler.schedule();
  EXPECT_EQ(p.decode_tokens, 2);
  EXPECT_EQ(p.prefill_tokens, 0);  // still full
  f.scheduler.finish(2);
  p = f.scheduler.schedule();
  EXPECT_TRUE(f.scheduler.is_running(3));
  EXPECT_EQ(p.decode_tokens, 1);
  EXPECT_EQ(p.prefill_tokens, 2);
}

TEST(Scheduler, MaxLorasPerBatchWithBaseRequestsGoingPast) {
  SchedulerFixture f({100, 8, /*max_loras_per_batch=*/1, 0}, 2, {"a", "b"});
  f.scheduler.enqueue(1, "a", 3, 1);
  f.scheduler.enqueue(2, "b", 3, 1);  // a second distinct adapter: blocked
  f.scheduler.enqueue(3, "", 3, 1);   // base: goes past
  f.scheduler.enqueue(4, "a", 3, 1);  // a is in use, but adapter requests keep FIFO order behind 2
  f.scheduler.enqueue(5, "", 3, 1);
  StepPlan p = f.scheduler.schedule();
  std::set<RequestId> admitted;
  for (const StepItem& i : p.items) admitted.insert(i.id);
  EXPECT_EQ(admitted, (std::set<RequestId>{1, 3, 5}));
  EXPECT_EQ(f.pool.adapters_in_use(), 1);
  EXPECT_EQ(f.scheduler.waiting_ids(), (std::vector<RequestId>{2, 4}));
  for (const StepItem& i : p.items) EXPECT_EQ(i.slot, i.id == 1 ? f.pool.slot_of("a").value() : -1);

  // While request 1 runs, nothing changes for 2 and 4.
  f.scheduler.schedule();
  EXPECT_EQ(f.scheduler.waiting_ids(), (std::vector<RequestId>{2, 4}));
  // Request 1 finishes: b gets its turn first (a is no longer in use, so 4 now needs a new
  // distinct adapter and waits behind 2).
  f.scheduler.finish(1);
  p = f.scheduler.schedule();
  EXPECT_EQ(f.scheduler.waiting_ids(), (std::vector<RequestId>{4}));
  EXPECT_TRUE(f.scheduler.is_running(2));
  EXPECT_EQ(f.pool.refcount("b"), 1);
  EXPECT_EQ(f.pool.refcount("a"), 0);
  f.scheduler.finish(2);
  f.scheduler.schedule();
  EXPECT_TRUE(f.scheduler.is_running(4));
  EXPECT_EQ(f.scheduler.waiting(), 0);
}

TEST(Scheduler, SameAdapterSharesOneSlot) {
  SchedulerFixture f({100, 8, 1, 0}, 1, {"a"});
  for (RequestId id = 1; id <= 3; ++id) f.scheduler.enqueue(id, "a", 2, 1);
  const StepPlan p = f.scheduler.schedule();
  EXPECT_EQ(p.items.size(), 3u);
  EXPECT_EQ(f.pool.refcount("a"), 3);
  EXPECT_EQ(f.pool.stats().misses, 1);
  EXPECT_EQ(f.pool.stats().hits, 2);
}

TEST(Scheduler, SlotShortageBlocksLikeTheLoraLimit) {
  // max_loras 2 with 2 slots, one pinned to an adapter nobody uses: only one slot is left.
  SchedulerFixture f({100, 8, 2, 0}, 2, {"a", "b"});
  f.pool.add("p", "p", /*pin=*/true);
  f.scheduler.enqueue(1, "a", 2, 1);
  f.scheduler.enqueue(2, "b", 2, 1);
  f.scheduler.enqueue(3, "", 2, 1);
  f.scheduler.schedule();
  EXPECT_TRUE(f.scheduler.is_running(1));
  EXPECT_TRUE(f.scheduler.is_waiting(2));
  EXPECT_TRUE(f.scheduler.is_running(3));
  f.scheduler.finish(1);
  f.scheduler.schedule();
  EXPECT_TRUE(f.scheduler.is_running(2));
}

TEST(Scheduler, CancellationReleasesTheSlot) {
  SchedulerFixture f({100, 8, 1, 4}, 1, {"a"});
  f.scheduler.enqueue(1, "a", 10, 1);
  f.scheduler.enqueue(2, "a", 10, 1);
  f.scheduler.schedule();  // both admitted, mid-prefill
  EXPECT_EQ(f.pool.refcount("a"), 2);
  EXPECT_TRUE(f.scheduler.remove(1));
  EXPECT_EQ(f.pool.refcount("a"), 1);
  EXPECT_TRUE(f.scheduler.remove(2));
  EXPECT_EQ(f.pool.refcount("a"), 0);
  EXPECT_FALSE(f.scheduler.remove(2));
  f.scheduler.enqueue(3, "", 1, 1);
  EXPECT_TRUE(f.scheduler.remove(3));  // waiting
  EXPECT_TRUE(f.scheduler.schedule().empty());
}

TEST(Scheduler, UnloadableAdapterFailsOnlyItsRequest) {
  FakeWriter writer;
  FakeDisk disk;
  AdapterPool pool(2, 0, writer, disk.loader());  // no host cache: admission reads the files
  Scheduler scheduler({100, 8, 2, 0}, pool);
  pool.add("gone", "/x/gone");
  disk.broken.insert("gone");
  scheduler.enqueue(1, "gone", 3, 1);
  scheduler.enqueue(2, "", 3, 1);
  const StepPlan p = scheduler.schedule();
  ASSERT_EQ(p.failed.size(), 1u);
  EXPECT_EQ(p.failed[0].first, 1u);
  EXPECT_TRUE(contains(p.failed[0].second, "adapter_config.json is missing")) << p.failed[0].second;
  EXPECT_TRUE(scheduler.is_running(2));
  EXPECT_FALSE(scheduler.is_waiting(1));
  EXPECT_EQ(pool.refcount("gone"), 0);
}

// Options with a KV page pool of `pages` pages of `page_size` tokens.
SchedulerOptions with_kv(SchedulerOptions o, int64_t pages, int64_t page_size) {
  o.kv_pages = pages;
  o.kv_page_size = page_size;
  return o;
}

TEST(Scheduler, KvReservationAdmitsWhatFitsInArrivalOrder) {
  // 7 pages of 5 tokens. Each request reserves ceil((prompt + max_new) / 5) pages.
  SchedulerFixture f(with_kv({64, 8, 2, 0}, 7, 5), 2, {"a"});
  f.scheduler.enqueue(1, "", 9, 3);   // 12 tokens: 3 pages
  f.scheduler.enqueue(2, "", 6, 4);   // 10 tokens: 2 pages
  f.scheduler.enqueue(3, "a", 7, 5);  // 12 tokens: 3 pages, 2 free: waits
  f.scheduler.enqueue(4, "", 1, 1);   // 1 page would fit, but waits behind 3
  StepPlan p = f.scheduler.schedule();
  EXPECT_TRUE(p.kv_blocked);
  EXPECT_TRUE(f.scheduler.is_running(1));
  EXPECT_TRUE(f.scheduler.is_running(2));
  EXPECT_EQ(f.scheduler.waiting_ids(), (std::vector<RequestId>{3, 4}));
  EXPECT_EQ(f.scheduler.kv_pages_reserved(), 5);
  EXPECT_EQ(f.pool.refcount("a"), 0) << "a request waiting for KV pages must not hold a slot";
  // Still 2 free pages: nothing joins, the running requests decode.
  p = f.scheduler.schedule();
  EXPECT_TRUE(p.kv_blocked);
  EXPECT_EQ(p.decode_tokens, 2);
  EXPECT_EQ(f.scheduler.waiting(), 2);
  // 2 leaves (2 pages back): 3 fits (3 + 3 = 6 pages), then 4 (7 pages).
  f.scheduler.finish(2);
  EXPECT_EQ(f.scheduler.kv_pages_reserved(), 3);
  p = f.scheduler.schedule();
  EXPECT_FALSE(p.kv_blocked);
  EXPECT_TRUE(f.scheduler.is_running(3));
  EXPECT_TRUE(f.scheduler.is_running(4));
  EXPECT_EQ(f.scheduler.kv_pages_reserved(), 7);
  EXPECT_EQ(f.pool.refcount("a"), 1);
  // Cancelling a running request gives its pages back too.
  EXPECT_TRUE(f.scheduler.remove(3));
  EXPECT_EQ(f.scheduler.kv_pages_reserved(), 4);
  f.scheduler.finish(1);
  f.scheduler.finish(4);
  EXPECT_EQ(f.scheduler.kv_pages_reserved(), 0);
}

TEST(Scheduler, KvRequestLargerThanThePoolIsRefused) {
  SchedulerFixture f(with_kv({64, 8, 1, 0}, 7, 5), 1);
  const std::string message = error_of([&] { f.scheduler.enqueue(1, "", 30, 6); });
  EXPECT_TRUE(contains(message,
                       "prompt (30 tokens) + max_new_tokens (6) = 36 tokens need 8 KV "
                       "pages of 5 tokens; the whole KV cache has 7 pages (35 tokens)"))
      << message;
  EXPECT_FALSE(f.scheduler.is_waiting(1));
  f.scheduler.enqueue(2, "", 30, 5);  // exactly the pool
  f.scheduler.schedule();
  EXPECT_TRUE(f.scheduler.is_running(2));
  EXPECT_EQ(f.scheduler.kv_pages_reserved(), 7);
  // Without a pool nothing is reserved and any length is accepted.
  SchedulerFixture unlimited({64, 8, 1, 0}, 1);
  unlimited.scheduler.enqueue(1, "", 5000, 5000);
  unlimited.scheduler.schedule();
  EXPECT_EQ(unlimited.scheduler.kv_pages_reserved(), 0);
  EXPECT_TRUE(contains(error_of([&] { unlimited.scheduler.enqueue(2, "", 3, 0); }),
                       "max_new_tokens must be >= 1, got 0"));
}

// Many random requests through a tiny page pool, with pages really allocated (PageAllocator, as
// the GPU executor does) for every token the plans run and every sampled token fed back: the
// allocator never runs dry, every request finishes (some stop early), and the pool is never
// over-reserved.
TEST(Scheduler, KvPoolNeverRunsDryUnderRandomLoad) {
  std::mt19937_64 rng(test::test_seed(97));
  const int64_t page_size = 3, num_pages = 11;
  SchedulerFixture f(with_kv({13, 6, 2, 4}, num_pages, page_size), 2, {"a", "b", "c"});
  PageAllocator pages(num_pages, static_cast<int>(page_size), static_cast<int>(num_pages));
  struct Live {
    int64_t prompt = 0, max_new = 0, stop_after = 0, generated = 0;
    SequenceHandle sequence = -1;
  };
  std::map<RequestId, Live> live;
  std::uniform_int_distribution<int64_t> len(1, 17), adapter(0, 3);
  const char* names[] = {"", "a", "b", "c"};
  const int kRequests = 41;
  RequestId next = 1;
  int finished = 0, blocked_steps = 0;
  for (int step = 0; finished < kRequests; ++step) {
    ASSERT_LT(step, 5000) << "requests do not finish";
    // Up to two arrivals per step; sizes up to the whole pool (33 tokens).
    for (int k = 0; k < 2 && next <= kRequests; ++k, ++next) {
      Live l;
      l.prompt = len(rng);
      l.max_new = std::uniform_int_distribution<int64_t>(1, num_pages * page_size - l.prompt)(rng);
      l.stop_after = std::uniform_int_distribution<int64_t>(1, l.max_new)(rng);  // early stops
      f.scheduler.enqueue(next, names[adapter(rng)], l.prompt, l.max_new);
      live[next] = l;
    }
    const StepPlan plan = f.scheduler.schedule();
    ASSERT_TRUE(plan.failed.empty());
    blocked_steps += plan.kv_blocked;
    ASSERT_LE(f.scheduler.kv_pages_reserved(), num_pages);
    for (const StepItem& item : plan.items) {
      Live& l = live.at(item.id);
      if (item.admitted) l.sequence = pages.new_sequence();
      const int64_t length = pages.length(l.sequence) + item.count;
      ASSERT_NO_THROW(pages.reserve(l.sequence, length)) << "request " << item.id;
      pages.commit(l.sequence, length);
    }
    for (const StepItem& item : plan.items) {
      if (!item.samples) continue;
      Live& l = live.at(item.id);
      if (++l.generated < l.stop_after) continue;
      f.scheduler.finish(item.id);
      pages.free_sequence(l.sequence);
      live.erase(item.id);
      ++finished;
    }
  }
  EXPECT_EQ(pages.free_pages(), num_pages);
  EXPECT_EQ(f.scheduler.kv_pages_reserved(), 0);
  EXPECT_GT(blocked_steps, 0) << "the pool never limited admission: the test proves nothing";
}

TEST(Scheduler, OptionsAreChecked) {
  EXPECT_TRUE(contains(error_of([] {
                         check_scheduler_options({4, 8, 1, 0}, 1);
                       }),
                       "max_batch_tokens (4) must be >= max_running (8)"));
  EXPECT_TRUE(contains(error_of([] {
                         check_scheduler_options({8, 8, 3, 0}, 2);
                       }),
                       "max_loras_per_batch (3) exceeds adapter_slots (2)"));
  EXPECT_TRUE(contains(error_of([] {
                         check_scheduler_options({8, 0, 1, 0}, 2);
                       }),
                       "max_running must be >= 1"));
  EXPECT_TRUE(contains(error_of([] {
                         check_scheduler_options({8, 8, 1, -1}, 2);
                       }),
                       "prefill_chunk"));
  EXPECT_TRUE(contains(error_of([] {
                         check_scheduler_options(with_kv({8, 8, 1, 0}, 4, 0), 2);
                       }),
                       "kv_page_size >= 1"));
}

// ================================================================ Engine on the fixtures

fs::path fixture(const std::string& model) {
  return test::data_dir() / "parity" / model;
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, int64_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& t : out) t = dist(rng);
  return out;
}

model::Model load_quiet(const fs::path& dir) {
  model::ModelOptions options;
  options.show_progress = false;
  return model::Model::load(dir, options);
}

// AdapterSet in fixed-slot mode (what CpuExecutor uses for its slot pool).
TEST(AdapterSlots, SetClearResize) {
  model::Model m = load_quiet(fixture("qwen3_moe") / "base");
  const fs::path dir = fixture("qwen3_moe");
  model::AdapterSet& set = m.adapters();
  set.resize(3);
  EXPECT_EQ(set.size(), 3);
  EXPECT_TRUE(set.names().empty());
  const io::LoraAdapter a = io::load_adapter(dir / "lora_peft3d", m.config(), "a");
  const io::LoraAdapter b = io::load_adapter(dir / "lora_shared_outer", m.config(), "b");
  set.set(2, a);
  EXPECT_TRUE(set.occupied(2));
  EXPECT_FALSE(set.occupied(0));
  EXPECT_EQ(set.slot_of("a"), 2);
  EXPECT_EQ(set.names(), std::vector<std::string>{"a"});
  EXPECT_TRUE(contains(error_of([&] { set.set(0, a); }), "'a' is already loaded in slot 2"));
  EXPECT_TRUE(contains(error_of([&] { set.adapter(0); }), "adapter slot 0 is empty"));
  EXPECT_TRUE(contains(error_of([&] { set.set(3, b); }), "adapter slot 3 is not in [0, 3)"));
  EXPECT_TRUE(contains(error_of([&] { set.resize(2); }), "slot 2 holds adapter 'a'"));
  // Empty slots have no factors; the occupied one has them.
  const auto q = set.target(0, &io::LayerLora::q_proj);
  ASSERT_EQ(q.size(), 3u);
  EXPECT_EQ(q[0], nullptr);
  EXPECT_NE(q[2], nullptr);
  EXPECT_EQ(set.moe(0)[1].gate_up, nullptr);

  // A sequence on the slot sees the adapter; replacing the slot changes what a new sequence sees.
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  model::Sequence on_a = m.new_sequence(2), base = m.new_sequence(-1);
  const Tensor logits_a = m.forward(on_a, prompt);
  const Tensor logits_base = m.forward(base, prompt);
  EXPECT_GT(test::max_abs_diff(logits_a, logits_base), 1e-3);
  set.set(2, b);
  model::Sequence on_b = m.new_sequence(2);
  const Tensor logits_b = m.forward(on_b, prompt);
  EXPECT_GT(test::max_abs_diff(logits_b, logits_a), 1e-3);
  model::Model reference = load_quiet(fixture("qwen3_moe") / "base");
  const int32_t ref_slot = reference.load_adapter("b", dir / "lora_shared_outer");
  model::Sequence ref = reference.new_sequence(ref_slot);
  EXPECT_TRUE(test::all_close(logits_b, reference.forward(ref, prompt), 0.0f, 0.0f));
  set.clear(2);
  EXPECT_FALSE(set.occupied(2));
  EXPECT_FALSE(set.contains("b"));
  set.resize(1);
  EXPECT_EQ(set.size(), 1);
}

// Wraps the CPU executor and records what every forward looked like.
class RecordingExecutor final : public Executor {
 public:
  explicit RecordingExecutor(std::unique_ptr<Executor> inner) : inner_(std::move(inner)) {}
  struct Forward {
    int64_t tokens = 0;
    int64_t sequences = 0;
    std::set<int32_t> slots;  // adapter slots (>= 0) in the batch
    int64_t base_sequences = 0;
  };
  std::vector<Forward> forwards;

  const io::ModelConfig& config() const override { return inner_->config(); }
  const ExecutorLimits& limits() const override { return inner_->limits(); }
  void check_adapter(const io::LoraAdapter& a) const override { inner_->check_adapter(a); }
  void write_slot(int32_t slot, const io::LoraAdapter& a) override { inner_->write_slot(slot, a); }
  void clear_slot(int32_t slot) override { inner_->clear_slot(slot); }
  SequenceHandle new_sequence() override {
    const SequenceHandle s = inner_->new_sequence();
    if (pages_) page_of_[s] = pages_->new_sequence();
    return s;
  }
  void free_sequence(SequenceHandle s) override {
    inner_->free_sequence(s);
    if (pages_) {
      pages_->free_sequence(page_of_.at(s));
      page_of_.erase(s);
    }
  }
  int64_t sequence_length(SequenceHandle s) const override { return inner_->sequence_length(s); }
  int64_t live_sequences() const override { return inner_->live_sequences(); }
  uint64_t cache_bytes() const override { return inner_->cache_bytes(); }
  uint64_t state_bytes() const override { return inner_->state_bytes(); }
  int64_t state_slots() const override { return inner_->state_slots(); }
  // Knobs of the contract tests: a backend sequence-length limit, random adapters (drawn as the
  // stand-in adapter under a per-seed name), and a hook that may spoil sampled tokens.
  int64_t max_length = 0;
  bool random_adapters = false;
  io::LoraAdapter random_stand_in;
  std::vector<std::tuple<int32_t, int64_t, bool, uint64_t>> randomized;
  std::function<void(std::span<const BatchEntry>, std::vector<int32_t>&)> tamper;
  std::vector<std::vector<ops::SampleRowParams>> params_seen;
  std::vector<std::vector<float>> uniforms_seen;

  int64_t max_sequence_length() const override { return max_length; }

  // A fixed KV page pool like the GPU executor's: every forward takes the pages its tokens need
  // from a PageAllocator first and throws (as the GPU executor does) when too few are free.
  // Set before Engine::create, which reads kv_capacity().
  void use_page_pool(int64_t pages, int page_size) {
    pages_.emplace(pages, page_size, static_cast<int>(pages));
  }
  KvCapacity kv_capacity() const override { return pages_ ? pages_->capacity() : KvCapacity{}; }
  int64_t peak_pages_in_use = 0;
  bool supports_random_adapters() const override { return random_adapters; }
  void randomize_slot(int32_t slot, int64_t rank, bool shared_outer, uint64_t seed) override {
    if (!random_adapters) Executor::randomize_slot(slot, rank, shared_outer, seed);
    randomized.emplace_back(slot, rank, shared_outer, seed);
    io::LoraAdapter a = random_stand_in;
    a.name = "random-" + std::to_string(seed);
    inner_->clear_slot(slot);
    inner_->write_slot(slot, a);
  }
  std::vector<int32_t> forward_sample(std::span<const BatchEntry> batch,
                                      std::span<const ops::SampleRowParams> params,
                                      std::span<const float> uniforms) override {
    params_seen.emplace_back(params.begin(), params.end());
    uniforms_seen.emplace_back(uniforms.begin(), uniforms.end());
    std::vector<int32_t> tokens = Executor::forward_sample(batch, params, uniforms);
    if (tamper) tamper(batch, tokens);
    return tokens;
  }
  ExecutorCounters counters() const override { return inner_->counters(); }

  // A forward that keeps the thread busy this long, like a GPU step's wait for the device.
  std::chrono::microseconds busy_forward{0};

  std::vector<Tensor> forward(std::span<const BatchEntry> batch) override {
    const auto busy_until = std::chrono::steady_clock::now() + busy_forward;
    while (std::chrono::steady_clock::now() < busy_until) {
    }
    Forward f;
    for (const BatchEntry& b : batch) {
      f.tokens += static_cast<int64_t>(b.tokens.size());
      ++f.sequences;
      if (b.slot >= 0) {
        f.slots.insert(b.slot);
      } else {
        ++f.base_sequences;
      }
    }
    forwards.push_back(f);
    if (!pages_) return inner_->forward(batch);
    size_t reserved = 0;
    try {
      for (; reserved < batch.size(); ++reserved) {
        const SequenceHandle p = page_of_.at(batch[reserved].sequence);
        pages_->reserve(p, pages_->length(p) + static_cast<int64_t>(batch[reserved].tokens.size()));
      }
    } catch (...) {
      for (size_t i = 0; i < reserved; ++i) pages_->rollback(page_of_.at(batch[i].sequence));
      throw;
    }
    peak_pages_in_use = std::max(peak_pages_in_use, pages_->pages_in_use());
    std::vector<Tensor> logits = inner_->forward(batch);
    for (const BatchEntry& b : batch) {
      const SequenceHandle p = page_of_.at(b.sequence);
      pages_->commit(p, pages_->length(p) + static_cast<int64_t>(b.tokens.size()));
    }
    return logits;
  }

 private:
  std::unique_ptr<Executor> inner_;
  std::optional<PageAllocator> pages_;
  std::map<SequenceHandle, SequenceHandle> page_of_;  // inner handle -> page allocator handle
};

EngineOptions small_options() {
  EngineOptions o;
  o.max_batch_tokens = 24;
  o.max_running = 4;
  o.max_loras_per_batch = 2;
  o.adapter_slots = 2;
  o.max_lora_rank = 16;
  o.host_adapter_cache = 4;
  o.prefill_chunk = 7;
  return o;
}

struct TestEngine {
  std::unique_ptr<Engine> engine;
  RecordingExecutor* executor = nullptr;  // owned by the engine
};

// kv: a fixed KV page pool for the backend (RecordingExecutor::use_page_pool); none by default.
TestEngine make_engine(const fs::path& model_dir, const EngineOptions& options,
                       KvCapacity kv = {}) {
  const ExecutorLimits limits{options.max_batch_tokens, options.max_running, options.adapter_slots,
                              options.max_lora_rank};
  auto recording = std::make_unique<RecordingExecutor>(
      std::make_unique<CpuExecutor>(load_quiet(model_dir), limits));
  if (kv.limited()) recording->use_page_pool(kv.pages, static_cast<int>(kv.page_size));
  TestEngine t;
  t.executor = recording.get();
  Result<std::unique_ptr<Engine>> created = Engine::create(std::move(recording), options);
  EXPECT_TRUE(created.is_ok()) << created.status().message();
  t.engine = std::move(created.value());
  return t;
}

// Events of one request, as a client would collect them.
struct Collected {
  std::vector<int32_t> tokens;
  std::vector<int64_t> indices;
  int finals = 0;
  FinishReason reason = FinishReason::kNone;
  std::string error;
};

TokenCallback collect_into(Collected& c) {
  return [&c](const TokenEvent& e) {
    if (e.token >= 0) {
      c.tokens.push_back(e.token);
      c.indices.push_back(e.index);
    }
    if (e.finished) {
      ++c.finals;
      c.reason = e.finish_reason;
      c.error = e.error;
    }
  };
}

struct Case {
  std::vector<int32_t> prompt;
  std::string adapter;  // "" = base
  int64_t max_new = 0;
  int join_step = 0;  // submitted before this step
  double temperature = 0.0;
};

// Runs `cases` through the engine, each submitted before its join_step, and checks every output
// against model::generate of that request alone (same adapter, same sampler seed).
// kv: a KV page pool for the backend (none by default); with one, no request may fail for lack
// of pages and the pool must have limited admission at least once.
void expect_engine_matches_generate(const std::string& model,
                                    const std::map<std::string, std::string>& adapters,
                                    const std::vector<Case>& cases, const EngineOptions& options,
                                    KvCapacity kv = {}) {
  TestEngine t = make_engine(fixture(model) / "base", options, kv);
  for (const auto& [name, dir] : adapters) {
    const Status s = t.engine->register_adapter(name, fixture(model) / dir);
    ASSERT_TRUE(s.is_ok()) << s.message();
  }
  std::vector<Collected> got(cases.size());
  size_t submitted = 0;
  for (int step = 0; submitted < cases.size() || !t.engine->idle(); ++step) {
    for (size_t i = 0; i < cases.size(); ++i) {
      if (cases[i].join_step != step) continue;
      Request r;
      r.prompt = cases[i].prompt;
      r.adapter = cases[i].adapter;
      r.sampling.max_new_tokens = cases[i].max_new;
      r.sampling.ignore_eos = true;
      r.sampling.temperature = cases[i].temperature;
      r.sampling.top_p = cases[i].temperature > 0 ? 0.9 : 1.0;
      r.sampling.seed = 1000 + i;
      ASSERT_TRUE(t.engine->submit(r, collect_into(got[i])).is_ok());
      ++submitted;
    }
    ASSERT_TRUE(t.engine->step().is_ok());
    ASSERT_LT(step, 500) << "the engine does not finish";
  }

  model::Model reference = load_quiet(fixture(model) / "base");
  for (const auto& [name, dir] : adapters) reference.load_adapter(name, fixture(model) / dir);
  for (size_t i = 0; i < cases.size(); ++i) {
    model::GenerationRequest g;
    g.prompt = cases[i].prompt;
    g.slot = cases[i].adapter.empty() ? -1 : reference.adapters().slot_of(cases[i].adapter);
    g.max_new_tokens = cases[i].max_new;
    g.sampling = {cases[i].temperature, cases[i].temperature > 0 ? 0.9 : 1.0, 0, 1000 + i};
    const model::GenerationResult alone = model::generate(reference, std::span(&g, 1));
    EXPECT_EQ(got[i].tokens, alone.outputs[0].tokens)
        << "request " << i << " (adapter '" << cases[i].adapter << "')";
    EXPECT_EQ(got[i].finals, 1) << "request " << i;
    EXPECT_EQ(got[i].reason, FinishReason::kLength) << "request " << i << ": " << got[i].error;
    std::vector<int64_t> expected_indices(got[i].tokens.size());
    std::iota(expected_indices.begin(), expected_indices.end(), 0);
    EXPECT_EQ(got[i].indices, expected_indices);
  }

  // What the backend saw: within the limits, and really mixed.
  bool mixed = false;
  for (const auto& f : t.executor->forwards) {
    EXPECT_LE(f.tokens, options.max_batch_tokens);
    EXPECT_LE(f.sequences, options.max_running);
    EXPECT_LE(static_cast<int32_t>(f.slots.size()), options.max_loras_per_batch);
    mixed = mixed || (f.slots.size() >= 2 && f.base_sequences > 0);
  }
  if (adapters.size() >= 2 && options.max_loras_per_batch >= 2) {
    EXPECT_TRUE(mixed) << "no step mixed two adapters and the base model";
  }
  const EngineStats stats = t.engine->stats();
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.kv_cache_bytes, 0u);
  EXPECT_EQ(stats.steps, static_cast<int64_t>(t.executor->forwards.size()));
  EXPECT_EQ(stats.requests_finished, static_cast<int64_t>(cases.size()));
  EXPECT_EQ(stats.requests_failed, 0);
  if (kv.limited()) {
    EXPECT_EQ(t.engine->model_info().kv_cache_pages, kv.pages);
    EXPECT_EQ(t.engine->model_info().kv_page_size, kv.page_size);
    EXPECT_GT(stats.kv_blocked_steps, 0) << "the page pool never limited admission";
    EXPECT_LE(stats.peak_kv_pages_reserved, kv.pages);
    EXPECT_LE(t.executor->peak_pages_in_use, stats.peak_kv_pages_reserved);
    EXPECT_EQ(stats.kv_pages_reserved, 0);
  }
}

TEST(Engine, ContinuousBatchingEqualsEachRequestAloneQwen) {
  std::mt19937_64 rng(test::test_seed(71));
  const int64_t vocab = 512;
  // Requests join at different steps, with prompts longer than prefill_chunk (7) so that prefill
  // chunks and decodes of other requests share steps, and leave at different steps.
  std::vector<Case> cases = {
      {random_tokens(rng, 19, vocab), "peft3d", 9, 0},
      {random_tokens(rng, 5, vocab), "", 12, 0},
      {random_tokens(rng, 11, vocab), "shared", 4, 0},
      {random_tokens(rng, 3, vocab), "peft3d", 6, 2},
      {random_tokens(rng, 23, vocab), "", 5, 3},
      {random_tokens(rng, 1, vocab), "shared", 7, 5},
      {random_tokens(rng, 8, vocab), "per_expert", 6, 6},
      {random_tokens(rng, 13, vocab), "peft3d", 3, 9},
      {random_tokens(rng, 6, vocab), "", 8, 9, /*temperature=*/0.8},
  };
  expect_engine_matches_generate("qwen3_moe",
                                 {{"peft3d", "lora_peft3d"},
                                  {"shared", "lora_shared_outer"},
                                  {"per_expert", "lora_per_expert"}},
                                 cases, small_options());
}

// Qwen3.5: Gated DeltaNet layers carry a per-sequence recurrent state instead of KV rows. Prompts
// longer than prefill_chunk (7) are prefilled over several steps beside other requests' decodes,
// so each state must survive its chunks untouched by the others; the state is freed with the
// request (kv_cache_bytes back to 0).
TEST(Engine, ContinuousBatchingEqualsEachRequestAloneQwen35) {
  std::mt19937_64 rng(test::test_seed(73));
  std::vector<Case> cases = {
      {random_tokens(rng, 17, 512), "all", 6, 0},
      {random_tokens(rng, 4, 512), "", 9, 0},
      {random_tokens(rng, 12, 512), "linear", 5, 1},
      {random_tokens(rng, 1, 512), "all", 7, 3},
      {random_tokens(rng, 9, 512), "", 4, 4, /*temperature=*/0.8},
      {random_tokens(rng, 21, 512), "linear", 3, 6},
  };
  expect_engine_matches_generate("qwen3_5_moe", {{"all", "lora_all"}, {"linear", "lora_linear"}},
                                 cases, small_options());
}

// The engine reports the linear-attention state apart from the KV cache: a fixed size per running
// sequence (it does not grow with the tokens, as the KV rows of the full-attention layers do),
// and nothing once the requests end. A model without such layers reports none.
TEST(Engine, LinearAttentionStateIsCountedApartFromTheKvCache) {
  std::mt19937_64 rng(test::test_seed(79));
  TestEngine t = make_engine(fixture("qwen3_5_moe") / "base", small_options());
  EXPECT_EQ(t.engine->model_info().state_slots, 0);  // the CPU backend allocates per sequence
  auto submit = [&](int64_t prompt_len, int64_t max_new) {
    Request r;
    r.prompt = random_tokens(rng, prompt_len, 512);
    r.sampling.max_new_tokens = max_new;
    r.sampling.ignore_eos = true;
    ASSERT_TRUE(t.engine->submit(r, [](const TokenEvent&) {}).is_ok());
  };
  submit(5, 6);
  ASSERT_TRUE(t.engine->step().is_ok());
  const EngineStats one = t.engine->stats();
  EXPECT_EQ(one.state_sequences, 1);
  EXPECT_GT(one.state_cache_bytes, 0u);
  EXPECT_GT(one.kv_cache_bytes, 0u);  // the fixture's full-attention layers
  ASSERT_TRUE(t.engine->step().is_ok());
  const EngineStats later = t.engine->stats();
  EXPECT_EQ(later.state_cache_bytes, one.state_cache_bytes);
  EXPECT_GT(later.kv_cache_bytes, one.kv_cache_bytes);
  submit(3, 2);
  ASSERT_TRUE(t.engine->step().is_ok());
  const EngineStats two = t.engine->stats();
  EXPECT_EQ(two.state_sequences, 2);
  EXPECT_EQ(two.state_cache_bytes, 2 * one.state_cache_bytes);
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(t.engine->stats().state_cache_bytes, 0u);
  EXPECT_EQ(t.engine->stats().state_sequences, 0);

  TestEngine q3 = make_engine(fixture("qwen3_moe") / "base", small_options());
  Request r;
  r.prompt = random_tokens(rng, 5, 512);
  r.sampling.max_new_tokens = 3;
  ASSERT_TRUE(q3.engine->submit(r, [](const TokenEvent&) {}).is_ok());
  ASSERT_TRUE(q3.engine->step().is_ok());
  EXPECT_EQ(q3.engine->stats().state_cache_bytes, 0u);
  EXPECT_EQ(q3.engine->stats().state_sequences, 0);
  EXPECT_GT(q3.engine->stats().kv_cache_bytes, 0u);
}

TEST(Engine, ContinuousBatchingEqualsEachRequestAloneDeepseek) {
  std::mt19937_64 rng(test::test_seed(72));
  std::vector<Case> cases = {
      {random_tokens(rng, 9, 512), "dense", 6, 0},       {random_tokens(rng, 14, 512), "", 5, 0},
      {random_tokens(rng, 4, 512), "peft3d", 8, 1},      {random_tokens(rng, 2, 512), "", 4, 4},
      {random_tokens(rng, 10, 512), "dense", 3, 4, 0.7},
  };
  EngineOptions o = small_options();
  o.max_batch_tokens = 16;
  o.prefill_chunk = 0;  // only the step budget chunks
  expect_engine_matches_generate(
      "deepseek_v3", {{"dense", "lora_dense_shared"}, {"peft3d", "lora_peft3d"}}, cases, o);
}

// A backend whose KV pool holds 9 pages of 5 tokens (45 tokens) while the requests want 103
// tokens together: they wait at submission order and join as others finish; none fails, and each
// output is still the one of the request alone.
TEST(Engine, SmallKvPoolMakesRequestsWaitNeverFail) {
  std::mt19937_64 rng(test::test_seed(73));
  const int64_t vocab = 512;
  std::vector<Case> cases = {
      {random_tokens(rng, 19, vocab), "peft3d", 9, 0},  // 28 tokens: 6 pages
      {random_tokens(rng, 5, vocab), "", 12, 0},        // 17: 4
      {random_tokens(rng, 11, vocab), "shared", 4, 0},  // 15: 3
      {random_tokens(rng, 3, vocab), "peft3d", 6, 1},   // 9: 2
      {random_tokens(rng, 23, vocab), "", 5, 1},        // 28: 6
      {random_tokens(rng, 1, vocab), "shared", 7, 2},   // 8: 2
      {random_tokens(rng, 8, vocab), "", 6, 2, 0.8},    // 14: 3
  };
  expect_engine_matches_generate("qwen3_moe",
                                 {{"peft3d", "lora_peft3d"}, {"shared", "lora_shared_outer"}},
                                 cases, small_options(), KvCapacity{9, 5});
}

TEST(Engine, RequestLargerThanTheKvPoolIsRejectedAtSubmit) {
  TestEngine t =
      make_engine(fixture("qwen3_moe") / "base", small_options(), KvCapacity{4, 6});  // 24 tokens
  Request r;
  r.prompt = std::vector<int32_t>(20, 11);
  r.sampling.max_new_tokens = 5;
  r.sampling.ignore_eos = true;
  const Result<RequestId> refused = t.engine->submit(r, nullptr);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kOutOfRange);
  EXPECT_TRUE(contains(refused.status().message(),
                       "request: prompt (20 tokens) + max_new_tokens (5) = 25 tokens need 5 KV "
                       "cache pages of 6 tokens, but the whole KV cache has 4 pages (24 tokens)"))
      << refused.status().message();
  EXPECT_EQ(t.engine->stats().waiting, 0);
  // Exactly the pool fits, and runs to its end.
  r.sampling.max_new_tokens = 4;
  Collected c;
  ASSERT_TRUE(t.engine->submit(r, collect_into(c)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(c.reason, FinishReason::kLength) << c.error;
  EXPECT_EQ(c.tokens.size(), 4u);
  EXPECT_EQ(t.engine->stats().peak_kv_pages_reserved, 4);
}

TEST(Engine, OneSlotEvictsAndReloadsFromTheHostCache) {
  std::mt19937_64 rng(test::test_seed(73));
  std::vector<Case> cases;
  const std::vector<std::string> order = {"a", "b", "", "a", "b", "a"};
  for (size_t i = 0; i < order.size(); ++i) {
    cases.push_back(
        {random_tokens(rng, 4 + static_cast<int64_t>(i), 512), order[i], 3, static_cast<int>(i)});
  }
  EngineOptions o = small_options();
  o.adapter_slots = 1;
  o.max_loras_per_batch = 1;
  expect_engine_matches_generate("qwen3_moe", {{"a", "lora_peft3d"}, {"b", "lora_per_expert"}},
                                 cases, o);
}

TEST(Engine, PoolStatsAfterEvictions) {
  EngineOptions o = small_options();
  o.adapter_slots = 1;
  o.max_loras_per_batch = 1;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  ASSERT_TRUE(t.engine->register_adapter("b", fixture("qwen3_moe") / "lora_shared_outer").is_ok());
  for (const char* name : {"a", "b", "a", "b"}) {
    Request r;
    r.prompt = {1, 2, 3};
    r.adapter = name;
    r.sampling.max_new_tokens = 2;
    ASSERT_TRUE(t.engine->submit(r, {}).is_ok());
    ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  }
  const EngineStats s = t.engine->stats();
  EXPECT_EQ(s.pool_misses, 4);  // one slot: every request loads its adapter
  EXPECT_EQ(s.pool_hits, 0);
  EXPECT_EQ(s.pool_evictions, 3);
  EXPECT_EQ(s.host_misses, 2);  // the two registrations read the files; no slot load did
  EXPECT_EQ(s.host_hits, 4);
}

TEST(Engine, CancelMidPrefillAndMidDecodeFreesCacheAndSlot) {
  EngineOptions o = small_options();
  o.prefill_chunk = 4;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  std::mt19937_64 rng(test::test_seed(74));
  Collected prefilling, decoding, other;
  Request long_prompt{random_tokens(rng, 30, 512), "a", {}};
  long_prompt.sampling.max_new_tokens = 5;
  Request short_prompt{random_tokens(rng, 3, 512), "a", {}};
  short_prompt.sampling.max_new_tokens = 50;
  Request base{random_tokens(rng, 5, 512), "", {}};
  base.sampling.max_new_tokens = 12;
  for (Request* r : {&long_prompt, &short_prompt, &base}) r->sampling.ignore_eos = true;
  const RequestId p = t.engine->submit(long_prompt, collect_into(prefilling)).value();
  const RequestId d = t.engine->submit(short_prompt, collect_into(decoding)).value();
  const RequestId b = t.engine->submit(base, collect_into(other)).value();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(t.engine->step().is_ok());
  ASSERT_EQ(decoding.tokens.size(), 3u);  // d is decoding, p is still in prefill (30 > 3 * 4)
  ASSERT_TRUE(prefilling.tokens.empty());
  EXPECT_EQ(t.executor->live_sequences(), 3);
  const auto adapter_users = [&] {
    for (const AdapterInfo& a : t.engine->adapters())
      if (a.name == "a") return a.running_requests;
    return -1;
  };
  EXPECT_EQ(adapter_users(), 2);
  const uint64_t bytes_before = t.engine->stats().kv_cache_bytes;

  ASSERT_TRUE(t.engine->cancel(p).is_ok());
  EXPECT_EQ(t.executor->live_sequences(), 2);
  EXPECT_EQ(adapter_users(), 1);
  EXPECT_LT(t.engine->stats().kv_cache_bytes, bytes_before);
  ASSERT_TRUE(t.engine->cancel(d).is_ok());
  EXPECT_EQ(t.executor->live_sequences(), 1);
  EXPECT_EQ(adapter_users(), 0);
  const Status again = t.engine->cancel(d);
  EXPECT_EQ(again.code(), ErrorCode::kNotFound);
  EXPECT_TRUE(contains(again.message(), "is not waiting or running")) << again.message();

  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(prefilling.finals, 1);
  EXPECT_EQ(prefilling.reason, FinishReason::kCancelled);
  EXPECT_EQ(decoding.reason, FinishReason::kCancelled);
  EXPECT_EQ(decoding.tokens.size(), 3u);  // nothing after the cancel
  EXPECT_EQ(other.reason, FinishReason::kLength);
  EXPECT_EQ(other.tokens.size(), 12u);
  EXPECT_EQ(t.executor->live_sequences(), 0);
  EXPECT_EQ(t.engine->stats().requests_cancelled, 2);
  (void)b;

  // The base request ran undisturbed: same tokens as alone.
  model::Model reference = load_quiet(fixture("qwen3_moe") / "base");
  model::GenerationRequest g;
  g.prompt = base.prompt;
  g.max_new_tokens = 12;
  EXPECT_EQ(other.tokens, model::generate(reference, std::span(&g, 1)).outputs[0].tokens);
}

TEST(Engine, CancelWhileWaitingAndFromACallback) {
  EngineOptions o = small_options();
  o.max_running = 1;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  Collected first, queued;
  Request r{{4, 5, 6}, "", {}};
  r.sampling.max_new_tokens = 20;
  r.sampling.ignore_eos = true;
  RequestId first_id = 0;
  first_id = t.engine
                 ->submit(r,
                          [&](const TokenEvent& e) {
                            collect_into(first)(e);
                            if (e.index == 2) {
                              EXPECT_TRUE(t.engine->cancel(first_id).is_ok());
                            }
                          })
                 .value();
  const RequestId q = t.engine->submit(r, collect_into(queued)).value();
  ASSERT_TRUE(t.engine->cancel(q).is_ok());  // still waiting
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(first.tokens.size(), 3u);
  EXPECT_EQ(first.reason, FinishReason::kCancelled);
  EXPECT_EQ(first.finals, 1);
  EXPECT_TRUE(queued.tokens.empty());
  EXPECT_EQ(queued.reason, FinishReason::kCancelled);
  EXPECT_TRUE(t.engine->idle());
}

TEST(Engine, ThrowingCallbackCancelsOnlyItsRequest) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  Request r{{7, 8, 9}, "", {}};
  r.sampling.max_new_tokens = 6;
  r.sampling.ignore_eos = true;
  int thrower_calls = 0;
  Collected good;
  ASSERT_TRUE(t.engine
                  ->submit(r,
                           [&](const TokenEvent&) {
                             ++thrower_calls;
                             throw std::runtime_error("client went away");
                           })
                  .is_ok());
  ASSERT_TRUE(t.engine->submit(r, collect_into(good)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(thrower_calls, 1);
  EXPECT_EQ(good.tokens.size(), 6u);
  EXPECT_EQ(t.engine->stats().requests_cancelled, 1);
  EXPECT_EQ(t.executor->live_sequences(), 0);
}

TEST(Engine, StopTokensEndARequest) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  Request r{{11, 12, 13, 14}, "", {}};
  r.sampling.max_new_tokens = 10;
  r.sampling.ignore_eos = true;
  Collected free_run;
  ASSERT_TRUE(t.engine->submit(r, collect_into(free_run)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  ASSERT_EQ(free_run.tokens.size(), 10u);
  r.sampling.stop_token_ids = {free_run.tokens[4]};
  Collected stopped;
  ASSERT_TRUE(t.engine->submit(r, collect_into(stopped)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  const auto first = std::find(free_run.tokens.begin(), free_run.tokens.end(), free_run.tokens[4]);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(free_run.tokens.begin(), first + 1));
  EXPECT_EQ(stopped.reason, FinishReason::kStop);
}

TEST(Engine, EndOfSequenceStopsUnlessIgnored) {
  // Find prompts whose greedy continuation contains the model's EOS id: every one-token prompt,
  // 6 tokens each (deterministic: the same candidates on every run).
  EngineOptions o = small_options();
  o.max_running = 64;
  o.max_batch_tokens = 64;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  const int32_t eos = t.engine->model_info().eos_token_ids.at(0);
  std::vector<Request> candidates(512);
  std::vector<Collected> free_runs(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) {
    candidates[i].prompt = {static_cast<int32_t>(i)};
    candidates[i].sampling.max_new_tokens = 6;
    candidates[i].sampling.ignore_eos = true;
    ASSERT_TRUE(t.engine->submit(candidates[i], collect_into(free_runs[i])).is_ok());
  }
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  int checked = 0;
  for (size_t i = 0; i < candidates.size() && checked < 3; ++i) {
    const std::vector<int32_t>& free_run = free_runs[i].tokens;
    const auto first = std::find(free_run.begin(), free_run.end(), eos);
    if (first == free_run.end()) continue;
    Request r = candidates[i];
    r.sampling.ignore_eos = false;
    Collected stopped;
    ASSERT_TRUE(t.engine->submit(r, collect_into(stopped)).is_ok());
    ASSERT_TRUE(t.engine->run_until_idle().is_ok());
    EXPECT_EQ(stopped.tokens, std::vector<int32_t>(free_run.begin(), first + 1))
        << "candidate " << i;
    EXPECT_EQ(stopped.reason, FinishReason::kStop);
    ++checked;
  }
  EXPECT_EQ(checked, 3) << "too few candidate prompts generate the EOS token";
}

TEST(Engine, UnregisterRefusedWhileInUseAllowedAfter) {
  EngineOptions o = small_options();
  o.max_running = 1;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  Request r{{1, 2, 3}, "a", {}};
  r.sampling.max_new_tokens = 3;
  ASSERT_TRUE(t.engine->submit(r, {}).is_ok());
  ASSERT_TRUE(t.engine->submit(r, {}).is_ok());
  Status s = t.engine->unregister_adapter("a");  // both waiting
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "'a' is in use by 2 requests (0 running, 2 waiting)"))
      << s.message();
  ASSERT_TRUE(t.engine->step().is_ok());
  s = t.engine->unregister_adapter("a");
  EXPECT_TRUE(contains(s.message(), "(1 running, 1 waiting)")) << s.message();
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_TRUE(t.engine->unregister_adapter("a").is_ok());
  EXPECT_TRUE(t.engine->adapters().empty());
  EXPECT_EQ(t.engine->unregister_adapter("a").code(), ErrorCode::kNotFound);
  const Result<RequestId> late = t.engine->submit(r, {});
  EXPECT_FALSE(late.is_ok());
  EXPECT_TRUE(contains(late.status().message(), "unknown adapter 'a'; no adapters are registered"))
      << late.status().message();
  // Registering again under the same name works.
  EXPECT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_shared_outer").is_ok());
}

TEST(Engine, PinnedAdapterAndAdapterErrors) {
  EngineOptions o = small_options();
  o.max_lora_rank = 6;  // lora_peft3d: r 4, and 6 on one o_proj
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(
      t.engine->register_adapter("p", fixture("qwen3_moe") / "lora_peft3d", /*pin=*/true).is_ok());
  const std::vector<AdapterInfo> list = t.engine->adapters();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_TRUE(list[0].pinned);
  EXPECT_GE(list[0].slot, 0);

  // per-expert gate and up LoRA of rank 4 are one rank-8 gate_up LoRA: above max_lora_rank 6.
  Status s = t.engine->register_adapter("big", fixture("qwen3_moe") / "lora_per_expert");
  EXPECT_EQ(s.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(s.message(), "rank")) << s.message();
  s = t.engine->register_adapter("p", fixture("qwen3_moe") / "lora_shared_outer");
  EXPECT_TRUE(contains(s.message(), "'p' is already registered")) << s.message();
  s = t.engine->register_adapter("missing", fixture("qwen3_moe") / "no_such_adapter");
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_TRUE(contains(s.message(), "no_such_adapter")) << s.message();
  // An adapter made for the other architecture.
  s = t.engine->register_adapter("other", fixture("deepseek_v3") / "lora_peft3d");
  EXPECT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "other")) << s.message();
  EXPECT_EQ(t.engine->adapters().size(), 1u);
}

TEST(Engine, BadRequestsAreRejectedWithClearMessages) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  const auto rejected = [&](Request r) {
    const Result<RequestId> id = t.engine->submit(std::move(r), {});
    EXPECT_FALSE(id.is_ok());
    return id.status().message();
  };
  Request good{{1, 2, 3}, "", {}};
  good.sampling.ignore_eos = true;
  Request r = good;
  r.prompt.clear();
  EXPECT_EQ(rejected(r), "request: the prompt is empty");
  r = good;
  r.prompt = {1, 2, 512, 3};
  EXPECT_EQ(rejected(r),
            "request: token id 512 at prompt position 2 is outside the vocabulary [0, 512)");
  r.prompt = {-4};
  EXPECT_TRUE(contains(rejected(r), "token id -4 at prompt position 0"));
  r = good;
  r.adapter = "zzz";
  EXPECT_EQ(rejected(r), "request: unknown adapter 'zzz'; registered: a");
  r = good;
  r.sampling.max_new_tokens = 0;
  EXPECT_EQ(rejected(r), "request: max_new_tokens must be >= 1, got 0");
  r = good;
  r.sampling.max_new_tokens = 510;
  EXPECT_TRUE(contains(rejected(r), "= 513 exceeds the model's context of 512 tokens"));
  r = good;
  r.sampling.temperature = -1;
  EXPECT_TRUE(contains(rejected(r), "request: temperature must be"));
  r = good;
  r.sampling.top_p = 0;
  EXPECT_TRUE(contains(rejected(r), "top_p"));
  r = good;
  r.sampling.stop_token_ids = {600};
  EXPECT_TRUE(contains(rejected(r), "stop token id 600"));
  // Nothing was queued, and the engine still works.
  EXPECT_TRUE(t.engine->idle());
  Collected c;
  ASSERT_TRUE(t.engine->submit(good, collect_into(c)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(c.tokens.size(), 16u);  // the default max_new_tokens
}

TEST(Engine, BadOptionsAreRejected) {
  EngineOptions o;
  o.model_dir = fixture("qwen3_moe") / "base";
  const auto error = [](const EngineOptions& options) {
    const Result<std::unique_ptr<Engine>> e = Engine::create(options);
    EXPECT_FALSE(e.is_ok());
    return e.status().message();
  };
  EngineOptions bad = o;
  bad.device = "cuda";
  EXPECT_TRUE(contains(error(bad), "device 'cuda'"));
  EXPECT_EQ(check_device("cuda").code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(check_device("cpu").is_ok());
  bad.device = "tpu";
  EXPECT_TRUE(contains(error(bad), "device 'tpu' is unknown"));
  bad = o;
  bad.max_batch_tokens = 8;
  bad.max_running = 16;
  EXPECT_TRUE(contains(error(bad), "max_batch_tokens (8) must be >= max_running (16)"));
  bad = o;
  bad.max_loras_per_batch = 9;
  EXPECT_TRUE(contains(error(bad), "max_loras_per_batch (9) exceeds adapter_slots (8)"));
  bad = o;
  bad.model_dir = fixture("qwen3_moe") / "does_not_exist";
  EXPECT_TRUE(contains(error(bad), "does_not_exist"));
  bad = o;
  bad.attention = "flash";
  EXPECT_TRUE(contains(error(bad), "attention must be auto, flashinfer or moelora, got 'flash'"));
  // The defaults work and describe the model.
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  ASSERT_TRUE(e.is_ok()) << e.status().message();
  EXPECT_EQ(e.value()->model_info().vocab_size, 512);
  EXPECT_EQ(e.value()->model_info().model_type, "qwen3_moe");
  EXPECT_EQ(e.value()->model_info().eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(e.value()->model_info().attention_kernel, "reference");
}

TEST(Engine, LoraOffRejectsAdapterRequests) {
  EngineOptions o = small_options();
  o.max_loras_per_batch = 0;
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  ASSERT_TRUE(t.engine->register_adapter("a", fixture("qwen3_moe") / "lora_peft3d").is_ok());
  const Result<RequestId> id = t.engine->submit({{1, 2}, "a", {}}, {});
  EXPECT_FALSE(id.is_ok());
  EXPECT_TRUE(contains(id.status().message(), "LoRA is off")) << id.status().message();
}

TEST(Engine, SubmitFromAnotherThreadWhileStepping) {
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  constexpr int kRequests = 6;
  std::vector<Collected> got(kRequests);
  std::atomic<int> submitted{0};
  std::thread client([&] {
    for (int i = 0; i < kRequests; ++i) {
      Request r{{static_cast<int32_t>(10 + i), 20, 30}, "", {}};
      r.sampling.max_new_tokens = 4;
      r.sampling.ignore_eos = true;
      EXPECT_TRUE(t.engine->submit(r, collect_into(got[i])).is_ok());
      ++submitted;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  while (submitted < kRequests || !t.engine->idle()) {
    ASSERT_TRUE(t.engine->step().is_ok());
    std::this_thread::yield();
  }
  client.join();
  model::Model reference = load_quiet(fixture("qwen3_moe") / "base");
  for (int i = 0; i < kRequests; ++i) {
    model::GenerationRequest g;
    g.prompt = {static_cast<int32_t>(10 + i), 20, 30};
    g.max_new_tokens = 4;
    EXPECT_EQ(got[i].tokens, model::generate(reference, std::span(&g, 1)).outputs[0].tokens) << i;
  }
}

// ================================================================ Executor contract

// One sampled request and one greedy request: the engine hands the executor one uniform per
// sampling request per step, drawn from that request's own generator (and none for greedy ones).
TEST(EngineContract, UniformsComeFromEachRequestsOwnSampler) {
  std::mt19937_64 rng(test::test_seed(81));
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  Collected sampled, greedy;
  Request a;
  a.prompt = random_tokens(rng, 9, 512);
  a.sampling = {0.8, 0.9, 5, 4242, 6, true, {}};
  Request b;
  b.prompt = random_tokens(rng, 3, 512);
  b.sampling.max_new_tokens = 4;
  b.sampling.ignore_eos = true;
  ASSERT_TRUE(t.engine->submit(a, collect_into(sampled)).is_ok());
  ASSERT_TRUE(t.engine->submit(b, collect_into(greedy)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  ASSERT_EQ(sampled.tokens.size(), 6u);
  ASSERT_EQ(greedy.tokens.size(), 4u);

  // The non-zero uniforms, in step order, are the sampler's draws for seed 4242.
  model::Sampler reference({0.8, 0.9, 5, 4242});
  std::vector<float> expected, got;
  for (int i = 0; i < 6; ++i) expected.push_back(static_cast<float>(reference.next_uniform()));
  for (size_t step = 0; step < t.executor->params_seen.size(); ++step) {
    const auto& params = t.executor->params_seen[step];
    const auto& uniforms = t.executor->uniforms_seen[step];
    ASSERT_EQ(params.size(), uniforms.size());
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].temperature > 0) {
        EXPECT_FLOAT_EQ(params[i].temperature, 0.8f);
        EXPECT_FLOAT_EQ(params[i].top_p, 0.9f);
        EXPECT_EQ(params[i].top_k, 5);
        got.push_back(uniforms[i]);
      } else {
        EXPECT_EQ(uniforms[i], 0.0f) << "a greedy row got a uniform at step " << step;
      }
    }
  }
  EXPECT_EQ(got, expected);
  // The CPU backend runs every forward eagerly and captures nothing.
  const EngineStats stats = t.engine->stats();
  EXPECT_EQ(stats.eager_forwards, stats.steps);
  EXPECT_EQ(stats.graph_captures, 0);
  EXPECT_EQ(stats.graph_replays, 0);
}

// A row the backend cannot sample (-1) ends that request with an error; the others go on.
TEST(EngineContract, FailedSamplingEndsOnlyItsRequest) {
  std::mt19937_64 rng(test::test_seed(82));
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  SequenceHandle victim = -1;
  t.executor->tamper = [&](std::span<const BatchEntry> batch, std::vector<int32_t>& tokens) {
    for (size_t i = 0; i < batch.size(); ++i) {
      if (victim < 0) victim = batch[i].sequence;  // the first request's sequence
      if (batch[i].sequence == victim) tokens[i] = -1;
    }
  };
  Collected first, second;
  Request r;
  r.prompt = random_tokens(rng, 4, 512);
  r.sampling.max_new_tokens = 3;
  r.sampling.ignore_eos = true;
  ASSERT_TRUE(t.engine->submit(r, collect_into(first)).is_ok());
  ASSERT_TRUE(t.engine->submit(r, collect_into(second)).is_ok());
  ASSERT_TRUE(t.engine->run_until_idle().is_ok());
  EXPECT_EQ(first.reason, FinishReason::kError);
  EXPECT_TRUE(contains(first.error, "sampling failed")) << first.error;
  EXPECT_TRUE(first.tokens.empty());
  EXPECT_EQ(second.reason, FinishReason::kLength);
  EXPECT_EQ(second.tokens.size(), 3u);
  EXPECT_EQ(t.engine->stats().requests_failed, 1);
}

TEST(EngineContract, BackendSequenceLengthLimitsRequests) {
  // The engine reads the backend's limit at creation.
  const EngineOptions o = small_options();
  auto recording = std::make_unique<RecordingExecutor>(std::make_unique<CpuExecutor>(
      load_quiet(fixture("qwen3_moe") / "base"),
      ExecutorLimits{o.max_batch_tokens, o.max_running, o.adapter_slots, o.max_lora_rank}));
  recording->max_length = 20;
  Result<std::unique_ptr<Engine>> created = Engine::create(std::move(recording), o);
  ASSERT_TRUE(created.is_ok());
  Engine& engine = *created.value();
  EXPECT_EQ(engine.model_info().max_sequence_length, 20);
  Request r;
  r.prompt = std::vector<int32_t>(15, 7);
  r.sampling.max_new_tokens = 6;
  const Result<RequestId> refused = engine.submit(r, nullptr);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kOutOfRange);
  EXPECT_TRUE(contains(refused.status().message(),
                       "= 21 exceeds the engine's maximum sequence "
                       "length of 20"))
      << refused.status().message();
  r.sampling.max_new_tokens = 5;
  EXPECT_TRUE(engine.submit(r, nullptr).is_ok());
  EXPECT_TRUE(engine.run_until_idle().is_ok());
}

TEST(EngineContract, RandomAdaptersAreDrawnIntoSlotsAndAgainAfterEviction) {
  std::mt19937_64 rng(test::test_seed(83));
  EngineOptions o = small_options();
  o.adapter_slots = 1;
  o.max_loras_per_batch = 1;
  o.host_adapter_cache = 0;  // the placeholder must come back without files
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", o);
  // A backend without random adapters refuses them at registration.
  Status refused = t.engine->register_random_adapter("r0", 4, false, 11);
  EXPECT_EQ(refused.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(refused.message(), "need device 'cuda'")) << refused.message();

  t.executor->random_adapters = true;
  t.executor->random_stand_in =
      io::load_adapter(fixture("qwen3_moe") / "lora_peft3d", t.executor->config(), "stand-in");
  ASSERT_TRUE(t.engine->register_random_adapter("r0", 4, false, 11).is_ok());
  ASSERT_TRUE(t.engine->register_random_adapter("r1", 4, true, 12).is_ok());
  EXPECT_EQ(t.engine->register_random_adapter("r0", 4, false, 13).code(),
            ErrorCode::kInvalidArgument);  // the name is taken
  EXPECT_EQ(t.engine->register_random_adapter("big", 17, false, 1).code(),
            ErrorCode::kOutOfRange);            // above max_lora_rank 16
  EXPECT_TRUE(t.executor->randomized.empty());  // nothing drawn before a request needs it

  // r0, r1, r0 one after the other through the single slot: three draws, same seeds again.
  std::vector<Collected> got(3);
  const std::vector<std::string> order = {"r0", "r1", "r0"};
  for (size_t i = 0; i < order.size(); ++i) {
    Request r;
    r.prompt = random_tokens(rng, 5, 512);
    r.adapter = order[i];
    r.sampling.max_new_tokens = 3;
    r.sampling.ignore_eos = true;
    ASSERT_TRUE(t.engine->submit(r, collect_into(got[i])).is_ok());
    ASSERT_TRUE(t.engine->run_until_idle().is_ok());
    EXPECT_EQ(got[i].reason, FinishReason::kLength) << got[i].error;
  }
  using Draw = std::tuple<int32_t, int64_t, bool, uint64_t>;
  EXPECT_EQ(t.executor->randomized,
            (std::vector<Draw>{{0, 4, false, 11}, {0, 4, true, 12}, {0, 4, false, 11}}));
  const std::vector<AdapterInfo> listed = t.engine->adapters();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_TRUE(contains(listed[0].dir.string(), "random:rank=4")) << listed[0].dir;
  ASSERT_TRUE(t.engine->unregister_adapter("r0").is_ok());
  ASSERT_TRUE(t.engine->register_random_adapter("r0", 8, false, 99).is_ok());
}

// A server's engine thread steps back to back while a request runs; a request submitted from
// another thread meanwhile must start at the next step, not when the running one finishes (the
// engine's lock is first come, first served).
TEST(EngineContract, SubmitWhileStepsRunBackToBackStartsAtTheNextStep) {
  std::mt19937_64 rng(test::test_seed(89));
  TestEngine t = make_engine(fixture("qwen3_moe") / "base", small_options());
  t.executor->busy_forward = std::chrono::microseconds(1500);
  constexpr int64_t kLongTokens = 150;
  std::atomic<int64_t> long_tokens{0};
  std::atomic<bool> long_done{false};
  Request long_request;
  long_request.prompt = random_tokens(rng, 5, 512);
  long_request.sampling.max_new_tokens = kLongTokens;
  long_request.sampling.ignore_eos = true;
  ASSERT_TRUE(t.engine
                  ->submit(long_request,
                           [&](const TokenEvent& e) {
                             if (e.token >= 0) long_tokens.fetch_add(1);
                             if (e.finished) long_done.store(true);
                           })
                  .is_ok());
  std::atomic<bool> stop{false};
  Status loop_status = Status::ok();
  std::thread stepper([&] {
    while (!stop.load()) {
      if (t.engine->idle()) {
        std::this_thread::yield();
        continue;
      }
      loop_status = t.engine->step();
      if (!loop_status) return;
    }
  });
  while (long_tokens.load() < 3 && !long_done.load()) std::this_thread::yield();

  for (int i = 0; i < 5; ++i) {
    const int64_t before = long_tokens.load();
    std::atomic<int64_t> at_first_token{-1};
    std::atomic<bool> done{false};
    Request r;
    r.prompt = random_tokens(rng, 5, 512);
    r.sampling.max_new_tokens = 1;
    ASSERT_TRUE(t.engine
                    ->submit(r,
                             [&](const TokenEvent& e) {
                               if (e.token >= 0) at_first_token.store(long_tokens.load());
                               if (e.finished) done.store(true);
                             })
                    .is_ok());
    while (!done.load() && loop_status.is_ok()) std::this_thread::yield();
    ASSERT_TRUE(loop_status.is_ok()) << loop_status.message();
    // The step in progress when submit() asked for the lock, then the step that prefills the
    // new prompt and samples its first token (the long request decodes in both).
    EXPECT_LE(at_first_token.load() - before, 2) << "request " << i << " waited "
                                                  << at_first_token.load() - before << " steps";
  }
  EXPECT_FALSE(long_done.load()) << "the long request ended before the check was over";
  stop.store(true);
  stepper.join();
  ASSERT_TRUE(loop_status.is_ok()) << loop_status.message();
}

TEST(EngineContract, DevicesAndRandomWeightsOnTheCpu) {
  EXPECT_TRUE(check_device("cpu").is_ok());
  EXPECT_EQ(check_device("tpu").code(), ErrorCode::kInvalidArgument);
  if (!cuda_device_available()) {
    const Status cuda = check_device("cuda");
    EXPECT_EQ(cuda.code(), ErrorCode::kUnsupported);
    EXPECT_TRUE(contains(cuda.message(), "use device 'cpu'")) << cuda.message();
    EXPECT_EQ(default_device(), "cpu");
  }
  EngineOptions o = small_options();
  o.model_dir = fixture("qwen3_moe") / "base";
  o.random_weights = true;
  const auto created = Engine::create(o);
  ASSERT_FALSE(created.is_ok());
  EXPECT_TRUE(contains(created.status().message(), "random_weights needs device 'cuda'"))
      << created.status().message();
  o.random_weights = false;
  o.gpu_memory_fraction = 1.5;
  EXPECT_TRUE(contains(Engine::create(o).status().message(), "gpu_memory_fraction"));
  o.gpu_memory_fraction = 0.9;
  o.max_layers = 2;  // the CPU backend honours max_layers too
  auto two = Engine::create(o);
  ASSERT_TRUE(two.is_ok()) << two.status().message();
  EXPECT_EQ(two.value()->model_info().num_layers, 2);
}

// ================================================================ GPU executor, host side

TEST(GpuExecutorHost, DecodeBuckets) {
  EXPECT_EQ(decode_buckets(128), (std::vector<int>{1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128}));
  EXPECT_EQ(decode_buckets(5), (std::vector<int>{1, 2, 4, 5}));
  EXPECT_EQ(decode_buckets(1), (std::vector<int>{1}));
  EXPECT_EQ(decode_buckets(100), (std::vector<int>{1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100}));
  EXPECT_EQ(decode_buckets(200).back(), 200);
  EXPECT_EQ(decode_buckets(200)[decode_buckets(200).size() - 2], 192);
  const std::vector<int> b = decode_buckets(100);
  EXPECT_EQ(decode_bucket(1, b), 1);
  EXPECT_EQ(decode_bucket(3, b), 4);
  EXPECT_EQ(decode_bucket(17, b), 24);
  EXPECT_EQ(decode_bucket(97, b), 100);
  EXPECT_EQ(decode_bucket(101, b), -1);
  EXPECT_EQ(decode_bucket(1, std::vector<int>{}), -1);
}

TEST(GpuExecutorHost, PageAllocator) {
  PageAllocator pages(5, 4, 3);  // 5 pages of 4 tokens; a sequence holds at most 12 tokens
  EXPECT_EQ(pages.max_length(), 12);
  const SequenceHandle a = pages.new_sequence(), b = pages.new_sequence();
  pages.reserve(a, 5);  // 2 pages
  EXPECT_EQ(pages.pages(a), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(pages.length(a), 0);  // not committed yet
  pages.commit(a, 5);
  EXPECT_EQ(pages.length(a), 5);
  pages.reserve(b, 4);
  pages.commit(b, 4);
  EXPECT_EQ(pages.pages(b), (std::vector<int32_t>{2}));
  pages.reserve(a, 8);  // still 2 pages
  EXPECT_EQ(pages.pages(a).size(), 2u);
  pages.reserve(a, 9);  // a third
  EXPECT_EQ(pages.pages(a), (std::vector<int32_t>{0, 1, 3}));
  pages.rollback(a);  // the forward failed: back to 5 tokens, 2 pages
  EXPECT_EQ(pages.pages(a), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(pages.free_pages(), 2);
  // Beyond the page table, and beyond the pool: kOutOfRange, nothing changes.
  EXPECT_TRUE(contains(error_of([&] { pages.reserve(a, 13); }), "the KV page table holds 12"));
  pages.reserve(b, 12);  // 2 more pages: the pool is empty now
  EXPECT_EQ(pages.free_pages(), 0);
  EXPECT_TRUE(contains(error_of([&] { pages.reserve(a, 9); }), "the KV cache is full"));
  EXPECT_EQ(pages.pages(a).size(), 2u);
  pages.free_sequence(b);
  EXPECT_EQ(pages.free_pages(), 3);
  EXPECT_FALSE(pages.live(b));
  EXPECT_TRUE(contains(error_of([&] { pages.free_sequence(b); }), "not live"));
  const SequenceHandle c = pages.new_sequence();
  pages.reserve(c, 1);
  EXPECT_EQ(pages.pages(c), (std::vector<int32_t>{2}));  // b's first page comes back first
  EXPECT_EQ(pages.live_sequences(), 2);
  EXPECT_TRUE(contains(error_of([] { PageAllocator(0, 4, 1); }), "num_pages 0"));
}

struct PlanFixture {
  StepCapacity cap{16, 6, 3, 4, 100};  // 16 rows, 6 sequences, 3 slots, 4 pages of 8, vocab 100
  PageAllocator pages{20, 8, 4};
  std::vector<bool> occupied{true, true, false};
  std::vector<int> buckets = decode_buckets(6);
  GpuStepPlan plan;
};

// A mixed batch: prefill chunks and decodes, two adapters and base rows, known lengths.
TEST(GpuExecutorHost, PlanGroupsRowsBySlotWithSegmentsPositionsAndPages) {
  PlanFixture f;
  const SequenceHandle s0 = f.pages.new_sequence(), s1 = f.pages.new_sequence(),
                       s2 = f.pages.new_sequence(), s3 = f.pages.new_sequence();
  f.pages.reserve(s1, 9);  // s1 has 9 tokens cached (2 pages), s3 has 3
  f.pages.commit(s1, 9);
  f.pages.reserve(s3, 3);
  f.pages.commit(s3, 3);
  const std::vector<int32_t> t0 = {5, 6, 7}, t1 = {8}, t2 = {9, 10}, t3 = {11};
  // batch order: base, slot 1, slot 0, slot 1
  const std::vector<BatchEntry> batch = {{s0, t0, -1}, {s1, t1, 1}, {s2, t2, 0}, {s3, t3, 1}};
  std::vector<ops::SampleRowParams> params(4);
  params[1].temperature = 0.5f;
  const std::vector<float> uniforms = {0.0f, 0.25f, 0.0f, 0.0f};
  plan_gpu_step(batch, params, uniforms, f.cap, f.buckets, f.occupied, f.pages, f.plan);
  const GpuStepPlan& p = f.plan;
  // Slot 0 first, then slot 1 (batch order kept), base last.
  EXPECT_EQ(p.order, (std::vector<int>{2, 1, 3, 0}));
  EXPECT_EQ(p.num_tokens, 7);
  EXPECT_EQ(p.num_seqs, 4);
  EXPECT_FALSE(p.graph);  // prefill chunks: eager at the exact size
  EXPECT_EQ(p.rows, 7);
  EXPECT_EQ(p.seqs, 4);
  EXPECT_EQ(p.max_q_len, 3);
  EXPECT_EQ(p.max_kv_len, 10);  // s1: 9 + 1
  EXPECT_TRUE(p.lora);
  EXPECT_EQ(p.single_slot, -1);  // two slots
  const std::vector<int32_t> ids = {9, 10, 8, 11, 5, 6, 7};
  const std::vector<int32_t> slot = {0, 0, 1, 1, -1, -1, -1};
  const std::vector<int32_t> seq = {0, 0, 1, 2, 3, 3, 3};
  const std::vector<int32_t> pos = {0, 1, 9, 3, 0, 1, 2};
  for (int r = 0; r < 16; ++r) {
    const bool valid = r < 7;
    EXPECT_EQ(p.token_ids[r], valid ? ids[r] : 0) << r;
    EXPECT_EQ(p.token_slot[r], valid ? slot[r] : -1) << r;
    EXPECT_EQ(p.token_seq[r], valid ? seq[r] : -1) << r;
    EXPECT_EQ(p.token_pos[r], valid ? pos[r] : 0) << r;
  }
  EXPECT_EQ(p.q_start, (std::vector<int32_t>{0, 2, 3, 4, 0, 0}));
  EXPECT_EQ(p.q_len, (std::vector<int32_t>{2, 1, 1, 3, 0, 0}));
  EXPECT_EQ(p.kv_len, (std::vector<int32_t>{2, 10, 4, 3, 0, 0}));
  EXPECT_EQ(p.last_row, (std::vector<int32_t>{1, 2, 3, 6, 0, 0}));
  EXPECT_EQ(p.num_lora_segments, 2);
  EXPECT_EQ(p.lora_segments, (std::vector<int32_t>{0, 0, 0, 2, 1, 0, 2, 4, 0, 0, 0, 0}));
  // Page tables: each sequence's pages (reserved now for the new tokens), zeros elsewhere.
  for (int k = 0; k < 6; ++k) {
    std::vector<int32_t> row(p.page_table.begin() + k * 4, p.page_table.begin() + k * 4 + 4);
    std::vector<int32_t> expected(4, 0);
    if (k < 4) {
      const std::vector<int32_t>& held = f.pages.pages(batch[p.order[k]].sequence);
      std::copy(held.begin(), held.end(), expected.begin());
      const int64_t kv = p.kv_len[k];
      EXPECT_EQ(static_cast<int64_t>(held.size()), (kv + 7) / 8) << k;
    }
    EXPECT_EQ(row, expected) << "sequence " << k;
  }
  // Linear-attention rows: sequence k's rows [cu_seqlens[k], cu_seqlens[k + 1]), padding
  // sequences empty at num_tokens; state slots left for the executor (-1).
  EXPECT_EQ(p.cu_seqlens, (std::vector<int32_t>{0, 2, 3, 4, 7, 7, 7}));
  EXPECT_EQ(p.state_slot, (std::vector<int32_t>(6, -1)));
  EXPECT_FLOAT_EQ(p.sample_params[1].temperature, 0.5f);  // batch entry 1 is sequence 1
  EXPECT_FLOAT_EQ(p.uniform[1], 0.25f);
  EXPECT_EQ(p.sample_params[0].temperature, 0.0f);
  // Nothing committed: lengths are the caller's to commit.
  EXPECT_EQ(f.pages.length(s1), 9);
}

TEST(GpuExecutorHost, DecodeOnlyBatchesBecomeGraphBuckets) {
  PlanFixture f;
  std::vector<SequenceHandle> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back(f.pages.new_sequence());
  f.pages.reserve(seqs[2], 17);
  f.pages.commit(seqs[2], 17);
  const std::vector<int32_t> tok = {42};
  const std::vector<BatchEntry> batch = {{seqs[0], tok, 1}, {seqs[1], tok, -1}, {seqs[2], tok, 1}};
  plan_gpu_step(batch, {}, {}, f.cap, f.buckets, f.occupied, f.pages, f.plan);
  const GpuStepPlan& p = f.plan;
  EXPECT_TRUE(p.graph);
  EXPECT_EQ(p.rows, 4);  // bucket of 3
  EXPECT_EQ(p.seqs, 4);
  EXPECT_EQ(p.num_seqs, 3);
  EXPECT_EQ(p.max_q_len, 1);
  EXPECT_EQ(p.max_kv_len, 32);   // page-table capacity: any length fits the graph
  EXPECT_EQ(p.single_slot, -1);  // never baked into a graph
  EXPECT_EQ(p.order, (std::vector<int>{0, 2, 1}));
  EXPECT_EQ(p.num_lora_segments, 1);
  EXPECT_EQ(std::vector<int32_t>(p.lora_segments.begin(), p.lora_segments.begin() + 4),
            (std::vector<int32_t>{1, 0, 0, 2}));
  EXPECT_EQ(p.token_seq[3], -1);  // padding row of the bucket
  EXPECT_EQ(p.q_len[3], 0);       // padding sequence
  EXPECT_EQ(p.token_pos[1], 17);

  // Without buckets (graphs off) the same batch runs eagerly at its size; one slot -> fast path.
  f.pages.rollback(seqs[0]);
  f.pages.rollback(seqs[1]);
  f.pages.rollback(seqs[2]);
  const std::vector<BatchEntry> one_slot = {{seqs[0], tok, 1}, {seqs[2], tok, 1}};
  plan_gpu_step(one_slot, {}, {}, f.cap, {}, f.occupied, f.pages, f.plan);
  EXPECT_FALSE(f.plan.graph);
  EXPECT_EQ(f.plan.rows, 2);
  EXPECT_EQ(f.plan.single_slot, 1);
  EXPECT_EQ(f.plan.max_kv_len, 18);
}

TEST(GpuExecutorHost, BadBatchesThrowAndReserveNothing) {
  PlanFixture f;
  const SequenceHandle a = f.pages.new_sequence(), b = f.pages.new_sequence();
  const std::vector<int32_t> tok = {1, 2}, bad = {100}, none = {};
  auto plan = [&](std::vector<BatchEntry> batch) {
    return error_of(
        [&] { plan_gpu_step(batch, {}, {}, f.cap, f.buckets, f.occupied, f.pages, f.plan); });
  };
  EXPECT_TRUE(contains(plan({{a, tok, 2}}), "slot 2, which is empty"));
  EXPECT_TRUE(contains(plan({{a, tok, 3}}), "outside [-1, 3)"));
  EXPECT_TRUE(contains(plan({{a, tok, -1}, {a, tok, -1}}), "appears twice"));
  EXPECT_TRUE(contains(plan({{a, bad, -1}}), "token id 100 is outside the vocabulary"));
  EXPECT_TRUE(contains(plan({{a, none, -1}}), "has no tokens"));
  EXPECT_TRUE(contains(plan({}), "empty batch"));
  const std::vector<int32_t> many(17, 1);
  EXPECT_TRUE(contains(plan({{a, many, -1}}), "forward of 17 tokens; the limit is 16"));
  // b fits, a does not (30 + 3 tokens, beyond its page table): b's reservation is undone.
  const std::vector<int32_t> three = {1, 2, 3};
  f.pages.reserve(a, 30);
  f.pages.commit(a, 30);
  EXPECT_TRUE(contains(plan({{b, tok, -1}, {a, three, -1}}), "the KV page table holds 32"));
  EXPECT_TRUE(f.pages.pages(b).empty());
  EXPECT_EQ(f.pages.pages(a).size(), 4u);
  const std::vector<ops::SampleRowParams> params(1);
  EXPECT_TRUE(contains(error_of([&] {
                         const std::vector<BatchEntry> batch = {{b, tok, -1}};
                         plan_gpu_step(batch, params, {}, f.cap, f.buckets, f.occupied, f.pages,
                                       f.plan);
                       }),
                       "sampling params"));
}

TEST(GpuExecutorHost, EstimatesScaleWithTheShapes) {
  const io::ModelConfig qwen = io::load_model_config(fixture("qwen3_moe") / "base");
  const io::ModelConfig deepseek = io::load_model_config(fixture("deepseek_v3") / "base");
  // GQA: layers x 2 (K, V) x KV heads x head_dim x 2 bytes; MLA: layers x (latent + rope) x 2.
  EXPECT_EQ(estimate_kv_bytes_per_token(qwen),
            static_cast<uint64_t>(qwen.num_hidden_layers * 2 * qwen.num_key_value_heads *
                                  qwen.head_dim * 2));
  EXPECT_EQ(estimate_kv_bytes_per_token(deepseek),
            static_cast<uint64_t>(deepseek.num_hidden_layers *
                                  (deepseek.kv_lora_rank + deepseek.qk_rope_head_dim) * 2));
  const ExecutorLimits none{64, 4, 0, 8}, slots{64, 4, 4, 8};
  const uint64_t bf16 = estimate_gpu_model_bytes(qwen, false, none);
  EXPECT_LT(estimate_gpu_model_bytes(qwen, true, none), bf16);    // FP8 experts are smaller
  EXPECT_GT(estimate_gpu_model_bytes(qwen, false, slots), bf16);  // adapter pool
  const io::ModelConfig one = first_layers(qwen, 1);
  EXPECT_EQ(one.num_hidden_layers, 1);
  EXPECT_LT(estimate_gpu_model_bytes(one, false, none), bf16);
  EXPECT_EQ(first_layers(qwen, 0), qwen);
  EXPECT_EQ(first_layers(qwen, 99), qwen);

  // Qwen3.5: only the full-attention layers hold KV rows; each Gated DeltaNet layer holds a bf16
  // conv state [conv_dim, K - 1] and an fp32 recurrent state [nv, dk, dv] per sequence.
  const io::ModelConfig q35 = io::load_model_config(fixture("qwen3_5_moe") / "base");
  const io::LinearAttentionConfig& la = q35.linear_attention;
  int64_t linear = 0;
  for (int64_t l = 0; l < q35.num_hidden_layers; ++l) linear += is_linear_attention_layer(q35, l);
  EXPECT_EQ(linear, 4);
  EXPECT_EQ(estimate_kv_bytes_per_token(q35),
            static_cast<uint64_t>(1 * 2 * q35.num_key_value_heads * q35.head_dim * 2));
  const int64_t conv_dim =
      2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim;
  EXPECT_EQ(linear_attention_state_bytes(q35),
            static_cast<uint64_t>(linear *
                                  (conv_dim * (la.conv_kernel_dim - 1) * 2 +
                                   la.num_value_heads * la.key_head_dim * la.value_head_dim * 4)));
  EXPECT_EQ(linear_attention_state_bytes(qwen), 0u);
  // The linear layers' projections are what for_each_dense_linear lists for them.
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for_each_dense_linear(q35, 0, [&](int64_t out, int64_t in) { shapes.emplace_back(out, in); });
  const int64_t H = q35.hidden_size, vd = la.num_value_heads * la.value_head_dim;
  const std::vector<std::pair<int64_t, int64_t>> expected = {
      {conv_dim, H},
      {vd, H},
      {la.num_value_heads, H},
      {la.num_value_heads, H},
      {H, vd},
      {q35.shared_expert_intermediate_size, H},
      {q35.shared_expert_intermediate_size, H},
      {H, q35.shared_expert_intermediate_size}};
  EXPECT_EQ(shapes, expected);
}

// ================================================================ moelora bench

std::string quote(const fs::path& p) {
  return "'" + p.string() + "'";
}

TEST(BenchCli, TableAndJson) {
  test::TempDir tmp;
  const fs::path json = tmp / "bench.json";
  const fs::path q = fixture("qwen3_moe");
  const auto r =
      test::run_moelora("bench --device cpu --model " + quote(q / "base") + " --adapters a=" +
                        quote(q / "lora_peft3d") + ",b=" + quote(q / "lora_shared_outer") +
                        " --adapter-dist skewed --base-share 0.34 --batch-sizes 2,3 --input-len 5 "
                        "--output-len 4 --seed 3 --json " +
                        quote(json));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "| B | adapters | prefill tok/s | decode tok/s | overall tok/s |"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "base-only requests match the no-LoRA run")) << r.output;
  // The adapter pool is sized from the run: one slot per adapter, the largest rank rounded up to
  // a multiple of 8.
  const io::ModelConfig config = io::load_model_config(q / "base");
  const int64_t rank = std::max(io::load_adapter(q / "lora_peft3d", config, "a").max_rank,
                                io::load_adapter(q / "lora_shared_outer", config, "b").max_rank);
  const int64_t pool_rank = (rank + 7) / 8 * 8;
  EXPECT_TRUE(contains(r.output, "threads; adapter slots 2 (max 2 per batch), max LoRA rank " +
                                     std::to_string(pool_rank) + "; attention reference\n"))
      << r.output;

  const nlohmann::json j = nlohmann::json::parse(test::read_text_file(json));
  EXPECT_EQ(j["adapter_slots"], 2);
  EXPECT_EQ(j["max_lora_rank"], pool_rank);
  EXPECT_EQ(j["attention_kernel"], "reference");  // the CPU backend
  EXPECT_EQ(j["kv_cache_pages"], 0);              // the CPU backend has no page pool
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["input_len"], 5);
  EXPECT_EQ(j["output_len"], 4);
  EXPECT_EQ(j["adapter_dist"], "skewed");
  EXPECT_EQ(j["model"]["model_type"], "qwen3_moe");
  EXPECT_TRUE(j["targets"].is_array());
  ASSERT_EQ(j["runs"].size(), 4u);  // per B: no-LoRA, LoRA
  for (size_t i = 0; i < 4; ++i) {
    const nlohmann::json& run = j["runs"][i];
    const bool lora = i % 2 == 1;
    const int64_t b = i < 2 ? 2 : 3;
    EXPECT_EQ(run["batch_size"], b);
    EXPECT_EQ(run["lora"], lora);
    for (const char* field : {"prefill_tokens_per_s", "decode_tokens_per_s", "overall_tokens_per_s",
                              "latency_s", "peak_rss_mb", "peak_kv_cache_mb"}) {
      ASSERT_TRUE(run[field].is_number()) << field;
      EXPECT_GT(run[field].get<double>(), 0.0) << field << " of run " << i;
    }
    EXPECT_GT(run["ttft_ms"]["max"].get<double>(), 0.0);
    EXPECT_LE(run["ttft_ms"]["p50"].get<double>(), run["ttft_ms"]["max"].get<double>());
    const double overall = run["overall_tokens_per_s"];
    EXPECT_NEAR(overall, static_cast<double>(b * (5 + 4)) / run["latency_s"].get<double>(),
                1e-6 * overall);
    if (lora) {
      EXPECT_GT(run["pct_of_no_lora"]["overall"].get<double>(), 0.0);
      EXPECT_EQ(run["base_requests_match"], true);
      EXPECT_EQ(run["base_requests"], 1);  // 0.34 of 2 or 3 requests
    } else {
      EXPECT_TRUE(run["pct_of_no_lora"].is_null());
      EXPECT_EQ(run["adapters_in_batch"], 0);
    }
  }

  // scripts/engine-report renders the file: one row per run, the LoRA runs' share of no-LoRA as
  // percentages taken from the JSON, and CPU runs without GPU fields shown as "-".
  const fs::path report =
      test::data_dir().parent_path().parent_path() / "scripts" / "engine-report";
  const auto rendered = test::run_command("python3 " + quote(report) + " " + quote(json));
  ASSERT_EQ(rendered.exit_code, 0) << rendered.output;
  EXPECT_TRUE(contains(rendered.output, "| model | B | adapters | in / out |")) << rendered.output;
  const double pct = j["runs"][1]["pct_of_no_lora"]["overall"].get<double>();
  char share[32];
  std::snprintf(share, sizeof share, "| %.1f %% (", pct);
  EXPECT_TRUE(contains(rendered.output, "| qwen3_moe (3 layers, reference attention) |"))
      << rendered.output;
  EXPECT_TRUE(contains(rendered.output, share)) << share << "\n" << rendered.output;
  size_t rows = 0;
  for (size_t pos = 0; (pos = rendered.output.find("\n| qwen3_moe (", pos)) != std::string::npos;
       ++pos)
    ++rows;
  EXPECT_EQ(rows, 4u) << rendered.output;
  const auto broken =
      test::run_command("python3 " + quote(report) + " " + quote(tmp / "missing.json"));
  EXPECT_NE(broken.exit_code, 0);
  EXPECT_TRUE(contains(broken.output, "missing.json")) << broken.output;
}

TEST(BenchCli, DistinctAdaptersAndSynthesizedPreset) {
  test::TempDir tmp;
  const fs::path json = tmp / "bench.json";
  const auto r = test::run_moelora(
      "bench --device cpu --preset tiny-qwen3-moe --synth-adapters 1 --synth-rank 4 "
      "--adapter-dist distinct "
      "--batch-sizes 3 "
      "--input-len 4 --output-len 3 --max-batch-tokens 5 --json " +
      quote(json));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(test::read_text_file(json));
  ASSERT_EQ(j["runs"].size(), 2u);
  EXPECT_EQ(j["runs"][1]["adapters_in_batch"], 3);  // one slot per request
  EXPECT_EQ(j["max_batch_tokens"], 5);              // prompts chunked over several steps
  EXPECT_GT(j["runs"][0]["steps"].get<int64_t>(), 3);
  EXPECT_EQ(j["model"]["preset"], "tiny-qwen3-moe");
  EXPECT_EQ(j["adapter_slots"], 3);  // one registered name per request of the largest batch
  EXPECT_EQ(j["max_lora_rank"], 8);  // --synth-rank 4, rounded up to a multiple of 8
  EXPECT_TRUE(contains(r.output, "adapter slots 3 (max 3 per batch), max LoRA rank 8")) << r.output;
}

TEST(BenchCli, AdapterPoolSizedFromTheRunOrTheOverrides) {
  const fs::path q = fixture("qwen3_moe");
  const std::string common =
      "bench --device cpu --batch-sizes 2 --input-len 3 --output-len 2 "
      "--model " +
      quote(q / "base");
  // No adapters: one slot of the smallest rank.
  auto r = test::run_moelora(common);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "adapter slots 1 (max 1 per batch), max LoRA rank 8; attention"))
      << r.output;
  // Overrides, used as given.
  r = test::run_moelora(common + " --adapters a=" + quote(q / "lora_peft3d") +
                        " --adapter-slots 3 --max-lora-rank 13");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "adapter slots 3 (max 3 per batch), max LoRA rank 13; attention"))
      << r.output;
  // Overrides too small for the run's adapters.
  r = test::run_moelora(common + " --adapters a=" + quote(q / "lora_peft3d") +
                        ",b=" + quote(q / "lora_shared_outer") + " --adapter-slots 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.output, "--adapter-slots 1 is below the 2 adapters this run registers"))
      << r.output;
  const int64_t rank =
      io::load_adapter(q / "lora_peft3d", io::load_model_config(q / "base"), "a").max_rank;
  ASSERT_GT(rank, 1);
  r = test::run_moelora(common + " --adapters a=" + quote(q / "lora_peft3d") + " --max-lora-rank " +
                        std::to_string(rank - 1));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.output, "--max-lora-rank " + std::to_string(rank - 1) +
                                     " is below the largest adapter rank of this run, " +
                                     std::to_string(rank)))
      << r.output;
}

TEST(BenchCli, ErrorsAreOneClearLine) {
  const fs::path q = fixture("qwen3_moe") / "base";
  struct BadCase {
    std::string args, message;
  };
  std::vector<BadCase> cases = {
      {"bench --device cpu --input-len 4", "give exactly one of --model DIR and --preset NAME"},
      {"bench --device cpu --preset tiny-qwen3-moe --random-weights",
       "--random-weights needs --preset NAME and --device cuda"},
      {"bench --device cpu --model " + quote(q) + " --random-adapters 2",
       "--random-adapters needs --random-weights"},
      {"bench --model " + quote(q) + " --adapter-dist zipf", "--adapter-dist 'zipf' is unknown"},
      {"bench --model " + quote(q) + " --batch-sizes 4,x", "--batch-sizes: 'x' is not an integer"},
      {"bench --model " + quote(q) + " --adapters a", "must be given as NAME=DIR"},
      {"bench --model " + quote(q) + " --base-share 2", "--base-share must be in [0, 1]"},
  };
  if (!cuda_device_available())
    cases.push_back({"bench --model " + quote(q) + " --device cuda", "device 'cuda'"});
  for (const BadCase& c : cases) {
    const auto r = test::run_moelora(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_TRUE(contains(r.output, c.message)) << c.args << "\n" << r.output;
  }
}

}  // namespace
}  // namespace moelora::runtime
