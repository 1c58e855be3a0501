// `moelora bench` run as a user would (table, --json fields, errors, the adapter pool sized from
// the run or from --adapter-slots / --max-lora-rank and printed in the header).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/hf_config.h"
#include "io/peft.h"
#include "runtime/gpu_executor.h"
#include "support/test_support.h"

namespace moelora::runtime {
namespace {

namespace fs = std::filesystem;

using test::contains;
using test::fixture;

// Shell-quoted path (appended piecewise: GCC 12's -Wrestrict misfires on "'" + string + "'").
std::string quote(const fs::path& p) {
  std::string q = "'";
  q += p.string();
  q += '\'';
  return q;
}

TEST(BenchCli, TableAndJson) {
  test::TempDir tmp;
  const fs::path json = tmp / "bench.json";
  const fs::path q = fixture("qwen3_moe");
  const auto r =
      test::run_moelora("bench --device cpu --model " + quote(q / "base") + " --adapters a=" +
                        quote(q / "lora_peft3d") + ",b=" + quote(q / "lora_shared_outer") +
                        " --adapter-dist skewed --base-share 0.34 --batch-sizes 2,3 --input-len 5 "
                        "--output-len 4 --seed 3 --json " +
                        quote(json));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "| B | adapters | prefill tok/s | decode tok/s | overall tok/s |"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "base-only requests match the no-LoRA run")) << r.output;
  // The adapter pool is sized from the run: one slot per adapter, the largest rank rounded up to
  // a multiple of 8.
  const io::ModelConfig config = io::load_model_config(q / "base");
  const int64_t rank = std::max(io::load_adapter(q / "lora_peft3d", config, "a").max_rank,
                                io::load_adapter(q / "lora_shared_outer", config, "b").max_rank);
  const int64_t pool_rank = (rank + 7) / 8 * 8;
  EXPECT_TRUE(contains(r.output, "threads; adapter slots 2 (max 2 per batch), max LoRA rank " +
                                     std::to_string(pool_rank) + "; attention reference\n"))
      << r.output;

