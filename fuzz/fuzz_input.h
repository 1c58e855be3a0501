// Shared helpers of the fuzz targets: the input as a file under a per-process scratch
// directory (the parsers under test read files the way users hand them over), and the rule every
// target enforces: bad input may only end in moelora::Error. Anything else (another exception
// escaping, a sanitizer report, a crash, a hang, unbounded memory) is a finding.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace moelora::fuzz {

// A directory of its own for this process (libFuzzer's -jobs / -workers run several), under
// $TMPDIR (scripts/fuzz points it into the build directory).
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::filesystem::path d = std::filesystem::path(base ? base : "/tmp") /
                              ("moelora-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

// Writes `bytes` to scratch_dir()/name (replacing it) and returns the path.
inline std::filesystem::path write_file(const std::string& name, std::string_view bytes) {
  const std::filesystem::path path = scratch_dir() / name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace moelora::fuzz
