// The router launch on given logits: one warp per token (route_device.cuh's route_token), four
// tokens per CTA, plus the optional x row quant in extra CTAs. Instances per router kind and per
// E bound. The launch that computes the logits itself is router_route_cuda.cu.
#include <cuda_bf16.h>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/route/route_cuda.cuh"
#include "ops/route/route_device.cuh"

namespace moelora::ops::cuda {

namespace route_internal {

namespace {

constexpr int kWarpsPerCta = 4;

template <int kMaxPerLane, bool kNoauxTc>
__global__ void __launch_bounds__(32 * kWarpsPerCta) route_kernel(const KernelParams p) {
  __shared__ float biased[kNoauxTc ? kWarpsPerCta : 1][kNoauxTc ? kMaxExperts : 1];
  __shared__ unsigned char group_kept[kWarpsPerCta][32];
  // The align kernel may be scheduled at once (it waits for this grid before reading).
  ::moelora::cuda::sm90::launch_dependents();
  // The L2 fills of the next kernels' cold inputs go out first, beside this kernel's own loads.
  for (const auto& range : p.a.prefetch)
    ::moelora::cuda::sm90::prefetch_l2_range(range.ptr, range.bytes,
                                             blockIdx.x * blockDim.x + threadIdx.x,
                                             gridDim.x * blockDim.x);
  if (p.a.pdl) ::moelora::cuda::sm90::grid_dependency_wait();
  const int warp = threadIdx.x / 32;
  const int route_ctas = (p.a.max_tokens + kWarpsPerCta - 1) / kWarpsPerCta;
  if (static_cast<int>(blockIdx.x) >= route_ctas) {
    quantize_x_group(p.a, (blockIdx.x - route_ctas) * kWarpsPerCta + warp);
    return;
  }
  const int token = blockIdx.x * kWarpsPerCta + warp;
  if (token >= p.a.max_tokens) return;
  route_token<kMaxPerLane, kNoauxTc>(p, token, p.a.logits + static_cast<size_t>(token) * p.E,
                                     kNoauxTc ? biased[warp] : nullptr, group_kept[warp]);
}

}  // namespace

template <bool kNoauxTc>
void launch_route_logits(const KernelParams& p, cudaStream_t stream) {
  const int route_ctas = (p.a.max_tokens + kWarpsPerCta - 1) / kWarpsPerCta;
  const int quant_warps = p.a.quant.q ? p.a.max_tokens * (p.a.quant.hidden / 128) : 0;
  const dim3 grid(route_ctas + (quant_warps + kWarpsPerCta - 1) / kWarpsPerCta), block(32 * kWarpsPerCta);
  auto launch = [&](auto kernel) { ::moelora::cuda::launch_kernel(kernel, grid, block, 0, stream, p.a.pdl, p); };
  if (p.E <= 64) {
    launch(route_kernel<2, kNoauxTc>);
  } else if (p.E <= 128) {
    launch(route_kernel<4, kNoauxTc>);
  } else if (p.E <= 256) {
    launch(route_kernel<8, kNoauxTc>);
  } else if (p.E <= 512) {
    launch(route_kernel<16, kNoauxTc>);
  } else {
    launch(route_kernel<32, kNoauxTc>);
  }
}
template void launch_route_logits<false>(const KernelParams&, cudaStream_t);
template void launch_route_logits<true>(const KernelParams&, cudaStream_t);

}  // namespace route_internal

void launch_route(const RouteParams& params, const RouteDeviceArgs& args, cudaStream_t stream) {
  using route_internal::kMaxExperts;
  check_route_params(params);
  MOELORA_CHECK(params.num_experts <= kMaxExperts, ErrorCode::kUnsupported, "GPU router: E = ", params.num_experts,
                " experts; at most ", kMaxExperts, " are supported");
  MOELORA_CHECK(params.top_k <= 32, ErrorCode::kUnsupported, "GPU router: k = ", params.top_k,
                "; at most 32 are supported");
  MOELORA_CHECK(params.kind != RouterKind::kSigmoidNoauxTc || params.n_group <= 32, ErrorCode::kUnsupported,
                "GPU router: n_group = ", params.n_group, "; at most 32 are supported");
  const bool router_gemm = args.router.weight != nullptr;
  MOELORA_CHECK((router_gemm || args.logits) && args.topk_ids && args.topk_weights, ErrorCode::kInvalidArgument,
                "GPU router: logits (or the router GEMM's weight), topk_ids and topk_weights are required");
  MOELORA_CHECK(!args.quant.q || (args.quant.x && args.quant.scale && args.quant.hidden > 0 &&
                                  args.quant.hidden % 128 == 0),
                ErrorCode::kInvalidArgument, "GPU router: the row quant needs x, scale and hidden (",
                args.quant.hidden, ") a positive multiple of 128");
  if (router_gemm) {
    MOELORA_CHECK(args.router.x && args.router.partials && args.router.tickets, ErrorCode::kInvalidArgument,
                  "GPU router: the router GEMM needs x, partials and tickets");
    MOELORA_CHECK(router_route_supports(params, args.router.hidden, args.max_tokens), ErrorCode::kUnsupported,
                  "GPU router: the router GEMM in the route launch takes at most ", kRouterRouteMaxTokens,
                  " tokens and a hidden size that is a positive multiple of 8; got max_tokens = ", args.max_tokens,
                  ", hidden = ", args.router.hidden, " (run the GEMM first and pass logits)");
  }
  if (args.max_tokens == 0) return;
  route_internal::KernelParams p;
  p.a = args;
  p.E = static_cast<int>(params.num_experts);
  p.k = static_cast<int>(params.top_k);
  p.n_group = static_cast<int>(params.n_group);
  p.topk_group = static_cast<int>(params.topk_group);
  p.renormalize = params.renormalize;
  p.routed_scaling_factor = params.routed_scaling_factor;
  const bool noaux = params.kind == RouterKind::kSigmoidNoauxTc;
  if (router_gemm) {
    noaux ? route_internal::launch_router_route<true>(p, stream) : route_internal::launch_router_route<false>(p, stream);
  } else {
    noaux ? route_internal::launch_route_logits<true>(p, stream) : route_internal::launch_route_logits<false>(p, stream);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