  const nlohmann::json j = nlohmann::json::parse(test::read_text_file(json));
  EXPECT_EQ(j["adapter_slots"], 2);
  EXPECT_EQ(j["max_lora_rank"], pool_rank);
  EXPECT_EQ(j["attention_kernel"], "reference");  // the CPU backend
  EXPECT_EQ(j["moe_scheduling"], (nlohmann::json{{"seam1_after_quant", -1},
                                                 {"seam2_in_finalize", -1},
                                                 {"stream_schedule", "auto"}}));
  EXPECT_EQ(j["moe_shared_expert_in_experts"], true);  // the engine's default
  EXPECT_EQ(j["moe_shared_experts_in_experts_layers"], 0);
  EXPECT_EQ(j["kv_cache_pages"], 0);              // the CPU backend has no page pool
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["input_len"], 5);
  EXPECT_EQ(j["output_len"], 4);
  EXPECT_EQ(j["adapter_dist"], "skewed");
  EXPECT_EQ(j["model"]["model_type"], "qwen3_moe");
  EXPECT_EQ(j["model"]["max_layers"], 0);
  EXPECT_EQ(j["model"]["max_layers_fit"], false);
  EXPECT_TRUE(j["targets"].is_array());
  ASSERT_EQ(j["runs"].size(), 4u);  // per B: no-LoRA, LoRA
  for (size_t i = 0; i < 4; ++i) {
    const nlohmann::json& run = j["runs"][i];
    const bool lora = i % 2 == 1;
    const int64_t b = i < 2 ? 2 : 3;
    EXPECT_EQ(run["batch_size"], b);
    EXPECT_EQ(run["lora"], lora);
    for (const char* field : {"prefill_tokens_per_s", "decode_tokens_per_s", "overall_tokens_per_s",
                              "latency_s", "peak_rss_mb", "peak_kv_cache_mb"}) {
      ASSERT_TRUE(run[field].is_number()) << field;
      EXPECT_GT(run[field].get<double>(), 0.0) << field << " of run " << i;
    }
    EXPECT_GT(run["ttft_ms"]["max"].get<double>(), 0.0);
    EXPECT_LE(run["ttft_ms"]["p50"].get<double>(), run["ttft_ms"]["max"].get<double>());
    const double overall = run["overall_tokens_per_s"];
    EXPECT_NEAR(overall, static_cast<double>(b * (5 + 4)) / run["latency_s"].get<double>(),
                1e-6 * overall);
    if (lora) {
      EXPECT_GT(run["pct_of_no_lora"]["overall"].get<double>(), 0.0);
      EXPECT_EQ(run["base_requests_match"], true);
      EXPECT_EQ(run["base_requests"], 1);  // 0.34 of 2 or 3 requests
    } else {
      EXPECT_TRUE(run["pct_of_no_lora"].is_null());
      EXPECT_EQ(run["adapters_in_batch"], 0);
    }
  }

  // scripts/engine-report renders the file: one row per run, the LoRA runs' share of no-LoRA as
  // percentages taken from the JSON, and CPU runs without GPU fields shown as "-".
  const fs::path report =
      test::data_dir().parent_path().parent_path() / "scripts" / "engine-report";
  const auto rendered = test::run_command("python3 " + quote(report) + " " + quote(json));
  ASSERT_EQ(rendered.exit_code, 0) << rendered.output;
  EXPECT_TRUE(contains(rendered.output, "| model | B | adapters | in / out |")) << rendered.output;
  const double pct = j["runs"][1]["pct_of_no_lora"]["overall"].get<double>();
  char share[32];
  std::snprintf(share, sizeof share, "| %.1f %% (", pct);
  EXPECT_TRUE(contains(rendered.output, "| qwen3_moe (3 layers, reference attention) |"))
      << rendered.output;
  EXPECT_TRUE(contains(rendered.output, share)) << share << "\n" << rendered.output;
  size_t rows = 0;
  for (size_t pos = 0; (pos = rendered.output.find("\n| qwen3_moe (", pos)) != std::string::npos;
       ++pos)
    ++rows;
  EXPECT_EQ(rows, 4u) << rendered.output;
  // --svg: one bar per run, each LoRA bar labelled with its decode share of the no-LoRA run.
  const fs::path chart = tmp / "runs.svg";
  const auto drawn =
      test::run_command("python3 " + quote(report) + " --svg " + quote(chart) + " " + quote(json));
  ASSERT_EQ(drawn.exit_code, 0) << drawn.output;
  const std::string svg = test::read_text_file(chart);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u) << svg.substr(0, 200);
  size_t bars = 0;
  for (size_t pos = 0; (pos = svg.find("class=\"run\"", pos)) != std::string::npos; ++pos) ++bars;
  EXPECT_EQ(bars, 4u);
  char decode_share[32];
  std::snprintf(decode_share, sizeof decode_share, ">%.0f%%<",
                j["runs"][1]["pct_of_no_lora"]["decode"].get<double>());
  EXPECT_TRUE(contains(svg, decode_share)) << decode_share;
  EXPECT_TRUE(contains(svg, "qwen3_moe, 3 layers"));
  const auto broken =
      test::run_command("python3 " + quote(report) + " " + quote(tmp / "missing.json"));
  EXPECT_NE(broken.exit_code, 0);
  EXPECT_TRUE(contains(broken.output, "missing.json")) << broken.output;
}

TEST(BenchCli, DistinctAdaptersAndSynthesizedPreset) {
  test::TempDir tmp;
  const fs::path json = tmp / "bench.json";
  const auto r = test::run_moelora(
      "bench --device cpu --preset tiny-qwen3-moe --synth-adapters 1 --synth-rank 4 "
      "--adapter-dist distinct --moe-shared-expert-separate "
      "--batch-sizes 3 "
      "--input-len 4 --output-len 3 --max-batch-tokens 5 --json " +
      quote(json));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(test::read_text_file(json));
  ASSERT_EQ(j["runs"].size(), 2u);
  EXPECT_EQ(j["runs"][1]["adapters_in_batch"], 3);  // one slot per request
  EXPECT_EQ(j["max_batch_tokens"], 5);              // prompts chunked over several steps
  EXPECT_GT(j["runs"][0]["steps"].get<int64_t>(), 3);
  EXPECT_EQ(j["model"]["preset"], "tiny-qwen3-moe");
  EXPECT_EQ(j["adapter_slots"], 3);  // one registered name per request of the largest batch
  EXPECT_EQ(j["max_lora_rank"], 8);  // --synth-rank 4, rounded up to a multiple of 8
  EXPECT_EQ(j["moe_shared_expert_in_experts"], false);  // --moe-shared-expert-separate
  EXPECT_TRUE(contains(r.output, "adapter slots 3 (max 3 per batch), max LoRA rank 8")) << r.output;
}

