// Weight-streaming dense projection for decode (linear_stream_cuda.cuh has the contract).
//
//   y[t, n] = sum_k x[t, k] W[n, k]      t < rows <= 64
//
// Why a kernel of our own next to cuBLAS: a decode projection (qkv of Qwen3-30B-A3B at 16 tokens:
// 21 MB of weights, 64 KB of x) is a stream of W, and cuBLAS's kernels start reading it only when
// the kernel before them has finished and end with a ramp-down (and o_proj with a split-K reduce
// launch after it): 2.6-2.7 TB/s on qkv, 1.9 TB/s on o_proj at 16 tokens (H200,
// bench/results/h200/linear_stream_dropped.md). Here the weights, which no kernel writes, are
// requested before griddepcontrol.wait: launched programmatically after the residual RMSNorm
// (which lets its dependents start at once), the first ring fill of every CTA (~12 MB over the
// GPU) streams while the norm runs.
//
// Orientation (swap-AB, as the expert GEMM): 64 weight rows are the wgmma M side, the tokens the N
// side (m64nNk16, N = 8 / 16 / 32 / 64 from rows). A stage is one unit of work: the weight tile
// [64 rows x 64 k] (8 KB, 128-byte swizzle, L2 evict-first) and x [N rows x 64 k] by TMA (8-row
// boxes; rows past `rows` read as zeros), completion counted in bytes on the stage's mbarrier.
// The ring takes as many stages as fit in 96 KB (10 at N = 8, 9 at 16, 8 at 32, 6 at 64), two
// CTAs per SM.
//
// Work split (stream-K): units u = tile * k_blocks + kb, tile-major; CTA c takes
// [c U / G, (c + 1) U / G) (U units, G CTAs = min(2 SMs, U / 4)), so all CTAs stream the same
// bytes. Within its range a CTA accumulates each tile's run of k blocks (a segment) in registers:
//   - a segment that is the whole tile is stored as bf16 at once;
//   - otherwise (at most two per CTA: the tile its range starts inside, and the tile it ends
//     inside) the fp32 partial goes to partials[c][slot][token][64 rows] (slot 1 for the tile
//     the range starts inside, 0 for the other), then a ticket per tile: the CTA whose add
//     completes the tile's contributors (the CTAs owning its first to last unit) sums their
//     partials in CTA order and stores the tile. Fixed order, so the bits do not depend on which
//     CTA finishes last; the completing CTA resets the ticket for the next launch.
//
// Programmatic dependent launch: the producer issues the weight copies of the first ring fill,
// then griddepcontrol.wait, then the x copies; outputs, partials and tickets are written only
// after it. The kernel lets its own dependents launch at once (they wait for its completion).
#include <cuda.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/mma_ptx.cuh"
#include "core/sm90_ptx.cuh"
#include "core/tma_map.h"
#include "ops/linear/linear_stream_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

namespace sm90 = ::moelora::cuda::sm90;

constexpr int kBlockM = 64;                   // weight rows per tile (the wgmma M of a warpgroup)
constexpr int kBlockK = kLinearStreamBlockK;  // k per stage: 64 bf16 = one 128-byte swizzled row
constexpr int kRowBytes = kBlockK * 2;
constexpr int kTokenBox = 8;  // x rows per TMA box
constexpr int kMaxStages = 12;
constexpr int kConsumerThreads = 128;
constexpr int kThreads = kConsumerThreads + 32;  // + the producer warp
constexpr int kCtasPerSm = 2;
constexpr int kWeightTileBytes = kBlockM * kRowBytes;  // 8 KB
constexpr int kRingBudget = 96 * 1024;                 // weight + x tiles of all stages
constexpr int kMinUnitsPerCta = 4;                     // ramp-up is paid per CTA

// What the producer tells the consumer about a stage.
enum StageFlags : int {
  kSegmentFirst = 1,       // first k block of the CTA's run in this tile: the wgmma overwrites
  kSegmentLast = 2,        // last one: the segment's result is stored or left as a partial
  kWholeTile = 4,          // the segment is the whole tile (stored directly)
  kStartsBeforeRange = 8,  // the tile began before the CTA's range (partial slot 1)
  kNoMoreWork = 16,        // no tile: the consumer ends
};
struct StageInfo {
  int tile;
  int flags;
};

