// `--device cpu|cuda` of `moelora generate` and `moelora logits`: the device check with the fix a
// CLI user needs, and the GPU runs, so that GPU results can be compared with the CPU reference
// from the command line.
//
// Everything here goes through CUDA-free headers (the public Engine API and
// runtime/gpu_executor.h), so the tools compile in every build: a build without CUDA links the
// runtime's stubs, and require_cli_device("cuda") fails before any of them is reached.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "logits_batch.h"
#include "model/model_setup.h"

namespace moelora::tools {

// The help text of --device (both subcommands).
inline constexpr const char* kDeviceHelp =
    "cpu (the fp32 reference model) or cuda (the bf16 / FP8 GPU model; needs a CUDA build and a "
    "visible device)";

// Throws moelora::Error unless `device` is "cpu", or "cuda" and this build can run it:
// kInvalidArgument for another name, kUnsupported (moelora::check_device's one-line reason, plus
// "pass --device cpu") when the build has no CUDA or no device is visible.
void require_cli_device(const std::string& device);

// An upper bound of the rank the loaded adapters of `specs` have, from their
// adapter_config.json alone (r and rank_pattern, doubled: the loader may fuse a gate and an up
// factor into one LoRA of twice the rank); at least 8. Sizes the GPU slot pool.
int64_t adapter_rank_bound(const std::vector<model::AdapterSpec>& specs);

// `moelora generate --device cuda`: one request through the public Engine API.
struct DeviceGenerateRequest {
  std::filesystem::path model_dir;
  std::vector<model::AdapterSpec> adapters;  // all registered (and so validated), as on the CPU
  std::string adapter;                       // "" = base model
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 0;
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::vector<int32_t> extra_stop_tokens;  // besides config.json's eos ids (the tokenizer's eos)
  int64_t max_layers = 0;
  bool show_progress = false;
};
struct DeviceGenerateResult {
  std::vector<int32_t> tokens;  // generated tokens only
  bool stopped = false;         // ended on a stop token
  int64_t prompt_tokens = 0;
  double seconds = 0.0;  // forward + sampling time (prefill + decode)
  double tokens_per_second() const {
    return seconds > 0 ? static_cast<double>(tokens.size()) / seconds : 0.0;
  }
};
DeviceGenerateResult generate_on_device(const std::string& device,
                                        const DeviceGenerateRequest& request);

// `moelora logits --device cuda`: the logits of every position of every entry, F32
// [tokens_i, vocab] in entry order, as the CPU path writes them.
//
// The GPU model computes logits only at each sequence's last row, so the entries are fed one
// token per forward over the paged KV cache: forward p runs position p of every entry that is
// that long (a mixed-adapter batch, each entry with its adapter slot), and its logits are
// position p's. Every position is thus computed exactly as in generation (a decode step), and
// the batch stays one batch per position. Eager launches (no CUDA graphs).
std::vector<Tensor> logits_on_gpu(const std::filesystem::path& model_dir,
                                  const std::vector<model::AdapterSpec>& adapters,
                                  const std::vector<BatchEntry>& entries, int64_t max_layers,
                                  bool show_progress);

}  // namespace moelora::tools