TEST(BenchCli, AdapterPoolSizedFromTheRunOrTheOverrides) {
  const fs::path q = fixture("qwen3_moe");
  const std::string common =
      "bench --device cpu --batch-sizes 2 --input-len 3 --output-len 2 "
      "--model " +
      quote(q / "base");
  // No adapters: one slot of the smallest rank.
  auto r = test::run_moelora(common);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "adapter slots 1 (max 1 per batch), max LoRA rank 8; attention"))
      << r.output;
  // Overrides, used as given.
  r = test::run_moelora(common + " --adapters a=" + quote(q / "lora_peft3d") +
                        " --adapter-slots 3 --max-lora-rank 13");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "adapter slots 3 (max 3 per batch), max LoRA rank 13; attention"))
      << r.output;
  // Overrides too small for the run's adapters.
  r = test::run_moelora(common + " --adapters a=" + quote(q / "lora_peft3d") +
                        ",b=" + quote(q / "lora_shared_outer") + " --adapter-slots 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.output, "--adapter-slots 1 is below the 2 adapters this run registers"))
      << r.output;
  const int64_t rank =
      io::load_adapter(q / "lora_peft3d", io::load_model_config(q / "base"), "a").max_rank;
  ASSERT_GT(rank, 1);
  r = test::run_moelora(common + " --adapters a=" + quote(q / "lora_peft3d") + " --max-lora-rank " +
                        std::to_string(rank - 1));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.output, "--max-lora-rank " + std::to_string(rank - 1) +
                                     " is below the largest adapter rank of this run, " +
                                     std::to_string(rank)))
      << r.output;
}

TEST(BenchCli, ErrorsAreOneClearLine) {
  const fs::path q = fixture("qwen3_moe") / "base";
  struct BadCase {
    std::string args, message;
  };
  std::vector<BadCase> cases = {
      {"bench --device cpu --input-len 4", "give exactly one of --model DIR and --preset NAME"},
      {"bench --device cpu --preset tiny-qwen3-moe --random-weights",
       "--random-weights needs --preset NAME and --device cuda"},
      {"bench --device cpu --model " + quote(q) + " --random-adapters 2",
       "--random-adapters needs --random-weights"},
      {"bench --model " + quote(q) + " --adapter-dist zipf", "--adapter-dist 'zipf' is unknown"},
      {"bench --model " + quote(q) + " --batch-sizes 4,x", "--batch-sizes: 'x' is not an integer"},
      {"bench --model " + quote(q) + " --adapters a", "must be given as NAME=DIR"},
      {"bench --model " + quote(q) + " --base-share 2", "--base-share must be in [0, 1]"},
      {"bench --device cpu --model " + quote(q) + " --max-layers two",
       "--max-layers: expected a layer count >= 0 (0 = all) or 'fit', got 'two'"},
      {"bench --device cpu --model " + quote(q) + " --max-layers -1",
       "--max-layers: expected a layer count >= 0 (0 = all) or 'fit', got '-1'"},
      {"bench --device cpu --model " + quote(q) + " --max-layers fit",
       "--max-layers fit needs --device cuda"},
      {"bench --device cpu --model " + quote(q) + " --moe-seam1-after-quant 1",
       "schedule the GPU's MoE kernels: use them with --device cuda"},
      {"bench --device cpu --model " + quote(q) + " --moe-stream-schedule fifo",
       "--moe-stream-schedule: fifo not in {auto,claimed,round-robin}"},
      {"bench --device cpu --model " + quote(q) + " --moe-seam1-after-quant 2",
       "--moe-seam1-after-quant: Value 2 not in range"},
  };
  if (!cuda_device_available())
    cases.push_back({"bench --model " + quote(q) + " --device cuda", "device 'cuda'"});
  for (const BadCase& c : cases) {
    const auto r = test::run_moelora(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_TRUE(contains(r.output, c.message)) << c.args << "\n" << r.output;
  }
}


}  // namespace
}  // namespace moelora::runtime
