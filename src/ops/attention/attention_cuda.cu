// Paged causal GQA attention on the GPU (see attention_cuda.cuh for the layouts, attention.h for
// the math): the KV append and one FlashAttention-2 style kernel family for prefill and decode.
//
// Rows of a CTA tile are (token, query head) pairs of ONE sequence and ONE KV head: row
// r = token_in_sequence * G + g with G = Hq / Hkv, so a tile of K/V read from the cache serves all
// G query heads that share it. A warp owns 16 rows (one m16 tile of mma.sync m16n8k16, bf16 in,
// fp32 accumulate) and a slice of every 64-key tile:
//   prefill config: 4 row warps x 1 key warp  -> 64 rows x 64 keys, grid over row blocks;
//   decode config:  1 row warp  x 4 key warps -> the G heads of one token (padded to 16) and each
//                   warp a 16-key quarter of the tile, grid over KV splits (flash-decoding).
// K/V tiles are gathered through the page table with cp.async (16-byte chunks, zero-filled past
// the last needed key) into a two-stage shared-memory ring. Softmax is online in fp32 in the
// log2 domain (scale * log2(e) folded into the exponents, ex2.approx: ops/attention/online_softmax.cuh), with the probabilities rounded
// to bf16 for the P.V product. The causal mask is applied only to tiles that reach past the
// first row's position (the diagonal tiles).
//
// Epilogue: every warp parks its (max, sum, unnormalized acc) rows in shared memory; the CTA
// merges its key warps and either writes bf16 rows of `out` (one split) or fp32 partials to the
// workspace, which attention_combine_kernel merges over the splits (decode only).
//
// Head dims other than D = Dv = 64 or 128 (any multiple of 8 up to 256: the tiny parity models)
// take attention_generic_kernel: one warp per (row, query head), scalar fp32, slow but simple.
//
// Graph capture: grids depend only on capacities and host bounds (max_seqs, max_q_len,
// max_kv_len); per-step counts are read on the device, and CTAs without work exit at once.
#include "ops/attention/attention_cuda.cuh"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/cuda_utils.h"
#include "core/error.h"
#include "core/mma_ptx.cuh"
#include "ops/attention/online_softmax.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kTileKeys = 64;  // keys per K/V tile (one cp.async stage)
constexpr int kThreads = 128;  // 4 warps in every tensor-core config
constexpr int kSmemPad = 8;    // bf16 elements of padding per shared row (bank spread)
constexpr int kMinKeysPerSplit = 256;
constexpr int kMaxSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;

// Split capacity for a workspace sized for `max_seqs` decode sequences: many splits for a few
// sequences (long-context single-user decode), at least 8 for large batches.
int split_capacity(int max_seqs) {
  return std::clamp(512 / std::max(max_seqs, 1), 8, kMaxSplits);
}

// Keys per split for a sequence of kv_len keys and `splits` splits: a whole number of tiles so a
// tile never straddles two splits. Split s covers [s * chunk, min(kv_len, (s + 1) * chunk)).
__host__ __device__ inline int split_chunk(int kv_len, int splits) {
  const int per_split = (kv_len + splits - 1) / splits;
  return (per_split + kTileKeys - 1) / kTileKeys * kTileKeys;
}

// PTX wrappers: src/core/mma_ptx.cuh.
using namespace ::moelora::cuda::ptx;


// ---- kernel arguments ----------------------------------------------------------------------

struct KernelArgs {
  PagedKv cache;
  AttentionBatch batch;
  const __nv_bfloat16* q;
  int64_t q_stride;
  int num_q_heads;
  int group;           // G = Hq / Hkv
  float scale_log2;    // softmax scale * log2(e)
  __nv_bfloat16* out;  // [T, Hq, Dv]
  int num_splits;      // 1: write `out`; > 1: write partials
  float* part_acc;     // [max_seqs, Hq, num_splits, Dv] unnormalized, relative to part_max
  float* part_max;     // [max_seqs, Hq, num_splits] running max (log2 domain)
  float* part_sum;     // [max_seqs, Hq, num_splits]
};

// ---- tensor-core kernel --------------------------------------------------------------------

