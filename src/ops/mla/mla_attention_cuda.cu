// Absorbed MLA attention over the paged latent cache (mla_cuda.cuh): one KV head whose key is the
// whole cache row [c_kv | k_rope] (r + rope = 576 for Kimi) and whose value is its first r = 512
// columns, shared by all n query heads. The query rows of a sequence are its (token, head) pairs,
// row i = (token i / n, head i % n), which are also consecutive rows of q_full [T, n, r + rope]
// and o_lat [T, n, r], so heads and prefill tokens are handled alike: a CTA takes
// (sequence, 32 query rows, KV split) and reads every cache tile once for all its rows.
//
// Per 32-key tile (8 warps, tensor cores mma.sync m16n8k16 bf16 -> fp32):
//   S [32 rows, 32 keys] = Q [32, Dp] . K^T        one 16x8 block of S per warp, Dp / 16 k-steps
//   online softmax (8 threads per row), P in bf16   causal limit per row = its token's position
//   O [32, r] = alpha O + P [32, 32] . V [32, r]    warp w owns the n8 column blocks w, w + 8, ...
//                                                   (at most 8 blocks = 64 fp32 per thread for r
//                                                   512)
// Dp = r + rope rounded up to 16 (zero columns); keys past the range are zero rows (never read from
// the cache, so P = 0 never meets a stale NaN). The next tile is prefetched with cp.async while the
// current one is used (two buffers).
//
// Decode has few query rows, so the KV range is split over CTAs (flash-decoding): each split writes
// its normalized partial output and log-sum-exp (base 2) to the workspace and a combine kernel
// merges them. The number of splits comes from host capacities (max_tokens, max_kv_len) only, so a
// captured graph stays valid for any device-side counts within those bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda_utils.h"
#include "ops/mla/mla_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 32;  // query rows per CTA (two m16 blocks)
constexpr int kKeys = 32;  // cache rows per tile (four n8 blocks of S, two k16 steps of P.V)
constexpr int kScoreLd = kKeys + 1;  // fp32 row stride of S in shared memory
constexpr int kProbLd = kKeys + 8;   // bf16 row stride of P (conflict-free fragment loads)
constexpr int kMaxRank = 512;
constexpr int kMaxKeyDim = 640;                         // r + rope (Kimi / DeepSeek-V3: 576)
constexpr int kMaxValueBlocks = kMaxRank / 8 / kWarps;  // n8 output blocks per warp
// Split-KV: splits * max_tokens <= kSplitRowBudget bounds the workspace for every capacity.
constexpr int kMaxSplits = 32;
constexpr int kSplitRowBudget = 256;
constexpr int kMinKeysPerSplit = 64;

using bf16 = __nv_bfloat16;

struct AttentionKernelParams {
  const bf16* cache = nullptr;   // [num_pages, page_size, dim]
  const bf16* q_full = nullptr;  // [max_tokens, heads, dim]
  bf16* o_lat = nullptr;         // [max_tokens, heads, rank]
  float* partial_o = nullptr;    // [splits, max_tokens, heads, rank] (splits > 1)
  float* partial_lse = nullptr;  // [splits, max_tokens, heads] (base 2)
  AttentionBatch batch;
  int page_size = 0;
  int heads = 0;
  int rank = 0;
  int dim = 0;         // rank + rope
  int dim_padded = 0;  // dim rounded up to 16
  int splits = 1;
  float scale_log2 = 0.f;  // softmax scale * log2(e)
};

__device__ __forceinline__ int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;  // 0: nothing is read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ uint32_t load_u32(const bf16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Two bf16 of different rows packed as one mma operand register (low half = lower k index).
__device__ __forceinline__ uint32_t pack_u16(const bf16* lo, const bf16* hi) {
  const uint32_t l = *reinterpret_cast<const unsigned short*>(lo);
  const uint32_t h = *reinterpret_cast<const unsigned short*>(hi);
  return l | (h << 16);
}

