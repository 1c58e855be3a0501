// Host-side tensor maps for the tensor memory accelerator (TMA) of Hopper: the 2-D row-major views
// the weight-streaming expert GEMMs (ops/gemm/moe_gemm_*stream_cuda.cu) copy their tiles through.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace moelora::cuda {

// Row-major 2-D tensor [outer, inner] of `dtype` elements, `row_bytes` apart, tiled in boxes of
// [box_outer, box_inner]; out-of-range elements read as zeros. `what` names the tensor in the error
// (moelora::Error, kCuda) when the driver refuses the map (an unaligned base or stride, a box past
// the swizzle span) or has no cuTensorMapEncodeTiled.
CUtensorMap make_tensor_map_2d(const void* base, CUtensorMapDataType dtype, uint64_t inner, uint64_t outer,
                               uint64_t row_bytes, uint32_t box_inner, uint32_t box_outer,
                               CUtensorMapSwizzle swizzle, const char* what);

}  // namespace moelora::cuda
