// One rank of an NCCL group, for the GPU shards: collectives on device buffers, enqueued on a
// CUDA stream (so a decode step's graph captures them), with the contract of communicator.h
// (every rank issues the same collectives in the same order with the same sizes).
//
// Its own layer (moelora_nccl), built with the toolkit's NCCL when CMake finds it
// (MOELORA_WITH_NCCL), so that nothing else links NCCL before it is needed. Why it is more than
// ncclCommInitRank + ncclAllReduce:
//   - The communicator is created non-blocking (ncclConfig_t::blocking = 0) and every call that
//     answers ncclInProgress is polled with ncclCommGetAsyncError under a deadline: a rank that
//     never joins, or a peer that died inside a collective, turns into an error naming this rank,
//     the group size and what it was doing, after `timeout`, instead of a hang; the communicator is
//     then aborted (ncclCommAbort), never destroyed while work may be queued on a lost peer.
//   - NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set in the environment before the
//     first communicator of the process is created (multicast objects can take shared GPUs of
//     these hosts out of service).
//   - The unique id that every rank needs travels as text (nccl_new_unique_id: 256 hex digits), so
//     a launcher can hand it to each rank's process on its command line or environment.
#pragma once

#if defined(MOELORA_WITH_NCCL)

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "core/device_collectives.h"
#include "core/dtype.h"
#include "dist/communicator.h"

namespace moelora::dist {

// A fresh NCCL unique id (ncclGetUniqueId) as 256 lowercase hex digits. Rank 0's process makes
// it; NCCL keeps a bootstrap listener for it until the group forms (for the process's lifetime if
// it never does).
std::string nccl_new_unique_id();

class NcclCommunicator final : public DeviceCollectives {
 public:
  // Joins the group `unique_id` (from nccl_new_unique_id, the same on every rank) as rank `rank`
  // of `size` on CUDA device `device` (made current on the calling thread). Throws kInternal
  // naming the rank when the group has not formed within `timeout` (a rank that was not started
  // or was given another id) and with NCCL's error text when NCCL fails, kInvalidArgument for a
  // malformed id, rank, size or timeout.
  static std::unique_ptr<NcclCommunicator> create(
      const std::string& unique_id, int rank, int size, int device,
      std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
  ~NcclCommunicator();  // finalizes and destroys a healthy communicator, aborts a broken one
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }

  // Enqueued on `stream` (capturable into a CUDA graph); `dtype` is kF32 or kBF16; buffers are
  // device pointers of `count` elements (all_gather's recv and reduce_scatter's send: size()
  // times that, rank-major as in communicator.h). Reductions sum.
  void all_reduce_sum(void* inout, size_t count, DType dtype, cudaStream_t stream) override;
  void all_gather(const void* send, void* recv, size_t count, DType dtype,
                  cudaStream_t stream) override;
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dtype,
                          cudaStream_t stream);
  void broadcast(void* buf, size_t count, DType dtype, int root, cudaStream_t stream);

  // Waits until `stream` has drained, watching NCCL's asynchronous error: a peer that died or
  // never arrives at a collective fails this rank after the timeout (and aborts the
  // communicator) instead of blocking forever.
  void synchronize(cudaStream_t stream);

  // ncclCommAbort: queued and later collectives of this rank fail; every later call throws with
  // `reason`. The first abort wins. Like every member, called from the thread that uses the
  // communicator (a watchdog on another thread would race with a call in progress).
  void abort(const std::string& reason);
  bool aborted() const { return !abort_reason_.empty(); }

 private:
  struct Handle;  // the ncclComm_t, kept out of this header
  NcclCommunicator(std::unique_ptr<Handle> handle, int rank, int size, int device,
                   std::chrono::milliseconds timeout);
  // Polls a call that answered ncclInProgress (or any asynchronous error) until it settles;
  // `what` names the call in errors.
  void settle(int result, const char* what);
  void check_usable(const char* what) const;

  std::unique_ptr<Handle> handle_;
  int rank_ = 0, size_ = 1, device_ = 0;
  std::chrono::milliseconds timeout_;
  std::string abort_reason_;
};

}  // namespace moelora::dist

#endif  // MOELORA_WITH_NCCL
