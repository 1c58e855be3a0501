// A minimal fork-join helper for the CPU reference: splits [0, n) into contiguous chunks over
// hardware threads. Deterministic: each index is processed by exactly one call of fn, and
// nothing is reduced across threads, so results do not depend on the thread count.
#pragma once

#include <cstdint>
#include <functional>

namespace moelora {

// Number of worker threads used by parallel_for (MOELORA_NUM_THREADS overrides; default: all
// hardware threads).
int num_threads();

// Calls fn(begin, end) on disjoint chunks covering [0, n). Runs inline when n is small
// (below min_chunk per thread) or when called from inside another parallel_for.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk = 1);

}  // namespace moelora
