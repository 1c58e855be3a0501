// `moelora bench`: engine-level throughput of one batch (PERF.md "How to benchmark").
//
//   moelora bench (--model DIR | --preset NAME [--random-weights] [--quant bf16|fp8|nvfp4])
//                 --input-len N --output-len N --batch-sizes 16,32,64
//                 [--adapters none | --adapters a=DIR,b=DIR | --adapter NAME=DIR ... |
//                  --synth-adapters K | --random-adapters K] [--synth-rank R]
//                 [--synth-layout per-expert|shared-outer|peft-3d]
//                 [--adapter-dist uniform|distinct|skewed] [--base-share F] [--json FILE]
//                 [--device cpu|cuda] [--seed S] [--max-batch-tokens N] [--prefill-chunk N]
//                 [--max-layers N|fit] [--gpu-memory-fraction F] [--adapter-slots N]
//                 [--max-lora-rank R] [--attention auto|flashinfer|moelora]
//                 [--moe-shared-expert-separate]
//
// --device defaults to cuda when this build has CUDA and a device is visible, else cpu.
// --random-weights (GPU only) takes the preset's config.json without writing any weights: the
// GPU model draws them on the device, so presets of real sizes (qwen3-30b-a3b, kimi-k2.5 with
// --max-layers) run in seconds; --random-adapters K registers K seeded random adapters of
// --synth-rank in --synth-layout the same way (Engine::register_random_adapter). --max-layers N
// runs the first N decoder layers only (per-layer figures stay comparable); --max-layers fit runs
// the most leading layers whose weights, adapter pool, workspaces and the KV cache of the largest
// batch at input + output tokens fit --gpu-memory-fraction of the free device memory
// (runtime::gpu_layers_that_fit, the executor's own memory plan), and prints the split.
//
// The adapter pool is sized from the run, not from the engine defaults (8 slots of rank 64: for
// Kimi-K2.5 shapes, 384 experts and hidden 7168, that is ~8 GB of device memory per MoE layer):
// adapter_slots = max_loras_per_batch = the adapters the run registers (at least 1), and
// max_lora_rank = the largest rank among them (--synth-rank for random adapters, the files' ranks
// otherwise) rounded up to a multiple of 8. --adapter-slots / --max-lora-rank override them; the
// header line prints the values used.
//
// For every batch size B: B prompts of random token ids (seeded, the same for every run of that
// B) are submitted at once to the Engine and generated greedily with EOS ignored, first without
// LoRA, then (when adapters are given) with the adapters assigned to the requests by
// --adapter-dist. Reported per run: prefill and decode throughput (the engine's step times: a step
// with prompt tokens counts as prefill), overall throughput B * (in + out) / latency, time to
// first token (mean, median, max over the batch), peak resident memory (getrusage: the process
// peak so far) and KV cache, and for LoRA runs the percentage of the no-LoRA run's throughput.
// Before a LoRA run counts, its output is checked against the no-LoRA run: base-only requests
// (--base-share) must produce exactly the same tokens, since a request's tokens may not depend on
// its batch; requests on adapters are counted when they differ (adapters with random weights
// change the output).
//
// --preset writes a random checkpoint with `moelora synth` (and --synth-adapters K random PEFT
// adapters with `moelora synth-adapter`) into a temporary directory, through the same binary's
// subcommands, so the benchmark runs anywhere with nothing to download. The adapters are pinned
// in the slot pool (one slot each), so slot loads stay out of the timed runs.
//
// Output: a Markdown table on stdout, a progress bar per run on stderr, and with --json FILE one
// object: {"benchmark", "date", "host", "device", "threads", "model", "input_len", "output_len",
// "seed", "max_batch_tokens", "prefill_chunk", "adapter_slots", "max_lora_rank", "kv_cache_pages",
// "kv_page_size", "attention_kernel", "moe_shared_expert_in_experts", "moe_scheduling"
// {"seam1_after_quant", "seam2_in_finalize", "stream_schedule"},
// "moe_shared_experts_in_experts_layers", "adapters", "adapter_dist", "base_share", "runs":
// [{"batch_size", "lora", "adapters_in_batch", "base_requests", "prefill_tokens_per_s",
// "decode_tokens_per_s", "overall_tokens_per_s", "latency_s", "ttft_ms": {"mean", "p50", "max"},
// "peak_rss_mb", "peak_kv_cache_mb", "steps", "kv_blocked_steps", "pct_of_no_lora": null or
// {"overall", "decode",
// "prefill"}, "base_requests_match": null or bool, "adapter_requests_changed": null or int}],
// "targets": []}. GPU runs add "gpu" {name, sm, driver, cuda_runtime, memory_gb, sm_clock_mhz},
// "commit", "copy_bandwidth_gbps" (a 1 GiB device-to-device copy timed in the same run, read +
// write counted), and per run "peak_gpu_memory_mb" (device bytes in use at the peak, from
// cudaMemGetInfo after every step), "decode_step_ms", "decode_us_per_layer", "step_bytes_mb" and
// "roofline_fraction" (runtime::decode_step_bytes over the measured step time: every weight read
// once, the D(B) experts uniform routing touches, the KV cache at the run's mean decode context
// input + output / 2, each adapter's factors for its share of the batch; runtime/step_bytes.h),
// and fill `targets` with the E1-E3 entries of PERF.md that the runs measure:
//   E1  a run with 1 adapter: (LoRA / no-LoRA decode throughput) / (ideal ratio from bytes),
//       target 0.97; with shared-outer adapters also the plain ratio, target 0.95;
//   E2  a no-LoRA run: ideal decode step time (bytes / copy bandwidth) / measured, target 0.80;
//   E3  runs with 4 or 8 distinct adapters: LoRA / no-LoRA decode throughput, target 0.92.
// A CPU run measures none of the targets, so `targets` stays empty there.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench.h"
#include "cli.h"
#include "core/error.h"
#include "core/progress.h"
#include "core/threads.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "model/model_setup.h"
#include "moelora/engine.h"
#include "runtime/gpu_executor.h"
#include "synth.h"

