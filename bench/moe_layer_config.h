// bench_moe_layer's configuration: the layer presets, the LoRA configurations, the command line
// and the peer's measured µs (PERF.md) that rows are compared with.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ops/moe/moe_layer_cuda.cuh"

namespace moelora::bench {

struct Preset {
  std::string name;
  int E, k, H, I, Is;
  bool shared_gate;
  RouterKind router;
  int n_group, topk_group;
  float scaling;
};

// Every layer shape the benchmark knows (--preset).
extern const std::vector<Preset> kPresets;

struct LoraConfig {
  std::string name;
  int adapters;  // 0 = no LoRA
  int rank;
  bool shared_outer;
};

// none, 1x r16, 1x r64, 8x r16, 1x r16 shared-outer (--lora).
extern const std::vector<LoraConfig> kLoraConfigs;

struct Options {
  std::vector<std::string> presets = {"qwen3.5-35b-a3b", "kimi-k2.5", "kimi-k2.5-ep8"};
  std::vector<int> decode = {1, 2, 4, 8, 16, 32, 64, 128};
  std::vector<int> prefill = {2048, 4096, 8192, 16384};
  int reps = 60;
  bool routed_only_too = true;
  bool full_layer = true;         // false: routed-only rows alone (--routed-only)
  std::vector<std::string> lora;  // LoRA configurations to run (empty = all)
  std::string out = "bench/results/h200";
  bool quick = false;
  bool baseline = true;
  bool compare_register = false;
  bool compare_schedule = false;
  ops::cuda::StreamGemmSchedule stream_schedule = ops::cuda::StreamGemmSchedule::kAuto;
  ops::cuda::GemmPath gemm_path = ops::cuda::GemmPath::kAuto;
  ops::cuda::RouterGemmPath router_gemm = ops::cuda::RouterGemmPath::kAuto;
  bool nvfp4 = false;  // NVFP4 routed experts (--experts nvfp4); FP8 otherwise
  // --nvfp4-instance: the NVFP4 stream GEMMs' instance (MoeLayerCuda::set_nvfp4_instance)
  ops::cuda::Nvfp4StreamInstance nvfp4_instance = ops::cuda::Nvfp4StreamInstance::kAuto;
  // --shared-in-experts: the shared expert (FP8, where Is = I and the layer holds every expert) as
  // one more expert of the routed GEMMs (MoeLayerConfig::shared_in_experts); no unfused baseline
  bool shared_in_experts = false;
  std::vector<int> timeline;  // decode batch sizes whose kernel timeline is recorded (--timeline)
  ops::cuda::SideStreamScheduling side;  // the layer's default unless --lora-side-ctas
  ops::cuda::DecodeLoraPath decode_lora = ops::cuda::DecodeLoraPath::kSideStream;
  float warmup_ms = 20.f;  // warm-up replays before timing (0 under a profiler)
  // Expert parallelism (--ep N): time rank 0 of N, holding experts [0, E / N) of the E the router
  // scores and 1 / N of the shared expert's channels (rows and files named <preset>-ep<N>-rank0).
  int ep = 1;
};

// Parses the command line into `opt`. Returns -1 to go on, else the exit status (0 after --help,
// 2 after a bad option, with a message on stderr).
int parse_options(int argc, char** argv, Options& opt);

// The adapter pool's rank R for the layers of a run: the largest rank among the LoRA
// configurations it times (at least 16). A pool sized for r64 while r16 adapters run would time
// other kernels than a server with --max-lora-rank 16 runs: the seam-2 expand folds into the
// finalize only for pools of rank <= 32 (ops::cuda::kFinalizeFoldMaxRank).
int adapter_pool_rank(const Options& opt);

// The peer's µs for a routed-only row (0 when the peer was not measured there).
double peer_us_for(const std::string& preset, int tokens, const std::string& lora,
                   bool routed_only);

// Per-forward LoRA bytes for the (slot, expert) pairs the batch touches.
double lora_bytes(const Preset& p, const LoraConfig& lc, const std::vector<int32_t>& ids,
                  const std::vector<int32_t>& slots, int k, bool shared);

}  // namespace moelora::bench
