// `moelora bench`: what its two sources share (the command's documentation is in bench.cpp).
//
//   bench.cpp         the options, the engine set up for the run, the timed batches, --help
//   bench_report.cpp  the PERF.md targets (E1-E3) from the byte model of a decode step
//                     (runtime/step_bytes.h), the Markdown table on stdout and the --json file
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/hf_config.h"
#include "model/model_setup.h"
#include "runtime/gpu_executor.h"

namespace moelora::cli::bench {

struct BenchArgs {
  std::string model_dir;
  std::string preset;
  std::string adapters = "none";
  std::vector<std::string> adapter_list;  // --adapter NAME=DIR (repeatable)
  int64_t synth_adapters = 0;
  int64_t synth_rank = 16;
  std::string synth_layout = "per-expert";
  std::string synth_targets = "all";
  std::string dist = "uniform";
  double base_share = 0.0;
  int64_t input_len = 128;
  int64_t output_len = 32;
  std::string batch_sizes = "16,32,64";
  std::string json;
  std::string device;  // "" = cuda when available, else cpu
  uint64_t seed = 0;
  int64_t max_batch_tokens = 0;  // 0 = auto
  int64_t prefill_chunk = 0;
  bool random_weights = false;
  std::string quant;  // "" = fp8 with --random-weights, else bf16
  int64_t random_adapters = 0;
  std::string max_layers = "0";  // N (0 = all) or "fit"
  double gpu_memory_fraction = 0.9;
  int64_t adapter_slots = 0;       // 0 = the run's adapters (at least 1)
  int64_t max_lora_rank = 0;       // 0 = the run's largest rank, rounded up to a multiple of 8
  std::string attention = "auto";  // EngineOptions::attention
  bool moe_shared_expert_in_experts = true;  // EngineOptions::moe_shared_expert_in_experts
  // The MoE layers' decode scheduling on the GPU, for A/B runs of the engine headline
  // (EngineOptions::moe_seam1_after_quant, moe_seam2_in_finalize_max_tokens, moe_stream_schedule;
  // -1 / "auto" = the layers' measured rules).
  int moe_seam1_after_quant = -1;
  int moe_seam2_in_finalize = -1;
  std::string moe_stream_schedule = "auto";
};

struct Ttft {
  double mean = 0, p50 = 0, max = 0;  // milliseconds
};

struct RunResult {
  int64_t batch_size = 0;
  bool lora = false;
  int64_t adapters_in_batch = 0;  // distinct adapters among the requests
  int64_t base_requests = 0;
  double prefill_tps = 0, decode_tps = 0, overall_tps = 0, latency_s = 0;
  Ttft ttft;
  double peak_rss_mb = 0, peak_kv_mb = 0;
  std::optional<double> peak_gpu_mb;  // GPU runs: device bytes in use at the peak
  int64_t steps = 0;
  int64_t kv_blocked_steps = 0;               // steps where a request waited for KV pages
  int64_t decode_steps = 0;                   // decode-only steps
  double decode_s = 0;                        // their time
  std::optional<double> step_bytes;           // GPU runs: the byte model of a decode step
  std::vector<std::vector<int32_t>> outputs;  // per request
  std::vector<std::string> adapter_of;        // per request ("" = base)
  // LoRA runs, against the no-LoRA run of the same B.
  std::optional<double> pct_overall, pct_decode, pct_prefill;
  std::optional<bool> base_match;
  std::optional<int64_t> adapter_changed;

  // Mean time of a decode-only step in ms (0 without one).
  double step_ms() const {
    return decode_steps > 0 ? 1e3 * decode_s / static_cast<double>(decode_steps) : 0.0;
  }
};

// ---- the report

// What the run was, beside its arguments: the model and engine as set up, the device.
struct BenchSetup {
  bool gpu = false;
  runtime::GpuDeviceReport device;
  double copy_bandwidth = 0;  // bytes/s, read + write counted
  std::string quant;
  std::filesystem::path model_dir;
  io::ModelConfig config;   // cut to the layers that run
  int64_t max_layers = 0;   // the layers asked for (0 = all), after --max-layers fit
  bool layers_fit = false;  // --max-layers fit chose them
  int64_t max_rank = 1;     // the largest adapter rank of the run
  bool shared_outer = false;
  int64_t max_batch_tokens = 0, prefill_chunk = 0, adapter_slots = 0, max_lora_rank = 0;
  int64_t kv_cache_pages = 0, kv_page_size = 0;
  std::string attention_kernel;
  int64_t moe_shared_experts_in_experts = 0;  // ModelInfo's: the layers that took the option
  std::vector<model::AdapterSpec> specs;
};

struct TargetLine {
  std::string id, config;
  double value = 0, target = 0;
};

// Fills every run's step_bytes and returns the E1-E3 lines the runs measure (GPU runs only; the
// no-LoRA run of a batch size precedes its LoRA run).
std::vector<TargetLine> bench_targets(const BenchArgs& a, const BenchSetup& s,
                                      std::vector<RunResult>& runs);
// The Markdown tables on stdout: runs, targets, the base-only / adapter output checks.
void print_bench_report(const BenchArgs& a, const BenchSetup& s, const std::vector<RunResult>& runs,
                        const std::vector<TargetLine>& targets);
// The --json object (bench.cpp's file comment lists its keys).
nlohmann::json bench_json(const BenchArgs& a, const BenchSetup& s,
                          const std::vector<RunResult>& runs,
                          const std::vector<TargetLine>& targets);

std::string fmt(double v, const char* format = "%.1f");

}  // namespace moelora::cli::bench
