// Token embedding on the GPU (see embedding_cuda.cuh): one CTA per token row copies the bf16 row
// of the table with 16-byte loads and stores. The grid is sized by the capacity `tokens`; rows at
// or beyond the device count *num_tokens return at once, so the launch is graph-capturable.
#include <cstdint>

#include "core/cuda_utils.h"
#include "ops/embedding/embedding_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

constexpr int kEmbeddingThreads = 128;

// table [V, H], ids [T], out [T, H]; H % 8 == 0 so every row is a whole number of uint4 vectors.
__global__ void __launch_bounds__(kEmbeddingThreads)
    embedding_gather_kernel(const EmbeddingArgs args) {
  const int token = blockIdx.x;
  const int valid = args.num_tokens ? *args.num_tokens : args.tokens;
  if (token >= valid) return;
  const int64_t id = static_cast<int64_t>(args.ids[token]) - args.first_id;
  const int vectors = args.hidden / 8;
  uint4* dst = reinterpret_cast<uint4*>(args.out + static_cast<int64_t>(token) * args.hidden);
  if (id < 0 || id >= args.vocab) {
    // Another rank's id, or one the host should have rejected: a zero row, never an
    // out-of-bounds read.
    for (int v = threadIdx.x; v < vectors; v += blockDim.x) dst[v] = make_uint4(0, 0, 0, 0);
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(args.table + id * args.hidden);
  for (int v = threadIdx.x; v < vectors; v += blockDim.x) dst[v] = src[v];
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void launch_embedding(const EmbeddingArgs& args, cudaStream_t stream) {
  MOELORA_CHECK(args.tokens >= 0, ErrorCode::kInvalidArgument,
                "embedding: tokens must be >= 0, got ", args.tokens);
  if (args.tokens == 0) return;
  MOELORA_CHECK(args.table && args.ids && args.out, ErrorCode::kInvalidArgument,
                "embedding: table, ids and out must be device pointers (got null)");
  MOELORA_CHECK(args.hidden > 0 && args.hidden % 8 == 0, ErrorCode::kInvalidArgument,
                "embedding: hidden must be a positive multiple of 8, got ", args.hidden);
  MOELORA_CHECK(args.vocab > 0 && args.first_id >= 0, ErrorCode::kInvalidArgument,
                "embedding: vocab must be > 0 and first_id >= 0, got ", args.vocab, " and ",
                args.first_id);
  MOELORA_CHECK(aligned16(args.table) && aligned16(args.out), ErrorCode::kInvalidArgument,
                "embedding: table and out must be 16-byte aligned");
  embedding_gather_kernel<<<args.tokens, kEmbeddingThreads, 0, stream>>>(args);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::ops::cuda
