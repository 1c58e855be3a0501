// How one rank's share of a weight and of its LoRA factors is cut, for tensor parallelism (TP)
// and expert parallelism (EP). The rule of the LoRA factors follows the base weight's split:
//
//   column-parallel weight W [out, in] split on out:  W_r [out / n, in]
//       LoRA B [Eb, out, R] split on out (B_r [Eb, out / n, R]), A [Ea, R, in] whole:
//       y_r = x W_r^T + s (x A^T) B_r^T is rank r's slice of the output columns.
//   row-parallel weight W [out, in] split on in:  W_r [out, in / n]
//       LoRA A split on in (A_r [Ea, R, in / n]), B whole:
//       sum_r (x_r W_r^T + s (x_r A_r^T) B^T) = x W^T + s (x A^T) B^T, so the partial sums of the
//       base and the delta are reduced together, once.
//   expert-parallel weights W [E, ...] split on E:  experts [r E / n, (r + 1) E / n)
//       per-expert factors [E, ...] split likewise; a shared-outer factor ([1, ...], used by every
//       expert) is kept whole on every rank.
//
// Every split is into n equal contiguous blocks; a dimension that n does not divide is an error
// naming the tensor, the dimension and both numbers. The returned tensors are copies (a rank owns
// its share, as a GPU would).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"

namespace moelora::dist {

// Rank `rank` of `size` ranks in one parallel dimension (TP or EP).
struct ShardSpec {
  int rank = 0;
  int size = 1;
};

// [begin, end) of `shard`'s block of `n` items; `what` names the tensor and dimension in errors.
struct ShardRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
ShardRange shard_range(int64_t n, ShardSpec shard, const std::string& what);

// &f when f holds factors, else nullptr (the "not targeted" of the operators' LoRA arguments).
inline const LoraFactors* factors_or_null(const LoraFactors& f) {
  return f.defined() ? &f : nullptr;
}

// The shard's block of dimension `dim` of `t` (any rank of tensor), as a new contiguous tensor.
Tensor shard_dim(const Tensor& t, int dim, ShardSpec shard, const std::string& what);
// Items [begin, end) of dimension `dim` of `t`, as a new contiguous tensor (a block that several
// ranks hold alike, such as a KV head when there are more ranks than KV heads).
Tensor slice_dim(const Tensor& t, int dim, int64_t begin, int64_t end, const std::string& what);

// The items of several [begin, end) ranges of dimension `dim` of `t`, concatenated in order: the
// share of a tensor whose rows are blocks laid end to end (Gated DeltaNet's [q | k | v] channels).
Tensor slice_ranges(const Tensor& t, int dim, const std::vector<ShardRange>& ranges,
                    const std::string& what);

// LoRA factors of a column-parallel weight (B split on out), of a row-parallel weight (A split on
// in), and of expert-parallel weights (per-expert factors split on experts, shared-outer whole).
// Undefined factors stay undefined.
LoraFactors shard_lora_column(const LoraFactors& f, ShardSpec shard, const std::string& what);
LoraFactors shard_lora_row(const LoraFactors& f, ShardSpec shard, const std::string& what);
LoraFactors shard_lora_experts(const LoraFactors& f, int64_t num_experts, ShardSpec shard,
                               const std::string& what);

}  // namespace moelora::dist
