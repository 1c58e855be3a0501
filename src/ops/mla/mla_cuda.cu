// MLA pieces around the attention kernel (mla_cuda.cuh): the latent cache append, the query
// absorption and output projection as cuBLAS GEMMs batched over heads, and the factored LoRA of
// kv_b_proj. The attention itself is in mla_attention_cuda.cu.
//
// kv_b_proj [n (nope + dv), r] row-major holds per head h W_UK[h] [nope, r] (rows h (nope + dv) ..)
// and W_UV[h] [dv, r] (the next dv rows), so head h's slices are a fixed stride (nope + dv) r
// apart: exactly a strided batch. cuBLAS is column-major; a row-major [R, C] matrix is its [C, R]
// transpose.
#include <algorithm>
#include <cstdint>

#include "core/cuda_utils.h"
#include "ops/mla/mla_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kAppendThreads = 128;
constexpr int kCopyThreads = 256;
constexpr int kLoraThreads = 128;
constexpr int kLoraMaxRank = 256;

void check_cublas(cublasStatus_t status, const char* what) {
  MOELORA_CHECK(status == CUBLAS_STATUS_SUCCESS, ErrorCode::kCuda, what,
                " failed with cuBLAS status ", static_cast<int>(status));
}

void check_shape(const MlaShape& shape, const char* what) {
  MOELORA_CHECK(shape.num_heads > 0 && shape.nope > 0 && shape.rope >= 0 && shape.v_dim > 0,
                ErrorCode::kInvalidArgument, what, ": MLA shape num_heads ", shape.num_heads,
                ", nope ", shape.nope, ", rope ", shape.rope, ", v_dim ", shape.v_dim,
                " (num_heads, nope, v_dim > 0, rope >= 0)");
  MOELORA_CHECK(shape.rank > 0 && shape.rank % 8 == 0 && shape.rank <= 512, ErrorCode::kUnsupported,
                what, ": kv_lora_rank ", shape.rank,
                " unsupported; must be a multiple of 8 in [8, 512]");
}

// One CTA per token row: copies c_kv [r] and k_rope [rope] into the row's page slot.
// grid (max_tokens), kAppendThreads threads.
__global__ void __launch_bounds__(kAppendThreads) mla_cache_append_kernel(const MlaAppendArgs p) {
  const int token = blockIdx.x;
  const AttentionBatch& batch = p.batch;
  const int seq = batch.token_seq[token];
  if (seq < 0 || seq >= batch.max_seqs) return;  // padding row
  const int pos = batch.token_pos[token];
  if (pos < 0) return;
  const int page_index = pos / p.cache.page_size;
  if (page_index >= batch.max_pages_per_seq) return;
  const int page =
      batch.page_table[static_cast<int64_t>(seq) * batch.max_pages_per_seq + page_index];
  if (page < 0) return;
  const int rank = p.shape.rank, rope = p.shape.rope, dim = rank + rope;
  bf16* dst =
      p.cache.kv + (static_cast<int64_t>(page) * p.cache.page_size + pos % p.cache.page_size) * dim;
  const bf16* c_kv = p.c_kv + static_cast<int64_t>(token) * p.c_kv_stride;
  const bf16* k_rope = p.k_rope + static_cast<int64_t>(token) * p.k_rope_stride;
  for (int i = threadIdx.x; i < dim; i += kAppendThreads)
    dst[i] = i < rank ? c_kv[i] : k_rope[i - rank];
}

// q_full[t, h, r + i] = q[t, h, nope + i], i < rope: the rope tail of the absorbed query.
// grid-stride over tokens * n * rope elements.
__global__ void mla_copy_rope_kernel(const MlaAbsorbArgs p) {
  const int heads = p.shape.num_heads, rope = p.shape.rope, nope = p.shape.nope,
            rank = p.shape.rank;
  const int64_t total = static_cast<int64_t>(p.tokens) * heads * rope;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t item = i / rope;  // token * heads + head
    const int col = static_cast<int>(i % rope);
    const int64_t token = item / heads;
    const int head = static_cast<int>(item % heads);
    p.q_full[item * (rank + rope) + rank + col] =
        p.q[token * p.q_stride + static_cast<int64_t>(head) * (nope + rope) + nope + col];
  }
}

struct LoraSlot {
  int slot = -1;
  int rank = 0;
};

