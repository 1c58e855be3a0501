// `moelora run`: the main job on its built-in default (README.md). It shows the engine's point
// end to end on any machine, with nothing to download:
//   1. `moelora synth` writes a small Qwen3-MoE checkpoint with random weights and
//      `moelora synth-adapter` two LoRA adapters for it in different layouts (per-expert on
//      attention + experts, shared-outer), all as real Hugging Face / PEFT files;
//   2. the CPU model loads the checkpoint and both adapters;
//   3. one prompt is continued three times -- base model, adapter 1, adapter 2 -- as ONE
//      mixed-adapter batch, and each continuation is checked against the same request run alone;
//   4. `moelora bench` runs one batch of 4 random prompts through the serving Engine (continuous
//      batching, adapter slot pool) without LoRA and with the two adapters, and prints the
//      throughput table (prefill, decode, overall, TTFT, memory, % of no-LoRA).
// With a CUDA device (and a CUDA build) steps 2-4 run on the GPU instead: the serving Engine on
// device cuda loads the checkpoint (bf16 on the device) and both adapters into its slot pool,
// continues the prompt for the three requests as one mixed batch and then each alone through
// the same engine (decode steps replay CUDA graphs), and `moelora bench --device cuda` times
// batches of 4 and 16. --device cpu forces the CPU path.
//
// The synthesis and the benchmark run through the same binary's `synth` / `synth-adapter` /
// `bench` subcommands (looked up in the subcommand registry), so the demo writes and measures
// exactly what a user of those commands would get.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "core/error.h"
#include "model/generate.h"
#include "model/model_setup.h"
#include "moelora/engine.h"

