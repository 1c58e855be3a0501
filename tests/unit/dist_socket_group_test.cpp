// DistSocketGroup: ranks in separate processes over TCP (src/dist/socket_group.h, tcp.h), played
// here by threads that each join over 127.0.0.1 as a process would.
//   - Collectives: a program of every collective (in-place forms, uneven all_to_all_v counts,
//     a non-zero broadcast root, empty buffers) gives every rank bitwise the results of the same
//     program on InProcessGroup, for 1-5 ranks. Both groups compute with collective_rules.h, so
//     this checks the transport; dist_communicator_test checks the arithmetic against sums of
//     its own.
//   - Mismatched calls: the same kInvalidArgument verdict on every rank, as InProcessGroup gives.
//   - A joined rank that sends hostile calls (counts beyond its data, short count vectors, sizes
//     that do not multiply, another collective #): a named verdict or error, never a crash.
//   - Join: ranks missing at the deadline named on rank 0 and on the ranks that came; a rank with
//     another fingerprint, a duplicate rank, a wrong group size refused with both sides named;
//     strangers on the port (garbage, a frame announcing a terabyte, silence) dropped.
//   - Failure, not hang: a rank that dies (closes its connection) in the middle of a collective,
//     or never arrives, fails the others with its rank in the message, well before any
//     generous timeout for the first case; abort() from another thread wakes a blocked rank
//     with its reason.
//   - The control plane: commands reach every worker in order; failed replies are named by rank;
//     a worker that never replies is named at the timeout.
//   - tcp.h: HOST:PORT parsing, truncated payloads, oversized frame lengths.
// Rank threads record what they got; the main thread asserts.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/messages.h"
#include "dist/socket_group.h"
#include "dist/tcp.h"
#include "support/test_support.h"

