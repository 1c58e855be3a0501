// Flat split-KV GQA decode attention (see gqa_decode_cuda.cuh for the scheme, attention.h for the
// math). Shapes per CTA: the ring holds kStages tiles of K [64, D] and V [64, Dv] (bf16, rows
// padded by 8 elements so ldmatrix rows fall in distinct banks); warp w computes the scores
// S [16 rows (query heads, G used), 32 keys] of key group w / 2 and the value dims
// [(w % 2) * Dv / 2, + Dv / 2) of that group's O [16, Dv]; the groups merge at a pair's end.
#include "ops/attention/gqa_decode_cuda.cuh"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>

#include "core/cuda_utils.h"
#include "core/error.h"
#include "core/mma_ptx.cuh"
#include "ops/attention/online_softmax.cuh"

namespace moelora::ops::cuda {

namespace {

using namespace ::moelora::cuda::ptx;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTileKeys = 64;
constexpr int kPad = 8;             // bf16 elements of padding per shared row
constexpr int kStages = 3;          // K/V tiles in the ring, all in flight while one is awaited
constexpr int kMaxGroup = 16;       // query heads per KV head: the m16 rows
constexpr int kMinTilesPerCta = 4;  // fewer CTAs for small batches: short chains of partials
constexpr int kMaxSeqs = 1024;      // the tile prefix lives in shared memory (4 KB)
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct Cfg {
  static constexpr int kKStride = D + kPad;
  static constexpr int kStageElems = kTileKeys * 2 * kKStride;  // K then V (Dv == D)
  static constexpr int kRingBytes = kStages * kStageElems * 2;
  // Warp w: key group w / 2 (keys [32 (w / 2), + 32) of a tile), dim half w % 2 of O.
  static constexpr int kKeysPerWarp = kTileKeys / 2;
  static constexpr int kDimsPerWarp = D / 2;
  static constexpr int kOutTiles = kDimsPerWarp / 8;    // n8 tiles of O per warp
  static constexpr int kScoreTiles = kKeysPerWarp / 8;  // n8 tiles of S per warp
  // Merge of the key groups at a pair's end, in the stage just consumed: acc [2 dim halves][16
  // rows][D / 2] then max / sum [16 rows][2] of key group 1.
  static constexpr int kMergeFloats = 16 * D + 32;
  static_assert(kDimsPerWarp % 16 == 0, "a warp's value dims are whole ldmatrix.x4.trans pairs");
  static_assert(kMergeFloats * 4 <= kStageElems * 2, "the key-group merge fits one stage");
};

// The ring, then the tile prefix [max_seqs + 1] and the kv lengths [max_seqs] (int32).
size_t smem_bytes(int head_dim, int max_seqs) {
  const size_t ring = static_cast<size_t>(kStages) * kTileKeys * 2 * (head_dim + kPad) * 2;
  return ring + static_cast<size_t>(2 * max_seqs + 1) * sizeof(int32_t);
}

struct KernelArgs {
  PagedKv cache;
  AttentionBatch batch;
  const __nv_bfloat16* q;
  int64_t q_stride;
  int num_q_heads;
  int group;           // G = Hq / Hkv
  float scale_log2;    // softmax scale * log2(e)
  __nv_bfloat16* out;  // [T, Hq, Dv]
  int page_shift;      // log2(page_size)
  int32_t* tickets;    // [max_seqs, Hkv]: tiles of a (sequence, KV head) finished so far
  float* partials;     // [num_ctas, 2 slots]: acc [G, Dv] (unnormalized), [G, max (log2), sum]
};

// Where unit u (a 64-key tile) of the flat list lies: sequence, KV head, tile within the pair.
struct Unit {
  int seq, kv_head, tile, tiles;
  int pair_begin;  // unit index of the pair's tile 0
};

// prefix [num_seqs + 1]: tiles per sequence, exclusive sum. The largest b with Hkv * prefix[b] <= u
// is u's sequence (sequences without tiles share their successor's prefix and are skipped).
__device__ __forceinline__ Unit locate(int u, const int32_t* prefix, int num_seqs, int Hkv) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (Hkv * prefix[mid] <= u)
      lo = mid;
    else
      hi = mid - 1;
  }
  Unit x;
  x.seq = lo;
  x.tiles = prefix[lo + 1] - prefix[lo];
  const int r = u - Hkv * prefix[lo];
  x.kv_head = r / x.tiles;
  x.tile = r - x.kv_head * x.tiles;
  x.pair_begin = Hkv * prefix[lo] + x.kv_head * x.tiles;
  return x;
}

