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
  ::moelora::cuda::launch_kernel(moe_align_kernel, dim3(1), dim3(kThreads), smem, stream, a.pdl, a);
}

}  // namespace moelora::ops::cuda
