// RoPE on the GPU (see rope_cuda.cuh). One CTA per token: its threads first compute the token's
// cos/sin table (rotary_dim / 2 entries, precise cosf/sinf of float(pos) * inv_freq[j] times
// attention_factor, exactly the reference's fp32 steps) into shared memory, then rotate the pairs
// of every head in place. With aligned strides a thread rotates 8 pairs (rotate-half: one 16-byte
// vector from each half) or 4 pairs (interleaved: one 16-byte vector of 8 elements); otherwise one
// pair per step.
#include <cstdint>

#include "core/cuda_utils.h"
#include "ops/rope/rope_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kRopeThreads = 256;
constexpr int kMaxHalf = 256;  // rotary_dim <= 512

// (a, b) -> (a c - b s, b c + a s), rounded to bf16 once.
__device__ __forceinline__ void rotate(float a, float b, float c, float s, float& a_out,
                                       float& b_out) {
  a_out = a * c - b * s;
  b_out = b * c + a * s;
}

template <bool kVec>
__global__ void __launch_bounds__(kRopeThreads) rope_kernel(const RopeCudaArgs args) {
  __shared__ float cos_table[kMaxHalf];
  __shared__ float sin_table[kMaxHalf];
  const int token = blockIdx.x;
  const int valid = args.num_tokens ? *args.num_tokens : args.tokens;
  if (token >= valid) return;  // uniform over the CTA
  const int half = args.rotary_dim / 2;
  const float pos = static_cast<float>(args.positions[token]);
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    const float angle = pos * args.inv_freq[j];
    cos_table[j] = cosf(angle) * args.attention_factor;
    sin_table[j] = sinf(angle) * args.attention_factor;
  }
  __syncthreads();

  __nv_bfloat16* token_base =
      args.x + static_cast<int64_t>(token) * args.token_stride + args.dim_offset;
  const bool rotate_half = args.style == RopeStyle::kRotateHalf;
  // Pairs per work item: rotate-half vectors take 8 consecutive j, interleaved vectors 4.
  const int per_item = kVec ? (rotate_half ? 8 : 4) : 1;
  const int items_per_head = half / per_item;
  const int items = items_per_head * args.heads;
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int head = item / items_per_head;
    const int j0 = (item % items_per_head) * per_item;
    __nv_bfloat16* v = token_base + static_cast<int64_t>(head) * args.head_stride;
    if constexpr (kVec) {
      if (rotate_half) {
        // a = v[j0 .. j0 + 8), b = v[half + j0 .. half + j0 + 8)
        uint4 raw_a = *reinterpret_cast<const uint4*>(v + j0);
        uint4 raw_b = *reinterpret_cast<const uint4*>(v + half + j0);
        __nv_bfloat16* a = reinterpret_cast<__nv_bfloat16*>(&raw_a);
        __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(&raw_b);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float ra, rb;
          rotate(__bfloat162float(a[i]), __bfloat162float(b[i]), cos_table[j0 + i],
                 sin_table[j0 + i], ra, rb);
          a[i] = __float2bfloat16_rn(ra);
          b[i] = __float2bfloat16_rn(rb);
        }
        *reinterpret_cast<uint4*>(v + j0) = raw_a;
        *reinterpret_cast<uint4*>(v + half + j0) = raw_b;
      } else {
        // v[2 j0 .. 2 j0 + 8) holds the pairs j0 .. j0 + 4, each (even, odd)
        uint4 raw = *reinterpret_cast<const uint4*>(v + 2 * j0);
        __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float ra, rb;
          rotate(__bfloat162float(e[2 * i]), __bfloat162float(e[2 * i + 1]), cos_table[j0 + i],
                 sin_table[j0 + i], ra, rb);
          e[2 * i] = __float2bfloat16_rn(ra);
          e[2 * i + 1] = __float2bfloat16_rn(rb);
        }
        *reinterpret_cast<uint4*>(v + 2 * j0) = raw;
      }
    } else {
      const int ia = rotate_half ? j0 : 2 * j0;
      const int ib = rotate_half ? j0 + half : 2 * j0 + 1;
      float ra, rb;
      rotate(__bfloat162float(v[ia]), __bfloat162float(v[ib]), cos_table[j0], sin_table[j0], ra,
             rb);
      v[ia] = __float2bfloat16_rn(ra);
      v[ib] = __float2bfloat16_rn(rb);
    }
  }
}

}  // namespace

void launch_rope(const RopeCudaArgs& args, cudaStream_t stream) {
  MOELORA_CHECK(args.tokens >= 0, ErrorCode::kInvalidArgument, "rope: tokens must be >= 0, got ",
                args.tokens);
  if (args.tokens == 0 || args.heads == 0) return;
  MOELORA_CHECK(args.x && args.positions && args.inv_freq, ErrorCode::kInvalidArgument,
                "rope: x, positions and inv_freq must be device pointers (got null)");
  MOELORA_CHECK(args.heads > 0, ErrorCode::kInvalidArgument, "rope: heads must be >= 0, got ",
                args.heads);
  MOELORA_CHECK(args.rotary_dim > 0 && args.rotary_dim % 2 == 0 && args.rotary_dim / 2 <= kMaxHalf,
                ErrorCode::kInvalidArgument, "rope: rotary_dim must be even, in [2, ", 2 * kMaxHalf,
                "], got ", args.rotary_dim);
  MOELORA_CHECK(args.dim_offset >= 0, ErrorCode::kInvalidArgument,
                "rope: dim_offset must be >= 0, got ", args.dim_offset);
  MOELORA_CHECK(args.head_stride >= args.dim_offset + args.rotary_dim || args.heads == 1,
                ErrorCode::kInvalidArgument, "rope: head_stride ", args.head_stride,
                " is smaller than the rotated range end ", args.dim_offset + args.rotary_dim);
  const int half = args.rotary_dim / 2;
  const bool rotate_half = args.style == RopeStyle::kRotateHalf;
  const bool vec = reinterpret_cast<uintptr_t>(args.x) % 16 == 0 && args.token_stride % 8 == 0 &&
                   args.head_stride % 8 == 0 && args.dim_offset % 8 == 0 &&
                   (rotate_half ? half % 8 == 0 : half % 4 == 0);
  if (vec) {
    rope_kernel<true><<<args.tokens, kRopeThreads, 0, stream>>>(args);
  } else {
    rope_kernel<false><<<args.tokens, kRopeThreads, 0, stream>>>(args);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
