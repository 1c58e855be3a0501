// GPU sampler (see sample_cuda.cuh and sample.h). One CTA of 1024 threads per row.
//
// Greedy rows: one pass, (value, index) max reduction with ties to the lower index.
//
// Sampled rows never sort the vocabulary. Tokens are ranked by an order-preserving integer key of
// the logit (descending, ties by lower id), which is the reference's ranking by probability
// wherever the double-precision probabilities of different logits differ. Each token's mass is
// q = round(2^40 * exp2((l - max) * log2(e) / T)), a 64-bit fixed-point number: every sum is an
// integer sum, exact and independent of the order of the atomics, so the result is deterministic
// and all comparisons (top-p threshold, pick) are consistent with each other. Tokens with
// p < 2^-40 (the "tail") get q = 0: they can never be picked, and they rank after every other
// token, so top-k boundaries inside the tail do not change the kept mass.
//
// A "search" finds the first position of the ranking at which the running count reaches
// count_thr or the running mass reaches mass_thr:
//   1. a histogram of (count, mass, min key, max key) over 1024 bins of log2(p) in [-40, 0]
//      (built once per row) -> the first bin where the running totals meet a threshold;
//   2. refinement passes over that bin's key range, 1024 sub-bins each (at most 4 passes: a
//      32-bit key range shrinks at least 512-fold per pass) down to a single key K;
//   3. within the tokens of key K (all of equal mass), the tie index j in id order, by arithmetic.
// Row flow: max pass, histogram pass, search for the end of the kept prefix (count_thr = top_k,
// mass_thr = ceil(top_p * Z)), search for the pick (mass_thr = floor(u * kept) + 1), then one
// ordered pass that finds the id of the j-th token of key K. Histogram updates are aggregated
// over the lanes of a warp that hold the same key (__match_any_sync), so masked (-inf) or tied
// logits do not serialize on one shared-memory address.
#include <cfloat>
#include <climits>
#include <cstdint>

#include "core/cuda_utils.h"
#include "ops/sample/sample_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = kThreads;                 // one bin per thread in the scans
constexpr float kMinLog2 = -40.0f;              // tail: log2 p below this
constexpr float kMassScale = 1099511627776.0f;  // 2^40
constexpr unsigned long long kNoLimit = ~0ull;
constexpr int kMaxRefinePasses = 8;  // 4 suffice; a guard against an endless loop

struct Histogram {
  uint32_t count[kBins];
  unsigned long long mass[kBins];
  uint32_t key_min[kBins];
  uint32_t key_max[kBins];
};

struct SharedState {
  Histogram coarse;
  Histogram fine;
  unsigned long long warp_count[kWarps];
  unsigned long long warp_mass[kWarps];
  float best_value[kWarps];
  int best_index[kWarps];
  int first_bin;
  int token;
};

// Order-preserving key: a larger logit gives a larger key. NaN ranks like -inf, -0 like +0.
__device__ __forceinline__ uint32_t order_key(float l) {
  if (l != l) l = -INFINITY;
  if (l == 0.0f) l = 0.0f;
  const uint32_t bits = __float_as_uint(l);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// log2 of the token's probability relative to the maximum (<= 0; NaN logits give NaN = tail).
__device__ __forceinline__ float log2_prob(float l, float max_logit, float log2_scale) {
  return (l - max_logit) * log2_scale;
}
__device__ __forceinline__ bool in_tail(float t) {
  return !(t >= kMinLog2);
}
__device__ __forceinline__ unsigned long long fixed_mass(float t) {
  return __float2ull_rn(exp2f(t) * kMassScale);
}
__device__ __forceinline__ int coarse_bin(float t) {
  return min(kBins - 1, __float2int_rz(-t * (kBins / -kMinLog2)));
}

__device__ void clear(Histogram& h) {
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
    h.count[b] = 0;
    h.mass[b] = 0;
    h.key_min[b] = 0xffffffffu;
    h.key_max[b] = 0;
  }
}

// Adds `peers` (lanes with the same key) to bin `bin`, once per group, from its lowest lane.
__device__ __forceinline__ void add_group(Histogram& h, int bin, unsigned peers, uint32_t key,
                                          unsigned long long q) {
  if ((threadIdx.x % 32) != __ffs(peers) - 1) return;
  const unsigned n = __popc(peers);
  atomicAdd(&h.count[bin], n);
  atomicAdd(&h.mass[bin], static_cast<unsigned long long>(n) * q);
  atomicMin(&h.key_min[bin], key);
  atomicMax(&h.key_max[bin], key);
}

