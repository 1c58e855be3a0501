// Token embedding lookup: the first op of every model, and the only one that takes raw token ids
// from the outside world. A bad id (a tokenizer for another vocabulary, a corrupt request) must
// become an error that names the id and the table size, never an out-of-bounds read.
//
//   out[t, :] = fp32(table[ids[t], :])    table [V, H] (F32, BF16 or F16), ids [T] -> out F32 [T, H]
#pragma once

#include <cstdint>
#include <span>

#include "core/tensor.h"

namespace moelora::ops {

// table: [V, H] of any float dtype (the checkpoint's embed_tokens, used in place); ids: I32 or I64
// [T]. Returns F32 [T, H]. Throws kOutOfRange for an id outside [0, V), naming the id, its
// position and V; kInvalidArgument for a table that is not 2-D float or ids that are not 1-D ints.
Tensor embedding_ref(const Tensor& table, const Tensor& ids);
// Same, ids given as a host span (what the tokenizer and the scheduler hold).
Tensor embedding_ref(const Tensor& table, std::span<const int32_t> ids);

}  // namespace moelora::ops
