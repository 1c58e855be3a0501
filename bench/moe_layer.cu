// bench/moe_layer: op-level benchmark of one FP8 MoE layer with multi-LoRA on the GPU
// (PERF.md "How to benchmark"). For each preset, batch size and LoRA configuration it checks the
// layer once, then times CUDA-graph replays with CUDA events (warm-up, >= 50 repetitions, median
// and min), rotating inputs and flushing L2 between repetitions so every replay streams its
// experts from HBM. It reports the byte roofline of the experts actually touched, achieved TB/s,
// % of the copy bandwidth measured in the same run, TFLOP/s for prefill, LoRA/no-LoRA time
// ratios against the ideal byte ratio, and writes JSON + Markdown with the `targets` array.
//
// Routed-only rows of the presets the peer was measured on carry the peer's µs (PERF.md: SGLang's
// Triton fused_moe FP8 on an H200, LoRA by its fast-path kernels) and a P1 target entry each;
// --compare-register also times the earlier register-fed decode GEMM on the no-LoRA decode rows
// (before / after in one run); --compare-schedule times every decode row again with the stream
// GEMMs' round-robin work items (--stream-schedule picks the timed rows' schedule). One JSON +
// Markdown file per preset: moe_layer_<preset>.json/.md.
//
//   bench_moe_layer [--preset NAME|all] [--decode 1,2,4,...] [--prefill 2048,4096] [--reps N]
//                   [--no-routed-only] [--out DIR] [--quick] [--no-baseline] [--compare-register]
//                   [--compare-schedule] [--stream-schedule auto|claimed|round-robin]
#include <cublas_v2.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/cuda_utils.h"
#include "kernel_timeline.h"
#include "ops/moe/moe_layer_cuda.cuh"

using namespace moelora;

namespace {

using bench::json_escape;
using bench::measure_copy_bandwidth;
using bench::median;
using bench::parse_list;

struct Preset {
  std::string name;
  int E, k, H, I, Is;
  bool shared_gate;
  RouterKind router;
  int n_group, topk_group;
  float scaling;
};

const std::vector<Preset> kPresets = {
    {"qwen3.5-35b-a3b", 256, 8, 2048, 512, 512, true, RouterKind::kSoftmaxTopK, 1, 1, 1.0f},
    {"kimi-k2.5", 384, 8, 7168, 2048, 2048, false, RouterKind::kSigmoidNoauxTc, 1, 1, 2.827f},
    {"kimi-k2.5-ep8", 48, 8, 7168, 2048, 2048, false, RouterKind::kSigmoidNoauxTc, 1, 1, 2.827f},
    {"qwen3-30b-a3b", 128, 8, 2048, 768, 0, false, RouterKind::kSoftmaxTopK, 1, 1, 1.0f},
};

struct LoraConfig {
  std::string name;
  int adapters;  // 0 = no LoRA
  int rank;
  bool shared_outer;
};

const std::vector<LoraConfig> kLoraConfigs = {
    {"none", 0, 0, false},
    {"1x r16", 1, 16, false},
    {"1x r64", 1, 64, false},
    {"8x r16", 8, 16, false},
    {"1x r16 shared-outer", 1, 16, true},
};

struct Row {
  std::string preset, mode, lora;
  bool routed_only;
  int tokens;
  double us_median, us_min;
  double bytes, ideal_us, tbps, pct_copy, tflops;
  double lora_ratio = 0, ideal_ratio = 0, ratio_of_ideal = 0;  // for LoRA rows
  int distinct_experts;
  double baseline_us = 0;  // unfused baseline (0 = not run)
  double peer_us = 0;      // the peer's µs for this configuration (0 = not measured)
  double register_us = 0;  // the register-fed decode GEMM's µs (0 = not run)
  double round_robin_us = 0;  // the stream GEMMs with round-robin work items (0 = not run)
  double check_cosine = 0; // cosine of the output against the unfused baseline's (0 = not checked)
};

// The peer on the same H200 (PERF.md, "The peer"): SGLang's Triton fused_moe FP8 (w8a8, 128x128
// blocks, tuned H200 configs), routed experts only (no router GEMM, no shared expert); LoRA =
// one r16 per-expert adapter through its fast-path kernels, given as the LoRA / no-LoRA time ratio.
struct PeerPoint {
  int tokens;
  double no_lora_us, lora_time_ratio;
};
const std::map<std::string, std::vector<PeerPoint>> kPeer = {
    {"qwen3.5-35b-a3b",
     {{1, 29.8, 1.35}, {4, 47.1, 1.27}, {16, 100.0, 1.22}, {32, 144.0, 1.19}, {64, 196.5, 1.16}, {128, 225.2, 1.16},
      {4096, 766.0, 1.38}}},
    {"kimi-k2.5-ep8",
     {{1, 113, 1.11}, {4, 303, 1.05}, {16, 518, 1.04}, {32, 545, 1.05}, {64, 559, 1.07}, {128, 576, 1.09},
      {4096, 4668, 1.18}}},
};

// The peer's µs for a routed-only row (0 when the peer was not measured there).
double peer_us_for(const std::string& preset, int tokens, const std::string& lora, bool routed_only) {
  if (!routed_only || (lora != "none" && lora != "1x r16")) return 0;
  auto it = kPeer.find(preset);
  if (it == kPeer.end()) return 0;
  for (const auto& pt : it->second)
    if (pt.tokens == tokens) return lora == "none" ? pt.no_lora_us : pt.no_lora_us * pt.lora_time_ratio;
  return 0;
}

struct Options {
  std::vector<std::string> presets = {"qwen3.5-35b-a3b", "kimi-k2.5", "kimi-k2.5-ep8"};
  std::vector<int> decode = {1, 2, 4, 8, 16, 32, 64, 128};
  std::vector<int> prefill = {2048, 4096, 8192, 16384};
  int reps = 60;
  bool routed_only_too = true;
  bool full_layer = true;             // false: routed-only rows alone (--routed-only)
  std::vector<std::string> lora;      // LoRA configurations to run (empty = all)
  std::string out = "bench/results/h200";
  bool quick = false;
  bool baseline = true;
  bool compare_register = false;
  bool compare_schedule = false;
  ops::cuda::StreamGemmSchedule stream_schedule = ops::cuda::StreamGemmSchedule::kAuto;
  ops::cuda::GemmPath gemm_path = ops::cuda::GemmPath::kAuto;
  std::vector<int> timeline;  // decode batch sizes whose kernel timeline is recorded (--timeline)
  ops::cuda::SideStreamScheduling side;  // the layer's default unless --lora-side-ctas
  ops::cuda::DecodeLoraPath decode_lora = ops::cuda::DecodeLoraPath::kSideStream;
  float warmup_ms = 20.f;  // warm-up replays before timing (0 under a profiler)
};

// Per-forward LoRA bytes for the (slot, expert) pairs the batch touches.
double lora_bytes(const Preset& p, const LoraConfig& lc, const std::vector<int32_t>& ids,
                  const std::vector<int32_t>& slots, int k, bool shared) {
  if (lc.adapters == 0) return 0;
  std::map<std::pair<int, int>, int> pairs;
  std::map<int, int> slots_used;
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    slots_used[slots[t]] = 1;
    for (int j = 0; j < k; ++j) pairs[{slots[t], ids[t * k + j]}] = 1;
  }
  const double r = lc.rank, H = p.H, I = p.I;
  // per (slot, expert): gate_up A [r, H], B [2I, r]; down A [r, I], B [H, r] (bf16)
  double per_pair = 2.0 * r * (H + 2 * I + I + H);
  double per_slot = 0;
  if (lc.shared_outer) {  // A13 and B2 are per slot, not per pair
    per_pair = 2.0 * r * (2 * I + I);
    per_slot = 2.0 * r * (H + H);
  }
  // shared expert: gate/up A [r, H] + B [2Is, r], down A [r, Is] + B [H, r], once per slot
  if (shared && p.Is > 0) per_slot += 2.0 * r * (H + 2.0 * p.Is + p.Is + H);
  return per_pair * pairs.size() + per_slot * slots_used.size();
}