struct RowContext {
  const float* logits;  // [vocab]
  int vocab;
  float max_logit;
  float log2_scale;
};

// Histogram of the non-tail tokens over bins of log2 p.
__device__ void build_coarse(const RowContext& r, SharedState& s) {
  const int lane = threadIdx.x % 32;
  for (int base = (threadIdx.x / 32) * 32; base < r.vocab; base += kThreads) {  // warp-uniform
    const int i = base + lane;
    const float l = i < r.vocab ? r.logits[i] : -INFINITY;
    const float t = log2_prob(l, r.max_logit, r.log2_scale);
    const bool take = i < r.vocab && !in_tail(t);
    const uint32_t key = order_key(l);
    const unsigned peers =
        __match_any_sync(0xffffffffu, take ? static_cast<unsigned long long>(key) : (1ull << 32));
    if (take) add_group(s.coarse, coarse_bin(t), peers, key, fixed_mass(t));
  }
}

// Histogram of the tokens with key in [lo, hi] over sub-bins (hi - key) >> shift (0 = highest).
__device__ void build_fine(const RowContext& r, SharedState& s, uint32_t lo, uint32_t hi,
                           int shift) {
  const int lane = threadIdx.x % 32;
  for (int base = (threadIdx.x / 32) * 32; base < r.vocab; base += kThreads) {
    const int i = base + lane;
    const float l = i < r.vocab ? r.logits[i] : -INFINITY;
    const uint32_t key = order_key(l);
    const bool take = i < r.vocab && key >= lo && key <= hi;
    const unsigned peers =
        __match_any_sync(0xffffffffu, take ? static_cast<unsigned long long>(key) : (1ull << 32));
    if (take) {
      const int bin = static_cast<int>((hi - key) >> shift);
      add_group(s.fine, bin, peers, key, fixed_mass(log2_prob(l, r.max_logit, r.log2_scale)));
    }
  }
}

// Inclusive scan of (count, mass) over the bins of h (thread b = bin b), offset by `above`; returns
// the first bin whose running totals meet a threshold, or kBins. Ends with all threads synced.
__device__ int first_bin_meeting(const Histogram& h, SharedState& s, unsigned long long above_count,
                                 unsigned long long above_mass, unsigned long long count_thr,
                                 unsigned long long mass_thr, unsigned long long& count_incl,
                                 unsigned long long& mass_incl) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned long long c = h.count[threadIdx.x], m = h.mass[threadIdx.x];
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long oc = __shfl_up_sync(0xffffffffu, c, o);
    const unsigned long long om = __shfl_up_sync(0xffffffffu, m, o);
    if (lane >= o) {
      c += oc;
      m += om;
    }
  }
  if (threadIdx.x == 0) s.first_bin = kBins;
  if (lane == 31) {
    s.warp_count[warp] = c;
    s.warp_mass[warp] = m;
  }
  __syncthreads();
  unsigned long long before_c = above_count, before_m = above_mass;
  for (int w = 0; w < warp; ++w) {
    before_c += s.warp_count[w];
    before_m += s.warp_mass[w];
  }
  count_incl = c + before_c;
  mass_incl = m + before_m;
  if (count_incl >= count_thr || mass_incl >= mass_thr)
    atomicMin(&s.first_bin, static_cast<int>(threadIdx.x));
  __syncthreads();
  return s.first_bin;
}

struct Position {
  bool found = false;
  uint32_t key = 0;
  unsigned long long tie_index =
      0;  // j: the position is the (j+1)-th token of key `key` (id order)
  unsigned long long mass_incl = 0;  // running mass through this position
};

