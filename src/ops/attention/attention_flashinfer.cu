// FlashInferAttention (attention_flashinfer.cuh): moelora's paged batch handed to FlashInfer's
// header-only FA2 paged-prefill kernel. Compiled with FlashInfer's headers (and the CCCL they
// bundle) when CMake finds them; without them only compiled() / supports() exist in practice
// (the constructor throws kUnsupported).
#include "ops/attention/attention_flashinfer.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <string>

#include "core/cuda_utils.h"
#include "core/error.h"

#ifdef MOELORA_WITH_FLASHINFER
#include <flashinfer/attention/default_prefill_params.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#endif

namespace moelora::ops::cuda {

bool FlashInferAttention::compiled() {
#ifdef MOELORA_WITH_FLASHINFER
  return true;
#else
  return false;
#endif
}

bool FlashInferAttention::supports(int num_q_heads, int num_kv_heads, int head_dim) {
  return compiled() && num_kv_heads > 0 && num_q_heads > 0 && num_q_heads % num_kv_heads == 0 &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

#ifdef MOELORA_WITH_FLASHINFER

namespace {

namespace fi = flashinfer;
using Bf16 = nv_bfloat16;
using Variant = fi::DefaultAttention</*custom_mask=*/false, /*sliding_window=*/false,
                                     /*soft_cap=*/false, /*alibi=*/false>;
using Params = fi::BatchPrefillPagedParams<Bf16, Bf16, Bf16, int32_t>;

// Query-tile heights FlashInfer's planner picks from (FA2DetermineCtaTileQ) and the largest.
constexpr int kMaxCtaTileQ = 128;

// Pinned host memory, freed with its owner.
struct PinnedHost {
  void* ptr = nullptr;
  explicit PinnedHost(size_t bytes) { MOELORA_CUDA_CHECK(cudaMallocHost(&ptr, bytes)); }
  ~PinnedHost() {
    if (ptr) cudaFreeHost(ptr);
  }
  PinnedHost(const PinnedHost&) = delete;
  PinnedHost& operator=(const PinnedHost&) = delete;
};

template <int D>
cudaError_t run_kernel(const Params& params, Bf16* tmp_v, float* tmp_s, int cta_tile_q, bool pdl,
                       cudaStream_t stream) {
  cudaError_t status = cudaErrorInvalidConfiguration;
  DISPATCH_CTA_TILE_Q(cta_tile_q, CTA_TILE_Q, {
    status = fi::BatchPrefillWithPagedKVCacheDispatched<
        /*SAME_KV_STRIDES=*/true, CTA_TILE_Q, D, D, fi::PosEncodingMode::kNone,
        /*fp16_qk_reduction=*/false, fi::MaskMode::kCausal, /*token_head_sf=*/false, Variant>(
        params, tmp_v, tmp_s, /*enable_pdl=*/pdl, stream);
  });
  return status;
}

}  // namespace

struct FlashInferAttention::Impl {
  FlashInferAttentionShape shape;
  // FlashInfer's schedule (int) and split-KV partials (float) workspaces; the int one is written
  // from a pinned staging copy by each plan.
  ::moelora::cuda::DeviceBuffer float_ws, int_ws;
  std::unique_ptr<PinnedHost> int_staging;
  // CSR view of the batch, int32: page list [max_seqs * max_pages_per_seq] | page offsets
  // [max_seqs + 1] | last-page lengths [max_seqs] | query row offsets [max_seqs + 1]; built in
  // pinned memory by plan() and copied in one go.
  ::moelora::cuda::DeviceBuffer csr;
  std::unique_ptr<PinnedHost> csr_staging;
  size_t at_indptr = 0, at_last = 0, at_q_indptr = 0, csr_bytes = 0;
  // Recorded after each plan's copies: the next plan waits on it before it rewrites the staging.
  ::moelora::cuda::Event copies_done;
  bool copies_pending = false;

  fi::PrefillPlanInfo plan;
  bool planned = false;
  int batch = 0;  // sequences FlashInfer sees in the last plan (0: nothing to run)

  int32_t* staging(size_t at) const { return static_cast<int32_t*>(csr_staging->ptr) + at; }
  int32_t* device(size_t at) const { return csr.as<int32_t>() + at; }
};

FlashInferAttention::FlashInferAttention(const FlashInferAttentionShape& s)
    : impl_(std::make_unique<Impl>()) {
  MOELORA_CHECK(compiled(), ErrorCode::kUnsupported,
                "FlashInferAttention: this build has no FlashInfer kernels");
  MOELORA_CHECK(supports(s.num_q_heads, s.num_kv_heads, s.head_dim), ErrorCode::kUnsupported,
                "FlashInferAttention: heads ", s.num_q_heads, " / ", s.num_kv_heads,
                " of head_dim ", s.head_dim,
                " are not served (head_dim 64, 128 or 256, query heads a multiple of KV heads)");
  MOELORA_CHECK(s.page_size >= 1 && s.max_seqs >= 1 && s.max_tokens >= 1 && s.max_pages_per_seq >= 1,
                ErrorCode::kInvalidArgument, "FlashInferAttention: page_size ", s.page_size,
                ", max_seqs ", s.max_seqs, ", max_tokens ", s.max_tokens, ", max_pages_per_seq ",
                s.max_pages_per_seq, " must all be >= 1");
  Impl& m = *impl_;
  m.shape = s;
  const int group = s.num_q_heads / s.num_kv_heads;
  // The current device, as FlashInfer's planner sees it (cudaGetDevice), not device 0.
  int device = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&device));
  const int num_sms = ::moelora::cuda::device_info(device).num_sms;
  // Bounds of FlashInfer's planner (PrefillPlanImpl): it splits KV only while the work items fit
  // two CTAs per SM per KV head (budget), so split partials need at most budget * 128 / group
  // rows; under CUDA graphs the grid is padded to max(budget, query tiles).
  const int64_t budget = 2LL * num_sms / s.num_kv_heads;
  const int64_t partial_rows = (budget * kMaxCtaTileQ + group - 1) / group;
  const size_t float_bytes =
      static_cast<size_t>(s.num_q_heads) * partial_rows * (s.head_dim + 1) * sizeof(float) + (1 << 20);
  const int64_t tiles = (static_cast<int64_t>(s.max_tokens) * group + 15) / 16 + s.max_seqs;
  const int64_t padded = std::max(budget, tiles);
  const size_t int_bytes =
      static_cast<size_t>(4 * padded + 2 * s.max_seqs + s.max_tokens + 64) * sizeof(int32_t) + (1 << 20);
  m.float_ws = ::moelora::cuda::DeviceBuffer(float_bytes);
  m.int_ws = ::moelora::cuda::DeviceBuffer(int_bytes);
  m.int_staging = std::make_unique<PinnedHost>(int_bytes);
  m.at_indptr = static_cast<size_t>(s.max_seqs) * s.max_pages_per_seq;
  m.at_last = m.at_indptr + s.max_seqs + 1;
  m.at_q_indptr = m.at_last + s.max_seqs;
  m.csr_bytes = (m.at_q_indptr + s.max_seqs + 1) * sizeof(int32_t);
  m.csr = ::moelora::cuda::DeviceBuffer(m.csr_bytes);
  m.csr_staging = std::make_unique<PinnedHost>(m.csr_bytes);
}