// The unit after x (the loader and the compute loop walk their ranges in order: no search).
__device__ __forceinline__ void advance(Unit& x, const int32_t* prefix, int num_seqs, int Hkv) {
  if (++x.tile < x.tiles) return;
  x.tile = 0;
  x.pair_begin += x.tiles;
  if (++x.kv_head < Hkv) return;
  x.kv_head = 0;
  do {
    ++x.seq;
  } while (x.seq < num_seqs - 1 && prefix[x.seq + 1] == prefix[x.seq]);
  x.tiles = prefix[x.seq + 1] - prefix[x.seq];
}

// The partial / ticket handshake: each contributor's stores happen before its ticket add
// (release), the last contributor's reads of the others' partials after it saw the total
// (acquire). Lighter than __threadfence's sequentially consistent fence.
__device__ __forceinline__ void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

// CTA i covers units [i * total / N, (i + 1) * total / N).
__device__ __forceinline__ int64_t range_begin(int64_t cta, int64_t total, int64_t num_ctas) {
  return cta * total / num_ctas;
}
// The CTA whose range holds unit u: the largest i with range_begin(i) <= u.
__device__ __forceinline__ int64_t cta_of(int64_t u, int64_t total, int64_t num_ctas) {
  return ((u + 1) * num_ctas - 1) / total;
}

