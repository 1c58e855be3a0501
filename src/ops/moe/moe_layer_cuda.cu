// MoeLayerCuda: weights, adapter pool and workspace of one MoE layer, and the two-stream forward
// of docs/gpu_moe.md §1.
//
// bf16 experts (MoeLayerConfig::bf16_experts) run the same pipeline without any FP8: no quant
// kernel, GEMM1 = bf16 grouped GEMM over x rows gathered through sorted_token, the activation
// writes only the bf16 copy a16 (which the down LoRA reads anyway) and GEMM2 reads a16. Weights
// are stored unpadded ([E, 2I, H], [E, H, I]); H and I need only be multiples of 8.
#include "ops/moe/moe_layer_cuda.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/gemm/moe_gemm.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/lora/lora_cuda.cuh"
#include "ops/lora/lora_mma_cuda.cuh"
#include "ops/moe/moe_cuda.cuh"
#include "ops/moe_align/moe_align_cuda.cuh"
#include "ops/quant/quant_cuda.cuh"
#include "ops/route/route_cuda.cuh"

namespace moelora::ops::cuda {

namespace {

int round_up(int v, int m) {
  return (v + m - 1) / m * m;
}

void check_cublas(cublasStatus_t s, const char* what) {
  MOELORA_CHECK(s == CUBLAS_STATUS_SUCCESS, ErrorCode::kCuda, what, " failed with cuBLAS status ",
                static_cast<int>(s));
}

// y [rows, n] (bf16 or f32) = x [rows, k] bf16 . w [n, k]^T bf16, fp32 accumulation.
void gemm_bf16_nt(cublasHandle_t h, cudaStream_t stream, const __nv_bfloat16* x,
                  const __nv_bfloat16* w, void* y, cudaDataType_t y_type, int rows, int n, int k) {
  check_cublas(cublasSetStream(h, stream), "cublasSetStream");
  const float alpha = 1.f, beta = 0.f;
  // Column-major view: Y^T [n, rows] = W [k, n]^T . X^T [k, rows]
  check_cublas(
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &alpha, w, CUDA_R_16BF, k, x,
                   CUDA_R_16BF, k, &beta, y, y_type, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

// Host tensor -> bf16 bytes (any float dtype).
std::vector<uint16_t> to_bf16_bits(const Tensor& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = f32_to_bf16_bits(t.item_f32(i));
  return out;
}

// Uploads a host tensor of any float dtype as bf16 to `dst` (numel elements). bf16 tensors are
// copied as they are; others are converted (expert stacks can be large: no per-element calls
// for the common bf16 checkpoint case).
void upload_bf16(const Tensor& t, void* dst) {
  if (t.dtype() == DType::kBF16) {
    MOELORA_CUDA_CHECK(cudaMemcpy(dst, t.raw_data(), t.nbytes(), cudaMemcpyHostToDevice));
    return;
  }
  const std::vector<uint16_t> bits = to_bf16_bits(t);
  MOELORA_CUDA_CHECK(cudaMemcpy(dst, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
}

// ---- seeded device-side random fill (benchmarks) ----
__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__device__ __forceinline__ float uniform_pm1(uint64_t seed, size_t i) {  // uniform in [-1, 1)
  return static_cast<float>(mix64(seed ^ (i * 0x2545f4914f6cdd1dull)) >> 40) *
             (2.0f / 16777216.0f) -
         1.0f;
}
// e4m3 codes with magnitude codes in [0, 0x5f] (|v| <= 30) and random sign; never NaN.
__global__ void fill_e4m3_kernel(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(seed ^ (i * 0x2545f4914f6cdd1dull));
    p[i] = static_cast<uint8_t>((r % 0x60) | ((r >> 32) & 0x80));
  }
}
__global__ void fill_f32_kernel(float* p, size_t n, float lo, float hi, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = lo + (hi - lo) * 0.5f * (uniform_pm1(seed, i) + 1.0f);
}
// bf16 values uniform in [-amp, amp); element i is zero when (i / inner) % period >= keep (rank
// tail).
__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, float amp, size_t inner, size_t period,
                                 size_t keep, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const bool zero = ((i / inner) % period) >= keep;
    p[i] = __float2bfloat16(zero ? 0.f : amp * uniform_pm1(seed, i));
  }
}
constexpr int kFillBlocks = 1024, kFillThreads = 256;

// One pool target: device regions for A, B, scaling, rank and the shared flags.
struct PoolTarget {
  size_t a = 0, b = 0, scaling = 0, rank = 0, a_shared = 0, b_shared = 0;
  int ea = 1, eb = 1, in = 0, out = 0;
  int max_rank = 0;  // the shared expert's fused gate/up target holds rank_gate + rank_up
  bool present = false;
};

}  // namespace

struct MoeLayerCuda::Impl {
  MoeLayerConfig c;
  cudaStream_t main = nullptr, side = nullptr;
  int Hp = 0, Ip = 0, P = 0, num_sms = 0;
  int scale_ld = 0;  // leading dimension of the k-major activation scales (P rounded up to 4)
  ::moelora::cuda::CublasHandle cublas, cublas_side;  // one per stream: each owns its workspace
  std::vector<uint8_t> slot_shared_a;  // host copy: gate_up A of the slot is shared by all experts
  ::moelora::cuda::Event ev_route, ev_act, ev_shared_act, ev_lora1, ev_shared_lora1, ev_lora2;

  // weights (one arena) and workspace (another)
  ::moelora::cuda::DeviceArena weights;
  size_t w13 = 0, w13s = 0, w2 = 0, w2s = 0, router = 0, bias = 0, sw13 = 0, sw2 = 0, sgate = 0;
  bool has_bias = false, has_shared = false, has_shared_gate = false;

  ::moelora::cuda::DeviceArena pool;
  PoolTarget gate_up, down, shared_gate_up, shared_down;

