// Starts the local ranks of a multi-process job (one process per GPU, or per CPU rank) and
// supervises them, as torchrun or SGLang's launcher do: the job lives while every rank lives.
//
//   - Each rank is a child process running `argv` (argv[0] the program path); `inherit_fds` stay
//     open in it (the rendezvous socket the launcher bound for rank 0). A child dies with the
//     launcher (PR_SET_PDEATHSIG), so killing the launcher never leaves ranks behind.
//   - SIGINT / SIGTERM to the launcher are passed on to every rank; the job then ends normally.
//   - The first rank that ends on its own with a failure (a non-zero exit, or a signal the
//     launcher did not send) ends the job: the launcher reports it, sends SIGTERM to the others,
//     SIGKILL to those still alive after `grace`, and returns 1. A rank that exits 0 on its own
//     (a worker told to stop) is waited for with the rest.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace moelora::dist {

struct RankProcess {
  int rank = 0;
  std::vector<std::string> argv;
  std::vector<int> inherit_fds;
  // KEY=VALUE entries added to (or replacing those of) the launcher's environment.
  std::vector<std::string> env;
};

struct LaunchOptions {
  std::chrono::milliseconds grace{std::chrono::seconds(10)};
  // Where the launcher's own lines go ("moelora serve: rank 1 (pid 4242) ..."); stderr if empty.
  std::function<void(const std::string&)> log;
  // Called once every rank has started, with their pids in `ranks` order (tests, and the line
  // that tells a user which process is which rank).
  std::function<void(const std::vector<int>&)> started;
};

// Runs the ranks to the end. 0 when every rank exited 0 (or ended by the launcher's forwarding
// of a stop signal), 1 after a rank failed (the log says which and how). Throws kInternal when a
// process cannot be started (after stopping the ones already started).
int launch_and_supervise(const std::vector<RankProcess>& ranks, const LaunchOptions& options);

// "exited with code 3" / "was killed by signal 9 (Killed)": a waitpid status in words.
std::string describe_exit(int wait_status);

}  // namespace moelora::dist
