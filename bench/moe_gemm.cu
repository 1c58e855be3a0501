// bench_moe_gemm: the decode expert GEMMs alone, FP8 (launch_moe_gemm_fp8_stream) against NVFP4
// (launch_moe_gemm_nvfp4_stream, W4A16, and launch_moe_gemm_nvfp4_w4a8, W4A8 with e4m3 rows),
// on the MoE presets' shapes: GEMM1 (gate_up, N = 2 I, K = H) and
// GEMM2 (down, N = H, K = I) for B decode tokens routed top-k uniformly over the experts (k
// distinct experts per token, a fixed seed per B). Each timed launch follows an L2 flush (a
// memset of 2x the L2), so the touched experts come from HBM as in a model's forward. Reported:
// the median µs, the bytes each kernel must move (touched experts' weights and scales, activation
// rows, outputs) and the percent of the measured copy bandwidth they amount to, and NVFP4's
// speed-up over FP8 (both NVFP4 kernels stream the same weight bytes; W4A8 reads 1-byte rows).
// Writes moe_gemm_<preset>.{md,json} under --out.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/cuda_utils.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/gemm/moe_gemm_nvfp4.h"

namespace moelora::bench {
namespace {

struct Shape {
  std::string preset;
  int E, k, H, I;
};

const std::vector<Shape> kShapes = {
    {"qwen3.5-35b-a3b", 256, 8, 2048, 512},
    {"kimi-k2.5-ep8", 48, 8, 7168, 2048},
    {"qwen3-30b-a3b", 128, 8, 2048, 768},
};

// Bytes of every value are drawn from a hash, masked (0x77: no e4m3 NaN, no negative NVFP4 scale).
__global__ void fill_bytes(uint8_t* p, size_t n, uint32_t seed, uint8_t mask) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = static_cast<uint8_t>(h) & mask;
  }
}
void fill(cuda::DeviceBuffer& b, uint32_t seed, uint8_t mask) {
  fill_bytes<<<1024, 256>>>(b.as<uint8_t>(), b.bytes(), seed, mask);
  MOELORA_CUDA_CHECK(cudaGetLastError());
}

struct Routing {
  std::vector<int32_t> offsets, active;
  int P = 0;
};
Routing route(int E, int k, int tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> count(E, 0);
  std::vector<int> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int t = 0; t < tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int j = 0; j < std::min(k, E); ++j) ++count[experts[j]];
  }
  Routing r;
  r.offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    r.offsets[e + 1] = r.offsets[e] + count[e];
    if (count[e]) r.active.push_back(e);
  }
  r.P = r.offsets[E];
  return r;
}

struct Row {
  std::string gemm;
  int tokens, touched, max_per_expert;
  double fp8_us, fp8_bytes, nvfp4_us, nvfp4_bytes, w4a8_us, w4a8_bytes;
  std::string nvfp4_instance;  // the W4A16 instance auto picks for the row's busiest expert
  // --nvfp4-instances: the W4A16 kernel with each instance forced (narrow, wide, prefill; 0 where
  // not run: prefill needs N a multiple of 256)
  double instance_us[3] = {0, 0, 0};
};

struct Options {
  std::vector<std::string> presets = {"qwen3.5-35b-a3b", "kimi-k2.5-ep8"};
  std::vector<int> decode = {1, 2, 4, 8, 16, 32, 64, 128};
  int reps = 30;
  std::string out = "bench/results/h200";
  bool instances = false;  // --nvfp4-instances
};

int parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::cout << "bench_moe_gemm: the decode expert GEMMs alone, FP8 stream kernel against the "
                   "NVFP4 stream kernel\n"
                   "(W4A16) and the NVFP4 W4A8 decode kernel.\n\n"
                   "  --preset LIST   qwen3.5-35b-a3b, kimi-k2.5-ep8, qwen3-30b-a3b (default: the "
                   "first two)\n"
                   "  --decode LIST   decode token counts (default 1,2,4,8,16,32,64,128)\n"
                   "  --reps N        timed launches per row, each after an L2 flush (default 30)\n"
                   "  --out DIR       where moe_gemm_<preset>.{md,json} go (default "
                   "bench/results/h200)\n"
                   "  --nvfp4-instances  also time the W4A16 kernel with each of its instances "
                   "forced\n"
                   "                  (narrow: 64-row items, wide: 128-row items, both 32-token "
                   "passes;\n"
                   "                  prefill: 256-row x 128-token pass items), in a second "
                   "table\n";
      return 0;
    } else if (a == "--preset") {
      o.presets.clear();
      std::stringstream ss(next());
      for (std::string item; std::getline(ss, item, ',');) o.presets.push_back(item);
    } else if (a == "--decode") {
      o.decode = parse_list(next());
    } else if (a == "--reps") {
      o.reps = std::stoi(next());
    } else if (a == "--out") {
      o.out = next();
    } else if (a == "--nvfp4-instances") {
      o.instances = true;
    } else {
      std::cerr << "bench_moe_gemm: unknown option " << a << " (see --help)\n";
      return 2;
    }
  }
  return -1;
}

// Median µs of `launch` over reps, each launch after an L2 flush.
template <typename F>
double time_us(F&& launch, int reps, cuda::DeviceBuffer& flush, cudaStream_t stream) {
  cuda::Event e0(true), e1(true);
  launch();  // warm-up (first-launch setup, tensor-map cache)
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), r & 0xff, flush.bytes(), stream));
    e0.record(stream);
    launch();
    e1.record(stream);
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(stream));
    ms.push_back(cuda::Event::elapsed_ms(e0, e1));
  }
  return median(ms) * 1e3;
}