template <int D, int Dv, int kRowWarps, int kKeyWarps>
struct TcConfig {
  static constexpr int kRows = 16 * kRowWarps;                // rows of a CTA
  static constexpr int kKeysPerWarp = kTileKeys / kKeyWarps;  // keys of a tile per warp
  static constexpr int kKStride = D + kSmemPad;               // shared K row (elements)
  static constexpr int kVStride = Dv + kSmemPad;
  static constexpr int kStageElems = kTileKeys * (kKStride + kVStride);
  static constexpr int kStageBytes = kStageElems * 2;
  static constexpr int kEpilogueBytes = kKeyWarps * kRows * (Dv + 2) * 4;
  static constexpr int kSmemBytes = std::max(2 * kStageBytes, kEpilogueBytes);
  static_assert(kRowWarps * kKeyWarps * 32 == kThreads, "4 warps per CTA");
  static_assert(kKeysPerWarp % 16 == 0, "a warp's key slice is whole k16 steps");
  static_assert(D % 16 == 0 && Dv % 16 == 0, "tensor-core head dims are multiples of 16");
};

// Grid: x = row block (kDecode: KV split), y = KV head * row blocks per head (kDecode) or KV
// head, z = batch sequence. Decode CTAs serve sequences with q_len == 1, prefill CTAs q_len >= 2.
template <int D, int Dv, int kRowWarps, int kKeyWarps, bool kDecode>
__global__ void __launch_bounds__(kThreads) paged_attention_tc_kernel(const KernelArgs p) {
  using Cfg = TcConfig<D, Dv, kRowWarps, kKeyWarps>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);

  const int seq = blockIdx.z;
  const int q_len = p.batch.q_len[seq];
  const int kv_len = p.batch.kv_len[seq];
  if (kDecode ? q_len != 1 : q_len < 2) return;
  if (kv_len < q_len) return;  // inconsistent metadata: leave the rows alone

  const int G = p.group;
  const int num_rows = q_len * G;
  int kv_head, row_begin, split;
  if constexpr (kDecode) {
    const int row_blocks = (G + Cfg::kRows - 1) / Cfg::kRows;
    kv_head = blockIdx.y / row_blocks;
    row_begin = (blockIdx.y % row_blocks) * Cfg::kRows;
    split = blockIdx.x;
  } else {
    kv_head = blockIdx.y;
    row_begin = (gridDim.x - 1 - blockIdx.x) * Cfg::kRows;  // heaviest (last) row blocks first
    split = 0;
  }
  if (row_begin >= num_rows) return;
  const int row_end = min(row_begin + Cfg::kRows, num_rows);
  const int first_pos = kv_len - q_len;  // position of token 0
  const int cta_min_pos = first_pos + row_begin / G;
  const int cta_max_pos = first_pos + (row_end - 1) / G;

  // Keys of this CTA: the split's range, cut at the last row's position (causal).
  int key_begin = 0, key_end = cta_max_pos + 1;
  if (p.num_splits > 1) {
    const int chunk = split_chunk(kv_len, p.num_splits);
    key_begin = split * chunk;
    key_end = min(key_end, key_begin + chunk);
  }
  if (key_begin >= key_end) return;  // empty split (shorter context than the capacity)
  const int num_tiles = (key_end - key_begin + kTileKeys - 1) / kTileKeys;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_warp = warp % kRowWarps, key_warp = warp / kRowWarps;
  const int gid = lane / 4, tig = lane % 4;  // mma fragment coordinates (group, thread in group)
  const int q_start = p.batch.q_start[seq];
  const int Hkv = p.cache.num_kv_heads, page_size = p.cache.page_size;

  // This thread's two rows: warp rows gid and gid + 8. Padding rows (past num_rows) get a zero
  // query and the last position, so they stay finite; their results are never stored.
  int row_pos[2];
  uint32_t q_frag[D / 16][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row_begin + row_warp * 16 + gid + half * 8;
    const bool valid = r < row_end;
    row_pos[half] = valid ? first_pos + r / G : cta_max_pos;
    const __nv_bfloat16* q_row =
        p.q + (static_cast<int64_t>(q_start + (valid ? r / G : 0))) * p.q_stride +
        static_cast<int64_t>(kv_head * G + (valid ? r % G : 0)) * D;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      // A fragment: regs 0/1 = rows gid/gid+8 at cols 2*tig, regs 2/3 the same at cols + 8.
      q_frag[ks][half] = valid ? *reinterpret_cast<const uint32_t*>(q_row + ks * 16 + 2 * tig) : 0u;
      q_frag[ks][half + 2] =
          valid ? *reinterpret_cast<const uint32_t*>(q_row + ks * 16 + 8 + 2 * tig) : 0u;
    }
  }

  // Issues the cp.async copies of tile `tile` into stage `stage`: K [64, D] then V [64, Dv].
  const int32_t* page_row =
      p.batch.page_table + static_cast<int64_t>(seq) * p.batch.max_pages_per_seq;
  auto load_tile = [&](int tile, int stage) {
    __nv_bfloat16* ks = smem + stage * Cfg::kStageElems;
    __nv_bfloat16* vs = ks + kTileKeys * Cfg::kKStride;
    const int tile_key0 = key_begin + tile * kTileKeys;
    constexpr int kKChunks = D / 8, kVChunks = Dv / 8;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < kTileKeys * (kKChunks + kVChunks); c += kThreads) {
      const bool is_k = c < kTileKeys * kKChunks;
      const int cc = is_k ? c : c - kTileKeys * kKChunks;
      const int chunks = is_k ? kKChunks : kVChunks;
      const int key = cc / chunks, col = (cc % chunks) * 8;
      const int pos = tile_key0 + key;
      int64_t slot = -1;  // cache row of `pos`, -1 = zero fill
      if (pos < key_end) {
        const int page_index = pos / page_size;
        const int page = page_index < p.batch.max_pages_per_seq ? page_row[page_index] : -1;
        if (page >= 0) slot = static_cast<int64_t>(page) * page_size + pos % page_size;
      }
      const __nv_bfloat16* src;
      uint32_t dst;
      if (is_k) {
        src = p.cache.k + (slot >= 0 ? (slot * Hkv + kv_head) * D + col : 0);
        dst = smem_addr(ks + key * Cfg::kKStride + col);
      } else {
        src = p.cache.v + (slot >= 0 ? (slot * Hkv + kv_head) * Dv + col : 0);
        dst = smem_addr(vs + key * Cfg::kVStride + col);
      }
      cp_async_16(dst, src, slot >= 0 ? 16 : 0);
    }
  };

  constexpr int kScoreTiles = Cfg::kKeysPerWarp / 8;  // n8 tiles of S per warp
  constexpr int kOutTiles = Dv / 8;                   // n8 tiles of O
  float acc[kOutTiles][4];
