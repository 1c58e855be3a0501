// bench_decode_step: where the engine's decode step spends its time, kernel by kernel.
//
//   bench_decode_step --preset qwen3-30b-a3b --batch-sizes 16,64 --context 2048 --adapters 0,1
//                     [--layers N] [--rank 16] [--warm-steps 3] [--steps 4] [--out DIR]
//
// For each batch size B and adapter count K it builds one engine (random FP8 weights drawn on the
// device, K random adapters of --rank), runs B prompts of --context tokens through prefill, lets
// the decode graph of the bucket be captured (--warm-steps), then records --steps decode steps with
// CUPTI's kernel activity (bench/kernel_timeline.*): every kernel of the graph replay with its
// queue and GPU timestamps. It prints, per (B, K), each kernel's calls and microseconds per step,
// its share of the step, and the time the main chain sat idle before it (launch gaps and waits on
// the side streams), sorted by time; --out also gets the whole timeline of the first recorded step
// and the tables as JSON. The engine's own decode throughput is `moelora bench`'s job; this program
// says which kernels a faster step has to shorten or remove.
//
// --no-timeline leaves CUPTI alone (Nsight Compute cannot attach beside another CUPTI subscriber)
// and brackets the recorded steps with cudaProfilerStart / Stop instead, so that
//   ncu --profile-from-start off -k regex:moe_ bench_decode_step --no-timeline ...
// profiles the engine's own kernels in place; it prints only the wall time per step.
#include <cuda_profiler_api.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "bench_util.h"
#include "core/cuda_utils.h"
#include "core/error.h"
#include "io/hf_config.h"
#include "kernel_timeline.h"
#include "moelora/engine.h"
#include "runtime/gpu_executor.h"
#include "synth.h"

namespace fs = std::filesystem;
using moelora::ErrorCode;

