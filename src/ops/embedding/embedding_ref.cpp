// CPU reference of the token embedding lookup (see embedding.h). Every id is checked before any
// row is read, so a bad request fails without touching memory beyond the table.
#include "ops/embedding/embedding.h"

#include <cstring>
#include <vector>

#include "core/threads.h"

namespace moelora::ops {

namespace {

// Copies row `row` of table [V, H] into out (H floats), converting to fp32.
void load_row(const Tensor& table, int64_t row, int64_t hidden, float* out) {
  const uint64_t first = static_cast<uint64_t>(row) * static_cast<uint64_t>(hidden);
  switch (table.dtype()) {
    case DType::kF32: std::memcpy(out, table.data<float>() + first, sizeof(float) * hidden); return;
    case DType::kBF16: {
      const uint16_t* bits = table.data<uint16_t>() + first;
      for (int64_t h = 0; h < hidden; ++h) out[h] = bf16_bits_to_f32(bits[h]);
      return;
    }
    default:
      for (int64_t h = 0; h < hidden; ++h) out[h] = load_as_f32(table.raw_data(), table.dtype(), first + h);
  }
}

void check_table(const Tensor& table) {
  MOELORA_CHECK(table.defined() && table.ndim() == 2 && dtype_is_float(table.dtype()),
                ErrorCode::kInvalidArgument,
                "embedding table: expected a 2-D float tensor [vocab, hidden], got ",
                table.defined() ? std::string(dtype_name(table.dtype())) + " " + shape_str(table.shape())
                                : std::string("an undefined tensor"));
}

}  // namespace

Tensor embedding_ref(const Tensor& table, std::span<const int32_t> ids) {
  check_table(table);
  const int64_t vocab = table.dim(0);
  const int64_t hidden = table.dim(1);
  const int64_t tokens = static_cast<int64_t>(ids.size());
  for (int64_t t = 0; t < tokens; ++t) {
    MOELORA_CHECK(ids[t] >= 0 && ids[t] < vocab, ErrorCode::kOutOfRange, "token id ", ids[t], " at position ",
                  t, " is out of range for an embedding table of vocab size ", vocab, " (valid ids: 0..",
                  vocab - 1, ")");
  }
  Tensor out = Tensor::empty(DType::kF32, {tokens, hidden});
  float* dst = out.data<float>();
  parallel_for(
      tokens,
      [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) load_row(table, ids[t], hidden, dst + t * hidden);
      },
      /*min_chunk=*/64);
  return out;
}

Tensor embedding_ref(const Tensor& table, const Tensor& ids) {
  MOELORA_CHECK(
      ids.defined() && ids.ndim() == 1 && (ids.dtype() == DType::kI32 || ids.dtype() == DType::kI64),
      ErrorCode::kInvalidArgument, "embedding ids: expected a 1-D I32 or I64 tensor [tokens], got ",
      ids.defined() ? std::string(dtype_name(ids.dtype())) + " " + shape_str(ids.shape())
                    : std::string("an undefined tensor"));
  if (ids.dtype() == DType::kI32) {
    return embedding_ref(table,
                         std::span<const int32_t>(ids.data<int32_t>(), static_cast<size_t>(ids.numel())));
  }
  // I64 ids: range-check in 64 bits first so that a huge id is reported as itself, not truncated.
  check_table(table);
  const int64_t* wide = ids.data<int64_t>();
  const int64_t vocab = table.dim(0);
  std::vector<int32_t> narrow(static_cast<size_t>(ids.numel()));
  for (int64_t t = 0; t < ids.numel(); ++t) {
    MOELORA_CHECK(wide[t] >= 0 && wide[t] < vocab, ErrorCode::kOutOfRange, "token id ", wide[t],
                  " at position ", t, " is out of range for an embedding table of vocab size ", vocab,
                  " (valid ids: 0..", vocab - 1, ")");
    narrow[t] = static_cast<int32_t>(wide[t]);
  }
  return embedding_ref(table, std::span<const int32_t>(narrow));
}

}  // namespace moelora::ops