namespace moelora::dist {
namespace {

using std::chrono::milliseconds;
using test::error_message;

constexpr milliseconds kTestTimeout{20000};  // a bug fails the test instead of hanging it

// Each rank's outcome of a run: its error message ("" when none) and what it recorded.
struct RankRun {
  std::string error;
  std::vector<float> record;
  std::vector<std::string> notes;
};

// Starts `size` ranks as threads; rank r joins with `options` (rank, size, address, listen_fd
// filled in; `tweak` may change each rank's options) and runs body. Joins all threads.
std::vector<RankRun> run_socket_ranks(int size,
                                      const std::function<void(SocketGroup&, RankRun&)>& body,
                                      const std::function<void(SocketGroupOptions&)>& tweak = {}) {
  Listener listener = Listener::bind({"127.0.0.1", 0});
  const int port = listener.port();
  std::vector<RankRun> runs(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      SocketGroupOptions o;
      o.rank = r;
      o.size = size;
      o.address = {"127.0.0.1", port};
      o.listen_fd = r == 0 ? dup(listener.fd()) : -1;
      o.join_timeout = kTestTimeout;
      o.collective_timeout = kTestTimeout;
      o.fingerprint = "test";
      if (tweak) tweak(o);
      try {
        std::unique_ptr<SocketGroup> group = SocketGroup::join(o);
        body(*group, runs[static_cast<size_t>(r)]);
      } catch (const std::exception& e) {
        runs[static_cast<size_t>(r)].error = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return runs;
}

// A plain TCP connection to 127.0.0.1:port, for bytes that no Connection would send.
int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

std::vector<float> random_floats(std::mt19937& rng, size_t count) {
  std::uniform_real_distribution<float> mantissa(-1.f, 1.f);
  std::uniform_int_distribution<int> exponent(-3, 3);
  std::vector<float> v(count);
  for (float& x : v) x = mantissa(rng) * std::pow(10.f, static_cast<float>(exponent(rng)));
  return v;
}

// Every collective once or twice, each rank's inputs seeded by its rank; appends every output to
// `record`.
void collective_program(Communicator& comm, std::vector<float>& record) {
  const int n = comm.size(), r = comm.rank();
  std::mt19937 rng(1234 + static_cast<uint32_t>(r));
  auto keep = [&](std::span<const float> v) { record.insert(record.end(), v.begin(), v.end()); };

  std::vector<float> reduce = random_floats(rng, 37);
  comm.all_reduce_sum(reduce);
  keep(reduce);
  std::vector<float> empty;
  comm.all_reduce_sum(empty);

  const std::vector<float> piece = random_floats(rng, 5);
  std::vector<float> gathered(5 * static_cast<size_t>(n));
  comm.all_gather(piece, gathered);
  keep(gathered);
  std::vector<float> in_place = random_floats(rng, 3 * static_cast<size_t>(n));
  comm.all_gather(std::span<const float>(in_place.data() + 3 * r, 3), in_place);
  keep(in_place);

  const std::vector<float> scatter_in = random_floats(rng, 6 * static_cast<size_t>(n));
  std::vector<float> scattered(6);
  comm.reduce_scatter_sum(scatter_in, scattered);
  keep(scattered);
  std::vector<float> scatter_in_place = random_floats(rng, 4 * static_cast<size_t>(n));
  comm.reduce_scatter_sum(scatter_in_place, std::span<float>(scatter_in_place.data() + 4 * r, 4));
  keep(std::span<const float>(scatter_in_place.data() + 4 * r, 4));

  // Rank a sends (a + 2 b) % 4 floats to rank b, some of them none.
  std::vector<int64_t> send_counts(static_cast<size_t>(n)), recv_counts(static_cast<size_t>(n));
  int64_t send_total = 0, recv_total = 0;
  for (int b = 0; b < n; ++b) {
    send_counts[static_cast<size_t>(b)] = (r + 2 * b) % 4;
    recv_counts[static_cast<size_t>(b)] = (b + 2 * r) % 4;
    send_total += send_counts[static_cast<size_t>(b)];
    recv_total += recv_counts[static_cast<size_t>(b)];
  }
  const std::vector<float> a2a_send = random_floats(rng, static_cast<size_t>(send_total) + 2);
  std::vector<float> a2a_recv(static_cast<size_t>(recv_total) + 1, -7.f);  // spare capacity
  comm.all_to_all_v(a2a_send, send_counts, a2a_recv, recv_counts);
  keep(a2a_recv);

  std::vector<float> cast = random_floats(rng, 9);
  comm.broadcast(cast, n - 1);
  keep(cast);
  comm.barrier();
}

TEST(DistSocketGroup, CollectivesEqualTheInProcessGroupBitwise) {
  for (int size : {1, 2, 3, 5}) {
    SCOPED_TRACE("ranks " + std::to_string(size));
    std::vector<std::vector<float>> expected(static_cast<size_t>(size));
    run_ranks(size, [&](Communicator& comm) {
      collective_program(comm, expected[static_cast<size_t>(comm.rank())]);
    });
    const std::vector<RankRun> runs = run_socket_ranks(
        size, [](SocketGroup& g, RankRun& run) { collective_program(g, run.record); });
    for (int r = 0; r < size; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_EQ(runs[static_cast<size_t>(r)].error, "");
      const std::vector<float>& got = runs[static_cast<size_t>(r)].record;
      ASSERT_EQ(got.size(), expected[static_cast<size_t>(r)].size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i]),
                  std::bit_cast<uint32_t>(expected[static_cast<size_t>(r)][i]))
            << "output " << i << ": " << got[i] << " vs " << expected[static_cast<size_t>(r)][i];
      }
    }
  }
}

// Rank 0's welcome payload (what a GPU job sends: the NCCL unique id, 128 arbitrary bytes with
// zeros in them) reaches every worker byte for byte; rank 0 keeps its own copy.
TEST(DistSocketGroup, EveryRankReceivesTheWelcomePayload) {
  std::string welcome(128, '\0');
  for (size_t i = 0; i < welcome.size(); ++i) welcome[i] = static_cast<char>((i * 37 + 11) % 256);
  welcome[5] = '\0';
  const std::vector<RankRun> runs = run_socket_ranks(
      4,
      [&](SocketGroup& g, RankRun& run) {
        run.notes.push_back(g.welcome());
        g.barrier();
      },
      [&](SocketGroupOptions& o) {
        if (o.rank == 0) o.welcome = welcome;
      });
  for (size_t r = 0; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].error, "") << "rank " << r;
    ASSERT_EQ(runs[r].notes.size(), 1u);
    EXPECT_EQ(runs[r].notes[0], welcome) << "rank " << r << "'s welcome differs";
  }
}

TEST(DistSocketGroup, MismatchedCallsFailEveryRankWithOneVerdict) {
  const std::vector<RankRun> runs = run_socket_ranks(3, [](SocketGroup& g, RankRun&) {
    std::vector<float> v(g.rank() == 2 ? 4 : 3, 1.f);
    g.all_reduce_sum(v);
  });
  for (const RankRun& run : runs)
    EXPECT_EQ(run.error,
              "all_reduce_sum at collective #0: rank 2 has count 4, expected 3 as on rank 0");

  const std::vector<RankRun> ops = run_socket_ranks(2, [](SocketGroup& g, RankRun&) {
    std::vector<float> v(2, 1.f);
    if (g.rank() == 1) {
      g.broadcast(v, 0);
    } else {
      g.all_reduce_sum(v);
    }
  });
  for (const RankRun& run : ops)
    EXPECT_NE(run.error.find("collective #0: rank 1 called broadcast, expected all_reduce_sum"),
              std::string::npos)
        << run.error;
}

