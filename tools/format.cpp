#include "format.h"

#include <cstdio>

namespace moelora::cli {

std::string format_bytes(uint64_t bytes) {
  char text[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= 1'000'000'000'000ull) {
    std::snprintf(text, sizeof text, "%.2f TB", b / 1e12);
  } else if (bytes >= 1'000'000'000ull) {
    std::snprintf(text, sizeof text, "%.2f GB", b / 1e9);
  } else if (bytes >= 1'000'000ull) {
    std::snprintf(text, sizeof text, "%.1f MB", b / 1e6);
  } else {
    std::snprintf(text, sizeof text, "%.1f kB", b / 1e3);
  }
  return text;
}

std::string format_count(uint64_t n) {
  char text[64];
  if (n >= 1'000'000'000ull) {
    std::snprintf(text, sizeof text, "%.2f B", static_cast<double>(n) / 1e9);
  } else if (n >= 1'000'000ull) {
    std::snprintf(text, sizeof text, "%.1f M", static_cast<double>(n) / 1e6);
  } else {
    std::snprintf(text, sizeof text, "%llu", static_cast<unsigned long long>(n));
  }
  return text;
}

}  // namespace moelora::cli