namespace {

namespace fs = std::filesystem;
using moelora::ErrorCode;
using Clock = std::chrono::steady_clock;
using namespace moelora::cli::bench;

// Unwraps a public-API result, turning a failed Status into the library's exception.
void check(const moelora::Status& status) {
  if (!status) throw moelora::Error(status.code(), status.message());
}

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // Linux: kilobytes
}

Ttft summarize(std::vector<double> ms) {
  Ttft t;
  if (ms.empty()) return t;
  std::sort(ms.begin(), ms.end());
  for (double v : ms) t.mean += v / static_cast<double>(ms.size());
  const size_t n = ms.size();
  t.p50 = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  t.max = ms.back();
  return t;
}

std::vector<std::vector<int32_t>> random_prompts(int64_t batch, int64_t len, int64_t vocab,
                                                 uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(batch));
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch));
  for (auto& p : prompts) {
    p.resize(static_cast<size_t>(len));
    for (auto& t : p) t = dist(rng);
  }
  return prompts;
}

// Adapter of each of `batch` requests ("" = base). `names` are the registered adapters: for
// "distinct" one per request (batch of them), else the K given ones.
std::vector<std::string> assign_adapters(int64_t batch, const std::vector<std::string>& names,
                                         const std::string& dist, double base_share,
                                         uint64_t seed) {
  std::vector<std::string> out(static_cast<size_t>(batch));
  if (names.empty()) return out;
  std::mt19937_64 rng(seed + 17);
  // Zipf weights 1/(k+1) for "skewed": adapter 0 gets the most requests.
  std::vector<double> weights;
  for (size_t k = 0; k < names.size(); ++k) weights.push_back(1.0 / static_cast<double>(k + 1));
  std::discrete_distribution<size_t> zipf(weights.begin(), weights.end());
  int64_t adapter_index = 0;
  for (int64_t i = 0; i < batch; ++i) {
    // round(batch * share) base-only requests, spread evenly: request i is base when
    // round((i + 1) * share) steps up.
    const bool base = std::floor(static_cast<double>(i + 1) * base_share + 0.5) >
                      std::floor(static_cast<double>(i) * base_share + 0.5);
    if (base) continue;
    if (dist == "skewed") {
      out[i] = names[zipf(rng)];
    } else {  // uniform: round-robin over the adapters; distinct: one name per request
      out[i] = names[static_cast<size_t>(adapter_index % static_cast<int64_t>(names.size()))];
    }
    ++adapter_index;
  }
  return out;
}

