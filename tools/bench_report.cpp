// `moelora bench`'s report: the byte model of a decode step, the PERF.md targets it measures, the
// Markdown tables and the --json object (bench.cpp's file comment documents both).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <string>

#include "bench.h"
#include "core/threads.h"
#include "runtime/step_bytes.h"

namespace moelora::cli::bench {

namespace {

nlohmann::json opt_json(const std::optional<double>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

std::string iso_date() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

// The commit of the source tree the benchmark runs in (the working directory's repository), with
// "-dirty" when the tree has uncommitted changes (the binary may then be of code no commit holds),
// or "unknown" outside a repository.
std::string git_commit() {
  FILE* pipe = popen("git describe --always --dirty --abbrev=12 2>/dev/null", "r");
  if (pipe == nullptr) return "unknown";
  char buf[64] = {0};
  const bool got = std::fgets(buf, sizeof buf, pipe) != nullptr;
  pclose(pipe);
  std::string commit = got ? buf : "";
  while (!commit.empty() && (commit.back() == '\n' || commit.back() == ' ')) commit.pop_back();
  return commit.empty() ? "unknown" : commit;
}

// The fraction of the byte roofline a run's decode step reaches, when measured.
std::optional<double> roofline_fraction(const RunResult& r, double copy_bandwidth) {
  const double ms = r.step_ms();
  if (!r.step_bytes || ms <= 0 || copy_bandwidth <= 0) return std::nullopt;
  return (*r.step_bytes / copy_bandwidth) / (ms * 1e-3);
}

}  // namespace

std::string fmt(double v, const char* format) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::vector<TargetLine> bench_targets(const BenchArgs& a, const BenchSetup& s,
                                      std::vector<RunResult>& runs) {
  std::vector<TargetLine> lines;
  if (!s.gpu) return lines;
  const double context = static_cast<double>(a.input_len) + static_cast<double>(a.output_len) / 2;
  const RunResult* base = nullptr;
  for (RunResult& r : runs) {
    if (!r.lora) base = &r;
    const runtime::StepBytes bytes = runtime::decode_step_bytes(
        s.config, r.batch_size, context, r.adapters_in_batch, r.batch_size - r.base_requests,
        s.max_rank, s.shared_outer, s.moe_shared_experts_in_experts > 0);
    r.step_bytes = bytes.base + bytes.lora;
    if (base == nullptr || r.step_ms() <= 0 || base->step_ms() <= 0) continue;
    const std::string cfg =
        (a.preset.empty() ? s.config.model_type : a.preset) + " B=" + std::to_string(r.batch_size) +
        " in=" + std::to_string(a.input_len) + " out=" + std::to_string(a.output_len);
    if (!r.lora) {
      const double ideal_ms = 1e3 * bytes.base / s.copy_bandwidth;
      lines.push_back({"E2", cfg + " no LoRA", ideal_ms / r.step_ms(), 0.80});
      continue;
    }
    const double ratio = base->step_ms() / r.step_ms();  // decode throughput, LoRA / no-LoRA
    const std::string lora_cfg = cfg + " r" + std::to_string(s.max_rank) + " " +
                                 std::to_string(r.adapters_in_batch) + " adapter" +
                                 (r.adapters_in_batch == 1 ? "" : "s") + " " +
                                 (s.shared_outer ? "shared-outer" : "per-expert");
    if (r.adapters_in_batch == 1) {
      const double ideal = bytes.base / (bytes.base + bytes.lora);
      lines.push_back({"E1", lora_cfg + " (over the ideal ratio " + fmt(ideal, "%.3f") + ")",
                       ratio / ideal, 0.97});
      if (s.shared_outer) lines.push_back({"E1", lora_cfg + " (absolute)", ratio, 0.95});
    }
    if (r.adapters_in_batch == 4 || r.adapters_in_batch == 8)
      lines.push_back({"E3", lora_cfg, ratio, 0.92});
  }
  return lines;
}

void print_bench_report(const BenchArgs& a, const BenchSetup& s, const std::vector<RunResult>& runs,
                        const std::vector<TargetLine>& targets) {
  const int64_t layers = std::max<int64_t>(s.config.num_hidden_layers, 1);
  std::printf(
      "\n| B | adapters | prefill tok/s | decode tok/s | overall tok/s | TTFT ms mean / p50 / max "
      "| latency s | peak RSS MB | KV MB | %% of no-LoRA overall (decode) | decode step ms "
      "(us/layer) | peak GPU MB | %% of byte roofline |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const RunResult& r : runs) {
    std::string adapters = "none";
    if (r.lora) {
      adapters = std::to_string(r.adapters_in_batch) + " " + a.dist;
      if (r.base_requests > 0) adapters += ", " + std::to_string(r.base_requests) + " base";
    }
    std::string pct = "-";
    if (r.pct_overall)
      pct = fmt(*r.pct_overall) + " % (" + (r.pct_decode ? fmt(*r.pct_decode) + " %" : "-") + ")";
    const double ms = r.step_ms();
    const std::string step =
        ms > 0 ? fmt(ms, "%.3f") + " (" + fmt(1e3 * ms / static_cast<double>(layers)) + ")" : "-";
    const std::string gpu_mb = r.peak_gpu_mb ? fmt(*r.peak_gpu_mb, "%.0f") : "-";
    const std::optional<double> roof = roofline_fraction(r, s.copy_bandwidth);
    const std::string roof_text = roof ? fmt(100.0 * *roof) + " %" : "-";
    std::printf("| %lld | %s | %s | %s | %s | %s / %s / %s | %s | %s | %s | %s | %s | %s | %s |\n",
                static_cast<long long>(r.batch_size), adapters.c_str(), fmt(r.prefill_tps).c_str(),
                fmt(r.decode_tps).c_str(), fmt(r.overall_tps).c_str(), fmt(r.ttft.mean).c_str(),
                fmt(r.ttft.p50).c_str(), fmt(r.ttft.max).c_str(), fmt(r.latency_s, "%.3f").c_str(),
                fmt(r.peak_rss_mb, "%.0f").c_str(), fmt(r.peak_kv_mb, "%.1f").c_str(), pct.c_str(),
                step.c_str(), gpu_mb.c_str(), roof_text.c_str());
  }
  if (!targets.empty()) {
    std::printf("\n| target | config | value | target | met |\n|---|---|---|---|---|\n");
    for (const TargetLine& t : targets) {
      std::printf("| %s | %s | %.3f | %.2f | %s |\n", t.id.c_str(), t.config.c_str(), t.value,
                  t.target, t.value >= t.target ? "yes" : "NO");
    }
  }
  for (const RunResult& r : runs) {
    if (!r.lora) continue;
    const std::string base_check =
        r.base_requests == 0 ? std::string("no base-only requests")
                             : std::to_string(r.base_requests) + " base-only requests " +
                                   (*r.base_match ? "match" : "DO NOT MATCH") + " the no-LoRA run";
    std::printf("check B=%lld: %s; %lld of %lld adapter requests changed the output\n",
                static_cast<long long>(r.batch_size), base_check.c_str(),
                static_cast<long long>(r.adapter_changed.value_or(0)),
                static_cast<long long>(r.batch_size - r.base_requests));
  }
}

nlohmann::json bench_json(const BenchArgs& a, const BenchSetup& s,
                          const std::vector<RunResult>& runs,
                          const std::vector<TargetLine>& targets) {
  const int64_t layers = std::max<int64_t>(s.config.num_hidden_layers, 1);
  nlohmann::json j;
  j["benchmark"] = "moelora bench";
  j["date"] = iso_date();
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  j["host"] = {{"name", host},
               {"hardware_threads", static_cast<int64_t>(sysconf(_SC_NPROCESSORS_ONLN))}};
  j["device"] = a.device;
  j["threads"] = num_threads();
  j["commit"] = git_commit();
  if (s.gpu) {
    const runtime::GpuDeviceReport& d = s.device;
    j["gpu"] = {{"name", d.name},
                {"sm", std::to_string(d.sm_major) + std::to_string(d.sm_minor)},
                {"num_sms", d.num_sms},
                {"driver", d.driver_version},
                {"cuda_runtime", d.runtime_version},
                {"memory_gb", static_cast<double>(d.total_bytes) / 1e9},
                {"sm_clock_mhz", d.sm_clock_khz / 1000},
                {"memory_clock_mhz", d.memory_clock_khz / 1000}};
    j["copy_bandwidth_gbps"] = s.copy_bandwidth / 1e9;
    j["random_weights"] = a.random_weights;
    j["quant"] = s.quant;
  }
  j["model"] = {{"dir", a.preset.empty() ? s.model_dir.string() : std::string()},
                {"preset", a.preset},
                {"model_type", s.config.model_type},
                {"layers", s.config.num_hidden_layers},
                {"max_layers", s.max_layers},
                {"max_layers_fit", s.layers_fit},
                {"hidden", s.config.hidden_size},
                {"experts", s.config.num_experts},
                {"top_k", s.config.num_experts_per_tok},
                {"vocab", s.config.vocab_size}};
  j["input_len"] = a.input_len;
  j["output_len"] = a.output_len;
  j["seed"] = a.seed;
  j["max_batch_tokens"] = s.max_batch_tokens;
  j["prefill_chunk"] = s.prefill_chunk;
  j["adapter_slots"] = s.adapter_slots;
  j["max_lora_rank"] = s.max_lora_rank;
  j["kv_cache_pages"] = s.kv_cache_pages;
  j["kv_page_size"] = s.kv_page_size;
  j["attention_kernel"] = s.attention_kernel;
  j["moe_shared_expert_in_experts"] = a.moe_shared_expert_in_experts;
  j["moe_scheduling"] = {{"seam1_after_quant", a.moe_seam1_after_quant},
                         {"seam2_in_finalize", a.moe_seam2_in_finalize},
                         {"stream_schedule", a.moe_stream_schedule}};
  j["moe_shared_experts_in_experts_layers"] = s.moe_shared_experts_in_experts;
  j["adapters"] = nlohmann::json::array();
  for (const auto& spec : s.specs) {
    j["adapters"].push_back({{"name", spec.name},
                             {"dir", spec.dir.empty() ? "random (" + a.synth_layout + ", rank " +
                                                            std::to_string(a.synth_rank) + ")"
                                                      : spec.dir.string()}});
  }
  j["adapter_dist"] = a.dist;
  j["base_share"] = a.base_share;
  j["runs"] = nlohmann::json::array();
  for (const RunResult& r : runs) {
    nlohmann::json run = {
        {"batch_size", r.batch_size},
        {"lora", r.lora},
        {"adapters_in_batch", r.adapters_in_batch},
        {"base_requests", r.base_requests},
        {"prefill_tokens_per_s", r.prefill_tps},
        {"decode_tokens_per_s", r.decode_tps},
        {"overall_tokens_per_s", r.overall_tps},
        {"latency_s", r.latency_s},
        {"ttft_ms", {{"mean", r.ttft.mean}, {"p50", r.ttft.p50}, {"max", r.ttft.max}}},
        {"peak_rss_mb", r.peak_rss_mb},
        {"peak_kv_cache_mb", r.peak_kv_mb},
        {"steps", r.steps},
        {"kv_blocked_steps", r.kv_blocked_steps},
        {"decode_steps", r.decode_steps}};
    const double ms = r.step_ms();
    run["decode_step_ms"] = ms > 0 ? nlohmann::json(ms) : nlohmann::json(nullptr);
    run["decode_us_per_layer"] =
        ms > 0 ? nlohmann::json(1e3 * ms / static_cast<double>(layers)) : nlohmann::json(nullptr);
    run["peak_gpu_memory_mb"] = opt_json(r.peak_gpu_mb);
    run["step_bytes_mb"] =
        r.step_bytes ? nlohmann::json(*r.step_bytes / 1e6) : nlohmann::json(nullptr);
    run["roofline_fraction"] = opt_json(roofline_fraction(r, s.copy_bandwidth));
    run["pct_of_no_lora"] = r.pct_overall ? nlohmann::json{{"overall", opt_json(r.pct_overall)},
                                                           {"decode", opt_json(r.pct_decode)},
                                                           {"prefill", opt_json(r.pct_prefill)}}
                                          : nlohmann::json(nullptr);
    run["base_requests_match"] =
        r.base_match ? nlohmann::json(*r.base_match) : nlohmann::json(nullptr);
    run["adapter_requests_changed"] =
        r.adapter_changed ? nlohmann::json(*r.adapter_changed) : nlohmann::json(nullptr);
    j["runs"].push_back(run);
  }
  j["targets"] = nlohmann::json::array();
  for (const TargetLine& t : targets) {
    j["targets"].push_back({{"id", t.id},
                            {"config", t.config},
                            {"value", t.value},
                            {"target", t.target},
                            {"met", t.value >= t.target}});
  }
  return j;
}

}  // namespace moelora::cli::bench