#pragma unroll
  for (int i = 0; i < kOutTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 domain
  float row_sum[2] = {0.f, 0.f};              // this thread's share; reduced in the epilogue

  load_tile(0, 0);
  cp_async_commit();
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) {
      load_tile(tile + 1, (tile + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const __nv_bfloat16* ks = smem + (tile & 1) * Cfg::kStageElems;
    const __nv_bfloat16* vs = ks + kTileKeys * Cfg::kKStride;
    const int warp_key0 = key_warp * Cfg::kKeysPerWarp;  // within the tile
    const int tile_key0 = key_begin + tile * kTileKeys;

    // S = Q K^T for this warp's 16 rows x kKeysPerWarp keys.
    float s[kScoreTiles][4];
#pragma unroll
    for (int nt = 0; nt < kScoreTiles; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const __nv_bfloat16* k_row = ks + (warp_key0 + nt * 8 + gid) * Cfg::kKStride + 2 * tig;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        // B fragment (k = dims, n = keys): key gid, dims 2*tig (+1) and 2*tig + 8 (+1).
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(k_row + kk * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(k_row + kk * 16 + 8);
        mma_bf16_16816(s[nt], q_frag[kk], b0, b1);
      }
    }

    // Mask keys after a row's position on diagonal tiles (this also masks the zero-filled keys
    // past key_end, since every row's position is < key_end there); the scale is applied by the
    // softmax step.
    if (tile_key0 + kTileKeys - 1 > cta_min_pos) {
#pragma unroll
      for (int nt = 0; nt < kScoreTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (tile_key0 + warp_key0 + nt * 8 + 2 * tig + (e & 1) > row_pos[e / 2])
            s[nt][e] = -INFINITY;
    }

    // Online softmax: each row is spread over the 4 threads of a group (lanes 4*gid .. +3).
    online_softmax_step(s, acc, row_max, row_sum, p.scale_log2);

    // O += P V over this warp's keys, all Dv dims.
    accumulate_pv<Cfg::kKeysPerWarp / 16, Dv / 16>(s, acc, vs + warp_key0 * Cfg::kVStride,
                                                  Cfg::kVStride, lane);
    __syncthreads();  // the stage is refilled by the next iteration's prefetch
  }

  // ---- epilogue: park per-warp rows, merge key warps, store --------------------------------
  // Shared (reusing the K/V ring): acc [kKeyWarps][kRows][Dv], max / sum [kKeyWarps][kRows].
  float* e_acc = reinterpret_cast<float*>(smem_raw);
  float* e_max = e_acc + kKeyWarps * Cfg::kRows * Dv;
  float* e_sum = e_max + kKeyWarps * Cfg::kRows;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row_warp * 16 + gid + half * 8;
    float* dst = e_acc + (key_warp * Cfg::kRows + row) * Dv + 2 * tig;
#pragma unroll
    for (int i = 0; i < kOutTiles; ++i) {
      dst[i * 8] = acc[i][2 * half];
      dst[i * 8 + 1] = acc[i][2 * half + 1];
    }
    if (tig == 0) {
      e_max[key_warp * Cfg::kRows + row] = row_max[half];
      e_sum[key_warp * Cfg::kRows + row] = sum;
    }
  }
  __syncthreads();

  const int rows_here = row_end - row_begin;
  for (int i = threadIdx.x; i < rows_here * Dv; i += kThreads) {
    const int row = i / Dv, d = i % Dv;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kKeyWarps; ++w) m = fmaxf(m, e_max[w * Cfg::kRows + row]);
    const float base = m == -INFINITY ? 0.f : m;
    float o = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kKeyWarps; ++w) {
      const float weight = exp2f(e_max[w * Cfg::kRows + row] - base);
      o += weight * e_acc[(w * Cfg::kRows + row) * Dv + d];
      l += weight * e_sum[w * Cfg::kRows + row];
    }
    const int r = row_begin + row;
    const int token = q_start + r / G, head = kv_head * G + r % G;
    if (p.num_splits == 1) {
      p.out[(static_cast<int64_t>(token) * p.num_q_heads + head) * Dv + d] =
          __float2bfloat16(l > 0.f ? o / l : 0.f);
    } else {
      const int64_t part =
          (static_cast<int64_t>(seq) * p.num_q_heads + head) * p.num_splits + split;
      p.part_acc[part * Dv + d] = o;
      if (d == 0) {
        p.part_max[part] = m;
        p.part_sum[part] = l;
      }
    }
  }
}

