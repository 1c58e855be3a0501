// parallel_for: every index exactly once, fixed chunking, exceptions propagate, nested calls run
// inline, and many back-to-back jobs (the persistent pool's job hand-over) lose nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "core/threads.h"

namespace moelora {
namespace {

TEST(ParallelFor, CoversEveryIndexOnce) {
  for (int64_t n : {1, 2, 7, 100, 12345}) {
    std::vector<std::atomic<int>> hits(n);
    parallel_for(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(ParallelFor, ManyShortJobsBackToBack) {
  std::atomic<int64_t> total{0};
  for (int job = 0; job < 2000; ++job) {
    parallel_for(64, [&](int64_t b, int64_t e) { total.fetch_add(e - b); });
  }
  EXPECT_EQ(total.load(), 2000 * 64);
}

TEST(ParallelFor, ExceptionsPropagateToTheCaller) {
  EXPECT_THROW(parallel_for(1000, [](int64_t b, int64_t) {
                 if (b > 0) throw std::runtime_error("chunk failed");
               }),
               std::runtime_error);
  // the pool still works afterwards
  std::atomic<int64_t> count{0};
  parallel_for(100, [&](int64_t b, int64_t e) { count.fetch_add(e - b); });
  EXPECT_EQ(count.load(), 100);
}

TEST(ParallelFor, NestedCallsRunInline) {
  std::atomic<int64_t> count{0};
  parallel_for(8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) parallel_for(10, [&](int64_t b2, int64_t e2) { count.fetch_add(e2 - b2); });
  });
  EXPECT_EQ(count.load(), 80);
}

}  // namespace
}  // namespace moelora
