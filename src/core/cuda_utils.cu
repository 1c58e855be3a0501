#include "core/cuda_utils.h"

namespace moelora::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" status
    return 0;
  }
  return n;
}

DeviceInfo device_info(int ordinal) {
  cudaDeviceProp p{};
  MOELORA_CUDA_CHECK(cudaGetDeviceProperties(&p, ordinal));
  DeviceInfo d;
  d.ordinal = ordinal;
  d.name = p.name;
  d.sm_major = p.major;
  d.sm_minor = p.minor;
  d.num_sms = p.multiProcessorCount;
  d.l2_bytes = p.l2CacheSize;
  d.max_smem_per_block_optin = p.sharedMemPerBlockOptin;
  d.total_memory = p.totalGlobalMem;
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&d.memory_clock_khz, cudaDevAttrMemoryClockRate, ordinal));
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&d.memory_bus_width_bits, cudaDevAttrGlobalMemoryBusWidth, ordinal));
  MOELORA_CUDA_CHECK(cudaDriverGetVersion(&d.driver_version));
  MOELORA_CUDA_CHECK(cudaRuntimeGetVersion(&d.runtime_version));
  return d;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) MOELORA_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void wait_for_host_copies() {
  // cudaMemcpy from pageable memory returns once the data is staged; the DMA into device memory
  // runs on the legacy default stream, which work on non-blocking streams does not wait for.
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  MOELORA_CHECK(offset + bytes <= bytes_, ErrorCode::kOutOfRange, "upload of ", bytes, " bytes at offset ", offset,
                " into a device buffer of ", bytes_, " bytes");
  if (bytes) MOELORA_CUDA_CHECK(cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice));
  wait_for_host_copies();
}

void DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  MOELORA_CHECK(offset + bytes <= bytes_, ErrorCode::kOutOfRange, "download of ", bytes, " bytes at offset ", offset,
                " from a device buffer of ", bytes_, " bytes");
  if (bytes)
    MOELORA_CUDA_CHECK(cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::zero() {
  if (bytes_) MOELORA_CUDA_CHECK(cudaMemset(ptr_, 0, bytes_));
}

DeviceBuffer to_device(const Tensor& t) {
  DeviceBuffer b(t.nbytes());
  b.upload(t.raw_data(), t.nbytes());
  return b;
}

Tensor to_host(const DeviceBuffer& buf, DType dtype, const Shape& shape) {
  Tensor t = Tensor::empty(dtype, shape);
  buf.download(t.raw_data(), t.nbytes());
  return t;
}

Stream::Stream() { MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
Stream Stream::greatest_priority() {
  int least = 0, greatest = 0;
  MOELORA_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t created = nullptr;
  MOELORA_CUDA_CHECK(cudaStreamCreateWithPriority(&created, cudaStreamNonBlocking, greatest));
  return Stream(created);
}
Stream::~Stream() {
  if (s_) cudaStreamDestroy(s_);
}
Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    if (s_) cudaStreamDestroy(s_);
    s_ = std::exchange(o.s_, nullptr);
  }
  return *this;
}
void Stream::synchronize() const { MOELORA_CUDA_CHECK(cudaStreamSynchronize(s_)); }

Event::Event(bool timing) {
  MOELORA_CUDA_CHECK(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
}
Event::~Event() {
  if (e_) cudaEventDestroy(e_);
}
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (e_) cudaEventDestroy(e_);
    e_ = std::exchange(o.e_, nullptr);
  }
  return *this;
}
void Event::record(cudaStream_t stream) const { MOELORA_CUDA_CHECK(cudaEventRecord(e_, stream)); }
float Event::elapsed_ms(const Event& start, const Event& end) {
  MOELORA_CUDA_CHECK(cudaEventSynchronize(end.e_));
  float ms = 0;
  MOELORA_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e_, end.e_));
  return ms;
}

}  // namespace moelora::cuda

#include <cublas_v2.h>

#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

namespace moelora::cuda {

namespace {

// Workspace of every live CublasHandle, by cuBLAS handle.
struct CublasWorkspaces {
  std::mutex mutex;
  std::unordered_map<void*, std::pair<void*, size_t>> by_handle;
};
CublasWorkspaces& cublas_workspaces() {
  static CublasWorkspaces* registry = new CublasWorkspaces;  // outlives every static handle
  return *registry;
}

void check_cublas_status(cublasStatus_t status, const char* what) {
  MOELORA_CHECK(status == CUBLAS_STATUS_SUCCESS, ErrorCode::kCuda, what, " failed with status ",
                static_cast<int>(status));
}

}  // namespace

CublasHandle::CublasHandle(size_t workspace_bytes) : workspace_(workspace_bytes) {
  cublasHandle_t h = nullptr;
  check_cublas_status(cublasCreate(&h), "cublasCreate");
  handle_ = h;
  check_cublas_status(cublasSetWorkspace(h, workspace_.get(), workspace_bytes), "cublasSetWorkspace");
  CublasWorkspaces& r = cublas_workspaces();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.by_handle[handle_] = {workspace_.get(), workspace_bytes};
}

CublasHandle::~CublasHandle() {
  if (!handle_) return;
  {
    CublasWorkspaces& r = cublas_workspaces();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.by_handle.erase(handle_);
  }
  cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void set_cublas_stream(void* handle, cudaStream_t stream) {
  auto h = static_cast<cublasHandle_t>(handle);
  check_cublas_status(cublasSetStream(h, stream), "cublasSetStream");
  std::pair<void*, size_t> workspace{nullptr, 0};
  {
    CublasWorkspaces& r = cublas_workspaces();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.by_handle.find(handle);
    if (it == r.by_handle.end()) return;  // a handle made elsewhere keeps cuBLAS's default
    workspace = it->second;
  }
  check_cublas_status(cublasSetWorkspace(h, workspace.first, workspace.second), "cublasSetWorkspace");
}

void prefer_max_shared_carveout(const void* kernel) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (!done.insert({kernel, device}).second) return;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
}

}  // namespace moelora::cuda