namespace {

namespace fs = std::filesystem;
namespace mm = moelora::model;
using moelora::ErrorCode;
using Clock = std::chrono::steady_clock;

struct RunArgs {
  std::string out;
  std::string preset = "small-qwen3-moe";
  std::string tokenizer;
  std::string prompt = "The mixture of experts";
  int64_t max_new_tokens = 24;
  uint64_t seed = 0;
  bool no_bench = false;
  std::string device;  // "" = cuda when available, else cpu
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

// Printable one-line form of generated text: control characters escaped.
std::string one_line(const std::string& text) {
  std::string out;
  for (unsigned char c : moelora::io::sanitize_utf8(text)) {
    if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7f) {
      out += ' ';
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

void check_status(const moelora::Status& status) {
  if (!status) throw moelora::Error(status.code(), status.message());
}

// Runs `prompts` (adapter names alongside, "" = base) through the engine as one batch, greedy,
// EOS ignored; returns each request's tokens.
std::vector<std::vector<int32_t>> engine_generate(moelora::Engine& engine,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  const std::vector<std::string>& adapters,
                                                  int64_t max_new_tokens) {
  std::vector<std::vector<int32_t>> out(prompts.size());
  std::string error;
  for (size_t i = 0; i < prompts.size(); ++i) {
    moelora::Request request;
    request.prompt = prompts[i];
    request.adapter = adapters[i];
    request.sampling.max_new_tokens = max_new_tokens;
    request.sampling.ignore_eos = true;
    moelora::Result<moelora::RequestId> id =
        engine.submit(std::move(request), [&, i](const moelora::TokenEvent& e) {
          if (e.token >= 0) out[i].push_back(e.token);
          if (e.finish_reason == moelora::FinishReason::kError && error.empty()) error = e.error;
        });
    check_status(id.status());
  }
  check_status(engine.run_until_idle());
  MOELORA_CHECK(error.empty(), ErrorCode::kInternal, "a request failed: ", error);
  return out;
}

struct DemoAdapter {
  std::string name, layout, targets;
  int64_t rank;
};

// Steps 2-4 on the GPU engine (see the file comment). Returns the exit code.
int run_gpu_steps(const RunArgs& args, const fs::path& root, const fs::path& model_dir,
                  const std::vector<DemoAdapter>& adapters, int steps) {
  std::printf(
      "\n[2/%d] loading the model and the adapters onto the GPU (serving engine, device "
      "cuda)\n",
      steps);
  std::fflush(stdout);
  auto start = Clock::now();
  moelora::EngineOptions options;
  options.model_dir = model_dir;
  options.device = "cuda";
  options.max_running = 16;
  options.max_batch_tokens = 1024;
  options.adapter_slots = static_cast<int32_t>(adapters.size());
  options.max_loras_per_batch = static_cast<int32_t>(adapters.size());
  // Separate gate_proj and up_proj LoRAs of the routed experts are stacked into one A of the sum
  // of their ranks (io/peft.cpp), so the pool's rank is twice the largest adapter rank.
  int64_t largest_rank = 0;
  for (const DemoAdapter& a : adapters) largest_rank = std::max(largest_rank, a.rank);
  options.max_lora_rank = (2 * largest_rank + 7) / 8 * 8;
  options.max_seq_len = 1024;
  moelora::Result<std::unique_ptr<moelora::Engine>> created = moelora::Engine::create(options);
  check_status(created.status());
  moelora::Engine& engine = *created.value();
  for (const DemoAdapter& a : adapters)
    check_status(engine.register_adapter(a.name, root / a.name, /*pin=*/true));
  const double load_seconds = seconds_since(start);
  const moelora::ModelInfo& info = engine.model_info();
  std::printf("      %s: %lld layers, vocab %lld; adapters:", info.model_type.c_str(),
              static_cast<long long>(info.num_layers), static_cast<long long>(info.vocab_size));
  for (const moelora::AdapterInfo& a : engine.adapters())
    std::printf(" %s (slot %d)", a.name.c_str(), a.slot);
  std::printf("\n");

  std::optional<moelora::io::Tokenizer> tokenizer = mm::find_tokenizer(model_dir);
  std::vector<int32_t> prompt;
  if (tokenizer) {
    prompt = tokenizer->encode(args.prompt);
    MOELORA_CHECK(!prompt.empty(), ErrorCode::kInvalidArgument, "--prompt encodes to no tokens");
  } else {
    for (int64_t i = 0; i < 8; ++i)
      prompt.push_back(static_cast<int32_t>((5 + 37 * i) % info.vocab_size));
  }
  for (int32_t id : prompt) {
    MOELORA_CHECK(id < info.vocab_size, ErrorCode::kInvalidArgument, "the tokenizer gives id ", id,
                  ", beyond the model's vocabulary of ", info.vocab_size);
  }
  std::vector<std::string> names = {""}, labels = {"base"};
  for (const DemoAdapter& a : adapters) {
    names.push_back(a.name);
    labels.push_back(a.name);
  }
  const std::vector<std::vector<int32_t>> prompts(names.size(), prompt);
  std::printf(
      "\n[3/%d] continuing the prompt (%zu tokens) by %lld tokens, greedy, for %zu "
      "requests in ONE batch on the GPU\n",
      steps, prompt.size(), static_cast<long long>(args.max_new_tokens), names.size());
  std::fflush(stdout);
  engine_generate(engine, prompts, names, 2);  // warm-up: captures the decode graphs
  const moelora::EngineStats before = engine.stats();
  start = Clock::now();
  const auto batch = engine_generate(engine, prompts, names, args.max_new_tokens);
  const double batch_seconds = seconds_since(start);
  const moelora::EngineStats after = engine.stats();
  size_t identical = 0;
  double alone_seconds = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    start = Clock::now();
    const auto alone = engine_generate(engine, {prompt}, {names[i]}, args.max_new_tokens);
    alone_seconds += seconds_since(start);
    identical += alone[0] == batch[i];
  }
  std::printf("\n  %-18s %s\n", "request",
              tokenizer ? "continuation (text | token ids)" : "continuation (token ids)");
  std::printf("  %-18s %s\n", "------------------",
              "--------------------------------------------------------");
  for (size_t i = 0; i < names.size(); ++i) {
    if (tokenizer)
      std::printf("  %-18s %s\n", labels[i].c_str(), one_line(tokenizer->decode(batch[i])).c_str());
    std::printf("  %-18s %s\n", tokenizer ? "" : labels[i].c_str(), join_ids(batch[i]).c_str());
  }
  const int64_t generated = static_cast<int64_t>(names.size()) * args.max_new_tokens;
  std::printf("\n  %-34s %8.2f s\n", "load onto the GPU", load_seconds);
  std::printf("  %-34s %8.3f s  (%lld tokens, %.1f tokens/s; %lld steps, %lld graph replays)\n",
              "generation, mixed batch of 3", batch_seconds, static_cast<long long>(generated),
              batch_seconds > 0 ? static_cast<double>(generated) / batch_seconds : 0.0,
              static_cast<long long>(after.steps - before.steps),
              static_cast<long long>(after.graph_replays - before.graph_replays));
  std::printf("  %-34s %8.3f s\n", "same 3 requests one at a time", alone_seconds);
  // bf16 kernels may pick other tilings for other batch shapes, so a near-tie between two logits
  // can break differently; the CPU path (fp32, exact) is where this check is strict.
  std::printf(
      "\n  mixed batch == each request alone: %s (%zu of %zu continuations identical)\n",
      identical == names.size() ? "yes" : "not all (bf16 rounding can differ by batch shape)",
      identical, names.size());
  size_t differ = 0;
  for (size_t i = 1; i < names.size(); ++i) differ += batch[i] != batch[0];
  std::printf("  adapters change the output:        %s (%zu of %zu differ from the base model)\n",
              differ == adapters.size() ? "yes" : "partly", differ, adapters.size());
  if (!args.no_bench) {
    std::printf(
        "\n[4/%d] moelora bench on the GPU: batches of 4 and 16 requests (32 random prompt "
        "tokens, 16 generated), without LoRA and with the two adapters\n",
        steps);
    std::fflush(stdout);
    std::string list;
    for (const DemoAdapter& a : adapters)
      list += (list.empty() ? "" : ",") + a.name + "=" + (root / a.name).string();
    moelora::cli::run_subcommand(
        "bench", {"--model", model_dir.string(), "--device", "cuda", "--adapters", list,
                  "--adapter-dist", "uniform", "--batch-sizes", "4,16", "--input-len", "32",
                  "--output-len", "16", "--seed", std::to_string(args.seed)});
  }
  return 0;
}

int run_demo(const RunArgs& args) {
  const std::string device = args.device.empty() ? moelora::default_device() : args.device;
  check_status(moelora::check_device(device));
  const bool gpu = device == "cuda" || device == "gpu";
  MOELORA_CHECK(args.max_new_tokens > 0, ErrorCode::kInvalidArgument,
                "--max-new-tokens must be > 0, got ", args.max_new_tokens);
  std::unique_ptr<moelora::cli::ScratchDir> scratch;
  fs::path root;
  if (args.out.empty()) {
    scratch = std::make_unique<moelora::cli::ScratchDir>("run");
    root = scratch->path();
  } else {
    root = args.out;
    fs::create_directories(root);
  }
  const fs::path model_dir = root / "model";
  const std::vector<DemoAdapter> adapters = {{"per-expert-r8", "per-expert", "all", 8},
                                             {"shared-outer-r16", "shared-outer", "experts", 16}};

  std::printf("moelora run: one MoE model, two LoRA adapters, one mixed batch (%s)\n\n",
              gpu ? "GPU serving engine" : "CPU reference backend");
  const int steps = args.no_bench ? 3 : 4;
  std::printf("[1/%d] writing a random %s checkpoint and two PEFT adapters to %s%s\n", steps,
              args.preset.c_str(), root.string().c_str(),
              scratch ? " (removed at exit; --out DIR keeps them)" : "");
  std::fflush(stdout);
  auto start = Clock::now();
  std::vector<std::string> synth_args = {
      "--preset", args.preset, "--seed", std::to_string(args.seed), "--out", model_dir.string()};
  if (!args.tokenizer.empty()) synth_args.insert(synth_args.end(), {"--tokenizer", args.tokenizer});
  moelora::cli::run_subcommand("synth", synth_args);
  for (size_t i = 0; i < adapters.size(); ++i) {
    moelora::cli::run_subcommand(
        "synth-adapter",
        {"--model", model_dir.string(), "--layout", adapters[i].layout, "--targets",
         adapters[i].targets, "--rank", std::to_string(adapters[i].rank), "--alpha",
         std::to_string(2 * adapters[i].rank), "--seed", std::to_string(args.seed + 1 + i), "--out",
         (root / adapters[i].name).string()});
  }
  const double synth_seconds = seconds_since(start);
  if (gpu) {
    std::printf("      written in %.2f s\n", synth_seconds);
    return run_gpu_steps(args, root, model_dir, adapters, steps);
  }

  std::printf("\n[2/%d] loading the model and the adapters\n", steps);
  std::fflush(stdout);
  start = Clock::now();
  std::vector<mm::AdapterSpec> specs;
  for (const DemoAdapter& a : adapters) specs.push_back({a.name, root / a.name});
  mm::Model model = mm::load_model(model_dir, specs);
  const double load_seconds = seconds_since(start);
  const moelora::io::ModelConfig& config = model.config();
  std::printf(
      "      %s: %lld layers, hidden %lld, %lld experts (top-%lld), vocab %lld; %.0f MB of fp32 "
      "weights\n",
      config.model_type.c_str(), static_cast<long long>(config.num_hidden_layers),
      static_cast<long long>(config.hidden_size), static_cast<long long>(config.num_experts),
      static_cast<long long>(config.num_experts_per_tok), static_cast<long long>(config.vocab_size),
      static_cast<double>(model.weights().bytes) / 1e6);
  for (int32_t s = 0; s < model.adapters().size(); ++s) {
    const moelora::io::LoraAdapter& a = model.adapters().adapter(s);
    std::string targets;  // module names of the loader's "module (layers ...): rank ..." lines
    for (const std::string& t : a.targets)
      targets += (targets.empty() ? "" : ", ") + t.substr(0, t.find(" ("));
    std::printf("      adapter %-17s slot %d, %s experts, max rank %lld: %s\n", a.name.c_str(), s,
                moelora::io::expert_lora_layout_name(a.expert_layout),
                static_cast<long long>(a.max_rank), targets.c_str());
  }

  // The prompt: text through the tokenizer when there is one, else fixed token ids.
  std::optional<moelora::io::Tokenizer> tokenizer = mm::find_tokenizer(model_dir);
  std::vector<int32_t> prompt;
  if (tokenizer) {
    prompt = tokenizer->encode(args.prompt);
    MOELORA_CHECK(!prompt.empty(), ErrorCode::kInvalidArgument, "--prompt encodes to no tokens");
  } else {
    for (int64_t i = 0; i < 8; ++i)
      prompt.push_back(static_cast<int32_t>((5 + 37 * i) % config.vocab_size));
  }
  for (int32_t id : prompt) {
    MOELORA_CHECK(id < config.vocab_size, ErrorCode::kInvalidArgument, "the tokenizer gives id ",
                  id, ", beyond the model's vocabulary of ", config.vocab_size);
  }

  std::vector<mm::GenerationRequest> requests(1 + adapters.size());
  std::vector<std::string> labels = {"base"};
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].prompt = prompt;
    requests[i].slot = static_cast<int32_t>(i) - 1;
    requests[i].max_new_tokens = args.max_new_tokens;
    if (i > 0) labels.push_back(adapters[i - 1].name);
  }
  std::printf(
      "\n[3/%d] continuing the prompt (%zu tokens: %s) by %lld tokens, greedy, for %zu requests in "
      "ONE "
      "batch\n",
      steps, prompt.size(),
      tokenizer ? ("\"" + one_line(args.prompt) + "\"").c_str() : join_ids(prompt).c_str(),
      static_cast<long long>(args.max_new_tokens), requests.size());
  std::fflush(stdout);
  {  // warm-up (thread pool, caches), not timed
    std::vector<mm::GenerationRequest> warm = requests;
    for (auto& r : warm) r.max_new_tokens = 2;
    mm::generate(model, warm);
  }
  const mm::GenerationResult batch = mm::generate(model, requests);

