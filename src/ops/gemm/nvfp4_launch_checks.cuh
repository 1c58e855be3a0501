// Host-side checks the two NVFP4 expert GEMM launchers share (W4A16: moe_gemm_nvfp4_stream_cuda.cu,
// W4A8: moe_gemm_nvfp4_w4a8_cuda.cu): their arguments (the two Args structs have the same fields,
// activations of another type) and the device they launch on.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include "core/cuda_utils.h"
#include "core/error.h"
#include "ops/gemm/stream_gemm_common.cuh"

namespace moelora::ops::cuda::nvfp4_launch {

// Throws moelora::Error naming the first bad field (`what` names the kernel); n_multiple: the
// weight rows of the kernel's smallest work item, k_multiple: the columns of a stage.
template <class Args>
void check_args(const Args& a, int n_multiple, int k_multiple, const char* what) {
  constexpr int kMaxExperts = stream_gemm::kMaxExperts;
  MOELORA_CHECK(
      a.act && a.act_scale && a.weight && a.row_scale && a.expert_offsets && a.active_experts &&
          a.num_active && a.out,
      ErrorCode::kInvalidArgument, what,
      ": act, act_scale, weight, row_scale, expert_offsets, active_experts, num_active and out are "
      "required");
  MOELORA_CHECK(a.num_experts > 0 && a.num_experts <= kMaxExperts, ErrorCode::kUnsupported, what,
                ": E = ", a.num_experts, " experts; the kernel's schedule holds 1 to ",
                kMaxExperts);
  MOELORA_CHECK(a.n > 0 && a.n % n_multiple == 0 && a.k > 0 && a.k % k_multiple == 0,
                ErrorCode::kUnsupported, what, ": N = ", a.n, " must be a positive multiple of ",
                n_multiple, " and K = ", a.k, " of ", k_multiple);
  MOELORA_CHECK(a.max_active_experts >= 1 && a.max_active_experts <= a.num_experts,
                ErrorCode::kInvalidArgument, what, ": max_active_experts = ", a.max_active_experts,
                " outside [1, E = ", a.num_experts, "]");
  MOELORA_CHECK(a.act_rows > 0, ErrorCode::kInvalidArgument, what, ": act_rows = ", a.act_rows,
                " must be positive");
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(a.weight) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.act) % 16 == 0,
                ErrorCode::kInvalidArgument, what, ": weight and act must be 16-byte aligned");
  MOELORA_CHECK(static_cast<int64_t>(a.num_experts) * a.n < (1LL << 31),
                ErrorCode::kInvalidArgument, what,
                ": E * N = ", static_cast<int64_t>(a.num_experts) * a.n, " rows exceed 2^31");
}

// Once per (device, kernel): refuses a device that is not sm_90 (the kernels use wgmma and TMA,
// built for sm_90a) and raises the kernel's dynamic shared-memory limit to smem_bytes.
inline void prepare_kernel(const void* kernel, int smem_bytes, const char* what) {
  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::set<std::pair<int, const void*>> prepared;
  std::lock_guard<std::mutex> lock(mutex);
  if (prepared.count({device, kernel})) return;
  int major = 0, minor = 0;
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  MOELORA_CHECK(major == 9 && minor == 0, ErrorCode::kUnsupported, what, ": device ", device,
                " is sm_", major, minor, "; the kernel needs sm_90a (Hopper: wgmma and TMA)");
  MOELORA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  prepared.insert({device, kernel});
}

}  // namespace moelora::ops::cuda::nvfp4_launch