  ::moelora::cuda::DeviceArena ws;
  size_t logits = 0, ids = 0, tw = 0, offsets = 0, sorted_pair = 0, sorted_token = 0, pair_pos = 0,
         active = 0, num_active = 0, segments = 0, num_segments = 0, token_sorted = 0,
         token_pos = 0, token_segments = 0, num_token_segments = 0, xq = 0, sx = 0, h = 0, d1 = 0,
         a16 = 0, aq = 0, sa = 0, y = 0, d2 = 0, part1 = 0, part2 = 0, sh = 0, sd1 = 0, sa16 = 0,
         sout = 0, sd2 = 0, spart1 = 0, spart2 = 0, prefill_ws = 0;
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
        ev_lora2(false) {}

  template <typename T>
  T* w(size_t off) const {
    return weights.at<T>(off);
  }
  template <typename T>
  T* x(size_t off) const {
    return ws.at<T>(off);
  }

  LoraPoolTarget view(const PoolTarget& t) const {
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

  void plan_pool_target(PoolTarget& t, int ea, int eb, int in, int out, int max_rank) {
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
  void write_pool(const PoolTarget& t, int slot, const LoraFactors* f, const char* what) {
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

MoeLayerCuda::MoeLayerCuda(const MoeLayerConfig& config, const MoeLayerHostWeights& hw,
                           cudaStream_t main_stream, cudaStream_t side_stream)
    : impl_(std::make_unique<Impl>(config, main_stream, side_stream)), config_(config) {
  Impl& m = *impl_;
  const MoeLayerConfig& c = config_;
  MOELORA_CHECK(c.hidden > 0 && c.inter > 0 && c.num_experts > 0 && c.top_k > 0 && c.max_tokens > 0,
                ErrorCode::kInvalidArgument, "MoeLayerCuda: H = ", c.hidden, ", I = ", c.inter,
                ", E = ", c.num_experts, ", k = ", c.top_k, ", max_tokens = ", c.max_tokens,
                " must all be positive");
  MOELORA_CHECK(c.bf16_experts || c.inter % 128 == 0, ErrorCode::kUnsupported,
                "MoeLayerCuda: FP8 experts need I % 128 == 0 (got I = ", c.inter,
                "): gate and up scale blocks must not straddle");
  MOELORA_CHECK(c.inter % 8 == 0, ErrorCode::kUnsupported, "MoeLayerCuda: I = ", c.inter,
                " must be a multiple of 8 (16-byte rows)");
  MOELORA_CHECK(c.hidden % 8 == 0 && (c.shared_inter % 8 == 0), ErrorCode::kUnsupported,
                "MoeLayerCuda: H = ", c.hidden, " and Is = ", c.shared_inter,
                " must be multiples of 8 (16-byte rows)");
  MOELORA_CHECK(c.num_slots == 0 || (c.max_rank > 0 && c.max_rank % 8 == 0),
                ErrorCode::kInvalidArgument, "MoeLayerCuda: max_rank = ", c.max_rank,
                " must be a positive multiple of 8 when slots exist");
  check_route_params(c.route);
  const int E = c.num_experts, H = c.hidden, I = c.inter, k = c.top_k;
  const bool bf16 = c.bf16_experts;
  m.Hp = bf16 ? H : round_up(H, 128);  // FP8: whole scale blocks; bf16 needs no padding
  m.Ip = I;
  m.P = c.max_tokens * k;
  m.scale_ld = round_up(m.P, 4);
  m.num_sms = ::moelora::cuda::device_info().num_sms;

  // ---- weights ----
  const bool upload = hw.w13.defined();
  if (upload && bf16) {
    check_shape(hw.w13, {E, 2 * I, H}, "MoeLayerCuda: w13 (bf16 experts)");
    check_shape(hw.w2, {E, H, I}, "MoeLayerCuda: w2 (bf16 experts)");
    // Unscaled float types only: FP8 codes without their block scales would be wrong values.
    auto plain_float = [](DType d) {
      return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16 || d == DType::kF64;
    };
    MOELORA_CHECK(plain_float(hw.w13.dtype()) && plain_float(hw.w2.dtype()),
                  ErrorCode::kInvalidArgument,
                  "MoeLayerCuda: bf16 experts need F32, F64, BF16 or F16 w13 / w2, got ",
                  dtype_name(hw.w13.dtype()), " / ", dtype_name(hw.w2.dtype()));
    check_shape(hw.router, {E, H}, "MoeLayerCuda: router");
  } else if (upload) {
    check_shape(hw.w13, {E, 2 * I, H}, "MoeLayerCuda: w13");
    check_dtype(hw.w13, DType::kF8E4M3, "MoeLayerCuda: w13");
    check_shape(hw.w13_scale, {E, 2 * I / 128, (H + 127) / 128}, "MoeLayerCuda: w13_scale");
    check_shape(hw.w2, {E, H, I}, "MoeLayerCuda: w2");
    check_dtype(hw.w2, DType::kF8E4M3, "MoeLayerCuda: w2");
    check_shape(hw.w2_scale, {E, (H + 127) / 128, I / 128}, "MoeLayerCuda: w2_scale");
    check_shape(hw.router, {E, H}, "MoeLayerCuda: router");
  }
  m.has_bias = upload ? hw.correction_bias.defined() : c.route.kind == RouterKind::kSigmoidNoauxTc;
  m.has_shared = c.shared_inter > 0;
  m.has_shared_gate = m.has_shared && c.shared_gate;
  if (bf16) {
    m.w13 = m.weights.reserve(static_cast<size_t>(E) * 2 * I * H * 2);
    m.w2 = m.weights.reserve(static_cast<size_t>(E) * H * I * 2);
  } else {
    m.w13 = m.weights.reserve(static_cast<size_t>(E) * 2 * I * m.Hp);
    m.w13s = m.weights.reserve(static_cast<size_t>(E) * (2 * I / 128) * (m.Hp / 128) * 4);
    m.w2 = m.weights.reserve(static_cast<size_t>(E) * H * I);
    m.w2s = m.weights.reserve(static_cast<size_t>(E) * ((H + 127) / 128) * (I / 128) * 4);
  }
  m.router = m.weights.reserve(static_cast<size_t>(E) * H * 2);
  if (m.has_bias) m.bias = m.weights.reserve(static_cast<size_t>(E) * 4);
  if (m.has_shared) {
    if (upload) {
      check_shape(hw.shared_w13, {2 * c.shared_inter, H}, "MoeLayerCuda: shared_w13");
      check_shape(hw.shared_w2, {H, c.shared_inter}, "MoeLayerCuda: shared_w2");
    }
    m.sw13 = m.weights.reserve(static_cast<size_t>(2) * c.shared_inter * H * 2);
    m.sw2 = m.weights.reserve(static_cast<size_t>(H) * c.shared_inter * 2);
    if (m.has_shared_gate) {
      MOELORA_CHECK(!upload || (hw.shared_gate.defined() && hw.shared_gate.numel() == H),
                    ErrorCode::kInvalidArgument, "MoeLayerCuda: shared_gate must have H = ", H,
                    " values");
      m.sgate = m.weights.reserve(static_cast<size_t>(H) * 2);
    }
  }
  m.weights.allocate();
  if (upload && bf16) {
    upload_bf16(hw.w13, m.w<void>(m.w13));
    upload_bf16(hw.w2, m.w<void>(m.w2));
  } else if (upload) {
    // W13 rows padded from H to Hp columns (zeros), scales likewise.
    std::vector<uint8_t> rows(static_cast<size_t>(E) * 2 * I * m.Hp, 0);
    const uint8_t* src = hw.w13.data<uint8_t>();
    for (size_t r = 0; r < static_cast<size_t>(E) * 2 * I; ++r)
      std::memcpy(&rows[r * m.Hp], src + r * H, H);
    MOELORA_CUDA_CHECK(
        cudaMemcpy(m.w<uint8_t>(m.w13), rows.data(), rows.size(), cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<float>(m.w13s), hw.w13_scale.raw_data(),
                                  hw.w13_scale.nbytes(), cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(m.w<uint8_t>(m.w2), hw.w2.raw_data(), hw.w2.nbytes(), cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<float>(m.w2s), hw.w2_scale.raw_data(), hw.w2_scale.nbytes(),
                                  cudaMemcpyHostToDevice));
  }
  if (upload) {
    auto router = to_bf16_bits(hw.router);
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<uint16_t>(m.router), router.data(), router.size() * 2,
                                  cudaMemcpyHostToDevice));
    if (m.has_bias) {
      Tensor b = hw.correction_bias.to_f32();
      MOELORA_CUDA_CHECK(
          cudaMemcpy(m.w<float>(m.bias), b.raw_data(), b.nbytes(), cudaMemcpyHostToDevice));
    }
    if (m.has_shared) {
      auto s13 = to_bf16_bits(hw.shared_w13);
      auto s2 = to_bf16_bits(hw.shared_w2);
      MOELORA_CUDA_CHECK(
          cudaMemcpy(m.w<uint16_t>(m.sw13), s13.data(), s13.size() * 2, cudaMemcpyHostToDevice));
      MOELORA_CUDA_CHECK(
          cudaMemcpy(m.w<uint16_t>(m.sw2), s2.data(), s2.size() * 2, cudaMemcpyHostToDevice));
      if (m.has_shared_gate) {
        auto g = to_bf16_bits(hw.shared_gate);
        MOELORA_CUDA_CHECK(
            cudaMemcpy(m.w<uint16_t>(m.sgate), g.data(), g.size() * 2, cudaMemcpyHostToDevice));
      }
    }
  }

  // ---- adapter pool ----
  if (c.num_slots > 0) {
    m.plan_pool_target(m.gate_up, c.per_expert_pool ? E : 1, E, H, 2 * I, c.max_rank);
    m.plan_pool_target(m.down, E, c.per_expert_pool ? E : 1, I, H, c.max_rank);
    if (m.has_shared) {
      m.plan_pool_target(m.shared_gate_up, 1, 1, H, 2 * c.shared_inter, 2 * c.max_rank);
      m.plan_pool_target(m.shared_down, 1, 1, c.shared_inter, H, c.max_rank);
    }
    m.pool.allocate();
    m.slot_shared_a.assign(c.num_slots, 0);
    for (int s = 0; s < c.num_slots; ++s) clear_adapter(s);
  }

  // ---- workspace ----
  const size_t T = c.max_tokens, P = m.P, R = std::max(c.max_rank, 8), S = c.num_slots;
  m.max_segments = static_cast<int>(std::min<size_t>(P, S * E));
  m.logits = m.ws.reserve(T * E * 4);
  m.ids = m.ws.reserve(P * 4);
  m.tw = m.ws.reserve(P * 4);
  m.offsets = m.ws.reserve((E + 1) * 4);
  m.sorted_pair = m.ws.reserve(P * 4);
  m.sorted_token = m.ws.reserve(P * 4);
  m.pair_pos = m.ws.reserve(P * 4);
  m.active = m.ws.reserve(E * 4);
  m.num_active = m.ws.reserve(4);
  m.segments = m.ws.reserve(std::max<size_t>(m.max_segments, 1) * 16);
  m.num_segments = m.ws.reserve(4);
  m.token_sorted = m.ws.reserve(T * 4);
  m.token_pos = m.ws.reserve(T * 4);
  m.token_segments = m.ws.reserve(std::max<size_t>(S, 1) * 16);
  m.num_token_segments = m.ws.reserve(4);
  if (!bf16) {  // FP8 activations and the CUTLASS workspace; bf16 experts quantize nothing
    m.xq = m.ws.reserve(P * m.Hp);  // prefill permutes into P rows; decode uses the first T
    // scales: row-major [P, K/128] (prefill, register decode) or k-major [K/128, scale_ld] (stream)
    m.sx = m.ws.reserve(static_cast<size_t>(m.scale_ld) * (m.Hp / 128) * 4);
    m.aq = m.ws.reserve(P * m.Ip);
    m.sa = m.ws.reserve(static_cast<size_t>(m.scale_ld) * (m.Ip / 128) * 4);
    m.prefill_ws_bytes = moe_gemm_prefill_workspace_bytes(E, m.num_sms);
    m.prefill_ws = m.ws.reserve(m.prefill_ws_bytes);
  }
  m.h = m.ws.reserve(P * 2 * I * 2);
  m.a16 = m.ws.reserve(P * I * 2);
  m.y = m.ws.reserve(P * H * 2);
  if (S > 0) {
    m.d1 = m.ws.reserve(P * 2 * I * 2);
    m.d2 = m.ws.reserve(P * H * 2);
    m.part1 = m.ws.reserve(lora_partial_bytes(H, static_cast<int>(P), static_cast<int>(R)));
    m.part2 = m.ws.reserve(lora_partial_bytes(I, static_cast<int>(P), static_cast<int>(R)));
  }
  if (m.has_shared) {
    const size_t Is = c.shared_inter;
    m.sh = m.ws.reserve(T * 2 * Is * 2);
    m.sa16 = m.ws.reserve(T * Is * 2);
    m.sout = m.ws.reserve(T * H * 2);
    if (S > 0) {
      m.sd1 = m.ws.reserve(T * 2 * Is * 2);
      m.sd2 = m.ws.reserve(T * H * 2);
      m.spart1 = m.ws.reserve(lora_partial_bytes(H, static_cast<int>(T), static_cast<int>(2 * R)));
      m.spart2 = m.ws.reserve(
          lora_partial_bytes(static_cast<int>(Is), static_cast<int>(T), static_cast<int>(R)));
    }
  }
  m.ws.allocate();
  ::moelora::cuda::wait_for_host_copies();
}

MoeLayerCuda::~MoeLayerCuda() = default;

void MoeLayerCuda::set_adapter(int slot, const MoeLayerAdapter& a) {
  Impl& m = *impl_;
  MOELORA_CHECK(slot >= 0 && slot < config_.num_slots, ErrorCode::kOutOfRange,
                "MoeLayerCuda: slot ", slot, " outside [0, ", config_.num_slots, ")");
  m.write_pool(m.gate_up, slot, a.gate_up, "experts gate_up LoRA");
  m.slot_shared_a[slot] =
      a.gate_up && a.gate_up->defined() && a.gate_up->a.dim(0) == 1 && m.gate_up.ea > 1;
  m.write_pool(m.down, slot, a.down, "experts down LoRA");
  if (m.has_shared) {
    // The shared expert's gate and up LoRAs are fused into one gate_up target: A = [A_gate; A_up]
    // (rank rg + ru), B block-diagonal; a differing up scaling is folded into B.
    LoraFactors fused;
    const LoraFactors* g = a.shared_gate;
    const LoraFactors* u = a.shared_up;
    const bool has_g = g && g->defined(), has_u = u && u->defined();
    if (has_g || has_u) {
      const int64_t H = config_.hidden, Is = config_.shared_inter;
      const int64_t rg = has_g ? g->rank() : 0, ru = has_u ? u->rank() : 0;
      const float s = has_g ? g->scaling : u->scaling;
      fused.a = Tensor::zeros(DType::kF32, {1, rg + ru, H});
      fused.b = Tensor::zeros(DType::kF32, {1, 2 * Is, rg + ru});
      fused.scaling = s;
      float* fa = fused.a.data<float>();
      float* fb = fused.b.data<float>();
      if (has_g) {
        check_shape(g->a, {1, rg, H}, "shared expert gate LoRA A");
        check_shape(g->b, {1, Is, rg}, "shared expert gate LoRA B");
        std::memcpy(fa, g->a.data<float>(), static_cast<size_t>(rg * H) * 4);
        for (int64_t n = 0; n < Is; ++n)
          for (int64_t i = 0; i < rg; ++i) fb[n * (rg + ru) + i] = g->b.data<float>()[n * rg + i];
      }
      if (has_u) {
        check_shape(u->a, {1, ru, H}, "shared expert up LoRA A");
        check_shape(u->b, {1, Is, ru}, "shared expert up LoRA B");
        std::memcpy(fa + rg * H, u->a.data<float>(), static_cast<size_t>(ru * H) * 4);
        const float ratio = u->scaling / s;
        for (int64_t n = 0; n < Is; ++n)
          for (int64_t i = 0; i < ru; ++i)
            fb[(Is + n) * (rg + ru) + rg + i] = ratio * u->b.data<float>()[n * ru + i];
      }
      m.write_pool(m.shared_gate_up, slot, &fused, "shared expert gate/up LoRA");
    } else {
      m.write_pool(m.shared_gate_up, slot, nullptr, "shared expert gate/up LoRA");
    }
    m.write_pool(m.shared_down, slot, a.shared_down, "shared expert down LoRA");
  }
  // The next forward / replay reads the slot on other streams.
  ::moelora::cuda::wait_for_host_copies();
}

void MoeLayerCuda::clear_adapter(int slot) {
  set_adapter(slot, MoeLayerAdapter{});
}

void MoeLayerCuda::randomize_weights(uint64_t seed) {
  Impl& m = *impl_;
  const MoeLayerConfig& c = config_;
  const size_t E = c.num_experts, H = c.hidden, I = c.inter;
  if (c.bf16_experts) {
    // uniform in [-a, a) has standard deviation a / sqrt(3) ~ 1 / sqrt(fan-in): outputs stay O(1)
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.w13), E * 2 * I * H,
                                                    1.7f / std::sqrt(static_cast<float>(H)), 1, 1,
                                                    1, seed + 1);
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.w2), E * H * I,
                                                    1.7f / std::sqrt(static_cast<float>(I)), 1, 1,
                                                    1, seed + 2);
  } else {
    fill_e4m3_kernel<<<kFillBlocks, kFillThreads>>>(m.w<uint8_t>(m.w13), E * 2 * I * m.Hp,
                                                    seed + 1);
    fill_e4m3_kernel<<<kFillBlocks, kFillThreads>>>(m.w<uint8_t>(m.w2), E * H * I, seed + 2);
    // dequantized magnitude ~ 8 * scale: pick scales so that outputs stay O(1)
    const float s13 = 1.0f / (8.0f * std::sqrt(static_cast<float>(H))),
                s2 = 1.0f / (8.0f * std::sqrt(static_cast<float>(I)));
    fill_f32_kernel<<<kFillBlocks, kFillThreads>>>(
        m.w<float>(m.w13s), E * (2 * I / 128) * (m.Hp / 128), 0.5f * s13, 1.5f * s13, seed + 3);
    fill_f32_kernel<<<kFillBlocks, kFillThreads>>>(
        m.w<float>(m.w2s), E * ((H + 127) / 128) * (I / 128), 0.5f * s2, 1.5f * s2, seed + 4);
  }
  fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.router), E * H,
                                                  2.0f / std::sqrt(static_cast<float>(H)), 1, 1, 1,
                                                  seed + 5);
  if (m.has_bias)
    fill_f32_kernel<<<kFillBlocks, kFillThreads>>>(m.w<float>(m.bias), E, -0.01f, 0.01f, seed + 6);
  if (m.has_shared) {
    const size_t Is = c.shared_inter;
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.sw13), 2 * Is * H,
                                                    1.7f / std::sqrt(static_cast<float>(H)), 1, 1,
                                                    1, seed + 7);
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.sw2), H * Is,
                                                    1.7f / std::sqrt(static_cast<float>(Is)), 1, 1,
                                                    1, seed + 8);
    if (m.has_shared_gate)
      fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.sgate), H,
                                                      1.7f / std::sqrt(static_cast<float>(H)), 1, 1,
                                                      1, seed + 9);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
}

