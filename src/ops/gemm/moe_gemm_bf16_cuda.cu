// Grouped bf16 expert GEMM (GEMM1 and GEMM2 of the MoE layer when the routed experts are bf16:
// the tiny parity models and non-quantized checkpoints). For every expert e with rows
// [offsets[e], offsets[e + 1]) of the align's sorted order:
//
//   out[q, n] = sum_k act[row(q), k] * W[e, n, k],   row(q) = gather ? gather[q] : q
//
// bf16 in, fp32 accumulation (mma.sync.m16n8k16), bf16 out. Only N % 8 == 0 and K % 8 == 0 are
// required (16-byte chunks are then all valid or all past the end), so the tiny models' H = 64,
// I = 32 work as well as the real shapes.
//
// Orientation: swap-AB as in the FP8 decode kernel. Weight rows are the MMA's M side (16 per
// m-tile), tokens its N side (8 per n-tile): a decode step with one token per expert pads to 8
// tokens, not to 16.
//
// Scheduling (like the FP8 kernels): grid = (N tiles, max active experts, row splits). CTA
// (x, y, z) takes expert active_experts[y] (and exits at once when y >= *num_active, so a grid
// sized by capacity stays valid inside a CUDA graph for any routing) and its token tiles z,
// z + gridDim.z, ... of that expert: any number of rows per expert is covered.
//
// Per token tile: a kStages-deep cp.async pipeline stages [kTileW rows x 32 k] of W and
// [kTileT tokens x 32 k] of act in shared memory (rows padded to 40 bf16 so the fragment loads
// are free of bank conflicts; rows past N, tokens past the expert's end and k past K are
// zero-filled by cp.async's src-size operand). The accumulators go through shared memory so the
// output is written in coalesced 16-byte chunks.
#include <cuda_bf16.h>

#include <algorithm>

#include "core/cuda_utils.h"
#include "ops/gemm/moe_gemm_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kBlockK = 32;                 // k per pipeline stage (two m16n8k16 k-steps)
constexpr int kSmemStride = kBlockK + 8;    // bf16 per staged row: 80 bytes, conflict-free
constexpr int kChunksPerRow = kBlockK / 8;  // 16-byte chunks per staged row
constexpr int kMaxRowSplits = 64;

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;  // 0: nothing is read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// d += a (16x16, row-major: weight rows x k) . b (16x8, col-major: k x tokens), fp32 accumulate.
// Fragments (g = lane / 4, t = lane % 4): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 =
// A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; d0, d1 = D[g][2t,
// 2t+1], d2, d3 = D[g+8][2t, 2t+1].
__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1,
                                                 uint32_t a2, uint32_t a3, uint32_t b0,
                                                 uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // bf16 MMA needs sm_80+; the launcher refuses older devices
#endif
}

