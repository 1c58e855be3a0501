// Helpers for GPU tests: skip cleanly (reported as skipped by CTest) without a CUDA device or on
// a device older than Hopper, and small host<->device conveniences.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "core/cuda_utils.h"
#include "core/tensor.h"

#define MOELORA_REQUIRE_SM90()                                                        \
  do {                                                                                \
    if (::moelora::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";       \
    auto moelora_info_ = ::moelora::cuda::device_info(0);                             \
    if (moelora_info_.sm_major < 9)                                                   \
      GTEST_SKIP() << "needs sm_90 (Hopper); device is sm_" << moelora_info_.sm_major \
                   << moelora_info_.sm_minor;                                         \
  } while (0)

namespace moelora::test {

template <typename T>
cuda::DeviceBuffer upload_vector(const std::vector<T>& v) {
  cuda::DeviceBuffer b(v.size() * sizeof(T));
  b.upload(v.data(), v.size() * sizeof(T));
  return b;
}

template <typename T>
std::vector<T> download_vector(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  b.download(v.data(), n * sizeof(T));
  return v;
}

// A CUDA graph of what `enqueue` puts on `stream` (captured once, thread-local mode), replayed by
// launch(); destroyed with the object.
class CapturedGraph {
 public:
  CapturedGraph(cudaStream_t stream, const std::function<void(cudaStream_t)>& enqueue)
      : stream_(stream) {
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue(stream);
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    MOELORA_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  // One replay, then waits for it.
  void launch() {
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace moelora::test
