// Hugging Face config.json (io/hf_config.h): the input is the file's text, read the way a model
// directory is loaded; the accepted configs are written back to JSON (every field must be
// printable) and parsed again.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz_input.h"
#include "io/hf_config.h"

#include <nlohmann/json.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora;
  fuzz::write_file("config.json", fuzz::as_text(data, size));
  try {
    const io::ModelConfig config = io::load_model_config(fuzz::scratch_dir());
    (void)io::parse_model_config(io::model_config_to_json(config), "round trip");
  } catch (const Error&) {
  }
  return 0;
}