// Merges the split partials of decode sequences. Grid: x = batch sequence, y = query head.
__global__ void __launch_bounds__(kThreads) attention_combine_kernel(const KernelArgs p, int Dv) {
  const int seq = blockIdx.x, head = blockIdx.y;
  if (p.batch.q_len[seq] != 1) return;
  const int kv_len = p.batch.kv_len[seq];
  if (kv_len < 1) return;
  const int chunk = split_chunk(kv_len, p.num_splits);
  const int used = min(p.num_splits, (kv_len + chunk - 1) / chunk);  // non-empty splits
  const int64_t part0 = (static_cast<int64_t>(seq) * p.num_q_heads + head) * p.num_splits;
  float m = -INFINITY;
  for (int s = 0; s < used; ++s) m = fmaxf(m, p.part_max[part0 + s]);
  const float base = m == -INFINITY ? 0.f : m;
  float l = 0.f;
  for (int s = 0; s < used; ++s) l += exp2f(p.part_max[part0 + s] - base) * p.part_sum[part0 + s];
  const float inv_l = l > 0.f ? 1.f / l : 0.f;
  const int token = p.batch.q_start[seq];
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < used; ++s)
      o += exp2f(p.part_max[part0 + s] - base) * p.part_acc[(part0 + s) * Dv + d];
    p.out[(static_cast<int64_t>(token) * p.num_q_heads + head) * Dv + d] =
        __float2bfloat16(o * inv_l);
  }
}

