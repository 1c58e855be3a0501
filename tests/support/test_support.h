// Shared helpers for the test suites: seeded random inputs (seed printed, MOELORA_TEST_SEED
// overrides), tolerance checks with readable failure reports, fixture paths, error messages,
// temporary directories and running the moelora binary.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moelora::test {

// Directory of committed fixtures (tests/data): $MOELORA_TEST_DATA_DIR when set (test executables
// run on another machine than the one that built them), else the source tree's.
std::filesystem::path data_dir();
// Directory holding the moelora binary: $MOELORA_BINARY_DIR when set, else the build directory.
std::filesystem::path binary_dir();
// A committed model fixture: data_dir() / "parity" / model (its base/ and adapter directories).
std::filesystem::path fixture(const std::string& model);

// Seed for a test: MOELORA_TEST_SEED if set, else `fallback`; printed through RecordProperty and
// stdout so a failure can be replayed.
uint64_t test_seed(uint64_t fallback);

// n token ids drawn uniformly from [0, vocab).
std::vector<int32_t> random_tokens(std::mt19937_64& rng, int64_t n, int64_t vocab);

// Random fp32 tensor, normal(0, stddev).
Tensor random_normal(const Shape& shape, std::mt19937_64& rng, float stddev = 1.0f);
Tensor random_uniform(const Shape& shape, std::mt19937_64& rng, float lo, float hi);

// A fresh empty directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// |x - ref| <= atol + rtol * |ref| elementwise, no NaN/Inf anywhere. On failure: max abs error,
// first bad index and up to 10 offending elements.
::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, float atol, float rtol);
// PERF.md's bf16-vs-reference rule: |x - ref| <= 2e-2 |ref| + 2e-2 rms(ref), cosine >= min_cosine.
::testing::AssertionResult close_bf16(const Tensor& actual, const Tensor& expected, double min_cosine = 0.9999);
double cosine_similarity(const Tensor& a, const Tensor& b);
double max_abs_diff(const Tensor& a, const Tensor& b);

// Runs the moelora binary with `args` (shell-quoted by the caller), capturing stdout+stderr.
struct CommandResult {
  int exit_code;
  std::string output;
};
CommandResult run_moelora(const std::string& args);
CommandResult run_command(const std::string& command);

// Runs fn and returns the message of the moelora::Error it throws. Adds a test failure when nothing
// (or another exception type) is thrown, when `code` is given and differs, or when the message
// spans more than one line (errors are one line by design).
std::string error_message(const std::function<void()>& fn, std::optional<ErrorCode> code = std::nullopt);
// Runs fn and returns the message of the moelora::Error it throws, or "<no error>" when nothing is
// thrown. Unlike error_message it checks nothing and adds no failure (other exceptions propagate).
std::string error_of(const std::function<void()>& fn);
// Whether `part` occurs in `text`.
bool contains(const std::string& text, const std::string& part);

void write_text_file(const std::filesystem::path& path, const std::string& text);
std::string read_text_file(const std::filesystem::path& path);

}  // namespace moelora::test