__device__ __forceinline__ uint32_t lds32(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// CTA tile: kWarpsW * kTilesW * 16 weight rows x kWarpsT * kTilesT * 8 tokens; warp (ww, wt)
// owns kTilesW m16 tiles x kTilesT n8 tiles of it.
template <int kWarpsW, int kWarpsT, int kTilesW, int kTilesT, int kStages>
struct Bf16Tile {
  static constexpr int kThreads = 32 * kWarpsW * kWarpsT;
  static constexpr int kRowsW = kWarpsW * kTilesW * 16;  // weight rows (output columns) per CTA
  static constexpr int kRowsT = kWarpsT * kTilesT * 8;   // tokens per CTA tile
  static constexpr int kStageElems = (kRowsW + kRowsT) * kSmemStride;
  static constexpr int kOutStride = kRowsW + 8;  // bf16 per staged output row
  static constexpr int kSmemElems =
      kStages * kStageElems > kRowsT* kOutStride ? kStages* kStageElems : kRowsT* kOutStride;
  static_assert(kSmemElems * 2 <= 48 * 1024, "static shared memory is limited to 48 KB");
  static_assert(kStages >= 2, "the pipeline needs at least two stages");
};

template <int kWarpsW, int kWarpsT, int kTilesW, int kTilesT, int kStages>
__global__ void __launch_bounds__(32 * kWarpsW * kWarpsT)
    moe_gemm_bf16_kernel(const MoeGemmBf16Args p) {
  using Tile = Bf16Tile<kWarpsW, kWarpsT, kTilesW, kTilesT, kStages>;
  __shared__ alignas(16) __nv_bfloat16 smem[Tile::kSmemElems];
  __shared__ int token_row[Tile::kRowsT];  // act row of each token of the tile, -1 past the end

  const int active_index = blockIdx.y;
  if (active_index >= *p.num_active) return;
  const int expert = p.active_experts[active_index];
  if (expert < 0 || expert >= p.num_experts) return;
  const int q_begin = p.expert_offsets[expert];
  const int q_end = p.expert_offsets[expert + 1];

  const int N = p.n, K = p.k;
  const int n0 = blockIdx.x * Tile::kRowsW;  // first weight row (output column) of this CTA
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ww = warp % kWarpsW, wt = warp / kWarpsW;
  const int g = lane / 4, t = lane % 4;
  const int k_tiles = (K + kBlockK - 1) / kBlockK;
  const __nv_bfloat16* w_expert = p.weight + static_cast<size_t>(expert) * N * K;

  for (int m0 = q_begin + blockIdx.z * Tile::kRowsT; m0 < q_end; m0 += gridDim.z * Tile::kRowsT) {
    for (int i = threadIdx.x; i < Tile::kRowsT; i += Tile::kThreads) {
      const int q = m0 + i;
      token_row[i] = q < q_end ? (p.gather ? p.gather[q] : q) : -1;
    }
    __syncthreads();  // token_row visible; the previous tile's epilogue is done with smem

    // Stage s <- k tile kt: W rows [n0, n0 + kRowsW) and the tile's tokens, k [32 kt, 32 kt + 32).
    auto load_stage = [&](int s, int kt) {
      __nv_bfloat16* w_s = smem + s * Tile::kStageElems;
      __nv_bfloat16* x_s = w_s + Tile::kRowsW * kSmemStride;
      const int k0 = kt * kBlockK;
      constexpr int kChunks = (Tile::kRowsW + Tile::kRowsT) * kChunksPerRow;
      for (int c = threadIdx.x; c < kChunks; c += Tile::kThreads) {
        const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
        const bool k_ok = k0 + col < K;
        if (row < Tile::kRowsW) {
          const int n = n0 + row;
          const bool ok = k_ok && n < N;
          const __nv_bfloat16* src =
              ok ? w_expert + static_cast<size_t>(n) * K + k0 + col : p.weight;
          cp_async_16(w_s + row * kSmemStride + col, src, ok);
        } else {
          const int r = row - Tile::kRowsW;
          const int act_row = token_row[r];
          const bool ok = k_ok && act_row >= 0;
          const __nv_bfloat16* src =
              ok ? p.act + static_cast<size_t>(act_row) * K + k0 + col : p.act;
          cp_async_16(x_s + r * kSmemStride + col, src, ok);
        }
      }
    };

    float acc[kTilesW][kTilesT][4];
#pragma unroll
    for (int i = 0; i < kTilesW; ++i)
#pragma unroll
      for (int j = 0; j < kTilesT; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage(s, s);
      cp_async_commit();  // empty groups keep the group count uniform
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();  // k tile kt has landed (for this thread's copies) ...
      __syncthreads();               // ... and for every thread's; stage (kt - 1) is free again
      const int next = kt + kStages - 1;
      if (next < k_tiles) load_stage(next % kStages, next);
      cp_async_commit();

      const __nv_bfloat16* w_s = smem + (kt % kStages) * Tile::kStageElems;
      const __nv_bfloat16* x_s = w_s + Tile::kRowsW * kSmemStride;
#pragma unroll
      for (int kk = 0; kk < kBlockK; kk += 16) {
        uint32_t b[kTilesT][2];
#pragma unroll
        for (int j = 0; j < kTilesT; ++j) {
          const __nv_bfloat16* xr = x_s + ((wt * kTilesT + j) * 8 + g) * kSmemStride + kk + 2 * t;
          b[j][0] = lds32(xr);
          b[j][1] = lds32(xr + 8);
        }
#pragma unroll
        for (int i = 0; i < kTilesW; ++i) {
          const __nv_bfloat16* wr = w_s + ((ww * kTilesW + i) * 16 + g) * kSmemStride + kk + 2 * t;
          const uint32_t a0 = lds32(wr), a1 = lds32(wr + 8 * kSmemStride);
          const uint32_t a2 = lds32(wr + 8), a3 = lds32(wr + 8 * kSmemStride + 8);
#pragma unroll
          for (int j = 0; j < kTilesT; ++j)
            mma_bf16_16x8x16(acc[i][j], a0, a1, a2, a3, b[j][0], b[j][1]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages: reuse smem for the output tile

    // out_s [kRowsT tokens][kRowsW columns] bf16
    __nv_bfloat16* out_s = smem;
#pragma unroll
    for (int i = 0; i < kTilesW; ++i)
#pragma unroll
      for (int j = 0; j < kTilesT; ++j) {
        const int col = (ww * kTilesW + i) * 16 + g;  // weight row inside the CTA tile
        const int tok = (wt * kTilesT + j) * 8 + 2 * t;
        out_s[tok * Tile::kOutStride + col] = __float2bfloat16(acc[i][j][0]);
        out_s[(tok + 1) * Tile::kOutStride + col] = __float2bfloat16(acc[i][j][1]);
        out_s[tok * Tile::kOutStride + col + 8] = __float2bfloat16(acc[i][j][2]);
        out_s[(tok + 1) * Tile::kOutStride + col + 8] = __float2bfloat16(acc[i][j][3]);
      }
    __syncthreads();
    constexpr int kOutChunks = Tile::kRowsT * (Tile::kRowsW / 8);
    for (int c = threadIdx.x; c < kOutChunks; c += Tile::kThreads) {
      const int r = c / (Tile::kRowsW / 8), col = (c % (Tile::kRowsW / 8)) * 8;
      const int q = m0 + r, n = n0 + col;
      if (q < q_end && n < N)  // N % 8 == 0: a chunk is all inside or all outside
        *reinterpret_cast<uint4*>(p.out + static_cast<size_t>(q) * N + n) =
            *reinterpret_cast<const uint4*>(out_s + r * Tile::kOutStride + col);
    }
    // The next tile's first __syncthreads (after token_row) orders these reads before its loads.
  }
}

// Decode: 64 weight rows x 16 tokens, 4 warps, 6 stages (38 KB): many small CTAs keep enough
// weight bytes in flight when each expert has a handful of tokens.
constexpr int kDecodeWarpsW = 4, kDecodeWarpsT = 1, kDecodeTilesW = 1, kDecodeTilesT = 2,
              kDecodeStages = 6;
// Prefill: 128 weight rows x 64 tokens, 8 warps of 32 x 32, 3 stages (45 KB).
constexpr int kPrefillWarpsW = 4, kPrefillWarpsT = 2, kPrefillTilesW = 2, kPrefillTilesT = 4,
              kPrefillStages = 3;

template <int kWarpsW, int kWarpsT, int kTilesW, int kTilesT, int kStages>
void launch_instance(const MoeGemmBf16Args& p, cudaStream_t stream) {
  using Tile = Bf16Tile<kWarpsW, kWarpsT, kTilesW, kTilesT, kStages>;
  const int tokens_per_expert = std::max(1, p.max_tokens_per_expert);
  const int splits =
      std::clamp((tokens_per_expert + Tile::kRowsT - 1) / Tile::kRowsT, 1, kMaxRowSplits);
  dim3 grid((p.n + Tile::kRowsW - 1) / Tile::kRowsW, p.max_active_experts, splits);
  moe_gemm_bf16_kernel<kWarpsW, kWarpsT, kTilesW, kTilesT, kStages>
      <<<grid, dim3(Tile::kThreads), 0, stream>>>(p);
}

}  // namespace

MoeGemmBf16Tile choose_moe_gemm_bf16_tile(int max_tokens_per_expert) {
  return max_tokens_per_expert <= 32 ? MoeGemmBf16Tile::kDecode : MoeGemmBf16Tile::kPrefill;
}

void check_moe_gemm_bf16_args(const MoeGemmBf16Args& p) {
  MOELORA_CHECK(p.act && p.weight && p.expert_offsets && p.active_experts && p.num_active && p.out,
                ErrorCode::kInvalidArgument, "bf16 moe GEMM: a required device pointer is null");
  MOELORA_CHECK(p.n > 0 && p.n % 8 == 0, ErrorCode::kInvalidArgument, "bf16 moe GEMM: N = ", p.n,
                " must be a positive multiple of 8 (16-byte output chunks)");
  MOELORA_CHECK(p.k > 0 && p.k % 8 == 0, ErrorCode::kInvalidArgument, "bf16 moe GEMM: K = ", p.k,
                " must be a positive multiple of 8 (16-byte loads)");
  MOELORA_CHECK(p.num_experts > 0 && p.max_active_experts > 0 &&
                    p.max_active_experts <= p.num_experts && p.max_active_experts <= 65535,
                ErrorCode::kInvalidArgument,
                "bf16 moe GEMM: max_active_experts = ", p.max_active_experts,
                " must be in [1, E = ", p.num_experts, "]");
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(p.act) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.weight) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.out) % 16 == 0,
                ErrorCode::kInvalidArgument,
                "bf16 moe GEMM: act, weight and out must be 16-byte aligned");
}

void launch_moe_gemm_bf16(const MoeGemmBf16Args& p, cudaStream_t stream) {
  check_moe_gemm_bf16_args(p);
  const MoeGemmBf16Tile tile = p.tile == MoeGemmBf16Tile::kAuto
                                   ? choose_moe_gemm_bf16_tile(p.max_tokens_per_expert)
                                   : p.tile;
  if (tile == MoeGemmBf16Tile::kDecode) {
    launch_instance<kDecodeWarpsW, kDecodeWarpsT, kDecodeTilesW, kDecodeTilesT, kDecodeStages>(
        p, stream);
  } else {
    launch_instance<kPrefillWarpsW, kPrefillWarpsT, kPrefillTilesW, kPrefillTilesT, kPrefillStages>(
        p, stream);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