// The token's slot and its rank for this target; rank 0 = leave the token alone.
__device__ __forceinline__ LoraSlot token_lora_slot(const MlaKvbLoraArgs& p, int token) {
  LoraSlot s;
  const int count = p.num_tokens ? *p.num_tokens : p.tokens;
  if (token >= count) return s;
  const int slot = p.token_slot[token];
  if (slot < 0 || slot >= p.pool.num_slots) return s;
  s.slot = slot;
  s.rank = min(p.pool.rank[slot], p.pool.max_rank);
  return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Query side, one CTA per (token, head):
//   u[j] = s * sum_i B[h (nope + dv) + i, j] q_nope[i]        j < rank    (B_k[h]^T q_nope)
//   q_full[t, h, c] += sum_j A[j, c] u[j]                     c < r       (A^T u)
// grid (tokens, n), kLoraThreads threads.
__global__ void __launch_bounds__(kLoraThreads) mla_kvb_lora_query_kernel(const MlaKvbLoraArgs p) {
  __shared__ float u[kLoraMaxRank];
  const int token = blockIdx.x, head = blockIdx.y;
  const LoraSlot ls = token_lora_slot(p, token);
  if (ls.rank <= 0) return;
  const LoraPoolTarget& pool = p.pool;
  const int R = pool.max_rank, rank_in = pool.in_features, out = pool.out_features;
  const int nope = p.shape.nope, rope = p.shape.rope, dv = p.shape.v_dim, r = p.shape.rank;
  const float scaling = pool.scaling[ls.slot];
  const bf16* a =
      pool.a + static_cast<int64_t>(ls.slot) * pool.ea * R * rank_in;  // [R, r] (expert 0)
  const bf16* b_k = pool.b + static_cast<int64_t>(ls.slot) * pool.eb * out * R +
                    static_cast<int64_t>(head) * (nope + dv) * R;  // [nope, R]
  const bf16* q_nope =
      p.q + static_cast<int64_t>(token) * p.q_stride + static_cast<int64_t>(head) * (nope + rope);
  for (int j = threadIdx.x; j < ls.rank; j += kLoraThreads) {
    float acc = 0.f;
    for (int i = 0; i < nope; ++i)
      acc = fmaf(__bfloat162float(b_k[static_cast<int64_t>(i) * R + j]),
                 __bfloat162float(q_nope[i]), acc);
    u[j] = acc * scaling;
  }
  __syncthreads();
  bf16* dst = p.q_full + (static_cast<int64_t>(token) * p.shape.num_heads + head) * (r + rope);
  for (int c = threadIdx.x; c < r; c += kLoraThreads) {
    float acc = 0.f;
    for (int j = 0; j < ls.rank; ++j)
      acc = fmaf(__bfloat162float(a[static_cast<int64_t>(j) * rank_in + c]), u[j], acc);
    dst[c] = __float2bfloat16(__bfloat162float(dst[c]) + acc);
  }
}

// Output side, one CTA per (token, head):
//   w[k] = s * sum_c A[k, c] o_lat[t, h, c]                      k < rank   (A o_lat), warp per k
//   out[t, h dv + j] += sum_k B[h (nope + dv) + nope + j, k] w[k]  j < dv     (B_v[h] w)
// grid (tokens, n), kLoraThreads threads.
__global__ void __launch_bounds__(kLoraThreads) mla_kvb_lora_output_kernel(const MlaKvbLoraArgs p) {
  __shared__ float w[kLoraMaxRank];
  const int token = blockIdx.x, head = blockIdx.y;
  const LoraSlot ls = token_lora_slot(p, token);
  if (ls.rank <= 0) return;
  const LoraPoolTarget& pool = p.pool;
  const int R = pool.max_rank, rank_in = pool.in_features, out = pool.out_features;
  const int nope = p.shape.nope, dv = p.shape.v_dim, r = p.shape.rank, heads = p.shape.num_heads;
  const float scaling = pool.scaling[ls.slot];
  const bf16* a = pool.a + static_cast<int64_t>(ls.slot) * pool.ea * R * rank_in;
  const bf16* b_v = pool.b + static_cast<int64_t>(ls.slot) * pool.eb * out * R +
                    (static_cast<int64_t>(head) * (nope + dv) + nope) * R;  // [dv, R]
  const bf16* o_lat = p.o_lat + (static_cast<int64_t>(token) * heads + head) * r;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int k = warp; k < ls.rank; k += kLoraThreads / 32) {
    float acc = 0.f;
    for (int c = lane; c < r; c += 32)
      acc = fmaf(__bfloat162float(a[static_cast<int64_t>(k) * rank_in + c]),
                 __bfloat162float(o_lat[c]), acc);
    acc = warp_sum(acc);
    if (lane == 0) w[k] = acc * scaling;
  }
  __syncthreads();
  bf16* dst = p.out + static_cast<int64_t>(token) * heads * dv + static_cast<int64_t>(head) * dv;
  for (int j = threadIdx.x; j < dv; j += kLoraThreads) {
    float acc = 0.f;
    for (int k = 0; k < ls.rank; ++k)
      acc = fmaf(__bfloat162float(b_v[static_cast<int64_t>(j) * R + k]), w[k], acc);
    dst[j] = __float2bfloat16(__bfloat162float(dst[j]) + acc);
  }
}