int run(const Options& o) {
  const auto& dev = cuda::device_info(0);
  const double bw = measure_copy_bandwidth();
  std::printf("%s, %d SMs, copy bandwidth %.2f TB/s\n", dev.name.c_str(), dev.num_sms, bw / 1e12);
  cuda::Stream stream;
  cuda::DeviceBuffer flush(static_cast<size_t>(std::max(dev.l2_bytes, 1 << 20)) * 2);
  cuda::DeviceBuffer counters(16);
  counters.zero();
  const int max_tokens = *std::max_element(o.decode.begin(), o.decode.end());
  for (const std::string& name : o.presets) {
    const auto it = std::find_if(kShapes.begin(), kShapes.end(), [&](const Shape& s) { return s.preset == name; });
    if (it == kShapes.end()) {
      std::cerr << "bench_moe_gemm: unknown preset " << name << " (see --help)\n";
      return 2;
    }
    const Shape sh = *it;
    std::vector<Row> rows;
    for (int g = 0; g < 2; ++g) {
      const int N = g == 0 ? 2 * sh.I : sh.H, K = g == 0 ? sh.H : sh.I;
      const std::string gemm = g == 0 ? "GEMM1 (gate_up)" : "GEMM2 (down)";
      const size_t expert_codes = static_cast<size_t>(N) * K;
      // FP8 experts and their 128 x 128 block scales; NVFP4 image and row scales
      cuda::DeviceBuffer w8(sh.E * expert_codes), s8(static_cast<size_t>(sh.E) * (N / 128) * (K / 128) * 4 + 16);
      cuda::DeviceBuffer w4(static_cast<size_t>(sh.E) * (N / 64) * (K / 128) * ops::kNvfp4StreamBlockBytes);
      cuda::DeviceBuffer rs(static_cast<size_t>(sh.E) * N * 4);
      fill(w8, 1, 0x77);
      fill(w4, 2, 0x77);
      fill(s8, 3, 0x3f);  // small positive floats' high bytes are enough for timing
      fill(rs, 4, 0x3f);
      const int P_max = max_tokens * sh.k;
      const int ld = (P_max + 3) / 4 * 4;
      cuda::DeviceBuffer x8(static_cast<size_t>(P_max) * K), sx8(static_cast<size_t>(K / 128) * ld * 4);
      cuda::DeviceBuffer x16(static_cast<size_t>(P_max) * K * 2), sx16(static_cast<size_t>(P_max) * 4);
      cuda::DeviceBuffer out(static_cast<size_t>(P_max) * N * 2);
      fill(x8, 5, 0x37);
      fill(x16, 6, 0x37);
      fill(sx8, 7, 0x3f);
      fill(sx16, 8, 0x3f);
      for (int T : o.decode) {
        const Routing r = route(sh.E, sh.k, T, 1000 + T);
        std::vector<int32_t> active(sh.E, -1);
        std::copy(r.active.begin(), r.active.end(), active.begin());
        cuda::DeviceBuffer offsets_d(r.offsets.size() * 4), active_d(active.size() * 4), num_d(4);
        offsets_d.upload(r.offsets.data(), r.offsets.size() * 4);
        active_d.upload(active.data(), active.size() * 4);
        const int32_t num = static_cast<int32_t>(r.active.size());
        num_d.upload(&num, 4);
        int max_per = 0;
        for (int e = 0; e < sh.E; ++e) max_per = std::max(max_per, r.offsets[e + 1] - r.offsets[e]);
        const int max_active = std::min(sh.E, r.P);

        ops::cuda::MoeGemmFp8Args a8;
        a8.act = x8.as<uint8_t>();
        a8.act_scale = sx8.as<float>();
        a8.weight = w8.as<uint8_t>();
        a8.weight_scale = s8.as<float>();
        a8.expert_offsets = offsets_d.as<int32_t>();
        a8.active_experts = active_d.as<int32_t>();
        a8.num_active = num_d.as<int32_t>();
        a8.out = out.as<__nv_bfloat16>();
        a8.num_experts = sh.E;
        a8.n = N;
        a8.k = K;
        a8.max_active_experts = max_active;
        a8.max_tokens_per_expert = T;
        a8.act_rows = P_max;
        a8.act_scale_ld = ld;
        a8.work_counters = counters.as<int>();

        ops::cuda::MoeGemmNvfp4Args a4;
        a4.act = x16.as<__half>();
        a4.act_scale = sx16.as<float>();
        a4.weight = w4.as<uint8_t>();
        a4.row_scale = rs.as<float>();
        a4.expert_offsets = offsets_d.as<int32_t>();
        a4.active_experts = active_d.as<int32_t>();
        a4.num_active = num_d.as<int32_t>();
        a4.out = out.as<__nv_bfloat16>();
        a4.num_experts = sh.E;
        a4.n = N;
        a4.k = K;
        a4.max_active_experts = max_active;
        a4.max_tokens_per_expert = max_per;
        a4.act_rows = P_max;
        a4.work_counters = counters.as<int>() + 2;

        ops::cuda::MoeGemmNvfp4W4a8Args a48;  // the same image bytes (timing only), e4m3 rows
        a48.act = x8.as<uint8_t>();
        a48.act_scale = sx16.as<float>();
        a48.weight = w4.as<uint8_t>();
        a48.row_scale = rs.as<float>();
        a48.expert_offsets = offsets_d.as<int32_t>();
        a48.active_experts = active_d.as<int32_t>();
        a48.num_active = num_d.as<int32_t>();
        a48.out = out.as<__nv_bfloat16>();
        a48.num_experts = sh.E;
        a48.n = N;
        a48.k = K;
        a48.max_active_experts = max_active;
        a48.act_rows = P_max;
        a48.work_counters = counters.as<int>() + 2;

        const double fp8_us = time_us(
            [&] { ops::cuda::launch_moe_gemm_fp8_stream(a8, dev.num_sms, false, stream.get()); }, o.reps, flush,
            stream.get());
        const double nvfp4_us = time_us(
            [&] { ops::cuda::launch_moe_gemm_nvfp4_stream(a4, dev.num_sms, false, stream.get()); }, o.reps, flush,
            stream.get());
        const double w4a8_us = time_us(
            [&] { ops::cuda::launch_moe_gemm_nvfp4_w4a8(a48, dev.num_sms, false, stream.get()); },
            o.reps, flush, stream.get());
        const double touched = static_cast<double>(r.active.size());
        const double out_bytes = static_cast<double>(r.P) * N * 2;
        const double fp8_bytes = touched * (static_cast<double>(expert_codes) + (N / 128.0) * (K / 128.0) * 4) +
                                 static_cast<double>(r.P) * K * (1 + 4.0 / 128) + out_bytes;
        const double nvfp4_bytes = touched * (static_cast<double>(expert_codes) * 0.5625 + N * 4.0) +
                                   static_cast<double>(r.P) * (K * 2 + 4) + out_bytes;
        const double w4a8_bytes = touched * (static_cast<double>(expert_codes) * 0.5625 + N * 4.0) +
                                  static_cast<double>(r.P) * (K + 4) + out_bytes;
        rows.push_back(
            {gemm, T, static_cast<int>(touched), max_per, fp8_us, fp8_bytes, nvfp4_us, nvfp4_bytes,
             w4a8_us, w4a8_bytes,
             ops::cuda::nvfp4_stream_instance_name(ops::cuda::nvfp4_stream_instance(a4))});
        Row& row = rows.back();
        if (o.instances) {
          const ops::cuda::Nvfp4StreamInstance forced[3] = {
              ops::cuda::Nvfp4StreamInstance::kNarrow, ops::cuda::Nvfp4StreamInstance::kWide,
              ops::cuda::Nvfp4StreamInstance::kPrefill};
          for (int i = 0; i < 3; ++i) {
            if (forced[i] == ops::cuda::Nvfp4StreamInstance::kPrefill && N % 256 != 0) continue;
            ops::cuda::MoeGemmNvfp4Args ai = a4;
            ai.instance = forced[i];
            row.instance_us[i] = time_us(
                [&] {
                  ops::cuda::launch_moe_gemm_nvfp4_stream(ai, dev.num_sms, false, stream.get());
                },
                o.reps, flush, stream.get());
          }
          std::printf(
              "%-16s %-16s B=%4d nvfp4 instances (auto = %s): narrow %.1f  wide %.1f  prefill %.1f "
              "us\n",
              name.c_str(), gemm.c_str(), T, row.nvfp4_instance.c_str(), row.instance_us[0],
              row.instance_us[1], row.instance_us[2]);
        }
        std::printf(
            "%-16s %-16s B=%4d experts %3d  fp8 %8.1f us (%3.0f %%)  nvfp4 %8.1f us (%3.0f %%)  "
            "x%.2f  w4a8 %8.1f us "
            "(%3.0f %%)  x%.2f\n",
            name.c_str(), gemm.c_str(), T, row.touched, fp8_us,
            100.0 * fp8_bytes / bw / (fp8_us * 1e-6), nvfp4_us,
            100.0 * nvfp4_bytes / bw / (nvfp4_us * 1e-6), fp8_us / nvfp4_us, w4a8_us,
            100.0 * w4a8_bytes / bw / (w4a8_us * 1e-6), fp8_us / w4a8_us);
        std::fflush(stdout);
      }
    }
    // Markdown + JSON
    const std::string base = o.out + "/moe_gemm_" + name;
    std::filesystem::create_directories(o.out);
    std::ofstream md(base + ".md");
    if (!md) throw std::runtime_error("cannot write " + base + ".md (check --out)");
    md << "# bench_moe_gemm " << name << " (" << dev.name << ", copy bandwidth " << bw / 1e12
       << " TB/s)\n\n"
       << "Decode expert GEMMs alone, each launch after an L2 flush; median of " << o.reps
       << " launches. "
       << "% = the kernel's bytes (touched experts' weights and scales, activation rows, outputs) "
          "over the copy "
          "bandwidth, against its time.\n\n"
       << "| GEMM | B | experts touched | max tokens / expert | FP8 µs | FP8 % | NVFP4 µs | NVFP4 "
          "% | NVFP4 speed-up "
          "| W4A8 µs | W4A8 % | W4A8 speed-up |\n"
       << "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    char buf[512];
    for (const Row& r : rows) {
      std::snprintf(
          buf, sizeof buf,
          "| %s | %d | %d | %d | %.1f | %.0f | %.1f | %.0f | %.2fx | %.1f | %.0f | %.2fx |\n",
          r.gemm.c_str(), r.tokens, r.touched, r.max_per_expert, r.fp8_us,
          100.0 * r.fp8_bytes / bw / (r.fp8_us * 1e-6), r.nvfp4_us,
          100.0 * r.nvfp4_bytes / bw / (r.nvfp4_us * 1e-6), r.fp8_us / r.nvfp4_us, r.w4a8_us,
          100.0 * r.w4a8_bytes / bw / (r.w4a8_us * 1e-6), r.fp8_us / r.w4a8_us);
      md << buf;
    }
    if (o.instances) {
      md << "\nThe W4A16 kernel with each instance forced (µs; auto = the instance the kernel "
            "picks "
            "from the busiest expert's tokens, the NVFP4 column above):\n\n"
         << "| GEMM | B | max tokens / expert | auto | narrow µs | wide µs | prefill µs |\n"
         << "|---|---|---|---|---|---|---|\n";
      for (const Row& r : rows) {
        char prefill[32] = "-";  // not run where N is not a multiple of 256
        if (r.instance_us[2] > 0) std::snprintf(prefill, sizeof prefill, "%.1f", r.instance_us[2]);
        std::snprintf(buf, sizeof buf, "| %s | %d | %d | %s | %.1f | %.1f | %s |\n", r.gemm.c_str(),
                      r.tokens, r.max_per_expert, r.nvfp4_instance.c_str(), r.instance_us[0],
                      r.instance_us[1], prefill);
        md << buf;
      }
    }
    std::ofstream js(base + ".json");
    js << "{\"preset\": \"" << json_escape(name) << "\", \"device\": \"" << json_escape(dev.name)
       << "\", \"copy_bandwidth_bytes_per_s\": " << bw << ", \"reps\": " << o.reps << ", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      js << (i ? ", " : "") << "{\"gemm\": \"" << json_escape(r.gemm)
         << "\", \"tokens\": " << r.tokens << ", \"experts_touched\": " << r.touched
         << ", \"max_tokens_per_expert\": " << r.max_per_expert << ", \"fp8_us\": " << r.fp8_us
         << ", \"fp8_bytes\": " << r.fp8_bytes << ", \"nvfp4_us\": " << r.nvfp4_us
         << ", \"nvfp4_bytes\": " << r.nvfp4_bytes << ", \"w4a8_us\": " << r.w4a8_us
         << ", \"w4a8_bytes\": " << r.w4a8_bytes << ", \"nvfp4_instance\": \"" << r.nvfp4_instance
         << "\"";
      if (o.instances)
        js << ", \"narrow_us\": " << r.instance_us[0] << ", \"wide_us\": " << r.instance_us[1]
           << ", \"prefill_us\": " << r.instance_us[2];
      js << "}";
    }
    js << "]}\n";
    md.flush();
    js.flush();
    if (!md || !js) throw std::runtime_error("writing " + base + ".{md,json} failed (disk full?)");
    std::printf("wrote %s.{md,json}\n", base.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace moelora::bench

int main(int argc, char** argv) {
  moelora::bench::Options o;
  try {
    const int rc = moelora::bench::parse(argc, argv, o);
    if (rc >= 0) return rc;
    return moelora::bench::run(o);
  } catch (const std::exception& e) {
    std::cerr << "bench_moe_gemm: " << e.what() << "\n";
    return 1;
  }
}
