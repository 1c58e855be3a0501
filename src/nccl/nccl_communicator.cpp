// NCCL communicator of one rank (nccl_communicator.h).
#include "nccl/nccl_communicator.h"

#if defined(MOELORA_WITH_NCCL)

#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/cuda_utils.h"
#include "core/error.h"

namespace moelora::dist {

struct NcclCommunicator::Handle {
  ncclComm_t comm = nullptr;
};

namespace {

constexpr char kHexDigits[] = "0123456789abcdef";

// NVLink multicast off for every communicator of the process (read by NCCL at its first init).
void keep_nvls_off() {
  static std::once_flag once;
  std::call_once(once, [] { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1); });
}

ncclDataType_t nccl_type(DType dtype, const char* what) {
  MOELORA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, ErrorCode::kInvalidArgument,
                "NCCL ", what, ": dtype ", dtype_name(dtype), " is not F32 or BF16");
  return dtype == DType::kF32 ? ncclFloat32 : ncclBfloat16;
}

ncclUniqueId parse_unique_id(const std::string& text) {
  ncclUniqueId id;
  MOELORA_CHECK(text.size() == 2 * sizeof(id.internal), ErrorCode::kInvalidArgument,
                "NCCL unique id: expected ", 2 * sizeof(id.internal), " hex digits, got ",
                text.size(), " characters");
  auto nibble = [&](char c, size_t at) {
    const char* p = std::strchr(kHexDigits, c >= 'A' && c <= 'F' ? c - 'A' + 'a' : c);
    MOELORA_CHECK(c != '\0' && p != nullptr, ErrorCode::kInvalidArgument,
                  "NCCL unique id: character ", at, " ('", std::string(1, c),
                  "') is not a hex digit");
    return static_cast<unsigned>(p - kHexDigits);
  };
  for (size_t i = 0; i < sizeof(id.internal); ++i)
    id.internal[i] = static_cast<char>(nibble(text[2 * i], 2 * i) << 4 | nibble(text[2 * i + 1], 2 * i + 1));
  return id;
}

}  // namespace

std::string nccl_new_unique_id() {
  keep_nvls_off();
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  MOELORA_CHECK(r == ncclSuccess, ErrorCode::kInternal, "ncclGetUniqueId failed: ",
                ncclGetErrorString(r), " (", ncclGetLastError(nullptr), ")");
  std::string text;
  text.reserve(2 * sizeof(id.internal));
  for (char c : id.internal) {
    const auto b = static_cast<unsigned char>(c);
    text += kHexDigits[b >> 4];
    text += kHexDigits[b & 15];
  }
  return text;
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(const std::string& unique_id, int rank,
                                                           int size, int device,
                                                           std::chrono::milliseconds timeout) {
  MOELORA_CHECK(size >= 1 && rank >= 0 && rank < size, ErrorCode::kInvalidArgument, "NCCL group: rank ",
                rank, " of ", size, " ranks is not a rank (expected 0 <= rank < size)");
  MOELORA_CHECK(timeout.count() > 0, ErrorCode::kInvalidArgument, "NCCL group: timeout ",
                timeout.count(), " ms must be positive");
  const ncclUniqueId id = parse_unique_id(unique_id);
  keep_nvls_off();
  MOELORA_CUDA_CHECK(cudaSetDevice(device));
  auto handle = std::make_unique<Handle>();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&handle->comm, size, id, rank, &config);
  MOELORA_CHECK(r == ncclSuccess || r == ncclInProgress, ErrorCode::kInternal, "NCCL group: rank ",
                rank, " of ", size, " could not start joining: ", ncclGetErrorString(r), " (",
                ncclGetLastError(handle->comm), ")");
  // The communicator object exists from here on: settle() aborts it when the group does not form.
  std::unique_ptr<NcclCommunicator> comm(
      new NcclCommunicator(std::move(handle), rank, size, device, timeout));
  comm->settle(r, "joining the group (did every rank start, with the same unique id?)");
  return comm;
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Handle> handle, int rank, int size, int device,
                                   std::chrono::milliseconds timeout)
    : handle_(std::move(handle)), rank_(rank), size_(size), device_(device), timeout_(timeout) {}

