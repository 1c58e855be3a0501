// CUDA runtime helpers: error checking into moelora::Error, move-only RAII owners for device
// memory, streams and events, and device properties. Included only by CUDA translation units
// (*.cu) and GPU tests; the CPU build never sees this header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/tensor.h"

// Throws moelora::Error(kCuda) with the failing expression, the CUDA error name and message.
#define MOELORA_CUDA_CHECK(expr)                                                                \
  do {                                                                                          \
    cudaError_t moelora_cuda_status_ = (expr);                                                  \
    if (moelora_cuda_status_ != cudaSuccess) {                                                  \
      throw ::moelora::Error(::moelora::ErrorCode::kCuda,                                       \
                             ::moelora::detail::concat(#expr, " failed: ",                      \
                                                       cudaGetErrorName(moelora_cuda_status_), \
                                                       " (", cudaGetErrorString(moelora_cuda_status_), ")"), \
                             __FILE__, __LINE__);                                               \
    }                                                                                           \
  } while (0)

// After a kernel launch: reports launch-configuration errors (not asynchronous faults).
#define MOELORA_CUDA_CHECK_LAUNCH() MOELORA_CUDA_CHECK(cudaGetLastError())

namespace moelora::cuda {

// Number of visible CUDA devices; 0 when there is no driver or no device (never throws).
int device_count();

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int num_sms = 0;
  int l2_bytes = 0;
  size_t max_smem_per_block_optin = 0;
  size_t total_memory = 0;
  int memory_clock_khz = 0;
  int memory_bus_width_bits = 0;
  int driver_version = 0, runtime_version = 0;
};
DeviceInfo device_info(int ordinal = 0);

// Waits until every cudaMemcpy from host memory issued so far has landed in device memory. A
// cudaMemcpy from pageable memory may return before its DMA completes, and that DMA runs on the
// legacy default stream, which kernels on non-blocking streams (all of ours) do not wait for:
// call this at the end of every synchronous upload API before device work may read the data.
void wait_for_host_copies();

// Sets `kernel`'s preferred shared-memory carveout (the split of an SM's unified L1 / shared
// memory) to the shared-memory maximum, once per kernel and device. Kernels that run beside the
// persistent stream GEMM (two CTAs with ~213 KB of shared memory per SM) need it: an SM that runs
// a CTA of a kernel with a smaller carveout takes no GEMM CTA until that CTA drains, which the
// decode timeline showed as the GEMM starting only after a side-stream grid of ~1000 CTAs
// finished. Not a stream operation (safe during graph capture).
void prefer_max_shared_carveout(const void* kernel);

// Owned device allocation (cudaMalloc). Move-only. Allocation happens at construction only
// (Workspace sizing), never inside a forward pass.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

  // Synchronous helpers for tests and set-up code (never used on the forward path).
  void upload(const void* host, size_t bytes, size_t offset = 0);
  void download(void* host, size_t bytes, size_t offset = 0) const;
  void zero();

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Device copy of a host tensor (bytes as they are) and back.
DeviceBuffer to_device(const Tensor& t);
Tensor to_host(const DeviceBuffer& buf, DType dtype, const Shape& shape);

class Stream {
 public:
  Stream();  // non-blocking stream
  // A non-blocking stream of the device's greatest priority: the block scheduler places its
  // kernels' pending CTAs before those of lower-priority streams (and, in CUDA graphs instantiated
  // with cudaGraphInstantiateFlagUseNodePriority, its captured kernel nodes keep that priority).
  static Stream greatest_priority();
  ~Stream();
  Stream(Stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }
  void synchronize() const;

 private:
  explicit Stream(cudaStream_t created) : s_(created) {}  // takes ownership
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  explicit Event(bool timing = false);
  ~Event();
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }
  void record(cudaStream_t stream) const;
  // Milliseconds between two recorded timing events (synchronizes on `end`).
  static float elapsed_ms(const Event& start, const Event& end);

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace moelora::cuda

namespace moelora::cuda {

// Sub-allocation of one device allocation: plan the regions first (offsets only), allocate
// once, then hand out typed pointers. Used for Workspaces and weight/pool storage so that
// nothing is allocated after construction.
class DeviceArena {
 public:
  // Reserves `bytes` (256-byte aligned) and returns the region's offset.
  size_t reserve(size_t bytes) {
    const size_t offset = (size_ + 255) / 256 * 256;
    size_ = offset + bytes;
    return offset;
  }
  void allocate() { buffer_ = DeviceBuffer(size_ == 0 ? 256 : size_); }
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(buffer_.get()) + offset);
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
  DeviceBuffer buffer_;
};

// cuBLAS handle bound to a preallocated workspace (required for graph capture). cublasSetStream
// resets a handle's workspace to cuBLAS's default pool, so a handle must change streams only
// through set_cublas_stream below, which binds this workspace again.
class CublasHandle {
 public:
  explicit CublasHandle(size_t workspace_bytes = 32u << 20);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  void* get() const { return handle_; }  // cublasHandle_t

 private:
  void* handle_ = nullptr;
  DeviceBuffer workspace_;
};

// Points `handle` (a cublasHandle_t) at `stream` and, for a handle made by CublasHandle, binds its
// own workspace again (cublasSetStream alone falls back to cuBLAS's default workspace pool, which
// handles running on different streams, and eager runs and graph captures, then share: split-K
// GEMMs on two streams could overwrite each other's partial sums). Capture-safe (no stream work).
void set_cublas_stream(void* handle, cudaStream_t stream);

}  // namespace moelora::cuda
