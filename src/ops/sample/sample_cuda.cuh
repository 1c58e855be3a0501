// GPU sampler (sample.h is the oracle): one CTA per row over fp32 logits [B, V]; greedy rows do an
// argmax (first index of the maximum, bit-identical to the reference); sampled rows compute the
// softmax in fp32, apply top-k / top-p without sorting the vocabulary (threshold search on the
// probabilities) and pick with the row's uniform number u. Probability ties at a top-k / top-p
// boundary may resolve differently from the double-precision reference; everything else matches.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/sample/sample.h"

namespace moelora::ops::cuda {

struct SampleArgs {
  const float* logits = nullptr;  // [rows, vocab], row stride `stride` (0 = vocab)
  int64_t stride = 0;
  const SampleRowParams* params = nullptr;  // [rows] device
  const float* uniform = nullptr;           // [rows] device, u in [0, 1)
  int32_t* tokens = nullptr;                // [rows] out
  int rows = 0;                             // grid capacity
  const int32_t* num_rows = nullptr;        // [1] valid rows (device), nullptr = rows
  int vocab = 0;
};
void launch_sample(const SampleArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