constexpr int kBookkeepingBytes = 3 * kMaxStages * 8 + 16;  // full / empty barriers, infos, flag
constexpr int kSmemBytes = kRingBudget + kBookkeepingBytes + 1024;  // + alignment slack
static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs per SM");
static_assert(sizeof(StageInfo) == 8);

struct Params {
  __nv_bfloat16* y;
  int64_t ldy;
  float* partials;   // [G][2][kLinearStreamMaxRows][kBlockM]
  int32_t* tickets;  // [tiles]
  int rows, n, k_blocks, units, stages, width;
};

// Shared-memory carve-up (addresses in the shared window; tiles 1024-byte aligned for the swizzle).
struct Ring {
  uint32_t base;
  int stages, width;
  __device__ uint32_t weight(int s) const { return base + s * kWeightTileBytes; }
  __device__ uint32_t act(int s) const {
    return base + stages * kWeightTileBytes + s * width * kRowBytes;
  }
  __device__ uint32_t full(int s) const { return base + kRingBudget + s * 8; }
  __device__ uint32_t empty(int s) const { return base + kRingBudget + (kMaxStages + s) * 8; }
  __device__ uint32_t info(int s) const { return base + kRingBudget + (2 * kMaxStages + s) * 8; }
  __device__ uint32_t flag() const { return base + kRingBudget + 3 * kMaxStages * 8; }
};

// First unit of CTA c's range, and the CTA whose range holds unit u.
__host__ __device__ __forceinline__ int range_begin(int c, int units, int ctas) {
  return static_cast<int>(static_cast<int64_t>(c) * units / ctas);
}
__device__ __forceinline__ int range_owner(int u, int units, int ctas) {
  return static_cast<int>((static_cast<int64_t>(u + 1) * ctas - 1) / units);
}

// wgmma N for rows tokens.
__host__ __device__ __forceinline__ int pass_width(int rows) {
  return rows <= 8 ? 8 : rows <= 16 ? 16 : rows <= 32 ? 32 : 64;
}

// The producer thread: fills the ring with the CTA's units in order.
__device__ __forceinline__ void producer(const Ring& ring, StageInfo* info,
                                         const CUtensorMap* tma_w, const CUtensorMap* tma_x,
                                         const Params& p) {
  sm90::prefetch_tensor_map(tma_w);
  sm90::prefetch_tensor_map(tma_x);
  const uint64_t evict_first = sm90::l2_evict_first_policy();
  const int begin = range_begin(blockIdx.x, p.units, gridDim.x);
  const int end = range_begin(blockIdx.x + 1, p.units, gridDim.x);
  const uint32_t stage_bytes = kWeightTileBytes + p.width * kRowBytes;
  auto describe = [&](int u) {
    const int tile = u / p.k_blocks, kb = u % p.k_blocks;
    const int tile_begin = tile * p.k_blocks, tile_end = tile_begin + p.k_blocks;
    int flags = 0;
    if (u == begin || kb == 0) flags |= kSegmentFirst;
    if (u == end - 1 || kb == p.k_blocks - 1) flags |= kSegmentLast;
    if (tile_begin >= begin && tile_end <= end) flags |= kWholeTile;
    if (tile_begin < begin) flags |= kStartsBeforeRange;
    return StageInfo{tile, flags};
  };
  auto issue_weight = [&](int s, int u) {
    sm90::tma_load_2d_hint(ring.weight(s), tma_w, ring.full(s), (u % p.k_blocks) * kBlockK,
                           (u / p.k_blocks) * kBlockM, evict_first);
  };
  auto issue_x = [&](int s, int u) {
    for (int j = 0; j < p.width / kTokenBox; ++j)
      sm90::tma_load_2d(ring.act(s) + j * kTokenBox * kRowBytes, tma_x, ring.full(s),
                        (u % p.k_blocks) * kBlockK, j * kTokenBox);
  };
  // The first ring fill: records and weight copies now (the ring is fresh, no waits), the x copies
  // once the previous kernel in the stream (which writes x) has completed.
  const int first_fill = min(end - begin, p.stages);
  for (int s = 0; s < first_fill; ++s) {
    info[s] = describe(begin + s);
    sm90::mbar_arrive_expect_tx(ring.full(s), stage_bytes);
    issue_weight(s, begin + s);
  }
  sm90::grid_dependency_wait();
  for (int s = 0; s < first_fill; ++s) issue_x(s, begin + s);
  int i = first_fill;
  for (; begin + i < end; ++i) {
    const int s = i % p.stages;
    sm90::mbar_wait(ring.empty(s), ((i / p.stages) & 1) ^ 1);
    info[s] = describe(begin + i);
    sm90::mbar_arrive_expect_tx(ring.full(s), stage_bytes);
    issue_weight(s, begin + i);
    issue_x(s, begin + i);
  }
  const int s = i % p.stages;
  sm90::mbar_wait(ring.empty(s), ((i / p.stages) & 1) ^ 1);
  info[s] = StageInfo{0, kNoMoreWork};
  sm90::mbar_arrive(ring.full(s));
}

