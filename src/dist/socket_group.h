// A group of ranks in separate processes (one per GPU, or CPU ranks for the reference backend),
// joined over TCP at rank 0's address, as torchrun's rendezvous or SGLang's --dist-init-addr.
//
// Two jobs:
//   - Control plane for every backend: the join itself (every rank says who it is and what it
//     runs; rank 0 admits the group only when all `size` ranks arrived with the same
//     fingerprint, and hands each the same `welcome` payload, e.g. the NCCL unique id), then
//     commands from rank 0 (the serving loop's step, an adapter to load) and each worker's reply.
//   - The CPU backend's collectives (Communicator): every rank sends its call to rank 0, which
//     checks the calls against each other and computes every rank's result with the same rules
//     as InProcessGroup (collective_rules.h): sums in rank order, so the results are bitwise
//     those of the threads' group. GPU ranks use NCCL (src/nccl) for their collectives instead.
//
// Failure is always an error that names the rank and the cause, never a hang: a rank that does
// not join by the join deadline, a peer whose connection closes (its process died), a collective
// a rank does not arrive at within the collective timeout, mismatched calls. After any of them
// the group is broken: every later call throws the first cause.
//
// Threads: one thread uses the group (the step thread on rank 0, the worker loop elsewhere);
// abort() may come from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dist/collective_rules.h"
#include "dist/communicator.h"
#include "dist/tcp.h"

namespace moelora::dist {

struct SocketGroupOptions {
  int rank = 0;
  int size = 1;
  // Where rank 0 listens and the others connect ("HOST:PORT").
  HostPort address;
  // Rank 0 only: an inherited listening socket to use instead of binding `address` (the
  // launcher binds it before starting the ranks). -1: bind `address`.
  int listen_fd = -1;
  std::chrono::milliseconds join_timeout{std::chrono::minutes(5)};
  std::chrono::milliseconds collective_timeout = kDefaultCollectiveTimeout;
  // What this rank runs (model, split, options), readable: ranks whose fingerprints differ are
  // refused at the join with both texts in the error.
  std::string fingerprint;
  // Rank 0 only: the payload every rank receives once the group is complete.
  std::string welcome;
};

class SocketGroup final : public Communicator {
 public:
  // Joins (rank 0: listens, admits, welcomes; others: connect, introduce themselves, wait to be
  // admitted). Throws when the group cannot form before join_timeout, naming the ranks missing.
  static std::unique_ptr<SocketGroup> join(const SocketGroupOptions& options);
  ~SocketGroup() override;
  SocketGroup(const SocketGroup&) = delete;
  SocketGroup& operator=(const SocketGroup&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& welcome() const { return welcome_; }

  // Control plane. Rank 0 sends a command to every worker; a worker waits for the next one as
  // long as it takes (throws when rank 0 closed the connection or aborted the group), runs it and
  // replies ("" when it went well, else the error's message). collect_replies() on rank 0 waits
  // (`timeout`, else the collective timeout) for every worker's reply and throws the failures,
  // naming the ranks; the group stays usable after failed replies.
  void send_command(std::span<const std::byte> command);
  std::vector<std::byte> receive_command();
  void send_reply(const std::string& error);
  // `what` names the command in errors ("write_slot 'sql'").
  void collect_replies(const std::string& what,
                       std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  void all_reduce_sum(std::span<float> inout) override;
  void all_gather(std::span<const float> send, std::span<float> recv) override;
  void reduce_scatter_sum(std::span<const float> send, std::span<float> recv) override;
  void all_to_all_v(std::span<const float> send, std::span<const int64_t> send_counts,
                    std::span<float> recv, std::span<const int64_t> recv_counts) override;
  void broadcast(std::span<float> buf, int root) override;
  void barrier() override;
  // Marks the group broken and closes the connections, so peers blocked on this rank fail at
  // once (their error names this rank's connection as closed).
  void abort(const std::string& reason) override;

  // Rank 0, between commands (no frame is due then): a worker connection with anything to read
  // means the worker closed it or broke the group, and the group breaks with that cause. Returns
  // at once; for the thread that uses the group.
  void check_peers();

  // Breaks the group from the thread that uses it, telling every peer `reason` first (abort()
  // only closes the connections, so the peers learn just that this rank went away).
  void break_group(const std::string& reason);

  bool broken() const { return broken_.load(); }
  std::string failure() const;  // the first cause, once broken ("" before)

 private:
  SocketGroup(int rank, int size, std::chrono::milliseconds collective_timeout);

  // Runs this rank's part of one collective described by `call`; writes this rank's result into
  // `out` (result floats), except the broadcast root.
  void run(const detail::Call& call, float* out);
  // Throws the first cause when the group is broken.
  void check_usable(const char* what) const;
  // Breaks the group with `reason`: tells the peers (best effort), closes, throws kInternal.
  [[noreturn]] void fail(const std::string& reason);
  // A frame from rank `from` that is not what the protocol expects at this point.
  [[noreturn]] void unexpected(const Frame& frame, int from, const char* expected);

  const int rank_;
  const int size_;
  const std::chrono::milliseconds collective_timeout_;
  std::string welcome_;
  // Rank 0: connections to ranks 1..size-1 at [r]; others: the connection to rank 0 at [0].
  std::vector<Connection> peers_;
  uint64_t next_seq_ = 0;  // this rank's next collective #
  std::vector<float> scratch_;
  std::atomic<bool> broken_{false};
  mutable std::mutex reason_mutex_;
  std::string reason_;  // the first cause, once broken
};

}  // namespace moelora::dist