void check_lora_args(const MlaKvbLoraArgs& p, const char* what) {
  check_shape(p.shape, what);
  const LoraPoolTarget& pool = p.pool;
  MOELORA_CHECK(pool.a && pool.b && pool.scaling && pool.rank && p.token_slot,
                ErrorCode::kInvalidArgument, what,
                ": pool a, b, scaling, rank and token_slot are required");
  MOELORA_CHECK(pool.max_rank > 0 && pool.max_rank <= kLoraMaxRank, ErrorCode::kUnsupported, what,
                ": pool rank ", pool.max_rank, " unsupported; must be in [1, ", kLoraMaxRank, "]");
  MOELORA_CHECK(pool.num_slots >= 0 && pool.ea >= 1 && pool.eb >= 1, ErrorCode::kInvalidArgument,
                what, ": num_slots ", pool.num_slots, ", ea ", pool.ea, ", eb ", pool.eb);
  MOELORA_CHECK(pool.in_features == p.shape.rank, ErrorCode::kInvalidArgument, what,
                ": kv_b LoRA in_features ", pool.in_features, " must equal kv_lora_rank ",
                p.shape.rank);
  const int64_t out = static_cast<int64_t>(p.shape.num_heads) * (p.shape.nope + p.shape.v_dim);
  MOELORA_CHECK(pool.out_features == out, ErrorCode::kInvalidArgument, what,
                ": kv_b LoRA out_features ", pool.out_features,
                " must equal num_heads * (nope + v_dim) = ", out);
  MOELORA_CHECK(p.tokens >= 0 && p.shape.num_heads <= 65535, ErrorCode::kInvalidArgument, what,
                ": tokens ", p.tokens, ", num_heads ", p.shape.num_heads);
}

}  // namespace