// The four consumer warps only (the producer warp never joins): named barrier 1.
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

// Stores v (the accumulator layout: v[4c + 2i + j] = weight row 16 warp + lane / 4 + 8 i of the
// tile, token 8c + 2 (lane % 4) + j) as bf16 rows of y.
template <int kWidth>
__device__ __forceinline__ void store_tile(const float (&v)[kWidth / 2], int tile,
                                           const Params& p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = tile * kBlockM + 16 * warp + lane / 4;
#pragma unroll
  for (int c = 0; c < kWidth / 8; ++c)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int token = 8 * c + 2 * (lane % 4) + j;
      if (token >= p.rows) continue;
      __nv_bfloat16* out = p.y + static_cast<int64_t>(token) * p.ldy;
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (n0 + 8 * i < p.n) out[n0 + 8 * i] = __float2bfloat16(v[4 * c + 2 * i + j]);
    }
}

// Offset of (token, row of the thread's fragment element) in a partial tile.
__device__ __forceinline__ int partial_index(int c, int i, int j) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  return (8 * c + 2 * (lane % 4) + j) * kBlockM + 16 * warp + lane / 4 + 8 * i;
}

// The end of a segment: store it, or leave its partial and, if this CTA completes the tile, sum
// the tile's partials in CTA order and store that.
template <int kWidth>
__device__ __forceinline__ void finish_segment(const float (&acc)[kWidth / 2], const StageInfo st,
                                               const Params& p, volatile int* completes) {
  if (st.flags & kWholeTile) {
    store_tile<kWidth>(acc, st.tile, p);
    return;
  }
  const int lane = threadIdx.x % 32;
  constexpr size_t kSlotFloats = static_cast<size_t>(kLinearStreamMaxRows) * kBlockM;
  const int slot = (st.flags & kStartsBeforeRange) ? 1 : 0;
  float* mine = p.partials + (static_cast<size_t>(blockIdx.x) * 2 + slot) * kSlotFloats;
#pragma unroll
  for (int c = 0; c < kWidth / 8; ++c)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (8 * c + 2 * (lane % 4) + j >= p.rows) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i) mine[partial_index(c, i, j)] = acc[4 * c + 2 * i + j];
    }
  // Classic last-block pattern: every writer fences its stores before the ticket add; the
  // completing CTA fences again before it reads the others' partials (from L2).
  __threadfence();
  consumer_sync();
  const int tile_begin = st.tile * p.k_blocks;
  const int c0 = range_owner(tile_begin, p.units, gridDim.x);
  const int c1 = range_owner(tile_begin + p.k_blocks - 1, p.units, gridDim.x);
  if (threadIdx.x == 0) {
    const int done = atomicAdd(p.tickets + st.tile, 1) + 1;
    const bool last = done == c1 - c0 + 1;
    if (last) p.tickets[st.tile] = 0;  // every contributor has added: ready for the next launch
    *completes = last;
  }
  consumer_sync();
  if (!*completes) return;
  __threadfence();
  float sum[kWidth / 2];
