#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/sm90_ptx.cuh"
#include "ops/moe_align/moe_align_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kThreads = 1024;

// In-place exclusive scan of data[0, n) in shared memory by the whole CTA; returns the total.
// Each thread scans a contiguous chunk; chunk totals are scanned with warp shuffles.
__device__ int block_exclusive_scan(int* data, int n, int* warp_totals) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int chunk = (n + kThreads - 1) / kThreads;
  const int begin = min(n, tid * chunk), end = min(n, begin + chunk);
  int total = 0;
  for (int i = begin; i < end; ++i) total += data[i];
  int incl = total;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_totals[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = warp_totals[lane];
    int wincl = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, wincl, o);
      if (lane >= o) wincl += v;
    }
    warp_totals[lane] = wincl - w;  // exclusive prefix of warp totals
    if (lane == 31) warp_totals[32] = wincl;
  }
  __syncthreads();
  int running = warp_totals[warp] + incl - total;
  for (int i = begin; i < end; ++i) {
    const int v = data[i];
    data[i] = running;
    running += v;
  }
  const int grand_total = warp_totals[32];
  __syncthreads();  // warp_totals is reused by the next scan
  return grand_total;
}

__global__ void __launch_bounds__(kThreads) moe_align_kernel(const MoeAlignDeviceArgs a) {
  extern __shared__ int smem[];
  __shared__ int warp_totals[33];
  const int S1 = a.num_slots + 1;
  const int bins = a.num_experts * S1;
  int* counts = smem;           // [bins]
  int* cursor = smem + bins;    // [bins] running write position
  int* flags = smem + 2 * bins; // [bins + 2 (S + 1)] scratch for compaction scans
  // Pairs per token: the k routed ones, then the shared expert's (shared_expert >= 0).
  const int kp = a.top_k + (a.shared_expert >= 0 ? 1 : 0);
  const int P = a.max_tokens * kp;
  const int tid = threadIdx.x;
  // The quant kernel after this one waits for our completion before it reads or triggers.
  ::moelora::cuda::sm90::launch_dependents();
  ::moelora::cuda::sm90::grid_dependency_wait();
  const int valid_tokens = a.num_tokens ? *a.num_tokens : a.max_tokens;
  // Local expert of pair p (-1: none on this launch) and its bin's slot (-1 = base).
  auto pair_expert = [&](int p, int& slot) {
    const int t = p / kp, j = p % kp;
    if (j == a.top_k) {  // the shared expert's pair: base bin, valid tokens only
      slot = -1;
      return t < valid_tokens ? a.shared_expert : -1;
    }
    const int e = a.topk_ids[t * a.top_k + j] - a.expert_begin;  // -1 (no pair) stays negative
    slot = a.slot ? a.slot[t] : -1;
    return e >= 0 && e < a.num_experts ? e : -1;
  };

  for (int b = tid; b < bins; b += kThreads) counts[b] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += kThreads) {
    int s;
    const int e = pair_expert(p, s);
    if (e < 0) {
      a.pair_pos[p] = -1;
      continue;
    }
    atomicAdd(&counts[e * S1 + (s + 1)], 1);
  }
  __syncthreads();
  for (int b = tid; b < bins; b += kThreads) cursor[b] = counts[b];
  __syncthreads();
  const int total = block_exclusive_scan(cursor, bins, warp_totals);
  for (int e = tid; e < a.num_experts; e += kThreads) a.expert_offsets[e] = cursor[e * S1];
  if (tid == 0) a.expert_offsets[a.num_experts] = total;
  __syncthreads();

  // Scatter. Positions are exact (cursor starts at the bin offset); only the order inside a bin
  // depends on atomic timing.
  for (int p = tid; p < P; p += kThreads) {
    int s;
    const int e = pair_expert(p, s);
    if (e < 0) continue;
    const int pos = atomicAdd(&cursor[e * S1 + (s + 1)], 1);
    a.sorted_pair[pos] = p;
    a.sorted_token[pos] = p / kp;
    a.pair_pos[p] = pos;
    if (a.sorted_slot_expert) a.sorted_slot_expert[pos] = make_int2(s, e);
  }
  __syncthreads();
  // After the scatter cursor[b] = end of bin b; begin = cursor[b] - counts[b].

  // Active experts, ascending: flags[e] = 1 when expert e has pairs, scanned in place into the
  // expert's index in the compact list.
  for (int e = tid; e < a.num_experts; e += kThreads) {
    int c = 0;
    for (int s = 0; s < S1; ++s) c += counts[e * S1 + s];
    flags[e] = c > 0 ? 1 : 0;
    a.active_experts[e] = -1;
  }
  __syncthreads();
  const int num_active = block_exclusive_scan(flags, a.num_experts, warp_totals);
  for (int e = tid; e < a.num_experts; e += kThreads) {
    int c = 0;
    for (int s = 0; s < S1; ++s) c += counts[e * S1 + s];
    if (c > 0) a.active_experts[flags[e]] = e;
  }
  if (tid == 0) *a.num_active = num_active;
  __syncthreads();

  // LoRA segments: bins with slot >= 0 and pairs, in bin order.
  if (a.lora_segments && a.num_slots > 0) {
    for (int b = tid; b < bins; b += kThreads) flags[b] = (b % S1 != 0 && counts[b] > 0) ? 1 : 0;
    __syncthreads();
    const int num_segments = block_exclusive_scan(flags, bins, warp_totals);
    for (int b = tid; b < bins; b += kThreads) {
      if (b % S1 == 0 || counts[b] == 0) continue;
      const int i = flags[b];
      if (i < a.max_lora_segments) {
        const int end = cursor[b];
        a.lora_segments[i] = make_int4(b % S1 - 1, b / S1, end - counts[b], end);
      }
    }
    if (tid == 0) *a.num_lora_segments = min(num_segments, a.max_lora_segments);
  } else if (a.num_lora_segments && tid == 0) {
    *a.num_lora_segments = 0;
  }

  // Tokens by slot. The stable order (ascending token inside a slot) is built with one warp
  // ballot per 32 tokens, serially over chunks: T is at most a few thousand here.
  if (a.token_sorted && a.num_slots > 0) {
    __syncthreads();
    const int valid = valid_tokens;
    int* slot_count = flags;            // [S + 1]
    int* slot_cursor = flags + S1;      // [S + 1]
    for (int s = tid; s < S1; s += kThreads) slot_count[s] = 0;
    __syncthreads();
    for (int t = tid; t < valid; t += kThreads) atomicAdd(&slot_count[(a.slot ? a.slot[t] : -1) + 1], 1);
    __syncthreads();
    if (tid == 0) {
      int run = 0, segments = 0;
      for (int s = 0; s < S1; ++s) {
        slot_cursor[s] = run;
        if (s > 0 && slot_count[s] > 0) {
          a.token_segments[segments++] = make_int4(s - 1, 0, run, run + slot_count[s]);
        }
        run += slot_count[s];
      }
      *a.num_token_segments = segments;
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // one warp, chunks of 32 tokens in order: stable
      const int lane = threadIdx.x;
      for (int t0 = 0; t0 < a.max_tokens; t0 += 32) {
        const int t = t0 + lane;
        const bool real = t < valid;
        const int s1 = real ? (a.slot ? a.slot[t] : -1) + 1 : -1;
        const unsigned same = __match_any_sync(0xffffffffu, s1);
        const int rank = __popc(same & ((1u << lane) - 1u));
        int pos = -1;
        if (real) pos = slot_cursor[s1] + rank;
        __syncwarp();
        // the highest lane of each group advances that slot's cursor
        if (real && (same >> lane) == 1u) slot_cursor[s1] += __popc(same);
        __syncwarp();
        if (t < a.max_tokens) {
          a.token_pos[t] = pos;
          if (real) a.token_sorted[pos] = t;
          // the shared pair's sorted row (written by the scatter above, before a barrier)
          if (real && a.token_shared_row) a.token_shared_row[pos] = a.pair_pos[t * kp + a.top_k];
        }
      }
    }
  }
}

