#include "core/tensor.h"

#include <cstring>
#include <limits>

namespace moelora {

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    MOELORA_CHECK(d >= 0, ErrorCode::kInvalidArgument, "negative dimension in shape ", shape_str(shape));
    MOELORA_CHECK(d == 0 || n <= std::numeric_limits<int64_t>::max() / d, ErrorCode::kOutOfRange,
                  "element count of shape ", shape_str(shape), " overflows int64");
    n *= d;
  }
  return n;
}

Tensor Tensor::empty(DType dtype, Shape shape) {
  Tensor t;
  t.dtype_ = dtype;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  const uint64_t bytes = std::max<uint64_t>(t.nbytes(), 1);
  std::shared_ptr<uint8_t[]> storage(new uint8_t[bytes]);
  t.data_ = storage.get();
  t.owner_ = std::shared_ptr<const void>(storage, storage.get());
  return t;
}

Tensor Tensor::zeros(DType dtype, Shape shape) {
  Tensor t = empty(dtype, std::move(shape));
  std::memset(t.raw_data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::external(DType dtype, Shape shape, const void* data, std::shared_ptr<const void> owner) {
  Tensor t;
  t.dtype_ = dtype;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.data_ = data;
  t.owner_ = std::move(owner);
  return t;
}

Tensor Tensor::from_f32(const std::vector<float>& values, Shape shape) {
  Tensor t = empty(DType::kF32, std::move(shape));
  MOELORA_CHECK(static_cast<int64_t>(values.size()) == t.numel_, ErrorCode::kInvalidArgument,
                "from_f32: ", values.size(), " values for shape ", shape_str(t.shape_));
  std::memcpy(t.raw_data(), values.data(), t.nbytes());
  return t;
}

Tensor Tensor::from_i32(const std::vector<int32_t>& values, Shape shape) {
  Tensor t = empty(DType::kI32, std::move(shape));
  MOELORA_CHECK(static_cast<int64_t>(values.size()) == t.numel_, ErrorCode::kInvalidArgument,
                "from_i32: ", values.size(), " values for shape ", shape_str(t.shape_));
  std::memcpy(t.raw_data(), values.data(), t.nbytes());
  return t;
}

int64_t Tensor::dim(int i) const {
  const int n = ndim();
  const int j = i < 0 ? i + n : i;
  MOELORA_CHECK(j >= 0 && j < n, ErrorCode::kOutOfRange, "dimension ", i, " of a tensor with shape ",
                shape_str(shape_));
  return shape_[j];
}

Tensor Tensor::reshape(Shape shape) const {
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      MOELORA_CHECK(infer < 0, ErrorCode::kInvalidArgument, "reshape: more than one -1 in ", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    MOELORA_CHECK(known > 0 && numel_ % known == 0, ErrorCode::kInvalidArgument, "cannot reshape ",
                  shape_str(shape_), " to ", shape_str(shape));
    shape[infer] = numel_ / known;
  }
  MOELORA_CHECK(shape_numel(shape) == numel_, ErrorCode::kInvalidArgument, "cannot reshape ",
                shape_str(shape_), " to ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  MOELORA_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0], ErrorCode::kOutOfRange,
                "slice [", begin, ", ", end, ") of dimension 0 of shape ", shape_str(shape_));
  const int64_t row = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  const uint64_t row_bits = static_cast<uint64_t>(row) * dtype_bits(dtype_);
  MOELORA_CHECK(row_bits % 8 == 0 || begin == 0, ErrorCode::kInvalidArgument,
                "slice of a packed tensor does not start on a byte");
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.numel_ = row * (end - begin);
  t.data_ = static_cast<const uint8_t*>(data_) + row_bits / 8 * begin;
  return t;
}

Tensor Tensor::select0(int64_t i) const {
  Tensor t = slice0(i, i + 1);
  t.shape_.erase(t.shape_.begin());
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  Tensor out = zeros(dtype, shape_);
  for (int64_t i = 0; i < numel_; ++i) store_from_f32(out.raw_data(), dtype, i, load_as_f32(data_, dtype_, i));
  return out;
}

Tensor Tensor::clone() const {
  Tensor out = empty(dtype_, shape_);
  if (nbytes()) std::memcpy(out.raw_data(), data_, nbytes());
  return out;
}

float Tensor::item_f32(int64_t flat_index) const {
  MOELORA_CHECK(flat_index >= 0 && flat_index < numel_, ErrorCode::kOutOfRange, "element ", flat_index,
                " of a tensor with ", numel_, " elements");
  return load_as_f32(data_, dtype_, static_cast<uint64_t>(flat_index));
}

void check_shape(const Tensor& t, const Shape& expected, const std::string& what) {
  MOELORA_CHECK(t.shape() == expected, ErrorCode::kInvalidArgument, what, ": expected shape ",
                shape_str(expected), ", got ", shape_str(t.shape()));
}

void check_dtype(const Tensor& t, DType expected, const std::string& what) {
  MOELORA_CHECK(t.dtype() == expected, ErrorCode::kInvalidArgument, what, ": expected dtype ",
                dtype_name(expected), ", got ", dtype_name(t.dtype()));
}

}  // namespace moelora
