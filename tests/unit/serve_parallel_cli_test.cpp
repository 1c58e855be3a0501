// ServeParallelCli: `moelora serve --tp N` as a user runs it, on the CPU backend: the launcher
// starts one process per rank, rank 0 answers the OpenAI API, and the answers (base and adapter,
// greedy) equal those of a one-process server on the same model; killing a rank ends the whole
// job with an error naming the rank, its pid and the signal; a rank that never joins ends the job
// at --dist-timeout with the missing rank named; two nodes (two launchers with --nnodes 2 on
// this machine) form one job; bad combinations of the parallel flags are refused with the flag
// named.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

#include "dist/tcp.h"
#include "support/serve_client.h"
#include "support/test_support.h"

namespace moelora::test {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// `moelora serve ARGS` in the background, its stdout and stderr in files.
class ServeProcess {
 public:
  ServeProcess(const fs::path& dir, const std::string& name, const std::vector<std::string>& args)
      : out_(dir / (name + ".out")), err_(dir / (name + ".err")) {
    std::vector<std::string> argv = {(binary_dir() / "moelora").string(), "serve"};
    argv.insert(argv.end(), args.begin(), args.end());
    pid_ = fork();
    if (pid_ == 0) {
      freopen(out_.c_str(), "w", stdout);
      freopen(err_.c_str(), "w", stderr);
      setenv("MOELORA_NO_PROGRESS", "1", 1);
      std::vector<char*> c;
      for (std::string& a : argv) c.push_back(a.data());
      c.push_back(nullptr);
      execv(c[0], c.data());
      _exit(127);
    }
  }
  ~ServeProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // The first match of `pattern`'s group 1 in stdout, waiting up to `timeout`; "" if none.
  std::string wait_for(const std::string& pattern,
                       std::chrono::seconds timeout = std::chrono::seconds(60)) {
    const std::regex re(pattern);
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      std::smatch m;
      const std::string text = read_file(out_);
      if (std::regex_search(text, m, re)) return m[1].str();
      if (!exited_ && waitpid(pid_, &status_, WNOHANG) == pid_) exited_ = true;
      if (exited_) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return "";
  }
  // The exit code (-1 if it was killed by a signal), waiting up to `timeout`; -2 if still running.
  int wait_exit(std::chrono::seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!exited_ && Clock::now() < deadline) {
      if (waitpid(pid_, &status_, WNOHANG) == pid_)
        exited_ = true;
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!exited_) return -2;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }
  pid_t pid() const { return pid_; }
  std::string output() const { return read_file(out_) + read_file(err_); }

 private:
  fs::path out_, err_;
  pid_t pid_ = -1;
  int status_ = 0;
  bool exited_ = false;
};

// A tiny Qwen3-MoE with the test tokenizer and one adapter, written once per test.
struct TinyModel {
  TempDir dir;
  fs::path model = dir / "model", adapter = dir / "adapter";
  TinyModel() {
    const CommandResult synth =
        run_moelora("synth --preset tiny-qwen3-moe --out " + model.string() + " --tokenizer " +
                    (data_dir() / "tokenizer").string());
    EXPECT_EQ(synth.exit_code, 0) << synth.output;
    const CommandResult lora = run_moelora(
        "synth-adapter --model " + model.string() +
        " --rank 8 --alpha 16 --layout peft-3d --targets all --out " + adapter.string());
    EXPECT_EQ(lora.exit_code, 0) << lora.output;
  }
};

std::string completion(int port, const std::string& model) {
  const HttpAnswer a =
      http_post(port, "/v1/completions",
                R"({"model": ")" + model +
                    R"(", "prompt": "hello world", "max_tokens": 12, "temperature": 0})");
  EXPECT_EQ(a.status, 200) << a.raw << a.error;
  if (a.status != 200) return "";
  return a.body["choices"][0]["text"].get<std::string>();
}

int free_port() {
  dist::Listener l = dist::Listener::bind({"127.0.0.1", 0});
  return l.port();
}

