// The gated delta rule in its chunked form, for prefill (gdn_cuda.cuh; the oracle is
// gated_delta_rule_recurrent_ref / _chunked_ref). One CTA (8 warps) per (sequence, value head)
// with at least p.chunk_min_tokens tokens walks the sequence's tokens in chunks of C = 64; the
// state S [dk, dv] (fp32) stays in shared memory for the whole call. Per chunk, with S0 the state
// at its start, Gc the cumulative log decay (Gc_t = g_0 + ... + g_t over the chunk's tokens),
// Eg_t = exp(Gc_t), Kd_t = exp(Gc_last - Gc_t) (all <= 1: g <= 0):
//
//   L = strictly lower part of  beta_t (k_t . k_j) exp(Gc_t - Gc_j)            [C, C]
//   P = lower part (diagonal included) of  (q_t . k_j) exp(Gc_t - Gc_j)         [C, C]
//   R = beta (V - Eg K S0)                                                      [C, dv]
//   (I + L) D = R, by forward substitution: D = the chunk's deltas               [C, dv]
//   O = Eg Q S0 + P D                                                           [C, dv]
//   S = Eg_last S0 + (Kd K)^T D                                                  [dk, dv]
//
// (gdn_ref.cpp derives it: the deltas of a chunk solve one unit lower-triangular system.) The
// products run on the tensor cores as warp-level mma.sync m16n8k8 in TF32 with fp32 accumulation
// (k k^T with q k^T and K S0 with Q S0 share their right-hand fragments; the triangular P D skips
// the zero blocks). The triangular solve goes by 16-row blocks: each warp owns dv / 8 columns of
// D, which are independent, so a block takes the earlier blocks' terms in one small product and
// then its 16 rows one by one in fp32 without any block-wide barrier. The outputs go through the
// gated RMSNorm and out as bf16 rows; the conv state of the item's channels is rolled as the
// recurrent rule kernel does it.
//
// Measured on an H200 before the blocked solve and the shared fragments (one row at a time over
// all 64 rows): 50 us per chunk, issue-bound (IPC 1.3 with 8 warps, the row-by-row solve ~60% of
// the instructions); see docs/gpu_engine.md for the numbers after.
//
// Numerics: TF32 keeps 10 mantissa bits of each product's operands (relative 2^-11 per operand,
// rounded to nearest); sums are fp32. Against the fp32 reference this adds ~1e-3 relative errors to
// the deltas and the state (tests/gpu/gdn_rig.cuh states the bounds), which decay with g like the
// state itself. The split of a prompt into calls changes where the chunks start, so unlike the
// recurrent kernel a split prompt gives the one-call outputs only within those bounds, not bitwise.
//
// Shared memory (dk = dv = 128): S 68 KiB, Q and K 33 KiB each, V / R / D 34 KiB, L and P 17 KiB
// each: 204 KiB, one CTA per SM. Row strides are padded so that the mma operand reads hit 32
// distinct banks: +4 floats for rows read as A[m][k] (Q, K, P), +8 for rows read as B[k][n] (S, D).
#include <cstdint>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/mma_ptx.cuh"
#include "core/sm90_ptx.cuh"
#include "ops/gdn/gdn_internal_cuda.cuh"