// ---- generic (slow) kernel -----------------------------------------------------------------

constexpr int kGenericWarps = 4;
constexpr int kGenericMaxPerLane = 8;  // 256 dims / 32 lanes

// One warp per (row, query head): lane holds dims lane, lane + 32, ... of q and of the output.
// Grid: x = row (token) capacity, y = ceil(Hq / 4).
__global__ void __launch_bounds__(32 * kGenericWarps) attention_generic_kernel(const KernelArgs p) {
  const int row = blockIdx.x;
  const int head = blockIdx.y * kGenericWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (head >= p.num_q_heads) return;
  const int seq = p.batch.token_seq[row];
  if (seq < 0 || seq >= p.batch.max_seqs) return;
  const int q_start = p.batch.q_start[seq], q_len = p.batch.q_len[seq],
            kv_len = p.batch.kv_len[seq];
  if (row < q_start || row >= q_start + q_len || kv_len < q_len) return;
  const int pos = kv_len - q_len + (row - q_start);
  const int D = p.cache.head_dim, Dv = p.cache.v_head_dim, Hkv = p.cache.num_kv_heads;
  const int kv_head = head / p.group, page_size = p.cache.page_size;

  float q[kGenericMaxPerLane], acc[kGenericMaxPerLane];
  const __nv_bfloat16* q_row =
      p.q + static_cast<int64_t>(row) * p.q_stride + static_cast<int64_t>(head) * D;
#pragma unroll
  for (int i = 0; i < kGenericMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    q[i] = d < D ? __bfloat162float(q_row[d]) : 0.f;
    acc[i] = 0.f;
  }
  const int32_t* page_row =
      p.batch.page_table + static_cast<int64_t>(seq) * p.batch.max_pages_per_seq;
  float m = -INFINITY, l = 0.f;
  for (int key = 0; key <= pos; ++key) {
    const int page_index = key / page_size;
    const int page = page_index < p.batch.max_pages_per_seq ? page_row[page_index] : -1;
    if (page < 0) continue;  // corrupt table: skip rather than read out of bounds
    const int64_t slot = static_cast<int64_t>(page) * page_size + key % page_size;
    const __nv_bfloat16* k_row = p.cache.k + (slot * Hkv + kv_head) * D;
    const __nv_bfloat16* v_row = p.cache.v + (slot * Hkv + kv_head) * Dv;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kGenericMaxPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < D) dot = fmaf(q[i], __bfloat162float(k_row[d]), dot);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float score = dot * p.scale_log2;
    const float m_new = fmaxf(m, score);
    const float correction = exp2f(m - m_new);  // m = -inf on the first key: 0
    const float prob = exp2f(score - m_new);
    l = l * correction + prob;
#pragma unroll
    for (int i = 0; i < kGenericMaxPerLane; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * correction + (d < Dv ? prob * __bfloat162float(v_row[d]) : 0.f);
    }
    m = m_new;
  }
  const float inv_l = l > 0.f ? 1.f / l : 0.f;
  __nv_bfloat16* out_row = p.out + (static_cast<int64_t>(row) * p.num_q_heads + head) * Dv;
#pragma unroll
  for (int i = 0; i < kGenericMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < Dv) out_row[d] = __float2bfloat16(acc[i] * inv_l);
  }
}

// ---- KV append -----------------------------------------------------------------------------