// Decode sizes (at most kRankPairs pairs): the pairs sorted by rank instead of by bin counts. Each
// thread holds one pair's key (bin << 16 | p; bin = e (S + 1) + slot + 1 as above) and its sorted
// position is the number of smaller keys, so the bins are never materialised: E (S + 1) bin
// counters, three block scans and ~20 barriers of 1,024 threads become three barriers of 128
// threads, whatever S. Offsets, active experts and the pair and token segments come from the
// sorted keys (binary searches and warp ballots). The order inside a bin is ascending p, the CPU
// reference's.
// kRankPairs = the CTA's threads (kMoeAlignRankedMaxPairs, a multiple of 32). With 512 (one H100,
// bench/results/h200/h100/align_ranked/c1) the ranked form was 1-3.6 us faster than the counted
// one at 1-8 tokens of qwen3.5 (two-round means), even at 16, 0.5-2 us slower at 32 and 4-9 us at
// 64 tokens (k = 8), where each thread's rank loop reads 512 keys; 128 (c2) took 3-4.7 us off the
// LoRA rows at 1-16 tokens.
constexpr int kRankPairs = kMoeAlignRankedMaxPairs;
static_assert(kRankPairs % 32 == 0 && kRankPairs <= 1024);
constexpr int kRankWarps = kRankPairs / 32;
constexpr uint32_t kNoKey = 0xffffffffu;