RunResult run_batch(moelora::Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                    const std::vector<std::string>& adapter_of, int64_t output_len,
                    const std::string& label, bool gpu) {
  const int64_t batch = static_cast<int64_t>(prompts.size());
  RunResult r;
  r.batch_size = batch;
  r.adapter_of = adapter_of;
  r.outputs.resize(prompts.size());
  std::vector<double> first_ms(prompts.size(), -1.0);
  std::string error;
  moelora::ProgressBar progress(label, static_cast<uint64_t>(batch * output_len), "tokens");
  const moelora::EngineStats before = engine.stats();
  const auto start = Clock::now();
  auto last_event = start;
  for (size_t i = 0; i < prompts.size(); ++i) {
    moelora::Request request;
    request.prompt = prompts[i];
    request.adapter = adapter_of[i];
    request.sampling.max_new_tokens = output_len;
    request.sampling.ignore_eos = true;
    moelora::Result<moelora::RequestId> id =
        engine.submit(std::move(request), [&, i](const moelora::TokenEvent& event) {
          last_event = Clock::now();
          if (event.finish_reason == moelora::FinishReason::kError && error.empty())
            error = event.error;
          if (event.token < 0) return;
          if (first_ms[i] < 0)
            first_ms[i] = std::chrono::duration<double, std::milli>(last_event - start).count();
          r.outputs[i].push_back(event.token);
          progress.advance();
        });
    check(id.status());
  }
  double peak_kv = 0, peak_gpu = 0;
  while (!engine.idle()) {
    check(engine.step());
    peak_kv = std::max(peak_kv, static_cast<double>(engine.stats().kv_cache_bytes) / 1e6);
    if (gpu)
      peak_gpu =
          std::max(peak_gpu, static_cast<double>(moelora::runtime::gpu_memory_in_use()) / 1e6);
  }
  if (gpu) r.peak_gpu_mb = peak_gpu;
  progress.finish();
  MOELORA_CHECK(error.empty(), ErrorCode::kInternal, label, ": a request failed: ", error);
  const moelora::EngineStats after = engine.stats();
  r.latency_s = std::chrono::duration<double>(last_event - start).count();
  const double prefill_s = after.prefill_seconds - before.prefill_seconds;
  const double decode_s = after.decode_seconds - before.decode_seconds;
  r.prefill_tps = prefill_s > 0
                      ? static_cast<double>(after.prompt_tokens - before.prompt_tokens) / prefill_s
                      : 0;
  r.decode_tps =
      decode_s > 0
          ? static_cast<double>(after.decode_only_tokens - before.decode_only_tokens) / decode_s
          : 0;
  const int64_t input_len = prompts.empty() ? 0 : static_cast<int64_t>(prompts[0].size());
  r.overall_tps =
      r.latency_s > 0 ? static_cast<double>(batch * (input_len + output_len)) / r.latency_s : 0;
  r.ttft = summarize(first_ms);
  r.peak_rss_mb = peak_rss_mb();
  r.peak_kv_mb = peak_kv;
  r.steps = after.steps - before.steps;
  r.kv_blocked_steps = after.kv_blocked_steps - before.kv_blocked_steps;
  r.decode_steps = (after.steps - after.prefill_steps) - (before.steps - before.prefill_steps);
  r.decode_s = decode_s;
  std::vector<std::string> distinct;
  for (const std::string& a : adapter_of) {
    if (a.empty()) {
      ++r.base_requests;
    } else if (std::find(distinct.begin(), distinct.end(), a) == distinct.end()) {
      distinct.push_back(a);
    }
  }
  r.lora = !distinct.empty();
  r.adapters_in_batch = static_cast<int64_t>(distinct.size());
  return r;
}

void compare_with_baseline(RunResult& lora, const RunResult& base) {
  auto pct = [](double a, double b) {
    return b > 0 ? std::optional<double>(100.0 * a / b) : std::nullopt;
  };
  lora.pct_overall = pct(lora.overall_tps, base.overall_tps);
  lora.pct_decode = pct(lora.decode_tps, base.decode_tps);
  lora.pct_prefill = pct(lora.prefill_tps, base.prefill_tps);
  bool match = true;
  int64_t changed = 0;
  for (size_t i = 0; i < lora.outputs.size(); ++i) {
    if (lora.adapter_of[i].empty()) {
      match = match && lora.outputs[i] == base.outputs[i];
    } else {
      changed += lora.outputs[i] != base.outputs[i];
    }
  }
  lora.base_match = match;
  lora.adapter_changed = changed;
}

