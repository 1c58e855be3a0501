// DistLauncher: starting and supervising the local ranks of a job (dist/launcher.h) with small
// shell programs as ranks: a clean end, a failing rank that stops the others (named with its pid
// and exit code), a rank that ignores SIGTERM killed after the grace period, a stop signal passed
// on to every rank, a program that cannot be executed, and exit statuses in words.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/launcher.h"
#include "support/test_support.h"

namespace moelora::dist {
namespace {

using Clock = std::chrono::steady_clock;

RankProcess shell(int rank, const std::string& script) {
  return {rank, {"/bin/sh", "-c", script}, {}, {}};
}

struct JobRun {
  int code = -1;
  std::vector<std::string> log;
  std::vector<int> pids;
  double seconds = 0;
};

JobRun supervise(const std::vector<RankProcess>& ranks,
                 std::chrono::milliseconds grace = std::chrono::seconds(10)) {
  JobRun run;
  std::mutex mutex;
  LaunchOptions options;
  options.grace = grace;
  options.log = [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(mutex);
    run.log.push_back(line);
  };
  options.started = [&](const std::vector<int>& pids) { run.pids = pids; };
  const auto start = Clock::now();
  run.code = launch_and_supervise(ranks, options);
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return run;
}

TEST(DistLauncher, RanksThatAllExitCleanlyEndTheJobCleanly) {
  const JobRun run =
      supervise({shell(0, "exit 0"), shell(1, "sleep 0.2; exit 0"), shell(2, "true")});
  EXPECT_EQ(run.code, 0);
  EXPECT_EQ(run.pids.size(), 3u);
  EXPECT_TRUE(run.log.empty());
}

TEST(DistLauncher, AFailingRankStopsTheOthers) {
  const JobRun run =
      supervise({shell(0, "sleep 30"), shell(1, "sleep 0.2; exit 3"), shell(2, "sleep 30")});
  EXPECT_EQ(run.code, 1);
  ASSERT_EQ(run.pids.size(), 3u);
  ASSERT_EQ(run.log.size(), 1u);
  EXPECT_EQ(run.log[0], "rank 1 (pid " + std::to_string(run.pids[1]) +
                            ") exited with code 3; stopping the other ranks");
  EXPECT_LT(run.seconds, 10) << "the sleeping ranks must be stopped, not waited for";
}

TEST(DistLauncher, ARankThatIgnoresSigtermIsKilledAfterTheGrace) {
  // Rank 1 fails only once rank 0 ignores SIGTERM (the file says so), whatever the load.
  test::TempDir dir;
  const std::string ready = (dir / "trapped").string();
  const JobRun run =
      supervise({shell(0, "trap '' TERM; touch " + ready + "; while :; do sleep 0.05; done"),
                 shell(1, "while [ ! -f " + ready + " ]; do sleep 0.01; done; exit 2")},
                std::chrono::milliseconds(300));
  EXPECT_EQ(run.code, 1);
  ASSERT_EQ(run.log.size(), 2u);
  EXPECT_NE(run.log[0].find("rank 1 (pid"), std::string::npos) << run.log[0];
  EXPECT_EQ(run.log[1], "rank 0 (pid " + std::to_string(run.pids[0]) +
                            ") did not stop within 300 ms; killing it");
  EXPECT_LT(run.seconds, 10);
}

TEST(DistLauncher, AStopSignalIsPassedOnAndEndsTheJobNormally) {
  // The helper thread must not take the SIGTERM itself: block it before starting the thread.
  sigset_t term, old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, &old);
  std::thread stopper([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(getpid(), SIGTERM);
  });
  const JobRun run = supervise({shell(0, "sleep 30"), shell(1, "sleep 30")});
  stopper.join();
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  EXPECT_EQ(run.code, 0);
  EXPECT_TRUE(run.log.empty());
  EXPECT_LT(run.seconds, 10);
}

// Ranks start with no signal blocked, even when the launcher's caller blocks some (SIGTERM here),
// so a forwarded SIGTERM reaches them. grep is the rank itself, not a shell that might reset its
// mask: it exits 0 only when the SigBlk mask of /proc/self/status is all zeros.
TEST(DistLauncher, ARankStartsWithNoSignalBlocked) {
  sigset_t term, old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, &old);
  const JobRun run =
      supervise({{0, {"/bin/grep", "-q", "^SigBlk:[[:space:]]*0*$", "/proc/self/status"}, {}, {}}});
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  EXPECT_EQ(run.code, 0) << (run.log.empty() ? "" : run.log[0]);
}

// A rank sees the launcher's environment with its own entries added or replacing.
TEST(DistLauncher, RanksGetTheLaunchersEnvironmentWithTheirOwnEntries) {
  setenv("MOELORA_LAUNCHER_TEST_KEEP", "kept", 1);
  setenv("MOELORA_LAUNCHER_TEST_REPLACE", "old", 1);
  RankProcess rank = shell(0,
                           "test \"$MOELORA_LAUNCHER_TEST_KEEP\" = kept && "
                           "test \"$MOELORA_LAUNCHER_TEST_REPLACE\" = new && "
                           "test \"$MOELORA_LAUNCHER_TEST_ADD\" = 7");
  rank.env = {"MOELORA_LAUNCHER_TEST_ADD=6", "MOELORA_LAUNCHER_TEST_REPLACE=new",
              "MOELORA_LAUNCHER_TEST_ADD=7"};  // the last of one key counts
  const JobRun run = supervise({rank});
  unsetenv("MOELORA_LAUNCHER_TEST_KEEP");
  unsetenv("MOELORA_LAUNCHER_TEST_REPLACE");
  EXPECT_EQ(run.code, 0) << (run.log.empty() ? "" : run.log[0]);
}

TEST(DistLauncher, AProgramThatCannotStartIsAFailedRank) {
  const JobRun run = supervise({{0, {"/nonexistent/moelora"}, {}, {}}, shell(1, "sleep 30")});
  EXPECT_EQ(run.code, 1);
  ASSERT_FALSE(run.log.empty());
  EXPECT_NE(run.log[0].find("rank 0 (pid"), std::string::npos);
  EXPECT_NE(run.log[0].find("exited with code 127"), std::string::npos) << run.log[0];
}

TEST(DistLauncher, ExitStatusesInWords) {
  int status = 0;
  const pid_t a = fork();
  if (a == 0) _exit(5);
  waitpid(a, &status, 0);
  EXPECT_EQ(describe_exit(status), "exited with code 5");
  const pid_t b = fork();
  if (b == 0) {
    pause();
    _exit(0);
  }
  kill(b, SIGKILL);
  waitpid(b, &status, 0);
  EXPECT_EQ(describe_exit(status), "was killed by signal 9 (Killed)");
  EXPECT_THROW(launch_and_supervise({}, {}), Error);
}

}  // namespace
}  // namespace moelora::dist
