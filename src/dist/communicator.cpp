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
#include "dist/collective_rules.h"

namespace moelora::dist {

namespace {

using detail::Call;
using detail::Op;
using detail::op_name;
using detail::rank_list;
using ::moelora::detail::concat;

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
    // Into scratch first: other ranks read inout until every rank has departed.
    run(detail::all_reduce_call(inout), [&](const std::vector<Call>& calls) {
      scratch_.resize(inout.size());
      detail::collective_result(calls, rank_, scratch_.data());
    });
    std::copy_n(scratch_.begin(), inout.size(), inout.begin());
  }

  void all_gather(std::span<const float> send, std::span<float> recv) override {
    run(detail::all_gather_call(send, recv, rank_, size()), [&](const std::vector<Call>& calls) {
      detail::collective_result(calls, rank_, recv.data());
    });
  }

  void reduce_scatter_sum(std::span<const float> send, std::span<float> recv) override {
    run(detail::reduce_scatter_call(send, recv, rank_, size()),
        [&](const std::vector<Call>& calls) {
          scratch_.resize(recv.size());
          detail::collective_result(calls, rank_, scratch_.data());
        });
    std::copy_n(scratch_.begin(), recv.size(), recv.begin());
  }

  void all_to_all_v(std::span<const float> send, std::span<const int64_t> send_counts,
                    std::span<float> recv, std::span<const int64_t> recv_counts) override {
    run(detail::all_to_all_call(send, send_counts, recv, recv_counts, size()),
        [&](const std::vector<Call>& calls) {
          detail::collective_result(calls, rank_, recv.data());
        });
  }

  void broadcast(std::span<float> buf, int root) override {
    run(detail::broadcast_call(buf, root, size()), [&](const std::vector<Call>& calls) {
      detail::collective_result(calls, rank_, buf.data());
    });
  }

  void barrier() override {
    run(detail::barrier_call(), [](const std::vector<Call>&) {});
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
      group.verdict = detail::check_calls(group.calls, seq);
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
