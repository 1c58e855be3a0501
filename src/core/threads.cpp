#include "core/threads.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace moelora {

namespace {

thread_local bool t_inside_parallel = false;

// A persistent pool: parallel_for is called many times per token in the CPU model, and starting
// threads each time would dominate small calls. Workers sleep on a condition variable between
// jobs. One job at a time (callers from several threads serialize on job_mutex_).
class ThreadPool {
 public:
  explicit ThreadPool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { worker_loop(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // Runs fn(chunk) for chunk in [0, chunks) on the workers and the calling thread.
  void run(int64_t chunks, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    // Each job has its own counters, shared with the workers: a worker still finishing an old
    // job can never take chunks of a new one.
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->chunks = chunks;
    job->pending = chunks;
    job->errors.resize(static_cast<size_t>(chunks));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      current_ = job;
      ++generation_;
    }
    wake_.notify_all();
    work(*job);  // the caller helps
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return job->pending == 0; });
    current_.reset();
    for (auto& e : job->errors)
      if (e) std::rethrow_exception(e);
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* fn = nullptr;
    int64_t chunks = 0;
    std::atomic<int64_t> next{0};
    int64_t pending = 0;  // guarded by mutex_
    std::vector<std::exception_ptr> errors;
  };

  void work(Job& job) {
    const bool was_inside = t_inside_parallel;
    t_inside_parallel = true;
    for (;;) {
      const int64_t chunk = job.next.fetch_add(1);
      if (chunk >= job.chunks) break;
      try {
        (*job.fn)(chunk);
      } catch (...) {
        job.errors[static_cast<size_t>(chunk)] = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (--job.pending == 0) done_.notify_all();
    }
    t_inside_parallel = was_inside;
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = current_;
      }
      if (job) work(*job);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_, job_mutex_;
  std::condition_variable wake_, done_;
  std::shared_ptr<Job> current_;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

ThreadPool& pool() {
  static ThreadPool p(num_threads() - 1);
  return p;
}

}  // namespace

int num_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("MOELORA_NUM_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return v;
    }
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return n;
}

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
  if (n <= 0) return;
  const int64_t workers =
      std::min<int64_t>(num_threads(), std::max<int64_t>(1, n / std::max<int64_t>(1, min_chunk)));
  if (workers <= 1 || t_inside_parallel) {
    fn(0, n);
    return;
  }
  // Fixed chunk boundaries (independent of which thread runs which chunk): deterministic.
  const int64_t chunk = (n + workers - 1) / workers;
  const int64_t chunks = (n + chunk - 1) / chunk;
  pool().run(chunks, [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); });
}

}  // namespace moelora
