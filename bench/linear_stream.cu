// bench_linear_stream: the dense projections of a decode step, cuBLAS (cublasGemmEx, what the
// engine ran before) against moelora's weight-streaming kernel (ops/linear/linear_stream_cuda.cuh),
// on the presets' projection shapes and decode row counts. Two timings per kernel, each launch
// after an L2 flush (a memset of 2x the L2), so the weights come from HBM as in a forward:
//   - alone: the GEMM by itself;
//   - after the norm: a residual RMSNorm of the rows, then the GEMM, timed together, the way the
//     engine runs them; the stream kernel is launched programmatically there, so its first weight
//     tiles stream while the norm runs (cuBLAS waits for the norm to end).
// Reported: median µs, the weight bytes over the time as TB/s and % of the measured copy
// bandwidth, the stream kernel's speed-up, and the largest difference between the two outputs
// relative to the largest |output| (both are bf16 roundings of fp32 sums). Writes
// linear_stream.{md,json} under --out.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/cuda_utils.h"
#include "core/dtype.h"
#include "ops/linear/linear_stream_cuda.cuh"
#include "ops/norm/norm_cuda.cuh"

namespace moelora::bench {
namespace {

struct Projection {
  std::string preset, name;
  int n, k;
};

const std::vector<Projection> kProjections = {
    {"qwen3-30b-a3b", "qkv", 5120, 2048},
    {"qwen3-30b-a3b", "o_proj", 2048, 4096},
    {"qwen3.5-35b-a3b", "qkv + gate", 9216, 2048},
    {"qwen3.5-35b-a3b", "gdn in_proj", 12352, 2048},
    {"qwen3.5-35b-a3b", "o_proj / gdn out_proj", 2048, 4096},
    {"kimi-k2.5", "q_a", 1536, 7168},
    {"kimi-k2.5", "kv_a", 576, 7168},
    {"kimi-k2.5", "q_b", 12288, 1536},
    {"kimi-k2.5", "o_proj", 7168, 8192},
};

struct Options {
  std::vector<std::string> presets = {"qwen3-30b-a3b", "qwen3.5-35b-a3b", "kimi-k2.5"};
  std::vector<int> rows = {1, 4, 16, 32, 64};
  int reps = 30;
  std::string out = "bench/results/h200";
};

int parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::cout
          << "bench_linear_stream: the dense decode projections, cuBLAS against moelora's "
             "weight-streaming kernel, alone and after a residual RMSNorm.\n\n"
             "  --preset LIST   qwen3-30b-a3b, qwen3.5-35b-a3b, kimi-k2.5 (default: all)\n"
             "  --rows LIST     decode rows (default 1,4,16,32,64; at most 64)\n"
             "  --reps N        timed launches per row, each after an L2 flush (default 30)\n"
             "  --out DIR       where linear_stream.{md,json} go (default bench/results/h200)\n";
      return 0;
    } else if (a == "--preset") {
      o.presets.clear();
      std::stringstream ss(next());
      for (std::string item; std::getline(ss, item, ',');) o.presets.push_back(item);
    } else if (a == "--rows") {
      o.rows = parse_list(next());
    } else if (a == "--reps") {
      o.reps = std::stoi(next());
    } else if (a == "--out") {
      o.out = next();
    } else {
      std::cerr << "bench_linear_stream: unknown option " << a << " (see --help)\n";
      return 2;
    }
  }
  for (int r : o.rows)
    if (!ops::cuda::linear_stream_supports(r, 64, 64)) {
      std::cerr << "bench_linear_stream: --rows " << r << " is outside 1.."
                << ops::cuda::kLinearStreamMaxRows << "\n";
      return 2;
    }
  return -1;
}

// Median µs of `launch` over reps, each after an L2 flush.
template <typename F>
double time_us(F&& launch, int reps, cuda::DeviceBuffer& flush, cudaStream_t stream) {
  cuda::Event e0(true), e1(true);
  launch();  // warm-up (cuBLAS heuristics, the kernel's shared-memory attribute)
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

__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(scale * (static_cast<float>(h & 0xffff) / 32768.f - 1.f));
  }
}

struct Row {
  Projection p;
  int rows;
  double cublas_us, stream_us, norm_cublas_us, norm_stream_us, rel_diff;
};

