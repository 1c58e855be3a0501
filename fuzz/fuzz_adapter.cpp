// A whole PEFT adapter against a model's shapes (io/peft.h, load_adapter): the input is
// adapter_config.json's text, a NUL byte, then adapter_model.safetensors' bytes; the base model
// is the Qwen3-MoE parity model of tests/data (8 experts; the seeds are its adapters in the PEFT
// 3-D, per-expert and shared-outer layouts). Target names, ranks, layouts and tensor shapes that
// do not fit the model must be refused.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string_view>

#include "core/error.h"
#include "fuzz_input.h"
#include "io/hf_config.h"
#include "io/peft.h"

#ifndef MOELORA_FUZZ_DATA_DIR
#error "MOELORA_FUZZ_DATA_DIR (tests/data) is set by fuzz/CMakeLists.txt"
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora;
  static const io::ModelConfig base =
      io::load_model_config(std::filesystem::path(MOELORA_FUZZ_DATA_DIR) / "parity" / "qwen3_moe" / "base");
  const std::string_view input = fuzz::as_text(data, size);
  const size_t split = input.find('\0');
  if (split == std::string_view::npos) return 0;
  fuzz::write_file("adapter_config.json", input.substr(0, split));
  fuzz::write_file("adapter_model.safetensors", input.substr(split + 1));
  try {
    (void)io::load_adapter(fuzz::scratch_dir(), base, "fuzz");
  } catch (const Error&) {
  }
  return 0;
}
