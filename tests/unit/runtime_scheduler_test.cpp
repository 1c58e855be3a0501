// Unit tests of the serving runtime's bookkeeping without a model (src/runtime):
//   - AdapterPool (LRU eviction, pinning, refcounts, never evicting an adapter in use, host-cache
//     hits, failing loads and slot writes);
//   - Scheduler decisions (token budget, decode first, chunked prefill, max_running,
//     max_loras_per_batch, base requests going past a blocked adapter request, FIFO among adapter
//     requests, cancellation; KV page reservation: requests wait in arrival order until their
//     pages are free, a random load through a tiny real page pool never runs it dry, a request
//     larger than the pool is refused).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/adapter_pool.h"
#include "runtime/gpu_executor.h"
#include "runtime/scheduler.h"
#include "support/test_support.h"

namespace moelora::runtime {
namespace {

namespace fs = std::filesystem;

using test::contains;
using test::error_of;

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

}  // namespace
}  // namespace moelora::runtime
