// Internal to the MoE layer's two translation units (moe_layer_cuda.cu: weights, adapter pool,
// workspace; moe_layer_forward_cuda.cu: the forward): the layer's state behind MoeLayerCuda's
// pimpl and the small cuBLAS helpers both use. Not part of the op's interface.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/cuda_utils.h"
#include "ops/lora/lora_cuda.cuh"
#include "ops/moe/moe_layer_cuda.cuh"

namespace moelora::ops::cuda {

namespace moe_layer_internal {

inline int round_up(int v, int m) {
  return (v + m - 1) / m * m;
}

inline void check_cublas(cublasStatus_t s, const char* what) {
  MOELORA_CHECK(s == CUBLAS_STATUS_SUCCESS, ErrorCode::kCuda, what, " failed with cuBLAS status ",
                static_cast<int>(s));
}

// y [rows, n] (bf16 or f32) = x [rows, k] bf16 . w [n, k]^T bf16, fp32 accumulation.
inline void gemm_bf16_nt(cublasHandle_t h, cudaStream_t stream, const __nv_bfloat16* x,
                  const __nv_bfloat16* w, void* y, cudaDataType_t y_type, int rows, int n, int k) {
  ::moelora::cuda::set_cublas_stream(h, stream);
  const float alpha = 1.f, beta = 0.f;
  // Column-major view: Y^T [n, rows] = W [k, n]^T . X^T [k, rows]
  check_cublas(
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &alpha, w, CUDA_R_16BF, k, x,
                   CUDA_R_16BF, k, &beta, y, y_type, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}


// One pool target: device regions for A, B, scaling, rank and the shared flags.
struct PoolTarget {
  size_t a = 0, b = 0, scaling = 0, rank = 0, a_shared = 0, b_shared = 0;
  int ea = 1, eb = 1, in = 0, out = 0;
  int max_rank = 0;  // the shared expert's fused gate/up target holds rank_gate + rank_up
  bool present = false;
};

}  // namespace moe_layer_internal

struct MoeLayerCuda::Impl {
  MoeLayerConfig c;
  cudaStream_t main = nullptr, side = nullptr;
  // The shared expert's LoRA stream (SideStreamScheduling::shared_lora_stream): the
  // MoeSharedWorkspace's when the layer shares one, else own_side2; null in layers without a
  // shared expert among the pairs or without adapter slots.
  cudaStream_t side2 = nullptr;
  std::optional<::moelora::cuda::Stream> own_side2;
  // Ex: experts in the GEMM stacks (E, + 1 with shared_in_experts); P: pair rows (T kp).
  int Hp = 0, Ip = 0, P = 0, Ex = 0, num_sms = 0;
  int scale_ld = 0;  // leading dimension of the k-major activation scales (P rounded up to 4)
  // One cuBLAS handle per stream, each with its own workspace: the MoeSharedWorkspace's when the
  // layer shares one, else the layer's own.
  std::optional<::moelora::cuda::CublasHandle> own_cublas, own_cublas_side;
  void* cublas = nullptr;  // cublasHandle_t
  void* cublas_side = nullptr;
  std::vector<uint8_t> slot_shared_a;  // host copy: gate_up A of the slot is shared by all experts
  ::moelora::cuda::Event ev_route, ev_act, ev_shared_act, ev_lora1, ev_shared_lora1, ev_lora2,
      ev_shared_lora2;

  // weights (one arena) and workspace (another)
  ::moelora::cuda::DeviceArena weights;
  size_t w13 = 0, w13s = 0, w2 = 0, w2s = 0, router = 0, bias = 0, sw13 = 0, sw2 = 0, sgate = 0;
  bool has_bias = false, has_shared = false, has_shared_gate = false;

  ::moelora::cuda::DeviceArena pool;
  moe_layer_internal::PoolTarget gate_up, down, shared_gate_up, shared_down;

  // The transient buffers: planned in `ws`, placed in `shared_ws` when the layer shares one
  // (MoeSharedWorkspace), else in ws's own allocation. Counters that the kernels leave at zero
  // between launches must outlive every forward, so they keep their own small arena (`state`).
  ::moelora::cuda::DeviceArena ws;
  MoeSharedWorkspace* shared_ws = nullptr;
  ::moelora::cuda::DeviceArena state;
  size_t logits = 0, ids = 0, tw = 0, offsets = 0, sorted_pair = 0, sorted_token = 0, pair_pos = 0,
         sorted_slot_expert = 0, active = 0, num_active = 0, segments = 0, num_segments = 0,
         token_sorted = 0, token_pos = 0, token_segments = 0, num_token_segments = 0, xq = 0,
         sx = 0, h = 0, d1 = 0, a16 = 0, aq = 0, sa = 0, y = 0, d2 = 0, part1 = 0, part2 = 0,
         sh = 0, sd1 = 0, sa16 = 0, sout = 0, sd2 = 0, spart1 = 0, spart2 = 0, prefill_ws = 0,
         xh = 0, sxh = 0, ah = 0, sah = 0,  // NVFP4 experts: f16 rows of x / a and their row scales
      token_shared_row =
          0,  // shared expert among the pairs, with LoRA: its pairs' rows by token_sorted
      router_partials = 0;  // fp32 partial logits of the router GEMM in the route launch
  // In `state`:
  size_t gemm_work = 0,  // [4] int: the stream GEMMs' work counters, GEMM1's pair then GEMM2's
      gemv_tickets = 0,  // [kMoeGemvMaxTickets] int: the expert GEMV up kernel's per-expert tickets
      router_tickets = 0;       // [router_route_tickets] int, zero between launches
  int router_route_tokens = 0;  // forwards of up to this many tokens compute the logits in the route launch
  size_t prefill_ws_bytes = 0;
  int max_segments = 0;

