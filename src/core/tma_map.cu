#include "core/tma_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>

#include "core/error.h"

namespace moelora::cuda {

namespace {

// The driver entry point, looked up once through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) ==
            cudaSuccess &&
        status == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  });
  MOELORA_CHECK(fn != nullptr, ErrorCode::kCuda,
                "tensor map: the driver has no cuTensorMapEncodeTiled (needs a CUDA 12+ driver)");
  return fn;
}

}  // namespace

CUtensorMap make_tensor_map_2d(const void* base, CUtensorMapDataType dtype, uint64_t inner, uint64_t outer,
                               uint64_t row_bytes, uint32_t box_inner, uint32_t box_outer,
                               CUtensorMapSwizzle swizzle, const char* what) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&map, dtype, 2, const_cast<void*>(base), dims, strides, box,
                                          element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOELORA_CHECK(r == CUDA_SUCCESS, ErrorCode::kCuda, "tensor map: cuTensorMapEncodeTiled failed for ", what,
                " (error ", static_cast<int>(r), ", ", outer, " x ", inner, " elements, row stride ", row_bytes,
                " bytes)");
  return map;
}

}  // namespace moelora::cuda
