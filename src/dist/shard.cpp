// Weight and LoRA slicing for tensor and expert parallelism (see shard.h).
#include "dist/shard.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace moelora::dist {

namespace {

void check_shard(ShardSpec shard, const std::string& what) {
  MOELORA_CHECK(shard.size >= 1 && shard.rank >= 0 && shard.rank < shard.size,
                ErrorCode::kInvalidArgument, what, ": rank ", shard.rank, " of ", shard.size,
                " ranks is not a rank (expected 0 <= rank < size, size >= 1)");
}

}  // namespace

ShardRange shard_range(int64_t n, ShardSpec shard, const std::string& what) {
  check_shard(shard, what);
  MOELORA_CHECK(n >= 0 && n % shard.size == 0, ErrorCode::kInvalidArgument, what, ": ", n,
                " is not divisible by ", shard.size,
                " ranks; every rank needs an equal share (choose a parallel size that divides it)");
  const int64_t per = n / shard.size;
  return {per * shard.rank, per * (shard.rank + 1)};
}

Tensor shard_dim(const Tensor& t, int dim, ShardSpec shard, const std::string& what) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, what, ": the tensor to split is undefined");
  MOELORA_CHECK(dim >= 0 && dim < t.ndim(), ErrorCode::kInvalidArgument, what,
                ": cannot split dimension ", dim, " of a tensor of shape ", shape_str(t.shape()));
  const ShardRange range =
      shard_range(t.dim(dim), shard, what + " (dimension " + std::to_string(dim) + " of " +
                                         shape_str(t.shape()) + ")");
  return slice_dim(t, dim, range.begin, range.end, what);
}

Tensor slice_dim(const Tensor& t, int dim, int64_t begin, int64_t end, const std::string& what) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, what, ": the tensor to slice is undefined");
  MOELORA_CHECK(dim >= 0 && dim < t.ndim(), ErrorCode::kInvalidArgument, what,
                ": cannot slice dimension ", dim, " of a tensor of shape ", shape_str(t.shape()));
  MOELORA_CHECK(0 <= begin && begin < end && end <= t.dim(dim), ErrorCode::kOutOfRange, what,
                ": items [", begin, ", ", end, ") of dimension ", dim, " of ", shape_str(t.shape()),
                " are not within it");
  // View t as [outer, n, inner] and copy items [begin, end) of the middle dimension.
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= t.dim(d);
  for (int d = dim + 1; d < t.ndim(); ++d) inner *= t.dim(d);
  Shape shape = t.shape();
  shape[static_cast<size_t>(dim)] = end - begin;
  Tensor out = Tensor::empty(t.dtype(), shape);
  const auto* src = static_cast<const uint8_t*>(t.raw_data());
  auto* dst = static_cast<uint8_t*>(out.raw_data());
  const auto bytes = [&](int64_t elements) {
    return static_cast<size_t>(dtype_bytes(t.dtype(), static_cast<uint64_t>(elements)));
  };
  const size_t block = bytes((end - begin) * inner);
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(dst + static_cast<size_t>(o) * block, src + bytes((o * t.dim(dim) + begin) * inner),
                block);
  }
  return out;
}

Tensor slice_ranges(const Tensor& t, int dim, const std::vector<ShardRange>& ranges,
                    const std::string& what) {
  MOELORA_CHECK(!ranges.empty(), ErrorCode::kInvalidArgument, what, ": no ranges to slice");
  for (const ShardRange& r : ranges)
    MOELORA_CHECK(r.size() > 0, ErrorCode::kInvalidArgument, what, ": an empty range [", r.begin,
                  ", ", r.end, ") among the blocks to slice (a block of zero heads?)");
  std::vector<Tensor> parts;
  int64_t total = 0;
  for (const ShardRange& r : ranges) {
    parts.push_back(slice_dim(t, dim, r.begin, r.end, what));
    total += r.size();
  }
  // Each part as [outer, size, inner]; the result [outer, total, inner] takes them side by side.
  int64_t outer = 1;
  for (int d = 0; d < dim; ++d) outer *= t.dim(d);
  Shape shape = t.shape();
  shape[static_cast<size_t>(dim)] = total;
  Tensor out = Tensor::empty(t.dtype(), shape);
  auto* dst = static_cast<uint8_t*>(out.raw_data());
  const size_t out_block = static_cast<size_t>(out.nbytes() / std::max<int64_t>(outer, 1));
  size_t offset = 0;
  for (const Tensor& part : parts) {
    const size_t block = static_cast<size_t>(part.nbytes() / std::max<int64_t>(outer, 1));
    const auto* src = static_cast<const uint8_t*>(part.raw_data());
    for (int64_t o = 0; o < outer; ++o)
      std::memcpy(dst + static_cast<size_t>(o) * out_block + offset,
                  src + static_cast<size_t>(o) * block, block);
    offset += block;
  }
  return out;
}

LoraFactors shard_lora_column(const LoraFactors& f, ShardSpec shard, const std::string& what) {
  if (!f.defined()) return f;
  return {f.a.clone(), shard_dim(f.b, 1, shard, what + " lora B"), f.scaling};
}

LoraFactors shard_lora_row(const LoraFactors& f, ShardSpec shard, const std::string& what) {
  if (!f.defined()) return f;
  return {shard_dim(f.a, 2, shard, what + " lora A"), f.b.clone(), f.scaling};
}

LoraFactors shard_lora_experts(const LoraFactors& f, int64_t num_experts, ShardSpec shard,
                               const std::string& what) {
  if (!f.defined()) return f;
  auto split = [&](const Tensor& t, const char* name) {
    if (t.dim(0) == 1 && num_experts != 1) return t.clone();  // shared-outer: every rank
    MOELORA_CHECK(t.dim(0) == num_experts, ErrorCode::kInvalidArgument, what, " lora ", name,
                  ": expected 1 or ", num_experts, " experts in dimension 0, got ",
                  shape_str(t.shape()));
    return shard_dim(t, 0, shard, what + " lora " + name);
  };
  return {split(f.a, "A"), split(f.b, "B"), f.scaling};
}

}  // namespace moelora::dist
