// bench/moe_layer: op-level benchmark of one FP8 MoE layer with multi-LoRA on the GPU
// (PERF.md "How to benchmark"). For each preset, batch size and LoRA configuration it checks the
// layer once, then times CUDA-graph replays with CUDA events (warm-up, >= 50 repetitions, median
// and min), rotating inputs and flushing L2 between repetitions so every replay streams its
// experts from HBM. It reports the byte roofline of the experts actually touched, achieved TB/s,
// % of the copy bandwidth measured in the same run, TFLOP/s for prefill, LoRA/no-LoRA time
// ratios against the ideal byte ratio, and writes JSON + Markdown with the `targets` array.
//
// Routed-only rows of the presets the peer was measured on carry the peer's µs (PERF.md: SGLang's
// Triton fused_moe FP8 on an H200, LoRA by its fast-path kernels) and a P1 target entry each;
// --compare-register also times the earlier register-fed decode GEMM on the no-LoRA decode rows
// (before / after in one run); --compare-schedule times every decode row again with the stream
// GEMMs' round-robin work items (--stream-schedule picks the timed rows' schedule). One JSON +
// Markdown file per preset: moe_layer_<preset>.json/.md.
//
// This file holds the measurement loop; moe_layer_config.* the presets, the command line and the
// peer table, moe_layer_report.* the targets and result files, moe_layer_baseline.* the unfused
// baseline.
//
//   bench_moe_layer [--preset NAME|all] [--decode 1,2,4,...] [--prefill 2048,4096] [--reps N]
//                   [--no-routed-only] [--out DIR] [--quick] [--no-baseline] [--compare-register]
//                   [--compare-schedule] [--stream-schedule auto|claimed|round-robin]
#include <cublas_v2.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/cuda_utils.h"
#include "kernel_timeline.h"
#include "moe_layer_baseline.cuh"
#include "moe_layer_config.h"
#include "moe_layer_report.h"
#include "ops/moe/moe_layer_cuda.cuh"
#include "ops/moe_gemv/moe_gemv_cuda.cuh"

using namespace moelora;
using namespace moelora::bench;