template <int D>
__global__ void __launch_bounds__(kThreads) gqa_decode_kernel(const KernelArgs p) {
  using C = Cfg<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int num_seqs = p.batch.max_seqs;
  __nv_bfloat16* ring = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  int32_t* prefix = reinterpret_cast<int32_t*>(smem_raw + C::kRingBytes);  // [num_seqs + 1]
  int32_t* kv_lens = prefix + num_seqs + 1;                                // [num_seqs]
  __shared__ int32_t warp_total[kWarps];
  __shared__ int last_contributor;
  __shared__ float merge_max[kMaxGroup], merge_inv_sum[kMaxGroup];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int gid = lane / 4, tig = lane % 4;  // mma fragment coordinates
  const int Hkv = p.cache.num_kv_heads, G = p.group;
  const int page_size = p.cache.page_size;

  // ---- tiles per sequence -> exclusive prefix in shared memory (block scan) ----
  {
    const int per = (num_seqs + kThreads - 1) / kThreads;
    const int b0 = min(tid * per, num_seqs), b1 = min(b0 + per, num_seqs);
    int32_t local = 0;
    for (int b = b0; b < b1; ++b) {
      const int kv = p.batch.kv_len[b];
      kv_lens[b] = kv;
      local += (p.batch.q_len[b] == 1 && kv > 0) ? (kv + kTileKeys - 1) / kTileKeys : 0;
    }
    int32_t incl = local;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int32_t v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    int32_t offset = incl - local;
    for (int w = 0; w < warp; ++w) offset += warp_total[w];
    for (int b = b0; b < b1; ++b) {
      prefix[b] = offset;
      const int kv = kv_lens[b];
      offset += (p.batch.q_len[b] == 1 && kv > 0) ? (kv + kTileKeys - 1) / kTileKeys : 0;
    }
    if (tid == kThreads - 1) prefix[num_seqs] = offset;
    __syncthreads();
  }
  const int64_t total = static_cast<int64_t>(Hkv) * prefix[num_seqs];
  // At least kMinTilesPerCta tiles per CTA (a small batch leaves the rest of the grid idle): every
  // range is non-empty, and a long pair of a small batch is cut into fewer partials.
  const int64_t num_ctas =
      min(static_cast<int64_t>(gridDim.x), max(static_cast<int64_t>(1), total / kMinTilesPerCta));
  if (blockIdx.x >= num_ctas) return;
  const int64_t u0 = range_begin(blockIdx.x, total, num_ctas);
  const int64_t u1 = range_begin(blockIdx.x + 1, total, num_ctas);
  if (u0 >= u1) return;  // an empty batch (no sequence with q_len 1): nothing to do
  const int n = static_cast<int>(u1 - u0);

  // ---- K/V tile loads: 16-byte cp.async chunks through the page table, zero past kv_len ----
  // Thread tid copies 16-byte column chunk tid % kChunks of keys tid / kChunks + j * kKeyStep
  // (j < kPasses) of K and of V. The page ids of a tile are read one loop iteration before its
  // copies are issued (fetch_pages, then issue_tile next time), so the page-table latency never
  // sits between a barrier and the copies that keep the ring full.
  constexpr int kChunks = D / 8;
  constexpr int kKeyStep = kThreads / kChunks;
  constexpr int kPasses = kTileKeys / kKeyStep;
  static_assert(kThreads % kChunks == 0 && kTileKeys % kKeyStep == 0, "whole passes per tile");
  const int col = (tid % kChunks) * 8, key_base = tid / kChunks;
  Unit load_at = locate(static_cast<int>(u0), prefix, num_seqs, Hkv);
  // Pages of 64 keys or more hold a whole tile: one page id per tile, rows at a fixed stride.
  const bool page_per_tile = page_size >= kTileKeys;
  int next_pages[kPasses];  // page ids of the tile at load_at (-1: past kv_len or no page)
  auto fetch_pages = [&]() {
    const int32_t* page_row =
        p.batch.page_table + static_cast<int64_t>(load_at.seq) * p.batch.max_pages_per_seq;
    if (page_per_tile) {
      const int page_index = (load_at.tile * kTileKeys) >> p.page_shift;
      next_pages[0] = page_index < p.batch.max_pages_per_seq ? page_row[page_index] : -1;
      return;
    }
    const int kv_len = kv_lens[load_at.seq];
#pragma unroll
    for (int j = 0; j < kPasses; ++j) {
      const int pos = load_at.tile * kTileKeys + key_base + j * kKeyStep;
      const int page_index = pos >> p.page_shift;
      next_pages[j] =
          pos < kv_len && page_index < p.batch.max_pages_per_seq ? page_row[page_index] : -1;
    }
  };
  auto issue_tile = [&](int stage) {  // the tile at load_at into `stage`, then the next one
    __nv_bfloat16* ks = ring + stage * C::kStageElems;
    const int key0 = load_at.tile * kTileKeys;
    if (page_per_tile) {
      const int kv_len = kv_lens[load_at.seq];
      const int slot0 = (next_pages[0] << p.page_shift) + (key0 & (page_size - 1)) + key_base;
      const int64_t base = (static_cast<int64_t>(slot0) * Hkv + load_at.kv_head) * D + col;
      const int64_t pass_stride = static_cast<int64_t>(kKeyStep) * Hkv * D;
#pragma unroll
      for (int j = 0; j < kPasses; ++j) {
        const int key = key_base + j * kKeyStep;
        const bool hit = next_pages[0] >= 0 && key0 + key < kv_len;
        const int64_t offset = hit ? base + j * pass_stride : 0;
        cp_async_16(smem_addr(ks + key * C::kKStride + col), p.cache.k + offset, hit ? 16 : 0);
        cp_async_16(smem_addr(ks + (kTileKeys + key) * C::kKStride + col), p.cache.v + offset,
                    hit ? 16 : 0);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kPasses; ++j) {
        const int key = key_base + j * kKeyStep;
        const int slot = (next_pages[j] << p.page_shift) + ((key0 + key) & (page_size - 1));
        const bool hit = next_pages[j] >= 0;
        const int64_t offset =
            hit ? static_cast<int64_t>(slot * Hkv + load_at.kv_head) * D + col : 0;
        cp_async_16(smem_addr(ks + key * C::kKStride + col), p.cache.k + offset, hit ? 16 : 0);
        cp_async_16(smem_addr(ks + (kTileKeys + key) * C::kKStride + col), p.cache.v + offset,
                    hit ? 16 : 0);
      }
    }
    advance(load_at, prefix, num_seqs, Hkv);
  };

  fetch_pages();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) {
      issue_tile(s);
      if (s + 1 < n) fetch_pages();
    }
    cp_async_commit();
  }

  uint32_t q_frag[D / 16][4];
  float acc[C::kOutTiles][4];
  float row_max[2], row_sum[2];
  int pair_first_tile = 0, row0 = 0;  // of the current pair: its first tile here, its q / out row
  Unit compute_at = locate(static_cast<int>(u0), prefix, num_seqs, Hkv);
  const int key_group = warp / 2;
  const int dim0 = (warp % 2) * C::kDimsPerWarp;
  const int warp_key0 = key_group * C::kKeysPerWarp;  // within a tile

  for (int i = 0; i < n; ++i) {
    // Refill first, then wait: while tile i is awaited, tiles i + 1 .. i + kStages - 1 are in
    // flight too (kStages tiles, where waiting first would leave kStages - 2).
    __syncthreads();  // every warp is done with tile i - 1: its stage is free
    {
      const int j = i + kStages - 1;
      if (j < n) {
        issue_tile(j % kStages);
        if (j + 1 < n) fetch_pages();
      }
      cp_async_commit();
    }
    cp_async_wait<kStages - 1>();
    __syncthreads();  // tile i landed for every thread
    const Unit x = compute_at;
    advance(compute_at, prefix, num_seqs, Hkv);
    const int kv_len = kv_lens[x.seq];

    if (i == 0 || x.tile == 0) {  // a new (sequence, KV head): fresh state, its query rows
      pair_first_tile = x.tile;
      row0 = p.batch.q_start[x.seq];  // read here only: its latency is paid once per pair
#pragma unroll
      for (int t = 0; t < C::kOutTiles; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
      row_max[0] = row_max[1] = -INFINITY;
      row_sum[0] = row_sum[1] = 0.f;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int g = gid + 8 * half;
        const bool valid = g < G;
        const __nv_bfloat16* q_row = p.q + static_cast<int64_t>(row0) * p.q_stride +
                                     static_cast<int64_t>(x.kv_head * G + (valid ? g : 0)) * D;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          // A fragment: regs 0/1 = rows gid / gid + 8 at cols 2 tig, regs 2/3 at cols + 8.
          q_frag[ks][half] =
              valid ? *reinterpret_cast<const uint32_t*>(q_row + ks * 16 + 2 * tig) : 0u;
          q_frag[ks][half + 2] =
              valid ? *reinterpret_cast<const uint32_t*>(q_row + ks * 16 + 8 + 2 * tig) : 0u;
        }
      }
    }

    const __nv_bfloat16* ks = ring + (i % kStages) * C::kStageElems;
    const __nv_bfloat16* vs = ks + kTileKeys * C::kKStride;

    // S = Q K^T over the warp's 32 keys. ldmatrix.x4 on K rows: matrix m = lane / 8 holds dims
    // kk * 16 + 8 m .. + 7 of key nt * 8 + (lane % 8): the B fragments of k steps kk, kk + 1.
    float s[C::kScoreTiles][4];
