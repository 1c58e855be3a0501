// Helpers of the sharding tests (tests/unit/dist_*_test.cpp): ranks as threads over the
// in-process communicator, random LoRA factors, exact and reassociation-tolerant comparisons, and
// errors that must name every part.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "support/test_support.h"

namespace moelora::dist::test_helpers {

// The moelora::Error that fn throws names every part (test::error_message fails the test when
// nothing is thrown).
inline void expect_error_mentions(const std::function<void()>& fn,
                                  std::initializer_list<const char*> parts) {
  const std::string message = test::error_message(fn);
  for (const char* part : parts)
    EXPECT_TRUE(test::contains(message, part)) << "'" << part << "' not in: " << message;
}

// Reassociated fp32 sums (partial sums added across ranks instead of one dot product).
constexpr float kAtol = 1e-5f, kRtol = 1e-4f;

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.raw_data(), b.raw_data(), static_cast<size_t>(a.nbytes())) == 0;
}

inline LoraFactors random_lora(std::mt19937_64& rng, int64_t ea, int64_t eb, int64_t rank,
                               int64_t in, int64_t out, float scaling) {
  return {test::random_normal({ea, rank, in}, rng, 1.0f / std::sqrt(static_cast<float>(in))),
          test::random_normal({eb, out, rank}, rng, 0.5f), scaling};
}

// Runs body(rank) on `ranks` threads and collects each rank's output tensor.
inline std::vector<Tensor> on_ranks(int ranks, const std::function<Tensor(Communicator&)>& body) {
  std::vector<Tensor> outputs(static_cast<size_t>(ranks));
  run_ranks(ranks,
            [&](Communicator& comm) { outputs[static_cast<size_t>(comm.rank())] = body(comm); });
  return outputs;
}

}  // namespace moelora::dist::test_helpers