// See the file comment. Block-uniform result; every thread must call it.
__device__ Position search(const RowContext& r, SharedState& s, unsigned long long count_thr,
                           unsigned long long mass_thr) {
  Position pos;
  unsigned long long c_incl, m_incl;
  int bin = first_bin_meeting(s.coarse, s, 0, 0, count_thr, mass_thr, c_incl, m_incl);
  if (bin >= kBins) return pos;
  // The bin's values, read by every thread after the scan's final barrier.
  uint32_t lo = s.coarse.key_min[bin], hi = s.coarse.key_max[bin];
  unsigned long long tie_count = s.coarse.count[bin], tie_mass = s.coarse.mass[bin];
  // Totals ranked before the bin: its inclusive totals minus its own (thread `bin` holds them).
  __shared__ unsigned long long above[2];
  if (threadIdx.x == bin) {
    above[0] = c_incl - tie_count;
    above[1] = m_incl - tie_mass;
  }
  __syncthreads();
  unsigned long long above_count = above[0], above_mass = above[1];
  for (int pass = 0; pass < kMaxRefinePasses && lo != hi; ++pass) {
    int shift = 0;
    while (((hi - lo) >> shift) >= static_cast<uint32_t>(kBins)) ++shift;
    __syncthreads();  // everyone has read the previous fine histogram and `above`
    clear(s.fine);
    __syncthreads();
    build_fine(r, s, lo, hi, shift);
    __syncthreads();
    const int sub =
        first_bin_meeting(s.fine, s, above_count, above_mass, count_thr, mass_thr, c_incl, m_incl);
    if (sub >= kBins) return pos;  // cannot happen: the bin's own totals met a threshold
    lo = s.fine.key_min[sub];
    hi = s.fine.key_max[sub];
    tie_count = s.fine.count[sub];
    tie_mass = s.fine.mass[sub];
    __syncthreads();
    if (threadIdx.x == sub) {
      above[0] = c_incl - tie_count;
      above[1] = m_incl - tie_mass;
    }
    __syncthreads();
    above_count = above[0];
    above_mass = above[1];
  }
  if (lo != hi || tie_count == 0) return pos;
  // All tokens of key K have the same mass q.
  const unsigned long long q = tie_mass / tie_count;
  unsigned long long j = tie_count - 1;
  if (count_thr != kNoLimit)
    j = min(j, count_thr > above_count ? count_thr - above_count - 1 : 0ull);
  if (mass_thr != kNoLimit) {
    if (mass_thr <= above_mass) {
      j = 0;
    } else if (q > 0) {
      const unsigned long long need = mass_thr - above_mass;  // (j + 1) * q >= need
      j = min(j, (need + q - 1) / q - 1);
    }
  }
  pos.found = true;
  pos.key = lo;
  pos.tie_index = j;
  pos.mass_incl = above_mass + (j + 1) * q;
  return pos;
}

