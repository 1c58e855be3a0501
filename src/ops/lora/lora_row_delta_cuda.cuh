// Device side of LoraRowDelta (lora_cuda.cuh): a consumer kernel adds a dense target's LoRA delta
// to the row it is about to read, with the multi-target expand's arithmetic (same sums in the same
// order, the same two roundings), so folding the expand-add into the consumer changes no bit.
//
//   const int rank = lora_row_u(d, row, g, group, u);  // u: kLoraRowMaxRank floats, shared
//   <sync the group>
//   if (rank > 0) x[n] = lora_row_add(d, slot, rank, n, u, x[n]);
#pragma once

#include <cuda_bf16.h>

#include "ops/lora/lora_cuda.cuh"

namespace moelora::ops::cuda {

// u[r] = scaling[slot] * sum over splits of partial[split, row, r] for r < rank, written by the
// `group` threads of the caller (index g); returns rank (0: no delta for this row). *slot_out gets
// the row's slot. The caller synchronizes the group before reading u.
__device__ __forceinline__ int lora_row_u(const LoraRowDelta& d, int row, int g, int group,
                                          float* u, int* slot_out) {
  if (d.pool.b == nullptr) return 0;
  const int slot = d.row_slot[row];
  *slot_out = slot;
  if (slot < 0) return 0;
  const int R = d.pool.max_rank;
  const int rank = min(d.pool.rank[slot], R);
  if (rank == 0) return 0;
  const float scaling = d.pool.scaling[slot];
  for (int r = g; r < rank; r += group) {
    float s = 0.f;
    for (int sp = 0; sp < d.splits; ++sp)
      s += d.partial[(static_cast<size_t>(sp) * d.row_capacity + row) * R + r];
    u[r] = s * scaling;
  }
  return rank;
}

// bf16(x + bf16(sum_r u[r] * B[slot, 0, n, r])) for output column n (fma over r ascending, as the
// expand; R is a multiple of 8, so the pair (r, r + 1) is always inside B's row).
__device__ __forceinline__ float lora_row_add(const LoraRowDelta& d, int slot, int rank, int64_t n,
                                              const float* u, float x) {
  const int R = d.pool.max_rank;
  const __nv_bfloat16* b_row =
      d.pool.b + (static_cast<size_t>(slot) * d.pool.eb * d.pool.out_features + n) * R;
  float acc = 0.f;
  for (int r = 0; r < rank; r += 2) {
    const float2 bf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(b_row + r));
    acc = fmaf(u[r], bf.x, acc);
    acc = fmaf(r + 1 < rank ? u[r + 1] : 0.f, bf.y, acc);
  }
  return __bfloat162float(__float2bfloat16(x + __bfloat162float(__float2bfloat16(acc))));
}

}  // namespace moelora::ops::cuda
