// MoeLayerCuda: weights, adapter pool and workspace of one MoE layer (its forward, the two-stream
// pipeline of docs/gpu_moe.md §1, is in moe_layer_forward_cuda.cu).
//
// NVFP4 experts (MoeLayerConfig::nvfp4_experts) run the bf16 experts' pipeline below with the NVFP4
// stream GEMM (ops/gemm/moe_gemm_nvfp4.h): x rows gathered into f16 (rows_to_f16_pow2) for GEMM1,
// the activation's bf16 copy converted likewise for GEMM2; weights stored as the kernel's image.
//
// bf16 experts (MoeLayerConfig::bf16_experts) run the same pipeline without any FP8: no quant
// kernel, GEMM1 = bf16 grouped GEMM over x rows gathered through sorted_token, the activation
// writes only the bf16 copy a16 (which the down LoRA reads anyway) and GEMM2 reads a16. Weights
// are stored unpadded ([E, 2I, H], [E, H, I]); H and I need only be multiples of 8.
#include "ops/moe/moe_layer_cuda.cuh"
#include "ops/moe/moe_layer_impl_cuda.cuh"
#include "ops/moe_gemv/moe_gemv_cuda.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/gemm/moe_gemm.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/gemm/moe_gemm_nvfp4.h"
#include "ops/gemm/stream_gemm_common.cuh"
#include "ops/lora/lora_cuda.cuh"
#include "ops/lora/lora_mma_cuda.cuh"
#include "ops/moe/moe_cuda.cuh"
#include "ops/moe_align/moe_align_cuda.cuh"
#include "ops/quant/quant_cuda.cuh"
#include "ops/route/route_cuda.cuh"

namespace moelora::ops::cuda {

using moe_layer_internal::PoolTarget;
using moe_layer_internal::round_up;

static_assert(kMoeLayerStreamMaxExperts == stream_gemm::kMaxExperts,
              "the layer's expert bound is the stream GEMMs' schedule capacity");

namespace {

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
// The NVFP4 stream image: random code bytes, group-scale bytes in [0x30, 0x3f] (0.5 .. 1.875).
__global__ void fill_nvfp4_image_kernel(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed ^ (i * 0x2545f4914f6cdd1dull));
    p[i] = i % kNvfp4StreamBlockBytes < kNvfp4StreamCodeBytes ? static_cast<uint8_t>(h)
                                                             : static_cast<uint8_t>(0x30 | (h & 0xf));
  }
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

}  // namespace

void MoeSharedWorkspace::reserve(size_t bytes) {
  if (bytes > buffer_.bytes()) buffer_ = ::moelora::cuda::DeviceBuffer(bytes);
}

void* MoeSharedWorkspace::cublas_main() {
  if (!cublas_main_) cublas_main_.emplace();
  return cublas_main_->get();
}

void* MoeSharedWorkspace::cublas_side() {
  if (!cublas_side_) cublas_side_.emplace();
  return cublas_side_->get();
}

cudaStream_t MoeSharedWorkspace::shared_lora_stream() {
  if (!shared_lora_stream_)
    shared_lora_stream_.emplace(::moelora::cuda::Stream::greatest_priority());
  return shared_lora_stream_->get();
}

