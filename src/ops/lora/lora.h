// LoRA deltas on a plain linear layer, per token slot.
//
//   y[t] += s * (x[t] A^T) B^T    x [T, in], A [R, in], B [out, R], y [T, out]
// Multi-adapter form: slot[t] picks the adapter of token t (-1 = base: no work at all).
#pragma once

#include <cstdint>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"

namespace moelora::ops {

// y [T, out] += scaling * (x [T, in] a [R, in]^T) b [out, R]^T, fp32. a and b may also be given
// as [E, R, in] / [E, out, R] (expert index 0 is used). Per token: u = x a^T first, then
// y += scaling * (u b^T), the order of PEFT's lora_B(lora_A(x)) * scaling. R = 0 adds nothing.
void lora_add_ref(const Tensor& x, const Tensor& a, const Tensor& b, float scaling, Tensor& y);

// Multi-slot: adapters[s] is the LoRA of slot s for this target (undefined = the slot's adapter
// does not target this module; a null pointer means the same). Expert index 0 of each factor is
// used (plain targets). slot.size() must be T and every value -1 or in [0, adapters.size());
// tokens of slot -1 are not touched.
void lora_add_slots_ref(const Tensor& x, const std::vector<int32_t>& slot,
                        const std::vector<const LoraFactors*>& adapters, Tensor& y);

}  // namespace moelora::ops
