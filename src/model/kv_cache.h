// Per-sequence state of the CPU model: the token history and one growable fp32 cache per layer.
//
// GQA layers (Qwen3-MoE) keep ops::KvCacheRef: K [S, Hkv, D] (after k_norm and RoPE) and
// V [S, Hkv, D], exactly what transformers' DynamicCache holds.
//
// Gated DeltaNet layers (Qwen3.5 linear attention) keep no per-token rows at all: their state is a
// fixed-size ops::GdnState (the conv inputs of the last K - 1 tokens and the recurrent state
// S [nv, dk, dv]), the same size at position 0 and at position 100k. Such a state cannot be cut
// back to an earlier position; the cache keeps the state from before the forward pass that is
// running (a backup, dropped by commit()) so that a failed pass can be undone, and otherwise only
// truncates to its current length or to 0 (a fresh state).
//
// MLA layers (DeepSeek-V3 / Kimi) keep the expanded per-head keys and values, like transformers:
// k_nope [S, n, nope] and v [S, n, dv] (the kv_b_proj output, LoRA included) and the rotated
// shared k_rope [S, rope] (stored once, not per head). The alternative, the 576-value latent
// (c_kv, k_rope) that the GPU engine caches, would make every decode step re-run kv_b_proj (and its
// LoRA) over all S cached positions on the CPU; since a sequence's adapter never changes, the
// expanded form is both exact and cheaper here. The GPU path is tested against the absorbed
// form of ops/mla instead.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/tensor.h"
#include "ops/attention/attention.h"
#include "ops/gdn/gdn.h"

namespace moelora::model {

// Rows of a fixed width, appended at the end; view() aliases the storage until the next append.
class RowBuffer {
 public:
  RowBuffer() = default;
  explicit RowBuffer(int64_t width) : width_(width) {}
  int64_t rows() const { return rows_; }
  int64_t width() const { return width_; }
  // Appends `rows` rows of `width` floats each from `data` (consecutive rows `stride` floats
  // apart).
  void append(const float* data, int64_t rows, int64_t stride);
  void truncate(int64_t rows);
  // The stored rows as F32 `shape` (whose element count must be rows() * width()), zero-copy.
  Tensor view(const Shape& shape) const;

 private:
  int64_t width_ = 0;
  int64_t rows_ = 0;
  std::vector<float> data_;
};

struct MlaLayerCache {
  RowBuffer k_nope;  // [S, n * nope]
  RowBuffer k_rope;  // [S, rope], rotated
  RowBuffer v;       // [S, n * dv]
};

// The recurrent state of one linear-attention layer of one sequence.
struct GdnLayerCache {
  ops::GdnState state;
  int64_t tokens = 0;  // tokens folded into the state
  // The state before the running forward pass (see the file comment); tokens_before = -1: none.
  ops::GdnState before;
  int64_t tokens_before = -1;

  // Keeps the current state as the backup of the running pass (once per pass) before it changes.
  void begin_update();
  // The running pass succeeded: drops the backup.
  void commit();
};

struct LayerCache {
  std::optional<ops::KvCacheRef> gqa;  // GQA layers
  MlaLayerCache mla;                   // MLA layers
  std::optional<GdnLayerCache> gdn;    // Gated DeltaNet layers
  int64_t size() const { return gqa ? gqa->size() : gdn ? gdn->tokens : mla.k_rope.rows(); }
  // GQA / MLA: drops the rows from `size` on. Gated DeltaNet: `size` must be the current length
  // (no-op), the length before the running pass (restores its backup) or 0 (a fresh state);
  // anything else is kUnsupported.
  void truncate(int64_t size);
  void commit();  // the running forward pass succeeded (drops a Gated DeltaNet backup)
  uint64_t bytes() const;
};

// One sequence being decoded: its adapter slot (-1 = base), the tokens it has been fed and the
// caches of every layer. Made by Model::new_sequence; advanced only by Model::forward.
class Sequence {
 public:
  Sequence() = default;
  int32_t slot() const { return slot_; }
  // Number of tokens in the cache (= the position of the next token).
  int64_t length() const { return static_cast<int64_t>(tokens_.size()); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Forgets all but the first `length` tokens (e.g. to re-run a prompt suffix). A model with
  // linear-attention layers can only go back to 0 tokens (their state has no per-token history):
  // any other shorter length is kUnsupported.
  void truncate(int64_t length);
  // Bytes held by the caches: all of them, the attention layers' KV only, the linear-attention
  // (Gated DeltaNet) layers' conv + recurrent states only.
  uint64_t cache_bytes() const;
  uint64_t kv_bytes() const;
  uint64_t state_bytes() const;

 private:
  friend class Model;
  uint64_t model_id_ = 0;
  int32_t slot_ = -1;
  std::vector<int32_t> tokens_;
  std::vector<LayerCache> layers_;
};

}  // namespace moelora::model