// ---------------------------------------------------------------------------------------------
// Unfused baseline: what a straightforward implementation does. Routing comes back to the host;
// then per active expert: dequantize its FP8 weights to bf16, gather its tokens, cuBLAS GEMM1,
// SiLU*up, cuBLAS GEMM2, weighted scatter-add; LoRA as separate cuBLAS GEMMs per (adapter,
// expert); the shared expert through cuBLAS. Timed with the same events, eagerly (it cannot be
// captured: its launches depend on the routing).

__global__ void dequant_fp8_bf16_kernel(const uint8_t* q, const float* scale, __nv_bfloat16* out, int rows, int cols,
                                        int cols_padded) {
  const int kb = cols_padded / 128;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < static_cast<size_t>(rows) * cols;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / cols), c = static_cast<int>(i % cols);
    const float v = __half2float(__nv_cvt_fp8_to_halfraw(q[static_cast<size_t>(r) * cols_padded + c], __NV_E4M3)) *
                    scale[(r / 128) * kb + c / 128];
    out[i] = __float2bfloat16(v);
  }
}
__global__ void gather_rows_kernel(const __nv_bfloat16* x, const int32_t* rows, __nv_bfloat16* out, int n, int cols) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < static_cast<size_t>(n) * cols;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = x[static_cast<size_t>(rows[i / cols]) * cols + i % cols];
}
__global__ void silu_mul_kernel(const __nv_bfloat16* h, __nv_bfloat16* a, int n, int inter) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < static_cast<size_t>(n) * inter;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = i / inter, c = i % inter;
    const float g = __bfloat162float(h[r * 2 * inter + c]), u = __bfloat162float(h[r * 2 * inter + inter + c]);
    a[i] = __float2bfloat16(g / (1.f + expf(-g)) * u);
  }
}
__global__ void scatter_add_kernel(const __nv_bfloat16* y, const int32_t* rows, const float* w, float* out, int n, int cols) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < static_cast<size_t>(n) * cols;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[static_cast<size_t>(rows[i / cols]) * cols + i % cols] += w[i / cols] * __bfloat162float(y[i]);
}
__global__ void add_bf16_to_f32_kernel(const __nv_bfloat16* y, float* out, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] += __bfloat162float(y[i]);
}
__global__ void f32_to_bf16_kernel(const float* in, __nv_bfloat16* out, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
}

