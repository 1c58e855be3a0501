// `moelora generate`: continues a prompt with the CPU model, optionally through a LoRA adapter.
//
//   moelora generate --model DIR [--adapter NAME=DIR ...] [--use NAME]
//                    (--prompt TEXT | --tokens 1,2,3) --max-new-tokens N
//                    [--temperature T] [--top-p P] [--top-k K] [--seed S] [--ignore-eos] [--json]
//
// The continuation goes to stdout (text when a tokenizer is found, else token ids), the timing to
// stderr; --json prints one object instead:
//   {"tokens": [...], "text": "..." or null, "tokens_per_s": ..., "prompt_tokens": ...,
//    "adapter": NAME or null, "stopped": true if an end-of-sequence token ended it}
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "core/error.h"
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
};

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

int run_generate(const GenerateArgs& args) {
  MOELORA_CHECK(args.has_prompt != !args.tokens.empty(), ErrorCode::kInvalidArgument,
                "give exactly one of --prompt and --tokens");
  MOELORA_CHECK(args.max_new_tokens >= 0, ErrorCode::kInvalidArgument, "--max-new-tokens must be >= 0, got ",
                args.max_new_tokens);
  mm::SamplingParams sampling{args.temperature, args.top_p, args.top_k, args.seed};
  mm::check_sampling_params(sampling);
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
  MOELORA_CHECK(args.tokenizer_dir.empty() || tokenizer.has_value(), ErrorCode::kNotFound, args.tokenizer_dir,
                ": no tokenizer.json");
  std::vector<int32_t> prompt;
  if (args.has_prompt) {
    MOELORA_CHECK(tokenizer.has_value(), ErrorCode::kInvalidArgument, "--prompt needs a tokenizer, but ",
                  args.model_dir, " has no tokenizer.json; pass --tokenizer DIR or --tokens");
    prompt = tokenizer->encode(args.prompt);
    MOELORA_CHECK(!prompt.empty(), ErrorCode::kInvalidArgument, "--prompt encodes to no tokens");
  } else {
    prompt = moelora::cli::parse_int_list(args.tokens, "--tokens");
  }

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
  const mm::GenerationOutput& out = result.outputs[0];

  std::optional<std::string> text;
  if (tokenizer) text = io::sanitize_utf8(tokenizer->decode(out.tokens));
  if (args.json) {
    nlohmann::json j;
    j["tokens"] = out.tokens;
    j["text"] = text ? nlohmann::json(*text) : nlohmann::json(nullptr);
    j["tokens_per_s"] = result.stats.tokens_per_second();
    j["prompt_tokens"] = result.stats.prompt_tokens;
    j["adapter"] = args.use.empty() ? nlohmann::json(nullptr) : nlohmann::json(args.use);
    j["stopped"] = out.stopped;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("%s\n", text ? text->c_str() : ids_text(out.tokens).c_str());
  std::fprintf(stderr, "%zu tokens in %.3f s: %.1f tokens/s (prompt %lld tokens, %s)%s\n", out.tokens.size(),
               result.stats.prefill_seconds + result.stats.decode_seconds, result.stats.tokens_per_second(),
               static_cast<long long>(result.stats.prompt_tokens),
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
  app.add_option("--tokenizer", args->tokenizer_dir, "Directory with tokenizer.json (default: --model's)");
  app.add_option("--max-new-tokens", args->max_new_tokens, "Tokens to generate")->capture_default_str();
  app.add_option("--temperature", args->temperature, "Sampling temperature (0 = greedy)")
      ->capture_default_str();
  app.add_option("--top-p", args->top_p, "Nucleus sampling mass in (0, 1]")->capture_default_str();
  app.add_option("--top-k", args->top_k, "Keep only the K most probable tokens (0 = off)")
      ->capture_default_str();
  app.add_option("--seed", args->seed, "Seed of the sampler")->capture_default_str();
  app.add_flag("--ignore-eos", args->ignore_eos, "Do not stop at end-of-sequence tokens");
  app.add_flag("--json", args->json,
               "Print one JSON object {tokens, text, tokens_per_s, prompt_tokens, adapter, stopped}");
  app.add_option("--max-layers", args->max_layers, "Use only the first N decoder layers (0 = all)");
  return [args, prompt] {
    args->has_prompt = prompt->count() > 0;
    return run_generate(*args);
  };
}

MOELORA_SUBCOMMAND("generate", "Continue a prompt with the CPU model, optionally through a LoRA adapter", 10,
                   setup_generate);

}  // namespace