#pragma unroll
    for (int nt = 0; nt < C::kScoreTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {
#pragma unroll
      for (int nt = 0; nt < C::kScoreTiles; ++nt) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(ks + (warp_key0 + nt * 8 + (lane & 7)) * C::kKStride + kk * 16 +
                                 (lane >> 3) * 8));
        mma_bf16_16816(s[nt], q_frag[kk], b[0], b[1]);
        mma_bf16_16816(s[nt], q_frag[kk + 1], b[2], b[3]);
      }
    }
    const int key0 = x.tile * kTileKeys;
    if (key0 + kTileKeys > kv_len) {  // the pair's last tile: keys past kv_len do not count
#pragma unroll
      for (int nt = 0; nt < C::kScoreTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key0 + warp_key0 + nt * 8 + 2 * tig + (e & 1) >= kv_len) s[nt][e] = -INFINITY;
    }

    // Online softmax per key group; a row lives in the 4 threads of a quad. Key group 1 may see
    // only masked keys (the pair's last tile), so its max can stay -inf: subtract 0 then.
    online_softmax_step(s, acc, row_max, row_sum, p.scale_log2);

    // O += P V for this warp's keys and dims.
    accumulate_pv<C::kKeysPerWarp / 16, C::kDimsPerWarp / 16>(
        s, acc, vs + warp_key0 * C::kKStride + dim0, C::kKStride, lane);

    if (i != n - 1 && x.tile != x.tiles - 1) continue;

    // ---- the pair ends here for this CTA: store it, or leave a partial and maybe merge ----
    float l[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      l[half] = row_sum[half];
      l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
      l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    }
    // Key group 1 hands its rows to key group 0 through the stage just consumed (it is refilled
    // only after the next iteration's barrier); group 0 then holds the pair's state alone.
    __syncthreads();
    float* merge = reinterpret_cast<float*>(ring + (i % kStages) * C::kStageElems);
    float* merge_acc = merge + (warp % 2) * 16 * C::kDimsPerWarp;  // [16 rows][D / 2]
    float* merge_ml = merge + 16 * D;                              // [16 rows][max, sum]
    if (key_group == 1) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = gid + 8 * half;