TEST(DistSocketGroup, MissingRanksAreNamedAtTheJoinDeadline) {
  // Ranks 0 and 2 of 4 come; 1 and 3 never do.
  const std::vector<RankRun> runs = run_socket_ranks(
      4, [](SocketGroup&, RankRun&) {},
      [](SocketGroupOptions& o) {
        o.join_timeout = milliseconds(3000);
        if (o.rank == 1 || o.rank == 3) {
          o.address = {"127.0.0.1", 1};  // nobody listens there
          o.join_timeout = milliseconds(300);
        }
      });
  EXPECT_NE(runs[0].error.find("ranks 1, 3 of 4 did not join 127.0.0.1:"), std::string::npos)
      << runs[0].error;
  EXPECT_NE(runs[0].error.find("(ranks 0, 2 joined)"), std::string::npos) << runs[0].error;
  EXPECT_NE(runs[2].error.find("rank 0 refused the group: ranks 1, 3 of 4 did not join"),
            std::string::npos)
      << runs[2].error;
  EXPECT_NE(runs[1].error.find("cannot connect to 127.0.0.1:1"), std::string::npos)
      << runs[1].error;
}

TEST(DistSocketGroup, RanksThatRunSomethingElseAreRefused) {
  const std::vector<RankRun> fingerprint = run_socket_ranks(
      2, [](SocketGroup&, RankRun&) {},
      [](SocketGroupOptions& o) {
        o.fingerprint = o.rank == 0 ? "model a, tp 2" : "model b, tp 2";
      });
  for (const RankRun& run : fingerprint) {
    EXPECT_NE(run.error.find("runs something else than rank 0: rank 0 'model a, tp 2', rank 1 "
                             "'model b, tp 2'"),
              std::string::npos)
        << run.error;
  }
  const std::vector<RankRun> duplicate = run_socket_ranks(
      3, [](SocketGroup&, RankRun&) {},
      [](SocketGroupOptions& o) {
        if (o.rank == 2) o.rank = 1;
        o.join_timeout = milliseconds(3000);
      });
  EXPECT_NE(duplicate[0].error.find("joined twice: two processes were given the same rank"),
            std::string::npos)
      << duplicate[0].error;
  const std::vector<RankRun> sizes = run_socket_ranks(
      2, [](SocketGroup&, RankRun&) {},
      [](SocketGroupOptions& o) {
        if (o.rank == 1) o.size = 3;
      });
  EXPECT_NE(sizes[0].error.find("rank 1 (from 127.0.0.1:"), std::string::npos) << sizes[0].error;
  EXPECT_NE(sizes[0].error.find("expects a group of 3 ranks, rank 0 of 2"), std::string::npos)
      << sizes[0].error;
}