namespace {

struct Options {
  std::string preset = "qwen3-30b-a3b";
  int64_t layers = 0;
  std::string batch_sizes = "16,64";
  std::string adapters = "0,1";
  int64_t context = 2048;
  int64_t rank = 16;
  int64_t warm_steps = 3;
  int64_t steps = 4;
  std::string attention = "auto";
  bool attention_pdl = true;  // EngineOptions::attention_pdl
  std::string router_gemm = "route";
  int seam1_after_quant = -1;  // EngineOptions::moe_seam1_after_quant
  bool pdl_after_side_join = true;
  int seam2_in_finalize = -1;  // EngineOptions::moe_seam2_in_finalize_max_tokens
  int seam2_shrink_in_activation = -1;  // EngineOptions::moe_seam2_shrink_in_activation
  int shared_lora_stream = -1;          // EngineOptions::moe_shared_lora_stream
  int lora_side_ctas = 0;               // EngineOptions::moe_lora_side_ctas
  std::string stream_schedule = "auto";  // EngineOptions::moe_stream_schedule
  int activation_pdl_shared = -1;       // EngineOptions::moe_activation_pdl_with_shared_pairs
  bool shared_in_experts = true;  // EngineOptions::moe_shared_expert_in_experts
  bool gdn_delta_in_mix = false;  // EngineOptions::gdn_lora_delta_in_mix
  bool no_timeline = false;
  std::string out;
  uint64_t seed = 0;
};

// One kernel name's share of a decode step, averaged over the recorded steps.
struct KernelRow {
  std::string name;
  double calls = 0;      // launches per step
  double us = 0;         // summed duration per step
  double main_idle = 0;  // main chain idle before its launches, per step (main-chain kernels only)
  // What its launches added to the step's span: the part of each one that ends after every kernel
  // that started before it. Kernels launched early with programmatic dependent launch wait inside
  // (their duration includes the wait), so this, not the duration, is their cost.
  double adds = 0;
  bool main = false;  // a main-chain kernel (see on_main_chain)
};

struct StepProfile {
  double span_us = 0;       // first kernel start to last kernel end
  double main_busy_us = 0;  // summed kernel time of the main chain
  double main_idle_us = 0;  // gaps between consecutive main-chain kernels
  double side_busy_us = 0;  // summed kernel time of the LoRA kernels on the side streams
  double kernels = 0;       // launches per step
  std::vector<KernelRow> rows;
};

void check(const moelora::Status& s) {
  if (!s) throw moelora::Error(s.code(), s.message());
}

// The main chain: every kernel but the LoRA ones (lora_*), which the model and the MoE layers put
// on their side streams. Not CUPTI's stream ids: a graph replay runs its branches on queues of the
// executor's choosing (the timelines' q0, q3, ... change from layer to layer), so the queue with
// the most kernels is not the capturing main stream once the LoRA branches are several.
bool on_main_chain(const std::string& kernel) {
  return kernel.rfind("lora_", 0) != 0;
}

StepProfile profile_steps(const std::vector<std::vector<moelora::bench::KernelRecord>>& steps) {
  StepProfile p;
  std::map<std::string, KernelRow> by_name;
  for (const auto& step : steps) {
    if (step.empty()) continue;
    uint64_t first = step.front().start_ns, last = first, main_end = 0;
    for (const auto& r : step) {  // sorted by start time
      const double dur = static_cast<double>(r.end_ns - r.start_ns) / 1e3;
      KernelRow& row = by_name[r.name];
      row.name = r.name;
      row.calls += 1;
      row.us += dur;
      row.adds += r.end_ns > last ? static_cast<double>(r.end_ns - last) / 1e3 : 0;
      last = std::max(last, r.end_ns);
      p.kernels += 1;
      if (on_main_chain(r.name)) {
        row.main = true;
        const double idle = main_end > 0 && r.start_ns > main_end
                                ? static_cast<double>(r.start_ns - main_end) / 1e3
                                : 0;
        row.main_idle += idle;
        p.main_idle_us += idle;
        p.main_busy_us += dur;
        main_end = std::max(main_end, r.end_ns);
      } else {
        p.side_busy_us += dur;
      }
    }
    p.span_us += static_cast<double>(last - first) / 1e3;
  }
  const double n = std::max<double>(1, static_cast<double>(steps.size()));
  for (auto& [name, row] : by_name) {
    row.calls /= n;
    row.us /= n;
    row.main_idle /= n;
    row.adds /= n;
    p.rows.push_back(row);
  }
  p.span_us /= n;
  p.main_busy_us /= n;
  p.main_idle_us /= n;
  p.side_busy_us /= n;
  p.kernels /= n;
  std::sort(p.rows.begin(), p.rows.end(),
            [](const KernelRow& a, const KernelRow& b) { return a.adds > b.adds; });
  return p;
}

std::string format_profile(const StepProfile& p, int64_t layers) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line,
                "step span %.1f us (%.2f us per layer), %.0f kernels; main chain kernel time %.1f "
                "us (durations summed: "
                "kernels launched early overlap), idle "
                "%.1f us; LoRA kernels busy %.1f us\n\n",
                p.span_us, p.span_us / static_cast<double>(std::max<int64_t>(layers, 1)), p.kernels,
                p.main_busy_us, p.main_idle_us, p.side_busy_us);
  out += line;
  out +=
      "| kernel | chain | calls/step | adds to span, us/step | % of span | adds per call, us | "
      "duration per call, us | main idle before, us/step |\n";
  out += "|---|---|---|---|---|---|---|---|\n";
  for (const KernelRow& r : p.rows) {
    const double calls = std::max(r.calls, 1e-9);
    std::snprintf(line, sizeof line, "| %s | %s | %.0f | %.1f | %.1f | %.2f | %.2f | %.1f |\n",
                  r.name.substr(0, 60).c_str(), r.main ? "main" : "LoRA", r.calls, r.adds,
                  100.0 * r.adds / std::max(p.span_us, 1e-9), r.adds / calls, r.us / calls,
                  r.main_idle);
    out += line;
  }
  return out;
}

nlohmann::json profile_json(const StepProfile& p) {
  nlohmann::json rows = nlohmann::json::array();
  for (const KernelRow& r : p.rows)
    rows.push_back({{"kernel", r.name},
                    {"main_queue", r.main},
                    {"calls_per_step", r.calls},
                    {"us_per_step", r.us},
                    {"adds_to_span_us", r.adds},
                    {"main_idle_before_us", r.main_idle}});
  return {{"span_us", p.span_us},           {"main_busy_us", p.main_busy_us},
          {"main_idle_us", p.main_idle_us}, {"side_busy_us", p.side_busy_us},
          {"kernels_per_step", p.kernels},  {"kernels", rows}};
}