// Id of the (j+1)-th token (in id order) whose key is `key`; -1 if there is none.
__device__ int nth_with_key(const RowContext& r, SharedState& s, uint32_t key,
                            unsigned long long j) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Warp w owns the contiguous ids [w * span, (w + 1) * span), walked 32 at a time.
  const int span = ((r.vocab + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int begin = warp * span, end = min(r.vocab, begin + span);
  unsigned long long n = 0;
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    n += __popc(__ballot_sync(0xffffffffu, i < end && order_key(r.logits[i]) == key));
  }
  if (threadIdx.x == 0) s.token = -1;
  if (lane == 0) s.warp_count[warp] = n;
  __syncthreads();
  unsigned long long before = 0;
  for (int w = 0; w < warp; ++w) before += s.warp_count[w];
  if (j >= before && j < before + n) {  // this warp holds the token
    unsigned long long left = j - before;
    for (int base = begin; base < end; base += 32) {
      const int i = base + lane;
      unsigned mask = __ballot_sync(0xffffffffu, i < end && order_key(r.logits[i]) == key);
      const unsigned here = __popc(mask);
      if (left < here) {
        for (unsigned k = 0; k < left; ++k) mask &= mask - 1;  // drop the lower set bits
        if (lane == 0) s.token = base + __ffs(mask) - 1;
        break;
      }
      left -= here;
    }
  }
  __syncthreads();
  return s.token;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const SampleArgs args) {
  __shared__ SharedState s;
  const int row = blockIdx.x;
  const int valid = args.num_rows ? *args.num_rows : args.rows;
  if (row >= valid) return;
  const int64_t stride = args.stride ? args.stride : args.vocab;
  RowContext r;
  r.logits = args.logits + static_cast<int64_t>(row) * stride;
  r.vocab = args.vocab;
  const SampleRowParams params = args.params[row];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // ---- max and first argmax (NaN counts as -inf)
  float best = -INFINITY;
  int best_index = INT_MAX;
  for (int i = threadIdx.x; i < r.vocab; i += kThreads) {
    float v = r.logits[i];
    if (v != v) v = -INFINITY;
    if (v > best || (v == best && i < best_index)) {
      best = v;
      best_index = i;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_index, o);
    if (ov > best || (ov == best && oi < best_index)) {
      best = ov;
      best_index = oi;
    }
  }
  if (lane == 0) {
    s.best_value[warp] = best;
    s.best_index[warp] = best_index;
  }
  __syncthreads();
  best = s.best_value[0];
  best_index = s.best_index[0];
  for (int w = 1; w < kWarps; ++w) {
    if (s.best_value[w] > best || (s.best_value[w] == best && s.best_index[w] < best_index)) {
      best = s.best_value[w];
      best_index = s.best_index[w];
    }
  }
  const float log2_scale = 1.4426950408889634f / params.temperature;
  // Greedy: temperature <= 0, and the degenerate rows softmax cannot handle (a +inf logit, a
  // temperature so small that the scale overflows, a row of -inf).
  if (!(params.temperature > 0.0f) || !isfinite(best) || !isfinite(log2_scale)) {
    if (threadIdx.x == 0) args.tokens[row] = best_index;
    return;
  }
  r.max_logit = best;
  r.log2_scale = log2_scale;

  // ---- histogram; Z = total mass
  clear(s.coarse);
  __syncthreads();
  build_coarse(r, s);
  __syncthreads();

  unsigned long long total = s.coarse.mass[threadIdx.x];  // integer sum: any order is exact
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane == 0) s.warp_mass[warp] = total;
  __syncthreads();
  total = 0;
  for (int w = 0; w < kWarps; ++w) total += s.warp_mass[w];
  __syncthreads();  // warp_mass is reused by the scans below

  // ---- end of the kept prefix: top-k and top-p
  const unsigned long long count_thr = params.top_k > 0 && params.top_k < r.vocab
                                           ? static_cast<unsigned long long>(params.top_k)
                                           : kNoLimit;
  unsigned long long mass_thr = kNoLimit;
  if (params.top_p < 1.0f) {
    // A token is kept while the mass ranked before it is < top_p * Z, so the last kept token is
    // the first whose running mass is >= ceil(top_p * Z).
    const double limit =
        ceil(static_cast<double>(fmaxf(params.top_p, 0.0f)) * static_cast<double>(total));
    mass_thr = max(1ull, static_cast<unsigned long long>(limit));
  }
  unsigned long long kept = total;
  if (count_thr != kNoLimit || mass_thr != kNoLimit) {
    const Position end = search(r, s, count_thr, mass_thr);
    if (end.found) kept = end.mass_incl;  // else the end lies in the tail, which has no mass
  }

  // ---- the pick: first position whose running mass exceeds u * kept
  const double u = fmin(fmax(static_cast<double>(args.uniform[row]), 0.0), 1.0);
  unsigned long long target = static_cast<unsigned long long>(u * static_cast<double>(kept)) + 1;
  target = min(target, kept);
  const Position pick = search(r, s, kNoLimit, target);
  int token = best_index;
  if (pick.found) {
    const int id = nth_with_key(r, s, pick.key, pick.tie_index);
    if (id >= 0) token = id;
  }
  if (threadIdx.x == 0) args.tokens[row] = token;
}

}  // namespace

void launch_sample(const SampleArgs& args, cudaStream_t stream) {
  MOELORA_CHECK(args.rows >= 0, ErrorCode::kInvalidArgument, "sample: rows must be >= 0, got ",
                args.rows);
  if (args.rows == 0) return;
  MOELORA_CHECK(args.logits && args.params && args.uniform && args.tokens,
                ErrorCode::kInvalidArgument,
                "sample: logits, params, uniform and tokens must be device pointers (got null)");
  MOELORA_CHECK(args.vocab > 0 && args.vocab <= INT_MAX - 32 * kThreads,
                ErrorCode::kInvalidArgument, "sample: vocab must be in [1, ",
                INT_MAX - 32 * kThreads, "], got ", args.vocab);
  MOELORA_CHECK(args.stride == 0 || args.stride >= args.vocab, ErrorCode::kInvalidArgument,
                "sample: stride ", args.stride, " is smaller than vocab ", args.vocab,
                " (0 = vocab)");
  sample_kernel<<<args.rows, kThreads, 0, stream>>>(args);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