// Copies one row's K [Hkv, D] and V [Hkv, Dv] into its page row, kVec bf16 values at a time.
// Grid: x = row (token) capacity.
template <int kVec>
__global__ void __launch_bounds__(128) paged_kv_append_kernel(const PagedKvAppendArgs p) {
  using Chunk = std::conditional_t<kVec == 8, uint4, __nv_bfloat16>;
  const int row = blockIdx.x;
  const int seq = p.batch.token_seq[row];
  if (seq < 0 || seq >= p.batch.max_seqs) return;
  const int pos = p.batch.token_pos[row];
  if (pos < 0) return;
  const int page_index = pos / p.cache.page_size;
  if (page_index >= p.batch.max_pages_per_seq) return;
  const int page =
      p.batch.page_table[static_cast<int64_t>(seq) * p.batch.max_pages_per_seq + page_index];
  if (page < 0) return;
  const int64_t slot = static_cast<int64_t>(page) * p.cache.page_size + pos % p.cache.page_size;
  const int Hkv = p.cache.num_kv_heads;
  const int k_chunks = Hkv * p.cache.head_dim / kVec, v_chunks = Hkv * p.cache.v_head_dim / kVec;
  const Chunk* k_src = reinterpret_cast<const Chunk*>(p.k + row * p.k_stride);
  const Chunk* v_src = reinterpret_cast<const Chunk*>(p.v + row * p.v_stride);
  Chunk* k_dst = reinterpret_cast<Chunk*>(p.cache.k + slot * Hkv * p.cache.head_dim);
  Chunk* v_dst = reinterpret_cast<Chunk*>(p.cache.v + slot * Hkv * p.cache.v_head_dim);
  for (int i = threadIdx.x; i < k_chunks; i += blockDim.x) k_dst[i] = k_src[i];
  for (int i = threadIdx.x; i < v_chunks; i += blockDim.x) v_dst[i] = v_src[i];
}

// ---- host side -----------------------------------------------------------------------------

bool use_tensor_cores(const PagedKv& c) {
  return (c.head_dim == 64 && c.v_head_dim == 64) || (c.head_dim == 128 && c.v_head_dim == 128);
}

