// `moelora generate`: continues a prompt with the CPU reference model or the GPU model,
// optionally through a LoRA adapter.
//
//   moelora generate --model DIR [--adapter NAME=DIR ...] [--use NAME] [--device cpu|cuda]
//                    (--prompt TEXT | --tokens 1,2,3) --max-new-tokens N
//                    [--temperature T] [--top-p P] [--top-k K] [--seed S] [--ignore-eos] [--json]
//
// The continuation goes to stdout (text when a tokenizer is found, else token ids), the timing to
// stderr; --json prints one object instead:
//   {"tokens": [...], "text": "..." or null, "tokens_per_s": ..., "prompt_tokens": ...,
//    "adapter": NAME or null, "stopped": true if an end-of-sequence token ended it,
//    "device": "cpu" or "cuda"}
//
// --device cpu (the default) runs model::generate on the fp32 reference model; --device cuda runs
// one request through the public Engine API on the GPU model (device_run.h). Both draw sampling
// numbers from the request's own std::mt19937_64 seeded with --seed, so greedy runs are
// comparable token for token. The CPU path stays on model::generate rather than the Engine's CPU
// backend: the Engine hands its sampler u as a float (the GPU sampler's type) where
// model::Sampler uses the double, which can pick another token at a decision boundary when
// --temperature > 0, and `generate --device cpu` keeps giving exactly the tokens it always gave.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "core/error.h"
#include "device_run.h"
#include "model/generate.h"
#include "model/model_setup.h"