// D += A . B, A 16x16 row-major, B 16x8 (k-major per column), fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Shared memory of one CTA, ld = dim_padded + 8 (bf16 elements; keeps fragment loads
// conflict-free and rows 16-byte aligned).
size_t attention_smem_bytes(int dim_padded) {
  const size_t ld = static_cast<size_t>(dim_padded) + 8;
  return (kRows + 2 * kKeys) * ld * sizeof(bf16) + kRows * kScoreLd * sizeof(float) +
         kRows * kProbLd * sizeof(bf16) + 4 * kRows * sizeof(float);
}

// grid (max_seqs, row groups of kRows, splits), kThreads threads, attention_smem_bytes.
__global__ void __launch_bounds__(kThreads) mla_attention_kernel(const AttentionKernelParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int ld = p.dim_padded + 8;
  bf16* q_s = reinterpret_cast<bf16*>(smem);                     // [kRows][ld]
  bf16* k_s = q_s + kRows * ld;                                  // [2][kKeys][ld]
  float* s_s = reinterpret_cast<float*>(k_s + 2 * kKeys * ld);   // [kRows][kScoreLd]
  bf16* p_s = reinterpret_cast<bf16*>(s_s + kRows * kScoreLd);   // [kRows][kProbLd]
  float* m_s = reinterpret_cast<float*>(p_s + kRows * kProbLd);  // [kRows] running max (log2)
  float* l_s = m_s + kRows;                                      // [kRows] running sum
  float* alpha_s = l_s + kRows;                                  // [kRows] rescale of this tile
  int* limit_s = reinterpret_cast<int*>(alpha_s + kRows);        // [kRows] key end per row

  const AttentionBatch& batch = p.batch;
  const int seq = blockIdx.x, group = blockIdx.y, split = blockIdx.z;
  const int q_len = batch.q_len[seq];
  const int rows_valid = q_len * p.heads;
  const int row0 = group * kRows;
  if (q_len <= 0 || row0 >= rows_valid) return;  // padding sequence or rows past this one's tokens
  const int kv_len = batch.kv_len[seq];
  const int q_start = batch.q_start[seq];
  const int first_pos = kv_len - q_len;  // position of the sequence's first new token
  const int rows_here = min(kRows, rows_valid - row0);
  // Keys visible to the CTA's last row bound the tiles it loads; each row masks its own limit.
  const int cta_end = min(kv_len, first_pos + (row0 + rows_here - 1) / p.heads + 1);
  const int per_split = ceil_div(ceil_div(max(kv_len, 0), p.splits), kKeys) * kKeys;
  const int key_begin = split * per_split;
  const int key_end = min(key_begin + per_split, cta_end);
  const int num_tiles = key_end > key_begin ? ceil_div(key_end - key_begin, kKeys) : 0;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group_id = lane >> 2, lane_in_group = lane & 3;  // mma fragment coordinates
  const int vecs_per_row = p.dim_padded / 8, real_vecs = p.dim / 8;
  const int64_t first_row =
      static_cast<int64_t>(q_start) * p.heads + row0;  // row of q_full / o_lat

  if (tid < kRows) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
    const int row_end = first_pos + (row0 + tid) / p.heads + 1;
    limit_s[tid] = tid < rows_here ? min(key_end, row_end) : key_begin;
  }

  // Q rows (zero past rows_here and past dim) and the first tile form the first cp.async group.
  for (int i = tid; i < kRows * vecs_per_row; i += kThreads) {
    const int row = i / vecs_per_row, vec = i % vecs_per_row;
    const bool valid = row < rows_here && vec < real_vecs;
    const bf16* src = valid ? p.q_full + (first_row + row) * p.dim + vec * 8 : p.q_full;
    cp_async_16(q_s + row * ld + vec * 8, src, valid);
  }
  auto load_tile = [&](int tile, int buffer) {
    const int key0 = key_begin + tile * kKeys;
    bf16* dst = k_s + buffer * kKeys * ld;
    for (int i = tid; i < kKeys * vecs_per_row; i += kThreads) {
      const int key_row = i / vecs_per_row, vec = i % vecs_per_row;
      const int key = key0 + key_row;
      const bf16* src = p.cache;
      bool valid = key < key_end && vec < real_vecs;
      if (valid) {
        const int page_index = key / p.page_size;
        valid = page_index < batch.max_pages_per_seq;
        const int page =
            valid
                ? batch.page_table[static_cast<int64_t>(seq) * batch.max_pages_per_seq + page_index]
                : -1;
        valid = page >= 0;
        if (valid)
          src = p.cache + (static_cast<int64_t>(page) * p.page_size + key % p.page_size) * p.dim +
                vec * 8;
      }
      cp_async_16(dst + key_row * ld + vec * 8, src, valid);
    }
  };
  if (num_tiles > 0) load_tile(0, 0);
  cp_async_commit();

  const int value_blocks = p.rank / 8;
  float o[2][kMaxValueBlocks][4];
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int j = 0; j < kMaxValueBlocks; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[mb][j][c] = 0.f;

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int buffer = tile & 1;
    __syncthreads();  // every warp is done with the previous tile (its buffer is refilled next)
    if (tile + 1 < num_tiles) load_tile(tile + 1, buffer ^ 1);
    cp_async_commit();   // possibly empty: keeps the group count uniform
    cp_async_wait<1>();  // this thread's copies of `tile` (and Q) have landed
    __syncthreads();     // ... and everyone else's
    const bf16* kt = k_s + buffer * kKeys * ld;

    // S = Q K^T: warp -> m block (warp / 4) x n block (warp % 4).
    {
      const int mb = warp >> 2, nb = warp & 3;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      const bf16* qa = q_s + (mb * 16 + group_id) * ld + 2 * lane_in_group;
      const bf16* kb = kt + (nb * 8 + group_id) * ld + 2 * lane_in_group;
      for (int k0 = 0; k0 < p.dim_padded; k0 += 16) {
        const uint32_t a[4] = {load_u32(qa + k0), load_u32(qa + 8 * ld + k0), load_u32(qa + k0 + 8),
                               load_u32(qa + 8 * ld + k0 + 8)};
        const uint32_t b[2] = {load_u32(kb + k0), load_u32(kb + k0 + 8)};
        mma_16816(acc, a, b);
      }
      float* s_row = s_s + (mb * 16 + group_id) * kScoreLd + nb * 8 + 2 * lane_in_group;
      s_row[0] = acc[0];
      s_row[1] = acc[1];
      s_row[8 * kScoreLd] = acc[2];
      s_row[8 * kScoreLd + 1] = acc[3];
    }
    __syncthreads();

    // Online softmax in base 2: 8 consecutive lanes own one row, 4 keys each.
    {
      const int row = tid >> 3, part = tid & 7;
      const int key0 = key_begin + tile * kKeys + part * 4;
      const int limit = limit_s[row];
      float s[4];
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[j] = key0 + j < limit ? s_s[row * kScoreLd + part * 4 + j] * p.scale_log2 : -INFINITY;
        tile_max = fmaxf(tile_max, s[j]);
      }
