// Collectives between the ranks of a sharded model (tensor / expert parallelism), and an
// in-process implementation whose ranks are threads.
//
// Why: the sharded model code is written once against Communicator. On GPUs it will run over
// NCCL; on a CPU (tests, CI) it runs over InProcessGroup, which keeps NCCL's contract and checks
// what NCCL cannot: a program that would hang or silently compute garbage under NCCL (ranks
// calling different collectives, inconsistent sizes or roots, a rank that never arrives) fails
// here with an error on every rank of the call that names the collective, its sequence number,
// the ranks and the expected vs actual value.
//
// Contract (NCCL's):
//   - Collectives are blocking and matched by call order: the k-th collective call of every rank
//     (k counted from 0 per group; messages write it "collective #k") is the same collective,
//     with the same sizes and root.
//   - Reductions sum in rank order 0, 1, ..., n-1, so results are bitwise identical on every
//     rank and equal to the sequential float sum ((x0 + x1) + x2) + ...
//   - Buffers belong to the caller and must stay valid and unmodified until the call returns.
//     A rank's send and receive buffers must not overlap (checked), except NCCL's in-place forms:
//     all_gather with send == recv + rank * send.size(), reduce_scatter_sum with
//     recv == send + rank * recv.size().
//   - After a collective throws, treat the group as broken (as an NCCL communicator after an
//     error): abort it and stop. A timeout or abort() makes every later collective fail.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace moelora::dist {

inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{std::chrono::seconds(60)};

// One rank's handle on a group of size() ranks. Each rank's handle is used from one thread;
// abort() may be called from any thread.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // inout (count): every rank gets sum over ranks r of inout_r, summed in rank order.
  virtual void all_reduce_sum(std::span<float> inout) = 0;

  // send (count) -> recv (size() * count), rank-major: rank r's send lands at recv[r * count].
  virtual void all_gather(std::span<const float> send, std::span<float> recv) = 0;

  // send (size() * count) -> recv (count): rank r gets sum over ranks of block r of send
  // (send[r * count, (r + 1) * count)), summed in rank order.
  virtual void reduce_scatter_sum(std::span<const float> send, std::span<float> recv) = 0;

  // Variable-size exchange (expert-parallel token dispatch / combine).
  //   send_counts (size()): send_counts[j] floats go to rank j; the blocks lie back to back in
  //                         send in rank order, starting at send[0].
  //   recv_counts (size()): recv_counts[j] floats come from rank j; back to back in recv in
  //                         rank order, starting at recv[0].
  // send / recv may be longer than the counts' sums (preallocated capacity); the rest of recv is
  // left as it was. Rank i's send_counts[j] must equal rank j's recv_counts[i].
  virtual void all_to_all_v(std::span<const float> send, std::span<const int64_t> send_counts,
                            std::span<float> recv, std::span<const int64_t> recv_counts) = 0;

  // buf (count): every rank gets root's buf. root is the same on every rank.
  virtual void broadcast(std::span<float> buf, int root) = 0;

  // Returns once every rank has called barrier(); writes made before it are visible after it.
  virtual void barrier() = 0;

  // Like ncclCommAbort: every rank blocked in, or later entering, a collective of this group
  // fails promptly with an error naming this rank and the reason. The first abort wins.
  virtual void abort(const std::string& reason) = 0;
};

// A group of `size` ranks in one process that share one rendezvous; rank(r) is used by one
// thread (the thread that plays rank r). A rank that waits longer than `timeout` for the others
// to arrive at a collective fails with an error naming the missing ranks, and aborts the group.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size, std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const;
  Communicator& rank(int r);

  // True when rank r's communicator has thrown because another rank aborted the group (or timed
  // out waiting): its failure is a consequence, not a cause. run_ranks uses it to rethrow the
  // cause.
  bool failed_from_remote_abort(int r) const;

 private:
  struct Shared;  // the rendezvous state, defined in communicator.cpp
  class Rank;
  std::unique_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

// Runs body(rank r's communicator) on `size` threads of one InProcessGroup, joins them all and
// then rethrows the first exception in rank order, skipping the errors that only follow from
// another rank's abort. A rank whose body throws aborts the group ("rank r threw: ..."), so the
// others fail instead of waiting for it; so does a rank whose body returns (it calls no more
// collectives), so a collective the others are still waiting in fails at once, not at the timeout.
void run_ranks(int size, const std::function<void(Communicator&)>& body,
               std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);

}  // namespace moelora::dist
