// bench_moe_layer's results: one row per timed configuration, the PERF.md targets they are held
// to (L1-L4, and P1 against the peer), and the JSON / Markdown files they are written to.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/cuda_utils.h"

namespace moelora::bench {

struct Row {
  std::string preset, mode, lora;
  bool routed_only;
  int tokens;
  double us_median, us_min;
  double bytes, ideal_us, tbps, pct_copy, tflops;
  double lora_ratio = 0, ideal_ratio = 0, ratio_of_ideal = 0;  // for LoRA rows
  int distinct_experts;
  double baseline_us = 0;     // unfused baseline (0 = not run)
  double peer_us = 0;         // the peer's µs for this configuration (0 = not measured)
  double register_us = 0;     // the register-fed decode GEMM's µs (0 = not run)
  double round_robin_us = 0;  // the stream GEMMs with round-robin work items (0 = not run)
  double check_cosine = 0;  // cosine of the output against the unfused baseline's (0 = not checked)
  // Expert parallel rows (--ep N): the ranks, and the bytes each rank's partial output [T, H]
  // bf16 adds to the all-reduce that sums the layer (not timed: one GPU has no peer).
  int ep = 1;
  double allreduce_bytes = 0;
};

// Writes moe_layer_<preset>.json and .md (and timeline_<preset>.md when `timelines` has the
// preset) into out_dir from the rows of that preset.
void write_results(const std::string& preset, const std::vector<Row>& all_rows,
                   const std::string& out_dir, const cuda::DeviceInfo& dev, double copy_bw,
                   const std::map<std::string, std::string>& timelines);

}  // namespace moelora::bench