#pragma unroll
      for (int offset = 1; offset < 8; offset <<= 1)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      const float m_old = m_s[row];
      const float m_new = fmaxf(m_old, tile_max);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet: all p are 0
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float prob = exp2f(s[j] - m_use);
        p_s[row * kProbLd + part * 4 + j] = __float2bfloat16(prob);
        sum += prob;
      }
#pragma unroll
      for (int offset = 1; offset < 8; offset <<= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      __syncwarp();  // all lanes of the row read m_s / l_s before lane part 0 updates them
      if (part == 0) {
        const float alpha = exp2f(m_old - m_use);
        m_s[row] = m_new;
        l_s[row] = l_s[row] * alpha + sum;
        alpha_s[row] = alpha;
      }
    }
    __syncthreads();

    // O = alpha O + P V, V = the first r columns of the tile.
    {
      const float alpha[2][2] = {{alpha_s[group_id], alpha_s[group_id + 8]},
                                 {alpha_s[16 + group_id], alpha_s[24 + group_id]}};
#pragma unroll
      for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int j = 0; j < kMaxValueBlocks; ++j) {
          o[mb][j][0] *= alpha[mb][0];
          o[mb][j][1] *= alpha[mb][0];
          o[mb][j][2] *= alpha[mb][1];
          o[mb][j][3] *= alpha[mb][1];
        }
      uint32_t pa[2][2][4];  // [m block][k step] A fragments of P
