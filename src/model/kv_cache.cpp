// Growable per-sequence caches (see kv_cache.h).
#include "model/kv_cache.h"

#include <algorithm>

namespace moelora::model {

void RowBuffer::append(const float* data, int64_t rows, int64_t stride) {
  MOELORA_ASSERT(rows >= 0 && stride >= width_);
  data_.reserve(static_cast<size_t>((rows_ + rows) * width_));
  for (int64_t r = 0; r < rows; ++r) data_.insert(data_.end(), data + r * stride, data + r * stride + width_);
  rows_ += rows;
}

void RowBuffer::truncate(int64_t rows) {
  MOELORA_CHECK(rows >= 0 && rows <= rows_, ErrorCode::kOutOfRange, "cache truncation to ", rows,
                " rows; it holds ", rows_);
  rows_ = rows;
  data_.resize(static_cast<size_t>(rows_ * width_));
}

Tensor RowBuffer::view(const Shape& shape) const {
  MOELORA_ASSERT(shape_numel(shape) == rows_ * width_, "cache view ", shape_str(shape), " of ", rows_, " x ",
                 width_);
  return Tensor::external(DType::kF32, shape, data_.data(), nullptr);
}

void LayerCache::truncate(int64_t size) {
  if (gqa) {
    gqa->truncate(size);
  } else {
    mla.k_nope.truncate(size);
    mla.k_rope.truncate(size);
    mla.v.truncate(size);
  }
}

void Sequence::truncate(int64_t length) {
  MOELORA_CHECK(length >= 0 && length <= this->length(), ErrorCode::kOutOfRange, "sequence truncation to ",
                length, " tokens; it holds ", this->length());
  tokens_.resize(static_cast<size_t>(length));
  for (LayerCache& layer : layers_) layer.truncate(length);
}

uint64_t Sequence::cache_bytes() const {
  uint64_t bytes = 0;
  for (const LayerCache& layer : layers_) {
    if (layer.gqa) {
      bytes += sizeof(float) * static_cast<uint64_t>(layer.gqa->size() * layer.gqa->num_kv_heads() *
                                                     (layer.gqa->head_dim() + layer.gqa->v_head_dim()));
    } else {
      bytes +=
          sizeof(float) *
          static_cast<uint64_t>(layer.mla.k_rope.rows() *
                                (layer.mla.k_nope.width() + layer.mla.k_rope.width() + layer.mla.v.width()));
    }
  }
  return bytes;
}

}  // namespace moelora::model