  Impl(const MoeLayerConfig& config, cudaStream_t m, cudaStream_t s)
      : c(config),
        main(m),
        side(s),
        ev_route(false),
        ev_act(false),
        ev_shared_act(false),
        ev_lora1(false),
        ev_shared_lora1(false),
        ev_lora2(false),
        ev_shared_lora2(false) {}

  template <typename T>
  T* w(size_t off) const {
    return weights.at<T>(off);
  }
  template <typename T>
  T* x(size_t off) const {
    if (shared_ws) return reinterpret_cast<T*>(static_cast<char*>(shared_ws->get()) + off);
    return ws.at<T>(off);
  }
  template <typename T>
  T* s(size_t off) const {
    return state.at<T>(off);
  }

  LoraPoolTarget view(const moe_layer_internal::PoolTarget& t) const {
    LoraPoolTarget v;
    v.a = pool.at<__nv_bfloat16>(t.a);
    v.b = pool.at<__nv_bfloat16>(t.b);
    v.scaling = pool.at<float>(t.scaling);
    v.rank = pool.at<int32_t>(t.rank);
    v.a_shared = pool.at<uint8_t>(t.a_shared);
    v.b_shared = pool.at<uint8_t>(t.b_shared);
    v.num_slots = c.num_slots;
    v.ea = t.ea;
    v.eb = t.eb;
    v.max_rank = t.max_rank;
    v.in_features = t.in;
    v.out_features = t.out;
    return v;
  }

  void plan_pool_target(moe_layer_internal::PoolTarget& t, int ea, int eb, int in, int out, int max_rank) {
    const size_t S = c.num_slots, R = max_rank;
    t.max_rank = max_rank;
    t.ea = ea;
    t.eb = eb;
    t.in = in;
    t.out = out;
    t.present = true;
    t.a = pool.reserve(S * ea * R * in * 2);
    t.b = pool.reserve(S * eb * out * R * 2);
    t.scaling = pool.reserve(S * 4);
    t.rank = pool.reserve(S * 4);
    t.a_shared = pool.reserve(S);
    t.b_shared = pool.reserve(S);
  }

  // Writes one adapter factor pair into slot `slot` of target t (rank tail zero).
  void write_pool(const moe_layer_internal::PoolTarget& t, int slot, const LoraFactors* f, const char* what) {
    const size_t R = t.max_rank;
    const int32_t zero_rank = 0;
    if (!f || !f->defined()) {
      MOELORA_CUDA_CHECK(
          cudaMemcpy(pool.at<int32_t>(t.rank) + slot, &zero_rank, 4, cudaMemcpyHostToDevice));
      return;
    }
    const int64_t ea = f->a.dim(0), eb = f->b.dim(0), r = f->rank();
    MOELORA_CHECK(r <= t.max_rank, ErrorCode::kUnsupported, what, ": adapter rank ", r,
                  " exceeds the pool's maximum rank ", t.max_rank);
    MOELORA_CHECK(f->a.dim(2) == t.in && f->b.dim(1) == t.out && f->b.dim(2) == r,
                  ErrorCode::kInvalidArgument, what, ": LoRA factors A ", shape_str(f->a.shape()),
                  " / B ", shape_str(f->b.shape()), " do not fit in = ", t.in, ", out = ", t.out);
    MOELORA_CHECK((ea == 1 || ea == t.ea) && (eb == 1 || eb == t.eb), ErrorCode::kInvalidArgument,
                  what, ": expert extents Ea = ", ea, ", Eb = ", eb, " do not fit the pool's ",
                  t.ea, " / ", t.eb);
    // A: [ea, r, in] -> slot region [t.ea, R, in]; B: [eb, out, r] -> [t.eb, out, R]
    std::vector<uint16_t> a(static_cast<size_t>(t.ea) * R * t.in, 0),
        b(static_cast<size_t>(t.eb) * t.out * R, 0);
    const float* ap = f->a.data<float>();
    const float* bp = f->b.data<float>();
    for (int64_t e = 0; e < ea; ++e)
      for (int64_t i = 0; i < r; ++i)
        for (int64_t k = 0; k < t.in; ++k)
          a[(e * R + i) * t.in + k] = f32_to_bf16_bits(ap[(e * r + i) * t.in + k]);
    for (int64_t e = 0; e < eb; ++e)
      for (int64_t n = 0; n < t.out; ++n)
        for (int64_t i = 0; i < r; ++i)
          b[(e * t.out + n) * R + i] = f32_to_bf16_bits(bp[(e * t.out + n) * r + i]);
    MOELORA_CUDA_CHECK(
        cudaMemcpy(pool.at<uint16_t>(t.a) + static_cast<size_t>(slot) * t.ea * R * t.in, a.data(),
                   a.size() * 2, cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(pool.at<uint16_t>(t.b) + static_cast<size_t>(slot) * t.eb * t.out * R, b.data(),
                   b.size() * 2, cudaMemcpyHostToDevice));
    const float scaling = f->scaling;
    const int32_t rank = static_cast<int32_t>(r);
    const uint8_t a_shared = ea == 1 && t.ea > 1, b_shared = eb == 1 && t.eb > 1;
    MOELORA_CUDA_CHECK(
        cudaMemcpy(pool.at<float>(t.scaling) + slot, &scaling, 4, cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(pool.at<int32_t>(t.rank) + slot, &rank, 4, cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(pool.at<uint8_t>(t.a_shared) + slot, &a_shared, 1, cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(pool.at<uint8_t>(t.b_shared) + slot, &b_shared, 1, cudaMemcpyHostToDevice));
  }
};

}  // namespace moelora::ops::cuda