#pragma unroll
      for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
          const bf16* base = p_s + (mb * 16 + group_id) * kProbLd + ks * 16 + 2 * lane_in_group;
          pa[mb][ks][0] = load_u32(base);
          pa[mb][ks][1] = load_u32(base + 8 * kProbLd);
          pa[mb][ks][2] = load_u32(base + 8);
          pa[mb][ks][3] = load_u32(base + 8 * kProbLd + 8);
        }
#pragma unroll
      for (int j = 0; j < kMaxValueBlocks; ++j) {
        const int vb = warp + j * kWarps;
        if (vb < value_blocks) {
#pragma unroll
          for (int ks = 0; ks < 2; ++ks) {
            // B[k = key][n = column]: keys 2 lane_in_group, + 1 (and the same + 8) of column
            // vb * 8 + group_id, two rows apart in shared memory.
            const bf16* v = kt + (ks * 16 + 2 * lane_in_group) * ld + vb * 8 + group_id;
            const uint32_t b[2] = {pack_u16(v, v + ld), pack_u16(v + 8 * ld, v + 9 * ld)};
            mma_16816(o[0][j], pa[0][ks], b);
            mma_16816(o[1][j], pa[1][ks], b);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing may stay in flight (num_tiles == 0 leaves the Q group pending)
  __syncthreads();     // m_s / l_s final (and initialized when there was no tile)

  // Accumulator c of block (mb, j) sits at row mb * 16 + group_id (+ 8 for c >= 2), column
  // vb * 8 + 2 lane_in_group (+ 1 for odd c).
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = mb * 16 + half * 8 + group_id;
      if (row >= rows_here) continue;
      const float l = l_s[row];
      const float inv_l = l > 0.f ? 1.f / l : 0.f;
      const int64_t out_row = first_row + row;
#pragma unroll
      for (int j = 0; j < kMaxValueBlocks; ++j) {
        const int vb = warp + j * kWarps;
        if (vb >= value_blocks) continue;
        const int col = vb * 8 + 2 * lane_in_group;
        const float v0 = o[mb][j][2 * half] * inv_l, v1 = o[mb][j][2 * half + 1] * inv_l;
        if (p.splits == 1) {
          *reinterpret_cast<__nv_bfloat162*>(p.o_lat + out_row * p.rank + col) =
              __floats2bfloat162_rn(v0, v1);
        } else {
          const int64_t part_row =
              static_cast<int64_t>(split) * batch.max_tokens * p.heads + out_row;
          *reinterpret_cast<float2*>(p.partial_o + part_row * p.rank + col) = make_float2(v0, v1);
        }
      }
    }
  if (p.splits > 1 && tid < rows_here) {
    const float l = l_s[tid];
    const int64_t part_row =
        static_cast<int64_t>(split) * batch.max_tokens * p.heads + first_row + tid;
    p.partial_lse[part_row] = l > 0.f ? m_s[tid] + log2f(l) : -INFINITY;
  }
}

// Merges the splits' partials: o = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).
// grid (max_seqs, row groups of kRows), kThreads threads; warp = one row at a time.
__global__ void __launch_bounds__(kThreads)
    mla_attention_combine_kernel(const AttentionKernelParams p) {
  __shared__ float weight_s[kWarps][kMaxSplits];
  const AttentionBatch& batch = p.batch;
  const int seq = blockIdx.x, group = blockIdx.y;
  const int q_len = batch.q_len[seq];
  const int rows_valid = q_len * p.heads;
  const int row0 = group * kRows;
  if (q_len <= 0 || row0 >= rows_valid) return;
  const int rows_here = min(kRows, rows_valid - row0);
  const int64_t first_row = static_cast<int64_t>(batch.q_start[seq]) * p.heads + row0;
  const int64_t split_stride = static_cast<int64_t>(batch.max_tokens) * p.heads;  // rows per split
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int row = warp; row < rows_here; row += kWarps) {
    const int64_t out_row = first_row + row;
    const float lse = lane < p.splits ? p.partial_lse[lane * split_stride + out_row] : -INFINITY;
    float max_lse = lse;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
    const float w = (lse == -INFINITY) ? 0.f : exp2f(lse - max_lse);
    float total = w;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      total += __shfl_xor_sync(0xffffffffu, total, offset);
    weight_s[warp][lane] = total > 0.f ? w / total : 0.f;
    __syncwarp();
    for (int col = lane * 4; col < p.rank; col += 128) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s = 0; s < p.splits; ++s) {
        const float ws = weight_s[warp][s];
        if (ws == 0.f) continue;  // empty split: its partial output is 0 but skip the read anyway
        const float4 v = *reinterpret_cast<const float4*>(
            p.partial_o + (s * split_stride + out_row) * p.rank + col);
        acc.x += ws * v.x;
        acc.y += ws * v.y;
        acc.z += ws * v.z;
        acc.w += ws * v.w;
      }
      __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(p.o_lat + out_row * p.rank + col);
      dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
      dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
    }
    __syncwarp();  // weight_s of this row is read before the next row overwrites it
  }
}

