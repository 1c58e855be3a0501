// Prefill-regime grouped FP8 expert GEMM: many tokens per expert, so the work is tensor-core bound
// and a CUTLASS sm90 grouped GEMM with blockwise scaling does it (the DeepSeek-V3 recipe: 1x128
// activation scales, 128x128 weight scales, promoted into fp32 in the mainloop after every 128-wide
// K block). One CUTLASS group per expert:
//
//   D_e [M_e, N] bf16 = (A_e [M_e, K] e4m3 . sA) x (B_e [N, K] e4m3 . sB)^T
//   A_e = act rows [off[e], off[e+1]) (already permuted into expert-sorted order)
//   B_e = weight[e] (row-major [N, K] = CUTLASS's column-major K x N operand)
//   D_e = out rows [off[e], off[e+1])
//
// The row counts M_e exist only on the device (they come from the align kernel), so the GEMM takes
// its problem shapes from device memory with no host copy: a small setup kernel turns
// expert_offsets into the per-group shapes, pointers, strides and scale layouts in the caller's
// workspace, and the persistent kernel (grid = SMs, independent of M) walks the groups with
// CUTLASS's group tile scheduler. Groups with M_e = 0 have zero tiles and are skipped by the
// scheduler before any of their pointers is touched. Both launches are stream-ordered, allocate
// nothing and never synchronize, so the pair can be captured into a CUDA graph and replayed for any
// routing.
//
// Scale layouts. CUTLASS describes the scales with Sm90BlockwiseScaleConfig; "K-major" means the K
// blocks of one row are contiguous, i.e. exactly our row-major act_scale [P, K/128] and
// weight_scale [E, N/128, K/128]. The mainloop's scale loads are per-element cp.async with
// coordinate predicates, so both majors are supported for A and B and no transposed copy of the
// activation scales is needed: group e's A scales start at act_scale + off[e] * K/128.
//
// Instance (one, to keep compile time low): KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
// tile 128x128x128 (two consumer warpgroups of 64 rows each), cluster 1x2x1 (the activation tile is
// multicast to the two CTAs that compute neighbouring N tiles of the same rows), 6 pipeline stages,
// TMA-store epilogue writing bf16, rasterized along N (consecutive CTAs take neighbouring N tiles
// of one expert's rows, so an activation tile comes from HBM once and then from L2). Measured on
// an H200 with uniform routing: ~930-960 TFLOP/s at ~680 rows per expert (N, K = 4096, 7168 and
// 7168, 2048), ~630 and ~395 TFLOP/s at ~128 rows per expert (1024, 2048 and 2048, 512), where
// about a third of the MMA rows are padding of the last row tile of each expert.
#include <cuda_bf16.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"

#include "core/cuda_utils.h"
#include "ops/gemm/moe_gemm_cuda.cuh"

#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) || !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the prefill MoE GEMM needs CUDA >= 12.3 (sm90 grouped GEMM with device-side TMA descriptor updates)"
#endif

namespace moelora::ops::cuda {

namespace {

// ---- the CUTLASS instance ----

using ElementFp8 = cutlass::float_e4m3_t;  // activations and weights
using ElementD = cutlass::bfloat16_t;      // output
using ElementAccumulator = float;          // also the scale type (the blockwise mainloop requires it)
constexpr int kAlignFp8 = 16;              // elements per 16-byte TMA access
constexpr int kAlignD = 8;
constexpr int kScaleBlock = 128;  // the FP8 recipe's block size along N and K

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using GroupShape = ProblemShape::UnderlyingProblemShape;

// One CUTLASS group per expert: A = the expert's activation rows (M = its row count), B = its
// weights (N = output features), D row-major [M_e, N]. Both operands have K contiguous (A
// row-major, B column-major), and both scale tensors are K-major: our row-major act_scale
// [P, K/128] (granularity 1 x 128) and weight_scale [E, N/128, K/128] (granularity 128 x 128).
template <int kTileM, int kTileN, int kClusterM, int kClusterN>
struct PrefillInstance {
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kScaleBlock>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using LayoutA = cutlass::layout::RowMajor;     // act [M_e, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // weight [N, K] row-major = column-major K x N
  using LayoutD = cutlass::layout::RowMajor;     // out [M_e, N]
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock,
                                                                cute::GMMA::Major::K, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  // D = acc (alpha = 1, beta = 0): C is void, so the epilogue never loads a source tensor.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,  //
      void, LayoutD*, kAlignD,                                                                  // C
      ElementD, LayoutD*, kAlignD,                                                              // D
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,                 //
      ElementFp8, cute::tuple<LayoutA*, LayoutSFA*>, kAlignFp8,            //
      ElementFp8, cute::tuple<LayoutB*, LayoutSFB*>, kAlignFp8,            //
      ElementAccumulator, TileShape, ClusterShape,                         //
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(  //
          sizeof(typename CollectiveEpilogue::SharedStorage))>,            //
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;  // (K, _1, _0)
  using StrideB = typename GemmKernel::InternalStrideB;  // (K, _1, _0)
  using StrideD = typename GemmKernel::InternalStrideD;  // (N, _1, _0)
  static_assert(std::is_same_v<StrideD, typename GemmKernel::InternalStrideC>,
                "the D stride array is passed for the (unused) C stride too");