NcclCommunicator::~NcclCommunicator() {
  if (handle_ == nullptr || handle_->comm == nullptr) return;
  if (aborted()) return;  // abort() released the communicator
  // A healthy communicator: finalize (non-blocking, polled under the deadline), then destroy; if
  // finalizing fails or does not settle, a peer is gone and destroying would wait for it: abort.
  ncclResult_t state = ncclCommFinalize(handle_->comm);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (state == ncclSuccess || state == ncclInProgress) {
    if (ncclCommGetAsyncError(handle_->comm, &state) != ncclSuccess) state = ncclInternalError;
    if (state != ncclInProgress || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (state == ncclSuccess)
    ncclCommDestroy(handle_->comm);
  else
    ncclCommAbort(handle_->comm);
  handle_->comm = nullptr;
}

void NcclCommunicator::check_usable(const char* what) const {
  MOELORA_CHECK(!aborted(), ErrorCode::kInternal, "NCCL ", what, " on rank ", rank_, " of ",
                size_, ": the communicator was aborted (", abort_reason_, ")");
}

void NcclCommunicator::settle(int result, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  ncclResult_t state = static_cast<ncclResult_t>(result);
  for (;;) {
    if (state != ncclSuccess && state != ncclInProgress) {
      const std::string detail = std::string(ncclGetErrorString(state)) + " (" +
                                 ncclGetLastError(handle_->comm) + ")";
      abort(std::string(what) + " failed: " + detail);
      MOELORA_THROW(ErrorCode::kInternal, "NCCL rank ", rank_, " of ", size_, ": ", what,
                    " failed: ", detail);
    }
    // A call that answered success may still have failed asynchronously (a lost peer).
    const ncclResult_t query = ncclCommGetAsyncError(handle_->comm, &state);
    if (query != ncclSuccess) state = query;
    if (state == ncclSuccess) return;
    if (state == ncclInProgress && std::chrono::steady_clock::now() > deadline) {
      abort(std::string(what) + " did not finish within " + std::to_string(timeout_.count()) +
            " ms");
      MOELORA_THROW(ErrorCode::kInternal, "NCCL rank ", rank_, " of ", size_, ": ", what,
                    " did not finish within ", timeout_.count(),
                    " ms; the communicator is aborted");
    }
    if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclCommunicator::all_reduce_sum(void* inout, size_t count, DType dtype, cudaStream_t stream) {
  check_usable("all_reduce_sum");
  settle(ncclAllReduce(inout, inout, count, nccl_type(dtype, "all_reduce_sum"), ncclSum,
                       handle_->comm, stream),
         "all_reduce_sum");
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t count, DType dtype,
                                  cudaStream_t stream) {
  check_usable("all_gather");
  settle(ncclAllGather(send, recv, count, nccl_type(dtype, "all_gather"), handle_->comm, stream),
         "all_gather");
}

void NcclCommunicator::reduce_scatter_sum(const void* send, void* recv, size_t count, DType dtype,
                                          cudaStream_t stream) {
  check_usable("reduce_scatter_sum");
  settle(ncclReduceScatter(send, recv, count, nccl_type(dtype, "reduce_scatter_sum"), ncclSum,
                           handle_->comm, stream),
         "reduce_scatter_sum");
}

void NcclCommunicator::broadcast(void* buf, size_t count, DType dtype, int root,
                                 cudaStream_t stream) {
  check_usable("broadcast");
  MOELORA_CHECK(root >= 0 && root < size_, ErrorCode::kInvalidArgument, "NCCL broadcast: root ",
                root, " is not a rank of ", size_);
  settle(ncclBroadcast(buf, buf, count, nccl_type(dtype, "broadcast"), root, handle_->comm, stream),
         "broadcast");
}

void NcclCommunicator::synchronize(cudaStream_t stream) {
  check_usable("synchronize");
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done == cudaSuccess) return;
    MOELORA_CHECK(done == cudaErrorNotReady, ErrorCode::kCuda, "NCCL rank ", rank_,
                  ": the stream failed: ", cudaGetErrorString(done));
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(handle_->comm, &state) != ncclSuccess) state = ncclInternalError;
    if (state != ncclSuccess && state != ncclInProgress) settle(state, "a collective on the stream");
    if (std::chrono::steady_clock::now() > deadline) {
      abort("the stream did not drain within " + std::to_string(timeout_.count()) + " ms");
      MOELORA_THROW(ErrorCode::kInternal, "NCCL rank ", rank_, " of ", size_,
                    ": the stream's collectives did not finish within ", timeout_.count(),
                    " ms (a peer died or never arrived); the communicator is aborted");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void NcclCommunicator::abort(const std::string& reason) {
  if (aborted()) return;
  abort_reason_ = reason.empty() ? "aborted" : reason;
  if (handle_ != nullptr && handle_->comm != nullptr) {
    ncclCommAbort(handle_->comm);
    handle_->comm = nullptr;
  }
}

}  // namespace moelora::dist

#endif  // MOELORA_WITH_NCCL
