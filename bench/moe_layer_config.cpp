// bench_moe_layer's presets, command line and peer table (moe_layer_config.h).
#include "moe_layer_config.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "bench_util.h"

namespace moelora::bench {

const std::vector<Preset> kPresets = {
    {"qwen3.5-35b-a3b", 256, 8, 2048, 512, 512, true, RouterKind::kSoftmaxTopK, 1, 1, 1.0f},
    {"kimi-k2.5", 384, 8, 7168, 2048, 2048, false, RouterKind::kSigmoidNoauxTc, 1, 1, 2.827f},
    {"kimi-k2.5-ep8", 48, 8, 7168, 2048, 2048, false, RouterKind::kSigmoidNoauxTc, 1, 1, 2.827f},
    {"qwen3-30b-a3b", 128, 8, 2048, 768, 0, false, RouterKind::kSoftmaxTopK, 1, 1, 1.0f},
};

const std::vector<LoraConfig> kLoraConfigs = {
    {"none", 0, 0, false},
    {"1x r16", 1, 16, false},
    {"1x r64", 1, 64, false},
    {"8x r16", 8, 16, false},
    {"1x r16 shared-outer", 1, 16, true},
};

namespace {

// The peer on the same H200 (PERF.md, "The peer"): SGLang's Triton fused_moe FP8 (w8a8, 128x128
// blocks, tuned H200 configs), routed experts only (no router GEMM, no shared expert); LoRA =
// one r16 per-expert adapter through its fast-path kernels, given as the LoRA / no-LoRA time ratio.
struct PeerPoint {
  int tokens;
  double no_lora_us, lora_time_ratio;
};
const std::map<std::string, std::vector<PeerPoint>> kPeer = {
    {"qwen3.5-35b-a3b",
     {{1, 29.8, 1.35},
      {4, 47.1, 1.27},
      {16, 100.0, 1.22},
      {32, 144.0, 1.19},
      {64, 196.5, 1.16},
      {128, 225.2, 1.16},
      {4096, 766.0, 1.38}}},
    {"kimi-k2.5-ep8",
     {{1, 113, 1.11},
      {4, 303, 1.05},
      {16, 518, 1.04},
      {32, 545, 1.05},
      {64, 559, 1.07},
      {128, 576, 1.09},
      {4096, 4668, 1.18}}},
};

// Sets `out` to the value named `v` among `choices`; false, with a message naming the flag and
// the choices, when none has that name.
template <typename T>
bool pick_choice(const std::string& flag, const std::string& v,
                 std::initializer_list<std::pair<const char*, T>> choices, T& out) {
  std::string names;
  for (const auto& [name, value] : choices) {
    if (v == name) {
      out = value;
      return true;
    }
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  std::fprintf(stderr, "bench_moe_layer: %s must be one of %s, got '%s'\n", flag.c_str(),
               names.c_str(), v.c_str());
  return false;
}

}  // namespace

double peer_us_for(const std::string& preset, int tokens, const std::string& lora,
                   bool routed_only) {
  if (!routed_only || (lora != "none" && lora != "1x r16")) return 0;
  auto it = kPeer.find(preset);
  if (it == kPeer.end()) return 0;
  for (const auto& pt : it->second)
    if (pt.tokens == tokens)
      return lora == "none" ? pt.no_lora_us : pt.no_lora_us * pt.lora_time_ratio;
  return 0;
}

double lora_bytes(const Preset& p, const LoraConfig& lc, const std::vector<int32_t>& ids,
                  const std::vector<int32_t>& slots, int k, bool shared) {
  if (lc.adapters == 0) return 0;
  std::map<std::pair<int, int>, int> pairs;
  std::map<int, int> slots_used;
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    slots_used[slots[t]] = 1;
    for (int j = 0; j < k; ++j)
      if (ids[t * k + j] >= 0) pairs[{slots[t], ids[t * k + j]}] = 1;  // -1: not this rank's
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

int adapter_pool_rank(const Options& opt) {
  int rank = 16;
  for (const LoraConfig& lc : kLoraConfigs) {
    const bool timed = (opt.lora.empty() ||
                        std::find(opt.lora.begin(), opt.lora.end(), lc.name) != opt.lora.end()) &&
                       (!opt.quick || lc.name == "none" || lc.name == "1x r16");
    if (timed && lc.adapters > 0) rank = std::max(rank, lc.rank);
  }
  return rank;
}

namespace {

// parse_options without its guard: std::stoi / std::stod throw on a value that is not a number;
// `option` names the option being read.
int parse_options_or_throw(int argc, char** argv, Options& opt, std::string& option) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    option = a;
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
        if (std::none_of(kLoraConfigs.begin(), kLoraConfigs.end(),
                         [&](const LoraConfig& c) { return c.name == item; })) {
          std::fprintf(stderr, "bench_moe_layer: unknown LoRA configuration '%s' (see --help)\n",
                       item.c_str());
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
      if (!pick_choice(a, next(),
                       {{"auto", ops::cuda::StreamGemmSchedule::kAuto},
                        {"claimed", ops::cuda::StreamGemmSchedule::kClaimed},
                        {"round-robin", ops::cuda::StreamGemmSchedule::kRoundRobin}},
                       opt.stream_schedule))
        return 2;
    } else if (a == "--gemm-path") {
      if (!pick_choice(a, next(),
                       {{"auto", ops::cuda::GemmPath::kAuto},
                        {"stream", ops::cuda::GemmPath::kDecode},
                        {"register", ops::cuda::GemmPath::kDecodeRegister},
                        {"prefill", ops::cuda::GemmPath::kPrefill},
                        {"gemv", ops::cuda::GemmPath::kGemv}},
                       opt.gemm_path))
        return 2;
    } else if (a == "--router-gemm") {
      if (!pick_choice(a, next(),
                       {{"route", ops::cuda::RouterGemmPath::kAuto}, {"cublas", ops::cuda::RouterGemmPath::kCublas}},
                       opt.router_gemm))
        return 2;
    } else if (a == "--experts") {
      const std::string v = next();
      if (v != "fp8" && v != "nvfp4") {
        std::fprintf(stderr, "bench_moe_layer: --experts takes fp8 or nvfp4, got %s\n", v.c_str());
        return 2;
      }
      opt.nvfp4 = v == "nvfp4";
    } else if (a == "--nvfp4-instance") {
      if (!pick_choice(a, next(),
                       {{"auto", ops::cuda::Nvfp4StreamInstance::kAuto},
                        {"narrow", ops::cuda::Nvfp4StreamInstance::kNarrow},
                        {"wide", ops::cuda::Nvfp4StreamInstance::kWide},
                        {"prefill", ops::cuda::Nvfp4StreamInstance::kPrefill}},
                       opt.nvfp4_instance))
        return 2;
    } else if (a == "--timeline") {
      opt.timeline = parse_list(next());
    } else if (a == "--decode-lora") {
      if (!pick_choice(a, next(),
                       {{"side", ops::cuda::DecodeLoraPath::kSideStream},
                        {"fused", ops::cuda::DecodeLoraPath::kFused},
                        {"epilogue", ops::cuda::DecodeLoraPath::kEpilogue}},
                       opt.decode_lora))
        return 2;
    } else if (a == "--shared-in-experts") {
      opt.shared_in_experts = true;
    } else if (a == "--seam1-after-quant") {
      opt.side.seam1_after_quant = 1;
    } else if (a == "--no-seam1-after-quant") {
      opt.side.seam1_after_quant = 0;
    } else if (a == "--pdl-after-side-join") {
      opt.side.pdl_after_side_join = true;
    } else if (a == "--no-pdl-after-side-join") {
      opt.side.pdl_after_side_join = false;
    } else if (a == "--seam2-in-finalize") {
      const std::string v = next();
      opt.side.seam2_expand_in_finalize_max_tokens = std::stoi(v);
      if (opt.side.seam2_expand_in_finalize_max_tokens < -1) {
        std::fprintf(stderr, "bench_moe_layer: --seam2-in-finalize must be >= -1, got '%s'\n",
                     v.c_str());
        return 2;
      }
    } else if (a == "--seam2-shrink-in-activation") {
      opt.side.seam2_shrink_in_activation = 1;
    } else if (a == "--no-seam2-shrink-in-activation") {
      opt.side.seam2_shrink_in_activation = 0;
    } else if (a == "--shared-lora-stream") {
      opt.side.shared_lora_stream = 1;
    } else if (a == "--no-shared-lora-stream") {
      opt.side.shared_lora_stream = 0;
    } else if (a == "--activation-pdl-with-shared-pairs") {
      opt.side.activation_pdl_with_shared_pairs = 1;
    } else if (a == "--no-activation-pdl-with-shared-pairs") {
      opt.side.activation_pdl_with_shared_pairs = 0;
    } else if (a == "--lora-side-ctas") {
      const std::string v = next();
      opt.side.lora_max_ctas = v == "sms" ? -1 : v == "rule" ? -2 : std::stoi(v);
      if (opt.side.lora_max_ctas < -2) {
        std::fprintf(stderr,
                     "bench_moe_layer: --lora-side-ctas must be rule, sms, 0 or a CTA count, got "
                     "'%s'\n",
                     v.c_str());
        return 2;
      }
    } else if (a == "--ep") {
      opt.ep = std::atoi(next().c_str());
      if (opt.ep < 1) {
        std::fprintf(stderr, "bench_moe_layer: --ep needs a positive rank count\n");
        return 2;
      }
    } else if (a == "--warmup-ms") {
      opt.warmup_ms = std::stof(next());
    } else if (a == "--help" || a == "-h") {
      std::printf(
          "bench_moe_layer: time one FP8 MoE layer with multi-LoRA on the GPU.\n"
          "  --preset LIST|all   comma-separated from qwen3.5-35b-a3b, kimi-k2.5, kimi-k2.5-ep8, "
          "qwen3-30b-a3b\n"
          "                      (default: the first three)\n"
          "  --decode LIST       decode batch sizes (default 1,2,4,8,16,32,64,128)\n"
          "  --prefill LIST      prefill token counts (default 2048,4096,8192,16384; none = no "
          "prefill rows)\n"
          "  --reps N            timed repetitions per configuration (default 60)\n"
          "  --no-routed-only    skip the routed-experts-only rows (router logits given, no shared "
          "expert)\n"
          "  --routed-only       run the routed-experts-only rows alone (what the peer measured)\n"
          "  --lora LIST         LoRA configurations, comma-separated from: none, 1x r16, 1x r64, "
          "8x r16,\n"
          "                      1x r16 shared-outer; _ for a space (1x_r16). Default: all; "
          "prefill runs none and 1x r16\n"
          "  --quick             fewer configurations (smoke run)\n"
          "  --no-baseline       skip the unfused baseline (dequantize + cuBLAS per expert + "
          "separate LoRA GEMMs)\n"
          "  --compare-register  also time the earlier register-fed decode GEMM on the no-LoRA "
          "decode rows\n"
          "  --compare-schedule  also time every decode row with the stream GEMMs' round-robin "
          "work items\n"
          "  --stream-schedule S work items of the stream GEMMs: auto (default; claimed from an "
          "atomic\n"
          "                      counter, round-robin with LoRA for NVFP4 experts and layers of "
          "more than\n"
          "                      128 experts), claimed or round-robin\n"
          "  --gemm-path P       expert GEMMs: auto (default), stream, register (decode kernels), "
          "prefill,\n"
          "                      or gemv (the expert GEMV chain: no-LoRA rows of up to 8 tokens; "
          "other\n"
          "                      rows are refused)\n"
          "  --router-gemm R     router logits of full-layer rows: route (default; inside the "
          "route "
          "launch\n"
          "                      up to 64 tokens) or cublas (a GEMM before it)\n"
          "  --experts F         routed experts: fp8 (default; 128 x 128 block scales) or nvfp4 "
          "(e2m1 "
          "codes,\n"
          "                      e4m3 scale per 16, the NVFP4 stream GEMM; rows and files named "
          "<preset>-nvfp4,\n"
          "                      no unfused baseline)\n"
          "  --nvfp4-instance I  NVFP4 stream GEMM instance: auto (default; from the expected "
          "tokens of\n"
          "                      the busiest expert), narrow, wide or prefill (rows named "
          "<preset>-nvfp4-I)\n"
          "  --timeline LIST     decode batch sizes whose kernel timeline (CUPTI: kernel, stream, "
          "start,\n"
          "                      end of the median of 5 replays) goes to timeline_<preset>.md\n"
          "  --decode-lora P     routed-expert LoRA at decode: side (default; shrink + expand "
          "kernels on the\n"
          "                      side stream) or fused (shrinks and the seam-1 expand inside the "
          "quant and\n"
          "                      activation kernels) or epilogue (the shrinks in the quant and "
          "activation\n"
          "                      kernels, the expands in the expert GEMMs' epilogues: no LoRA "
          "kernel)\n"
          "  --shared-in-experts the shared expert (FP8, where its size is the routed experts' and "
          "the layer\n"
          "                      holds every expert) as one more expert of the routed GEMMs "
          "instead of a\n"
          "                      separate bf16 MLP (full-layer rows; no unfused baseline)\n"
          "  --seam1-after-quant / --no-seam1-after-quant  the side stream's seam-1 LoRA "
          "kernels start after\n"
          "                      the quant kernel, so GEMM1 reaches the SMs first / after the "
          "align (default:\n"
          "                      the layer's rule: after the quant where H <= 4096, without a "
          "shared expert\n"
          "                      or with one among the routed experts whose LoRA has its own "
          "stream)\n"
          "  --no-pdl-after-side-join  the activation and finalize launched plainly after the "
          "side stream's\n"
          "                      LoRA events (default: programmatic launches after them; "
          "--pdl-after-side-join)\n"
          "  --seam2-in-finalize N  decode batches of at most N tokens form the seam-2 LoRA "
          "expand in the\n"
          "                      finalize kernel (only the shrink stays on the side stream; "
          "side-stream LoRA,\n"
          "                      programmatic finalize, no shared expert, top_k <= 8, R <= 32); "
          "0 = never,\n"
          "                      -1 = the layer's default (64 tokens, at most 32 x 7168 tokens x "
          "hidden)\n"
          "  --[no-]seam2-shrink-in-activation  where the seam-2 expand is in the finalize, the "
          "seam-2 shrinks\n"
          "                      (routed and shared expert) run in the activation kernel (or on "
          "the side stream);\n"
          "                      default: the layer's rule (off)\n"
          "  --[no-]shared-lora-stream  a shared expert among the routed experts runs its LoRA "
          "kernels on a\n"
          "                      second side stream (or after the routed experts' on the side "
          "stream);\n"
          "                      default: the layer's rule (on); no effect on one-adapter rows, "
          "which take\n"
          "                      the single-adapter forward (its LoRA stays on the side stream)\n"
          "  --[no-]activation-pdl-with-shared-pairs  with a shared expert among the routed "
          "experts, the\n"
          "                      activation is a programmatic launch after its LoRA events (or a "
          "plain one);\n"
          "                      default: the layer's rule\n"
          "  --lora-side-ctas N  grid cap of the decode LoRA kernels on the side stream: 0 "
          "(default, one CTA\n"
          "                      per work unit), sms (one CTA per SM), rule (one CTA per SM up "
          "to 16 tokens where\n"
          "                      hidden <= 4096, else uncapped) or a CTA count\n"
          "  --ep N              expert parallelism: time rank 0 of N ranks (experts [0, E / N) "
          "of the E the router\n"
          "                      scores, 1 / N of the shared expert); rows named "
          "<preset>-ep<N>-rank0, "
          "no unfused baseline\n"
          "  --warmup-ms MS      warm-up replays before each timing (default 20; 0 under a "
          "profiler)\n"
          "  --out DIR           results directory (default bench/results/h200); one\n"
          "                      moe_layer_<preset>.json / .md per preset\n"
          "Routed-only rows of qwen3.5-35b-a3b and kimi-k2.5-ep8 show the peer's µs (PERF.md) and "
          "a P1 target.\n");
      return 0;
    } else {
      std::fprintf(stderr, "bench_moe_layer: unknown option %s (see --help)\n", a.c_str());
      return 2;
    }
  }
  return -1;
}

}  // namespace

int parse_options(int argc, char** argv, Options& opt) {
  std::string option;
  try {
    return parse_options_or_throw(argc, argv, opt, option);
  } catch (const std::logic_error& e) {  // std::invalid_argument, std::out_of_range
    std::fprintf(stderr, "bench_moe_layer: %s needs a number in range (%s); see --help\n",
                 option.c_str(), e.what());
    return 2;
  }
}

}  // namespace moelora::bench