void MoeLayerCuda::randomize_adapter(int slot, int rank, bool shared_outer, uint64_t seed) {
  Impl& m = *impl_;
  const MoeLayerConfig& c = config_;
  MOELORA_CHECK(slot >= 0 && slot < c.num_slots && rank > 0 && rank <= c.max_rank,
                ErrorCode::kInvalidArgument, "randomize_adapter: slot ", slot, " / rank ", rank,
                " outside the pool (", c.num_slots, " slots, rank <= ", c.max_rank, ")");
  auto fill = [&](const PoolTarget& t, bool a_shared, bool b_shared, uint64_t s) {
    if (!t.present) return;
    const size_t R = t.max_rank;
    const size_t a_experts = a_shared ? 1 : t.ea, b_experts = b_shared ? 1 : t.eb;
    // A [ea, R, in]: rows r >= rank zero; B [eb, out, R]: columns r >= rank zero
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(
        m.pool.at<__nv_bfloat16>(t.a) + static_cast<size_t>(slot) * t.ea * R * t.in,
        a_experts * R * t.in, 1.7f / std::sqrt(static_cast<float>(t.in)), t.in, R, rank, s);
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(
        m.pool.at<__nv_bfloat16>(t.b) + static_cast<size_t>(slot) * t.eb * t.out * R,
        b_experts * t.out * R, 1.7f / std::sqrt(static_cast<float>(rank)), 1, R, rank, s + 1);
    const float scaling = 1.0f;
    const int32_t r32 = rank;
    const uint8_t as = a_shared && t.ea > 1, bs = b_shared && t.eb > 1;
    MOELORA_CUDA_CHECK(
        cudaMemcpy(m.pool.at<float>(t.scaling) + slot, &scaling, 4, cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(m.pool.at<int32_t>(t.rank) + slot, &r32, 4, cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(m.pool.at<uint8_t>(t.a_shared) + slot, &as, 1, cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(m.pool.at<uint8_t>(t.b_shared) + slot, &bs, 1, cudaMemcpyHostToDevice));
  };
  fill(m.gate_up, shared_outer, false, seed + 11);
  m.slot_shared_a[slot] = shared_outer && m.gate_up.ea > 1;
  fill(m.down, false, shared_outer, seed + 13);
  fill(m.shared_gate_up, false, false, seed + 15);
  fill(m.shared_down, false, false, seed + 17);
  MOELORA_CUDA_CHECK_LAUNCH();
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
}

void MoeLayerCuda::forward(const MoeForwardArgs& f) {
  Impl& m = *impl_;
  const MoeLayerConfig& c = config_;
  const int T = f.tokens, E = c.num_experts, H = c.hidden, I = c.inter, k = c.top_k;
  MOELORA_CHECK(T > 0 && T <= c.max_tokens, ErrorCode::kInvalidArgument,
                "MoeLayerCuda::forward: tokens = ", T, " outside [1, max_tokens = ", c.max_tokens,
                "]");
  MOELORA_CHECK(f.x && f.out, ErrorCode::kInvalidArgument,
                "MoeLayerCuda::forward: x and out are required");
  const bool lora = f.lora && c.num_slots > 0 && f.slot;
  const bool shared = f.shared && m.has_shared;
  const int P = T * k;
  auto* cublas = static_cast<cublasHandle_t>(m.cublas.get());
  int32_t* offsets = m.x<int32_t>(m.offsets);
  const int32_t* num_pairs = offsets + E;  // device value: number of routed pairs

  // 1. router GEMM + route
  const float* logits = f.router_logits;
  if (!logits) {
    gemm_bf16_nt(cublas, m.main, f.x, m.w<__nv_bfloat16>(m.router), m.x<float>(m.logits),
                 CUDA_R_32F, T, E, H);
    logits = m.x<float>(m.logits);
  }
  RouteDeviceArgs ra;
  ra.logits = logits;
  ra.correction_bias = m.has_bias ? m.w<float>(m.bias) : nullptr;
  ra.num_tokens = f.num_tokens;
  ra.topk_ids = m.x<int32_t>(m.ids);
  ra.topk_weights = m.x<float>(m.tw);
  ra.max_tokens = T;
  launch_route(c.route, ra, m.main);

  // 2. align
  MoeAlignDeviceArgs aa;
  aa.topk_ids = m.x<int32_t>(m.ids);
  aa.slot = lora ? f.slot : nullptr;
  aa.max_tokens = T;
  aa.top_k = k;
  aa.num_experts = E;
  aa.num_slots = lora ? c.num_slots : 0;
  aa.expert_offsets = offsets;
  aa.sorted_pair = m.x<int32_t>(m.sorted_pair);
  aa.sorted_token = m.x<int32_t>(m.sorted_token);
  aa.pair_pos = m.x<int32_t>(m.pair_pos);
  aa.active_experts = m.x<int32_t>(m.active);
  aa.num_active = m.x<int32_t>(m.num_active);
  aa.lora_segments = lora ? m.x<int4>(m.segments) : nullptr;
  aa.num_lora_segments = m.x<int32_t>(m.num_segments);
  aa.max_lora_segments = lora ? std::min(P, c.num_slots * E) : 0;
  aa.num_tokens = f.num_tokens;
  aa.token_sorted = lora ? m.x<int32_t>(m.token_sorted) : nullptr;
  aa.token_pos = lora ? m.x<int32_t>(m.token_pos) : nullptr;
  aa.token_segments = lora ? m.x<int4>(m.token_segments) : nullptr;
  aa.num_token_segments = lora ? m.x<int32_t>(m.num_token_segments) : nullptr;
  // Decode on FP8 experts chains route -> align -> quant -> GEMM1 -> activation -> GEMM2 ->
  // finalize with programmatic dependent launches (each kernel's launch and prologue overlap its
  // predecessor's tail; docs/gpu_moe.md §1 says what each may read before its wait).
  const bool decode = gemm_path_ == GemmPath::kDecode || gemm_path_ == GemmPath::kDecodeRegister ||
                      (gemm_path_ == GemmPath::kAuto && should_use_decode_gemm(T, k, E));
  const bool register_decode = decode && gemm_path_ == GemmPath::kDecodeRegister;
  const bool stream = decode && !register_decode && !c.bf16_experts;
  aa.pdl = stream;
  launch_moe_align(aa, m.main);
  if (lora) m.ev_route.record(m.main);

  // side stream, seam 1 (and the shared expert's gate/up LoRA)
  // Row chunks per segment: a (slot, expert) segment holds about the busiest expert's tokens; a
  // token segment may hold every token (one adapter over a whole prefill).
  const int expected_expert_rows = std::min(T, 2 * ((T * k + E - 1) / E) + 6);
  LoraSegmentsView pair_segments{m.x<int4>(m.segments), m.x<int32_t>(m.num_segments),
                                 aa.max_lora_segments, (expected_expert_rows + 31) / 32};
  LoraSegmentsView token_segments{m.x<int4>(m.token_segments), m.x<int32_t>(m.num_token_segments),
                                  std::min(T, c.num_slots), (T + 31) / 32};
  auto* cublas_side = static_cast<cublasHandle_t>(m.cublas_side.get());
  // Prefill-sized forwards take the tensor-core shrink / expand (64-row tiles of a segment through
  // mma.sync): from kLoraMmaMinTokens tokens on, a segment holds enough rows that the CUDA-core
  // kernels' per-row FMA work dominates (lora_mma_cuda.cuh). Decode sizes keep the CUDA-core
  // kernels, whose split-K shrink spreads a few rows over many CTAs. Both write the same partial
  // and delta layouts; the mma shrink fills split 0 only, so its expand runs with splits = 1.
  const bool lora_mma = lora_path_ == LoraPath::kTensorCore ||
                        (lora_path_ == LoraPath::kAuto && should_use_lora_mma(T));
  // The LoRA of one target, on the side stream: shrink x rows (gathered) into fp32 partials (the
  // segmented kernel, or one dense cuBLAS GEMM over all T rows of x when `dense_a` is given), then
  // expand into `delta` (rows in the segments' order). max_rows bounds the rows of all segments
  // together (the mma kernels' grid capacity): T * k for expert pairs, T for tokens.
  auto run_lora = [&](const PoolTarget& t, const LoraSegmentsView& seg, int max_rows,
                      const __nv_bfloat16* x, const int32_t* gather, float* partial,
                      int row_capacity, __nv_bfloat16* delta, const __nv_bfloat16* dense_a) {
    LoraExpandArgs e;
    e.pool = m.view(t);
    e.seg = seg;
    e.partial = partial;
    e.delta = delta;
    if (dense_a) {
      gemm_bf16_nt(cublas_side, m.side, x, dense_a, partial, CUDA_R_32F, T, t.max_rank, t.in);
      e.row_capacity = c.max_tokens;
      e.splits = 1;
      e.u_row = gather;  // u rows are x rows
    } else {
      LoraShrinkArgs sh;
      sh.pool = e.pool;
      sh.seg = seg;
      sh.x = x;
      sh.gather = gather;
      sh.partial = partial;
      sh.row_capacity = row_capacity;
      if (lora_mma) {
        launch_lora_shrink_mma(sh, max_rows, m.side);
        e.splits = 1;
      } else {
        launch_lora_shrink(sh, m.side);
      }
      e.row_capacity = row_capacity;
    }
    if (lora_mma) {
      launch_lora_expand_mma(e, max_rows, m.side);
    } else {
      launch_lora_expand(e, m.side);
    }
  };
  // A slot's A factor of target t (expert 0), for the dense single-adapter shrink.
  auto slot_a = [&](const PoolTarget& t, int slot) {
    return m.pool.at<__nv_bfloat16>(t.a) + static_cast<size_t>(slot) * t.ea * t.max_rank * t.in;
  };

  if (lora) {
    MOELORA_CHECK(f.single_slot >= -1 && f.single_slot < c.num_slots, ErrorCode::kOutOfRange,
                  "MoeLayerCuda::forward: single_slot ", f.single_slot, " outside [-1, ",
                  c.num_slots, ")");
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.side, m.ev_route.get(), 0));
    const int single = f.single_slot;
    // One adapter whose gate_up A is shared by the experts: u = x A^T depends on the token only,
    // so one dense GEMM over the T tokens replaces the per-pair shrink (k times fewer rows); base
    // tokens' rows are computed but never expanded.
    run_lora(m.gate_up, pair_segments, P, f.x, m.x<int32_t>(m.sorted_token), m.x<float>(m.part1),
             m.P, m.x<__nv_bfloat16>(m.d1),
             single >= 0 && m.slot_shared_a[single] ? slot_a(m.gate_up, single) : nullptr);
    m.ev_lora1.record(m.side);
    if (shared) {  // the shared expert's A is a plain [R, H] matrix: dense for a single adapter
      run_lora(m.shared_gate_up, token_segments, T, f.x, m.x<int32_t>(m.token_sorted),
               m.x<float>(m.spart1), c.max_tokens, m.x<__nv_bfloat16>(m.sd1),
               single >= 0 ? slot_a(m.shared_gate_up, single) : nullptr);
      m.ev_shared_lora1.record(m.side);
    }
  }

  // Expected busiest expert under near-uniform routing; the GEMM kernels loop over more tokens
  // when an expert gets more, so this only picks the fastest instance / grid.
  const int max_active = std::min(E, P);
  const int max_tokens_per_expert = std::min(T, 2 * ((T * k + E - 1) / E) + 6);

  // 3-5, bf16 experts: GEMM1 gathers bf16 x rows through sorted_token, the activation writes
  // only the bf16 copy, GEMM2 reads it. No FP8 anywhere.
  MoeGemmBf16Args b1;
  if (c.bf16_experts) {
    b1.act = f.x;
    b1.gather = m.x<int32_t>(m.sorted_token);
    b1.weight = m.w<__nv_bfloat16>(m.w13);
    b1.expert_offsets = offsets;
    b1.active_experts = m.x<int32_t>(m.active);
    b1.num_active = m.x<int32_t>(m.num_active);
    b1.out = m.x<__nv_bfloat16>(m.h);
    b1.num_experts = E;
    b1.n = 2 * I;
    b1.k = H;
    b1.max_active_experts = max_active;
    b1.max_tokens_per_expert = max_tokens_per_expert;
    b1.tile = gemm_path_ == GemmPath::kPrefill ? MoeGemmBf16Tile::kPrefill
              : gemm_path_ == GemmPath::kAuto  ? MoeGemmBf16Tile::kAuto
                                               : MoeGemmBf16Tile::kDecode;
    launch_moe_gemm_bf16(b1, m.main);
  }

  // 3. quant + GEMM1 (FP8 experts). Decode (stream kernel) and prefill (CUTLASS) read each
  // expert's rows contiguously, so the quant kernel permutes x into sorted order; the stream
  // kernel takes its scales k-major. The register decode kernel gathers per-token FP8 rows.
  const int scale_ld = stream ? m.scale_ld : 0;
  MoeGemmFp8Args g1;
  MoeGemmPrefillWorkspace pws{m.x<void>(m.prefill_ws), m.prefill_ws_bytes, m.num_sms};
  auto run_gemm = [&](const MoeGemmFp8Args& g) {
    if (stream) {
      launch_moe_gemm_fp8_stream(g, m.num_sms, /*pdl=*/true, m.main);
    } else if (register_decode) {
      launch_moe_gemm_fp8_decode(g, m.num_sms, m.main);
    } else {
      launch_moe_gemm_fp8_prefill(g, pws, m.main);
    }
  };
  if (!c.bf16_experts) {
    QuantFp8DeviceArgs qa;
    qa.x = f.x;
    qa.gather = register_decode ? nullptr : m.x<int32_t>(m.sorted_token);
    qa.num_rows = register_decode ? f.num_tokens : num_pairs;
    qa.max_rows = register_decode ? T : P;
    qa.cols = H;
    qa.cols_padded = m.Hp;
    qa.q = m.x<uint8_t>(m.xq);
    qa.scale = m.x<float>(m.sx);
    qa.scale_ld = scale_ld;
    qa.pdl = stream;
    launch_quantize_fp8_rows(qa, m.main);

    g1.act = m.x<uint8_t>(m.xq);
    g1.act_scale = m.x<float>(m.sx);
    g1.act_rows = m.P;
    g1.act_scale_ld = scale_ld;
    g1.gather = register_decode ? m.x<int32_t>(m.sorted_token) : nullptr;
    g1.weight = m.w<uint8_t>(m.w13);
    g1.weight_scale = m.w<float>(m.w13s);
    g1.expert_offsets = offsets;
    g1.active_experts = m.x<int32_t>(m.active);
    g1.num_active = m.x<int32_t>(m.num_active);
    g1.out = m.x<__nv_bfloat16>(m.h);
    g1.num_experts = E;
    g1.n = 2 * I;
    g1.k = m.Hp;
    g1.max_active_experts = max_active;
    g1.max_tokens_per_expert = max_tokens_per_expert;
    run_gemm(g1);
  }

  // 4. activation (+ seam-1 delta)
  if (lora) MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.main, m.ev_lora1.get(), 0));
  MoeActivationArgs act;
  act.h = m.x<__nv_bfloat16>(m.h);
  act.delta = lora ? m.x<__nv_bfloat16>(m.d1) : nullptr;
  act.row_token = m.x<int32_t>(m.sorted_token);
  act.slot = lora ? f.slot : nullptr;
  act.num_rows = num_pairs;
  act.max_rows = P;
  act.inter = I;
  act.inter_padded = round_up(I, 128);  // = Ip for FP8 experts (I % 128 == 0)
  act.a16 = m.x<__nv_bfloat16>(m.a16);
  act.aq = c.bf16_experts ? nullptr : m.x<uint8_t>(m.aq);
  act.sa = c.bf16_experts ? nullptr : m.x<float>(m.sa);
  act.scale_ld = scale_ld;
  // After GEMM1 with no event to join, the activation is a programmatic dependent of the stream
  // kernel: it is scheduled while GEMM1 drains and GEMM2 after it prefetches its weights.
  act.pdl = stream && !lora;
  launch_moe_activation(act, m.main);
  if (lora) {
    m.ev_act.record(m.main);
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.side, m.ev_act.get(), 0));
    run_lora(m.down, pair_segments, P, m.x<__nv_bfloat16>(m.a16), nullptr, m.x<float>(m.part2), m.P,
             m.x<__nv_bfloat16>(m.d2), nullptr);
  }

  // 5. GEMM2
  if (c.bf16_experts) {
    MoeGemmBf16Args b2 = b1;
    b2.act = m.x<__nv_bfloat16>(m.a16);
    b2.gather = nullptr;
    b2.weight = m.w<__nv_bfloat16>(m.w2);
    b2.out = m.x<__nv_bfloat16>(m.y);
    b2.n = H;
    b2.k = I;
    launch_moe_gemm_bf16(b2, m.main);
  } else {
    MoeGemmFp8Args g2 = g1;
    g2.act = m.x<uint8_t>(m.aq);
    g2.act_scale = m.x<float>(m.sa);
    g2.act_scale_ld = scale_ld;
    g2.gather = nullptr;
    g2.weight = m.w<uint8_t>(m.w2);
    g2.weight_scale = m.w<float>(m.w2s);
    g2.out = m.x<__nv_bfloat16>(m.y);
    g2.n = H;
    g2.k = m.Ip;
    run_gemm(g2);
  }

  // 6. shared expert (bf16), its LoRA deltas from the side stream
  if (shared) {
    const int Is = c.shared_inter;
    gemm_bf16_nt(cublas, m.main, f.x, m.w<__nv_bfloat16>(m.sw13), m.x<__nv_bfloat16>(m.sh),
                 CUDA_R_16BF, T, 2 * Is, H);
    if (lora) MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.main, m.ev_shared_lora1.get(), 0));
    MoeActivationArgs sact;
    sact.h = m.x<__nv_bfloat16>(m.sh);
    sact.delta = lora ? m.x<__nv_bfloat16>(m.sd1) : nullptr;
    sact.delta_row = lora ? m.x<int32_t>(m.token_pos) : nullptr;
    sact.row_token = nullptr;
    sact.slot = lora ? f.slot : nullptr;
    sact.num_rows = f.num_tokens;
    sact.max_rows = T;
    sact.inter = Is;
    sact.inter_padded = round_up(Is, 128);
    sact.a16 = m.x<__nv_bfloat16>(m.sa16);
    sact.aq = nullptr;
    sact.sa = nullptr;
    launch_moe_activation(sact, m.main);
    gemm_bf16_nt(cublas, m.main, m.x<__nv_bfloat16>(m.sa16), m.w<__nv_bfloat16>(m.sw2),
                 m.x<__nv_bfloat16>(m.sout), CUDA_R_16BF, T, H, Is);
    if (lora) {
      m.ev_shared_act.record(m.main);
      MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.side, m.ev_shared_act.get(), 0));
      run_lora(m.shared_down, token_segments, T, m.x<__nv_bfloat16>(m.sa16),
               m.x<int32_t>(m.token_sorted), m.x<float>(m.spart2), c.max_tokens,
               m.x<__nv_bfloat16>(m.sd2), nullptr);
    }
  }
  if (lora) {
    m.ev_lora2.record(m.side);
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.main, m.ev_lora2.get(), 0));
  }

  // 7. finalize
  MoeFinalizeArgs fa;
  fa.y = m.x<__nv_bfloat16>(m.y);
  fa.delta = lora ? m.x<__nv_bfloat16>(m.d2) : nullptr;
  fa.topk_ids = m.x<int32_t>(m.ids);
  fa.topk_weights = m.x<float>(m.tw);
  fa.pair_pos = m.x<int32_t>(m.pair_pos);
  fa.slot = lora ? f.slot : nullptr;
  fa.shared = shared ? m.x<__nv_bfloat16>(m.sout) : nullptr;
  fa.shared_delta = (shared && lora) ? m.x<__nv_bfloat16>(m.sd2) : nullptr;
  fa.shared_delta_row = (shared && lora) ? m.x<int32_t>(m.token_pos) : nullptr;
  fa.shared_gate = (shared && m.has_shared_gate) ? m.w<__nv_bfloat16>(m.sgate) : nullptr;
  fa.x = f.x;
  fa.num_tokens = f.num_tokens;
  fa.max_tokens = T;
  fa.top_k = k;
  fa.hidden = H;
  fa.out = f.out;
  fa.pdl = stream && !lora && !shared;  // directly after GEMM2 on this stream
  launch_moe_finalize(fa, m.main);
}

