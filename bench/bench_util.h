// Helpers shared by the GPU benchmark programs: medians, the device-to-device copy bandwidth
// they report against, comma lists on the command line, JSON string escaping.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "core/cuda_utils.h"

namespace moelora::bench {

inline double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Device-to-device copy bandwidth (bytes read + written per second) over 2 GB: the practical
// ceiling of a kernel that streams its bytes from HBM once.
inline double measure_copy_bandwidth() {
  const size_t bytes = size_t(1) << 31;
  cuda::DeviceBuffer a(bytes), b(bytes);
  a.zero();
  cuda::Event e0(true), e1(true);
  for (int i = 0; i < 3; ++i)
    MOELORA_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));
  std::vector<float> ms;
  for (int i = 0; i < 10; ++i) {
    e0.record(nullptr);
    MOELORA_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));
    e1.record(nullptr);
    ms.push_back(cuda::Event::elapsed_ms(e0, e1));
  }
  return 2.0 * bytes / (median(ms) * 1e-3);
}

// "16,32,64" -> {16, 32, 64}; "" or "none" -> {}.
inline std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  if (s == "none") return out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoi(item));
  return out;
}

inline std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

}  // namespace moelora::bench
