// Fused MoE routers on the GPU (one launch): logits [T, E] f32 -> top-k ids and weights, with the
// exact semantics of ops/route/route.h (softmax top-k with optional renormalization; sigmoid
// noaux_tc with correction bias, group top-k, unbiased weights, renormalization and routed
// scaling). Ties go to the lower index, rows come out sorted by descending selection score.
//
// At decode sizes the launch can also compute the logits (RouteDeviceArgs::router): logits = x
// Wg^T (bf16 in, fp32 accumulate, linear.h's product up to summation order) by CTAs of 16
// experts x 16 tokens x 2048 columns on mma.sync, their fp32 partials summed in column order by
// the CTA that completes a token tile's ticket, which then routes the tile's 16 tokens (one warp
// each). One kernel instead of a cuBLAS GEMM (a handful of CTAs reading the whole router each,
// 5-6 us at 16 tokens on the H200) followed by the router; the same bits on every launch.
#pragma once

#include <cuda_bf16.h>
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
  // Optional: the router GEMM in this launch (router_route_supports says for which shapes; set
  // weight to enable). `logits` above is then ignored.
  struct RouterGemm {
    const __nv_bfloat16* x = nullptr;       // [max_tokens, hidden]
    const __nv_bfloat16* weight = nullptr;  // [E, hidden] (the router's Wg)
    int hidden = 0;                         // multiple of 8
    float* logits = nullptr;                // [max_tokens, E] out (optional): x Wg^T in fp32
    float* partials = nullptr;              // [router_route_partial_floats(E, hidden, max_tokens)]
    int32_t* tickets = nullptr;             // [router_route_tickets(max_tokens)]: zero before the
                                            // first launch; every launch leaves them zero
  };
  RouterGemm router;
  // Programmatic stream serialization: the launch may start while the previous kernel in the
  // stream runs; it reads nothing that kernel writes before griddepcontrol.wait (the router's
  // weight rows, which no kernel writes, are loaded before it).
  bool pdl = false;
};

// The fused router GEMM's limits and workspace (floats and ints; see RouteDeviceArgs::router).
constexpr int kRouterRouteMaxTokens = 64;
constexpr int kRouterRouteTileTokens = 16;
constexpr int kRouterRouteChunk = 2048;  // columns of x per CTA
size_t router_route_partial_floats(int num_experts, int hidden, int max_tokens);
int router_route_tickets(int max_tokens);
// Whether launch_route can compute the logits itself for this router, hidden size and max_tokens
// (max_tokens <= kRouterRouteMaxTokens: larger forwards re-read the router weight once per 16
// tokens, where a GEMM reads it once; hidden a multiple of 8; E, k and groups as launch_route).
bool router_route_supports(const RouteParams& params, int hidden, int max_tokens);

// E <= 1024 and k <= 32 (Error otherwise); the optional row quant needs x, scale and hidden a
// positive multiple of 128; the optional router GEMM x, partials, tickets and a shape that
// router_route_supports accepts.
void launch_route(const RouteParams& params, const RouteDeviceArgs& args, cudaStream_t stream);

}  // namespace moelora::ops::cuda
