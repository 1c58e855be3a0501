// Sums over the ranks of a GPU group, enqueued on a CUDA stream: what a tensor- / expert-parallel
// GpuModel needs from its group (model::GpuModelOptions::collectives). NCCL implements it across
// GPUs (dist::NcclCommunicator); the GPU tests implement it for ranks that share one device.
//
// Contract (NCCL's, as in dist/communicator.h): every rank issues the same calls in the same order
// with the same count and dtype; the call returns once the sum is enqueued on `stream` (work
// enqueued after it on that stream sees the sum); the buffer belongs to the caller.
#pragma once

#include <cstddef>

#include "core/dtype.h"

struct CUstream_st;  // cudaStream_t, without the CUDA headers

namespace moelora {

class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // inout: `count` elements of `dtype` (kF32 or kBF16) on the device; every rank gets the sum over
  // the ranks.
  virtual void all_reduce_sum(void* inout, size_t count, DType dtype, CUstream_st* stream) = 0;
};

}  // namespace moelora