#pragma unroll
  for (int e = 0; e < kWidth / 2; ++e) sum[e] = 0.f;
  for (int c = c0; c <= c1; ++c) {
    const int c_slot = range_begin(c, p.units, gridDim.x) > tile_begin ? 1 : 0;
    const float* part = p.partials + (static_cast<size_t>(c) * 2 + c_slot) * kSlotFloats;
#pragma unroll
    for (int cc = 0; cc < kWidth / 8; ++cc)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (8 * cc + 2 * (lane % 4) + j >= p.rows) continue;
#pragma unroll
        for (int i = 0; i < 2; ++i)
          sum[4 * cc + 2 * i + j] += __ldcg(part + partial_index(cc, i, j));
      }
  }
  store_tile<kWidth>(sum, st.tile, p);
}

template <int kWidth>
__device__ __forceinline__ void consume(const Ring& ring, uint8_t* smem_generic, uint32_t window,
                                        const StageInfo* info, const Params& p) {
  constexpr int kAcc = kWidth / 2;
  volatile int* completes = reinterpret_cast<volatile int*>(smem_generic + (ring.flag() - window));
  float acc[kAcc];
#pragma unroll
  for (int e = 0; e < kAcc; ++e) acc[e] = 0.f;
  for (int i = 0;; ++i) {
    const int s = i % p.stages;
    sm90::mbar_wait(ring.full(s), (i / p.stages) & 1);
    const StageInfo st = info[s];
    if (st.flags & kNoMoreWork) break;
    const uint64_t desc_w = sm90::wgmma_desc_k_major_sw128(ring.weight(s));
    const uint64_t desc_x = sm90::wgmma_desc_k_major_sw128(ring.act(s));
    const bool fresh = st.flags & kSegmentFirst;
#pragma unroll
    for (int e = 0; e < kAcc; ++e) sm90::fence_operand(acc[e]);
    sm90::wgmma_fence();
#pragma unroll
    for (int step = 0; step < kBlockK / 16;
         ++step)  // 32 bytes of k per step: +2 in the address field
      sm90::WgmmaBf16<kWidth>::mma(acc, desc_w + 2 * step, desc_x + 2 * step,
                                   !(fresh && step == 0));
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int e = 0; e < kAcc; ++e) sm90::fence_operand(acc[e]);
    sm90::mbar_arrive(ring.empty(s));  // every thread, after its last read of the stage
    if (st.flags & kSegmentLast) finish_segment<kWidth>(acc, st, p, completes);
  }
}

__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    linear_stream_kernel(const __grid_constant__ CUtensorMap tma_w,
                         const __grid_constant__ CUtensorMap tma_x, const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const uint32_t window = ::moelora::cuda::ptx::smem_addr(smem);
  const Ring ring{(window + 1023u) & ~1023u, p.stages, p.width};
  sm90::launch_dependents();
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      sm90::mbar_init(ring.full(s), 1);                  // the producer's arrive.expect_tx
      sm90::mbar_init(ring.empty(s), kConsumerThreads);  // one arrival per consumer thread
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  StageInfo* info = reinterpret_cast<StageInfo*>(smem + (ring.info(0) - window));
  if (threadIdx.x >= kConsumerThreads) {
    if (threadIdx.x == kConsumerThreads) producer(ring, info, &tma_w, &tma_x, p);
    return;
  }
  switch (p.width) {
    case 8: consume<8>(ring, smem, window, info, p); break;
    case 16: consume<16>(ring, smem, window, info, p); break;
    case 32: consume<32>(ring, smem, window, info, p); break;
    default: consume<64>(ring, smem, window, info, p); break;
  }
#else
  __trap();  // wgmma and TMA need sm_90a; the launcher refuses other devices
#endif
}

// Refuses devices without wgmma / TMA and raises the kernel's dynamic shared-memory limit, once
// per device (not a stream operation, so a launch under graph capture may come here first).
void prepare_device() {
  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::vector<bool> prepared;
  std::lock_guard<std::mutex> lock(mutex);
  if (device < static_cast<int>(prepared.size()) && prepared[device]) return;
  int major = 0, minor = 0;
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  MOELORA_CHECK(major == 9 && minor == 0, ErrorCode::kUnsupported, "linear stream kernel: device ",
                device, " is sm_", major, minor,
                "; the kernel needs sm_90a (Hopper: wgmma and TMA)");
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(linear_stream_kernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  if (device >= static_cast<int>(prepared.size())) prepared.resize(device + 1, false);
  prepared[device] = true;
}

int tiles_of(int n) {
  return (n + kBlockM - 1) / kBlockM;
}

}  // namespace