int run(const Options& o) {
  const auto& dev = cuda::device_info(0);
  const double bw = measure_copy_bandwidth();
  std::printf("%s, %d SMs, copy bandwidth %.2f TB/s\n", dev.name.c_str(), dev.num_sms, bw / 1e12);
  cuda::Stream stream;
  cuda::CublasHandle cublas;
  cuda::DeviceBuffer flush(static_cast<size_t>(std::max(dev.l2_bytes, 1 << 20)) * 2);
  const int max_rows = *std::max_element(o.rows.begin(), o.rows.end());
  int max_n = 0, max_k = 0;
  for (const Projection& p : kProjections)
    max_n = std::max(max_n, p.n), max_k = std::max(max_k, p.k);
  cuda::DeviceBuffer partials(ops::cuda::linear_stream_partial_floats(dev.num_sms) * 4);
  cuda::DeviceBuffer tickets(static_cast<size_t>(ops::cuda::linear_stream_tickets(max_n)) * 4);
  tickets.zero();
  ops::cuda::LinearStreamWorkspace ws{partials.as<float>(), tickets.as<int32_t>(),
                                      ops::cuda::linear_stream_tickets(max_n)};
  cuda::DeviceBuffer resid(static_cast<size_t>(max_rows) * max_k * 2), branch(resid.bytes()),
      x(resid.bytes()), norm_w(static_cast<size_t>(max_k) * 2);
  cuda::DeviceBuffer y_cublas(static_cast<size_t>(max_rows) * max_n * 2),
      y_stream(y_cublas.bytes());
  fill_bf16<<<256, 256, 0, stream.get()>>>(resid.as<__nv_bfloat16>(), resid.bytes() / 2, 1, 1.f);
  fill_bf16<<<256, 256, 0, stream.get()>>>(branch.as<__nv_bfloat16>(), branch.bytes() / 2, 2, 1.f);
  fill_bf16<<<256, 256, 0, stream.get()>>>(x.as<__nv_bfloat16>(), x.bytes() / 2, 3, 1.f);
  fill_bf16<<<256, 256, 0, stream.get()>>>(norm_w.as<__nv_bfloat16>(), norm_w.bytes() / 2, 4, 1.f);
  MOELORA_CUDA_CHECK(cudaGetLastError());

  std::vector<Row> table;
  for (const std::string& preset : o.presets) {
    bool known = false;
    for (const Projection& p : kProjections) {
      if (p.preset != preset) continue;
      known = true;
      cuda::DeviceBuffer w(static_cast<size_t>(p.n) * p.k * 2);
      fill_bf16<<<1024, 256, 0, stream.get()>>>(w.as<__nv_bfloat16>(), w.bytes() / 2, 5 + p.n,
                                                0.05f);
      MOELORA_CUDA_CHECK(cudaGetLastError());
      for (int rows : o.rows) {
        auto gemm_cublas = [&] {
          cuda::set_cublas_stream(cublas.get(), stream.get());
          const float alpha = 1.f, beta = 0.f;
          const cublasStatus_t st = cublasGemmEx(
              static_cast<cublasHandle_t>(cublas.get()), CUBLAS_OP_T, CUBLAS_OP_N, p.n, rows, p.k,
              &alpha, w.get(), CUDA_R_16BF, p.k, x.get(), CUDA_R_16BF, p.k, &beta, y_cublas.get(),
              CUDA_R_16BF, p.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasGemmEx failed");
        };
        auto gemm_stream = [&](bool pdl) {
          ops::cuda::LinearStreamArgs a;
          a.x = x.as<__nv_bfloat16>();
          a.w = w.as<__nv_bfloat16>();
          a.y = y_stream.as<__nv_bfloat16>();
          a.rows = rows;
          a.n = p.n;
          a.k = p.k;
          a.ws = ws;
          ops::cuda::launch_linear_stream(a, dev.num_sms, pdl, stream.get());
        };
        auto norm = [&] {  // resid += branch; x = norm(resid), as the engine's branch norm
          ops::cuda::RmsNormArgs n;
          n.x = branch.as<__nv_bfloat16>();
          n.residual = resid.as<__nv_bfloat16>();
          n.weight = norm_w.as<__nv_bfloat16>();
          n.y = x.as<__nv_bfloat16>();
          n.rows = rows;
          n.dim = p.k;
          ops::cuda::launch_rms_norm(n, stream.get());
        };
        Row r{p, rows, 0, 0, 0, 0, 0};
        r.cublas_us = time_us(gemm_cublas, o.reps, flush, stream.get());
        r.stream_us = time_us([&] { gemm_stream(false); }, o.reps, flush, stream.get());
        r.norm_cublas_us = time_us([&] { norm(), gemm_cublas(); }, o.reps, flush, stream.get());
        r.norm_stream_us = time_us([&] { norm(), gemm_stream(true); }, o.reps, flush, stream.get());
        // Same x for both outputs (the norm above rewrote x; both GEMMs read the current one).
        gemm_cublas();
        gemm_stream(false);
        MOELORA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
        std::vector<uint16_t> a(static_cast<size_t>(rows) * p.n), b(a.size());
        y_cublas.download(a.data(), a.size() * 2);
        y_stream.download(b.data(), b.size() * 2);
        double max_diff = 0, max_abs = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          const double va = bf16_bits_to_f32(a[i]), vb = bf16_bits_to_f32(b[i]);
          max_diff = std::max(max_diff, std::fabs(va - vb));
          max_abs = std::max(max_abs, std::fabs(va));
        }
        r.rel_diff = max_abs > 0 ? max_diff / max_abs : max_diff;
        std::printf(
            "%-16s %-22s rows %2d: cuBLAS %7.2f us, stream %7.2f us | after the norm: %7.2f / "
            "%7.2f us\n",
            p.preset.c_str(), p.name.c_str(), rows, r.cublas_us, r.stream_us, r.norm_cublas_us,
            r.norm_stream_us);
        table.push_back(r);
      }
    }
    if (!known) {
      std::cerr << "bench_linear_stream: unknown preset " << preset << " (see --help)\n";
      return 2;
    }
  }

  std::string md = "# Dense decode projections: cuBLAS against the weight-streaming kernel\n\n";
  char line[512];
  std::snprintf(
      line, sizeof(line),
      "%s, %d SMs, copy bandwidth %.2f TB/s; median of %d launches, each after an L2 flush. "
      "TB/s and %% copy: weight bytes over the time. 'after the norm': a residual RMSNorm "
      "of the rows, then the GEMM, timed together (the stream kernel a programmatic launch).\n\n",
      dev.name.c_str(), dev.num_sms, bw / 1e12, o.reps);
  md += line;
  md +=
      "| preset | projection | n x k | MB | rows | cuBLAS us | stream us | speed-up | stream TB/s "
      "| % copy | "
      "norm + cuBLAS us | norm + stream us | speed-up | rel. diff |\n";
  md += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  std::string json = "{\"benchmark\": \"bench_linear_stream\", \"device\": \"" +
                     json_escape(dev.name) + "\", \"copy_bandwidth\": " + std::to_string(bw) +
                     ", \"rows\": [\n";
  for (size_t i = 0; i < table.size(); ++i) {
    const Row& r = table[i];
    const double bytes = 2.0 * r.p.n * r.p.k;
    const double tbs = bytes / (r.stream_us * 1e-6) / 1e12;
    std::snprintf(line, sizeof(line),
                  "| %s | %s | %d x %d | %.1f | %d | %.2f | %.2f | %.2fx | %.2f | %.0f | %.2f | "
                  "%.2f | %.2fx | %.1e |\n",
                  r.p.preset.c_str(), r.p.name.c_str(), r.p.n, r.p.k, bytes / 1e6, r.rows,
                  r.cublas_us, r.stream_us, r.cublas_us / r.stream_us, tbs, 100.0 * tbs * 1e12 / bw,
                  r.norm_cublas_us, r.norm_stream_us, r.norm_cublas_us / r.norm_stream_us,
                  r.rel_diff);
    md += line;
    std::snprintf(
        line, sizeof(line),
        "  {\"preset\": \"%s\", \"projection\": \"%s\", \"n\": %d, \"k\": %d, \"rows\": %d, "
        "\"cublas_us\": %.3f, \"stream_us\": %.3f, \"norm_cublas_us\": %.3f, \"norm_stream_us\": "
        "%.3f, "
        "\"rel_diff\": %.3e}%s\n",
        json_escape(r.p.preset).c_str(), json_escape(r.p.name).c_str(), r.p.n, r.p.k, r.rows,
        r.cublas_us, r.stream_us, r.norm_cublas_us, r.norm_stream_us, r.rel_diff,
        i + 1 < table.size() ? "," : "");
    json += line;
  }
  json += "]}\n";
  const std::string base = o.out + "/linear_stream";
  std::ofstream(base + ".md") << md;
  std::ofstream(base + ".json") << json;
  std::printf("wrote %s.{md,json}\n", base.c_str());
  return 0;
}

}  // namespace
}  // namespace moelora::bench

int main(int argc, char** argv) {
  try {
    moelora::bench::Options o;
    const int rc = moelora::bench::parse(argc, argv, o);
    if (rc >= 0) return rc;
    return moelora::bench::run(o);
  } catch (const std::exception& e) {
    std::cerr << "bench_linear_stream: " << e.what() << "\n";
    return 1;
  }
}