MoeLayerCuda::MoeLayerCuda(const MoeLayerConfig& config, const MoeLayerHostWeights& hw,
                           cudaStream_t main_stream, cudaStream_t side_stream,
                           MoeSharedWorkspace* shared_workspace)
    : impl_(std::make_unique<Impl>(config, main_stream, side_stream)), config_(config) {
  Impl& m = *impl_;
  if (shared_workspace) {
    m.cublas = shared_workspace->cublas_main();
    m.cublas_side = shared_workspace->cublas_side();
  } else {
    m.cublas = m.own_cublas.emplace().get();
    m.cublas_side = m.own_cublas_side.emplace().get();
  }
  const MoeLayerConfig& c = config_;
  // The shared expert's LoRA stream (SideStreamScheduling::shared_lora_stream): created here,
  // before any capture, for the layers that can use it.
  if (c.shared_in_experts && c.num_slots > 0)
    m.side2 = shared_workspace
                  ? shared_workspace->shared_lora_stream()
                  : m.own_side2.emplace(::moelora::cuda::Stream::greatest_priority()).get();
  MOELORA_CHECK(c.hidden > 0 && c.inter > 0 && c.num_experts > 0 && c.top_k > 0 && c.max_tokens > 0,
                ErrorCode::kInvalidArgument, "MoeLayerCuda: H = ", c.hidden, ", I = ", c.inter,
                ", E = ", c.num_experts, ", k = ", c.top_k, ", max_tokens = ", c.max_tokens,
                " must all be positive");
  MOELORA_CHECK(!(c.bf16_experts && c.nvfp4_experts), ErrorCode::kInvalidArgument,
                "MoeLayerCuda: bf16_experts and nvfp4_experts are exclusive");
  MOELORA_CHECK(!c.nvfp4_experts || (c.hidden % 128 == 0 && c.inter % 128 == 0), ErrorCode::kUnsupported,
                "MoeLayerCuda: NVFP4 experts need H % 128 == 0 and I % 128 == 0 (got H = ", c.hidden, ", I = ",
                c.inter, "): the stream kernel's 128-row tiles and 128-column stages");
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
  const int Er = static_cast<int>(c.route.num_experts);  // experts the router scores
  MOELORA_CHECK(c.expert_begin >= 0 && c.expert_begin + E <= Er, ErrorCode::kInvalidArgument,
                "MoeLayerCuda: experts [", c.expert_begin, ", ", c.expert_begin + E,
                ") are not among the router's ", Er,
                " (route.num_experts: num_experts, or all experts under expert parallelism)");
  const bool bf16 = c.bf16_experts, nvfp4 = c.nvfp4_experts;
  MOELORA_CHECK(!c.shared_in_experts || E + 1 <= kMoeLayerStreamMaxExperts, ErrorCode::kUnsupported,
                "MoeLayerCuda: shared_in_experts makes E + 1 = ", E + 1,
                " experts; the decode GEMMs schedule at most ", kMoeLayerStreamMaxExperts,
                " (keep the shared expert separate)");
  MOELORA_CHECK(
      !c.shared_in_experts ||
          (c.shared_inter == I && !bf16 && !nvfp4 && c.expert_begin == 0 && Er == E),
      ErrorCode::kInvalidArgument,
      "MoeLayerCuda: shared_in_experts needs a shared expert of the routed experts' size (Is = ",
      c.shared_inter, ", I = ", I, "), FP8 experts and every expert on this layer (experts [",
      c.expert_begin, ", ", c.expert_begin + E, ") of ", Er, ")");
  m.Hp = bf16 ? H : round_up(H, 128);  // FP8: whole scale blocks; bf16 needs no padding (NVFP4: none)
  m.Ip = I;
  // The shared expert among the routed ones: expert E of the stacks, pair k of every token.
  m.Ex = E + (c.shared_in_experts ? 1 : 0);
  m.P = c.max_tokens * (k + (c.shared_in_experts ? 1 : 0));
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
    check_shape(hw.router, {Er, H}, "MoeLayerCuda: router");
  } else if (upload && nvfp4) {
    check_dtype(hw.w13, DType::kU8, "MoeLayerCuda: w13 (NVFP4 codes)");
    check_shape(hw.w13, {E, 2 * I, H / 2}, "MoeLayerCuda: w13 (NVFP4 codes)");
    check_shape(hw.w13_scale, {E, 2 * I, H / 16}, "MoeLayerCuda: w13_scale (NVFP4)");
    check_shape(hw.w13_scale_2, {E, 2 * I}, "MoeLayerCuda: w13_scale_2 (NVFP4)");
    check_dtype(hw.w13_scale_2, DType::kF32, "MoeLayerCuda: w13_scale_2 (NVFP4)");
    check_dtype(hw.w2, DType::kU8, "MoeLayerCuda: w2 (NVFP4 codes)");
    check_shape(hw.w2, {E, H, I / 2}, "MoeLayerCuda: w2 (NVFP4 codes)");
    check_shape(hw.w2_scale, {E, H, I / 16}, "MoeLayerCuda: w2_scale (NVFP4)");
    check_shape(hw.w2_scale_2, {E, H}, "MoeLayerCuda: w2_scale_2 (NVFP4)");
    check_dtype(hw.w2_scale_2, DType::kF32, "MoeLayerCuda: w2_scale_2 (NVFP4)");
    check_shape(hw.router, {Er, H}, "MoeLayerCuda: router");
  } else if (upload) {
    check_shape(hw.w13, {E, 2 * I, H}, "MoeLayerCuda: w13");
    check_dtype(hw.w13, DType::kF8E4M3, "MoeLayerCuda: w13");
    check_shape(hw.w13_scale, {E, 2 * I / 128, (H + 127) / 128}, "MoeLayerCuda: w13_scale");
    check_shape(hw.w2, {E, H, I}, "MoeLayerCuda: w2");
    check_dtype(hw.w2, DType::kF8E4M3, "MoeLayerCuda: w2");
    check_shape(hw.w2_scale, {E, (H + 127) / 128, I / 128}, "MoeLayerCuda: w2_scale");
    check_shape(hw.router, {Er, H}, "MoeLayerCuda: router");
    if (c.shared_in_experts) {  // expert E of the stacks
      check_shape(hw.shared_w13, {2 * I, H}, "MoeLayerCuda: shared_w13 (shared_in_experts)");
      check_dtype(hw.shared_w13, DType::kF8E4M3, "MoeLayerCuda: shared_w13 (shared_in_experts)");
      check_shape(hw.shared_w13_scale, {2 * I / 128, (H + 127) / 128},
                  "MoeLayerCuda: shared_w13_scale");
      check_shape(hw.shared_w2, {H, I}, "MoeLayerCuda: shared_w2 (shared_in_experts)");
      check_dtype(hw.shared_w2, DType::kF8E4M3, "MoeLayerCuda: shared_w2 (shared_in_experts)");
      check_shape(hw.shared_w2_scale, {(H + 127) / 128, I / 128}, "MoeLayerCuda: shared_w2_scale");
    }
  }
  m.has_bias = upload ? hw.correction_bias.defined() : c.route.kind == RouterKind::kSigmoidNoauxTc;
  m.has_shared = c.shared_inter > 0;
  m.has_shared_gate = m.has_shared && c.shared_gate;
  if (bf16) {
    m.w13 = m.weights.reserve(static_cast<size_t>(E) * 2 * I * H * 2);
    m.w2 = m.weights.reserve(static_cast<size_t>(E) * H * I * 2);
  } else if (nvfp4) {  // the stream kernel's images ([E, N/64, K/128] blocks) and per-row scale_2
    m.w13 = m.weights.reserve(static_cast<size_t>(E) * (2 * I / 64) * (H / 128) * kNvfp4StreamBlockBytes);
    m.w13s = m.weights.reserve(static_cast<size_t>(E) * 2 * I * 4);
    m.w2 = m.weights.reserve(static_cast<size_t>(E) * (H / 64) * (I / 128) * kNvfp4StreamBlockBytes);
    m.w2s = m.weights.reserve(static_cast<size_t>(E) * H * 4);
  } else {  // FP8: Ex experts (the shared one last with shared_in_experts)
    m.w13 = m.weights.reserve(static_cast<size_t>(m.Ex) * 2 * I * m.Hp);
    m.w13s = m.weights.reserve(static_cast<size_t>(m.Ex) * (2 * I / 128) * (m.Hp / 128) * 4);
    m.w2 = m.weights.reserve(static_cast<size_t>(m.Ex) * H * I);
    m.w2s = m.weights.reserve(static_cast<size_t>(m.Ex) * ((H + 127) / 128) * (I / 128) * 4);
  }
  m.router = m.weights.reserve(static_cast<size_t>(Er) * H * 2);
  if (m.has_bias) m.bias = m.weights.reserve(static_cast<size_t>(Er) * 4);
  if (m.has_shared) {
    if (upload) {
      check_shape(hw.shared_w13, {2 * c.shared_inter, H}, "MoeLayerCuda: shared_w13");
      check_shape(hw.shared_w2, {H, c.shared_inter}, "MoeLayerCuda: shared_w2");
    }
    if (!c.shared_in_experts) {  // bf16, for the cuBLAS GEMMs
      m.sw13 = m.weights.reserve(static_cast<size_t>(2) * c.shared_inter * H * 2);
      m.sw2 = m.weights.reserve(static_cast<size_t>(H) * c.shared_inter * 2);
    }
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
  } else if (upload && nvfp4) {
    const Tensor w13 = pack_nvfp4_for_stream(hw.w13, hw.w13_scale);
    const Tensor w2 = pack_nvfp4_for_stream(hw.w2, hw.w2_scale);
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<uint8_t>(m.w13), w13.raw_data(), w13.nbytes(), cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<uint8_t>(m.w2), w2.raw_data(), w2.nbytes(), cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<float>(m.w13s), hw.w13_scale_2.raw_data(), hw.w13_scale_2.nbytes(),
                                  cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<float>(m.w2s), hw.w2_scale_2.raw_data(), hw.w2_scale_2.nbytes(),
                                  cudaMemcpyHostToDevice));
  } else if (upload) {
    // W13 rows padded from H to Hp columns (zeros), scales likewise; the shared expert after the
    // routed ones with shared_in_experts.
    std::vector<uint8_t> rows(static_cast<size_t>(m.Ex) * 2 * I * m.Hp, 0);
    const uint8_t* src = hw.w13.data<uint8_t>();
    for (size_t r = 0; r < static_cast<size_t>(E) * 2 * I; ++r)
      std::memcpy(&rows[r * m.Hp], src + r * H, H);
    if (c.shared_in_experts)
      for (size_t r = 0; r < static_cast<size_t>(2) * I; ++r)
        std::memcpy(&rows[(static_cast<size_t>(E) * 2 * I + r) * m.Hp],
                    hw.shared_w13.data<uint8_t>() + r * H, H);
    MOELORA_CUDA_CHECK(
        cudaMemcpy(m.w<uint8_t>(m.w13), rows.data(), rows.size(), cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<float>(m.w13s), hw.w13_scale.raw_data(),
                                  hw.w13_scale.nbytes(), cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(
        cudaMemcpy(m.w<uint8_t>(m.w2), hw.w2.raw_data(), hw.w2.nbytes(), cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(cudaMemcpy(m.w<float>(m.w2s), hw.w2_scale.raw_data(), hw.w2_scale.nbytes(),
                                  cudaMemcpyHostToDevice));
    if (c.shared_in_experts) {
      MOELORA_CUDA_CHECK(cudaMemcpy(m.w<uint8_t>(m.w13s) + hw.w13_scale.nbytes(),
                                    hw.shared_w13_scale.raw_data(), hw.shared_w13_scale.nbytes(),
                                    cudaMemcpyHostToDevice));
      MOELORA_CUDA_CHECK(cudaMemcpy(m.w<uint8_t>(m.w2) + hw.w2.nbytes(), hw.shared_w2.raw_data(),
                                    hw.shared_w2.nbytes(), cudaMemcpyHostToDevice));
      MOELORA_CUDA_CHECK(cudaMemcpy(m.w<uint8_t>(m.w2s) + hw.w2_scale.nbytes(),
                                    hw.shared_w2_scale.raw_data(), hw.shared_w2_scale.nbytes(),
                                    cudaMemcpyHostToDevice));
    }
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
    if (m.has_shared && !c.shared_in_experts) {
      auto s13 = to_bf16_bits(hw.shared_w13);
      auto s2 = to_bf16_bits(hw.shared_w2);
      MOELORA_CUDA_CHECK(
          cudaMemcpy(m.w<uint16_t>(m.sw13), s13.data(), s13.size() * 2, cudaMemcpyHostToDevice));
      MOELORA_CUDA_CHECK(
          cudaMemcpy(m.w<uint16_t>(m.sw2), s2.data(), s2.size() * 2, cudaMemcpyHostToDevice));
    }
    if (m.has_shared_gate) {
      auto g = to_bf16_bits(hw.shared_gate);
      MOELORA_CUDA_CHECK(
          cudaMemcpy(m.w<uint16_t>(m.sgate), g.data(), g.size() * 2, cudaMemcpyHostToDevice));
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
  m.max_segments = static_cast<int>(std::min<size_t>(T * k, S * E));  // routed pairs only
  m.logits = m.ws.reserve(T * Er * 4);
  // The router GEMM in the route launch (decode sizes): its fp32 partials and token-tile tickets.
  if (router_route_supports(c.route, H, std::min<int>(c.max_tokens, kRouterRouteMaxTokens))) {
    m.router_route_tokens = std::min<int>(c.max_tokens, kRouterRouteMaxTokens);
    m.router_partials =
        m.ws.reserve(router_route_partial_floats(Er, H, m.router_route_tokens) * sizeof(float));
    m.router_tickets =
        m.state.reserve(router_route_tickets(m.router_route_tokens) * sizeof(int32_t));
  }
  // The routing stays in the layer's own arena, not the shared workspace: topk_ids() /
  // topk_weights() report this layer's last forward after the later layers have run.
  m.ids = m.state.reserve(P * 4);
  m.tw = m.state.reserve(P * 4);
  m.offsets = m.ws.reserve((m.Ex + 1) * 4);
  m.sorted_pair = m.ws.reserve(P * 4);
  m.sorted_token = m.ws.reserve(P * 4);
  m.sorted_slot_expert = m.ws.reserve(P * 8);
  m.pair_pos = m.ws.reserve(P * 4);
  m.active = m.ws.reserve(m.Ex * 4);
  m.num_active = m.ws.reserve(4);
  m.segments = m.ws.reserve(std::max<size_t>(m.max_segments, 1) * 16);
  m.num_segments = m.ws.reserve(4);
  m.token_sorted = m.ws.reserve(T * 4);
  m.token_pos = m.ws.reserve(T * 4);
  m.token_segments = m.ws.reserve(std::max<size_t>(S, 1) * 16);
  m.num_token_segments = m.ws.reserve(4);
  if (nvfp4) {  // f16 rows of x (sorted order) and of the activation, their power-of-two scales
    m.xh = m.ws.reserve(P * H * 2);
    m.sxh = m.ws.reserve(P * 4);
    m.ah = m.ws.reserve(P * I * 2);
    m.sah = m.ws.reserve(P * 4);
    m.gemm_work = m.state.reserve(4 * sizeof(int32_t));
  } else if (!bf16) {  // FP8 activations and the CUTLASS workspace; bf16 experts quantize nothing
    m.xq = m.ws.reserve(P * m.Hp);  // prefill permutes into P rows; decode uses the first T
    // scales: row-major [P, K/128] (prefill, register decode) or k-major [K/128, scale_ld] (stream)
    m.sx = m.ws.reserve(static_cast<size_t>(m.scale_ld) * (m.Hp / 128) * 4);
    m.aq = m.ws.reserve(P * m.Ip);
    m.sa = m.ws.reserve(static_cast<size_t>(m.scale_ld) * (m.Ip / 128) * 4);
    m.prefill_ws_bytes = moe_gemm_prefill_workspace_bytes(m.Ex, m.num_sms);
    m.prefill_ws = m.ws.reserve(m.prefill_ws_bytes);
    m.gemm_work = m.state.reserve(4 * sizeof(int32_t));
    m.gemv_tickets = m.state.reserve(kMoeGemvMaxTickets * sizeof(int32_t));
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
    if (c.shared_in_experts) {  // its rows are among the pairs'
      if (S > 0) m.token_shared_row = m.ws.reserve(T * 4);
    } else {
      m.sh = m.ws.reserve(T * 2 * Is * 2);
      m.sa16 = m.ws.reserve(T * Is * 2);
      m.sout = m.ws.reserve(T * H * 2);
    }
    if (S > 0) {
      m.sd1 = m.ws.reserve(T * 2 * Is * 2);
      m.sd2 = m.ws.reserve(T * H * 2);
      m.spart1 = m.ws.reserve(lora_partial_bytes(H, static_cast<int>(T), static_cast<int>(2 * R)));
      m.spart2 = m.ws.reserve(
          lora_partial_bytes(static_cast<int>(Is), static_cast<int>(T), static_cast<int>(R)));
    }
  }
  if (shared_workspace) {
    shared_workspace->reserve(m.ws.size());
    m.shared_ws = shared_workspace;
  } else {
    m.ws.allocate();
  }
  // The counters start at zero; every launch leaves them so for the next.
  m.state.allocate();
  MOELORA_CUDA_CHECK(cudaMemset(m.state.at<void>(0), 0, m.state.size()));
  ::moelora::cuda::wait_for_host_copies();
}

MoeLayerCuda::~MoeLayerCuda() = default;

void MoeLayerCuda::set_nvfp4_instance(Nvfp4StreamInstance i) {
  MOELORA_CHECK(i != Nvfp4StreamInstance::kPrefill ||
                    (config_.hidden % 256 == 0 && 2 * config_.inter % 256 == 0),
                ErrorCode::kInvalidArgument,
                "MoeLayerCuda: the NVFP4 prefill instance needs H and 2I multiples of 256; H = ",
                config_.hidden, ", 2I = ", 2 * config_.inter);
  nvfp4_instance_ = i;
}

void MoeLayerCuda::set_side_stream_scheduling(const SideStreamScheduling& s) {
  // The switches: 1 = on, 0 = off, -1 = the layer's rule.
  auto check_switch = [](int value, const char* field) {
    MOELORA_CHECK(value >= -1 && value <= 1, ErrorCode::kInvalidArgument,
                  "SideStreamScheduling::", field, " = ", value,
                  " must be -1 (the layer's rule), 0 or 1");
  };
  check_switch(s.seam1_after_quant, "seam1_after_quant");
  check_switch(s.seam2_shrink_in_activation, "seam2_shrink_in_activation");
  check_switch(s.shared_lora_stream, "shared_lora_stream");
  check_switch(s.activation_pdl_with_shared_pairs, "activation_pdl_with_shared_pairs");
  MOELORA_CHECK(s.seam2_expand_in_finalize_max_tokens >= -1, ErrorCode::kInvalidArgument,
                "SideStreamScheduling::seam2_expand_in_finalize_max_tokens = ",
                s.seam2_expand_in_finalize_max_tokens,
                " must be -1 (the default), 0 or a token count");
  MOELORA_CHECK(s.lora_max_ctas >= -2, ErrorCode::kInvalidArgument,
                "SideStreamScheduling::lora_max_ctas = ", s.lora_max_ctas,
                " must be -2 (the layer's rule), -1 (one CTA per SM), 0 or a CTA count");
  side_scheduling_ = s;
}

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
  } else if (c.nvfp4_experts) {
    // random codes; group scales in [0.5, 1.875] (e4m3 0x30..0x3f); a code's mean magnitude ~2.4,
    // so a row scale of 1 / (2.5 sqrt(fan-in)) keeps outputs O(1)
    fill_nvfp4_image_kernel<<<kFillBlocks, kFillThreads>>>(
        m.w<uint8_t>(m.w13), E * (2 * I / 64) * (H / 128) * kNvfp4StreamBlockBytes, seed + 1);
    fill_nvfp4_image_kernel<<<kFillBlocks, kFillThreads>>>(
        m.w<uint8_t>(m.w2), E * (H / 64) * (I / 128) * kNvfp4StreamBlockBytes, seed + 2);
    const float r13 = 1.0f / (2.5f * std::sqrt(static_cast<float>(H))),
                r2 = 1.0f / (2.5f * std::sqrt(static_cast<float>(I)));
    fill_f32_kernel<<<kFillBlocks, kFillThreads>>>(m.w<float>(m.w13s), E * 2 * I, 0.5f * r13, 1.5f * r13, seed + 3);
    fill_f32_kernel<<<kFillBlocks, kFillThreads>>>(m.w<float>(m.w2s), E * H, 0.5f * r2, 1.5f * r2, seed + 4);
  } else {  // FP8: the shared expert too with shared_in_experts (expert E)
    const size_t Ex = m.Ex;
    fill_e4m3_kernel<<<kFillBlocks, kFillThreads>>>(m.w<uint8_t>(m.w13), Ex * 2 * I * m.Hp,
                                                    seed + 1);
    fill_e4m3_kernel<<<kFillBlocks, kFillThreads>>>(m.w<uint8_t>(m.w2), Ex * H * I, seed + 2);
    // dequantized magnitude ~ 8 * scale: pick scales so that outputs stay O(1)
    const float s13 = 1.0f / (8.0f * std::sqrt(static_cast<float>(H))),
                s2 = 1.0f / (8.0f * std::sqrt(static_cast<float>(I)));
    fill_f32_kernel<<<kFillBlocks, kFillThreads>>>(
        m.w<float>(m.w13s), Ex * (2 * I / 128) * (m.Hp / 128), 0.5f * s13, 1.5f * s13, seed + 3);
    fill_f32_kernel<<<kFillBlocks, kFillThreads>>>(
        m.w<float>(m.w2s), Ex * ((H + 127) / 128) * (I / 128), 0.5f * s2, 1.5f * s2, seed + 4);
  }
  const size_t Er = c.route.num_experts;
  fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.router), Er * H,
                                                  2.0f / std::sqrt(static_cast<float>(H)), 1, 1, 1,
                                                  seed + 5);
  if (m.has_bias)
    fill_f32_kernel<<<kFillBlocks, kFillThreads>>>(m.w<float>(m.bias), Er, -0.01f, 0.01f, seed + 6);
  if (m.has_shared && !c.shared_in_experts) {
    const size_t Is = c.shared_inter;
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.sw13), 2 * Is * H,
                                                    1.7f / std::sqrt(static_cast<float>(H)), 1, 1,
                                                    1, seed + 7);
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(m.w<__nv_bfloat16>(m.sw2), H * Is,
                                                    1.7f / std::sqrt(static_cast<float>(Is)), 1, 1,
                                                    1, seed + 8);
  }
  if (m.has_shared_gate)
    fill_bf16_kernel<<<kFillBlocks, kFillThreads>>>(
        m.w<__nv_bfloat16>(m.sgate), H, 1.7f / std::sqrt(static_cast<float>(H)), 1, 1, 1, seed + 9);
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