size_t linear_stream_partial_floats(int num_sms) {
  return static_cast<size_t>(kCtasPerSm) * std::max(num_sms, 1) * 2 * kLinearStreamMaxRows *
         kBlockM;
}

int linear_stream_tickets(int max_n) {
  return tiles_of(std::max(max_n, 1));
}

bool linear_stream_supports(int rows, int n, int k) {
  return rows >= 1 && rows <= kLinearStreamMaxRows && n >= 1 && k >= kBlockK && k % kBlockK == 0;
}

void launch_linear_stream(const LinearStreamArgs& args, int num_sms, bool pdl,
                          cudaStream_t stream) {
  LinearStreamArgs a = args;
  if (a.ldx == 0) a.ldx = a.k;
  if (a.ldy == 0) a.ldy = a.n;
  MOELORA_CHECK(linear_stream_supports(a.rows, a.n, a.k), ErrorCode::kInvalidArgument,
                "linear stream kernel: rows = ", a.rows, ", n = ", a.n, ", k = ", a.k,
                " (needs 1 <= rows <= ", kLinearStreamMaxRows,
                ", n >= 1, k a positive multiple of ", kBlockK, ")");
  MOELORA_CHECK(a.x && a.w && a.y, ErrorCode::kInvalidArgument,
                "linear stream kernel: x, w and y must be device pointers (got null)");
  MOELORA_CHECK(a.ldx >= a.k && a.ldx % 8 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.w) % 16 == 0,
                ErrorCode::kInvalidArgument, "linear stream kernel: x (row stride ", a.ldx,
                ", k = ", a.k,
                ") and w must be 16-byte aligned with rows a multiple of 16 bytes apart (TMA)");
  MOELORA_CHECK(a.ldy >= a.n, ErrorCode::kInvalidArgument, "linear stream kernel: y row stride ",
                a.ldy, " is smaller than n = ", a.n);
  MOELORA_CHECK(num_sms > 0, ErrorCode::kInvalidArgument,
                "linear stream kernel: num_sms = ", num_sms);
  const int tiles = tiles_of(a.n), k_blocks = a.k / kBlockK;
  MOELORA_CHECK(a.ws.partials && a.ws.tickets && a.ws.max_tiles >= tiles,
                ErrorCode::kInvalidArgument, "linear stream kernel: the workspace has ",
                a.ws.max_tiles, " tickets (", a.ws.tickets ? "" : "none, ",
                a.ws.partials ? "" : "no partials, ", "n = ", a.n, " needs ", tiles, ")");
  MOELORA_CHECK(static_cast<int64_t>(tiles) * k_blocks < (1LL << 31), ErrorCode::kInvalidArgument,
                "linear stream kernel: n = ", a.n, ", k = ", a.k, " has too many units");
  Params p{};
  p.y = a.y;
  p.ldy = a.ldy;
  p.partials = a.ws.partials;
  p.tickets = a.ws.tickets;
  p.rows = a.rows;
  p.n = a.n;
  p.k_blocks = k_blocks;
  p.units = tiles * k_blocks;
  p.width = pass_width(a.rows);
  p.stages = std::min(kMaxStages, kRingBudget / (kWeightTileBytes + p.width * kRowBytes));
  const int ctas = std::min(kCtasPerSm * num_sms, std::max(1, p.units / kMinUnitsPerCta));
  const CUtensorMap tma_w = ::moelora::cuda::make_tensor_map_2d(
      a.w, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a.k, a.n, static_cast<uint64_t>(a.k) * 2, kBlockK,
      kBlockM, CU_TENSOR_MAP_SWIZZLE_128B, "the projection weight");
  const CUtensorMap tma_x = ::moelora::cuda::make_tensor_map_2d(
      a.x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a.k, a.rows, static_cast<uint64_t>(a.ldx) * 2, kBlockK,
      kTokenBox, CU_TENSOR_MAP_SWIZZLE_128B, "the projection input");
  prepare_device();
  ::moelora::cuda::launch_kernel(linear_stream_kernel, dim3(ctas), dim3(kThreads), kSmemBytes,
                                 stream, pdl, tma_w, tma_x, p);
}

}  // namespace moelora::ops::cuda