uint64_t MoeLayerCuda::expert_bytes() const {
  const uint64_t H = config_.hidden, I = config_.inter;
  if (config_.bf16_experts) return 3 * H * I * 2;
  const uint64_t scales = (2 * I / 128) * ((H + 127) / 128) * 4 + ((H + 127) / 128) * (I / 128) * 4;
  return 3 * H * I + scales;
}
uint64_t MoeLayerCuda::router_bytes() const {
  return static_cast<uint64_t>(config_.num_experts) * config_.hidden * 2;
}
uint64_t MoeLayerCuda::shared_bytes() const {
  return impl_->has_shared ? 3ull * config_.hidden * config_.shared_inter * 2 : 0;
}
size_t MoeLayerCuda::workspace_bytes() const {
  return impl_->ws.size();
}
MoeLayerCuda::DeviceView MoeLayerCuda::device_view() const {
  const Impl& m = *impl_;
  DeviceView v{};
  if (config_.bf16_experts) {
    v.w13_bf16 = m.w<__nv_bfloat16>(m.w13);
    v.w2_bf16 = m.w<__nv_bfloat16>(m.w2);
  } else {
    v.w13 = m.w<uint8_t>(m.w13);
    v.w13_scale = m.w<float>(m.w13s);
    v.w2 = m.w<uint8_t>(m.w2);
    v.w2_scale = m.w<float>(m.w2s);
  }
  v.correction_bias = m.has_bias ? m.w<float>(m.bias) : nullptr;
  v.router = m.w<__nv_bfloat16>(m.router);
  v.shared_w13 = m.has_shared ? m.w<__nv_bfloat16>(m.sw13) : nullptr;
  v.shared_w2 = m.has_shared ? m.w<__nv_bfloat16>(m.sw2) : nullptr;
  if (config_.num_slots > 0) {
    v.lora_a13 = m.pool.at<__nv_bfloat16>(m.gate_up.a);
    v.lora_b13 = m.pool.at<__nv_bfloat16>(m.gate_up.b);
    v.lora_a2 = m.pool.at<__nv_bfloat16>(m.down.a);
    v.lora_b2 = m.pool.at<__nv_bfloat16>(m.down.b);
    v.lora_a13_experts = m.gate_up.ea;
    v.lora_b2_experts = m.down.eb;
    v.max_rank = config_.max_rank;
  }
  v.hidden_padded = m.Hp;
  return v;
}
const int32_t* MoeLayerCuda::topk_ids() const {
  return impl_->x<int32_t>(impl_->ids);
}
const float* MoeLayerCuda::topk_weights() const {
  return impl_->x<float>(impl_->tw);
}

}  // namespace moelora::ops::cuda
