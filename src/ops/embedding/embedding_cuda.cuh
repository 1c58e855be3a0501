// Token embedding on the GPU: out[t, :] = table[ids[t] - first_id, :] (bf16 rows copied as they
// are).
// Ids were validated on the host by the scheduler (embedding_ref's kOutOfRange is the contract);
// the kernel still clamps nothing and reads rows < vocab only: an id outside [first_id, first_id +
// vocab) writes a zero row instead of reading out of bounds.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::ops::cuda {

struct EmbeddingArgs {
  const __nv_bfloat16* table = nullptr;  // [V, H]
  const int32_t* ids = nullptr;          // [T]
  __nv_bfloat16* out = nullptr;          // [T, H]
  int tokens = 0;                        // T (grid capacity; rows >= *num_tokens are skipped)
  const int32_t* num_tokens = nullptr;   // [1] valid rows (device), nullptr = tokens
  int hidden = 0;                        // H, multiple of 8
  int vocab = 0;                         // V: the table's rows
  // The id of the table's first row: a rank of a split vocabulary holds rows [first_id, first_id +
  // V) and writes zero rows for every other id (the group sums the ranks' lookups).
  int first_id = 0;
};
void launch_embedding(const EmbeddingArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