TEST(DistSocketGroup, AStrangerOnThePortIsIgnored) {
  Listener listener = Listener::bind({"127.0.0.1", 0});
  const int port = listener.port();
  std::string error0, error1;
  float result = 0;
  std::thread rank0([&] {
    SocketGroupOptions o;
    o.size = 2;
    o.listen_fd = dup(listener.fd());
    o.join_timeout = kTestTimeout;
    try {
      auto g = SocketGroup::join(o);
      std::vector<float> v{1.5f};
      g->all_reduce_sum(v);
      result = v[0];
    } catch (const std::exception& e) {
      error0 = e.what();
    }
  });
  // Garbage, a frame of the wrong kind, a header announcing a terabyte (the payload never
  // comes), a third of a header, and a connection that says nothing: all dropped, the last three
  // held open until the group has formed.
  const auto start = Clock::now();
  const int silent = raw_connect(port);
  const int huge = raw_connect(port);
  const int partial = raw_connect(port);  // a third of a header, then nothing
  const uint32_t tag = 1;
  const uint64_t terabyte = uint64_t{1} << 40;
  ASSERT_EQ(write(huge, &tag, 4), 4);
  ASSERT_EQ(write(huge, &terabyte, 8), 8);
  ASSERT_EQ(write(partial, &tag, 4), 4);
  {
    Connection junk = connect_until({"127.0.0.1", port}, Clock::now() + kTestTimeout);
    const std::string text = "GET / HTTP/1.1\r\n\r\n";
    junk.send(0x20544547, std::as_bytes(std::span<const char>(text.data(), text.size())));
    Connection wrong = connect_until({"127.0.0.1", port}, Clock::now() + kTestTimeout);
    wrong.send(4, {});
  }
  std::thread rank1([&] {
    SocketGroupOptions o;
    o.rank = 1;
    o.size = 2;
    o.address = {"127.0.0.1", port};
    o.join_timeout = kTestTimeout;
    try {
      auto g = SocketGroup::join(o);
      std::vector<float> v{2.25f};
      g->all_reduce_sum(v);
    } catch (const std::exception& e) {
      error1 = e.what();
    }
  });
  rank0.join();
  rank1.join();
  const auto took = Clock::now() - start;
  close(silent);
  close(huge);
  close(partial);
  // The silent connection, the lying header and the partial one had 3 s each to introduce
  // themselves; the group formed without waiting for them.
  EXPECT_LT(took, std::chrono::milliseconds(2500));
  EXPECT_EQ(error0, "");
  EXPECT_EQ(error1, "");
  EXPECT_EQ(result, 3.75f);
}

TEST(DistSocketGroup, ARankThatDiesFailsTheOthersAtOnce) {
  const auto start = Clock::now();
  const std::vector<RankRun> runs = run_socket_ranks(3, [](SocketGroup& g, RankRun&) {
    std::vector<float> v(8, 1.f);
    g.all_reduce_sum(v);
    if (g.rank() == 2) throw std::runtime_error("rank 2 dies");  // its connection closes
    g.all_reduce_sum(v);
  });
  const auto elapsed = Clock::now() - start;
  EXPECT_EQ(runs[2].error, "rank 2 dies");
  EXPECT_NE(runs[0].error.find("all_reduce_sum at collective #1: the connection to rank 2"),
            std::string::npos)
      << runs[0].error;
  EXPECT_NE(runs[0].error.find("closed"), std::string::npos) << runs[0].error;
  // Rank 1 learns it from rank 0's abort (or its closed connection), with the cause.
  EXPECT_NE(runs[1].error.find("rank 2"), std::string::npos) << runs[1].error;
  EXPECT_LT(elapsed, kTestTimeout / 2) << "a dead rank must fail the others before the timeout";
}

TEST(DistSocketGroup, ARankThatNeverArrivesTimesOut) {
  const std::vector<RankRun> runs = run_socket_ranks(
      2,
      [](SocketGroup& g, RankRun&) {
        std::vector<float> v(2, 1.f);
        if (g.rank() == 1) std::this_thread::sleep_for(milliseconds(1500));
        g.all_reduce_sum(v);
      },
      [](SocketGroupOptions& o) { o.collective_timeout = milliseconds(300); });
  EXPECT_EQ(runs[0].error,
            "all_reduce_sum at collective #0: rank 1 did not arrive within the 300 ms timeout "
            "(rank 0 waiting); the group is aborted");
  EXPECT_NE(runs[1].error.find("aborted"), std::string::npos) << runs[1].error;
}

