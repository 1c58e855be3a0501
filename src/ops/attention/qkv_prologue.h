// The input stage of GQA attention on a fused qkv projection, as one op: per-head RMSNorm of q and
// k (Qwen3's q_norm / k_norm; optional), RoPE on q and k, and (on the GPU) the append of the new
// k and v rows to the paged KV cache. The CPU reference is the composition of the references it
// fuses (ops::rms_norm_inplace_ref per head, ops::apply_rope_inplace_ref); the GPU kernel is
// qkv_prologue_cuda.cuh.
//
// A row of qkv [T, width] holds q [q_heads, head_dim] at column 0, k [kv_heads, head_dim] at
// k_offset and v [kv_heads, head_dim] at v_offset (Qwen3.5's gated q_proj puts its gate block
// between q and k; the op never touches it).
#pragma once

#include <cstdint>
#include <span>

#include "core/model_enums.h"
#include "core/tensor.h"
#include "ops/norm/norm.h"
#include "ops/rope/rope.h"

namespace moelora::ops {

struct QkvPrologueParams {
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t k_offset = 0;  // first column of k in a row
  int64_t v_offset = 0;  // first column of v in a row
  RmsNormParams norm;    // eps and style of q_norm / k_norm
  RopeStyle rope_style = RopeStyle::kRotateHalf;
  // Round to bf16 after the norm and after RoPE, as a bf16 activation buffer stores them (the GPU
  // engine's numerics); false keeps fp32 throughout (the fp32 reference model's).
  bool round_bf16 = false;
};

// qkv: F32 [T, width], modified in place: each q head normalized by q_norm [head_dim] and each k
// head by k_norm (both absent: no norm), then q and k rotated at positions[t] on the first
// table.rotary_dim dims of each head; v and every other column untouched. Throws
// kInvalidArgument naming the tensor or field on a shape mismatch.
void qkv_prologue_ref(Tensor& qkv, const Tensor* q_norm, const Tensor* k_norm,
                      std::span<const int64_t> positions, const RopeTable& table,
                      const QkvPrologueParams& params);

}  // namespace moelora::ops