FlashInferAttention::~FlashInferAttention() = default;

const FlashInferAttentionShape& FlashInferAttention::shape() const { return impl_->shape; }

void FlashInferAttention::plan(const FlashInferHostBatch& batch, bool decode, cudaStream_t stream) {
  Impl& m = *impl_;
  const FlashInferAttentionShape& s = m.shape;
  const ErrorCode bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(batch.seqs >= 0 && batch.seqs <= s.max_seqs, bad,
                "FlashInferAttention::plan: batch.seqs = ", batch.seqs, ", expected 0 .. max_seqs = ",
                s.max_seqs);
  if (m.copies_pending) MOELORA_CUDA_CHECK(cudaEventSynchronize(m.copies_done.get()));
  m.copies_pending = false;
  m.planned = false;
  int32_t* indices = m.staging(0);
  int32_t* indptr = m.staging(m.at_indptr);
  int32_t* last = m.staging(m.at_last);
  int32_t* q_indptr = m.staging(m.at_q_indptr);
  const int64_t max_kv = static_cast<int64_t>(s.max_pages_per_seq) * s.page_size;
  indptr[0] = 0;
  q_indptr[0] = 0;
  int64_t pages = 0, rows = 0;
  for (int b = 0; b < batch.seqs; ++b) {
    int64_t q = batch.q_len[b], kv = batch.kv_len[b], np = 0;
    MOELORA_CHECK(q >= 0, bad, "FlashInferAttention::plan: q_len[", b, "] = ", q);
    if (q == 0) {
      // No rows: a padding sequence. Decode plans give it one position of page 0 (its table row
      // and kv_len may hold anything; page 0 always exists) so that every plan of a bucket has
      // the same shape; general plans give it nothing to read.
      kv = decode ? 1 : 0;
      np = decode ? 1 : 0;
      if (decode) {
        q = 1;
        indices[pages] = 0;
      }
    } else {
      MOELORA_CHECK(kv >= q && kv <= max_kv, bad, "FlashInferAttention::plan: sequence ", b,
                    " has q_len ", q, " and kv_len ", kv, " (need q_len <= kv_len <= ", max_kv,
                    ", the page table's capacity)");
      if (decode) {
        MOELORA_CHECK(q == 1 && batch.q_start[b] == b, bad, "FlashInferAttention::plan (decode): "
                      "sequence ", b, " has q_len ", q, " at row ", batch.q_start[b],
                      "; decode plans take one row per sequence, row b for sequence b");
      } else {
        MOELORA_CHECK(batch.q_start[b] == rows, bad, "FlashInferAttention::plan: sequence ", b,
                      " starts at row ", batch.q_start[b], ", expected ", rows,
                      " (rows must be back to back in sequence order)");
      }
      np = (kv + s.page_size - 1) / s.page_size;
      const int32_t* table = batch.page_table + static_cast<size_t>(b) * s.max_pages_per_seq;
      for (int64_t i = 0; i < np; ++i) {
        MOELORA_CHECK(table[i] >= 0, bad, "FlashInferAttention::plan: sequence ", b,
                      " has page_table[", i, "] = ", table[i], " within its kv_len ", kv);
        indices[pages + i] = table[i];
      }
    }
    pages += np;
    indptr[b + 1] = static_cast<int32_t>(pages);
    last[b] = static_cast<int32_t>(np > 0 ? kv - (np - 1) * s.page_size : 0);
    rows += q;
    q_indptr[b + 1] = static_cast<int32_t>(rows);
  }
  MOELORA_CHECK(rows <= s.max_tokens, bad, "FlashInferAttention::plan: ", rows,
                " query rows (the sum of q_len), more than max_tokens = ", s.max_tokens);
  m.batch = rows > 0 ? batch.seqs : 0;
  if (m.batch == 0) {
    m.planned = true;
    return;
  }
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(m.csr.get(), m.csr_staging->ptr, m.csr_bytes,
                                     cudaMemcpyHostToDevice, stream));
  m.copies_done.record(stream);  // also if the planner fails below
  m.copies_pending = true;
  cudaError_t status = cudaSuccess;
  try {
    status = fi::PrefillPlan<int32_t>(
        m.float_ws.get(), m.float_ws.bytes(), m.int_ws.get(), m.int_staging->ptr, m.int_ws.bytes(),
        m.plan, q_indptr, indptr, static_cast<uint32_t>(rows), static_cast<uint32_t>(batch.seqs),
        s.num_q_heads, s.num_kv_heads, s.head_dim, s.head_dim, s.page_size,
        /*enable_cuda_graph=*/decode, /*sizeof_dtype_o=*/2, /*window_left=*/-1,
        /*fixed_split_size=*/-1, /*disable_split_kv=*/false, /*num_colocated_ctas=*/0,
        /*uniform_q_len=*/decode ? 1 : 0, /*fixed_uniform_q_len=*/decode, stream);
  } catch (const std::exception& e) {
    MOELORA_THROW(ErrorCode::kInternal, "FlashInferAttention::plan: FlashInfer's planner: ", e.what());
  }
  MOELORA_CHECK(status == cudaSuccess, ErrorCode::kCuda, "FlashInferAttention::plan (",
                batch.seqs, " sequences, ", rows, " rows, decode ", decode, "): FlashInfer's planner: ",
                cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
  m.copies_done.record(stream);  // after the planner's own copy of its schedule

  m.planned = true;
}

