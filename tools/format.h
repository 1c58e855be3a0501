// Human-readable sizes and counts for the moelora tool's tables ("213.1 MB", "106.6 M").
#pragma once

#include <cstdint>
#include <string>

namespace moelora::cli {

std::string format_bytes(uint64_t bytes);  // kB / MB / GB / TB, decimal units
std::string format_count(uint64_t n);      // plain below a million, then M / B

}  // namespace moelora::cli
