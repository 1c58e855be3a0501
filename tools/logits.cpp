// `moelora logits`: runs token ids through the CPU reference model or the GPU model (optionally
// with LoRA adapters) and writes the logits of every position to a safetensors file, for
// comparisons with other implementations (transformers, the GPU engine).
//
//   moelora logits --model DIR [--adapter NAME=DIR ...] [--use NAME] --tokens 1,2,3 --out FILE
//       -> FILE holds `logits` F32 [num_tokens, vocab]
//   moelora logits --model DIR --adapter a=DIR_A --batch batch.json --out FILE
//       batch.json: [{"tokens": [1, 2, 3], "adapter": "a"}, {"tokens": [4, 5], "adapter": null}]
//       -> all sequences run in ONE forward pass (a mixed-adapter batch); FILE holds `logits.0`,
//          `logits.1`, ... F32 [num_tokens_i, vocab], in batch order
//   --device cuda: the same file from the GPU model (metadata "device" says which). The CPU runs
//       every sequence's tokens in one forward; the GPU model computes logits only at each
//       sequence's last row, so there the tokens go one position per forward over the paged KV
//       cache, every sequence of the batch (each with its adapter) in each forward
//       (tools::logits_on_gpu in device_run.h).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "core/error.h"
#include "device_run.h"
#include "io/safetensors.h"
#include "logits_batch.h"
#include "model/model_setup.h"

namespace {

using moelora::ErrorCode;
using moelora::tools::BatchEntry;
using moelora::tools::read_batch;
namespace mm = moelora::model;

struct LogitsArgs {
  std::string model_dir;
  std::vector<std::string> adapters;
  std::string use;
  std::string tokens;
  std::string batch_file;
  std::string out;
  int64_t max_layers = 0;
  std::string device = "cpu";
};

int run_logits(const LogitsArgs& args) {
  MOELORA_CHECK(args.tokens.empty() != args.batch_file.empty(), ErrorCode::kInvalidArgument,
                "give exactly one of --tokens and --batch");
  MOELORA_CHECK(args.batch_file.empty() || args.use.empty(), ErrorCode::kInvalidArgument,
                "--use applies to --tokens; with --batch each entry names its \"adapter\"");
  moelora::tools::require_cli_device(args.device);
  std::vector<mm::AdapterSpec> specs;
  for (const std::string& s : args.adapters) specs.push_back(mm::parse_adapter_spec(s));

  std::vector<BatchEntry> entries;
  if (!args.batch_file.empty()) {
    entries = read_batch(args.batch_file);
  } else {
    entries.push_back({moelora::cli::parse_int_list(args.tokens, "--tokens"), args.use});
  }
  // Adapter names are checked before the (slow) model load.
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].adapter.empty()) continue;
    bool known = false;
    for (const auto& s : specs) known = known || s.name == entries[i].adapter;
    std::string names;
    for (const auto& s : specs) names += (names.empty() ? "" : ", ") + s.name;
    MOELORA_CHECK(
        known, ErrorCode::kNotFound, "unknown adapter '", entries[i].adapter, "'",
        entries.size() > 1 ? " in batch entry " + std::to_string(i) : std::string(), "; ",
        names.empty() ? std::string("no --adapter NAME=DIR was given") : "given: " + names);
  }

  std::vector<moelora::Tensor> logits;
  if (args.device == "cpu") {
    mm::ModelOptions options;
    options.max_layers = args.max_layers;
    mm::Model model = mm::load_model(args.model_dir, specs, options);

    std::vector<mm::Sequence> sequences;
    for (const BatchEntry& e : entries) sequences.push_back(model.new_sequence(e.adapter));
    std::vector<mm::SequenceInput> inputs;
    for (size_t i = 0; i < entries.size(); ++i)
      inputs.push_back({&sequences[i], entries[i].tokens});
    logits = model.forward(inputs);
  } else {
    logits = moelora::tools::logits_on_gpu(args.model_dir, specs, entries, args.max_layers,
                                           /*show_progress=*/true);
  }

  moelora::io::SafetensorsWriter writer;
  if (args.batch_file.empty()) {
    writer.add("logits", logits[0].clone());
  } else {
    for (size_t i = 0; i < logits.size(); ++i)
      writer.add("logits." + std::to_string(i), logits[i].clone());
  }
  writer.set_metadata("model", args.model_dir);
  if (args.device != "cpu") writer.set_metadata("device", args.device);
  writer.write(args.out);
  for (size_t i = 0; i < logits.size(); ++i) {
    std::printf("%s: [%lld, %lld]%s%s\n",
                args.batch_file.empty() ? "logits" : ("logits." + std::to_string(i)).c_str(),
                static_cast<long long>(logits[i].dim(0)), static_cast<long long>(logits[i].dim(1)),
                entries[i].adapter.empty() ? " base" : " adapter ", entries[i].adapter.c_str());
  }
  std::printf("wrote %s\n", args.out.c_str());
  return 0;
}

std::function<int()> setup_logits(CLI::App& app) {
  auto args = std::make_shared<LogitsArgs>();
  app.add_option("--model", args->model_dir, "Checkpoint directory (config.json + *.safetensors)")
      ->required();
  app.add_option("--adapter", args->adapters, "LoRA adapter to load, as NAME=DIR (repeatable)");
  app.add_option("--use", args->use, "Adapter NAME applied to --tokens (default: the base model)");
  app.add_option("--tokens", args->tokens, "Comma-separated token ids of one sequence, e.g. 1,2,3");
  app.add_option(
      "--batch", args->batch_file,
      "JSON list of {\"tokens\": [...], \"adapter\": NAME or null}: all run in one batch");
  app.add_option("--out", args->out, "Output .safetensors file")->required();
  app.add_option("--max-layers", args->max_layers, "Use only the first N decoder layers (0 = all)");
  app.add_option("--device", args->device, moelora::tools::kDeviceHelp)->capture_default_str();
  app.footer(
      "Writes `logits` F32 [tokens, vocab] (--tokens) or `logits.0`, `logits.1`, ... (--batch).\n"
      "--device cuda writes the same layout from the GPU model, one position per forward over its\n"
      "KV cache (it computes logits only at a sequence's last row); compare with --device cpu\n"
      "within bf16 tolerance.\n"
      "Example: moelora logits --model m --adapter a=ad --use a --tokens 1,2,3 --out "
      "l.safetensors");
  return [args] { return run_logits(*args); };
}

MOELORA_SUBCOMMAND("logits",
                   "Write the logits of token ids (with optional LoRA adapters) to safetensors", 20,
                   setup_logits);

}  // namespace