  // The same requests one at a time: a mixed batch must not change anybody's tokens.
  size_t identical = 0;
  double alone_seconds = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const mm::GenerationResult alone =
        mm::generate(model, std::span<const mm::GenerationRequest>(&requests[i], 1));
    alone_seconds += alone.stats.prefill_seconds + alone.stats.decode_seconds;
    identical += alone.outputs[0].tokens == batch.outputs[i].tokens;
  }

  std::printf("\n  %-18s %s\n", "request",
              tokenizer ? "continuation (text | token ids)" : "continuation (token ids)");
  std::printf("  %-18s %s\n", "------------------",
              "--------------------------------------------------------");
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::vector<int32_t>& tokens = batch.outputs[i].tokens;
    if (tokenizer)
      std::printf("  %-18s %s\n", labels[i].c_str(), one_line(tokenizer->decode(tokens)).c_str());
    std::printf("  %-18s %s\n", tokenizer ? "" : labels[i].c_str(), join_ids(tokens).c_str());
  }
  const mm::GenerationStats& st = batch.stats;
  std::printf("\n  %-34s %8.2f s\n", "write checkpoint + adapters", synth_seconds);
  std::printf("  %-34s %8.2f s\n", "load + convert to fp32", load_seconds);
  std::printf("  %-34s %8.3f s  (%lld prompt tokens)\n", "prefill, one batch", st.prefill_seconds,
              static_cast<long long>(st.prompt_tokens));
  std::printf("  %-34s %8.3f s  (%lld steps, %.1f tokens/s)\n", "decode, one batch",
              st.decode_seconds, static_cast<long long>(st.steps - 1),
              st.decode_tokens_per_second());
  std::printf("  %-34s %8.3f s  (%lld tokens, %.1f tokens/s)\n", "generation, mixed batch of 3",
              st.prefill_seconds + st.decode_seconds, static_cast<long long>(st.generated_tokens),
              st.tokens_per_second());
  std::printf("  %-34s %8.3f s  (%.1f tokens/s)\n", "same 3 requests one at a time", alone_seconds,
              alone_seconds > 0 ? static_cast<double>(st.generated_tokens) / alone_seconds : 0.0);
  std::printf("\n  mixed batch == each request alone: %s (%zu of %zu continuations identical)\n",
              identical == requests.size() ? "yes" : "NO", identical, requests.size());
  size_t differ = 0;
  for (size_t i = 1; i < requests.size(); ++i)
    differ += batch.outputs[i].tokens != batch.outputs[0].tokens;
  std::printf("  adapters change the output:        %s (%zu of %zu differ from the base model)\n",
              differ == adapters.size() ? "yes" : "partly", differ, adapters.size());
  if (!args.no_bench) {
    std::printf(
        "\n[4/%d] moelora bench: one batch of 4 requests (32 random prompt tokens, 16 generated), "
        "without "
        "LoRA and with the two adapters, through the serving engine\n",
        steps);
    std::fflush(stdout);
    std::string list;
    for (const DemoAdapter& a : adapters)
      list += (list.empty() ? "" : ",") + a.name + "=" + (root / a.name).string();
    moelora::cli::run_subcommand(
        "bench", {"--model", model_dir.string(), "--adapters", list, "--adapter-dist", "uniform",
                  "--batch-sizes", "4", "--input-len", "32", "--output-len", "16", "--seed",
                  std::to_string(args.seed)});
  }
  return identical == requests.size() ? 0 : 1;
}

