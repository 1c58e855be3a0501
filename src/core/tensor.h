// Host tensors.
//
// Tensor is a contiguous, row-major, host-side n-d array with shared storage: copying a Tensor
// aliases the same bytes (like a shared_ptr). The storage either owns heap memory or keeps some
// other owner alive (an mmap'ed safetensors file), so weights can be used in place without a copy.
// Device memory lives in src/core/cuda_* (DeviceBuffer), never here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace moelora {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);  // "[2, 3, 4]"
// Product of dims; throws on negative dims or int64 overflow.
int64_t shape_numel(const Shape& shape);

namespace detail {
template <typename T>
struct ElementTraits;
template <>
struct ElementTraits<float> {
  static bool accepts(DType t) { return t == DType::kF32; }
};
template <>
struct ElementTraits<double> {
  static bool accepts(DType t) { return t == DType::kF64; }
};
template <>
struct ElementTraits<int32_t> {
  static bool accepts(DType t) { return t == DType::kI32; }
};
template <>
struct ElementTraits<int64_t> {
  static bool accepts(DType t) { return t == DType::kI64; }
};
template <>
struct ElementTraits<uint16_t> {  // raw bits of bf16 / fp16
  static bool accepts(DType t) { return t == DType::kBF16 || t == DType::kF16 || t == DType::kU16; }
};
template <>
struct ElementTraits<uint8_t> {  // raw bytes of 8-bit and packed 4-bit types
  static bool accepts(DType t) {
    return t == DType::kU8 || t == DType::kF8E4M3 || t == DType::kF8E5M2 ||
           t == DType::kF8E8M0 || t == DType::kE2M1x2 || t == DType::kBool;
  }
};
}  // namespace detail

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(DType dtype, Shape shape);
  static Tensor zeros(DType dtype, Shape shape);
  // Wraps memory owned by `owner` (kept alive as long as any alias of the tensor lives).
  static Tensor external(DType dtype, Shape shape, const void* data, std::shared_ptr<const void> owner);
  static Tensor from_f32(const std::vector<float>& values, Shape shape);
  static Tensor from_i32(const std::vector<int32_t>& values, Shape shape);

  bool defined() const { return data_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Size of dimension i; negative i counts from the end.
  int64_t dim(int i) const;
  int64_t numel() const { return numel_; }
  uint64_t nbytes() const { return dtype_bytes(dtype_, static_cast<uint64_t>(numel_)); }

  const void* raw_data() const { return data_; }
  void* raw_data() { return const_cast<void*>(data_); }
  template <typename T>
  T* data() {
    check_element<T>();
    return static_cast<T*>(raw_data());
  }
  template <typename T>
  const T* data() const {
    check_element<T>();
    return static_cast<const T*>(raw_data());
  }

  // Same storage, new shape with the same number of elements. One dim may be -1.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) of dimension 0, sharing storage.
  Tensor slice0(int64_t begin, int64_t end) const;
  // Element i of dimension 0 with that dimension removed, sharing storage.
  Tensor select0(int64_t i) const;

  // New tensor with values converted through fp32 (exact for widening conversions).
  Tensor to(DType dtype) const;
  Tensor to_f32() const { return to(DType::kF32); }
  Tensor clone() const;
  float item_f32(int64_t flat_index) const;

 private:
  template <typename T>
  void check_element() const {
    MOELORA_CHECK(detail::ElementTraits<T>::accepts(dtype_), ErrorCode::kInvalidArgument,
                  "tensor of dtype ", dtype_name(dtype_), " accessed with an element type of ",
                  sizeof(T), " bytes that does not match");
  }

  DType dtype_ = DType::kF32;
  Shape shape_;
  int64_t numel_ = 0;
  std::shared_ptr<const void> owner_;
  const void* data_ = nullptr;
};

// Throws kInvalidArgument naming `what` when t's shape differs from `expected`.
void check_shape(const Tensor& t, const Shape& expected, const std::string& what);
void check_dtype(const Tensor& t, DType expected, const std::string& what);

}  // namespace moelora