// First index in sorted[0, n) whose key is >= key.
__device__ __forceinline__ int lower_bound_key(const uint32_t* sorted, int n, uint32_t key) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (sorted[mid] < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Number of keys in keys[0, n) (n a multiple of 4, 16-byte aligned) below `key`.
__device__ __forceinline__ int count_below(const uint32_t* keys, int n, uint32_t key) {
  int below = 0;
  const uint4* k4 = reinterpret_cast<const uint4*>(keys);
#pragma unroll 4
  for (int i = 0; i < n / 4; ++i) {
    const uint4 v = k4[i];
    below += (v.x < key) + (v.y < key) + (v.z < key) + (v.w < key);
  }
  return below;
}

// Exclusive prefixes over the CTA of kFlags flags per thread (ballots, warp totals in
// warp_counts[f]); total[f] gets the CTA's sum. One barrier: every thread calls it.
template <int kFlags>
__device__ __forceinline__ void block_flag_prefix(const bool (&flag)[kFlags],
                                                  int (*warp_counts)[kRankWarps],
                                                  int (&before)[kFlags], int (&total)[kFlags]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned ballot[kFlags];
#pragma unroll
  for (int f = 0; f < kFlags; ++f) {
    ballot[f] = __ballot_sync(0xffffffffu, flag[f]);
    if (lane == 0) warp_counts[f][warp] = __popc(ballot[f]);
  }
  __syncthreads();
#pragma unroll
  for (int f = 0; f < kFlags; ++f) {
    int b = 0, t = 0;
#pragma unroll
    for (int w = 0; w < kRankWarps; ++w) {
      const int c = warp_counts[f][w];
      b += w < warp ? c : 0;
      t += c;
    }
    before[f] = b + __popc(ballot[f] & ((1u << lane) - 1u));
    total[f] = t;
  }
}

__global__ void __launch_bounds__(kRankPairs) moe_align_rank_kernel(const MoeAlignDeviceArgs a) {
  __shared__ alignas(16) uint32_t pair_key[kRankPairs];    // by pair
  __shared__ alignas(16) uint32_t sorted_key[kRankPairs];  // [total]
  __shared__ alignas(16) uint32_t token_key[kRankPairs];   // by token: (slot + 1) << 16 | t
  __shared__ alignas(16) uint32_t sorted_token_key[kRankPairs];
  __shared__ int pair_rank[kRankPairs];
  __shared__ int warp_counts[4][kRankWarps];
  const int S1 = a.num_slots + 1;
  const int kp = a.top_k + (a.shared_expert >= 0 ? 1 : 0);
  const int P = a.max_tokens * kp, T = a.max_tokens;
  const int tid = threadIdx.x;
  const bool token_sort = a.token_sorted && a.num_slots > 0;
  ::moelora::cuda::sm90::launch_dependents();
  ::moelora::cuda::sm90::grid_dependency_wait();
  const int valid_tokens = a.num_tokens ? *a.num_tokens : a.max_tokens;

  // 1. keys. Keys past P (and pairs without a local expert) are kNoKey: they rank after all.
  uint32_t key = kNoKey;
  int slot = -1, expert = -1;
  if (tid < P) {
    const int t = tid / kp, j = tid % kp;
    if (j == a.top_k) {  // the shared expert's pair: base bin, valid tokens only
      expert = t < valid_tokens ? a.shared_expert : -1;
    } else {
      const int e = a.topk_ids[t * a.top_k + j] - a.expert_begin;
      slot = a.slot ? a.slot[t] : -1;
      expert = e >= 0 && e < a.num_experts ? e : -1;
    }
    if (expert >= 0) key = static_cast<uint32_t>(expert * S1 + slot + 1) << 16 | tid;
  }
  pair_key[tid] = key;
  if (token_sort) {
    uint32_t tk = kNoKey;
    if (tid < valid_tokens && tid < T)
      tk = static_cast<uint32_t>((a.slot ? a.slot[tid] : -1) + 1) << 16 | tid;
    token_key[tid] = tk;
  }
  int ignored[1], valid_pairs[1];
  block_flag_prefix<1>({key != kNoKey}, &warp_counts[0], ignored, valid_pairs);  // keys stored
  const int total = valid_pairs[0];

  // 2. ranks and the scatter.
  const int round_p = (P + 3) & ~3;
  int rank = -1;
  if (key != kNoKey) {
    rank = count_below(pair_key, round_p, key);
    sorted_key[rank] = key;
    a.sorted_pair[rank] = tid;
    a.sorted_token[rank] = tid / kp;
    if (a.sorted_slot_expert) a.sorted_slot_expert[rank] = make_int2(slot, expert);
  }
  if (tid < P) a.pair_pos[tid] = rank;
  pair_rank[tid] = rank;
  int token_rank = -1;
  if (token_sort && tid < valid_tokens && tid < T) {
    token_rank = count_below(token_key, (T + 3) & ~3, token_key[tid]);
    sorted_token_key[token_rank] = token_key[tid];
  }
  __syncthreads();  // sorted keys (and pair ranks) complete

  // 3. expert offsets: the first sorted key of each expert's bins.
  for (int e = tid; e <= a.num_experts; e += kRankPairs)
    a.expert_offsets[e] = e == a.num_experts ? total
                                             : lower_bound_key(sorted_key, total,
                                                               static_cast<uint32_t>(e * S1) << 16);
  // Active experts and LoRA segments: the sorted positions where an expert / a slotted bin starts.
  const int q = tid;
  const uint32_t bin = q < total ? sorted_key[q] >> 16 : 0;
  const uint32_t prev_bin = q > 0 && q < total ? sorted_key[q - 1] >> 16 : 0xffffu;
  const int e_q = static_cast<int>(bin) / S1, s_q = static_cast<int>(bin) % S1 - 1;
  const bool expert_start = q < total && (q == 0 || static_cast<int>(prev_bin) / S1 != e_q);
  const bool segment_start =
      a.num_slots > 0 && q < total && s_q >= 0 && (q == 0 || prev_bin != bin);
  // Token segments: the sorted token positions where a slot >= 0 starts.
  const int valid = min(valid_tokens, T);
  const uint32_t token_slot1 = token_sort && q < valid ? sorted_token_key[q] >> 16 : 0;
  const bool token_segment_start =
      token_slot1 > 0 && (q == 0 || (sorted_token_key[q - 1] >> 16) != token_slot1);
  int index[3], count[3];
  block_flag_prefix<3>({expert_start, segment_start, token_segment_start}, &warp_counts[1], index,
                       count);
  const int active_index = index[0], num_active = count[0];
  const int segment_index = index[1], num_segments = count[1];
  if (expert_start) a.active_experts[active_index] = e_q;
  for (int i = num_active + tid; i < a.num_experts; i += kRankPairs) a.active_experts[i] = -1;
  if (tid == 0) *a.num_active = num_active;
  if (a.lora_segments && a.num_slots > 0) {
    if (segment_start && segment_index < a.max_lora_segments)
      a.lora_segments[segment_index] =
          make_int4(s_q, e_q, q, lower_bound_key(sorted_key, total, (bin + 1) << 16));
    if (tid == 0) *a.num_lora_segments = min(num_segments, a.max_lora_segments);
  } else if (a.num_lora_segments && tid == 0) {
    *a.num_lora_segments = 0;
  }

  // Tokens by slot: ascending token inside a slot (the key's low bits), padding tokens -1.
  if (token_sort) {
    if (tid < T) a.token_pos[tid] = token_rank;
    if (token_rank >= 0) {
      a.token_sorted[token_rank] = tid;
      if (a.token_shared_row) a.token_shared_row[token_rank] = pair_rank[tid * kp + a.top_k];
    }
    if (token_segment_start)
      a.token_segments[index[2]] =
          make_int4(static_cast<int>(token_slot1) - 1, 0, q,
                    lower_bound_key(sorted_token_key, valid, (token_slot1 + 1) << 16));
    if (tid == 0) *a.num_token_segments = count[2];
  }
}

}  // namespace

