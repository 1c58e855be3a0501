#include "support/test_support.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace moelora::test {

namespace {
std::filesystem::path env_or(const char* name, const char* built_in) {
  const char* value = std::getenv(name);
  return value && *value ? value : built_in;
}
}  // namespace

std::filesystem::path data_dir() { return env_or("MOELORA_TEST_DATA_DIR", MOELORA_TEST_DATA_DIR); }
std::filesystem::path binary_dir() { return env_or("MOELORA_BINARY_DIR", MOELORA_BINARY_DIR); }
std::filesystem::path fixture(const std::string& model) { return data_dir() / "parity" / model; }

uint64_t test_seed(uint64_t fallback) {
  uint64_t seed = fallback;
  if (const char* env = std::getenv("MOELORA_TEST_SEED")) seed = std::strtoull(env, nullptr, 10);
  std::printf("[ seed     ] %llu (set MOELORA_TEST_SEED to replay)\n", static_cast<unsigned long long>(seed));
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, int64_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& t : out) t = dist(rng);
  return out;
}

Tensor random_normal(const Shape& shape, std::mt19937_64& rng, float stddev) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  std::normal_distribution<float> dist(0.0f, stddev);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
  return t;
}

Tensor random_uniform(const Shape& shape, std::mt19937_64& rng, float lo, float hi) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  std::uniform_real_distribution<float> dist(lo, hi);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
  return t;
}

TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "moelora-test-XXXXXX").string();
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

namespace {
std::string index_str(const Shape& shape, int64_t flat) {
  Shape idx(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  return shape_str(idx);
}

::testing::AssertionResult check_same_shape(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape())
    return ::testing::AssertionFailure() << "shape mismatch: actual " << shape_str(a.shape()) << " vs expected "
                                         << shape_str(b.shape());
  return ::testing::AssertionSuccess();
}
}  // namespace

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(double(a.item_f32(i)) - b.item_f32(i)));
  return m;
}

double cosine_similarity(const Tensor& a, const Tensor& b) {
  double dot = 0, na = 0, nb = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = a.item_f32(i), y = b.item_f32(i);
    dot += x * y;
    na += x * x;
    nb += y * y;
  }
  if (na == 0 && nb == 0) return 1.0;
  return dot / std::sqrt(na * nb + 1e-300);
}

::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, float atol, float rtol) {
  if (auto r = check_same_shape(actual, expected); !r) return r;
  int64_t bad = 0, first_bad = -1;
  double max_err = 0;
  std::ostringstream rows;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double x = actual.item_f32(i), r = expected.item_f32(i);
    const double err = std::fabs(x - r);
    const bool ok = std::isfinite(x) && std::isfinite(r) && err <= atol + rtol * std::fabs(r);
    if (std::isfinite(err)) max_err = std::max(max_err, err);
    if (!ok) {
      if (bad < 10) rows << "\n  at " << index_str(actual.shape(), i) << ": actual " << x << " expected " << r;
      if (first_bad < 0) first_bad = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess() << "max abs error " << max_err;
  return ::testing::AssertionFailure() << bad << " of " << actual.numel() << " elements differ (atol " << atol
                                       << ", rtol " << rtol << "); max abs error " << max_err << "; first bad index "
                                       << index_str(actual.shape(), first_bad) << rows.str();
}

::testing::AssertionResult close_bf16(const Tensor& actual, const Tensor& expected, double min_cosine) {
  if (auto r = check_same_shape(actual, expected); !r) return r;
  double sum_sq = 0;
  for (int64_t i = 0; i < expected.numel(); ++i) sum_sq += double(expected.item_f32(i)) * expected.item_f32(i);
  const double rms = expected.numel() ? std::sqrt(sum_sq / expected.numel()) : 0.0;
  auto r = all_close(actual, expected, static_cast<float>(2e-2 * rms), 2e-2f);
  if (!r) return r;
  const double cos = cosine_similarity(actual, expected);
  if (cos < min_cosine)
    return ::testing::AssertionFailure() << "cosine similarity " << cos << " below " << min_cosine;
  return ::testing::AssertionSuccess();
}

CommandResult run_command(const std::string& command) {
  CommandResult result{-1, ""};
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return result;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) result.output.append(buf, n);
  int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

CommandResult run_moelora(const std::string& args) {
  return run_command("MOELORA_NO_PROGRESS=1 " + (binary_dir() / "moelora").string() + " " + args);
}

std::string error_message(const std::function<void()>& fn, std::optional<ErrorCode> code) {
  try {
    fn();
  } catch (const Error& e) {
    if (code) {
      EXPECT_EQ(e.code(), *code) << "message: " << e.what();
    }
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line expected: " << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected moelora::Error, got std::exception: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected moelora::Error, nothing was thrown";
  return "";
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

void write_text_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace moelora::test