namespace {

using moelora::ErrorCode;
namespace mm = moelora::model;
namespace io = moelora::io;

struct GenerateArgs {
  std::string model_dir;
  std::vector<std::string> adapters;
  std::string use;
  std::string prompt;
  bool has_prompt = false;  // --prompt given (an empty prompt is an error, not "no prompt")
  std::string tokens;
  std::string tokenizer_dir;
  int64_t max_new_tokens = 32;
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  bool json = false;
  int64_t max_layers = 0;
  std::string device = "cpu";
};

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

int run_generate(const GenerateArgs& args) {
  MOELORA_CHECK(args.has_prompt != !args.tokens.empty(), ErrorCode::kInvalidArgument,
                "give exactly one of --prompt and --tokens");
  MOELORA_CHECK(args.max_new_tokens >= 0, ErrorCode::kInvalidArgument,
                "--max-new-tokens must be >= 0, got ", args.max_new_tokens);
  mm::SamplingParams sampling{args.temperature, args.top_p, args.top_k, args.seed};
  mm::check_sampling_params(sampling);
  moelora::tools::require_cli_device(args.device);
  std::vector<mm::AdapterSpec> specs;
  for (const std::string& s : args.adapters) specs.push_back(mm::parse_adapter_spec(s));
  if (!args.use.empty()) {
    bool known = false;
    for (const auto& s : specs) known = known || s.name == args.use;
    MOELORA_CHECK(known, ErrorCode::kNotFound, "--use ", args.use, ": no --adapter ", args.use,
                  "=DIR was given");
  }

  // The tokenizer: --tokenizer DIR, else the model directory's tokenizer.json if any.
  std::optional<io::Tokenizer> tokenizer =
      mm::find_tokenizer(args.tokenizer_dir.empty() ? args.model_dir : args.tokenizer_dir);
  MOELORA_CHECK(args.tokenizer_dir.empty() || tokenizer.has_value(), ErrorCode::kNotFound,
                args.tokenizer_dir, ": no tokenizer.json");
  std::vector<int32_t> prompt;
  if (args.has_prompt) {
    MOELORA_CHECK(tokenizer.has_value(), ErrorCode::kInvalidArgument,
                  "--prompt needs a tokenizer, but ", args.model_dir,
                  " has no tokenizer.json; pass --tokenizer DIR or --tokens");
    prompt = tokenizer->encode(args.prompt);
    MOELORA_CHECK(!prompt.empty(), ErrorCode::kInvalidArgument, "--prompt encodes to no tokens");
  } else {
    prompt = moelora::cli::parse_int_list(args.tokens, "--tokens");
  }

  moelora::tools::DeviceGenerateResult out;
  if (args.device == "cpu") {
    mm::ModelOptions options;
    options.max_layers = args.max_layers;
    options.show_progress = !args.json;
    mm::Model model = mm::load_model(args.model_dir, specs, options);

    mm::GenerationRequest request;
    request.prompt = prompt;
    request.slot = args.use.empty() ? -1 : model.adapters().slot_of(args.use);
    request.max_new_tokens = args.max_new_tokens;
    request.sampling = sampling;
    if (!args.ignore_eos)
      request.stop_tokens = mm::stop_tokens(model.config(), tokenizer ? &*tokenizer : nullptr);
    const mm::GenerationResult result =
        mm::generate(model, std::span<const mm::GenerationRequest>(&request, 1));
    out.tokens = result.outputs[0].tokens;
    out.stopped = result.outputs[0].stopped;
    out.prompt_tokens = result.stats.prompt_tokens;
    out.seconds = result.stats.prefill_seconds + result.stats.decode_seconds;
  } else {
    moelora::tools::DeviceGenerateRequest request;
    request.model_dir = args.model_dir;
    request.adapters = specs;
    request.adapter = args.use;
    request.prompt = prompt;
    request.max_new_tokens = args.max_new_tokens;
    request.temperature = args.temperature;
    request.top_p = args.top_p;
    request.top_k = args.top_k;
    request.seed = args.seed;
    request.ignore_eos = args.ignore_eos;
    // The Engine stops at config.json's eos ids itself; the tokenizer's eos comes on top, as
    // mm::stop_tokens adds it on the CPU.
    if (tokenizer && tokenizer->eos_token_id())
      request.extra_stop_tokens.push_back(static_cast<int32_t>(*tokenizer->eos_token_id()));
    request.max_layers = args.max_layers;
    request.show_progress = !args.json;
    out = moelora::tools::generate_on_device(args.device, request);
  }

  std::optional<std::string> text;
  if (tokenizer) text = io::sanitize_utf8(tokenizer->decode(out.tokens));
  if (args.json) {
    nlohmann::json j;
    j["tokens"] = out.tokens;
    j["text"] = text ? nlohmann::json(*text) : nlohmann::json(nullptr);
    j["tokens_per_s"] = out.tokens_per_second();
    j["prompt_tokens"] = out.prompt_tokens;
    j["adapter"] = args.use.empty() ? nlohmann::json(nullptr) : nlohmann::json(args.use);
    j["stopped"] = out.stopped;
    j["device"] = args.device;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("%s\n", text ? text->c_str() : ids_text(out.tokens).c_str());
  std::fprintf(stderr, "%zu tokens in %.3f s: %.1f tokens/s (prompt %lld tokens, %s)%s\n",
               out.tokens.size(), out.seconds, out.tokens_per_second(),
               static_cast<long long>(out.prompt_tokens),
               args.use.empty() ? "base model" : ("adapter " + args.use).c_str(),
               out.stopped ? ", stopped at end-of-sequence" : "");
  return 0;
}

std::function<int()> setup_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  app.add_option("--model", args->model_dir, "Checkpoint directory (config.json + *.safetensors)")
      ->required();
  app.add_option("--adapter", args->adapters, "LoRA adapter to load, as NAME=DIR (repeatable)");
  app.add_option("--use", args->use, "Adapter NAME to generate with (default: the base model)");
  CLI::Option* prompt = app.add_option("--prompt", args->prompt, "Prompt text (needs a tokenizer)");
  app.add_option("--tokens", args->tokens, "Prompt as comma-separated token ids, e.g. 1,2,3");
  app.add_option("--tokenizer", args->tokenizer_dir,
                 "Directory with tokenizer.json (default: --model's)");
  app.add_option("--max-new-tokens", args->max_new_tokens, "Tokens to generate")
      ->capture_default_str();
  app.add_option("--temperature", args->temperature, "Sampling temperature (0 = greedy)")
      ->capture_default_str();
  app.add_option("--top-p", args->top_p, "Nucleus sampling mass in (0, 1]")->capture_default_str();
  app.add_option("--top-k", args->top_k, "Keep only the K most probable tokens (0 = off)")
      ->capture_default_str();
  app.add_option("--seed", args->seed, "Seed of the sampler")->capture_default_str();
  app.add_flag("--ignore-eos", args->ignore_eos, "Do not stop at end-of-sequence tokens");
  app.add_flag(
      "--json", args->json,
      "Print one JSON object {tokens, text, tokens_per_s, prompt_tokens, adapter, stopped}");
  app.add_option("--max-layers", args->max_layers, "Use only the first N decoder layers (0 = all)");
  app.add_option("--device", args->device, moelora::tools::kDeviceHelp)->capture_default_str();
  app.footer(
      "--device cuda runs the request through the Engine on the GPU model (bf16 / FP8); greedy\n"
      "tokens match --device cpu except where bf16 rounding flips a near-tie.");
  return [args, prompt] {
    args->has_prompt = prompt->count() > 0;
    return run_generate(*args);
  };
}

MOELORA_SUBCOMMAND("generate",
                   "Continue a prompt (CPU or GPU model), optionally through a LoRA adapter", 10,
                   setup_generate);

}  // namespace