size_t moe_align_smem_bytes(int num_experts, int num_slots) {
  const size_t bins = static_cast<size_t>(num_experts) * (num_slots + 1);
  return (3 * bins + 2 * static_cast<size_t>(num_slots + 1)) * sizeof(int);
}

void launch_moe_align(const MoeAlignDeviceArgs& a, cudaStream_t stream) {
  MOELORA_CHECK(a.topk_ids && a.expert_offsets && a.sorted_pair && a.sorted_token && a.pair_pos &&
                    a.active_experts && a.num_active,
                ErrorCode::kInvalidArgument, "moe_align: a required device pointer is null");
  MOELORA_CHECK(a.num_experts > 0 && a.top_k > 0 && a.num_slots >= 0 && a.expert_begin >= 0,
                ErrorCode::kInvalidArgument, "moe_align: E = ", a.num_experts, ", k = ", a.top_k,
                ", S = ", a.num_slots, ", expert_begin = ", a.expert_begin);
  const size_t smem = moe_align_smem_bytes(a.num_experts, a.num_slots);
  MOELORA_CHECK(smem <= 200 * 1024, ErrorCode::kUnsupported, "moe_align: E * (S + 1) = ",
                a.num_experts * (a.num_slots + 1), " bins need ", smem, " bytes of shared memory; at most 200 KB");
  MOELORA_CHECK(a.num_slots == 0 || (a.lora_segments && a.num_lora_segments), ErrorCode::kInvalidArgument,
                "moe_align: lora_segments and num_lora_segments are required when S > 0");
  MOELORA_CHECK(a.shared_expert >= -1 && a.shared_expert < a.num_experts &&
                    (a.shared_expert < 0 || a.expert_begin == 0),
                ErrorCode::kInvalidArgument, "moe_align: shared_expert = ", a.shared_expert,
                " must be -1 or a local expert in [0, ", a.num_experts,
                ") of a launch that holds all experts (expert_begin = ", a.expert_begin, ")");
  MOELORA_CHECK(!a.token_shared_row || (a.shared_expert >= 0 && a.token_sorted),
                ErrorCode::kInvalidArgument,
                "moe_align: token_shared_row needs shared_expert >= 0 and token_sorted");
  // Opt in once to 200 KB: the 48 KB default bounds static + dynamic shared memory together, so a
  // dynamic size just under 48 KB failed to launch with this kernel's static part; not a stream
  // operation, so capture-safe.
  static const bool opted_in = [] {
    MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_align_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    return true;
  }();
  (void)opted_in;
  // Decode sizes take the ranked form. Its keys hold the bin in 16 bits and the pair in 16: the
  // shared-memory bound above already keeps E * (S + 1) under 17,067 bins.
  static_assert(200 * 1024 / (3 * sizeof(int)) < (1 << 16) - 1);
  const int kp = a.top_k + (a.shared_expert >= 0 ? 1 : 0);
  if (static_cast<int64_t>(a.max_tokens) * kp <= kRankPairs) {
    ::moelora::cuda::launch_kernel(moe_align_rank_kernel, dim3(1), dim3(kRankPairs), 0, stream,
                                   a.pdl, a);
    return;
  }
  ::moelora::cuda::launch_kernel(moe_align_kernel, dim3(1), dim3(kThreads), smem, stream, a.pdl, a);
}

}  // namespace moelora::ops::cuda
