#include "core/threads.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

namespace moelora {

namespace {
thread_local bool t_inside_parallel = false;
}

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
  const int64_t workers = std::min<int64_t>(num_threads(), std::max<int64_t>(1, n / std::max<int64_t>(1, min_chunk)));
  if (workers <= 1 || t_inside_parallel) {
    fn(0, n);
    return;
  }
  const int64_t chunk = (n + workers - 1) / workers;
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(workers);
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t begin = w * chunk, end = std::min(n, begin + chunk);
    if (begin >= end) break;
    threads.emplace_back([&, w, begin, end] {
      t_inside_parallel = true;
      try {
        fn(begin, end);
      } catch (...) {
        errors[w] = std::current_exception();
      }
    });
  }
  t_inside_parallel = true;
  try {
    fn(0, std::min(n, chunk));
  } catch (...) {
    errors[0] = std::current_exception();
  }
  t_inside_parallel = false;
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace moelora