struct Baseline {
  cublasHandle_t h = nullptr;
  cuda::DeviceBuffer w13, w2, xe, he, ae, ye, u, rows_d, w_d, acc, sh, sa, so, ws;
  int H, I, Is, E, R;
  Baseline(const Preset& p, int max_tokens, int max_rank)
      : w13(static_cast<size_t>(2) * p.I * p.H * 2), w2(static_cast<size_t>(p.H) * p.I * 2),
        xe(static_cast<size_t>(max_tokens) * p.H * 2), he(static_cast<size_t>(max_tokens) * 2 * p.I * 2),
        ae(static_cast<size_t>(max_tokens) * p.I * 2), ye(static_cast<size_t>(max_tokens) * p.H * 2),
        u(static_cast<size_t>(max_tokens) * max_rank * 2), rows_d(static_cast<size_t>(max_tokens) * 4),
        w_d(static_cast<size_t>(max_tokens) * 4), acc(static_cast<size_t>(max_tokens) * p.H * 4),
        sh(static_cast<size_t>(max_tokens) * 2 * std::max(p.Is, 1) * 2), sa(static_cast<size_t>(max_tokens) * std::max(p.Is, 1) * 2),
        so(static_cast<size_t>(max_tokens) * p.H * 2), ws(size_t(32) << 20), H(p.H), I(p.I), Is(p.Is), E(p.E), R(max_rank) {
    cublasCreate(&h);
    cublasSetWorkspace(h, ws.get(), ws.bytes());
  }
  ~Baseline() { cublasDestroy(h); }
  // y[rows, n] (+)= x[rows, k] . w[n, k]^T, all bf16
  void gemm(const void* x, const void* w, void* y, int rows, int n, int k, float beta, cudaStream_t s, int ldw = 0) {
    const float alpha = 1.f;
    cublasSetStream(h, s);
    cublasSetWorkspace(h, ws.get(), ws.bytes());  // cublasSetStream fell back to the default pool
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &alpha, w, CUDA_R_16BF, ldw ? ldw : k, x, CUDA_R_16BF, k,
                 &beta, y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
  // One unfused forward. ids/weights/slots on the host (downloaded by the caller as part of the timing).
  void forward(const ops::cuda::MoeLayerCuda::DeviceView& v, const __nv_bfloat16* x, const std::vector<int32_t>& ids,
               const std::vector<float>& wts, const std::vector<int32_t>& slots, int T, int k, bool lora, int rank,
               bool shared, __nv_bfloat16* out, cudaStream_t s) {
    const int blocks = 512, threads = 256;
    MOELORA_CUDA_CHECK(cudaMemsetAsync(acc.get(), 0, static_cast<size_t>(T) * H * 4, s));
    std::vector<std::vector<int32_t>> rows(E);
    std::vector<std::vector<float>> ws_e(E);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        const int e = ids[t * k + j];
        if (e < 0) continue;
        rows[e].push_back(t);
        ws_e[e].push_back(wts[t * k + j]);
      }
    for (int e = 0; e < E; ++e) {
      const int m = static_cast<int>(rows[e].size());
      if (m == 0) continue;
      MOELORA_CUDA_CHECK(cudaMemcpyAsync(rows_d.get(), rows[e].data(), m * 4, cudaMemcpyHostToDevice, s));
      MOELORA_CUDA_CHECK(cudaMemcpyAsync(w_d.get(), ws_e[e].data(), m * 4, cudaMemcpyHostToDevice, s));
      dequant_fp8_bf16_kernel<<<blocks, threads, 0, s>>>(v.w13 + static_cast<size_t>(e) * 2 * I * v.hidden_padded,
                                                         v.w13_scale + static_cast<size_t>(e) * (2 * I / 128) * (v.hidden_padded / 128),
                                                         w13.as<__nv_bfloat16>(), 2 * I, H, v.hidden_padded);
      dequant_fp8_bf16_kernel<<<blocks, threads, 0, s>>>(v.w2 + static_cast<size_t>(e) * H * I,
                                                         v.w2_scale + static_cast<size_t>(e) * ((H + 127) / 128) * (I / 128),
                                                         w2.as<__nv_bfloat16>(), H, I, I);
      gather_rows_kernel<<<blocks, threads, 0, s>>>(x, rows_d.as<int32_t>(), xe.as<__nv_bfloat16>(), m, H);
      gemm(xe.get(), w13.get(), he.get(), m, 2 * I, H, 0.f, s);
      const int slot = lora ? slots[rows[e][0]] : -1;  // the baseline runs single-adapter batches
      if (slot >= 0) {
        const int ea = v.lora_a13_experts == 1 ? 0 : e;
        const __nv_bfloat16* a13 = v.lora_a13 + (static_cast<size_t>(slot) * v.lora_a13_experts + ea) * R * H;
        const __nv_bfloat16* b13 = v.lora_b13 + (static_cast<size_t>(slot) * E + e) * 2 * I * R;
        gemm(xe.get(), a13, u.get(), m, rank, H, 0.f, s);  // shrink: rows of A past `rank` are zero
        gemm(u.get(), b13, he.get(), m, 2 * I, rank, 1.f, s, R);  // expand: B rows have R entries
      }
      silu_mul_kernel<<<blocks, threads, 0, s>>>(he.as<__nv_bfloat16>(), ae.as<__nv_bfloat16>(), m, I);
      gemm(ae.get(), w2.get(), ye.get(), m, H, I, 0.f, s);
      if (slot >= 0) {
        const int eb = v.lora_b2_experts == 1 ? 0 : e;
        const __nv_bfloat16* a2 = v.lora_a2 + (static_cast<size_t>(slot) * E + e) * R * I;
        const __nv_bfloat16* b2 = v.lora_b2 + (static_cast<size_t>(slot) * v.lora_b2_experts + eb) * H * R;
        gemm(ae.get(), a2, u.get(), m, rank, I, 0.f, s);
        gemm(u.get(), b2, ye.get(), m, H, rank, 1.f, s, R);
      }
      scatter_add_kernel<<<blocks, threads, 0, s>>>(ye.as<__nv_bfloat16>(), rows_d.as<int32_t>(), w_d.as<float>(),
                                                    acc.as<float>(), m, H);
    }
    if (shared && Is > 0) {
      gemm(x, v.shared_w13, sh.get(), T, 2 * Is, H, 0.f, s);
      silu_mul_kernel<<<blocks, threads, 0, s>>>(sh.as<__nv_bfloat16>(), sa.as<__nv_bfloat16>(), T, Is);
      gemm(sa.get(), v.shared_w2, so.get(), T, H, Is, 0.f, s);
      add_bf16_to_f32_kernel<<<blocks, threads, 0, s>>>(so.as<__nv_bfloat16>(), acc.as<float>(), static_cast<size_t>(T) * H);
    }
    f32_to_bf16_kernel<<<blocks, threads, 0, s>>>(acc.as<float>(), out, static_cast<size_t>(T) * H);
  }
};

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_moe_layer: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--preset") {
      std::string v = next();
      opt.presets.clear();
      if (v == "all") {
        for (auto& p : kPresets) opt.presets.push_back(p.name);
      } else {
        std::stringstream ss(v);
        for (std::string item; std::getline(ss, item, ',');) opt.presets.push_back(item);
      }
    } else if (a == "--decode") {
      opt.decode = parse_list(next());
    } else if (a == "--prefill") {
      opt.prefill = parse_list(next());
    } else if (a == "--reps") {
      opt.reps = std::stoi(next());
    } else if (a == "--out") {
      opt.out = next();
    } else if (a == "--no-routed-only") {
      opt.routed_only_too = false;
    } else if (a == "--routed-only") {
      opt.full_layer = false;
    } else if (a == "--lora") {
      std::stringstream ss(next());
      for (std::string item; std::getline(ss, item, ',');) {
        std::replace(item.begin(), item.end(), '_', ' ');  // 1x_r16 = "1x r16" (no quoting needed)
        if (std::none_of(kLoraConfigs.begin(), kLoraConfigs.end(), [&](const LoraConfig& c) { return c.name == item; })) {
          std::fprintf(stderr, "bench_moe_layer: unknown LoRA configuration '%s' (see --help)\n", item.c_str());
          return 2;
        }
        opt.lora.push_back(item);
      }
    } else if (a == "--quick") {
      opt.quick = true;
    } else if (a == "--no-baseline") {
      opt.baseline = false;
    } else if (a == "--compare-register") {
      opt.compare_register = true;
    } else if (a == "--compare-schedule") {
      opt.compare_schedule = true;
    } else if (a == "--stream-schedule") {
      const std::string v = next();
      if (v == "auto") opt.stream_schedule = ops::cuda::StreamGemmSchedule::kAuto;
      else if (v == "claimed") opt.stream_schedule = ops::cuda::StreamGemmSchedule::kClaimed;
      else if (v == "round-robin") opt.stream_schedule = ops::cuda::StreamGemmSchedule::kRoundRobin;
      else {
        std::fprintf(stderr, "bench_moe_layer: --stream-schedule must be auto, claimed or round-robin, got '%s'\n", v.c_str());
        return 2;
      }
    } else if (a == "--gemm-path") {
      const std::string v = next();
      if (v == "auto") opt.gemm_path = ops::cuda::GemmPath::kAuto;
      else if (v == "stream") opt.gemm_path = ops::cuda::GemmPath::kDecode;
      else if (v == "register") opt.gemm_path = ops::cuda::GemmPath::kDecodeRegister;
      else if (v == "prefill") opt.gemm_path = ops::cuda::GemmPath::kPrefill;
      else {
        std::fprintf(stderr, "bench_moe_layer: --gemm-path must be auto, stream, register or prefill, got '%s'\n", v.c_str());
        return 2;
      }
    } else if (a == "--timeline") {
      opt.timeline = parse_list(next());
    } else if (a == "--decode-lora") {
      const std::string v = next();
      if (v != "side" && v != "fused") {
        std::fprintf(stderr, "bench_moe_layer: --decode-lora must be side or fused, got '%s'\n", v.c_str());
        return 2;
      }
      opt.decode_lora = v == "fused" ? ops::cuda::DecodeLoraPath::kFused : ops::cuda::DecodeLoraPath::kSideStream;
    } else if (a == "--lora-side-ctas") {
      const std::string v = next();
      opt.side.lora_max_ctas = v == "sms" ? -1 : std::stoi(v);
      if (opt.side.lora_max_ctas < -1) {
        std::fprintf(stderr, "bench_moe_layer: --lora-side-ctas must be sms, 0 or a CTA count, got '%s'\n", v.c_str());
        return 2;
      }
    } else if (a == "--warmup-ms") {
      opt.warmup_ms = std::stof(next());
    } else if (a == "--help" || a == "-h") {
      std::printf(
          "bench_moe_layer: time one FP8 MoE layer with multi-LoRA on the GPU.\n"
          "  --preset LIST|all   comma-separated from qwen3.5-35b-a3b, kimi-k2.5, kimi-k2.5-ep8, qwen3-30b-a3b\n"
          "                      (default: the first three)\n"
          "  --decode LIST       decode batch sizes (default 1,2,4,8,16,32,64,128)\n"
          "  --prefill LIST      prefill token counts (default 2048,4096,8192,16384; none = no prefill rows)\n"
          "  --reps N            timed repetitions per configuration (default 60)\n"
          "  --no-routed-only    skip the routed-experts-only rows (router logits given, no shared expert)\n"
          "  --routed-only       run the routed-experts-only rows alone (what the peer measured)\n"
          "  --lora LIST         LoRA configurations, comma-separated from: none, 1x r16, 1x r64, 8x r16,\n"
          "                      1x r16 shared-outer; _ for a space (1x_r16). Default: all; prefill runs none and 1x r16\n"
          "  --quick             fewer configurations (smoke run)\n"
          "  --no-baseline       skip the unfused baseline (dequantize + cuBLAS per expert + separate LoRA GEMMs)\n"
          "  --compare-register  also time the earlier register-fed decode GEMM on the no-LoRA decode rows\n"
          "  --compare-schedule  also time every decode row with the stream GEMMs' round-robin work items\n"
          "  --stream-schedule S work items of the stream GEMMs: auto (default; claimed from an atomic\n"
          "                      counter without LoRA, round-robin with it), claimed or round-robin\n"
          "  --gemm-path P       expert GEMMs: auto (default), stream, register (decode kernels) or prefill\n"
          "  --timeline LIST     decode batch sizes whose kernel timeline (CUPTI: kernel, stream, start,\n"
          "                      end of the median of 5 replays) goes to timeline_<preset>.md\n"
          "  --decode-lora P     routed-expert LoRA at decode: side (default; shrink + expand kernels on the\n"
          "                      side stream) or fused (shrinks and the seam-1 expand inside the quant and\n"
          "                      activation kernels)\n"
          "  --lora-side-ctas N  grid cap of the decode LoRA kernels on the side stream: 0 (default, one\n"
          "                      CTA per work unit), sms (one CTA per SM) or a CTA count\n"
          "  --warmup-ms MS      warm-up replays before each timing (default 20; 0 under a profiler)\n"
          "  --out DIR           results directory (default bench/results/h200); one\n"
          "                      moe_layer_<preset>.json / .md per preset\n"
          "Routed-only rows of qwen3.5-35b-a3b and kimi-k2.5-ep8 show the peer's µs (PERF.md) and a P1 target.\n");
      return 0;
    } else {
      std::fprintf(stderr, "bench_moe_layer: unknown option %s (see --help)\n", a.c_str());
      return 2;
    }
  }
  try {
    if (cuda::device_count() == 0) {
      std::fprintf(stderr, "bench_moe_layer: no CUDA device\n");
      return 1;
    }
    const auto dev = cuda::device_info(0);
    const double copy_bw = measure_copy_bandwidth();
    std::printf("# %s, %d SMs, L2 %.0f MB, driver %d, runtime %d; copy bandwidth %.2f TB/s\n", dev.name.c_str(),
                dev.num_sms, dev.l2_bytes / 1e6, dev.driver_version, dev.runtime_version, copy_bw / 1e12);

    cuda::Stream main_stream, side_stream;
    std::unique_ptr<bench::KernelTimeline> timeline;
    if (!opt.timeline.empty()) timeline = std::make_unique<bench::KernelTimeline>();
    std::map<std::string, std::string> timelines;  // preset -> Markdown sections
    cuda::DeviceBuffer flush(size_t(200) << 20);  // larger than L2
    std::vector<Row> all_rows;
    std::mt19937_64 rng(1234);

    // Results are rewritten after every preset, so a long run that is cut short keeps what it measured.
    auto write_results = [&](const std::string& preset) {
      std::vector<Row> rows;
      for (const auto& r : all_rows)
        if (r.preset == preset) rows.push_back(r);
    // ---- targets (PERF.md L1, L2, L3, L4) ----
      struct Target {
        std::string id, config;
        double value, target;
        bool met;
      };
      std::vector<Target> targets;
      for (const auto& r : rows) {
        if (r.mode == "decode" && r.lora == "none") {
          const double goal = r.tokens >= 16 ? 92 : r.tokens == 4 ? 85 : r.tokens == 1 ? 50 : -1;
          if (goal > 0)
            targets.push_back({"L1", r.preset + " B=" + std::to_string(r.tokens) + (r.routed_only ? " routed-only" : " full layer"),
                               r.pct_copy, goal, r.pct_copy >= goal});
        }
        if (r.mode == "decode" && r.lora == "1x r16" && (r.tokens >= 16 || r.tokens <= 4)) {
          const double goal = r.tokens >= 16 ? 0.98 : 0.90;
          targets.push_back({"L2", r.preset + " B=" + std::to_string(r.tokens) + " r16 1 adapter" + (r.routed_only ? " routed-only" : " full layer"),
                             r.ratio_of_ideal, goal, r.ratio_of_ideal >= goal});
        }
        if (r.mode == "decode" && r.lora == "8x r16" && r.tokens == 64)
          targets.push_back({"L3", r.preset + " B=64 8 adapters r16" + std::string(r.routed_only ? " routed-only" : " full layer"),
                             r.ratio_of_ideal, 0.95, r.ratio_of_ideal >= 0.95});
        if (r.mode == "prefill" && r.tokens == 4096 && r.lora == "none") {
          const double goal = r.preset == "kimi-k2.5-ep8" ? 1000 : 550;
          targets.push_back({"L4", r.preset + " 4096 tokens TFLOP/s" + std::string(r.routed_only ? " routed-only" : " full layer"),
                             r.tflops, goal, r.tflops >= goal});
        }
        if (r.peer_us > 0)
          targets.push_back({"P1", r.preset + " " + r.mode + " B=" + std::to_string(r.tokens) + " " + r.lora +
                                       " routed-only: peer µs / moelora µs (> 1 = faster than the peer)",
                             r.peer_us / r.us_median, 1.0, r.us_median < r.peer_us});
        if (r.mode == "prefill" && r.tokens == 4096 && r.lora == "1x r16") {
          const double ratio = r.lora_ratio > 0 ? 1.0 / r.lora_ratio : 0;
          targets.push_back({"L4", r.preset + " 4096 tokens LoRA/no-LoRA time" + std::string(r.routed_only ? " routed-only" : " full layer"),
                             ratio, 1.07, ratio > 0 && ratio <= 1.07});
        }
      }
  
      // ---- outputs ----
      std::string commit = "unknown";
      if (FILE* g = popen("git describe --always --dirty --abbrev=7 2>/dev/null", "r")) {
        char buf[64] = {0};
        if (fgets(buf, sizeof buf, g)) commit = std::string(buf, strcspn(buf, "\n"));
        pclose(g);
      }
      char date[32];
      std::time_t now = std::time(nullptr);
      std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
      std::string cmd = "mkdir -p '" + opt.out + "'";
      if (std::system(cmd.c_str()) != 0) throw std::runtime_error("cannot create " + opt.out);
      const std::string stem = opt.out + "/moe_layer_" + preset;
      std::ofstream js(stem + ".json");
      js << "{\n  \"benchmark\": \"moe_layer\",\n  \"gpu\": \"" << json_escape(dev.name) << "\",\n  \"sms\": " << dev.num_sms
         << ",\n  \"l2_bytes\": " << dev.l2_bytes << ",\n  \"memory_clock_khz\": " << dev.memory_clock_khz
         << ",\n  \"driver\": " << dev.driver_version << ",\n  \"cuda_runtime\": " << dev.runtime_version
         << ",\n  \"commit\": \"" << commit << "\",\n  \"date\": \"" << date << "\",\n  \"ceilings\": {\"copy_bandwidth_bytes_per_s\": "
         << copy_bw << "},\n  \"rows\": [\n";
      for (size_t i = 0; i < rows.size(); ++i) {
        const auto& r = rows[i];
        js << "    {\"preset\": \"" << r.preset << "\", \"mode\": \"" << r.mode << "\", \"tokens\": " << r.tokens
           << ", \"lora\": \"" << r.lora << "\", \"routed_only\": " << (r.routed_only ? "true" : "false")
           << ", \"us_median\": " << r.us_median << ", \"us_min\": " << r.us_min << ", \"bytes\": " << r.bytes
           << ", \"distinct_experts\": " << r.distinct_experts << ", \"ideal_us\": " << r.ideal_us << ", \"tb_per_s\": " << r.tbps
           << ", \"pct_of_copy_roofline\": " << r.pct_copy << ", \"tflops\": " << r.tflops << ", \"lora_ratio\": " << r.lora_ratio
           << ", \"ideal_lora_ratio\": " << r.ideal_ratio << ", \"ratio_of_ideal\": " << r.ratio_of_ideal
           << ", \"unfused_baseline_us\": " << r.baseline_us << ", \"peer_us\": " << r.peer_us
           << ", \"register_decode_us\": " << r.register_us << ", \"round_robin_us\": " << r.round_robin_us
           << ", \"cosine_vs_unfused\": " << r.check_cosine << "}"
           << (i + 1 < rows.size() ? "," : "") << "\n";
      }
      js << "  ],\n  \"targets\": [\n";
      for (size_t i = 0; i < targets.size(); ++i) {
        const auto& t = targets[i];
        js << "    {\"id\": \"" << t.id << "\", \"config\": \"" << json_escape(t.config) << "\", \"value\": " << t.value
           << ", \"target\": " << t.target << ", \"met\": " << (t.met ? "true" : "false") << "}"
           << (i + 1 < targets.size() ? "," : "") << "\n";
      }
      js << "  ]\n}\n";
      std::ofstream md(stem + ".md");
      md << "# moe_layer " << preset << " on " << dev.name << " (commit " << commit << ", " << date << ")\n\n"
         << "Copy bandwidth measured in the same run: " << copy_bw / 1e12 << " TB/s (read + write). "
         << "peer µs: SGLang's Triton fused_moe FP8 on an H200 (PERF.md), routed experts only; "
         << "register µs: the earlier register-fed decode GEMM in the same run; round-robin µs: the "
         << "stream GEMMs with a fixed share of work items per CTA instead of claimed ones, same run.\n\n"
         << "| preset | mode | tokens | LoRA | layer | µs (median) | µs (min) | experts | TB/s | % roofline | TFLOP/s | LoRA/no-LoRA | ideal | of ideal | peer µs | vs peer | register µs | round-robin µs | unfused µs | speedup |\n"
         << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
      for (const auto& r : rows) {
        char line[768];
        std::string unfused = r.baseline_us > 0 ? std::to_string(static_cast<int>(r.baseline_us)) : "";
        std::string speedup = r.baseline_us > 0 ? std::to_string(r.baseline_us / r.us_median).substr(0, 5) + "x" : "";
        char peer[32] = "", vs_peer[32] = "", reg[32] = "", rr[32] = "";
        if (r.peer_us > 0) {
          std::snprintf(peer, sizeof peer, "%.1f", r.peer_us);
          std::snprintf(vs_peer, sizeof vs_peer, "%.2fx", r.peer_us / r.us_median);
        }
        if (r.register_us > 0) std::snprintf(reg, sizeof reg, "%.1f", r.register_us);
        if (r.round_robin_us > 0) std::snprintf(rr, sizeof rr, "%.1f", r.round_robin_us);
        std::snprintf(line, sizeof line, "| %s | %s | %d | %s | %s | %.1f | %.1f | %d | %.2f | %.1f | %.1f | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                      r.preset.c_str(), r.mode.c_str(), r.tokens, r.lora.c_str(), r.routed_only ? "routed only" : "full",
                      r.us_median, r.us_min, r.distinct_experts, r.tbps, r.pct_copy, r.tflops,
                      r.lora_ratio > 0 ? std::to_string(r.lora_ratio).substr(0, 5).c_str() : "",
                      r.ideal_ratio > 0 ? std::to_string(r.ideal_ratio).substr(0, 5).c_str() : "",
                      r.ratio_of_ideal > 0 ? std::to_string(r.ratio_of_ideal).substr(0, 5).c_str() : "", peer, vs_peer, reg,
                      rr, unfused.c_str(), speedup.c_str());
        md << line;
      }
      md << "\n## Targets\n\n| id | config | value | target | met |\n|---|---|---|---|---|\n";
      for (const auto& t : targets)
        md << "| " << t.id << " | " << t.config << " | " << t.value << " | " << t.target << " | " << (t.met ? "yes" : "no") << " |\n";
      if (timelines.count(preset)) {
        std::ofstream tl(opt.out + "/timeline_" + preset + ".md");
        tl << "# Kernel timelines, " << preset << " (" << dev.name << ", commit " << commit << ", " << date
           << ")\n\nOne graph replay each (the median span of 5, L2 flushed before each, CUPTI timestamps): start / end in "
              "µs from the first kernel's start; queue = the stream the kernel ran on, named by first appearance (a graph replay picks its own streams for its branches); idle = time the queue sat between its previous kernel's end and this start.\n\n"
           << timelines[preset];
      }
      };

    for (const auto& pname : opt.presets) {
      auto it = std::find_if(kPresets.begin(), kPresets.end(), [&](const Preset& p) { return p.name == pname; });
      if (it == kPresets.end()) throw std::runtime_error("unknown preset " + pname);
      const Preset& p = *it;
      std::vector<std::pair<std::string, int>> modes;
      for (int b : opt.decode) modes.push_back({"decode", b});
      for (int t : opt.prefill) modes.push_back({"prefill", t});
      const int max_tokens = std::max(*std::max_element(opt.decode.begin(), opt.decode.end()),
                                      opt.prefill.empty() ? 0 : *std::max_element(opt.prefill.begin(), opt.prefill.end()));
      ops::cuda::MoeLayerConfig c;
      c.hidden = p.H;
      c.inter = p.I;
      c.num_experts = p.E;
      c.top_k = p.k;
      c.route.kind = p.router;
      c.route.num_experts = p.E;
      c.route.top_k = p.k;
      c.route.renormalize = true;
      c.route.n_group = p.n_group;
      c.route.topk_group = p.topk_group;
      c.route.routed_scaling_factor = p.scaling;
      c.shared_inter = p.Is;
      c.shared_gate = p.shared_gate;
      c.max_tokens = max_tokens;
      c.num_slots = 8;
      c.max_rank = 64;
      ops::cuda::MoeLayerCuda layer(c, ops::cuda::MoeLayerHostWeights{}, main_stream.get(), side_stream.get());
      layer.randomize_weights(42);
      layer.set_gemm_path(opt.gemm_path);
      layer.set_side_stream_scheduling(opt.side);
      layer.set_decode_lora_path(opt.decode_lora);
      layer.set_stream_gemm_schedule(opt.stream_schedule);
      const int max_decode = *std::max_element(opt.decode.begin(), opt.decode.end());
      std::unique_ptr<Baseline> baseline;
      if (opt.baseline) baseline = std::make_unique<Baseline>(p, max_decode, c.max_rank);
      std::fprintf(stderr, "[%s] weights %.2f GB, workspace %.2f GB\n", p.name.c_str(),
                   (layer.expert_bytes() * double(p.E) + layer.router_bytes() + layer.shared_bytes()) / 1e9,
                   layer.workspace_bytes() / 1e9);

      for (const auto& [mode, T] : modes) {
        // Inputs rotate over kSets sets so consecutive replays route differently.
        const int kSets = mode == "prefill" ? 1 : 4;  // prefill touches every expert anyway
        std::vector<cuda::DeviceBuffer> xs, logits, slotbufs;
        std::vector<std::vector<int32_t>> slot_host(kSets);
        for (int s = 0; s < kSets; ++s) {
          std::vector<uint16_t> x(static_cast<size_t>(T) * p.H);
          std::normal_distribution<float> nd(0.f, 1.f);
          for (auto& v : x) v = f32_to_bf16_bits(nd(rng));
          cuda::DeviceBuffer xb(x.size() * 2);
          xb.upload(x.data(), x.size() * 2);
          xs.push_back(std::move(xb));
          std::vector<float> l(static_cast<size_t>(T) * p.E);
          for (auto& v : l) v = nd(rng);
          cuda::DeviceBuffer lb(l.size() * 4);
          lb.upload(l.data(), l.size() * 4);
          logits.push_back(std::move(lb));
          slotbufs.emplace_back(static_cast<size_t>(T) * 4);
        }
        cuda::DeviceBuffer out(static_cast<size_t>(T) * p.H * 2), x_cur(static_cast<size_t>(T) * p.H * 2),
            l_cur(static_cast<size_t>(T) * p.E * 4), s_cur(static_cast<size_t>(T) * 4);
        std::map<std::string, double> base_us;  // routed_only flag -> no-LoRA median
        for (bool routed_only : {false, true}) {
          if (routed_only && !opt.routed_only_too) continue;
          if (!routed_only && !opt.full_layer) continue;
          for (const auto& lc : kLoraConfigs) {
            if (opt.quick && lc.name != "none" && lc.name != "1x r16") continue;
            if (!opt.lora.empty() && std::find(opt.lora.begin(), opt.lora.end(), lc.name) == opt.lora.end()) continue;
            if (mode == "prefill" && lc.name != "none" && lc.name != "1x r16") continue;
            for (int s = 0; s < 8; ++s) layer.clear_adapter(s);
            // One adapter goes to slot 3 (nothing may assume slot 0); several fill slots 0..n-1.
            auto slot_of = [&](int a) { return lc.adapters == 1 ? 3 : a; };
            for (int a = 0; a < lc.adapters; ++a) layer.randomize_adapter(slot_of(a), lc.rank, lc.shared_outer, 100 + a);
            // slots: adapters spread round-robin over tokens
            for (int s = 0; s < kSets; ++s) {
              slot_host[s].assign(T, -1);
              for (int t = 0; t < T; ++t) slot_host[s][t] = lc.adapters ? slot_of(t % lc.adapters) : -1;
              slotbufs[s].upload(slot_host[s].data(), T * 4);
            }
            ops::cuda::MoeForwardArgs f;
            f.x = x_cur.as<__nv_bfloat16>();
            f.slot = s_cur.as<int32_t>();
            f.router_logits = routed_only ? l_cur.as<float>() : nullptr;
            f.tokens = T;
            f.lora = lc.adapters > 0;
            f.single_slot = lc.adapters == 1 ? slot_of(0) : -1;  // the host knows the batch's slot set
            f.shared = !routed_only;
            f.out = out.as<__nv_bfloat16>();
            // The layer's forward captured as one graph (what every timed repetition replays).
            auto capture_forward = [&](cudaGraph_t& g, cudaGraphExec_t& e) {
              MOELORA_CUDA_CHECK(cudaStreamBeginCapture(main_stream.get(), cudaStreamCaptureModeGlobal));
              layer.forward(f);
              MOELORA_CUDA_CHECK(cudaStreamEndCapture(main_stream.get(), &g));
              MOELORA_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
            };
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            capture_forward(graph, exec);

            auto stage_inputs = [&](int set) {
              MOELORA_CUDA_CHECK(cudaMemcpyAsync(x_cur.get(), xs[set].get(), x_cur.bytes(), cudaMemcpyDeviceToDevice, main_stream.get()));
              MOELORA_CUDA_CHECK(cudaMemcpyAsync(l_cur.get(), logits[set].get(), l_cur.bytes(), cudaMemcpyDeviceToDevice, main_stream.get()));
              MOELORA_CUDA_CHECK(cudaMemcpyAsync(s_cur.get(), slotbufs[set].get(), s_cur.bytes(), cudaMemcpyDeviceToDevice, main_stream.get()));
            };
            // Bytes of each input set's routing (one untimed replay per set).
            double bytes_sum = 0;
            int distinct_sum = 0;
            std::vector<std::vector<int32_t>> set_ids(kSets);
            std::vector<std::vector<float>> set_w(kSets);
            for (int set = 0; set < kSets; ++set) {
              stage_inputs(set);
              MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_stream.get()));
              main_stream.synchronize();
              std::vector<int32_t> ids(static_cast<size_t>(T) * p.k);
              MOELORA_CUDA_CHECK(cudaMemcpy(ids.data(), layer.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
              set_w[set].resize(ids.size());
              MOELORA_CUDA_CHECK(cudaMemcpy(set_w[set].data(), layer.topk_weights(), ids.size() * 4, cudaMemcpyDeviceToHost));
              set_ids[set] = ids;
              std::vector<char> seen(p.E, 0);
              int distinct = 0;
              for (int32_t e : ids)
                if (e >= 0 && !seen[e]) seen[e] = 1, ++distinct;
              distinct_sum += distinct;
              double b = distinct * double(layer.expert_bytes()) + (routed_only ? 0.0 : layer.router_bytes() + layer.shared_bytes());
              b += lora_bytes(p, lc, ids, slot_host[set], p.k, !routed_only);
              bytes_sum += b;
            }
            // Timed replays back to back with no host synchronization in between (an idle GPU
            // lowers its clocks), after ~20 ms of warm-up replays. Between replays: the next input
            // set and a 200 MB memset that evicts L2, both outside the timed interval.
            const int reps = mode == "prefill" ? std::max(10, opt.reps / 4) : opt.reps;
            std::vector<cuda::Event> e0, e1;
            for (int rep = 0; rep < reps; ++rep) e0.emplace_back(true), e1.emplace_back(true);
            auto time_replays = [&](cudaGraphExec_t graph_exec) {
              {
                cuda::Event w0(true), w1(true);
                w0.record(main_stream.get());
                MOELORA_CUDA_CHECK(cudaGraphLaunch(graph_exec, main_stream.get()));
                w1.record(main_stream.get());
                const float one_ms = std::max(0.005f, cuda::Event::elapsed_ms(w0, w1));
                const int warm = opt.warmup_ms > 0 ? std::min(2000, static_cast<int>(opt.warmup_ms / one_ms) + 3) : 0;
                for (int i = 0; i < warm; ++i) {
                  stage_inputs(i % kSets);
                  MOELORA_CUDA_CHECK(cudaGraphLaunch(graph_exec, main_stream.get()));
                }
              }
              for (int rep = 0; rep < reps; ++rep) {
                stage_inputs(rep % kSets);
                MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), rep & 0xff, flush.bytes(), main_stream.get()));
                e0[rep].record(main_stream.get());
                MOELORA_CUDA_CHECK(cudaGraphLaunch(graph_exec, main_stream.get()));
                e1[rep].record(main_stream.get());
              }
              main_stream.synchronize();
              std::vector<float> times;
              for (int rep = 0; rep < reps; ++rep) times.push_back(cuda::Event::elapsed_ms(e0[rep], e1[rep]));
              return times;
            };
            const std::vector<float> ms = time_replays(exec);
            if (timeline && mode == "decode" && std::count(opt.timeline.begin(), opt.timeline.end(), T)) {
              std::vector<std::vector<bench::KernelRecord>> traced;
              auto span = [](const std::vector<bench::KernelRecord>& r) {
                uint64_t end = 0;
                for (const auto& k : r) end = std::max(end, k.end_ns);
                return r.empty() ? 0 : end - r.front().start_ns;
              };
              for (int i = 0; i < 5; ++i) {
                stage_inputs(i % kSets);
                MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), i & 0xff, flush.bytes(), main_stream.get()));
                timeline->start();
                MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_stream.get()));
                traced.push_back(timeline->stop());
              }
              std::sort(traced.begin(), traced.end(), [&](const auto& a, const auto& b) { return span(a) < span(b); });
              timelines[p.name] += "## decode B=" + std::to_string(T) + ", LoRA " + lc.name + (routed_only ? ", routed experts only" : ", full layer") +
                                   "\n\n" + bench::format_timeline(traced[2]) + "\n";
            }
            // Before / after in one run: the same forward with the register-fed decode GEMM.
            double register_us = 0;
            if (opt.compare_register && mode == "decode" && lc.adapters == 0) {
              layer.set_gemm_path(ops::cuda::GemmPath::kDecodeRegister);
              cudaGraph_t reg_graph;
              cudaGraphExec_t reg_exec;
              capture_forward(reg_graph, reg_exec);
              register_us = median(time_replays(reg_exec)) * 1e3;
              MOELORA_CUDA_CHECK(cudaGraphExecDestroy(reg_exec));
              MOELORA_CUDA_CHECK(cudaGraphDestroy(reg_graph));
              layer.set_gemm_path(opt.gemm_path);
            }
            // Claimed against round-robin work items of the stream GEMMs, in one run.
            double round_robin_us = 0;
            if (opt.compare_schedule && mode == "decode") {
              layer.set_stream_gemm_schedule(ops::cuda::StreamGemmSchedule::kRoundRobin);
              cudaGraph_t rr_graph;
              cudaGraphExec_t rr_exec;
              capture_forward(rr_graph, rr_exec);
              round_robin_us = median(time_replays(rr_exec)) * 1e3;
              MOELORA_CUDA_CHECK(cudaGraphExecDestroy(rr_exec));
              MOELORA_CUDA_CHECK(cudaGraphDestroy(rr_graph));
              layer.set_stream_gemm_schedule(opt.stream_schedule);
            }
            double baseline_us = 0, check_cosine = 0;
            if (opt.baseline && baseline && mode == "decode" && lc.adapters <= 1) {
              std::vector<float> bms;
              cuda::DeviceBuffer logit_scratch(static_cast<size_t>(T) * p.E * 4);
              for (int rep = 0; rep < std::min(reps, 20); ++rep) {
                const int set = rep % kSets;
                stage_inputs(set);
                MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), rep & 0xff, flush.bytes(), main_stream.get()));
                e0[rep].record(main_stream.get());
                if (!routed_only)  // the router GEMM runs on the GPU; the routing then comes back to the host
                  baseline->gemm(x_cur.get(), layer.device_view().router, logit_scratch.get(), T, p.E, p.H, 0.f,
                                 main_stream.get());
                int32_t probe;
                MOELORA_CUDA_CHECK(cudaMemcpyAsync(&probe, layer.topk_ids(), 4, cudaMemcpyDeviceToHost, main_stream.get()));
                main_stream.synchronize();
                baseline->forward(layer.device_view(), x_cur.as<__nv_bfloat16>(), set_ids[set], set_w[set], slot_host[set], T,
                                  p.k, lc.adapters > 0, lc.rank, !routed_only, out.as<__nv_bfloat16>(), main_stream.get());
                e1[rep].record(main_stream.get());
                main_stream.synchronize();
                bms.push_back(cuda::Event::elapsed_ms(e0[rep], e1[rep]));
              }
              baseline_us = median(bms) * 1e3;
              // Correctness of the timed graph: its output against the unfused baseline's (bf16
              // weights dequantized from the same FP8 codes, unquantized activations) on the same
              // input set. FP8 activation noise keeps the cosine near 0.999; a wrong kernel is far off.
              const int set = (std::min(reps, 20) - 1) % kSets;
              std::vector<uint16_t> want(static_cast<size_t>(T) * p.H), got(want.size());
              out.download(want.data(), want.size() * 2);
              stage_inputs(set);
              MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_stream.get()));
              main_stream.synchronize();
              out.download(got.data(), got.size() * 2);
              double dot = 0, nw = 0, ng = 0;
              for (size_t i = 0; i < want.size(); ++i) {
                const double a = bf16_bits_to_f32(got[i]), b = bf16_bits_to_f32(want[i]);
                dot += a * b, nw += b * b, ng += a * a;
              }
              check_cosine = dot / std::sqrt(nw * ng);
              if (!(check_cosine >= 0.99))
                throw std::runtime_error(p.name + " B=" + std::to_string(T) + " " + lc.name +
                                         ": the layer's output disagrees with the unfused baseline (cosine " +
                                         std::to_string(check_cosine) + ", expected >= 0.99)");
            }
            MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
            MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
            Row r;
            r.baseline_us = baseline_us;
            r.check_cosine = check_cosine;
            r.preset = p.name;
            r.mode = mode;
            r.lora = lc.name;
            r.routed_only = routed_only;
            r.tokens = T;
            r.us_median = median(ms) * 1e3;
            r.us_min = *std::min_element(ms.begin(), ms.end()) * 1e3;
            r.bytes = bytes_sum / kSets;
            r.distinct_experts = distinct_sum / kSets;
            r.ideal_us = r.bytes / copy_bw * 1e6;
            r.tbps = r.bytes / (r.us_median * 1e-6) / 1e12;
            r.pct_copy = 100.0 * r.ideal_us / r.us_median;
            const double flops = 2.0 * T * p.k * (3.0 * p.H * p.I) + (routed_only ? 0 : 2.0 * T * (3.0 * p.H * p.Is + p.H * p.E));
            r.tflops = flops / (r.us_median * 1e-6) / 1e12;
            const std::string key = std::to_string(routed_only);
            if (lc.adapters == 0) {
              base_us[key] = r.us_median;
              base_us[key + "bytes"] = r.bytes;
            } else if (base_us.count(key)) {
              r.lora_ratio = base_us[key] / r.us_median;  // throughput ratio LoRA / no-LoRA
              r.ideal_ratio = base_us[key + "bytes"] / r.bytes;
              r.ratio_of_ideal = r.lora_ratio / r.ideal_ratio;
            }
            r.peer_us = peer_us_for(p.name, T, lc.name, routed_only);
            r.register_us = register_us;
            r.round_robin_us = round_robin_us;
            all_rows.push_back(r);
            std::printf("%-16s %-7s %6d %-22s %-6s %9.1f us  %6.2f TB/s  %5.1f%% roofline  %7.1f TF  ratio %.3f (ideal %.3f, %.3f)  peer %.1f us  register %.1f us  round-robin %.1f us  unfused %.1f us\n",
                        p.name.c_str(), mode.c_str(), T, lc.name.c_str(), routed_only ? "routed" : "full", r.us_median,
                        r.tbps, r.pct_copy, r.tflops, r.lora_ratio, r.ideal_ratio, r.ratio_of_ideal, r.peer_us,
                        r.register_us, r.round_robin_us, r.baseline_us);
            std::fflush(stdout);
          }
        }
      }
      write_results(p.name);
      std::printf("wrote %s/moe_layer_%s.json and .md\n", opt.out.c_str(), p.name.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe_layer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
