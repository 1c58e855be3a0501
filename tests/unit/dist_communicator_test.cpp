// DistCommunicator: the in-process communicator (ranks as threads, NCCL's contract) against
// direct computations for sizes 1-8 with seeded random data, empty buffers and uneven
// all_to_all_v counts; bitwise determinism of the rank-order sums; an error on every rank for
// inconsistent calls; timeouts and aborts that fail rather than hang; run_ranks rethrowing the
// cause; and a long run of mixed collectives.
//
// Ranks record what they got; the main thread compares after run_ranks, so no gtest assertion
// runs on a rank thread. Timeouts are generous (kTestTimeout) except where the timeout is the
// subject, and no test asserts how fast anything happens.
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"

namespace moelora::dist {
namespace {

using std::chrono::milliseconds;
using Buffers = std::vector<std::vector<float>>;  // (size) one buffer per rank

constexpr milliseconds kTestTimeout{10000};  // a bug fails the test instead of hanging it
constexpr int kSizes[] = {1, 2, 3, 4, 8};
constexpr size_t kCounts[] = {0, 1, 7, 257};

// count floats of mixed magnitude (1e-3 .. 1e3, both signs): the order of a sum changes its
// rounding, so a sum in any other order than 0, 1, ..., n-1 is caught.
std::vector<float> random_floats(std::mt19937& rng, size_t count) {
  std::uniform_real_distribution<float> mantissa(-1.f, 1.f);
  std::uniform_int_distribution<int> exponent(-3, 3);
  std::vector<float> v(count);
  for (float& x : v) x = mantissa(rng) * std::pow(10.f, static_cast<float>(exponent(rng)));
  return v;
}

Buffers random_buffers(int size, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  Buffers buffers;
  for (int r = 0; r < size; ++r) buffers.push_back(random_floats(rng, count));
  return buffers;
}

// (count): sum over ranks r of inputs[r][offset + i], sequentially in rank order.
std::vector<float> rank_order_sum(const Buffers& inputs, size_t offset, size_t count) {
  std::vector<float> sum(count);
  for (size_t i = 0; i < count; ++i) {
    float s = inputs[0][offset + i];
    for (size_t r = 1; r < inputs.size(); ++r) s += inputs[r][offset + i];
    sum[i] = s;
  }
  return sum;
}

// Bit patterns, not values: -0.0 vs 0.0 and a last-bit rounding difference both count.
void expect_bitwise_equal(const std::vector<float>& actual, const std::vector<float>& expected,
                          const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (std::bit_cast<uint32_t>(actual[i]) != std::bit_cast<uint32_t>(expected[i])) {
      ADD_FAILURE() << what << ": first difference at " << i << ": got " << actual[i]
                    << ", expected " << expected[i];
      return;
    }
  }
}

// Calls check(size, count) for every group size and buffer length of the sweeps.
void sweep(const std::function<void(int, size_t)>& check) {
  for (int size : kSizes) {
    for (size_t count : kCounts) {
      SCOPED_TRACE(testing::Message() << "size " << size << " count " << count);
      check(size, count);
    }
  }
}

std::string rank_label(int r) {
  return "rank " + std::to_string(r);
}

// Runs body on `size` ranks and returns what each rank's body returned.
Buffers outputs_of(int size, const std::function<std::vector<float>(Communicator&)>& body) {
  Buffers outputs(size);
  run_ranks(
      size, [&](Communicator& comm) { outputs[comm.rank()] = body(comm); }, kTestTimeout);
  return outputs;
}

struct RankError {
  bool thrown = false;
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
};

// Runs body on every rank and returns the moelora::Error each rank threw (thrown == false for a
// rank that returned normally).
std::vector<RankError> errors_of(int size, const std::function<void(Communicator&)>& body) {
  std::vector<RankError> errors(size);
  run_ranks(
      size,
      [&](Communicator& comm) {
        try {
          body(comm);
        } catch (const Error& e) {
          errors[comm.rank()] = {true, e.code(), e.what()};
        }
      },
      kTestTimeout);
  return errors;
}

// Every rank threw an error with `code` whose message contains each of `parts`.
void expect_error_on_every_rank(const std::vector<RankError>& errors, ErrorCode code,
                                const std::vector<std::string>& parts) {
  for (size_t r = 0; r < errors.size(); ++r) {
    ASSERT_TRUE(errors[r].thrown) << "rank " << r << " did not fail";
    EXPECT_EQ(errors[r].code, code) << "rank " << r << ": " << errors[r].message;
    for (const std::string& part : parts) {
      EXPECT_NE(errors[r].message.find(part), std::string::npos)
          << "rank " << r << ": '" << errors[r].message << "' lacks '" << part << "'";
    }
  }
}

TEST(DistCommunicator, AllReduceSumsInRankOrder) {
  sweep([](int size, size_t count) {
    const Buffers inputs = random_buffers(size, count, 1000 * size + uint32_t(count));
    const Buffers outputs = outputs_of(size, [&](Communicator& comm) {
      std::vector<float> buf = inputs[comm.rank()];
      comm.all_reduce_sum(buf);
      return buf;
    });
    const std::vector<float> expected = rank_order_sum(inputs, 0, count);
    for (int r = 0; r < size; ++r) expect_bitwise_equal(outputs[r], expected, rank_label(r));
  });
}

TEST(DistCommunicator, AllReduceIsBitwiseDeterministic) {
  constexpr int kSize = 8;
  constexpr size_t kCount = 4096;
  const Buffers inputs = random_buffers(kSize, kCount, 42);
  const std::vector<float> expected = rank_order_sum(inputs, 0, kCount);
  // The data is order-sensitive: summing in reverse rank order rounds differently somewhere, so
  // matching the rank-order sum bit for bit means something.
  const Buffers reversed(inputs.rbegin(), inputs.rend());
  const std::vector<float> reverse_sum = rank_order_sum(reversed, 0, kCount);
  size_t differing = 0;
  for (size_t i = 0; i < kCount; ++i) differing += expected[i] != reverse_sum[i];
  ASSERT_GT(differing, 0u);

  for (int run = 0; run < 3; ++run) {
    const Buffers outputs = outputs_of(kSize, [&](Communicator& comm) {
      std::vector<float> buf = inputs[comm.rank()];
      comm.all_reduce_sum(buf);
      return buf;
    });
    for (int r = 0; r < kSize; ++r) {
      expect_bitwise_equal(outputs[r], expected,
                           "run " + std::to_string(run) + " " + rank_label(r));
    }
  }
}

TEST(DistCommunicator, AllGatherIsRankMajor) {
  sweep([](int size, size_t count) {
    const Buffers inputs = random_buffers(size, count, 2000 * size + uint32_t(count));
    const Buffers outputs = outputs_of(size, [&](Communicator& comm) {
      std::vector<float> recv(size * count, -7.f);
      comm.all_gather(inputs[comm.rank()], recv);
      return recv;
    });
    std::vector<float> expected;
    for (const auto& in : inputs) expected.insert(expected.end(), in.begin(), in.end());
    for (int r = 0; r < size; ++r) expect_bitwise_equal(outputs[r], expected, rank_label(r));
  });
}

TEST(DistCommunicator, ReduceScatterSumsEachRanksBlockInRankOrder) {
  sweep([](int size, size_t count) {
    const Buffers inputs = random_buffers(size, size * count, 3000 * size + uint32_t(count));
    const Buffers outputs = outputs_of(size, [&](Communicator& comm) {
      std::vector<float> recv(count, -7.f);
      comm.reduce_scatter_sum(inputs[comm.rank()], recv);
      return recv;
    });
    for (int r = 0; r < size; ++r) {
      expect_bitwise_equal(outputs[r], rank_order_sum(inputs, r * count, count), rank_label(r));
    }
  });
}

TEST(DistCommunicator, AllToAllVRoutesUnevenCounts) {
  for (int size : kSizes) {
    std::mt19937 rng(4000 + size);
    // counts[i][j]: floats rank i sends to rank j; every third pair sends nothing.
    std::vector<std::vector<int64_t>> counts(size, std::vector<int64_t>(size));
    for (int i = 0; i < size; ++i) {
      for (int j = 0; j < size; ++j) counts[i][j] = (i * size + j) % 3 == 0 ? 0 : rng() % 6;
    }
    // Float k of the block from i to j is i * 10000 + j * 100 + k: exact, and tells where it
    // came from.
    auto payload = [](int from, int to, int64_t k) { return float(from * 10000 + to * 100 + k); };
    constexpr size_t kSlack = 3;  // capacity beyond the counts, must stay untouched
    const Buffers outputs = outputs_of(size, [&](Communicator& comm) {
      const int me = comm.rank();
      std::vector<float> send;
      std::vector<int64_t> recv_counts(size);
      int64_t recv_total = 0;
      for (int j = 0; j < size; ++j) {
        for (int64_t k = 0; k < counts[me][j]; ++k) send.push_back(payload(me, j, k));
        recv_counts[j] = counts[j][me];
        recv_total += recv_counts[j];
      }
      std::vector<float> recv(recv_total + kSlack, -7.f);
      comm.all_to_all_v(send, counts[me], recv, recv_counts);
      return recv;
    });
    for (int j = 0; j < size; ++j) {
      std::vector<float> expected;
      for (int i = 0; i < size; ++i) {
        for (int64_t k = 0; k < counts[i][j]; ++k) expected.push_back(payload(i, j, k));
      }
      expected.insert(expected.end(), kSlack, -7.f);
      expect_bitwise_equal(outputs[j], expected,
                           "size " + std::to_string(size) + " " + rank_label(j));
    }
  }
}

TEST(DistCommunicator, BroadcastCopiesTheRootsBuffer) {
  sweep([](int size, size_t count) {
    for (int root = 0; root < size; ++root) {
      const Buffers inputs = random_buffers(size, count, 5000 * size + 100 * root + count);
      const Buffers outputs = outputs_of(size, [&](Communicator& comm) {
        std::vector<float> buf = inputs[comm.rank()];
        comm.broadcast(buf, root);
        return buf;
      });
      for (int r = 0; r < size; ++r) {
        expect_bitwise_equal(outputs[r], inputs[root],
                             rank_label(r) + " root " + std::to_string(root));
      }
    }
  });
}

TEST(DistCommunicator, BarrierMakesEarlierWritesVisible) {
  for (int size : kSizes) {
    std::vector<int> slots(size, -1);  // slots[r] written by rank r only, between barriers
    std::vector<int> stale(size, 0);
    run_ranks(
        size,
        [&](Communicator& comm) {
          for (int round = 0; round < 50; ++round) {
            slots[comm.rank()] = round;
            comm.barrier();
            for (int r = 0; r < size; ++r) stale[comm.rank()] += slots[r] != round;
            comm.barrier();  // nobody writes the next round before all have read this one
          }
        },
        kTestTimeout);
    for (int r = 0; r < size; ++r) EXPECT_EQ(stale[r], 0) << "size " << size << " rank " << r;
  }
}

TEST(DistCommunicator, InPlaceAllGatherAndReduceScatter) {
  constexpr int kSize = 4;
  constexpr size_t kCount = 5;
  const Buffers inputs = random_buffers(kSize, kSize * kCount, 6000);
  Buffers gathered(kSize), scattered(kSize);
  run_ranks(
      kSize,
      [&](Communicator& comm) {
        const int me = comm.rank();
        // NCCL's in-place forms: this rank's block of the big buffer is the small one.
        std::vector<float> gather(kSize * kCount, -7.f);
        std::copy_n(inputs[me].begin(), kCount, gather.begin() + me * kCount);
        comm.all_gather(std::span<const float>(gather).subspan(me * kCount, kCount), gather);
        gathered[me] = gather;
        std::vector<float> scatter = inputs[me];
        comm.reduce_scatter_sum(scatter, std::span<float>(scatter).subspan(me * kCount, kCount));
        scattered[me].assign(scatter.begin() + me * kCount, scatter.begin() + (me + 1) * kCount);
      },
      kTestTimeout);
  std::vector<float> expected_gather;
  for (const auto& in : inputs)
    expected_gather.insert(expected_gather.end(), in.begin(), in.begin() + kCount);
  for (int r = 0; r < kSize; ++r) {
    expect_bitwise_equal(gathered[r], expected_gather, "all_gather rank " + std::to_string(r));
    expect_bitwise_equal(scattered[r], rank_order_sum(inputs, r * kCount, kCount),
                         "reduce_scatter_sum rank " + std::to_string(r));
  }
}

TEST(DistCommunicator, MismatchedCollectivesFailOnEveryRank) {
  const auto errors = errors_of(3, [](Communicator& comm) {
    comm.barrier();  // collective #0 matches
    std::vector<float> buf(4, 1.f);
    if (comm.rank() == 1) {
      comm.barrier();
    } else {
      comm.all_reduce_sum(buf);
    }
  });
  expect_error_on_every_rank(errors, ErrorCode::kInvalidArgument,
                             {"collective #1", "rank 1 called barrier", "expected all_reduce_sum"});
}

TEST(DistCommunicator, MismatchedSizesAndRootsFailOnEveryRank) {
  struct Case {
    int size;
    std::function<void(Communicator&)> body;
    std::vector<std::string> parts;  // the message must contain each
  };
  const std::vector<Case> cases = {
      {2,
       [](Communicator& comm) {
         std::vector<float> buf(comm.rank() == 0 ? 10 : 12);
         comm.all_reduce_sum(buf);
       },
       {"all_reduce_sum at collective #0", "rank 1 has count 12, expected 10"}},
      {3,
       [](Communicator& comm) {
         std::vector<float> buf(4);
         comm.broadcast(buf, comm.rank() == 2 ? 1 : 0);
       },
       {"broadcast at collective #0", "rank 2 has root 1, expected 0"}},
      {3,
       [](Communicator& comm) {
         std::vector<float> send(comm.rank() == 2 ? 3 : 2), recv(3 * send.size());
         comm.all_gather(send, recv);
       },
       {"all_gather at collective #0", "rank 2 has send count 3, expected 2"}},
      {3,
       [](Communicator& comm) {
         std::vector<float> send(2), recv(comm.rank() == 1 ? 7 : 6);
         comm.all_gather(send, recv);
       },
       {"all_gather at collective #0", "rank 1: recv has 7 floats, expected size 3 x send 2 = 6"}},
      {2,
       [](Communicator& comm) {
         std::vector<float> recv(comm.rank() == 1 ? 4 : 3), send(2 * recv.size());
         comm.reduce_scatter_sum(send, recv);
       },
       {"reduce_scatter_sum at collective #0", "rank 1 has recv count 4, expected 3"}},
      {3,
       [](Communicator& comm) {
         std::vector<float> send(3), recv(4);
         std::vector<int64_t> send_counts(3, 1), recv_counts(3, 1);
         if (comm.rank() == 2) recv_counts[0] = 2;
         comm.all_to_all_v(send, send_counts, recv, recv_counts);
       },
       {"all_to_all_v at collective #0", "rank 0 sends 1 floats to rank 2",
        "rank 2 expects 2 from rank 0"}},
      {2,
       [](Communicator& comm) {
         std::vector<float> send(2), recv(2);
         std::vector<int64_t> send_counts(2, 1), recv_counts(2, 1);
         if (comm.rank() == 1) send_counts[0] = -1;
         comm.all_to_all_v(send, send_counts, recv, recv_counts);
       },
       {"all_to_all_v at collective #0", "rank 1: send_counts[0] is -1, expected >= 0"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.parts.back());
    expect_error_on_every_rank(errors_of(c.size, c.body), ErrorCode::kInvalidArgument, c.parts);
  }
}

TEST(DistCommunicator, MissingRankTimesOutNamingIt) {
  InProcessGroup group(3, milliseconds(200));
  std::vector<RankError> errors(2);
  std::vector<std::thread> waiting;
  for (int r = 0; r < 2; ++r) {
    waiting.emplace_back([&, r] {
      std::vector<float> buf(8, 1.f);
      try {
        group.rank(r).all_reduce_sum(buf);  // rank 2 never comes
      } catch (const Error& e) {
        errors[r] = {true, e.code(), e.what()};
      }
    });
  }
  for (auto& t : waiting) t.join();
  expect_error_on_every_rank(
      errors, ErrorCode::kInternal,
      {"all_reduce_sum at collective #0", "rank 2 did not arrive", "200 ms"});
  // The late rank fails at once instead of reading the waiters' stale buffers.
  std::vector<float> buf(8, 1.f);
  try {
    group.rank(2).all_reduce_sum(buf);
    ADD_FAILURE() << "the late rank's collective succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("aborted by rank"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(group.failed_from_remote_abort(2));
}

TEST(DistCommunicator, AbortFailsBlockedAndLaterCollectives) {
  const auto errors = errors_of(4, [](Communicator& comm) {
    std::vector<float> buf(16, 1.f);
    if (comm.rank() == 0) {
      // Give the others time to block (if they are late they fail on entry instead: same error).
      std::this_thread::sleep_for(milliseconds(20));
      comm.abort("out of memory while loading experts");
      comm.barrier();  // the aborting rank's own later collectives fail too
    } else {
      comm.all_reduce_sum(buf);
    }
  });
  expect_error_on_every_rank(errors, ErrorCode::kInternal,
                             {"aborted by rank 0", "out of memory while loading experts"});
}

struct RankFailure : std::exception {
  const char* what() const noexcept override { return "rank 2 failed to load its shard"; }
};

TEST(DistCommunicator, RunRanksRethrowsTheOriginalException) {
  std::vector<std::string> secondary(4);
  auto body = [&](Communicator& comm) {
    if (comm.rank() == 2) throw RankFailure();
    try {
      std::vector<float> buf(4, 1.f);
      comm.all_reduce_sum(buf);  // would wait for rank 2 forever without the abort
    } catch (const Error& e) {
      secondary[comm.rank()] = e.what();
      throw;
    }
  };
  EXPECT_THROW(run_ranks(4, body, kTestTimeout), RankFailure);
  for (int r : {0, 1, 3}) {
    EXPECT_NE(secondary[r].find("rank 2 threw: rank 2 failed to load its shard"), std::string::npos)
        << "rank " << r << ": " << secondary[r];
  }

  // Errors that every rank throws by itself are all causes: rank 0's is rethrown.
  auto mismatch = [](Communicator& comm) {
    std::vector<float> buf(comm.rank() == 0 ? 10 : 12);
    comm.all_reduce_sum(buf);
  };
  EXPECT_THROW(run_ranks(2, mismatch, kTestTimeout), Error);
}

// A rank that is done while the others still wait in a collective for it fails them at once
// (with the 60 s default timeout the test would otherwise take a minute), naming that rank.
TEST(DistCommunicator, RankThatReturnsEarlyFailsTheOthersAtOnce) {
  std::vector<std::string> errors(3);
  const auto start = std::chrono::steady_clock::now();
  auto body = [&](Communicator& comm) {
    if (comm.rank() == 2) return;  // forgot its share of the barrier
    try {
      comm.barrier();
    } catch (const Error& e) {
      errors[comm.rank()] = e.what();
      throw;
    }
  };
  EXPECT_THROW(run_ranks(3, body), Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  for (int r : {0, 1})
    EXPECT_NE(errors[r].find("rank 2 returned from its body"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  // Ranks that all finish their collectives and return: no error.
  run_ranks(3, [](Communicator& comm) {
    std::vector<float> buf(5, 1.f);
    comm.all_reduce_sum(buf);
  });
}

TEST(DistCommunicator, ManyMixedCollectivesBackToBack) {
  constexpr int kSize = 4;
  constexpr int kCalls = 5000;
  std::vector<int> wrong(kSize, 0);  // results that differ from the expected ones, per rank
  run_ranks(
      kSize,
      [&](Communicator& comm) {
        const int me = comm.rank();
        std::mt19937 rng(77);  // the same on every rank: the same sequence of collectives
        // Small integers: every sum is exact, so the expected values are simple formulas.
        auto value = [](int rank, int call, size_t i) {
          return float((rank + 1) * (i + 1) + call % 7);
        };
        auto sum_over_ranks = [&](int call, size_t i) {
          float sum = 0;
          for (int r = 0; r < kSize; ++r) sum += value(r, call, i);
          return sum;
        };
        for (int call = 0; call < kCalls; ++call) {
          const int op = int(rng() % 6);
          const size_t count = rng() % 9;
          std::vector<float> buf(count), out;
          for (size_t i = 0; i < count; ++i) buf[i] = value(me, call, i);
          switch (op) {
            case 0:
              comm.all_reduce_sum(buf);
              for (size_t i = 0; i < count; ++i) wrong[me] += buf[i] != sum_over_ranks(call, i);
              break;
            case 1:
              out.assign(kSize * count, -1.f);
              comm.all_gather(buf, out);
              for (size_t i = 0; i < out.size(); ++i) {
                wrong[me] += out[i] != value(int(i / count), call, i % count);
              }
              break;
            case 2: {
              std::vector<float> send(kSize * count);
              for (size_t i = 0; i < send.size(); ++i) send[i] = value(me, call, i);
              out.assign(count, -1.f);
              comm.reduce_scatter_sum(send, out);
              for (size_t i = 0; i < count; ++i) {
                wrong[me] += out[i] != sum_over_ranks(call, me * count + i);
              }
              break;
            }
            case 3: {
              // from rank i to rank j: (call + i + 2 j) % 3 floats of value i * 10 + j
              auto n = [call](int i, int j) { return int64_t((call + i + 2 * j) % 3); };
              std::vector<int64_t> send_counts(kSize), recv_counts(kSize);
              std::vector<float> send, expected;
              for (int j = 0; j < kSize; ++j) {
                send_counts[j] = n(me, j);
                recv_counts[j] = n(j, me);
                send.insert(send.end(), send_counts[j], float(me * 10 + j));
                expected.insert(expected.end(), recv_counts[j], float(j * 10 + me));
              }
              out.assign(expected.size(), -1.f);
              comm.all_to_all_v(send, send_counts, out, recv_counts);
              wrong[me] += out != expected;
              break;
            }
            case 4: {
              const int root = call % kSize;
              comm.broadcast(buf, root);
              for (size_t i = 0; i < count; ++i) wrong[me] += buf[i] != value(root, call, i);
              break;
            }
            default: comm.barrier();
          }
        }
      },
      kTestTimeout);
  for (int r = 0; r < kSize; ++r) EXPECT_EQ(wrong[r], 0) << "rank " << r;
}

TEST(DistCommunicator, RejectsBadGroupArguments) {
  EXPECT_THROW(InProcessGroup(0), Error);
  EXPECT_THROW(InProcessGroup(2, milliseconds(0)), Error);
  InProcessGroup group(2);
  EXPECT_EQ(group.size(), 2);
  EXPECT_EQ(group.rank(1).rank(), 1);
  EXPECT_EQ(group.rank(1).size(), 2);
  EXPECT_THROW(group.rank(2), Error);
  EXPECT_THROW(group.rank(-1), Error);
}

}  // namespace
}  // namespace moelora::dist