int run(const Options& o) {
  const auto bad = ErrorCode::kInvalidArgument;
  const std::vector<int> batch_sizes = moelora::bench::parse_list(o.batch_sizes);
  const std::vector<int> adapter_counts = moelora::bench::parse_list(o.adapters);
  MOELORA_CHECK(!batch_sizes.empty(), bad, "--batch-sizes: expected a comma list such as 16,64");
  MOELORA_CHECK(!adapter_counts.empty(), bad, "--adapters: expected a comma list such as 0,1,8");
  for (int b : batch_sizes) MOELORA_CHECK(b >= 1, bad, "--batch-sizes: ", b, " is not >= 1");
  for (int k : adapter_counts) MOELORA_CHECK(k >= 0, bad, "--adapters: ", k, " is not >= 0");
  MOELORA_CHECK(o.context >= 1 && o.steps >= 1 && o.warm_steps >= 1, bad,
                "--context, --steps and --warm-steps must be >= 1");

  // Only the configuration goes to disk: the GPU draws the weights (EngineOptions::random_weights).
  const fs::path dir =
      fs::temp_directory_path() / ("moelora-decode-step-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  struct RemoveOnExit {  // also when a run throws
    fs::path path;
    ~RemoveOnExit() {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
  } remove_dir{dir};
  const moelora::io::ModelConfig config = moelora::cli::preset_config(o.preset, o.layers, "fp8");
  {
    std::ofstream f(dir / "config.json");
    f << moelora::io::model_config_to_json(config).dump(2) << "\n";
    MOELORA_CHECK(f.good(), bad, "cannot write ", (dir / "config.json").string());
  }
  const int64_t layers = config.num_hidden_layers;
  if (!o.out.empty()) fs::create_directories(o.out);
  // Output names of runs off the default paths, so that an A/B pair can share one --out folder.
  const std::string variant =
      std::string(o.router_gemm == "cublas" ? "_router_cublas" : "") +
      (o.seam1_after_quant >= 0 ? "_seam1_after_quant_" + std::to_string(o.seam1_after_quant)
                                : "") +
      (o.pdl_after_side_join ? "" : "_plain_after_join") +
      (o.seam2_in_finalize >= 0 ? "_seam2_in_finalize_" + std::to_string(o.seam2_in_finalize)
                                : "") +
      (o.seam2_shrink_in_activation >= 0
           ? "_seam2_shrink_in_activation_" + std::to_string(o.seam2_shrink_in_activation)
           : "") +
      (o.shared_lora_stream >= 0 ? "_shared_lora_stream_" + std::to_string(o.shared_lora_stream)
                                 : "") +
      (o.lora_side_ctas == -2  ? "_lora_side_ctas_rule"
       : o.lora_side_ctas != 0 ? "_lora_side_ctas_" + std::to_string(o.lora_side_ctas)
                               : "") +
      (o.stream_schedule == "auto" ? "" : "_stream_schedule_" + o.stream_schedule) +
      (o.activation_pdl_shared >= 0
           ? "_activation_pdl_shared_" + std::to_string(o.activation_pdl_shared)
           : "") +
      (o.shared_in_experts ? "" : "_shared_separate") +
      (o.gdn_delta_in_mix ? "_gdn_delta_in_mix" : "") +
      (o.attention_pdl ? "" : "_plain_attention_launch");
  std::optional<moelora::bench::KernelTimeline> timeline;
  if (!o.no_timeline) timeline.emplace();
  nlohmann::json results = nlohmann::json::array();
  std::string report = "# Decode step kernels: " + o.preset + ", " + std::to_string(layers) +
                       " layers, context " + std::to_string(o.context) + ", r" +
                       std::to_string(o.rank) + " adapters\n\n";
  report +=
      "Command: bench_decode_step --preset " + o.preset + " --layers " + std::to_string(o.layers) +
      " --batch-sizes " + o.batch_sizes + " --adapters " + o.adapters + " --context " +
      std::to_string(o.context) + " --steps " + std::to_string(o.steps) + " --attention " +
      o.attention + (o.attention_pdl ? "" : " --no-attention-pdl") + " --router-gemm " +
      o.router_gemm + " --seam1-after-quant " + std::to_string(o.seam1_after_quant) +
      (o.pdl_after_side_join ? "" : " --no-pdl-after-side-join") + " --seam2-in-finalize " +
      std::to_string(o.seam2_in_finalize) + " --seam2-shrink-in-activation " +
      std::to_string(o.seam2_shrink_in_activation) + " --shared-lora-stream " +
      std::to_string(o.shared_lora_stream) + " --lora-side-ctas " +
      std::to_string(o.lora_side_ctas) + " --stream-schedule " + o.stream_schedule +
      " --activation-pdl-with-shared-pairs " + std::to_string(o.activation_pdl_shared) +
      (o.shared_in_experts ? "" : " --shared-expert-separate") +
      (o.gdn_delta_in_mix ? " --gdn-delta-in-mix" : "") +
      ". Kernel times from CUPTI activity records of graph replays (GPU timestamps), averaged "
      "over the recorded steps; the main chain is every kernel but the LoRA ones (lora_*, on "
      "the side streams), and 'main idle before' is the gap in it before the kernel's launches "
      "(launch latency, or a wait on a side stream).\n\n";

  for (int batch : batch_sizes) {
    for (int adapters : adapter_counts) {
      moelora::EngineOptions options;
      options.model_dir = dir;
      options.device = "cuda";
      options.max_running = batch;
      options.max_batch_tokens =
          std::max<int64_t>(batch, std::min<int64_t>(batch * o.context, 8192));
      options.adapter_slots = std::max(adapters, 1);
      options.max_loras_per_batch = std::max(adapters, 1);
      options.host_adapter_cache = std::max(adapters, 1);
      options.max_lora_rank = (o.rank + 7) / 8 * 8;
      options.random_weights = true;
      options.random_seed = o.seed;
      options.attention = o.attention;
      options.attention_pdl = o.attention_pdl;
      options.router_in_route = o.router_gemm == "route";
      options.moe_seam1_after_quant = o.seam1_after_quant;
      options.moe_pdl_after_side_join = o.pdl_after_side_join;
      options.moe_seam2_in_finalize_max_tokens = o.seam2_in_finalize;
      options.moe_seam2_shrink_in_activation = o.seam2_shrink_in_activation;
      options.moe_shared_lora_stream = o.shared_lora_stream;
      options.moe_lora_side_ctas = o.lora_side_ctas;
      options.moe_stream_schedule =
          moelora::runtime::moe_stream_schedule_from_name(o.stream_schedule);
      options.moe_activation_pdl_with_shared_pairs = o.activation_pdl_shared;
      options.moe_shared_expert_in_experts = o.shared_in_experts;
      options.gdn_lora_delta_in_mix = o.gdn_delta_in_mix;
      const int64_t prefill_steps =
          (batch * o.context + options.max_batch_tokens - 1) / options.max_batch_tokens;
      const int64_t max_new_tokens = prefill_steps + o.warm_steps + o.steps + 4;
      options.max_seq_len = o.context + max_new_tokens + 8;
      auto created = moelora::Engine::create(options);
      check(created.status());
      moelora::Engine& engine = *created.value();
      std::vector<std::string> names;
      for (int i = 0; i < adapters; ++i) {
        names.push_back("random-r" + std::to_string(o.rank) + "-" + std::to_string(i));
        check(engine.register_random_adapter(names.back(), o.rank, false, o.seed + 1 + i,
                                             /*pin=*/true));
      }
      std::mt19937_64 rng(o.seed);
      std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.vocab_size - 1));
      std::vector<int64_t> generated(static_cast<size_t>(batch), 0);
      std::vector<moelora::RequestId> ids;
      for (int i = 0; i < batch; ++i) {
        moelora::Request request;
        request.prompt.resize(static_cast<size_t>(o.context));
        for (auto& t : request.prompt) t = token(rng);
        request.adapter = names.empty() ? "" : names[static_cast<size_t>(i) % names.size()];
        // Long enough that no request ends before the recorded steps: the first requests decode
        // while later prompts are still in prefill. They are cancelled after the recording.
        request.sampling.max_new_tokens = max_new_tokens;
        request.sampling.ignore_eos = true;
        auto id = engine.submit(std::move(request), [&generated, i](const moelora::TokenEvent& e) {
          if (e.token >= 0) ++generated[static_cast<size_t>(i)];
        });
        check(id.status());
        ids.push_back(id.value());
      }
      std::fprintf(stderr, "B=%d, %d adapters: prefill of %d x %lld tokens ...\n", batch, adapters,
                   batch, static_cast<long long>(o.context));
      auto all_started = [&] {
        return std::all_of(generated.begin(), generated.end(), [](int64_t g) { return g > 0; });
      };
      while (!all_started()) check(engine.step());
      for (int64_t s = 0; s < o.warm_steps; ++s)
        check(engine.step());  // captures the bucket's graph
      std::vector<std::vector<moelora::bench::KernelRecord>> steps;
      const moelora::EngineStats before = engine.stats();
      if (!timeline) MOELORA_CUDA_CHECK(cudaProfilerStart());
      const auto wall_start = std::chrono::steady_clock::now();
      for (int64_t s = 0; s < o.steps; ++s) {
        if (timeline) timeline->start();
        check(engine.step());
        if (timeline) steps.push_back(timeline->stop());
      }
      const double wall_ms_per_step =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall_start)
              .count() /
          static_cast<double>(o.steps);
      if (!timeline) MOELORA_CUDA_CHECK(cudaProfilerStop());
      const moelora::EngineStats after = engine.stats();
      // Every recorded step must be one replay of the bucket's decode graph over all B sequences
      // (no prefill chunk, no capture, no request ending in between).
      MOELORA_CHECK(after.graph_replays - before.graph_replays == o.steps &&
                        after.graph_captures == before.graph_captures &&
                        after.decode_only_tokens - before.decode_only_tokens == o.steps * batch,
                    ErrorCode::kInternal, "the ", o.steps, " recorded steps were ",
                    after.graph_replays - before.graph_replays, " graph replays and ",
                    after.graph_captures - before.graph_captures, " captures decoding ",
                    after.decode_only_tokens - before.decode_only_tokens, " tokens; expected ",
                    o.steps, " replays of ", batch, " tokens each (raise --warm-steps)");
      for (moelora::RequestId id : ids) check(engine.cancel(id));
      check(engine.run_until_idle());
      if (!timeline) {  // kernel records off (a profiler attached): the step's wall time only
        std::printf("B = %d, %d adapter%s: %.3f ms per decode step (wall clock, %lld steps)\n",
                    batch, adapters, adapters == 1 ? "" : "s", wall_ms_per_step,
                    static_cast<long long>(o.steps));
        std::fflush(stdout);
        continue;
      }

      const StepProfile p = profile_steps(steps);
      const std::string title = "## B = " + std::to_string(batch) + ", " +
                                std::to_string(adapters) + " adapter" + (adapters == 1 ? "" : "s");
      const std::string table = format_profile(p, layers);
      std::printf("%s\n\n%s\n", title.c_str(), table.c_str());
      std::fflush(stdout);
      report += title + "\n\n" + table + "\n";
      nlohmann::json j = profile_json(p);
      j["batch_size"] = batch;
      j["adapters"] = adapters;
      results.push_back(j);
      if (!o.out.empty()) {
        const fs::path path =
            fs::path(o.out) / ("decode_step_" + o.preset + variant + "_B" + std::to_string(batch) + "_" +
                               std::to_string(adapters) + "adapters_timeline.md");
        std::ofstream f(path);
        f << title << ", the first recorded step\n\n"
          << moelora::bench::format_timeline(steps.front());
      }
    }
  }
  if (!o.out.empty() && timeline) {  // (no tables without the kernel records)
    const fs::path base = fs::path(o.out) / ("decode_step_" + o.preset + variant);
    std::ofstream(base.string() + ".md") << report;
    nlohmann::json doc = {{"benchmark", "bench_decode_step"},
                          {"preset", o.preset},
                          {"layers", layers},
                          {"context", o.context},
                          {"rank", o.rank},
                          {"steps", o.steps},
                          {"attention", o.attention},
                          {"router_gemm", o.router_gemm},
                          {"seam1_after_quant", o.seam1_after_quant},
                          {"pdl_after_side_join", o.pdl_after_side_join},
                          {"seam2_in_finalize", o.seam2_in_finalize},
                          {"seam2_shrink_in_activation", o.seam2_shrink_in_activation},
                          {"shared_lora_stream", o.shared_lora_stream},
                          {"lora_side_ctas", o.lora_side_ctas},
                          {"stream_schedule", o.stream_schedule},
                          {"activation_pdl_with_shared_pairs", o.activation_pdl_shared},
                          {"shared_expert_in_experts", o.shared_in_experts},
                          {"gdn_delta_in_mix", o.gdn_delta_in_mix},
                          {"runs", results}};
    std::ofstream(base.string() + ".json") << doc.dump(2) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "Where the engine's decode step spends its time: the kernels of a decode graph replay, "
      "recorded with CUPTI, per batch size and adapter count (random weights drawn on the GPU)."};
  app.add_option("--preset", o.preset, "Model preset of `moelora synth` (its config only)")
      ->capture_default_str();
  app.add_option("--layers", o.layers, "Keep the first N decoder layers (0 = all)")
      ->capture_default_str();
  app.add_option("--batch-sizes", o.batch_sizes, "Comma list of decode batch sizes")
      ->capture_default_str();
  app.add_option("--adapters", o.adapters, "Comma list of adapter counts (0 = no LoRA)")
      ->capture_default_str();
  app.add_option("--context", o.context,
                 "Prompt tokens per sequence (the KV context of the decode steps)")
      ->capture_default_str();
  app.add_option("--rank", o.rank, "Rank of the random adapters")->capture_default_str();
  app.add_option("--warm-steps", o.warm_steps,
                 "Decode steps before recording (the first captures the graph)")
      ->capture_default_str();
  app.add_option("--steps", o.steps, "Decode steps recorded and averaged")->capture_default_str();
  app.add_option("--attention", o.attention, "GQA attention kernels: auto, flashinfer, moelora")
      ->capture_default_str();
  app.add_flag("--attention-pdl,!--no-attention-pdl", o.attention_pdl,
               "GQA layers on FlashInfer's kernels: launch the attention and its split merge as "
               "programmatic dependents of the qkv prologue, so their launch and set-up overlap "
               "it (the default); --no-attention-pdl launches them plainly "
               "(EngineOptions::attention_pdl, docs/gpu_engine.md §4b)");
  app.add_option("--router-gemm", o.router_gemm,
                 "MoE router logits at decode: route (inside the route launch) or cublas (a GEMM "
                 "before it; the earlier path, for A/B runs)")
      ->check(CLI::IsMember({"route", "cublas"}))
      ->capture_default_str();
  app.add_option("--seam1-after-quant", o.seam1_after_quant,
                 "MoE layers: start the seam-1 LoRA side work after the quant kernel (1) instead "
                 "of the align (0); -1 = the layer's rule (SideStreamScheduling::"
                 "seam1_after_quant, docs/gpu_moe.md)")
      ->check(CLI::Range(-1, 1))
      ->capture_default_str();
  app.add_flag("--pdl-after-side-join,!--no-pdl-after-side-join", o.pdl_after_side_join,
               "MoE layers: the activation and finalize launched programmatically after the side "
               "stream's LoRA events (SideStreamScheduling::pdl_after_side_join, the default); "
               "--no-pdl-after-side-join: plain launches after them, the schedule before");
  app.add_option(
         "--seam2-in-finalize", o.seam2_in_finalize,
         "MoE layers without a separate shared expert: decode steps of at most N tokens form the "
         "seam-2 LoRA expand in the finalize kernel instead of on the side stream (0 = "
         "never, -1 = the layer's default; SideStreamScheduling::"
         "seam2_expand_in_finalize_max_tokens, which lists the other conditions)")
      ->check(CLI::Range(-1, 1 << 30))
      ->capture_default_str();
  app.add_option("--seam2-shrink-in-activation", o.seam2_shrink_in_activation,
                 "MoE layers where the seam-2 expand is formed in the finalize: the seam-2 LoRA "
                 "shrinks (routed experts and a shared expert among them) run in the activation "
                 "kernel and the shared expert's expand in the finalize (1) instead of on the side "
                 "stream (0); -1 = the layer's rule, off (SideStreamScheduling::"
                 "seam2_shrink_in_activation, docs/gpu_moe.md §6.0h)")
      ->check(CLI::Range(-1, 1))
      ->capture_default_str();
  app.add_option("--shared-lora-stream", o.shared_lora_stream,
                 "MoE layers with the shared expert among the routed GEMMs' experts: its LoRA "
                 "kernels on a second side stream beside the routed experts' (1) or after them on "
                 "the side stream (0); -1 = the layer's rule (SideStreamScheduling::"
                 "shared_lora_stream, docs/gpu_moe.md §6.0i)")
      ->check(CLI::Range(-1, 1))
      ->capture_default_str();
  app.add_option("--lora-side-ctas", o.lora_side_ctas,
                 "MoE layers: grid cap of the decode LoRA kernels on the side stream: 0 = one CTA "
                 "per work unit (the default), -1 = one CTA per SM, -2 = the opt-in rule (one CTA "
                 "per SM up to 16 tokens where hidden <= 4096), N = at most N CTAs "
                 "(SideStreamScheduling::lora_max_ctas, docs/gpu_moe.md §6.0q)")
      ->check(CLI::Range(-2, 1 << 20))
      ->capture_default_str();
  app.add_option("--stream-schedule", o.stream_schedule,
                 "MoE layers' stream GEMMs: work items claimed from a counter (claimed) or a fixed "
                 "share per CTA (round-robin); auto = the layer's rule: claimed, except with LoRA "
                 "for NVFP4 experts and layers of more than 128 experts (StreamGemmSchedule, "
                 "docs/gpu_moe.md §6.0k)")
      ->check(CLI::IsMember({"auto", "claimed", "round-robin"}))
      ->capture_default_str();
  app.add_option("--activation-pdl-with-shared-pairs", o.activation_pdl_shared,
                 "MoE layers with the shared expert among the routed GEMMs' experts: the "
                 "activation a programmatic launch after its LoRA events (1) or a plain one (0); "
                 "-1 = the layer's rule (SideStreamScheduling::activation_pdl_with_shared_pairs, "
                 "docs/gpu_moe.md §6.0i)")
      ->check(CLI::Range(-1, 1))
      ->capture_default_str();
  app.add_flag("--shared-expert-in-experts,!--shared-expert-separate", o.shared_in_experts,
               "MoE layers with an FP8 shared expert of the routed experts' size (Qwen3.5, "
               "DeepSeek-V3 / Kimi shapes) run it as one more expert of the routed FP8 GEMMs (the "
               "default); --shared-expert-separate keeps it a separate bf16 MLP (two cuBLAS GEMMs "
               "and an activation after GEMM2) (EngineOptions::moe_shared_expert_in_experts)");
  app.add_flag("--gdn-delta-in-mix", o.gdn_delta_in_mix,
               "Gated DeltaNet layers: expand the in-projection's LoRA delta on the side stream "
               "beside the base GEMM and add it in the mix kernels as they read their inputs, "
               "instead of in place after the GEMM (EngineOptions::gdn_lora_delta_in_mix)");
  app.add_flag("--no-timeline", o.no_timeline,
               "Record no CUPTI kernel timeline (for Nsight Compute, which cannot attach beside "
               "it): the recorded steps run between cudaProfilerStart and Stop and only their "
               "wall time is printed");
  app.add_option("--seed", o.seed, "Seed of the weights, adapters and prompts")
      ->capture_default_str();
  app.add_option("--out", o.out,
                 "Folder for decode_step_<preset>.{md,json} and the per-run timelines");
  app.footer(
      "Example: bench_decode_step --preset qwen3-30b-a3b --batch-sizes 16,64 --adapters 0,1 "
      "--context 2048 "
      "--out bench/results/h200\nNeeds a GPU and CUPTI (LD_LIBRARY_PATH with the toolkit's "
      "extras/CUPTI/lib64).");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_decode_step: %s\n", e.what());
    return 1;
  }
}