// Splits of the decode grid, from capacities and host bounds only (graph replays see other kv
// lengths): enough CTAs for ~4 per SM, at least kMinKeysPerSplit keys each, within the workspace.
int decode_splits(int max_seqs, int ctas_per_split, int max_kv_len) {
  int device = 0, num_sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
        sms > 0)
      num_sms = sms;
  }
  const int64_t base = static_cast<int64_t>(std::max(max_seqs, 1)) * ctas_per_split;
  int64_t splits = (4 * static_cast<int64_t>(num_sms) + base - 1) / base;
  splits = std::min<int64_t>(splits,
                             (std::max(max_kv_len, 1) + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  splits = std::min<int64_t>(splits, split_capacity(max_seqs));
  return static_cast<int>(std::max<int64_t>(splits, 1));
}

template <int D, int Dv, int kRowWarps, int kKeyWarps, bool kDecode>
void launch_tc(const KernelArgs& args, dim3 grid, cudaStream_t stream) {
  using Cfg = TcConfig<D, Dv, kRowWarps, kKeyWarps>;
  auto kernel = paged_attention_tc_kernel<D, Dv, kRowWarps, kKeyWarps, kDecode>;
  MOELORA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(args);
  MOELORA_CUDA_CHECK_LAUNCH();
}

template <int D>
void launch_tc_family(const KernelArgs& args, const AttentionBatch& b, int num_kv_heads,
                      cudaStream_t stream) {
  constexpr int kPrefillRows = TcConfig<D, D, 4, 1>::kRows;
  constexpr int kDecodeRows = TcConfig<D, D, 1, 4>::kRows;
  const int group = args.group;
  // Decode (q_len == 1): the G heads of one token per row block, KV range split over x.
  const int decode_row_blocks = (group + kDecodeRows - 1) / kDecodeRows;
  launch_tc<D, D, 1, 4, true>(
      args, dim3(args.num_splits, num_kv_heads * decode_row_blocks, b.max_seqs), stream);
  if (args.num_splits > 1) {
    attention_combine_kernel<<<dim3(b.max_seqs, args.num_q_heads), kThreads, 0, stream>>>(args, D);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
  // Prefill (q_len >= 2): row blocks of 64 (token, head) rows, one CTA per block, no split.
  if (b.max_q_len >= 2) {
    KernelArgs prefill = args;
    prefill.num_splits = 1;
    const int64_t row_blocks =
        (static_cast<int64_t>(b.max_q_len) * group + kPrefillRows - 1) / kPrefillRows;
    MOELORA_CHECK(row_blocks <= 0x7fffffff, ErrorCode::kOutOfRange,
                  "launch_paged_attention: max_q_len ", b.max_q_len, " x group ", group,
                  " is too large for the grid");
    launch_tc<D, D, 4, 1, false>(
        prefill, dim3(static_cast<unsigned>(row_blocks), num_kv_heads, b.max_seqs), stream);
  }
}

}  // namespace

namespace detail {

void check_paged_kv(const PagedKv& c, const char* where) {
  MOELORA_CHECK(c.k != nullptr && c.v != nullptr, ErrorCode::kInvalidArgument, where,
                ": the paged KV cache has a null K or V pointer");
  MOELORA_CHECK(c.page_size >= 16 && (c.page_size & (c.page_size - 1)) == 0,
                ErrorCode::kInvalidArgument, where,
                ": page_size must be a power of two >= 16, got ", c.page_size);
  MOELORA_CHECK(c.num_kv_heads > 0, ErrorCode::kInvalidArgument, where,
                ": num_kv_heads must be > 0, got ", c.num_kv_heads);
  MOELORA_CHECK(c.head_dim > 0 && c.head_dim <= 256 && c.head_dim % 8 == 0,
                ErrorCode::kInvalidArgument, where,
                ": head_dim must be a multiple of 8 in [8, 256], got ", c.head_dim);
  MOELORA_CHECK(c.v_head_dim > 0 && c.v_head_dim <= 256 && c.v_head_dim % 8 == 0,
                ErrorCode::kInvalidArgument, where,
                ": v_head_dim must be a multiple of 8 in [8, 256], got ", c.v_head_dim);
  MOELORA_CHECK(
      reinterpret_cast<uintptr_t>(c.k) % 16 == 0 && reinterpret_cast<uintptr_t>(c.v) % 16 == 0,
      ErrorCode::kInvalidArgument, where, ": the K/V cache pointers must be 16-byte aligned");
}

void check_attention_batch(const AttentionBatch& b, const char* where) {
  MOELORA_CHECK(b.page_table && b.q_start && b.q_len && b.kv_len && b.token_seq && b.token_pos,
                ErrorCode::kInvalidArgument, where, ": an AttentionBatch device array is null");
  MOELORA_CHECK(b.max_pages_per_seq > 0, ErrorCode::kInvalidArgument, where,
                ": max_pages_per_seq must be > 0, got ", b.max_pages_per_seq);
  MOELORA_CHECK(b.max_seqs <= 65535, ErrorCode::kOutOfRange, where, ": max_seqs ", b.max_seqs,
                " exceeds the grid limit 65535");
}

}  // namespace detail

size_t paged_attention_workspace_bytes(int max_tokens, int num_q_heads, int v_head_dim,
                                       int max_seqs) {
  (void)max_tokens;  // split partials exist for decode sequences only (one row each)
  const size_t slots = static_cast<size_t>(std::max(max_seqs, 0)) * split_capacity(max_seqs) *
                       static_cast<size_t>(std::max(num_q_heads, 0));
  return slots * (static_cast<size_t>(std::max(v_head_dim, 0)) + 2) * sizeof(float);
}

void launch_paged_kv_append(const PagedKvAppendArgs& args, cudaStream_t stream) {
  detail::check_paged_kv(args.cache, "launch_paged_kv_append");
  detail::check_attention_batch(args.batch, "launch_paged_kv_append");
  if (args.batch.max_tokens <= 0 || args.batch.max_seqs <= 0) return;
  MOELORA_CHECK(args.k != nullptr && args.v != nullptr, ErrorCode::kInvalidArgument,
                "launch_paged_kv_append: the new K or V rows are null");
  const int Hkv = args.cache.num_kv_heads;
  MOELORA_CHECK(args.k_stride >= static_cast<int64_t>(Hkv) * args.cache.head_dim &&
                    args.v_stride >= static_cast<int64_t>(Hkv) * args.cache.v_head_dim,
                ErrorCode::kInvalidArgument, "launch_paged_kv_append: row strides (k ",
                args.k_stride, ", v ", args.v_stride, ") are shorter than a row (k ",
                Hkv * args.cache.head_dim, ", v ", Hkv * args.cache.v_head_dim, ")");
  const bool vec = reinterpret_cast<uintptr_t>(args.k) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(args.v) % 16 == 0 && args.k_stride % 8 == 0 &&
                   args.v_stride % 8 == 0;
  if (vec) {
    paged_kv_append_kernel<8><<<args.batch.max_tokens, 128, 0, stream>>>(args);
  } else {
    paged_kv_append_kernel<1><<<args.batch.max_tokens, 128, 0, stream>>>(args);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_paged_attention(const PagedAttentionArgs& args, cudaStream_t stream) {
  detail::check_paged_kv(args.cache, "launch_paged_attention");
  detail::check_attention_batch(args.batch, "launch_paged_attention");
  const AttentionBatch& b = args.batch;
  if (b.max_tokens <= 0 || b.max_seqs <= 0 || b.max_q_len <= 0) return;
  const int Hq = args.num_q_heads, Hkv = args.cache.num_kv_heads, D = args.cache.head_dim;
  MOELORA_CHECK(Hq > 0 && Hq % Hkv == 0, ErrorCode::kInvalidArgument,
                "launch_paged_attention: ", Hq, " query heads are not a positive multiple of ", Hkv,
                " KV heads");
  MOELORA_CHECK(args.q != nullptr && args.out != nullptr, ErrorCode::kInvalidArgument,
                "launch_paged_attention: q or out is null");
  MOELORA_CHECK(args.q_stride >= static_cast<int64_t>(Hq) * D && args.q_stride % 2 == 0 &&
                    reinterpret_cast<uintptr_t>(args.q) % 4 == 0,
                ErrorCode::kInvalidArgument,
                "launch_paged_attention: q_stride must be even and >= Hq * D = ", Hq * D,
                " with a 4-byte aligned q, got stride ", args.q_stride);
  MOELORA_CHECK(std::isfinite(args.scale) && args.scale >= 0.f, ErrorCode::kInvalidArgument,
                "launch_paged_attention: scale must be finite and >= 0 (0 = head_dim^-0.5), got ",
                args.scale);
  MOELORA_CHECK(b.max_kv_len >= b.max_q_len, ErrorCode::kInvalidArgument,
                "launch_paged_attention: max_kv_len ", b.max_kv_len, " is smaller than max_q_len ",
                b.max_q_len);

  KernelArgs k{};
  k.cache = args.cache;
  k.batch = b;
  k.q = args.q;
  k.q_stride = args.q_stride;
  k.num_q_heads = Hq;
  k.group = Hq / Hkv;
  const float scale = args.scale > 0.f ? args.scale : 1.0f / std::sqrt(static_cast<float>(D));
  k.scale_log2 = scale * kLog2e;
  k.out = args.out;
  k.num_splits = 1;

  if (!use_tensor_cores(args.cache)) {
    attention_generic_kernel<<<dim3(b.max_tokens, (Hq + kGenericWarps - 1) / kGenericWarps),
                               32 * kGenericWarps, 0, stream>>>(k);
    MOELORA_CUDA_CHECK_LAUNCH();
    return;
  }

  const int decode_row_blocks = (k.group + 15) / 16;
  k.num_splits = decode_splits(b.max_seqs, Hkv * decode_row_blocks, b.max_kv_len);
  if (k.num_splits > 1) {
    MOELORA_CHECK(
        args.workspace != nullptr, ErrorCode::kInvalidArgument,
        "launch_paged_attention: workspace is null; it needs paged_attention_workspace_bytes(...) "
        "= ",
        paged_attention_workspace_bytes(b.max_tokens, Hq, args.cache.v_head_dim, b.max_seqs),
        " bytes");
    const size_t parts = static_cast<size_t>(b.max_seqs) * Hq * k.num_splits;
    float* ws = static_cast<float*>(args.workspace);
    k.part_acc = ws;
    k.part_max = ws + parts * args.cache.v_head_dim;
    k.part_sum = k.part_max + parts;
  }
  if (D == 64) {
    launch_tc_family<64>(k, b, Hkv, stream);
  } else {
    launch_tc_family<128>(k, b, Hkv, stream);
  }
}

}  // namespace moelora::ops::cuda