int split_capacity(int max_tokens) {
  return std::clamp(kSplitRowBudget / std::max(1, max_tokens), 1, kMaxSplits);
}

int num_splits(const AttentionBatch& batch) {
  const int wanted = (std::max(batch.max_kv_len, 1) + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
  return std::clamp(wanted, 1, split_capacity(batch.max_tokens));
}

size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// Workspace: partial outputs [kSplitRowBudget, n, r] fp32, then log-sum-exps [kSplitRowBudget, n].
size_t partial_o_bytes(const MlaShape& shape) {
  return align256(static_cast<size_t>(kSplitRowBudget) * shape.num_heads * shape.rank *
                  sizeof(float));
}

void check_shape(const MlaShape& shape, const char* what) {
  MOELORA_CHECK(shape.num_heads > 0 && shape.nope > 0 && shape.rope >= 0 && shape.v_dim > 0,
                ErrorCode::kInvalidArgument, what, ": MLA shape num_heads ", shape.num_heads,
                ", nope ", shape.nope, ", rope ", shape.rope, ", v_dim ", shape.v_dim,
                " (num_heads, nope, v_dim > 0, rope >= 0)");
  MOELORA_CHECK(shape.rank > 0 && shape.rank % 8 == 0 && shape.rank <= kMaxRank,
                ErrorCode::kUnsupported, what, ": kv_lora_rank ", shape.rank,
                " unsupported; must be a multiple of 8 in [8, ", kMaxRank, "]");
  MOELORA_CHECK((shape.rank + shape.rope) % 8 == 0 && shape.rank + shape.rope <= kMaxKeyDim,
                ErrorCode::kUnsupported, what,
                ": cache row width kv_lora_rank + rope = ", shape.rank + shape.rope,
                " unsupported; must be a multiple of 8 and at most ", kMaxKeyDim);
}

}  // namespace

size_t mla_attention_workspace_bytes(const MlaShape& shape, int max_tokens, int max_seqs) {
  // The split count depends on the batch's capacities, but splits * max_tokens never exceeds
  // kSplitRowBudget, so one size fits every batch (a workspace sized for prefill also serves the
  // decode buckets). max_seqs does not matter: partials are indexed by token row.
  (void)max_seqs;
  check_shape(shape, "mla_attention_workspace_bytes");
  if (max_tokens <= 0) return 0;
  return partial_o_bytes(shape) +
         align256(static_cast<size_t>(kSplitRowBudget) * shape.num_heads * sizeof(float));
}