#pragma unroll
        for (int t = 0; t < C::kOutTiles; ++t) {
          merge_acc[r * C::kDimsPerWarp + t * 8 + 2 * tig] = acc[t][2 * half];
          merge_acc[r * C::kDimsPerWarp + t * 8 + 2 * tig + 1] = acc[t][2 * half + 1];
        }
        if (warp == 2 && tig == 0) {
          merge_ml[2 * r] = row_max[half];
          merge_ml[2 * r + 1] = l[half];
        }
      }
    }
    __syncthreads();
    if (key_group == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = gid + 8 * half;
        const float m1 = merge_ml[2 * r], l1 = merge_ml[2 * r + 1];
        const float m = fmaxf(row_max[half], m1);  // finite: group 0 always sees a valid key
        const float w0 = fast_exp2(row_max[half] - m), w1 = fast_exp2(m1 - m);
        row_max[half] = m;
        l[half] = l[half] * w0 + l1 * w1;
#pragma unroll
        for (int t = 0; t < C::kOutTiles; ++t) {
          acc[t][2 * half] =
              acc[t][2 * half] * w0 + merge_acc[r * C::kDimsPerWarp + t * 8 + 2 * tig] * w1;
          acc[t][2 * half + 1] =
              acc[t][2 * half + 1] * w0 + merge_acc[r * C::kDimsPerWarp + t * 8 + 2 * tig + 1] * w1;
        }
      }
    }
    const int head0 = x.kv_head * G;
    if (pair_first_tile == 0 && x.tile == x.tiles - 1) {  // the whole pair was this CTA's
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int g = gid + 8 * half;
        if (g >= G || key_group != 0) continue;
        const float inv = 1.f / l[half];
        __nv_bfloat16* o =
            p.out + (static_cast<int64_t>(row0) * p.num_q_heads + head0 + g) * D + dim0 + 2 * tig;
#pragma unroll
        for (int t = 0; t < C::kOutTiles; ++t)
          *reinterpret_cast<uint32_t*>(o + t * 8) =
              pack_bf16x2(acc[t][2 * half] * inv, acc[t][2 * half + 1] * inv);
      }
      continue;
    }
    // Slot 0: the pair is this CTA's first (its range starts inside the pair); slot 1: its last.
    // A slot: acc [G][D] (unnormalized), then [G][max (log2), sum]; slot_floats keeps slots
    // 16-byte aligned for the merge's float4 reads.
    const int slot_floats = (G * (D + 2) + 3) & ~3;
    float* part =
        p.partials +
        (static_cast<int64_t>(blockIdx.x) * 2 + (u0 >= x.pair_begin ? 0 : 1)) * slot_floats;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int g = gid + 8 * half;
      if (g >= G || key_group != 0) continue;
      float* dst = part + g * D + dim0 + 2 * tig;
