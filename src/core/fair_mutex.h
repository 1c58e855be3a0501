// A first-come, first-served mutex (a ticket lock that sleeps on a condition variable).
//
// Why: std::mutex lets the thread that just unlocked take the lock again before a thread it woke
// gets to run. The engine's step loop does exactly that (unlock after a step, relock for the next
// a few microseconds later), so with one request running on a fast GPU step, an HTTP thread in
// Engine::submit() could lose the race step after step and wait for the running request to finish
// (requests served one at a time while 64 clients wait). With FairMutex a thread that is waiting
// when the lock is released gets it before anyone who asks later, so a submit waits at most for
// the step in progress.
//
// Satisfies BasicLockable and Lockable (std::lock_guard, std::unique_lock). Not recursive.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace moelora {

class FairMutex {
 public:
  FairMutex() = default;
  FairMutex(const FairMutex&) = delete;
  FairMutex& operator=(const FairMutex&) = delete;

  void lock() {
    std::unique_lock<std::mutex> guard(inner_);
    const uint64_t ticket = next_ticket_++;
    turn_.wait(guard, [&] { return serving_ == ticket; });
  }

  bool try_lock() {
    std::lock_guard<std::mutex> guard(inner_);
    if (next_ticket_ != serving_) return false;  // held, or others queued before us
    ++next_ticket_;
    return true;
  }

  void unlock() {
    bool queued;
    {
      std::lock_guard<std::mutex> guard(inner_);
      ++serving_;
      queued = next_ticket_ != serving_;
    }
    // Every waiter wakes and the one whose ticket is served proceeds; waiters are few (HTTP
    // workers in submit / cancel / stats), so one condition variable is enough.
    if (queued) turn_.notify_all();
  }

  // Threads waiting for the lock now (not counting the holder). For tests and diagnostics.
  uint64_t waiting() const {
    std::lock_guard<std::mutex> guard(inner_);
    return next_ticket_ - serving_ - (next_ticket_ != serving_ ? 1 : 0);
  }

 private:
  mutable std::mutex inner_;
  std::condition_variable turn_;
  uint64_t next_ticket_ = 0;  // the ticket the next lock() takes
  uint64_t serving_ = 0;      // the ticket that holds (or may take) the lock
};

}  // namespace moelora