void FlashInferAttention::launch(const PagedAttentionArgs& args, cudaStream_t stream) const {
  const Impl& m = *impl_;
  const FlashInferAttentionShape& s = m.shape;
  const ErrorCode bad = ErrorCode::kInvalidArgument;
  MOELORA_CHECK(m.planned, bad, "FlashInferAttention::launch before plan() (or after a plan() that failed)");
  MOELORA_CHECK(args.num_q_heads == s.num_q_heads && args.cache.num_kv_heads == s.num_kv_heads &&
                    args.cache.head_dim == s.head_dim && args.cache.v_head_dim == s.head_dim &&
                    args.cache.page_size == s.page_size,
                bad, "FlashInferAttention::launch: heads ", args.num_q_heads, " / ",
                args.cache.num_kv_heads, ", head dims ", args.cache.head_dim, " / ",
                args.cache.v_head_dim, ", page size ", args.cache.page_size, "; planned for ",
                s.num_q_heads, " / ", s.num_kv_heads, ", ", s.head_dim, ", ", s.page_size);
  // FlashInfer loads q / k / v and stores out in 16-byte vectors and indexes rows in 32 bits.
  const auto check_pointer = [&](const void* p, const char* name) {
    MOELORA_CHECK(p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0, bad,
                  "FlashInferAttention::launch: ", name, " = ", p, " must be non-null and 16-byte aligned");
  };
  check_pointer(args.q, "q");
  check_pointer(args.out, "out");
  check_pointer(args.cache.k, "cache.k");
  check_pointer(args.cache.v, "cache.v");
  const int64_t row = int64_t(s.num_q_heads) * s.head_dim;
  MOELORA_CHECK(args.q_stride >= row && args.q_stride % 8 == 0 &&
                    (int64_t(s.max_tokens) - 1) * args.q_stride + row < (int64_t(1) << 31) &&
                    int64_t(s.max_tokens) * row < (int64_t(1) << 31),
                bad, "FlashInferAttention::launch: q_stride = ", args.q_stride,
                " (need a multiple of 8, >= Hq * D = ", row, ", and max_tokens = ", s.max_tokens,
                " rows of q and out addressable in 31 bits)");
  if (m.batch == 0) return;
  // A general plan sizes the grid and the split merge for its own batch; only decode plans keep
  // one launch configuration for every batch of a bucket (see the header).
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOELORA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  MOELORA_CHECK(capturing == cudaStreamCaptureStatusNone || m.plan.enable_cuda_graph, bad,
                "FlashInferAttention::launch: a CUDA graph is being captured after a general "
                "plan; only decode plans (plan(..., decode = true)) may be captured");
  const int D = s.head_dim;
  fi::paged_kv_t<Bf16, int32_t> kv(
      s.num_kv_heads, s.page_size, D, m.batch, fi::QKVLayout::kNHD,
      reinterpret_cast<Bf16*>(args.cache.k), reinterpret_cast<Bf16*>(args.cache.v), m.device(0),
      m.device(m.at_indptr), m.device(m.at_last));
  const float scale = args.scale > 0 ? args.scale : 1.0f / std::sqrt(static_cast<float>(D));
  Params p(const_cast<Bf16*>(reinterpret_cast<const Bf16*>(args.q)), kv, /*custom_mask=*/nullptr,
           m.device(m.at_q_indptr), /*mask_indptr=*/nullptr, /*q_rope_offset=*/nullptr,
           reinterpret_cast<Bf16*>(args.out), /*lse=*/nullptr, /*alibi=*/nullptr, s.num_q_heads,
           static_cast<int32_t>(args.q_stride), D, /*window_left=*/-1, /*soft_cap=*/0.0f, scale,
           /*rope_scale=*/1.0f, /*rope_theta=*/1e4f);
  void* ib = m.int_ws.get();
  const fi::PrefillPlanInfo& plan = m.plan;
  p.request_indices = fi::GetPtrFromBaseOffset<int32_t>(ib, plan.request_indices_offset);
  p.qo_tile_indices = fi::GetPtrFromBaseOffset<int32_t>(ib, plan.qo_tile_indices_offset);
  p.kv_tile_indices = fi::GetPtrFromBaseOffset<int32_t>(ib, plan.kv_tile_indices_offset);
  p.o_indptr = fi::GetPtrFromBaseOffset<int32_t>(ib, plan.o_indptr_offset);
  p.kv_chunk_size_ptr = fi::GetPtrFromBaseOffset<int32_t>(ib, plan.kv_chunk_size_ptr_offset);
  Bf16* tmp_v = nullptr;
  float* tmp_s = nullptr;
  if (plan.split_kv) {
    p.merge_indptr = fi::GetPtrFromBaseOffset<int32_t>(ib, plan.merge_indptr_offset);
    tmp_v = fi::GetPtrFromBaseOffset<Bf16>(m.float_ws.get(), plan.v_offset);
    tmp_s = fi::GetPtrFromBaseOffset<float>(m.float_ws.get(), plan.s_offset);
  }
  p.padded_batch_size = static_cast<uint32_t>(plan.padded_batch_size);
  p.max_total_num_rows = static_cast<uint32_t>(plan.total_num_rows);
  p.partition_kv = plan.split_kv;
  if (plan.enable_cuda_graph) {
    p.block_valid_mask = fi::GetPtrFromBaseOffset<bool>(ib, plan.block_valid_mask_offset);
    p.total_num_rows = fi::GetPtrFromBaseOffset<uint32_t>(ib, plan.total_num_rows_offset);
  }
  const int tile = static_cast<int>(plan.cta_tile_q);
  cudaError_t status = cudaErrorInvalidValue;
  try {
    const bool pdl = s.programmatic_launch;
    if (D == 64)
      status = run_kernel<64>(p, tmp_v, tmp_s, tile, pdl, stream);
    else if (D == 128)
      status = run_kernel<128>(p, tmp_v, tmp_s, tile, pdl, stream);
    else
      status = run_kernel<256>(p, tmp_v, tmp_s, tile, pdl, stream);
  } catch (const std::exception& e) {
    MOELORA_THROW(ErrorCode::kInternal, "FlashInferAttention::launch: FlashInfer: ", e.what());
  }
  MOELORA_CHECK(status == cudaSuccess, ErrorCode::kCuda, "FlashInferAttention::launch (",
                m.batch, " sequences, Hq ", s.num_q_heads, ", D ", D, ", query tile ", tile,
                "): ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
}

#else  // !MOELORA_WITH_FLASHINFER

struct FlashInferAttention::Impl {
  FlashInferAttentionShape shape;
};

FlashInferAttention::FlashInferAttention(const FlashInferAttentionShape&) {
  MOELORA_THROW(ErrorCode::kUnsupported,
                "FlashInferAttention: this build has no FlashInfer kernels (scripts/setup fetches "
                "their headers into .deps/flashinfer; reconfigure)");
}
FlashInferAttention::~FlashInferAttention() = default;
const FlashInferAttentionShape& FlashInferAttention::shape() const { return impl_->shape; }
void FlashInferAttention::plan(const FlashInferHostBatch&, bool, cudaStream_t) {}
void FlashInferAttention::launch(const PagedAttentionArgs&, cudaStream_t) const {}

#endif  // MOELORA_WITH_FLASHINFER

}  // namespace moelora::ops::cuda
