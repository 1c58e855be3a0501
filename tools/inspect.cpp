// `moelora inspect DIR`: what a model or adapter directory holds, as an aligned table (or JSON
// with --json), and whether the engine loads it.
//
// A model directory (config.json + safetensors) is described from its config (architecture,
// layers, attention, experts, router, RoPE, quantization) and from the safetensors headers
// (dtypes, bytes, parameters); then load_checkpoint validates every tensor against the config
// and the "check" row says ok or gives the loader's one-line error; tensors the loader skips as
// transformers does (a vision tower, an MTP layer) are counted, with the reason, in an "ignored"
// row. Qwen3.5's hybrid layers are shown as counts and as their repeating pattern ("10 x (3
// linear + 1 full)"). An adapter directory
// (adapter_config.json) is described from its config (r, alpha, rsLoRA, patterns, targets) and
// its tensor names and shapes (expert layout, per-target ranks and scalings); when the base
// model can be found (--model, or base_model_name_or_path as a directory) load_adapter checks it
// against that model. Reading headers only, inspect is fast on multi-GB checkpoints: tensors are
// mapped, never read.
//
// The model report is in inspect_model.cpp, the adapter report in inspect_adapter.cpp.
#include <filesystem>
#include <memory>
#include <string>

#include "cli.h"
#include "core/error.h"
#include "inspect_internal.h"

namespace moelora::cli {
namespace {

namespace fs = std::filesystem;
using inspect::inspect_adapter;
using inspect::inspect_model;

struct InspectOptions {
  std::string dir;
  std::string model;
  bool json = false;
};

int run_inspect(const InspectOptions& o) {
  const fs::path dir(o.dir);
  std::error_code ec;
  MOELORA_CHECK(fs::is_directory(dir, ec), ErrorCode::kNotFound, dir.string(), ": not a directory");
  if (fs::is_regular_file(dir / "adapter_config.json", ec))
    return inspect_adapter(dir, o.model, o.json);
  MOELORA_CHECK(fs::is_regular_file(dir / "config.json", ec), ErrorCode::kNotFound, dir.string(),
                ": neither a model (config.json) nor an adapter (adapter_config.json) directory");
  return inspect_model(dir, o.json);
}

std::function<int()> setup_inspect(CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  app.add_option("dir", o->dir, "Model directory (config.json + safetensors) or adapter directory")
      ->required();
  app.add_flag("--json", o->json, "Print JSON instead of the table");
  app.add_option("--model", o->model,
                 "For an adapter: the base model directory to check it against (default: "
                 "base_model_name_or_path when that is a directory)");
  app.footer(
      "\nThe last row, check, is the loader's verdict: the model or adapter is loaded and\n"
      "validated (every shape and dtype against config.json); the exit code is 1 when that\n"
      "fails.");
  return [o] { return run_inspect(*o); };
}

MOELORA_SUBCOMMAND("inspect", "Describe a model or adapter directory and check that it loads", 62,
                   setup_inspect);

}  // namespace
}  // namespace moelora::cli
