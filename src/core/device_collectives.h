// Sums and gathers over the ranks of a GPU group, enqueued on a CUDA stream: what a tensor- /
// expert-parallel GpuModel needs from its group (model::GpuModelOptions::collectives). NCCL
// implements it across GPUs (dist::NcclCommunicator); the GPU tests implement it for ranks that
// share one device.
//
// Contract (NCCL's, as in dist/communicator.h): every rank issues the same calls in the same order
// with the same count and dtype; the call returns once the sum is enqueued on `stream` (work
// enqueued after it on that stream sees the sum); the buffer belongs to the caller.
#pragma once

#include <cstddef>
#include <cstdint>

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
  // send: `count` elements of `dtype` on the device; recv: size() * count elements, rank r's
  // send at [r * count, (r + 1) * count) on every rank (NCCL's all-gather). send and recv do not
  // overlap.
  virtual void all_gather(const void* send, void* recv, size_t count, DType dtype,
                          CUstream_st* stream) = 0;
};

// The rows of the vocabulary (token embedding and lm_head) rank `rank` of a group of `size` holds:
// [begin, begin + count), an equal share when the vocabulary divides evenly, else (or for one
// rank) the whole of it. dist::shard_checkpoint cuts the checkpoint by it and the GPU model runs
// its embedding and output head by it.
struct VocabShard {
  int64_t begin = 0, count = 0;
  bool split = false;  // count < the vocabulary
};
inline VocabShard vocab_shard(int64_t vocab, int rank, int size) {
  if (size <= 1 || vocab % size != 0) return {0, vocab, false};
  const int64_t count = vocab / size;
  return {count * rank, count, true};
}

}  // namespace moelora