namespace moelora::ops::cuda::gdn_detail {

namespace {

constexpr int kChunk = kGdnChunkTokens;
constexpr int kChunkThreads = 256;  // 8 warps; the warp tilings below assume it

template <int kDk, int kDv>
struct ChunkSmem {
  static constexpr int kQkStride = kDk + 4;     // Q, K rows [C][dk]
  static constexpr int kSvStride = kDv + 8;     // S rows [dk][dv], V / R / D rows [C][dv]
  static constexpr int kLpStride = kChunk + 4;  // L, P rows [C][C]
  static constexpr int kOffS = 0;
  static constexpr int kOffQ = kOffS + kDk * kSvStride;
  static constexpr int kOffK = kOffQ + kChunk * kQkStride;
  static constexpr int kOffV = kOffK + kChunk * kQkStride;
  static constexpr int kOffL = kOffV + kChunk * kSvStride;
  static constexpr int kOffP = kOffL + kChunk * kLpStride;
  static constexpr int kOffGc = kOffP + kChunk * kLpStride;  // [C] cumulative log decay
  static constexpr int kOffEg = kOffGc + kChunk;             // [C] exp(Gc)
  static constexpr int kOffKd = kOffEg + kChunk;             // [C] exp(Gc_last - Gc)
  static constexpr int kOffBeta = kOffKd + kChunk;           // [C]
  static constexpr int kOffRowSq = kOffBeta + kChunk;        // [2][C] partial sums of o^2
  static constexpr int kFloats = kOffRowSq + 2 * kChunk;
  static constexpr size_t kBytes = kFloats * sizeof(float);
  static_assert(kBytes <= 227 * 1024, "one CTA's shared memory");
};

using ::moelora::cuda::ptx::mma_tf32_1688;
using ::moelora::cuda::ptx::to_tf32;

// One warp: acc (kMt x kNt tiles of 16 x 8 at rows m0 + 16 mt, columns n0 + 8 nt) += A B over
// k in [0, k_count) (a multiple of 8), with a_at(m, k) and b_at(k, n) giving the operands' TF32
// bits (shared memory). With kDual, acc2 += A2 B as well, sharing B's fragments (two products
// with one right-hand side: k k^T and q k^T, K S0 and Q S0).
template <bool kDual, int kMt, int kNt, class AAt, class A2At, class BAt>
__device__ __forceinline__ void warp_gemm_impl(float (&acc)[kMt][kNt][4],
                                               float (&acc2)[kMt][kNt][4], int m0, int n0,
                                               int k_count, AAt a_at, A2At a2_at, BAt b_at) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll 2
  for (int k0 = 0; k0 < k_count; k0 += 8) {
    uint32_t a[kMt][4], a2[kMt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      const int m = m0 + 16 * mt + g;
      a[mt][0] = a_at(m, k0 + t);
      a[mt][1] = a_at(m + 8, k0 + t);
      a[mt][2] = a_at(m, k0 + t + 4);
      a[mt][3] = a_at(m + 8, k0 + t + 4);
      if constexpr (kDual) {
        a2[mt][0] = a2_at(m, k0 + t);
        a2[mt][1] = a2_at(m + 8, k0 + t);
        a2[mt][2] = a2_at(m, k0 + t + 4);
        a2[mt][3] = a2_at(m + 8, k0 + t + 4);
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      const int n = n0 + 8 * nt + g;
      const uint32_t b0 = b_at(k0 + t, n), b1 = b_at(k0 + t + 4, n);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        mma_tf32_1688(acc[mt][nt], a[mt], b0, b1);
        if constexpr (kDual) mma_tf32_1688(acc2[mt][nt], a2[mt], b0, b1);
      }
    }
  }
}
template <int kMt, int kNt, class AAt, class BAt>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMt][kNt][4], int m0, int n0, int k_count,
                                          AAt a_at, BAt b_at) {
  warp_gemm_impl<false>(acc, acc, m0, n0, k_count, a_at, a_at, b_at);
}
template <int kMt, int kNt, class AAt, class A2At, class BAt>
__device__ __forceinline__ void warp_gemm_dual(float (&acc)[kMt][kNt][4],
                                               float (&acc2)[kMt][kNt][4], int m0, int n0,
                                               int k_count, AAt a_at, A2At a2_at, BAt b_at) {
  warp_gemm_impl<true>(acc, acc2, m0, n0, k_count, a_at, a2_at, b_at);
}

// Calls f(row, column, element) for each accumulator element this lane holds.
template <int kMt, int kNt, class F>
__device__ __forceinline__ void for_each_acc(float (&acc)[kMt][kNt][4], int m0, int n0, F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        f(m0 + 16 * mt + g + (i >= 2 ? 8 : 0), n0 + 8 * nt + 2 * t + (i & 1), acc[mt][nt][i]);
}

template <int kMt, int kNt>
__device__ __forceinline__ void zero(float (&acc)[kMt][kNt][4]) {
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
}