#pragma unroll
      for (int t = 0; t < C::kOutTiles; ++t)
        *reinterpret_cast<float2*>(dst + t * 8) =
            make_float2(acc[t][2 * half], acc[t][2 * half + 1]);
      if (warp == 0 && tig == 0)
        *reinterpret_cast<float2*>(part + G * D + 2 * g) = make_float2(row_max[half], l[half]);
    }
    fence_acq_rel_gpu();
    __syncthreads();
    int32_t* ticket = p.tickets + static_cast<int64_t>(x.seq) * Hkv + x.kv_head;
    if (tid == 0) {
      const int done = x.tile - pair_first_tile + 1;
      last_contributor = atomicAdd(ticket, done) + done == x.tiles;
    }
    __syncthreads();
    if (!last_contributor) continue;
    fence_acq_rel_gpu();
    // Every contributor's partial is visible: merge them in CTA order (fixed, so the bits are).
    // Contributors are CTAs c_first .. c_last (ranges are never empty); c's partial of this pair
    // is in its slot 0 when its range starts inside the pair, else in slot 1. First the row
    // maxima and sums (warp w: rows w, w + 4, ..; lanes over contributors, all rows' loads
    // issued together), then the outputs (float4 per thread, every contributor's loads in
    // flight at once).
    const int64_t c_first = cta_of(x.pair_begin, total, num_ctas);
    const int64_t c_last = cta_of(x.pair_begin + x.tiles - 1, total, num_ctas);
    auto partial_of = [&](int64_t c) -> const float* {
      const int slot = range_begin(c, total, num_ctas) >= x.pair_begin ? 0 : 1;
      return p.partials + (c * 2 + slot) * slot_floats;
    };
    // (m, s) <- the softmax state of both (m, s) and (m2, s2).
    auto combine = [](float& m, float& s, float m2, float s2) {
      const float nm = fmaxf(m, m2);
      if (nm == -INFINITY) return;
      s = s * fast_exp2(m - nm) + s2 * fast_exp2(m2 - nm);
      m = nm;
    };
    {
      constexpr int kRows = kMaxGroup / kWarps;
      float mx[kRows], sm[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) mx[r] = -INFINITY, sm[r] = 0.f;
      for (int64_t c = c_first + lane; c <= c_last; c += 32) {
        const float* ml = partial_of(c) + G * D;
        float2 v[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int g = warp + r * kWarps;
          v[r] =
              g < G ? __ldcg(reinterpret_cast<const float2*>(ml) + g) : make_float2(-INFINITY, 0.f);
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) combine(mx[r], sm[r], v[r].x, v[r].y);
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2)
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float m2 = __shfl_xor_sync(0xffffffffu, mx[r], o);
          const float s2 = __shfl_xor_sync(0xffffffffu, sm[r], o);
          combine(mx[r], sm[r], m2, s2);
        }
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int g = warp + r * kWarps;
          if (g < G) {
            merge_max[g] = mx[r];
            merge_inv_sum[g] = 1.f / sm[r];
          }
        }
    }
    __syncthreads();
    {
      constexpr int kF4 = kMaxGroup * D / 4 / kThreads;  // float4 of the pair per thread, at most
      const int n4 = G * D / 4;
      float4 o[kF4];
#pragma unroll
      for (int k = 0; k < kF4; ++k) o[k] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
      for (int64_t c = c_first; c <= c_last; ++c) {
        const float* base = partial_of(c);
#pragma unroll
        for (int k = 0; k < kF4; ++k) {
          const int idx = tid + k * kThreads;
          if (idx >= n4) continue;
          const int g = idx * 4 / D;
          const float w = fast_exp2(__ldcg(base + G * D + 2 * g) - merge_max[g]);
          const float4 a = __ldcg(reinterpret_cast<const float4*>(base) + idx);
          o[k].x += w * a.x, o[k].y += w * a.y, o[k].z += w * a.z, o[k].w += w * a.w;
        }
      }
#pragma unroll
      for (int k = 0; k < kF4; ++k) {
        const int idx = tid + k * kThreads;
        if (idx >= n4) continue;
        const int g = idx * 4 / D, d = idx * 4 % D;
        const float inv = merge_inv_sum[g];
        uint2 packed;
        packed.x = pack_bf16x2(o[k].x * inv, o[k].y * inv);
        packed.y = pack_bf16x2(o[k].z * inv, o[k].w * inv);
        *reinterpret_cast<uint2*>(
            p.out + (static_cast<int64_t>(row0) * p.num_q_heads + head0 + g) * D + d) = packed;
      }
    }
    if (tid == 0) *ticket = 0;  // every contributor has added: ready for the next launch
  }
  cp_async_wait<0>();
}

