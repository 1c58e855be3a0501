// Decode-regime grouped FP8 expert GEMM: few tokens per expert, so the cost is streaming the
// expert weights from HBM once. Tokens go on the MMA's N side ("swap-AB"): each warp owns 16
// weight rows (M = 16) and multiplies them with up to 8 tokens per mma.sync.m16n8k32 (e4m3 in,
// fp32 accumulate).
//
// Loads. The mma fragment of lane (g = lane/4, t = lane%4) holds, for one 32-wide k-step,
// A[g][4t..4t+3], A[g][16+4t..], A[g+8][4t..], A[g+8][16+4t..] and B[4t..4t+3][g], B[16+4t..][g].
// Permuting k inside a 128-column scale block identically for A and B leaves the dot product
// unchanged, so we let lane t own the 32 contiguous bytes [32t, 32t+32) of every 128-byte block
// of its two weight rows and of its token's activation row; k-step s uses bytes [8s, 8s+8) of
// them (first 4 -> a0/b0, next 4 -> a2/b1). Each lane then issues two 16-byte loads per row per
// block: weights stream in 512-byte, fully used segments straight from global memory, with no
// shared-memory staging and no pre-shuffled weight copy.
//
// Scales. The four k-steps of a 128-column block accumulate into `blk`, which is promoted into
// `acc` with weight_scale[row block][k block] * act_scale[token][k block] (DeepGEMM-style
// promotion; the 16 rows of a warp always lie inside one 128-row scale block).
//
// CTA = warps_n x warps_k warps: warps_n 16-row tiles side by side, K split over warps_k warps
// (interleaved by 128-blocks) and reduced through shared memory in a fixed order, so results are
// deterministic. Grid = (ceil(N / (16 warps_n)), max active experts); CTAs past *num_active
// return immediately, so a captured graph stays valid for any routing.
#include <cuda_bf16.h>

#include "core/cuda_utils.h"
#include "ops/gemm/moe_gemm_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kWarpsPerCta = 8;

__device__ __forceinline__ uint4 load_cached_16(const uint8_t* p) {
  // Activations are re-read by every warp of the CTA and by neighbouring CTAs: cache them.
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ uint32_t word(const uint4& lo, const uint4& hi, int i) {
  // word i (0..7) of the 32 bytes held as two uint4
  switch (i) {
    case 0: return lo.x;
    case 1: return lo.y;
    case 2: return lo.z;
    case 3: return lo.w;
    case 4: return hi.x;
    case 5: return hi.y;
    case 6: return hi.z;
    default: return hi.w;
  }
}

__device__ __forceinline__ void mma_e4m3_16x8x32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // FP8 MMA needs sm_89+; the launcher refuses older devices before we get here
#endif
}