  // Device pointers to the per-expert arrays (E entries each) that the setup kernel fills.
  struct Arrays {
    GroupShape* shapes;
    const ElementFp8** ptr_a;
    const ElementFp8** ptr_b;
    ElementD** ptr_d;
    const ElementAccumulator** ptr_sfa;
    const ElementAccumulator** ptr_sfb;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
  };
};

using Instance = PrefillInstance<128, 128, 1, 2>;

// ---- the workspace ----

// Byte offsets of the regions of MoeGemmPrefillWorkspace (see the header for the order).
struct WorkspacePlan {
  size_t cutlass = 0, shapes = 0, ptr_a = 0, ptr_b = 0, ptr_d = 0, ptr_sfa = 0, ptr_sfb = 0, stride_a = 0,
         stride_b = 0, stride_d = 0, layout_sfa = 0, layout_sfb = 0;
  size_t total = 0;
};

size_t cutlass_workspace_bytes(int num_sms) {
  // Per-SM TMA descriptors (A, B, D) and the scheduler's state: sized from the SM count alone
  // (the problem shapes are only read for their type).
  typename Instance::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.hw_info.sm_count = num_sms;
  return Instance::Gemm::get_workspace_size(args);
}

WorkspacePlan plan_workspace(int num_experts, int num_sms) {
  WorkspacePlan p;
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    const size_t at = offset;
    offset = (offset + bytes + 255) / 256 * 256;
    return at;
  };
  const size_t e = static_cast<size_t>(num_experts);
  p.cutlass = take(cutlass_workspace_bytes(num_sms));
  p.shapes = take(e * sizeof(GroupShape));
  p.ptr_a = take(e * sizeof(void*));
  p.ptr_b = take(e * sizeof(void*));
  p.ptr_d = take(e * sizeof(void*));
  p.ptr_sfa = take(e * sizeof(void*));
  p.ptr_sfb = take(e * sizeof(void*));
  p.stride_a = take(e * sizeof(Instance::StrideA));
  p.stride_b = take(e * sizeof(Instance::StrideB));
  p.stride_d = take(e * sizeof(Instance::StrideD));
  p.layout_sfa = take(e * sizeof(Instance::LayoutSFA));
  p.layout_sfb = take(e * sizeof(Instance::LayoutSFB));
  p.total = offset;
  return p;
}

Instance::Arrays group_arrays(const WorkspacePlan& p, void* base) {
  char* b = static_cast<char*>(base);
  Instance::Arrays g;
  g.shapes = reinterpret_cast<GroupShape*>(b + p.shapes);
  g.ptr_a = reinterpret_cast<const ElementFp8**>(b + p.ptr_a);
  g.ptr_b = reinterpret_cast<const ElementFp8**>(b + p.ptr_b);
  g.ptr_d = reinterpret_cast<ElementD**>(b + p.ptr_d);
  g.ptr_sfa = reinterpret_cast<const ElementAccumulator**>(b + p.ptr_sfa);
  g.ptr_sfb = reinterpret_cast<const ElementAccumulator**>(b + p.ptr_sfb);
  g.stride_a = reinterpret_cast<Instance::StrideA*>(b + p.stride_a);
  g.stride_b = reinterpret_cast<Instance::StrideB*>(b + p.stride_b);
  g.stride_d = reinterpret_cast<Instance::StrideD*>(b + p.stride_d);
  g.layout_sfa = reinterpret_cast<Instance::LayoutSFA*>(b + p.layout_sfa);
  g.layout_sfb = reinterpret_cast<Instance::LayoutSFB*>(b + p.layout_sfb);
  return g;
}

// ---- kernels and launch ----

// One thread per expert e: group e's shape (M_e, N, K) and operand addresses.
//   act [P, K] e4m3, act_scale [P, K/128], weight [E, N, K], weight_scale [E, N/128, K/128],
//   out [P, N] bf16; the rows of expert e are [off[e], off[e+1]).
__global__ void moe_gemm_prefill_setup_kernel(const MoeGemmFp8Args p, Instance::Arrays g) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.num_experts) return;
  const int begin = p.expert_offsets[e];
  // Offsets are non-decreasing by contract; clamping keeps a corrupt range from becoming a huge
  // unsigned extent inside CUTLASS.
  const int rows = max(p.expert_offsets[e + 1] - begin, 0);
  const int N = p.n, K = p.k;
  const int k_blocks = K / kScaleBlock, n_blocks = N / kScaleBlock;

  g.shapes[e] = GroupShape{rows, N, K};
  g.ptr_a[e] = reinterpret_cast<const ElementFp8*>(p.act + static_cast<size_t>(begin) * K);
  g.ptr_b[e] = reinterpret_cast<const ElementFp8*>(p.weight + static_cast<size_t>(e) * N * K);
  g.ptr_d[e] = reinterpret_cast<ElementD*>(p.out + static_cast<size_t>(begin) * N);
  g.ptr_sfa[e] = p.act_scale + static_cast<size_t>(begin) * k_blocks;
  g.ptr_sfb[e] = p.weight_scale + static_cast<size_t>(e) * n_blocks * k_blocks;
  g.stride_a[e] = cutlass::make_cute_packed_stride(Instance::StrideA{}, cute::make_shape(rows, K, 1));
  g.stride_b[e] = cutlass::make_cute_packed_stride(Instance::StrideB{}, cute::make_shape(N, K, 1));
  g.stride_d[e] = cutlass::make_cute_packed_stride(Instance::StrideD{}, cute::make_shape(rows, N, 1));
  // The mainloop rebuilds these from the problem shape; they are filled for completeness.
  g.layout_sfa[e] = Instance::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, N, K, 1));
  g.layout_sfb[e] = Instance::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(rows, N, K, 1));
}

