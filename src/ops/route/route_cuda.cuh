// Fused MoE routers on the GPU (one launch): logits [T, E] f32 -> top-k ids and weights, with the
// exact semantics of ops/route/route.h (softmax top-k with optional renormalization; sigmoid
// noaux_tc with correction bias, group top-k, unbiased weights, renormalization and routed
// scaling). Ties go to the lower index, rows come out sorted by descending selection score.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/route/route.h"

namespace moelora::ops::cuda {

struct RouteDeviceArgs {
  const float* logits = nullptr;           // [T, E]
  const float* correction_bias = nullptr;  // [E] (noaux_tc) or nullptr (= zeros)
  const int32_t* num_tokens = nullptr;     // [1] valid tokens (device value) or nullptr (= max_tokens)
  int32_t* topk_ids = nullptr;             // [T, k]; rows of tokens >= *num_tokens are set to -1
  float* topk_weights = nullptr;           // [T, k]; 0 for those rows
  int max_tokens = 0;                      // T (grid capacity)
  // Inputs of the kernels after the router that are likely cold in L2 (the layer's x, the slot
  // map): their fills are issued at the router's start so that their DRAM latency overlaps the
  // router's own loads instead of following it. Optional.
  struct Prefetch {
    const void* ptr = nullptr;
    size_t bytes = 0;
  };
  Prefetch prefetch[2];
  // Optional (the decode expert GEMV chain, ops/moe_gemv): the layer input x [max_tokens, hidden]
  // bf16 quantized per token per 128 columns as quant.h's per-token groups, into q [max_tokens,
  // hidden] e4m3 and scale [max_tokens, hidden / 128] (row-major). Extra CTAs of the same launch
  // do it (one warp per 128-column group), beside the routing, so it adds no kernel and no time
  // to the chain. hidden must be a multiple of 128. Set q to enable.
  struct QuantRows {
    const void* x = nullptr;  // __nv_bfloat16 [max_tokens, hidden]
    int hidden = 0;
    uint8_t* q = nullptr;
    float* scale = nullptr;
  };
  QuantRows quant;
};

// E <= 1024 and k <= 32 (Error otherwise); the optional row quant needs x, scale and hidden a
// positive multiple of 128.
void launch_route(const RouteParams& params, const RouteDeviceArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
