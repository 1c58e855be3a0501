// Start and supervise the local ranks (launcher.h).
//
// The launcher blocks SIGCHLD, SIGINT and SIGTERM and takes them with sigtimedwait in one loop,
// so child exits and stop requests are handled in normal code, never in a signal handler. The
// children get the launcher's original signal mask back before exec.
#include "dist/launcher.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>

#include "core/error.h"

namespace moelora::dist {

namespace {

using ::moelora::detail::concat;

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = true;
  bool reported = false;  // its end was looked at
  int status = 0;
};

// Blocks the launcher's signals in the calling thread and makes SIGCHLD's disposition the
// default (a SIGCHLD inherited as ignored would have the kernel reap the children, and waitpid
// would never see them); restores both on scope exit.
struct SignalGuard {
  sigset_t old{};
  struct sigaction old_chld {};
  explicit SignalGuard(const sigset_t& block) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGCHLD, &dfl, &old_chld);
    pthread_sigmask(SIG_BLOCK, &block, &old);
  }
  ~SignalGuard() {
    // Drop SIGCHLDs that arrived for our children while blocked, then unblock.
    sigset_t pending;
    sigemptyset(&pending);
    sigaddset(&pending, SIGCHLD);
    const timespec zero{0, 0};
    while (sigtimedwait(&pending, nullptr, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    sigaction(SIGCHLD, &old_chld, nullptr);
  }
};

// The launcher's environment with `extra` KEY=VALUE entries added or replacing, as exec wants it.
std::vector<std::string> environment_with(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  auto key = [](const std::string& entry) { return entry.substr(0, entry.find('=')); };
  auto in = [&](const std::string& k, auto begin, auto end) {
    return std::any_of(begin, end, [&](const std::string& x) { return key(x) == k; });
  };
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (!in(key(entry), extra.begin(), extra.end())) env.push_back(entry);
  }
  // Of extra entries with the same key, the last one counts.
  for (auto it = extra.begin(); it != extra.end(); ++it)
    if (!in(key(*it), it + 1, extra.end())) env.push_back(*it);
  return env;
}

pid_t start(const RankProcess& rank) {
  // Everything exec needs is built before fork: the child of a threaded process may only make
  // async-signal-safe calls.
  std::vector<char*> argv;
  for (const std::string& a : rank.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const std::vector<std::string> env_strings = environment_with(rank.env);
  std::vector<char*> envp;
  for (const std::string& e : env_strings) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  // Child: only async-signal-safe calls until exec.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(127);  // the launcher is already gone
  for (int fd : rank.inherit_fds) fcntl(fd, F_SETFD, 0);
  // A rank starts with every signal deliverable and at its default action, whatever the
  // launcher's caller blocked or ignored: the forwarded SIGTERM must reach it.
  for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE, SIGHUP}) signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  execve(argv[0], argv.data(), envp.data());
  const char message[] = "moelora launcher: exec of a rank failed\n";
  (void)!write(2, message, sizeof(message) - 1);
  _exit(127);
}

}  // namespace

std::string describe_exit(int wait_status) {
  if (WIFEXITED(wait_status)) return concat("exited with code ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    const char* name = strsignal(sig);
    return concat("was killed by signal ", sig, " (", name != nullptr ? name : "?", ")");
  }
  return concat("ended with wait status ", wait_status);
}

int launch_and_supervise(const std::vector<RankProcess>& ranks, const LaunchOptions& options) {
  MOELORA_CHECK(!ranks.empty(), ErrorCode::kInvalidArgument, "launcher: no ranks to start");
  auto log = [&](const std::string& line) {
    if (options.log)
      options.log(line);
    else
      std::fprintf(stderr, "%s\n", line.c_str());
  };
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, SIGCHLD);
  sigaddset(&handled, SIGINT);
  sigaddset(&handled, SIGTERM);
  SignalGuard guard(handled);

  std::vector<Child> children;
  auto signal_all = [&](int sig) {
    for (const Child& c : children)
      if (c.running) kill(c.pid, sig);
  };
  auto reap = [&](bool block) {
    for (Child& c : children) {
      if (!c.running) continue;
      int status = 0;
      const pid_t got = waitpid(c.pid, &status, block ? 0 : WNOHANG);
      if (got == c.pid) {
        c.running = false;
        c.status = status;
      } else if (got < 0 && errno == ECHILD) {  // reaped elsewhere: gone, its status unknown
        c.running = false;
        c.status = 0;
      }
    }
  };
  for (const RankProcess& r : ranks) {
    MOELORA_CHECK(!r.argv.empty(), ErrorCode::kInvalidArgument, "launcher: rank ", r.rank,
                  " has no command");
    const pid_t pid = start(r);
    if (pid < 0) {
      const std::string reason = std::strerror(errno);
      signal_all(SIGKILL);
      for (Child& c : children) waitpid(c.pid, nullptr, 0);
      MOELORA_THROW(ErrorCode::kInternal, "launcher: cannot start rank ", r.rank, ": ", reason);
    }
    children.push_back({r.rank, pid, true, false, 0});
  }
  if (options.started) {
    std::vector<int> pids;
    for (const Child& c : children) pids.push_back(c.pid);
    options.started(pids);
  }

  bool stopping = false;  // a stop signal was passed on, or a rank failed
  bool failed = false;
  auto kill_deadline = std::chrono::steady_clock::time_point::max();
  for (;;) {
    reap(false);
    for (Child& c : children) {
      if (c.running || c.reported) continue;
      const bool clean = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
      if (clean) continue;
      c.reported = true;
      if (stopping) {
        // While stopping, ranks end by the forwarded signal or with the error of a lost peer;
        // a crash is still worth a line.
        const int sig = WIFSIGNALED(c.status) ? WTERMSIG(c.status) : 0;
        if (sig != 0 && sig != SIGTERM && sig != SIGINT && sig != SIGKILL)
          log(concat("rank ", c.rank, " (pid ", c.pid, ") ", describe_exit(c.status),
                     " while stopping"));
        continue;
      }
      log(concat("rank ", c.rank, " (pid ", c.pid, ") ", describe_exit(c.status),
                 "; stopping the other ranks"));
      failed = true;
      stopping = true;
      signal_all(SIGTERM);
      kill_deadline = std::chrono::steady_clock::now() + options.grace;
      break;
    }
    bool any_running = false;
    for (const Child& c : children) any_running = any_running || c.running;
    if (!any_running) break;
    if (std::chrono::steady_clock::now() >= kill_deadline) {
      for (const Child& c : children)
        if (c.running)
          log(concat("rank ", c.rank, " (pid ", c.pid, ") did not stop within ",
                     options.grace.count(), " ms; killing it"));
      signal_all(SIGKILL);
      reap(true);
      break;
    }
    const timespec tick{0, 100 * 1000 * 1000};
    const int sig = sigtimedwait(&handled, nullptr, &tick);
    if ((sig == SIGINT || sig == SIGTERM) && !stopping) {
      stopping = true;
      signal_all(sig);
      kill_deadline = std::chrono::steady_clock::now() + options.grace;
    }
  }
  return failed ? 1 : 0;
}

}  // namespace moelora::dist
