// InProcessGroup: NCCL-style collectives between the threads of one process.
//
// One rendezvous slot serves the group's collectives one after another. Collective #k runs in
// three steps:
//   arrive   each rank posts a Call (op, buffer pointers, sizes, root, problems with its own
//            arguments) into calls[rank]; the last to arrive checks the calls against each other
//            once and leaves the verdict for all ranks;
//   compute  without the lock, each rank reads the other ranks' buffers directly and writes only
//            its own output (reductions into a private scratch buffer);
//   depart   each rank waits until every rank has finished reading; the last to depart clears
//            the slot and advances `generation` to k + 1, which opens it for #k+1.
// No rank returns from #k before the slot has advanced, so a rank entering #k+1 always finds
// generation == k + 1, and a waiter compares the generation with its own k, never with a flag
// that a later collective could have reset (no ABA). All shared fields change under one mutex
// and every change is followed by notify_all, so no wake-up is lost.
//
// Reductions are copied into the caller's buffer only after departing: until then other ranks
// may still read that buffer (all_reduce_sum works in place).
#include "dist/communicator.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "core/error.h"

namespace moelora::dist {
namespace detail {

enum class Op { kAllReduceSum, kAllGather, kReduceScatterSum, kAllToAllV, kBroadcast, kBarrier };

// What one rank passed to one collective. The pointers are into the caller's buffers and stay
// valid until the collective's depart step.
struct Call {
  Op op = Op::kBarrier;
  const float* send = nullptr;  // (send_count) read by other ranks
  size_t send_count = 0;
  float* recv = nullptr;  // (recv_count) written by this rank only
  size_t recv_count = 0;
  std::span<const int64_t> send_counts;  // (group size) all_to_all_v only
  std::span<const int64_t> recv_counts;  // (group size) all_to_all_v only
  int root = 0;                          // broadcast only
  std::string local_error;  // what is wrong with this rank's own arguments; "" when nothing
};

}  // namespace detail

namespace {

using detail::Call;
using detail::Op;
using ::moelora::detail::concat;

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduceSum: return "all_reduce_sum";
    case Op::kAllGather: return "all_gather";
    case Op::kReduceScatterSum: return "reduce_scatter_sum";
    case Op::kAllToAllV: return "all_to_all_v";
    case Op::kBroadcast: return "broadcast";
    case Op::kBarrier: return "barrier";
  }
  return "unknown collective";
}

bool overlap(const float* a, size_t a_count, const float* b, size_t b_count) {
  if (a_count == 0 || b_count == 0) return false;
  const std::less<const float*> before;
  return before(a, b + b_count) && before(b, a + a_count);
}

Call make_call(Op op, std::span<const float> send, std::span<float> recv) {
  Call call;
  call.op = op;
  call.send = send.data();
  call.send_count = send.size();
  call.recv = recv.data();
  call.recv_count = recv.size();
  return call;
}

// "ranks 1, 3" / "rank 2": the ranks r with selected[r] == want.
std::string rank_list(const std::vector<char>& selected, bool want) {
  std::string names;
  int count = 0;
  for (size_t r = 0; r < selected.size(); ++r) {
    if (static_cast<bool>(selected[r]) != want) continue;
    names += (count++ ? ", " : "") + std::to_string(r);
  }
  return (count == 1 ? "rank " : "ranks ") + names;
}

// Checks the calls of collective #seq against each other: the first disagreement as a message,
// "" when they agree. Every rank throws this one message, so all ranks report the same problem.
std::string check_calls(const std::vector<Call>& calls, uint64_t seq) {
  const int size = static_cast<int>(calls.size());
  const Call& first = calls[0];
  const char* name = op_name(first.op);
  for (int r = 1; r < size; ++r) {
    if (calls[r].op != first.op) {
      return concat("collective #", seq, ": rank ", r, " called ", op_name(calls[r].op),
                    ", expected ", name, " as called by rank 0 (every rank must call the same",
                    " collectives in the same order)");
    }
  }
  for (int r = 0; r < size; ++r) {
    if (!calls[r].local_error.empty()) {
      return concat(name, " at collective #", seq, ": rank ", r, ": ", calls[r].local_error);
    }
  }
  // The first rank whose `what` differs from rank 0's.
  auto same_on_all = [&](const char* what, auto value_of) -> std::string {
    for (int r = 1; r < size; ++r) {
      if (value_of(calls[r]) != value_of(first)) {
        return concat(name, " at collective #", seq, ": rank ", r, " has ", what, " ",
                      value_of(calls[r]), ", expected ", value_of(first), " as on rank 0");
      }
    }
    return "";
  };
  auto send_count = [](const Call& c) { return c.send_count; };
  switch (first.op) {
    case Op::kAllReduceSum: return same_on_all("count", send_count);
    case Op::kAllGather: return same_on_all("send count", send_count);
    case Op::kReduceScatterSum:
      return same_on_all("recv count", [](const Call& c) { return c.recv_count; });
    case Op::kBroadcast: {
      std::string error = same_on_all("root", [](const Call& c) { return c.root; });
      return error.empty() ? same_on_all("count", send_count) : error;
    }
    case Op::kAllToAllV:
      for (int from = 0; from < size; ++from) {
        for (int to = 0; to < size; ++to) {
          const int64_t sent = calls[from].send_counts[to];
          const int64_t expected = calls[to].recv_counts[from];
          if (sent == expected) continue;
          return concat(name, " at collective #", seq, ": rank ", from, " sends ", sent,
                        " floats to rank ", to, " but rank ", to, " expects ", expected,
                        " from rank ", from, " (send_counts[", to, "] on rank ", from,
                        " must equal recv_counts[", from, "] on rank ", to, ")");
        }
      }
      return "";
    case Op::kBarrier: return "";
  }
  return "";
}