void launch_mla_cache_append(const MlaAppendArgs& args, cudaStream_t stream) {
  check_shape(args.shape, "launch_mla_cache_append");
  const AttentionBatch& batch = args.batch;
  MOELORA_CHECK(args.cache.kv && args.c_kv && (args.k_rope || args.shape.rope == 0),
                ErrorCode::kInvalidArgument,
                "launch_mla_cache_append: cache.kv, c_kv and k_rope are required");
  MOELORA_CHECK(batch.page_table && batch.token_seq && batch.token_pos, ErrorCode::kInvalidArgument,
                "launch_mla_cache_append: batch page_table, token_seq and token_pos are required");
  MOELORA_CHECK(args.cache.page_size > 0 && batch.max_pages_per_seq > 0 && batch.max_tokens >= 0,
                ErrorCode::kInvalidArgument, "launch_mla_cache_append: page_size ",
                args.cache.page_size, ", max_pages_per_seq ", batch.max_pages_per_seq,
                ", max_tokens ", batch.max_tokens);
  MOELORA_CHECK(args.c_kv_stride >= args.shape.rank && args.k_rope_stride >= args.shape.rope,
                ErrorCode::kInvalidArgument, "launch_mla_cache_append: c_kv_stride ",
                args.c_kv_stride, " must be >= kv_lora_rank ", args.shape.rank,
                " and k_rope_stride ", args.k_rope_stride, " >= rope ", args.shape.rope);
  if (batch.max_tokens == 0) return;
  mla_cache_append_kernel<<<batch.max_tokens, kAppendThreads, 0, stream>>>(args);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_mla_absorb_query(cublasHandle_t handle, const MlaAbsorbArgs& args,
                             cudaStream_t stream) {
  const MlaShape& s = args.shape;
  check_shape(s, "launch_mla_absorb_query");
  MOELORA_CHECK(handle && args.q && args.kv_b && args.q_full, ErrorCode::kInvalidArgument,
                "launch_mla_absorb_query: handle, q, kv_b and q_full are required");
  MOELORA_CHECK(
      args.tokens >= 0 && args.q_stride >= static_cast<int64_t>(s.num_heads) * (s.nope + s.rope),
      ErrorCode::kInvalidArgument, "launch_mla_absorb_query: tokens ", args.tokens, ", q_stride ",
      args.q_stride, " (must be >= num_heads * (nope + rope) = ", s.num_heads * (s.nope + s.rope),
      ")");
  if (args.tokens == 0) return;
  ::moelora::cuda::set_cublas_stream(handle, stream);
  // Per head h, row-major: q_lat [T, r] (rows of q_full, stride n (r + rope)) =
  //   q_nope [T, nope] (stride q_stride) . W_UK[h] [nope, r].
  // Column-major: q_lat^T [r, T] = W_UK[h]^T-as-stored [r, nope] (ld r) . q_nope^T [nope, T] (ld
  // q_stride).
  const float alpha = 1.f, beta = 0.f;
  const int64_t dim = s.rank + s.rope;
  check_cublas(cublasGemmStridedBatchedEx(
                   handle, CUBLAS_OP_N, CUBLAS_OP_N, s.rank, args.tokens, s.nope, &alpha, args.kv_b,
                   CUDA_R_16BF, s.rank, static_cast<int64_t>(s.nope + s.v_dim) * s.rank, args.q,
                   CUDA_R_16BF, static_cast<int>(args.q_stride), s.nope + s.rope, &beta,
                   args.q_full, CUDA_R_16BF, static_cast<int>(s.num_heads * dim), dim, s.num_heads,
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "launch_mla_absorb_query: cublasGemmStridedBatchedEx");
  if (s.rope > 0) {
    const int64_t total = static_cast<int64_t>(args.tokens) * s.num_heads * s.rope;
    const int blocks =
        static_cast<int>(std::min<int64_t>((total + kCopyThreads - 1) / kCopyThreads, 4096));
    mla_copy_rope_kernel<<<blocks, kCopyThreads, 0, stream>>>(args);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
}

void launch_mla_project_output(cublasHandle_t handle, const MlaProjectArgs& args,
                               cudaStream_t stream) {
  const MlaShape& s = args.shape;
  check_shape(s, "launch_mla_project_output");
  MOELORA_CHECK(handle && args.o_lat && args.kv_b && args.out, ErrorCode::kInvalidArgument,
                "launch_mla_project_output: handle, o_lat, kv_b and out are required");
  MOELORA_CHECK(args.tokens >= 0, ErrorCode::kInvalidArgument, "launch_mla_project_output: tokens ",
                args.tokens);
  if (args.tokens == 0) return;
  ::moelora::cuda::set_cublas_stream(handle, stream);
  // Per head h, row-major: out [T, dv] (stride n dv) = o_lat [T, r] (stride n r) . W_UV[h]^T.
  // Column-major: out^T [dv, T] = op_T(W_UV[h] stored as [r, dv], ld r) . o_lat^T [r, T] (ld n r).
  const float alpha = 1.f, beta = 0.f;
  check_cublas(
      cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, s.v_dim, args.tokens, s.rank, &alpha,
          args.kv_b + static_cast<int64_t>(s.nope) * s.rank, CUDA_R_16BF, s.rank,
          static_cast<int64_t>(s.nope + s.v_dim) * s.rank, args.o_lat, CUDA_R_16BF,
          s.num_heads * s.rank, s.rank, &beta, args.out, CUDA_R_16BF, s.num_heads * s.v_dim,
          s.v_dim, s.num_heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "launch_mla_project_output: cublasGemmStridedBatchedEx");
}

void launch_mla_kvb_lora_query(const MlaKvbLoraArgs& args, cudaStream_t stream) {
  check_lora_args(args, "launch_mla_kvb_lora_query");
  MOELORA_CHECK(args.q && args.q_full, ErrorCode::kInvalidArgument,
                "launch_mla_kvb_lora_query: q and q_full are required");
  MOELORA_CHECK(args.q_stride >= static_cast<int64_t>(args.shape.num_heads) *
                                     (args.shape.nope + args.shape.rope),
                ErrorCode::kInvalidArgument, "launch_mla_kvb_lora_query: q_stride ", args.q_stride,
                " must be >= num_heads * (nope + rope)");
  if (args.tokens == 0) return;
  mla_kvb_lora_query_kernel<<<dim3(args.tokens, args.shape.num_heads), kLoraThreads, 0, stream>>>(
      args);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_mla_kvb_lora_output(const MlaKvbLoraArgs& args, cudaStream_t stream) {
  check_lora_args(args, "launch_mla_kvb_lora_output");
  MOELORA_CHECK(args.o_lat && args.out, ErrorCode::kInvalidArgument,
                "launch_mla_kvb_lora_output: o_lat and out are required");
  if (args.tokens == 0) return;
  mla_kvb_lora_output_kernel<<<dim3(args.tokens, args.shape.num_heads), kLoraThreads, 0, stream>>>(
      args);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