TEST(DistSocketGroup, CommandsReachEveryWorkerAndFailedRepliesAreNamed) {
  const std::vector<RankRun> runs = run_socket_ranks(3, [](SocketGroup& g, RankRun& run) {
    if (g.rank() == 0) {
      for (const std::string command : {"first", "second"}) {
        g.send_command(std::as_bytes(std::span<const char>(command.data(), command.size())));
        try {
          g.collect_replies(command);
          run.notes.push_back(command + ": ok");
        } catch (const Error& e) {
          run.notes.push_back(command + ": " + e.what());
        }
      }
      return;
    }
    for (int i = 0; i < 2; ++i) {
      const std::vector<std::byte> bytes = g.receive_command();
      const std::string command(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      run.notes.push_back(command);
      g.send_reply(command == "second" && g.rank() == 2 ? "no such adapter" : "");
    }
  });
  for (const RankRun& run : runs) EXPECT_EQ(run.error, "");
  EXPECT_EQ(runs[0].notes,
            (std::vector<std::string>{"first: ok", "second: rank 2: no such adapter"}));
  EXPECT_EQ(runs[1].notes, (std::vector<std::string>{"first", "second"}));
  EXPECT_EQ(runs[2].notes, (std::vector<std::string>{"first", "second"}));
}

TEST(DistSocketGroup, WorkersLearnThatRankZeroIsGone) {
  const std::vector<RankRun> runs = run_socket_ranks(2, [](SocketGroup& g, RankRun&) {
    if (g.rank() == 0) return;  // rank 0 ends: its connections close
    (void)g.receive_command();
  });
  EXPECT_EQ(runs[0].error, "");
  EXPECT_NE(runs[1].error.find("the connection to rank 0 (127.0.0.1:"), std::string::npos)
      << runs[1].error;
  EXPECT_NE(runs[1].error.find("closed"), std::string::npos) << runs[1].error;
}

// A process that joins properly and then sends calls no moelora rank would (another build, a
// corrupt stream): rank 0 answers each with a named verdict and goes on; a call for another
// collective # breaks the group with both numbers named.
TEST(DistSocketGroup, HostileCallsFromAJoinedRankAreNamedNotCrashes) {
  Listener listener = Listener::bind({"127.0.0.1", 0});
  const int port = listener.port();
  std::vector<std::string> errors;
  std::thread rank0([&] {
    SocketGroupOptions o;
    o.size = 2;
    o.listen_fd = dup(listener.fd());
    o.join_timeout = kTestTimeout;
    o.collective_timeout = kTestTimeout;
    auto g = SocketGroup::join(o);
    std::vector<float> send(4, 1.f), recv(8);
    const std::vector<int64_t> counts = {2, 2};
    for (int i = 0; i < 4; ++i) {
      try {
        if (i == 2) {
          std::vector<float> in(4, 1.f), out(2);
          g->reduce_scatter_sum(in, out);
        } else {
          g->all_to_all_v(send, counts, recv, counts);
        }
        errors.push_back("no error");
      } catch (const Error& e) {
        errors.push_back(e.what());
      }
    }
  });
  Connection c = connect_until({"127.0.0.1", port}, Clock::now() + kTestTimeout);
  c.send(1, encode_join({kProtocolVersion, 1, 2, ""}));
  ASSERT_TRUE(c.receive(Clock::now() + kTestTimeout).has_value());  // welcome
  auto hostile = [&](const detail::Call& call, uint64_t seq, size_t floats) {
    const std::vector<float> data(floats, 2.f);
    c.send(6, encode_collective_head(call, seq, floats),
           std::as_bytes(std::span<const float>(data)));
    (void)c.receive(Clock::now() + kTestTimeout);  // the verdict (or the abort)
  };
  // 1. Counts that promise 5 floats with none sent.
  const std::vector<int64_t> five = {5, 0}, two = {2, 2}, one = {4};
  detail::Call a2a;
  a2a.op = detail::Op::kAllToAllV;
  a2a.send_counts = five;
  a2a.recv_counts = two;
  a2a.recv_count = 4;
  hostile(a2a, 0, 0);
  // 2. A count vector of one entry in a group of two.
  a2a.send_counts = one;
  a2a.send_count = 4;
  hostile(a2a, 1, 4);
  // 3. A reduce_scatter whose send is not size x recv.
  detail::Call scatter;
  scatter.op = detail::Op::kReduceScatterSum;
  scatter.send_count = 3;
  scatter.recv_count = 2;
  hostile(scatter, 2, 3);
  // 4. Another collective #.
  a2a.send_counts = two;
  hostile(a2a, 7, 4);
  rank0.join();
  ASSERT_EQ(errors.size(), 4u);
  EXPECT_EQ(errors[0],
            "all_to_all_v at collective #0: rank 1: send_counts[0..0] sum to 5 floats but send "
            "has only 0");
  EXPECT_EQ(errors[1],
            "all_to_all_v at collective #1: rank 1: send_counts has 1 entries, expected one per "
            "rank (2)");
  EXPECT_EQ(errors[2],
            "reduce_scatter_sum at collective #2: rank 1: send has 3 floats, expected size 2 x "
            "recv 2");
  EXPECT_EQ(errors[3], "all_to_all_v: rank 1 is at collective #7 while rank 0 is at #3");
}

TEST(DistSocketGroup, AbortFromAnotherThreadWakesABlockedRankWithItsReason) {
  std::thread stopper;
  const std::vector<RankRun> runs = run_socket_ranks(2, [&](SocketGroup& g, RankRun&) {
    if (g.rank() == 1) {
      std::this_thread::sleep_for(milliseconds(1500));  // arrives late: rank 0 is blocked
      return;
    }
    stopper = std::thread([&g] {
      std::this_thread::sleep_for(milliseconds(200));
      g.abort("the operator stopped the job");
    });
    std::vector<float> v(3, 1.f);
    try {
      g.all_reduce_sum(v);
    } catch (...) {
      stopper.join();  // before the group dies with this scope
      throw;
    }
    stopper.join();
  });
  EXPECT_EQ(runs[0].error, "aborted on rank 0: the operator stopped the job");
}

TEST(DistSocketGroup, AWorkerThatNeverRepliesIsNamedAtTheTimeout) {
  const std::vector<RankRun> runs = run_socket_ranks(
      3,
      [](SocketGroup& g, RankRun&) {
        if (g.rank() == 0) {
          const std::string c = "load";
          g.send_command(std::as_bytes(std::span<const char>(c.data(), c.size())));
          g.collect_replies("loading 'sql'", milliseconds(300));
          return;
        }
        (void)g.receive_command();
        if (g.rank() == 1) g.send_reply("");
        std::this_thread::sleep_for(milliseconds(1000));
      },
      [](SocketGroupOptions& o) { o.collective_timeout = milliseconds(5000); });
  EXPECT_EQ(runs[0].error, "rank 2 did not finish loading 'sql' within the 300 ms timeout");
}

TEST(DistTcp, HostPortParsing) {
  EXPECT_EQ(parse_host_port("10.0.0.1:29500", "--dist-init-addr").text(), "10.0.0.1:29500");
  EXPECT_EQ(parse_host_port("node-0:1", "--dist-init-addr").host, "node-0");
  const HostPort v6 = parse_host_port("[::1]:8000", "--dist-init-addr");
  EXPECT_EQ(v6.host, "::1");
  EXPECT_EQ(v6.port, 8000);
  EXPECT_EQ(v6.text(), "[::1]:8000");
  for (const char* bad : {"", "host", "host:", ":80", "host:0", "host:65536", "host:8x", "a:b:1",
                          "[::1]8000", "host:123456"}) {
    SCOPED_TRACE(bad);
    EXPECT_NE(error_message([&] { parse_host_port(bad, "--dist-init-addr"); },
                            ErrorCode::kInvalidArgument)
                  .find("--dist-init-addr '" + std::string(bad) + "' is not HOST:PORT"),
              std::string::npos);
  }
}

TEST(DistTcp, MalformedPayloadsAndFramesAreErrors) {
  ByteWriter w;
  w.put<uint32_t>(7).put_string("abc");
  const std::vector<std::byte> bytes = w.bytes();
  ByteReader ok(bytes, "a test frame");
  EXPECT_EQ(ok.get<uint32_t>(), 7u);
  EXPECT_EQ(ok.get_string(), "abc");
  ByteReader cut(std::span<const std::byte>(bytes).first(bytes.size() - 1), "a test frame");
  (void)cut.get<uint32_t>();
  EXPECT_NE(error_message([&] { cut.get_string(); }, ErrorCode::kInvalidArgument)
                .find("a test frame is malformed: it announces 3 items of 1 bytes with only 2"),
            std::string::npos);

  // The header's wire bytes: tag then length, 12 bytes, read back as written.
  std::byte header[kFrameHeaderBytes];
  write_frame_header({0xA1B2C3D4u, (uint64_t{1} << 40) + 3}, header);
  const FrameHeader back = read_frame_header(header);
  EXPECT_EQ(back.tag, 0xA1B2C3D4u);
  EXPECT_EQ(back.length, (uint64_t{1} << 40) + 3);
  uint32_t raw_tag = 0;
  std::memcpy(&raw_tag, header, 4);
  EXPECT_EQ(raw_tag, 0xA1B2C3D4u) << "the tag leads the header";

  // A frame header announcing more than kMaxFramePayload is refused without allocating it.
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  Connection reader(fds[0], "the test peer");
  const uint32_t tag = 5;
  const uint64_t length = kMaxFramePayload + 1;
  ASSERT_EQ(write(fds[1], &tag, 4), 4);
  ASSERT_EQ(write(fds[1], &length, 8), 8);
  EXPECT_NE(error_message([&] { reader.receive(Clock::now() + kTestTimeout); },
                          ErrorCode::kInvalidArgument)
                .find("a frame from the test peer says its payload has"),
            std::string::npos);
  // Nothing arrives before the deadline: nullopt, not an error.
  Connection idle(fds[1], "the idle peer");
  EXPECT_FALSE(idle.receive(Clock::now() + milliseconds(50)).has_value());
}

}  // namespace
}  // namespace moelora::dist