TEST(ServeParallelCli, TwoRanksAnswerAsOneProcessAndAKilledRankEndsTheJob) {
  TinyModel tiny;
  const std::vector<std::string> common = {
      "--model",   tiny.model.string(),           "--device", "cpu", "--port", "0",
      "--adapter", "sql=" + tiny.adapter.string()};
  ServeProcess one(tiny.dir.path(), "one", common);
  std::vector<std::string> tp2 = common;
  tp2.insert(tp2.end(), {"--tp", "2"});
  ServeProcess two(tiny.dir.path(), "two", tp2);
  const std::string port_one = one.wait_for(R"(listening on http://127\.0\.0\.1:(\d+))");
  const std::string port_two = two.wait_for(R"(listening on http://127\.0\.0\.1:(\d+))");
  ASSERT_NE(port_one, "") << one.output();
  ASSERT_NE(port_two, "") << two.output();
  for (const char* model : {"model", "sql"}) {
    SCOPED_TRACE(model);
    const std::string expected = completion(std::stoi(port_one), model);
    EXPECT_FALSE(expected.empty());
    EXPECT_EQ(completion(std::stoi(port_two), model), expected);
  }
  EXPECT_EQ(completion(std::stoi(port_two), "sql") == completion(std::stoi(port_two), "model"),
            false)
      << "the adapter changes nothing: the comparison would prove little";
  EXPECT_EQ(http_get(std::stoi(port_two), "/health").status, 200);

  const std::string rank1 = two.wait_for(R"(rank 1 \(pid (\d+)\))");
  ASSERT_NE(rank1, "") << two.output();
  // NVLink multicast is off in every rank the launcher starts.
  std::string environ_text = read_file("/proc/" + rank1 + "/environ");
  std::replace(environ_text.begin(), environ_text.end(), '\0', '\n');
  EXPECT_NE(environ_text.find("\nNCCL_NVLS_ENABLE=0\n"), std::string::npos);
  ASSERT_EQ(kill(std::stoi(rank1), SIGKILL), 0);
  EXPECT_EQ(two.wait_exit(std::chrono::seconds(30)), 1) << two.output();
  EXPECT_NE(two.output().find("rank 1 (pid " + rank1 + ") was killed by signal 9"),
            std::string::npos)
      << two.output();

  kill(one.pid(), SIGTERM);
  EXPECT_EQ(one.wait_exit(std::chrono::seconds(30)), 0) << one.output();
}

TEST(ServeParallelCli, TwoNodesFormOneJobAndAMissingNodeIsNamed) {
  TinyModel tiny;
  const std::string address = "127.0.0.1:" + std::to_string(free_port());
  const std::vector<std::string> common = {"--model",
                                           tiny.model.string(),
                                           "--device",
                                           "cpu",
                                           "--port",
                                           "0",
                                           "--tp",
                                           "2",
                                           "--nnodes",
                                           "2",
                                           "--dist-init-addr",
                                           address,
                                           "--dist-timeout",
                                           "60"};
  std::vector<std::string> node0 = common, node1 = common;
  node0.insert(node0.end(), {"--node-rank", "0"});
  node1.insert(node1.end(), {"--node-rank", "1"});
  ServeProcess first(tiny.dir.path(), "node0", node0);
  ServeProcess second(tiny.dir.path(), "node1", node1);
  const std::string port = first.wait_for(R"(listening on http://127\.0\.0\.1:(\d+))");
  ASSERT_NE(port, "") << first.output() << second.output();
  EXPECT_FALSE(completion(std::stoi(port), "model").empty());
  // Stopping node 0 stops the job: node 1's rank is told to stop and ends cleanly.
  kill(first.pid(), SIGTERM);
  EXPECT_EQ(first.wait_exit(std::chrono::seconds(30)), 0) << first.output();
  EXPECT_EQ(second.wait_exit(std::chrono::seconds(30)), 0) << second.output();

  // Node 1 never comes: node 0 gives up at --dist-timeout naming rank 1.
  std::vector<std::string> alone = common;
  alone[alone.size() - 1] = "1";  // --dist-timeout 1
  alone[alone.size() - 3] = "127.0.0.1:" + std::to_string(free_port());
  alone.insert(alone.end(), {"--node-rank", "0"});
  ServeProcess lonely(tiny.dir.path(), "lonely", alone);
  EXPECT_EQ(lonely.wait_exit(std::chrono::seconds(30)), 1) << lonely.output();
  EXPECT_NE(lonely.output().find("rank 1 of 2 did not join"), std::string::npos) << lonely.output();
}