int main(int argc, char** argv) {
  Options opt;
  if (const int status = parse_options(argc, argv, opt); status >= 0) return status;
  try {
    if (cuda::device_count() == 0) {
      std::fprintf(stderr, "bench_moe_layer: no CUDA device\n");
      return 1;
    }
    const auto dev = cuda::device_info(0);
    const double copy_bw = measure_copy_bandwidth();
    std::printf("# %s, %d SMs, L2 %.0f MB, driver %d, runtime %d; copy bandwidth %.2f TB/s\n", dev.name.c_str(),
                dev.num_sms, dev.l2_bytes / 1e6, dev.driver_version, dev.runtime_version, copy_bw / 1e12);

    cuda::Stream main_stream, side_stream;
    std::unique_ptr<bench::KernelTimeline> timeline;
    if (!opt.timeline.empty()) timeline = std::make_unique<bench::KernelTimeline>();
    std::map<std::string, std::string> timelines;  // preset -> Markdown sections
    cuda::DeviceBuffer flush(size_t(200) << 20);  // larger than L2
    std::vector<Row> all_rows;
    std::mt19937_64 rng(1234);

    // Results are rewritten after every preset, so a long run that is cut short keeps what it measured.
    for (const auto& pname : opt.presets) {
      auto it = std::find_if(kPresets.begin(), kPresets.end(), [&](const Preset& p) { return p.name == pname; });
      if (it == kPresets.end()) throw std::runtime_error("unknown preset " + pname);
      // NVFP4 experts: rows and result files named <preset>-nvfp4 (the peer measured FP8 only)
      Preset p = *it;
      if (opt.nvfp4) p.name += "-nvfp4";
      // a forced NVFP4 GEMM instance: rows and files named <preset>-nvfp4-<instance>
      if (opt.nvfp4 && opt.nvfp4_instance != ops::cuda::Nvfp4StreamInstance::kAuto)
        p.name += std::string("-") + ops::cuda::nvfp4_stream_instance_name(opt.nvfp4_instance);
      // Expert parallel rank 0 of opt.ep: experts [0, E_local) of the E the router scores.
      if (p.E % opt.ep != 0 || p.Is % opt.ep != 0)
        throw std::runtime_error(p.name + ": --ep " + std::to_string(opt.ep) +
                                 " does not divide its " + std::to_string(p.E) + " experts and " +
                                 std::to_string(p.Is) + " shared-expert channels");
      const int E_local = p.E / opt.ep;
      if (opt.ep > 1) p.name += "-ep" + std::to_string(opt.ep) + "-rank0";
      // the shared expert among the routed experts: rows and files named <preset>-shared-in-experts
      const bool shared_in_experts =
          opt.shared_in_experts && !opt.nvfp4 && opt.ep == 1 && p.Is == p.I;
      if (shared_in_experts) p.name += "-shared-in-experts";
      Preset local = p;  // this rank's shared expert, for the LoRA bytes
      local.Is = p.Is / opt.ep;
      std::vector<std::pair<std::string, int>> modes;
      for (int b : opt.decode) modes.push_back({"decode", b});
      for (int t : opt.prefill) modes.push_back({"prefill", t});
      const int max_tokens =
          std::max(opt.decode.empty() ? 0 : *std::max_element(opt.decode.begin(), opt.decode.end()),
                   opt.prefill.empty() ? 0 : *std::max_element(opt.prefill.begin(), opt.prefill.end()));
      ops::cuda::MoeLayerConfig c;
      c.hidden = p.H;
      c.inter = p.I;
      c.num_experts = E_local;
      c.expert_begin = 0;
      c.top_k = p.k;
      c.route.kind = p.router;
      c.route.num_experts = p.E;
      c.route.top_k = p.k;
      c.route.renormalize = true;
      c.route.n_group = p.n_group;
      c.route.topk_group = p.topk_group;
      c.route.routed_scaling_factor = p.scaling;
      c.shared_inter = local.Is;
      c.shared_gate = p.shared_gate;
      c.max_tokens = max_tokens;
      c.num_slots = 8;
      c.max_rank = adapter_pool_rank(opt);
      c.nvfp4_experts = opt.nvfp4;
      c.shared_in_experts = shared_in_experts;
      ops::cuda::MoeLayerCuda layer(c, ops::cuda::MoeLayerHostWeights{}, main_stream.get(), side_stream.get());
      layer.randomize_weights(42);
      layer.set_gemm_path(opt.gemm_path);
      layer.set_router_gemm_path(opt.router_gemm);
      layer.set_side_stream_scheduling(opt.side);
      layer.set_decode_lora_path(opt.decode_lora);
      layer.set_stream_gemm_schedule(opt.stream_schedule);
      layer.set_nvfp4_instance(opt.nvfp4_instance);
      const int max_decode = opt.decode.empty() ? 0 : *std::max_element(opt.decode.begin(), opt.decode.end());
      std::unique_ptr<Baseline> baseline;
      // the baseline dequantizes FP8 experts (the bf16 shared expert's weights) and times decode
      // rows only
      if (opt.baseline && !opt.nvfp4 && opt.ep == 1 && !c.shared_in_experts && max_decode > 0)
        baseline = std::make_unique<Baseline>(p, max_decode, c.max_rank);
      std::fprintf(
          stderr, "[%s] weights %.2f GB, workspace %.2f GB, adapter pool rank %d\n", p.name.c_str(),
          (layer.expert_bytes() * double(E_local) + layer.router_bytes() + layer.shared_bytes()) /
              1e9,
          layer.workspace_bytes() / 1e9, c.max_rank);

      for (const auto& [mode, T] : modes) {
        // Inputs rotate over kSets sets so consecutive replays route differently.
        const int kSets = mode == "prefill" ? 1 : 4;  // prefill touches every expert anyway
        std::vector<cuda::DeviceBuffer> xs, logits, slotbufs;
        std::vector<std::vector<int32_t>> slot_host(kSets);
        for (int s = 0; s < kSets; ++s) {
          std::vector<uint16_t> x(static_cast<size_t>(T) * p.H);
          std::normal_distribution<float> nd(0.f, 1.f);
          for (auto& v : x) v = f32_to_bf16_bits(nd(rng));
          cuda::DeviceBuffer xb(x.size() * 2);
          xb.upload(x.data(), x.size() * 2);
          xs.push_back(std::move(xb));
          std::vector<float> l(static_cast<size_t>(T) * p.E);
          for (auto& v : l) v = nd(rng);
          cuda::DeviceBuffer lb(l.size() * 4);
          lb.upload(l.data(), l.size() * 4);
          logits.push_back(std::move(lb));
          slotbufs.emplace_back(static_cast<size_t>(T) * 4);
        }
        cuda::DeviceBuffer out(static_cast<size_t>(T) * p.H * 2), x_cur(static_cast<size_t>(T) * p.H * 2),
            l_cur(static_cast<size_t>(T) * p.E * 4), s_cur(static_cast<size_t>(T) * 4);
        std::map<std::string, double> base_us;  // routed_only flag -> no-LoRA median
        for (bool routed_only : {false, true}) {
          if (routed_only && !opt.routed_only_too) continue;
          if (!routed_only && !opt.full_layer) continue;
          for (const auto& lc : kLoraConfigs) {
            if (opt.quick && lc.name != "none" && lc.name != "1x r16") continue;
            if (!opt.lora.empty() && std::find(opt.lora.begin(), opt.lora.end(), lc.name) == opt.lora.end()) continue;
            if (mode == "prefill" && lc.name != "none" && lc.name != "1x r16") continue;
            // the expert GEMV chain runs no-LoRA forwards of up to 8 tokens only
            if (opt.gemm_path == ops::cuda::GemmPath::kGemv &&
                (lc.adapters > 0 || T > ops::cuda::kMoeGemvMaxTokens))
              continue;
            for (int s = 0; s < 8; ++s) layer.clear_adapter(s);
            // One adapter goes to slot 3 (nothing may assume slot 0); several fill slots 0..n-1.
            auto slot_of = [&](int a) { return lc.adapters == 1 ? 3 : a; };
            for (int a = 0; a < lc.adapters; ++a) layer.randomize_adapter(slot_of(a), lc.rank, lc.shared_outer, 100 + a);
            // slots: adapters spread round-robin over tokens
            for (int s = 0; s < kSets; ++s) {
              slot_host[s].assign(T, -1);
              for (int t = 0; t < T; ++t) slot_host[s][t] = lc.adapters ? slot_of(t % lc.adapters) : -1;
              slotbufs[s].upload(slot_host[s].data(), T * 4);
            }
            ops::cuda::MoeForwardArgs f;
            f.x = x_cur.as<__nv_bfloat16>();
            f.slot = s_cur.as<int32_t>();
            f.router_logits = routed_only ? l_cur.as<float>() : nullptr;
            f.tokens = T;
            f.lora = lc.adapters > 0;
            f.single_slot = lc.adapters == 1 ? slot_of(0) : -1;  // the host knows the batch's slot set
            f.shared = !routed_only;
            f.out = out.as<__nv_bfloat16>();
            // The layer's forward captured as one graph (what every timed repetition replays).
            auto capture_forward = [&](cudaGraph_t& g, cudaGraphExec_t& e) {
              MOELORA_CUDA_CHECK(cudaStreamBeginCapture(main_stream.get(), cudaStreamCaptureModeGlobal));
              layer.forward(f);
              MOELORA_CUDA_CHECK(cudaStreamEndCapture(main_stream.get(), &g));
              // node priorities, as the engine's graphs (the shared expert's LoRA stream)
              MOELORA_CUDA_CHECK(
                  cudaGraphInstantiate(&e, g, cudaGraphInstantiateFlagUseNodePriority));
            };
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            capture_forward(graph, exec);

            auto stage_inputs = [&](int set) {
              MOELORA_CUDA_CHECK(cudaMemcpyAsync(x_cur.get(), xs[set].get(), x_cur.bytes(), cudaMemcpyDeviceToDevice, main_stream.get()));
              MOELORA_CUDA_CHECK(cudaMemcpyAsync(l_cur.get(), logits[set].get(), l_cur.bytes(), cudaMemcpyDeviceToDevice, main_stream.get()));
              MOELORA_CUDA_CHECK(cudaMemcpyAsync(s_cur.get(), slotbufs[set].get(), s_cur.bytes(), cudaMemcpyDeviceToDevice, main_stream.get()));
            };
            // Bytes of each input set's routing (one untimed replay per set).
            double bytes_sum = 0, local_pairs_sum = 0;
            int distinct_sum = 0;
            std::vector<std::vector<int32_t>> set_ids(kSets);
            std::vector<std::vector<float>> set_w(kSets);
            for (int set = 0; set < kSets; ++set) {
              stage_inputs(set);
              MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_stream.get()));
              main_stream.synchronize();
              std::vector<int32_t> ids(static_cast<size_t>(T) * p.k);
              MOELORA_CUDA_CHECK(cudaMemcpy(ids.data(), layer.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
              set_w[set].resize(ids.size());
              MOELORA_CUDA_CHECK(cudaMemcpy(set_w[set].data(), layer.topk_weights(), ids.size() * 4, cudaMemcpyDeviceToHost));
              set_ids[set] = ids;
              // The experts this rank holds ([0, E_local)); the other ranks' pairs read nothing
              // here.
              std::vector<int32_t> local_ids(ids.size(), -1);
              std::vector<char> seen(p.E, 0);
              int distinct = 0;
              for (size_t i = 0; i < ids.size(); ++i) {
                const int32_t e = ids[i];
                if (e < 0 || e >= E_local) continue;
                local_ids[i] = e;
                local_pairs_sum += 1;
                if (!seen[e]) seen[e] = 1, ++distinct;
              }
              distinct_sum += distinct;
              double b = distinct * double(layer.expert_bytes()) + (routed_only ? 0.0 : layer.router_bytes() + layer.shared_bytes());
              b += lora_bytes(local, lc, local_ids, slot_host[set], p.k, !routed_only);
              bytes_sum += b;
            }
            // Timed replays back to back with no host synchronization in between (an idle GPU
            // lowers its clocks), after ~20 ms of warm-up replays. Between replays: the next input
            // set and a 200 MB memset that evicts L2, both outside the timed interval.
            const int reps = mode == "prefill" ? std::max(10, opt.reps / 4) : opt.reps;
            std::vector<cuda::Event> e0, e1;
            for (int rep = 0; rep < reps; ++rep) e0.emplace_back(true), e1.emplace_back(true);
            auto time_replays = [&](cudaGraphExec_t graph_exec) {
              {
                cuda::Event w0(true), w1(true);
                w0.record(main_stream.get());
                MOELORA_CUDA_CHECK(cudaGraphLaunch(graph_exec, main_stream.get()));
                w1.record(main_stream.get());
                const float one_ms = std::max(0.005f, cuda::Event::elapsed_ms(w0, w1));
                const int warm = opt.warmup_ms > 0 ? std::min(2000, static_cast<int>(opt.warmup_ms / one_ms) + 3) : 0;
                for (int i = 0; i < warm; ++i) {
                  stage_inputs(i % kSets);
                  MOELORA_CUDA_CHECK(cudaGraphLaunch(graph_exec, main_stream.get()));
                }
              }
              for (int rep = 0; rep < reps; ++rep) {
                stage_inputs(rep % kSets);
                MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), rep & 0xff, flush.bytes(), main_stream.get()));
                e0[rep].record(main_stream.get());
                MOELORA_CUDA_CHECK(cudaGraphLaunch(graph_exec, main_stream.get()));
                e1[rep].record(main_stream.get());
              }
              main_stream.synchronize();
              std::vector<float> times;
              for (int rep = 0; rep < reps; ++rep) times.push_back(cuda::Event::elapsed_ms(e0[rep], e1[rep]));
              return times;
            };
            const std::vector<float> ms = time_replays(exec);
            if (timeline && mode == "decode" && std::count(opt.timeline.begin(), opt.timeline.end(), T)) {
              std::vector<std::vector<bench::KernelRecord>> traced;
              auto span = [](const std::vector<bench::KernelRecord>& r) {
                uint64_t end = 0;
                for (const auto& k : r) end = std::max(end, k.end_ns);
                return r.empty() ? 0 : end - r.front().start_ns;
              };
              for (int i = 0; i < 5; ++i) {
                stage_inputs(i % kSets);
                MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), i & 0xff, flush.bytes(), main_stream.get()));
                timeline->start();
                MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_stream.get()));
                traced.push_back(timeline->stop());
              }
              std::sort(traced.begin(), traced.end(), [&](const auto& a, const auto& b) { return span(a) < span(b); });
              timelines[p.name] += "## decode B=" + std::to_string(T) + ", LoRA " + lc.name + (routed_only ? ", routed experts only" : ", full layer") +
                                   "\n\n" + bench::format_timeline(traced[2]) + "\n";
            }
            // The same forward with one setting changed, captured and timed in this run (median µs);
            // `set` changes the layer, `restore` puts the benchmark's setting back.
            auto time_variant = [&](auto set, auto restore) {
              set();
              cudaGraph_t variant_graph;
              cudaGraphExec_t variant_exec;
              capture_forward(variant_graph, variant_exec);
              const double us = median(time_replays(variant_exec)) * 1e3;
              MOELORA_CUDA_CHECK(cudaGraphExecDestroy(variant_exec));
              MOELORA_CUDA_CHECK(cudaGraphDestroy(variant_graph));
              restore();
              return us;
            };
            // Before / after in one run: the register-fed decode GEMM; round-robin work items.
            double register_us = 0, round_robin_us = 0;
            if (opt.compare_register && mode == "decode" && lc.adapters == 0)
              register_us = time_variant([&] { layer.set_gemm_path(ops::cuda::GemmPath::kDecodeRegister); },
                                         [&] { layer.set_gemm_path(opt.gemm_path); });
            if (opt.compare_schedule && mode == "decode")
              round_robin_us = time_variant(
                  [&] { layer.set_stream_gemm_schedule(ops::cuda::StreamGemmSchedule::kRoundRobin); },
                  [&] { layer.set_stream_gemm_schedule(opt.stream_schedule); });
            double baseline_us = 0, check_cosine = 0;
            if (baseline && mode == "decode" && lc.adapters <= 1) {
              std::vector<float> bms;
              cuda::DeviceBuffer logit_scratch(static_cast<size_t>(T) * p.E * 4);
              for (int rep = 0; rep < std::min(reps, 20); ++rep) {
                const int set = rep % kSets;
                stage_inputs(set);
                MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), rep & 0xff, flush.bytes(), main_stream.get()));
                e0[rep].record(main_stream.get());
                if (!routed_only)  // the router GEMM runs on the GPU; the routing then comes back to the host
                  baseline->gemm(x_cur.get(), layer.device_view().router, logit_scratch.get(), T, p.E, p.H, 0.f,
                                 main_stream.get());
                int32_t probe;
                MOELORA_CUDA_CHECK(cudaMemcpyAsync(&probe, layer.topk_ids(), 4, cudaMemcpyDeviceToHost, main_stream.get()));
                main_stream.synchronize();
                baseline->forward(layer.device_view(), x_cur.as<__nv_bfloat16>(), set_ids[set], set_w[set], slot_host[set], T,
                                  p.k, lc.adapters > 0, lc.rank, !routed_only, out.as<__nv_bfloat16>(), main_stream.get());
                e1[rep].record(main_stream.get());
                main_stream.synchronize();
                bms.push_back(cuda::Event::elapsed_ms(e0[rep], e1[rep]));
              }
              baseline_us = median(bms) * 1e3;
              // Correctness of the timed graph: its output against the unfused baseline's (bf16
              // weights dequantized from the same FP8 codes, unquantized activations) on the same
              // input set. FP8 activation noise keeps the cosine near 0.999; a wrong kernel is far off.
              const int set = (std::min(reps, 20) - 1) % kSets;
              std::vector<uint16_t> want(static_cast<size_t>(T) * p.H), got(want.size());
              out.download(want.data(), want.size() * 2);
              stage_inputs(set);
              MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_stream.get()));
              main_stream.synchronize();
              out.download(got.data(), got.size() * 2);
              double dot = 0, nw = 0, ng = 0;
              for (size_t i = 0; i < want.size(); ++i) {
                const double a = bf16_bits_to_f32(got[i]), b = bf16_bits_to_f32(want[i]);
                dot += a * b, nw += b * b, ng += a * a;
              }
              check_cosine = dot / std::sqrt(nw * ng);
              if (!(check_cosine >= 0.99))
                throw std::runtime_error(p.name + " B=" + std::to_string(T) + " " + lc.name +
                                         ": the layer's output disagrees with the unfused baseline (cosine " +
                                         std::to_string(check_cosine) + ", expected >= 0.99)");
            }
            MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
            MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
            Row r;
            r.baseline_us = baseline_us;
            r.check_cosine = check_cosine;
            r.preset = p.name;
            r.mode = mode;
            r.lora = lc.name;
            r.routed_only = routed_only;
            r.tokens = T;
            r.us_median = median(ms) * 1e3;
            r.us_min = *std::min_element(ms.begin(), ms.end()) * 1e3;
            r.bytes = bytes_sum / kSets;
            r.distinct_experts = distinct_sum / kSets;
            r.ideal_us = r.bytes / copy_bw * 1e6;
            r.tbps = r.bytes / (r.us_median * 1e-6) / 1e12;
            r.pct_copy = 100.0 * r.ideal_us / r.us_median;
            const double flops = 2.0 * (local_pairs_sum / kSets) * (3.0 * p.H * p.I) +
                                 (routed_only ? 0 : 2.0 * T * (3.0 * p.H * local.Is + p.H * p.E));
            r.tflops = flops / (r.us_median * 1e-6) / 1e12;
            const std::string key = std::to_string(routed_only);
            if (lc.adapters == 0) {
              base_us[key] = r.us_median;
              base_us[key + "bytes"] = r.bytes;
            } else if (base_us.count(key)) {
              r.lora_ratio = base_us[key] / r.us_median;  // throughput ratio LoRA / no-LoRA
              r.ideal_ratio = base_us[key + "bytes"] / r.bytes;
              r.ratio_of_ideal = r.lora_ratio / r.ideal_ratio;
            }
            r.peer_us = peer_us_for(p.name, T, lc.name, routed_only);
            r.register_us = register_us;
            r.round_robin_us = round_robin_us;
            r.ep = opt.ep;
            r.allreduce_bytes = opt.ep > 1 ? 2.0 * T * p.H : 0;
            all_rows.push_back(r);
            std::printf("%-16s %-7s %6d %-22s %-6s %9.1f us  %6.2f TB/s  %5.1f%% roofline  %7.1f TF  ratio %.3f (ideal %.3f, %.3f)  peer %.1f us  register %.1f us  round-robin %.1f us  unfused %.1f us\n",
                        p.name.c_str(), mode.c_str(), T, lc.name.c_str(), routed_only ? "routed" : "full", r.us_median,
                        r.tbps, r.pct_copy, r.tflops, r.lora_ratio, r.ideal_ratio, r.ratio_of_ideal, r.peer_us,
                        r.register_us, r.round_robin_us, r.baseline_us);
            std::fflush(stdout);
          }
        }
      }
      write_results(p.name, all_rows, opt.out, dev, copy_bw, timelines);
      std::printf("wrote %s/moe_layer_%s.json and .md\n", opt.out.c_str(), p.name.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe_layer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