// Grid: max_seqs x nv CTAs (item = seq * nv + h), kChunkThreads threads; see the file comment.
template <int kDk, int kDv>
__global__ void __launch_bounds__(kChunkThreads, 1) gdn_chunk_rule_kernel(const GdnParams p) {
  using Sm = ChunkSmem<kDk, kDv>;
  constexpr int kQs = Sm::kQkStride, kSs = Sm::kSvStride, kLs = Sm::kLpStride;
  extern __shared__ __align__(16) float smem[];
  float* S = smem + Sm::kOffS;
  float* Q = smem + Sm::kOffQ;
  float* K = smem + Sm::kOffK;
  float* V = smem + Sm::kOffV;  // V, then R, then D
  float* Lm = smem + Sm::kOffL;
  float* P = smem + Sm::kOffP;
  float* Gc = smem + Sm::kOffGc;
  float* Eg = smem + Sm::kOffEg;
  float* Kd = smem + Sm::kOffKd;
  float* Beta = smem + Sm::kOffBeta;
  float* RowSq = smem + Sm::kOffRowSq;

  // cu_seqlens and slots are the step's inputs, not an earlier kernel's outputs: read before the
  // wait, as the recurrent rule kernel does.
  const int seq = blockIdx.x / p.nv, h = blockIdx.x % p.nv;
  const int start = p.cu_seqlens[seq], T = p.cu_seqlens[seq + 1] - start;
  const int slot = p.slots[seq];
  if (p.chunk_min_tokens <= 0 || T < p.chunk_min_tokens || !slot_valid(p, slot)) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kh = h / p.group;
  float* state = p.recurrent_state + (static_cast<int64_t>(slot) * p.nv + h) * kDk * kDv;

  // S0 is not the conv kernel's output either: its copy overlaps the wait.
  constexpr int kSVec = kDv / 4;
  for (int i = tid; i < kDk * kSVec; i += kChunkThreads) {
    const int r = i / kSVec, c = 4 * (i % kSVec);
    *reinterpret_cast<float4*>(S + r * kSs + c) = reinterpret_cast<const float4*>(state)[i];
  }
  ::moelora::cuda::sm90::grid_dependency_wait();
  update_conv_state(p, h, slot, start, T);

  // Warp tiles: [C, C] products 16 x 32 per warp, [C, dv] ones 16 x dv / 2, the state dk / 4 x
  // dv / 2.
  constexpr int kNtV = kDv / 16, kMtS = kDk / 64;
  const int cm0 = 16 * (warp % 4), cn0 = 32 * (warp / 4);
  const int om0 = 16 * (warp % 4), on0 = (kDv / 2) * (warp / 4);
  const int sm0 = (kDk / 4) * (warp % 4), sn0 = (kDv / 2) * (warp / 4);
  // Operand readers (TF32 bits). Q, K and P are stored rounded to TF32 (they are only ever mma
  // operands); S, D and L are kept in fp32 (S seeds the next state, D and L feed the triangular
  // solve) and rounded as they are read.
  auto bits = [](float x) { return __float_as_uint(x); };
  auto q_at = [&](int t, int r) { return bits(Q[t * kQs + r]); };
  auto k_at = [&](int t, int r) { return bits(K[t * kQs + r]); };
  auto kt_at = [&](int r, int t) { return bits(K[t * kQs + r]); };  // K^T
  auto s_at = [&](int r, int c) { return to_tf32(S[r * kSs + c]); };
  auto d_at = [&](int t, int c) { return to_tf32(V[t * kSs + c]); };
  auto p_at = [&](int t, int j) { return bits(P[t * kLs + j]); };
  auto l_at = [&](int t, int j) { return to_tf32(Lm[t * kLs + j]); };
  auto round4 = [](float4 v) {
    return make_float4(__uint_as_float(to_tf32(v.x)), __uint_as_float(to_tf32(v.y)),
                       __uint_as_float(to_tf32(v.z)), __uint_as_float(to_tf32(v.w)));
  };

  for (int c0 = 0; c0 < T; c0 += kChunk) {
    const int L = min(kChunk, T - c0);
    const int64_t row0 = static_cast<int64_t>(start) + c0;

    // 1. The chunk's q, k (key head kh), v and gates; rows past L are zeros (then they add nothing
    //    to any product: beta = 0 makes their deltas 0).
    constexpr int kKVec = kDk / 4;
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int i = tid; i < kChunk * kKVec; i += kChunkThreads) {
      const int t = i / kKVec, c = 4 * (i % kKVec);
      float4 q = zero4, k = zero4;
      if (t < L) {
        const int64_t o = (row0 + t) * p.key_dim + kh * kDk + c;
        q = *reinterpret_cast<const float4*>(p.ws.q + o);
        k = *reinterpret_cast<const float4*>(p.ws.k + o);
      }
      *reinterpret_cast<float4*>(Q + t * kQs + c) = round4(q);
      *reinterpret_cast<float4*>(K + t * kQs + c) = round4(k);
    }
    for (int i = tid; i < kChunk * kSVec; i += kChunkThreads) {
      const int t = i / kSVec, c = 4 * (i % kSVec);
      float4 v = zero4;
      if (t < L)
        v = *reinterpret_cast<const float4*>(p.ws.v + (row0 + t) * p.value_dim + h * kDv + c);
      *reinterpret_cast<float4*>(V + t * kSs + c) = v;
    }
    if (warp == 0) {  // two tokens per lane; inclusive scan of g
      const int t0 = 2 * lane, t1 = t0 + 1;
      float g0 = 0.0f, g1 = 0.0f, b0 = 0.0f, b1 = 0.0f;
      if (t0 < L) {
        g0 = p.ws.g[(row0 + t0) * p.nv + h];
        b0 = p.ws.beta[(row0 + t0) * p.nv + h];
      }
      if (t1 < L) {
        g1 = p.ws.g[(row0 + t1) * p.nv + h];
        b1 = p.ws.beta[(row0 + t1) * p.nv + h];
      }
      float incl = g0 + g1;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
      }
      const float before = incl - (g0 + g1);
      Gc[t0] = before + g0;
      Gc[t1] = before + g0 + g1;
      Beta[t0] = b0;
      Beta[t1] = b1;
      __syncwarp();
      const float last = Gc[L - 1];
      Eg[t0] = expf(Gc[t0]);
      Eg[t1] = expf(Gc[t1]);
      Kd[t0] = expf(last - Gc[t0]);
      Kd[t1] = expf(last - Gc[t1]);
    }
    __syncthreads();

    // 2. L and P (k k^T and q k^T, decayed and masked; tiles above the diagonal are zeros).
    if (cn0 >= cm0 + 16) {
      const int g = lane / 4, t4 = lane % 4;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int t = cm0 + g + (i >= 2 ? 8 : 0), j = cn0 + 8 * nt + 2 * t4 + (i & 1);
          Lm[t * kLs + j] = 0.0f;
          P[t * kLs + j] = 0.0f;
        }
    } else {
      float kk[1][4][4], qk[1][4][4];
      zero(kk);
      zero(qk);
      warp_gemm_dual(kk, qk, cm0, cn0, kDk, k_at, q_at, kt_at);
      const int g = lane / 4, t4 = lane % 4;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int t = cm0 + g + (i >= 2 ? 8 : 0), j = cn0 + 8 * nt + 2 * t4 + (i & 1);
          const float decay = j <= t ? expf(Gc[t] - Gc[j]) : 0.0f;
          Lm[t * kLs + j] = j < t ? Beta[t] * kk[0][nt][i] * decay : 0.0f;
          P[t * kLs + j] = __uint_as_float(to_tf32(qk[0][nt][i] * decay));
        }
    }
    // 3. K S0 -> R = beta (V - Eg K S0) in place of V; Q S0 -> the output's inter-chunk part.
    float o[1][kNtV][4];
    {
      float ks[1][kNtV][4];
      zero(ks);
      zero(o);
      warp_gemm_dual(ks, o, om0, on0, kDk, k_at, q_at, s_at);
      for_each_acc(ks, om0, on0, [&](int t, int c, float& v) {
        float& x = V[t * kSs + c];
        x = Beta[t] * (x - Eg[t] * v);
      });
      for_each_acc(o, om0, on0, [&](int t, int, float& v) { v *= Eg[t]; });
    }
    __syncthreads();

    // 4. (I + L) D = R, in 16-row blocks. Warp w owns columns [w kCols, (w + 1) kCols) of D (the
    //    columns are independent), so no other warp's data is ever needed: a block first takes the
    //    earlier blocks' terms in one product (tensor cores), then its own rows one by one, kSplit
    //    lanes per column.
    {
      constexpr int kCols = kDv / 8, kSplit = 32 / kCols, kNtD = kCols / 8;
      const int col0 = warp * kCols, part = lane / kCols;
      float* column = V + col0 + lane % kCols;
      for (int b0 = 0; b0 < L; b0 += 16) {
        if (b0 > 0) {
          float earlier[1][kNtD][4];
          zero(earlier);
          warp_gemm(earlier, b0, col0, b0, l_at, d_at);
          for_each_acc(earlier, b0, col0, [&](int t, int c, float& v) { V[t * kSs + c] -= v; });
          __syncwarp();
        }
        const int end = min(b0 + 16, L);
        for (int i = b0 + 1; i < end; ++i) {
          const float* l_row = Lm + i * kLs;
          float s = 0.0f;
          for (int j = b0 + part; j < i; j += kSplit) s += l_row[j] * column[j * kSs];
#pragma unroll
          for (int off = kCols; off < 32; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
          if (part == 0) column[i * kSs] -= s;
          __syncwarp();
        }
      }
    }
    __syncthreads();

    // 5. O += P D, and the partial sums of o^2 of each row over this warp's columns.
    warp_gemm(o, om0, on0, om0 + 16, p_at,
              d_at);  // P is lower triangular: k <= the tile's last row
    {
      float ss[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < kNtV; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) ss[i / 2] += o[0][nt][i] * o[0][nt][i];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], 1);
        ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], 2);
      }
      if (lane % 4 == 0) {
        RowSq[(warp / 4) * kChunk + om0 + lane / 4] = ss[0];
        RowSq[(warp / 4) * kChunk + om0 + lane / 4 + 8] = ss[1];
      }
    }
    // 6. S = Eg_last S0 + (Kd K)^T D (every warp has read S0 before the barrier above).
    {
      float acc[kMtS][kNtV][4];
      const float decay = Eg[L - 1];
      for_each_acc(acc, sm0, sn0, [&](int r, int c, float& v) { v = decay * S[r * kSs + c]; });
      auto kdt_at = [&](int r, int t) { return to_tf32(K[t * kQs + r] * Kd[t]); };
      warp_gemm(acc, sm0, sn0, kChunk, kdt_at, d_at);
      for_each_acc(acc, sm0, sn0, [&](int r, int c, float& v) { S[r * kSs + c] = v; });
    }
    __syncthreads();

    // 7. Gated RMSNorm of the chunk's rows -> out (bf16 pairs).
    {
      const int g = lane / 4, t4 = lane % 4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = om0 + g + 8 * half;
        if (t >= L) continue;
        const float inv =
            1.0f / sqrtf((RowSq[t] + RowSq[kChunk + t]) / static_cast<float>(kDv) + p.norm_eps);
        const __nv_bfloat16* z = p.z + (row0 + t) * p.z_stride + h * kDv;
        __nv_bfloat16* out = p.out + (row0 + t) * p.out_stride + h * kDv;
#pragma unroll
        for (int nt = 0; nt < kNtV; ++nt) {
          const int c = on0 + 8 * nt + 2 * t4;
          const float o0 = o[0][nt][2 * half], o1 = o[0][nt][2 * half + 1];
          const float y0 = p.norm_weight[c] * (o0 * inv) * silu(__bfloat162float(z[c]));
          const float y1 = p.norm_weight[c + 1] * (o1 * inv) * silu(__bfloat162float(z[c + 1]));
          *reinterpret_cast<__nv_bfloat162*>(out + c) = __floats2bfloat162_rn(y0, y1);
        }
      }
    }
  }

  for (int i = tid; i < kDk * kSVec; i += kChunkThreads) {
    const int r = i / kSVec, c = 4 * (i % kSVec);
    __stcs(reinterpret_cast<float4*>(state) + i, *reinterpret_cast<const float4*>(S + r * kSs + c));
  }
}

template <int kDk, int kDv>
void launch(const GdnParams& p, int max_seqs, cudaStream_t stream) {
  using Sm = ChunkSmem<kDk, kDv>;
  auto kernel = gdn_chunk_rule_kernel<kDk, kDv>;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(Sm::kBytes)));
  ::moelora::cuda::launch_kernel(kernel, dim3(max_seqs * p.nv), dim3(kChunkThreads), Sm::kBytes,
                                 stream, true, p);
}

}  // namespace

void launch_gdn_chunk_rule(const GdnParams& p, int max_seqs, cudaStream_t stream) {
  switch (p.dk * 1000 + p.dv) {
    case 64064: launch<64, 64>(p, max_seqs, stream); break;
    case 64128: launch<64, 128>(p, max_seqs, stream); break;
    case 128064: launch<128, 64>(p, max_seqs, stream); break;
    default: launch<128, 128>(p, max_seqs, stream); break;
  }
}

}  // namespace moelora::ops::cuda::gdn_detail
