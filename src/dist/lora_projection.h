// y [T, out] = x W^T plus each token's LoRA delta: the projection every tensor-parallel block of
// src/dist runs on its share, for the adapters of any block (GqaLora, MlaLora, GdnLora, ...).
#pragma once

#include <cstdint>
#include <vector>

#include "core/lora.h"
#include "core/tensor.h"
#include "dist/shard.h"
#include "ops/linear/linear.h"
#include "ops/lora/lora.h"

namespace moelora::dist {

// x F32 [T, in], w F32 [out, in]; slot[t] picks lora[slot[t]] (-1 = base) and `member` the
// projection's factors in it (undefined = that adapter leaves the projection alone).
template <class BlockLora>
Tensor project_with_lora(const Tensor& x, const Tensor& w, const std::vector<int32_t>& slot,
                         const std::vector<BlockLora>& lora, LoraFactors BlockLora::*member) {
  Tensor y = ops::linear_ref(x, w);
  std::vector<const LoraFactors*> adapters;
  for (const BlockLora& l : lora) adapters.push_back(factors_or_null(l.*member));
  ops::lora_add_slots_ref(x, slot, adapters, y);
  return y;
}

}  // namespace moelora::dist