// One-time, per-device kernel set-up: the dynamic shared-memory opt-in and the number of
// clusters that fit at once (the persistent grid's size). Host-side calls only (no stream work),
// so the first launch may happen inside a stream capture.
int prepare_device(int device) {
  using GemmKernel = Instance::GemmKernel;
  static std::mutex mutex;
  static std::vector<int> max_active_clusters;  // by device ordinal; 0 = not prepared yet
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(max_active_clusters.size())) max_active_clusters.resize(device + 1, 0);
  if (max_active_clusters[device] == 0) {
    MOELORA_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(GemmKernel::SharedStorageSize)));
    const int clusters = cutlass::KernelHardwareInfo::query_device_max_active_clusters<GemmKernel>();
    MOELORA_CHECK(clusters > 0, ErrorCode::kCuda, "prefill MoE GEMM: the kernel (",
                  GemmKernel::SharedStorageSize, " bytes of shared memory, cluster of ",
                  cute::size(Instance::ClusterShape{}), ") cannot be resident on device ", device);
    max_active_clusters[device] = clusters;
  }
  return max_active_clusters[device];
}

}  // namespace

size_t moe_gemm_prefill_workspace_bytes(int num_experts, int num_sms) {
  MOELORA_CHECK(num_experts > 0, ErrorCode::kInvalidArgument,
                "prefill MoE GEMM workspace: num_experts = ", num_experts, " must be positive");
  MOELORA_CHECK(num_sms > 0, ErrorCode::kInvalidArgument, "prefill MoE GEMM workspace: num_sms = ", num_sms,
                " must be positive");
  return plan_workspace(num_experts, num_sms).total;
}