__device__ __forceinline__ uint4 load_streaming_16(const uint8_t* p) {
  // Weights are read exactly once: bypass L1, keep them from evicting activations.
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Weights of kDepth consecutive K blocks of this warp (two rows x 32 bytes each per lane).
template <int kDepth>
struct WeightGroup {
  uint4 lo[kDepth][2], hi[kDepth][2];
};

// One token subtile keeps registers low enough for two CTAs per SM; more subtiles get the whole
// register file of one CTA (8 warps, still 64 KB of weights in flight per SM).
//
// Measured alternative (kept out): staging the weights through shared memory with a 4-deep
// cp.async pipeline into lane-private slots was 10-35 % slower on the H200 at every batch size
// (e.g. qwen3.5 routed B=16: 204 vs 150 us), so weights go straight to registers, double
// buffered.
template <int kSub, int kWarpsN>
__global__ void __launch_bounds__(32 * kWarpsPerCta, kSub == 1 ? 2 : 1)
    moe_gemm_fp8_decode_kernel(const MoeGemmFp8Args p) {
  constexpr int kWarpsK = kWarpsPerCta / kWarpsN;
  // Blocks per weight group. Two groups are in flight per warp (double buffering): while one is
  // multiplied the next one's loads are outstanding, so each warp always has 2 * kDepth * 64
  // bytes per lane requested from HBM.
  constexpr int kDepth = 2;
  __shared__ float partial[kWarpsK][kWarpsN][kSub][32][4];  // K-split partial sums

  const int active_slot = blockIdx.y;
  if (active_slot >= *p.num_active) return;
  const int expert = p.active_experts[active_slot];
  const int q_begin = p.expert_offsets[expert];
  const int q_end = p.expert_offsets[expert + 1];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wn = warp % kWarpsN, wk = warp / kWarpsN;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = (blockIdx.x * kWarpsN + wn) * 16;  // first weight row of this warp
  const int K = p.k, N = p.n;
  const int k_blocks = K / 128;
  const int n_blocks = (N + 127) / 128;
  // This warp's K blocks are kb = wk + i * kWarpsK, i < my_blocks.
  const int my_blocks = wk < k_blocks ? (k_blocks - wk + kWarpsK - 1) / kWarpsK : 0;
  const int groups = (my_blocks + kDepth - 1) / kDepth;

  const uint8_t* w_expert = p.weight + static_cast<size_t>(expert) * N * K;
  const float* ws_row = p.weight_scale + (static_cast<size_t>(expert) * n_blocks + n0 / 128) * k_blocks;
  const int row_lo = n0 + g, row_hi = n0 + g + 8;
  const bool has_lo = row_lo < N, has_hi = row_hi < N;
  const uint8_t* w_lo = w_expert + static_cast<size_t>(has_lo ? row_lo : 0) * K + t * 32;
  const uint8_t* w_hi = w_expert + static_cast<size_t>(has_hi ? row_hi : 0) * K + t * 32;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  auto load_group = [&](WeightGroup<kDepth>& w, int group) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int i = group * kDepth + d;
      const bool in_k = i < my_blocks;
      const size_t off = static_cast<size_t>(wk + i * kWarpsK) * 128;
      w.lo[d][0] = in_k && has_lo ? load_streaming_16(w_lo + off) : zero;
      w.lo[d][1] = in_k && has_lo ? load_streaming_16(w_lo + off + 16) : zero;
      w.hi[d][0] = in_k && has_hi ? load_streaming_16(w_hi + off) : zero;
      w.hi[d][1] = in_k && has_hi ? load_streaming_16(w_hi + off + 16) : zero;
    }
  };

  for (int m0 = q_begin; m0 < q_end; m0 += 8 * kSub) {
    // Row indices, not pointers: registers are the scarce resource here.
    int x_row[kSub];       // activation row fed as B column g, -1 past the expert's tokens
    int sx_row[kSub][2];   // activation rows of output columns 2t, 2t+1 (their scales)
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
      const int q = m0 + s * 8 + g;
      x_row[s] = q < q_end ? (p.gather ? p.gather[q] : q) : -1;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int qc = m0 + s * 8 + 2 * t + c;
        sx_row[s][c] = qc < q_end ? (p.gather ? p.gather[qc] : qc) : -1;
      }
    }

    float acc[kSub][4];
#pragma unroll
    for (int s = 0; s < kSub; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[s][i] = 0.f;

    // Multiplies one weight group: per block and token subtile, load the activation bytes (L1/L2
    // hits: every warp of the CTA reads the same rows) and run the four k-steps.
    auto compute_group = [&](const WeightGroup<kDepth>& w, int group) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int i = group * kDepth + d;
        if (i >= my_blocks) break;
        const int kb = wk + i * kWarpsK;
        const size_t off = static_cast<size_t>(kb) * 128;
        const float sw = (has_lo || has_hi) ? ws_row[kb] : 0.f;  // tiles past N read nothing
#pragma unroll
        for (int s = 0; s < kSub; ++s) {
          if (m0 + s * 8 >= q_end) break;  // subtile beyond this expert's tokens (warp-uniform)
          const uint8_t* xr = p.act + static_cast<size_t>(x_row[s] < 0 ? 0 : x_row[s]) * K + t * 32 + off;
          const uint4 x0 = x_row[s] >= 0 ? load_cached_16(xr) : zero;
          const uint4 x1 = x_row[s] >= 0 ? load_cached_16(xr + 16) : zero;
          float blk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int step = 0; step < 4; ++step) {
            mma_e4m3_16x8x32(blk, word(w.lo[d][0], w.lo[d][1], 2 * step), word(w.hi[d][0], w.hi[d][1], 2 * step),
                             word(w.lo[d][0], w.lo[d][1], 2 * step + 1), word(w.hi[d][0], w.hi[d][1], 2 * step + 1),
                             word(x0, x1, 2 * step), word(x0, x1, 2 * step + 1));
          }
          const float s0 = sx_row[s][0] >= 0 ? p.act_scale[static_cast<size_t>(sx_row[s][0]) * k_blocks + kb] * sw : 0.f;
          const float s1 = sx_row[s][1] >= 0 ? p.act_scale[static_cast<size_t>(sx_row[s][1]) * k_blocks + kb] * sw : 0.f;
          acc[s][0] += blk[0] * s0;  // (row g,   token 2t)
          acc[s][1] += blk[1] * s1;  // (row g,   token 2t+1)
          acc[s][2] += blk[2] * s0;  // (row g+8, token 2t)
          acc[s][3] += blk[3] * s1;  // (row g+8, token 2t+1)
        }
      }
    };

    WeightGroup<kDepth> buf0, buf1;
    if (groups > 0) load_group(buf0, 0);
    for (int grp = 0; grp < groups; grp += 2) {
      if (grp + 1 < groups) load_group(buf1, grp + 1);
      compute_group(buf0, grp);
      if (grp + 1 >= groups) break;
      if (grp + 2 < groups) load_group(buf0, grp + 2);
      compute_group(buf1, grp + 1);
    }

    // Reduce the K-split partials in a fixed order (deterministic), then store bf16.
    if constexpr (kWarpsK > 1) {
#pragma unroll
      for (int s = 0; s < kSub; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[wk][wn][s][lane][i] = acc[s][i];
      __syncthreads();
      if (wk == 0) {
#pragma unroll
        for (int s = 0; s < kSub; ++s)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float sum = partial[0][wn][s][lane][i];
#pragma unroll
            for (int w = 1; w < kWarpsK; ++w) sum += partial[w][wn][s][lane][i];
            acc[s][i] = sum;
          }
      }
    }
    if (wk == 0) {
#pragma unroll
      for (int s = 0; s < kSub; ++s) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int q = m0 + s * 8 + 2 * t + c;
          if (q >= q_end) continue;
          __nv_bfloat16* out_row = p.out + static_cast<size_t>(q) * N;
          if (has_lo) out_row[row_lo] = __float2bfloat16(acc[s][c]);
          if (has_hi) out_row[row_hi] = __float2bfloat16(acc[s][2 + c]);
        }
      }
    }
    if constexpr (kWarpsK > 1) __syncthreads();  // `partial` is reused by the next pass
  }
}