// all_to_all_v's own arguments: one count per rank, none negative, sums within the buffers.
std::string check_counts(const char* what, std::span<const int64_t> counts, int size,
                         size_t buffer_size, const char* buffer) {
  if (counts.size() != static_cast<size_t>(size)) {
    return concat(what, " has ", counts.size(), " entries, expected one per rank (", size, ")");
  }
  uint64_t total = 0;
  for (int r = 0; r < size; ++r) {
    if (counts[r] < 0) return concat(what, "[", r, "] is ", counts[r], ", expected >= 0");
    total += static_cast<uint64_t>(counts[r]);
    if (total > buffer_size) {
      return concat(what, "[0..", r, "] sum to ", total, " floats but ", buffer, " has only ",
                    buffer_size);
    }
  }
  return "";
}

// out (count) = sum over ranks r of calls[r].send[offset, offset + count), in rank order.
void sum_in_rank_order(const std::vector<Call>& calls, size_t offset, size_t count,
                       std::vector<float>& out) {
  out.assign(calls[0].send + offset, calls[0].send + offset + count);
  for (size_t r = 1; r < calls.size(); ++r) {
    const float* in = calls[r].send + offset;
    for (size_t i = 0; i < count; ++i) out[i] += in[i];
  }
}

}  // namespace

struct InProcessGroup::Shared {
  Shared(int size, std::chrono::milliseconds timeout)
      : size(size), timeout(timeout), calls(size), has_arrived(size, 0) {}

  const int size;
  const std::chrono::milliseconds timeout;

  std::mutex mutex;
  std::condition_variable changed;  // notified after any field below changes
  uint64_t generation = 0;          // the collective # the slot serves
  int arrived = 0;                  // ranks that posted their call for #generation
  int departed = 0;                 // ranks done reading other ranks' buffers for #generation
  std::vector<Call> calls;          // (size) the calls of #generation, by rank
  std::vector<char> has_arrived;    // (size) for the timeout message
  std::string verdict;              // check_calls of #generation, set by the last to arrive
  bool aborted = false;             // final: every later collective fails
  int abort_rank = -1;
  std::string abort_reason;
};