// Node 1's rank dies while node 0's rank 0 serves: node 1's launcher ends with the rank named;
// rank 0 notices it while idle (no request needed), its engine stops, and node 0's job ends with
// the cause instead of a server that answers errors forever.
TEST(ServeParallelCli, ALostNodeEndsTheJobOnTheOtherNode) {
  TinyModel tiny;
  const std::string address = "127.0.0.1:" + std::to_string(free_port());
  const std::vector<std::string> common = {
      "--model", tiny.model.string(), "--device", "cpu", "--port", "0", "--tp", "2", "--nnodes",
      "2",       "--dist-init-addr",  address};
  std::vector<std::string> node0 = common, node1 = common;
  node0.insert(node0.end(), {"--node-rank", "0"});
  node1.insert(node1.end(), {"--node-rank", "1"});
  ServeProcess first(tiny.dir.path(), "node0", node0);
  ServeProcess second(tiny.dir.path(), "node1", node1);
  const std::string port = first.wait_for(R"(listening on http://127\.0\.0\.1:(\d+))");
  ASSERT_NE(port, "") << first.output() << second.output();
  EXPECT_FALSE(completion(std::stoi(port), "model").empty());
  const std::string rank1 = second.wait_for(R"(rank 1 \(pid (\d+)\))");
  ASSERT_NE(rank1, "");
  ASSERT_EQ(kill(std::stoi(rank1), SIGKILL), 0);
  EXPECT_EQ(second.wait_exit(std::chrono::seconds(30)), 1) << second.output();
  EXPECT_EQ(first.wait_exit(std::chrono::seconds(30)), 1) << first.output();
  EXPECT_NE(first.output().find("the engine stopped: the backend cannot run any more steps"),
            std::string::npos)
      << first.output();
  EXPECT_NE(first.output().find("rank 0 (pid"), std::string::npos) << first.output();
}

TEST(ServeParallelCli, BadParallelFlagsAreRefusedNamingTheFlag) {
  TinyModel tiny;
  const std::string base = "serve --model " + tiny.model.string() + " --port 0 ";
  struct Case {
    std::string args, message;
  };
  const std::vector<Case> cases = {
      {"--device cpu --tp 2 --ep 1",
       "--ep 1 with --tp 2: the routed experts are split over the "
       "same ranks as the attention heads"},
      {"--device cuda --tp 2 --dp-attention", "run on the CPU reference only"},
      {"--device cpu --tp 3 --nnodes 2 --dist-init-addr 127.0.0.1:1",
       "--tp 3 is not divisible by "
       "--nnodes 2"},
      {"--device cpu --tp 2 --nnodes 2", "--nnodes 2 needs --dist-init-addr HOST:PORT"},
      {"--device cpu --tp 2 --dist-init-addr nowhere",
       "--dist-init-addr 'nowhere' is not HOST:PORT"},
      {"--device cpu --dp-attention", "--dp-attention needs --tp > 1"},
      {"--device cpu --tp 2 --moe-dispatch", "--moe-dispatch needs --dp-attention"},
      {"--device cpu --tp 2 --dist-collective-timeout 0",
       "--dist-collective-timeout 0 must be in (0, 86400] seconds"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const CommandResult r = run_moelora(base + c.args);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << r.output;
  }
  // GPU ranks where they cannot run: a build without NCCL, or a machine without a GPU.
  const CommandResult r = run_moelora(base + "--device cuda --tp 2");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(r.output.find("this build has no NCCL") != std::string::npos ||
              r.output.find("no CUDA device is visible") != std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace moelora::test