template <int kSub>
void launch_with_sub(const MoeGemmFp8Args& p, const DecodeGemmConfig& c, cudaStream_t stream) {
  const int n_tiles = (p.n + 15) / 16;
  dim3 grid((n_tiles + c.warps_n - 1) / c.warps_n, p.max_active_experts);
  dim3 block(32 * kWarpsPerCta);
  switch (c.warps_n) {
    case 1: moe_gemm_fp8_decode_kernel<kSub, 1><<<grid, block, 0, stream>>>(p); break;
    case 2: moe_gemm_fp8_decode_kernel<kSub, 2><<<grid, block, 0, stream>>>(p); break;
    case 4: moe_gemm_fp8_decode_kernel<kSub, 4><<<grid, block, 0, stream>>>(p); break;
    case 8: moe_gemm_fp8_decode_kernel<kSub, 8><<<grid, block, 0, stream>>>(p); break;
    default: MOELORA_THROW(ErrorCode::kInternal, "decode GEMM: warps_n ", c.warps_n, " has no instance");
  }
}

}  // namespace

void check_moe_gemm_fp8_args(const MoeGemmFp8Args& p) {
  MOELORA_CHECK(p.act && p.act_scale && p.weight && p.weight_scale && p.expert_offsets && p.out,
                ErrorCode::kInvalidArgument, "moe GEMM: a required device pointer is null");
  MOELORA_CHECK(p.k > 0 && p.k % 128 == 0, ErrorCode::kInvalidArgument, "moe GEMM: K = ", p.k,
                " must be a positive multiple of 128 (the layer pads K to whole scale blocks)");
  MOELORA_CHECK(p.n > 0, ErrorCode::kInvalidArgument, "moe GEMM: N = ", p.n, " must be positive");
  MOELORA_CHECK(p.num_experts > 0 && p.max_active_experts > 0 && p.max_active_experts <= p.num_experts,
                ErrorCode::kInvalidArgument, "moe GEMM: max_active_experts = ", p.max_active_experts,
                " must be in [1, E = ", p.num_experts, "]");
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(p.act) % 16 == 0 && reinterpret_cast<uintptr_t>(p.weight) % 16 == 0,
                ErrorCode::kInvalidArgument, "moe GEMM: act and weight must be 16-byte aligned");
}

void launch_moe_gemm_fp8_decode(const MoeGemmFp8Args& p, int num_sms, cudaStream_t stream) {
  check_moe_gemm_fp8_args(p);
  MOELORA_CHECK(p.active_experts && p.num_active, ErrorCode::kInvalidArgument,
                "decode GEMM: active_experts and num_active are required");
  const DecodeGemmConfig c =
      choose_decode_gemm_config(p.n, p.k, p.max_active_experts, p.max_tokens_per_expert, num_sms);
  switch (c.token_subtiles) {
    case 1: launch_with_sub<1>(p, c, stream); break;
    case 2: launch_with_sub<2>(p, c, stream); break;
    default: launch_with_sub<4>(p, c, stream); break;
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
