// ServeEngineLoop: the server's engine thread (src/server/engine_loop.h) over an Engine on the
// CPU executor (wrapped in the tests' RecordingExecutor): an idle loop asks the backend every
// 200 ms whether it can still run, so a backend that breaks while no request runs stops the loop
// (healthy() false, the failure callback called once with the reason, later submits refused);
// a healthy idle loop keeps serving.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "server/engine_loop.h"
#include "support/engine_helpers.h"
#include "support/test_support.h"

namespace moelora::server {
namespace {

using namespace runtime::engine_test;

TEST(ServeEngineLoop, ABackendThatBreaksWhileIdleStopsTheLoop) {
  TestEngine t = make_engine(test::fixture("qwen3_moe") / "base", small_options());
  std::mutex mutex;
  std::vector<std::string> failures;
  EngineLoop loop(*t.engine, {}, [&](const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex);
    failures.push_back(message);
  });
  loop.start();
  // A request runs to the end on the healthy backend.
  Request r{{7, 8, 9}, "", {}};
  r.sampling.max_new_tokens = 3;
  r.sampling.ignore_eos = true;
  std::atomic<int> finals{0};
  ASSERT_TRUE(loop.submit(r, [&](const TokenEvent& e) { finals += e.finished ? 1 : 0; }).is_ok());
  for (int i = 0; i < 200 && finals == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(finals, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_TRUE(loop.healthy());
  EXPECT_GT(t.executor->health_checks, 0) << "the idle loop never asked the backend";

  t.executor->break_on_health_check = "rank 1 closed its connection";
  for (int i = 0; i < 300 && loop.healthy(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(loop.healthy());
  EXPECT_EQ(loop.failure(), "the backend cannot run any more steps: rank 1 closed its connection");
  {
    std::lock_guard<std::mutex> lock(mutex);
    ASSERT_EQ(failures.size(), 1u);
    EXPECT_EQ(failures[0], loop.failure());
  }
  const Result<RequestId> refused = loop.submit(r, [](const TokenEvent&) {});
  EXPECT_FALSE(refused.is_ok());
  loop.stop();
}

}  // namespace
}  // namespace moelora::server
