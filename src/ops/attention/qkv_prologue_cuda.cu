// GQA attention input stage in one kernel (see qkv_prologue_cuda.cuh). The arithmetic repeats
// that of the per-head RMSNorm kernel it replaced and of rope_kernel (rope_cuda.cu) expression for
// expression.
#include <cstdint>

#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/attention/qkv_prologue_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kWarps = 4;  // heads per CTA
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxHalf = kMaxHeadDim / 2;

// x, or bf16(x + delta) when the row has a delta (add_rows' rounding).
__device__ __forceinline__ __nv_bfloat16 with_delta(const __nv_bfloat16* x,
                                                    const __nv_bfloat16* delta, int64_t i) {
  return delta ? __float2bfloat16_rn(__bfloat162float(x[i]) + __bfloat162float(delta[i])) : x[i];
}

// Grid (ceil((q_heads + kv_heads) / kWarps), rows): one warp per head of one row, so a decode
// batch of 16 rows of Qwen3 (36 heads) runs 144 CTAs instead of 16 that would each walk 36 heads
// (latency-bound: 8.6 us per layer measured on the H200 with one CTA per row). CTAs of column 0
// also copy the row's v heads to the cache. kDelta: p.delta is given (an instance apart, so the
// base path keeps its loads and latency).
template <bool kDelta>
__global__ void __launch_bounds__(kThreads) qkv_prologue_kernel(const QkvPrologueArgs p) {
  __shared__ float cos_table[kMaxHalf];
  __shared__ float sin_table[kMaxHalf];
  __shared__ __nv_bfloat16 head_buffer[kWarps][kMaxHeadDim];
  // The attention launched programmatically after this kernel (FlashInferAttentionShape::
  // programmatic_launch) may be scheduled at once: it reads q and the cache only after its
  // griddepcontrol.wait, which waits for this whole grid. No effect on a plain launch after it.
  ::moelora::cuda::sm90::launch_dependents();
  const int row = blockIdx.y;
  if (row >= *p.num_tokens) return;  // uniform over the CTA
  const int D = p.cache.head_dim, Hkv = p.cache.num_kv_heads;
  const int half = p.rotary_dim / 2;
  const int pos = p.batch.token_pos[row];
  const float fpos = static_cast<float>(pos);
  for (int j = threadIdx.x; j < half; j += kThreads) {
    const float angle = fpos * p.inv_freq[j];
    cos_table[j] = cosf(angle) * p.attention_factor;
    sin_table[j] = sinf(angle) * p.attention_factor;
  }

  // The row's cache slot, or -1 when it is not appended.
  int64_t slot = -1;
  const int seq = p.batch.token_seq[row];
  if (seq >= 0 && seq < p.batch.max_seqs && pos >= 0) {
    const int page_index = pos / p.cache.page_size;
    if (page_index < p.batch.max_pages_per_seq) {
      const int page =
          p.batch.page_table[static_cast<int64_t>(seq) * p.batch.max_pages_per_seq + page_index];
      if (page >= 0)
        slot = static_cast<int64_t>(page) * p.cache.page_size + pos % p.cache.page_size;
    }
  }
  __nv_bfloat16* row_base = p.qkv + static_cast<int64_t>(row) * p.row_stride;
  const __nv_bfloat16* row_delta = kDelta && p.delta_slot[row] >= 0
                                       ? p.delta + static_cast<int64_t>(row) * p.row_stride
                                       : nullptr;
  if (blockIdx.x == 0) {  // v: a plain copy (its delta added); the other columns' delta in place
    const int Dv = p.cache.v_head_dim;
    const int64_t v_width = static_cast<int64_t>(Hkv) * Dv;
    __nv_bfloat16* v = row_base + p.v_offset;
    const __nv_bfloat16* dv = row_delta ? row_delta + p.v_offset : nullptr;
    __nv_bfloat16* cache_v = slot >= 0 ? p.cache.v + slot * v_width : nullptr;
    if (dv || cache_v) {
      for (int64_t i = threadIdx.x; i < v_width; i += kThreads) {
        const __nv_bfloat16 value = with_delta(v, dv, i);
        if (dv) v[i] = value;
        if (cache_v) cache_v[i] = value;
      }
    }
  }
  if (row_delta) {
    // Columns outside the q, k and v heads (Qwen3.5's gate block, a tail): every CTA of the row
    // adds a share, 8 columns (16 bytes) at a time; the launcher checks the alignment.
    const int64_t kv_width = static_cast<int64_t>(Hkv) * D;
    const int64_t ranges[3][2] = {{static_cast<int64_t>(p.q_heads) * D, p.k_offset},
                                  {p.k_offset + kv_width, p.v_offset},
                                  {p.v_offset + kv_width, p.row_stride}};
    const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * 8,
                  stride = static_cast<int64_t>(gridDim.x) * kThreads * 8;
    for (const auto& range : ranges) {
      for (int64_t c = range[0] + first; c < range[1]; c += stride) {
        uint4 x = *reinterpret_cast<const uint4*>(row_base + c);
        const uint4 d = *reinterpret_cast<const uint4*>(row_delta + c);
        __nv_bfloat162* xv = reinterpret_cast<__nv_bfloat162*>(&x);
        const __nv_bfloat162* dv = reinterpret_cast<const __nv_bfloat162*>(&d);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 a = __bfloat1622float2(xv[i]), b = __bfloat1622float2(dv[i]);
          xv[i] = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
        }
        *reinterpret_cast<uint4*>(row_base + c) = x;
      }
    }
  }
  __syncthreads();  // the cos / sin table

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.x * kWarps + warp;
  if (h >= p.q_heads + Hkv) return;
  __nv_bfloat16* buffer = head_buffer[warp];
  const bool is_k = h >= p.q_heads;
  const int head = is_k ? h - p.q_heads : h;
  const int64_t head_column = (is_k ? p.k_offset : 0) + static_cast<int64_t>(head) * D;
  __nv_bfloat16* x = row_base + head_column;
  const __nv_bfloat16* dx = row_delta ? row_delta + head_column : nullptr;
  const __nv_bfloat16* weight = is_k ? p.k_norm : p.q_norm;
  if (weight != nullptr) {  // head_rms_norm's arithmetic: lane-strided squares, a butterfly sum
    float sum = 0.0f;
    for (int d = lane; d < D; d += 32) {
      const float v = __bfloat162float(with_delta(x, dx, d));
      sum += v * v;
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const float inv_rms = 1.0f / sqrtf(sum / static_cast<float>(D) + p.eps);
    for (int d = lane; d < D; d += 32) {
      const float w = __bfloat162float(weight[d]);
      const float v = __bfloat162float(with_delta(x, dx, d)) * inv_rms;
      buffer[d] =
          __float2bfloat16(p.norm_style == NormStyle::kOnePlusWeight ? v * (1.0f + w) : w * v);
    }
  } else {
    for (int d = lane; d < D; d += 32) buffer[d] = with_delta(x, dx, d);
  }
  __syncwarp();
  const bool rotate_half = p.rope_style == RopeStyle::kRotateHalf;
  for (int j = lane; j < half; j += 32) {  // rope_kernel's arithmetic, one pair per lane
    const int ia = rotate_half ? j : 2 * j;
    const int ib = rotate_half ? j + half : 2 * j + 1;
    const float a = __bfloat162float(buffer[ia]), b = __bfloat162float(buffer[ib]);
    const float c = cos_table[j], s = sin_table[j];
    const float ra = a * c - b * s;
    const float rb = b * c + a * s;
    buffer[ia] = __float2bfloat16_rn(ra);
    buffer[ib] = __float2bfloat16_rn(rb);
  }
  __syncwarp();
  __nv_bfloat16* cache_row =
      is_k && slot >= 0 ? p.cache.k + (slot * Hkv + head) * static_cast<int64_t>(D) : nullptr;
  for (int d = lane; d < D; d += 32) {
    x[d] = buffer[d];
    if (cache_row != nullptr) cache_row[d] = buffer[d];
  }
}

}  // namespace

