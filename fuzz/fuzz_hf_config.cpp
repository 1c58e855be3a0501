// Hugging Face config.json (io/hf_config.h), and ModelOpt's legacy hf_quant_config.json beside it:
// the input is config.json's text, optionally followed by a NUL byte and hf_quant_config.json's
// text, read the way a model directory is loaded. Accepted configs are written back to JSON
// (every field must be printable) and parsed again.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "fuzz_input.h"
#include "io/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora;
  const std::string_view input = fuzz::as_text(data, size);
  const size_t split = input.find('\0');
  fuzz::write_file("config.json", input.substr(0, split));
  if (split == std::string_view::npos) {
    std::filesystem::remove(fuzz::scratch_dir() / "hf_quant_config.json");
  } else {
    fuzz::write_file("hf_quant_config.json", input.substr(split + 1));
  }
  try {
    const io::ModelConfig config = io::load_model_config(fuzz::scratch_dir());
    (void)io::parse_model_config(io::model_config_to_json(config), "round trip");
  } catch (const Error&) {
  }
  return 0;
}
