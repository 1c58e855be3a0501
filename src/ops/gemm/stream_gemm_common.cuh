// What the two weight-streaming expert GEMMs (FP8: moe_gemm_stream_cuda.cu, NVFP4:
// moe_gemm_nvfp4_stream_cuda.cu) share on the device: the routing schedule copied into shared
// memory, work items claimed first come first served, and the activation copies of the first
// ring fill held back until the kernel before them in the stream has completed (programmatic
// dependent launch: weights do not depend on it, activations do). sm_90a only.
#pragma once

#include <cstdint>

#include "core/sm90_ptx.cuh"

namespace moelora::ops::cuda::stream_gemm {

// The schedule in shared memory: active[kMaxExperts], offsets[kMaxExperts + 1], count.
constexpr int kMaxExperts = 512;
constexpr int kScheduleBytes = (2 * kMaxExperts + 2) * 4;

struct Schedule {
  const int* active;   // experts with pairs, ascending
  const int* offsets;  // [E + 1] sorted-position ranges
  int num_active;
};

// Every thread of the CTA copies its share of the align kernel's schedule into `smem` (written
// before the kernel this one may overlap started, so readable before griddepcontrol.wait); the
// caller's __syncthreads publishes it and schedule_view reads it after.
__device__ __forceinline__ void stage_schedule(int* smem, const int32_t* num_active, const int32_t* active,
                                               const int32_t* offsets, int num_experts) {
  const int n_active = *num_active;
  for (int i = threadIdx.x; i < n_active; i += blockDim.x) smem[i] = active[i];
  for (int i = threadIdx.x; i <= num_experts; i += blockDim.x) smem[kMaxExperts + i] = offsets[i];
  if (threadIdx.x == 0) smem[2 * kMaxExperts + 1] = n_active;
}
__device__ __forceinline__ Schedule schedule_view(const int* smem) {
  return Schedule{smem, smem + kMaxExperts, smem[2 * kMaxExperts + 1]};
}

// The CTA's next work item after `current` (its first is its own index): from the shared counter
// work[0] when there is one, else round-robin.
__device__ __forceinline__ int claim_item(int* work, int current) {
  return (work ? atomicAdd(work, 1) : current) + static_cast<int>(gridDim.x);
}

// After the CTA's final claim: the last CTA to get here resets both counters for the next launch
// (no claim of this launch can follow any more).
__device__ __forceinline__ void release_work_counters(int* work) {
  if (!work) return;
  __threadfence();
  if (atomicAdd(work + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    atomicExch(work, 0);
    atomicExch(work + 1, 0);
  }
}

// The producer's activation copies of stages 0 .. kStages - 1 (the first ring fill) wait until
// the fill's weight copies are all issued, then griddepcontrol.wait, then go out; later stages'
// copies go out at once. issue(stage, q0, width, k_block) issues one stage's copies.
template <int kStages>
struct FirstFillGate {
  int q0[kStages], width[kStages], k_block[kStages];
  int pending = 0;
  bool waited = false;

  template <typename Issue>
  __device__ __forceinline__ void copy(int stage, int pass_q0, int pass_width, int kb, Issue&& issue) {
    if (waited) {
      issue(stage, pass_q0, pass_width, kb);
      return;
    }
    q0[pending] = pass_q0, width[pending] = pass_width, k_block[pending] = kb;
    if (++pending == kStages) release(issue);
  }
  // Issues what is held (a CTA with fewer stages of work than the ring); call once at the end.
  template <typename Issue>
  __device__ __forceinline__ void finish(Issue&& issue) {
    if (!waited) release(issue);
  }

 private:
  template <typename Issue>
  __device__ __forceinline__ void release(Issue& issue) {
    ::moelora::cuda::sm90::grid_dependency_wait();
    waited = true;
    for (int s = 0; s < pending; ++s) issue(s, q0[s], width[s], k_block[s]);
  }
};

}  // namespace moelora::ops::cuda::stream_gemm