int run_bench(const BenchArgs& arg_in) {
  const auto bad = ErrorCode::kInvalidArgument;
  BenchArgs a = arg_in;
  if (a.device.empty()) a.device = moelora::default_device();
  check(moelora::check_device(a.device));
  const bool gpu = a.device == "cuda" || a.device == "gpu";
  MOELORA_CHECK(!a.random_weights || (gpu && !a.preset.empty()), bad,
                "--random-weights needs --preset NAME and --device cuda (the GPU draws the "
                "weights; the CPU backend needs files: drop --random-weights)");
  MOELORA_CHECK(a.random_adapters == 0 || a.random_weights, bad,
                "--random-adapters needs --random-weights (use --synth-adapters with files)");
  MOELORA_CHECK(a.random_adapters >= 0, bad, "--random-adapters must be >= 0");
  // --max-layers N, or "fit": the most layers the device holds with this run's KV cache (GPU;
  // chosen below once the engine's limits are known; all layers until then).
  const bool fit_layers = a.max_layers == "fit";
  int64_t max_layers = 0;
  if (!fit_layers) {
    char* end = nullptr;
    max_layers = std::strtoll(a.max_layers.c_str(), &end, 10);
    MOELORA_CHECK(!a.max_layers.empty() && *end == '\0' && max_layers >= 0, bad,
                  "--max-layers: expected a layer count >= 0 (0 = all) or 'fit', got '",
                  a.max_layers, "'");
  }
  MOELORA_CHECK(!fit_layers || (gpu && (a.random_weights || !a.model_dir.empty())), bad,
                "--max-layers fit needs --device cuda and either --random-weights or --model DIR "
                "(the layers that fit are chosen from the device's free memory)");
  MOELORA_CHECK(a.synth_rank >= 1, bad, "--synth-rank must be >= 1, got ", a.synth_rank);
  // The scheduling switches act on the GPU's MoE layers only; on the CPU they would be ignored.
  const bool moe_switches = a.moe_seam1_after_quant != -1 || a.moe_seam2_in_finalize != -1 ||
                            a.moe_stream_schedule != "auto";
  MOELORA_CHECK(gpu || !moe_switches, bad,
                "--moe-seam1-after-quant, --moe-seam2-in-finalize and --moe-stream-schedule "
                "schedule the GPU's MoE kernels: use them with --device cuda, or drop them");
  MOELORA_CHECK(a.adapter_slots >= 0 && a.adapter_slots <= INT32_MAX && a.max_lora_rank >= 0, bad,
                "--adapter-slots and --max-lora-rank must be >= 0 (0 = sized from the run), got ",
                a.adapter_slots, " and ", a.max_lora_rank);
  const std::string quant = !a.quant.empty() ? a.quant : a.random_weights ? "fp8" : "bf16";
  MOELORA_CHECK(
      a.model_dir.empty() != a.preset.empty(), bad,
      "give exactly one of --model DIR and --preset NAME (e.g. --preset small-qwen3-moe)");
  MOELORA_CHECK(a.input_len >= 1, bad, "--input-len must be >= 1, got ", a.input_len);
  MOELORA_CHECK(a.output_len >= 1, bad, "--output-len must be >= 1, got ", a.output_len);
  MOELORA_CHECK(a.dist == "uniform" || a.dist == "distinct" || a.dist == "skewed", bad,
                "--adapter-dist '", a.dist, "' is unknown; expected uniform, distinct or skewed");
  MOELORA_CHECK(a.base_share >= 0.0 && a.base_share <= 1.0, bad,
                "--base-share must be in [0, 1], got ", a.base_share);
  MOELORA_CHECK(a.synth_adapters >= 0, bad, "--synth-adapters must be >= 0, got ",
                a.synth_adapters);
  MOELORA_CHECK(a.max_batch_tokens >= 0 && a.prefill_chunk >= 0, bad,
                "--max-batch-tokens and --prefill-chunk must be >= 0 (0 = automatic / no cap)");
  std::vector<int64_t> batch_sizes;
  for (int32_t b : moelora::cli::parse_int_list(a.batch_sizes, "--batch-sizes")) {
    MOELORA_CHECK(b >= 1, bad, "--batch-sizes: every size must be >= 1, got ", b);
    batch_sizes.push_back(b);
  }
  std::vector<moelora::model::AdapterSpec> specs;
  if (a.adapters != "none" && !a.adapters.empty()) {
    size_t pos = 0;
    while (pos <= a.adapters.size()) {
      const size_t end = std::min(a.adapters.find(',', pos), a.adapters.size());
      specs.push_back(moelora::model::parse_adapter_spec(a.adapters.substr(pos, end - pos)));
      pos = end + 1;
    }
  }
  for (const std::string& s : a.adapter_list)
    specs.push_back(moelora::model::parse_adapter_spec(s));
  for (size_t i = 0; i < specs.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      MOELORA_CHECK(specs[i].name != specs[j].name, bad, "adapter name '", specs[i].name,
                    "' is given twice");
    }
  }

  std::unique_ptr<moelora::cli::ScratchDir> scratch;
  fs::path model_dir = a.model_dir;
  if (!a.preset.empty() || a.synth_adapters > 0)
    scratch = std::make_unique<moelora::cli::ScratchDir>("bench");
  if (!a.preset.empty() && a.random_weights) {
    // Only the configuration: the GPU draws the weights.
    model_dir = scratch->path() / "model";
    fs::create_directories(model_dir);
    const moelora::io::ModelConfig preset =
        moelora::cli::preset_config(a.preset, max_layers, quant);
    std::ofstream out(model_dir / "config.json");
    out << moelora::io::model_config_to_json(preset).dump(2) << "\n";
    MOELORA_CHECK(out.good(), ErrorCode::kInvalidArgument, "cannot write ",
                  (model_dir / "config.json").string());
  } else if (!a.preset.empty()) {
    model_dir = scratch->path() / "model";
    std::fprintf(stderr, "writing a random %s checkpoint to %s\n", a.preset.c_str(),
                 model_dir.string().c_str());
    std::vector<std::string> synth = {
        "--preset", a.preset, "--seed", std::to_string(a.seed), "--out", model_dir.string()};
    if (max_layers > 0) synth.insert(synth.end(), {"--layers", std::to_string(max_layers)});
    if (!a.quant.empty()) synth.insert(synth.end(), {"--quant", a.quant});
    moelora::cli::run_subcommand("synth", synth);
  }
  for (int64_t i = 0; i < a.synth_adapters; ++i) {
    const std::string name = "synth-r" + std::to_string(a.synth_rank) + "-" + std::to_string(i);
    const fs::path dir = scratch->path() / name;
    moelora::cli::run_subcommand(
        "synth-adapter",
        {"--model", model_dir.string(), "--layout", a.synth_layout, "--targets", a.synth_targets,
         "--rank", std::to_string(a.synth_rank), "--alpha", std::to_string(2 * a.synth_rank),
         "--seed", std::to_string(a.seed + 1 + i), "--out", dir.string()});
    specs.push_back({name, dir});
  }
  MOELORA_CHECK(
      a.dist != "distinct" || !specs.empty() || a.base_share == 1.0, bad,
      "--adapter-dist distinct needs adapters (--adapters, --adapter or --synth-adapters)");

  moelora::io::ModelConfig config =
      moelora::runtime::first_layers(moelora::io::load_model_config(model_dir), max_layers);
  // Random adapters (GPU): registered by name, drawn on the device.
  const bool shared_outer = a.synth_layout == "shared-outer";
  MOELORA_CHECK(a.random_adapters == 0 || shared_outer || a.synth_layout == "per-expert", bad,
                "--synth-layout '", a.synth_layout,
                "' with --random-adapters: expected per-expert or shared-outer");
  for (int64_t i = 0; i < a.random_adapters; ++i) {
    specs.push_back(
        {"random-r" + std::to_string(a.synth_rank) + "-" + std::to_string(i), fs::path()});
  }
  const int64_t max_batch = *std::max_element(batch_sizes.begin(), batch_sizes.end());
  // Registered names: the adapters themselves, or for "distinct" one name per request of the
  // largest batch (the given directories round-robin), so every request has its own slot.
  std::vector<moelora::model::AdapterSpec> registered = specs;
  if (a.dist == "distinct" && !specs.empty()) {
    registered.clear();
    for (int64_t i = 0; i < max_batch; ++i) {
      const auto& s = specs[static_cast<size_t>(i) % specs.size()];
      registered.push_back({s.name + "#" + std::to_string(i), s.dir});
    }
  }
  int64_t max_rank = a.random_adapters > 0 ? a.synth_rank : 1;
  for (const auto& s : specs) {
    if (s.dir.empty()) continue;  // random
    max_rank = std::max(max_rank, moelora::io::load_adapter(s.dir, config, s.name).max_rank);
  }
  // The adapter pool, sized from the run (see the file comment). Every adapter is pinned to its
  // own slot, so fewer slots than adapters cannot work.
  const int64_t run_slots = std::max<int64_t>(1, static_cast<int64_t>(registered.size()));
  MOELORA_CHECK(a.adapter_slots == 0 || a.adapter_slots >= static_cast<int64_t>(registered.size()),
                bad, "--adapter-slots ", a.adapter_slots, " is below the ", registered.size(),
                " adapters this run registers (each is pinned to its own slot)");
  const int32_t adapter_slots =
      static_cast<int32_t>(a.adapter_slots > 0 ? a.adapter_slots : run_slots);
  MOELORA_CHECK(a.max_lora_rank == 0 || a.max_lora_rank >= max_rank, bad, "--max-lora-rank ",
                a.max_lora_rank, " is below the largest adapter rank of this run, ", max_rank);
  const int64_t pool_rank = a.max_lora_rank > 0 ? a.max_lora_rank : (max_rank + 7) / 8 * 8;
  // GPU ceilings measured before the model takes the memory.
  double copy_bandwidth = 0;
  moelora::runtime::GpuDeviceReport device_report;
  if (gpu) {
    device_report = moelora::runtime::gpu_device_report();
    copy_bandwidth = moelora::runtime::measure_copy_bandwidth();
  }

  moelora::EngineOptions options;
  options.model_dir = model_dir;
  options.device = a.device;
  options.max_running = static_cast<int32_t>(max_batch);
  // Default budget: the whole batch's prompts in one step, up to 8192 tokens (then chunked).
  options.max_batch_tokens =
      a.max_batch_tokens > 0
          ? a.max_batch_tokens
          : std::max<int64_t>(max_batch, std::min<int64_t>(max_batch * a.input_len, 8192));
  options.prefill_chunk = a.prefill_chunk;
  options.adapter_slots = adapter_slots;
  options.max_loras_per_batch = adapter_slots;
  options.host_adapter_cache = static_cast<int32_t>(registered.size());
  options.max_lora_rank = pool_rank;
  options.show_progress = true;
  options.max_layers = max_layers;
  options.random_weights = a.random_weights;
  options.random_seed = a.seed;
  options.gpu_memory_fraction = a.gpu_memory_fraction;
  options.attention = a.attention;
  options.moe_shared_expert_in_experts = a.moe_shared_expert_in_experts;
  options.moe_seam1_after_quant = a.moe_seam1_after_quant;
  options.moe_seam2_in_finalize_max_tokens = a.moe_seam2_in_finalize;
  options.moe_stream_schedule =
      moelora::runtime::moe_stream_schedule_from_name(a.moe_stream_schedule);
  if (gpu) options.max_seq_len = std::max<int64_t>(a.input_len + a.output_len, 64);
  if (fit_layers) {
    // The free memory now (the bandwidth probe's buffers are gone), as the executor will see it.
    const uint64_t free_bytes = device_report.total_bytes - moelora::runtime::gpu_memory_in_use();
    const moelora::runtime::GpuExecutorOptions executor =
        moelora::runtime::gpu_executor_options(options);
    const int64_t all = config.num_hidden_layers;
    max_layers = moelora::runtime::gpu_layers_that_fit(config, executor, free_bytes,
                                                       device_report.total_bytes);
    MOELORA_CHECK(max_layers >= 1, ErrorCode::kOutOfRange,
                  "--max-layers fit: not even one decoder layer of ", config.model_type,
                  " fits with the KV cache of ", max_batch, " sequences of ",
                  a.input_len + a.output_len, " tokens in ", a.gpu_memory_fraction, " of the ",
                  free_bytes >> 20, " MiB free on ", device_report.name,
                  "; use smaller batches, shorter sequences or fewer adapter slots");
    config = moelora::runtime::first_layers(config, max_layers);
    options.max_layers = max_layers;
    const moelora::runtime::GpuMemoryPlan plan =
        moelora::runtime::plan_gpu_memory(config, executor, device_report.total_bytes);
    std::printf(
        "--max-layers fit: %lld of %lld decoder layers (model ~%.1f GiB with the adapter pool "
        "and workspaces, KV cache %.1f GiB, %.1f GiB kept free; %.2f of %.1f GiB free)\n",
        static_cast<long long>(max_layers), static_cast<long long>(all),
        static_cast<double>(plan.model_bytes) / (1ull << 30),
        static_cast<double>(plan.full_kv_bytes) / (1ull << 30),
        static_cast<double>(plan.slack_bytes) / (1ull << 30), a.gpu_memory_fraction,
        static_cast<double>(free_bytes) / (1ull << 30));
  }
  moelora::Result<std::unique_ptr<moelora::Engine>> created = moelora::Engine::create(options);
  if (!created.status() && !a.preset.empty()) {
    // e.g. a preset the backend cannot run (Qwen3.5's Gated DeltaNet layers on the GPU)
    throw moelora::Error(created.status().code(),
                         "--preset " + a.preset + ": " + created.status().message());
  }
  check(created.status());
  moelora::Engine& engine = *created.value();
  for (size_t i = 0; i < registered.size(); ++i) {
    const auto& s = registered[i];
    if (s.dir.empty()) {
      check(engine.register_random_adapter(s.name, a.synth_rank, shared_outer,
                                           a.seed + 1 + static_cast<uint64_t>(i), /*pin=*/true));
    } else {
      check(engine.register_adapter(s.name, s.dir, /*pin=*/true));
    }
  }
  std::vector<std::string> names;
  for (const auto& s : registered) names.push_back(s.name);

  std::printf(
      "moelora bench: %s, %lld layers, hidden %lld, %lld experts top-%lld, vocab %lld; device %s, "
      "%d threads; adapter slots %d (max %d per batch), max LoRA rank %lld; attention %s\n",
      config.model_type.c_str(), static_cast<long long>(config.num_hidden_layers),
      static_cast<long long>(config.hidden_size), static_cast<long long>(config.num_experts),
      static_cast<long long>(config.num_experts_per_tok), static_cast<long long>(config.vocab_size),
      a.device.c_str(), moelora::num_threads(), options.adapter_slots, options.max_loras_per_batch,
      static_cast<long long>(options.max_lora_rank), engine.model_info().attention_kernel.c_str());
  if (moe_switches)
    std::printf(
        "MoE decode scheduling: seam-1 after quant %d, seam-2 in finalize %d, stream "
        "schedule %s (-1 / auto: the layers' rules)\n",
        a.moe_seam1_after_quant, a.moe_seam2_in_finalize, a.moe_stream_schedule.c_str());
  const moelora::ModelInfo& info = engine.model_info();
  BenchSetup setup;
  setup.gpu = gpu;
  setup.device = device_report;
  setup.copy_bandwidth = copy_bandwidth;
  setup.quant = quant;
  setup.model_dir = model_dir;
  setup.max_layers = max_layers;
  setup.layers_fit = fit_layers;
  setup.max_rank = max_rank;
  setup.shared_outer = shared_outer;
  setup.max_batch_tokens = options.max_batch_tokens;
  setup.prefill_chunk = options.prefill_chunk;
  setup.adapter_slots = options.adapter_slots;
  setup.max_lora_rank = options.max_lora_rank;
  setup.specs = specs;
  if (info.kv_cache_pages > 0) {
    std::printf(
        "KV cache: %lld pages of %lld tokens (%lld tokens); each request reserves the pages of "
        "input + output at admission\n",
        static_cast<long long>(info.kv_cache_pages), static_cast<long long>(info.kv_page_size),
        static_cast<long long>(info.kv_cache_pages * info.kv_page_size));
  }
  std::printf(
      "one batch per run: input %lld, output %lld tokens per request, greedy, EOS ignored; %lld "
      "tokens per step\n",
      static_cast<long long>(a.input_len), static_cast<long long>(a.output_len),
      static_cast<long long>(options.max_batch_tokens));
  if (gpu) {
    std::printf(
        "GPU: %s (sm_%d%d, %d SMs, %.0f GB), driver %d, CUDA runtime %d; device-to-device "
        "copy %.0f GB/s (read + write)%s\n",
        device_report.name.c_str(), device_report.sm_major, device_report.sm_minor,
        device_report.num_sms, static_cast<double>(device_report.total_bytes) / 1e9,
        device_report.driver_version, device_report.runtime_version, copy_bandwidth / 1e9,
        a.random_weights ? "; random weights drawn on the device" : "");
  }
  if (!specs.empty()) {
    std::string list;
    for (const auto& s : specs) list += (list.empty() ? "" : ", ") + s.name;
    std::printf("adapters: %s; distribution %s%s\n", list.c_str(), a.dist.c_str(),
                a.base_share > 0 ? (", base-only share " + fmt(a.base_share, "%.2f")).c_str() : "");
  }
  std::fflush(stdout);

  {  // warm-up (threads, first touch of the weights and of every adapter), not reported
    const int64_t b =
        std::min<int64_t>(max_batch, std::max<int64_t>(2, static_cast<int64_t>(names.size())));
    const auto prompts =
        random_prompts(b, std::min<int64_t>(a.input_len, 8), config.vocab_size, a.seed + 99);
    run_batch(engine, prompts, std::vector<std::string>(static_cast<size_t>(b)), 2, "warm-up", gpu);
    if (!names.empty()) {
      std::vector<std::string> all(static_cast<size_t>(b));
      for (int64_t i = 0; i < b; ++i) all[i] = names[static_cast<size_t>(i) % names.size()];
      run_batch(engine, prompts, all, 2, "warm-up lora", gpu);
    }
  }

  std::vector<RunResult> runs;
  bool all_match = true;
  for (int64_t b : batch_sizes) {
    const auto prompts = random_prompts(b, a.input_len, config.vocab_size, a.seed);
    RunResult base = run_batch(engine, prompts, std::vector<std::string>(static_cast<size_t>(b)),
                               a.output_len, "bench B=" + std::to_string(b) + " no-lora", gpu);
    runs.push_back(base);
    if (specs.empty()) continue;
    const auto adapter_of = assign_adapters(b, names, a.dist, a.base_share, a.seed);
    RunResult lora = run_batch(engine, prompts, adapter_of, a.output_len,
                               "bench B=" + std::to_string(b) + " lora", gpu);
    compare_with_baseline(lora, base);
    all_match = all_match && lora.base_match.value_or(true);
    runs.push_back(lora);
  }

  setup.config = config;
  setup.kv_cache_pages = info.kv_cache_pages;
  setup.kv_page_size = info.kv_page_size;
  setup.attention_kernel = info.attention_kernel;
  setup.moe_shared_experts_in_experts = info.moe_shared_experts_in_experts;
  const std::vector<TargetLine> targets = bench_targets(a, setup, runs);
  print_bench_report(a, setup, runs, targets);
  if (!a.json.empty()) {
    std::ofstream out(a.json);
    MOELORA_CHECK(out.good(), bad, "--json: cannot write ", a.json);
    out << bench_json(a, setup, runs, targets).dump(2) << "\n";
    MOELORA_CHECK(out.good(), bad, "--json: writing ", a.json, " failed");
    std::printf("\nwrote %s\n", a.json.c_str());
  }
  if (!all_match) {
    std::fprintf(stderr,
                 "moelora bench: base-only requests produced different tokens in a mixed batch\n");
    return 1;
  }
  return 0;
}

