// Error handling for moelora: one exception type inside the library, Status/Result at the public
// boundary. Messages always name the thing that is wrong (file, tensor, field), the expected and
// the actual value, so that a user can act on one line of output.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace moelora {

enum class ErrorCode {
  kInvalidArgument,  // a caller passed a bad value
  kInvalidFile,      // a file on disk is malformed or inconsistent
  kNotFound,         // a file, tensor or key is missing
  kUnsupported,      // well-formed but not supported (DoRA, an unknown target, ...)
  kOutOfRange,       // index or size beyond a limit
  kCuda,             // a CUDA runtime or driver call failed
  kInternal,         // a bug: an invariant did not hold
};

const char* error_code_name(ErrorCode code);

// The single exception type thrown by library code. what() is the full message; location() is the
// source position of the throw (kept separate so user-facing output can omit it).
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message, const char* file = "", int line = 0)
      : std::runtime_error(std::move(message)), code_(code), file_(file), line_(line) {}
  ErrorCode code() const { return code_; }
  std::string location() const { return std::string(file_) + ":" + std::to_string(line_); }

 private:
  ErrorCode code_;
  const char* file_;
  int line_;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Public-API result: either a value or an error. Library internals throw; the API boundary
// (tools, server, Engine) catches and converts with `capture`.
class Status {
 public:
  Status() = default;
  static Status ok() { return Status(); }
  Status(ErrorCode code, std::string message) : ok_(false), code_(code), message_(std::move(message)) {}
  bool is_ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  bool ok_ = true;
  ErrorCode code_ = ErrorCode::kInternal;
  std::string message_;
};

template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : value_(std::move(status)) {}  // NOLINT
  bool is_ok() const { return std::holds_alternative<T>(value_); }
  T& value() {
    if (!is_ok()) throw Error(status().code(), status().message());
    return std::get<T>(value_);
  }
  Status status() const { return is_ok() ? Status::ok() : std::get<Status>(value_); }

 private:
  std::variant<T, Status> value_;
};

// Runs fn and converts a thrown moelora::Error (or std::exception) to a Status.
template <typename Fn>
Status capture(Fn&& fn) {
  try {
    fn();
    return Status::ok();
  } catch (const Error& e) {
    return Status(e.code(), e.what());
  } catch (const std::exception& e) {
    return Status(ErrorCode::kInternal, e.what());
  }
}

}  // namespace moelora

// MOELORA_CHECK(cond, code, parts...): throws moelora::Error with the concatenated parts.
//   MOELORA_CHECK(rank <= max_rank, ErrorCode::kUnsupported, "adapter '", name, "': rank ", rank,
//                 " exceeds the configured maximum ", max_rank);
#define MOELORA_CHECK(cond, code, ...)                                                    \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      throw ::moelora::Error((code), ::moelora::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                                     \
  } while (0)

#define MOELORA_THROW(code, ...) \
  throw ::moelora::Error((code), ::moelora::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

// Internal invariant: failing means a bug in moelora, not bad input.
#define MOELORA_ASSERT(cond, ...) \
  MOELORA_CHECK(cond, ::moelora::ErrorCode::kInternal, "internal error: " #cond " failed. ", ##__VA_ARGS__)