void launch_moe_gemm_fp8_prefill(const MoeGemmFp8Args& p, const MoeGemmPrefillWorkspace& ws,
                                 cudaStream_t stream) {
  check_moe_gemm_fp8_args(p);
  MOELORA_CHECK(
      p.gather == nullptr, ErrorCode::kInvalidArgument,
      "prefill MoE GEMM: gather must be null (activations must already be permuted into sorted order)");
  MOELORA_CHECK(p.n % kScaleBlock == 0, ErrorCode::kInvalidArgument, "prefill MoE GEMM: N = ", p.n,
                " must be a multiple of ", kScaleBlock);
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(p.out) % 16 == 0, ErrorCode::kInvalidArgument,
                "prefill MoE GEMM: out must be 16-byte aligned (TMA store)");
  constexpr int kClusterSize = cute::size(Instance::ClusterShape{});
  MOELORA_CHECK(ws.num_sms >= kClusterSize, ErrorCode::kInvalidArgument,
                "prefill MoE GEMM: workspace num_sms = ", ws.num_sms, " must be at least the cluster size ",
                kClusterSize);
  const WorkspacePlan plan = plan_workspace(p.num_experts, ws.num_sms);
  MOELORA_CHECK(ws.data != nullptr && ws.bytes >= plan.total, ErrorCode::kInvalidArgument,
                "prefill MoE GEMM: workspace has ", ws.bytes, " bytes, needs ", plan.total,
                " for E = ", p.num_experts, " and ", ws.num_sms, " SMs");
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(ws.data) % 256 == 0, ErrorCode::kInvalidArgument,
                "prefill MoE GEMM: workspace must be 256-byte aligned");

  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  const int clusters = prepare_device(device);

  // 1. Per-expert shapes and addresses from the device-side offsets.
  const Instance::Arrays g = group_arrays(plan, ws.data);
  constexpr int kSetupThreads = 128;
  moe_gemm_prefill_setup_kernel<<<(p.num_experts + kSetupThreads - 1) / kSetupThreads, kSetupThreads, 0,
                                  stream>>>(p, g);
  MOELORA_CUDA_CHECK_LAUNCH();

  // 2. The grouped GEMM on those arrays. Host problem shapes are null: CUTLASS sizes the
  //    persistent grid from the SM count and reads every group's shape on the device.
  using Gemm = Instance::Gemm;
  Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{p.num_experts, g.shapes, nullptr};
  args.mainloop.ptr_A = g.ptr_a;
  args.mainloop.dA = g.stride_a;
  args.mainloop.ptr_B = g.ptr_b;
  args.mainloop.dB = g.stride_b;
  args.mainloop.ptr_SFA = g.ptr_sfa;
  args.mainloop.layout_SFA = g.layout_sfa;
  args.mainloop.ptr_SFB = g.ptr_sfb;
  args.mainloop.layout_SFB = g.layout_sfb;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = g.stride_d;
  args.epilogue.ptr_D = g.ptr_d;
  args.epilogue.dD = g.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = ws.num_sms;
  // Never more clusters than the caller's SM budget allows.
  args.hw_info.max_active_clusters = std::min(clusters, ws.num_sms / kClusterSize);
  // Along N, no swizzle: measured best of {N, M} x {1, 2, 4} on both target shapes.
  args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;
  args.scheduler.max_swizzle_size = 1;

  MOELORA_CHECK(Gemm::can_implement(args) == cutlass::Status::kSuccess, ErrorCode::kInvalidArgument,
                "prefill MoE GEMM: CUTLASS cannot implement N = ", p.n, ", K = ", p.k);
  auto params =
      Instance::GemmKernel::to_underlying_arguments(args, static_cast<char*>(ws.data) + plan.cutlass);
  const cutlass::Status status = Gemm::run(params, stream);
  MOELORA_CHECK(status == cutlass::Status::kSuccess, ErrorCode::kCuda,
                "prefill MoE GEMM: launch failed: ", cutlass::cutlassGetStatusString(status));
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
