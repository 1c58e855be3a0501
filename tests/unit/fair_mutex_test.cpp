// FairMutex: mutual exclusion, try_lock, and the property it exists for: a thread that waits while
// the lock is held gets it before the holder can take it again (the engine's step loop relocks
// right after every step; a submitting thread must not starve behind it).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "core/fair_mutex.h"

namespace moelora {
namespace {

void wait_until_waiting(const FairMutex& m, uint64_t n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (m.waiting() < n) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "waiters never queued";
    std::this_thread::yield();
  }
}

TEST(FairMutex, ExcludesOtherThreads) {
  FairMutex m;
  int64_t counter = 0;  // unsynchronized but for the mutex
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        std::lock_guard<FairMutex> lock(m);
        ++counter;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(counter, 8 * 20000);
  EXPECT_EQ(m.waiting(), 0u);
}

TEST(FairMutex, TryLockFailsWhileHeldOrQueued) {
  FairMutex m;
  ASSERT_TRUE(m.try_lock());
  EXPECT_FALSE(m.try_lock());
  std::thread waiter([&] {
    std::lock_guard<FairMutex> lock(m);
  });
  wait_until_waiting(m, 1);
  m.unlock();
  waiter.join();
  EXPECT_TRUE(m.try_lock());
  m.unlock();
}

// The holder releases and immediately asks again, as the engine loop does between steps: every
// thread that was already waiting must go first, in the order it arrived.
TEST(FairMutex, WaitersGoBeforeTheHolderRelocks) {
  FairMutex m;
  std::mutex order_mutex;
  std::vector<int> order;
  auto record = [&](int who) {
    std::lock_guard<std::mutex> lock(order_mutex);
    order.push_back(who);
  };
  m.lock();
  std::vector<std::thread> waiters;
  for (int w = 1; w <= 3; ++w) {
    waiters.emplace_back([&, w] {
      std::lock_guard<FairMutex> lock(m);
      record(w);
    });
    wait_until_waiting(m, static_cast<uint64_t>(w));  // queue them in a known order
  }
  m.unlock();
  m.lock();  // the "next step": must come after all three
  record(0);
  m.unlock();
  for (std::thread& t : waiters) t.join();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 0}));
}

// A loop that holds the lock almost all the time (relocking a few microseconds after each 1 ms
// hold) next to threads that take it over and over: whenever a thread was queued at a release,
// it got the lock before the loop's next hold. With std::mutex the loop may win again and again.
TEST(FairMutex, BusyRelockingLoopLetsEveryQueuedWaiterIn) {
  FairMutex m;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> waiter_holds{0};
  int64_t busy_holds = 0, releases_with_waiters = 0, overtaken = 0;
  std::atomic<bool> busy_started{false};
  std::thread busy([&] {
    m.lock();
    busy_started.store(true);
    // The waiters start only now, and this first hold lasts until one of them is queued (or 10 s
    // pass), so at least one release happens with a thread waiting however the threads are
    // scheduled on a loaded machine (otherwise the waiters could all finish before this lock).
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (m.waiting() == 0 && std::chrono::steady_clock::now() < give_up) {
    }
    while (!stop.load()) {
      ++busy_holds;
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
      while (std::chrono::steady_clock::now() < until) {
      }
      // Tickets of the threads counted here were taken before this release.
      const bool queued = m.waiting() > 0;
      const int64_t before = waiter_holds.load();
      m.unlock();
      m.lock();
      if (queued) {
        ++releases_with_waiters;
        if (waiter_holds.load() == before) ++overtaken;
      }
    }
    m.unlock();
  });
  std::vector<std::thread> waiters;
  for (int w = 0; w < 3; ++w) {
    waiters.emplace_back([&] {
      while (!busy_started.load()) std::this_thread::yield();
      for (int i = 0; i < 30; ++i) {
        std::lock_guard<FairMutex> lock(m);
        waiter_holds.fetch_add(1);
      }
    });
  }
  for (std::thread& t : waiters) t.join();
  stop.store(true);
  busy.join();
  EXPECT_EQ(waiter_holds.load(), 90);
  EXPECT_GT(releases_with_waiters, 0);
  EXPECT_EQ(overtaken, 0) << "of " << releases_with_waiters << " releases with a thread queued ("
                          << busy_holds << " holds of the loop)";
}

}  // namespace
}  // namespace moelora