class InProcessGroup::Rank final : public Communicator {
 public:
  Rank(Shared& shared, int rank) : shared_(shared), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return shared_.size; }
  bool failed_from_remote_abort() const { return failed_from_remote_abort_.load(); }

  void all_reduce_sum(std::span<float> inout) override {
    Call call = make_call(Op::kAllReduceSum, inout, inout);
    run(std::move(call), [&](const std::vector<Call>& calls) {
      sum_in_rank_order(calls, 0, inout.size(), scratch_);
    });
    std::copy_n(scratch_.begin(), inout.size(), inout.begin());
  }

  void all_gather(std::span<const float> send, std::span<float> recv) override {
    Call call = make_call(Op::kAllGather, send, recv);
    const size_t count = send.size();
    if (recv.size() != size_t(size()) * count) {
      call.local_error = concat("recv has ", recv.size(), " floats, expected size ", size(),
                                " x send ", count, " = ", size_t(size()) * count);
    } else if (send.data() != recv.data() + size_t(rank_) * count &&
               overlap(send.data(), count, recv.data(), recv.size())) {
      call.local_error =
          "send overlaps recv (the only allowed overlap is in place: send == recv"
          " + rank * send.size())";
    }
    run(std::move(call), [&](const std::vector<Call>& calls) {
      for (int r = 0; r < size(); ++r) {
        float* block = recv.data() + size_t(r) * count;  // (count)
        if (calls[r].send != block) std::copy_n(calls[r].send, count, block);
      }
    });
  }

  void reduce_scatter_sum(std::span<const float> send, std::span<float> recv) override {
    Call call = make_call(Op::kReduceScatterSum, send, recv);
    const size_t count = recv.size();
    if (send.size() != size_t(size()) * count) {
      call.local_error = concat("send has ", send.size(), " floats, expected size ", size(),
                                " x recv ", count, " = ", size_t(size()) * count);
    } else if (recv.data() != send.data() + size_t(rank_) * count &&
               overlap(send.data(), send.size(), recv.data(), count)) {
      call.local_error =
          "recv overlaps send (the only allowed overlap is in place: recv == send"
          " + rank * recv.size())";
    }
    run(std::move(call), [&](const std::vector<Call>& calls) {
      sum_in_rank_order(calls, size_t(rank_) * count, count, scratch_);
    });
    std::copy_n(scratch_.begin(), count, recv.begin());
  }

  void all_to_all_v(std::span<const float> send, std::span<const int64_t> send_counts,
                    std::span<float> recv, std::span<const int64_t> recv_counts) override {
    Call call = make_call(Op::kAllToAllV, send, recv);
    call.send_counts = send_counts;
    call.recv_counts = recv_counts;
    call.local_error = check_counts("send_counts", send_counts, size(), send.size(), "send");
    if (call.local_error.empty()) {
      call.local_error = check_counts("recv_counts", recv_counts, size(), recv.size(), "recv");
    }
    if (call.local_error.empty() && overlap(send.data(), send.size(), recv.data(), recv.size())) {
      call.local_error = "send overlaps recv";
    }
    run(std::move(call), [&](const std::vector<Call>& calls) {
      size_t recv_offset = 0;
      for (int from = 0; from < size(); ++from) {
        const Call& sender = calls[from];
        size_t send_offset = 0;  // where the sender's block for this rank starts
        for (int r = 0; r < rank_; ++r) send_offset += size_t(sender.send_counts[r]);
        const size_t count = size_t(recv_counts[from]);
        std::copy_n(sender.send + send_offset, count, recv.data() + recv_offset);
        recv_offset += count;
      }
    });
  }

  void broadcast(std::span<float> buf, int root) override {
    Call call = make_call(Op::kBroadcast, buf, buf);
    call.root = root;
    if (root < 0 || root >= size()) {
      call.local_error = concat("root ", root, " is out of range [0, ", size(), ")");
    }
    run(std::move(call), [&](const std::vector<Call>& calls) {
      // Only the root's buffer is read, and the root does not write it.
      if (rank_ != root) std::copy_n(calls[root].send, buf.size(), buf.data());
    });
  }

  void barrier() override {
    run(make_call(Op::kBarrier, {}, {}), [](const std::vector<Call>&) {});
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(shared_.mutex);
    if (shared_.aborted) return;  // the first cause is the one worth reporting
    shared_.aborted = true;
    shared_.abort_rank = rank_;
    shared_.abort_reason = reason;
    shared_.changed.notify_all();
  }

 private:
  // Runs this rank's part of the next collective: arrive, compute(calls) when the calls agree,
  // depart. Throws the verdict of check_calls, a timeout or the abort error.
  template <typename Compute>
  void run(Call call, Compute&& compute) {
    Shared& group = shared_;
    const uint64_t seq = next_seq_++;
    const Op op = call.op;
    std::unique_lock<std::mutex> lock(group.mutex);
    if (group.aborted) throw_aborted(op, seq);
    MOELORA_ASSERT(group.generation == seq, "rank ", rank_, " enters collective #", seq,
                   " while the group serves #", group.generation);
    group.calls[rank_] = std::move(call);
    group.has_arrived[rank_] = 1;
    if (++group.arrived == group.size) {
      group.verdict = check_calls(group.calls, seq);
      group.changed.notify_all();
    } else {
      const auto deadline = std::chrono::steady_clock::now() + group.timeout;
      // Once all have arrived the collective runs to the end even if an abort follows: other
      // ranks may be reading this rank's buffers, so it must not leave early.
      while (group.arrived < group.size) {
        if (group.aborted) throw_aborted(op, seq);
        if (group.changed.wait_until(lock, deadline) == std::cv_status::timeout &&
            group.arrived < group.size && !group.aborted) {
          // The missing ranks may arrive later and must not read this rank's stale call, so
          // the group is aborted with this message as the reason.
          std::string message = concat(
              op_name(op), " at collective #", seq, ": ", rank_list(group.has_arrived, false),
              " did not arrive within the ", group.timeout.count(), " ms timeout (",
              rank_list(group.has_arrived, true), " waiting); the group is aborted");
          group.aborted = true;
          group.abort_rank = rank_;
          group.abort_reason = message;
          group.changed.notify_all();
          MOELORA_THROW(ErrorCode::kInternal, message);
        }
      }
    }
    const std::string verdict = group.verdict;
    lock.unlock();

    // group.calls does not change before this rank departs, so it is read without the lock.
    std::exception_ptr compute_error;
    if (verdict.empty()) {
      try {
        compute(group.calls);
      } catch (...) {  // e.g. bad_alloc of the scratch buffer; depart first, then rethrow
        compute_error = std::current_exception();
      }
    }

    lock.lock();
    if (++group.departed == group.size) {
      group.arrived = 0;
      group.departed = 0;
      std::fill(group.has_arrived.begin(), group.has_arrived.end(), 0);
      group.verdict.clear();
      ++group.generation;
      group.changed.notify_all();
    } else {
      // Bounded: every rank has arrived and computing cannot block.
      group.changed.wait(lock, [&] { return group.generation != seq; });
    }
    lock.unlock();
    if (compute_error) std::rethrow_exception(compute_error);
    if (!verdict.empty()) MOELORA_THROW(ErrorCode::kInvalidArgument, verdict);
  }

  // Requires shared_.mutex held and shared_.aborted.
  [[noreturn]] void throw_aborted(Op op, uint64_t seq) {
    if (shared_.abort_rank != rank_) failed_from_remote_abort_ = true;
    MOELORA_THROW(ErrorCode::kInternal, op_name(op), " at collective #", seq, " failed on rank ",
                  rank_, ": the group was aborted by rank ", shared_.abort_rank, ": ",
                  shared_.abort_reason);
  }

  Shared& shared_;
  const int rank_;
  uint64_t next_seq_ = 0;       // this rank's next collective #
  std::vector<float> scratch_;  // reduction results, kept to avoid an allocation per call
  std::atomic<bool> failed_from_remote_abort_{false};
};

