// Growable per-sequence caches (see kv_cache.h).
#include "model/kv_cache.h"

#include <algorithm>

namespace moelora::model {

void RowBuffer::append(const float* data, int64_t rows, int64_t stride) {
  MOELORA_ASSERT(rows >= 0 && stride >= width_);
  data_.reserve(static_cast<size_t>((rows_ + rows) * width_));
  for (int64_t r = 0; r < rows; ++r)
    data_.insert(data_.end(), data + r * stride, data + r * stride + width_);
  rows_ += rows;
}

void RowBuffer::truncate(int64_t rows) {
  MOELORA_CHECK(rows >= 0 && rows <= rows_, ErrorCode::kOutOfRange, "cache truncation to ", rows,
                " rows; it holds ", rows_);
  rows_ = rows;
  data_.resize(static_cast<size_t>(rows_ * width_));
}

Tensor RowBuffer::view(const Shape& shape) const {
  MOELORA_ASSERT(shape_numel(shape) == rows_ * width_, "cache view ", shape_str(shape), " of ",
                 rows_, " x ", width_);
  return Tensor::external(DType::kF32, shape, data_.data(), nullptr);
}

void GdnLayerCache::begin_update() {
  if (tokens_before >= 0) return;
  before = {state.conv.clone(), state.recurrent.clone()};
  tokens_before = tokens;
}

void GdnLayerCache::commit() {
  before = {};
  tokens_before = -1;
}

void LayerCache::truncate(int64_t size) {
  if (gqa) {
    gqa->truncate(size);
  } else if (gdn) {
    // The backup first: a pass that failed inside the state update left the state changed but
    // the token count not yet advanced.
    if (gdn->tokens_before >= 0 && size == gdn->tokens_before) {
      gdn->state = gdn->before;
      gdn->tokens = gdn->tokens_before;
      gdn->commit();
    } else if (size == gdn->tokens) {
      return;
    } else if (size == 0) {
      gdn->state = {Tensor::zeros(DType::kF32, gdn->state.conv.shape()),
                    Tensor::zeros(DType::kF32, gdn->state.recurrent.shape())};
      gdn->tokens = 0;
      gdn->commit();
    } else {
      MOELORA_THROW(
          ErrorCode::kUnsupported, "cannot truncate a linear-attention (Gated DeltaNet) ",
          "state of ", gdn->tokens, " tokens to ", size,
          ": the state keeps no per-token history; truncate to 0 and feed the tokens again");
    }
  } else {
    mla.k_nope.truncate(size);
    mla.k_rope.truncate(size);
    mla.v.truncate(size);
  }
}

void LayerCache::commit() {
  if (gdn) gdn->commit();
}

uint64_t LayerCache::bytes() const {
  if (gqa) {
    return sizeof(float) * static_cast<uint64_t>(gqa->size() * gqa->num_kv_heads() *
                                                 (gqa->head_dim() + gqa->v_head_dim()));
  }
  if (gdn) return gdn->state.conv.nbytes() + gdn->state.recurrent.nbytes();
  return sizeof(float) *
         static_cast<uint64_t>(mla.k_rope.rows() *
                               (mla.k_nope.width() + mla.k_rope.width() + mla.v.width()));
}

void Sequence::truncate(int64_t length) {
  MOELORA_CHECK(length >= 0 && length <= this->length(), ErrorCode::kOutOfRange,
                "sequence truncation to ", length, " tokens; it holds ", this->length());
  for (const LayerCache& layer : layers_) {
    MOELORA_CHECK(
        !layer.gdn || length == 0 || length == this->length(), ErrorCode::kUnsupported,
        "cannot truncate a sequence of a model with linear-attention (Gated DeltaNet) layers from ",
        this->length(), " to ", length,
        " tokens: their state keeps no per-token history; truncate to 0 and feed the tokens again");
  }
  tokens_.resize(static_cast<size_t>(length));
  for (LayerCache& layer : layers_) layer.truncate(length);
}

uint64_t Sequence::cache_bytes() const {
  return kv_bytes() + state_bytes();
}

uint64_t Sequence::kv_bytes() const {
  uint64_t bytes = 0;
  for (const LayerCache& layer : layers_) {
    if (!layer.gdn) bytes += layer.bytes();
  }
  return bytes;
}

uint64_t Sequence::state_bytes() const {
  uint64_t bytes = 0;
  for (const LayerCache& layer : layers_) {
    if (layer.gdn) bytes += layer.bytes();
  }
  return bytes;
}

}  // namespace moelora::model
