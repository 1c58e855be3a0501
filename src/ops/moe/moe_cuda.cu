#include "core/cuda_utils.h"
#include "ops/moe/moe_cuda.cuh"
#include "ops/quant/fp8_device.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kActWarps = 8;

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// Warp per (row, 128-column group): lane owns columns 4*lane .. 4*lane+3 of the group.
__global__ void __launch_bounds__(32 * kActWarps) moe_activation_kernel(const MoeActivationArgs p) {
  const int row = blockIdx.x;
  const int valid = p.num_rows ? *p.num_rows : p.max_rows;
  if (row >= valid) return;
  const int groups = p.inter_padded / 128;
  const int group = blockIdx.y * kActWarps + threadIdx.x / 32;
  if (group >= groups) return;
  const int lane = threadIdx.x % 32;
  const int I = p.inter;
  const __nv_bfloat16* h = p.h + static_cast<size_t>(row) * 2 * I;
  bool use_delta = false;
  if (p.delta && p.slot) {
    const int token = p.row_token ? p.row_token[row] : row;
    use_delta = p.slot[token] >= 0;
  }
  const int drow = p.delta_row ? p.delta_row[row] : row;
  const __nv_bfloat16* d = use_delta ? p.delta + static_cast<size_t>(drow) * 2 * I : nullptr;
  const int c0 = group * 128 + lane * 4;
  float a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = c0 + i;
    if (c < I) {
      float g = __bfloat162float(h[c]), u = __bfloat162float(h[I + c]);
      if (d) {
        g += __bfloat162float(d[c]);
        u += __bfloat162float(d[I + c]);
      }
      a[i] = silu(g) * u;
      p.a16[static_cast<size_t>(row) * I + c] = __float2bfloat16(a[i]);
    } else {
      a[i] = 0.f;
    }
  }
  if (p.aq) {
    uint32_t codes;
    const float s = quantize_group_128(a, codes);
    *reinterpret_cast<uint32_t*>(p.aq + static_cast<size_t>(row) * p.inter_padded + c0) = codes;
    if (lane == 0) p.sa[static_cast<size_t>(row) * groups + group] = s;
  }
}

constexpr int kFinalizeThreads = 256;

__global__ void __launch_bounds__(kFinalizeThreads) moe_finalize_kernel(const MoeFinalizeArgs p) {
  __shared__ float reduce[kFinalizeThreads / 32];
  __shared__ float gate_value;
  const int t = blockIdx.x;
  const int valid = p.num_tokens ? *p.num_tokens : p.max_tokens;
  if (t >= valid) return;
  const int H = p.hidden, k = p.top_k;
  const bool lora = p.slot && p.slot[t] >= 0;

  float gate = 1.f;
  if (p.shared && p.shared_gate) {
    float s = 0.f;
    for (int c = threadIdx.x; c < H; c += kFinalizeThreads)
      s += __bfloat162float(p.x[static_cast<size_t>(t) * H + c]) * __bfloat162float(p.shared_gate[c]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int w = 0; w < kFinalizeThreads / 32; ++w) total += reduce[w];  // fixed order
      gate_value = 1.f / (1.f + expf(-total));
    }
    __syncthreads();
    gate = gate_value;
  }

  const int shared_row = (p.shared_delta && lora) ? p.shared_delta_row[t] : -1;
  for (int c = threadIdx.x; c < H; c += kFinalizeThreads) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
      if (p.topk_ids[t * k + j] < 0) continue;
      const size_t pos = static_cast<size_t>(p.pair_pos[t * k + j]);
      float v = __bfloat162float(p.y[pos * H + c]);
      if (lora && p.delta) v += __bfloat162float(p.delta[pos * H + c]);
      acc = fmaf(p.topk_weights[t * k + j], v, acc);
    }
    if (p.shared) {
      float s = __bfloat162float(p.shared[static_cast<size_t>(t) * H + c]);
      if (shared_row >= 0) s += __bfloat162float(p.shared_delta[static_cast<size_t>(shared_row) * H + c]);
      acc = fmaf(gate, s, acc);
    }
    p.out[static_cast<size_t>(t) * H + c] = __float2bfloat16(acc);
  }
}

}  // namespace

void launch_moe_activation(const MoeActivationArgs& p, cudaStream_t stream) {
  MOELORA_CHECK(p.h && p.a16 && (!p.aq || p.sa), ErrorCode::kInvalidArgument, "moe activation: null pointer");
  MOELORA_CHECK(p.inter > 0 && p.inter_padded % 128 == 0 && p.inter_padded >= p.inter && p.inter_padded - p.inter < 128,
                ErrorCode::kInvalidArgument, "moe activation: inter_padded = ", p.inter_padded,
                " must be I = ", p.inter, " rounded up to a multiple of 128");
  if (p.max_rows == 0) return;
  dim3 grid(p.max_rows, (p.inter_padded / 128 + kActWarps - 1) / kActWarps);
  moe_activation_kernel<<<grid, 32 * kActWarps, 0, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_moe_finalize(const MoeFinalizeArgs& p, cudaStream_t stream) {
  MOELORA_CHECK(p.y && p.topk_ids && p.topk_weights && p.pair_pos && p.out, ErrorCode::kInvalidArgument,
                "moe finalize: null pointer");
  MOELORA_CHECK(!p.shared_gate || p.x, ErrorCode::kInvalidArgument, "moe finalize: the shared gate needs x");
  MOELORA_CHECK(!p.shared_delta || (p.shared_delta_row && p.slot), ErrorCode::kInvalidArgument,
                "moe finalize: shared_delta needs shared_delta_row and slot");
  if (p.max_tokens == 0) return;
  moe_finalize_kernel<<<p.max_tokens, kFinalizeThreads, 0, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
