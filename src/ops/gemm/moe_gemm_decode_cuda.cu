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

__device__ __forceinline__ uint4 load_streaming_16(const uint8_t* p) {
  // Weights are read exactly once: bypass L1, keep them from evicting activations.
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

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

template <int kSub, int kWarpsN>
__global__ void __launch_bounds__(32 * kWarpsPerCta, 2)
    moe_gemm_fp8_decode_kernel(const MoeGemmFp8Args p) {
  constexpr int kWarpsK = kWarpsPerCta / kWarpsN;
  // 128-column blocks whose loads are issued before computing: 2 keeps ~32 KB in flight per SM at
  // two CTAs per SM (registers capped at 128 by the launch bounds).
  constexpr int kDepth = kSub == 4 ? 1 : 2;
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

  const uint8_t* w_expert = p.weight + static_cast<size_t>(expert) * N * K;
  const float* ws_row = p.weight_scale + (static_cast<size_t>(expert) * n_blocks + n0 / 128) * k_blocks;
  const int row_lo = n0 + g, row_hi = n0 + g + 8;
  const bool has_lo = row_lo < N, has_hi = row_hi < N;
  const uint8_t* w_lo = w_expert + static_cast<size_t>(has_lo ? row_lo : 0) * K + t * 32;
  const uint8_t* w_hi = w_expert + static_cast<size_t>(has_hi ? row_hi : 0) * K + t * 32;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  for (int m0 = q_begin; m0 < q_end; m0 += 8 * kSub) {
    // This lane feeds token column g of each subtile into the B fragment and owns output token
    // columns 2t and 2t+1 of the C fragment.
    const uint8_t* x_row[kSub];
    bool x_valid[kSub];
    const float* sx_row[kSub][2];
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
      const int q = m0 + s * 8 + g;
      x_valid[s] = q < q_end;
      const int row = x_valid[s] ? (p.gather ? p.gather[q] : q) : 0;
      x_row[s] = p.act + static_cast<size_t>(row) * K + t * 32;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int qc = m0 + s * 8 + 2 * t + c;
        const int rc = qc < q_end ? (p.gather ? p.gather[qc] : qc) : -1;
        sx_row[s][c] = rc >= 0 ? p.act_scale + static_cast<size_t>(rc) * k_blocks : nullptr;
      }
    }

    float acc[kSub][4];
#pragma unroll
    for (int s = 0; s < kSub; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[s][i] = 0.f;

    for (int kb0 = wk; kb0 < k_blocks; kb0 += kDepth * kWarpsK) {
      // Issue every load of kDepth blocks first: bytes in flight hide HBM latency.
      uint4 wa[kDepth][2], wb[kDepth][2], xb[kDepth][kSub][2];
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int kb = kb0 + d * kWarpsK;
        const bool in_k = kb < k_blocks;
        const size_t off = static_cast<size_t>(kb) * 128;
        wa[d][0] = in_k && has_lo ? load_streaming_16(w_lo + off) : zero;
        wa[d][1] = in_k && has_lo ? load_streaming_16(w_lo + off + 16) : zero;
        wb[d][0] = in_k && has_hi ? load_streaming_16(w_hi + off) : zero;
        wb[d][1] = in_k && has_hi ? load_streaming_16(w_hi + off + 16) : zero;
#pragma unroll
        for (int s = 0; s < kSub; ++s) {
          xb[d][s][0] = in_k && x_valid[s] ? load_cached_16(x_row[s] + off) : zero;
          xb[d][s][1] = in_k && x_valid[s] ? load_cached_16(x_row[s] + off + 16) : zero;
        }
      }
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int kb = kb0 + d * kWarpsK;
        if (kb >= k_blocks) break;
        float blk[kSub][4];
#pragma unroll
        for (int s = 0; s < kSub; ++s)
#pragma unroll
          for (int i = 0; i < 4; ++i) blk[s][i] = 0.f;
#pragma unroll
        for (int step = 0; step < 4; ++step) {
          const uint32_t a0 = word(wa[d][0], wa[d][1], 2 * step);
          const uint32_t a2 = word(wa[d][0], wa[d][1], 2 * step + 1);
          const uint32_t a1 = word(wb[d][0], wb[d][1], 2 * step);
          const uint32_t a3 = word(wb[d][0], wb[d][1], 2 * step + 1);
#pragma unroll
          for (int s = 0; s < kSub; ++s) {
            mma_e4m3_16x8x32(blk[s], a0, a1, a2, a3, word(xb[d][s][0], xb[d][s][1], 2 * step),
                             word(xb[d][s][0], xb[d][s][1], 2 * step + 1));
          }
        }
        const float sw = (has_lo || has_hi) ? ws_row[kb] : 0.f;  // tiles past N read nothing
#pragma unroll
        for (int s = 0; s < kSub; ++s) {
          const float s0 = sx_row[s][0] ? sx_row[s][0][kb] * sw : 0.f;
          const float s1 = sx_row[s][1] ? sx_row[s][1][kb] * sw : 0.f;
          acc[s][0] += blk[s][0] * s0;  // (row g,   token 2t)
          acc[s][1] += blk[s][1] * s1;  // (row g,   token 2t+1)
          acc[s][2] += blk[s][2] * s0;  // (row g+8, token 2t)
          acc[s][3] += blk[s][3] * s1;  // (row g+8, token 2t+1)
        }
      }
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