// The default grid for head dim D on the current device: its SMs times the CTAs one SM holds
// (shared memory bounds it: the ring plus the prefix of the largest batch). Cached per device, so
// a launch queries nothing after the first.
int grid_ctas(int head_dim) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> cache;  // (device, head_dim) -> CTAs per SM
  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find({device, head_dim});
  if (it != cache.end()) return it->second;
  int per_sm = 0, sms = 0;
  MOELORA_CUDA_CHECK(
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t per_cta = smem_bytes(head_dim, kMaxSeqs) + 1024;  // + the runtime's reserve
  const int ctas = std::clamp(static_cast<int>(per_sm / per_cta), 1, 4);
  cache[{device, head_dim}] = ctas * sms;
  // The kernel's shared-memory limit, once per device (the attribute is per device context).
  const int limit = static_cast<int>(smem_bytes(head_dim, kMaxSeqs));
  if (head_dim == 64)
    MOELORA_CUDA_CHECK(cudaFuncSetAttribute(gqa_decode_kernel<64>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
  else if (head_dim == 128)
    MOELORA_CUDA_CHECK(cudaFuncSetAttribute(gqa_decode_kernel<128>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
  else
    MOELORA_CUDA_CHECK(cudaFuncSetAttribute(gqa_decode_kernel<256>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
  return ctas * sms;
}

}  // namespace

bool gqa_decode_supports(int num_q_heads, int num_kv_heads, int head_dim, int v_head_dim) {
  if (num_kv_heads <= 0 || num_q_heads <= 0 || num_q_heads % num_kv_heads != 0) return false;
  if (num_q_heads / num_kv_heads > kMaxGroup) return false;
  return head_dim == v_head_dim && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

int gqa_decode_default_ctas(int head_dim) {
  MOELORA_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256, ErrorCode::kUnsupported,
                "gqa_decode_default_ctas: head_dim must be 64, 128 or 256, got ", head_dim);
  return grid_ctas(head_dim);
}

size_t gqa_decode_workspace_bytes(int max_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                  int num_ctas) {
  if (num_ctas <= 0) num_ctas = gqa_decode_default_ctas(head_dim);
  const size_t tickets =
      (static_cast<size_t>(std::max(max_seqs, 1)) * num_kv_heads * 4 + 255) / 256 * 256;
  const int group = num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0;
  const size_t slot_floats = (static_cast<size_t>(group) * (head_dim + 2) + 3) / 4 * 4;
  return tickets + static_cast<size_t>(num_ctas) * 2 * slot_floats * sizeof(float);
}

void reset_gqa_decode_workspace(void* workspace, int max_seqs, int num_kv_heads,
                                cudaStream_t stream) {
  MOELORA_CHECK(workspace != nullptr, ErrorCode::kInvalidArgument,
                "reset_gqa_decode_workspace: null workspace");
  MOELORA_CUDA_CHECK(cudaMemsetAsync(
      workspace, 0, static_cast<size_t>(std::max(max_seqs, 1)) * num_kv_heads * 4, stream));
}

void launch_gqa_decode_attention(const PagedAttentionArgs& args, cudaStream_t stream,
                                 int num_ctas) {
  const char* where = "launch_gqa_decode_attention";
  detail::check_paged_kv(args.cache, where);
  detail::check_attention_batch(args.batch, where);
  const int Hq = args.num_q_heads, Hkv = args.cache.num_kv_heads, D = args.cache.head_dim;
  MOELORA_CHECK(gqa_decode_supports(Hq, Hkv, D, args.cache.v_head_dim), ErrorCode::kUnsupported,
                where, ": serves head_dim == v_head_dim in {64, 128, 256} and up to ", kMaxGroup,
                " query heads per KV head; got ", Hq, " / ", Hkv, " heads, head_dim ", D,
                ", v_head_dim ", args.cache.v_head_dim);
  MOELORA_CHECK(args.batch.max_q_len == 1, ErrorCode::kInvalidArgument, where,
                ": decode only (max_q_len must be 1, got ", args.batch.max_q_len,
                "); prefill rows go through launch_paged_attention");
  MOELORA_CHECK(args.batch.max_seqs >= 1 && args.batch.max_seqs <= kMaxSeqs,
                ErrorCode::kInvalidArgument, where, ": max_seqs must be in [1, ", kMaxSeqs,
                "], got ", args.batch.max_seqs);
  MOELORA_CHECK(args.q && args.out && args.workspace, ErrorCode::kInvalidArgument, where,
                ": q, out and workspace must be device pointers (got null)");
  MOELORA_CHECK(args.q_stride >= static_cast<int64_t>(Hq) * D && args.q_stride % 2 == 0,
                ErrorCode::kInvalidArgument, where,
                ": q_stride must be even and >= Hq * D = ", static_cast<int64_t>(Hq) * D, ", got ",
                args.q_stride);
  // The default grid also sets the kernels' shared-memory limit on this device.
  const int default_ctas = grid_ctas(D);
  if (num_ctas <= 0) num_ctas = default_ctas;
  MOELORA_CHECK(reinterpret_cast<uintptr_t>(args.q) % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(args.out) % 8 == 0,
                ErrorCode::kInvalidArgument, where,
                ": q must be 4-byte and out 8-byte aligned (bf16 pairs / quads are moved at once)");
  MOELORA_CHECK(num_ctas <= 65535 * 16, ErrorCode::kInvalidArgument, where, ": num_ctas ", num_ctas,
                " is beyond any grid this kernel needs");

  KernelArgs k;
  k.cache = args.cache;
  k.batch = args.batch;
  k.q = args.q;
  k.q_stride = args.q_stride;
  k.num_q_heads = Hq;
  k.group = Hq / Hkv;
  const float scale = args.scale > 0.f ? args.scale : 1.0f / std::sqrt(static_cast<float>(D));
  k.scale_log2 = scale * kLog2e;
  k.out = args.out;
  k.page_shift = 0;
  while ((1 << k.page_shift) < args.cache.page_size) ++k.page_shift;
  k.tickets = static_cast<int32_t*>(args.workspace);
  const size_t tickets = (static_cast<size_t>(args.batch.max_seqs) * Hkv * 4 + 255) / 256 * 256;
  k.partials = reinterpret_cast<float*>(static_cast<uint8_t*>(args.workspace) + tickets);

  const size_t smem = smem_bytes(D, args.batch.max_seqs);
  if (D == 64)
    gqa_decode_kernel<64><<<num_ctas, kThreads, smem, stream>>>(k);
  else if (D == 128)
    gqa_decode_kernel<128><<<num_ctas, kThreads, smem, stream>>>(k);
  else
    gqa_decode_kernel<256><<<num_ctas, kThreads, smem, stream>>>(k);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