std::function<int()> setup_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  app.add_option("--model", a->model_dir, "Checkpoint directory (config.json + *.safetensors)");
  app.add_option("--preset", a->preset,
                 "Synthesize a random checkpoint of this `moelora synth` preset instead (e.g. "
                 "small-qwen3-moe)");
  app.add_option("--adapters", a->adapters, "none, or NAME=DIR[,NAME=DIR...]")
      ->capture_default_str();
  app.add_option("--adapter", a->adapter_list, "One more adapter NAME=DIR (repeatable)");
  app.add_option("--synth-adapters", a->synth_adapters,
                 "Synthesize K random PEFT adapters for the model")
      ->capture_default_str();
  app.add_option("--synth-rank", a->synth_rank, "Rank of the synthesized adapters")
      ->capture_default_str();
  app.add_option("--synth-layout", a->synth_layout,
                 "Expert layout of the synthesized adapters (per-expert, "
                 "peft-3d, shared-outer)")
      ->capture_default_str();
  app.add_option("--synth-targets", a->synth_targets,
                 "Targets of the synthesized adapters (see synth-adapter)")
      ->capture_default_str();
  app.add_option(
         "--adapter-dist", a->dist,
         "Requests to adapters: uniform (round-robin), distinct (every request its own adapter "
         "name and slot), skewed (Zipf: adapter k with weight 1/(k+1))")
      ->capture_default_str();
  app.add_option("--base-share", a->base_share,
                 "Share of base-only requests in LoRA runs, in [0, 1]")
      ->capture_default_str();
  app.add_option("--input-len", a->input_len, "Prompt tokens per request")->capture_default_str();
  app.add_option("--output-len", a->output_len, "Generated tokens per request")
      ->capture_default_str();
  app.add_option("--batch-sizes", a->batch_sizes, "Comma list of batch sizes B")
      ->capture_default_str();
  app.add_option("--json", a->json, "Also write the results as JSON to FILE");
  app.add_option("--device", a->device,
                 "cpu or cuda (default: cuda when this build has CUDA and a device is visible)");
  app.add_flag("--random-weights", a->random_weights,
               "GPU: take only the --preset's config and draw the weights on the device");
  app.add_option("--quant", a->quant,
                 "Expert weights of --preset: bf16, fp8 or nvfp4 (default: fp8 with "
                 "--random-weights, else bf16)");
  app.add_option("--random-adapters", a->random_adapters,
                 "GPU with --random-weights: K random adapters of --synth-rank / --synth-layout, "
                 "drawn on the device")
      ->capture_default_str();
  app.add_option("--max-layers", a->max_layers,
                 "Run only the first N decoder layers (0 = all), or 'fit': the most layers the "
                 "GPU holds with the KV cache of the largest batch at input + output tokens")
      ->capture_default_str();
  app.add_option("--gpu-memory-fraction", a->gpu_memory_fraction,
                 "GPU: share of the free device memory the engine may use (KV cache sizing)")
      ->capture_default_str();
  app.add_option("--adapter-slots", a->adapter_slots,
                 "Adapter slots of the engine, also its max LoRAs per batch (0 = the run's "
                 "adapters, at least 1)")
      ->capture_default_str();
  app.add_option("--max-lora-rank", a->max_lora_rank,
                 "Largest adapter rank a slot holds (0 = the run's largest rank, rounded up to a "
                 "multiple of 8)")
      ->capture_default_str();
  app.add_option("--attention", a->attention,
                 "GPU attention kernels of GQA models: auto (FlashInfer's when built in and the "
                 "head dim is served), flashinfer, moelora")
      ->check(CLI::IsMember({"auto", "flashinfer", "moelora"}))
      ->capture_default_str();
  app.add_flag("--moe-shared-expert-in-experts,!--moe-shared-expert-separate",
               a->moe_shared_expert_in_experts,
               "MoE layers whose shared expert is FP8 with the routed experts' size (Qwen3.5, "
               "DeepSeek-V3 / Kimi FP8 checkpoints and presets) run it as one more expert of the "
               "routed GEMMs (the default; the byte roofline counts it in FP8 where the engine "
               "took it, ModelInfo::moe_shared_experts_in_experts); --moe-shared-expert-separate "
               "keeps it a separate bf16 MLP");
  app.add_option("--moe-seam1-after-quant", a->moe_seam1_after_quant,
                 "GPU MoE decode with LoRA: release the seam-1 LoRA kernels after the activation "
                 "quant (1, the expert GEMM reaches the SMs first) or after the align (0); -1 = "
                 "the layers' rule (docs/gpu_moe.md 6.0d)")
      ->check(CLI::Range(-1, 1))
      ->capture_default_str();
  app.add_option("--moe-seam2-in-finalize", a->moe_seam2_in_finalize,
                 "GPU MoE decode with LoRA: form the seam-2 expand in the finalize kernel for "
                 "steps of at most N tokens (0 = never, on the side stream); -1 = the layers' "
                 "default (64 tokens, at most 32 x 7168 tokens x hidden; docs/gpu_moe.md 6.0g, "
                 "6.0n)")
      ->check(CLI::Range(-1, 1 << 20))
      ->capture_default_str();
  app.add_option("--moe-stream-schedule", a->moe_stream_schedule,
                 "GPU MoE decode GEMMs: work items claimed from a counter (claimed), a fixed "
                 "share per CTA (round-robin), or the layers' rule (auto)")
      ->check(CLI::IsMember({"auto", "claimed", "round-robin"}))
      ->capture_default_str();
  app.add_option("--seed", a->seed,
                 "Seed of the prompts (and of --preset / --synth-adapters weights)")
      ->capture_default_str();
  app.add_option("--max-batch-tokens", a->max_batch_tokens,
                 "Tokens per engine step (0 = the largest batch's prompts, at most 8192)")
      ->capture_default_str();
  app.add_option("--prefill-chunk", a->prefill_chunk,
                 "Prompt tokens per request per step (0 = no cap)")
      ->capture_default_str();
  app.footer(
      "\nExample (GPU, Qwen3-30B-A3B shapes, nothing on disk):\n"
      "  moelora bench --preset qwen3-30b-a3b --random-weights --random-adapters 8 --synth-rank 16 "
      "--batch-sizes 16,32,64 --input-len 2048 --output-len 2048 --json results.json\n"
      "Example (CPU, a few seconds):\n"
      "  moelora bench --preset small-qwen3-moe --synth-adapters 2 --batch-sizes 4 --input-len 32 "
      "--output-len 16\n"
      "Each batch size runs without LoRA, then with the adapters; LoRA runs report the % of the "
      "no-LoRA\n"
      "throughput and check that base-only requests produce the same tokens as without LoRA.");
  return [a] { return run_bench(*a); };
}

}  // namespace

MOELORA_SUBCOMMAND("bench",
                   "Engine throughput of one batch of B prompts, without and with LoRA adapters",
                   20, setup_bench);