uint64_t MoeLayerCuda::expert_bytes() const {
  const uint64_t H = config_.hidden, I = config_.inter;
  if (config_.bf16_experts) return 3 * H * I * 2;
  if (config_.nvfp4_experts) return 3 * H * I / 2 + 3 * H * I / 16 + (2 * I + H) * 4;
  const uint64_t scales = (2 * I / 128) * ((H + 127) / 128) * 4 + ((H + 127) / 128) * (I / 128) * 4;
  return 3 * H * I + scales;
}
uint64_t MoeLayerCuda::router_bytes() const {
  return static_cast<uint64_t>(config_.route.num_experts) * config_.hidden * 2;
}
uint64_t MoeLayerCuda::shared_bytes() const {
  if (!impl_->has_shared) return 0;
  // FP8 with its scales as expert E, else bf16
  return config_.shared_in_experts ? expert_bytes()
                                   : 3ull * config_.hidden * config_.shared_inter * 2;
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
  } else if (config_.nvfp4_experts) {
    v.w13_nvfp4 = m.w<uint8_t>(m.w13);
    v.w13_scale_2 = m.w<float>(m.w13s);
    v.w2_nvfp4 = m.w<uint8_t>(m.w2);
    v.w2_scale_2 = m.w<float>(m.w2s);
  } else {
    v.w13 = m.w<uint8_t>(m.w13);
    v.w13_scale = m.w<float>(m.w13s);
    v.w2 = m.w<uint8_t>(m.w2);
    v.w2_scale = m.w<float>(m.w2s);
  }
  v.correction_bias = m.has_bias ? m.w<float>(m.bias) : nullptr;
  v.router = m.w<__nv_bfloat16>(m.router);
  const bool shared_bf16 = m.has_shared && !config_.shared_in_experts;
  v.shared_w13 = shared_bf16 ? m.w<__nv_bfloat16>(m.sw13) : nullptr;
  v.shared_w2 = shared_bf16 ? m.w<__nv_bfloat16>(m.sw2) : nullptr;
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
  return impl_->s<int32_t>(impl_->ids);
}
const float* MoeLayerCuda::topk_weights() const {
  return impl_->s<float>(impl_->tw);
}

}  // namespace moelora::ops::cuda