std::function<int()> setup_run(CLI::App& app) {
  auto args = std::make_shared<RunArgs>();
  app.add_option("--out", args->out,
                 "Keep the synthesized model and adapters in DIR (default: a temp dir)");
  app.add_option("--preset", args->preset,
                 "Model preset of `moelora synth` (a qwen3_moe or deepseek_v3 one)")
      ->capture_default_str();
  app.add_option(
         "--tokenizer", args->tokenizer,
         "Directory with a tokenizer.json to copy into the model: prompt and continuations as text")
      ->capture_default_str();
  app.add_option("--prompt", args->prompt, "Prompt text (used with --tokenizer)")
      ->capture_default_str();
  app.add_option("--max-new-tokens", args->max_new_tokens, "Tokens to generate per request")
      ->capture_default_str();
  app.add_option("--seed", args->seed, "Seed of the random weights")->capture_default_str();
  app.add_flag("--no-bench", args->no_bench, "Skip the final `moelora bench` run");
  app.add_option("--device", args->device,
                 "cpu or cuda (default: cuda when this build has CUDA and a device is visible)");
  app.footer(
      "\nWhat it does: writes a random Hugging Face checkpoint (`moelora synth --preset "
      "small-qwen3-moe`:\n"
      "8 layers, 32 experts top-4, ~110 M parameters) and two PEFT adapters (`moelora "
      "synth-adapter`: a\n"
      "per-expert rank-8 adapter on every module, a shared-outer rank-16 adapter on the experts; "
      "scaling "
      "2),\n"
      "loads them into the CPU reference model, and continues one prompt with the base model and "
      "with\n"
      "each adapter, all three in ONE mixed-adapter batch; then runs each request alone and checks "
      "that\n"
      "the tokens are identical; then `moelora bench` times one batch of 4 requests through the "
      "serving\n"
      "engine without LoRA and with both adapters. The weights are random, so the text is "
      "nonsense: the\n"
      "point is the machinery (file formats, LoRA on every seam, mixed batches, KV cache, "
      "timing).\n"
      "No tokenizer is bundled: continuations are token ids unless --tokenizer DIR names a "
      "directory with\n"
      "a tokenizer.json (e.g. tests/data/tokenizer of the source tree; ids outside the "
      "tokenizer's\n"
      "vocabulary decode to nothing). Takes a few seconds on 2 CPU cores. Exit code 1 if the batch "
      "and\n"
      "the single runs disagree (or the benchmark's base-only requests change in a mixed batch).");
  return [args] { return run_demo(*args); };
}

}  // namespace

MOELORA_SUBCOMMAND("run", "Run the built-in demo (the README's main job)", 0, setup_run);
