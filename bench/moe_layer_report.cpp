// bench_moe_layer's targets and result files (moe_layer_report.h).
#include "moe_layer_report.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <stdexcept>

#include "bench_util.h"

namespace moelora::bench {

void write_results(const std::string& preset, const std::vector<Row>& all_rows,
                   const std::string& out_dir, const cuda::DeviceInfo& dev, double copy_bw,
                   const std::map<std::string, std::string>& timelines) {
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
        targets.push_back({"L1",
                           r.preset + " B=" + std::to_string(r.tokens) +
                               (r.routed_only ? " routed-only" : " full layer"),
                           r.pct_copy, goal, r.pct_copy >= goal});
    }
    if (r.mode == "decode" && r.lora == "1x r16" && (r.tokens >= 16 || r.tokens <= 4)) {
      const double goal = r.tokens >= 16 ? 0.98 : 0.90;
      targets.push_back({"L2",
                         r.preset + " B=" + std::to_string(r.tokens) + " r16 1 adapter" +
                             (r.routed_only ? " routed-only" : " full layer"),
                         r.ratio_of_ideal, goal, r.ratio_of_ideal >= goal});
    }
    if (r.mode == "decode" && r.lora == "8x r16" && r.tokens == 64)
      targets.push_back({"L3",
                         r.preset + " B=64 8 adapters r16" +
                             std::string(r.routed_only ? " routed-only" : " full layer"),
                         r.ratio_of_ideal, 0.95, r.ratio_of_ideal >= 0.95});
    if (r.mode == "prefill" && r.tokens == 4096 && r.lora == "none") {
      const double goal = r.preset == "kimi-k2.5-ep8" ? 1000 : 550;
      targets.push_back({"L4",
                         r.preset + " 4096 tokens TFLOP/s" +
                             std::string(r.routed_only ? " routed-only" : " full layer"),
                         r.tflops, goal, r.tflops >= goal});
    }
    if (r.peer_us > 0)
      targets.push_back({"P1",
                         r.preset + " " + r.mode + " B=" + std::to_string(r.tokens) + " " + r.lora +
                             " routed-only: peer µs / moelora µs (> 1 = faster than the peer)",
                         r.peer_us / r.us_median, 1.0, r.us_median < r.peer_us});
    if (r.mode == "prefill" && r.tokens == 4096 && r.lora == "1x r16") {
      const double ratio = r.lora_ratio > 0 ? 1.0 / r.lora_ratio : 0;
      targets.push_back({"L4",
                         r.preset + " 4096 tokens LoRA/no-LoRA time" +
                             std::string(r.routed_only ? " routed-only" : " full layer"),
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
  std::string cmd = "mkdir -p '" + out_dir + "'";
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("cannot create " + out_dir);
  const std::string stem = out_dir + "/moe_layer_" + preset;
  std::ofstream js(stem + ".json");
  js << "{\n  \"benchmark\": \"moe_layer\",\n  \"gpu\": \"" << json_escape(dev.name)
     << "\",\n  \"sms\": " << dev.num_sms << ",\n  \"l2_bytes\": " << dev.l2_bytes
     << ",\n  \"memory_clock_khz\": " << dev.memory_clock_khz
     << ",\n  \"driver\": " << dev.driver_version
     << ",\n  \"cuda_runtime\": " << dev.runtime_version << ",\n  \"commit\": \"" << commit
     << "\",\n  \"date\": \"" << date
     << "\",\n  \"ceilings\": {\"copy_bandwidth_bytes_per_s\": " << copy_bw
     << "},\n  \"rows\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    js << "    {\"preset\": \"" << r.preset << "\", \"mode\": \"" << r.mode
       << "\", \"tokens\": " << r.tokens << ", \"lora\": \"" << r.lora
       << "\", \"routed_only\": " << (r.routed_only ? "true" : "false")
       << ", \"us_median\": " << r.us_median << ", \"us_min\": " << r.us_min
       << ", \"bytes\": " << r.bytes << ", \"distinct_experts\": " << r.distinct_experts
       << ", \"ideal_us\": " << r.ideal_us << ", \"tb_per_s\": " << r.tbps
       << ", \"pct_of_copy_roofline\": " << r.pct_copy << ", \"tflops\": " << r.tflops
       << ", \"lora_ratio\": " << r.lora_ratio << ", \"ideal_lora_ratio\": " << r.ideal_ratio
       << ", \"ratio_of_ideal\": " << r.ratio_of_ideal
       << ", \"unfused_baseline_us\": " << r.baseline_us << ", \"peer_us\": " << r.peer_us
       << ", \"register_decode_us\": " << r.register_us
       << ", \"round_robin_us\": " << r.round_robin_us
       << ", \"cosine_vs_unfused\": " << r.check_cosine << ", \"ep\": " << r.ep
       << ", \"allreduce_bytes\": " << r.allreduce_bytes << "}" << (i + 1 < rows.size() ? "," : "")
       << "\n";
  }
  js << "  ],\n  \"targets\": [\n";
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    js << "    {\"id\": \"" << t.id << "\", \"config\": \"" << json_escape(t.config)
       << "\", \"value\": " << t.value << ", \"target\": " << t.target
       << ", \"met\": " << (t.met ? "true" : "false") << "}" << (i + 1 < targets.size() ? "," : "")
       << "\n";
  }
  js << "  ]\n}\n";
  std::ofstream md(stem + ".md");
  md << "# moe_layer " << preset << " on " << dev.name << " (commit " << commit << ", " << date
     << ")\n\n"
     << "Copy bandwidth measured in the same run: " << copy_bw / 1e12 << " TB/s (read + write). "
     << "peer µs: SGLang's Triton fused_moe FP8 on an H200 (PERF.md), routed experts only; "
     << "register µs: the earlier register-fed decode GEMM in the same run; round-robin µs: the "
     << "stream GEMMs with a fixed share of work items per CTA instead of claimed ones, same "
        "run.\n\n";
  if (!rows.empty() && rows.front().ep > 1)
    md << "Expert parallel: rank 0 of " << rows.front().ep << " ranks (--ep), the router scoring "
       << "every expert and the layer running the pairs of its experts (and its "
       << "tensor-parallel share of the shared expert); experts, bytes and TFLOP/s count that "
       << "rank's work. Each forward's partial output ([T, H] bf16, "
       << rows.front().allreduce_bytes / rows.front().tokens
       << " bytes per token; allreduce_bytes in the JSON) is summed over the ranks by an "
          "all-reduce "
          "that one GPU cannot time.\n\n";
  md << "| preset | mode | tokens | LoRA | layer | µs (median) | µs (min) | experts | TB/s | % "
        "roofline | TFLOP/s | LoRA/no-LoRA | ideal | of ideal | peer µs | vs peer | register µs | "
        "round-robin µs | unfused µs | speedup |\n"
     << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    char line[768];
    std::string unfused = r.baseline_us > 0 ? std::to_string(static_cast<int>(r.baseline_us)) : "";
    std::string speedup =
        r.baseline_us > 0 ? std::to_string(r.baseline_us / r.us_median).substr(0, 5) + "x" : "";
    char peer[32] = "", vs_peer[32] = "", reg[32] = "", rr[32] = "";
    if (r.peer_us > 0) {
      std::snprintf(peer, sizeof peer, "%.1f", r.peer_us);
      std::snprintf(vs_peer, sizeof vs_peer, "%.2fx", r.peer_us / r.us_median);
    }
    if (r.register_us > 0) std::snprintf(reg, sizeof reg, "%.1f", r.register_us);
    if (r.round_robin_us > 0) std::snprintf(rr, sizeof rr, "%.1f", r.round_robin_us);
    std::snprintf(line, sizeof line,
                  "| %s | %s | %d | %s | %s | %.1f | %.1f | %d | %.2f | %.1f | %.1f | %s | %s | %s "
                  "| %s | %s | %s | %s | %s | %s |\n",
                  r.preset.c_str(), r.mode.c_str(), r.tokens, r.lora.c_str(),
                  r.routed_only ? "routed only" : "full", r.us_median, r.us_min, r.distinct_experts,
                  r.tbps, r.pct_copy, r.tflops,
                  r.lora_ratio > 0 ? std::to_string(r.lora_ratio).substr(0, 5).c_str() : "",
                  r.ideal_ratio > 0 ? std::to_string(r.ideal_ratio).substr(0, 5).c_str() : "",
                  r.ratio_of_ideal > 0 ? std::to_string(r.ratio_of_ideal).substr(0, 5).c_str() : "",
                  peer, vs_peer, reg, rr, unfused.c_str(), speedup.c_str());
    md << line;
  }
  md << "\n## Targets\n\n| id | config | value | target | met |\n|---|---|---|---|---|\n";
  for (const auto& t : targets)
    md << "| " << t.id << " | " << t.config << " | " << t.value << " | " << t.target << " | "
       << (t.met ? "yes" : "no") << " |\n";
  if (timelines.count(preset)) {
    std::ofstream tl(out_dir + "/timeline_" + preset + ".md");
    tl << "# Kernel timelines, " << preset << " (" << dev.name << ", commit " << commit << ", "
       << date
       << ")\n\nOne graph replay each (the median span of 5, L2 flushed before each, CUPTI "
          "timestamps): start / end in "
          "µs from the first kernel's start; queue = the stream the kernel ran on, named by first "
          "appearance (a graph replay picks its own streams for its branches); idle = time the "
          "queue sat between its previous kernel's end and this start.\n\n"
       << timelines.at(preset);
  }
}

}  // namespace moelora::bench