InProcessGroup::InProcessGroup(int size, std::chrono::milliseconds timeout) {
  MOELORA_CHECK(size >= 1, ErrorCode::kInvalidArgument, "InProcessGroup size ", size,
                " is invalid, expected >= 1");
  MOELORA_CHECK(timeout.count() > 0, ErrorCode::kInvalidArgument, "InProcessGroup timeout ",
                timeout.count(), " ms is invalid, expected > 0");
  shared_ = std::make_unique<Shared>(size, timeout);
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(*shared_, r));
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::size() const {
  return shared_->size;
}

Communicator& InProcessGroup::rank(int r) {
  MOELORA_CHECK(r >= 0 && r < size(), ErrorCode::kOutOfRange, "rank ", r,
                " is out of range for a group of size ", size());
  return *ranks_[r];
}

bool InProcessGroup::failed_from_remote_abort(int r) const {
  MOELORA_CHECK(r >= 0 && r < size(), ErrorCode::kOutOfRange, "rank ", r,
                " is out of range for a group of size ", size());
  return ranks_[r]->failed_from_remote_abort();
}

void run_ranks(int size, const std::function<void(Communicator&)>& body,
               std::chrono::milliseconds timeout) {
  InProcessGroup group(size, timeout);
  std::vector<std::exception_ptr> errors(size);  // written by rank r's thread only
  std::vector<std::thread> threads;
  threads.reserve(size);
  auto play_rank = [&](int r) {
    Communicator& comm = group.rank(r);
    try {
      body(comm);
      // A rank that is done calls no more collectives: one that the others wait in (or start
      // later) can never complete, so fail them now rather than at the timeout.
      comm.abort(concat("rank ", r, " returned from its body; a collective that needs it cannot "
                        "complete"));
    } catch (const std::exception& e) {
      errors[r] = std::current_exception();
      comm.abort(concat("rank ", r, " threw: ", e.what()));
    } catch (...) {
      errors[r] = std::current_exception();
      comm.abort(concat("rank ", r, " threw a non-standard exception"));
    }
  };
  try {
    for (int r = 0; r < size; ++r) threads.emplace_back(play_rank, r);
  } catch (...) {  // could not start a thread: release the started ranks, then report
    group.rank(0).abort("run_ranks could not start all threads");
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) {
    if (errors[r] && !group.failed_from_remote_abort(r)) std::rethrow_exception(errors[r]);
  }
  for (int r = 0; r < size; ++r) {
    if (errors[r]) std::rethrow_exception(errors[r]);
  }
}

}  // namespace moelora::dist