void launch_qkv_prologue(const QkvPrologueArgs& p, cudaStream_t stream) {
  const auto bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(
      p.qkv != nullptr && p.num_tokens != nullptr && p.inv_freq != nullptr, bad,
      "launch_qkv_prologue: qkv, num_tokens and inv_freq must be device pointers (got null)");
  MOELORA_CHECK(p.cache.k != nullptr && p.cache.v != nullptr, bad,
                "launch_qkv_prologue: the paged KV cache has a null K or V pointer");
  MOELORA_CHECK(
      p.batch.token_seq != nullptr && p.batch.token_pos != nullptr && p.batch.page_table != nullptr,
      bad, "launch_qkv_prologue: batch.token_seq, token_pos and page_table are required");
  const int D = p.cache.head_dim, Hkv = p.cache.num_kv_heads;
  MOELORA_CHECK(D > 0 && D <= kMaxHeadDim && p.cache.v_head_dim == D, bad,
                "launch_qkv_prologue: head_dim ", D, " and v_head_dim ", p.cache.v_head_dim,
                " must be equal and in [1, ", kMaxHeadDim, "]");
  MOELORA_CHECK(p.q_heads > 0 && Hkv > 0, bad, "launch_qkv_prologue: q_heads ", p.q_heads,
                " and cache.num_kv_heads ", Hkv, " must be > 0");
  MOELORA_CHECK(p.cache.page_size > 0 && p.batch.max_pages_per_seq > 0, bad,
                "launch_qkv_prologue: cache.page_size ", p.cache.page_size,
                " and batch.max_pages_per_seq ", p.batch.max_pages_per_seq, " must be > 0");
  MOELORA_CHECK(p.rotary_dim > 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= D, bad,
                "launch_qkv_prologue: rotary_dim must be even and in [2, head_dim = ", D, "], got ",
                p.rotary_dim);
  MOELORA_CHECK((p.q_norm == nullptr) == (p.k_norm == nullptr), bad,
                "launch_qkv_prologue: q_norm and k_norm are given together or not at all");
  MOELORA_CHECK(p.delta == nullptr ||
                    (p.row_stride % 8 == 0 && p.k_offset % 8 == 0 && p.v_offset % 8 == 0 &&
                     p.cache.head_dim % 8 == 0 && reinterpret_cast<uintptr_t>(p.qkv) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(p.delta) % 16 == 0),
                bad, "launch_qkv_prologue: with a delta, row_stride (", p.row_stride,
                "), k_offset (", p.k_offset, "), v_offset (", p.v_offset, ") and head_dim (",
                p.cache.head_dim,
                ") must be multiples of 8 and qkv and delta 16-byte aligned (the columns outside "
                "the heads are added 8 at a time)");
  MOELORA_CHECK((p.delta == nullptr) == (p.delta_slot == nullptr), bad,
                "launch_qkv_prologue: delta and delta_slot are given together or not at all (got "
                "delta ",
                p.delta != nullptr, ", delta_slot ", p.delta_slot != nullptr, ")");
  const int64_t q_width = static_cast<int64_t>(p.q_heads) * D,
                kv_width = static_cast<int64_t>(Hkv) * D;
  MOELORA_CHECK(p.k_offset >= q_width && p.v_offset >= p.k_offset + kv_width &&
                    p.row_stride >= p.v_offset + kv_width,
                bad, "launch_qkv_prologue: the row layout q [0, ", q_width, "), k [", p.k_offset,
                ", ", p.k_offset + kv_width, "), v [", p.v_offset, ", ", p.v_offset + kv_width,
                ") does not fit in order in row_stride ", p.row_stride);
  if (p.batch.max_tokens <= 0) return;
  MOELORA_CHECK(p.batch.max_tokens <= 65535, bad, "launch_qkv_prologue: batch.max_tokens ",
                p.batch.max_tokens, " exceeds the grid's 65535 rows");
  const dim3 grid((p.q_heads + Hkv + kWarps - 1) / kWarps, p.batch.max_tokens);
  if (p.delta)
    qkv_prologue_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  else
    qkv_prologue_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
