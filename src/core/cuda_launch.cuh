// Launches of the decode chain's kernels (route .. finalize, the LoRA segment kernels), which run
// beside or overlap the persistent stream GEMM: each takes the shared-memory-maximum carveout
// (prefer_max_shared_carveout in core/cuda_utils.h says why), and optionally programmatic
// dependent launch (PDL): with `pdl` set, the kernel
// is launched with programmatic stream serialization, so it may be scheduled while the previous
// kernel in the stream is still running (that kernel lets it start with griddepcontrol.
// launch_dependents, and this one waits for it with griddepcontrol.wait before reading its
// outputs; core/sm90_ptx.cuh). Without `pdl` it is an ordinary launch. Capturable into graphs.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "core/cuda_utils.h"

namespace moelora::cuda {

template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, bool pdl, Args&&... args) {
  prefer_max_shared_carveout(reinterpret_cast<const void*>(kernel));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  MOELORA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace moelora::cuda