void launch_mla_attention(const MlaAttentionArgs& args, cudaStream_t stream) {
  const MlaShape& shape = args.shape;
  const AttentionBatch& batch = args.batch;
  check_shape(shape, "launch_mla_attention");
  MOELORA_CHECK(args.cache.kv && args.q_full && args.o_lat, ErrorCode::kInvalidArgument,
                "launch_mla_attention: cache.kv, q_full and o_lat are required");
  MOELORA_CHECK(batch.page_table && batch.q_start && batch.q_len && batch.kv_len,
                ErrorCode::kInvalidArgument,
                "launch_mla_attention: batch page_table, q_start, q_len and kv_len are required");
  MOELORA_CHECK(args.cache.page_size > 0 && batch.max_pages_per_seq > 0,
                ErrorCode::kInvalidArgument, "launch_mla_attention: page_size ",
                args.cache.page_size, " and max_pages_per_seq ", batch.max_pages_per_seq,
                " must be > 0");
  MOELORA_CHECK(
      batch.max_seqs >= 0 && batch.max_tokens >= 0 && batch.max_q_len >= 0 && batch.max_kv_len >= 0,
      ErrorCode::kInvalidArgument, "launch_mla_attention: negative capacity (max_seqs ",
      batch.max_seqs, ", max_tokens ", batch.max_tokens, ", max_q_len ", batch.max_q_len,
      ", max_kv_len ", batch.max_kv_len, ")");
  const auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  MOELORA_CHECK(aligned16(args.cache.kv) && aligned16(args.q_full) && aligned16(args.workspace),
                ErrorCode::kInvalidArgument,
                "launch_mla_attention: cache.kv, q_full and workspace must be 16-byte aligned");
  MOELORA_CHECK(args.scale >= 0.f && std::isfinite(args.scale), ErrorCode::kInvalidArgument,
                "launch_mla_attention: scale must be finite and >= 0 (0 = qk_head_dim^-0.5), got ",
                args.scale);
  if (batch.max_seqs == 0 || batch.max_tokens == 0 || batch.max_q_len == 0) return;

  const int64_t row_groups =
      (static_cast<int64_t>(batch.max_q_len) * shape.num_heads + kRows - 1) / kRows;
  MOELORA_CHECK(row_groups <= 65535, ErrorCode::kUnsupported, "launch_mla_attention: max_q_len ",
                batch.max_q_len, " x ", shape.num_heads, " heads needs ", row_groups,
                " row groups of ", kRows, "; at most 65535 are supported");
  const int splits = num_splits(batch);
  MOELORA_CHECK(splits == 1 || args.workspace, ErrorCode::kInvalidArgument,
                "launch_mla_attention: ", splits,
                " KV splits need the workspace (mla_attention_workspace_bytes)");

  AttentionKernelParams p;
  p.cache = args.cache.kv;
  p.q_full = args.q_full;
  p.o_lat = args.o_lat;
  if (splits > 1) {
    p.partial_o = static_cast<float*>(args.workspace);
    p.partial_lse =
        reinterpret_cast<float*>(static_cast<char*>(args.workspace) + partial_o_bytes(shape));
  }
  p.batch = batch;
  p.page_size = args.cache.page_size;
  p.heads = shape.num_heads;
  p.rank = shape.rank;
  p.dim = shape.rank + shape.rope;
  p.dim_padded = (p.dim + 15) / 16 * 16;
  p.splits = splits;
  const float scale =
      args.scale > 0.f ? args.scale : 1.0f / std::sqrt(static_cast<float>(shape.nope + shape.rope));
  p.scale_log2 = scale * 1.4426950408889634f;

  const size_t smem = attention_smem_bytes(p.dim_padded);
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(
      mla_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(batch.max_seqs, static_cast<unsigned>(row_groups), splits);
  mla_attention_kernel<<<grid, kThreads, smem, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
  if (splits > 1) {
    mla_attention_combine_kernel<<<dim3(batch.max_seqs, static_cast<unsigned>(row_groups)),
                                   kThreads, 0, stream>>>(p);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moelora::ops::cuda
